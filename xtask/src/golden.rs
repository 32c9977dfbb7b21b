//! `cargo xtask golden`: rebuild every golden fixture from the pinned Python tools.
//!
//! The fixtures come from tools no one here wrote (HF transformers, llama.cpp's converter and
//! quantizer, llama.cpp itself), so the xtask's job is only plumbing: make the pinned venv, get
//! llama.cpp's converter out of the llama-cpp-python sdist, and run golden/pipeline.py step by
//! step, printing each step's time. `--from-gguf` instead writes references for one file, for
//! example a slice of a real checkpoint.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const LLAMA_CPP_PYTHON: &str = "llama-cpp-python==0.3.36";
const SDIST: &str = "llama_cpp_python-0.3.36.tar.gz";
/// Paths inside the sdist that make up the converter (script, its package, its gguf-py).
const CONVERTER_PARTS: [&str; 3] = ["convert_hf_to_gguf.py", "conversion", "gguf-py"];
const SDIST_LLAMA_CPP: &str = "llama_cpp_python-0.3.36/vendor/llama.cpp";

#[derive(clap::Args)]
pub struct Args {
    /// Write references for this GGUF (first shard of a split set) instead of the fixtures.
    #[arg(long, requires = "prompt")]
    from_gguf: Option<PathBuf>,
    /// Prompt text for --from-gguf (repeatable).
    #[arg(long)]
    prompt: Vec<String>,
    /// Output folder for --from-gguf.
    #[arg(long, default_value = "target/golden/from-gguf")]
    out: PathBuf,
}

pub fn run(args: Args) -> Result<()> {
    let root = repo_root()?;
    std::env::set_current_dir(&root)?;
    let python = step("python venv", || ensure_venv(&root))?;
    step("llama.cpp converter", || ensure_converter(&root, &python))?;
    if let Some(gguf) = args.from_gguf {
        return step("references", || {
            from_gguf(&python, &gguf, &args.prompt, &args.out)
        });
    }
    let started = Instant::now();
    for name in ["models", "convert", "story", "quantize"] {
        step(name, || python_run(&python, &["golden/pipeline.py", name]))?;
    }
    step("quant blocks", || {
        if Path::new("golden/quant_fixtures.py").exists() {
            python_run(&python, &["golden/quant_fixtures.py", "golden/quant"])
        } else {
            println!("  golden/quant_fixtures.py not present yet: skipped");
            Ok(())
        }
    })?;
    for name in ["refs", "tokenizer_cases", "manifest"] {
        step(name, || python_run(&python, &["golden/pipeline.py", name]))?;
    }
    println!("golden: done in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Runs one named step and prints how long it took.
fn step<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    println!("golden: {name} ...");
    let t = Instant::now();
    let out = f().with_context(|| format!("golden step `{name}` failed"))?;
    println!("golden: {name} done in {:.1} s", t.elapsed().as_secs_f64());
    Ok(out)
}

fn repo_root() -> Result<PathBuf> {
    let xtask_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    Ok(xtask_dir
        .parent()
        .context("xtask has no parent folder")?
        .to_path_buf())
}

/// target/golden-venv with golden/requirements.txt installed. A copy of requirements.txt next
/// to it records what it was made from; a different file means rebuild.
fn ensure_venv(root: &Path) -> Result<PathBuf> {
    let venv = root.join("target/golden-venv");
    let stamp = root.join("target/golden-venv.requirements.txt");
    let python = venv.join("bin/python");
    let requirements =
        std::fs::read(root.join("golden/requirements.txt")).context("golden/requirements.txt")?;
    if python.exists() && std::fs::read(&stamp).ok().as_deref() == Some(&requirements[..]) {
        println!("  {} is up to date", venv.display());
        return Ok(python);
    }
    println!(
        "  creating {} (builds llama-cpp-python from source: many minutes)",
        venv.display()
    );
    if venv.exists() {
        std::fs::remove_dir_all(&venv)?;
    }
    run_checked(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    run_checked(Command::new(&python).args([
        "-m",
        "pip",
        "install",
        "-r",
        "golden/requirements.txt",
    ]))?;
    std::fs::write(&stamp, &requirements)?;
    Ok(python)
}

/// target/golden/converter: convert_hf_to_gguf.py, conversion/ and gguf-py/ from the sdist.
fn ensure_converter(root: &Path, python: &Path) -> Result<()> {
    let work = root.join("target/golden");
    let converter = work.join("converter");
    if converter.join("convert_hf_to_gguf.py").exists() {
        println!("  {} is present", converter.display());
        return Ok(());
    }
    std::fs::create_dir_all(&work)?;
    if !work.join(SDIST).exists() {
        run_checked(
            Command::new(python)
                // `--no-binary :all:` would also build cmake itself from source; only the
                // package itself must be the sdist.
                .args([
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    "llama-cpp-python",
                ])
                .arg(LLAMA_CPP_PYTHON)
                .arg("-d")
                .arg(&work),
        )?;
    }
    let parts: Vec<String> = CONVERTER_PARTS
        .iter()
        .map(|p| format!("{SDIST_LLAMA_CPP}/{p}"))
        .collect();
    run_checked(
        Command::new("tar")
            .arg("-xzf")
            .arg(work.join(SDIST))
            .arg("-C")
            .arg(&work)
            .args(&parts),
    )?;
    std::fs::rename(work.join(SDIST_LLAMA_CPP), &converter)?;
    std::fs::remove_dir_all(work.join("llama_cpp_python-0.3.36"))?;
    Ok(())
}

/// References for one user-supplied GGUF, with its own tokenizer rebuilt from the metadata.
fn from_gguf(python: &Path, gguf: &Path, prompts: &[String], out: &Path) -> Result<()> {
    let stem = gguf
        .file_name()
        .and_then(|n| n.to_str())
        .context("--from-gguf needs a file name")?;
    let stem = stem.trim_end_matches(".gguf");
    std::fs::create_dir_all(out)?;
    let prefix = out.join(stem);
    let summary = out.join(format!("{stem}.summary.json"));
    let mut cmd = Command::new(python);
    cmd.arg("golden/reference.py")
        .arg("--gguf")
        .arg(gguf)
        .arg("--out")
        .arg(&prefix);
    cmd.arg("--summary").arg(&summary).arg("--llamacpp");
    for p in prompts {
        cmd.arg("--prompt").arg(p);
    }
    run_checked(&mut cmd)?;
    println!(
        "  references: {}.p*.safetensors, summary: {}",
        prefix.display(),
        summary.display()
    );
    Ok(())
}

fn python_run(python: &Path, args: &[&str]) -> Result<()> {
    run_checked(Command::new(python).args(args).env("PYTHONHASHSEED", "0"))
}

fn run_checked(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("could not start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} exited with {status}");
    }
    Ok(())
}
