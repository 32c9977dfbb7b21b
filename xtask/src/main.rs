//! `cargo xtask <command>`: the project's developer commands (golden, gpu-bundle, bench, synth, slice).

mod bench;
mod chain;
mod golden;
mod gpu_bundle;
mod slice;
mod synth;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "mla-engine developer commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Regenerate the golden fixtures (or references for one GGUF with --from-gguf).
    Golden(golden::Args),
    /// Build the folder that runs the GPU tests on a GPU host without Rust (bundle/).
    GpuBundle(gpu_bundle::Args),
    /// Measure kernels and whole-model decode against the GPU's copy bandwidth and mma rate.
    Bench(bench::Args),
    /// Write a synthetic GGUF with the real GLM-5 or DeepSeek-V3 shapes and a few layers.
    Synth(synth::Args),
    /// Cut chosen layers (with embedding, output norm and head) out of a GGUF, byte for byte.
    Slice(slice::Args),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Golden(args) => golden::run(args),
        Command::GpuBundle(args) => gpu_bundle::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Synth(args) => synth::run(args),
        Command::Slice(args) => slice::run(args),
    }
}
