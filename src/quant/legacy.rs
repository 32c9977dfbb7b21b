//! The original 32-element formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
//!
//! Every block holds 32 elements. Multi-byte fields are little-endian; `d` and `m` are f16.
//! "Nibble j" of the 16 `qs` bytes means: for j < 16 the low 4 bits of `qs[j]`, for j >= 16 the
//! high 4 bits of `qs[j - 16]` (the first half of the block in low nibbles, the second half in
//! high nibbles). `qh` is a u32 whose bit j is the fifth bit of element j.
//!
//! | type | bytes | fields (offset: name) | element j |
//! | --- | --- | --- | --- |
//! | Q4_0 | 18 | 0: d, 2: qs[16] | d * (nibble j - 8) |
//! | Q4_1 | 20 | 0: d, 2: m, 4: qs[16] | d * nibble j + m |
//! | Q5_0 | 22 | 0: d, 2: qh (u32), 6: qs[16] | d * ((nibble j \| bit j of qh << 4) - 16) |
//! | Q5_1 | 24 | 0: d, 2: m, 4: qh (u32), 8: qs[16] | d * (nibble j \| bit j of qh << 4) + m |
//! | Q8_0 | 34 | 0: d, 2: qs[32] (i8) | d * qs[j] |
//!
//! All arithmetic is f32: the integer is converted exactly, then one multiply (and one add for
//! the `m` formats, not fused), which is what gguf-py does, so results match it bit for bit.
//! DeepSeek files use these where a row is not a multiple of 256 (attn_k_b, attn_v_b) as the
//! fallback for the K-quants.

use super::f16_at;

/// The 32 4-bit codes of a `qs[16]` field, in element order.
#[inline(always)]
fn nibbles(qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = qs[j] & 0x0F;
        q[j + 16] = qs[j] >> 4;
    }
    q
}

/// The 32 5-bit codes of a `qh` + `qs[16]` pair, in element order.
#[inline(always)]
fn five_bit_codes(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let high = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = nibbles(qs);
    for (j, qj) in q.iter_mut().enumerate() {
        *qj |= (((high >> j) & 1) as u8) << 4;
    }
    q
}

pub(super) fn dequant_q4_0(b: &[u8; 18], out: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let q = nibbles(&b[2..18]);
    for j in 0..32 {
        out[j] = d * (q[j] as i32 - 8) as f32;
    }
}

pub(super) fn dequant_q4_1(b: &[u8; 20], out: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let q = nibbles(&b[4..20]);
    for j in 0..32 {
        out[j] = d * q[j] as f32 + m;
    }
}

pub(super) fn dequant_q5_0(b: &[u8; 22], out: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let q = five_bit_codes(&b[2..6], &b[6..22]);
    for j in 0..32 {
        out[j] = d * (q[j] as i32 - 16) as f32;
    }
}

pub(super) fn dequant_q5_1(b: &[u8; 24], out: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let q = five_bit_codes(&b[4..8], &b[8..24]);
    for j in 0..32 {
        out[j] = d * q[j] as f32 + m;
    }
}

pub(super) fn dequant_q8_0(b: &[u8; 34], out: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        out[j] = d * b[2 + j] as i8 as f32;
    }
}
