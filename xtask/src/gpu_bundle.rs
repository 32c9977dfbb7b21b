//! `cargo xtask gpu-bundle`: one folder that runs the GPU checks on a machine with GPUs and no
//! Rust toolchain: the nextest archive of the GPU test binaries (tests/cuda_*.rs,
//! tests/nvrtc_compile.rs, tests/tp_nccl.rs), and in bin.tar.gz the `cargo-nextest` binary
//! that runs it, the release `generate` and the `xtask` binary (synth, bench); the golden
//! fixtures the tests read (models, references, manifest); `run.sh` (xtask/gpu-run.sh: the
//! phases tests, golden, tp, synth, tp-synth, bench, ab) and `bench.sh`. Binaries are stripped
//! of symbols and compressed to keep the folder small enough to carry to the GPU host (64 MiB).
//!
//! `--baseline REV` adds REV's own `xtask` (built from `git archive REV`, cached under
//! target/baseline/), so that the phase `ab` times this build's decode and prefill beside
//! REV's, alternating, in one call: a change is measured against its parent on the same GPU.
//!
//! The tests find the fixtures at this machine's workspace path (compiled in), so `run.sh`
//! points that path at the bundle's copy, or with `--no-fixtures` at the checkout the bundle
//! sits in, when it does not exist on the GPU host.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

#[derive(clap::Args)]
pub struct Args {
    /// Output folder (replaced).
    #[arg(long, default_value = "bundle")]
    out: PathBuf,
    /// Leave the golden fixtures out: run.sh then reads them from the checkout the bundle is
    /// placed in (bundle inside the repository root).
    #[arg(long)]
    no_fixtures: bool,
    /// A git revision whose `xtask` goes into the bundle too (repeatable), for run.sh's phase
    /// `ab`: whole-model decode and prefill of each build, alternating.
    #[arg(long)]
    baseline: Vec<String>,
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

fn git(root: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git").current_dir(root).args(args).output()?;
    if !out.status.success() {
        bail!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_string())
}

/// The release `xtask` of revision `rev` (its commit's short hash, and the binary), built
/// once from `git archive` into target/baseline/HASH/ (a target folder shared by every
/// baseline, so that their dependencies build once).
fn baseline_xtask(root: &Path, cargo: &str, rev: &str) -> Result<(String, PathBuf)> {
    let hash = git(
        root,
        &["rev-parse", "--short=9", &format!("{rev}^{{commit}}")],
    )?;
    let dir = root.join("target/baseline").join(&hash);
    let binary = dir.join("xtask");
    if binary.exists() {
        return Ok((hash, binary));
    }
    let src = dir.join("src");
    if src.exists() {
        std::fs::remove_dir_all(&src)?;
    }
    std::fs::create_dir_all(&src)?;
    let archive = dir.join("src.tar");
    run_cmd(Command::new("git").current_dir(root).args([
        "archive",
        "--output",
        &archive.display().to_string(),
        &hash,
    ]))?;
    // -m: the files dated now, so that cargo, whose target folder the baselines share, sees
    // them newer than another baseline's build and compiles them.
    run_cmd(
        Command::new("tar")
            .arg("-xmf")
            .arg(&archive)
            .arg("-C")
            .arg(&src),
    )?;
    let target = root.join("target/baseline/target");
    run_cmd(
        Command::new(cargo)
            .current_dir(&src)
            .env("CARGO_TARGET_DIR", &target)
            .args(["build", "--release", "-p", "xtask"]),
    )?;
    std::fs::copy(target.join("release/xtask"), &binary)?;
    std::fs::remove_dir_all(&src)?;
    std::fs::remove_file(&archive)?;
    Ok((hash, binary))
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
            if stem.starts_with("cuda_") || stem == "nvrtc_compile" || stem == "tp_nccl" {
                archive.args(["--test", stem]);
                binaries.push(format!("binary({stem})"));
            }
        }
    }
    binaries.sort();
    let archive_file = out.join("tests.tar.zst");
    run_cmd(archive.arg("--archive-file").arg(&archive_file))?;
    strip_archive(&archive_file)?;

    run_cmd(Command::new(&cargo).current_dir(&root).args([
        "build",
        "--release",
        "--bin",
        "generate",
    ]))?;
    let which = Command::new("which").arg("cargo-nextest").output()?;
    let nextest = String::from_utf8(which.stdout)?.trim().to_string();
    if nextest.is_empty() {
        bail!("cargo-nextest is not on PATH (cargo install cargo-nextest)");
    }
    let bin = out.join("bin");
    std::fs::create_dir_all(&bin)?;
    let mut executables = vec![
        (PathBuf::from(nextest), "cargo-nextest".to_string()),
        (root.join("target/release/generate"), "generate".to_string()),
        (std::env::current_exe()?, "xtask".to_string()),
    ];
    // bin/builds: one line per xtask that phase ab times, "FILE REVISION", this build first.
    let this = git(
        &root,
        &[
            "describe",
            "--always",
            "--dirty",
            "--abbrev=9",
            "--exclude=*",
        ],
    )?;
    let mut builds = format!("xtask {this}\n");
    for rev in &args.baseline {
        let (hash, binary) = baseline_xtask(&root, &cargo, rev)?;
        builds += &format!("xtask-{hash} {hash}\n");
        executables.push((binary, format!("xtask-{hash}")));
    }
    std::fs::write(bin.join("builds"), builds)?;
    for (from, to) in &executables {
        run_cmd(Command::new("strip").arg("-o").arg(bin.join(to)).arg(from))?;
    }
    run_cmd(
        Command::new("tar")
            .arg("-czf")
            .arg(out.join("bin.tar.gz"))
            .arg("-C")
            .arg(&out)
            .arg("bin"),
    )?;
    std::fs::remove_dir_all(&bin)?;

    // `nextest run --workspace-remap` wants a workspace there: its manifests, and a stub for
    // the library's root file that the manifest names (the tests are already built).
    let ws = out.join("workspace");
    std::fs::create_dir_all(ws.join("src"))?;
    std::fs::copy(root.join("Cargo.toml"), ws.join("Cargo.toml"))?;
    std::fs::write(ws.join("src/lib.rs"), "")?;
    copy_dir(&root.join("xtask"), &ws.join("xtask"))?;

    if !args.no_fixtures {
        let golden = root.join("golden");
        for dir in ["models", "refs"] {
            copy_dir(&golden.join(dir), &ws.join("golden").join(dir))?;
        }
        std::fs::copy(
            golden.join("manifest.json"),
            ws.join("golden/manifest.json"),
        )?;
    }

    let script = std::fs::read_to_string(root.join("xtask/gpu-run.sh"))?
        .replace("@WORKSPACE@", &root.display().to_string())
        .replace("@FILTER@", &binaries.join(" | "));
    use std::os::unix::fs::PermissionsExt;
    for (name, text) in [
        ("run.sh", script),
        (
            "bench.sh",
            std::fs::read_to_string(root.join("xtask/bench.sh"))?,
        ),
    ] {
        std::fs::write(out.join(name), text)?;
        std::fs::set_permissions(out.join(name), std::fs::Permissions::from_mode(0o755))?;
    }
    eprintln!("gpu-bundle: wrote {}", out.display());
    Ok(())
}
