//! DeepSeek Sparse Attention's lightning indexer (GLM-5): per query, pick the `top_k` cache
//! positions MLA may attend to.
//!
//! q_i = indexer.attn_q_b(q-LoRA latent) per indexer head; k_i = LayerNorm(indexer.attn_k x),
//! one key per position, cached; both roped on their first dr dimensions (adjacent pairs);
//! score(s) = sum_h w_h * relu(q_i,h . k_i(s) / sqrt(d)) with w = indexer.proj x.
//! The reference also multiplies w by n_head^-0.5: a positive constant, so the ranking (all
//! that is used) does not change and it is left out.

use super::Model;
use crate::backend::{Backend, IndexKeyProjection};
use crate::config::IndexerConfig;
use crate::weights::Indexer;

/// The layer-norm epsilon of indexer.k_norm (fixed in the reference models).
const K_NORM_EPS: f32 = 1e-6;

/// Which cache positions the queries of a batch may attend to (`I`: the backend's `Ids`).
pub enum Selection<I> {
    /// Every causal key: no query sees more than `top_k` of them, so the indexer keeps all.
    AllCausal,
    /// [n * top_k] positions per query, ascending, -1 padded.
    TopK(I),
}

impl<I> Selection<I> {
    /// The explicit list, None when every causal key is kept (attention then runs dense).
    pub fn positions(&self) -> Option<&I> {
        match self {
            Selection::AllCausal => None,
            Selection::TopK(ids) => Some(ids),
        }
    }

    /// [n * top_k] positions as the reference records them (for traces).
    pub fn ids<B: Backend<Ids = I>>(
        &self,
        b: &B,
        ix: &IndexerConfig,
        pos0: usize,
        n: usize,
    ) -> Vec<i32> {
        match self {
            Selection::AllCausal => (0..n)
                .flat_map(|i| {
                    (0..ix.top_k as i32).map(move |p| if p <= (pos0 + i) as i32 { p } else { -1 })
                })
                .collect(),
            Selection::TopK(ids) => b.ids_to_host(ids),
        }
    }
}

/// The indexer key's projection of a batch, its outputs on their way into `keys`
/// (`Backend::latent_projections` stores them with the latent).
pub fn key_projection<'a, B: Backend>(
    w: &'a Indexer<B::Weight>,
    keys: &'a mut B::Tensor,
) -> IndexKeyProjection<'a, B> {
    IndexKeyProjection {
        w: &w.k,
        keys,
        norm: (&w.k_norm, &w.k_norm_bias),
        eps: K_NORM_EPS,
    }
}

/// The selection of the queries at positions `pos0..pos0 + n` (x: attn_norm's output [n, E],
/// q_a: q-LoRA's normed latent) over `keys`, which hold this batch's keys already. While no
/// query sees more than `top_k` keys the selection is every causal key whatever the scores,
/// so they are not computed (the keys still are stored: later queries rank them).
pub fn select<B: Backend>(
    m: &Model<B>,
    w: &Indexer<B::Weight>,
    ix: &IndexerConfig,
    x: &B::Tensor,
    q_a: &B::Tensor,
    keys: &B::Tensor,
    pos0: usize,
) -> Selection<B::Ids> {
    let b = &m.backend;
    if pos0 + b.shape(x).0 <= ix.top_k {
        return Selection::AllCausal;
    }
    let (q, head_weights) = queries(m, w, ix, x, q_a, pos0);
    Selection::TopK(b.dsa_topk(&q, keys, &head_weights, pos0, score_scale(ix), ix.top_k))
}

/// The indexer's queries [n, nh*d], roped, and head weights [n, nh] of positions
/// `pos0..pos0 + n` (x: attn_norm's output, q_a: q-LoRA's normed latent).
pub fn queries<B: Backend>(
    m: &Model<B>,
    w: &Indexer<B::Weight>,
    ix: &IndexerConfig,
    x: &B::Tensor,
    q_a: &B::Tensor,
    pos0: usize,
) -> (B::Tensor, B::Tensor) {
    let b = &m.backend;
    let mut q = b.linear(q_a, &w.q_b); // [n, nh*d]
    b.rope(&mut q, ix.n_head, 0, pos0, &m.rope);
    let head_weights = b.linear(x, &w.proj); // [n, nh]
    (q, head_weights)
}

/// The factor of q . k in a score: 1 / sqrt(d).
pub fn score_scale(ix: &IndexerConfig) -> f32 {
    1.0 / (ix.head_dim as f32).sqrt()
}
