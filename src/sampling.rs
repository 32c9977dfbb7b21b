//! Turning logits into the next token: greedy at temperature 0, else temperature and top-p
//! (nucleus) sampling from a seeded generator, so a run is reproducible.

use rayon::prelude::*;

/// A small deterministic generator (SplitMix64): same seed, same tokens.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Clone, Debug)]
pub struct Sampler {
    /// 0: greedy.
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability reaches top_p (1: all).
    pub top_p: f32,
    rng: Rng,
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best
}

impl Sampler {
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Sampler {
        Sampler {
            temperature,
            top_p,
            rng: Rng::new(seed),
        }
    }

    /// The next token from one position's logits [V]: with p_i = exp((l_i - max) / T) / sum,
    /// the tokens in order of falling p (lowest id on ties), the shortest prefix of them whose
    /// mass reaches top_p (at least one), and a uniform draw over that prefix's mass.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.temperature <= 0.0 {
            return argmax(logits) as u32;
        }
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        // The exponentials on every core (~2 ms a token on one for a 155K vocabulary); the
        // sum in index order.
        let mut probs: Vec<f64> = logits
            .par_iter()
            .map(|l| (((l - max) / self.temperature) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.par_iter_mut().for_each(|p| *p /= total);
        // Only the nucleus needs sorting, and it lies among the tokens of p >= t for any t
        // whose tokens hold more than top_p: every other token is less likely than all of
        // them. Sorting all 129-155K tokens of a large vocabulary took ~20 ms a token (one
        // core of a 2-core machine).
        let top = probs.iter().cloned().fold(0.0, f64::max);
        // The margin covers the order of summation (the prefix below sums in falling order).
        // Where no threshold down to top / 2^64 holds enough (top_p >= 1, NaNs), t = 0 keeps
        // every token.
        let enough = self.top_p as f64 + 1e-9;
        let mut t = 0.0;
        for k in 1..=8 {
            let tk = top / 256f64.powi(k);
            if probs.iter().filter(|&&p| p >= tk).sum::<f64>() >= enough {
                t = tk;
                break;
            }
        }
        let mut sorted: Vec<(f64, usize)> = (probs.iter().cloned().enumerate())
            .filter(|&(_, p)| p >= t || p.is_nan())
            .map(|(i, p)| (p, i))
            .collect();
        sorted.par_sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        draw_nucleus(&sorted, self.top_p, &mut self.rng)
    }
}

/// The draw of `Sampler::sample` from (p, id) in falling order (every token of the nucleus
/// first): the shortest prefix whose mass reaches top_p (at least one), and a uniform draw
/// over that prefix's mass.
fn draw_nucleus(sorted: &[(f64, usize)], top_p: f32, rng: &mut Rng) -> u32 {
    let mut kept = 0;
    let mut mass = 0.0;
    for p in sorted {
        kept += 1;
        mass += p.0;
        if mass >= top_p as f64 {
            break;
        }
    }
    let r = rng.next_f64() * mass;
    let mut acc = 0.0;
    for p in &sorted[..kept] {
        acc += p.0;
        if r < acc {
            return p.1 as u32;
        }
    }
    sorted[kept - 1].1 as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temperature_zero_is_argmax() {
        let mut s = Sampler::new(0.0, 1.0, 7);
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_p_cuts_the_tail() {
        let logits = [2.0, 1.9, 0.0, -5.0, 1.0];
        let draw = |seed| {
            let mut s = Sampler::new(1.0, 0.6, seed);
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        // p(0) and p(1) are about 0.40 and 0.36: top-p 0.6 keeps exactly those two.
        assert!(draw(3).iter().all(|&t| t == 0 || t == 1));
        assert!(draw(3).contains(&0) && draw(3).contains(&1));
    }

    /// The sampler as first written, every token sorted before the draw: the definition
    /// `sample` keeps.
    fn sample_by_full_sort(temperature: f32, top_p: f32, rng: &mut Rng, logits: &[f32]) -> u32 {
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(f64, usize)> = logits
            .iter()
            .enumerate()
            .map(|(i, l)| ((((l - max) / temperature) as f64).exp(), i))
            .collect();
        let total: f64 = probs.iter().map(|p| p.0).sum();
        probs.iter_mut().for_each(|p| p.0 /= total);
        probs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        draw_nucleus(&probs, top_p, rng)
    }

    /// Logits of `n` tokens: normal with standard deviation `scale`, some rounded to halves
    /// (ties) and some -inf, from `rng`.
    fn logits(rng: &mut Rng, n: usize, scale: f64) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let (u, v) = (rng.next_f64().max(1e-300), rng.next_f64());
                let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * scale;
                match i % 11 {
                    3 => (z * 2.0).round() as f32 / 2.0,
                    7 if i % 5 == 0 => f32::NEG_INFINITY,
                    _ => z as f32,
                }
            })
            .collect()
    }

    #[test]
    fn sorting_only_the_nucleus_draws_the_tokens_of_a_full_sort() {
        let mut rng = Rng::new(11);
        let mut cases = 0;
        for (n, draws) in [(1000, 40), (129_280, 1)] {
            for scale in [0.5, 3.0, 12.0] {
                let x = logits(&mut rng, n, scale);
                for temperature in [0.3, 0.7, 1.0, 1.6] {
                    for top_p in [0.0, 0.5, 0.9, 0.95, 0.999_999, 1.0] {
                        let mut s = Sampler::new(temperature, top_p, cases);
                        let mut oracle = Rng::new(cases);
                        for _ in 0..draws {
                            let want = sample_by_full_sort(temperature, top_p, &mut oracle, &x);
                            assert_eq!(
                                s.sample(&x),
                                want,
                                "{n} tokens, scale {scale}, T {temperature}, top_p {top_p}"
                            );
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
}
