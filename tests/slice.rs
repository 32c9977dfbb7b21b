//! `cargo xtask slice`: a slice holds the input's tensors byte for byte under renumbered names,
//! consistent metadata, the tokenizer and chat template, and comes out the same from any shard
//! of a split set. The slicer (and the synthetic generator for inputs with MTP blocks) are
//! compiled in from xtask's source (xtask is a binary crate).

mod common;
#[allow(dead_code)]
#[path = "../xtask/src/slice.rs"]
mod slice;
#[allow(dead_code)]
#[path = "../xtask/src/synth.rs"]
mod synth;

use std::path::{Path, PathBuf};

use mla_engine::gguf::{split_shard_path, GgmlType, GgufFile, GgufWriter, Value};

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("golden/models")
        .join(name)
}

fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mla-slice-test-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every tensor of the slice is the input's tensor of the mapped name, same type, shape and
/// bytes; and every input tensor of a chosen layer or outside the layers is there.
fn assert_byte_exact(input: &GgufFile, out: &GgufFile, layers: &[usize]) {
    let mut expected = 0;
    for t in input.tensors() {
        let name = match t.name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((l, rest)) => match layers.iter().position(|&c| c.to_string() == l) {
                Some(new) => format!("blk.{new}.{rest}"),
                None => continue,
            },
            None => t.name.clone(),
        };
        expected += 1;
        let s = out
            .tensor(&name)
            .unwrap_or_else(|| panic!("{name} (from {}) missing", t.name));
        assert_eq!((s.ggml_type, &s.ne), (t.ggml_type, &t.ne), "{name}");
        assert!(
            out.tensor_data(s) == input.tensor_data(t),
            "{name}: bytes differ from {}",
            t.name
        );
    }
    assert_eq!(out.tensors().len(), expected);
}

#[test]
fn slice_of_a_golden_model_is_byte_exact_with_consistent_metadata() {
    let input_path = golden("ds3.q8_0.gguf");
    let input = GgufFile::open(&input_path).unwrap();
    let dir = temp_dir("golden");
    for layers in [vec![0, 2], vec![1], vec![0, 1, 2]] {
        let out_path = dir.join("slice.gguf");
        slice::slice(&input_path, &layers, &out_path).unwrap();
        let out = GgufFile::open(&out_path).unwrap();
        assert_byte_exact(&input, &out, &layers);

        let n_dense = layers.iter().filter(|&&l| l < 1).count(); // ds3 has 1 dense layer
        assert_eq!(
            out.get_usize("deepseek2.block_count").unwrap(),
            layers.len()
        );
        assert_eq!(
            out.get_usize("deepseek2.leading_dense_block_count")
                .unwrap(),
            n_dense
        );
        let chosen: Vec<Value> = layers.iter().map(|&l| Value::U32(l as u32)).collect();
        assert_eq!(
            out.get(slice::SLICE_LAYERS_KEY),
            Some(&Value::Array(chosen))
        );
        // Every other key (tokenizer and chat template included) is unchanged, in order.
        let rewritten = [
            "deepseek2.block_count",
            "deepseek2.leading_dense_block_count",
            slice::SLICE_LAYERS_KEY,
        ];
        let keep = |m: &[(String, Value)]| -> Vec<(String, Value)> {
            m.iter()
                .filter(|(k, _)| !rewritten.contains(&k.as_str()))
                .cloned()
                .collect()
        };
        assert_eq!(keep(out.metadata()), keep(input.metadata()));
        assert!(out.get_str("tokenizer.chat_template").is_ok());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes `input` as a split set of `count` shards (tensors dealt out in order, metadata on the
/// first shard only) and returns the shards' paths.
fn write_split(input: &GgufFile, prefix: &Path, count: usize) -> Vec<PathBuf> {
    let tensors = input.tensors();
    let per_shard = tensors.len().div_ceil(count);
    let mut paths = Vec::new();
    for (no, part) in tensors.chunks(per_shard).enumerate() {
        let path = split_shard_path(prefix, no, count);
        let mut w = GgufWriter::new(&path, 32).unwrap();
        w.add_split_keys(no, count, tensors.len()).unwrap();
        if no == 0 {
            for (k, v) in input.metadata() {
                w.add_kv(k, v.clone()).unwrap();
            }
        }
        for t in part {
            w.add_tensor(&t.name, t.ggml_type, &t.ne).unwrap();
        }
        for t in part {
            w.write_tensor(&t.name, input.tensor_data(t)).unwrap();
        }
        w.finish().unwrap();
        paths.push(path);
    }
    assert_eq!(paths.len(), count);
    paths
}

#[test]
fn any_shard_of_a_split_set_gives_the_same_slice() {
    let dir = temp_dir("split");
    let single = golden("ds3.q8_0.gguf");
    let input = GgufFile::open(&single).unwrap();
    let shards = write_split(&input, &dir.join("ds3"), 3);
    let from_single = dir.join("from-single.gguf");
    slice::slice(&single, &[0, 2], &from_single).unwrap();
    let expected = std::fs::read(&from_single).unwrap();
    for shard in &shards {
        let out = dir.join("from-shard.gguf");
        slice::slice(shard, &[0, 2], &out).unwrap();
        let sliced = GgufFile::open(&out).unwrap();
        assert!(sliced.get("split.count").is_none() && sliced.get("split.no").is_none());
        assert!(
            std::fs::read(&out).unwrap() == expected,
            "slice of {} differs",
            shard.display()
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn mtp_blocks_and_their_key_are_dropped() {
    let dir = temp_dir("mtp");
    let input_path = dir.join("glm.gguf");
    let spec = synth::Spec {
        arch: synth::SynthArch::GlmDsa,
        shape: synth::Shape::tiny(synth::SynthArch::GlmDsa),
        n_layer: 3,
        n_dense: 1,
        n_nextn: 1,
        mix: GgmlType::Q8_0,
        seed: 1,
    };
    synth::synthesize(&spec, &input_path, false).unwrap();
    let input = GgufFile::open(&input_path).unwrap();
    assert!(input.tensor("blk.3.nextn.eh_proj.weight").is_some());

    let out_path = dir.join("slice.gguf");
    slice::slice(&input_path, &[0, 2], &out_path).unwrap();
    let out = GgufFile::open(&out_path).unwrap();
    assert_byte_exact(&input, &out, &[0, 2]);
    assert!(out.get("glm-dsa.nextn_predict_layers").is_none());
    assert!(out
        .tensors()
        .iter()
        .all(|t| !t.name.contains("nextn") && !t.name.starts_with("blk.2.")));
    assert_eq!(out.get_usize("glm-dsa.block_count").unwrap(), 2);
    assert_eq!(
        out.get_usize("glm-dsa.leading_dense_block_count").unwrap(),
        1
    );

    let err = slice::slice(&input_path, &[0, 3], &out_path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layer 3 is out of range") && err.contains("MTP"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_layer_lists_are_refused_with_a_reason() {
    let input = golden("ds3.q8_0.gguf");
    let out = temp_dir("errors").join("never.gguf");
    let cases: [(&[usize], &str); 4] = [
        (&[], "--layers is empty"),
        (
            &[0, 3],
            "layer 3 is out of range: the model has layers 0..3",
        ),
        (&[1, 1], "layer 1 is chosen twice"),
        (&[2, 0], "must be increasing"),
    ];
    for (layers, message) in cases {
        let err = slice::slice(&input, layers, &out).unwrap_err().to_string();
        assert!(
            err.contains(message) && err.contains("ds3.q8_0.gguf"),
            "{layers:?}: {err}"
        );
        assert!(!out.exists(), "{layers:?}: no output is written");
    }
}

/// Logits [tokens, V] of one prefill of `tokens` by the CPU engine.
fn logits(path: &Path, tokens: &[u32]) -> Vec<f32> {
    use mla_engine::backend::{cpu::Cpu, Backend};
    use mla_engine::model::{Model, Taps};
    let model = Model::open(path, Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut cache = model.new_cache(tokens.len());
    let out = model
        .forward(&mut cache, tokens, &mut Taps::none())
        .unwrap();
    model.backend.download(&out)
}

/// A slice of every layer is the same model: the engine gives the same logits, bit for bit. A
/// slice of some layers is a smaller valid model the engine runs.
#[rstest::rstest]
fn the_engine_runs_slices_of_golden_models(
    #[values("ds3.q8_0", "glm5.q8_0", "v2lite.q8_0")] variant: &str,
) {
    let input = common::model_path(variant);
    let n_layer = mla_engine::config::ModelConfig::from_gguf(&GgufFile::open(&input).unwrap())
        .unwrap()
        .n_layer;
    let tokens = common::ref_tokens(&common::load_ref(variant, 1));
    let dir = temp_dir(&format!("engine-{variant}"));
    let all = dir.join("all.gguf");
    let every_layer: Vec<usize> = (0..n_layer).collect();
    slice::slice(&input, &every_layer, &all).unwrap();
    assert!(
        logits(&all, &tokens) == logits(&input, &tokens),
        "{variant}: logits of the full slice differ"
    );

    let some = dir.join("some.gguf");
    let first_and_last = [0, n_layer - 1];
    slice::slice(&input, &first_and_last, &some).unwrap();
    let out = logits(&some, &tokens);
    assert!(out.iter().all(|x| x.is_finite()));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// glm5's DSA layers [full, shared, full]: the types array follows the chosen layers, and a
/// slice may not start with a layer that has no indexer of its own.
#[test]
fn indexer_types_follow_the_chosen_layers() {
    let input = common::model_path("glm5.q8_0");
    let source = GgufFile::open(&input).unwrap();
    let types = source
        .get_array("glm-dsa.attention.indexer.types")
        .unwrap()
        .to_vec();
    assert_eq!(
        types,
        [Value::Bool(true), Value::Bool(false), Value::Bool(true)]
    );
    let dir = temp_dir("indexer-types");
    let out = dir.join("slice.gguf");
    slice::slice(&input, &[0, 1], &out).unwrap();
    let sliced = GgufFile::open(&out).unwrap();
    assert_eq!(
        sliced.get_array("glm-dsa.attention.indexer.types").unwrap(),
        &types[..2]
    );
    assert_byte_exact(&source, &sliced, &[0, 1]);
    let err = slice::slice(&input, &[1, 2], &out).unwrap_err().to_string();
    assert!(
        err.contains("layer 1 reuses the DSA indexer top-k"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
