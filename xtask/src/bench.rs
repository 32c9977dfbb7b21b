//! `cargo xtask bench`: how close each decode kernel, the prefill products and whole-model
//! decode come to the GPU's own ceilings, measured in one run (issue 9).
//!
//! Ceilings first: the device-to-device copy bandwidth (bytes read + written over the time of
//! a 1 GiB `cuMemcpyDtoDAsync`) and the bf16 `mma.sync` rate (a register-only loop of
//! m16n8k16 products with 8 independent accumulators per warp), plus the cost of one launch of
//! an empty kernel. Then every kernel at the real shapes of DeepSeek-V3 and GLM-5: achieved
//! GB/s = the bytes the kernel must read and write (weights once, activations once) over its
//! median time, beside the ratio to the copy bandwidth; prefill products as TFLOP/s beside the
//! ratio to the mma rate. Last, whole models from synthetic GGUF files: decode tokens/s beside
//! the bandwidth bound of the bytes a token must read, and prefill tokens/s (a prompt as
//! `generate` runs it: logits of the last token only).
//!
//! Timing: CUDA events around `reps` back-to-back launches (so a sample includes the gaps
//! between launches, as decode does), the median of several samples, after a warm-up. Weights
//! come from one large arena of random bytes on the device, and consecutive launches read
//! different copies of a matrix so that no launch finds its weights in the 50 MB L2. Every byte
//! of the arena has bit 6 clear, so every f16 scale and every f32 read from it is finite.
//! `--l2` does the opposite for the matrix-vector and MoE rows: every launch reads the same
//! weights, which then come from L2, so a row shows the kernel's own rate (its consumers' work
//! a stage) without DRAM: the cap that binds on a GPU whose DRAM is faster than that rate.
//!
//! On the GPU host (no Rust there) the `xtask` binary of the bundle runs this; see
//! `bench.sh`, which `cargo xtask gpu-bundle` writes next to it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, LaunchConfig, PushKernelArg};
use mla_engine::backend::cuda::ops::{AttentionPrefill, Matmul, Matvec, MlaDecode};
use mla_engine::backend::cuda::{Cuda, Gpu};
use mla_engine::backend::Backend;
use mla_engine::config::ModelConfig;
use mla_engine::gguf::{GgmlType, GgufFile};
use mla_engine::model::rope::rope_frequencies;
use mla_engine::model::{Cache, Model, Taps};
use mla_engine::weights::GgufTensors;
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct Args {
    /// Synthetic (or real) GGUF files whose whole-model decode and prefill are timed.
    #[arg(long)]
    model: Vec<PathBuf>,
    /// Where to write the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Only the rows whose name contains one of these (comma-separated) substrings.
    #[arg(long, value_delimiter = ',')]
    filter: Vec<String>,
    /// One sample of two launches per row and no ceilings: for runs under a profiler.
    #[arg(long)]
    quick: bool,
    /// The matrix-vector and MoE rows with weights that stay in L2 (each launch reads the same
    /// copy; weights over 40 MB skipped; every MoE choice the same expert): a kernel's own
    /// rate, which caps it where DRAM outruns it (the H200), measured on any GPU. Only those
    /// rows, named "... over L2".
    #[arg(long)]
    l2: bool,
    /// Only the ceilings and the models (each model in its own process keeps a crash in one
    /// from losing the others' numbers).
    #[arg(long)]
    skip_kernels: bool,
    /// Decode tokens timed per model.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// Prefill lengths timed per model (0 for none).
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    prefill: Vec<usize>,
    /// Decode is also timed after a prompt of this many tokens (0 for none), where it reads
    /// the latent cache too.
    #[arg(long, default_value_t = 4096)]
    long_context: usize,
    /// After loading the first model, run one decode token between cuProfilerStart and
    /// cuProfilerStop and exit (for `ncu --profile-from-start off`: launches per token).
    #[arg(long)]
    profile_token: bool,
    /// Like --profile-token, for one prefill of this many tokens (after a warm-up prefill).
    #[arg(long)]
    profile_prefill: Option<usize>,
    /// With --profile-token: the profiled token follows a prompt of this many tokens.
    #[arg(long, default_value_t = 0)]
    profile_context: usize,
    /// After loading the first model, time --tokens decode steps by the chain clock (every
    /// launch stamps when the one before it ended: MLA_CHAIN_CLOCK=1, set here), after a short
    /// prompt and after --long-context positions, and print what each launch of a step adds
    /// as the chain runs, in order and per kernel.
    #[arg(long)]
    chain_clock: bool,
}

/// The bench's own kernels: a random fill, the mma.sync rate and an empty kernel.
const BENCH_KERNELS: &str = r#"
typedef unsigned int u32;
typedef unsigned long long u64;

// Every byte gets bit 6 cleared: f16 exponents stay below 31 and f32 exponents below 255, so
// whatever type a kernel reads the arena as, the values are finite.
extern "C" __global__ void fill_random(u32* p, u64 n_words, u32 seed) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n_words;
         i += (u64)gridDim.x * blockDim.x) {
        u32 x = (u32)i * 0x9E3779B9u ^ (u32)(i >> 32) * 0x85EBCA6Bu ^ seed;
        x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
        p[i] = x & 0xBFBFBFBFu;
    }
}

// Each warp runs `iters` rounds of 8 independent m16n8k16 bf16 products (f32 accumulate).
extern "C" __global__ void mma_peak(float* out, int iters) {
    u32 s = (blockIdx.x * blockDim.x + threadIdx.x) * 0x9E3779B9u + 1u;
    u32 a[4], b[2];
    for (int i = 0; i < 4; i++) { s ^= s << 13; s ^= s >> 17; s ^= s << 5; a[i] = s & 0x3f7f3f7fu; }
    for (int i = 0; i < 2; i++) { s ^= s << 13; s ^= s >> 17; s ^= s << 5; b[i] = s & 0x3f7f3f7fu; }
    float c[8][4];
    for (int j = 0; j < 8; j++) for (int e = 0; e < 4; e++) c[j][e] = 0.0f;
    for (int it = 0; it < iters; it++) {
#pragma unroll
        for (int j = 0; j < 8; j++)
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    float sum = 0.0f;
    for (int j = 0; j < 8; j++) for (int e = 0; e < 4; e++) sum += c[j][e];
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

extern "C" __global__ void empty_kernel() {}

// Pure reads of n 16-byte words from p, 4 loads in flight a thread, nothing kept but an xor
// whose store never happens (it keeps the loads). stretches == 0: the grid sweeps p front to
// back (every block in the same region at a time); else each block reads its own contiguous
// 1/gridDim of p, as the matrix-vector kernels' blocks read their rows.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
extern "C" __global__ void read_bytes(const uint4* p, u64 n, int stretches, u32* out) {
    u64 begin = 0, end = n, stride = (u64)gridDim.x * blockDim.x;
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (stretches) {
        const u64 len = (n + gridDim.x - 1) / gridDim.x;
        begin = blockIdx.x * len;
        end = begin + len < n ? begin + len : n;
        stride = blockDim.x;
        i = begin + threadIdx.x;
    }
    u32 acc = 0;
    for (; i + 3 * stride < end; i += 4 * stride) {
        uint4 a = ld_stream(p + i), b = ld_stream(p + i + stride);
        uint4 c = ld_stream(p + i + 2 * stride), d = ld_stream(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
        acc ^= c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < end; i += stride) {
        uint4 a = ld_stream(p + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9E3779B9u && begin == end) out[0] = acc;
}

// Busy for `ns` nanoseconds of the global timer.
extern "C" __global__ void spin_ns(u64 ns) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"#;

const MMA_CHAINS: usize = 8;
const MMA_FLOPS: f64 = 2.0 * 16.0 * 8.0 * 16.0;

/// The device arena of random bytes that every weight, cache and activation is cut from.
const ARENA_BYTES: usize = 6 << 30;
/// Consecutive launches rotate over copies spanning at least this many bytes (L2 is 50 MB).
const ROTATE_BYTES: usize = 1 << 30;
/// With --l2, the most bytes a row's weights may take (of the 50 MB L2 of an H100 or H200).
const L2_ROW_BYTES: usize = 40 << 20;

struct Bench {
    gpu: Arc<Gpu>,
    module: Arc<CudaModule>,
    quick: bool,
    /// --l2: every launch reads the same weights.
    l2: bool,
    filter: Vec<String>,
    rows: Vec<Value>,
    /// Ceilings, once measured: bytes/s and FLOP/s.
    copy_bw: f64,
    mma_rate: f64,
}

/// The matrix-vector shapes of one model family: (name, rows, k).
struct Family {
    name: &'static str,
    hidden: usize,
    heads: usize,
    mats: Vec<(&'static str, usize, usize)>,
    /// Expert FFN width.
    ff_expert: usize,
}

fn families() -> Vec<Family> {
    // DeepSeek-V3: q_lora 1536, 128 heads of 128 + 64 (q) and 128 (v), kv_lora 512 + 64.
    let ds3 = Family {
        name: "ds3",
        hidden: 7168,
        heads: 128,
        ff_expert: 2048,
        mats: vec![
            ("q_a", 1536, 7168),
            ("q_b", 128 * 192, 1536),
            ("kv_a", 576, 7168),
            ("attn_output", 7168, 128 * 128),
            ("ffn_up", 18432, 7168),
            ("ffn_down", 7168, 18432),
            ("expert_up", 2048, 7168),
            ("expert_down", 7168, 2048),
            ("lm_head", 129280, 7168),
        ],
    };
    // GLM-5: q_lora 2048, 64 heads of 192 + 64 (q) and 256 (v), kv_lora 512 + 64.
    let glm5 = Family {
        name: "glm5",
        hidden: 6144,
        heads: 64,
        ff_expert: 2048,
        mats: vec![
            ("q_a", 2048, 6144),
            ("q_b", 64 * 256, 2048),
            ("kv_a", 576, 6144),
            ("attn_output", 6144, 64 * 256),
            ("ffn_up", 12288, 6144),
            ("ffn_down", 6144, 12288),
            ("expert_up", 2048, 6144),
            ("expert_down", 6144, 2048),
            ("lm_head", 154880, 6144),
        ],
    };
    vec![ds3, glm5]
}

const DECODE_TYPES: &[GgmlType] = &[
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
    GgmlType::IQ4_XS,
    // Not among issue 9's targets; the low-bit K-quants that fit the largest models on the
    // fewest GPUs.
    GgmlType::Q2_K,
    GgmlType::Q3_K,
];
const PREFILL_TYPES: &[GgmlType] = &[GgmlType::Q4_K, GgmlType::Q8_0];
const PREFILL_TOKENS: &[usize] = &[512, 2048];
const MLA_CONTEXTS: &[usize] = &[1024, 8192, 32768];
/// Selected experts per token (DeepSeek-V3 and GLM-5 both route to 8 of 256).
const MOE_USED: usize = 8;
const MOE_EXPERTS: usize = 256;

/// `count` sets of MOE_USED distinct random experts (xorshift from `seed`), as a router picks
/// them for `count` tokens.
fn expert_sets(mut seed: u64, count: usize) -> Vec<Vec<usize>> {
    (0..count)
        .map(|_| {
            let mut set = Vec::new();
            while set.len() < MOE_USED {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let e = (seed % MOE_EXPERTS as u64) as usize;
                if !set.contains(&e) {
                    set.push(e);
                }
            }
            set
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn align(n: usize) -> usize {
    n.div_ceil(256) * 256
}

impl Bench {
    fn new(quick: bool, l2: bool, filter: Vec<String>) -> Result<Bench> {
        let gpu = Arc::new(Gpu::new(0)?);
        let opts = cudarc::nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture=compute_{}", &gpu.arch[3..])],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(BENCH_KERNELS, opts)
            .context("compiling the bench kernels with NVRTC")?;
        let module = gpu.ctx.load_module(ptx)?;
        Ok(Bench {
            gpu,
            module,
            quick,
            l2,
            filter,
            rows: Vec::new(),
            copy_bw: f64::NAN,
            mma_rate: f64::NAN,
        })
    }

    /// How many copies of `bytes` to rotate over (one with --l2), and the distance between them.
    fn rotation(&self, bytes: usize, room: usize) -> (usize, usize) {
        let step = align(bytes);
        if self.l2 {
            return (1, step);
        }
        let copies = ROTATE_BYTES.div_ceil(step).clamp(1, (room / step).max(1));
        (copies, step)
    }

    /// A kernel row's name, marked when its weights come from L2.
    fn row_name(&self, name: String) -> String {
        if self.l2 {
            name + " over L2"
        } else {
            name
        }
    }

    fn wanted(&self, name: &str) -> bool {
        self.filter.is_empty() || self.filter.iter().any(|f| name.contains(f.as_str()))
    }

    fn function(&self, name: &str) -> Result<CudaFunction> {
        Ok(self.module.load_function(name)?)
    }

    fn fill_random(&self, buf: &mut CudaSlice<u8>, seed: u32) -> Result<()> {
        let f = self.function("fill_random")?;
        let words = (buf.len() / 4) as u64;
        let mut b = self.gpu.stream.launch_builder(&f);
        b.arg(buf).arg(&words).arg(&seed);
        let cfg = LaunchConfig {
            grid_dim: (4 * self.gpu.multiprocessors as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match fill_random's (u32*, u64, u32).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Median seconds per call of `f(i)` (i counts calls, for rotating inputs) on the device,
    /// and the host's seconds to submit one call.
    ///
    /// Each sample is a batch of back-to-back calls timed by CUDA events. A spin kernel queued
    /// first keeps the GPU busy while the host submits the whole batch, so the events see the
    /// kernels run back to back (the device's own gaps included) rather than the host's pace;
    /// the host's pace is the second number, and whole-model decode shows both together.
    fn time(&self, mut f: impl FnMut(usize) -> Result<()>) -> Result<(f64, f64)> {
        let stream = &self.gpu.stream;
        let spin = self.function("spin_ns")?;
        let ev = || {
            self.gpu
                .ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        };
        let (start, end) = (ev()?, ev()?);
        let mut calls = 0usize;
        let mut batch = |reps: usize, spin_ns: u64, calls: &mut usize| -> Result<(f64, f64)> {
            if spin_ns > 0 {
                let mut b = stream.launch_builder(&spin);
                b.arg(&spin_ns);
                let one = LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: spin_ns takes one u64.
                unsafe { b.launch(one) }?;
            }
            start.record(stream)?;
            let t = Instant::now();
            for _ in 0..reps {
                f(*calls)?;
                *calls += 1;
            }
            let host = t.elapsed().as_secs_f64() / reps as f64;
            end.record(stream)?;
            let device = start.elapsed_ms(&end)? as f64 * 1e-3 / reps as f64;
            Ok((device, host))
        };
        if self.quick {
            return batch(2, 0, &mut calls);
        }
        batch(3, 0, &mut calls)?; // warm-up: compiles and loads the kernels
                                  // The host's pace once compiled: sizing the spin by the warm-up's (a cold NVRTC
                                  // compile, seconds per call) made every sample spin for minutes.
        let (_, host) = batch(3, 0, &mut calls)?;
        let (first, _) = batch(3, (4.0 * host * 1e9) as u64 + 20_000, &mut calls)?;
        // Enough calls per sample for about 5 ms of device time.
        let reps = ((5e-3 / first.max(1e-7)) as usize).clamp(3, 500);
        let spin_ns = (1.5 * reps as f64 * host * 1e9) as u64 + 20_000;
        let samples = (0..9)
            .map(|_| batch(reps, spin_ns, &mut calls))
            .collect::<Result<Vec<_>>>()?;
        self.gpu.sync()?;
        Ok((
            median(samples.iter().map(|s| s.0).collect()),
            median(samples.iter().map(|s| s.1).collect()),
        ))
    }

    /// The timing of a row, or None after recording why it failed, so that one bad row (a
    /// shape a kernel refuses) does not cost the rest of the run.
    fn ok_or_report(
        &mut self,
        section: &str,
        name: &str,
        timed: Result<(f64, f64)>,
    ) -> Option<(f64, f64)> {
        match timed {
            Ok(t) => Some(t),
            Err(e) => {
                self.push(json!({"section": section, "name": name, "error": format!("{e:#}")}));
                None
            }
        }
    }

    fn push(&mut self, row: Value) {
        print_row(&row);
        self.rows.push(row);
    }

    /// A memory-bound row: `bytes` moved per call in `secs`.
    #[allow(clippy::too_many_arguments)]
    fn push_bw(
        &mut self,
        section: &str,
        name: String,
        bytes: f64,
        secs: f64,
        host: f64,
        extra: Value,
    ) {
        let gbps = bytes / secs / 1e9;
        let mut row = json!({
            "section": section, "name": name, "us": secs * 1e6, "host_us": host * 1e6,
            "bytes": bytes,
            "gb_s": gbps, "of_copy": bytes / secs / self.copy_bw,
        });
        merge(&mut row, extra);
        self.push(row);
    }

    /// A prefill product's row: TFLOP/s and its ratio to the mma rate beside GB/s.
    fn push_product(
        &mut self,
        name: String,
        flops: f64,
        bytes: f64,
        secs: f64,
        host: f64,
        extra: Value,
    ) {
        let mut row = json!({
            "section": "prefill", "name": name, "us": secs * 1e6, "host_us": host * 1e6,
            "flops": flops, "tflop_s": flops / secs / 1e12,
            "of_mma": flops / secs / self.mma_rate,
            "bytes": bytes, "gb_s": bytes / secs / 1e9,
        });
        merge(&mut row, extra);
        self.push(row);
    }

    fn ceilings(&mut self) -> Result<()> {
        let stream = self.gpu.stream.clone();
        let n = 1usize << 30;
        let mut src = stream.alloc_zeros::<u8>(n)?;
        let mut dst = stream.alloc_zeros::<u8>(n)?;
        self.fill_random(&mut src, 7)?;
        let (secs, _) = self.time(|_| Ok(stream.memcpy_dtod(&src, &mut dst)?))?;
        self.copy_bw = 2.0 * n as f64 / secs;
        self.push(json!({
            "section": "ceiling", "name": "copy d2d 1 GiB (read + write)", "us": secs * 1e6,
            "bytes": 2.0 * n as f64, "gb_s": self.copy_bw / 1e9, "of_copy": 1.0,
        }));
        drop((src, dst));

        let f = self.function("mma_peak")?;
        let blocks = 8 * self.gpu.multiprocessors;
        let threads = 256usize;
        let iters = 4096i32;
        let out = stream.alloc_zeros::<f32>(blocks * threads)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (secs, _) = self.time(|_| {
            let mut b = stream.launch_builder(&f);
            b.arg(&out).arg(&iters);
            // SAFETY: mma_peak takes (float*, int); out holds one float per thread.
            unsafe { b.launch(cfg) }?;
            Ok(())
        })?;
        let flops = (blocks * threads / 32) as f64 * iters as f64 * MMA_CHAINS as f64 * MMA_FLOPS;
        self.mma_rate = flops / secs;
        self.push(json!({
            "section": "ceiling", "name": "mma.sync m16n8k16 bf16 (register loop)",
            "us": secs * 1e6, "flops": flops, "tflop_s": self.mma_rate / 1e12, "of_mma": 1.0,
        }));

        // One launch: the host's cost to submit it, and the GPU's time per empty kernel when
        // they come back to back.
        let e = self.function("empty_kernel")?;
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let launch = || -> Result<()> {
            let mut b = stream.launch_builder(&e);
            // SAFETY: empty_kernel takes no arguments.
            unsafe { b.launch(one) }?;
            Ok(())
        };
        for _ in 0..100 {
            launch()?;
        }
        self.gpu.sync()?;
        let count = 20000;
        let t = Instant::now();
        for _ in 0..count {
            launch()?;
        }
        let host = t.elapsed().as_secs_f64() / count as f64;
        self.gpu.sync()?;
        let (gpu_secs, _) = self.time(|_| launch())?;
        self.push(json!({
            "section": "ceiling", "name": "launch of an empty kernel",
            "us": gpu_secs * 1e6, "host_us": host * 1e6,
        }));
        Ok(())
    }

    /// What one launch that only reads N bytes from DRAM reaches, for the sizes the decode
    /// kernels read a launch (q_b 21 MB .. the MoE gate-up pair 132 MB, the lm head 521 MB):
    /// the ramp and tail of a short launch, and the access pattern (the grid sweeping the bytes
    /// together, or each block its own stretch as the matrix-vector kernels read), beside the
    /// copy ceiling. 8 blocks of 256 threads an SM, 4 loads of 16 bytes in flight a thread.
    fn reads(&mut self, arena: &CudaSlice<u8>, out: u64) -> Result<()> {
        let base = self.gpu.ptr(arena, 0);
        let f = self.function("read_bytes")?;
        let cfg = LaunchConfig {
            grid_dim: (8 * self.gpu.multiprocessors as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        for mib in [16usize, 32, 64, 128, 256, 512] {
            for (stretches, how) in [(0i32, "grid sweep"), (1, "block stretches")] {
                let name = format!("read {mib} MiB, {how}");
                if !self.wanted(&name) {
                    continue;
                }
                let bytes = mib << 20;
                let (copies, step) = self.rotation(bytes, ARENA_BYTES);
                let words = (bytes / 16) as u64;
                let stream = self.gpu.stream.clone();
                let timed = self.time(|i| {
                    let p = base + ((i % copies) * step) as u64;
                    let mut b = stream.launch_builder(&f);
                    b.arg(&p).arg(&words).arg(&stretches).arg(&out);
                    // SAFETY: read_bytes takes (const uint4*, u64, int, u32*); p .. p + bytes
                    // lies in the arena, out holds a u32.
                    unsafe { b.launch(cfg) }?;
                    Ok(())
                });
                let Some((secs, host)) = self.ok_or_report("read", &name, timed) else {
                    continue;
                };
                self.push_bw("read", name, bytes as f64, secs, host, json!({"mib": mib}));
            }
        }
        Ok(())
    }

    fn matvec(&mut self, arena: &CudaSlice<u8>, x: u64, y: u64) -> Result<()> {
        let base = self.gpu.ptr(arena, 0);
        for fam in families() {
            for &(mat, rows, k) in &fam.mats {
                for &ty in DECODE_TYPES {
                    let name = self.row_name(format!(
                        "matvec {} {}.{mat} {rows}x{k}",
                        tname(ty),
                        fam.name
                    ));
                    let row_bytes = ty.row_bytes(k).context("whole blocks")?;
                    let bytes = rows * row_bytes;
                    if !self.wanted(&name) || self.l2 && bytes > L2_ROW_BYTES {
                        continue;
                    }
                    let (copies, step) = self.rotation(bytes, ARENA_BYTES);
                    let gpu = self.gpu.clone();
                    // As the engine's decode runs it: k's parts spread where that pays, their
                    // partials then summed by the next add_rmsnorm (not timed here).
                    let parts = gpu.spread_parts(&Matvec::single(ty, base, (x, y), (rows, k)))?;
                    let timed = self.time(|i| {
                        let w = base + ((i % copies) * step) as u64;
                        let a = Matvec {
                            y_part: if parts > 1 { rows } else { 0 },
                            ..Matvec::single(ty, w, (x, y), (rows, k))
                        };
                        Ok(gpu.matvec(&a)?)
                    });
                    let Some((secs, host)) = self.ok_or_report("matvec", &name, timed) else {
                        continue;
                    };
                    let moved = (bytes + 4 * k + 4 * rows * parts) as f64;
                    self.push_bw(
                        "matvec",
                        name,
                        moved,
                        secs,
                        host,
                        json!({"type": tname(ty), "rows": rows, "k": k, "family": fam.name,
                               "spread_parts": parts}),
                    );
                }
            }
        }
        Ok(())
    }

    /// MLA's absorbed per-head products of one decode token, one launch over the heads: k_b,
    /// per head h q_lat[h] (512) = k_b[h] (512 x dn) q_nope[h] (types whose blocks fit dn:
    /// Q5_0, Q8_0), and v_b, out[h] (dv) = v_b[h] (dv x 512) o_lat[h].
    fn heads(&mut self, arena: &CudaSlice<u8>, x: u64, y: u64) -> Result<()> {
        let base = self.gpu.ptr(arena, 0);
        let (kb, vb) = (
            [GgmlType::Q5_0, GgmlType::Q8_0],
            [GgmlType::Q4_K, GgmlType::Q6_K],
        );
        let shapes = [
            ("ds3", "k_b", 128usize, 512usize, 128usize, kb),
            ("glm5", "k_b", 64, 512, 192, kb),
            ("ds3", "v_b", 128, 128, 512, vb),
            ("glm5", "v_b", 64, 256, 512, vb),
        ];
        for (fam, what, heads, rows, k, types) in shapes {
            for ty in types {
                let name = self.row_name(format!(
                    "matvec_heads {} {fam}.{what} {heads} x {rows}x{k}",
                    tname(ty)
                ));
                if !self.wanted(&name) {
                    continue;
                }
                let row_bytes = ty.row_bytes(k).context("whole blocks")?;
                let bytes = heads * rows * row_bytes;
                let (copies, step) = self.rotation(bytes, ARENA_BYTES);
                let gpu = self.gpu.clone();
                let timed = self.time(|i| {
                    let w = base + ((i % copies) * step) as u64;
                    let mut a = Matvec::single(ty, w, (x, y), (rows, k));
                    a.batch = heads;
                    a.mat_stride = rows * row_bytes;
                    a.y_stride = rows;
                    Ok(gpu.matvec(&a)?)
                });
                let Some((secs, host)) = self.ok_or_report("matvec", &name, timed) else {
                    continue;
                };
                let moved = (bytes + 4 * heads * (k + rows)) as f64;
                self.push_bw(
                    "matvec",
                    name,
                    moved,
                    secs,
                    host,
                    json!({"type": tname(ty), "rows": rows, "k": k, "heads": heads,
                           "family": fam}),
                );
            }
        }
        Ok(())
    }

    /// The routed experts of one token as the CUDA backend runs them at decode: gate and up
    /// (8 items sharing x), silu * up, down (8 items), each item picking its expert by id; the
    /// first three in one launch where the kernel takes the pair (`Matvec::glu`).
    fn moe(&mut self, arena: &CudaSlice<u8>, scratch: u64) -> Result<()> {
        let base = self.gpu.ptr(arena, 0);
        // 64 sets of 8 distinct experts, so consecutive tokens read different experts (--l2:
        // every choice expert 0, whose three matrices then stay in L2).
        let sets: Vec<i32> = expert_sets(0x2545F4914F6CDD1D, 64)
            .into_iter()
            .flatten()
            .map(|e| if self.l2 { 0 } else { e as i32 })
            .collect();
        let ids = self.gpu.upload(&sets)?;
        let ids_ptr = self.gpu.ptr(&ids, 0);
        for fam in families() {
            for &ty in DECODE_TYPES {
                let name =
                    self.row_name(format!("moe {} {} 8 of 256 experts", tname(ty), fam.name));
                let (e, f) = (fam.hidden, fam.ff_expert);
                let gate_bytes = f * ty.row_bytes(e).context("whole blocks")?;
                let down_bytes = e * ty.row_bytes(f).context("whole blocks")?;
                if !self.wanted(&name) || self.l2 && 2 * gate_bytes + down_bytes > L2_ROW_BYTES {
                    continue;
                }
                let tensor = MOE_EXPERTS * gate_bytes.max(down_bytes);
                if tensor > ARENA_BYTES {
                    bail!("{name}: the expert tensor does not fit the arena");
                }
                // Three tensors over the arena, overlapping but shifted, so that gate, up and
                // down of one expert never share bytes.
                let room = ARENA_BYTES - tensor;
                let (gate_w, up_w, down_w) =
                    (base, base + align(room) as u64 / 2, base + room as u64);
                let (x, g, u, d) = (
                    scratch,
                    scratch + 4 * 8192,
                    scratch + 4 * (8192 + 8 * 8192),
                    scratch + 4 * (8192 + 16 * 8192),
                );
                let gpu = self.gpu.clone();
                let item = |w, mat_stride, rows, k, x, x_group, x_stride, y, i: usize| Matvec {
                    ty,
                    w,
                    mat_stride,
                    transposed: false,
                    pair: 0,
                    glu: false,
                    combine: None,
                    shared: (0, 0),
                    y_part: 0,
                    pick: 0,
                    ids: ids_ptr + (4 * MOE_USED * (i % 64)) as u64,
                    rows,
                    k,
                    x,
                    x_group,
                    x_stride,
                    y,
                    y_stride: rows,
                    batch: MOE_USED,
                };
                let glu_pair = |i| Matvec {
                    pair: up_w,
                    glu: true,
                    batch: 2 * MOE_USED,
                    ..item(gate_w, gate_bytes, f, e, x, MOE_USED, e, g, i)
                };
                let fused = gpu.takes_pair(&glu_pair(0));
                let timed = self.time(|i| {
                    if fused {
                        gpu.matvec(&glu_pair(i))?;
                    } else {
                        gpu.matvec(&item(gate_w, gate_bytes, f, e, x, MOE_USED, e, g, i))?;
                        gpu.matvec(&item(up_w, gate_bytes, f, e, x, MOE_USED, e, u, i))?;
                        gpu.silu_mul(g, u, g, MOE_USED * f)?;
                    }
                    gpu.matvec(&item(down_w, down_bytes, e, f, g, 1, f, d, i))?;
                    Ok(())
                });
                let Some((secs, host)) = self.ok_or_report("moe", &name, timed) else {
                    continue;
                };
                let moved = MOE_USED as f64 * (2.0 * gate_bytes as f64 + down_bytes as f64)
                    + 4.0 * (e + 3 * MOE_USED * f + MOE_USED * e) as f64;
                self.push_bw(
                    "moe",
                    name,
                    moved,
                    secs,
                    host,
                    json!({"type": tname(ty), "family": fam.name, "launches": if fused { 2 } else { 4 }}),
                );
            }
        }
        Ok(())
    }

    /// Absorbed MLA decode of one token over a latent cache of S rows [c_kv 512 | k_pe 64] (the
    /// format's hi and lo bf16 parts, 4 bytes a value),
    /// q_pe roped by the kernel as the model's decode has it (`MlaDecode::qp_rope`).
    fn mla(&mut self, arena: &CudaSlice<u8>, scratch: u64) -> Result<()> {
        let base = self.gpu.ptr(arena, 0);
        let (dl, dr) = (512usize, 64usize);
        let rope = rope_frequencies(dr, 10000.0, None);
        let inv_freq = self.gpu.upload(&rope.inv_freq)?;
        let qp_rope = (self.gpu.ptr(&inv_freq, 0), rope.cos_sin_scale);
        // The whole model's heads, and one rank's of tensor parallelism over 8 GPUs.
        let shapes = families()
            .into_iter()
            .flat_map(|f| [(f.name, f.heads, ""), (f.name, f.heads / 8, " tp8 rank")]);
        for (fam, h, rank) in shapes {
            for &s in MLA_CONTEXTS {
                let name = format!("mla_decode {fam}{rank} {}K context", s / 1024);
                if !self.wanted(&name) {
                    continue;
                }
                let cache_bytes = 4 * s * (dl + dr);
                let q_bytes = 4 * h * (dl + dr);
                let (copies, step) = self.rotation(cache_bytes + q_bytes, ARENA_BYTES);
                let gpu = self.gpu.clone();
                let timed = self.time(|i| {
                    let at = base + ((i % copies) * step) as u64;
                    Ok(gpu.mla_decode(&MlaDecode {
                        q_lat: at + cache_bytes as u64,
                        ql_tok: h * dl,
                        q_pe: at + (cache_bytes + 4 * h * dl) as u64,
                        qp_tok: h * dr,
                        qp_head: dr,
                        qp_rope,
                        cache: at,
                        dl,
                        dr,
                        heads: h,
                        tokens: 1,
                        pos0: s - 1,
                        key_ids: 0,
                        n_ids: 0,
                        scale: 0.07,
                        out: scratch,
                        out_tok: h * dl,
                    })?)
                });
                let Some((secs, host)) = self.ok_or_report("mla", &name, timed) else {
                    continue;
                };
                let (splits, per) = self.gpu.mla_decode_splits(s, h);
                let moved = (cache_bytes + q_bytes + 4 * h * dl) as f64;
                self.push_bw(
                    "mla",
                    name,
                    moved,
                    secs,
                    host,
                    json!({"family": fam, "context": s, "heads": h,
                           "kernel": self.gpu.mla_decode_form(s, h).0,
                           "splits": splits, "keys_per_split": per, "launches": 2}),
                );
            }
        }
        Ok(())
    }

    /// GLM-5's DSA indexer for one decode token over S cached indexer keys (f32, 32 heads of
    /// 128): the score of every key (dsa_scores), then the positions of the top 2048
    /// (topk_rows).
    fn dsa(&mut self, arena: &CudaSlice<u8>, scratch: u64) -> Result<()> {
        let base = self.gpu.ptr(arena, 0);
        let (heads, dim, top) = (32usize, 128usize, 2048usize);
        for &s in MLA_CONTEXTS {
            let name = format!("dsa_indexer glm5 {}K context", s / 1024);
            if !self.wanted(&name) {
                continue;
            }
            let key_bytes = 4 * s * dim;
            let q_bytes = 4 * heads * (dim + 1); // the query and the head weights
            let (copies, step) = self.rotation(key_bytes + q_bytes, ARENA_BYTES);
            let (scores, ids) = (scratch, scratch + 4 * s as u64);
            let gpu = self.gpu.clone();
            let timed = self.time(|i| {
                let at = base + ((i % copies) * step) as u64;
                let (q, w) = (
                    at + key_bytes as u64,
                    at + (key_bytes + 4 * heads * dim) as u64,
                );
                gpu.dsa_scores(q, at, w, heads, dim, 1, s, s - 1, 0.09, scores, s)?;
                Ok(gpu.topk_rows(scores, s, 1, s - 1, top, ids)?)
            });
            let Some((secs, host)) = self.ok_or_report("dsa", &name, timed) else {
                continue;
            };
            // The keys and query, the scores written and read back, the selected positions.
            let moved = (key_bytes + q_bytes + 2 * 4 * s + 4 * top) as f64;
            self.push_bw(
                "dsa",
                name,
                moved,
                secs,
                host,
                json!({"context": s, "heads": heads, "dim": dim, "top_k": top, "launches": 2}),
            );
        }
        Ok(())
    }

    /// Tensor-core products of T prompt tokens (f32 activations, quantized weights).
    fn prefill(&mut self, arena: &CudaSlice<u8>, xbuf: u64, ybuf: u64) -> Result<()> {
        let base = self.gpu.ptr(arena, 0);
        for fam in families() {
            for &(mat, n, k) in &fam.mats {
                if mat.starts_with("expert") || mat == "lm_head" {
                    continue;
                }
                for &ty in PREFILL_TYPES {
                    for &m in PREFILL_TOKENS {
                        let name = format!("matmul {} {}.{mat} {m}x{n}x{k}", tname(ty), fam.name);
                        if !self.wanted(&name) {
                            continue;
                        }
                        let bytes = n * ty.row_bytes(k).context("whole blocks")?;
                        let (copies, step) = self.rotation(bytes, ARENA_BYTES);
                        let gpu = self.gpu.clone();
                        let timed = self.time(|i| {
                            let w = base + ((i % copies) * step) as u64;
                            Ok(gpu.matmul(&Matmul::plain(
                                ty,
                                w,
                                (xbuf, k),
                                (ybuf, n),
                                (m, n, k),
                            ))?)
                        });
                        let Some((secs, host)) = self.ok_or_report("prefill", &name, timed) else {
                            continue;
                        };
                        let flops = 2.0 * (m * n * k) as f64;
                        let moved = (bytes + 4 * m * k + 4 * m * n) as f64;
                        // Columns run whole over k, then the split ones (matmul_cp_plan).
                        let plan = self
                            .gpu
                            .matmul_cp_plan(&Matmul::plain(ty, 0, (0, k), (0, n), (m, n, k)))?
                            .map(|p| json!({"whole_columns": p.head, "splits": p.splits}));
                        self.push_product(
                            name,
                            flops,
                            moved,
                            secs,
                            host,
                            json!({
                                "type": tname(ty), "m": m, "n": n, "k": k, "family": fam.name,
                                "plan": plan,
                            }),
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// The MoE prefill's grouped product (one launch for all experts, as moe_experts runs it):
    /// T tokens routed to 8 of 256 experts at random, the gate product of every expert's
    /// tokens. Bytes: the weights of the experts with tokens, X once, Y once.
    fn moe_prefill(&mut self, arena: &CudaSlice<u8>, xbuf: u64, ybuf: u64) -> Result<()> {
        let base = self.gpu.ptr(arena, 0);
        for fam in families() {
            for &ty in PREFILL_TYPES {
                for &m in PREFILL_TOKENS {
                    let name = format!(
                        "moe gate {} {} {m} tokens x 8 of 256 experts",
                        tname(ty),
                        fam.name
                    );
                    if !self.wanted(&name) {
                        continue;
                    }
                    let (e, f) = (fam.hidden, fam.ff_expert);
                    let mat_stride = f * ty.row_bytes(e).context("whole blocks")?;
                    let mut by_expert = vec![Vec::new(); MOE_EXPERTS];
                    for (t, set) in expert_sets(0x9E3779B97F4A7C15 ^ m as u64, m)
                        .into_iter()
                        .enumerate()
                    {
                        for ex in set {
                            by_expert[ex].push(t as i32);
                        }
                    }
                    let (mut spans, mut tokens): (Vec<i32>, Vec<i32>) = (Vec::new(), Vec::new());
                    for (ex, list) in by_expert.iter().enumerate() {
                        if !list.is_empty() {
                            spans.extend([ex as i32, tokens.len() as i32, list.len() as i32]);
                            tokens.extend(list);
                        }
                    }
                    let used = spans.len() / 3;
                    let largest = by_expert.iter().map(Vec::len).max().unwrap_or(0);
                    let (dspans, dtok) = (self.gpu.upload(&spans)?, self.gpu.upload(&tokens)?);
                    let mm = Matmul {
                        row_ids: self.gpu.ptr(&dtok, 0),
                        x_rows: m,
                        spans: self.gpu.ptr(&dspans, 0),
                        n_spans: used,
                        span_rows: tokens.len(),
                        mat_stride,
                        ..Matmul::plain(ty, base, (xbuf, e), (ybuf, f), (largest, f, e))
                    };
                    let gpu = self.gpu.clone();
                    let timed = self.time(|_| Ok(gpu.matmul(&mm)?));
                    let Some((secs, host)) = self.ok_or_report("prefill", &name, timed) else {
                        continue;
                    };
                    let rows = m * MOE_USED;
                    let flops = 2.0 * (rows * f * e) as f64;
                    let moved = (used * mat_stride + 4 * m * e + 4 * rows * f) as f64;
                    let of_copy = moved / secs / self.copy_bw;
                    self.push_product(
                        name,
                        flops,
                        moved,
                        secs,
                        host,
                        json!({
                            "of_copy": of_copy,
                            "type": tname(ty), "m": m, "n": f, "k": e, "family": fam.name,
                            "experts": used,
                        }),
                    );
                }
            }
        }
        Ok(())
    }

    fn kernels(&mut self) -> Result<()> {
        let stream = self.gpu.stream.clone();
        let mut arena = stream.alloc_zeros::<u8>(ARENA_BYTES)?;
        self.fill_random(&mut arena, 1)?;
        // Activations: x for matvec / prefill (up to 2048 x 18432 f32), y up to 2048 x 18432.
        let mut act = stream.alloc_zeros::<u8>(2 * 4 * 2048 * 18432)?;
        self.fill_random(&mut act, 2)?;
        let x = self.gpu.ptr(&act, 0);
        let mut out = stream.alloc_zeros::<u8>(4 * 2048 * 154880)?;
        self.fill_random(&mut out, 3)?;
        let y = self.gpu.ptr(&out, 0);
        self.gpu.sync()?;
        if !self.l2 {
            self.reads(&arena, y)?;
        }
        self.matvec(&arena, x, y)?;
        self.heads(&arena, x, y)?;
        self.moe(&arena, x)?;
        if self.l2 {
            return Ok(());
        }
        self.mla(&arena, y)?;
        self.dsa(&arena, y)?;
        self.prefill(&arena, x, y)?;
        self.moe_prefill(&arena, x, y)?;
        self.attention(x, y)?;
        self.argmax(y)?;
        Ok(())
    }

    /// The prefill's causal attention over T tokens of one layer (every head), on the f32
    /// kernel and on the tensor cores (`attention_prefill_mma`, with its bf16 rounding of q, k
    /// and v): FLOPs 2 (dqk + dv) per head and causal pair. Inputs overlap in `xbuf` (read only).
    fn attention(&mut self, xbuf: u64, ybuf: u64) -> Result<()> {
        // (family, heads, nope, rope, v)
        for (fam, heads, dn, dr, dv) in [("ds3", 128, 128, 64, 128), ("glm5", 64, 192, 64, 256)] {
            for &t in PREFILL_TOKENS {
                for mma in [false, true] {
                    let kind = if mma { "mma" } else { "f32" };
                    let name = format!("attention {kind} {fam} {t} tokens");
                    if !self.wanted(&name) {
                        continue;
                    }
                    let dqk = dn + dr;
                    let a = AttentionPrefill {
                        q: xbuf,
                        q_tok: heads * dqk,
                        q_head: dqk,
                        ka: xbuf + (4 * t * heads * dn / 2) as u64,
                        ka_tok: heads * dn,
                        ka_head: dn,
                        dka: dn,
                        kb: xbuf,
                        kb_tok: dr,
                        kb_head: 0,
                        dkb: dr,
                        v: xbuf + (4 * t * heads * dqk / 2) as u64,
                        v_tok: heads * dv,
                        v_head: dv,
                        dv,
                        out: ybuf,
                        o_tok: heads * dv,
                        o_head: dv,
                        mask: 0,
                        mask_words: 0,
                        tokens: t,
                        heads,
                        pos0: 0,
                        scale: 1.0 / (dqk as f32).sqrt(),
                    };
                    let gpu = self.gpu.clone();
                    let timed = self.time(|_| {
                        if mma {
                            anyhow::ensure!(gpu.attention_prefill_mma(&a)?, "no tensor-core form");
                        } else {
                            gpu.attention_prefill(&a)?;
                        }
                        Ok(())
                    });
                    let Some((secs, host)) = self.ok_or_report("prefill", &name, timed) else {
                        continue;
                    };
                    let flops = 2.0 * ((dqk + dv) * heads * t * (t + 1) / 2) as f64;
                    let moved = (4 * t * heads * (dqk + dn + 2 * dv) + 4 * t * dr) as f64;
                    self.push_product(
                        name,
                        flops,
                        moved,
                        secs,
                        host,
                        json!({"family": fam, "tokens": t, "heads": heads, "kernel": kind}),
                    );
                }
            }
        }
        Ok(())
    }

    /// The greedy pick of a decode token, on its critical path: the argmax of the logits.
    fn argmax(&mut self, logits: u64) -> Result<()> {
        let id = self.gpu.empty_i32(1)?;
        let out = self.gpu.ptr(&id, 0);
        for (fam, n) in [("ds3", 129_280), ("glm5", 154_880)] {
            let name = format!("argmax {fam}.logits {n}");
            if !self.wanted(&name) {
                continue;
            }
            let gpu = self.gpu.clone();
            let timed = self.time(|_| Ok(gpu.argmax_row(logits, n, out)?));
            if let Some((secs, host)) = self.ok_or_report("sampling", &name, timed) {
                self.push_bw("sampling", name, 4.0 * n as f64, secs, host, json!({}));
            }
        }
        Ok(())
    }

    /// Whole-model decode and prefill on a GGUF file.
    fn model(&mut self, path: &Path, args: &Args) -> Result<()> {
        let (tokens, prefill) = (args.tokens, &args.prefill);
        let file = Arc::new(GgufFile::open(path)?);
        let cfg = ModelConfig::from_gguf(&file)?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let t = Instant::now();
        let cuda = Cuda::new(0)?;
        let model = Model::load(cfg.clone(), cuda, &GgufTensors(file.clone()))
            .with_context(|| format!("loading {}", path.display()))?;
        let load_secs = t.elapsed().as_secs_f64();
        let per_token = mla_engine::weights::active_bytes_per_token(&file, &cfg);
        let prompt = token_ids(8, cfg.n_vocab);
        let mut cache = model.new_cache(prompt.len() + tokens + 8);
        model
            .backend
            .download(&model.forward(&mut cache, &prompt, &mut Taps::none())?);
        // Greedy steps as `generate` takes them: the forward queued on the GPU's pick of the
        // token before (argmax_pick), then that pick read back, so that the GPU runs a step
        // ahead of the host. A decode time: the median of `tokens` steps after 3 of warm-up;
        // beside it the host's time to queue a step (its launches and allocations): once that
        // nears the step, the host and not the GPU sets the pace.
        let mut before: Option<<Cuda as Backend>::Pick> = None;
        let mut step = |cache: &mut Cache<Cuda>| -> Result<(f64, f64)> {
            let t = Instant::now();
            let queued = greedy_step(&model, cache, &mut before)?;
            Ok((t.elapsed().as_secs_f64(), queued))
        };
        let mut decode_secs = |cache: &mut Cache<Cuda>| -> Result<(f64, f64)> {
            for _ in 0..3 {
                step(cache)?;
            }
            let (times, queued): (Vec<f64>, Vec<f64>) = (0..tokens)
                .map(|_| step(cache))
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .unzip();
            Ok((median(times), median(queued)))
        };
        let (secs, host) = decode_secs(&mut cache)?;
        // The latent cache rows read per token are few here (a short context): left out.
        let bound = per_token / self.copy_bw;
        self.push(json!({
            "section": "model", "name": format!("decode {name}"), "us": secs * 1e6,
            "tok_s": 1.0 / secs, "bytes": per_token, "gb_s": per_token / secs / 1e9,
            "of_copy": bound / secs, "bound_tok_s": 1.0 / bound, "load_s": load_secs,
            "layers": cfg.n_layer, "host_us": host * 1e6,
        }));
        // The same after a long prompt; the bytes add what each token reads from the cache.
        let ctx = args.long_context;
        if ctx > 0 {
            let ids = token_ids(ctx, cfg.n_vocab);
            let mut cache = model.new_cache(ctx + tokens + 8);
            drop(model.forward_last(&mut cache, &ids)?);
            let (secs, host) = decode_secs(&mut cache)?;
            let bytes = per_token + cache_bytes_per_token(&cfg, ctx);
            let bound = bytes / self.copy_bw;
            self.push(json!({
                "section": "model", "name": format!("decode {name} at {ctx} positions"),
                "us": secs * 1e6, "tok_s": 1.0 / secs, "bytes": bytes, "gb_s": bytes / secs / 1e9,
                "of_copy": bound / secs, "bound_tok_s": 1.0 / bound, "context": ctx,
                "host_us": host * 1e6,
            }));
        }
        for &n in prefill {
            if n == 0 {
                continue;
            }
            let ids = token_ids(n, cfg.n_vocab);
            let run = || -> Result<f64> {
                let mut cache = model.new_cache(n);
                let t = Instant::now();
                let logits = model.forward_last(&mut cache, &ids)?;
                model.backend.gpu.sync()?;
                let secs = t.elapsed().as_secs_f64();
                drop(logits);
                Ok(secs)
            };
            run()?;
            let secs = median((0..3).map(|_| run()).collect::<Result<Vec<_>>>()?);
            self.push(json!({
                "section": "model", "name": format!("prefill {n} {name}"), "us": secs * 1e6,
                "tok_s": n as f64 / secs, "tokens": n,
            }));
        }
        Ok(())
    }
}

/// One greedy decode step as `generate` takes it: the forward queued on the GPU's pick of the
/// token before (`before`, then this step's pick), then that pick read back, so that the GPU
/// runs a step ahead of the host. Returns the host's seconds to queue the step (its launches
/// and allocations, before the read-back).
fn greedy_step(
    model: &Model<Cuda>,
    cache: &mut Cache<Cuda>,
    before: &mut Option<<Cuda as Backend>::Pick>,
) -> Result<f64> {
    let t = Instant::now();
    let logits = match before.as_ref() {
        Some(pick) => model.forward_pick(cache, pick)?,
        None => model.forward(cache, &[1], &mut Taps::none())?,
    };
    let picked = before.replace(model.backend.argmax_pick(&logits));
    let queued = t.elapsed().as_secs_f64();
    if let Some(pick) = picked {
        model.backend.pick_id(&pick);
    }
    Ok(queued)
}

/// `n` token ids spread over the vocabulary (the same for every run).
fn token_ids(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// The cache bytes a decode token reads at `ctx` positions: every layer's latent rows (4
/// bytes a value of [kv_lora + rope]; with DSA, the top_k selected of them) and, in the layers that run their
/// own DSA indexer, the indexer key of every position (f32 [head_dim]).
fn cache_bytes_per_token(cfg: &ModelConfig, ctx: usize) -> f64 {
    let (latent_rows, index_keys) = match &cfg.indexer {
        Some(ix) => {
            let own = ix.full.iter().take(cfg.n_layer).filter(|&&f| f).count();
            (ctx.min(ix.top_k), own * ctx * ix.head_dim)
        }
        None => (ctx, 0),
    };
    (4 * (cfg.n_layer * latent_rows * cfg.latent_width() + index_keys)) as f64
}

fn tname(ty: GgmlType) -> String {
    ty.name().to_lowercase()
}

fn merge(row: &mut Value, extra: Value) {
    if let (Value::Object(r), Value::Object(e)) = (row, extra) {
        r.extend(e);
    }
}

fn print_row(row: &Value) {
    let f = |k: &str| row.get(k).and_then(Value::as_f64);
    let mut line = format!(
        "{:<8} {:<52} {:>10.1} us",
        row["section"].as_str().unwrap_or(""),
        row["name"].as_str().unwrap_or(""),
        f("us").unwrap_or(f64::NAN)
    );
    if let Some(g) = f("gb_s") {
        line += &format!(" {g:>8.0} GB/s");
    }
    if let Some(r) = f("of_copy") {
        line += &format!(" {:>5.1}% of copy", 100.0 * r);
    }
    if let Some(t) = f("tflop_s") {
        line += &format!(
            " {t:>7.1} TFLOP/s {:>5.1}% of mma",
            100.0 * f("of_mma").unwrap_or(0.0)
        );
    }
    if let Some(t) = f("tok_s") {
        line += &format!(" {t:>9.1} tok/s");
    }
    if let Some(e) = row.get("error").and_then(Value::as_str) {
        line += &format!(" FAILED: {e}");
    }
    if let Some(h) = f("host_us") {
        line += &format!(" (host {h:.2} us)");
    }
    println!("{line}");
}

/// Loads the model and runs one decode token (`prefill` None; after a prompt of `context`
/// tokens, at least 4) or one prefill of `prefill` tokens between cuProfilerStart and
/// cuProfilerStop, after warming the same shapes up.
fn profile_one_step(path: &Path, prefill: Option<usize>, context: usize) -> Result<()> {
    let file = Arc::new(GgufFile::open(path)?);
    let cfg = ModelConfig::from_gguf(&file)?;
    let model = Model::load(cfg.clone(), Cuda::new(0)?, &GgufTensors(file))?;
    let run = |cache: &mut _, tokens: &[u32]| -> Result<()> {
        model.backend.download(&model.forward_last(cache, tokens)?);
        Ok(())
    };
    let profiled: Vec<u32> = match prefill {
        Some(n) => {
            let tokens: Vec<u32> = (0..n as u32).map(|i| 1 + i % 1000).collect();
            run(&mut model.new_cache(n), &tokens)?;
            tokens
        }
        None => vec![7],
    };
    let mut cache = model.new_cache(context + profiled.len() + 16);
    if prefill.is_none() {
        let prompt = token_ids(context.max(4), cfg.n_vocab);
        for tokens in [&prompt[..], &[5], &[6]] {
            run(&mut cache, tokens)?;
        }
    }
    // SAFETY: plain driver calls on the current context, which Model's backend made current.
    unsafe { cudarc::driver::sys::cuProfilerStart() }.result()?;
    run(&mut cache, &profiled)?;
    unsafe { cudarc::driver::sys::cuProfilerStop() }.result()?;
    Ok(())
}

/// `--chain-clock`: the model's decode steps on the chain clock after a short prompt and,
/// where `long` > 0, after `long` positions, printed as each launch's share of a step and
/// written to `json`.
fn chain_clock_decode(path: &Path, steps: usize, long: usize, json: Option<&Path>) -> Result<()> {
    // Before the GPU is opened: the kernels compile with the stamps (kernels::chain_clock).
    std::env::set_var("MLA_CHAIN_CLOCK", "1");
    let file = Arc::new(GgufFile::open(path)?);
    let cfg = ModelConfig::from_gguf(&file)?;
    let model = Model::load(cfg.clone(), Cuda::new(0)?, &GgufTensors(file))?;
    let gpu = &model.backend.gpu;
    let mut docs = Vec::new();
    for context in [8, long].into_iter().filter(|&c| c > 0) {
        let prompt = token_ids(context, cfg.n_vocab);
        let mut cache = model.new_cache(prompt.len() + steps + 16);
        drop(model.forward_last(&mut cache, &prompt)?);
        // Steps as the bench's decode takes them (the GPU a step ahead of the host), the first
        // launch of each noted; 3 of warm-up, then the clock.
        let mut before: Option<<Cuda as Backend>::Pick> = None;
        let mut starts = Vec::new();
        for i in 0..3 + steps + 1 {
            if i == 3 {
                gpu.chain_clock_start()?;
            }
            starts.push(gpu.chain_clock_launches());
            greedy_step(&model, &mut cache, &mut before)?;
        }
        let stamps = gpu.chain_clock_read()?;
        let chain = crate::chain::Chain::from_stamps(&stamps, &starts[3..])?;
        println!(
            "{}: {} decode steps after {context} positions on the chain clock, {:.1} us a step",
            path.display(),
            chain.steps,
            chain.step_us
        );
        println!(
            "in chain order, what each launch adds (from the end of the one before to its \
             own), over the {} steps that launched step 0's kernels:",
            chain.same_steps
        );
        for (i, (name, us)) in chain.launches.iter().enumerate() {
            println!("{i:4} {name:<36} {us:8.1} us");
        }
        println!("per kernel, a step (us, share, launches):");
        for (name, n, us) in &chain.by_kernel {
            let share = 100.0 * us / chain.step_us;
            println!("{us:10.1} us {share:5.1}% {n:6.2}  {name}");
        }
        docs.push(json!({
            "context": context, "steps": chain.steps, "step_us": chain.step_us,
            "same_steps": chain.same_steps,
            "launches": chain.launches.iter().map(|(k, us)| json!({"kernel": k, "us": us})).collect::<Vec<_>>(),
            "by_kernel": chain.by_kernel.iter().map(|(k, n, us)| json!({"kernel": k, "launches": n, "us": us})).collect::<Vec<_>>(),
        }));
    }
    if let Some(json) = json {
        let doc = json!({"model": path.display().to_string(), "chains": docs});
        std::fs::write(json, serde_json::to_string_pretty(&doc)?)
            .with_context(|| json.display().to_string())?;
    }
    Ok(())
}

pub fn run(args: Args) -> Result<()> {
    if args.chain_clock {
        let path = args.model.first().context("--chain-clock needs --model")?;
        return chain_clock_decode(path, args.tokens, args.long_context, args.json.as_deref());
    }
    if args.profile_token || args.profile_prefill.is_some() {
        let path = args.model.first().context("profiling needs --model")?;
        return profile_one_step(path, args.profile_prefill, args.profile_context);
    }
    if args.l2 && (args.skip_kernels || !args.model.is_empty()) {
        bail!("--l2 times the matrix-vector and MoE rows only: no --model, no --skip-kernels");
    }
    let mut bench = Bench::new(args.quick, args.l2, args.filter.clone())?;
    println!(
        "{} ({}, {} SMs)",
        bench.gpu.name, bench.gpu.arch, bench.gpu.multiprocessors
    );
    if !args.quick {
        bench.ceilings()?;
    }
    if !args.skip_kernels {
        bench.kernels()?;
    }
    for path in &args.model {
        if let Err(e) = bench.model(path, &args) {
            println!("model {}: {e:#}", path.display());
        }
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "gpu": bench.gpu.name, "arch": bench.gpu.arch,
            "multiprocessors": bench.gpu.multiprocessors,
            "copy_gb_s": bench.copy_bw / 1e9, "mma_tflop_s": bench.mma_rate / 1e12,
            "l2": args.l2,
            "rows": bench.rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| path.display().to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth;
    use clap::Parser;

    #[derive(Parser)]
    struct SynthCli {
        #[command(flatten)]
        args: synth::Args,
    }

    /// The bytes a decode token reads, counted from the file's tensor table, agree with the
    /// count synth makes from its own plan, for both families, with an MTP block the engine
    /// skips and the experts that a token does not select.
    #[test]
    fn active_bytes_agree_with_the_synth_plan() {
        for arch in ["glm-dsa", "deepseek2"] {
            let path = std::env::temp_dir().join(format!(
                "mla-bench-active-{arch}-{}.gguf",
                std::process::id()
            ));
            let cli = SynthCli::parse_from([
                "synth",
                "--arch",
                arch,
                "--layers",
                "3",
                "--nextn",
                "1",
                "--tiny",
                path.to_str().unwrap(),
            ]);
            let spec = synth::Spec::from_args(&cli.args).unwrap();
            let summary = synth::synthesize(&spec, &path, false).unwrap();
            let file = GgufFile::open(&path).unwrap();
            let cfg = ModelConfig::from_gguf(&file).unwrap();
            let counted = mla_engine::weights::active_bytes_per_token(&file, &cfg);
            std::fs::remove_file(&path).unwrap();
            assert_eq!(counted, summary.active_bytes as f64, "{arch}");
        }
    }
}
