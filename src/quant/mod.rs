//! Block formats: exact CPU dequantization and the dot product of a quantized row with an f32
//! vector, for every type real DeepSeek/Kimi/GLM GGUF files use.
//!
//! A row of a ggml tensor is a run of blocks; each block holds `block_size` elements in
//! `type_size` bytes (see [`GgmlType`]). One file per family documents its block layouts in a
//! table (fields, bytes, how a value is reconstructed), which the CUDA kernels follow too:
//! [`float`] (F32, F16, BF16), [`legacy`] (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), [`kquant`] (Q2_K to
//! Q6_K), [`iq4`] (IQ4_NL, IQ4_XS).
//!
//! [`dequantize`] reproduces gguf-py's dequantization bit for bit (every value is computed with
//! the same f32 operations in the same order); `tests/quant.rs` checks that against fixtures
//! made by gguf-py. [`dot`] is the CPU engine's hot path: it dequantizes one block at a time
//! into a stack buffer and multiplies it with the matching slice of `x`, so the row is never
//! materialized.

mod float;
mod iq4;
mod kquant;
mod legacy;

use crate::gguf::ggml_type::GgmlType;

/// The types the engine can compute with, in ggml id order.
pub const SUPPORTED: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::BF16,
];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error(
        "tensor type {ty} is not supported; supported types: {}",
        supported_list()
    )]
    Unsupported { ty: GgmlType },
    #[error(
        "{ty}: cannot dequantize {src_len} bytes into {n} values \
         (expected a whole number of {block}-element blocks in {expected} bytes)"
    )]
    Length {
        ty: GgmlType,
        src_len: usize,
        n: usize,
        block: usize,
        expected: String,
    },
}

fn supported_list() -> String {
    SUPPORTED
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn supported(t: GgmlType) -> bool {
    SUPPORTED.contains(&t)
}

/// Ok for a type the engine can compute with, else an error naming it and listing the others.
pub fn check_supported(t: GgmlType) -> Result<(), QuantError> {
    if supported(t) {
        Ok(())
    } else {
        Err(QuantError::Unsupported { ty: t })
    }
}

/// Dequantizes `dst.len()` values (a whole number of blocks) from `src`, which must be exactly
/// `t.row_bytes(dst.len())` bytes. Bit-exact with gguf-py.
pub fn dequantize(t: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check_supported(t)?;
    let expected = t.row_bytes(dst.len());
    if expected != Some(src.len()) {
        return Err(QuantError::Length {
            ty: t,
            src_len: src.len(),
            n: dst.len(),
            block: t.block_size(),
            expected: expected.map_or("none".into(), |e| e.to_string()),
        });
    }
    match t {
        GgmlType::F32 => float::dequantize_f32(src, dst),
        GgmlType::F16 => float::dequantize_f16(src, dst),
        GgmlType::BF16 => float::dequantize_bf16(src, dst),
        GgmlType::Q4_0 => blockwise(src, dst, legacy::dequant_q4_0),
        GgmlType::Q4_1 => blockwise(src, dst, legacy::dequant_q4_1),
        GgmlType::Q5_0 => blockwise(src, dst, legacy::dequant_q5_0),
        GgmlType::Q5_1 => blockwise(src, dst, legacy::dequant_q5_1),
        GgmlType::Q8_0 => blockwise(src, dst, legacy::dequant_q8_0),
        GgmlType::Q2_K => blockwise(src, dst, kquant::dequant_q2_k),
        GgmlType::Q3_K => blockwise(src, dst, kquant::dequant_q3_k),
        GgmlType::Q4_K => blockwise(src, dst, kquant::dequant_q4_k),
        GgmlType::Q5_K => blockwise(src, dst, kquant::dequant_q5_k),
        GgmlType::Q6_K => blockwise(src, dst, kquant::dequant_q6_k),
        GgmlType::IQ4_NL => blockwise(src, dst, iq4::dequant_iq4_nl),
        GgmlType::IQ4_XS => blockwise(src, dst, iq4::dequant_iq4_xs),
        _ => unreachable!("check_supported passed"),
    }
    Ok(())
}

/// The dot product of the quantized row `row` with `x` (`x.len()` elements, a whole number of
/// blocks; `row` is `t.row_bytes(x.len())` bytes). Callers check types and shapes at load
/// time; here they are only debug-asserted.
pub fn dot(t: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(t.row_bytes(x.len()), Some(row.len()), "{t} dot shape");
    match t {
        GgmlType::F32 => float::dot_f32(row, x),
        GgmlType::F16 => float::dot_f16(row, x),
        GgmlType::BF16 => float::dot_bf16(row, x),
        GgmlType::Q4_0 => blockwise_dot(row, x, legacy::dequant_q4_0),
        GgmlType::Q4_1 => blockwise_dot(row, x, legacy::dequant_q4_1),
        GgmlType::Q5_0 => blockwise_dot(row, x, legacy::dequant_q5_0),
        GgmlType::Q5_1 => blockwise_dot(row, x, legacy::dequant_q5_1),
        GgmlType::Q8_0 => blockwise_dot(row, x, legacy::dequant_q8_0),
        GgmlType::Q2_K => blockwise_dot(row, x, kquant::dequant_q2_k),
        GgmlType::Q3_K => blockwise_dot(row, x, kquant::dequant_q3_k),
        GgmlType::Q4_K => blockwise_dot(row, x, kquant::dequant_q4_k),
        GgmlType::Q5_K => blockwise_dot(row, x, kquant::dequant_q5_k),
        GgmlType::Q6_K => blockwise_dot(row, x, kquant::dequant_q6_k),
        GgmlType::IQ4_NL => blockwise_dot(row, x, iq4::dequant_iq4_nl),
        GgmlType::IQ4_XS => blockwise_dot(row, x, iq4::dequant_iq4_xs),
        _ => panic!("dot: {t} is not supported (check_supported at load time)"),
    }
}

/// Runs a one-block dequantizer over a whole row.
#[inline(always)]
fn blockwise<const BYTES: usize, const N: usize>(
    src: &[u8],
    dst: &mut [f32],
    dequant_block: fn(&[u8; BYTES], &mut [f32; N]),
) {
    for (b, out) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(N)) {
        dequant_block(b.try_into().unwrap(), out.try_into().unwrap());
    }
}

/// Dot product one block at a time: dequantize the block on the stack, then multiply it with
/// its slice of `x`.
#[inline(always)]
fn blockwise_dot<const BYTES: usize, const N: usize>(
    row: &[u8],
    x: &[f32],
    dequant_block: fn(&[u8; BYTES], &mut [f32; N]),
) -> f32 {
    let mut w = [0f32; N]; // one dequantized block
    let mut sum = 0f32;
    for (b, xb) in row.chunks_exact(BYTES).zip(x.chunks_exact(N)) {
        dequant_block(b.try_into().unwrap(), &mut w);
        sum += dot_dense(&w, xb);
    }
    sum
}

/// Plain f32 dot product of two equal-length slices with eight independent partial sums, which
/// the compiler turns into SIMD lanes (it may not reorder one running sum by itself).
#[inline(always)]
pub(crate) fn dot_dense(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut acc = [0f32; LANES];
    let (a8, a_tail) = a.split_at(a.len() / LANES * LANES);
    let (b8, b_tail) = b.split_at(a8.len());
    for (ca, cb) in a8.chunks_exact(LANES).zip(b8.chunks_exact(LANES)) {
        for k in 0..LANES {
            acc[k] += ca[k] * cb[k];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for (p, q) in a_tail.iter().zip(b_tail) {
        sum += p * q;
    }
    sum
}

/// The f16 stored little-endian at `b[i..i + 2]`, as f32 (exact).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}
