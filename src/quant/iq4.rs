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

// The format types are named as ggml names them (Q4_K, IQ4_XS).
#![allow(non_camel_case_types)]

use super::{f16_at, times, BlockFormat, Unpacked};

/// The 16 levels a code selects.
const LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The 32 levels selected by the codes packed in `qs[16]`, in element order.
#[inline(always)]
fn levels_32(qs: &[u8], out: &mut [i8]) {
    for l in 0..16 {
        out[l] = LEVELS[(qs[l] & 15) as usize];
        out[l + 16] = LEVELS[(qs[l] >> 4) as usize];
    }
}

pub(super) struct IQ4_NL;

impl BlockFormat<18, 32, 1> for IQ4_NL {
    #[inline(always)]
    fn unpack(b: &[u8; 18]) -> Unpacked<32, 1> {
        let mut codes = [0i8; 32];
        levels_32(&b[2..18], &mut codes);
        Unpacked {
            codes,
            scale: [f16_at(b, 0)],
            offset: None,
        }
    }
}

pub(super) struct IQ4_XS;

impl BlockFormat<136, 256, 8> for IQ4_XS {
    #[inline(always)]
    fn unpack(b: &[u8; 136]) -> Unpacked<256, 8> {
        let d = f16_at(b, 0);
        let scales_h = u16::from_le_bytes([b[2], b[3]]);
        let scales_l = &b[4..8];
        let qs = &b[8..136];
        let mut codes = [0i8; 256];
        let mut sc = [0i8; 8];
        for s in 0..8 {
            levels_32(&qs[16 * s..][..16], &mut codes[32 * s..][..32]);
            let low = (scales_l[s / 2] >> (4 * (s % 2))) & 15;
            let high = ((scales_h >> (2 * s)) & 3) as u8;
            sc[s] = (low | high << 4) as i8 - 32;
        }
        Unpacked {
            codes,
            scale: times(d, sc),
            offset: None,
        }
    }
}
