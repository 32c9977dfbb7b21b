//! Tensor parallelism on the CPU backend: TP = 2, 4 and 8 against the engine's TP = 1.
//!
//! What "equal" means: a split changes only the order of float additions (the two all-reduces
//! per layer sum per-rank partial sums of attn_output, of the FFN / shared expert and of the
//! routed experts, in rank order). Two orders of the same m-term f32 sum differ by at most
//! 2 * gamma_(m-1) * sum|x_i| (Higham, Accuracy and Stability, section 4.2) and in practice by
//! about sqrt(m) * 2^-24 relative; the largest reductions here (m <= 256) give a few 1e-7, and
//! the network then propagates such perturbations exactly as it propagates f32 rounding. So
//! each stage is held to the bound the engine's golden stage tests use for f32 rounding:
//! max(1e-5, 4 x the reference's measured f32-vs-f64 noise for that stage) relative, ids
//! (experts, DSA top-k) and greedy tokens exactly. Replicated stages must be bit-identical on
//! every rank.

mod common;

use common::synth::{synth, Synth};
use common::*;
use mla_engine::backend::cpu::Cpu;
use mla_engine::backend::{Backend, Communicator};
use mla_engine::config::ModelConfig;
use mla_engine::gguf::{GgmlType, GgufFile};
use mla_engine::model::{Model, Taps};
use mla_engine::sampling::argmax;
use mla_engine::tp::{GreedyToken, Local, PlanError, ShardPlan, ShardedModel, Split, TpError};
use mla_engine::trace::{compare, relative_error, Comparison, Trace};
use mla_engine::weights::GgufTensors;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Every golden model file (split sets by their first shard).
fn golden_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(golden_dir().join("models"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            name.ends_with(".gguf") && (!name.contains("-of-") || name.contains("-00001-of-"))
        })
        .collect();
    files.sort();
    assert!(files.len() >= 2, "golden models missing: {files:?}");
    files
}

/// The variant name of a golden file (`ds3.q8_0`, `v2lite.q8_0`).
fn variant(path: &Path) -> String {
    let name = path.file_stem().unwrap().to_string_lossy().to_string();
    match name.find("-00001-of-") {
        Some(i) => name[..i].to_string(),
        None => name,
    }
}

fn open(path: &Path) -> (Arc<GgufFile>, ModelConfig) {
    let file = Arc::new(GgufFile::open(path).unwrap());
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    (file, cfg)
}

/// The model at TP = 1, as the engine runs it.
fn single(file: &Arc<GgufFile>, cfg: &ModelConfig) -> Model<Cpu> {
    Model::load(cfg.clone(), Cpu, &GgufTensors(file.clone())).unwrap()
}

/// The model over `tp` in-process ranks.
fn sharded(
    file: &Arc<GgufFile>,
    cfg: &ModelConfig,
    tp: usize,
) -> Result<ShardedModel<Cpu>, TpError> {
    let plan = ShardPlan::new(file, cfg, tp)?;
    let ranks = Local::group(tp)
        .into_iter()
        .map(|c| (Cpu, Box::new(c) as Box<dyn Communicator<Cpu>>))
        .collect();
    ShardedModel::load(file.clone(), plan, ranks, &|_| {})
}

fn traced_tp(m: &ShardedModel<Cpu>, tokens: &[u32]) -> Trace {
    let mut trace = Trace::new();
    let mut cache = m.new_cache(m.ranks[0].cfg.n_ctx);
    let (_, mismatches) = m.forward(&mut cache, tokens, Some(&mut trace)).unwrap();
    assert!(
        mismatches.is_empty(),
        "replicated stages differ between ranks: {mismatches:?}"
    );
    trace
}

/// Greedy continuation over the ranks, and the logits of every decode step.
fn greedy_tp(m: &ShardedModel<Cpu>, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let b = &m.ranks[0].backend;
    let vocab = m.ranks[0].cfg.n_vocab;
    let mut cache = m.new_cache(m.ranks[0].cfg.n_ctx);
    let (l, _) = m.forward(&mut cache, prompt, None).unwrap();
    let l = b.download(&l);
    let mut next = argmax(&l[l.len() - vocab..]) as u32;
    let (mut out, mut logits) = (vec![next], Vec::new());
    while out.len() < n {
        let (l, _) = m.forward(&mut cache, &[next], None).unwrap();
        let l = b.download(&l);
        next = argmax(&l) as u32;
        logits.extend_from_slice(&l);
        out.push(next);
    }
    (out, logits)
}

/// The same continuation as `generate` takes it: each step queued on the ranks' picks of the
/// token before (`greedy_step`), the picks read after that.
fn greedy_ahead(m: &ShardedModel<Cpu>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache(m.ranks[0].cfg.n_ctx);
    let (l, _) = m.forward(&mut cache, prompt, None).unwrap();
    let mut out = vec![m.backend().argmax_last(&l)];
    let mut picks = m.greedy_step(&mut cache, GreedyToken::Id(out[0])).unwrap();
    while out.len() < n {
        let ahead = m
            .greedy_step(&mut cache, GreedyToken::Picks(&picks))
            .unwrap();
        out.push(m.pick_id(&picks));
        picks = ahead;
    }
    out
}

/// Decode-step logits at TP = 1 for the same token sequence.
fn decode_logits(m: &Model<Cpu>, prompt: &[u32], continuation: &[u32]) -> Vec<f32> {
    let mut cache = m.new_cache(m.cfg.n_ctx);
    m.forward(&mut cache, prompt, &mut Taps::none()).unwrap();
    let mut out = Vec::new();
    for &t in &continuation[..continuation.len() - 1] {
        out.extend(
            m.backend
                .download(&m.forward(&mut cache, &[t], &mut Taps::none()).unwrap()),
        );
    }
    out
}

/// Compares every stage of `ours` with `base`; returns failures and the worst relative error.
fn check_stages(
    ours: &Trace,
    base: &Trace,
    tol: impl Fn(&str) -> f64,
) -> (Vec<String>, f64, usize) {
    let mut failures = Vec::new();
    let mut worst = 0.0f64;
    for name in base.names() {
        if ours.get(name).is_none() {
            failures.push(format!("{name}: missing at TP > 1"));
        }
    }
    let rows = compare(ours, base);
    for (name, cmp) in &rows {
        let bad = match cmp {
            Comparison::Relative(e) => {
                worst = worst.max(*e);
                *e > tol(name)
            }
            Comparison::Ids { differ, .. } => *differ > 0,
            Comparison::Mismatch(_) => true,
        };
        if bad {
            failures.push(format!("{name}: {cmp:?} (bound {:.1e})", tol(name)));
        }
    }
    (failures, worst, rows.len())
}

/// The golden prompts of a variant: from its reference files, or (a model without stage
/// references, like the story model) from the manifest.
fn prompts(variant: &str) -> Vec<Vec<u32>> {
    let from_refs: Vec<Vec<u32>> = (0..)
        .map(|k| ref_path(variant, k))
        .take_while(|p| p.exists())
        .map(|p| ref_tokens(&Trace::load(&p).unwrap()))
        .collect();
    if !from_refs.is_empty() {
        return from_refs;
    }
    let text = std::fs::read_to_string(golden_dir().join("manifest.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    let listed = manifest["gguf"][variant]["prompts"]
        .as_array()
        .unwrap_or_else(|| panic!("{variant}: no references and no prompts in the manifest"));
    listed
        .iter()
        .map(|p| {
            p["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

/// TP = `tp` on every golden file and prompt: every stage, the greedy continuation and its
/// decode logits equal TP = 1; where TP does not divide the heads or experts, the refusal.
fn golden_at(tp: usize) {
    let mut compared = 0;
    for path in golden_files() {
        let v = variant(&path);
        let (file, cfg) = open(&path);
        let m = match sharded(&file, &cfg, tp) {
            Ok(m) => m,
            Err(TpError::Plan(PlanError::Indivisible { what, count, .. })) => {
                assert_ne!(count % tp, 0);
                let expected = if what.contains("head") {
                    cfg.n_head
                } else {
                    cfg.moe.as_ref().unwrap().n_expert
                };
                assert_eq!(count, expected, "{v}: {what}");
                eprintln!("{v} TP={tp}: refused ({what} {count})");
                continue;
            }
            Err(TpError::Plan(e @ PlanError::Blocks { cols, block, .. })) => {
                assert_ne!(cols % block, 0);
                eprintln!("{v} TP={tp}: refused ({e})");
                continue;
            }
            Err(e) => panic!("{v} TP={tp}: {e}"),
        };
        let base = single(&file, &cfg);
        for (prompt, tokens) in prompts(&v).into_iter().enumerate() {
            let ours = traced_tp(&m, &tokens);
            let one = traced_prefill(&base, &tokens);
            let tol = |name: &str| {
                let noise = manifest_noise(&v, prompt, name).unwrap_or(0.0);
                (4.0 * noise).max(1e-5)
            };
            let (failures, worst, n) = check_stages(&ours, &one, tol);
            assert!(n > 20, "{v} p{prompt}: only {n} stages");
            assert!(
                failures.is_empty(),
                "{v} p{prompt} TP={tp}:\n{}",
                failures.join("\n")
            );

            let (tokens_tp, logits_tp) = greedy_tp(&m, &tokens, 16);
            let tokens_one = greedy(&base, &tokens, 16);
            assert_eq!(tokens_tp, tokens_one, "{v} p{prompt} TP={tp}: greedy");
            let tokens_ahead = greedy_ahead(&m, &tokens, 16);
            assert_eq!(
                tokens_ahead, tokens_one,
                "{v} p{prompt} TP={tp}: greedy on picks"
            );
            let logits_one = decode_logits(&base, &tokens, &tokens_one);
            let decode_err = relative_error(&logits_tp, &logits_one);
            assert!(
                decode_err <= 1e-5,
                "{v} p{prompt} TP={tp}: decode logits {decode_err:.2e}"
            );
            eprintln!(
                "{v} p{prompt} TP={tp}: {n} stages, worst {worst:.2e}; 16 greedy tokens identical, decode logits {decode_err:.2e}; warnings {:?}",
                m.plan.warnings
            );
            compared += 1;
        }
    }
    assert!(compared >= 2, "TP={tp}: no golden file compared");
}

#[test]
fn golden_models_at_tp2_equal_tp1() {
    golden_at(2);
}

#[test]
fn golden_models_at_tp4_equal_tp1() {
    golden_at(4);
}

#[test]
fn golden_models_at_tp8_are_refused_for_their_4_heads() {
    for path in golden_files() {
        let (file, cfg) = open(&path);
        let err = ShardPlan::new(&file, &cfg, 8).unwrap_err().to_string();
        assert_eq!(
            err,
            "--tp 8: the attention head count 4 cannot be divided among 8 ranks (TP must divide it)"
        );
    }
}

fn eight_by_eight() -> PathBuf {
    synth(&Synth::default(), "8x8")
}

#[test]
fn synthetic_8_heads_8_experts_at_tp2_4_8_equal_tp1() {
    let path = eight_by_eight();
    let (file, cfg) = open(&path);
    let base = single(&file, &cfg);
    let tokens: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % cfg.n_vocab as u32).collect();
    let one = traced_prefill(&base, &tokens);
    let greedy_one = greedy(&base, &tokens, 16);
    let decode_one = decode_logits(&base, &tokens, &greedy_one);
    for tp in [2, 4, 8] {
        let m = sharded(&file, &cfg, tp).unwrap();
        let ours = traced_tp(&m, &tokens);
        let (failures, worst, n) = check_stages(&ours, &one, |_| 1e-5);
        assert!(failures.is_empty(), "TP={tp}:\n{}", failures.join("\n"));
        let (greedy_tp, decode_tp) = greedy_tp(&m, &tokens, 16);
        assert_eq!(greedy_tp, greedy_one, "TP={tp}: greedy");
        let decode_err = relative_error(&decode_tp, &decode_one);
        assert!(
            decode_err <= 1e-5,
            "TP={tp}: decode logits {decode_err:.2e}"
        );
        eprintln!(
            "synthetic 8x8 TP={tp}: {n} stages, worst {worst:.2e}; greedy identical; decode {decode_err:.2e}; warnings {:?}",
            m.plan.warnings
        );
    }
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn each_rank_holds_its_share_read_from_the_map() {
    let path = eight_by_eight();
    let (file, cfg) = open(&path);
    let tp = 8;
    let m = sharded(&file, &cfg, tp).unwrap();
    let total: usize = file.tensors().iter().map(|t| t.n_bytes as usize).sum();
    let replicated: usize = m
        .plan
        .tensors
        .iter()
        .filter(|t| t.split == Split::Replicated)
        .map(|t| t.n_bytes)
        .sum();
    // exp_probs_b biases are read to the host by the loader, not handed to the backend.
    let host: usize = m
        .plan
        .tensors
        .iter()
        .filter(|t| t.name.ends_with("exp_probs_b.bias"))
        .map(|t| t.n_bytes)
        .sum();
    for rank in 0..tp {
        let planned = m.plan.rank_bytes(rank);
        // What the backend was handed equals the plan.
        assert_eq!(m.loaded_bytes[rank] + host, planned.total(), "rank {rank}");
        assert_eq!(planned.replicated, replicated);
        eprintln!(
            "rank {rank}: {} bytes ({} sharded + {} replicated) of a {total}-byte file",
            planned.total(),
            planned.sharded,
            planned.replicated
        );
    }
    // Split parts add up to the split tensors (rank 0 also holds the unsplit shared expert).
    let split: usize = m
        .plan
        .tensors
        .iter()
        .filter(|t| matches!(t.split, Split::Rows | Split::Columns))
        .map(|t| t.n_bytes)
        .sum();
    let first_rank: usize = m
        .plan
        .tensors
        .iter()
        .filter(|t| t.split == Split::FirstRank)
        .map(|t| t.n_bytes)
        .sum();
    let sharded_sum: usize = (0..tp).map(|r| m.plan.rank_bytes(r).sharded).sum();
    // The synthetic file has its own output.weight (no tied head counted twice).
    assert_eq!(sharded_sum, split + first_rank);
    // Dense FFN 128 and shared expert 32 wide: 16 and 4 columns per rank, not Q8_0 blocks.
    assert!(first_rank > 0);
    assert_eq!(m.plan.warnings.len(), 2, "{:?}", m.plan.warnings);

    // Row splits are views into the mapped file, not copies.
    use mla_engine::tp::ShardSource;
    use mla_engine::weights::TensorSource;
    let source = ShardSource {
        file: file.clone(),
        plan: m.plan.clone(),
        rank: 3,
    };
    for name in [
        "blk.1.attn_q_b.weight",
        "blk.2.ffn_gate_exps.weight",
        "output.weight",
    ] {
        let info = file.tensor(name).unwrap();
        let whole = file.tensor_data(info);
        let part = source.tensor(name).unwrap();
        let len = whole.len() / tp;
        assert_eq!(
            part.bytes.as_slice().as_ptr(),
            whole[3 * len..].as_ptr(),
            "{name}"
        );
        assert_eq!(part.bytes.as_slice(), &whole[3 * len..4 * len]);
    }
    // A column split holds the rank's blocks of every row.
    let name = "blk.0.attn_output.weight";
    let info = file.tensor(name).unwrap();
    let whole = file.tensor_data(info);
    let row = info.ggml_type.row_bytes(info.ne[0] as usize).unwrap();
    let part = source.tensor(name).unwrap();
    assert_eq!(part.ne, vec![info.ne[0] as usize / tp, info.ne[1] as usize]);
    for (r, got) in part.bytes.as_slice().chunks_exact(row / tp).enumerate() {
        assert_eq!(got, &whole[r * row + 3 * row / tp..r * row + 4 * row / tp]);
    }
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn counts_tp_cannot_divide_are_refused_clearly() {
    let five_heads = synth(
        &Synth {
            heads: 5,
            ..Synth::default()
        },
        "5heads",
    );
    let (file, cfg) = open(&five_heads);
    assert_eq!(
        ShardPlan::new(&file, &cfg, 2).unwrap_err().to_string(),
        "--tp 2: the attention head count 5 cannot be divided among 2 ranks (TP must divide it)"
    );
    std::fs::remove_file(&five_heads).unwrap();

    let six_experts = synth(
        &Synth {
            experts: 6,
            groups: Some(1),
            ..Synth::default()
        },
        "6experts",
    );
    let (file, cfg) = open(&six_experts);
    assert_eq!(
        ShardPlan::new(&file, &cfg, 4).unwrap_err().to_string(),
        "--tp 4: the routed expert count 6 cannot be divided among 4 ranks (TP must divide it)"
    );
    std::fs::remove_file(&six_experts).unwrap();

    // attn_output in Q4_K (256-element blocks), 8 heads x 32 = 256 columns: two ranks would
    // each hold half a block of every row.
    let k_quant = synth(
        &Synth {
            attn_output: GgmlType::Q4_K,
            ..Synth::default()
        },
        "q4k-out",
    );
    let (file, cfg) = open(&k_quant);
    assert_eq!(
        ShardPlan::new(&file, &cfg, 2).unwrap_err().to_string(),
        "--tp 2: tensor blk.0.attn_output.weight (Q4_K): each rank would hold 128 of its 256 columns, \
         not a whole number of 256-element blocks"
    );
    // TP = 1 of the same file plans as everything whole.
    let plan = ShardPlan::new(&file, &cfg, 1).unwrap();
    assert_eq!(
        plan.rank_bytes(0).total(),
        file.tensors()
            .iter()
            .map(|t| t.n_bytes as usize)
            .sum::<usize>()
    );
    std::fs::remove_file(&k_quant).unwrap();
}

// ----- the generate binary ------------------------------------------------------------------

/// The f32 values of an .npy file written by `generate --logits-out`.
fn read_npy(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn generate(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_generate"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap()
}

#[test]
fn generate_tp_gives_the_tp1_logits_and_reports_rank_memory() {
    let dir = std::env::temp_dir().join(format!("tp-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = "golden/models/glm5.q8_0.gguf";
    let logits = |tp: &str| {
        let out = dir.join(format!("tp{tp}.npy"));
        let o = generate(&[
            "--model",
            model,
            "--tp",
            tp,
            "--tokens",
            "3,141,59,265,35,89",
            "--logits-out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        read_npy(&out)
    };
    let one = logits("1");
    for tp in ["2", "4"] {
        let err = relative_error(&logits(tp), &one);
        assert!(err <= 1e-5, "--tp {tp}: logits {err:.2e}");
    }

    let o = generate(&[
        "--model",
        model,
        "--tp",
        "2",
        "--prompt",
        "In the",
        "--max-tokens",
        "4",
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    for rank in 0..2 {
        assert!(
            stderr.contains(&format!("tp rank {rank}: weights "))
                && stderr.contains("replicated (plan)"),
            "{stderr}"
        );
    }

    let o = generate(&["--model", model, "--tp", "3", "--prompt", "In the"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr).trim_end(),
        format!("error: {model}: --tp 3: the attention head count 4 cannot be divided among 3 ranks (TP must divide it)")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A communicator whose rank `fail_rank` panics in its `fail_at`-th all-reduce.
struct FailingRank {
    inner: Local,
    rank: usize,
    fail_rank: usize,
    fail_at: usize,
    calls: std::sync::atomic::AtomicUsize,
}

impl Communicator<Cpu> for FailingRank {
    fn all_reduce(&self, backend: &Cpu, x: &mut <Cpu as Backend>::Tensor) {
        let n = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.rank == self.fail_rank && n + 1 == self.fail_at {
            panic!("injected failure in rank {}", self.rank);
        }
        self.inner.all_reduce(backend, x);
    }
    fn all_gather_cols(
        &self,
        backend: &Cpu,
        x: <Cpu as Backend>::Tensor,
    ) -> <Cpu as Backend>::Tensor {
        self.inner.all_gather_cols(backend, x)
    }
    fn abort(&self) {
        Communicator::<Cpu>::abort(&self.inner);
    }
}

/// A rank that panics mid-forward stops the others (they would wait for it in the next
/// collective forever) and the caller sees that rank's own message.
#[test]
fn a_failing_rank_stops_the_group_with_its_message() {
    let path = golden_files()
        .into_iter()
        .find(|p| variant(p) == "ds3.q8_0")
        .unwrap();
    let (file, cfg) = open(&path);
    let tokens = ref_tokens(&load_ref("ds3.q8_0", 0));
    for (fail_rank, fail_at) in [(1, 3), (0, 1), (3, 5)] {
        let plan = ShardPlan::new(&file, &cfg, 4).unwrap();
        let ranks = Local::group(4)
            .into_iter()
            .enumerate()
            .map(|(rank, inner)| {
                let c = FailingRank {
                    inner,
                    rank,
                    fail_rank,
                    fail_at,
                    calls: Default::default(),
                };
                (Cpu, Box::new(c) as Box<dyn Communicator<Cpu>>)
            })
            .collect();
        let m = ShardedModel::load(file.clone(), plan, ranks, &|_| {}).unwrap();
        let mut cache = m.new_cache(cfg.n_ctx);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            m.forward(&mut cache, &tokens, None)
        }));
        let payload = outcome.expect_err("the forward must fail");
        let text = payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(
            text.contains(&format!("injected failure in rank {fail_rank}")),
            "rank {fail_rank} at all-reduce {fail_at}: {text}"
        );
    }
}
