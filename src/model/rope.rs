//! Rotary embedding frequencies, with YaRN context extension.
//!
//! deepseek2 and glm-dsa rotate adjacent pairs `(2i, 2i+1)` (the GGUF weight order) by the
//! angle `pos * inv_freq[i]`; the backend applies it (`Backend::rope`). YaRN (the paper's
//! "NTK-by-parts") keeps high frequencies, interpolates low ones by `factor`, and ramps
//! linearly between two dimension bounds set by beta_fast / beta_slow. Its attention-scale
//! part lives in `ModelConfig::attention_scale`.

use crate::backend::Rope;
use crate::config::Yarn;
use std::f64::consts::PI;

/// Frequencies for `dims` rotated dimensions with base `theta`, optionally YaRN-extended.
/// Computed in f32 like the reference implementation so positions rotate identically.
pub fn rope_frequencies(dims: usize, theta: f32, yarn: Option<&Yarn>) -> Rope {
    let half = dims / 2;
    let pos_freq = |i: usize| theta.powf((2 * i) as f32 / dims as f32);
    let inv_freq = match yarn {
        None => (0..half).map(|i| 1.0 / pos_freq(i)).collect(),
        Some(y) => {
            // Dimension where a frequency completes `rotations` turns over the original context.
            let correction_dim = |rotations: f32| {
                dims as f64 * (y.original_context as f64 / (rotations as f64 * 2.0 * PI)).ln()
                    / (2.0 * (theta as f64).ln())
            };
            let low = correction_dim(y.beta_fast).floor().max(0.0);
            let high = correction_dim(y.beta_slow).ceil().min(dims as f64 - 1.0);
            let high = if low == high { high + 0.001 } else { high };
            (0..half)
                .map(|i| {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0) as f32;
                    let extrapolation = 1.0 - ramp; // weight of the unscaled frequency
                    let inv = 1.0 / pos_freq(i);
                    let interp = 1.0 / (y.factor * pos_freq(i));
                    interp * (1.0 - extrapolation) + inv * extrapolation
                })
                .collect()
        }
    };
    // The GGUF stores one mscale (mscale_all_dim); with mscale == mscale_all_dim, as in every
    // DeepSeek config, YaRN's factor on cos/sin cancels to 1.
    Rope {
        inv_freq,
        cos_sin_scale: 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_rope_is_the_geometric_series() {
        let r = rope_frequencies(8, 10000.0, None);
        assert_eq!(r.inv_freq.len(), 4);
        assert_eq!(r.inv_freq[0], 1.0);
        assert!((r.inv_freq[2] - 0.01).abs() < 1e-8);
    }

    #[test]
    fn yarn_keeps_fast_and_interpolates_slow_dimensions() {
        let y = Yarn {
            factor: 40.0,
            original_context: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            log_multiplier: 0.1,
        };
        let plain = rope_frequencies(64, 10000.0, None);
        let r = rope_frequencies(64, 10000.0, Some(&y));
        assert_eq!(r.inv_freq[0], plain.inv_freq[0]);
        let last = r.inv_freq.len() - 1;
        assert!((r.inv_freq[last] - plain.inv_freq[last] / 40.0).abs() < 1e-12);
    }
}
