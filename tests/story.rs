//! The embedded default model (`story`, trained by the golden pipeline on Genesis) continues
//! its prompts exactly as transformers does: the greedy ids in golden/manifest.json were
//! produced by transformers on the same GGUF's dequantized weights. Its full stage references
//! are not committed (size); the stage tests cover the same layout on `ds3`.

mod common;

use common::{greedy, load};

#[test]
fn story_greedy_continuations_match_transformers() {
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::golden_dir().join("manifest.json")).unwrap(),
    )
    .unwrap();
    let prompts = manifest["gguf"]["story.q8_0"]["prompts"]
        .as_array()
        .expect("story.q8_0 prompts in the manifest");
    assert!(!prompts.is_empty());
    let model = load("story.q8_0");
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    for p in prompts {
        let (tokens, expected) = (ids(&p["tokens"]), ids(&p["greedy"]));
        let ours = greedy(&model, &tokens, expected.len());
        assert_eq!(ours, expected, "prompt k={}", p["k"]);
    }
}
