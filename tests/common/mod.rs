//! Helpers shared by the integration tests: golden file paths, loading, traced runs.
#![allow(dead_code)]

use mla_engine::backend::cpu::Cpu;
use mla_engine::backend::Backend;
use mla_engine::model::{Cache, Model, Taps};
use mla_engine::sampling::argmax;
use mla_engine::trace::Trace;
use std::path::PathBuf;

pub mod synth;

/// An rstest with one case per committed golden GGUF. Wraps a test function whose first argument
/// is `variant: &str`: each file's name (`ds3.q8_0`) becomes its own case, and the other
/// arguments keep their own rstest attributes (`#[values(0, 1)] prompt: usize`).
#[macro_export]
macro_rules! every_golden_file {
    (
        $(#[$($attr:tt)*])*
        fn $name:ident($variant:ident: &str $(, $($args:tt)*)?) { $($body:tt)* }
    ) => {
        $(#[$($attr)*])*
        #[rstest::rstest]
        fn $name(
            #[values(
                "ds3.f32",
                "ds3.q8_0",
                "ds3.q4_k_m",
                "ds3.mix",
                "ds3.legacy-q8_0",
                "glm5.q8_0",
                "v2lite.q8_0"
            )]
            $variant: &str,
            $($($args)*)?
        ) {
            $($body)*
        }
    };
}

pub fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("golden")
}

/// The GGUF of a golden variant (`ds3.q8_0`); split sets by their first shard.
pub fn model_path(variant: &str) -> PathBuf {
    let models = golden_dir().join("models");
    let single = models.join(format!("{variant}.gguf"));
    if single.exists() {
        return single;
    }
    let prefix = format!("{variant}-00001-of-");
    std::fs::read_dir(&models)
        .unwrap_or_else(|e| panic!("{}: {e}", models.display()))
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&prefix)
        })
        .unwrap_or_else(|| panic!("no golden model {variant} in {}", models.display()))
}

pub fn ref_path(variant: &str, prompt: usize) -> PathBuf {
    golden_dir()
        .join("refs")
        .join(format!("{variant}.p{prompt}.safetensors"))
}

pub fn load(variant: &str) -> Model<Cpu> {
    let path = model_path(variant);
    Model::open(&path, Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn load_ref(variant: &str, prompt: usize) -> Trace {
    let path = ref_path(variant, prompt);
    Trace::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

/// The prompt ids stored in a reference file.
pub fn ref_tokens(r: &Trace) -> Vec<u32> {
    ref_ids(r, "tokens")
}

/// The token ids stored under `name` in a reference file (`tokens`, `greedy`).
pub fn ref_ids(r: &Trace, name: &str) -> Vec<u32> {
    r.get(name)
        .unwrap_or_else(|| panic!("no {name} in the reference"))
        .i32()
        .unwrap_or_else(|| panic!("{name}: not i32 ids"))
        .iter()
        .map(|&t| t as u32)
        .collect()
}

/// One prefill of `tokens` with every stage recorded.
pub fn traced_prefill(model: &Model<Cpu>, tokens: &[u32]) -> Trace {
    let mut trace = Trace::new();
    let mut cache = model.new_cache(model.cfg.n_ctx);
    model
        .forward(&mut cache, tokens, &mut Taps::new(Some(&mut trace)))
        .expect("forward");
    trace
}

/// Logits [tokens.len(), V] of one untraced forward pass over `tokens`, appended to `cache`.
pub fn forward_logits<B: Backend>(
    model: &Model<B>,
    cache: &mut Cache<B>,
    tokens: &[u32],
) -> Vec<f32> {
    let logits = model
        .forward(cache, tokens, &mut Taps::none())
        .expect("forward");
    model.backend.download(&logits)
}

/// Logits [n, V] of a prefill of `tokens[..k]` followed by one decode step per remaining token.
pub fn logits_prefill_then_decode<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    k: usize,
) -> Vec<f32> {
    let mut cache = model.new_cache(model.cfg.n_ctx);
    let mut out = forward_logits(model, &mut cache, &tokens[..k]);
    for &t in &tokens[k..] {
        out.extend(forward_logits(model, &mut cache, &[t]));
    }
    out
}

/// Greedy continuation: `n` tokens after the prompt (decode steps on the cache).
pub fn greedy(model: &Model<Cpu>, prompt: &[u32], n: usize) -> Vec<u32> {
    let vocab = model.cfg.n_vocab;
    let mut cache = model.new_cache(model.cfg.n_ctx);
    let logits = forward_logits(model, &mut cache, prompt);
    let mut next = argmax(&logits[logits.len() - vocab..]) as u32;
    let mut out = vec![next];
    while out.len() < n {
        next = argmax(&forward_logits(model, &mut cache, &[next])) as u32;
        out.push(next);
    }
    out
}

/// The manifest's f32-vs-f64 noise of `stage` for `variant` and `prompt`, if recorded.
pub fn manifest_noise(variant: &str, prompt: usize, stage: &str) -> Option<f64> {
    manifest_prompt(variant, prompt)?
        .get("noise")?
        .get(stage)?
        .as_f64()
}

/// The manifest's record of prompt `prompt` of `variant` (noise, llama.cpp agreement...).
pub fn manifest_prompt(variant: &str, prompt: usize) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(golden_dir().join("manifest.json")).ok()?;
    let m: serde_json::Value = serde_json::from_str(&text).ok()?;
    m.get("gguf")?
        .get(variant)?
        .get("prompts")?
        .as_array()?
        .iter()
        .find(|p| p.get("k").and_then(|k| k.as_u64()) == Some(prompt as u64))
        .cloned()
}

/// The decode query's rope as MLA decode applies it when it loads q_pe (MlaDecode::qp_rope),
/// in f64 from the same f32 angles: q_pe of every (token, head) row of `q_whole` (whole heads
/// [q_nope | q_pe], dn + dr wide, `heads` a token), token t at position pos0 + t, adjacent
/// pairs turned by inv_freq and scaled by mscale.
pub fn roped_q_pe(
    q_whole: &[f32],
    heads: usize,
    (dn, dr): (usize, usize),
    pos0: usize,
    inv_freq: &[f32],
    mscale: f32,
) -> Vec<f32> {
    (0..q_whole.len() / (dn + dr) * dr)
        .map(|j| {
            let (th, d) = (j / dr, j % dr);
            let p = &q_whole[th * (dn + dr) + dn..][..dr];
            let angle = ((pos0 + th / heads) as f32 * inv_freq[d / 2]) as f64;
            let (s, c) = angle.sin_cos();
            let (x0, x1) = (p[d & !1] as f64, p[d | 1] as f64);
            let y = if d % 2 == 0 {
                x0 * c - x1 * s
            } else {
                x0 * s + x1 * c
            };
            (y * mscale as f64) as f32
        })
        .collect()
}

/// The span table of the grouped products (ops.rs `Matmul::spans`): (expert, first row,
/// count) triples as i32.
pub fn span_table(spans: &[(usize, usize, usize)]) -> Vec<i32> {
    spans
        .iter()
        .flat_map(|&(e, r0, c)| [e as i32, r0 as i32, c as i32])
        .collect()
}

/// f64 twin of layernorm over one row (weight, bias), its first 2 * inv_freq.len() values
/// then roped as adjacent pairs at position `pos` (cos and sin scaled by `mscale`).
pub fn layernorm_rope_twin(
    x: &[f32],
    (w, b): (&[f32], &[f32]),
    eps: f32,
    (inv_freq, pos, mscale): (&[f32], usize, f32),
) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps as f64).sqrt();
    let mut row: Vec<f64> = (0..x.len())
        .map(|i| (x[i] as f64 - mean) * inv * w[i] as f64 + b[i] as f64)
        .collect();
    rope_pairs_twin(&mut row, (inv_freq, pos, mscale));
    row
}

/// f64 twin of one token's MLA latent row kv [dl + dr] as the latent cache holds it: c_kv =
/// rmsnorm(kv[..dl]) * w, then k_pe = kv[dl..] roped as adjacent pairs at position `pos`.
pub fn latent_twin(
    kv: &[f32],
    w: &[f32],
    eps: f32,
    (inv_freq, pos, mscale): (&[f32], usize, f32),
) -> Vec<f64> {
    let dl = w.len();
    let mut row = rmsnorm_twin(&kv[..dl], w, eps);
    let mut k_pe: Vec<f64> = kv[dl..].iter().map(|&v| v as f64).collect();
    rope_pairs_twin(&mut k_pe, (inv_freq, pos, mscale));
    row.extend(k_pe);
    row
}

/// The first 2 * inv_freq.len() values of `row` roped as adjacent pairs at position `pos`,
/// cos and sin scaled by `mscale`.
fn rope_pairs_twin(row: &mut [f64], (inv_freq, pos, mscale): (&[f32], usize, f32)) {
    for (i, &f) in inv_freq.iter().enumerate() {
        // The angle is an f32 product, as in rope_pairs.
        let angle = (pos as f32 * f) as f64;
        let (s, c) = (angle.sin() * mscale as f64, angle.cos() * mscale as f64);
        let (a, b) = (row[2 * i], row[2 * i + 1]);
        row[2 * i] = a * c - b * s;
        row[2 * i + 1] = a * s + b * c;
    }
}

/// f64 twin of rmsnorm over one row.
pub fn rmsnorm_twin(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter()
        .zip(w)
        .map(|(&v, &g)| v as f64 * inv * g as f64)
        .collect()
}

/// The dot product of two f32 rows in f64.
pub fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Causal softmax attention of one query over the visible keys, in f64.
pub fn attend(scores: &[(usize, f64)], value: impl Fn(usize, usize) -> f64, dv: usize) -> Vec<f64> {
    let mx = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
    let mut out = vec![0f64; dv];
    let mut sum = 0.0;
    for &(s, sc) in scores {
        let p = (sc - mx).exp();
        sum += p;
        for (d, o) in out.iter_mut().enumerate() {
            *o += p * value(s, d);
        }
    }
    if sum > 0.0 {
        out.iter_mut().for_each(|o| *o /= sum);
    }
    out
}

/// The keys query t (at position pos0 + t) sees: its row of `keep` (n_ids positions, -1
/// skipped), or all causal keys without a selection.
pub fn visible_keys(keep: Option<&[i32]>, t: usize, n_ids: usize, pos0: usize) -> Vec<usize> {
    match keep {
        Some(keep) => keep[t * n_ids..][..n_ids]
            .iter()
            .filter(|&&s| s >= 0)
            .map(|&s| s as usize)
            .collect(),
        None => (0..=pos0 + t).collect(),
    }
}

/// CPU twin of topk_rows: the k best of row[0..n], ascending positions, ties lowest first.
pub fn topk_twin(row: &[f32], n: usize, k: usize) -> Vec<i32> {
    if n <= k {
        return (0..k).map(|i| if i < n { i as i32 } else { -1 }).collect();
    }
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    let mut chosen: Vec<i32> = idx[..k].iter().map(|&i| i as i32).collect();
    chosen.sort();
    chosen
}

/// DSA selections (rows of n_ids positions, -1 padded) as attention_prefill's key bit mask,
/// [rows][words] u32.
pub fn keep_mask(keep: &[i32], n_ids: usize, words: usize) -> Vec<u32> {
    let mut mask = vec![0u32; keep.len() / n_ids * words];
    for (t, row) in keep.chunks(n_ids).enumerate() {
        for &s in row.iter().filter(|&&s| s >= 0) {
            mask[t * words + s as usize / 32] |= 1 << (s % 32);
        }
    }
    mask
}

/// The prefill attention's sizes (ops.rs `AttentionPrefill`, laid out as the tests upload it:
/// q [tokens][heads][dn + dr], k_nope [S][heads][dn], k_pe [S][dr] for every head, v
/// [S][heads][dv], S = pos0 + tokens).
#[derive(Clone, Copy)]
pub struct AttentionShape {
    pub dn: usize,
    pub dr: usize,
    pub dv: usize,
    pub heads: usize,
    pub tokens: usize,
    pub pos0: usize,
}

/// The prefill attention in f64, [tokens][heads][dv]: each query over its causal keys, or
/// over its row of `keep` (DSA selections of n_ids positions).
pub fn attention_want(
    q: &[f32],
    k_nope: &[f32],
    k_pe: &[f32],
    v: &[f32],
    a: AttentionShape,
    keep: Option<(&[i32], usize)>,
    scale: f32,
) -> Vec<f64> {
    let (dn, dr, dv, heads) = (a.dn, a.dr, a.dv, a.heads);
    let dqk = dn + dr;
    let mut want = Vec::new();
    for t in 0..a.tokens {
        for h in 0..heads {
            let qr = &q[(t * heads + h) * dqk..][..dqk];
            let visible = visible_keys(keep.map(|k| k.0), t, keep.map_or(0, |k| k.1), a.pos0);
            let scores: Vec<(usize, f64)> = visible
                .iter()
                .map(|&s| {
                    let kn = &k_nope[(s * heads + h) * dn..][..dn];
                    let kp = &k_pe[s * dr..][..dr];
                    (
                        s,
                        (dot64(&qr[..dn], kn) + dot64(&qr[dn..], kp)) * scale as f64,
                    )
                })
                .collect();
            want.extend(attend(
                &scores,
                |s, d| v[(s * heads + h) * dv + d] as f64,
                dv,
            ));
        }
    }
    want
}
