//! The whole forward pass on `--backend cuda` against the golden references (transformers on
//! each file's own dequantized weights, the same files tests/stages.rs holds the CPU backend
//! to), stage by stage, and prefill/decode equivalence on the GPU.
//!
//! Tolerances (relative error ||gpu - ref|| / ||ref|| per stage):
//! - f32 path: prompts shorter than the backend's tensor-core threshold (16 rows) run every
//!   product in f32 matrix-vector kernels, so the GPU differs from the reference only by f32
//!   summation order: max(1e-4, 4 x the reference's own f32 noise from the manifest), ids
//!   exact.
//! - bf16 path: longer prompts round both operands of every product to bf16 (unit roundoff
//!   2^-9 = 2e-3 each); over the few products in series of a golden model that compounds to
//!   about 1e-2, so 3e-2, and at most 2% of router choices may differ (a near-tie that bf16
//!   flips; any systematic bug moves far more).
//!
//! Variants are every `golden/refs/{variant}.p{k}.safetensors` whose model exists. Without a
//! GPU every test prints `SKIPPED: no CUDA device` and passes.

use std::path::{Path, PathBuf};

use mla_engine::backend::cuda::backend::MATMUL_MIN_ROWS;
use mla_engine::backend::cuda::{Cuda, CudaError};
use mla_engine::backend::Backend;
use mla_engine::model::{Model, Taps};
use mla_engine::trace::{compare, relative_error, Comparison, Trace};

const BF16_PATH_TOL: f64 = 3e-2;
const BF16_PATH_IDS: f64 = 0.02;

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("golden")
}

fn cuda() -> Option<Cuda> {
    match Cuda::new(0) {
        Ok(c) => {
            println!("GPU: {} ({})", c.gpu.name, c.gpu.arch);
            Some(c)
        }
        Err(e @ (CudaError::NoDriver | CudaError::NoDevice(_))) => {
            println!("SKIPPED: no CUDA device ({e})");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// (variant, prompt index) of every reference whose model is present.
fn cases() -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let refs = golden().join("refs");
    for entry in std::fs::read_dir(&refs).unwrap_or_else(|e| panic!("{}: {e}", refs.display())) {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".safetensors") else {
            continue;
        };
        let Some((variant, p)) = stem.rsplit_once(".p") else {
            continue;
        };
        if model_path(variant).is_some() {
            out.push((variant.to_string(), p.parse().unwrap()));
        }
    }
    out.sort();
    assert!(
        !out.is_empty(),
        "no golden references in {}",
        refs.display()
    );
    out
}

/// The GGUF of a variant (split sets by their first shard).
fn model_path(variant: &str) -> Option<PathBuf> {
    let models = golden().join("models");
    let single = models.join(format!("{variant}.gguf"));
    if single.exists() {
        return Some(single);
    }
    let prefix = format!("{variant}-00001-of-");
    std::fs::read_dir(&models)
        .ok()?
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&prefix)
        })
}

fn open(path: &Path, backend: Cuda) -> Model<Cuda> {
    Model::open(path, backend).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn manifest_noise(variant: &str, prompt: usize, stage: &str) -> Option<f64> {
    let text = std::fs::read_to_string(golden().join("manifest.json")).ok()?;
    let m: serde_json::Value = serde_json::from_str(&text).ok()?;
    m.get("noise")?
        .get(format!("{variant}.p{prompt}"))?
        .get(stage)?
        .as_f64()
}

fn tokens_of(r: &Trace) -> Vec<u32> {
    let t = r.get("tokens").expect("tokens").i32().expect("i32 tokens");
    t.iter().map(|&t| t as u32).collect()
}

#[test]
fn every_stage_matches_the_reference_on_the_gpu() {
    let Some(first) = cuda() else { return };
    let mut backend = Some(first);
    let mut failures = Vec::new();
    for (variant, prompt) in cases() {
        let b = backend.take().map_or_else(|| Cuda::new(0).unwrap(), |b| b);
        let path = model_path(&variant).unwrap();
        let model = open(&path, b);
        println!(
            "{variant}: weights {} bytes on the GPU",
            model.backend.weight_bytes()
        );
        let reference =
            Trace::load(&golden().join(format!("refs/{variant}.p{prompt}.safetensors")))
                .unwrap_or_else(|e| panic!("{e}"));
        let tokens = tokens_of(&reference);
        let bf16_path = tokens.len() >= MATMUL_MIN_ROWS;
        let mut ours = Trace::new();
        let mut cache = model.new_cache(tokens.len() + 16);
        model
            .forward(&mut cache, &tokens, &mut Taps::new(Some(&mut ours)))
            .expect("forward");
        let mut compared = 0;
        for (name, cmp) in compare(&ours, &reference) {
            compared += 1;
            let tol = if bf16_path {
                BF16_PATH_TOL
            } else {
                (4.0 * manifest_noise(&variant, prompt, &name).unwrap_or(0.0)).max(1e-4)
            };
            let bad = match &cmp {
                Comparison::Relative(e) => !(*e <= tol),
                Comparison::Ids { differ, total } => {
                    let allowed = if bf16_path {
                        (BF16_PATH_IDS * *total as f64) as usize
                    } else {
                        0
                    };
                    *differ > allowed
                }
                Comparison::Mismatch(_) => true,
            };
            println!("{variant} p{prompt} {name}: {cmp:?} (tolerance {tol:.1e})");
            if bad {
                failures.push(format!(
                    "{variant} p{prompt} {name}: {cmp:?} (tolerance {tol:.1e})"
                ));
            }
        }
        assert!(
            compared > 20,
            "{variant} p{prompt}: only {compared} stages compared"
        );
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// Logits of one prefill of all tokens against a prefill of the first `k` tokens followed by
/// one decode step per remaining token: the expanded prefill attention and the absorbed decode
/// over the latent cache must compute the same function. Both stay on the f32 path (fewer than
/// MATMUL_MIN_ROWS tokens), so they agree to f32 rounding.
#[test]
fn prefill_equals_decode_on_the_gpu() {
    let Some(first) = cuda() else { return };
    let mut backend = Some(first);
    let mut seen = std::collections::BTreeSet::new();
    for (variant, _) in cases() {
        if !seen.insert(variant.clone()) {
            continue;
        }
        let b = backend.take().map_or_else(|| Cuda::new(0).unwrap(), |b| b);
        let model = open(&model_path(&variant).unwrap(), b);
        let vocab = model.cfg.n_vocab;
        let tokens: Vec<u32> = (0..12)
            .map(|i| (i * 37 + 5) as u32 % vocab as u32)
            .collect();
        let k = 4;

        let mut cache = model.new_cache(32);
        let all = model.backend.download(
            &model
                .forward(&mut cache, &tokens, &mut Taps::none())
                .unwrap(),
        );

        let mut cache = model.new_cache(32);
        let mut stepped = model.backend.download(
            &model
                .forward(&mut cache, &tokens[..k], &mut Taps::none())
                .unwrap(),
        );
        for &t in &tokens[k..] {
            let logits = model.forward(&mut cache, &[t], &mut Taps::none()).unwrap();
            stepped.extend(model.backend.download(&logits));
        }
        let e = relative_error(&stepped, &all);
        println!(
            "{variant}: prefill {} vs prefill {k} + {} decode steps: relative error {e:.2e}",
            tokens.len(),
            tokens.len() - k
        );
        assert!(e <= 1e-4, "{variant}: prefill and decode differ by {e:.2e}");
    }
}
