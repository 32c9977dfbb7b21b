//! The sharding plan: for every tensor of the file, what each rank holds.
//!
//! Splits follow the math, not the file layout:
//! - attention by heads: attn_q_b / attn_q rows, attn_k_b / attn_v_b (or a legacy attn_kv_b)
//!   whole heads, attn_output columns (its input side), so each rank's attn_output gives a
//!   partial sum of the full output;
//! - MoE by experts: each rank holds n_expert / TP whole experts; the router is replicated, so
//!   every rank routes identically and computes only the choices it holds;
//! - dense FFN and shared expert: gate/up by rows, down by columns when every rank's columns
//!   are whole quant blocks; otherwise held whole by rank 0 alone (a warning), so the
//!   all-reduce counts it exactly once;
//! - the LM head by vocabulary rows (a tied head: rows of token_embd), logits gathered;
//! - everything else (embedding, norms, q_a, kv_a_mqa, router, exp_probs_b, the DSA indexer)
//!   replicated; the latent cache is then identical on every rank.
//!
//! Row splits are contiguous byte ranges of the tensor (zero-copy views of the mmap); column
//! splits take whole blocks of every row (copied). What cannot be split is refused.

use crate::config::{KvLayout, ModelConfig};
use crate::gguf::{GgmlType, GgufFile, TensorInfo};
use crate::weights::Share;

/// How one tensor is spread over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it.
    Replicated,
    /// The last dimension (heads, experts, output rows, vocabulary) in TP equal contiguous
    /// parts: rank r holds part r, a byte range of the tensor.
    Rows,
    /// Every row's elements (`ne[0]`) in TP equal parts of whole blocks: rank r holds part r of
    /// each row.
    Columns,
    /// Held whole by rank 0 only: a dense or shared FFN that could not be split.
    FirstRank,
    /// Not read by the engine (the MTP block): no rank holds it.
    Unused,
}

/// One tensor's entry.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorPlan {
    pub name: String,
    pub ggml_type: GgmlType,
    /// ggml order, trailing 1s dropped.
    pub ne: Vec<usize>,
    pub n_bytes: usize,
    pub split: Split,
}

impl TensorPlan {
    /// Bytes rank `rank` of `tp` holds.
    pub fn rank_bytes(&self, rank: usize, tp: usize) -> usize {
        match self.split {
            Split::Replicated => self.n_bytes,
            Split::Rows | Split::Columns => self.n_bytes / tp,
            Split::FirstRank if rank == 0 => self.n_bytes,
            Split::FirstRank | Split::Unused => 0,
        }
    }
}

/// Why a model cannot be split over `tp` ranks.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("--tp {tp}: {what} {count} cannot be divided among {tp} ranks (TP must divide it)")]
    Indivisible {
        tp: usize,
        what: &'static str,
        count: usize,
    },
    #[error(
        "--tp {tp}: tensor {tensor} ({ggml_type}): each rank would hold {cols} of its {row} columns, \
         not a whole number of {block}-element blocks"
    )]
    Blocks {
        tp: usize,
        tensor: String,
        ggml_type: GgmlType,
        row: usize,
        cols: usize,
        block: usize,
    },
    #[error("--tp 0: at least one rank is needed")]
    NoRanks,
}

/// The plan for one file at one TP.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    pub tp: usize,
    /// Every tensor of the file, in file order.
    pub tensors: Vec<TensorPlan>,
    /// TP > 1 and the LM head is token_embd (tied): its vocabulary rows are each rank's head,
    /// besides the replicated table used for the embedding.
    pub tied_head: bool,
    /// Each rank's configuration: the model's, with the rank's head count.
    pub rank_cfg: ModelConfig,
    /// What each rank holds besides heads (indexed by rank).
    pub shares: Vec<Share>,
    /// Parts kept whole on rank 0 because they could not be split.
    pub warnings: Vec<String>,
}

/// Bytes one rank holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankBytes {
    /// Its parts of split tensors (and rank 0's unsplit FFNs).
    pub sharded: usize,
    /// Tensors every rank holds whole.
    pub replicated: usize,
}

impl RankBytes {
    pub fn total(&self) -> usize {
        self.sharded + self.replicated
    }
}

impl ShardPlan {
    /// Plans `file` (whose configuration is `cfg`) over `tp` ranks.
    pub fn new(file: &GgufFile, cfg: &ModelConfig, tp: usize) -> Result<ShardPlan, PlanError> {
        if tp == 0 {
            return Err(PlanError::NoRanks);
        }
        let divides = |what, count: usize| {
            if count.is_multiple_of(tp) {
                Ok(())
            } else {
                Err(PlanError::Indivisible { tp, what, count })
            }
        };
        divides("the attention head count", cfg.n_head)?;
        divides("the vocabulary size", cfg.n_vocab)?;
        if let Some(m) = &cfg.moe {
            divides("the routed expert count", m.n_expert)?;
        }
        let heads = cfg.n_head / tp;
        let mut warnings = Vec::new();

        // Dense FFN and shared expert: split only if every down projection splits on blocks.
        let layer_tensors = |suffix: &str| -> Vec<&TensorInfo> {
            (0..cfg.n_layer)
                .filter_map(|il| file.tensor(&format!("blk.{il}.{suffix}")))
                .collect()
        };
        let mut splits_on_blocks = |what: &str, width: usize, downs: Vec<&TensorInfo>| {
            let bad = downs.iter().find(|t| {
                !width.is_multiple_of(tp) || !(width / tp).is_multiple_of(t.ggml_type.block_size())
            });
            match bad {
                None => true,
                Some(t) => {
                    warnings.push(format!(
                        "{what} (width {width}) kept whole on rank 0: {} is {} and {width} / {tp} \
                         is not a whole number of its {}-element blocks",
                        t.name,
                        t.ggml_type,
                        t.ggml_type.block_size()
                    ));
                    false
                }
            }
        };
        let dense_split =
            splits_on_blocks("the dense FFN", cfg.n_ff, layer_tensors("ffn_down.weight"));
        let shared_width = cfg.moe.as_ref().map_or(0, |m| m.n_ff_expert * m.n_shared);
        let shared_split = shared_width == 0
            || splits_on_blocks(
                "the shared expert",
                shared_width,
                layer_tensors("ffn_down_shexp.weight"),
            );

        let mut tensors = Vec::with_capacity(file.tensors().len());
        for t in file.tensors() {
            let split = split_of(&t.name, cfg, dense_split, shared_split);
            let mut ne: Vec<usize> = t.ne.iter().map(|&n| n as usize).collect();
            while ne.len() > 1 && ne.last() == Some(&1) {
                ne.pop();
            }
            if split == Split::Columns {
                let block = t.ggml_type.block_size();
                let cols = ne[0] / tp;
                if !ne[0].is_multiple_of(tp) || !cols.is_multiple_of(block) {
                    return Err(PlanError::Blocks {
                        tp,
                        tensor: t.name.clone(),
                        ggml_type: t.ggml_type,
                        row: ne[0],
                        cols,
                        block,
                    });
                }
            }
            tensors.push(TensorPlan {
                name: t.name.clone(),
                ggml_type: t.ggml_type,
                ne,
                n_bytes: t.n_bytes as usize,
                split,
            });
        }

        let mut rank_cfg = cfg.clone();
        rank_cfg.n_head = heads;
        // An FFN of `width`: split, or whole on rank 0 and absent elsewhere.
        let ffn_part = |split: bool, width: usize, rank: usize| match (split, rank) {
            (true, _) => Some(width / tp),
            (false, 0) => Some(width),
            (false, _) => None,
        };
        let shares = (0..tp)
            .map(|rank| Share {
                n_ff: ffn_part(dense_split, cfg.n_ff, rank),
                n_ff_shared: ffn_part(shared_split, shared_width, rank).filter(|&w| w > 0),
                experts: cfg.moe.as_ref().map_or(0..0, |m| {
                    let per = m.n_expert / tp;
                    rank * per..(rank + 1) * per
                }),
                n_vocab_head: cfg.n_vocab / tp,
            })
            .collect();
        Ok(ShardPlan {
            tp,
            tied_head: tp > 1 && file.tensor("output.weight").is_none(),
            tensors,
            rank_cfg,
            shares,
            warnings,
        })
    }

    pub fn get(&self, name: &str) -> Option<&TensorPlan> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Weight bytes rank `rank` holds according to the plan (a tied head's rows counted as a
    /// second copy, which is what a GPU backend uploads).
    pub fn rank_bytes(&self, rank: usize) -> RankBytes {
        let mut b = RankBytes::default();
        for t in &self.tensors {
            let n = t.rank_bytes(rank, self.tp);
            match t.split {
                Split::Replicated => b.replicated += n,
                _ => b.sharded += n,
            }
        }
        if self.tied_head {
            if let Some(embd) = self.get("token_embd.weight") {
                b.sharded += embd.n_bytes / self.tp;
            }
        }
        b
    }
}

/// The split of tensor `name` (see the module comment).
fn split_of(name: &str, cfg: &ModelConfig, dense_split: bool, shared_split: bool) -> Split {
    let by_rows = |split: bool| if split { Split::Rows } else { Split::FirstRank };
    let by_cols = |split: bool| {
        if split {
            Split::Columns
        } else {
            Split::FirstRank
        }
    };
    match name {
        "token_embd.weight" | "output_norm.weight" => return Split::Replicated,
        "output.weight" => return Split::Rows,
        _ => {}
    }
    let Some((il, suffix)) = crate::weights::layer_of(name) else {
        return Split::Unused;
    };
    if il >= cfg.n_layer {
        return Split::Unused;
    }
    match suffix {
        "attn_q_b.weight" | "attn_q.weight" | "attn_k_b.weight" | "attn_v_b.weight" => Split::Rows,
        "attn_kv_b.weight" if cfg.kv_layout == KvLayout::Legacy => Split::Rows,
        "attn_output.weight" => Split::Columns,
        "ffn_gate_exps.weight" | "ffn_up_exps.weight" | "ffn_down_exps.weight" => Split::Rows,
        "ffn_gate.weight" | "ffn_up.weight" => by_rows(dense_split),
        "ffn_down.weight" => by_cols(dense_split),
        "ffn_gate_shexp.weight" | "ffn_up_shexp.weight" => by_rows(shared_split),
        "ffn_down_shexp.weight" => by_cols(shared_split),
        "attn_norm.weight"
        | "attn_q_a.weight"
        | "attn_q_a_norm.weight"
        | "attn_kv_a_mqa.weight"
        | "attn_kv_a_norm.weight"
        | "ffn_norm.weight"
        | "ffn_gate_inp.weight"
        | "exp_probs_b.bias" => Split::Replicated,
        s if s.starts_with("indexer.") => Split::Replicated,
        _ => Split::Unused,
    }
}
