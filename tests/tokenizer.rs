//! The tokenizer rebuilt from each golden GGUF's metadata against the ids HF's tokenizer gives
//! (golden/tokenizer_cases.json), exactly; and the chat template rendered by minijinja against
//! transformers' `apply_chat_template`.

mod common;

use common::*;
use mla_engine::gguf::GgufFile;
use mla_engine::tokenizer::{render_chat, Message, Tokenizer};
use rstest::rstest;

fn cases() -> serde_json::Value {
    let path = golden_dir().join("tokenizer_cases.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[rstest]
fn ids_match_the_hf_tokenizer(#[values("ds3", "glm5", "v2lite")] model: &str) {
    let file = GgufFile::open(model_path(&format!("{model}.q8_0"))).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let all = cases();
    let entry = &all[model];
    let mut failures = Vec::new();
    for case in entry["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let expected = ids(&case["ids"]);
        let ours = tok.encode(text, false).unwrap();
        if ours != expected {
            failures.push(format!("{text:?}: ours {ours:?}, HF {expected:?}"));
        }
    }
    assert!(failures.is_empty(), "{model}:\n{}", failures.join("\n"));

    // BOS: added in front of a prompt exactly when HF adds it.
    let with_bos = tok.encode("x", true).unwrap();
    let without = tok.encode("x", false).unwrap();
    assert_eq!(
        with_bos.len() > without.len(),
        entry["add_bos"].as_bool().unwrap()
    );
    if entry["add_bos"].as_bool().unwrap() {
        assert_eq!(with_bos[0] as u64, entry["bos_id"].as_u64().unwrap());
    }
    assert_eq!(tok.eos.map(|e| e as u64), entry["eos_id"].as_u64());
}

#[rstest]
fn chat_template_renders_like_transformers(#[values("ds3", "glm5")] model: &str) {
    let file = GgufFile::open(model_path(&format!("{model}.q8_0"))).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let template = file.get_str("tokenizer.chat_template").unwrap();
    let all = cases();
    let chat = &all[model]["chat"];
    let messages: Vec<Message> = serde_json::from_value(chat["messages"].clone()).unwrap();
    let text = render_chat(
        template,
        &messages,
        chat["add_generation_prompt"].as_bool().unwrap(),
        &tok,
    )
    .unwrap();
    assert_eq!(text, chat["text"].as_str().unwrap());
    assert_eq!(tok.encode(&text, false).unwrap(), ids(&chat["ids"]));
}
