//! Multi-head latent attention.
//!
//! Every position stores only its latent `[c_kv | k_pe]` (kv_lora + dr values per layer).
//! Two ways to attend over it, equal in exact arithmetic:
//! - expanded (prefill): k_nope = W_UK c_kv and v = W_UV c_kv per head, ordinary causal MHA;
//! - absorbed (decode): fold W_UK into the query (q_lat = W_UK^T q_nope), score against the
//!   latent cache directly, and apply W_UV after the softmax-weighted sum of c_kv.
//!
//! Prefill is matrix-matrix work where expanding is cheap; decode reads the whole cache for one
//! query, where the absorbed form reads 576 values per position instead of H*(dn+dr+dv).

use super::{dsa, Cache, Model, Taps};
use crate::backend::{Backend, LatentProjections};
use crate::weights::QueryProj;

/// RMSNorm epsilon of q_a_norm and kv_a_norm: the reference models build these two norms
/// with their default 1e-6, whatever the model's rms_norm_eps (which the GGUF stores alone).
pub const LATENT_NORM_EPS: f32 = 1e-6;

/// Attention of layer `il` for `x` (attn_norm output, [n, E]) at positions `pos0..pos0+n`;
/// appends the latents to the cache and returns attn_output [n, E].
pub fn attention<B: Backend>(
    m: &Model<B>,
    il: usize,
    x: &B::Tensor,
    cache: &mut Cache<B>,
    pos0: usize,
    topk: &mut Option<dsa::Selection<B::Ids>>,
    taps: &mut Taps,
) -> B::Tensor {
    let (b, cfg) = (&m.backend, &m.cfg);
    let w = &m.weights.layers[il].attn;
    let (h, dn) = (cfg.n_head, cfg.head_dim_nope);
    let (n, _) = b.shape(x);
    let indexer = m.weights.layers[il].indexer.as_ref();

    // The projections of x, for a token on a GPU one launch (two with q-LoRA's q_b): the
    // query's (through q-LoRA's a, its latent q_a [n, q_lora] normed, and b, or all of q), and
    // the latent [n, kv_lora + dr] straight into the cache, c_kv normed and k_pe roped; in DSA
    // layers with an indexer, its keys [n, d] into their cache.
    let (q_x, q_lora) = match &w.q {
        QueryProj::Lora { a, norm, b } => (a, Some((norm, b))),
        QueryProj::Direct(wq) => (wq, None),
    };
    let projections = LatentProjections {
        q: q_x,
        q_lora,
        kv_a: &w.kv_a_mqa,
        kv_norm: &w.kv_a_norm,
        eps: LATENT_NORM_EPS,
        index: indexer.map(|ix| {
            let keys = cache.index_keys[il]
                .as_mut()
                .expect("allocated for full indexer layers");
            dsa::key_projection(ix, keys)
        }),
    };
    // Queries [n, H*(dn+dr)], each head [q_nope | q_pe]; q_a feeds DSA too.
    let (mut q, q_a) = b.latent_projections(x, projections, &mut cache.latent[il], pos0, &m.rope);
    taps.tensor(b, || format!("L{il}.q"), &q);
    // q_pe's rope: here for the expanded form and the trace; the absorbed form ropes it in
    // latent_attention (on a GPU as the kernel loads the query: one launch fewer).
    let roped = n > 1 || taps.on();
    if roped {
        let q_pe = b.rope_columns(&mut q, h, dn, pos0, &m.rope); // [n, H*dr], q's own roped too
        taps.tensor(b, || format!("L{il}.q_pe"), &q_pe);
    }
    if taps.on() {
        let (c_kv, k_pe) = b.latent_rows(&cache.latent[il], pos0..pos0 + n);
        taps.tensor(b, || format!("L{il}.c_kv"), &c_kv);
        taps.tensor(b, || format!("L{il}.k_pe"), &k_pe);
    }

    // DSA: which keys each query may see (None: all causal keys, the dense path).
    let mut keep = None;
    if let Some(ix) = &cfg.indexer {
        if let (Some(indexer), Some(keys)) = (indexer, &cache.index_keys[il]) {
            let q_a = q_a.as_ref().expect("validated: DSA needs q-LoRA");
            *topk = Some(dsa::select(m, indexer, ix, x, q_a, keys, pos0));
        }
        let selection = topk
            .as_ref()
            .expect("validated: layer 0 runs its own indexer");
        if taps.on() {
            taps.ids(
                || format!("L{il}.dsa_topk"),
                n,
                &selection.ids(b, ix, pos0, n),
            );
        }
        keep = selection.positions();
    }

    let s = pos0 + n; // keys visible to the last query
    let latent = &cache.latent[il];
    let scale = cfg.attention_scale();
    let core = if n > 1 {
        // Expanded: per-head keys and values from the cached latents.
        let (c_kv_all, k_pe_all) = b.latent_rows(latent, 0..s); // [S, kv_lora], [S, dr]
        let k_nope = b.head_matmul(&c_kv_all, &w.k_b, true); // [S, H*dn]
        let v = b.head_matmul(&c_kv_all, &w.v_b, false); // [S, H*dv]
        b.attention(&q, &k_nope, &k_pe_all, &v, pos0, scale, keep)
    } else {
        // Absorbed: queries move into the latent space instead.
        let q_lat = b.head_matmul_cols(&q, h, 0..dn, &w.k_b, false); // k_b q_nope [n, H*kv_lora]
        let rope = (!roped).then_some(&m.rope);
        let out_lat = b.latent_attention(&q_lat, &q, h, rope, latent, pos0, scale, keep); // [n, H*kv_lora]
        b.head_matmul(&out_lat, &w.v_b, false) // [n, H*dv]
    };
    taps.tensor(b, || format!("L{il}.attn_core"), &core);
    b.residual_linear(&core, &w.output)
}
