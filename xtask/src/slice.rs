//! `cargo xtask slice IN.gguf --layers 0,1,5 -o OUT.gguf`: a few layers of a real model as a
//! model of its own.
//!
//! The slice keeps every tensor outside the layers (token embedding, output norm, head) and the
//! chosen layers, renumbered 0..k-1 in the order chosen (which must be increasing, so the dense
//! layers stay in front). Tensors are copied byte for byte, same type and shape. The metadata is
//! the input's, rewritten where the layer set shows through:
//!
//! - `{arch}.block_count` is k; `{arch}.leading_dense_block_count` counts the chosen dense
//!   layers;
//! - per-layer arrays under `{arch}.` (one entry per block, such as glm-dsa's
//!   `attention.indexer.types`) keep the chosen layers' entries;
//! - the MTP (nextn) blocks and `{arch}.nextn_predict_layers` are dropped: a slice has no MTP
//!   head;
//! - `split.*` is dropped (the slice is one file); `general.alignment` is kept;
//! - `mla_engine.slice.layers` records the chosen layers' indices in the input.
//!
//! The tokenizer and the chat template are metadata like any other, so they come along.
//!
//! Any shard of a split set opens the whole set. Tensor bytes are read with positioned reads in
//! chunks of [`CHUNK`] bytes and streamed into `GgufWriter`, so memory is one chunk, whatever
//! the size of the input.

use mla_engine::weights::layer_of;
use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mla_engine::gguf::{GgufFile, GgufWriter, Value, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Input GGUF (any shard of a split set).
    pub input: PathBuf,
    /// Layers to keep, in increasing order, comma-separated: 0,1,5.
    #[arg(long, value_delimiter = ',', required = true)]
    pub layers: Vec<usize>,
    /// Output file.
    #[arg(short, long)]
    pub out: PathBuf,
}

/// Records which input layers a slice holds.
pub const SLICE_LAYERS_KEY: &str = "mla_engine.slice.layers";

/// Bytes copied at a time.
const CHUNK: usize = 16 << 20;

/// What a slice holds.
#[derive(Clone, Debug)]
pub struct Summary {
    pub n_tensors: usize,
    pub bytes_copied: u64,
    pub seconds: f64,
}

/// Checks the chosen layers against the `n_layer` transformer layers of `input`
/// (`n_nextn` MTP blocks follow them).
fn check_layers(input: &Path, layers: &[usize], n_layer: usize, n_nextn: usize) -> Result<()> {
    let input = input.display();
    if layers.is_empty() {
        bail!("{input}: --layers is empty: choose at least one of the layers 0..{n_layer}");
    }
    for (i, &l) in layers.iter().enumerate() {
        if l >= n_layer {
            let mtp = if l < n_layer + n_nextn {
                " (it is an MTP block, which a slice drops)"
            } else {
                ""
            };
            bail!("{input}: layer {l} is out of range: the model has layers 0..{n_layer}{mtp}");
        }
        if layers[..i].contains(&l) {
            bail!("{input}: layer {l} is chosen twice in --layers {layers:?}");
        }
        if i > 0 && layers[i - 1] > l {
            bail!("{input}: --layers {layers:?} must be increasing (dense layers come first)");
        }
    }
    Ok(())
}

/// The slice's metadata: the input's, rewritten for the chosen layers (see the module doc).
fn metadata(file: &GgufFile, input: &Path, layers: &[usize]) -> Result<Vec<(String, Value)>> {
    let arch = file.get_str("general.architecture")?.to_string();
    let key = |name: &str| format!("{arch}.{name}");
    let block_count = file.get_usize(&key("block_count"))?;
    let n_nextn = match file.get(&key("nextn_predict_layers")) {
        Some(_) => file.get_usize(&key("nextn_predict_layers"))?,
        None => 0,
    };
    let n_layer = block_count.checked_sub(n_nextn).with_context(|| {
        format!(
            "{}: {n_nextn} nextn layers but only {block_count} blocks",
            input.display()
        )
    })?;
    check_layers(input, layers, n_layer, n_nextn)?;

    let mut out = Vec::new();
    for (k, value) in file.metadata() {
        let value = match k.as_str() {
            SPLIT_NO | SPLIT_COUNT | SPLIT_TENSORS_COUNT => continue,
            _ if *k == key("nextn_predict_layers") => continue,
            _ if *k == key("block_count") => Value::U32(layers.len() as u32),
            _ if *k == key("leading_dense_block_count") => {
                let n_dense = file.get_usize(k)?;
                Value::U32(layers.iter().filter(|&&l| l < n_dense).count() as u32)
            }
            _ if k.starts_with(&format!("{arch}.")) => match value {
                // One entry per block (or per transformer layer): keep the chosen ones.
                Value::Array(items) if items.len() == block_count || items.len() == n_layer => {
                    Value::Array(layers.iter().map(|&l| items[l].clone()).collect())
                }
                _ => value.clone(),
            },
            _ => value.clone(),
        };
        out.push((k.clone(), value));
    }
    if let Some(Value::Array(types)) = out
        .iter()
        .find(|(k, _)| *k == key("attention.indexer.types"))
        .map(|(_, v)| v)
    {
        if types.first() == Some(&Value::Bool(false))
            || types.first().and_then(Value::as_integer) == Some(0)
        {
            bail!(
                "{}: layer {} reuses the DSA indexer top-k of an earlier layer and has no indexer \
                 of its own, so it cannot be a slice's first layer: start with a layer that runs \
                 its own indexer (layer 0 does)",
                input.display(),
                layers[0]
            );
        }
    }
    let chosen = layers.iter().map(|&l| Value::U32(l as u32)).collect();
    out.push((SLICE_LAYERS_KEY.into(), Value::Array(chosen)));
    Ok(out)
}

/// Writes the slice of `input` holding `layers` to `out`.
pub fn slice(input: &Path, layers: &[usize], out: &Path) -> Result<Summary> {
    let started = Instant::now();
    let file = GgufFile::open(input)?;
    let metadata = metadata(&file, input, layers)?;

    // (input tensor, name in the slice), in the input's order.
    let mut kept = Vec::new();
    let mut names = HashSet::new();
    for t in file.tensors() {
        let name = match layer_of(&t.name) {
            Some((l, rest)) => match layers.iter().position(|&c| c == l) {
                Some(new) => format!("blk.{new}.{rest}"),
                None => continue,
            },
            None => t.name.clone(),
        };
        names.insert(name.clone());
        kept.push((t, name));
    }
    for (i, &l) in layers.iter().enumerate() {
        if !names
            .iter()
            .any(|n| layer_of(n).is_some_and(|(j, _)| j == i))
        {
            bail!(
                "{}: no tensor of layer {l} (blk.{l}.*) in the file",
                input.display()
            );
        }
    }

    let mut writer = GgufWriter::new(out, file.shards()[0].alignment)?;
    for (key, value) in metadata {
        writer.add_kv(&key, value)?;
    }
    for (t, name) in &kept {
        writer.add_tensor(name, t.ggml_type, &t.ne)?;
    }

    let shard_files = file
        .shards()
        .iter()
        .map(|s| File::open(&s.path).with_context(|| format!("opening {}", s.path.display())))
        .collect::<Result<Vec<_>>>()?;
    let mut buf = vec![0u8; CHUNK];
    let mut bytes_copied = 0;
    for (t, name) in &kept {
        let shard = &file.shards()[t.shard];
        if t.n_bytes == 0 {
            writer.write_tensor(name, &[])?;
            continue;
        }
        let mut at = 0;
        while at < t.n_bytes {
            let len = (t.n_bytes - at).min(CHUNK as u64) as usize;
            shard_files[t.shard]
                .read_exact_at(&mut buf[..len], t.offset + at)
                .with_context(|| {
                    format!(
                        "{}: reading tensor {} at offset {}",
                        shard.path.display(),
                        t.name,
                        t.offset + at
                    )
                })?;
            writer.write_tensor_part(&buf[..len])?;
            at += len as u64;
        }
        bytes_copied += t.n_bytes;
    }
    writer.finish()?;
    Ok(Summary {
        n_tensors: kept.len(),
        bytes_copied,
        seconds: started.elapsed().as_secs_f64(),
    })
}

pub fn run(args: Args) -> Result<()> {
    let s = slice(&args.input, &args.layers, &args.out)?;
    println!(
        "slice: layers {:?} of {} -> {}: {} tensors, {:.2} GB in {:.1} s ({:.0} MB/s)",
        args.layers,
        args.input.display(),
        args.out.display(),
        s.n_tensors,
        s.bytes_copied as f64 / 1e9,
        s.seconds,
        s.bytes_copied as f64 / 1e6 / s.seconds.max(1e-9)
    );
    Ok(())
}
