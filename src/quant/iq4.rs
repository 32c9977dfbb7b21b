//! The non-linear 4-bit formats IQ4_NL and IQ4_XS: each 4-bit code indexes a fixed table of 16
//! signed levels (denser near zero, where most weights are) instead of being used as an integer.
//!
//! Multi-byte fields are little-endian; `d` is f16. "Nibble l" of 16 bytes `q` means the low 4
//! bits of `q[l]` for l < 16 and the high 4 bits of `q[l - 16]` for l >= 16.
//!
//! | type | bytes | elements | fields (offset: name) | element |
//! | --- | --- | --- | --- | --- |
//! | IQ4_NL | 18  | 32  | 0: d, 2: qs[16] | element l: d * LEVELS[nibble l of qs] |
//! | IQ4_XS | 136 | 256 | 0: d, 2: scales_h (u16), 4: scales_l[4], 8: qs[128] | element 32*s + l: (d * sc_s) * LEVELS[nibble l of qs[16*s..16*s + 16]] |
//!
//! IQ4_XS has 8 sub-blocks of 32 with signed 6-bit scales: sc_s = (low4 | high2 << 4) - 32,
//! low4 = nibble s%2 (low first) of scales_l[s/2], high2 = bits 2s..2s+2 of scales_h.
//! Files quantized to IQ4_XS fall back to IQ4_NL for rows that are not a multiple of 256.
//! As everywhere, one f32 multiply per product in the order written, as gguf-py does.

use super::f16_at;

/// The 16 levels a code selects.
const LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Writes `dl * LEVELS[code]` for the 32 codes packed in `qs[16]`.
#[inline(always)]
fn decode_32(dl: f32, qs: &[u8], out: &mut [f32]) {
    for l in 0..16 {
        out[l] = dl * LEVELS[(qs[l] & 15) as usize] as f32;
        out[l + 16] = dl * LEVELS[(qs[l] >> 4) as usize] as f32;
    }
}

pub(super) fn dequant_iq4_nl(b: &[u8; 18], out: &mut [f32; 32]) {
    decode_32(f16_at(b, 0), &b[2..18], out);
}

pub(super) fn dequant_iq4_xs(b: &[u8; 136], out: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let scales_l = &b[4..8];
    let qs = &b[8..136];
    for s in 0..8 {
        let low = (scales_l[s / 2] >> (4 * (s % 2))) & 15;
        let high = ((scales_h >> (2 * s)) & 3) as u8;
        let sc = (low | high << 4) as i32 - 32;
        decode_32(d * sc as f32, &qs[16 * s..][..16], &mut out[32 * s..][..32]);
    }
}
