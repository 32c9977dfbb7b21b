//! DeepSeek Sparse Attention's lightning indexer (GLM-5): per query, pick the `top_k` cache
//! positions MLA may attend to.
//!
//! q_i = indexer.attn_q_b(q-LoRA latent) per indexer head; k_i = LayerNorm(indexer.attn_k x),
//! one key per position, cached; both roped on their first dr dimensions (adjacent pairs);
//! score(s) = sum_h w_h * relu(q_i,h . k_i(s) / sqrt(d)) with w = indexer.proj x.
//! The reference also multiplies w by n_head^-0.5: a positive constant, so the ranking (all
//! that is used) does not change and it is left out.

use super::Model;
use crate::backend::Backend;
use crate::config::IndexerConfig;
use crate::weights::Indexer;

/// The layer-norm epsilon of indexer.k_norm (fixed in the reference models).
const K_NORM_EPS: f32 = 1e-6;

/// Appends this batch's indexer keys to `keys` and returns the selection [n * top_k]
/// (ascending positions, -1 padded). While no query sees more than `top_k` keys the selection
/// is every causal key whatever the scores, so they are not computed (the keys still are: later
/// queries rank them).
pub fn select<B: Backend>(
    m: &Model<B>,
    w: &Indexer<B::Weight>,
    ix: &IndexerConfig,
    x: &B::Tensor,
    q_a: &B::Tensor,
    keys: &mut B::Tensor,
    pos0: usize,
) -> Vec<i32> {
    let b = &m.backend;
    let mut k = b.layer_norm(&b.linear(x, &w.k), &w.k_norm, &w.k_norm_bias, K_NORM_EPS); // [n, d]
    b.rope(&mut k, 1, 0, pos0, &m.rope);
    b.write_block(keys, pos0, 0, &k);
    let n = b.shape(x).0;
    if selects_all(ix, pos0, n) {
        return (0..n)
            .flat_map(|i| {
                (0..ix.top_k as i32).map(move |p| if p <= (pos0 + i) as i32 { p } else { -1 })
            })
            .collect();
    }
    let mut q = b.linear(q_a, &w.q_b); // [n, nh*d]
    b.rope(&mut q, ix.n_head, 0, pos0, &m.rope);
    let head_weights = b.linear(x, &w.proj); // [n, nh]
    let scale = 1.0 / (ix.head_dim as f32).sqrt();
    b.dsa_topk(&q, keys, &head_weights, pos0, scale, ix.top_k)
}

/// Whether every query of a batch of `n` at `pos0` sees at most `top_k` keys, so that the
/// indexer keeps all of them.
pub fn selects_all(ix: &IndexerConfig, pos0: usize, n: usize) -> bool {
    pos0 + n <= ix.top_k
}
