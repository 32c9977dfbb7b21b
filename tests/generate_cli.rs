//! The `generate` binary, run as a user would: bad input gives one clear line and exit code 1
//! (never a panic), --logits-out writes [n_tokens, vocab] float32, --trace + diff find no
//! divergence against the golden reference and name the first stage against another file.

mod common;

use common::*;
use mla_engine::trace::{relative_error, Trace};
use std::path::PathBuf;
use std::process::{Command, Output};

fn generate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_generate"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run generate")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mla-engine-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Exit code 1 and a single `error: ...` line containing `expected`.
fn assert_clear_error(o: &Output, expected: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "stderr: {err}");
    assert!(
        lines[0].contains(expected),
        "expected {expected:?} in {err}"
    );
}

fn ds3_tokens() -> (Vec<u32>, String) {
    let tokens = ref_tokens(&load_ref("ds3.q8_0", 0));
    let text = tokens
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    (tokens, text)
}

#[test]
fn prompt_on_the_embedded_model_streams_text_and_reports_speed() {
    let o = generate(&["--prompt", "In the beginning", "--max-tokens", "8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("In the beginning"));
    let err = stderr(&o);
    assert!(
        err.contains("prompt: ") && err.contains("tok/s") && err.contains("GB/s"),
        "{err}"
    );
}

#[test]
fn same_seed_same_text() {
    let args = [
        "--prompt",
        "And God said",
        "--max-tokens",
        "12",
        "--temperature",
        "0.9",
        "--seed",
        "4",
    ];
    assert_eq!(generate(&args).stdout, generate(&args).stdout);
}

#[test]
fn empty_prompt_is_refused() {
    assert_clear_error(&generate(&["--prompt", ""]), "the prompt is empty");
}

#[test]
fn prompt_longer_than_the_context_is_refused() {
    let long = "and the earth was without form ".repeat(40);
    assert_clear_error(&generate(&["--prompt", &long]), "longer than the context");
}

#[test]
fn token_id_out_of_range_is_refused() {
    assert_clear_error(
        &generate(&["--tokens", "1,2,5000"]),
        "token id 5000 at position 2 is out of range",
    );
    assert_clear_error(&generate(&["--tokens", "1,x"]), "is not a token id");
}

#[test]
fn unsupported_architecture_is_refused() {
    // A minimal GGUF v3: no tensors, one key general.architecture = "llama".
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes()); // tensors
    b.extend_from_slice(&1u64.to_le_bytes()); // keys
    let key = b"general.architecture";
    b.extend_from_slice(&(key.len() as u64).to_le_bytes());
    b.extend_from_slice(key);
    b.extend_from_slice(&8u32.to_le_bytes()); // string
    b.extend_from_slice(&5u64.to_le_bytes());
    b.extend_from_slice(b"llama");
    b.resize(b.len().div_ceil(32) * 32, 0); // the (empty) data section starts aligned
    let path = scratch("llama.gguf");
    std::fs::write(&path, b).unwrap();
    let o = generate(&["--model", path.to_str().unwrap(), "--prompt", "hi"]);
    assert_clear_error(&o, "architecture \"llama\" is not supported");
}

#[test]
fn missing_model_file_is_refused() {
    let o = generate(&["--model", "no/such/file.gguf", "--prompt", "hi"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(!stderr(&o).contains("panicked"));
}

#[test]
fn logits_out_is_float32_n_tokens_by_vocab_and_matches_the_reference() {
    let (tokens, text) = ds3_tokens();
    let out = scratch("logits.npy");
    let o = generate(&[
        "--model",
        "golden/models/ds3.q8_0.gguf",
        "--tokens",
        &text,
        "--logits-out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(header.contains("'descr': '<f4'"), "{header}");
    assert!(
        header.contains(&format!("'shape': ({}, 1000)", tokens.len())),
        "{header}"
    );
    assert_eq!((10 + header_len) % 64, 0);
    let values: Vec<f32> = bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let reference = load_ref("ds3.q8_0", 0);
    let expected = reference.get("logits").unwrap().f32().unwrap();
    assert_eq!(values.len(), expected.len());
    assert!(relative_error(&values, expected) < 1e-5);
}

#[test]
fn trace_then_diff_against_the_reference_and_another_file() {
    let (_, text) = ds3_tokens();
    let ours = scratch("q8_0.safetensors");
    let other = scratch("q4_k_m.safetensors");
    for (model, path) in [("ds3.q8_0", &ours), ("ds3.q4_k_m", &other)] {
        let o = generate(&[
            "--model",
            &format!("golden/models/{model}.gguf"),
            "--tokens",
            &text,
            "--trace",
            path.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let trace = Trace::load(&ours).unwrap();
    assert!(trace.get("L2.moe_out").is_some() && trace.get("logits").is_some());

    let reference = ref_path("ds3.q8_0", 0);
    let o = generate(&[
        "diff",
        ours.to_str().unwrap(),
        reference.to_str().unwrap(),
        "--threshold",
        "1e-5",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.contains("no stage beyond"), "{out}");
    assert!(
        out.find("embed").unwrap() < out.find("L0.attn_norm").unwrap(),
        "forward order: {out}"
    );

    let o = generate(&[
        "diff",
        other.to_str().unwrap(),
        ours.to_str().unwrap(),
        "--threshold",
        "1e-3",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("first divergence beyond 1e-3: "), "{out}");
}

#[test]
fn help_explains_every_flag() {
    let o = generate(&["--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    for flag in [
        "--prompt",
        "--model",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--seed",
        "--chat",
        "--backend",
        "--tp",
        "--tokens",
        "--logits-out",
        "--trace",
        "diff",
        "inspect",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
}

#[test]
fn inspect_describes_the_file() {
    let o = generate(&["inspect", "golden/models/glm5.q8_0.gguf"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success());
    assert!(out.contains("architecture  glm-dsa"), "{out}");
    assert!(
        out.contains("DSA indexer: ") && out.contains("top 8, full layers [0, 2]"),
        "{out}"
    );
    assert!(out.contains("Q8_0"), "{out}");
}
