//! `cargo xtask synth`: a synthetic GGUF with the real full-width shapes of GLM-5 or
//! DeepSeek-V3, only a few layers, and valid random quantized blocks.
//!
//! What it is for: measuring kernels and whole-model decode at the real shapes (a decode token
//! reads exactly the bytes a real file's layers would), and exercising the loader, the slicer
//! and the tracer on files of real size without downloading 400 GB. The weights are noise, so
//! the text is noise, but every value is finite and sized so that activations keep their scale
//! through the layers: a matrix whose rows have n elements dequantizes to values of standard
//! deviation about 1/sqrt(n) (so W x of a normalized x has entries of about unit size), and
//! norm weights are about 1.
//!
//! How blocks are made: the codes and the sub-block scales are random bytes; only the f16
//! super-block scale (and min) of each block is set. The scale that gives the wanted spread is
//! calibrated once per type by dequantizing a few hundred unit-scale blocks with
//! `quant::dequantize`; a min is set to the multiple of the scale that centres the codes. Bytes
//! come from a fast PRNG (wyrand) split over the cores with rayon, generated while the previous
//! chunk is written; the file streams through `GgufWriter`, so memory is two chunk buffers.
//!
//! The layer count N replaces the real one; the leading dense layers (`--dense`, default 1: the
//! real models have 3 of 61 or 78) are capped at N-1 so that MoE layers exist. `--nextn K` appends K MTP blocks (GLM-5 ships one) that the engine skips.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mla_engine::gguf::{GgmlType, GgufWriter, Value};
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SynthArch {
    /// GLM-5 shapes (with the DSA indexer).
    GlmDsa,
    /// DeepSeek-V3 shapes (with YaRN and grouped routing).
    Deepseek2,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, value_enum)]
    pub arch: SynthArch,
    /// Transformer layers (the real models have 61 or 78).
    #[arg(long)]
    pub layers: usize,
    /// Type of the big matrices (q4_k, q5_k, q6_k, q8_0, iq4_xs, q4_0, bf16, ...). Rows that
    /// are not a whole number of its blocks fall back as real quantizers do.
    #[arg(long, default_value = "q4_k")]
    pub quant: String,
    /// Leading dense layers (capped at N-1 so that MoE layers exist). The default, 1, keeps the
    /// file close to the real models' mix (3 dense of 61 or 78) at a few layers.
    #[arg(long, default_value_t = 1)]
    pub dense: usize,
    /// MTP (nextn) blocks appended after the layers, which the engine skips.
    #[arg(long, default_value_t = 0)]
    pub nextn: usize,
    /// Small widths with the same structure, for tests (hidden 256, 16 experts, vocab 1024).
    #[arg(long)]
    pub tiny: bool,
    /// Vocabulary size instead of the real one: full-width layers with a small embedding and
    /// head, so that a transformers reference of a slice fits in a laptop's memory.
    #[arg(long)]
    pub vocab: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output file.
    pub out: PathBuf,
}

/// The widths of a model family.
#[derive(Clone, Debug)]
pub struct Shape {
    pub n_embd: usize,
    /// Dense FFN width (leading layers).
    pub n_ff: usize,
    pub n_head: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    /// Per-head q/k widths without and with rope, and the value width.
    pub dn: usize,
    pub dr: usize,
    pub dv: usize,
    pub n_expert: usize,
    pub n_used: usize,
    pub n_shared: usize,
    pub n_ff_expert: usize,
    pub n_group: usize,
    pub n_group_used: usize,
    pub n_vocab: usize,
    pub n_ctx: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// YaRN factor and original context (DeepSeek-V3); mscale_all_dim is 1.
    pub yarn: Option<(f32, usize)>,
    /// DSA indexer heads, head width and top-k (GLM-5).
    pub indexer: Option<(usize, usize, usize)>,
}

impl Shape {
    /// From ../shared/REFERENCE.md ("GLM-5 shape").
    pub fn glm5() -> Shape {
        Shape {
            n_embd: 6144,
            n_ff: 12288,
            n_head: 64,
            q_lora: 2048,
            kv_lora: 512,
            dn: 192,
            dr: 64,
            dv: 256,
            n_expert: 256,
            n_used: 8,
            n_shared: 1,
            n_ff_expert: 2048,
            n_group: 1,
            n_group_used: 1,
            n_vocab: 154880,
            n_ctx: 202752,
            rope_base: 1e6,
            rms_eps: 1e-5,
            yarn: None,
            indexer: Some((32, 128, 2048)),
        }
    }

    /// From ../shared/REFERENCE.md ("DeepSeek-V3").
    pub fn deepseek_v3() -> Shape {
        Shape {
            n_embd: 7168,
            n_ff: 18432,
            n_head: 128,
            q_lora: 1536,
            kv_lora: 512,
            dn: 128,
            dr: 64,
            dv: 128,
            n_expert: 256,
            n_used: 8,
            n_shared: 1,
            n_ff_expert: 2048,
            n_group: 8,
            n_group_used: 4,
            n_vocab: 129280,
            n_ctx: 163840,
            rope_base: 10000.0,
            rms_eps: 1e-6,
            yarn: Some((40.0, 4096)),
            indexer: None,
        }
    }

    /// The family's structure at widths a test can write in milliseconds. Widths are multiples
    /// of 256 where the real ones are, so K-quants and their fallbacks land on the same tensors.
    pub fn tiny(arch: SynthArch) -> Shape {
        let full = Shape::of(arch, false);
        Shape {
            n_embd: 256,
            n_ff: 512,
            n_head: 4,
            q_lora: 256,
            kv_lora: 256,
            dn: if arch == SynthArch::GlmDsa { 64 } else { 32 },
            dr: 16,
            dv: 64,
            n_expert: 16,
            n_used: 4,
            n_ff_expert: 256,
            n_group: if full.n_group > 1 { 4 } else { 1 },
            n_group_used: if full.n_group > 1 { 2 } else { 1 },
            n_vocab: 1024,
            n_ctx: 4096,
            yarn: full.yarn.map(|(factor, _)| (factor, 256)),
            indexer: full.indexer.map(|_| (4, 32, 8)),
            ..full
        }
    }

    pub fn of(arch: SynthArch, tiny: bool) -> Shape {
        match (arch, tiny) {
            (_, true) => Shape::tiny(arch),
            (SynthArch::GlmDsa, false) => Shape::glm5(),
            (SynthArch::Deepseek2, false) => Shape::deepseek_v3(),
        }
    }
}

/// Everything that determines the file.
#[derive(Clone, Debug)]
pub struct Spec {
    pub arch: SynthArch,
    pub shape: Shape,
    pub n_layer: usize,
    /// Leading dense layers asked for (capped at n_layer - 1).
    pub n_dense: usize,
    pub n_nextn: usize,
    /// Type of the big matrices.
    pub mix: GgmlType,
    pub seed: u64,
}

impl Spec {
    pub fn from_args(args: &Args) -> Result<Spec> {
        let mix = GgmlType::from_name(&args.quant)
            .filter(|&t| mla_engine::quant::supported(t))
            .with_context(|| {
                let names: Vec<_> = mla_engine::quant::SUPPORTED
                    .iter()
                    .map(|t| t.name())
                    .collect();
                format!(
                    "--quant {}: expected one of {}",
                    args.quant,
                    names.join(", ")
                )
            })?;
        if args.layers == 0 {
            bail!("--layers must be at least 1");
        }
        let mut shape = Shape::of(args.arch, args.tiny);
        if let Some(n_vocab) = args.vocab {
            if n_vocab < 512 {
                bail!("--vocab {n_vocab}: at least 512 (special and byte tokens come first)");
            }
            shape.n_vocab = n_vocab;
        }
        Ok(Spec {
            arch: args.arch,
            shape,
            n_layer: args.layers,
            n_dense: args.dense,
            n_nextn: args.nextn,
            mix,
            seed: args.seed,
        })
    }

    fn arch_name(&self) -> &'static str {
        match self.arch {
            SynthArch::GlmDsa => "glm-dsa",
            SynthArch::Deepseek2 => "deepseek2",
        }
    }

    /// Leading dense layers in this file: as asked, leaving at least one MoE layer.
    pub fn n_dense_lead(&self) -> usize {
        self.n_dense.min(self.n_layer - 1)
    }
}

/// How a tensor's values are drawn: mean and standard deviation of the dequantized values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fill {
    pub mean: f32,
    pub std: f32,
}

/// How much of a tensor one decode token reads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Active {
    All,
    /// One row (the token embedding).
    OneRow,
    /// n_used of n_expert experts.
    Experts,
    /// Not run at all (MTP blocks).
    None,
}

/// One tensor of the file.
#[derive(Clone, Debug)]
pub struct Planned {
    pub name: String,
    pub ggml_type: GgmlType,
    /// ggml order, ne[0] contiguous.
    pub ne: Vec<u64>,
    pub fill: Fill,
    pub active: Active,
}

impl Planned {
    pub fn n_bytes(&self) -> u64 {
        mla_engine::gguf::tensor_bytes(self.ggml_type, &self.ne)
            .expect("planned shapes fit their types")
    }
}

/// The type a quantizer uses for rows of `row_len` elements when `mix` does not fit them
/// (attn_k_b rows of 128 or 192): the 32-element type of about the same precision.
pub fn fit_type(mix: GgmlType, row_len: usize) -> GgmlType {
    let fallback = match mix {
        _ if row_len.is_multiple_of(mix.block_size()) => return mix,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        GgmlType::IQ4_XS => GgmlType::IQ4_NL,
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        _ => GgmlType::F16,
    };
    if row_len.is_multiple_of(fallback.block_size()) {
        fallback
    } else {
        GgmlType::F16
    }
}

/// Bits per weight of a type (block bytes over block elements).
fn bits_per_weight(t: GgmlType) -> f64 {
    t.type_size() as f64 * 8.0 / t.block_size() as f64
}

/// The tensor table, in file order: token embedding, layers, output norm, head.
pub fn plan(spec: &Spec) -> Vec<Planned> {
    let s = &spec.shape;
    let mut out = Vec::new();
    let mut add = |name: String, ggml_type, ne: &[usize], fill, active| {
        let ne = ne.iter().map(|&n| n as u64).collect();
        out.push(Planned {
            name,
            ggml_type,
            ne,
            fill,
            active,
        });
    };
    let matrix = |row_len: usize| Fill {
        mean: 0.0,
        std: 1.0 / (row_len as f32).sqrt(),
    };
    let norm = Fill {
        mean: 1.0,
        std: 0.1,
    };
    let small = Fill {
        mean: 0.0,
        std: 0.01,
    };
    // The head stays at 6 bits or more, as llama.cpp's K-quant mixes keep it.
    let head_type = if bits_per_weight(spec.mix) < bits_per_weight(GgmlType::Q6_K) {
        GgmlType::Q6_K
    } else {
        spec.mix
    };

    let e = s.n_embd;
    add(
        "token_embd.weight".into(),
        fit_type(spec.mix, e),
        &[e, s.n_vocab],
        matrix(e),
        Active::OneRow,
    );
    for il in 0..spec.n_layer + spec.n_nextn {
        let active = if il < spec.n_layer {
            Active::All
        } else {
            Active::None
        };
        let experts = if il < spec.n_layer {
            Active::Experts
        } else {
            Active::None
        };
        let mut layer = |name: &str, ty: Option<GgmlType>, ne: &[usize], fill: Fill, active| {
            let ty = ty.unwrap_or_else(|| fit_type(spec.mix, ne[0]));
            add(format!("blk.{il}.{name}"), ty, ne, fill, active);
        };
        let f32 = Some(GgmlType::F32);
        layer("attn_norm.weight", f32, &[e], norm, active);
        layer("attn_q_a.weight", None, &[e, s.q_lora], matrix(e), active);
        layer("attn_q_a_norm.weight", f32, &[s.q_lora], norm, active);
        layer(
            "attn_q_b.weight",
            None,
            &[s.q_lora, s.n_head * (s.dn + s.dr)],
            matrix(s.q_lora),
            active,
        );
        layer(
            "attn_kv_a_mqa.weight",
            None,
            &[e, s.kv_lora + s.dr],
            matrix(e),
            active,
        );
        layer("attn_kv_a_norm.weight", f32, &[s.kv_lora], norm, active);
        layer(
            "attn_k_b.weight",
            None,
            &[s.dn, s.kv_lora, s.n_head],
            matrix(s.dn),
            active,
        );
        layer(
            "attn_v_b.weight",
            None,
            &[s.kv_lora, s.dv, s.n_head],
            matrix(s.kv_lora),
            active,
        );
        layer(
            "attn_output.weight",
            None,
            &[s.n_head * s.dv, e],
            matrix(s.n_head * s.dv),
            active,
        );
        if let Some((heads, dim, _)) = s.indexer {
            layer("indexer.k_norm.weight", f32, &[dim], norm, active);
            layer("indexer.k_norm.bias", f32, &[dim], small, active);
            layer("indexer.proj.weight", f32, &[e, heads], matrix(e), active);
            layer("indexer.attn_k.weight", None, &[e, dim], matrix(e), active);
            layer(
                "indexer.attn_q_b.weight",
                None,
                &[s.q_lora, heads * dim],
                matrix(s.q_lora),
                active,
            );
        }
        layer("ffn_norm.weight", f32, &[e], norm, active);
        if il < spec.n_dense_lead() {
            layer("ffn_gate.weight", None, &[e, s.n_ff], matrix(e), active);
            layer("ffn_up.weight", None, &[e, s.n_ff], matrix(e), active);
            layer(
                "ffn_down.weight",
                None,
                &[s.n_ff, e],
                matrix(s.n_ff),
                active,
            );
        } else {
            let (fe, n_exp, fs) = (s.n_ff_expert, s.n_expert, s.n_ff_expert * s.n_shared);
            layer("ffn_gate_inp.weight", f32, &[e, n_exp], matrix(e), active);
            layer("exp_probs_b.bias", f32, &[n_exp], small, active);
            layer(
                "ffn_gate_exps.weight",
                None,
                &[e, fe, n_exp],
                matrix(e),
                experts,
            );
            layer(
                "ffn_up_exps.weight",
                None,
                &[e, fe, n_exp],
                matrix(e),
                experts,
            );
            layer(
                "ffn_down_exps.weight",
                None,
                &[fe, e, n_exp],
                matrix(fe),
                experts,
            );
            layer("ffn_gate_shexp.weight", None, &[e, fs], matrix(e), active);
            layer("ffn_up_shexp.weight", None, &[e, fs], matrix(e), active);
            layer("ffn_down_shexp.weight", None, &[fs, e], matrix(fs), active);
        }
        if il >= spec.n_layer {
            layer(
                "nextn.eh_proj.weight",
                None,
                &[2 * e, e],
                matrix(2 * e),
                Active::None,
            );
            layer("nextn.enorm.weight", f32, &[e], norm, Active::None);
            layer("nextn.hnorm.weight", f32, &[e], norm, Active::None);
            layer(
                "nextn.shared_head_norm.weight",
                f32,
                &[e],
                norm,
                Active::None,
            );
        }
    }
    add(
        "output_norm.weight".into(),
        GgmlType::F32,
        &[e],
        norm,
        Active::All,
    );
    add(
        "output.weight".into(),
        fit_type(head_type, e),
        &[e, s.n_vocab],
        matrix(e),
        Active::All,
    );
    out
}

/// Bytes one decode token reads: every tensor of the layers it runs, n_used/n_expert of the
/// expert tensors, one embedding row, the head.
pub fn active_bytes(spec: &Spec, plan: &[Planned]) -> u64 {
    plan.iter()
        .map(|t| match t.active {
            Active::All => t.n_bytes(),
            Active::OneRow => t.n_bytes() / t.ne[1],
            Active::Experts => t.n_bytes() / spec.shape.n_expert as u64 * spec.shape.n_used as u64,
            Active::None => 0,
        })
        .sum()
}

/// The model's metadata (architecture keys, then the tokenizer).
pub fn metadata(spec: &Spec, plan: &[Planned]) -> Vec<(String, Value)> {
    let s = &spec.shape;
    let arch = spec.arch_name();
    let u32v = |n: usize| Value::U32(n as u32);
    let mut kv: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.type".into(), Value::String("model".into())),
        (
            "general.name".into(),
            Value::String(format!(
                "synthetic {} ({} layers, {}, random weights)",
                match spec.arch {
                    SynthArch::GlmDsa => "GLM-5",
                    SynthArch::Deepseek2 => "DeepSeek-V3",
                },
                spec.n_layer,
                spec.mix
            )),
        ),
        ("general.quantization_version".into(), Value::U32(2)),
    ];
    let mut a = |key: &str, v: Value| kv.push((format!("{arch}.{key}"), v));
    a("block_count", u32v(spec.n_layer + spec.n_nextn));
    if spec.n_nextn > 0 {
        a("nextn_predict_layers", u32v(spec.n_nextn));
    }
    a("context_length", u32v(s.n_ctx));
    a("embedding_length", u32v(s.n_embd));
    a("feed_forward_length", u32v(s.n_ff));
    a("attention.head_count", u32v(s.n_head));
    a("attention.head_count_kv", u32v(1));
    a("attention.key_length", u32v(s.kv_lora + s.dr));
    a("attention.value_length", u32v(s.kv_lora));
    a("attention.key_length_mla", u32v(s.dn + s.dr));
    a("attention.value_length_mla", u32v(s.dv));
    a("attention.q_lora_rank", u32v(s.q_lora));
    a("attention.kv_lora_rank", u32v(s.kv_lora));
    a("attention.layer_norm_rms_epsilon", Value::F32(s.rms_eps));
    a("rope.dimension_count", u32v(s.dr));
    a("rope.freq_base", Value::F32(s.rope_base));
    if let Some((factor, original)) = s.yarn {
        a("rope.scaling.type", Value::String("yarn".into()));
        a("rope.scaling.factor", Value::F32(factor));
        a("rope.scaling.original_context_length", u32v(original));
        a("rope.scaling.yarn_beta_fast", Value::F32(32.0));
        a("rope.scaling.yarn_beta_slow", Value::F32(1.0));
        // 0.1 * mscale_all_dim, with DeepSeek-V3's mscale_all_dim = 1.
        a("rope.scaling.yarn_log_multiplier", Value::F32(0.1));
    }
    a("leading_dense_block_count", u32v(spec.n_dense_lead()));
    a("expert_count", u32v(s.n_expert));
    a("expert_used_count", u32v(s.n_used));
    a("expert_shared_count", u32v(s.n_shared));
    a("expert_feed_forward_length", u32v(s.n_ff_expert));
    a("expert_weights_scale", Value::F32(2.5));
    a("expert_weights_norm", Value::Bool(true));
    a("expert_gating_func", u32v(2)); // sigmoid
    a("expert_group_count", u32v(s.n_group));
    a("expert_group_used_count", u32v(s.n_group_used));
    a("vocab_size", u32v(s.n_vocab));
    if let Some((heads, dim, top_k)) = s.indexer {
        a("attention.indexer.head_count", u32v(heads));
        a("attention.indexer.key_length", u32v(dim));
        a("attention.indexer.top_k", u32v(top_k));
    }
    kv.push(("general.file_type".into(), Value::U32(file_type(plan))));
    kv.extend(tokenizer(spec.arch, s.n_vocab));
    kv
}

/// llama.cpp's `general.file_type` for the mix: the id of the most common matrix type's
/// "mostly" file type (the ones llama.cpp names after a single type).
fn file_type(plan: &[Planned]) -> u32 {
    let biggest = plan.iter().max_by_key(|t| t.n_bytes()).map(|t| t.ggml_type);
    match biggest {
        Some(GgmlType::F32) => 0,
        Some(GgmlType::F16) => 1,
        Some(GgmlType::Q4_0) => 2,
        Some(GgmlType::Q4_1) => 3,
        Some(GgmlType::Q8_0) => 7,
        Some(GgmlType::Q5_0) => 8,
        Some(GgmlType::Q5_1) => 9,
        Some(GgmlType::Q2_K) => 10,
        Some(GgmlType::Q3_K) => 12, // Q3_K_M
        Some(GgmlType::Q4_K) => 15, // Q4_K_M
        Some(GgmlType::Q5_K) => 17, // Q5_K_M
        Some(GgmlType::Q6_K) => 18,
        Some(GgmlType::IQ4_NL) => 25,
        Some(GgmlType::IQ4_XS) => 30,
        Some(GgmlType::BF16) => 32,
        _ => 0,
    }
}

/// GPT-2's byte-level alphabet: printable bytes stand for themselves, the others (space,
/// controls...) for the characters from U+0100 on, in byte order.
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut shifted = 0;
    for b in 0..=255u8 {
        let printable = matches!(b, 33..=126 | 161..=172 | 174..=255);
        chars[b as usize] = if printable {
            b as char
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).expect("below U+0200")
        };
    }
    chars
}

/// Words whose BPE merges the synthetic vocabulary carries, so that English prompts come out as
/// a mix of byte tokens and a few longer ones.
const WORDS: &[&str] = &[
    "the", "and", "of", "to", "in", "is", "that", "it", "he", "was", "for", "on", "are", "with",
    "they", "be", "at", "one", "have", "this", "from", "by", "God", "said", "light", "earth",
    "heaven", "water", "day", "night", "there", "let", "made", "good", "which", "were",
];

/// A gpt2 BPE the engine's tokenizer can build: special tokens, the 256 byte tokens, the merges
/// of [`WORDS`] (with and without a leading space) and filler tokens up to `n_vocab`.
fn tokenizer(arch: SynthArch, n_vocab: usize) -> Vec<(String, Value)> {
    let (pre, specials, bos, eos, template) = match arch {
        SynthArch::Deepseek2 => (
            "deepseek-v3",
            vec!["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
            0,
            1,
            "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>\
             {{ m['content'] }}{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}\
             <｜end▁of▁sentence｜>{% else %}{{ m['content'] }}{% endif %}{% endfor %}\
             {% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
        ),
        SynthArch::GlmDsa => (
            "glm4",
            vec!["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"],
            1,
            0,
            "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}\
             {% if add_generation_prompt %}<|assistant|>\n{% endif %}",
        ),
    };
    let chars = byte_chars();
    let mut tokens: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
    let n_special = tokens.len();
    tokens.extend(chars.iter().map(|c| c.to_string()));
    let mut known: std::collections::HashSet<String> = tokens.iter().cloned().collect();
    let mut merges = Vec::new();
    'words: for word in WORDS {
        for spelled in [format!("{}{word}", chars[b' ' as usize]), word.to_string()] {
            let pieces: Vec<String> = spelled.chars().map(String::from).collect();
            let mut left = pieces[0].clone();
            for right in &pieces[1..] {
                let joined = format!("{left}{right}");
                if !known.contains(&joined) {
                    if tokens.len() == n_vocab {
                        break 'words;
                    }
                    merges.push(Value::String(format!("{left} {right}")));
                    known.insert(joined.clone());
                    tokens.push(joined.clone());
                }
                left = joined;
            }
        }
    }
    for i in tokens.len()..n_vocab {
        tokens.push(format!("<synth_{i}>"));
    }
    let types = (0..tokens.len())
        .map(|i| Value::I32(if i < n_special { 3 } else { 1 }))
        .collect();
    vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(bos)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)),
        ("tokenizer.ggml.padding_token_id".into(), Value::U32(eos)),
        (
            "tokenizer.ggml.add_bos_token".into(),
            Value::Bool(arch == SynthArch::Deepseek2),
        ),
        (
            "tokenizer.chat_template".into(),
            Value::String(template.into()),
        ),
    ]
}

/// wyrand: one multiply per 8 random bytes, good enough for noise.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = (self.0 as u128).wrapping_mul((self.0 ^ 0xe703_7ed1_a0b4_28db) as u128);
        (t >> 64) as u64 ^ t as u64
    }

    /// Uniform in [-1, 1).
    fn signed_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn fill(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

/// Mixes numbers into a seed (splitmix64's finalizer over a running sum).
fn mix_seed(parts: &[u64]) -> u64 {
    let mut h = 0x243f_6a88_85a3_08d3u64;
    for &p in parts {
        h = (h ^ p).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= h >> 31;
        h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 29;
    }
    h
}

fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Where a block type keeps its f16 scale, and its f16 min with the multiple of the scale that
/// centres the codes (the sign as the min enters the formula, see the quant family files).
fn scale_fields(t: GgmlType) -> (usize, Option<(usize, f32)>) {
    match t {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL | GgmlType::IQ4_XS => {
            (0, None)
        }
        // d * q + m with q in 0..16 / 0..32: m = -7.5 d / -15.5 d.
        GgmlType::Q4_1 => (0, Some((2, -7.5))),
        GgmlType::Q5_1 => (0, Some((2, -15.5))),
        // d * sc * q - dmin * m with the mean of q 1.5 / 7.5 / 15.5 and sc, m alike.
        GgmlType::Q2_K => (80, Some((82, 1.5))),
        GgmlType::Q4_K => (0, Some((2, 7.5))),
        GgmlType::Q5_K => (0, Some((2, 15.5))),
        GgmlType::Q3_K => (108, None),
        GgmlType::Q6_K => (208, None),
        other => unreachable!("{other} is not a block type"),
    }
}

fn is_float(t: GgmlType) -> bool {
    matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// Fills `out` (whole blocks, or whole elements for float types) with random values of the
/// given spread. `unit_rms` is the RMS of the type's dequantized blocks at scale 1.
fn fill_bytes(t: GgmlType, fill: Fill, unit_rms: f32, rng: &mut Rng, out: &mut [u8]) {
    let half_width = fill.std * 3f32.sqrt(); // a uniform on [-w, w] has std w / sqrt(3)
    match t {
        GgmlType::F32 => {
            for v in out.chunks_exact_mut(4) {
                v.copy_from_slice(&(fill.mean + half_width * rng.signed_unit()).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for v in out.chunks_exact_mut(2) {
                let x = half::f16::from_f32(fill.mean + half_width * rng.signed_unit());
                v.copy_from_slice(&x.to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for v in out.chunks_exact_mut(2) {
                let x = half::bf16::from_f32(fill.mean + half_width * rng.signed_unit());
                v.copy_from_slice(&x.to_le_bytes());
            }
        }
        _ => {
            debug_assert_eq!(fill.mean, 0.0, "quantized tensors are centred");
            rng.fill(out);
            let (d_at, min) = scale_fields(t);
            let d = fill.std / unit_rms;
            let d16 = half::f16::from_f32(d).to_le_bytes();
            let m16 = min.map(|(at, ratio)| (at, half::f16::from_f32(d * ratio).to_le_bytes()));
            let minus_d16 = half::f16::from_f32(-d).to_le_bytes();
            for block in out.chunks_exact_mut(t.type_size()) {
                // Without a min the codes are not centred (Q4_0's q - 8 averages -0.5): a
                // random sign of d centres them, as quantizers that pick the sign of the
                // largest weight do. The bit is one of the block's own random bytes.
                let negative = min.is_none() && block[d_at] & 1 == 1;
                block[d_at..d_at + 2].copy_from_slice(if negative { &minus_d16 } else { &d16 });
                if let Some((at, m)) = m16 {
                    block[at..at + 2].copy_from_slice(&m);
                }
            }
        }
    }
}

/// RMS of the dequantized values of random blocks of type `t` at scale 1 (1 for float types).
pub fn unit_rms(t: GgmlType) -> f32 {
    if is_float(t) {
        return 1.0;
    }
    const BLOCKS: usize = 512;
    let mut bytes = vec![0u8; BLOCKS * t.type_size()];
    fill_bytes(
        t,
        Fill {
            mean: 0.0,
            std: 1.0,
        },
        1.0,
        &mut Rng::new(name_hash(t.name())),
        &mut bytes,
    );
    let mut values = vec![0f32; BLOCKS * t.block_size()];
    mla_engine::quant::dequantize(t, &bytes, &mut values)
        .expect("whole blocks of a supported type");
    let mean_square = values.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / values.len() as f64;
    mean_square.sqrt() as f32
}

/// What a written file holds.
#[derive(Clone, Debug)]
pub struct Summary {
    pub n_tensors: usize,
    pub file_bytes: u64,
    pub active_bytes: u64,
    pub seconds: f64,
}

/// Bytes generated at a time per tensor (two buffers: one written while the next is made).
const CHUNK: usize = 64 << 20;
/// Bytes one rayon task generates.
const PIECE: usize = 1 << 20;

/// Writes the synthetic file. `progress` prints a line per big tensor and the totals.
pub fn synthesize(spec: &Spec, out: &Path, progress: bool) -> Result<Summary> {
    let started = Instant::now();
    let plan = plan(spec);
    let mut writer = GgufWriter::new(out, 32)?;
    for (key, value) in metadata(spec, &plan) {
        writer.add_kv(&key, value)?;
    }
    for t in &plan {
        writer.add_tensor(&t.name, t.ggml_type, &t.ne)?;
    }
    writer.write_header()?;

    let total: u64 = plan.iter().map(Planned::n_bytes).sum();
    let mut rms = std::collections::HashMap::new();
    let (mut buf, mut next) = (Vec::new(), Vec::new());
    let mut done = 0u64;
    for t in &plan {
        let unit = *rms
            .entry(t.ggml_type)
            .or_insert_with(|| unit_rms(t.ggml_type));
        // Chunks and pieces hold whole blocks (or whole elements).
        let atom = t.ggml_type.type_size();
        let chunk = CHUNK / atom * atom;
        let piece = PIECE / atom * atom;
        let n_bytes = t.n_bytes() as usize;
        let seed = mix_seed(&[spec.seed, name_hash(&t.name)]);
        let generate = |buf: &mut Vec<u8>, chunk_no: usize| {
            let len = chunk.min(n_bytes - chunk_no * chunk);
            buf.resize(len, 0);
            buf.par_chunks_mut(piece).enumerate().for_each(|(j, p)| {
                let mut rng = Rng::new(mix_seed(&[seed, chunk_no as u64, j as u64]));
                fill_bytes(t.ggml_type, t.fill, unit, &mut rng, p);
            });
        };
        let n_chunks = n_bytes.div_ceil(chunk);
        generate(&mut buf, 0);
        for c in 0..n_chunks {
            if c + 1 < n_chunks {
                let (written, ()) = rayon::join(
                    || writer.write_tensor_part(&buf),
                    || generate(&mut next, c + 1),
                );
                written?;
                std::mem::swap(&mut buf, &mut next);
            } else {
                writer.write_tensor_part(&buf)?;
            }
        }
        done += n_bytes as u64;
        if progress && n_bytes >= 256 << 20 {
            let secs = started.elapsed().as_secs_f64();
            println!(
                "  {:<28} {:<6} {:>8.1} MB   {:5.1}% of {:.2} GiB, {:.0} MB/s",
                t.name,
                t.ggml_type.name(),
                n_bytes as f64 / 1e6,
                100.0 * done as f64 / total as f64,
                total as f64 / (1u64 << 30) as f64,
                done as f64 / 1e6 / secs,
            );
        }
    }
    writer
        .finish()?
        .into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()?;
    let file_bytes = std::fs::metadata(out)?.len();
    Ok(Summary {
        n_tensors: plan.len(),
        file_bytes,
        active_bytes: active_bytes(spec, &plan),
        seconds: started.elapsed().as_secs_f64(),
    })
}

pub fn run(args: Args) -> Result<()> {
    let spec = Spec::from_args(&args)?;
    println!(
        "synth: {} with {} layers ({} dense, {} MoE{}), {} -> {}",
        spec.arch_name(),
        spec.n_layer,
        spec.n_dense_lead(),
        spec.n_layer - spec.n_dense_lead(),
        if spec.n_nextn > 0 {
            format!(", {} MTP", spec.n_nextn)
        } else {
            String::new()
        },
        spec.mix,
        args.out.display()
    );
    let s = synthesize(&spec, &args.out, true)?;
    println!(
        "synth: {} tensors, {:.2} GiB in {:.1} s ({:.0} MB/s); active bytes per decode token: {:.3} GB",
        s.n_tensors,
        s.file_bytes as f64 / (1u64 << 30) as f64,
        s.seconds,
        s.file_bytes as f64 / 1e6 / s.seconds,
        s.active_bytes as f64 / 1e9
    );
    Ok(())
}
