//! Turning logits into the next token: greedy at temperature 0, else temperature and top-p
//! (nucleus) sampling from a seeded generator, so a run is reproducible.

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

    /// The next token from one position's logits [V].
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.temperature <= 0.0 {
            return argmax(logits) as u32;
        }
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(f64, usize)> = logits
            .iter()
            .enumerate()
            .map(|(i, l)| ((((l - max) / self.temperature) as f64).exp(), i))
            .collect();
        let total: f64 = probs.iter().map(|p| p.0).sum();
        probs.iter_mut().for_each(|p| p.0 /= total);
        probs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        // Nucleus: the shortest prefix reaching top_p (at least one token).
        let mut kept = 0;
        let mut mass = 0.0;
        for p in &probs {
            kept += 1;
            mass += p.0;
            if mass >= self.top_p as f64 {
                break;
            }
        }
        let r = self.rng.next_f64() * mass;
        let mut acc = 0.0;
        for p in &probs[..kept] {
            acc += p.0;
            if r < acc {
                return p.1 as u32;
            }
        }
        probs[kept - 1].1 as u32
    }
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
}
