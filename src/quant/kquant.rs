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
//! q, then minus `dmin*m`, never fused), as gguf-py computes it.

use super::f16_at;

/// Q2_K, Q3_K, Q6_K: code k (0..4) of the 2-bit plane byte `byte`.
#[inline(always)]
fn two_bits(byte: u8, k: usize) -> u8 {
    (byte >> (2 * k)) & 3
}

pub(super) fn dequant_q2_k(b: &[u8; 84], out: &mut [f32; 256]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for h in 0..2 {
        for k in 0..4 {
            for half in 0..2 {
                let start = 128 * h + 32 * k + 16 * half;
                let s = scales[start / 16];
                let dl = d * (s & 15) as f32;
                let ml = dmin * (s >> 4) as f32;
                let q = &qs[32 * h + 16 * half..][..16];
                for l in 0..16 {
                    out[start + l] = dl * two_bits(q[l], k) as f32 - ml;
                }
            }
        }
    }
}

/// Q3_K's 16 signed 6-bit scales.
#[inline(always)]
fn q3_k_scales(b: &[u8]) -> [i32; 16] {
    let mut sc = [0i32; 16];
    for (s, out) in sc.iter_mut().enumerate() {
        let low = if s < 8 { b[s] & 15 } else { b[s - 8] >> 4 };
        let high = (b[8 + s % 4] >> (2 * (s / 4))) & 3;
        *out = (low | high << 4) as i32 - 32;
    }
    sc
}

pub(super) fn dequant_q3_k(b: &[u8; 110], out: &mut [f32; 256]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let sc = q3_k_scales(&b[96..108]);
    let d = f16_at(b, 108);
    for h in 0..2 {
        for k in 0..4 {
            let bit = 4 * h + k; // which hmask bit holds the high bit of these 32 elements
            for half in 0..2 {
                let start = 128 * h + 32 * k + 16 * half;
                let dl = d * sc[start / 16] as f32;
                for l in 16 * half..16 * half + 16 {
                    let low = two_bits(qs[32 * h + l], k) as i32;
                    let high_clear = 1 - ((hmask[l] >> bit) & 1) as i32;
                    out[128 * h + 32 * k + l] = dl * (low - 4 * high_clear) as f32;
                }
            }
        }
    }
}

/// Q4_K/Q5_K's 8 (scale, min) pairs.
#[inline(always)]
fn scale_min_k4(b: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for s in 0..4 {
        sc[s] = b[s] & 63;
        m[s] = b[s + 4] & 63;
        sc[s + 4] = (b[s + 8] & 15) | (b[s] >> 6) << 4;
        m[s + 4] = (b[s + 8] >> 4) | (b[s + 4] >> 6) << 4;
    }
    (sc, m)
}

pub(super) fn dequant_q4_k(b: &[u8; 144], out: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, m) = scale_min_k4(&b[4..16]);
    let qs = &b[16..144];
    for s in 0..8 {
        let dl = d * sc[s] as f32;
        let ml = dmin * m[s] as f32;
        let q = &qs[32 * (s / 2)..][..32];
        let shift = 4 * (s % 2);
        let o = &mut out[32 * s..][..32];
        for l in 0..32 {
            o[l] = dl * ((q[l] >> shift) & 15) as f32 - ml;
        }
    }
}

pub(super) fn dequant_q5_k(b: &[u8; 176], out: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, m) = scale_min_k4(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for s in 0..8 {
        let dl = d * sc[s] as f32;
        let ml = dmin * m[s] as f32;
        let q = &qs[32 * (s / 2)..][..32];
        let shift = 4 * (s % 2);
        let o = &mut out[32 * s..][..32];
        for l in 0..32 {
            let code = ((q[l] >> shift) & 15) | ((qh[l] >> s) & 1) << 4;
            o[l] = dl * code as f32 - ml;
        }
    }
}

pub(super) fn dequant_q6_k(b: &[u8; 210], out: &mut [f32; 256]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = f16_at(b, 208);
    for h in 0..2 {
        for j in 0..128 {
            let low = (ql[64 * h + j % 64] >> (4 * (j / 64))) & 15;
            let high = two_bits(qh[32 * h + j % 32], j / 32);
            let i = 128 * h + j;
            let dl = d * scales[i / 16] as i8 as f32;
            out[i] = dl * ((low | high << 4) as i32 - 32) as f32;
        }
    }
}
