//! `cargo xtask synth`: the file it writes is a valid GGUF whose table matches the plan, whose
//! blocks dequantize (with the quant layer, which tests/quant.rs checks against gguf-py) to the
//! intended spread, and whose metadata the engine's config reads back as the shapes it was
//! given. The generator is compiled into this test from xtask's source (xtask is a binary crate).

#[allow(dead_code)]
#[path = "../xtask/src/synth.rs"]
mod synth;

use std::path::PathBuf;

use mla_engine::gguf::{GgmlType, GgufFile, Value};
use mla_engine::quant;
use synth::{Shape, Spec, SynthArch};

fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mla-synth-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn tiny(arch: SynthArch, layers: usize, nextn: usize, mix: GgmlType) -> Spec {
    // Five dense layers asked for: capped at layers - 1.
    Spec {
        arch,
        shape: Shape::tiny(arch),
        n_layer: layers,
        n_dense: 5,
        n_nextn: nextn,
        mix,
        seed: 7,
    }
}

/// Mean and standard deviation of `values`.
fn spread(values: &[f32]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = values
        .iter()
        .map(|&v| (v as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, var.sqrt())
}

/// Dequantizes a whole tensor of `file`.
fn values(file: &GgufFile, name: &str) -> Vec<f32> {
    let t = file
        .tensor(name)
        .unwrap_or_else(|| panic!("no tensor {name}"));
    let mut out = vec![0f32; t.n_elements() as usize];
    quant::dequantize(t.ggml_type, file.tensor_data(t), &mut out).unwrap();
    out
}

#[test]
fn writes_the_planned_table_with_the_intended_spread() {
    for (arch, nextn) in [(SynthArch::Deepseek2, 0), (SynthArch::GlmDsa, 1)] {
        let spec = tiny(arch, 3, nextn, GgmlType::Q4_K);
        let path = temp_path(&format!("{arch:?}.gguf"));
        let summary = synth::synthesize(&spec, &path, false).unwrap();
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(summary.file_bytes, std::fs::metadata(&path).unwrap().len());

        let plan = synth::plan(&spec);
        assert_eq!(file.tensors().len(), plan.len());
        for (t, p) in file.tensors().iter().zip(&plan) {
            assert_eq!((&t.name, t.ggml_type, &t.ne), (&p.name, p.ggml_type, &p.ne));
        }
        for (name, expected) in [
            // attn_k_b rows (32 or 64 elements) cannot hold Q4_K blocks: Q5_0, as quantizers do.
            ("blk.0.attn_k_b.weight", GgmlType::Q5_0),
            ("blk.2.ffn_up_exps.weight", GgmlType::Q4_K),
            ("output.weight", GgmlType::Q6_K),
            ("blk.2.ffn_gate_inp.weight", GgmlType::F32),
        ] {
            assert_eq!(file.tensor(name).unwrap().ggml_type, expected, "{name}");
        }

        // Five leading dense layers asked for, capped at N-1.
        let key = |k: &str| format!("{}.{k}", file.get_str("general.architecture").unwrap());
        assert_eq!(
            file.get_usize(&key("leading_dense_block_count")).unwrap(),
            2
        );
        assert_eq!(file.get_usize(&key("block_count")).unwrap(), 3 + nextn);
        assert!(file.tensor("blk.1.ffn_down.weight").is_some());
        assert!(file.tensor("blk.2.ffn_down_exps.weight").is_some());
        assert_eq!(
            file.tensor(&format!("blk.{}.nextn.eh_proj.weight", 3))
                .is_some(),
            nextn == 1
        );

        for t in &plan {
            let v = values(&file, &t.name);
            assert!(v.iter().all(|x| x.is_finite()), "{}", t.name);
            if v.len() < 4096 {
                continue; // too few values for a stable estimate
            }
            let (mean, std) = spread(&v);
            let want = t.fill.std as f64;
            assert!(
                (std / want - 1.0).abs() < 0.1,
                "{} ({}): std {std} for {want}",
                t.name,
                t.ggml_type
            );
            assert!(
                (mean - t.fill.mean as f64).abs() < 0.1 * want.max(0.1),
                "{}: mean {mean}",
                t.name
            );
        }
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn every_supported_mix_has_the_intended_spread() {
    for &mix in quant::SUPPORTED {
        if mix == GgmlType::F32 {
            continue;
        }
        let spec = tiny(SynthArch::Deepseek2, 2, 0, mix);
        let path = temp_path(&format!("mix-{mix}.gguf"));
        synth::synthesize(&spec, &path, false).unwrap();
        let file = GgufFile::open(&path).unwrap();
        // ffn_gate_exps: 16 experts of 256 rows of 256 (the mix itself); attn_k_b: its fallback.
        for name in ["blk.1.ffn_gate_exps.weight", "blk.0.attn_k_b.weight"] {
            let t = file.tensor(name).unwrap();
            let (mean, std) = spread(&values(&file, name));
            let want = 1.0 / (t.ne[0] as f64).sqrt();
            assert!(
                (std / want - 1.0).abs() < 0.1,
                "{mix} {name} ({}): std {std} for {want}",
                t.ggml_type
            );
            assert!(mean.abs() < 0.1 * want, "{mix} {name}: mean {mean}");
        }
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn same_seed_same_bytes() {
    let spec = tiny(SynthArch::GlmDsa, 2, 0, GgmlType::IQ4_XS);
    let (a, b) = (temp_path("seed-a.gguf"), temp_path("seed-b.gguf"));
    synth::synthesize(&spec, &a, false).unwrap();
    synth::synthesize(&spec, &b, false).unwrap();
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap());
    synth::synthesize(&Spec { seed: 8, ..spec }, &b, false).unwrap();
    assert!(std::fs::read(&a).unwrap() != std::fs::read(&b).unwrap());
    std::fs::remove_file(&a).unwrap();
    std::fs::remove_file(&b).unwrap();
}

#[test]
fn tokenizer_metadata_is_a_consistent_gpt2_bpe() {
    let spec = tiny(SynthArch::Deepseek2, 2, 0, GgmlType::Q8_0);
    let path = temp_path("tokenizer.gguf");
    synth::synthesize(&spec, &path, false).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    let tokens: Vec<&str> = file
        .get_array("tokenizer.ggml.tokens")
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), spec.shape.n_vocab);
    assert_eq!(
        file.tensor("token_embd.weight").unwrap().ne[1] as usize,
        tokens.len()
    );
    let unique: std::collections::HashSet<_> = tokens.iter().collect();
    assert_eq!(unique.len(), tokens.len(), "token strings are unique");
    // Each merge joins two tokens into a third, all in the vocabulary.
    let merges = file.get_array("tokenizer.ggml.merges").unwrap();
    assert!(merges.len() > 50);
    for m in merges {
        let (a, b) = m.as_str().unwrap().split_once(' ').unwrap();
        for piece in [a.to_string(), b.to_string(), format!("{a}{b}")] {
            assert!(
                unique.contains(&piece.as_str()),
                "merge {m}: {piece} not a token"
            );
        }
    }
    assert_eq!(
        file.get("tokenizer.ggml.bos_token_id"),
        Some(&Value::U32(0))
    );
    assert!(file
        .get_str("tokenizer.chat_template")
        .unwrap()
        .contains("<｜Assistant｜>"));
    std::fs::remove_file(&path).unwrap();
}

/// The full-width plans: the shapes of ../shared/REFERENCE.md and the fallbacks it lists.
#[test]
fn full_width_plans_have_the_reference_shapes() {
    let ds = Spec {
        arch: SynthArch::Deepseek2,
        shape: Shape::deepseek_v3(),
        n_layer: 4,
        n_dense: 1,
        n_nextn: 0,
        mix: GgmlType::Q4_K,
        seed: 0,
    };
    let plan = synth::plan(&ds);
    let find =
        |plan: &[synth::Planned], n: &str| plan.iter().find(|t| t.name == n).unwrap().clone();
    assert_eq!(
        find(&plan, "blk.3.ffn_down_exps.weight").ne,
        [2048, 7168, 256]
    );
    assert_eq!(find(&plan, "blk.0.ffn_up.weight").ne, [7168, 18432]);
    assert_eq!(find(&plan, "blk.0.attn_q_b.weight").ne, [1536, 128 * 192]);
    assert_eq!(find(&plan, "blk.0.attn_k_b.weight").ne, [128, 512, 128]);
    assert_eq!(find(&plan, "token_embd.weight").ne, [7168, 129280]);
    assert!(
        plan.iter().all(|t| !t.name.starts_with("blk.1.ffn_up.")),
        "1 dense + 3 MoE"
    );
    let glm = Spec {
        arch: SynthArch::GlmDsa,
        shape: Shape::glm5(),
        mix: GgmlType::IQ4_XS,
        ..ds
    };
    let plan = synth::plan(&glm);
    assert_eq!(
        find(&plan, "blk.0.attn_k_b.weight").ggml_type,
        GgmlType::IQ4_NL
    );
    assert_eq!(find(&plan, "blk.0.attn_k_b.weight").ne, [192, 512, 64]);
    assert_eq!(
        find(&plan, "blk.3.indexer.attn_q_b.weight").ne,
        [2048, 32 * 128]
    );
    assert_eq!(find(&plan, "blk.0.attn_output.weight").ne, [64 * 256, 6144]);
    for (mix, fallback) in [
        (GgmlType::Q5_K, GgmlType::Q5_1),
        (GgmlType::Q6_K, GgmlType::Q8_0),
        (GgmlType::Q4_K, GgmlType::Q5_0),
    ] {
        assert_eq!(synth::fit_type(mix, 192), fallback);
    }
}

/// The engine reads the metadata back as the shapes the file was written with, builds its
/// tokenizer, and runs a prompt through every layer with logits of a sane size: the spread of
/// the weights keeps activations from vanishing or blowing up.
#[test]
fn the_engine_loads_and_runs_a_synthetic_file() {
    use mla_engine::backend::{cpu::Cpu, Backend};
    use mla_engine::config::{Gating, ModelConfig};
    use mla_engine::model::{Model, Taps};
    use mla_engine::tokenizer::Tokenizer;

    for arch in [SynthArch::Deepseek2, SynthArch::GlmDsa] {
        let spec = Spec {
            n_dense: 1,
            ..tiny(arch, 3, 1, GgmlType::Q4_K)
        };
        let s = &spec.shape;
        let path = temp_path(&format!("engine-{arch:?}.gguf"));
        synth::synthesize(&spec, &path, false).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let cfg = ModelConfig::from_gguf(&file).unwrap();
        assert_eq!((cfg.n_layer, cfg.n_nextn, cfg.n_dense_lead), (3, 1, 1));
        assert_eq!(
            (cfg.n_embd, cfg.n_head, cfg.q_lora, cfg.kv_lora),
            (s.n_embd, s.n_head, Some(s.q_lora), s.kv_lora)
        );
        assert_eq!(
            (cfg.head_dim_nope, cfg.head_dim_rope, cfg.head_dim_v),
            (s.dn, s.dr, s.dv)
        );
        assert_eq!((cfg.n_vocab, cfg.n_ff), (s.n_vocab, s.n_ff));
        let moe = cfg.moe.as_ref().unwrap();
        assert_eq!(
            (moe.n_expert, moe.n_used, moe.n_shared, moe.n_ff_expert),
            (16, 4, 1, 256)
        );
        assert_eq!(
            (moe.n_group, moe.n_group_used, moe.gating),
            (s.n_group, s.n_group_used, Gating::Sigmoid)
        );
        assert_eq!(cfg.yarn.is_some(), arch == SynthArch::Deepseek2);
        assert_eq!(
            cfg.indexer
                .as_ref()
                .map(|i| (i.n_head, i.head_dim, i.top_k)),
            s.indexer
        );

        let tokenizer = Tokenizer::from_gguf(&file).unwrap();
        let text = "In the beginning God created the heaven and the earth.";
        let ids = tokenizer.encode(text, false).unwrap();
        assert!(
            ids.len() < text.len(),
            "the merges shorten {text:?} to {ids:?}"
        );
        assert_eq!(tokenizer.decode(&ids), text);

        let model = Model::open(&path, Cpu).unwrap();
        let mut cache = model.new_cache(64);
        let logits = model
            .backend
            .download(&model.forward(&mut cache, &ids, &mut Taps::none()).unwrap());
        assert_eq!(logits.len(), ids.len() * s.n_vocab);
        let (_, std) = spread(&logits);
        assert!(logits.iter().all(|x| x.is_finite()));
        assert!((0.1..10.0).contains(&std), "{arch:?}: logits std {std}");
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn bad_arguments_are_refused_with_a_reason() {
    let args = |quant: &str, layers, vocab| synth::Args {
        arch: SynthArch::Deepseek2,
        layers,
        quant: quant.into(),
        dense: 1,
        nextn: 0,
        tiny: false,
        vocab,
        seed: 0,
        out: "never.gguf".into(),
    };
    let spec = Spec::from_args(&args("iq4_xs", 4, Some(4096))).unwrap();
    assert_eq!(
        (spec.mix, spec.shape.n_vocab, spec.shape.n_embd),
        (GgmlType::IQ4_XS, 4096, 7168)
    );
    for (a, message) in [
        (
            args("q9_k", 4, None),
            "--quant q9_k: expected one of F32, F16",
        ),
        (args("iq2_xxs", 4, None), "--quant iq2_xxs: expected one of"),
        (args("q4_k", 0, None), "--layers must be at least 1"),
        (args("q4_k", 4, Some(300)), "--vocab 300: at least 512"),
    ] {
        let err = Spec::from_args(&a).unwrap_err().to_string();
        assert!(err.contains(message), "{err}");
    }
}
