//! Opening a ~50 GB, 5-shard split set costs what reading its headers costs: the tensor data is
//! mapped, not read. The set is written as sparse files (headers and tables written, data left
//! as holes), so it takes almost no disk space.
//!
//! Ignored by default (it writes 50 GB of apparent file size). Run it with
//!     cargo nextest run --release --test gguf_large --run-ignored only --no-capture

mod gguf_support;

use std::process::Command;
use std::time::Instant;

use gguf_support::scratch_dir;
use mla_engine::gguf::{split_shard_path, GgmlType, GgufFile, GgufWriter, Value};

const SHARDS: usize = 5;
const LAYERS_PER_SHARD: usize = 5;
/// DeepSeek-V3-like widths; 80 experts per layer makes each shard about 10 GB.
const HIDDEN: u64 = 7168;
const EXPERT_FFN: u64 = 2048;
const EXPERTS: u64 = 80;
const Q_LORA: u64 = 1536;
const VOCAB: usize = 129280;

/// A field of /proc/self/status in KiB ("VmHWM", "VmRSS").
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The first field of the last line a shell tool (df, du) prints about `dir`.
fn tool(cmd: &str, args: &[&str], dir: &std::path::Path) -> String {
    let out = Command::new(cmd).args(args).arg(dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or("");
    last.split_whitespace().next().unwrap_or("").to_string()
}

#[test]
#[ignore = "writes a 50 GB sparse split set; run explicitly"]
fn open_50gb_split_set_reads_only_headers() {
    let dir = scratch_dir("large");
    let free_kib: u64 = tool("df", &["-k", "--output=avail"], &dir).parse().unwrap();
    println!("free disk: {} GiB", free_kib >> 20);
    assert!(
        free_kib > 1 << 20,
        "need 1 GiB free for the headers and page rounding"
    );

    let n_tensors = SHARDS * LAYERS_PER_SHARD * 5;
    let t = Instant::now();
    for no in 0..SHARDS {
        let mut w = GgufWriter::new(split_shard_path(dir.join("big"), no, SHARDS), 32).unwrap();
        if no == 0 {
            w.add_kv("general.architecture", Value::String("deepseek2".into()))
                .unwrap();
            let tokens = (0..VOCAB)
                .map(|i| Value::String(format!("tok{i}")))
                .collect();
            w.add_kv("tokenizer.ggml.tokens", Value::Array(tokens))
                .unwrap();
        }
        w.add_split_keys(no, SHARDS, n_tensors).unwrap();
        let mut names = Vec::new();
        for layer in no * LAYERS_PER_SHARD..(no + 1) * LAYERS_PER_SHARD {
            let tensors: [(&str, GgmlType, Vec<u64>); 5] = [
                ("attn_norm", GgmlType::F32, vec![HIDDEN]),
                ("attn_q_a", GgmlType::Q8_0, vec![HIDDEN, Q_LORA]),
                (
                    "ffn_gate_exps",
                    GgmlType::Q4_K,
                    vec![HIDDEN, EXPERT_FFN, EXPERTS],
                ),
                (
                    "ffn_up_exps",
                    GgmlType::Q4_K,
                    vec![HIDDEN, EXPERT_FFN, EXPERTS],
                ),
                (
                    "ffn_down_exps",
                    GgmlType::Q4_K,
                    vec![EXPERT_FFN, HIDDEN, EXPERTS],
                ),
            ];
            for (name, ty, ne) in tensors {
                let name = format!("blk.{layer}.{name}.weight");
                w.add_tensor(&name, ty, &ne).unwrap();
                names.push(name);
            }
        }
        for name in &names {
            w.skip_tensor(name).unwrap();
        }
        w.finish().unwrap();
    }
    println!(
        "wrote {SHARDS} sparse shards in {:.2?}; disk used: {} KiB",
        t.elapsed(),
        tool("du", &["-sk"], &dir)
    );

    let rss_before = status_kib("VmRSS");
    // Reset the peak (VmHWM) to the current RSS so it measures the open alone.
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let t = Instant::now();
    let f = GgufFile::open(split_shard_path(dir.join("big"), 2, SHARDS)).unwrap();
    let open_time = t.elapsed();
    let (rss_after, peak) = (status_kib("VmRSS"), status_kib("VmHWM"));

    let total: u64 = f.shards().iter().map(|s| s.file_size).sum();
    let headers: u64 = f.shards().iter().map(|s| s.data_offset).sum();
    println!(
        "opened {} shards, {} tensors, {:.1} GB in {open_time:.2?}; headers {} KiB; \
         RSS {rss_before} -> {rss_after} KiB, peak during open {peak} KiB (+{} KiB)",
        f.shards().len(),
        f.tensors().len(),
        total as f64 / 1e9,
        headers >> 10,
        peak - rss_before,
    );
    assert_eq!(f.tensors().len(), n_tensors);
    assert_eq!(f.get_array("tokenizer.ggml.tokens").unwrap().len(), VOCAB);
    assert!(total > 49_000_000_000, "{total}");
    // The tokens array (the bulk of the headers) becomes ~130k small Strings; everything else
    // is a few KiB. 50 GB of data must add nothing: allow 64 MiB over the headers.
    assert!(
        (peak - rss_before) << 10 < headers + (64 << 20),
        "peak grew by {} KiB",
        peak - rss_before
    );

    // The data is there to read (zeros from the holes), and reading one tensor touches only it.
    let last = f.tensor("blk.24.ffn_down_exps.weight").unwrap();
    assert_eq!(last.shard, 4);
    assert!(f.tensor_data(last)[..1 << 20].iter().all(|&b| b == 0));
    drop(f);
    std::fs::remove_dir_all(dir).unwrap();
}
