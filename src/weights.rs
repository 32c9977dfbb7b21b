//! Named weights of one rank, borrowed from the mapped file.
//!
//! `TensorRef` is what a backend receives: a type, a ggml shape and bytes that stay valid as
//! long as the mapped file does. `ModelWeights<W>` holds every tensor the forward pass reads,
//! already made resident by a backend (`W = Backend::Weight`). A tensor-parallel rank builds
//! the same struct from sharded `TensorRef`s (row or column ranges of the full tensors).

use crate::backend::{BackendError, WeightRole};
use crate::config::{KvLayout, ModelConfig};
use crate::gguf::{GgmlType, GgufFile};
use crate::quant;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// Bytes of one tensor, borrowed from an owner (the mapped file, or an owned buffer for
/// tensors rebuilt at load) that this handle keeps alive.
#[derive(Clone)]
pub struct MappedBytes {
    _owner: Arc<dyn std::any::Any + Send + Sync>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the bytes are immutable and owned by `_owner`, which is Send + Sync.
unsafe impl Send for MappedBytes {}
unsafe impl Sync for MappedBytes {}

impl MappedBytes {
    /// Borrows `select(&owner)` for as long as the returned handle lives. The owner must not
    /// mutate those bytes (a memory map or a frozen buffer): they are read without a lock.
    pub fn new<O: Send + Sync + 'static>(owner: Arc<O>, select: impl FnOnce(&O) -> &[u8]) -> Self {
        let bytes = select(&owner);
        let (ptr, len) = (bytes.as_ptr(), bytes.len());
        MappedBytes {
            _owner: owner,
            ptr,
            len,
        }
    }

    /// Bytes owned by this handle (tensors rebuilt at load, like a split legacy attn_kv_b).
    pub fn owned(bytes: Vec<u8>) -> Self {
        MappedBytes::new(Arc::new(bytes), |b| b.as_slice())
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `_owner` keeps the allocation or mapping alive and unchanged (see `new`),
        // and an Arc's contents never move.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// One tensor as a backend receives it.
#[derive(Clone)]
pub struct TensorRef {
    /// The GGUF name, for messages (`blk.3.attn_k_b.weight`).
    pub name: String,
    pub ggml_type: GgmlType,
    /// ggml order: `ne[0]` is the row length. Trailing dimensions of 1 are kept as given.
    pub ne: Vec<usize>,
    pub bytes: MappedBytes,
}

impl TensorRef {
    /// Number of elements.
    pub fn n_elements(&self) -> usize {
        self.ne.iter().product()
    }

    /// Number of rows of `ne[0]` elements (all dimensions after the first).
    pub fn n_rows(&self) -> usize {
        self.ne.iter().skip(1).product()
    }

    /// Bytes per row in the file's format.
    pub fn row_bytes(&self) -> usize {
        self.ggml_type
            .row_bytes(self.ne[0])
            .expect("row length checked against the block size when the TensorRef was made")
    }

    /// An f32 tensor owned by the handle.
    pub fn from_f32(name: &str, ne: Vec<usize>, values: &[f32]) -> TensorRef {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        TensorRef {
            name: name.to_string(),
            ggml_type: GgmlType::F32,
            ne,
            bytes: MappedBytes::owned(bytes),
        }
    }
}

impl fmt::Debug for TensorRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.ggml_type, self.ne)
    }
}

/// Where the weights come from: one tensor by GGUF name (the whole file, or a rank's shard).
pub trait TensorSource {
    fn tensor(&self, name: &str) -> Option<TensorRef>;
}

/// Every tensor of a mapped GGUF file (any split set), whole.
pub struct GgufTensors(pub Arc<GgufFile>);

impl TensorSource for GgufTensors {
    fn tensor(&self, name: &str) -> Option<TensorRef> {
        let info = self.0.tensor(name)?.clone();
        let bytes = MappedBytes::new(self.0.clone(), |f| f.tensor_data(&info));
        Some(TensorRef {
            name: info.name.clone(),
            ggml_type: info.ggml_type,
            ne: info.ne.iter().map(|&n| n as usize).collect(),
            bytes,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("tensor {tensor} is missing")]
    Missing { tensor: String },
    #[error("tensor {tensor}: shape {found:?} (ggml order), expected {expected:?}")]
    Shape {
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor {tensor}: {reason}")]
    Bad { tensor: String, reason: String },
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// q projection: q-LoRA (DeepSeek-V3, GLM-5) or a direct projection (V2-Lite).
pub enum QueryProj<W> {
    Lora {
        /// attn_q_a {E, q_lora}
        a: W,
        /// attn_q_a_norm {q_lora}
        norm: W,
        /// attn_q_b {q_lora, H*(dn+dr)}
        b: W,
    },
    /// attn_q {E, H*(dn+dr)}
    Direct(W),
}

pub struct Attention<W> {
    pub q: QueryProj<W>,
    /// attn_kv_a_mqa {E, kv_lora+dr}: [c_kv | k_pe]
    pub kv_a_mqa: W,
    /// attn_kv_a_norm {kv_lora}
    pub kv_a_norm: W,
    /// attn_k_b {dn, kv_lora, H} (Heads)
    pub k_b: W,
    /// attn_v_b {kv_lora, dv, H} (Heads)
    pub v_b: W,
    /// attn_output {H*dv, E}
    pub output: W,
}

/// The DSA lightning indexer of a layer that runs its own.
pub struct Indexer<W> {
    /// indexer.attn_q_b {q_lora, n_idx_head*idx_dim}
    pub q_b: W,
    /// indexer.attn_k {E, idx_dim}
    pub k: W,
    /// indexer.k_norm weight and bias {idx_dim} (LayerNorm)
    pub k_norm: W,
    pub k_norm_bias: W,
    /// indexer.proj {E, n_idx_head}
    pub proj: W,
}

pub struct DenseFfn<W> {
    /// {E, F}
    pub gate: W,
    /// {E, F}
    pub up: W,
    /// {F, E}
    pub down: W,
}

pub struct Moe<W> {
    /// ffn_gate_inp {E, n_expert}
    pub router: W,
    /// exp_probs_b.bias [n_expert] on the host: added to the scores for selection only.
    pub selection_bias: Option<Vec<f32>>,
    /// ffn_gate_exps, ffn_up_exps {E, F_exp, n_expert}
    pub gate_exps: W,
    pub up_exps: W,
    /// ffn_down_exps {F_exp, E, n_expert}
    pub down_exps: W,
    /// ffn_{gate,up,down}_shexp, width F_exp * n_shared (this rank's rows of it under TP;
    /// None on ranks that do not hold it)
    pub shared: Option<DenseFfn<W>>,
    /// The routed experts held here, as router ids (all at TP = 1): the `*_exps` stacks hold
    /// `experts.len()` experts, the first being `experts.start`.
    pub experts: Range<usize>,
}

pub enum Ffn<W> {
    Dense(DenseFfn<W>),
    Moe(Moe<W>),
    /// Tensor parallelism: this layer's dense FFN could not be split and another rank computes
    /// it whole; this rank adds nothing to the all-reduce.
    OtherRank,
}

/// What one tensor-parallel rank holds besides its heads (its `ModelConfig::n_head` is already
/// the rank's head count). `Share::whole` at TP = 1; made by `crate::tp` for each rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Share {
    /// Dense FFN width held (ffn_gate/up rows, ffn_down columns); None: another rank's.
    pub n_ff: Option<usize>,
    /// Shared-expert width held; None: another rank's (or the model has none).
    pub n_ff_shared: Option<usize>,
    /// Routed experts held, as router ids.
    pub experts: Range<usize>,
    /// LM head rows (vocabulary entries) held; the logits are gathered after.
    pub n_vocab_head: usize,
}

impl Share {
    /// Everything: one rank.
    pub fn whole(cfg: &ModelConfig) -> Share {
        Share {
            n_ff: Some(cfg.n_ff),
            n_ff_shared: cfg.moe.as_ref().map(|m| m.n_ff_expert * m.n_shared),
            experts: 0..cfg.moe.as_ref().map_or(0, |m| m.n_expert),
            n_vocab_head: cfg.n_vocab,
        }
    }
}

pub struct LayerWeights<W> {
    /// attn_norm {E}
    pub attn_norm: W,
    pub attn: Attention<W>,
    /// Present on DSA layers that run their own indexer.
    pub indexer: Option<Indexer<W>>,
    /// ffn_norm {E}
    pub ffn_norm: W,
    pub ffn: Ffn<W>,
}

/// Every weight the forward pass reads, resident in a backend (`W = Backend::Weight`).
pub struct ModelWeights<W> {
    /// token_embd {E, V}
    pub token_embd: W,
    /// output_norm {E}
    pub output_norm: W,
    /// output {E, V}; None: the lm head is token_embd (tied).
    pub output: Option<W>,
    pub layers: Vec<LayerWeights<W>>,
}

/// Fetches tensors by name, checks their shapes and hands them to the backend.
struct Loader<'a, W> {
    source: &'a dyn TensorSource,
    load: &'a mut dyn FnMut(&TensorRef, WeightRole) -> Result<W, BackendError>,
}

impl<W> Loader<'_, W> {
    fn fetch(&self, name: &str, ne: &[usize]) -> Result<TensorRef, WeightsError> {
        let t = self
            .source
            .tensor(name)
            .ok_or_else(|| WeightsError::Missing {
                tensor: name.to_string(),
            })?;
        // Writers may keep or drop trailing dimensions of 1 ({dn, kv_lora, 1} or {dn, kv_lora}).
        let trim = |d: &[usize]| {
            let mut d = d.to_vec();
            while d.len() > 1 && d.last() == Some(&1) {
                d.pop();
            }
            d
        };
        if trim(&t.ne) != trim(ne) {
            return Err(WeightsError::Shape {
                tensor: name.to_string(),
                expected: ne.to_vec(),
                found: t.ne.clone(),
            });
        }
        if t.ggml_type.row_bytes(ne[0]).is_none() {
            return Err(WeightsError::Bad {
                tensor: name.to_string(),
                reason: format!(
                    "rows of {} are not a whole number of {} blocks of {}",
                    ne[0],
                    t.ggml_type,
                    t.ggml_type.block_size()
                ),
            });
        }
        Ok(t)
    }

    fn get(&mut self, name: &str, ne: &[usize], role: WeightRole) -> Result<W, WeightsError> {
        let t = self.fetch(name, ne)?;
        Ok((self.load)(&t, role)?)
    }

    fn has(&self, name: &str) -> bool {
        self.source.tensor(name).is_some()
    }

    /// A small tensor dequantized to f32 on the host.
    fn host_f32(&self, name: &str, ne: &[usize]) -> Result<Vec<f32>, WeightsError> {
        let t = self.fetch(name, ne)?;
        let mut v = vec![0.0; t.n_elements()];
        quant::dequantize(t.ggml_type, t.bytes.as_slice(), &mut v).map_err(|e| {
            WeightsError::Bad {
                tensor: name.to_string(),
                reason: e.to_string(),
            }
        })?;
        Ok(v)
    }
}

impl<W> ModelWeights<W> {
    /// Loads every tensor `cfg` needs from `source`, making each resident with `load`
    /// (usually `|t, role| backend.load_weight(t, role)`).
    pub fn load(
        cfg: &ModelConfig,
        source: &dyn TensorSource,
        load: &mut dyn FnMut(&TensorRef, WeightRole) -> Result<W, BackendError>,
    ) -> Result<ModelWeights<W>, WeightsError> {
        ModelWeights::load_share(cfg, &Share::whole(cfg), source, load)
    }

    /// `load` for a tensor-parallel rank: `source` hands out the rank's shards, whose shapes
    /// `cfg` (heads) and `share` (the rest) describe.
    pub fn load_share(
        cfg: &ModelConfig,
        share: &Share,
        source: &dyn TensorSource,
        load: &mut dyn FnMut(&TensorRef, WeightRole) -> Result<W, BackendError>,
    ) -> Result<ModelWeights<W>, WeightsError> {
        use WeightRole::{Heads, Matrix, Vector};
        let mut l = Loader { source, load };
        let (e, v, h) = (cfg.n_embd, cfg.n_vocab, cfg.n_head);
        let (dn, dr, dv) = (cfg.head_dim_nope, cfg.head_dim_rope, cfg.head_dim_v);
        let kv = cfg.kv_lora;

        let token_embd = l.get("token_embd.weight", &[e, v], Matrix)?;
        let output_norm = l.get("output_norm.weight", &[e], Vector)?;
        let output = if l.has("output.weight") {
            Some(l.get("output.weight", &[e, share.n_vocab_head], Matrix)?)
        } else {
            None
        };

        let mut layers = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            let q = match cfg.q_lora {
                Some(r) => QueryProj::Lora {
                    a: l.get(&n("attn_q_a.weight"), &[e, r], Matrix)?,
                    norm: l.get(&n("attn_q_a_norm.weight"), &[r], Vector)?,
                    b: l.get(&n("attn_q_b.weight"), &[r, h * (dn + dr)], Matrix)?,
                },
                None => {
                    QueryProj::Direct(l.get(&n("attn_q.weight"), &[e, h * (dn + dr)], Matrix)?)
                }
            };
            let (k_b, v_b) = match cfg.kv_layout {
                KvLayout::Split => (
                    l.get(&n("attn_k_b.weight"), &[dn, kv, h], Heads)?,
                    l.get(&n("attn_v_b.weight"), &[kv, dv, h], Heads)?,
                ),
                KvLayout::Legacy => {
                    let name = n("attn_kv_b.weight");
                    let kv_b = l.host_f32(&name, &[kv, h * (dn + dv)])?;
                    let (k_b, v_b) = split_legacy_kv_b(&kv_b, kv, h, dn, dv);
                    (
                        (l.load)(
                            &TensorRef::from_f32(&n("attn_k_b.weight"), vec![dn, kv, h], &k_b),
                            Heads,
                        )?,
                        (l.load)(
                            &TensorRef::from_f32(&n("attn_v_b.weight"), vec![kv, dv, h], &v_b),
                            Heads,
                        )?,
                    )
                }
            };
            let attn = Attention {
                q,
                kv_a_mqa: l.get(&n("attn_kv_a_mqa.weight"), &[e, kv + dr], Matrix)?,
                kv_a_norm: l.get(&n("attn_kv_a_norm.weight"), &[kv], Vector)?,
                k_b,
                v_b,
                output: l.get(&n("attn_output.weight"), &[h * dv, e], Matrix)?,
            };
            let indexer = match &cfg.indexer {
                Some(ix) if ix.full[il] => {
                    let (nh, d) = (ix.n_head, ix.head_dim);
                    let r = cfg.q_lora.expect("validated: DSA needs q-LoRA");
                    Some(Indexer {
                        q_b: l.get(&n("indexer.attn_q_b.weight"), &[r, nh * d], Matrix)?,
                        k: l.get(&n("indexer.attn_k.weight"), &[e, d], Matrix)?,
                        k_norm: l.get(&n("indexer.k_norm.weight"), &[d], Vector)?,
                        k_norm_bias: l.get(&n("indexer.k_norm.bias"), &[d], Vector)?,
                        proj: l.get(&n("indexer.proj.weight"), &[e, nh], Matrix)?,
                    })
                }
                _ => None,
            };
            let ffn = match &cfg.moe {
                Some(m) if cfg.is_moe_layer(il) => {
                    let (x, f) = (m.n_expert, m.n_ff_expert);
                    let bias_name = n("exp_probs_b.bias");
                    let selection_bias = if l.has(&bias_name) {
                        Some(l.host_f32(&bias_name, &[x])?)
                    } else {
                        None
                    };
                    let shared = match share.n_ff_shared {
                        Some(fs) if m.n_shared > 0 => Some(DenseFfn {
                            gate: l.get(&n("ffn_gate_shexp.weight"), &[e, fs], Matrix)?,
                            up: l.get(&n("ffn_up_shexp.weight"), &[e, fs], Matrix)?,
                            down: l.get(&n("ffn_down_shexp.weight"), &[fs, e], Matrix)?,
                        }),
                        _ => None,
                    };
                    let xs = share.experts.len();
                    Ffn::Moe(Moe {
                        router: l.get(&n("ffn_gate_inp.weight"), &[e, x], Matrix)?,
                        selection_bias,
                        gate_exps: l.get(&n("ffn_gate_exps.weight"), &[e, f, xs], Matrix)?,
                        up_exps: l.get(&n("ffn_up_exps.weight"), &[e, f, xs], Matrix)?,
                        down_exps: l.get(&n("ffn_down_exps.weight"), &[f, e, xs], Matrix)?,
                        shared,
                        experts: share.experts.clone(),
                    })
                }
                _ => match share.n_ff {
                    Some(ff) => Ffn::Dense(DenseFfn {
                        gate: l.get(&n("ffn_gate.weight"), &[e, ff], Matrix)?,
                        up: l.get(&n("ffn_up.weight"), &[e, ff], Matrix)?,
                        down: l.get(&n("ffn_down.weight"), &[ff, e], Matrix)?,
                    }),
                    None => Ffn::OtherRank,
                },
            };
            layers.push(LayerWeights {
                attn_norm: l.get(&n("attn_norm.weight"), &[e], Vector)?,
                attn,
                indexer,
                ffn_norm: l.get(&n("ffn_norm.weight"), &[e], Vector)?,
                ffn,
            });
        }
        Ok(ModelWeights {
            token_embd,
            output_norm,
            output,
            layers,
        })
    }

    /// The lm head: `output`, or the embedding table when tied.
    pub fn lm_head(&self) -> &W {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }
}

/// Splits a legacy attn_kv_b (per head `dn` rows of k_nope then `dv` rows of v, each row
/// `kv_lora` long) into k_b {dn, kv_lora, H} (k rows transposed per head) and
/// v_b {kv_lora, dv, H} (v rows as they are).
fn split_legacy_kv_b(
    kv_b: &[f32],
    kv: usize,
    h: usize,
    dn: usize,
    dv: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut k_b = vec![0.0; h * kv * dn];
    let mut v_b = vec![0.0; h * dv * kv];
    for head in 0..h {
        let base = head * (dn + dv) * kv;
        for i in 0..dn {
            for l in 0..kv {
                k_b[head * kv * dn + l * dn + i] = kv_b[base + i * kv + l];
            }
        }
        v_b[head * dv * kv..(head + 1) * dv * kv]
            .copy_from_slice(&kv_b[base + dn * kv..base + (dn + dv) * kv]);
    }
    (k_b, v_b)
}

/// The layer a tensor name belongs to and the rest of its name: "blk.12.attn_norm.weight" is
/// (12, "attn_norm.weight"); None outside layers ("output.weight").
pub fn layer_of(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (index, rest) = rest.split_once('.')?;
    Some((index.parse().ok()?, rest))
}

/// Weight bytes one decode token reads: every tensor of the model's `n_layer` layers (MTP
/// blocks after them are not run) and outside them, of the routed experts only the chosen
/// n_used of n_expert, and of the token embedding one row when the head is a separate tensor
/// (a tied head reads all of it).
pub fn active_bytes_per_token(file: &GgufFile, cfg: &ModelConfig) -> f64 {
    let used = cfg
        .moe
        .as_ref()
        .map_or(1.0, |m| m.n_used as f64 / m.n_expert as f64);
    let separate_head = file.tensor("output.weight").is_some();
    file.tensors()
        .iter()
        .filter(|t| layer_of(&t.name).is_none_or(|(il, _)| il < cfg.n_layer))
        .map(|t| {
            let bytes = t.n_bytes as f64;
            if t.name.contains("_exps") {
                bytes * used
            } else if t.name == "token_embd.weight" && separate_head {
                bytes / cfg.n_vocab as f64
            } else {
                bytes
            }
        })
        .sum()
}
