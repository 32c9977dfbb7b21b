//! Plain float types: one element per "block", little-endian.
//!
//! | type | bytes | value |
//! | --- | --- | --- |
//! | F32  | 4 | IEEE binary32 |
//! | F16  | 2 | IEEE binary16, widened to f32 (exact, subnormals included) |
//! | BF16 | 2 | the upper 16 bits of a binary32: value = f32::from_bits(bits << 16) (exact) |
//!
//! Norms, the router and `exp_probs_b` are F32 in every file; some files keep attention or the
//! embedding in BF16 or F16. The dot products convert a chunk of the row into a stack buffer
//! and multiply it with x in SIMD lanes.

use half::{f16, slice::HalfFloatSliceExt};

use super::LANES;

/// Elements converted per step of a dot product (one stack buffer).
const CHUNK: usize = 64;

pub(super) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (b, d) in src.chunks_exact(4).zip(dst) {
        *d = f32::from_le_bytes(b.try_into().unwrap());
    }
}

pub(super) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (b, d) in src.chunks(2 * CHUNK).zip(dst.chunks_mut(CHUNK)) {
        f16_chunk_to_f32(b, d);
    }
}

pub(super) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (b, d) in src.chunks_exact(2).zip(dst) {
        *d = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

#[inline(always)]
pub(super) fn dot_f32(row: &[u8], x: &[f32], acc: &mut [f32; LANES]) {
    chunked_dot(row, x, acc, 4, dequantize_f32)
}

#[inline(always)]
pub(super) fn dot_f16(row: &[u8], x: &[f32], acc: &mut [f32; LANES]) {
    chunked_dot(row, x, acc, 2, f16_chunk_to_f32)
}

#[inline(always)]
pub(super) fn dot_bf16(row: &[u8], x: &[f32], acc: &mut [f32; LANES]) {
    chunked_dot(row, x, acc, 2, dequantize_bf16)
}

/// Converts up to CHUNK f16 values (`b` holds `2 * w.len()` bytes) with half's SIMD slice
/// conversion; the bytes are copied first because a row need not be 2-byte aligned.
fn f16_chunk_to_f32(b: &[u8], w: &mut [f32]) {
    let mut h = [f16::ZERO; CHUNK]; // the chunk as f16
    for (hi, bi) in h.iter_mut().zip(b.chunks_exact(2)) {
        *hi = f16::from_le_bytes([bi[0], bi[1]]);
    }
    h[..w.len()].convert_to_f32_slice(w);
}

/// Adds row . x into `acc` over CHUNK-element pieces: `convert` turns one piece of the row
/// (`elem_bytes` per element) into f32s on the stack. Rows of any length: a last piece shorter
/// than LANES goes into lane 0.
#[inline(always)]
fn chunked_dot(
    row: &[u8],
    x: &[f32],
    acc: &mut [f32; LANES],
    elem_bytes: usize,
    convert: impl Fn(&[u8], &mut [f32]),
) {
    debug_assert_eq!(row.len(), x.len() * elem_bytes);
    let mut w = [0f32; CHUNK]; // one converted piece of the row
    for (b, xc) in row.chunks(CHUNK * elem_bytes).zip(x.chunks(CHUNK)) {
        let w = &mut w[..xc.len()];
        convert(b, w);
        let whole = w.len() / LANES * LANES;
        for (wl, xl) in w[..whole].chunks_exact(LANES).zip(xc.chunks_exact(LANES)) {
            for k in 0..LANES {
                acc[k] += wl[k] * xl[k];
            }
        }
        for (wi, xi) in w[whole..].iter().zip(&xc[whole..]) {
            acc[0] += wi * xi;
        }
    }
}
