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
//! All arithmetic is f32: the integer converts exactly, then one exact multiply (and one
//! rounded add for the `m` formats), as gguf-py computes it. DeepSeek files use these where a row is not
//! a multiple of 256 (attn_k_b, attn_v_b), as the quantizer's fallback for the K-quants.

// The format types are named as ggml names them (Q4_K, IQ4_XS).
#![allow(non_camel_case_types)]

use super::{f16_at, BlockFormat, Unpacked};

/// The 32 4-bit codes of a `qs[16]` field, in element order.
#[inline(always)]
fn nibbles(qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = qs[j] & 15;
        q[j + 16] = qs[j] >> 4;
    }
    q
}

/// The 32 5-bit codes of a `qh` (4 bytes) + `qs` (16 bytes) pair, in element order. Bit j of
/// the little-endian u32 `qh` is bit j % 8 of byte j / 8; testing it against a constant mask
/// (rather than shifting by j) lets the compiler do all 32 lanes at once.
#[inline(always)]
fn five_bit_codes(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let mut q = nibbles(qs);
    for j in 0..32 {
        q[j] |= ((qh[j / 8] & (1 << (j % 8)) != 0) as u8) << 4;
    }
    q
}

/// Codes minus `zero`, as the signed values the formats without `m` multiply.
#[inline(always)]
fn centered(q: [u8; 32], zero: i8) -> [i8; 32] {
    let mut c = [0i8; 32];
    for j in 0..32 {
        c[j] = q[j] as i8 - zero;
    }
    c
}

pub(super) struct Q4_0;

impl BlockFormat<18, 32, 1> for Q4_0 {
    #[inline(always)]
    fn unpack(b: &[u8; 18]) -> Unpacked<32, 1> {
        Unpacked {
            codes: centered(nibbles(&b[2..18]), 8),
            scale: [f16_at(b, 0)],
            offset: None,
        }
    }
}

pub(super) struct Q4_1;

impl BlockFormat<20, 32, 1> for Q4_1 {
    #[inline(always)]
    fn unpack(b: &[u8; 20]) -> Unpacked<32, 1> {
        Unpacked {
            codes: centered(nibbles(&b[4..20]), 0),
            scale: [f16_at(b, 0)],
            offset: Some([f16_at(b, 2)]),
        }
    }
}

pub(super) struct Q5_0;

impl BlockFormat<22, 32, 1> for Q5_0 {
    #[inline(always)]
    fn unpack(b: &[u8; 22]) -> Unpacked<32, 1> {
        Unpacked {
            codes: centered(five_bit_codes(&b[2..6], &b[6..22]), 16),
            scale: [f16_at(b, 0)],
            offset: None,
        }
    }
}

pub(super) struct Q5_1;

impl BlockFormat<24, 32, 1> for Q5_1 {
    #[inline(always)]
    fn unpack(b: &[u8; 24]) -> Unpacked<32, 1> {
        Unpacked {
            codes: centered(five_bit_codes(&b[4..8], &b[8..24]), 0),
            scale: [f16_at(b, 0)],
            offset: Some([f16_at(b, 2)]),
        }
    }
}

pub(super) struct Q8_0;

impl BlockFormat<34, 32, 1> for Q8_0 {
    #[inline(always)]
    fn unpack(b: &[u8; 34]) -> Unpacked<32, 1> {
        let mut codes = [0i8; 32];
        for (c, &q) in codes.iter_mut().zip(&b[2..34]) {
            *c = q as i8;
        }
        Unpacked {
            codes,
            scale: [f16_at(b, 0)],
            offset: None,
        }
    }
}
