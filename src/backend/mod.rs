//! The `Backend` trait: every operation the forward pass (`crate::model`) needs.
//!
//! The grain is coarse enough for a fast GPU (a linear over a batch of tokens with a quantized
//! weight, MLA attention for a batch of queries over the whole cache, the routed experts of a
//! batch in one call) and fine enough that the model can tap every stage of the contract in
//! `crate::trace` between two calls.
//!
//! Conventions used by every method:
//! - An activation (`Backend::Tensor`) is a row-major f32 matrix `[rows, cols]`, one row per
//!   token (or per cache position). "Per head" layouts are `[rows, H*d]` with head `h` in
//!   columns `h*d..(h+1)*d`.
//! - A weight (`Backend::Weight`) keeps the file's own format (quantized blocks stay quantized)
//!   and its ggml shape `ne` (`ne[0]` is the row length, the contiguous dimension). A linear
//!   weight `{in, out}` has `out` rows of `in` elements: `y = W x` dots each row with `x`.
//! - The DSA selection (`dsa_topk`) stays in the backend's memory (`Backend::Ids`) from the
//!   indexer to attention: on a GPU, decode pays no host round trip per layer for it.
//! - Shapes are the caller's contract; a backend may panic on a mismatch (a bug in the model,
//!   never reachable from user input, which `crate::config` validates at load).

pub mod cpu;
pub mod cuda;

use crate::weights::TensorRef;
use std::ops::Range;

/// How a weight will be used, so a backend can pick its resident form at load time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightRole {
    /// A matrix `{in, out}` or a stack of expert matrices `{in, out, n_expert}` used by
    /// `linear`, `embed` and `moe_experts`: stays in the file's format.
    Matrix,
    /// Small per-head matrices `{a, b, H}` (attn_k_b, attn_v_b) used by `head_matmul` in both
    /// orientations: a backend may dequantize them once at load.
    Heads,
    /// A vector `{n}` (norm weights, biases): small, may be dequantized to f32 at load.
    Vector,
}

/// Rotary embedding parameters, computed once by `crate::model::rope` (YaRN included).
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// Per rotated pair `i`, the angle per position: `theta_i` [rot_dims / 2].
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor on the rotation; 1 without YaRN).
    pub cos_sin_scale: f32,
}

impl Rope {
    /// Number of rotated dimensions (adjacent pairs `(2i, 2i+1)`).
    pub fn rot_dims(&self) -> usize {
        2 * self.inv_freq.len()
    }
}

/// A weight or an activation the backend cannot take.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("tensor {tensor}: type {ggml_type} is not supported by the {backend} backend")]
    UnsupportedType {
        tensor: String,
        ggml_type: crate::gguf::GgmlType,
        backend: &'static str,
    },
    #[error("tensor {tensor}: {reason}")]
    BadWeight { tensor: String, reason: String },
    #[error("{backend} backend: {reason}")]
    Device {
        backend: &'static str,
        reason: String,
    },
}

/// The DSA indexer's keys of n positions on their way into their cache: `x_k` [n, d]
/// (indexer.attn_k x) becomes rows of `keys` [ctx, d] as `layer_norm(x_k, norm, eps)`, its
/// first `rope.rot_dims()` columns roped.
pub struct IndexKeys<'a, B: Backend + ?Sized> {
    pub keys: &'a mut B::Tensor,
    pub x_k: &'a B::Tensor,
    /// The layer norm's weight and bias.
    pub norm: (&'a B::Weight, &'a B::Weight),
    pub eps: f32,
}

/// The tokens a forward embeds: ids from the host, or one greedy pick left where it was made.
pub enum Tokens<'a, B: Backend + ?Sized> {
    Ids(&'a [u32]),
    Pick(&'a B::Pick),
}

/// A layer's first projections of x and the norms that put their latent parts into the caches
/// (`Backend::latent_projections`).
pub struct LatentProjections<'a, B: Backend + ?Sized> {
    /// The query's projection: q-LoRA's a, or all of q.
    pub q: &'a B::Weight,
    /// q-LoRA's latent norm and its second projection (q_b); None without q-LoRA.
    pub q_lora: Option<(&'a B::Weight, &'a B::Weight)>,
    pub kv_a: &'a B::Weight,
    pub kv_norm: &'a B::Weight,
    /// The epsilon of both RMS norms.
    pub eps: f32,
    /// In DSA layers with an indexer: its key's projection and the keys' cache.
    pub index: Option<IndexKeyProjection<'a, B>>,
}

/// The DSA indexer's key projection `w` (indexer.attn_k) of n positions, whose outputs go into
/// `keys` as `IndexKeys` says.
pub struct IndexKeyProjection<'a, B: Backend + ?Sized> {
    pub w: &'a B::Weight,
    pub keys: &'a mut B::Tensor,
    /// The layer norm's weight and bias.
    pub norm: (&'a B::Weight, &'a B::Weight),
    pub eps: f32,
}

impl<'a, B: Backend + ?Sized> LatentProjections<'a, B> {
    /// The projections' weights in their outputs' order: the query's, kv_a's, the index key's.
    pub fn weights(&self) -> Vec<&'a B::Weight> {
        let mut ws = vec![self.q, self.kv_a];
        ws.extend(self.index.as_ref().map(|ix| ix.w));
        ws
    }
}

impl<'a, B: Backend + ?Sized> IndexKeyProjection<'a, B> {
    /// The keys on their way into the cache, given the projection's output `x_k` [n, d].
    pub fn with_keys(self, x_k: &'a B::Tensor) -> IndexKeys<'a, B> {
        IndexKeys {
            keys: self.keys,
            x_k,
            norm: self.norm,
            eps: self.eps,
        }
    }
}

/// `Backend::latent_projections` as its parts: `linears` of x, `latent_append` of their
/// outputs, then with q-LoRA q_b's `linear` of the normed latent.
pub fn latent_projections_apart<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    p: LatentProjections<'_, B>,
    cache: &mut B::Latent,
    row0: usize,
    rope: &Rope,
) -> (B::Tensor, Option<B::Tensor>) {
    let mut of_x = b.linears(x, &p.weights()).into_iter();
    let (x_q, kv, x_k) = (of_x.next().unwrap(), of_x.next().unwrap(), of_x.next());
    let index_keys = p.index.zip(x_k.as_ref()).map(|(ix, x_k)| ix.with_keys(x_k));
    let query = p.q_lora.map(|(norm, _)| (&x_q, norm));
    let q_a = b.latent_append(cache, row0, &kv, p.kv_norm, p.eps, rope, query, index_keys);
    (lora_query(b, p.q_lora, x_q, q_a.as_ref()), q_a)
}

/// The query from the query's projection x_q: with q-LoRA (`LatentProjections::q_lora`), q_b's
/// `linear` of the normed latent q_a.
pub fn lora_query<B: Backend + ?Sized>(
    b: &B,
    q_lora: Option<(&B::Weight, &B::Weight)>,
    x_q: B::Tensor,
    q_a: Option<&B::Tensor>,
) -> B::Tensor {
    match (q_lora, q_a) {
        (Some((_, q_b)), Some(q_a)) => b.linear(q_a, q_b),
        _ => x_q,
    }
}

/// The operations of the forward pass. Implemented by `cpu::Cpu` (the f32 reference) and by
/// the CUDA backend.
pub trait Backend: Send + Sync {
    /// An activation matrix `[rows, cols]` of f32 in the backend's memory.
    type Tensor: Send + Sync;
    /// A weight of the model file in the backend's memory, in the file's format.
    type Weight: Send + Sync;
    /// Key positions per query, `[rows * k]` i32 (the DSA selection), in the backend's memory.
    type Ids: Send + Sync;
    /// One layer's MLA latent cache: per position `[c_kv | k_pe]` (kv_lora + dr values), in a
    /// form of the backend's choosing (the CPU: an f32 tensor; CUDA: what its decode kernel
    /// copies as it is).
    type Latent: Send + Sync;
    /// A greedy pick (`argmax_pick`): one token id in the backend's memory, on its way to the
    /// host.
    type Pick: Send + Sync;

    /// "cpu", "cuda": used in messages.
    fn name(&self) -> &'static str;

    // ----- memory -------------------------------------------------------------------------

    /// Makes one tensor of the file resident. Refuses (never panics on) a type this backend
    /// cannot compute with.
    fn load_weight(&self, t: &TensorRef, role: WeightRole) -> Result<Self::Weight, BackendError>;

    /// `data` [rows * cols] -> `[rows, cols]`.
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Self::Tensor;

    /// `[rows, cols]` -> row-major host copy [rows * cols].
    fn download(&self, x: &Self::Tensor) -> Vec<f32>;

    /// `(rows, cols)` of `x`.
    fn shape(&self, x: &Self::Tensor) -> (usize, usize);

    /// A zero matrix `[rows, cols]` (caches, accumulators).
    fn zeros(&self, rows: usize, cols: usize) -> Self::Tensor;

    /// An empty (zero) latent cache of `capacity` positions of `kv_lora + dr` values.
    fn latent_cache(&self, capacity: usize, kv_lora: usize, dr: usize) -> Self::Latent;

    /// Bytes the latent cache holds.
    fn latent_bytes(&self, cache: &Self::Latent) -> usize;

    /// Positions `rows` of a latent cache as f32 matrices: c_kv `[rows.len(), kv_lora]` and
    /// k_pe `[rows.len(), dr]` (the prefill's expanded attention, traces).
    fn latent_rows(&self, cache: &Self::Latent, rows: Range<usize>)
        -> (Self::Tensor, Self::Tensor);

    /// A copy of the block `x[rows, cols]`: `[rows.len(), cols.len()]`.
    fn slice(&self, x: &Self::Tensor, rows: Range<usize>, cols: Range<usize>) -> Self::Tensor;

    /// Per-head columns: `x` [n, heads*d] -> [n, heads*cols.len()] with columns `cols` of each
    /// head (`cols` within `0..d`).
    fn head_columns(&self, x: &Self::Tensor, heads: usize, cols: Range<usize>) -> Self::Tensor;

    /// Writes `src` [n, w] into `dst` at rows `row0..row0+n`, columns `col0..col0+w` (cache
    /// appends).
    fn write_block(&self, dst: &mut Self::Tensor, row0: usize, col0: usize, src: &Self::Tensor);

    // ----- element-wise and per-row ---------------------------------------------------------

    /// Embedding rows: `table` {E, V} -> [tokens.len(), E], dequantized rows of the table.
    /// Token ids are validated by the caller (< V).
    fn embed(&self, table: &Self::Weight, tokens: &[u32]) -> Self::Tensor;

    /// `embed` of the one token `pick` holds, read where it is: the host need not have seen it.
    fn embed_pick(&self, table: &Self::Weight, pick: &Self::Pick) -> Self::Tensor;

    /// The embedding of `tokens` (`embed` or `embed_pick`) and its RMSNorm with `w` (the first
    /// layer's attn_norm): (x, rms_norm(x, w, eps)). A GPU norms each row in the embedding's
    /// launch.
    fn embed_norm(
        &self,
        table: &Self::Weight,
        tokens: &Tokens<'_, Self>,
        w: &Self::Weight,
        eps: f32,
    ) -> (Self::Tensor, Self::Tensor) {
        let x = match tokens {
            Tokens::Ids(ids) => self.embed(table, ids),
            Tokens::Pick(pick) => self.embed_pick(table, pick),
        };
        let h = self.rms_norm(&x, w, eps);
        (x, h)
    }

    /// RMSNorm of each row: `x` [n, d], `w` {d} -> `x / sqrt(mean(x^2) + eps) * w`.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Weight, eps: f32) -> Self::Tensor;

    /// LayerNorm of each row with weight and bias {d} (the DSA indexer's k_norm).
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        b: &Self::Weight,
        eps: f32,
    ) -> Self::Tensor;

    /// `x += y`, both [n, d] (residual connections).
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor);

    /// The residual add and the RMSNorm after it: `x += y`, then returns `rms_norm(x, w, eps)`
    /// of the updated `x`. A GPU does both in one pass over the rows.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
    ) -> Self::Tensor {
        self.add_assign(x, y);
        self.rms_norm(x, w, eps)
    }

    /// `silu(gate) * up`, both [n, f] -> [n, f].
    fn swiglu(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Self::Tensor;

    /// Rotary embedding in place: `x` [n, heads*d]; row `r` is at position `pos0 + r`; in each
    /// head, columns `col0..col0 + rope.rot_dims()` rotate as adjacent pairs
    /// `(col0+2i, col0+2i+1)` by the angle `pos * inv_freq[i]`, cos and sin scaled by
    /// `rope.cos_sin_scale`. The other columns are untouched.
    fn rope(&self, x: &mut Self::Tensor, heads: usize, col0: usize, pos0: usize, rope: &Rope);

    /// `rope` of `x`, also returning the rotated columns `col0..col0 + rope.rot_dims()` of every
    /// head, [n, heads * rot_dims] (MLA's q_pe); a GPU writes both in one pass.
    fn rope_columns(
        &self,
        x: &mut Self::Tensor,
        heads: usize,
        col0: usize,
        pos0: usize,
        rope: &Rope,
    ) -> Self::Tensor {
        self.rope(x, heads, col0, pos0, rope);
        self.head_columns(x, heads, col0..col0 + rope.rot_dims())
    }

    /// The DSA indexer's keys of n positions into their cache (`IndexKeys`) at rows
    /// `row0..row0+n`, roped at those positions. A GPU does it in one pass.
    fn index_key_append(&self, row0: usize, k: IndexKeys<'_, Self>, rope: &Rope) {
        let (w, b) = k.norm;
        let mut y = self.layer_norm(k.x_k, w, b, k.eps);
        self.rope(&mut y, 1, 0, row0, rope);
        self.write_block(k.keys, row0, 0, &y);
    }

    /// The MLA latent of n positions into its cache: `kv` [n, kv_lora + dr] (the kv_a_mqa
    /// output, dr = `rope.rot_dims()`) -> positions `row0..row0+n` of `cache`,
    /// `[rms_norm(c_kv, w, eps) | k_pe roped at positions row0..row0+n]`; with `index_keys`,
    /// the DSA indexer's keys of the same positions into theirs (`index_key_append`); and with
    /// `query` (q-LoRA's latent [n, q_lora] and its norm), returns `rms_norm(query, eps)`. A
    /// GPU does it all in one launch, without the intermediate slices.
    #[allow(clippy::too_many_arguments)]
    fn latent_append(
        &self,
        cache: &mut Self::Latent,
        row0: usize,
        kv: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
        rope: &Rope,
        query: Option<(&Self::Tensor, &Self::Weight)>,
        index_keys: Option<IndexKeys<'_, Self>>,
    ) -> Option<Self::Tensor>;

    /// A layer's first projections of x (`LatentProjections`: the query's, kv_a's and the
    /// indexer key's) with their latent parts normed into the caches at positions
    /// `row0..row0+n` (`latent_append`): returns the query [n, H*(dn+dr)] (with q-LoRA through
    /// its latent's norm and q_b) and, with q-LoRA, its latent normed (q_a). A GPU runs the
    /// norms in the products' launches for one token.
    fn latent_projections(
        &self,
        x: &Self::Tensor,
        p: LatentProjections<'_, Self>,
        cache: &mut Self::Latent,
        row0: usize,
        rope: &Rope,
    ) -> (Self::Tensor, Option<Self::Tensor>) {
        latent_projections_apart(self, x, p, cache, row0, rope)
    }

    // ----- matrix products ----------------------------------------------------------------

    /// `x` [n, in] times a weight {in, out} -> [n, out] (`y[t] = W x[t]`).
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight) -> Self::Tensor;

    /// `linear(x, w)` for a product whose output the model only adds into the residual stream
    /// (`add_rms_norm`), all-reduces or records: a backend may return it in a form only those
    /// take (the CUDA backend: the partial sums of a decode product whose k its kernel spread
    /// over the blocks, added where add_rms_norm reads them).
    fn residual_linear(&self, x: &Self::Tensor, w: &Self::Weight) -> Self::Tensor {
        self.linear(x, w)
    }

    /// `linear(x, w)` for each of `ws`: the projections of one activation, which a backend may
    /// run as one launch.
    fn linears(&self, x: &Self::Tensor, ws: &[&Self::Weight]) -> Vec<Self::Tensor> {
        ws.iter().map(|w| self.linear(x, w)).collect()
    }

    /// The gated FFN's first half, `swiglu(linear(x, gate), linear(x, up))` -> [n, f]; a
    /// backend may run the two products as one.
    fn swiglu_linear(
        &self,
        x: &Self::Tensor,
        gate: &Self::Weight,
        up: &Self::Weight,
    ) -> Self::Tensor {
        self.swiglu(&self.linear(x, gate), &self.linear(x, up))
    }

    /// Per-head products with a `Heads` weight {a, b, H}: head `h` is a matrix `M_h` of `b`
    /// rows and `a` columns.
    /// - `transpose == false`: `x` [n, H*a] (or [n, a], shared by all heads) -> [n, H*b],
    ///   `y[t,h] = M_h x[t,h]`.
    /// - `transpose == true`: `x` [n, H*b] (or [n, b], shared) -> [n, H*a],
    ///   `y[t,h] = M_h^T x[t,h]`.
    ///
    /// MLA uses it four ways: q_lat = k_b q_nope (absorbed decode), k_nope = k_b^T c_kv and
    /// v = v_b c_kv (expanded prefill), out = v_b out_lat (absorbed decode).
    fn head_matmul(&self, x: &Self::Tensor, w: &Self::Weight, transpose: bool) -> Self::Tensor;

    /// `head_matmul` of columns `cols` of each head of `x` [n, heads*d] (`cols` within
    /// `0..d`): `head_matmul(head_columns(x, heads, cols), w, transpose)`, which a GPU reads
    /// in place instead of copying (the absorbed decode's q_nope, inside q).
    fn head_matmul_cols(
        &self,
        x: &Self::Tensor,
        heads: usize,
        cols: Range<usize>,
        w: &Self::Weight,
        transpose: bool,
    ) -> Self::Tensor {
        self.head_matmul(&self.head_columns(x, heads, cols), w, transpose)
    }

    // ----- attention ----------------------------------------------------------------------

    /// Expanded (MHA) causal attention for n queries at positions `pos0..pos0+n` over keys
    /// `0..S` (S = pos0 + n) of which query `t` sees `0..=pos0+t`:
    /// - `q` [n, H*(dn+dr)], each head `[q_nope | q_pe]` with q_pe already roped;
    /// - `k_nope` [S, H*dn]; `k_pe` [S, dr], one rope key shared by all heads;
    /// - `v` [S, H*dv];
    /// - `keep`: DSA selection [n, top_k] of key positions (-1 padded); other keys are
    ///   masked out. None: all causal keys.
    ///
    /// score = scale * (q_nope.k_nope + q_pe.k_pe); returns softmax(score) . v [n, H*dv].
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Tensor,
        k_nope: &Self::Tensor,
        k_pe: &Self::Tensor,
        v: &Self::Tensor,
        pos0: usize,
        scale: f32,
        keep: Option<&Self::Ids>,
    ) -> Self::Tensor;

    /// Absorbed (MQA over the latent cache) causal attention, same masking as `attention`:
    /// - `q_lat` [n, H*kv_lora] (= k_b q_nope per head);
    /// - `q` [n, H*(dn+dr)] (H = `heads`), each head `[q_nope | q_pe]`: q_pe roped already
    ///   (`rope` None), or to be roped here as `rope` of its columns would (a GPU does it as it
    ///   loads the query, one launch fewer);
    /// - `cache`: positions `0..pos0+n` valid.
    ///
    /// score = scale * (q_lat.c_kv + q_pe.k_pe); returns softmax(score) . c_kv [n, H*kv_lora].
    #[allow(clippy::too_many_arguments)]
    fn latent_attention(
        &self,
        q_lat: &Self::Tensor,
        q: &Self::Tensor,
        heads: usize,
        rope: Option<&Rope>,
        cache: &Self::Latent,
        pos0: usize,
        scale: f32,
        keep: Option<&Self::Ids>,
    ) -> Self::Tensor;

    /// DSA lightning indexer for n queries at positions `pos0..pos0+n`:
    /// - `q` [n, nh*d] (roped), `keys` [ctx, d] of which rows `0..pos0+n` are valid (roped, normed);
    /// - `head_weights` [n, nh].
    ///
    /// index score of key s for query t = sum_h head_weights[t,h] * relu(scale * q[t,h].k[s]),
    /// over causal keys only. Returns per query the `top_k` best key positions in ascending
    /// order, -1 padded when fewer keys exist: [n * top_k]. Ties keep the lower position.
    #[allow(clippy::too_many_arguments)]
    fn dsa_topk(
        &self,
        q: &Self::Tensor,
        keys: &Self::Tensor,
        head_weights: &Self::Tensor,
        pos0: usize,
        scale: f32,
        top_k: usize,
    ) -> Self::Ids;

    /// `ids` on the host (for traces).
    fn ids_to_host(&self, ids: &Self::Ids) -> Vec<i32>;

    // ----- mixture of experts -------------------------------------------------------------

    /// The routed experts of a batch, its router logits [n, n_expert] (`router` times `x`)
    /// computed and routed on the device by the rules of `model::moe::route`, so that decode
    /// pays no host round trip per MoE layer (and prefill no host routing of every token) and
    /// may take the product and the choice in one launch. `held`: the experts this
    /// rank's stacks hold (all at TP = 1); choices held elsewhere add nothing here. `shared`:
    /// the shared expert, which the backend may run as one more choice of every token. Returns
    /// the output and whether it includes the shared expert's (else the caller adds it). Where
    /// it does, or there is no shared expert, the output goes only to the residual add, an
    /// all-reduce or a trace, and may take a form only those take, as `residual_linear`'s (the
    /// CUDA backend: a decode token's expert outputs with their weights, combined where
    /// add_rms_norm reads them). None (the default): the caller routes on the host and calls
    /// `moe_experts`.
    #[allow(clippy::too_many_arguments)]
    fn moe_routed(
        &self,
        _x: &Self::Tensor,
        _router: &Self::Weight,
        _bias: Option<&[f32]>,
        _m: &crate::config::MoeConfig,
        _held: &Range<usize>,
        _experts: (&Self::Weight, &Self::Weight, &Self::Weight),
        _shared: Option<&crate::weights::DenseFfn<Self::Weight>>,
    ) -> Option<(Self::Tensor, bool)> {
        None
    }

    /// The routed experts of a batch: `x` [n, E]; `gate`, `up` {E, F, X}, `down` {F, E, X};
    /// `ids`, `weights` [n * k] (chosen experts and their final weights per token).
    /// Returns `sum_j weights[t,j] * down_e(silu(gate_e x) * up_e x)` with e = ids[t,j]: [n, E].
    #[allow(clippy::too_many_arguments)]
    fn moe_experts(
        &self,
        x: &Self::Tensor,
        gate: &Self::Weight,
        up: &Self::Weight,
        down: &Self::Weight,
        ids: &[u32],
        weights: &[f32],
        k: usize,
    ) -> Self::Tensor;

    // ----- sampling ----------------------------------------------------------------------------

    /// Greedy sampling, queued: the index of the largest value in the last row of `logits`
    /// (the first on ties), left in the backend's memory. A GPU backend copies no logits to the
    /// host, and work queued after the pick (the next token's forward, `embed_pick`) need not
    /// wait for the host to read it.
    fn argmax_pick(&self, logits: &Self::Tensor) -> Self::Pick;

    /// The id of `pick`, once the work queued before it is done (not the work queued after).
    fn pick_id(&self, pick: &Self::Pick) -> u32;

    /// Greedy sampling: `argmax_pick`, waited for.
    fn argmax_last(&self, logits: &Self::Tensor) -> u32 {
        self.pick_id(&self.argmax_pick(logits))
    }
}

/// The model's only contact with tensor parallelism: called after attn_output and after the
/// FFN/MoE (partial sums on each rank) and on the vocabulary-split logits. At TP = 1 it does
/// nothing (`SingleRank`).
pub trait Communicator<B: Backend>: Send + Sync {
    /// Sums `x` [n, E] over all ranks, in place.
    fn all_reduce(&self, backend: &B, x: &mut B::Tensor);
    /// Concatenates each rank's column block of `x` [n, V/TP] into [n, V].
    fn all_gather_cols(&self, backend: &B, x: B::Tensor) -> B::Tensor;
    /// This rank failed: the ranks waiting in a collective for it, or that enter one later,
    /// must fail too instead of waiting forever. Nothing by default.
    fn abort(&self) {}
}

/// One rank holds everything: nothing to reduce or gather.
pub struct SingleRank;

impl<B: Backend> Communicator<B> for SingleRank {
    fn all_reduce(&self, _backend: &B, _x: &mut B::Tensor) {}
    fn all_gather_cols(&self, _backend: &B, x: B::Tensor) -> B::Tensor {
        x
    }
}
