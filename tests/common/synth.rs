//! Synthetic models for the tests: the ds3 golden model's metadata with shapes changed and
//! random weights, written next to the test binary (the GGUF writer's own files).

use super::model_path;
use mla_engine::config::ModelConfig;
use mla_engine::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use std::path::PathBuf;

/// Shape changes from the ds3 golden model (`Synth::default()`: 8 heads, 8 experts, no expert
/// groups, attn_output, kv_a and q_b in Q8_0, the golden model's width and q_lora).
pub struct Synth {
    pub heads: usize,
    pub experts: usize,
    pub groups: Option<usize>,
    pub attn_output: GgmlType,
    /// kv_a_mqa's type (q_a is Q4_K): Q4_K puts both in one parts launch on a GPU.
    pub kv_a: GgmlType,
    /// The embedding width, a multiple of 256 (None: the golden model's).
    pub width: Option<usize>,
    /// q-LoRA's rank (None: the golden model's) and q_b's type.
    pub q_lora: Option<usize>,
    pub q_b: GgmlType,
}

impl Default for Synth {
    fn default() -> Synth {
        Synth {
            heads: 8,
            experts: 8,
            groups: None,
            attn_output: GgmlType::Q8_0,
            kv_a: GgmlType::Q8_0,
            width: None,
            q_lora: None,
            q_b: GgmlType::Q8_0,
        }
    }
}

/// A deterministic xorshift stream.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Random bytes of a tensor of `ty` with `n` elements of magnitude about `scale`: block
/// scales set so the values have that size, quants random.
fn random_tensor(
    rng: &mut XorShift,
    ty: GgmlType,
    n: usize,
    scale: f32,
    around_one: bool,
) -> Vec<u8> {
    let half = |v: f32| half::f16::from_f32(v).to_le_bytes();
    match ty {
        GgmlType::F32 => (0..n)
            .flat_map(|_| {
                let v = rng.uniform() * scale + if around_one { 1.0 } else { 0.0 };
                v.to_le_bytes()
            })
            .collect(),
        GgmlType::Q8_0 => (0..n / 32)
            .flat_map(|_| {
                let mut b = half(scale / 127.0).to_vec();
                b.extend((0..32).map(|_| rng.next() as u8));
                b
            })
            .collect(),
        GgmlType::Q4_K => (0..n / 256)
            .flat_map(|_| {
                // value = d * sc * q - dmin * m with sc, m < 64 and q < 16.
                let mut b = half(2.0 * scale / (63.0 * 15.0)).to_vec();
                b.extend(half(scale / 63.0));
                b.extend((0..140).map(|_| rng.next() as u8));
                b
            })
            .collect(),
        other => panic!("synth: no random {other}"),
    }
}

/// Writes a ds3-shaped model with `s`'s changes to the temp folder and returns its path.
pub fn synth(s: &Synth, tag: &str) -> PathBuf {
    let base = GgufFile::open(model_path("ds3.q8_0")).unwrap();
    let cfg = ModelConfig::from_gguf(&base).unwrap();
    let arch = "deepseek2";
    let path = std::env::temp_dir().join(format!("synth-{tag}-{}.gguf", std::process::id()));
    let mut w = GgufWriter::new(&path, 32).unwrap();
    let e = s.width.unwrap_or(cfg.n_embd);
    let r = s.q_lora.unwrap_or(cfg.q_lora.unwrap());
    for (k, v) in base.metadata() {
        let v = match k.strip_prefix(&format!("{arch}.")) {
            Some("attention.head_count") => Value::U32(s.heads as u32),
            Some("expert_count") => Value::U32(s.experts as u32),
            Some("expert_group_count") if s.groups.is_some() => {
                Value::U32(s.groups.unwrap() as u32)
            }
            Some("expert_group_used_count") if s.groups.is_some() => Value::U32(1),
            Some("embedding_length") => Value::U32(e as u32),
            Some("attention.q_lora_rank") => Value::U32(r as u32),
            _ => v.clone(),
        };
        if k != "general.alignment" {
            w.add_kv(k, v).unwrap();
        }
    }
    let (v, h, x) = (cfg.n_vocab, s.heads, s.experts);
    let (dn, dr, dv, kv) = (
        cfg.head_dim_nope,
        cfg.head_dim_rope,
        cfg.head_dim_v,
        cfg.kv_lora,
    );
    let m = cfg.moe.as_ref().unwrap();
    let (f, fs) = (m.n_ff_expert, m.n_ff_expert * m.n_shared);
    use GgmlType::{F32, Q4_K, Q8_0};
    // (name, type, ne, is a norm)
    let mut tensors: Vec<(String, GgmlType, Vec<usize>, bool)> = vec![
        ("token_embd.weight".into(), Q4_K, vec![e, v], false),
        ("output_norm.weight".into(), F32, vec![e], true),
        ("output.weight".into(), Q8_0, vec![e, v], false),
    ];
    for il in 0..cfg.n_layer {
        let n = |s: &str| format!("blk.{il}.{s}");
        tensors.extend([
            (n("attn_norm.weight"), F32, vec![e], true),
            (n("attn_q_a.weight"), Q4_K, vec![e, r], false),
            (n("attn_q_a_norm.weight"), F32, vec![r], true),
            (n("attn_q_b.weight"), s.q_b, vec![r, h * (dn + dr)], false),
            (n("attn_kv_a_mqa.weight"), s.kv_a, vec![e, kv + dr], false),
            (n("attn_kv_a_norm.weight"), F32, vec![kv], true),
            (n("attn_k_b.weight"), Q8_0, vec![dn, kv, h], false),
            (n("attn_v_b.weight"), Q8_0, vec![kv, dv, h], false),
            (
                n("attn_output.weight"),
                s.attn_output,
                vec![h * dv, e],
                false,
            ),
            (n("ffn_norm.weight"), F32, vec![e], true),
        ]);
        if il < cfg.n_dense_lead {
            tensors.extend([
                (n("ffn_gate.weight"), Q4_K, vec![e, cfg.n_ff], false),
                (n("ffn_up.weight"), Q4_K, vec![e, cfg.n_ff], false),
                (n("ffn_down.weight"), Q8_0, vec![cfg.n_ff, e], false),
            ]);
        } else {
            tensors.extend([
                (n("ffn_gate_inp.weight"), F32, vec![e, x], false),
                (n("exp_probs_b.bias"), F32, vec![x], false),
                (n("ffn_gate_exps.weight"), Q4_K, vec![e, f, x], false),
                (n("ffn_up_exps.weight"), Q4_K, vec![e, f, x], false),
                (n("ffn_down_exps.weight"), Q8_0, vec![f, e, x], false),
                (n("ffn_gate_shexp.weight"), Q4_K, vec![e, fs], false),
                (n("ffn_up_shexp.weight"), Q4_K, vec![e, fs], false),
                (n("ffn_down_shexp.weight"), Q8_0, vec![fs, e], false),
            ]);
        }
    }
    for (name, ty, ne, _) in &tensors {
        let ne: Vec<u64> = ne.iter().map(|&d| d as u64).collect();
        w.add_tensor(name, *ty, &ne).unwrap();
    }
    w.write_header().unwrap();
    let mut rng = XorShift(0x5eed_1234_abcd_0001);
    for (name, ty, ne, norm) in &tensors {
        let n: usize = ne.iter().product();
        let scale = if *norm {
            0.2
        } else {
            2.0 / (ne[0] as f32).sqrt()
        };
        w.write_tensor(name, &random_tensor(&mut rng, *ty, n, scale, *norm))
            .unwrap();
    }
    w.finish().unwrap();
    path
}
