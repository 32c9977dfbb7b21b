//! The K-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. Super-blocks of 256 elements split into
//! sub-blocks (16 of 16 elements, or 8 of 32) that each have their own small integer scale (and
//! min), which multiplies the super-block's f16 `d` (and `dmin`).
//!
//! Multi-byte fields are little-endian; `d`, `dmin` are f16. Element index i runs 0..256.
//! A "2-bit plane" layout, used by Q2_K and Q3_K's low bits and Q6_K's high bits, packs four
//! 32-element runs into the same 32 bytes: for i = 128*h + 32*k + l (h < 2, k < 4, l < 32) the
//! code is bits 2k..2k+2 of byte 32*h + l.
//!
//! | type | bytes | fields (offset: name) |
//! | --- | --- | --- |
//! | Q2_K | 84  | 0: scales[16], 16: qs[64], 80: d, 82: dmin |
//! | Q3_K | 110 | 0: hmask[32], 32: qs[64], 96: scales[12], 108: d |
//! | Q4_K | 144 | 0: d, 2: dmin, 4: scales[12], 16: qs[128] |
//! | Q5_K | 176 | 0: d, 2: dmin, 4: scales[12], 16: qh[32], 48: qs[128] |
//! | Q6_K | 210 | 0: ql[128], 128: qh[64], 192: scales[16] (i8), 208: d |
//!
//! | type | code q of element i | sub-block s, its scale | element i |
//! | --- | --- | --- | --- |
//! | Q2_K | 2-bit plane of qs | s = i/16; sc = scales[s] & 15, m = scales[s] >> 4 | (d*sc)*q - dmin*m |
//! | Q3_K | (2-bit plane of qs) - 4 * (1 - hbit), hbit = bit i/32 of hmask[i%32] | s = i/16; sc = 6-bit (see below) - 32 | (d*sc)*q |
//! | Q4_K | nibble: byte 32*(i/64) + i%32 of qs, low nibble when (i/32) is even, else high | s = i/32; sc, m 6-bit (see below) | (d*sc)*q - dmin*m |
//! | Q5_K | Q4_K's nibble \| (bit i/32 of qh[i%32]) << 4 | as Q4_K | (d*sc)*q - dmin*m |
//! | Q6_K | (low4 \| high2 << 4) - 32; i = 128*h + j: low4 = ql[64*h + j%64], low nibble when j < 64, else high; high2 = 2-bit plane of qh | s = i/16; sc = scales[s] | (d*sc)*q |
//!
//! Q3_K's 16 six-bit scales: low 4 bits are the low nibble of scales[s] for s < 8 and the high
//! nibble of scales[s - 8] for s >= 8; the high 2 bits are bits 2*(s/4)..+2 of scales[8 + s%4].
//!
//! Q4_K/Q5_K's 8 six-bit (scale, min) pairs in scales[12] (call it b): for s < 4, sc = b[s] & 63
//! and m = b[s + 4] & 63; for s >= 4, sc = (b[s + 4] & 15) | (b[s - 4] >> 6) << 4 and
//! m = (b[s + 4] >> 4) | (b[s] >> 6) << 4.
//!
//! Each product in the table is one f32 operation, in the order written (`d*sc` first, then times
//! q, then minus `dmin*m`), as gguf-py computes it; all but the last rounding are exact, so a
//! fused or reordered evaluation gives the same bits (see mod.rs). DeepSeek/GLM files use Q4_K to
//! Q6_K for most weights; Q2_K/Q3_K appear in the smallest Unsloth files.

// The format types are named as ggml names them (Q4_K, IQ4_XS).
#![allow(non_camel_case_types)]

use super::{f16_at, times, BlockFormat, Unpacked};

/// Code k (0..4) of a 2-bit plane byte: Q2_K, Q3_K, Q6_K.
#[inline(always)]
fn two_bits(byte: u8, k: usize) -> u8 {
    (byte >> (2 * k)) & 3
}

pub(super) struct Q2_K;

impl BlockFormat<84, 256, 16> for Q2_K {
    #[inline(always)]
    fn unpack(b: &[u8; 84]) -> Unpacked<256, 16> {
        let scales = &b[0..16];
        let qs = &b[16..80];
        let d = f16_at(b, 80);
        let dmin = f16_at(b, 82);
        let mut codes = [0i8; 256];
        for h in 0..2 {
            for k in 0..4 {
                for l in 0..32 {
                    codes[128 * h + 32 * k + l] = two_bits(qs[32 * h + l], k) as i8;
                }
            }
        }
        let mut sc = [0i8; 16];
        let mut m = [0i8; 16];
        for s in 0..16 {
            sc[s] = (scales[s] & 15) as i8;
            m[s] = (scales[s] >> 4) as i8;
        }
        // -(dmin * m) == (-dmin) * m bit for bit: rounding to nearest is symmetric.
        Unpacked {
            codes,
            scale: times(d, sc),
            offset: Some(times(-dmin, m)),
        }
    }
}

/// Q3_K's 16 signed 6-bit scales.
#[inline(always)]
fn q3_k_scales(b: &[u8]) -> [i8; 16] {
    let mut sc = [0i8; 16];
    for s in 0..16 {
        let low = if s < 8 { b[s] & 15 } else { b[s - 8] >> 4 };
        let high = two_bits(b[8 + s % 4], s / 4);
        sc[s] = (low | high << 4) as i8 - 32;
    }
    sc
}

pub(super) struct Q3_K;

impl BlockFormat<110, 256, 16> for Q3_K {
    #[inline(always)]
    fn unpack(b: &[u8; 110]) -> Unpacked<256, 16> {
        let hmask = &b[0..32];
        let qs = &b[32..96];
        let sc = q3_k_scales(&b[96..108]);
        let d = f16_at(b, 108);
        let mut codes = [0i8; 256];
        for h in 0..2 {
            for k in 0..4 {
                let bit = 4 * h + k; // the hmask bit that holds these 32 elements' high bits
                for l in 0..32 {
                    let low = two_bits(qs[32 * h + l], k) as i8;
                    let high_clear = 1 - ((hmask[l] >> bit) & 1) as i8;
                    codes[128 * h + 32 * k + l] = low - 4 * high_clear;
                }
            }
        }
        Unpacked {
            codes,
            scale: times(d, sc),
            offset: None,
        }
    }
}

/// Q4_K/Q5_K's 8 (scale, min) pairs from a block's 12 scale bytes.
#[inline(always)]
pub fn scale_min_k4(b: &[u8]) -> ([i8; 8], [i8; 8]) {
    let mut sc = [0i8; 8];
    let mut m = [0i8; 8];
    for s in 0..4 {
        sc[s] = (b[s] & 63) as i8;
        m[s] = (b[s + 4] & 63) as i8;
        sc[s + 4] = ((b[s + 8] & 15) | (b[s] >> 6) << 4) as i8;
        m[s + 4] = ((b[s + 8] >> 4) | (b[s + 4] >> 6) << 4) as i8;
    }
    (sc, m)
}

/// Q4_K/Q5_K's low 4 bits: sub-block s in the low (even s) or high (odd s) nibbles of
/// qs[32 * (s / 2)..][..32].
#[inline(always)]
fn k4_nibbles(qs: &[u8]) -> [i8; 256] {
    let mut codes = [0i8; 256];
    for s in 0..8 {
        for l in 0..32 {
            codes[32 * s + l] = ((qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 15) as i8;
        }
    }
    codes
}

pub(super) struct Q4_K;

impl BlockFormat<144, 256, 8> for Q4_K {
    #[inline(always)]
    fn unpack(b: &[u8; 144]) -> Unpacked<256, 8> {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let (sc, m) = scale_min_k4(&b[4..16]);
        Unpacked {
            codes: k4_nibbles(&b[16..144]),
            scale: times(d, sc),
            offset: Some(times(-dmin, m)),
        }
    }
}

pub(super) struct Q5_K;

impl BlockFormat<176, 256, 8> for Q5_K {
    #[inline(always)]
    fn unpack(b: &[u8; 176]) -> Unpacked<256, 8> {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let (sc, m) = scale_min_k4(&b[4..16]);
        let qh = &b[16..48];
        let mut codes = k4_nibbles(&b[48..176]);
        for s in 0..8 {
            for l in 0..32 {
                codes[32 * s + l] |= (((qh[l] >> s) & 1) << 4) as i8;
            }
        }
        Unpacked {
            codes,
            scale: times(d, sc),
            offset: Some(times(-dmin, m)),
        }
    }
}

pub(super) struct Q6_K;

impl BlockFormat<210, 256, 16> for Q6_K {
    #[inline(always)]
    fn unpack(b: &[u8; 210]) -> Unpacked<256, 16> {
        let ql = &b[0..128];
        let qh = &b[128..192];
        let scales = &b[192..208];
        let d = f16_at(b, 208);
        let mut codes = [0i8; 256];
        for h in 0..2 {
            for k in 0..4 {
                // Elements 128h + 32k + l: low nibbles of ql[64h..] for k < 2, high ones after.
                let ql = &ql[64 * h + 32 * (k % 2)..][..32];
                for l in 0..32 {
                    let low = (ql[l] >> (4 * (k / 2))) & 15;
                    let high = two_bits(qh[32 * h + l], k);
                    codes[128 * h + 32 * k + l] = (low | high << 4) as i8 - 32;
                }
            }
        }
        let mut sc = [0i8; 16];
        for s in 0..16 {
            sc[s] = scales[s] as i8;
        }
        Unpacked {
            codes,
            scale: times(d, sc),
            offset: None,
        }
    }
}
