//! The forward pass, written once against `Backend`, top to bottom:
//! embedding -> per layer [attn_norm -> MLA (+ DSA) -> residual -> ffn_norm -> FFN or MoE ->
//! residual] -> final norm -> lm head.
//!
//! `Model::forward` takes the next tokens of one sequence and its cache; a prefill is many
//! tokens at once (expanded MLA), a decode step is one (absorbed MLA over the latent cache).

pub mod dsa;
pub mod mla;
pub mod moe;
pub mod rope;

use crate::backend::{Backend, Communicator, Rope, SingleRank, Tokens};
use crate::config::ConfigError;
use crate::config::ModelConfig;
use crate::gguf::{GgufError, GgufFile};
use crate::trace::{StageData, Trace};
use crate::weights::{
    DenseFfn, Ffn, GgufTensors, ModelWeights, Share, TensorRef, TensorSource, WeightsError,
};
use std::path::Path;
use std::sync::Arc;

/// Why a model file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{}: {source}", .path.display())]
    Weights {
        path: std::path::PathBuf,
        source: WeightsError,
    },
}

/// A model ready to run on backend `B`.
pub struct Model<B: Backend> {
    pub cfg: ModelConfig,
    pub backend: B,
    pub weights: ModelWeights<B::Weight>,
    /// Frequencies of the MLA rope part (and the DSA indexer, which shares them).
    pub rope: Rope,
    /// Sums partial results over tensor-parallel ranks (nothing at TP = 1).
    pub comm: Box<dyn Communicator<B>>,
}

/// Per-sequence state: the latent cache of every layer and the DSA indexer keys.
pub struct Cache<B: Backend> {
    /// Per layer, `[c_kv | k_pe]` of each position.
    pub latent: Vec<B::Latent>,
    /// Per layer running its own indexer: [n_ctx, idx_dim] roped, normed keys.
    pub index_keys: Vec<Option<B::Tensor>>,
    /// Positions filled.
    pub len: usize,
    /// Rows allocated (the context length).
    pub capacity: usize,
}

/// Where the model reports stages; does nothing (and downloads nothing) when not tracing.
pub struct Taps<'a> {
    trace: Option<&'a mut Trace>,
}

impl<'a> Taps<'a> {
    pub fn new(trace: Option<&'a mut Trace>) -> Taps<'a> {
        Taps { trace }
    }

    pub fn none() -> Taps<'static> {
        Taps { trace: None }
    }

    pub fn on(&self) -> bool {
        self.trace.is_some()
    }

    /// Records activation `x` [rows, cols] as `name` (built only when tracing).
    pub fn tensor<B: Backend>(&mut self, b: &B, name: impl FnOnce() -> String, x: &B::Tensor) {
        if let Some(t) = self.trace.as_deref_mut() {
            let (rows, cols) = b.shape(x);
            t.record(&name(), rows, cols, StageData::F32(b.download(x)));
        }
    }

    /// Records host values [rows, cols].
    pub fn host_f32(&mut self, name: impl FnOnce() -> String, rows: usize, v: &[f32]) {
        if let Some(t) = self.trace.as_deref_mut() {
            t.record(
                &name(),
                rows,
                v.len() / rows.max(1),
                StageData::F32(v.to_vec()),
            );
        }
    }

    /// Records ids [rows, cols].
    pub fn ids(&mut self, name: impl FnOnce() -> String, rows: usize, v: &[i32]) {
        if let Some(t) = self.trace.as_deref_mut() {
            t.record(
                &name(),
                rows,
                v.len() / rows.max(1),
                StageData::I32(v.to_vec()),
            );
        }
    }
}

/// Bad input to `forward`, refused before any work.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error(
        "token id {id} at position {index} is out of range: the vocabulary has {n_vocab} tokens"
    )]
    TokenOutOfRange {
        id: u32,
        index: usize,
        n_vocab: usize,
    },
    #[error("{needed} positions do not fit in the context of {n_ctx} tokens")]
    ContextFull { needed: usize, n_ctx: usize },
    #[error("no tokens to run")]
    Empty,
}

impl<B: Backend> Model<B> {
    /// Loads the weights `cfg` names from `source` into `backend` (TP = 1).
    pub fn load(
        cfg: ModelConfig,
        backend: B,
        source: &dyn TensorSource,
    ) -> Result<Model<B>, WeightsError> {
        Model::load_with_progress(cfg, backend, source, &mut |_| {})
    }

    /// `load`, calling `progress` after each tensor is resident (for a progress bar).
    pub fn load_with_progress(
        cfg: ModelConfig,
        backend: B,
        source: &dyn TensorSource,
        progress: &mut dyn FnMut(&TensorRef),
    ) -> Result<Model<B>, WeightsError> {
        let share = Share::whole(&cfg);
        Model::load_rank(cfg, &share, backend, source, Box::new(SingleRank), progress)
    }

    /// One tensor-parallel rank (`crate::tp` calls it): `cfg` with the rank's head count,
    /// `share` the rest of what it holds, `source` its shards, `comm` joining it to the others.
    pub fn load_rank(
        cfg: ModelConfig,
        share: &Share,
        backend: B,
        source: &dyn TensorSource,
        comm: Box<dyn Communicator<B>>,
        progress: &mut dyn FnMut(&TensorRef),
    ) -> Result<Model<B>, WeightsError> {
        let weights = ModelWeights::load_share(&cfg, share, source, &mut |t, role| {
            let w = backend.load_weight(t, role);
            progress(t);
            w
        })?;
        let rope = rope::rope_frequencies(cfg.head_dim_rope, cfg.rope_base, cfg.yarn.as_ref());
        Ok(Model {
            cfg,
            backend,
            weights,
            rope,
            comm,
        })
    }

    /// Opens a GGUF file (any shard of a split set) and loads it into `backend` (TP = 1).
    pub fn open(path: &Path, backend: B) -> Result<Model<B>, LoadError> {
        let file = Arc::new(GgufFile::open(path)?);
        let cfg = ModelConfig::from_gguf(&file)?;
        Model::load(cfg, backend, &GgufTensors(file)).map_err(|source| LoadError::Weights {
            path: path.to_path_buf(),
            source,
        })
    }

    /// An empty cache for up to `capacity` positions (at most the context length).
    pub fn new_cache(&self, capacity: usize) -> Cache<B> {
        let capacity = capacity.min(self.cfg.n_ctx);
        let b = &self.backend;
        Cache {
            latent: (0..self.cfg.n_layer)
                .map(|_| b.latent_cache(capacity, self.cfg.kv_lora, self.cfg.head_dim_rope))
                .collect(),
            index_keys: self
                .weights
                .layers
                .iter()
                .map(|l| {
                    l.indexer
                        .as_ref()
                        .map(|_| b.zeros(capacity, self.cfg.indexer.as_ref().unwrap().head_dim))
                })
                .collect(),
            len: 0,
            capacity,
        }
    }

    /// Runs `tokens` (the next positions of the sequence in `cache`) and returns their logits
    /// [tokens.len(), V].
    pub fn forward(
        &self,
        cache: &mut Cache<B>,
        tokens: &[u32],
        taps: &mut Taps,
    ) -> Result<B::Tensor, ForwardError> {
        self.run(cache, Tokens::Ids(tokens), taps, false)
    }

    /// One decode step of greedy generation whose token is `pick` (the argmax of the previous
    /// logits, `Backend::argmax_pick`): the step is queued behind the pick, so that the host
    /// can read the pick while the device already runs this step. Returns the logits [1, V].
    pub fn forward_pick(
        &self,
        cache: &mut Cache<B>,
        pick: &B::Pick,
    ) -> Result<B::Tensor, ForwardError> {
        self.run(cache, Tokens::Pick(pick), &mut Taps::none(), false)
    }

    /// Like `forward`, but only the last token's logits [1, V]: what generation needs after a
    /// prompt, without the LM head product of every prompt token.
    pub fn forward_last(
        &self,
        cache: &mut Cache<B>,
        tokens: &[u32],
    ) -> Result<B::Tensor, ForwardError> {
        self.run(cache, Tokens::Ids(tokens), &mut Taps::none(), true)
    }

    fn run(
        &self,
        cache: &mut Cache<B>,
        input: Tokens<B>,
        taps: &mut Taps,
        last_only: bool,
    ) -> Result<B::Tensor, ForwardError> {
        let cfg = &self.cfg;
        let b = &self.backend;
        let w = &self.weights;
        let n = match input {
            Tokens::Ids(tokens) => tokens.len(),
            Tokens::Pick(_) => 1, // an argmax of the logits: always in the vocabulary
        };
        if n == 0 {
            return Err(ForwardError::Empty);
        }
        if let Tokens::Ids(tokens) = input {
            if let Some((index, &id)) = tokens
                .iter()
                .enumerate()
                .find(|(_, &id)| id as usize >= cfg.n_vocab)
            {
                return Err(ForwardError::TokenOutOfRange {
                    id,
                    index,
                    n_vocab: cfg.n_vocab,
                });
            }
        }
        if cache.len + n > cache.capacity {
            return Err(ForwardError::ContextFull {
                needed: cache.len + n,
                n_ctx: cache.capacity,
            });
        }
        let pos0 = cache.len;

        // The embedding [n, E] with the first layer's attn_norm (one launch on a GPU).
        let (mut x, h0) = b.embed_norm(&w.token_embd, &input, &w.layers[0].attn_norm, cfg.rms_eps);
        let mut h0 = Some(h0);
        taps.tensor(b, || "embed".into(), &x);

        // DSA: the last full indexer's selection, reused by the shared layers after it.
        let mut topk: Option<dsa::Selection<B::Ids>> = None;
        // Each residual add runs fused with the norm after it (`add_rms_norm`): the FFN output
        // of a layer waits here for the next layer's attn_norm (or the final norm).
        let mut ffn_out: Option<B::Tensor> = None;
        for (il, lw) in w.layers.iter().enumerate() {
            let h = match ffn_out.take() {
                Some(y) => b.add_rms_norm(&mut x, &y, &lw.attn_norm, cfg.rms_eps),
                None => h0.take().expect("layer 0's norm comes with the embedding"),
            };
            if il > 0 {
                taps.tensor(b, || format!("L{}.h_out", il - 1), &x);
            }
            taps.tensor(b, || format!("L{il}.attn_norm"), &h);

            let mut attn = mla::attention(self, il, &h, cache, pos0, &mut topk, taps);
            self.comm.all_reduce(b, &mut attn);
            taps.tensor(b, || format!("L{il}.attn_out"), &attn);
            let h = b.add_rms_norm(&mut x, &attn, &lw.ffn_norm, cfg.rms_eps);
            taps.tensor(b, || format!("L{il}.h_attn"), &x);
            taps.tensor(b, || format!("L{il}.ffn_norm"), &h);

            let mut out = match &lw.ffn {
                Ffn::Dense(ffn) => {
                    let y = b.residual_linear(&b.swiglu_linear(&h, &ffn.gate, &ffn.up), &ffn.down);
                    taps.tensor(b, || format!("L{il}.ffn_out"), &y);
                    y
                }
                Ffn::Moe(m) => moe::forward(self, il, m, &h, taps),
                Ffn::OtherRank => b.zeros(n, cfg.n_embd),
            };
            self.comm.all_reduce(b, &mut out);
            ffn_out = Some(out);
        }
        cache.len += n;

        if last_only && n > 1 {
            // Only the last position goes on (forward_last, never traced: the last layer's
            // h_out below is then that row alone).
            x = b.slice(&x, n - 1..n, 0..cfg.n_embd);
            ffn_out = ffn_out.map(|y| b.slice(&y, n - 1..n, 0..cfg.n_embd));
        }
        let y = ffn_out.expect("every model has a layer (config)");
        let h = b.add_rms_norm(&mut x, &y, &w.output_norm, cfg.rms_eps);
        if let Some(last) = w.layers.len().checked_sub(1) {
            taps.tensor(b, || format!("L{last}.h_out"), &x);
        }
        taps.tensor(b, || "final_norm".into(), &h);
        let logits = b.linear(&h, w.lm_head());
        let logits = self.comm.all_gather_cols(b, logits);
        taps.tensor(b, || "logits".into(), &logits);
        Ok(logits)
    }
}

/// `down(silu(gate x) * up x)`: the shared expert (the dense FFN's down is a
/// `residual_linear`).
pub fn dense_ffn<B: Backend>(b: &B, ffn: &DenseFfn<B::Weight>, x: &B::Tensor) -> B::Tensor {
    b.linear(&b.swiglu_linear(x, &ffn.gate, &ffn.up), &ffn.down)
}
