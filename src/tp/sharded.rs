//! A model over N ranks: each rank a `Model` built from its own shards, run in lockstep, one
//! thread per rank.

use super::local::BROKEN;
use super::plan::{ShardPlan, Split, TensorPlan};
use crate::backend::{Backend, Communicator};
use crate::gguf::GgufFile;
use crate::model::{Cache, ForwardError, Model, Taps};
use crate::trace::{StageData, Trace};
use crate::weights::{MappedBytes, TensorRef, TensorSource, WeightsError};
use std::sync::Arc;

/// The tensors of one rank: views of the mapped file (row splits, replicated tensors) or
/// copies of the rank's blocks of every row (column splits).
pub struct ShardSource {
    pub file: Arc<GgufFile>,
    pub plan: Arc<ShardPlan>,
    pub rank: usize,
}

impl ShardSource {
    /// Rank's part of `t` as laid out in the file's bytes.
    fn part(&self, t: &TensorPlan, bytes: MappedBytes) -> TensorRef {
        let (tp, rank) = (self.plan.tp, self.rank);
        let mut ne = t.ne.clone();
        let split = if tp == 1 { Split::Replicated } else { t.split };
        let bytes = match split {
            Split::Rows => {
                let last = ne.len() - 1;
                ne[last] /= tp;
                let len = t.n_bytes / tp;
                slice(bytes, rank * len..(rank + 1) * len)
            }
            Split::Columns => {
                let row_bytes = t.ggml_type.row_bytes(ne[0]).expect("checked by the plan");
                ne[0] /= tp;
                let part = row_bytes / tp;
                let all = bytes.as_slice();
                let mut out = Vec::with_capacity(t.n_bytes / tp);
                for row in all.chunks_exact(row_bytes) {
                    out.extend_from_slice(&row[rank * part..(rank + 1) * part]);
                }
                MappedBytes::owned(out)
            }
            Split::Replicated | Split::FirstRank | Split::Unused => bytes,
        };
        TensorRef {
            name: t.name.clone(),
            ggml_type: t.ggml_type,
            ne,
            bytes,
        }
    }
}

/// A sub-range of `bytes`, sharing its owner (no copy).
fn slice(bytes: MappedBytes, range: std::ops::Range<usize>) -> MappedBytes {
    MappedBytes::new(Arc::new(bytes), move |b| &b.as_slice()[range])
}

impl TensorSource for ShardSource {
    fn tensor(&self, name: &str) -> Option<TensorRef> {
        // A tied LM head: the rank's vocabulary rows of the embedding table.
        let (name, as_head) = match name {
            "output.weight" if self.plan.tied_head => ("token_embd.weight", true),
            _ => (name, false),
        };
        let t = self.plan.get(name)?;
        let held = match t.split {
            Split::FirstRank => self.rank == 0,
            Split::Unused => false,
            _ => true,
        };
        if !held {
            return None;
        }
        let info = self.file.tensor(name)?.clone();
        let bytes = MappedBytes::new(self.file.clone(), |f| f.tensor_data(&info));
        if as_head {
            let head = TensorPlan {
                name: "output.weight".into(),
                split: Split::Rows,
                ..t.clone()
            };
            return Some(self.part(&head, bytes));
        }
        Some(self.part(t, bytes))
    }
}

/// How a stage of one rank relates to the same stage at TP = 1 (for merging rank traces).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageKind {
    /// Per-head columns: the rank's heads; concatenated over ranks, per row.
    Heads,
    /// A partial sum: summed over ranks (in rank order).
    Partial,
    /// The same on every rank.
    Replicated,
}

/// The kind of stage `name` (`L3.attn_core`, `logits`).
pub fn stage_kind(name: &str) -> StageKind {
    let stage = name.rsplit('.').next().unwrap_or(name);
    match stage {
        "q" | "q_pe" | "attn_core" => StageKind::Heads,
        "ffn_out" | "moe_out" | "shared_out" => StageKind::Partial,
        _ => StageKind::Replicated,
    }
}

/// One trace as TP = 1 would record it, from the ranks' traces (rank order). Replicated stages
/// come from rank 0; `mismatches` lists those on which another rank differs at all.
pub fn merge_traces(ranks: &[Trace]) -> (Trace, Vec<String>) {
    let mut merged = Trace::new();
    let mut mismatches = Vec::new();
    for name in ranks[0].names() {
        let parts: Vec<_> = ranks.iter().filter_map(|t| t.get(name)).collect();
        let first = parts[0];
        let (rows, cols) = (first.shape[0], first.shape.get(1).copied().unwrap_or(0));
        match (stage_kind(name), &first.data) {
            (StageKind::Heads, StageData::F32(_)) => {
                let mut v = Vec::new();
                for r in 0..rows {
                    for p in &parts {
                        v.extend_from_slice(&p.f32().unwrap()[r * cols..(r + 1) * cols]);
                    }
                }
                merged.record(name, rows, cols * parts.len(), StageData::F32(v));
            }
            (StageKind::Partial, StageData::F32(v0)) => {
                let mut sum = v0.clone();
                for p in &parts[1..] {
                    sum.iter_mut()
                        .zip(p.f32().unwrap())
                        .for_each(|(s, x)| *s += x);
                }
                merged.record(name, rows, cols, StageData::F32(sum));
            }
            _ => {
                if parts.len() != ranks.len() || parts.iter().any(|p| p.data != first.data) {
                    mismatches.push(name.clone());
                }
                merged.record(name, rows, cols, first.data.clone());
            }
        }
    }
    // Stages only a later rank recorded (rank 0 holds all unsplit parts, so none expected).
    for t in &ranks[1..] {
        for name in t.names() {
            if merged.get(name).is_none() {
                mismatches.push(format!("{name} (not on rank 0)"));
            }
        }
    }
    (merged, mismatches)
}

/// Why a sharded model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error(transparent)]
    Plan(#[from] super::plan::PlanError),
    #[error("rank {rank}: {source}")]
    Weights { rank: usize, source: WeightsError },
    #[error("{ranks} ranks need {ranks} backends and communicators, got {got}")]
    Ranks { ranks: usize, got: usize },
}

/// One model over `plan.tp` ranks.
pub struct ShardedModel<B: Backend> {
    pub plan: Arc<ShardPlan>,
    /// Rank r's model (its heads, experts, FFN and vocabulary parts).
    pub ranks: Vec<Model<B>>,
    /// Weight bytes each rank's backend was given while loading (measured, not planned).
    pub loaded_bytes: Vec<usize>,
}

/// The per-sequence state of every rank (each holds the same latent cache).
pub struct ShardedCache<B: Backend> {
    pub ranks: Vec<Cache<B>>,
}

impl<B: Backend> ShardedModel<B> {
    /// Loads rank r's shards into `ranks[r]`'s backend, joined by its communicator; ranks load
    /// in parallel, calling `progress` after each tensor is resident.
    pub fn load(
        file: Arc<GgufFile>,
        plan: ShardPlan,
        ranks: Vec<(B, Box<dyn Communicator<B>>)>,
        progress: &(dyn Fn(&TensorRef) + Sync),
    ) -> Result<ShardedModel<B>, TpError> {
        if ranks.len() != plan.tp {
            return Err(TpError::Ranks {
                ranks: plan.tp,
                got: ranks.len(),
            });
        }
        let plan = Arc::new(plan);
        let loaded: Vec<Result<(Model<B>, usize), TpError>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .enumerate()
                .map(|(rank, (backend, comm))| {
                    let source = ShardSource {
                        file: file.clone(),
                        plan: plan.clone(),
                        rank,
                    };
                    let plan = &plan;
                    s.spawn(move || {
                        let mut bytes = 0;
                        let model = Model::load_rank(
                            plan.rank_cfg.clone(),
                            &plan.shares[rank],
                            backend,
                            &source,
                            comm,
                            &mut |t| {
                                bytes += t.bytes.as_slice().len();
                                progress(t);
                            },
                        )
                        .map_err(|source| TpError::Weights { rank, source })?;
                        Ok((model, bytes))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a rank panicked while loading"))
                .collect()
        });
        let mut models = Vec::new();
        let mut loaded_bytes = Vec::new();
        for r in loaded {
            let (m, b) = r?;
            models.push(m);
            loaded_bytes.push(b);
        }
        Ok(ShardedModel {
            plan,
            ranks: models,
            loaded_bytes,
        })
    }

    pub fn tp(&self) -> usize {
        self.ranks.len()
    }

    /// Rank 0's backend (where the gathered logits are).
    pub fn backend(&self) -> &B {
        &self.ranks[0].backend
    }

    /// Rank 0's configuration: the model's, with the rank's head count.
    pub fn cfg(&self) -> &crate::config::ModelConfig {
        &self.ranks[0].cfg
    }

    pub fn new_cache(&self, capacity: usize) -> ShardedCache<B> {
        ShardedCache {
            ranks: self.ranks.iter().map(|m| m.new_cache(capacity)).collect(),
        }
    }

    /// Runs `tokens` on every rank at once; returns rank 0's logits [n, V] (every rank has the
    /// gathered logits). With `trace`, records every stage as TP = 1 would (`merge_traces`)
    /// and returns the names of replicated stages on which ranks disagreed.
    pub fn forward(
        &self,
        cache: &mut ShardedCache<B>,
        tokens: &[u32],
        trace: Option<&mut Trace>,
    ) -> Result<(B::Tensor, Vec<String>), ForwardError> {
        self.run(cache, tokens, trace, false)
    }

    /// Only the last token's logits [1, V] (`Model::forward_last`), no trace.
    pub fn forward_last(
        &self,
        cache: &mut ShardedCache<B>,
        tokens: &[u32],
    ) -> Result<B::Tensor, ForwardError> {
        Ok(self.run(cache, tokens, None, true)?.0)
    }

    fn run(
        &self,
        cache: &mut ShardedCache<B>,
        tokens: &[u32],
        trace: Option<&mut Trace>,
        last_only: bool,
    ) -> Result<(B::Tensor, Vec<String>), ForwardError> {
        let tracing = trace.is_some();
        let step = |model: &Model<B>, cache: &mut Cache<B>, taps: &mut Taps| {
            if last_only {
                model.forward_last(cache, tokens)
            } else {
                model.forward(cache, tokens, taps)
            }
        };
        if let ([model], [cache]) = (&self.ranks[..], &mut cache.ranks[..]) {
            // One rank: run here, without a thread.
            let mut taps = Taps::new(trace);
            return Ok((step(model, cache, &mut taps)?, Vec::new()));
        }
        let results = self.on_ranks(cache, tracing, |_, model, cache, taps| {
            step(model, cache, taps)
        })?;
        let mut logits = None;
        let mut traces = Vec::new();
        for (l, t) in results {
            logits.get_or_insert(l);
            traces.push(t);
        }
        let mut mismatches = Vec::new();
        if let Some(out) = trace {
            let (merged, m) = merge_traces(&traces);
            *out = merged;
            mismatches = m;
        }
        Ok((logits.expect("at least one rank"), mismatches))
    }

    /// One step of greedy decoding: the forward of `token` on every rank, then each rank's
    /// `argmax_pick` of its logits (gathered: the same on every rank), not yet read. Queue the
    /// next step on these picks before reading them (`pick_id`), and the devices never wait
    /// for the host between two tokens.
    pub fn greedy_step(
        &self,
        cache: &mut ShardedCache<B>,
        token: GreedyToken<B>,
    ) -> Result<Vec<B::Pick>, ForwardError> {
        let picks = self.on_ranks(cache, false, |rank, model, cache, _| {
            let logits = match token {
                GreedyToken::Id(id) => model.forward(cache, &[id], &mut Taps::none())?,
                GreedyToken::Picks(picks) => model.forward_pick(cache, &picks[rank])?,
            };
            Ok(model.backend.argmax_pick(&logits))
        })?;
        Ok(picks.into_iter().map(|(pick, _)| pick).collect())
    }

    /// The token id of `picks` (`greedy_step`), once the ranks have made it.
    pub fn pick_id(&self, picks: &[B::Pick]) -> u32 {
        self.ranks[0].backend.pick_id(&picks[0])
    }

    /// `step(rank, model, cache, taps)` on every rank at once, each on a thread of its own
    /// (one rank: here), with a trace of its own when `tracing`.
    fn on_ranks<T: Send>(
        &self,
        cache: &mut ShardedCache<B>,
        tracing: bool,
        step: impl Fn(usize, &Model<B>, &mut Cache<B>, &mut Taps) -> Result<T, ForwardError> + Sync,
    ) -> Result<Vec<(T, Trace)>, ForwardError> {
        if let ([model], [cache]) = (&self.ranks[..], &mut cache.ranks[..]) {
            let mut t = Trace::new();
            let out = step(0, model, cache, &mut Taps::new(tracing.then_some(&mut t)))?;
            return Ok(vec![(out, t)]);
        }
        let step = &step;
        let results: Vec<Result<(T, Trace), ForwardError>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter()
                .zip(cache.ranks.iter_mut())
                .enumerate()
                .map(|(rank, (model, cache))| {
                    s.spawn(move || {
                        // A rank that panics breaks the group, so that the others stop in
                        // their next collective instead of waiting for it forever. (Forward
                        // errors are found by every rank alike, before any collective.)
                        let _guard = AbortOnPanic(&*model.comm);
                        let mut t = Trace::new();
                        let mut taps = Taps::new(tracing.then_some(&mut t));
                        let out = step(rank, model, cache, &mut taps)?;
                        Ok((out, t))
                    })
                })
                .collect();
            let joined: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
            // Report the failing rank's own panic, not the others' "another rank failed".
            let panics = joined.iter().filter_map(|j| j.as_ref().err());
            if let Some(first) = panics
                .clone()
                .find(|p| panic_text(p) != BROKEN)
                .or(panics.clone().next())
            {
                panic!("a tensor-parallel rank failed: {}", panic_text(first));
            }
            joined.into_iter().map(|j| j.unwrap()).collect()
        });
        results.into_iter().collect()
    }
}

/// The token of a greedy step: an id the host has, or the picks of the step before.
pub enum GreedyToken<'a, B: Backend> {
    Id(u32),
    Picks(&'a [B::Pick]),
}

/// Breaks the rank's group when dropped while its thread panics.
struct AbortOnPanic<'a, B: Backend>(&'a dyn Communicator<B>);

impl<B: Backend> Drop for AbortOnPanic<'_, B> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abort();
        }
    }
}

/// The message of a panic payload (`panic!` gives a &str or a String).
fn panic_text(payload: &Box<dyn std::any::Any + Send>) -> &str {
    match (
        payload.downcast_ref::<&str>(),
        payload.downcast_ref::<String>(),
    ) {
        (Some(s), _) => s,
        (_, Some(s)) => s,
        _ => "(no message)",
    }
}
