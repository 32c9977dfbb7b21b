//! `ModelConfig`: the hyperparameters the engine runs with, read from GGUF metadata.
//!
//! Two architectures: `deepseek2` (DeepSeek-V2/V3/R1, Kimi-K2) and `glm-dsa` (GLM-5, with the
//! DSA indexer). Everything is validated here, once: the forward pass trusts these numbers.
//! Whatever the engine cannot run is refused with one sentence naming the key or tensor.

use crate::gguf::{GgufError, GgufFile};
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{}: {what}", .path.display())]
    Unsupported { path: PathBuf, what: String },
    #[error("{}: key {key}: {reason}", .path.display())]
    BadKey {
        path: PathBuf,
        key: String,
        reason: String,
    },
    #[error("{}: tensor {tensor}: {reason}", .path.display())]
    BadTensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// DeepSeek-V2/V3/R1, Kimi-K2.
    Deepseek2,
    /// GLM-5: deepseek2 plus the DSA indexer, sigmoid routing by default.
    GlmDsa,
}

impl Arch {
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Deepseek2 => "deepseek2",
            Arch::GlmDsa => "glm-dsa",
        }
    }
}

/// How the per-head MLA up-projections are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLayout {
    /// attn_k_b {dn, kv_lora, H} and attn_v_b {kv_lora, dv, H} (current converters).
    Split,
    /// attn_kv_b {kv_lora, H*(dn+dv)}: split into k_b / v_b at load.
    Legacy,
}

/// YaRN context extension (DeepSeek-V3: factor 40 over 4096 positions).
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub original_context: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// rope.scaling.yarn_log_multiplier: 0.1 * mscale_all_dim.
    pub log_multiplier: f32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_expert: usize,
    /// Experts chosen per token (k).
    pub n_used: usize,
    pub n_shared: usize,
    /// Hidden width of one expert.
    pub n_ff_expert: usize,
    pub gating: Gating,
    /// Multiplies the final expert weights.
    pub weights_scale: f32,
    /// Normalize the chosen weights to sum 1 (before the scale).
    pub weights_norm: bool,
    /// Expert groups (1: no group limit) and how many groups a token may use.
    pub n_group: usize,
    pub n_group_used: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct IndexerConfig {
    pub n_head: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// Per layer: true runs its own indexer, false reuses the previous full layer's top-k.
    pub full: Vec<bool>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    /// Transformer layers run (block_count minus nextn/MTP layers).
    pub n_layer: usize,
    /// MTP layers in the file, skipped.
    pub n_nextn: usize,
    pub n_ctx: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
    pub n_head: usize,
    /// q-LoRA rank; None: the file has attn_q (V2-Lite).
    pub q_lora: Option<usize>,
    pub kv_lora: usize,
    /// Per-head q/k widths without and with rope, and the value width.
    pub head_dim_nope: usize,
    pub head_dim_rope: usize,
    pub head_dim_v: usize,
    pub kv_layout: KvLayout,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub yarn: Option<Yarn>,
    /// Dense FFN width (leading layers).
    pub n_ff: usize,
    pub n_dense_lead: usize,
    pub moe: Option<MoeConfig>,
    pub indexer: Option<IndexerConfig>,
    /// Things that load but deserve a loud note (known traps).
    pub warnings: Vec<String>,
}

impl ModelConfig {
    /// Whether layer `il` runs the MoE (else the dense FFN).
    pub fn is_moe_layer(&self, il: usize) -> bool {
        self.moe.is_some() && il >= self.n_dense_lead
    }

    /// The attention scale: 1/sqrt(dn+dr), times mscale^2 with YaRN.
    pub fn attention_scale(&self) -> f32 {
        let base = 1.0 / ((self.head_dim_nope + self.head_dim_rope) as f32).sqrt();
        match &self.yarn {
            Some(y) => {
                let mscale = 1.0 + y.log_multiplier * y.factor.ln();
                base * mscale * mscale
            }
            None => base,
        }
    }

    /// Values per position in the latent cache of one layer: [c_kv | k_pe].
    pub fn latent_width(&self) -> usize {
        self.kv_lora + self.head_dim_rope
    }

    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig, ConfigError> {
        Reader { file }.read()
    }
}

/// Reads keys with the architecture prefix and turns problems into `ConfigError`s.
struct Reader<'a> {
    file: &'a GgufFile,
}

impl Reader<'_> {
    fn path(&self) -> PathBuf {
        self.file.shards()[0].path.clone()
    }

    fn unsupported(&self, what: impl Into<String>) -> ConfigError {
        ConfigError::Unsupported {
            path: self.path(),
            what: what.into(),
        }
    }

    fn bad_key(&self, key: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError::BadKey {
            path: self.path(),
            key: key.to_string(),
            reason: reason.into(),
        }
    }

    fn usize(&self, key: &str) -> Result<usize, ConfigError> {
        Ok(self.file.get_usize(key)?)
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, ConfigError> {
        match self.file.get(key) {
            None => Ok(None),
            Some(_) => Ok(Some(self.file.get_usize(key)?)),
        }
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>, ConfigError> {
        match self.file.get(key) {
            None => Ok(None),
            Some(_) => Ok(Some(self.file.get_f32(key)?)),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        match self.file.get(key) {
            None => Ok(None),
            Some(_) => Ok(Some(self.file.get_bool(key)?)),
        }
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    fn read(&self) -> Result<ModelConfig, ConfigError> {
        let arch_name = self.file.get_str("general.architecture")?;
        let arch = match arch_name {
            "deepseek2" => Arch::Deepseek2,
            "glm-dsa" => Arch::GlmDsa,
            other => {
                return Err(self.unsupported(format!(
                "architecture {other:?} is not supported: this engine runs deepseek2 and glm-dsa"
            )))
            }
        };
        let k = |name: &str| format!("{arch_name}.{name}");
        let mut warnings = Vec::new();

        let block_count = self.usize(&k("block_count"))?;
        let n_nextn = self.opt_usize(&k("nextn_predict_layers"))?.unwrap_or(0);
        if n_nextn >= block_count {
            return Err(self.bad_key(
                &k("nextn_predict_layers"),
                format!("{n_nextn} MTP layers leave no layer of the {block_count} blocks"),
            ));
        }
        let n_layer = block_count - n_nextn;
        let n_embd = self.usize(&k("embedding_length"))?;
        let n_head = self.usize(&k("attention.head_count"))?;
        let kv_lora = self.usize(&k("attention.kv_lora_rank"))?;
        let q_lora = self
            .opt_usize(&k("attention.q_lora_rank"))?
            .filter(|&r| r > 0);
        let head_dim_rope = self.usize(&k("rope.dimension_count"))?;

        // MLA head widths: the *_mla keys exist in files with the split k_b/v_b layout; legacy
        // files store the per-head widths in key_length/value_length.
        let (key_len, value_len) = match (
            self.opt_usize(&k("attention.key_length_mla"))?,
            self.opt_usize(&k("attention.value_length_mla"))?,
        ) {
            (Some(kl), Some(vl)) => (kl, vl),
            _ => (
                self.usize(&k("attention.key_length"))?,
                self.usize(&k("attention.value_length"))?,
            ),
        };
        if key_len <= head_dim_rope {
            return Err(self.bad_key(
                &k("attention.key_length_mla"),
                format!("q/k head width {key_len} must exceed the rope width {head_dim_rope}"),
            ));
        }
        if head_dim_rope % 2 != 0 {
            return Err(self.bad_key(&k("rope.dimension_count"), "must be even (rotated pairs)"));
        }
        let kv_layout = if self.has_tensor("blk.0.attn_k_b.weight") {
            KvLayout::Split
        } else if self.has_tensor("blk.0.attn_kv_b.weight") {
            KvLayout::Legacy
        } else {
            return Err(self.unsupported(
                "neither blk.0.attn_k_b.weight nor blk.0.attn_kv_b.weight is present: not an MLA file",
            ));
        };

        let n_vocab = match self.file.tensor("token_embd.weight") {
            Some(t) if t.ne.len() >= 2 => t.ne[1] as usize,
            _ => {
                return Err(ConfigError::BadTensor {
                    path: self.path(),
                    tensor: "token_embd.weight".into(),
                    reason: "missing or not two-dimensional".into(),
                })
            }
        };

        let yarn = match self.file.get(&k("rope.scaling.type")) {
            None => None,
            Some(_) => match self.file.get_str(&k("rope.scaling.type"))? {
                "none" => None,
                "yarn" => Some(Yarn {
                    factor: self.opt_f32(&k("rope.scaling.factor"))?.unwrap_or(1.0),
                    original_context: self
                        .opt_usize(&k("rope.scaling.original_context_length"))?
                        .unwrap_or(4096),
                    beta_fast: self
                        .opt_f32(&k("rope.scaling.yarn_beta_fast"))?
                        .unwrap_or(32.0),
                    beta_slow: self
                        .opt_f32(&k("rope.scaling.yarn_beta_slow"))?
                        .unwrap_or(1.0),
                    log_multiplier: self
                        .opt_f32(&k("rope.scaling.yarn_log_multiplier"))?
                        .unwrap_or(0.0),
                }),
                other => {
                    return Err(self.unsupported(format!(
                        "rope scaling {other:?} is not supported: only none and yarn"
                    )))
                }
            },
        };
        let yarn = yarn.filter(|y| y.factor > 1.0);

        let n_expert = self.opt_usize(&k("expert_count"))?.unwrap_or(0);
        let moe = if n_expert == 0 {
            None
        } else {
            Some(self.read_moe(arch, &k, n_expert, &mut warnings)?)
        };

        let indexer = match arch {
            Arch::Deepseek2 => None,
            Arch::GlmDsa => self.read_indexer(&k, n_layer)?,
        };

        if self.has_tensor(&format!("blk.{}.ffn_gate_up_exps.weight", n_layer - 1)) {
            return Err(self.unsupported(
                "fused ffn_gate_up_exps tensors are not supported yet: convert with separate gate and up experts",
            ));
        }
        if self.file.get("tokenizer.chat_template").is_none() {
            warnings
                .push("no chat template (tokenizer.chat_template): --chat is unavailable".into());
        }

        let cfg = ModelConfig {
            arch,
            n_layer,
            n_nextn,
            n_ctx: self.usize(&k("context_length"))?,
            n_embd,
            n_vocab,
            n_head,
            q_lora,
            kv_lora,
            head_dim_nope: key_len - head_dim_rope,
            head_dim_rope,
            head_dim_v: value_len,
            kv_layout,
            rms_eps: self.file.get_f32(&k("attention.layer_norm_rms_epsilon"))?,
            rope_base: self.opt_f32(&k("rope.freq_base"))?.unwrap_or(10000.0),
            yarn,
            n_ff: self.opt_usize(&k("feed_forward_length"))?.unwrap_or(0),
            n_dense_lead: self
                .opt_usize(&k("leading_dense_block_count"))?
                .unwrap_or(0),
            moe,
            indexer,
            warnings,
        };
        self.validate(&cfg)?;
        Ok(cfg)
    }

    fn read_moe(
        &self,
        arch: Arch,
        k: &dyn Fn(&str) -> String,
        n_expert: usize,
        warnings: &mut Vec<String>,
    ) -> Result<MoeConfig, ConfigError> {
        let has_bias = (0..4).any(|il| self.has_tensor(&format!("blk.{il}.exp_probs_b.bias")));
        let gating_key = k("expert_gating_func");
        let gating = match self.opt_usize(&gating_key)? {
            Some(1) => Gating::Softmax,
            Some(2) => Gating::Sigmoid,
            Some(other) => {
                return Err(self.bad_key(
                    &gating_key,
                    format!("{other}: expected 1 (softmax) or 2 (sigmoid)"),
                ))
            }
            // GLM models route with sigmoid. A deepseek2 file with the selection bias but no
            // gating key comes from a config.json without scoring_func: the bias only exists
            // with sigmoid routing (V3), so softmax here would give garbage.
            None if arch == Arch::GlmDsa => Gating::Sigmoid,
            None if has_bias => {
                warnings.push(format!(
                    "{gating_key} is missing but the file has exp_probs_b (DeepSeek-V3 style routing): \
                     using sigmoid; llama.cpp would use softmax and produce garbage"
                ));
                Gating::Sigmoid
            }
            None => Gating::Softmax,
        };
        let n_group = self
            .opt_usize(&k("expert_group_count"))?
            .unwrap_or(1)
            .max(1);
        let n_group_used = self
            .opt_usize(&k("expert_group_used_count"))?
            .filter(|&g| g > 0)
            .unwrap_or(n_group);
        Ok(MoeConfig {
            n_expert,
            n_used: self.usize(&k("expert_used_count"))?,
            n_shared: self.opt_usize(&k("expert_shared_count"))?.unwrap_or(0),
            n_ff_expert: self.usize(&k("expert_feed_forward_length"))?,
            gating,
            weights_scale: self.opt_f32(&k("expert_weights_scale"))?.unwrap_or(1.0),
            weights_norm: self.opt_bool(&k("expert_weights_norm"))?.unwrap_or(false),
            n_group,
            n_group_used,
        })
    }

    fn read_indexer(
        &self,
        k: &dyn Fn(&str) -> String,
        n_layer: usize,
    ) -> Result<Option<IndexerConfig>, ConfigError> {
        let top_k = self.opt_usize(&k("attention.indexer.top_k"))?.unwrap_or(0);
        if top_k == 0 {
            return Ok(None); // a dense-attention checkpoint
        }
        let types_key = k("attention.indexer.types");
        let full = match self.file.get(&types_key) {
            None => vec![true; n_layer],
            Some(_) => {
                let values = self.file.get_array(&types_key)?;
                let mut full = Vec::with_capacity(n_layer);
                for v in values.iter().take(n_layer) {
                    match v.as_integer() {
                        Some(i) => full.push(i != 0),
                        None => match v {
                            crate::gguf::Value::Bool(b) => full.push(*b),
                            _ => {
                                return Err(self.bad_key(&types_key, "expected booleans per layer"))
                            }
                        },
                    }
                }
                if full.len() < n_layer {
                    return Err(self.bad_key(
                        &types_key,
                        format!("{} entries for {n_layer} layers", full.len()),
                    ));
                }
                if !full[0] {
                    return Err(self.bad_key(&types_key, "layer 0 must run its own indexer"));
                }
                full
            }
        };
        Ok(Some(IndexerConfig {
            n_head: self.usize(&k("attention.indexer.head_count"))?,
            head_dim: self.usize(&k("attention.indexer.key_length"))?,
            top_k,
            full,
        }))
    }

    fn validate(&self, c: &ModelConfig) -> Result<(), ConfigError> {
        let arch = c.arch.gguf_name();
        let positive = [
            ("embedding_length", c.n_embd),
            ("attention.head_count", c.n_head),
            ("attention.kv_lora_rank", c.kv_lora),
            ("context_length", c.n_ctx),
            ("value_length_mla", c.head_dim_v),
            ("rope.dimension_count", c.head_dim_rope),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(self.bad_key(&format!("{arch}.{key}"), "must be positive"));
            }
        }
        if c.n_dense_lead < c.n_layer && c.moe.is_none() && c.n_ff == 0 {
            return Err(self.bad_key(
                &format!("{arch}.feed_forward_length"),
                "missing for dense layers",
            ));
        }
        if let Some(m) = &c.moe {
            if m.n_used == 0 || m.n_used > m.n_expert {
                return Err(self.bad_key(
                    &format!("{arch}.expert_used_count"),
                    format!("{} experts per token out of {}", m.n_used, m.n_expert),
                ));
            }
            if m.n_expert % m.n_group != 0 || m.n_group_used > m.n_group {
                return Err(self.bad_key(
                    &format!("{arch}.expert_group_count"),
                    format!(
                        "{} groups ({} used) cannot partition {} experts",
                        m.n_group, m.n_group_used, m.n_expert
                    ),
                ));
            }
            if m.n_group > 1
                && (m.n_expert / m.n_group < 2
                    || m.n_group_used * (m.n_expert / m.n_group) < m.n_used)
            {
                return Err(self.bad_key(
                    &format!("{arch}.expert_group_used_count"),
                    "the used groups hold fewer experts than expert_used_count (or a group has fewer than 2)",
                ));
            }
        }
        if let Some(ix) = &c.indexer {
            if ix.head_dim < c.head_dim_rope || ix.n_head == 0 {
                return Err(self.bad_key(
                    &format!("{arch}.attention.indexer.key_length"),
                    format!(
                        "{} must be at least the rope width {}",
                        ix.head_dim, c.head_dim_rope
                    ),
                ));
            }
            if c.q_lora.is_none() {
                return Err(
                    self.unsupported("the DSA indexer needs q-LoRA (attention.q_lora_rank)")
                );
            }
        }
        Ok(())
    }
}
