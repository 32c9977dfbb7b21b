//! Known traps, on golden files rewritten with one thing changed: the engine must either run
//! them right (with a warning) or refuse them with one clear sentence.

mod common;

use common::*;
use mla_engine::backend::cpu::Cpu;
use mla_engine::config::{Gating, ModelConfig};
use mla_engine::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use mla_engine::model::Model;
use mla_engine::trace::{compare, Comparison};
use std::path::{Path, PathBuf};

/// Copies `src` to a scratch file without the keys in `drop`, with `retype` changing one
/// tensor to another type (its bytes zeroed).
fn rewrite(src: &Path, name: &str, drop: &[&str], retype: Option<(&str, GgmlType)>) -> PathBuf {
    rewrite_with(src, name, drop, &[], &[], retype)
}

/// `rewrite`, also setting the keys `set` and adding zero-filled F32 tensors `extra`.
fn rewrite_with(
    src: &Path,
    name: &str,
    drop: &[&str],
    set: &[(&str, Value)],
    extra: &[(&str, Vec<u64>)],
    retype: Option<(&str, GgmlType)>,
) -> PathBuf {
    let file = GgufFile::open(src).unwrap();
    let dir = std::env::temp_dir().join(format!("mla-engine-traps-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dst = dir.join(name);
    let mut w = GgufWriter::new(&dst, 32).unwrap();
    for (k, v) in file.metadata() {
        let replaced = set.iter().any(|(key, _)| key == k);
        if !drop.contains(&k.as_str()) && !replaced && k != "general.alignment" {
            w.add_kv(k, v.clone()).unwrap();
        }
    }
    for (k, v) in set {
        w.add_kv(k, v.clone()).unwrap();
    }
    let ty = |t: &mla_engine::gguf::TensorInfo| match retype {
        Some((n, ty)) if n == t.name => ty,
        _ => t.ggml_type,
    };
    for t in file.tensors() {
        w.add_tensor(&t.name, ty(t), &t.ne).unwrap();
    }
    for (n, ne) in extra {
        w.add_tensor(n, GgmlType::F32, ne).unwrap();
    }
    w.write_header().unwrap();
    for t in file.tensors() {
        if ty(t) == t.ggml_type {
            w.write_tensor(&t.name, file.tensor_data(t)).unwrap();
        } else {
            let n = mla_engine::gguf::tensor_bytes(ty(t), &t.ne).unwrap();
            w.write_tensor(&t.name, &vec![0u8; n as usize]).unwrap();
        }
    }
    for (n, ne) in extra {
        w.write_tensor(n, &vec![0u8; 4 * ne.iter().product::<u64>() as usize])
            .unwrap();
    }
    w.finish().unwrap();
    dst
}

/// A DeepSeek-V3 file converted from a config.json without `scoring_func` has no
/// expert_gating_func. Softmax (llama.cpp's default) would be garbage: the engine sees the
/// selection bias, uses sigmoid, warns, and still matches the reference at every stage.
#[test]
fn missing_gating_func_with_selection_bias_uses_sigmoid_and_warns() {
    let path = rewrite(
        &model_path("ds3.q8_0"),
        "no-gating.gguf",
        &["deepseek2.expert_gating_func"],
        None,
    );
    let file = GgufFile::open(&path).unwrap();
    assert!(file.get("deepseek2.expert_gating_func").is_none());
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    assert_eq!(cfg.moe.as_ref().unwrap().gating, Gating::Sigmoid);
    assert!(
        cfg.warnings
            .iter()
            .any(|w| w.contains("expert_gating_func is missing")),
        "{:?}",
        cfg.warnings
    );

    let model = Model::open(&path, Cpu).unwrap();
    let reference = load_ref("ds3.q8_0", 0);
    let ours = traced_prefill(&model, &ref_tokens(&reference));
    for (name, cmp) in compare(&ours, &reference) {
        match cmp {
            Comparison::Relative(e) => assert!(e < 1e-5, "{name}: {e:.2e}"),
            other => assert!(!other.diverges(0.0), "{name}: {other:?}"),
        }
    }
}

#[test]
fn unsupported_tensor_type_is_refused_naming_the_tensor() {
    let tensor = "blk.1.ffn_gate_exps.weight";
    let path = rewrite(
        &model_path("ds3.q8_0"),
        "iq2.gguf",
        &[],
        Some((tensor, GgmlType::IQ2_XXS)),
    );
    let err = Model::open(&path, Cpu)
        .err()
        .expect("IQ2_XXS is not supported")
        .to_string();
    assert!(
        err.contains(tensor) && err.contains("IQ2_XXS") && err.contains("not supported"),
        "{err}"
    );
}

#[test]
fn unsupported_architecture_is_refused() {
    let src = model_path("ds3.q8_0");
    let file = GgufFile::open(&src).unwrap();
    let dir = std::env::temp_dir().join(format!("mla-engine-traps-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dst = dir.join("qwen.gguf");
    let mut w = GgufWriter::new(&dst, 32).unwrap();
    w.add_kv("general.architecture", Value::String("qwen2".into()))
        .unwrap();
    w.write_header().unwrap();
    w.finish().unwrap();
    drop(file);
    let err = ModelConfig::from_gguf(&GgufFile::open(&dst).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "architecture \"qwen2\" is not supported: this engine runs deepseek2 and glm-dsa"
        ),
        "{err}"
    );
}

/// GLM-5 files count the MTP (nextn) block in block_count. The engine runs only the real
/// layers: a file declaring one more block as nextn, with that block's tensors present, gives
/// the same stages as the original.
#[test]
fn nextn_layers_are_skipped() {
    let src = model_path("glm5.q8_0");
    let n_layer = ModelConfig::from_gguf(&GgufFile::open(&src).unwrap())
        .unwrap()
        .n_layer;
    let e = 256u64;
    let path = rewrite_with(
        &src,
        "glm5-mtp.gguf",
        &[],
        &[
            ("glm-dsa.block_count", Value::U32(n_layer as u32 + 1)),
            ("glm-dsa.nextn_predict_layers", Value::U32(1)),
        ],
        &[
            (
                &format!("blk.{n_layer}.nextn.eh_proj.weight"),
                vec![2 * e, e],
            ),
            (&format!("blk.{n_layer}.attn_norm.weight"), vec![e]),
        ],
        None,
    );
    let model = Model::open(&path, Cpu).unwrap();
    assert_eq!((model.cfg.n_layer, model.cfg.n_nextn), (n_layer, 1));
    let reference = load_ref("glm5.q8_0", 0);
    let ours = traced_prefill(&model, &ref_tokens(&reference));
    for (name, cmp) in compare(&ours, &reference) {
        assert!(!cmp.diverges(1e-5), "{name}: {cmp:?}");
    }
}
