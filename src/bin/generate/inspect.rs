//! `generate inspect FILE`: what the file is and what the engine will do with it.

use anyhow::Result;
use mla_engine::config::{KvLayout, ModelConfig};
use mla_engine::gguf::{GgmlType, GgufFile};
use std::collections::BTreeMap;
use std::path::Path;

/// Types with fewer than 5 bits per weight: too coarse for attn_k_b (MLA's keys).
fn below_5_bits(t: GgmlType) -> bool {
    t.block_size() > 1 && (t.type_size() * 8) < 5 * t.block_size()
}

pub fn run(path: &Path) -> Result<()> {
    let file = GgufFile::open(path)?;
    let arch = file.get_str("general.architecture").unwrap_or("(missing)");
    println!("file          {}", path.display());
    println!("architecture  {arch}");
    println!("shards        {}", file.shards().len());
    for s in file.shards() {
        println!("              {}", s.path.display());
    }

    let mut histogram: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for t in file.tensors() {
        let e = histogram.entry(t.ggml_type.to_string()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    println!("tensor types");
    for (ty, (count, bytes)) in &histogram {
        println!(
            "  {ty:<8} {count:>6} tensors {:>12.1} MB",
            *bytes as f64 / 1e6
        );
    }

    let mut warnings = Vec::new();
    match ModelConfig::from_gguf(&file) {
        Ok(cfg) => {
            println!("hyperparameters the engine uses");
            println!(
                "  layers {} (+{} MTP skipped), context {}, hidden {}, vocab {}",
                cfg.n_layer, cfg.n_nextn, cfg.n_ctx, cfg.n_embd, cfg.n_vocab
            );
            println!(
                "  MLA: {} heads, q_lora {}, kv_lora {}, head dims nope {} rope {} v {}, layout {}",
                cfg.n_head,
                cfg.q_lora
                    .map_or("none (attn_q)".to_string(), |r| r.to_string()),
                cfg.kv_lora,
                cfg.head_dim_nope,
                cfg.head_dim_rope,
                cfg.head_dim_v,
                match cfg.kv_layout {
                    KvLayout::Split => "split (attn_k_b / attn_v_b)",
                    KvLayout::Legacy => "legacy (attn_kv_b, split at load)",
                }
            );
            println!(
                "  rope base {}, yarn {:?}, attention scale {:.6}",
                cfg.rope_base,
                cfg.yarn,
                cfg.attention_scale()
            );
            println!(
                "  rms eps {:e}, dense FFN {} in the first {} layers",
                cfg.rms_eps, cfg.n_ff, cfg.n_dense_lead
            );
            if let Some(m) = &cfg.moe {
                println!(
                    "  MoE: {} experts, {} used, {} shared, width {}, gating {:?}, scale {}, norm {}, groups {} ({} used)",
                    m.n_expert, m.n_used, m.n_shared, m.n_ff_expert, m.gating, m.weights_scale, m.weights_norm, m.n_group, m.n_group_used
                );
            }
            if let Some(ix) = &cfg.indexer {
                println!(
                    "  DSA indexer: {} heads x {}, top {}, full layers {:?}",
                    ix.n_head,
                    ix.head_dim,
                    ix.top_k,
                    ix.full
                        .iter()
                        .enumerate()
                        .filter(|(_, f)| **f)
                        .map(|(i, _)| i)
                        .collect::<Vec<_>>()
                );
            }
            let latent = cfg.latent_width() * cfg.n_layer * 4;
            println!(
                "  latent cache {} values per layer, {:.1} KB per token (f32)",
                cfg.latent_width(),
                latent as f64 / 1e3
            );
            warnings.extend(cfg.warnings.iter().cloned());
        }
        Err(e) => warnings.push(format!("the engine cannot run this file: {e}")),
    }
    for t in file
        .tensors()
        .iter()
        .filter(|t| t.name.ends_with("attn_k_b.weight"))
        .take(1)
    {
        if below_5_bits(t.ggml_type) {
            warnings.push(format!(
                "{} is {} (below 5 bits per weight): MLA's keys degrade badly this coarse",
                t.name, t.ggml_type
            ));
        }
    }
    for w in &warnings {
        println!("warning: {w}");
    }
    Ok(())
}
