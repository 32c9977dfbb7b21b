//! `cargo xtask <command>`: the project's developer commands (golden, gpu-bundle, bench, synth, slice).

mod bench;
mod gpu_bundle;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "mla-engine developer commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build the folder that runs the GPU tests on a GPU host without Rust (bundle/).
    GpuBundle(gpu_bundle::Args),
    /// Measure kernels and whole-model decode against the GPU's copy bandwidth and mma rate.
    Bench(bench::Args),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::GpuBundle(args) => gpu_bundle::run(args),
        Command::Bench(args) => bench::run(args),
    }
}
