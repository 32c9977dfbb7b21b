//! Helpers shared by the integration tests: golden file paths, loading, traced runs.
#![allow(dead_code)]

use mla_engine::backend::cpu::Cpu;
use mla_engine::backend::Backend;
use mla_engine::model::{Model, Taps};
use mla_engine::sampling::argmax;
use mla_engine::trace::Trace;
use std::path::PathBuf;

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
    r.get("tokens")
        .expect("tokens")
        .i32()
        .expect("i32 tokens")
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

/// Logits [n, V] of a prefill of `tokens[..k]` followed by one decode step per remaining token.
pub fn logits_prefill_then_decode(model: &Model<Cpu>, tokens: &[u32], k: usize) -> Vec<f32> {
    let mut cache = model.new_cache(model.cfg.n_ctx);
    let mut out = Vec::new();
    let logits = model
        .forward(&mut cache, &tokens[..k], &mut Taps::none())
        .unwrap();
    out.extend(model.backend.download(&logits));
    for &t in &tokens[k..] {
        let logits = model.forward(&mut cache, &[t], &mut Taps::none()).unwrap();
        out.extend(model.backend.download(&logits));
    }
    out
}

/// Greedy continuation: `n` tokens after the prompt (decode steps on the cache).
pub fn greedy(model: &Model<Cpu>, prompt: &[u32], n: usize) -> Vec<u32> {
    let vocab = model.cfg.n_vocab;
    let mut cache = model.new_cache(model.cfg.n_ctx);
    let logits = model.backend.download(
        &model
            .forward(&mut cache, prompt, &mut Taps::none())
            .unwrap(),
    );
    let mut next = argmax(&logits[logits.len() - vocab..]) as u32;
    let mut out = vec![next];
    while out.len() < n {
        let logits = model.backend.download(
            &model
                .forward(&mut cache, &[next], &mut Taps::none())
                .unwrap(),
        );
        next = argmax(&logits) as u32;
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
