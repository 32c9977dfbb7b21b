//! `cargo xtask gpu-bundle`: one folder that runs the GPU tests on a machine with a GPU and no
//! Rust toolchain: the nextest archive of the GPU test binaries (tests/cuda_*.rs and
//! tests/nvrtc_compile.rs), the `cargo-nextest` binary that runs it, the `generate` binary, the
//! golden fixtures the tests read (models, references, manifest), and `run.sh`. Binaries are
//! stripped of symbols to keep the folder small enough to carry to the GPU host (64 MiB).
//!
//! The tests find the fixtures at this machine's workspace path (compiled in), so `run.sh`
//! points that path at the bundle's copy when it does not exist on the GPU host.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

#[derive(clap::Args)]
pub struct Args {
    /// Output folder (replaced).
    #[arg(long, default_value = "bundle")]
    out: PathBuf,
    /// Build `generate` with the release profile (the tests always use the test profile).
    #[arg(long)]
    release: bool,
    /// Also ship the `xtask` binary (bench, synth) and bench.sh, which runs the benchmark.
    #[arg(long)]
    bench: bool,
}

fn run_cmd(cmd: &mut Command) -> Result<()> {
    eprintln!("gpu-bundle: {cmd:?}");
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from).with_context(|| from.display().to_string())? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// Strips the debug info from the executables inside a nextest archive (a test binary that
/// links the whole engine is over 100 MB with it, 2 MB without), keeping the entry order.
fn strip_archive(archive: &Path) -> Result<()> {
    let tmp = archive.with_extension("unpacked");
    std::fs::create_dir_all(&tmp)?;
    run_cmd(
        Command::new("tar")
            .arg("--zstd")
            .arg("-xf")
            .arg(archive)
            .arg("-C")
            .arg(&tmp),
    )?;
    let list = Command::new("tar")
        .arg("--zstd")
        .arg("-tf")
        .arg(archive)
        .output()?;
    let entries = String::from_utf8(list.stdout)?;
    for entry in entries.lines() {
        let path = tmp.join(entry);
        let in_profile_dir =
            entry.starts_with("target/debug/") && !entry.starts_with("target/debug/build/");
        let head = std::fs::read(&path).is_ok_and(|b| b.starts_with(b"\x7fELF"));
        if path.is_file() && in_profile_dir && head {
            run_cmd(Command::new("strip").arg("--strip-debug").arg(&path))?;
        }
    }
    let list_file = tmp.with_extension("entries");
    std::fs::write(&list_file, &entries)?;
    run_cmd(
        Command::new("tar")
            .arg("--zstd")
            .arg("-cf")
            .arg(archive)
            .arg("-C")
            .arg(&tmp)
            .arg("--no-recursion")
            .arg("-T")
            .arg(&list_file),
    )?;
    std::fs::remove_file(&list_file)?;
    std::fs::remove_dir_all(&tmp)?;
    Ok(())
}

pub fn run(args: Args) -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("xtask sits inside the workspace")?
        .to_path_buf();
    let out = if args.out.is_absolute() {
        args.out.clone()
    } else {
        root.join(&args.out)
    };
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| out.display().to_string())?;
    }
    std::fs::create_dir_all(&out)?;

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut archive = Command::new(&cargo);
    archive.current_dir(&root).args(["nextest", "archive"]);
    let mut binaries = Vec::new();
    for entry in std::fs::read_dir(root.join("tests"))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(stem) = name.strip_suffix(".rs") {
            if stem.starts_with("cuda_") || stem == "nvrtc_compile" {
                archive.args(["--test", stem]);
                binaries.push(format!("binary({stem})"));
            }
        }
    }
    binaries.sort();
    let archive_file = out.join("tests.tar.zst");
    run_cmd(archive.arg("--archive-file").arg(&archive_file))?;
    strip_archive(&archive_file)?;

    let mut build = Command::new(&cargo);
    build
        .current_dir(&root)
        .args(["build", "--bin", "generate"]);
    if args.release {
        build.arg("--release");
    }
    run_cmd(&mut build)?;
    let profile = if args.release { "release" } else { "debug" };
    std::fs::copy(
        root.join("target").join(profile).join("generate"),
        out.join("generate"),
    )
    .context("copying generate")?;

    let which = Command::new("which").arg("cargo-nextest").output()?;
    let nextest = String::from_utf8(which.stdout)?.trim().to_string();
    if nextest.is_empty() {
        bail!("cargo-nextest is not on PATH (cargo install cargo-nextest)");
    }
    for (from, to) in [
        (PathBuf::from(nextest), "cargo-nextest"),
        (out.join("generate"), "generate"),
    ] {
        run_cmd(
            Command::new("strip")
                .arg("-o")
                .arg(out.join(format!("{to}.stripped")))
                .arg(&from),
        )?;
        std::fs::rename(out.join(format!("{to}.stripped")), out.join(to))?;
    }

    // `nextest run --workspace-remap` wants a workspace there: its manifests, and a stub for
    // the library's root file that the manifest names (the tests are already built).
    let ws = out.join("workspace");
    std::fs::create_dir_all(ws.join("src"))?;
    std::fs::copy(root.join("Cargo.toml"), ws.join("Cargo.toml"))?;
    std::fs::write(ws.join("src/lib.rs"), "")?;
    copy_dir(&root.join("xtask"), &ws.join("xtask"))?;

    let golden = root.join("golden");
    copy_dir(&golden.join("models"), &out.join("workspace/golden/models"))?;
    copy_dir(&golden.join("refs"), &out.join("workspace/golden/refs"))?;
    if golden.join("manifest.json").exists() {
        std::fs::copy(
            golden.join("manifest.json"),
            out.join("workspace/golden/manifest.json"),
        )?;
    }

    let script = RUN_SH
        .replace("@WORKSPACE@", &root.display().to_string())
        .replace("@FILTER@", &binaries.join(" | "));
    std::fs::write(out.join("run.sh"), script)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(out.join("run.sh"), std::fs::Permissions::from_mode(0o755))?;
    if args.bench {
        crate::bench::add_to_bundle(&root, &out)?;
    }
    eprintln!("gpu-bundle: wrote {}", out.display());
    Ok(())
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs mla-engine's GPU tests on a host with an NVIDIA GPU and no Rust toolchain.
# Usage: run.sh [NEXTEST_FILTER]    (default: every test binary in the archive), then one
# `generate --backend cuda` on the embedded tiny model.
# Logs go to $OUT when set (the device tool's output folder), else ./out.
# Needs the NVIDIA driver (libcuda) and libnvrtc on the loader path.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"

# The tests read golden fixtures at the build machine's workspace path.
ws="@WORKSPACE@"
if [ ! -e "$ws/golden" ]; then
  mkdir -p "$(dirname "$ws")"
  ln -sfn "$here/workspace" "$ws"
fi
export MLA_CUBIN_CACHE=${MLA_CUBIN_CACHE:-/tmp/mla-cubin}

{ nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } >"$out/gpu.txt" 2>&1
head -n 20 "$out/gpu.txt"

filter=${1:-"@FILTER@"}
"$here/cargo-nextest" nextest run --archive-file "$here/tests.tar.zst" \
  --workspace-remap "$here/workspace" -E "$filter" --no-fail-fast \
  --success-output final --failure-output final 2>&1 | tee "$out/tests.log"
rc=${PIPESTATUS[0]}

# The whole model end to end on the GPU: the embedded tiny model, greedy.
"$here/generate" --backend cuda --prompt "The capital of France is" --max-tokens 16 2>&1 |
  tee "$out/generate.log"
exit "$rc"
"#;
