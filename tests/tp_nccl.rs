//! TP = 2 over NCCL on two GPUs against TP = 1 on one, every golden file: every stage of the
//! prefill, the greedy continuation token for token and the logits of its decode steps.
//!
//! Bound: prompts shorter than the CUDA backend's tensor-core threshold run every product in
//! f32 matrix-vector kernels whose per-row sums do not depend on how many rows a rank holds, so
//! TP = 2 differs from TP = 1 only where a sum is split over ranks (attn_output's heads, the
//! FFN's hidden units, the experts): the same f32 reordering the CPU tests bound (tests/tp.rs),
//! max(1e-5, 4 x the reference's f32 noise) per stage, ids exact. Without two GPUs the test
//! prints `SKIPPED: ...` and passes.

mod common;

use common::*;
use mla_engine::backend::cuda::backend::MATMUL_MIN_ROWS;
use mla_engine::backend::cuda::{Cuda, CudaError};
use mla_engine::backend::{Backend, Communicator};
use mla_engine::config::ModelConfig;
use mla_engine::gguf::GgufFile;
use mla_engine::model::{Model, Taps};
use mla_engine::sampling::argmax;
use mla_engine::tp::nccl::Nccl;
use mla_engine::tp::{ShardPlan, ShardedModel};
use mla_engine::trace::{compare, relative_error, Comparison, Trace};
use mla_engine::weights::GgufTensors;
use std::sync::Arc;

fn two_gpus() -> Option<[Cuda; 2]> {
    let open = |i| match Cuda::new(i) {
        Ok(c) => Some(c),
        Err(e @ (CudaError::NoDriver | CudaError::NoDevice(_))) => {
            println!("SKIPPED: TP over NCCL needs 2 CUDA devices, GPU {i}: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    };
    Some([open(0)?, open(1)?])
}

/// Prefill logits, the trace, and `n` greedy tokens with their decode logits.
struct Run {
    trace: Trace,
    greedy: Vec<u32>,
    decode: Vec<f32>,
}

fn run_tp1(m: &Model<Cuda>, tokens: &[u32], n: usize) -> Run {
    let mut trace = Trace::new();
    let mut cache = m.new_cache(m.cfg.n_ctx);
    let l = m
        .forward(&mut cache, tokens, &mut Taps::new(Some(&mut trace)))
        .unwrap();
    let l = m.backend.download(&l);
    let mut next = argmax(&l[l.len() - m.cfg.n_vocab..]) as u32;
    let (mut greedy, mut decode) = (vec![next], Vec::new());
    while greedy.len() < n {
        let l = m
            .backend
            .download(&m.forward(&mut cache, &[next], &mut Taps::none()).unwrap());
        next = argmax(&l) as u32;
        decode.extend(l);
        greedy.push(next);
    }
    Run {
        trace,
        greedy,
        decode,
    }
}

fn run_tp(m: &ShardedModel<Cuda>, tokens: &[u32], n: usize) -> Run {
    let mut trace = Trace::new();
    let mut cache = m.new_cache(m.cfg().n_ctx);
    let (l, mismatches) = m.forward(&mut cache, tokens, Some(&mut trace)).unwrap();
    assert!(mismatches.is_empty(), "ranks disagree on {mismatches:?}");
    let l = m.backend().download(&l);
    let mut next = argmax(&l[l.len() - m.cfg().n_vocab..]) as u32;
    let (mut greedy, mut decode) = (vec![next], Vec::new());
    while greedy.len() < n {
        let l = m
            .backend()
            .download(&m.forward(&mut cache, &[next], None).unwrap().0);
        next = argmax(&l) as u32;
        decode.extend(l);
        greedy.push(next);
    }
    Run {
        trace,
        greedy,
        decode,
    }
}

#[test]
fn tp2_over_nccl_equals_tp1_on_every_golden_file() {
    let Some([g0, g1]) = two_gpus() else { return };
    println!("GPUs: {} and {}", g0.gpu.name, g1.gpu.name);
    let mut compared = 0;
    for variant in [
        "ds3.f32",
        "ds3.q8_0",
        "ds3.q4_k_m",
        "ds3.mix",
        "ds3.legacy-q8_0",
        "glm5.q8_0",
        "v2lite.q8_0",
    ] {
        let path = model_path(variant);
        let file = Arc::new(GgufFile::open(&path).unwrap());
        let cfg = ModelConfig::from_gguf(&file).unwrap();
        let one = Model::load(
            cfg.clone(),
            Cuda::new(0).unwrap(),
            &GgufTensors(file.clone()),
        )
        .unwrap();
        let gpus = [Cuda::new(0).unwrap(), Cuda::new(1).unwrap()];
        let comms = Nccl::group(&gpus).unwrap();
        let ranks = gpus
            .into_iter()
            .zip(comms)
            .map(|(g, c)| (g, Box::new(c) as Box<dyn Communicator<Cuda>>))
            .collect();
        let plan = ShardPlan::new(&file, &cfg, 2).unwrap();
        let two = ShardedModel::load(file.clone(), plan, ranks, &|_| {}).unwrap();
        for prompt in 0..2 {
            let reference = load_ref(variant, prompt);
            let tokens = ref_tokens(&reference);
            if tokens.len() >= MATMUL_MIN_ROWS {
                continue; // the bf16 tensor-core path: held to its own bound in cuda_forward
            }
            let (a, b) = (run_tp(&two, &tokens, 16), run_tp1(&one, &tokens, 16));
            let mut failures = Vec::new();
            let mut worst = 0.0f64;
            for (name, cmp) in compare(&a.trace, &b.trace) {
                let bound = (4.0 * manifest_noise(variant, prompt, &name).unwrap_or(0.0)).max(1e-5);
                let bad = match cmp {
                    Comparison::Relative(e) => {
                        worst = worst.max(e);
                        e > bound
                    }
                    Comparison::Ids { differ, .. } => differ > 0,
                    Comparison::Mismatch(_) => true,
                };
                if bad {
                    failures.push(format!("{name}: {cmp:?} (bound {bound:.1e})"));
                }
            }
            assert_eq!(
                a.trace.names().len(),
                b.trace.names().len(),
                "{variant} p{prompt}: stages"
            );
            assert!(
                failures.is_empty(),
                "{variant} p{prompt}:\n{}",
                failures.join("\n")
            );
            assert_eq!(a.greedy, b.greedy, "{variant} p{prompt}: greedy");
            let decode = relative_error(&a.decode, &b.decode);
            assert!(
                decode <= 1e-5,
                "{variant} p{prompt}: decode logits {decode:.2e}"
            );
            let logits = match compare(&a.trace, &b.trace)
                .into_iter()
                .find(|(n, _)| n == "logits")
            {
                Some((_, Comparison::Relative(e))) => e,
                other => panic!("{variant}: logits {other:?}"),
            };
            println!(
                "{variant} p{prompt}: TP=2 vs TP=1 logits {logits:.2e}, worst stage {worst:.2e}, decode {decode:.2e}, greedy identical"
            );
            compared += 1;
        }
    }
    assert!(compared >= 7, "only {compared} prompts compared");
}
