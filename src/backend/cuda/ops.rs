//! One Rust function per kernel: checks the shapes it can, picks the launch geometry, launches.
//! Tensors are raw device addresses ([`DevicePtrRaw`]) with explicit strides in elements, so
//! the model can point a kernel at a slice of a larger buffer (a head, the rope part of q).
//! Optional inputs are 0.

use crate::gguf::ggml_type::GgmlType;

use super::device::{launch, DevicePtrRaw as Ptr, Gpu};
use super::error::{check, CudaError};
use super::kernels::{
    attention_mma_smem_bytes, attention_smem_bytes, dsa_scores_mma_kernel,
    dsa_scores_mma_smem_bytes, dsa_scores_smem_bytes, ATT_BQ, ATT_DQK_MAX, ATT_DV_MAX, ATT_MMA_BQ,
    ATT_MMA_FORMS, ATT_MMA_THREADS, ATT_THREADS, DSA_DIM_MAX, DSA_MMA_KEYS, DSA_Q_MAX,
    DSA_SCORES2_SMEM, LATENT_DIMS, LATENT_ROPE_AT, MLA_DL_MAX, MLA_DR_MAX, TOPK_CACHE_KEYS,
    TOPK_CLUSTER_CACHE_KEYS, TOPK_THREADS,
};
use cudarc::driver::sys::CUresult;

/// The ggml types the matvec, matmul and embedding kernels read: every type the CPU reference
/// reads, so any file the CPU runs, the GPU runs (tests/nvrtc_compile.rs checks the kernels).
pub const KERNEL_TYPES: &[GgmlType] = crate::quant::SUPPORTED;

fn typed_kernel(prefix: &str, ty: GgmlType) -> Result<String, CudaError> {
    check(KERNEL_TYPES.contains(&ty), prefix, || {
        format!("no kernel for tensor type {ty}")
    })?;
    Ok(format!("{prefix}_{}", ty.name().to_lowercase()))
}

/// `typed_kernel` and the bytes of one row of `k` values, which must be a whole number of the
/// type's blocks (and of 8: the kernels' unit walk).
fn typed_rows(prefix: &str, ty: GgmlType, k: usize) -> Result<(String, usize), CudaError> {
    let kernel = typed_kernel(prefix, ty)?;
    let row_bytes = ty.row_bytes(k).filter(|_| k.is_multiple_of(8));
    check(row_bytes.is_some(), prefix, || {
        format!("rows of {k} values are not a whole number of {ty} blocks")
    })?;
    Ok((kernel, row_bytes.unwrap()))
}

fn grid1(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block) as u32
}

/// y_b = W_b x_b for `batch` items (see kernels/matvec.cu): the decode workhorse, also for
/// the per-head absorbed products (one matrix per head) and the selected experts (`ids`).
pub struct Matvec {
    pub ty: GgmlType,
    /// Quantized rows, `row_bytes(k)` apart; matrix m starts at w + m * mat_stride bytes.
    pub w: Ptr,
    pub mat_stride: usize,
    /// [batch] i32 matrix index per item, or 0 for "item b uses matrix b". With ids, x must
    /// have been written before the ids were (the MoE router's input is): the one-x products
    /// on bulk copies read it before they wait for the kernel before them.
    pub ids: Ptr,
    pub rows: usize,
    pub k: usize,
    /// f32 inputs: item b reads x + (b / x_group) * x_stride.
    pub x: Ptr,
    pub x_group: usize,
    pub x_stride: usize,
    /// f32 outputs: item b writes y + b * y_stride, `rows` values.
    pub y: Ptr,
    pub y_stride: usize,
    pub batch: usize,
    /// y_b = W_b^T x_b instead: x_b has `rows` values, y_b has `k`.
    pub transposed: bool,
    /// Second matrices, or 0: items batch / 2 .. take their matrix from here instead of `w`,
    /// with ids and x counted from batch / 2 again (the MoE gate and up of the same choices in
    /// one launch). Only the tensor-core kernels take it (`Gpu::takes_pair`).
    pub pair: Ptr,
    /// With `pair`, its two products are a gated FFN's gate and up: item b < batch / 2 writes
    /// silu(W x_b) * (pair's W x_b) instead of both (the silu_mul launch folded in).
    pub glu: bool,
    /// Or None: the items' outputs summed per token with its choice weights in the same
    /// launch (the MoE combine; only the tensor-core kernels, `Gpu::takes_combine`).
    pub combine: Option<Combine>,
    /// The matrices of items whose id is MOE_SHARED (-2), for `w`'s items and for `pair`'s: the
    /// shared expert as one more MoE choice, or (0, 0). Only the tensor-core kernels take them
    /// (`Gpu::takes_shared`).
    pub shared: (Ptr, Ptr),
    /// 0, or the distance (values) between the partial outputs of one matrix whose rows the
    /// bulk-copy kernel takes in parts of k spread over its blocks (`Gpu::spread_parts` of
    /// them): part p's sums at y + p * y_part, their sum in part order is y.
    pub y_part: usize,
    /// 0, or an i32 for the index of y's largest value (the lowest on ties, as `argmax_row`):
    /// only matvec_tma_q6_k takes it (`Gpu::takes_pick`), finding it in its own launch.
    pub pick: Ptr,
}

/// The id of the shared expert among a token's MoE choices (`Matvec::shared`, moe_router).
pub const MOE_SHARED: i32 = -2;

impl Matvec {
    /// One `rows` x `k` matrix times one x into y: no ids, no pair, not transposed.
    pub fn single(ty: GgmlType, w: Ptr, (x, y): (Ptr, Ptr), (rows, k): (usize, usize)) -> Matvec {
        Matvec {
            ty,
            w,
            mat_stride: 0,
            ids: 0,
            rows,
            k,
            x,
            x_group: 1,
            x_stride: k,
            y,
            y_stride: rows,
            batch: 1,
            transposed: false,
            pair: 0,
            glu: false,
            combine: None,
            shared: (0, 0),
            y_part: 0,
            pick: 0,
        }
    }
}

/// The MoE combine in a down product's launch (`Matvec::combine`): out row t = sum over its
/// choices j of weights[t, j] * the output of item t * choices + j, in choice order, zero
/// weights skipped (as moe_combine sums). Every item must be held (no -1 id): a token none of
/// whose items runs here would get no sum.
#[derive(Clone, Copy)]
pub struct Combine {
    /// [batch / choices, choices] f32.
    pub weights: Ptr,
    /// [batch / choices, rows] f32.
    pub out: Ptr,
    pub choices: usize,
}

/// The kernel's TcCombine (kernels/matvec.cu); all 0 for none.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct TcCombine {
    weights: Ptr,
    out: Ptr,
    done: Ptr,
    choices: i32,
}
// SAFETY: plain integers in the kernel's C layout (8-byte addresses, a 4-byte int, padding).
unsafe impl cudarc::driver::DeviceRepr for TcCombine {}

/// The kernel's MatvecParts (kernels/matvec.cu): items 1 and 2 of a parts launch, or all 0;
/// with a latent (matvec_latent_<type>, matvec_tma_parts_<type>), the counters of its tail
/// and the latent's norms.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MatvecParts {
    w1: Ptr,
    w2: Ptr,
    rows1: i32,
    rows2: i32,
    y1: Ptr,
    y2: Ptr,
    done: Ptr,
    qsq: Ptr,
    latent: LatentNorm,
}
// SAFETY: plain integers in the kernel's C layout (8-byte addresses, 4-byte ints).
unsafe impl cudarc::driver::DeviceRepr for MatvecParts {}

/// The kernel's QueryRows (kernels/matvec.cu): what matvec_tma_query_<type> reads of the parts
/// launch before it.
#[repr(C)]
#[derive(Clone, Copy)]
struct QueryRows {
    sq: Ptr,
    tiles: i32,
    latent: LatentNorm,
}
// SAFETY: plain integers in the kernel's C layout (an 8-byte address, a 4-byte int, padding,
// then LatentNorm's).
unsafe impl cudarc::driver::DeviceRepr for QueryRows {}

/// What a parts launch does of a latent's norms (`Gpu::parts_launch`).
#[derive(Clone, Copy)]
enum PartsNorms<'a> {
    /// All of them in its last blocks (`Gpu::matvec_parts`).
    Tail(&'a LatentNorm),
    /// Its query tiles times the norm's weights, their sums of squares at the address, for
    /// q_b's launch after it (`Gpu::query_projections`).
    Weighed(&'a LatentNorm, Ptr),
}

/// The norms that put tokens' MLA latents into their cache (kernels/common.cuh, LatentNorm),
/// checked by `LatentNorm::new`: what latent_norm_rope runs, or for one token the tail of the
/// parts launch that makes kv, the query latent and the index key (`Gpu::matvec_parts`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct LatentNorm {
    kv: Ptr,
    w: Ptr,
    cache: Ptr,
    inv_freq: Ptr,
    qx: Ptr,
    qw: Ptr,
    qy: Ptr,
    kx: Ptr,
    kw: Ptr,
    kb: Ptr,
    ky: Ptr,
    dl: i32,
    dr: i32,
    dq: i32,
    dk: i32,
    pos0: i32,
    mscale: f32,
    eps: f32,
    k_eps: f32,
}
// SAFETY: plain integers and floats in the kernel's C layout (8-byte addresses, then 4-byte
// ints and floats: 120 bytes).
unsafe impl cudarc::driver::DeviceRepr for LatentNorm {}

impl LatentNorm {
    /// The MLA latent of `rows` tokens: row t of kv [rows, dl + dr] -> row t of `cache`
    /// (pointing at the first row to fill, in the latent cache format: `latent_split`), c_kv
    /// RMS-normed with w, k_pe roped at position pos0 + t (inv_freq: [dr / 2] f32); with
    /// `query`, its rows RMS-normed too (q-LoRA's latent, the same eps), and with `keys`,
    /// theirs layer-normed and their first dr values roped as k_pe (the DSA indexer's keys of
    /// the same tokens). See kernels/common.cuh.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kv: Ptr,
        w: Ptr,
        cache: Ptr,
        rows: usize,
        (dl, dr): (usize, usize),
        pos0: usize,
        (inv_freq, mscale): (Ptr, f32),
        eps: f32,
        query: Option<&RowsNorm>,
        keys: Option<&KeyRowsNorm>,
    ) -> Result<LatentNorm, CudaError> {
        check(
            dr.is_multiple_of(2) && pos0 + rows <= i32::MAX as usize,
            "latent_norm_rope",
            || format!("rope width {dr}, positions up to {}", pos0 + rows),
        )?;
        check(
            keys.is_none_or(|k| k.rows == rows && dr <= k.width),
            "latent_norm_rope",
            || format!("index keys of {rows} tokens, {dr} roped values each"),
        )?;
        latent_fits("latent_norm_rope", dl, dr)?;
        let (qx, qw, qy) = query.map_or((0, 0, 0), |q| (q.x, q.w, q.y));
        let (kx, kw, kb, ky, k_eps) =
            keys.map_or((0, 0, 0, 0, 0.0), |k| (k.x, k.w, k.b, k.y, k.eps));
        Ok(LatentNorm {
            kv,
            w,
            cache,
            inv_freq,
            qx,
            qw,
            qy,
            kx,
            kw,
            kb,
            ky,
            dl: dl as i32,
            dr: dr as i32,
            dq: query.map_or(0, |q| q.width) as i32,
            dk: keys.map_or(0, |k| k.width) as i32,
            pos0: pos0 as i32,
            mscale,
            eps,
            k_eps,
        })
    }

    /// Whether a tail of `threads` threads holding (query, latent, key) values each takes
    /// these rows (kernels/matvec.cu: TAIL_*_VALS, TMA_TAIL_*_VALS).
    fn fits(&self, threads: usize, (q, l, k): (usize, usize, usize)) -> bool {
        self.dq <= (q * threads) as i32 && self.cache_rows_fit(threads, (l, k))
    }

    /// Whether `threads` threads holding (latent, key) values each take the latent's and the
    /// key's rows (a block's, or matvec_tma_query_<type>'s producer warp: QUERY_TAIL_*_VALS).
    fn cache_rows_fit(&self, threads: usize, (l, k): (usize, usize)) -> bool {
        self.dl <= (l * threads) as i32 && self.dk <= (k * threads) as i32
    }
}

/// The types of matvec_latent_<type> (kernels/matvec.cu), the parts launch on the CUDA cores
/// with the latent's tail: those MLA's q_a and kv_a take in the models' files.
const LATENT_TAIL_TYPES: [GgmlType; 5] = [
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
    GgmlType::IQ4_XS,
];

/// One matrix of a parts launch (`Gpu::matvec_parts`): y = W x.
#[derive(Clone, Copy)]
pub struct MatvecPart {
    pub w: Ptr,
    pub rows: usize,
    pub y: Ptr,
}

// The geometry of matvec (kernels/matvec.cu): blocks of MATVEC_WARPS warps (f32: up to
// MATVEC_WIDE_WARPS), each row group of MATVEC_ROWS rows shared by 1, 2 or 4 of them.
const MATVEC_WARPS: usize = 4;
const MATVEC_WIDE_WARPS: usize = 16;
const MATVEC_ROWS: usize = 4;
/// INT_Q6_ROWS of kernels/matvec.cu.
const INT_Q6_ROWS: usize = 8;
/// About as many warps as an H200 holds at once (132 SMs x 64): a grid with fewer leaves
/// memory bandwidth unused, so short matrices split each row group over more warps.
const MATVEC_FILL_WARPS: usize = 8192;

/// (warps per block, row groups per block) of matvec: more warps per group (fewer groups per
/// block, then, up to `max_warps`, larger blocks) until the grid has about MATVEC_FILL_WARPS
/// warps, as long as each thread still gets 16 bytes (a piece) or more of each row. The kernel
/// reads the choice back from the grid and block sizes.
fn matvec_blocks(
    groups: usize,
    batch: usize,
    row_bytes: usize,
    max_warps: usize,
) -> (usize, usize) {
    let mut split = 1;
    while split < max_warps
        && groups * batch * split < MATVEC_FILL_WARPS
        && row_bytes >= 2 * split * 32 * 16
    {
        split *= 2;
    }
    (split.max(MATVEC_WARPS), MATVEC_WARPS.div_ceil(split))
}

/// Rows of at most this many values take half a warp per row group (matvec_half_<type>, for
/// the types of HALF_WARP_TYPES): a whole warp left half of its lanes without a piece on MLA's
/// per-head k_b (DeepSeek-V3: 128 values, 88-byte Q5_0 rows of 16 pieces; 128 heads x 512
/// rows ran at ~10% of copy in 16,384 one-round warps, docs/performance.md). Such a row is at
/// most 16 pieces for those types, one round of a half warp. Longer rows keep whole warps:
/// GLM-5's 192-value k_b (24 pieces) would take two rounds on half warps. H200, ncu per layer:
/// DS3's k_b 14.1 -> 9.4 us.
const MATVEC_HALF_WARP_K: usize = 128;
const HALF_WARP_TYPES: [GgmlType; 5] = [
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::F16,
    GgmlType::BF16,
];

/// The CUDA-core matvec for `batch` items of `rows` rows of `k` values of type `ty`: its
/// kernel (matvec_<type> or matvec_half_<type>), grid x and block (row groups sharing blocks).
fn matvec_geometry(
    ty: GgmlType,
    rows: usize,
    batch: usize,
    k: usize,
    row_bytes: usize,
) -> Result<(String, u32, u32), CudaError> {
    let groups = rows.div_ceil(MATVEC_ROWS);
    let max_warps = if ty == GgmlType::F32 {
        MATVEC_WIDE_WARPS
    } else {
        MATVEC_WARPS
    };
    let (warps, mut per_block) = matvec_blocks(groups, batch, row_bytes, max_warps);
    let mut prefix = "matvec";
    if k <= MATVEC_HALF_WARP_K && per_block == warps && HALF_WARP_TYPES.contains(&ty) {
        per_block *= 2; // two groups per warp (matvec_body reads it back from the grid)
        prefix = "matvec_half";
    }
    Ok((
        typed_kernel(prefix, ty)?,
        grid1(groups, per_block),
        32 * warps as u32,
    ))
}

/// matvec_tc_q4_k / matvec_tc8_q4_k (kernels/matvec.cu), the Q4_K product on the integer
/// tensor cores, serves matrices with at least TC_MIN_ROWS rows over the batch and k <=
/// TC_K_MAX (longer k: below): each of its thread blocks first turns x into integer planes (a
/// pass over k), which pays off only when a block has many rows to amortize it over. Measured
/// on an H200 (docs/performance.md): the GLM-5 expert up x16 (2048 x 6144 each) 54 -> 43 us,
/// a 24576 x 1536 q_b 16.4 -> 11.8 us; the CUDA-core kernel stays ahead on 576-2048 rows,
/// also when this kernel splits k over more blocks to fill the GPU (tried: q_a 6.7 -> 9.7 us,
/// kv_a 5.5 -> 7.3 us, attn_output 33.8 -> 39.3 us).
const TC_MIN_ROWS: usize = 8192;
const TC_K_MAX: usize = 8192;
/// Longer k (DeepSeek-V3's attn_output, k = 16384, and dense ffn_down, 18432) goes to the
/// 8-warp kernel from TC_LONG_MIN_ROWS rows on (lab, H200: 34.9 -> 30.6 us and 40.1 -> 33.7
/// us), up to TC_LONG_K_MAX (its x planes fill 85 KiB of shared memory). GLM-5's 6144 rows
/// only tied the CUDA-core kernel as a block per group; as one wave of blocks walking their
/// groups (a single matrix reads one x) its attn_output takes it too.
const TC_LONG_MIN_ROWS: usize = 6144;
pub(super) const TC_LONG_K_MAX: usize = 20480;

/// Whether `a`'s shape and alignment suit the tensor-core kernels (of any tile type): the
/// matrices 16-byte aligned, and their rows too unless the tile type takes rows that start
/// anywhere (Q6_K's).
fn tensor_core_shape(a: &Matvec, row_bytes: usize) -> bool {
    let rows = a.rows * a.batch;
    let shape_pays = if a.k <= TC_K_MAX {
        rows >= TC_MIN_ROWS
    } else {
        a.k <= TC_LONG_K_MAX && rows >= TC_LONG_MIN_ROWS
    };
    !a.transposed
        && shape_pays
        && (a.w | a.pair | a.shared.0 | a.shared.1).is_multiple_of(16)
        && ((a.mat_stride | row_bytes).is_multiple_of(16)
            || tma_tile(a.ty).is_some_and(|t| t.any_row_start))
}

/// matvec_int_q6_k (x as digit planes, dp4a; kernels/matvec.cu) takes a single Q6_K matrix of
/// at least this many rows (lab, H200: lm head 154880 x 6144 328 -> 280 us; 6144-24576 rows
/// tie with the CUDA-core kernel, which needs no digit planes first).
const INT_Q6_MIN_ROWS: usize = 32768;

/// Tiles per block of matvec_tc8_q4_k for several items with long rows (the MoE gate and up):
/// 8 (a warp each, all of k) or 4 (two warps each, half of k), whichever leaves less of the
/// GPU idle in the last wave of blocks, `slots` blocks per wave: a block of 4 tiles takes half
/// as long. 16 items of 128 tiles (8 experts' gate and up) fill 256 of an H200's 264 slots
/// with 8; the shared expert as a ninth choice makes 288 blocks, two waves of 8 tiles (59 us,
/// measured) against three of 4 (half as long each). Ties keep 8, the lab's choice for the
/// 8 experts.
fn tc8_tiles_per_block(tiles: usize, items: usize, slots: usize) -> usize {
    let time = |per_block: usize| (tiles.div_ceil(per_block) * items).div_ceil(slots) * per_block;
    if time(4) < time(8) {
        4
    } else {
        8
    }
}

/// Tiles per group of matvec_tc8_q4_k launched as one wave of blocks (items that all read one
/// x): two warps per tile, each taking half of a row's 256-blocks. H200, the engine's kernel in
/// a lab, gate and up of 9 choices (18 items of 128 tiles), 8 / 4 / 2 / 1 tiles per group: DS3
/// 64.6 / 53.9 / 54.1 / 56.2 us (62.1 as a block per group of 4 tiles), GLM-5 56.4 / 47.8 /
/// 49.1 / 51.9 (56.0); of 8 choices (DS3) 45.2 / 43.9 / 46.1 / 51.1 (45.6).
const ONE_WAVE_TILES: usize = 4;

fn uses_int_q6_k(a: &Matvec) -> bool {
    a.ty == GgmlType::Q6_K
        && !a.transposed
        && a.batch == 1
        && a.ids == 0
        && a.rows >= INT_Q6_MIN_ROWS
}

/// matvec_tma_q6_k (the bulk-copy form of matvec_int_q6_k, sm_90 and later) takes its
/// matrices from TMA6_K_MIN (a stage's 8 blocks then span two tiles at most) up to TMA6_K_MAX:
/// x's planes, scales and sums (4.1k bytes and a little) and two stages of 16 x 1744 bytes
/// fit SM120's 99 KiB with the kernel's static shared memory.
const TMA6_K_MIN: usize = 2048;
pub(super) const TMA6_K_MAX: usize = 8192;

/// Dynamic shared memory of matvec_tma_q6_k: x as matvec_tc_q4_k has it, then two stages.
pub fn tma6_smem_bytes(k: usize) -> usize {
    tc_smem_bytes(k) + 2 * 16 * 1744
}

/// Dynamic shared memory of matvec_tc_q4_k (kernels/matvec.cu, tc_x_bytes): four planes of
/// k + 32 bytes, k / 256 scales (rounded up to even: the sums after them are read in pairs)
/// and k / 32 sums, to a 128-byte boundary, then 256 bytes of zeros (the B of lanes whose
/// columns a product must not add to).
pub(super) fn tc_smem_bytes(k: usize) -> usize {
    (4 * (k + 32) + 4 * (k / 256).next_multiple_of(2) + 4 * (k / 32)).next_multiple_of(128) + 256
}

/// matvec_tma_q4_k (the weights by bulk copies, sm_90 and later) takes the tensor-core
/// products whose items all read one x (a single matrix, a token's MoE gate and up) from
/// k = TMA_K_MIN on, from a whole stage of 8 256-blocks a tile (H200: DS3's q_b 24576 x 1536
/// took 10.0 -> 12.4 us). Its x planes and 3 stages of 16 rows x 1184 bytes fit SM120's 99
/// KiB up to TmaTile::k_max; longer rows (attn_output, the dense down; not glu) go in parts of
/// at most that many elements (tma_part_k). Measured on an H200 against the matvec_tc kernels, same
/// call (docs/performance.md): ffn_up 18432 x 7168 38.2 -> 28.2 us, GLM-5's 12288 x 6144 19.7
/// -> 15.9 us; in a decode token (ncu) the launches it takes (the MoE and dense gate-up pairs,
/// GLM-5's q_b) DS3 220 -> 214 us, GLM-5 234 -> 209; the rows in parts tie or lose alone (DS3's
/// dense down 29.8 -> 31.0 us) and win in the model, their copies starting before the
/// previous kernel ends (decode GLM-5 1,135-1,138 -> 1,177-1,179 tokens/s, DS3 1,107-1,108 ->
/// 1,116-1,117).
const TMA_K_MIN: usize = 2048;

/// A quant type of the bulk-copy tensor-core kernels (kernels/matvec.cu: matvec_tma_body and
/// matvec_tma_items_body with its tile type TcQ4k, TcQ5k, TcIq4xs, TcQ6kTile or TcQ80). Q5_K,
/// IQ4_XS, Q6_K and Q8_0 have no other tensor-core kernel for these products: without bulk
/// copies (before sm_90), or where these do not take them (Q8_0's glu beyond 6144 values),
/// they stay on the CUDA cores (Q6_K's lm head: matvec_tma_q6_k / matvec_int_q6_k).
#[derive(Clone, Copy, Debug)]
pub struct TmaTile {
    /// The kernel of products whose items all read one x.
    pub kernel: &'static str,
    /// Its form for one matrix whose parts of k are spread over the blocks (`Matvec::y_part`).
    pub spread: &'static str,
    /// Its form for two or three matrices of one x (`Gpu::matvec_parts`).
    pub parts: &'static str,
    /// Its form for q-LoRA's q_b after the parts launch (`Gpu::query_projections`).
    pub query: &'static str,
    /// The kernel of items with their own x, and its consumer warps (a stage each; fewer
    /// where 4 stages would not fit). It copies rows whole: Q6_K's only where they are a
    /// multiple of 16 bytes (`uses_item_copies`).
    pub items: Option<(&'static str, usize)>,
    /// The bytes of 256 values (a 256-block: Q8_0's 8 blocks).
    pub bytes: usize,
    /// A stage row's bytes (the tile type's ROW: 8 blocks, padded to an odd multiple of 16).
    pub row: usize,
    /// Stages of kernel's ring (Tile::STAGES).
    pub stages: usize,
    /// Whether `kernel` takes rows that start anywhere modulo 16 (Tile::ANY_ROW_START: Q6_K's
    /// rows of 210-byte blocks, each copied from the 16-byte boundary below it); the other
    /// types' rows are a multiple of 16 bytes.
    pub any_row_start: bool,
    /// The longest part of k whose x planes fit beside the stages in SM120's 99 KiB with the
    /// kernel's static shared memory (longer rows go in parts, tma_part_k).
    pub k_max: usize,
}

impl TmaTile {
    /// The fewest 256-blocks a row or part of a row must be a multiple of for the bulk copies:
    /// those whose bytes are a multiple of 16 (1, IQ4_XS's 136-byte blocks 2), or 1 where the
    /// kernel copies rows that start anywhere (Q6_K's).
    pub fn block_step(&self) -> usize {
        match self.any_row_start {
            true => 1,
            false => 16 >> self.bytes.trailing_zeros().min(4),
        }
    }
}

pub const TMA_TILE_TYPES: [GgmlType; 5] = [
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::IQ4_XS,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
];

pub fn tma_tile(ty: GgmlType) -> Option<TmaTile> {
    let tile = |(kernel, spread, parts, query), items, row, stages, k_max| {
        Some(TmaTile {
            kernel,
            spread,
            parts,
            query,
            items,
            bytes: ty.row_bytes(256).expect("a type of whole 256-blocks"),
            row,
            stages,
            any_row_start: ty == GgmlType::Q6_K,
            k_max,
        })
    };
    match ty {
        GgmlType::Q4_K => tile(
            (
                "matvec_tma_q4_k",
                "matvec_tma_spread_q4_k",
                "matvec_tma_parts_q4_k",
                "matvec_tma_query_q4_k",
            ),
            Some(("matvec_tma_items_q4_k", 4)),
            1184,
            3,
            9216,
        ),
        GgmlType::Q5_K => tile(
            (
                "matvec_tma_q5_k",
                "matvec_tma_spread_q5_k",
                "matvec_tma_parts_q5_k",
                "matvec_tma_query_q5_k",
            ),
            Some(("matvec_tma_items_q5_k", 3)),
            1440,
            3,
            7168,
        ),
        GgmlType::IQ4_XS => tile(
            (
                "matvec_tma_iq4_xs",
                "matvec_tma_spread_iq4_xs",
                "matvec_tma_parts_iq4_xs",
                "matvec_tma_query_iq4_xs",
            ),
            Some(("matvec_tma_items_iq4_xs", 4)),
            1120,
            3,
            10240,
        ),
        GgmlType::Q6_K => tile(
            (
                "matvec_tma_groups_q6_k",
                "matvec_tma_spread_q6_k",
                "matvec_tma_parts_q6_k",
                "matvec_tma_query_q6_k",
            ),
            Some(("matvec_tma_items_q6_k", 3)),
            1712,
            2,
            10240,
        ),
        // A 256-block of Q8_0 is 8 blocks, 272 bytes (TcQ80): two stages of 16 x 2208 bytes
        // leave x room for 6144 values in SM120's 99 KiB, an items block room for two warps.
        GgmlType::Q8_0 => tile(
            (
                "matvec_tma_q8_0",
                "matvec_tma_spread_q8_0",
                "matvec_tma_parts_q8_0",
                "matvec_tma_query_q8_0",
            ),
            Some(("matvec_tma_items_q8_0", 2)),
            2208,
            2,
            6144,
        ),
        _ => None,
    }
}

/// The 256-blocks of a row in one stage of the bulk-copy kernels (TMA_BLOCKS of
/// kernels/matvec.cu: a consumer warp each).
const TMA_BLOCKS: usize = 8;

/// Dynamic shared memory of a tile type's kernel: x as tc_smem_bytes(k), then the stages.
pub fn tma_smem_bytes(tile: TmaTile, k: usize) -> usize {
    tc_smem_bytes(k) + tile.stages * 16 * tile.row
}

/// A tile type's items kernel (a whole tile a stage, a warp per tile; sm_90 and later) takes
/// the tensor-core products whose items each read their own x (the MoE downs, MLA's v_b) up to
/// TMI_K_MAX, a tile's 16 rows of 8 256-blocks in one stage.
pub(super) const TMI_K_MAX: usize = 2048;

/// Dynamic shared memory of a tile type's items kernel of `warps` consumer warps: two buffers
/// of x's planes as tc_smem_bytes(k), then a stage per warp.
pub fn tmi_smem_bytes(tile: TmaTile, warps: usize, k: usize) -> usize {
    2 * tc_smem_bytes(k) + warps * 16 * tile.row
}

/// The elements of each part of x that a tile type's kernel holds as planes at a time: k, or
/// beyond the tile's k_max as few equal parts of whole 256-blocks as fit (the last may be
/// shorter), each a multiple of the tile type's block_step.
pub fn tma_part_k(tile: TmaTile, k: usize) -> usize {
    let blocks = k / 256;
    let parts = blocks.div_ceil(tile.k_max / 256);
    256 * blocks.div_ceil(parts).next_multiple_of(tile.block_step())
}

/// The part of k (elements) of a one-matrix product whose units (part, tile) its `slots`
/// blocks take (`Gpu::spread_parts`; a run of blocks a part, kernels/matvec.cu), or None
/// where each block walking whole tiles through tma_part_k's parts is as quick. Each choice
/// is costed by its busiest block in half stage steps (a step: TMA_BLOCKS 256-blocks of the
/// tile's 16 rows), plus one for each part whose x planes it prepares; the spread parts are
/// tma_part_k's or a number of whole stages, at least half as long (more, shorter parts than
/// that: more partials for the residual add to read, not measured). DeepSeek-V3's
/// attn_output (448 tiles of k 16384 over 264 blocks): walked in 2 parts, a block's 2 tiles
/// take 16 steps; spread in 2 parts, 132 blocks a part, 4 tiles of 4; in 4 parts, 66 blocks
/// a part, 7 tiles of 2 steps, 14. GLM-5's (384 tiles): 2 parts, 3 tiles of 4 steps. Rows
/// whose planes fit whole stay whole: spread in parts, they were not timed against the walk
/// in one call (at f42dc02 the bench's IQ4_XS ffn_up read 65% of an H100's copy so, the walk
/// 71% in another; docs/performance.md, fortieth look).
pub fn spread_part_k(tile: TmaTile, k: usize, tiles: usize, slots: usize) -> Option<usize> {
    // The stage steps of each part of k in parts of kpart.
    let steps = |kpart: usize| -> Vec<usize> {
        (0..k.div_ceil(kpart))
            .map(|p| (kpart.min(k - p * kpart) / 256).div_ceil(TMA_BLOCKS))
            .collect()
    };
    let walked = tma_part_k(tile, k);
    if walked >= k {
        return None;
    }
    let walk = {
        let st = steps(walked);
        2 * tiles.div_ceil(slots) * st.iter().sum::<usize>() + st.len()
    };
    let stage = 256 * TMA_BLOCKS;
    let spread_cost = |kpart: usize| {
        let st = steps(kpart);
        let (parts, longest) = (st.len(), *st.iter().max().unwrap());
        match slots / parts {
            0 => 2 * tiles * st.iter().sum::<usize>() + parts.div_ceil(slots),
            blocks => 2 * tiles.div_ceil(blocks) * longest + 1,
        }
    };
    std::iter::once(walked)
        .chain((1..).map(|n| n * stage).take_while(|&kp| kp <= tile.k_max))
        .filter(|&kp| kp < k && 2 * kp >= walked)
        .map(|kp| (spread_cost(kp), std::cmp::Reverse(kp)))
        .min()
        .filter(|&(cost, _)| cost < walk)
        .map(|(_, std::cmp::Reverse(kp))| kp)
}

/// Blocks and threads of mla_decode_combine for `splits` partials: chunks of dims (1, 2, 4
/// or 8; they divide dl / 32) until there is a block per multiprocessor, and as many groups of
/// threads summing the splits as there are splits (a power of two, at most
/// MLA_COMBINE_THREADS threads, at least a warp). Few splits (a short context) then keep
/// small blocks, whose two block reductions of the split weights cost least.
pub fn mla_combine_shape(multiprocessors: usize, a: &MlaDecode, splits: usize) -> (u32, u32) {
    let chunks = [1, 2, 4, 8]
        .into_iter()
        .find(|c| a.heads * a.tokens * c >= multiprocessors)
        .unwrap_or(8);
    let cols = a.dl / 4 / chunks;
    let groups = splits
        .next_power_of_two()
        .min(MLA_COMBINE_THREADS as usize / cols)
        .max(32usize.div_ceil(cols));
    (chunks as u32, (cols * groups).next_multiple_of(32) as u32)
}

/// Whether every item of `a` reads one x (a single matrix, the MoE gate and up of a token).
fn one_x_of(a: &Matvec) -> bool {
    a.x_group >= if a.pair != 0 { a.batch / 2 } else { a.batch }
}

/// Whether the bulk-copy kernels' DivBy (kernels/matvec.cu) is exact for `a`: its groups (at
/// most batch x tiles) times its tiles below 2^32.
fn tma_div_fits(a: &Matvec) -> bool {
    let tiles = a.rows.div_ceil(16) as u64;
    (a.batch as u64) * tiles * tiles < 1 << 32
}

impl Gpu {
    /// Whether `matvec` takes `a` on a tensor-core kernel: Q4_K's (the bulk-copy forms where
    /// they take it, else matvec_tc_q4_k / matvec_tc8_q4_k), Q5_K's, IQ4_XS's, Q6_K's and Q8_0's
    /// bulk-copy forms only (Q6_K's lm head keeps its own kernels, uses_int_q6_k).
    fn on_tensor_cores(&self, a: &Matvec) -> bool {
        let shape = |rb| tma_tile(a.ty).is_some() && tensor_core_shape(a, rb);
        a.ty.row_bytes(a.k).is_some_and(shape)
            && !uses_int_q6_k(a)
            && (a.ty == GgmlType::Q4_K || self.uses_bulk_copies(a) || self.uses_item_copies(a))
    }

    /// Whether `matvec` takes `a` with a `pair` (the tensor-core kernels, an even batch).
    pub fn takes_pair(&self, a: &Matvec) -> bool {
        a.batch.is_multiple_of(2) && self.on_tensor_cores(a)
    }

    /// Whether the tensor-core product `a` goes to matvec_tma_<type> (glu: k within the tile
    /// type's k_max, one part).
    fn uses_bulk_copies(&self, a: &Matvec) -> bool {
        self.bulk_copies
            && a.k >= TMA_K_MIN
            && tma_tile(a.ty).is_some_and(|t| a.k <= t.k_max || !a.glu)
            && one_x_of(a)
            && a.combine.is_none()
            && tma_div_fits(a)
    }

    /// How many partial outputs `matvec` writes for `a` with a `y_part`: more than 1 where
    /// `a`, one matrix on the bulk-copy kernel with k in parts, takes fewer stage steps of
    /// its busiest block as units (part, tile) than as tiles each walked through all parts by
    /// one block (spread_part_k: GLM-5's attn_output, 384 tiles of 2 parts over 264 blocks,
    /// 3 tiles of one part a block instead of 2 of both), else 1 (no y_part).
    pub fn spread_parts(&self, a: &Matvec) -> Result<usize, CudaError> {
        Ok(self.spread_kpart(a)?.map_or(1, |kpart| a.k.div_ceil(kpart)))
    }

    /// The length of `a`'s spread parts (spread_part_k): None where `a` is not one matrix on
    /// the bulk-copy kernel or is walked whole.
    pub fn spread_kpart(&self, a: &Matvec) -> Result<Option<usize>, CudaError> {
        let single = a.batch == 1 && a.ids == 0 && a.pair == 0 && !a.transposed;
        if !(single && self.on_tensor_cores(a) && self.uses_bulk_copies(a)) {
            return Ok(None);
        }
        let tile = tma_tile(a.ty).expect("a tensor-core type");
        // A wave of the spread kernel with parts of k_max, the longest it may choose (longer
        // than the walk's where those are short: DeepSeek-V3's 7168 in two parts of Q8_0's).
        let slots = self.wave_blocks(tile.spread, 288, tma_smem_bytes(tile, tile.k_max))?;
        Ok(spread_part_k(tile, a.k, a.rows.div_ceil(16), slots))
    }

    /// Whether the tensor-core product `a` goes to matvec_tma_items_<type>.
    fn uses_item_copies(&self, a: &Matvec) -> bool {
        let whole_rows = |rb: usize| (a.mat_stride | rb).is_multiple_of(16);
        self.bulk_copies
            && self.item_copies
            && tma_tile(a.ty).is_some_and(|t| t.items.is_some())
            && a.ty.row_bytes(a.k).is_some_and(whole_rows)
            && a.k <= TMI_K_MAX
            && a.batch > 1
            && a.x_group == 1
            && a.pair == 0
            && tma_div_fits(a)
    }

    /// Whether `matvec` takes `a` with a `combine` (the tensor-core kernels, with ids, no pair).
    pub fn takes_combine(&self, a: &Matvec) -> bool {
        a.ids != 0 && a.pair == 0 && self.on_tensor_cores(a) && !self.uses_item_copies(a)
    }

    /// Whether `matvec` takes `a` with `shared` matrices (the tensor-core kernels, with ids).
    pub fn takes_shared(&self, a: &Matvec) -> bool {
        a.ids != 0 && self.on_tensor_cores(a)
    }

    /// Whether `matvec` takes `a` with `pick`: the one Q6_K matrix of many rows on bulk copies
    /// (matvec_tma_q6_k: in practice the lm head).
    pub fn takes_pick(&self, a: &Matvec) -> bool {
        uses_int_q6_k(a)
            && self.bulk_copies
            && (TMA6_K_MIN..=TMA6_K_MAX).contains(&a.k)
            && a.w.is_multiple_of(16)
    }

    pub fn matvec(&self, a: &Matvec) -> Result<(), CudaError> {
        let prefix = if a.transposed { "matvec_t" } else { "matvec" };
        let (kernel, row_bytes) = typed_rows(prefix, a.ty, a.k)?;
        check(a.pick == 0 || self.takes_pick(a), "matvec", || {
            "a pick from a product matvec_tma_q6_k does not take".into()
        })?;
        check(
            a.x.is_multiple_of(16) && a.x_stride.is_multiple_of(4),
            "matvec",
            || "x rows must be 16-byte aligned".into(),
        )?;
        check(a.x_group > 0 && a.batch > 0, "matvec", || {
            "empty batch".into()
        })?;
        check(a.pair == 0 || self.takes_pair(a), "matvec", || {
            "a pair of matrices needs the tensor-core kernel and an even batch".into()
        })?;
        check(!a.glu || a.pair != 0, "matvec", || {
            "glu: the gate and up products of a pair".into()
        })?;
        check(
            a.combine.is_none_or(|c| {
                c.choices > 0 && a.batch.is_multiple_of(c.choices) && self.takes_combine(a)
            }),
            "matvec",
            || "combine: the tensor-core kernel, ids, whole tokens of choices".into(),
        )?;
        check(a.shared == (0, 0) || self.takes_shared(a), "matvec", || {
            "a shared matrix needs the tensor-core kernel and ids".into()
        })?;
        // With y_part, the part of k the blocks take as units (spread_part_k).
        let spread_kpart = match a.y_part {
            0 => None,
            _ => self.spread_kpart(a)?,
        };
        check(
            a.y_part == 0 || (a.y_part >= a.rows && spread_kpart.is_some()),
            "matvec",
            || "partial outputs: where spread_parts says so, rows apart".into(),
        )?;
        if self.on_tensor_cores(a) {
            // Tiles of 16 rows. One matrix: blocks of 4 warps, 4 tiles per block (one warp
            // each, all of k) on large grids or short rows, else 2 (two warps each, half of k).
            // Several items (the MoE experts): blocks of 8 warps; where they all read one x,
            // one wave of blocks walking their groups of ONE_WAVE_TILES; where k is long, a
            // block per group of 8 tiles, or 4 where the grid is small; else (the expert down
            // products without bulk copies) one wave walking runs of 8-tile groups (H200, ncu:
            // DS3's 35 -> 33-34 us, GLM-5's 33 -> 31-33; 4-tile groups 38-40). k beyond
            // TC_K_MAX: 8 warps, 2 tiles. The faster choices in the lab runs (H200: 8 warps took
            // 10-12% off the expert products, and lost 9% on ffn_up).
            let tiles = a.rows.div_ceil(16);
            let tile = tma_tile(a.ty).expect("a tensor-core type");
            if self.uses_bulk_copies(a) {
                // A group per tile of an item (glu: of both matrices), one wave of blocks;
                // with y_part, a unit per part of each group.
                if let Some(kpart) = spread_kpart {
                    // A unit per part of each tile (spread_parts checked a single matrix).
                    let units = tiles * a.k.div_ceil(kpart);
                    let smem = tma_smem_bytes(tile, kpart);
                    let slots = self.wave_blocks(tile.spread, 288, smem)?;
                    launch!(self, tile.spread, (units.min(slots) as u32, 1, 1), 288, smem as u32;
                        a.w, a.rows as i32, a.k as i32, kpart as i32, row_bytes as i64, a.x, a.y,
                        a.y_part as i64);
                    return Ok(());
                }
                let kpart = tma_part_k(tile, a.k);
                let smem = tma_smem_bytes(tile, kpart);
                let kernel = tile.kernel;
                let groups = tiles * if a.glu { a.batch / 2 } else { a.batch };
                let slots = self.wave_blocks(kernel, 288, smem)?;
                launch!(self, kernel, (groups.min(slots) as u32, 1, 1), 288, smem as u32;
                    a.w, a.pair, a.shared.0, a.shared.1, a.mat_stride as i64, a.ids,
                    a.batch as i32, a.rows as i32, a.k as i32, kpart as i32, row_bytes as i64,
                    a.x, a.y, a.y_stride as i64, a.glu as i32);
                return Ok(());
            }
            if self.uses_item_copies(a) {
                let (kernel, warps) = tile.items.expect("uses_item_copies");
                let threads = 32 * (warps as u32 + 1);
                let smem = tmi_smem_bytes(tile, warps, a.k);
                let slots = self.wave_blocks(kernel, threads, smem)?;
                launch!(self, kernel, ((tiles * a.batch).min(slots) as u32, 1, 1), threads,
                    smem as u32;
                    a.w, a.shared.0, a.mat_stride as i64, a.ids, a.batch as i32, a.rows as i32,
                    a.k as i32, row_bytes as i64, a.x, a.x_stride as i64, a.y, a.y_stride as i64);
                return Ok(());
            }
            let long_k = a.k >= 4096;
            let smem = tc_smem_bytes(a.k);
            let one_x = one_x_of(a);
            let tc8_slots = || self.wave_blocks("matvec_tc8_q4_k", 256, smem);
            let (kernel, warps, per_block, one_wave) = match (a.batch > 1, tiles * a.batch) {
                _ if a.k > TC_K_MAX => ("matvec_tc8_q4_k", 8, 2, None),
                (false, t) if t >= 2048 || !long_k => ("matvec_tc_q4_k", 4, 4, None),
                (false, _) => ("matvec_tc_q4_k", 4, 2, None),
                (true, _) if one_x => ("matvec_tc8_q4_k", 8, ONE_WAVE_TILES, Some(tc8_slots()?)),
                (true, _) if long_k => {
                    let per_block = tc8_tiles_per_block(tiles, a.batch, tc8_slots()?);
                    ("matvec_tc8_q4_k", 8, per_block, None)
                }
                (true, _) => ("matvec_tc8_q4_k", 8, 8, Some(tc8_slots()?)),
            };
            // glu: a group's tiles are half as many rows of each matrix (even per_block).
            let groups = match a.glu {
                true => tiles.div_ceil(per_block / 2) * (a.batch / 2),
                false => tiles.div_ceil(per_block) * a.batch,
            };
            let blocks = one_wave.map_or(groups, |slots| groups.min(slots));
            let combine = match a.combine {
                None => TcCombine::default(),
                Some(c) => TcCombine {
                    weights: c.weights,
                    out: c.out,
                    // A counter per token and group of an item's rows.
                    done: self.zeroed_counters(&self.combine_done, groups)?,
                    choices: c.choices as i32,
                },
            };
            launch!(self, kernel, (blocks as u32, 1, 1), 32 * warps, smem as u32;
                a.w, a.pair, a.shared.0, a.shared.1, a.mat_stride as i64, a.ids,
                a.batch as i32, a.rows as i32, a.k as i32, row_bytes as i64, a.x,
                a.x_group as i32, a.x_stride as i64, a.y, a.y_stride as i64, per_block as i32,
                a.glu as i32, combine);
            return Ok(());
        }
        if self.takes_pick(a) {
            return self.matvec_tma_q6_k(a, row_bytes);
        }
        if uses_int_q6_k(a) {
            return self.matvec_int_q6_k(a, row_bytes);
        }
        let rb = row_bytes as i64;
        if a.transposed {
            // One thread per 8 columns.
            launch!(self, kernel, (grid1(a.k / 8, 128), a.batch as u32, 1), 128, 0;
                a.w, a.mat_stride as i64, a.ids, a.rows as i32, a.k as i32, rb, a.x,
                a.x_group as i32, a.x_stride as i64, a.y, a.y_stride as i64);
            return Ok(());
        }
        let (kernel, grid_x, block) = matvec_geometry(a.ty, a.rows, a.batch, a.k, rb as usize)?;
        launch!(self, kernel, (grid_x, a.batch as u32, 1), block, 0;
            a.w, a.mat_stride as i64, a.ids, a.rows as i32, a.k as i32, rb, a.x,
            a.x_group as i32, a.x_stride as i64, a.y, a.y_stride as i64, MatvecParts::default());
        Ok(())
    }

    /// Whether `a` runs on the CUDA-core matvec kernel, the one `matvec_parts` stands in for.
    pub fn on_cuda_cores(&self, a: &Matvec) -> bool {
        let readable = a.ty.row_bytes(a.k).is_some();
        readable && !a.transposed && !uses_int_q6_k(a) && !self.on_tensor_cores(a)
    }

    /// The bulk-copy kernel of `matvec_parts` for matrices of type `ty` and rows of `k`
    /// values, where the tile type takes them in one part (sm_90 and later): the rows'
    /// copies start as the launch does, before the previous kernel ends.
    fn parts_tile(&self, ty: GgmlType, k: usize) -> Option<TmaTile> {
        tma_tile(ty).filter(|t| {
            self.bulk_copies
                && (TMA_K_MIN..=t.k_max).contains(&k)
                && (k / 256).is_multiple_of(t.block_step())
        })
    }

    /// Whether the tail of `matvec_parts` for type `ty` and rows of `k` values takes the
    /// norms of `a`: the bulk-copy kernel's (288 threads), else matvec_latent_<type>'s (its
    /// types, 128 threads).
    pub fn parts_tail_takes(&self, ty: GgmlType, k: usize, a: &LatentNorm) -> bool {
        match self.parts_tile(ty, k) {
            Some(_) => a.fits(288, (8, 2, 1)),
            None => LATENT_TAIL_TYPES.contains(&ty) && a.fits(32 * MATVEC_WARPS, (16, 4, 2)),
        }
    }

    /// y_i = W_i x for two or three matrices of one type and row length `k` and one x: the
    /// projections of one activation (MLA's q_a, kv_a and the indexer key; a shared expert's
    /// gate and up) in one launch instead of one each: matvec_tma_parts_<type> where the
    /// bulk copies take the rows, else the CUDA-core kernel. With `latent` (where
    /// `parts_tail_takes` says so), the parts are one token's query latent (or without q-LoRA
    /// its query), kv and index key, and the launch's last blocks run their norms into the
    /// caches as latent_norm_rope would.
    pub fn matvec_parts(
        &self,
        ty: GgmlType,
        k: usize,
        x: Ptr,
        parts: &[MatvecPart],
        latent: Option<&LatentNorm>,
    ) -> Result<(), CudaError> {
        self.parts_launch(ty, k, x, parts, latent.map(PartsNorms::Tail))
    }

    /// The bulk-copy kernel of q-LoRA's q_b after a parts launch (`a`, one token): the plain
    /// walk in one part of k, also below TMA_K_MIN (DS3's 24576 x 1536, a partial stage a
    /// tile): alone slower than `matvec_tc_q4_k`, but it takes the parts launch's tail. H100,
    /// a DS3 layer on the chain clock: parts + q_b 11.2 + 11.1 -> 8.2 + 11.6 us, decode
    /// 1,033.7-1,035.0 -> 1,045.2-1,045.7 tok/s (docs/performance.md, thirty-eighth look).
    fn query_tile(&self, a: &Matvec) -> Option<TmaTile> {
        let single = a.batch == 1 && a.ids == 0 && a.pair == 0 && !a.glu && !a.transposed;
        let takes = single && self.on_tensor_cores(a) && self.bulk_copies && one_x_of(a);
        tma_tile(a.ty).filter(|t| takes && a.k <= t.k_max)
    }

    /// Whether `query_projections` takes q_b (`q_b`) after the parts launch of type `ty` and
    /// rows of `k` values with `latent`'s norms.
    pub fn query_takes(&self, ty: GgmlType, k: usize, q_b: &Matvec, latent: &LatentNorm) -> bool {
        self.parts_tile(ty, k).is_some()
            && self.query_tile(q_b).is_some()
            && latent.qx != 0
            && latent.dq as usize == q_b.k
            && latent.cache_rows_fit(32, (16, 4))
    }

    /// One token's projections with q-LoRA (`query_takes`): `matvec_parts`' launch, whose
    /// query tiles store the latent times its norm's weights (latent.qx) and their sums of
    /// squares (a float a 16-row tile), then q_b (`q_b`, x = latent.qx) on
    /// matvec_tma_query_<type>, whose rows take the norm's factor and whose last block's
    /// producer warp writes the normed latent (latent.qy, not x: the other blocks may still
    /// read x) and the latent's and the key's cache rows. q_b's wait then waits for no tail
    /// (docs/performance.md, thirty-seventh and thirty-eighth looks).
    pub fn query_projections(
        &self,
        (ty, k): (GgmlType, usize),
        x: Ptr,
        parts: &[MatvecPart],
        latent: &LatentNorm,
        q_b: &Matvec,
    ) -> Result<(), CudaError> {
        check(
            self.query_takes(ty, k, q_b, latent) && q_b.x == latent.qx && latent.qy != latent.qx,
            "query_projections",
            || format!("q_b of {} x {} after a {ty} parts launch", q_b.rows, q_b.k),
        )?;
        let tiles = (latent.dq as usize).div_ceil(16);
        let sums = self.empty(tiles)?;
        let sq = self.ptr(&sums, 0);
        self.parts_launch(ty, k, x, parts, Some(PartsNorms::Weighed(latent, sq)))?;
        let tile = self.query_tile(q_b).expect("query_takes");
        let (_, rb) = typed_rows("matvec", q_b.ty, q_b.k)?;
        let rows = QueryRows {
            sq,
            tiles: tiles as i32,
            latent: *latent,
        };
        let smem = tma_smem_bytes(tile, q_b.k);
        let slots = self.wave_blocks(tile.query, 288, smem)?;
        launch!(self, tile.query, (q_b.rows.div_ceil(16).min(slots) as u32, 1, 1), 288,
            smem as u32;
            q_b.w, q_b.rows as i32, q_b.k as i32, rb as i64, q_b.y, rows);
        Ok(())
    }

    /// matvec_parts' launch, with what it does of a latent's norms.
    fn parts_launch(
        &self,
        ty: GgmlType,
        k: usize,
        x: Ptr,
        parts: &[MatvecPart],
        latent: Option<PartsNorms<'_>>,
    ) -> Result<(), CudaError> {
        let (_, rb) = typed_rows("matvec", ty, k)?;
        check(
            (2..=3).contains(&parts.len()) && x.is_multiple_of(16),
            "matvec_parts",
            || format!("{} parts (2 or 3), x 16-byte aligned", parts.len()),
        )?;
        let part = |i: usize| {
            parts.get(i).copied().unwrap_or(MatvecPart {
                w: 0,
                rows: 0,
                y: 0,
            })
        };
        let (p0, p1, p2) = (part(0), part(1), part(2));
        if let Some(PartsNorms::Tail(a) | PartsNorms::Weighed(a, _)) = latent {
            let weighed = matches!(latent, Some(PartsNorms::Weighed(..)));
            check(
                (weighed || self.parts_tail_takes(ty, k, a))
                    && (a.qx == 0 || a.qx == p0.y)
                    && a.kv == p1.y
                    && a.kx == if parts.len() == 3 { p2.y } else { 0 },
                "matvec_parts",
                || format!("a latent's norms in the tail of a {ty} parts launch"),
            )?;
        }
        let mut extra = MatvecParts {
            w1: p1.w,
            w2: p2.w,
            rows1: p1.rows as i32,
            rows2: p2.rows as i32,
            y1: p1.y,
            y2: p2.y,
            ..MatvecParts::default()
        };
        match latent {
            Some(PartsNorms::Tail(a)) => {
                extra.done = self.zeroed_counters(&self.latent_done, 3)?;
                extra.latent = *a;
            }
            Some(PartsNorms::Weighed(a, sq)) => {
                extra.qsq = sq;
                extra.latent = *a;
            }
            None => {}
        }
        if let Some(tile) = self.parts_tile(ty, k) {
            check(
                parts.iter().all(|p| p.w.is_multiple_of(16)),
                "matvec_parts",
                || "the bulk copies need 16-byte aligned matrices".into(),
            )?;
            // A block per tile of the three matrices, up to a wave.
            let tiles: usize = parts.iter().map(|p| p.rows.div_ceil(16)).sum();
            let smem = tma_smem_bytes(tile, k);
            let slots = self.wave_blocks(tile.parts, 288, smem)?;
            launch!(self, tile.parts, (tiles.min(slots) as u32, 1, 1), 288,
                smem as u32;
                p0.w, p0.rows as i32, k as i32, rb as i64, x, p0.y, extra);
            return Ok(());
        }
        check(extra.qsq == 0, "matvec_parts", || {
            "the query's weighed tiles need the bulk-copy kernel".into()
        })?;
        // The grid of the longest part; the others' surplus blocks find no rows and return.
        let rows = parts.iter().map(|p| p.rows).max().unwrap();
        let (mut kernel, grid_x, block) = matvec_geometry(ty, rows, 1, k, rb)?;
        if latent.is_some() {
            check(block == 32 * MATVEC_WARPS as u32, "matvec_parts", || {
                format!("{block} threads for the tail of a {ty} parts launch")
            })?;
            kernel = typed_kernel("matvec_latent", ty)?;
        }
        launch!(self, kernel, (grid_x, parts.len() as u32, 1), block, 0;
            p0.w, 0i64, 0 as Ptr, p0.rows as i32, k as i32, rb as i64, x, 1i32, 0i64, p0.y, 0i64,
            extra);
        Ok(())
    }

    /// One Q6_K matrix times x on integer dot products: matvec_x_digits writes x's digits
    /// (planes [4][k] bytes, digit sums [k / 16][4] i32, scales [k / 256] f32) into scratch,
    /// matvec_int_q6_k reads them (kernels/matvec.cu).
    fn matvec_int_q6_k(&self, a: &Matvec, row_bytes: usize) -> Result<(), CudaError> {
        let digits = self.empty((5 * a.k + 4 * (a.k / 256)).div_ceil(4))?;
        let dp = self.ptr(&digits, 0);
        launch!(self, "matvec_x_digits", (grid1(a.k / 256, 4), 1, 1), 128, 0;
            a.x, a.k as i32, dp);
        let groups = a.rows.div_ceil(INT_Q6_ROWS);
        let (_, per_block) = matvec_blocks(groups, 1, row_bytes, MATVEC_WARPS);
        launch!(self, "matvec_int_q6_k", (grid1(groups, per_block), 1, 1),
            32 * MATVEC_WARPS as u32, 0;
            a.w, a.rows as i32, a.k as i32, row_bytes as i64, dp, a.y);
        Ok(())
    }

    /// One Q6_K matrix times x on the tensor cores, its rows by bulk copies: one wave of
    /// blocks walking the tiles of 16 rows (kernels/matvec.cu).
    fn matvec_tma_q6_k(&self, a: &Matvec, row_bytes: usize) -> Result<(), CudaError> {
        let kernel = "matvec_tma_q6_k";
        let smem = tma6_smem_bytes(a.k);
        let blocks = a
            .rows
            .div_ceil(16)
            .min(self.wave_blocks(kernel, 288, smem)?);
        let work = match a.pick {
            0 => 0,
            _ => self.zeroed_counters(&self.argmax_work, 1 + 2 * blocks)?,
        };
        launch!(self, kernel, (blocks as u32, 1, 1), 288, smem as u32;
            a.w, a.rows as i32, a.k as i32, row_bytes as i64, a.x, a.y, work, a.pick);
        Ok(())
    }

    /// y[t, :] = dequantized row t of `rows` of the [_, n] matrix w; with `norm` (its x is y),
    /// also its rows RMS-normed (eps) in the same launch, where `embed_norms(n)`.
    pub fn embed(
        &self,
        ty: GgmlType,
        w: Ptr,
        n: usize,
        rows: EmbedRows,
        y: Ptr,
        norm: Option<(&RowsNorm, f32)>,
    ) -> Result<(), CudaError> {
        let (kernel, row_bytes) = typed_rows("embed", ty, n)?;
        let threads = embed_threads(n);
        check(
            norm.is_none_or(|(h, _)| h.x == y && h.width == n && Self::embed_norms(n)),
            "embed",
            || format!("a norm of rows of {n} values in the embedding's launch"),
        )?;
        let (ids, id0, tokens) = match rows {
            EmbedRows::Ids(ids, tokens) => (ids, 0, tokens),
            EmbedRows::One(id) => (0, id as i32, 1),
        };
        let (norm_w, h, eps) = norm.map_or((0, 0, 0.0), |(h, eps)| (h.w, h.y, eps));
        launch!(self, kernel, (tokens as u32, 1, 1), threads, 0;
            w, row_bytes as i64, ids, id0, n as i32, y, norm_w, h, eps);
        Ok(())
    }

    /// Whether `embed` norms rows of `n` values in its launch (NORM_VALS = 8 a thread).
    pub fn embed_norms(n: usize) -> bool {
        n <= 8 * embed_threads(n) as usize
    }
}

/// embed_<type>'s threads for rows of `n` values: one 8-value unit a thread, up to 1024.
fn embed_threads(n: usize) -> u32 {
    (n / 8).next_multiple_of(32).clamp(32, 1024) as u32
}

/// The rows `Gpu::embed` dequantizes: `tokens` ids on the device, or one id by value (a decode
/// token: no copy to the device ahead of its first kernel).
pub enum EmbedRows {
    Ids(Ptr, usize),
    One(u32),
}

/// add_rmsnorm_cluster's blocks (its cluster) and their threads (NORM_CLUSTER and
/// CLUSTER_THREADS, kernels/norm.cu): a row of up to 8192 values, 4 a thread.
const NORM_CLUSTER: u32 = 8;
const NORM_CLUSTER_THREADS: u32 = 256;

/// Threads per block of rmsnorm / layernorm for rows of n values: each thread keeps at most
/// NORM_VALS = 8 of them in registers (kernels/norm.cu), 4 up to rows of 4096.
fn norm_block(n: usize, kernel: &str) -> Result<u32, CudaError> {
    check(n > 0 && n <= 8 * 1024, kernel, || {
        format!("rows of {n} values (1 ..= 8192)")
    })?;
    Ok((n.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32)
}

/// Y[m, :] = W X[row(m), :] for m < M on tensor cores (bf16 operands, f32 accumulation);
/// row(m) = row_ids[m] when given (the tokens routed to one expert), else m.
///
/// Batched mode (`spans` = 0, the per-head products in one launch): `n_spans` matrices (0
/// counts as 1); matrix z is at `w + z * mat_stride` bytes and reads X from
/// `x + z * x_mat_stride`, writes Y at `y + z * y_mat_stride` (elements, 4-byte f32 each),
/// every one with the same m, n, k and strides.
///
/// Grouped mode (`spans` != 0, the MoE prefill in one launch): `spans` is `n_spans` i32
/// triples (expert, first row r0, count); span s multiplies the matrix at
/// `w + expert * mat_stride` bytes for global rows r = r0 .. r0 + count, reading X row
/// row_ids[r] (or r) and writing Y row r; `m` is then the largest count (it sizes the grid),
/// `x_rows` the number of X rows (the cp.async kernels round them to bf16 once);
/// `x_mat_stride`, `y_mat_stride` are unused.
pub struct Matmul {
    pub ty: GgmlType,
    /// [n, k] quantized, or [k, n] when `transposed` (Y = X W).
    pub w: Ptr,
    pub transposed: bool,
    /// f32, x_stride elements per row.
    pub x: Ptr,
    pub x_stride: usize,
    /// [m] i32 or 0.
    pub row_ids: Ptr,
    /// Grouped mode: rows of X (row_ids index them; without row_ids, the spans' rows).
    pub x_rows: usize,
    /// [m, n] f32 with y_stride.
    pub y: Ptr,
    pub y_stride: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// [n_spans, 3] i32 (expert, first row, count) or 0.
    pub spans: Ptr,
    pub n_spans: usize,
    /// Grouped mode: the spans' rows in all (their counts' sum), or 0 where not known; Q4_K
    /// spans of CP_SPANS64_ROWS rows or more on average take 64-row tiles (each weight tile
    /// read once for up to 64 rows instead of once per 32).
    pub span_rows: usize,
    /// Bytes between consecutive matrices (experts in grouped mode, heads in batched mode).
    pub mat_stride: usize,
    /// Batched mode: f32 elements between consecutive matrices' X and Y.
    pub x_mat_stride: usize,
    pub y_mat_stride: usize,
}

impl Matmul {
    /// One product Y[m, n] = X W^T: no gather, no spans, not transposed. The other modes set
    /// their fields over it (`Matmul { spans, n_spans, ..Matmul::plain(..) }`).
    pub fn plain(
        ty: GgmlType,
        w: Ptr,
        (x, x_stride): (Ptr, usize),
        (y, y_stride): (Ptr, usize),
        (m, n, k): (usize, usize, usize),
    ) -> Matmul {
        Matmul {
            ty,
            w,
            transposed: false,
            x,
            x_stride,
            row_ids: 0,
            x_rows: 0,
            y,
            y_stride,
            m,
            n,
            k,
            spans: 0,
            n_spans: 1,
            span_rows: 0,
            mat_stride: 0,
            x_mat_stride: 0,
            y_mat_stride: 0,
        }
    }
}

// Tiles of the cp.async kernels (MATMUL_CP_KERNEL in kernels/matmul.cu): plain products take
// 128 x 128 tiles of 128 threads; grouped ones 32-row tiles of Q4_K 128 columns (128 threads)
// or Q8_0 256 columns (256 threads).
const CP_BM: usize = 128;
const CP_BN: usize = 128;
const CP_THREADS: u32 = 128;
const CP_SPANS_BM: usize = 32;
/// Average rows per span from which grouped Q4_K products take 64-row tiles
/// (matmul_cp_spans64_q4_k: 4 warps of 64 x 32, two blocks an SM): at 2048 prompt tokens a
/// token's 8 of 256 experts give ~64 rows an expert, which 32-row tiles read the weights of
/// twice.
pub const CP_SPANS64_ROWS: usize = 48;
/// Split-K keeps at least this many 64-wide k steps per split (fewer would spend more on the
/// partials than they save).
const CP_MIN_SPLIT_STEPS: usize = 4;

/// Time of `blocks` equal blocks on `sms` multiprocessors that hold `per_sm` each, in thirds
/// of a full round: a full round of blocks takes 3, a last round of at most one block a
/// multiprocessor 2 (a block alone on one runs faster: H200, 2026-12-05, DS3 q_a 2048 x 1536 x
/// 7168 in 192 blocks 245 us, in 2 x 192 of half the work 221 us with a kernel 8% slower).
fn cp_rounds(blocks: usize, sms: usize, per_sm: usize) -> usize {
    let wave = sms * per_sm;
    let last = match blocks % wave {
        0 => 0,
        r if r <= sms => 2,
        _ => 3,
    };
    3 * (blocks / wave) + last
}

/// Split-K of a plain product of `tiles` tiles and `steps` k steps on `sms` multiprocessors that
/// hold `per_sm` blocks each: where the tiles leave part of the GPU idle, the splits whose
/// blocks end soonest (`cp_rounds` of 1 / splits of a tile's work each), up to those that fill
/// one wave and with CP_MIN_SPLIT_STEPS k steps or more each; the fewest on ties, since each
/// split adds partials to write and sum. Rounding the splits up to fill the wave had made a
/// second, near-empty round: kv_a's 20 tiles in 14 splits are 280 blocks for 264 places.
fn cp_splits(tiles: usize, steps: usize, sms: usize, per_sm: usize) -> usize {
    let wave = sms * per_sm;
    let most = (steps / CP_MIN_SPLIT_STEPS).clamp(1, wave.div_ceil(tiles.max(1)));
    let units = |s: usize| cp_rounds(tiles * s, sms, per_sm);
    // units(s) / s against the best's, as exact integers.
    (1..=most).fold(1, |best, s| {
        if units(s) * best < units(best) * s {
            s
        } else {
            best
        }
    })
}

/// How a plain product of `tiles_m` x `tiles_n` tiles runs on matmul_cp_<type>: its first
/// `head` column tiles whole over k, then the other columns in `splits` k splits (head 0: the
/// whole product, split or not). A product of more tiles than one wave whose last round would
/// hold few blocks (H200, 512 tokens of DS3's ffn_up: 576 tiles, two rounds of 264, then 48
/// blocks alone) runs the columns of its full rounds first and splits the rest over the
/// whole GPU (48 tiles in 5 splits: 240 blocks of a fifth of the work), where `cp_rounds`
/// counts 4% or more less time (DS3's 576 tiles: 8 -> 6.6 thirds of a round; GLM-5's 384:
/// 5 -> 4.5; DS3's attn_output and ffn_down at 2048 tokens, 896 tiles: 11 -> 10.5; 2048
/// tokens of ffn_up, 2304 tiles, 27 -> 26.5, stay whole). At 5% those 896 stayed whole, and
/// their last round of 104 blocks came out unevenly spread (H100, ncu: multiprocessors active
/// 85.5% of the product's time); split, 1,464-1,475 -> 1,334-1,341 us (thirty-first look).
fn cp_plan(tiles_m: usize, tiles_n: usize, steps: usize, sms: usize, per_sm: usize) -> CpPlan {
    let (tiles, wave) = (tiles_m * tiles_n, sms * per_sm);
    let whole = CpPlan {
        head: 0,
        splits: cp_splits(tiles, steps, sms, per_sm),
    };
    if tiles <= wave {
        return whole;
    }
    let head = tiles / wave * wave / tiles_m;
    let rest = (tiles_n - head) * tiles_m;
    let s = cp_splits(rest, steps, sms, per_sm);
    // Both times in thirds of a round, times s.
    let split = cp_rounds(head * tiles_m, sms, per_sm) * s + cp_rounds(rest * s, sms, per_sm);
    if s > 1 && 25 * split <= 24 * s * cp_rounds(tiles, sms, per_sm) {
        CpPlan { head, splits: s }
    } else {
        whole
    }
}

/// The launches of a plain product on matmul_cp_<type> (`Gpu::matmul_cp_plan`): columns
/// [0, head) whole over k, then columns [head, n) in `splits` k splits (partials summed by
/// matmul_splitk_sum).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpPlan {
    pub head: usize,
    pub splits: usize,
}

/// Whether matmul_cp_<type> takes the product (else the first-generation kernels, which take
/// every type and mode): Q4_K or Q8_0, not transposed, k a multiple of 256, weights 16-byte
/// aligned (cp.async of raw rows), Y rows 16-byte aligned; grouped, or a single matrix of more
/// than 32 rows (fewer: matmul_s16 / matmul_s32, made for them; batched heads: the first
/// generation's gridDim.z).
fn matmul_cp_takes(a: &Matmul, row_bytes: usize) -> bool {
    matches!(a.ty, GgmlType::Q4_K | GgmlType::Q8_0)
        && !a.transposed
        && a.k.is_multiple_of(256)
        && a.w.is_multiple_of(16)
        && row_bytes.is_multiple_of(16)
        && a.mat_stride.is_multiple_of(16)
        && a.y.is_multiple_of(16)
        && a.y_stride.is_multiple_of(4)
        && (a.spans != 0 || (a.n_spans <= 1 && a.m > 32))
}

/// The shortest k chunk of the first-generation kernels' split-K.
const FG_SPLIT_MIN_K: usize = 512;

impl Gpu {
    pub fn matmul(&self, a: &Matmul) -> Result<(), CudaError> {
        let row_bytes = a.ty.row_bytes(if a.transposed { a.n } else { a.k });
        check(
            row_bytes.is_some() && a.k.is_multiple_of(32) && a.n.is_multiple_of(8),
            "matmul",
            || {
                format!(
                    "k = {}, n = {}: k a multiple of 32, rows whole {} blocks",
                    a.k, a.n, a.ty
                )
            },
        )?;
        let row_bytes = row_bytes.unwrap();
        check(
            a.x.is_multiple_of(16)
                && a.x_stride.is_multiple_of(4)
                && a.x_mat_stride.is_multiple_of(4),
            "matmul",
            || "x rows must be 16-byte aligned".into(),
        )?;
        let z = if a.spans == 0 {
            a.n_spans.max(1)
        } else {
            a.n_spans
        };
        check(z <= 65535, "matmul", || {
            format!("{z} spans or matrices (at most 65535)")
        })?;
        if z == 0 || a.m == 0 || a.n == 0 {
            return Ok(());
        }
        if matmul_cp_takes(a, row_bytes) {
            return self.matmul_cp(a, row_bytes);
        }
        // Row tiles (kernels/matmul.cu): 128 rows for large products; 64 where a matrix has
        // few rows; the small kernels (16 or 32 rows x 256 columns, k a multiple of 64) for
        // tiny plain or batched products and the grouped MoE spans. There m is the largest
        // count, while the typical span is far smaller (~16 tokens per expert in a 512-token
        // prefill, a few experts with 2-6x that): the few large spans take several 32-row
        // tiles (re-reading their expert's weights) rather than every span a 64-row one.
        let small = !a.transposed && a.k.is_multiple_of(64);
        let bm = match (small, a.spans != 0) {
            (true, _) if a.m <= 16 => 16,
            (true, true) if a.m <= 128 => 32,
            (true, false) if a.m <= 32 => 32,
            _ if a.spans != 0 || a.m <= 64 => 64,
            _ => 128,
        };
        let (prefix, bn) = match (a.transposed, bm) {
            (false, 16) => ("matmul_s16", 256),
            (false, 32) => ("matmul_s32", 256),
            (false, 128) => ("matmul", 128),
            (true, 128) => ("matmul_t", 128),
            (false, _) => ("matmul_m64", 128),
            (true, _) => ("matmul_t_m64", 128),
        };
        let kernel = typed_kernel(prefix, a.ty)?;
        let (grid_x, grid_y) = (grid1(a.n, bn), grid1(a.m, bm));
        let splits = self.first_generation_splits(a, (grid_x * grid_y) as usize);
        if splits > 1 {
            // Split-K as batched mode: "matrix" z is the z-th k chunk of every row (its bytes
            // and its X columns) and writes its own [m, n] partials, summed in split order.
            let chunk = a.k / splits;
            let part = self.empty(splits * a.m * a.n)?;
            let pp = self.ptr(&part, 0);
            launch!(self, kernel, (grid_x, grid_y, splits as u32), 256, 0;
                a.w, row_bytes as i64, a.x, a.x_stride as i64, a.row_ids, pp, a.n as i64,
                a.m as i32, a.n as i32, chunk as i32, 0u64,
                a.ty.row_bytes(chunk).unwrap() as i64, chunk as i64, (a.m * a.n) as i64);
            return self.matmul_splitk_sum(pp, splits, (a.m, a.n), (a.y, a.y_stride));
        }
        launch!(self, kernel, (grid_x, grid_y, z as u32), 256, 0;
            a.w, row_bytes as i64, a.x, a.x_stride as i64, a.row_ids, a.y,
            a.y_stride as i64, a.m as i32, a.n as i32, a.k as i32, a.spans,
            a.mat_stride as i64, a.x_mat_stride as i64, a.y_mat_stride as i64);
        Ok(())
    }

    /// Into how many k chunks a plain first-generation product of `blocks` tiles is split:
    /// the f32 MoE router of a prefill (512 x 256 x 6144) is 8 tiles on a GPU of 132 SMs.
    /// Chunks of a whole number of FG_SPLIT_MIN_K values (every type's block divides it); Y
    /// 16-byte aligned rows (matmul_splitk_sum stores float4).
    fn first_generation_splits(&self, a: &Matmul, blocks: usize) -> usize {
        let plain = a.spans == 0 && a.n_spans <= 1 && !a.transposed;
        if !plain
            || !a.k.is_multiple_of(FG_SPLIT_MIN_K)
            || !a.y.is_multiple_of(16)
            || !a.y_stride.is_multiple_of(4)
        {
            return 1;
        }
        let most = a.k / FG_SPLIT_MIN_K;
        let mut splits = self.multiprocessors.div_ceil(blocks).min(most);
        while !a.k.is_multiple_of(splits * FG_SPLIT_MIN_K) {
            splits -= 1;
        }
        splits
    }

    /// How `matmul` runs plain product `a` on matmul_cp_<type> (`CpPlan`, columns in elements);
    /// None where it takes other kernels or `a` is grouped.
    pub fn matmul_cp_plan(&self, a: &Matmul) -> Result<Option<CpPlan>, CudaError> {
        let Some(row_bytes) = a.ty.row_bytes(a.k) else {
            return Ok(None);
        };
        if !matmul_cp_takes(a, row_bytes) || a.spans != 0 {
            return Ok(None);
        }
        let kernel = format!("matmul_cp_{}", a.ty.name().to_lowercase());
        let smem = super::kernels::matmul_cp_smem_bytes(&kernel);
        let per_sm = self.blocks_per_sm(&kernel, CP_THREADS, smem)?.max(1);
        let steps = a.k / 64;
        let tiles_n = a.n.div_ceil(CP_BN);
        let plan = cp_plan(
            a.m.div_ceil(CP_BM),
            tiles_n,
            steps,
            self.multiprocessors,
            per_sm,
        );
        Ok(Some(CpPlan {
            head: (plan.head * CP_BN).min(a.n),
            // The splits of whole k steps that cover k (9 steps in 4 splits are 3 of 3).
            splits: steps.div_ceil(steps.div_ceil(plan.splits)),
        }))
    }

    /// The product on matmul_cp_<type> (see `matmul_cp_takes`): X rounded to bf16 once by
    /// matmul_xprep (plain mode: the rows gathered through row_ids; grouped mode: X's rows as
    /// they are, gathered by the tiles), then the tiles; plain products split over k where
    /// their tiles leave the GPU idle (`matmul_cp_plan`).
    fn matmul_cp(&self, a: &Matmul, row_bytes: usize) -> Result<(), CudaError> {
        let ty = a.ty.name().to_lowercase();
        let grouped = a.spans != 0;
        let wide =
            grouped && a.ty == GgmlType::Q4_K && a.span_rows >= CP_SPANS64_ROWS * a.n_spans.max(1);
        let kernel = match (grouped, wide) {
            (true, true) => "matmul_cp_spans64_q4_k".to_string(),
            (true, false) => format!("matmul_cp_spans_{ty}"),
            _ => format!("matmul_cp_{ty}"),
        };
        let smem = super::kernels::matmul_cp_smem_bytes(&kernel);
        let plan = self
            .matmul_cp_plan(a)?
            .unwrap_or(CpPlan { head: 0, splits: 1 });
        // Scratch, like the backend's temporaries: one stream-ordered allocation, freed in
        // stream order (after the kernels below) when it drops at the end of this function.
        // bf16 X [rows, k], then the split columns' partials [splits, m, n - head] f32 from a
        // 256-byte boundary.
        let (x_rows, gather) = if grouped {
            check(a.x_rows > 0, "matmul", || {
                "grouped mode needs x_rows".into()
            })?;
            (a.x_rows, 0)
        } else {
            (a.m, a.row_ids)
        };
        let xb_floats = (x_rows * a.k / 2).next_multiple_of(64);
        let part_floats = if plan.splits > 1 {
            plan.splits * a.m * (a.n - plan.head)
        } else {
            0
        };
        let scratch = self.empty(xb_floats + part_floats)?;
        let xb = self.ptr(&scratch, 0);
        launch!(self, "matmul_xprep", (grid1(x_rows * a.k / 32, 256), 1, 1), 256, 0;
            a.x, a.x_stride as i64, gather, x_rows as i32, a.k as i32, xb);
        if grouped {
            let (bn, threads) = if a.ty == GgmlType::Q4_K {
                (128, 128)
            } else {
                (256, 256)
            };
            let bm = if wide { 2 * CP_SPANS_BM } else { CP_SPANS_BM };
            let grid = (grid1(a.n, bn), grid1(a.m, bm), a.n_spans as u32);
            launch!(self, kernel, grid, threads, smem as u32;
                a.w, row_bytes as i64, xb, a.row_ids, a.y, a.y_stride as i64, a.m as i32,
                a.n as i32, a.k as i32, a.spans, a.mat_stride as i64, 0i32, 0i32, 0u64);
            return Ok(());
        }
        let cols = |n0: usize, n1: usize, splits: usize, part: Ptr| {
            // Columns n0 .. n1: W's rows n0 .., Y's columns n0 ...
            let (w, y, n) = (a.w + (n0 * row_bytes) as u64, a.y + 4 * n0 as u64, n1 - n0);
            let tiles_m = a.m.div_ceil(CP_BM);
            let tiles = tiles_m * n.div_ceil(CP_BN);
            let ksteps = (a.k / 64).div_ceil(splits);
            launch!(self, &kernel, (tiles as u32, splits as u32, 1), CP_THREADS, smem as u32;
                w, row_bytes as i64, xb, 0u64, y, a.y_stride as i64, a.m as i32, n as i32,
                a.k as i32, 0u64, 0i64, tiles_m as i32, ksteps as i32, part);
            if splits > 1 {
                self.matmul_splitk_sum(part, splits, (a.m, n), (y, a.y_stride))?;
            }
            Ok::<(), CudaError>(())
        };
        if plan.head > 0 {
            cols(0, plan.head, 1, 0)?;
        }
        let part = if plan.splits > 1 {
            self.ptr(&scratch, xb_floats)
        } else {
            0
        };
        cols(plan.head, a.n, plan.splits, part)
    }

    /// Y [m, n] (rows y_stride apart) = the sum of `splits` partials [splits, m, n] at `part`,
    /// in split order (float4 stores: Y rows 16-byte aligned).
    fn matmul_splitk_sum(
        &self,
        part: Ptr,
        splits: usize,
        (m, n): (usize, usize),
        (y, y_stride): (Ptr, usize),
    ) -> Result<(), CudaError> {
        launch!(self, "matmul_splitk_sum", (grid1(m * n / 4, 256), 1, 1), 256, 0;
            part, splits as i32, m as i32, n as i32, y, y_stride as i64);
        Ok(())
    }

    /// y = x / sqrt(mean(x^2) + eps) * w, row by row ([rows, n], strided).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm(
        &self,
        x: Ptr,
        x_stride: usize,
        w: Ptr,
        y: Ptr,
        y_stride: usize,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let block = norm_block(n, "rmsnorm")?;
        launch!(self, "rmsnorm", (rows as u32, 1, 1), block, 0;
            x, x_stride as i64, w, y, y_stride as i64, n as i32, eps);
        Ok(())
    }

    /// x += r (written back), then y = rmsnorm(x) * w, row by row ([rows, n], contiguous);
    /// r: (address, parts, weights), the sum in order of that many [rows, n] parts one after
    /// the other: partials (a product with `Matvec::y_part`; weights 0), or with weights
    /// ([parts] f32) a decode token's expert outputs, part p times weight p, a part of weight 0
    /// not added (the MoE combine: moe_combine's sum). One row goes to a cluster of blocks
    /// where the GPU has them (sm_90+), the only form that takes parts. See kernels/norm.cu.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rmsnorm(
        &self,
        x: Ptr,
        (r, r_parts, r_weights): (Ptr, usize, Ptr),
        w: Ptr,
        y: Ptr,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let block = norm_block(n, "add_rmsnorm")?;
        check(r_parts >= 1, "add_rmsnorm", || "no part of r".into())?;
        if rows == 1 && self.clusters {
            launch!(self, "add_rmsnorm_cluster", (NORM_CLUSTER, 1, 1), NORM_CLUSTER_THREADS, 0;
                x, r, r_parts as i32, n as i64, r_weights, w, y, n as i32, eps);
            return Ok(());
        }
        check(r_parts == 1 && r_weights == 0, "add_rmsnorm", || {
            "parts of r: one row, on a GPU with clusters of blocks".into()
        })?;
        launch!(self, "add_rmsnorm", (rows as u32, 1, 1), block, 0; x, r, w, y, n as i32, eps);
        Ok(())
    }

    /// The latent's norms of `rows` tokens in a launch of their own (`LatentNorm::new`; see
    /// kernels/norm.cu).
    pub fn latent_norm_rope(&self, rows: usize, a: &LatentNorm) -> Result<(), CudaError> {
        let block = norm_block(a.dl.max(a.dq).max(a.dk) as usize, "latent_norm_rope")?;
        if rows == 0 {
            return Ok(());
        }
        let grid = (rows as u32, 1 + (a.qx != 0) as u32 + (a.kx != 0) as u32, 1);
        launch!(self, "latent_norm_rope", grid, block, 0; *a);
        Ok(())
    }

    /// Rows 0 .. rows of a latent cache back as f32: c_kv [rows, dl] and k_pe [rows, dr] (the
    /// prefill's expanded attention; kernels/norm.cu).
    pub fn latent_rows(
        &self,
        cache: Ptr,
        rows: usize,
        (dl, dr): (usize, usize),
        c_kv: Ptr,
        k_pe: Ptr,
    ) -> Result<(), CudaError> {
        latent_fits("latent_rows", dl, dr)?;
        if rows == 0 {
            return Ok(());
        }
        launch!(self, "latent_rows", (rows as u32, 1, 1), 128, 0;
            cache, dl as i32, dr as i32, c_kv, k_pe);
        Ok(())
    }

    /// y = (x - mean) / sqrt(var + eps) * w + b, row by row; `rope` (or None): row r's first
    /// `dims` outputs then rotated as adjacent pairs at position pos0 + r (the DSA indexer's key
    /// into its cache row).
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm(
        &self,
        x: Ptr,
        x_stride: usize,
        w: Ptr,
        b: Ptr,
        y: Ptr,
        y_stride: usize,
        rows: usize,
        n: usize,
        eps: f32,
        rope: Option<PairRope>,
    ) -> Result<(), CudaError> {
        let block = norm_block(n, "layernorm")?;
        let r = rope.unwrap_or(PairRope {
            dims: 0,
            pos0: 0,
            inv_freq: 0,
            mscale: 1.0,
        });
        check(r.dims.is_multiple_of(2) && r.dims <= n, "layernorm", || {
            format!("rope width {} of rows of {n}", r.dims)
        })?;
        launch!(self, "layernorm", (rows as u32, 1, 1), block, 0;
            x, x_stride as i64, w, b, y, y_stride as i64, n as i32, eps, r.dims as i32,
            r.pos0 as i32, r.inv_freq, r.mscale);
        Ok(())
    }

    /// Rotates adjacent pairs of the `dims`-wide rope part of each (token, head) row in place:
    /// x + t * tok_stride + h * head_stride, token t at position pos0 + t; inv_freq: [dims / 2].
    /// `copy` (address, row stride), or (0, 0): the rotated values also to address + t * stride
    /// + h * dims.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_pairs(
        &self,
        x: Ptr,
        tok_stride: usize,
        head_stride: usize,
        tokens: usize,
        heads: usize,
        dims: usize,
        pos0: usize,
        inv_freq: Ptr,
        mscale: f32,
        copy: (Ptr, usize),
    ) -> Result<(), CudaError> {
        check(dims.is_multiple_of(2) && dims <= 2048, "rope_pairs", || {
            format!("rope width {dims}")
        })?;
        // Up to 256 threads per block: whole heads of `lanes` threads each.
        let lanes = (dims / 2).div_ceil(32) * 32;
        let per_block = (256 / lanes).clamp(1, heads.max(1));
        launch!(self, "rope_pairs", (tokens as u32, grid1(heads, per_block), 1),
            (lanes * per_block) as u32, 0;
            x, tok_stride as i64, head_stride as i64, dims as i32, heads as i32, lanes as i32,
            pos0 as i32, inv_freq, mscale, copy.0, copy.1 as i64);
        Ok(())
    }

    /// out = silu(gate) * up over n values.
    pub fn silu_mul(&self, gate: Ptr, up: Ptr, out: Ptr, n: usize) -> Result<(), CudaError> {
        launch!(self, "silu_mul", (grid1(n, 256), 1, 1), 256, 0; gate, up, out, n as i64);
        Ok(())
    }

    /// Copies rows x heads x cols floats between strided layouts (see kernels/elementwise.cu).
    #[allow(clippy::too_many_arguments)]
    pub fn copy_block(
        &self,
        src: Ptr,
        src_row: usize,
        src_head: usize,
        dst: Ptr,
        dst_row: usize,
        dst_head: usize,
        rows: usize,
        heads: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        if rows == 0 || heads == 0 || cols == 0 {
            return Ok(());
        }
        // COPY_COLS = 512 columns a block (kernels/elementwise.cu).
        launch!(self, "copy_block", (rows as u32, heads as u32, grid1(cols, 512)), 128, 0;
            src, src_row as i64, src_head as i64, dst, dst_row as i64, dst_head as i64, cols as i32);
        Ok(())
    }

    /// acc += x over n values.
    pub fn add_inplace(&self, acc: Ptr, x: Ptr, n: usize) -> Result<(), CudaError> {
        launch!(self, "add_inplace", (grid1(n, 256), 1, 1), 256, 0; acc, x, n as i64);
        Ok(())
    }
}

/// Causal prefill attention over expanded heads (see kernels/attention.cu). Strides are in
/// floats; a stride of 0 shares a tensor across heads (k_pe).
pub struct AttentionPrefill {
    /// [T, heads, dka + dkb] via (q_tok, q_head).
    pub q: Ptr,
    pub q_tok: usize,
    pub q_head: usize,
    /// First key part (k_nope), dka wide.
    pub ka: Ptr,
    pub ka_tok: usize,
    pub ka_head: usize,
    pub dka: usize,
    /// Second key part (k_pe), dkb wide.
    pub kb: Ptr,
    pub kb_tok: usize,
    pub kb_head: usize,
    pub dkb: usize,
    pub v: Ptr,
    pub v_tok: usize,
    pub v_head: usize,
    pub dv: usize,
    pub out: Ptr,
    pub o_tok: usize,
    pub o_head: usize,
    /// [T, mask_words] u32 key bitmask (DSA), or 0.
    pub mask: Ptr,
    pub mask_words: usize,
    pub tokens: usize,
    pub heads: usize,
    /// Position of query 0; keys 0 .. pos0 + tokens exist.
    pub pos0: usize,
    pub scale: f32,
}

impl Gpu {
    pub fn attention_prefill(&self, a: &AttentionPrefill) -> Result<(), CudaError> {
        let dqk = a.dka + a.dkb;
        check(
            dqk <= ATT_DQK_MAX && a.dv <= ATT_DV_MAX,
            "attention_prefill",
            || format!("head dims {dqk}/{} over {ATT_DQK_MAX}/{ATT_DV_MAX}", a.dv),
        )?;
        // The kernel reads q and k rows from shared memory as float4.
        check(dqk.is_multiple_of(4), "attention_prefill", || {
            format!("query/key head dim {dqk} not a multiple of 4")
        })?;
        let smem = attention_smem_bytes(dqk, a.dv) as u32;
        // Heads on x, query tiles on y: the kernel walks y backwards so the longest tiles
        // start first.
        let grid = (a.heads as u32, grid1(a.tokens, ATT_BQ), 1);
        launch!(self, "attention_prefill", grid, ATT_THREADS, smem;
            a.q, a.q_tok as i64, a.q_head as i64,
            a.ka, a.ka_tok as i64, a.ka_head as i64, a.dka as i32,
            a.kb, a.kb_tok as i64, a.kb_head as i64, a.dkb as i32,
            a.v, a.v_tok as i64, a.v_head as i64, a.dv as i32,
            a.out, a.o_tok as i64, a.o_head as i64, a.mask, a.mask_words as i32,
            a.tokens as i32, a.pos0 as i32, a.scale);
        Ok(())
    }

    /// `attention_prefill` on the tensor cores (bf16 operands, f32 accumulation: the bf16 path
    /// of prompts of 16 rows or more), in the smallest form (ATT_MMA_FORMS) whose padded head
    /// dims hold these; false where none does, or where the GPU has no room for its bf16 copies
    /// of q, the keys and v (attention_bf16, head-major, into scratch): attention_prefill then.
    pub fn attention_prefill_mma(&self, a: &AttentionPrefill) -> Result<bool, CudaError> {
        let dqk = a.dka + a.dkb;
        let form = ATT_MMA_FORMS.iter().find(|f| dqk <= f.1 && a.dv <= f.2);
        let Some(&(kernel, dq, dvp, bk)) = form.filter(|_| self.attention_mma) else {
            return Ok(false);
        };
        let keys = a.pos0 + a.tokens;
        // Scratch (bf16, freed in stream order when it drops): q [heads][T][dq], keys
        // [heads][S][dq], values [heads][S][dvp]; dq and dvp multiples of 16, so every part
        // starts 32-byte aligned.
        let (qn, kn, vn) = (
            a.heads * a.tokens * dq,
            a.heads * keys * dq,
            a.heads * keys * dvp,
        );
        let scratch = match self.empty((qn + kn + vn) / 2) {
            Ok(scratch) => scratch,
            // No room for the copies (a long prompt): the f32 kernel needs none.
            Err(CudaError::Driver(e)) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Ok(false)
            }
            Err(e) => return Err(e),
        };
        let (qb, kb, vb) = (
            self.ptr(&scratch, 0),
            self.ptr(&scratch, qn / 2),
            self.ptr(&scratch, (qn + kn) / 2),
        );
        let parts = [
            (a.q, a.q_tok, a.q_head, dqk, 0, 0, 0, 0, a.tokens, dq, qb),
            (
                a.ka, a.ka_tok, a.ka_head, a.dka, a.kb, a.kb_tok, a.kb_head, a.dkb, keys, dq, kb,
            ),
            (a.v, a.v_tok, a.v_head, a.dv, 0, 0, 0, 0, keys, dvp, vb),
        ];
        for (x, x_tok, x_head, dx, y, y_tok, y_head, dy, rows, d, out) in parts {
            launch!(self, "attention_bf16", (grid1(a.heads * rows * d / 8, 256), 1, 1), 256, 0;
                x, x_tok as i64, x_head as i64, dx as i32, y, y_tok as i64, y_head as i64,
                dy as i32, rows as i32, a.heads as i32, d as i32, out);
        }
        let grid = (a.heads as u32, grid1(a.tokens, ATT_MMA_BQ), 1);
        let smem = attention_mma_smem_bytes(dq, dvp, bk) as u32;
        launch!(self, kernel, grid, ATT_MMA_THREADS, smem;
            qb, kb, vb, a.out, a.o_tok as i64, a.o_head as i64, a.dv as i32, a.mask,
            a.mask_words as i32, a.tokens as i32, keys as i32, a.pos0 as i32,
            a.scale * std::f32::consts::LOG2_E);
        Ok(true)
    }
}

/// Whether a latent of dl + dr values fits the latent cache format.
pub fn latent_fits(kernel: &str, dl: usize, dr: usize) -> Result<(), CudaError> {
    check(
        dl <= LATENT_ROPE_AT && dr <= LATENT_DIMS - LATENT_ROPE_AT,
        kernel,
        || {
            format!(
                "latent {dl} + rope {dr}: the cache format holds at most {LATENT_ROPE_AT} + {}",
                LATENT_DIMS - LATENT_ROPE_AT
            )
        },
    )
}

/// The latent cache format (kernels/common.cuh) of `rows` [S, dl + dr] f32 `[c_kv | k_pe]`,
/// as latent_norm_rope writes it: per row LATENT_DIMS bf16 values x_hi = bf16(x) (rounded to
/// nearest even), then LATENT_DIMS values bf16(x - x_hi), c_kv at dims 0.., k_pe at
/// LATENT_ROPE_AT.., zeros elsewhere. For callers that fill a cache from the host.
pub fn latent_split(rows: &[f32], dl: usize, dr: usize) -> Result<Vec<u16>, CudaError> {
    latent_fits("latent_split", dl, dr)?;
    let mut out = vec![0u16; rows.len() / (dl + dr) * 2 * LATENT_DIMS];
    for (src, dst) in rows
        .chunks_exact(dl + dr)
        .zip(out.chunks_exact_mut(2 * LATENT_DIMS))
    {
        for (i, &x) in src.iter().enumerate() {
            let d = if i < dl { i } else { LATENT_ROPE_AT + i - dl };
            let hi = half::bf16::from_f32(x);
            dst[d] = hi.to_bits();
            dst[LATENT_DIMS + d] = half::bf16::from_f32(x - hi.to_f32()).to_bits();
        }
    }
    Ok(out)
}

/// Absorbed MLA attention over the latent cache, the decode path (see kernels/mla_decode.cu):
/// T query tokens at positions pos0 .. pos0 + T.
pub struct MlaDecode {
    /// [T, heads * dl] rows ql_tok apart: q_nope absorbed by W_UK.
    pub q_lat: Ptr,
    pub ql_tok: usize,
    /// [T, heads, dr] rows qp_tok apart, heads qp_head apart (dr, or dn + dr where q_pe is
    /// read in place from the whole query [q_nope | q_pe]).
    pub q_pe: Ptr,
    pub qp_tok: usize,
    pub qp_head: usize,
    /// (inv_freq [dr / 2], cos/sin scale) of the rope that q_pe still needs (the kernel turns
    /// it at each token's position as it loads it), or (0, _) when q_pe is roped already.
    pub qp_rope: (Ptr, f32),
    /// [S] rows in the latent cache format (`latent_split`).
    pub cache: Ptr,
    pub dl: usize,
    pub dr: usize,
    pub heads: usize,
    pub tokens: usize,
    pub pos0: usize,
    /// [T, n_ids] i32 key positions per token (DSA top-k, -1 skipped), or 0 for all causal keys.
    pub key_ids: Ptr,
    pub n_ids: usize,
    pub scale: f32,
    /// [T, heads * dl] rows out_tok apart.
    pub out: Ptr,
    pub out_tok: usize,
}

use super::kernels::{
    mla_decode_smem_bytes, MLA_COMBINE_THREADS, MLA_HB, MLA_MAX_SPLITS, MLA_THREADS,
};

/// The MLA decode pair takes programmatic dependent launch up to this many split blocks (a
/// short context: 2-8 blocks at DeepSeek-V3 / GLM-5 widths), where blocks waiting early on the
/// SMs take nothing from anyone.
const MLA_PDL_MAX_BLOCKS: u32 = 32;

/// Keys a split (at one block an SM) from which few heads take mla_decode_split16x2 (DS3's
/// 16 heads at 32K have 256, at 8K 64).
const MLA_X2_KEYS: usize = 256;

/// The most floats of split partials `mla_decode` keeps between calls (64 MiB; one decode
/// token needs about multiprocessors * 32 * dl, 8.6 MB on an H200); a larger call (many
/// tokens) allocates its own for the call.
const MLA_WORK_KEEP: usize = 16 << 20;

impl Gpu {
    /// The split kernel for up to `n_keys` keys and `heads` heads, and its heads per block:
    /// mla_decode_split16 (16 heads on all 8 warps, each with half the dims of the other
    /// form) for few heads (a tensor-parallel rank) and for splits of at most 32 keys, where a
    /// block's one or two key tiles are latency, else mla_decode_split (32 heads). Lab, H200: 16
    /// heads at 8K 23.2 -> 21.0 us; GLM-5's 64 heads over 2048 DSA keys 22.2 -> 20.1 us, 1K
    /// 20.4 -> 16.5 us; longer splits of many heads lose (GLM-5 8K 34.7 -> 41.6 us).
    ///
    /// Few heads with long splits (at least MLA_X2_KEYS keys a split at one block an SM) take
    /// mla_decode_split16x2, the same form held to 128 registers, two blocks an SM on the H200:
    /// one tensor-parallel rank's 16 heads (DS3) at 32K 42.4 -> 38.8 us, GLM-5's 8 at 32K
    /// 40.1 -> 35.9, where at 8K it lost (20.8 -> 21.9, 19.0 -> 19.8; bench, the same calls;
    /// key tiles of 16). On key tiles of 32 (sm_90) its 166 KB hold it to one block an SM,
    /// where it took the rank rows at 32K no slower than two of 16 keys (H100: DS3 44.0 ->
    /// 43.0 us, GLM-5 40.7 -> 40.9).
    pub fn mla_decode_form(&self, n_keys: usize, heads: usize) -> (&'static str, usize) {
        let (_, per) = self.splits_of(n_keys, heads, MLA_HB, 1);
        if heads <= 16 && self.splits_of(n_keys, heads, 16, 1).1 >= MLA_X2_KEYS {
            ("mla_decode_split16x2", 16)
        } else if heads <= 16 || per <= 32 {
            ("mla_decode_split16", 16)
        } else {
            ("mla_decode_split", MLA_HB)
        }
    }

    /// The number of sequence splits and keys per split for up to `n_keys` keys and `heads`
    /// heads (`mla_decode_form`).
    pub fn mla_decode_splits(&self, n_keys: usize, heads: usize) -> (usize, usize) {
        let (kernel, per_block) = self.mla_decode_form(n_keys, heads);
        let per_sm = if kernel == "mla_decode_split16x2" {
            self.blocks_per_sm(kernel, MLA_THREADS, mla_decode_smem_bytes(self.mla_bk))
                .unwrap_or(1)
                .max(1)
        } else {
            1
        };
        self.splits_of(n_keys, heads, per_block, per_sm)
    }

    /// Splits for heads in groups of `per_block`: `per_sm` blocks of the split kernel per
    /// multiprocessor (the forms but split16x2 hold up to 217 registers a thread, so one block
    /// fits an SM), keys per split a multiple of the key tile (`mla_bk`), at most
    /// MLA_MAX_SPLITS splits (what mla_decode_combine merges).
    fn splits_of(
        &self,
        n_keys: usize,
        heads: usize,
        per_block: usize,
        per_sm: usize,
    ) -> (usize, usize) {
        let groups = heads.div_ceil(per_block);
        let want = (self.multiprocessors * per_sm)
            .div_ceil(groups)
            .clamp(1, MLA_MAX_SPLITS);
        let bk = self.mla_bk;
        let splits = want.min(n_keys.div_ceil(bk)).max(1);
        let per = (n_keys.div_ceil(splits).div_ceil(bk) * bk).max(bk);
        (n_keys.div_ceil(per).max(1), per)
    }

    /// The keys the longest query row of `a` walks (DSA ids or causal positions).
    fn mla_decode_keys(a: &MlaDecode) -> usize {
        if a.key_ids != 0 {
            a.n_ids
        } else {
            a.pos0 + a.tokens
        }
    }

    pub fn mla_decode(&self, a: &MlaDecode) -> Result<(), CudaError> {
        let (_, per) = self.mla_decode_splits(Self::mla_decode_keys(a), a.heads);
        self.mla_decode_with(a, per)
    }

    /// `mla_decode` with `per` keys per split (any per >= 1 that makes at most MLA_MAX_SPLITS
    /// splits; the engine's choice is `mla_decode_splits`), so tests can pick the split count.
    pub fn mla_decode_with(&self, a: &MlaDecode, per: usize) -> Result<(), CudaError> {
        check(
            a.dl.is_multiple_of(32) && a.dl <= MLA_DL_MAX && a.dr <= MLA_DR_MAX,
            "mla_decode_split",
            || {
                format!(
                    "latent {} (multiple of 32, <= {MLA_DL_MAX}) and rope {} (<= {MLA_DR_MAX})",
                    a.dl, a.dr
                )
            },
        )?;
        // mla_decode_combine writes float4 rows.
        check(
            a.out.is_multiple_of(16) && a.out_tok.is_multiple_of(4),
            "mla_decode_combine",
            || {
                format!(
                    "out {:#x}, rows {} floats apart: not float4 rows",
                    a.out, a.out_tok
                )
            },
        )?;
        let splits = Self::mla_decode_keys(a).div_ceil(per.max(1)).max(1);
        check(
            per > 0 && splits <= MLA_MAX_SPLITS,
            "mla_decode_split",
            || format!("{per} keys per split make {splits} splits (at most {MLA_MAX_SPLITS})"),
        )?;
        if a.tokens == 0 {
            return Ok(());
        }
        // Partial results, one buffer: acc [T, splits, heads, dl], then (m, l) [T, splits,
        // heads, 2] (16-byte aligned: dl % 32 == 0). Every element is written by
        // mla_decode_split (empty splits write m = -inf, l = 0). The kept workspace is reused
        // without a host wait: every launch goes to the one stream, in order, and the lock is
        // held until both kernels are queued; growing frees the old buffer stream-ordered.
        let n_acc = a.tokens * splits * a.heads * a.dl;
        let n = n_acc + a.tokens * splits * a.heads * 2;
        let mut work = self.mla_work.lock().unwrap();
        let temp;
        let buf = if n <= MLA_WORK_KEEP {
            if work.as_ref().is_none_or(|w| w.len() < n) {
                *work = None;
                *work = Some(self.empty(n)?);
            } else if cfg!(debug_assertions) {
                // As `empty` does for a new buffer: NaN where a kernel fails to write.
                let p = self.ptr(work.as_ref().unwrap(), 0);
                // SAFETY: p addresses the n * 4 bytes of the workspace (len >= n); earlier
                // users of it are ordered before this on the stream.
                unsafe {
                    cudarc::driver::result::memset_d8_async(p, 0xff, n * 4, self.stream.cu_stream())
                }?;
            }
            work.as_ref().unwrap()
        } else {
            temp = self.empty(n)?;
            &temp
        };
        let (pa, pm) = (self.ptr(buf, 0), self.ptr(buf, n_acc));
        let (kernel, per_block) = self.mla_decode_form(Self::mla_decode_keys(a), a.heads);
        let grid = (grid1(a.heads, per_block), splits as u32, a.tokens as u32);
        // Programmatic launch only for a short context's few blocks (kernels.rs,
        // dependent_launch_helps: the pair measured slower with it on a full GPU).
        let pdl = self.dependent_launch && grid.0 * grid.1 * grid.2 <= MLA_PDL_MAX_BLOCKS;
        launch!(@dependent pdl, self, kernel, grid, MLA_THREADS,
            mla_decode_smem_bytes(self.mla_bk) as u32;
            a.q_lat, a.ql_tok as i64, a.q_pe, a.qp_tok as i64, a.qp_head as i32, a.qp_rope.0,
            a.qp_rope.1, a.cache, a.dl as i32, a.dr as i32, a.heads as i32, a.key_ids,
            a.n_ids as i32, a.pos0 as i32, per as i32, a.scale, pa, pm, a.out, a.out_tok as i64);
        if splits == 1 {
            return Ok(()); // the split kernel wrote the output
        }
        let (chunks, threads) = mla_combine_shape(self.multiprocessors, a, splits);
        launch!(@dependent pdl, self, "mla_decode_combine",
            (a.heads as u32, a.tokens as u32, chunks), threads, 0;
            pa, pm, splits as i32, a.heads as i32, a.dl as i32, a.out, a.out_tok as i64);
        Ok(())
    }

    /// The tensor-core scores kernel dsa_scores takes for `heads` of `dim`, and its heads
    /// padded (16, 32 or 64); None where it takes the f32 kernels (dsa_mma off, dim not a
    /// multiple of 16, more than 64 heads).
    pub fn dsa_scores_mma(&self, heads: usize, dim: usize) -> Option<(&'static str, usize)> {
        dsa_scores_mma_kernel(heads).filter(|_| self.dsa_mma && dim.is_multiple_of(16))
    }

    /// DSA indexer scores [T, s_stride] for keys 0 .. S (see kernels/dsa.cu).
    #[allow(clippy::too_many_arguments)]
    pub fn dsa_scores(
        &self,
        q: Ptr,
        k: Ptr,
        w: Ptr,
        heads: usize,
        dim: usize,
        tokens: usize,
        keys: usize,
        pos0: usize,
        scale: f32,
        scores: Ptr,
        s_stride: usize,
    ) -> Result<(), CudaError> {
        check(
            heads * dim <= DSA_Q_MAX && heads <= 64 && dim.is_multiple_of(4) && dim <= DSA_DIM_MAX,
            "dsa_scores",
            || format!("{heads} heads x {dim}: dim % 4 == 0, dim <= {DSA_DIM_MAX}, <= 64 heads"),
        )?;
        check(
            q.is_multiple_of(16) && k.is_multiple_of(16),
            "dsa_scores",
            || "q and k must be 16-byte aligned".into(),
        )?;
        if keys == 0 || tokens == 0 {
            return Ok(());
        }
        // On the tensor cores where the keys are whole k steps (tiles of 64 keys); else two
        // keys a lane where the tiles fit (tiles of 32 keys a lane) (kernels/dsa.cu).
        let (kernel, smem, tile) = match self.dsa_scores_mma(heads, dim) {
            Some((kernel, padded)) => {
                (kernel, dsa_scores_mma_smem_bytes(padded, dim), DSA_MMA_KEYS)
            }
            None if dsa_scores_smem_bytes(heads, dim, 2) <= DSA_SCORES2_SMEM => {
                ("dsa_scores2", dsa_scores_smem_bytes(heads, dim, 2), 64)
            }
            None => ("dsa_scores", dsa_scores_smem_bytes(heads, dim, 1), 32),
        };
        // Tiles a block: as many as spread all tiles over one wave of blocks, so that a long
        // row loads its query once per block rather than once per tile.
        let slots = self.wave_blocks(kernel, 128, smem)?;
        let tiles = (keys.div_ceil(tile) * tokens).div_ceil(slots).max(1);
        launch!(self, kernel, (grid1(keys, tile * tiles), tokens as u32, 1), 128,
            smem as u32;
            q, k, w, heads as i32, dim as i32, keys as i32, pos0 as i32, scale, scores,
            s_stride as i64, tiles as i32);
        Ok(())
    }

    /// bits [rows, words] (zeroed) |= the positions ids [rows, k] in 0 .. n_keys, as bits.
    pub fn keep_mask(
        &self,
        ids: Ptr,
        (rows, k): (usize, usize),
        n_keys: usize,
        words: usize,
        bits: Ptr,
    ) -> Result<(), CudaError> {
        check(n_keys <= 32 * words, "keep_mask", || {
            format!("{n_keys} keys need more than {words} words")
        })?;
        launch!(self, "keep_mask", (grid1(rows * k, 256), 1, 1), 256, 0;
            ids, rows as i32, k as i32, n_keys as i32, words as i32, bits);
        Ok(())
    }

    /// Per row t: the k best of scores[t, 0 ..= pos0 + t], ascending positions, -1 padded.
    /// A few long rows take a cluster of blocks each (topk_rows_cluster4 / 8), the others a block.
    pub fn topk_rows(
        &self,
        scores: Ptr,
        s_stride: usize,
        tokens: usize,
        pos0: usize,
        k: usize,
        out: Ptr,
    ) -> Result<(), CudaError> {
        let n = pos0 + tokens; // the longest row

        // A cluster a row (decode): 4 blocks while their stretches fit their caches, else 8.
        let (cluster, blocks) = if n <= 4 * TOPK_CLUSTER_CACHE_KEYS {
            ("topk_rows_cluster4", 4)
        } else {
            ("topk_rows_cluster8", 8)
        };
        if self.topk_cluster_keys.is_some_and(|min| n >= min)
            && tokens * blocks <= self.multiprocessors
        {
            // The longest stretch's keys, as far as they fit.
            let cache_keys = n
                .div_ceil(blocks)
                .next_multiple_of(32)
                .min(TOPK_CLUSTER_CACHE_KEYS);
            launch!(self, cluster, (blocks as u32, tokens as u32, 1),
                TOPK_THREADS, 4 * cache_keys as u32;
                scores, s_stride as i64, pos0 as i32, k as i32, cache_keys as i32, out);
            return Ok(());
        }
        // The longest row's keys, as far as they fit.
        let cache_keys = n.min(TOPK_CACHE_KEYS);
        launch!(self, "topk_rows", (tokens as u32, 1, 1), TOPK_THREADS, 4 * cache_keys as u32;
            scores, s_stride as i64, pos0 as i32, k as i32, cache_keys as i32, out);
        Ok(())
    }
}

/// ROUTER_THREADS of kernels/moe.cu: one block per token.
const ROUTER_THREADS: u32 = 256;

/// Adjacent-pair rotary embedding of a `dims`-wide part of each row, row r at position pos0 + r:
/// inv_freq [dims / 2] on the device, cos and sin scaled by `mscale` (kernels/rope.cu).
#[derive(Clone, Copy)]
pub struct PairRope {
    pub dims: usize,
    pub pos0: usize,
    pub inv_freq: Ptr,
    pub mscale: f32,
}

/// Rows of `width` values at x RMS-normed with w into y (contiguous rows).
pub struct RowsNorm {
    pub x: Ptr,
    pub w: Ptr,
    pub y: Ptr,
    pub width: usize,
}

/// `rows` rows of `width` values at x layer-normed with w and b (eps) into y (contiguous
/// rows), the first values of each then roped: the DSA indexer's keys into their cache.
pub struct KeyRowsNorm {
    pub x: Ptr,
    pub w: Ptr,
    pub b: Ptr,
    pub y: Ptr,
    pub rows: usize,
    pub width: usize,
    pub eps: f32,
}

/// Whether `Gpu::moe_route_f32` takes router rows of `dim` floats at `w` and x rows at `x`
/// (float4 rows).
pub fn route_f32_takes(dim: usize, x: Ptr, w: Ptr) -> bool {
    dim.is_multiple_of(4) && (x | w).is_multiple_of(16)
}

/// The MoE router's choice for T tokens (see kernels/moe.cu).
pub struct MoeRouter {
    /// [T, n_exp] f32: what `moe_router` reads, what `moe_route_f32` writes.
    pub logits: Ptr,
    /// [n_exp] f32 selection bias, or 0.
    pub bias: Ptr,
    pub n_exp: usize,
    pub k: usize,
    /// 1 softmax, 2 sigmoid (GGUF expert_gating_func).
    pub gating: u32,
    pub n_group: usize,
    pub group_used: usize,
    pub norm: bool,
    pub scale: f32,
    pub tokens: usize,
    /// The experts this rank holds (ids count from its start; others get id -1, weight 0).
    pub held: std::ops::Range<usize>,
    /// Rows of k + 1 choices, the last the shared expert (id MOE_SHARED, weight 1).
    pub shared: bool,
    /// [T, k] i32 and f32 outputs.
    pub ids: Ptr,
    pub weights: Ptr,
}

impl Gpu {
    pub fn moe_router(&self, a: &MoeRouter) -> Result<(), CudaError> {
        Self::check_router(a)?;
        launch!(self, "moe_router", (a.tokens as u32, 1, 1), ROUTER_THREADS, 0;
            a.logits, a.bias, a.n_exp as i32, a.k as i32, a.gating as i32, a.n_group as i32,
            a.group_used as i32, a.norm as i32, a.scale, a.held.start as i32, a.held.end as i32,
            a.shared as i32, a.ids, a.weights);
        Ok(())
    }

    /// The router product and `moe_router` in one launch: `a.logits` = x W^T for x [T, dim]
    /// and an f32 router W [n_exp, dim] (dim % 4 == 0, both 16-byte aligned), then the
    /// choice. For decode, where the two launches were ~6 us each on an H200 (ncu): the
    /// product on 64 blocks left half of the SMs idle, the choice was one block's latency.
    pub fn moe_route_f32(
        &self,
        a: &MoeRouter,
        (x, w, dim): (Ptr, Ptr, usize),
    ) -> Result<(), CudaError> {
        Self::check_router(a)?;
        check(route_f32_takes(dim, x, w), "moe_route_f32", || {
            format!("rows of {dim} floats at {x:#x}, {w:#x}: not float4 rows")
        })?;
        if a.tokens == 0 {
            return Ok(());
        }
        let done = self.zeroed_counters(&self.route_done, a.tokens)?;
        launch!(self, "moe_route_f32", (a.n_exp as u32, a.tokens as u32, 1), ROUTER_THREADS, 0;
            x, w, dim as i32, a.logits, done, a.bias, a.n_exp as i32, a.k as i32,
            a.gating as i32, a.n_group as i32, a.group_used as i32, a.norm as i32, a.scale,
            a.held.start as i32, a.held.end as i32, a.shared as i32, a.ids, a.weights);
        Ok(())
    }

    fn check_router(a: &MoeRouter) -> Result<(), CudaError> {
        check(
            a.n_exp <= 1024
                && a.k <= 32
                && a.k <= a.n_exp
                && a.n_group <= 32
                && (a.n_group <= 1 || a.n_exp.is_multiple_of(a.n_group)),
            "moe_router",
            || format!("{} experts, top {}, {} groups", a.n_exp, a.k, a.n_group),
        )?;
        check(a.gating == 1 || a.gating == 2, "moe_router", || {
            format!("gating function {}", a.gating)
        })
    }

    /// out[t, :] = sum_j weights[t, j] * rows[slots[t, j], :] ([T, k] slots and weights; slots
    /// 0: row t k + j).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        rows: Ptr,
        slots: Ptr,
        weights: Ptr,
        tokens: usize,
        k: usize,
        dim: usize,
        out: Ptr,
    ) -> Result<(), CudaError> {
        if tokens == 0 || dim == 0 {
            return Ok(());
        }
        launch!(self, "moe_combine", (grid1(dim, 256), tokens as u32, 1), 256, 0;
            rows, slots, weights, k as i32, dim as i32, out);
        Ok(())
    }

    /// out[0] = the index of the largest of x[0..n) (the lowest on ties).
    pub fn argmax_row(&self, x: Ptr, n: usize, out: Ptr) -> Result<(), CudaError> {
        const SPAN: usize = 256 * 16; // ARGMAX_SPAN, kernels/sampling.cu
        let blocks = n.div_ceil(SPAN);
        let work = self.zeroed_counters(&self.argmax_work, 1 + 2 * blocks)?;
        launch!(self, "argmax_row", (blocks as u32, 1, 1), 256, 0; x, n as i32, work, out);
        Ok(())
    }

    /// Nucleus sampling of one row of n logits with the host's uniform draw u;
    /// probs: [n] f32 scratch; out: one i32.
    #[allow(clippy::too_many_arguments)]
    pub fn top_p_sample(
        &self,
        x: Ptr,
        n: usize,
        temperature: f32,
        top_p: f32,
        u: f32,
        probs: Ptr,
        out: Ptr,
    ) -> Result<(), CudaError> {
        check(temperature > 0.0, "top_p_sample", || {
            "temperature 0 is argmax".into()
        })?;
        launch!(self, "top_p_sample", (1, 1, 1), 1024, 0;
            x, n as i32, temperature, top_p, u, probs, out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{cp_plan, cp_splits, spread_part_k, tc8_tiles_per_block, tma_tile, CpPlan};
    use crate::gguf::ggml_type::GgmlType;

    #[test]
    fn spread_part_k_takes_the_fewest_steps_of_the_busiest_block() {
        // An H200 or H100: 132 SMs x 2 blocks of matvec_tma_q4_k; tiles of 16 rows.
        let tile = tma_tile(GgmlType::Q4_K).unwrap();
        let kp = |k, rows: usize| spread_part_k(tile, k, rows / 16, 264);
        let cases = [
            (
                16384,
                6144,
                Some(8192),
                "GLM-5 attn_output: 16 steps + 2 parts -> 12 + 1",
            ),
            (16384, 7168, Some(4096), "DS3 attn_output: 16 + 2 -> 14 + 1"),
            (12288, 6144, Some(6144), "GLM-5 dense down: 12 + 2 -> 9 + 1"),
            (18432, 7168, Some(6144), "DS3 dense down: 20 + 2 -> 18 + 1"),
            (
                16384,
                2112,
                Some(8192),
                "half a wave of tiles: 8 + 2 -> 4 + 1",
            ),
            (16384, 4224, Some(8192), "a full wave: 8 + 2 -> 8 + 1"),
        ];
        for (k, rows, want, what) in cases {
            assert_eq!(kp(k, rows), want, "{what}");
        }
        assert_eq!(kp(7168, 18432), None, "rows whole in one part stay whole");
    }

    #[test]
    fn tc8_tiles_per_block_fills_the_last_wave() {
        // An H200: 132 SMs x 2 blocks of matvec_tc8_q4_k.
        let slots = 264;
        assert_eq!(
            tc8_tiles_per_block(128, 8, slots),
            4,
            "one set of 8 experts"
        );
        assert_eq!(
            tc8_tiles_per_block(128, 16, slots),
            8,
            "gate and up of 8 experts"
        );
        assert_eq!(
            tc8_tiles_per_block(128, 18, slots),
            4,
            "gate and up of 9 choices"
        );
    }

    #[test]
    fn cp_splits_fill_whole_rounds() {
        // An H200: 132 SMs x 2 blocks of matmul_cp_q4_k. 512 prompt tokens are 4 tile rows.
        let h200 = |tiles, steps| cp_splits(tiles, steps, 132, 2);
        assert_eq!(h200(20, 112), 13, "kv_a 576 x 7168: 260 blocks, one round");
        assert_eq!(h200(48, 112), 5, "q_a 1536 x 7168: 240 blocks");
        assert_eq!(h200(80, 112), 3, "kv_a at 2048 tokens: 240 blocks");
        assert_eq!(h200(64, 96), 4, "GLM-5 q_a: 256 blocks");
        assert_eq!(
            h200(224, 256),
            1,
            "attn_output 7168 x 16384: two full rounds of halves"
        );
        assert_eq!(
            h200(192, 192),
            2,
            "attn_output 6144 x 16384: a full and a lone round of halves"
        );
        assert_eq!(h200(576, 112), 1, "ffn_up fills the GPU");
        assert_eq!(h200(20, 8), 2, "k of 512: splits of 4 steps or more");
    }

    #[test]
    fn cp_plan_splits_a_last_round_of_lone_blocks() {
        // H200 (132 SMs x 2 blocks); tiles_m x tiles_n tiles of 128 x 128, k steps of 64.
        let h200 = |tiles_m, tiles_n, steps| cp_plan(tiles_m, tiles_n, steps, 132, 2);
        let plan = |head, splits| CpPlan { head, splits };
        assert_eq!(
            h200(4, 144, 112),
            plan(132, 5),
            "DS3 ffn_up at 512 tokens: 2 rounds of 528 tiles, then 48 in 5 splits"
        );
        assert_eq!(
            h200(4, 96, 96),
            plan(66, 2),
            "GLM-5 ffn_up at 512 tokens: a round, then 120 tiles in 2 splits"
        );
        assert_eq!(
            h200(16, 144, 112),
            plan(0, 1),
            "2048 tokens: 27 -> 26.5 thirds"
        );
        assert_eq!(
            h200(16, 56, 256),
            plan(49, 2),
            "DS3 attn_output at 2048 tokens: 3 rounds, then 112 tiles in 2 splits (11 -> 10.5)"
        );
        assert_eq!(
            h200(4, 192, 24),
            plan(0, 1),
            "DS3 q_b: the rest would not split"
        );
        assert_eq!(
            h200(4, 12, 112),
            plan(0, 5),
            "q_a: one wave, split as before"
        );
        assert_eq!(h200(4, 132, 112), plan(0, 1), "two full rounds");
    }
}
