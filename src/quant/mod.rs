//! Block formats: exact CPU dequantization and the dot product of a quantized row with an f32
//! vector, for every type real DeepSeek/Kimi/GLM GGUF files use.
//!
//! A row of a ggml tensor is a run of blocks; each block holds `block_size` elements in
//! `type_size` bytes (see [`GgmlType`]). One file per family documents its block layouts in a
//! table (fields, bytes, how a value is reconstructed), which the CUDA kernels follow too:
//! `float.rs` (F32, F16, BF16), `legacy.rs` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), `kquant.rs` (Q2_K
//! to Q6_K), `iq4.rs` (IQ4_NL, IQ4_XS).
//!
//! Every quantized format comes down to the same shape: a block unpacks into small integer
//! codes and, per sub-block, an f32 `scale` and sometimes an `offset`; element = scale * code
//! (+ offset). The family files only unpack ([`Unpacked`]); this file turns that into values
//! and dot products, once for all formats.
//!
//! [`dequantize`] reproduces gguf-py's dequantization bit for bit: the same f32 operations in
//! the same order (one multiply, then one add). `tests/quant.rs` checks it against fixtures
//! made by gguf-py. In every format here the products are exact in f32 (an f16 scale has 11
//! significant bits, the integer factors together at most 13, and Q6_K's 25-bit product is
//! rounded once whichever pair multiplies first), so each value is the exact real result
//! rounded at most once: a kernel that fuses the add or multiplies in another order (a GPU
//! kernel with FMA) still gets the same bits. [`dot`] is the CPU engine's hot path: it unpacks one block
//! at a time on the stack and folds the scales out of the inner loop (sum of scale * (code . x)
//! per sub-block), so the row is never materialized and the inner loop is integer-to-float
//! multiply-adds over eight SIMD lanes.

mod float;
mod iq4;
mod kquant;
mod legacy;

pub use kquant::scale_min_k4;

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
         (a block is {block} values in {block_bytes} bytes)"
    )]
    Length {
        ty: GgmlType,
        src_len: usize,
        n: usize,
        block: usize,
        block_bytes: usize,
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
    if t.row_bytes(dst.len()) != Some(src.len()) {
        return Err(QuantError::Length {
            ty: t,
            src_len: src.len(),
            n: dst.len(),
            block: t.block_size(),
            block_bytes: t.type_size(),
        });
    }
    match t {
        GgmlType::F32 => float::dequantize_f32(src, dst),
        GgmlType::F16 => float::dequantize_f16(src, dst),
        GgmlType::BF16 => float::dequantize_bf16(src, dst),
        GgmlType::Q4_0 => dequantize_blocks::<legacy::Q4_0, _, _, _>(src, dst),
        GgmlType::Q4_1 => dequantize_blocks::<legacy::Q4_1, _, _, _>(src, dst),
        GgmlType::Q5_0 => dequantize_blocks::<legacy::Q5_0, _, _, _>(src, dst),
        GgmlType::Q5_1 => dequantize_blocks::<legacy::Q5_1, _, _, _>(src, dst),
        GgmlType::Q8_0 => dequantize_blocks::<legacy::Q8_0, _, _, _>(src, dst),
        GgmlType::Q2_K => dequantize_blocks::<kquant::Q2_K, _, _, _>(src, dst),
        GgmlType::Q3_K => dequantize_blocks::<kquant::Q3_K, _, _, _>(src, dst),
        GgmlType::Q4_K => dequantize_blocks::<kquant::Q4_K, _, _, _>(src, dst),
        GgmlType::Q5_K => dequantize_blocks::<kquant::Q5_K, _, _, _>(src, dst),
        GgmlType::Q6_K => dequantize_blocks::<kquant::Q6_K, _, _, _>(src, dst),
        GgmlType::IQ4_NL => dequantize_blocks::<iq4::IQ4_NL, _, _, _>(src, dst),
        GgmlType::IQ4_XS => dequantize_blocks::<iq4::IQ4_XS, _, _, _>(src, dst),
        _ => unreachable!("check_supported passed"),
    }
    Ok(())
}

/// The dot product of the quantized row `row` with `x` (`x.len()` elements, a whole number of
/// blocks; `row` is `t.row_bytes(x.len())` bytes). Callers check types and shapes at load
/// time; here they are only debug-asserted.
pub fn dot(t: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(t.row_bytes(x.len()), Some(row.len()), "{t} dot shape");
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { dot_avx2(t, row, x) };
    }
    dot_any_cpu(t, row, x)
}

/// The same code as `dot_any_cpu` compiled for 256-bit vectors (everything below is inlined
/// into it), twice as wide as the SSE2 baseline of a default x86-64 build. No FMA: the results
/// equal the baseline's bit for bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dot_avx2(t: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    dot_any_cpu(t, row, x)
}

#[inline(always)]
fn dot_any_cpu(t: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    match t {
        GgmlType::F32 => float::dot_f32(row, x, &mut acc),
        GgmlType::F16 => float::dot_f16(row, x, &mut acc),
        GgmlType::BF16 => float::dot_bf16(row, x, &mut acc),
        GgmlType::Q4_0 => dot_blocks::<legacy::Q4_0, _, _, _>(row, x, &mut acc),
        GgmlType::Q4_1 => dot_blocks::<legacy::Q4_1, _, _, _>(row, x, &mut acc),
        GgmlType::Q5_0 => dot_blocks::<legacy::Q5_0, _, _, _>(row, x, &mut acc),
        GgmlType::Q5_1 => dot_blocks::<legacy::Q5_1, _, _, _>(row, x, &mut acc),
        GgmlType::Q8_0 => dot_blocks::<legacy::Q8_0, _, _, _>(row, x, &mut acc),
        GgmlType::Q2_K => dot_blocks::<kquant::Q2_K, _, _, _>(row, x, &mut acc),
        GgmlType::Q3_K => dot_blocks::<kquant::Q3_K, _, _, _>(row, x, &mut acc),
        GgmlType::Q4_K => dot_blocks::<kquant::Q4_K, _, _, _>(row, x, &mut acc),
        GgmlType::Q5_K => dot_blocks::<kquant::Q5_K, _, _, _>(row, x, &mut acc),
        GgmlType::Q6_K => dot_blocks::<kquant::Q6_K, _, _, _>(row, x, &mut acc),
        GgmlType::IQ4_NL => dot_blocks::<iq4::IQ4_NL, _, _, _>(row, x, &mut acc),
        GgmlType::IQ4_XS => dot_blocks::<iq4::IQ4_XS, _, _, _>(row, x, &mut acc),
        _ => panic!("dot: {t} is not supported (check_supported at load time)"),
    }
    acc.iter().sum()
}

/// One block of N elements in S sub-blocks of N/S, unpacked: element j of sub-block s is
/// `scale[s] * codes[j]`, plus `offset[s]` after that multiply when there is one.
pub(crate) struct Unpacked<const N: usize, const S: usize> {
    /// [N] integer codes, already shifted to their signed value (e.g. q - 8 for Q4_0)
    pub codes: [i8; N],
    /// [S] the f32 factor of each sub-block (d, or d * sub-block scale)
    pub scale: [f32; S],
    /// [S] the term added after the multiply: +m (Q4_1, Q5_1) or -(dmin * m) (K-quants)
    pub offset: Option<[f32; S]>,
}

/// A quantized block format: one block of BYTES bytes holds N elements in S sub-blocks.
/// The unpackers are `#[inline(always)]` so that they compile into `dot_avx2` too.
trait BlockFormat<const BYTES: usize, const N: usize, const S: usize> {
    fn unpack(b: &[u8; BYTES]) -> Unpacked<N, S>;
}

/// Dequantizes a row, block by block.
#[inline(always)]
fn dequantize_blocks<
    F: BlockFormat<BYTES, N, S>,
    const BYTES: usize,
    const N: usize,
    const S: usize,
>(
    src: &[u8],
    dst: &mut [f32],
) {
    let len = N / S;
    for (b, out) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(N)) {
        let u = F::unpack(b.try_into().unwrap());
        for s in 0..S {
            let codes = &u.codes[s * len..][..len];
            let out = &mut out[s * len..][..len];
            for (o, &q) in out.iter_mut().zip(codes) {
                *o = u.scale[s] * q as f32;
            }
            if let Some(offset) = &u.offset {
                for o in out.iter_mut() {
                    *o += offset[s];
                }
            }
        }
    }
}

/// SIMD lanes of the dot products: eight independent partial sums, which the compiler keeps
/// in vector registers (it may not reorder one running f32 sum by itself).
const LANES: usize = 8;

/// Adds row . x into `acc` one block at a time: per sub-block, scale * (codes . x) and
/// offset * sum(x), each as eight lanes, so the only reduction is the caller's, once per row.
#[inline(always)]
fn dot_blocks<F: BlockFormat<BYTES, N, S>, const BYTES: usize, const N: usize, const S: usize>(
    row: &[u8],
    x: &[f32],
    acc: &mut [f32; LANES],
) {
    let len = N / S;
    for (b, xb) in row.chunks_exact(BYTES).zip(x.chunks_exact(N)) {
        let u = F::unpack(b.try_into().unwrap());
        for s in 0..S {
            let xs = &xb[s * len..][..len];
            let qx = lanes_dot_codes(&u.codes[s * len..][..len], xs);
            for k in 0..LANES {
                acc[k] += u.scale[s] * qx[k];
            }
            if let Some(offset) = &u.offset {
                let sx = lanes_sum(xs);
                for k in 0..LANES {
                    acc[k] += offset[s] * sx[k];
                }
            }
        }
    }
}

/// codes . x in eight lanes (`len` a multiple of LANES).
#[inline(always)]
fn lanes_dot_codes(codes: &[i8], x: &[f32]) -> [f32; LANES] {
    let mut p = [0f32; LANES];
    for (q, x) in codes.chunks_exact(LANES).zip(x.chunks_exact(LANES)) {
        for k in 0..LANES {
            p[k] += q[k] as f32 * x[k];
        }
    }
    p
}

/// sum(x) in eight lanes (`len` a multiple of LANES).
#[inline(always)]
fn lanes_sum(x: &[f32]) -> [f32; LANES] {
    let mut p = [0f32; LANES];
    for x in x.chunks_exact(LANES) {
        for k in 0..LANES {
            p[k] += x[k];
        }
    }
    p
}

/// `d * q[s]` for each small integer (a sub-block scale or min), as f32.
#[inline(always)]
fn times<const S: usize>(d: f32, q: [i8; S]) -> [f32; S] {
    let mut out = [0f32; S];
    for s in 0..S {
        out[s] = d * q[s] as f32;
    }
    out
}

/// The f16 stored little-endian at `b[i..i + 2]`, as f32 (exact). half's software conversion:
/// it inlines into the block loops, where `to_f32` would be a call that checks CPU features.
#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32_const()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dot` runs the AVX2 build on machines that have it; the baseline build must give the
    /// same bits (same operations, same order), so that results do not depend on the CPU.
    #[test]
    fn baseline_and_avx2_dot_agree_bit_for_bit() {
        for &t in SUPPORTED {
            let n = 4 * 256;
            let row: Vec<u8> = (0..t.row_bytes(n).unwrap())
                .map(|i| (i * 37 % 251) as u8)
                .collect();
            // Finite f16 scales wherever they sit: bytes 0x00..0x3B as the high byte keep the
            // exponent below 0x1F.
            let row: Vec<u8> = row.iter().map(|b| b % 0x3C).collect();
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let expected = dot_any_cpu(t, &row, &x);
            assert!(expected.is_finite(), "{t}");
            assert_eq!(dot(t, &row, &x).to_bits(), expected.to_bits(), "{t}");
        }
    }
}
