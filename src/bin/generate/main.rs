//! `generate`: run one prompt through an MLA + MoE GGUF model, and the debugging tools around
//! it (teacher-forced logits, stage traces, trace diffs, file inspection).

mod diff;
mod inspect;
mod npy;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use mla_engine::backend::cpu::Cpu;
use mla_engine::backend::cuda::Cuda;
use mla_engine::backend::{Backend, Communicator, SingleRank};
use mla_engine::config::ModelConfig;
use mla_engine::gguf::GgufFile;
use mla_engine::model::{Cache, Model};
use mla_engine::sampling::Sampler;
use mla_engine::tokenizer::{render_chat, Message, TextStream, Tokenizer};
use mla_engine::tp::nccl::{Clock, Nccl};
use mla_engine::tp::{GreedyToken, Local, ShardPlan, ShardedCache, ShardedModel};
use mla_engine::trace::Trace;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// The model run when --model is not given: a tiny DeepSeek-V3-shaped model (random weights,
/// 1000-token BPE vocabulary) from golden/, so `generate --prompt ...` works anywhere.
const DEFAULT_MODEL: &[u8] = include_bytes!("../../../golden/models/story.q8_0.gguf");
const DEFAULT_MODEL_NAME: &str = "<embedded story.q8_0.gguf>";

/// Files above this size get a progress bar while their pages are read in.
const PROGRESS_BAR_BYTES: u64 = 1 << 30;

#[derive(Parser, Debug)]
#[command(
    name = "generate",
    about = "Run a prompt through an MLA + MoE model (DeepSeek-V2/V3, Kimi-K2, GLM-5) stored as GGUF",
    long_about = None
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    /// The prompt text. Without --model, runs the embedded tiny model.
    #[arg(long)]
    prompt: Option<String>,

    /// GGUF file to run; for a split set, any of its shards.
    #[arg(long)]
    model: Option<PathBuf>,

    /// Tokens to generate after the prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,

    /// Sampling temperature; 0 is greedy (always the most likely token).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,

    /// Nucleus sampling: sample among the most likely tokens holding this much probability.
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,

    /// Seed of the sampler: the same seed gives the same tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// Wrap the prompt as a user message in the model's chat template (tokenizer.chat_template).
    #[arg(long)]
    chat: bool,

    /// Where to run: cpu (the f32 reference) or cuda.
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    backend: BackendKind,

    /// Tensor-parallel ranks (GPUs) to split the model over.
    #[arg(long, default_value_t = 1)]
    tp: usize,

    /// Teacher forcing: run these token ids (comma-separated) instead of a prompt.
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<String>>,

    /// With --tokens: write the logits of every position, float32 [n_tokens, vocab], as .npy.
    #[arg(long)]
    logits_out: Option<PathBuf>,

    /// Write every stage of the prompt's prefill (embed, L{i}.*, logits) as safetensors.
    #[arg(long)]
    trace: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Compare two traces (or a trace and a golden reference) stage by stage in forward order
    /// and name the first stage whose relative error exceeds the threshold.
    Diff {
        a: PathBuf,
        b: PathBuf,
        /// Relative error ||a-b||/||b|| beyond which a stage diverges.
        #[arg(long, default_value_t = 1e-4)]
        threshold: f64,
    },
    /// Describe a GGUF file: architecture, the hyperparameters the engine will use, tensor
    /// types and bytes, MLA layout, shards, and warnings for known traps.
    Inspect { file: PathBuf },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    Cpu,
    Cuda,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match &cli.command {
        Some(Command::Diff { a, b, threshold }) => return diff::run(a, b, *threshold),
        Some(Command::Inspect { file }) => return inspect::run(file),
        None => {}
    }
    if cli.logits_out.is_some() && cli.tokens.is_none() {
        bail!("--logits-out needs --tokens (the ids to teacher-force)");
    }
    if cli.tokens.is_none() && cli.prompt.is_none() {
        bail!("nothing to run: give --prompt TEXT or --tokens IDS (see --help)");
    }

    let (file, name) = open_file(cli.model.as_ref())?;
    let cfg = ModelConfig::from_gguf(&file)?;
    for w in &cfg.warnings {
        eprintln!("warning: {w}");
    }
    let plan = ShardPlan::new(&file, &cfg, cli.tp).with_context(|| name.clone())?;
    for w in &plan.warnings {
        eprintln!("warning: --tp {}: {w}", cli.tp);
    }
    let tp = cli.tp;
    match cli.backend {
        BackendKind::Cpu => {
            let comms: Vec<Box<dyn Communicator<Cpu>>> = if tp == 1 {
                vec![Box::new(SingleRank)]
            } else {
                Local::group(tp)
                    .into_iter()
                    .map(|c| Box::new(c) as _)
                    .collect()
            };
            let ranks = comms.into_iter().map(|c| (Cpu, c)).collect();
            run_on(&cli, &file, plan, &name, ranks, None)
        }
        BackendKind::Cuda => {
            let gpus = (0..tp)
                .map(|rank| Cuda::new(rank).with_context(|| format!("--backend cuda, GPU {rank}")))
                .collect::<Result<Vec<_>>>()?;
            for g in gpus.iter().map(|c| &c.gpu) {
                eprintln!("cuda: {} ({}, {} SMs)", g.name, g.arch, g.multiprocessors);
            }
            // MLA_TP_TIMING=1: time each collective (synchronizing around it).
            let clock = std::env::var_os("MLA_TP_TIMING").map(|_| Arc::new(Clock::default()));
            let comms: Vec<Box<dyn Communicator<Cuda>>> = if tp == 1 {
                vec![Box::new(SingleRank)]
            } else {
                Nccl::group(&gpus)
                    .map_err(anyhow::Error::msg)?
                    .into_iter()
                    .enumerate()
                    .map(|(rank, n)| match &clock {
                        Some(c) if rank == 0 => Box::new(n.timed(c.clone())) as _,
                        _ => Box::new(n) as _,
                    })
                    .collect()
            };
            let ranks = gpus.into_iter().zip(comms).collect();
            run_on(&cli, &file, plan, &name, ranks, clock)
        }
    }
}

fn run_on<B: Backend + DeviceMemory>(
    cli: &Cli,
    file: &Arc<GgufFile>,
    plan: ShardPlan,
    name: &str,
    ranks: Vec<(B, Box<dyn Communicator<B>>)>,
    clock: Option<Arc<Clock>>,
) -> Result<()> {
    let model = load(file, plan, name, ranks)?;
    match &cli.tokens {
        Some(ids) => teacher_forced(cli, &model, ids),
        None => generate(cli, file, &model, clock.as_deref()),
    }
}

/// What a backend can say about its device memory, for the start-up report.
trait DeviceMemory {
    /// Bytes the weights occupy where they are computed on (None: read from the mmap).
    fn weight_bytes(&self) -> Option<usize>;
    /// Device bytes in use by this process and the driver (None: host memory).
    fn device_in_use(&self) -> Option<usize>;
}

impl DeviceMemory for Cpu {
    fn weight_bytes(&self) -> Option<usize> {
        None
    }
    fn device_in_use(&self) -> Option<usize> {
        None
    }
}

impl DeviceMemory for Cuda {
    fn weight_bytes(&self) -> Option<usize> {
        Some(Cuda::weight_bytes(self))
    }
    fn device_in_use(&self) -> Option<usize> {
        let (free, total) = self.memory();
        Some(total - free)
    }
}

/// Prints weights, KV cache and workspace bytes per rank (workspace: device memory in use
/// beyond the weights and the cache, i.e. context, kernels and activations; device backends
/// only); with TP > 1 also each rank's planned share and the process's resident memory.
fn report_memory<B: Backend + DeviceMemory>(model: &ShardedModel<B>, cache: &ShardedCache<B>) {
    if model.tp() > 1 {
        for rank in 0..model.tp() {
            let p = model.plan.rank_bytes(rank);
            eprintln!(
                "tp rank {rank}: weights {} = {} sharded + {} replicated (plan), {} loaded",
                size(p.total()),
                size(p.sharded),
                size(p.replicated),
                size(model.loaded_bytes[rank])
            );
        }
        if let Some(rss) = resident_bytes() {
            eprintln!("process resident memory: {}", size(rss));
        }
    }
    for ((model, cache), loaded) in model
        .ranks
        .iter()
        .zip(&cache.ranks)
        .zip(&model.loaded_bytes)
    {
        report_rank_memory(model, cache, *loaded);
    }
}

/// VmRSS of this process (Linux), in bytes.
fn resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    kb.split_whitespace()
        .nth(1)?
        .parse::<usize>()
        .ok()
        .map(|k| k * 1024)
}

/// One rank's line; `loaded`: the weight bytes its backend was handed (the figure for backends
/// that read weights from the mmap).
fn report_rank_memory<B: Backend + DeviceMemory>(
    model: &Model<B>,
    cache: &Cache<B>,
    loaded: usize,
) {
    let b = &model.backend;
    let weights = b.weight_bytes().unwrap_or(loaded);
    let kv: usize = cache
        .latent
        .iter()
        .map(|l| b.latent_bytes(l))
        .sum::<usize>()
        + cache
            .index_keys
            .iter()
            .flatten()
            .map(|t| {
                let (r, c) = b.shape(t);
                r * c * 4
            })
            .sum::<usize>();
    let workspace = b
        .device_in_use()
        .map(|used| format!(", workspace {}", size(used.saturating_sub(weights + kv))))
        .unwrap_or_default();
    eprintln!(
        "memory ({}): weights {}, KV cache {} for {} positions{workspace}",
        b.name(),
        size(weights),
        size(kv),
        cache.capacity
    );
}

/// Bytes as kB, MB or GB.
fn size(bytes: usize) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.1} kB", b / 1e3)
    }
}

fn open_file(path: Option<&PathBuf>) -> Result<(Arc<GgufFile>, String)> {
    match path {
        Some(p) => Ok((Arc::new(GgufFile::open(p)?), p.display().to_string())),
        None => Ok((
            Arc::new(GgufFile::from_bytes(
                DEFAULT_MODEL_NAME,
                DEFAULT_MODEL.to_vec(),
            )?),
            DEFAULT_MODEL_NAME.to_string(),
        )),
    }
}

/// Loads the weights; big files get a progress bar while their pages are read in.
fn load<B: Backend>(
    file: &Arc<GgufFile>,
    plan: ShardPlan,
    name: &str,
    ranks: Vec<(B, Box<dyn Communicator<B>>)>,
) -> Result<ShardedModel<B>> {
    let total: u64 = file.tensors().iter().map(|t| t.n_bytes).sum();
    let bar = (total >= PROGRESS_BAR_BYTES).then(|| {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(
                "loading {bar:40} {bytes}/{total_bytes} {bytes_per_sec} {eta}",
            )
            .expect("valid template"),
        );
        bar
    });
    let model = ShardedModel::load(file.clone(), plan, ranks, &|t| {
        if let Some(bar) = &bar {
            // Touch one byte per page so the first token does not pay for the disk.
            let bytes = t.bytes.as_slice();
            let mut sum = 0u8;
            for i in (0..bytes.len()).step_by(4096) {
                sum = sum.wrapping_add(bytes[i]);
            }
            std::hint::black_box(sum);
            bar.inc(bytes.len() as u64);
        }
    })
    .with_context(|| format!("loading {name}"))?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(model)
}

fn parse_ids(ids: &[String]) -> Result<Vec<u32>> {
    ids.iter()
        .map(|s| {
            s.trim().parse::<u32>().with_context(|| {
                format!("--tokens: {s:?} is not a token id (a non-negative integer)")
            })
        })
        .collect()
}

/// `--tokens`: one prefill of the given ids; logits of every position to .npy, stages to
/// --trace.
fn teacher_forced<B: Backend>(cli: &Cli, model: &ShardedModel<B>, ids: &[String]) -> Result<()> {
    let tokens = parse_ids(ids)?;
    if tokens.is_empty() {
        bail!("--tokens is empty");
    }
    let mut trace = Trace::new();
    let mut cache = model.new_cache(model.cfg().n_ctx);
    let (logits, _) = model.forward(&mut cache, &tokens, cli.trace.as_ref().map(|_| &mut trace))?;
    let logits = model.backend().download(&logits);
    let n_vocab = model.cfg().n_vocab;
    if let Some(path) = &cli.logits_out {
        npy::write_f32(path, &[tokens.len(), n_vocab], &logits)?;
        eprintln!(
            "wrote logits [{}, {n_vocab}] to {}",
            tokens.len(),
            path.display()
        );
    }
    if let Some(path) = &cli.trace {
        trace.save(path)?;
        eprintln!("wrote {} stages to {}", trace.names().len(), path.display());
    }
    Ok(())
}

fn generate<B: Backend + DeviceMemory>(
    cli: &Cli,
    file: &GgufFile,
    model: &ShardedModel<B>,
    clock: Option<&Clock>,
) -> Result<()> {
    let prompt = cli.prompt.as_deref().unwrap_or_default();
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let tok = Tokenizer::from_gguf(file)?;
    let tokens = if cli.chat {
        let template = match file.get("tokenizer.chat_template") {
            Some(_) => file.get_str("tokenizer.chat_template")?,
            None => bail!("--chat: this model has no chat template (tokenizer.chat_template)"),
        };
        let messages = [Message {
            role: "user".into(),
            content: prompt.into(),
        }];
        // The template writes BOS itself when the model uses one.
        tok.encode(&render_chat(template, &messages, true, &tok)?, false)?
    } else {
        tok.encode(prompt, true)?
    };
    let n_ctx = model.cfg().n_ctx;
    if tokens.len() >= n_ctx {
        bail!(
            "the prompt is {} tokens, longer than the context of {} tokens",
            tokens.len(),
            n_ctx
        );
    }
    let max_new = cli.max_tokens.min(n_ctx - tokens.len());

    let mut sampler = Sampler::new(cli.temperature, cli.top_p, cli.seed);
    let mut cache = model.new_cache(tokens.len() + max_new);
    report_memory(model, &cache);
    let mut trace = Trace::new();
    let vocab = model.cfg().n_vocab;
    let mut out = std::io::stdout().lock();
    let mut stream = TextStream::new();

    // Greedy picks on the device (no copy of the logits); sampling needs them here.
    let mut pick = |logits: &B::Tensor| -> u32 {
        let b = model.backend();
        if cli.temperature <= 0.0 {
            return b.argmax_last(logits);
        }
        let all = b.download(logits);
        sampler.sample(&all[all.len() - vocab..])
    };
    let start = Instant::now();
    let logits = match &cli.trace {
        Some(_) => model.forward(&mut cache, &tokens, Some(&mut trace))?.0,
        None => model.forward_last(&mut cache, &tokens)?,
    };
    let mut next = pick(&logits);
    let prompt_secs = start.elapsed().as_secs_f64();
    if let Some(path) = &cli.trace {
        trace.save(path)?;
    }

    write!(out, "{prompt}")?;
    out.flush()?;
    let start = Instant::now();
    let mut generated = 0;
    // Greedy decoding runs a step ahead: the step after a token is queued on the device's pick
    // of it before the host reads that pick, so the device does not wait for the host between
    // two tokens. `ahead`: the picks of the token after `next`, when already queued.
    let greedy = cli.temperature <= 0.0;
    let mut ahead: Option<Vec<B::Pick>> = None;
    while generated < max_new {
        if Some(next) == tok.eos {
            break;
        }
        write!(out, "{}", stream.push(&tok, next))?;
        out.flush()?;
        generated += 1;
        if generated == max_new {
            break;
        }
        next = if greedy {
            let picks = match ahead.take() {
                Some(picks) => picks,
                None => model.greedy_step(&mut cache, GreedyToken::Id(next))?,
            };
            if generated + 1 < max_new {
                ahead = Some(model.greedy_step(&mut cache, GreedyToken::Picks(&picks))?);
            }
            model.pick_id(&picks)
        } else {
            pick(&model.forward(&mut cache, &[next], None)?.0)
        };
    }
    writeln!(out)?;
    let gen_secs = start.elapsed().as_secs_f64();

    let per_token = mla_engine::weights::active_bytes_per_token(file, model.cfg());
    let gen_rate = generated.saturating_sub(1) as f64 / gen_secs.max(1e-9);
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.1} tok/s | {:.1} MB/token, {:.2} GB/s",
        tokens.len(),
        tokens.len() as f64 / prompt_secs.max(1e-9),
        generated,
        gen_rate,
        per_token / 1e6,
        per_token * gen_rate / 1e9
    );
    if let Some(clock) = clock {
        let (secs, calls) = clock.read();
        let steps = (generated + 1) as f64; // the prefill and each decode step
        eprintln!(
            "tp {}: collectives {calls} ({:.1} us each), {:.3} ms per step (rank 0, synchronized)",
            model.tp(),
            secs * 1e6 / calls.max(1) as f64,
            secs * 1e3 / steps
        );
    }
    Ok(())
}
