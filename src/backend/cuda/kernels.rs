//! The kernel families of `kernels/*.cu`, their sources and their shared-memory needs.
//!
//! NVRTC compiles each family as one program: `common.cuh`, then `quant.cuh` for the families
//! that read quantized blocks, then the family's own file. The sources are embedded in the
//! binary, so a GPU host needs only the driver and libnvrtc.

const COMMON: &str = include_str!("../../../kernels/common.cuh");
const QUANT: &str = include_str!("../../../kernels/quant.cuh");

/// One `kernels/NAME.cu` file.
pub struct Family {
    pub name: &'static str,
    /// Whether it includes the block formats (quant.cuh).
    quant: bool,
    body: &'static str,
}

/// Whether the kernels stamp the chain clock (MLA_CHAIN_CLOCK=1; common.cuh, `Gpu::chain_clock`):
/// a diagnostic of what each launch adds to decode as it runs. The define changes the source,
/// so its cubins are cached apart from the plain ones.
pub fn chain_clock() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MLA_CHAIN_CLOCK").is_ok_and(|v| v == "1"))
}

impl Family {
    /// The full program text NVRTC compiles for `arch` ("sm_90").
    pub fn source(&self, arch: &str) -> String {
        let mut s = String::new();
        if chain_clock() {
            s.push_str("#define MLA_CHAIN_CLOCK\n");
        }
        if self.name == "mla_decode" {
            s.push_str(&format!("#define MLA_BK {}\n", mla_keys_per_tile(arch)));
        }
        s.push_str(COMMON);
        if self.quant {
            s.push_str(QUANT);
        }
        s.push_str(self.body);
        s
    }
}

macro_rules! family {
    ($name:literal, $quant:expr) => {
        Family {
            name: $name,
            quant: $quant,
            body: include_str!(concat!("../../../kernels/", $name, ".cu")),
        }
    };
}

pub const FAMILIES: &[Family] = &[
    family!("matvec", true),
    family!("matmul", true),
    family!("norm", false),
    family!("rope", false),
    family!("elementwise", false),
    family!("attention", false),
    family!("mla_decode", false),
    family!("dsa", false),
    family!("moe", false),
    family!("sampling", false),
];

/// The family that defines `kernel` (by the kernel-name prefixes of each file).
pub fn family_of(kernel: &str) -> Option<&'static Family> {
    let name = match kernel {
        k if k.starts_with("matvec_") || k.starts_with("embed_") => "matvec",
        k if k.starts_with("matmul_") => "matmul",
        "rmsnorm"
        | "layernorm"
        | "add_rmsnorm"
        | "add_rmsnorm_cluster"
        | "latent_norm_rope"
        | "latent_rows" => "norm",
        "rope_pairs" => "rope",
        "silu_mul" | "add_inplace" | "copy_block" => "elementwise",
        "attention_prefill" | "attention_bf16" => "attention",
        k if k.starts_with("attention_mma_") => "attention",
        "mla_decode_split"
        | "mla_decode_split16"
        | "mla_decode_split16x2"
        | "mla_decode_combine" => "mla_decode",
        "dsa_scores" | "dsa_scores2" | "dsa_scores_mma16" | "dsa_scores_mma32"
        | "dsa_scores_mma64" | "topk_rows" | "topk_rows_cluster4" | "topk_rows_cluster8"
        | "keep_mask" => "dsa",
        "moe_router" | "moe_route_f32" | "moe_combine" => "moe",
        "argmax_row" | "top_p_sample" => "sampling",
        _ => return None,
    };
    FAMILIES.iter().find(|f| f.name == name)
}

/// SM120's limit on shared memory per block (static + dynamic), which every kernel keeps on
/// every architecture so that what runs on the H200 also runs on an RTX PRO 6000; only
/// mla_decode's key tiles grow where more is there (`shared_memory_limit`).
pub const SHARED_MEMORY_LIMIT: usize = 99 * 1024;

/// The most shared memory a block of a kernel compiled for `arch` may take: 227 KiB on sm_90
/// and sm_100 (Hopper, datacenter Blackwell), SM120's 99 KiB elsewhere (sm_80's 163 KiB is not
/// used: its kernels are SM120's).
pub fn shared_memory_limit(arch: &str) -> usize {
    let major = arch
        .strip_prefix("sm_")
        .and_then(|n| n.get(..n.len().saturating_sub(1)))
        .and_then(|m| m.parse::<u32>().ok());
    match major {
        Some(9 | 10) => 227 * 1024,
        _ => SHARED_MEMORY_LIMIT,
    }
}

/// Keys a shared tile of mla_decode_split's forms compiled for `arch` (the kernel's MLA_BK):
/// 32 where their stages fit a block (166 KB, with room for the static rest), else 16. A key
/// tile's chain is latency, and 32 keys carry twice its mma work: H100, DS3 at 8K 47.1 ->
/// 42.4 us, at 32K 137.4 -> 121.3; GLM-5 at 8K 31.9 -> 29.2; one tensor-parallel rank's rows
/// 1-11% faster or the same (fifty-ninth look).
pub fn mla_keys_per_tile(arch: &str) -> usize {
    if mla_decode_smem_bytes(32) + 8 * 1024 <= shared_memory_limit(arch) {
        32
    } else {
        16
    }
}

// Tile sizes shared with attention.cu (ATT_BQ, ATT_BK, ATT_THREADS).
pub const ATT_BQ: usize = 64;
const ATT_BK: usize = 16;
pub const ATT_THREADS: u32 = 128;
/// Largest head dims of attention_prefill (GLM-5: 192 + 64 and 256).
pub const ATT_DQK_MAX: usize = 256;
pub const ATT_DV_MAX: usize = 256;
/// Largest latent width of mla_decode_split (kv_lora of DeepSeek-V3 and GLM-5).
pub const MLA_DL_MAX: usize = 512;
/// Largest rope width next to it.
pub const MLA_DR_MAX: usize = 64;
/// The latent cache format (kernels/common.cuh): a row per position of LATENT_DIMS bf16 hi
/// parts, then as many lo parts, c_kv from dim 0 and k_pe from dim LATENT_ROPE_AT, zeros between.
pub const LATENT_DIMS: usize = MLA_DL_MAX + MLA_DR_MAX;
pub const LATENT_ROPE_AT: usize = MLA_DL_MAX;
/// Heads per block of mla_decode_split (two m16 tiles; mla_decode_split16: one), threads.
pub const MLA_HB: usize = 32;
pub const MLA_THREADS: u32 = 256;
/// Most sequence splits mla_decode_combine merges (its shared split weights).
pub const MLA_MAX_SPLITS: usize = 1024;
/// Most threads of mla_decode_combine (groups of threads sum every group-th split).
pub const MLA_COMBINE_THREADS: u32 = 512;

/// Dynamic shared memory of mla_decode_split (and split16, split16x2) on key tiles of `bk`
/// keys: two stages of a hi and a lo bf16 key tile (bk rows of MLA_DL_MAX + MLA_DR_MAX dims,
/// padded by 8), the partial scores of the 8 warps (f32 [16 heads, bk keys] each), and the key
/// flags of both stages.
pub fn mla_decode_smem_bytes(bk: usize) -> usize {
    let row = 2 * (MLA_DL_MAX + MLA_DR_MAX + 8);
    2 * 2 * bk * row + 4 * (8 * 16 * bk) + 4 * 2 * bk
}

/// Dynamic shared memory of attention_prefill: q tile and k tile (rows padded by 4 floats),
/// v tile 128 wide for dv <= 128, else 256; all f32.
pub fn attention_smem_bytes(dqk: usize, dv: usize) -> usize {
    let vw = if dv <= 128 { 128 } else { 256 };
    4 * ((ATT_BQ + ATT_BK) * (dqk + 4) + ATT_BK * vw)
}

/// The tensor-core forms of attention_prefill (kernels/attention.cu, ATTENTION_MMA): kernel,
/// padded query/key and value head dims, keys per shared tile.
pub const ATT_MMA_FORMS: &[(&str, usize, usize, usize)] = &[
    ("attention_mma_64_64", 64, 64, 64),
    ("attention_mma_192_128", 192, 128, 64),
    ("attention_mma_256_256", 256, 256, 32),
];
/// Queries per block and threads of the tensor-core forms.
pub const ATT_MMA_BQ: usize = 64;
pub const ATT_MMA_THREADS: u32 = 128;

/// Dynamic shared memory of a tensor-core attention form: two stages of bk key rows and bk
/// value rows, bf16, each row padded by 8.
pub fn attention_mma_smem_bytes(dqk: usize, dv: usize, bk: usize) -> usize {
    2 * 2 * bk * (dqk + 8 + dv + 8)
}

/// Largest key width of dsa_scores, and its largest query tile (heads x dim floats).
pub const DSA_DIM_MAX: usize = 256;
pub const DSA_Q_MAX: usize = 8192;

/// Threads of topk_rows (one block per row; at decode the block is alone on the GPU, and more
/// threads keep more loads in flight), and the most leading positions of a row whose keys it
/// keeps in shared memory for its later passes (88 KiB).
pub const TOPK_THREADS: u32 = 1024;
pub const TOPK_CACHE_KEYS: usize = 22528;
/// The most keys of its stretch a block of topk_rows_cluster4 / 8 keeps in shared memory
/// (64 KiB, beside its two 8 KiB histograms).
pub const TOPK_CLUSTER_CACHE_KEYS: usize = 16384;

/// Dynamic shared memory of dsa_scores (`keys_per_lane` 1) and dsa_scores2 (2): the query
/// [heads][dim] and two tiles of 32 keys a lane, rows padded by 4 floats.
pub fn dsa_scores_smem_bytes(heads: usize, dim: usize, keys_per_lane: usize) -> usize {
    4 * (heads * dim + 2 * 32 * keys_per_lane * (dim + 4))
}

/// Keys a block's tile of dsa_scores_mma (DSA_MMA_KEYS in kernels/dsa.cu).
pub const DSA_MMA_KEYS: usize = 64;

/// dsa_scores_mma's kernel for `heads` and the heads it pads them to (its N tiles of 8 heads:
/// 2, 4 or 8), None past 64.
pub fn dsa_scores_mma_kernel(heads: usize) -> Option<(&'static str, usize)> {
    match heads {
        0..=16 => Some(("dsa_scores_mma16", 16)),
        17..=32 => Some(("dsa_scores_mma32", 32)),
        33..=64 => Some(("dsa_scores_mma64", 64)),
        _ => None,
    }
}

/// Dynamic shared memory of dsa_scores_mma: the query's hi and lo bf16 values, `padded_heads`
/// of `dim` (`dsa_scores_mma_kernel`).
pub fn dsa_scores_mma_smem_bytes(padded_heads: usize, dim: usize) -> usize {
    4 * dim * padded_heads
}

/// The most dynamic shared memory dsa_scores2 is launched with (beside its 2.3 KiB of static
/// shared memory, within SM120's limit): GLM-5's 32 heads x 128 take 82 KiB.
pub const DSA_SCORES2_SMEM: usize = 96 * 1024;

/// Dynamic shared memory of the cp.async matmul kernels (CpCfg in kernels/matmul.cu, whose
/// static_assert keeps each under 99 KiB): STAGES stages of the X tile (bf16 rows of 128
/// bytes) and the raw weight bytes (Q4_K: 32 qs bytes per row, Q8_0: an 80-byte window), plus
/// Q4_K's two slots of 16-byte block headers and two scale buffers.
pub fn matmul_cp_smem_bytes(kernel: &str) -> usize {
    // (rows, columns, stages, Q4_K) of each kernel, as instantiated in matmul.cu.
    let (bm, bn, stages, q4) = match kernel {
        "matmul_cp_q4_k" => (128, 128, 4, true),
        "matmul_cp_q8_0" => (128, 128, 3, false),
        "matmul_cp_spans_q4_k" => (32, 128, 4, true),
        "matmul_cp_spans64_q4_k" => (64, 128, 4, true),
        "matmul_cp_spans_q8_0" => (32, 256, 3, false),
        _ => return 0,
    };
    let w_row = if q4 { 32 } else { 80 };
    let headers_and_scales = if q4 { 2 * (2 * bn * 16) } else { 0 };
    stages * (bm * 128 + bn * w_row) + headers_and_scales
}

/// Whether `kernel` launches with programmatic dependent launch where the GPU has it
/// (`Gpu::launch_raw`). Not the MLA decode pair (except on the few blocks of a short context,
/// see `Gpu::mla_decode_with`): one split block fills an SM's registers, and both kernels
/// measured 11-49% slower with it on an H200 (1K-32K contexts), while the matrix-vector
/// products gained 11-28%. Nor the Q6_K lm head (matvec_int_q6_k, 168 registers and 27 KiB of
/// shared memory per 4-warp block): lab, H200, 252 -> 273 us with it (GLM-5), 259 -> 269 (DS3).
pub fn dependent_launch_helps(kernel: &str) -> bool {
    !kernel.starts_with("mla_decode") && kernel != "matvec_int_q6_k"
}

/// The largest dynamic shared memory each kernel that uses it is ever launched with, compiled
/// for `arch`.
pub fn max_dynamic_smem(kernel: &str, arch: &str) -> usize {
    match kernel {
        "attention_prefill" => attention_smem_bytes(ATT_DQK_MAX, ATT_DV_MAX),
        k if k.starts_with("attention_mma_") => ATT_MMA_FORMS
            .iter()
            .find(|f| f.0 == k)
            .map_or(0, |&(_, dqk, dv, bk)| attention_mma_smem_bytes(dqk, dv, bk)),
        // heads * dim <= DSA_Q_MAX, dim <= DSA_DIM_MAX: the widest keys make the largest tiles.
        "dsa_scores" => dsa_scores_smem_bytes(DSA_Q_MAX / DSA_DIM_MAX, DSA_DIM_MAX, 1),
        "dsa_scores2" => DSA_SCORES2_SMEM,
        "dsa_scores_mma16" => dsa_scores_mma_smem_bytes(16, DSA_DIM_MAX),
        "dsa_scores_mma32" => dsa_scores_mma_smem_bytes(32, DSA_DIM_MAX),
        "dsa_scores_mma64" => dsa_scores_mma_smem_bytes(64, DSA_DIM_MAX),
        "topk_rows" => 4 * TOPK_CACHE_KEYS,
        "topk_rows_cluster4" | "topk_rows_cluster8" => 4 * TOPK_CLUSTER_CACHE_KEYS,
        "mla_decode_split" | "mla_decode_split16" | "mla_decode_split16x2" => {
            mla_decode_smem_bytes(mla_keys_per_tile(arch))
        }
        k if k.starts_with("matmul_cp_") => matmul_cp_smem_bytes(k),
        "matvec_tc8_q4_k" => super::ops::tc_smem_bytes(super::ops::TC_LONG_K_MAX),
        "matvec_tma_q6_k" => super::ops::tma6_smem_bytes(super::ops::TMA6_K_MAX),
        k => {
            let tiles = super::ops::TMA_TILE_TYPES
                .iter()
                .filter_map(|&ty| super::ops::tma_tile(ty));
            let mut sizes = tiles.filter_map(|t| match t.items {
                _ if [t.kernel, t.spread, t.parts, t.query].contains(&k) => {
                    Some(super::ops::tma_smem_bytes(t, t.k_max))
                }
                Some((items, warps)) if k == items => {
                    Some(super::ops::tmi_smem_bytes(t, warps, super::ops::TMI_K_MAX))
                }
                _ => None,
            });
            sizes.next().unwrap_or(0)
        }
    }
}
