//! The tensor-core kernels (kernels/matvec.cu's integer products, kernels/matmul.cu's bf16
//! prefill products, kernels/attention.cu's prefill attention, kernels/mla_decode.cu,
//! kernels/dsa.cu's indexer scores and top-k) checked
//! on the CPU: the kernels' own source, cut out and compiled for the host, run on emulated
//! warps and thread blocks (tests/warp_emulation/block.h: every thread a host thread,
//! mma.sync by the PTX ISA's fragment layouts, mbarriers and bulk copies as the ISA defines
//! them, the copies landing some random time after they are issued), against the engine's
//! dequantization (bit for bit gguf-py's, tests/quant.rs) and an f64 dot product.
//!
//! - The fragment math (`TcQ4k`, `TcQ5k`, `TcIq4xs`, `TcQ80`, and `TcQ6k` with `q6_dot`) on one
//!   warp over random 16-row tiles: a wrong lane, column, offset or scale gives an nmse near 1, the
//!   kernels' exact integer sums ~1e-14.
//! - The prefill products (kernels/matmul.cu's `matmul_cp_<type>` and `matmul_cp_spans_<type>`
//!   for Q4_K and Q8_0, after `matmul_xprep`, with `matmul_splitk_sum`) as ops.rs launches
//!   them: plain, split over k, rows gathered, grouped spans; against the f64 product of the
//!   operands as the kernels round them to bf16 (a wrong fragment, scale or k order gives an
//!   nmse near 1, the f32 sums ~1e-14) and of the exact dequantization (the GPU tests' bound).
//!   Their cp.async copies land when issued in one run and only at the wait for their group in
//!   the other: a stage read before its wait gives different bits.
//! - The prefill attention on the tensor cores (kernels/attention.cu's `attention_bf16` and
//!   `attention_mma_<DQK>_<DV>`, every form, causal and DSA-masked) against the f64 attention
//!   of the f32 inputs (the bf16 products' bound).
//! - The bulk-copy kernels whole (`matvec_tma_<type>` and `matvec_tma_items_<type>` for Q4_K,
//!   Q5_K, IQ4_XS, Q6_K and Q8_0, `matvec_tma_q6_k`), with the launch's shared memory from
//!   ops.rs: their producer and consumer warps, stage barriers, parts of k, shared expert first, items
//!   another rank holds, partial tiles and stages across tiles. A stage read before its copy landed or refilled
//!   while read gives wrong sums; a wait that never ends fails the run instead of hanging it;
//!   a shared-memory copy out of bounds or misaligned is refused, and the harness runs under
//!   AddressSanitizer and the alignment sanitizer where the compiler has them (reads past a
//!   buffer; a load of a word from an address the GPU would fault on, which x86 reads).
//!
//! - The DSA indexer's scores on the tensor cores (kernels/dsa.cu's `dsa_scores_mma16/32/64`,
//!   split bf16) against the f64 scores of the f32 inputs: padded heads, several k rounds,
//!   partial tiles, prefill rows whose later keys are -inf; and its top-k (`topk_rows`, a block
//!   of 1024 emulated threads a row) against the twin's selection, exactly: a row kept whole in
//!   shared memory and in part, ties at the boundary, rows of fewer keys than k. The same for
//!   its decode rows on clusters of 4 and 8 blocks (`topk_rows_cluster4` / `8`): each block a
//!   process of its own, distributed shared memory read from copies its blocks make of their
//!   statics at each cluster barrier (block.h, run_cluster).
//!
//! - The parts launches of MLA's q_a, kv_a and indexer key with the latent's norms in their
//!   last blocks (`matvec_latent_<type>`: matvec_body, then parts_tail; and
//!   `matvec_tma_parts_<type>`: matvec_tma_body, then tma_parts_tail), against the f64 norms
//!   of their rows.
//!
//! The bound is the GPU tests' for these kernels (cuda_kernels, F32_OP), so that a change of
//! a kernel can be checked before a GPU runs it. Needs a C++20 compiler (`$CXX`, else g++);
//! without one the tests print SKIPPED.

mod common;

use common::{
    attention_want, keep_mask, latent_twin, layernorm_rope_twin, rmsnorm_twin, roped_q_pe,
    span_table, topk_twin, AttentionShape,
};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use mla_engine::backend::cuda::kernels::{
    attention_mma_smem_bytes, dsa_scores_mma_kernel, dsa_scores_mma_smem_bytes,
    matmul_cp_smem_bytes, mla_decode_smem_bytes, ATT_MMA_FORMS, MLA_HB, MLA_THREADS,
};
use mla_engine::backend::cuda::ops::{
    latent_split, mla_combine_shape, tma6_smem_bytes, tma_part_k, tma_smem_bytes, tma_tile,
    tmi_smem_bytes, MlaDecode, CP_SPANS64_ROWS, MOE_SHARED, TMA_TILE_TYPES,
};
use mla_engine::gguf::ggml_type::GgmlType;
use mla_engine::quant;
use mla_engine::sampling::Rng;

/// A piece of kernels/*: a definition from its first line to its closing brace, a line (a
/// `#define`, with its continuation lines), or a kernel (`extern "C"` ... by its name).
enum Piece {
    Def(&'static str, &'static str),
    Line(&'static str, &'static str),
    Kernel(&'static str, &'static str),
}
use Piece::{Def, Kernel, Line};

/// What every harness is built from, in the order the sources define it. The functions that
/// are PTX (mma.sync, ldmatrix, cp.async, mbarriers, named barriers) are block.h's own.
const PIECES: &[Piece] = &[
    Line("common.cuh", "#define NEG_INF"),
    Line("common.cuh", "#define MOE_SHARED"),
    Def("common.cuh", "__device__ __forceinline__ bool count_in("),
    Def("common.cuh", "__device__ __forceinline__ float silu("),
    Def(
        "common.cuh",
        "__device__ __forceinline__ float bf16_to_f32(",
    ),
    Line("common.cuh", "#define LATENT_DIMS"),
    Line("common.cuh", "#define LATENT_ROPE_AT"),
    Line("common.cuh", "#define LATENT_ROW_BYTES"),
    Def(
        "common.cuh",
        "template <int N>\n__device__ __forceinline__ void ld_words(",
    ),
    Def("common.cuh", "__device__ __forceinline__ float warp_sum("),
    Def(
        "common.cuh",
        "__device__ __forceinline__ float half_warp_sum(",
    ),
    Def("common.cuh", "__device__ float block_sum("),
    Def(
        "common.cuh",
        "__device__ __forceinline__ float2 rope_cos_sin(",
    ),
    Def("common.cuh", "__device__ __forceinline__ void rope_turn("),
    Def("common.cuh", "__device__ __forceinline__ void rope_pair("),
    Def("common.cuh", "__device__ __forceinline__ void latent_store("),
    Def("common.cuh", "__device__ float block_max("),
    Def(
        "common.cuh",
        "__device__ __forceinline__ void argmax_pair(",
    ),
    Def(
        "common.cuh",
        "__device__ __forceinline__ void warp_argmax(",
    ),
    Def("common.cuh", "__device__ void grid_argmax("),
    Line("common.cuh", "#define NORM_VALS "),
    Def("common.cuh", "struct BlockTeam {"),
    Def("common.cuh", "struct WarpTeam {"),
    Def(
        "common.cuh",
        "template <int V = NORM_VALS, bool L2 = false, class Team = BlockTeam>\n__device__ __forceinline__ void load_row(",
    ),
    Def(
        "common.cuh",
        "template <int V = NORM_VALS, class Team = BlockTeam>\n__device__ __forceinline__ float rms_inv(",
    ),
    Def(
        "common.cuh",
        "template <int V = NORM_VALS, class Team = BlockTeam>\n__device__ __forceinline__ void rms_store(",
    ),
    Def(
        "common.cuh",
        "template <int V = NORM_VALS, bool L2 = false, class Team = BlockTeam>\n__device__ __forceinline__ void layernorm_rope_row(",
    ),
    Def("common.cuh", "struct LatentNorm {"),
    Def(
        "common.cuh",
        "template <int V, bool L2, class Team = BlockTeam>\n__device__ __forceinline__ void latent_row(",
    ),
    Def(
        "common.cuh",
        "template <int V, bool L2, class Team = BlockTeam>\n__device__ __forceinline__ void query_row(",
    ),
    Def(
        "common.cuh",
        "template <int V, bool L2, class Team = BlockTeam>\n__device__ __forceinline__ void key_row(",
    ),
    Line("matvec.cu", "#define MATVEC_WARPS "),
    Line("matvec.cu", "#define MATVEC_WIDE_WARPS "),
    Line("matvec.cu", "#define MATVEC_ROWS "),
    Def("matvec.cu", "struct MatvecParts {"),
    Def("matvec.cu", "struct QueryRows {"),
    Line("matvec.cu", "#define TAIL_QUERY_VALS "),
    Line("matvec.cu", "#define TAIL_LATENT_VALS "),
    Line("matvec.cu", "#define TAIL_KEY_VALS "),
    Def(
        "matvec.cu",
        "__device__ __forceinline__ void parts_tail_prefetch(",
    ),
    Def(
        "matvec.cu",
        "__device__ __forceinline__ void parts_tail(",
    ),
    Line("matvec.cu", "#define TMA_TAIL_QUERY_VALS "),
    Line("matvec.cu", "#define TMA_TAIL_LATENT_VALS "),
    Line("matvec.cu", "#define TMA_TAIL_KEY_VALS "),
    Def(
        "matvec.cu",
        "__device__ __forceinline__ void tma_parts_tail(",
    ),
    Def(
        "matvec.cu",
        "__device__ __forceinline__ float query_norm_factor(",
    ),
    Line("matvec.cu", "#define QUERY_TAIL_LATENT_VALS "),
    Line("matvec.cu", "#define QUERY_TAIL_KEY_VALS "),
    Def(
        "matvec.cu",
        "__device__ __forceinline__ void tma_query_tail(",
    ),
    Line("matvec.cu", "typedef void (*PieceFn)("),
    Def("matvec.cu", "__device__ __forceinline__ u16 ld_nc16("),
    Def("matvec.cu", "__device__ __forceinline__ float byte_f("),
    Def("matvec.cu", "__device__ __forceinline__ float dot4("),
    Def("matvec.cu", "__device__ __forceinline__ float sum4("),
    Def("matvec.cu", "__device__ __forceinline__ void piece_q2_k("),
    Def("matvec.cu", "__device__ __forceinline__ void piece_q3_k("),
    Def("matvec.cu", "__device__ __forceinline__ u32 bits_to_byte4("),
    Def("matvec.cu", "__device__ __forceinline__ void piece_q5_0("),
    Line("matvec.cu", "#define IQ4_B0 "),
    Line("matvec.cu", "#define IQ4_B1 "),
    Line("matvec.cu", "#define IQ4_B2 "),
    Line("matvec.cu", "#define IQ4_B3 "),
    Def(
        "matvec.cu",
        "template <int ELEMS, int BYTES, int PIECES, PieceFn PIECE, bool HALF>\n__device__ void matvec_body(",
    ),
    Def(
        "matvec.cu",
        "__device__ __forceinline__ int tc_plane_stride(",
    ),
    Def("matvec.cu", "__device__ __forceinline__ int tc_scales_len("),
    Def("matvec.cu", "__device__ __forceinline__ int tc_zeros_at("),
    Def("matvec.cu", "__device__ __forceinline__ int tc_x_bytes("),
    Def("matvec.cu", "struct XDigits {"),
    Def(
        "matvec.cu",
        "template <bool HALVES = false>\n__device__ __forceinline__ XDigits x_block_digits(",
    ),
    Def(
        "matvec.cu",
        "template <bool HALVES = false>\n__device__ void tc_prepare_x(",
    ),
    Def("matvec.cu", "__device__ __forceinline__ void q4k_packed("),
    Def("matvec.cu", "struct TcBCol {"),
    Def("matvec.cu", "struct TcBPair {"),
    Def("matvec.cu", "template <bool Q5>\nstruct TcKquant {"),
    Line("matvec.cu", "typedef TcKquant<false> TcQ4k;"),
    Line("matvec.cu", "typedef TcKquant<true> TcQ5k;"),
    Line("matvec.cu", "#define IQ4_S0 "),
    Line("matvec.cu", "#define IQ4_S1 "),
    Line("matvec.cu", "#define IQ4_S2_PLUS1 "),
    Line("matvec.cu", "#define IQ4_S3_PLUS1 "),
    Def("matvec.cu", "struct TcIq4xs {"),
    Def(
        "matvec.cu",
        "template <int MIS8>\n__device__ __forceinline__ uint2 lds8_at(",
    ),
    Def("matvec.cu", "struct TcQ80 {"),
    Def("matvec.cu", "__device__ __forceinline__ void quad_sums("),
    Def("matvec.cu", "struct TcItem {"),
    Def("matvec.cu", "__device__ __forceinline__ TcItem tc_item("),
    Def("matvec.cu", "struct DivBy {"),
    Def(
        "matvec.cu",
        "template <int N>\n__device__ __forceinline__ void lds_words_mis(",
    ),
    Def("matvec.cu", "struct TcQ6k {"),
    Def("matvec.cu", "__device__ __forceinline__ void q6_dot("),
    Def("matvec.cu", "struct TcQ6kTile {"),
    Line("matvec.cu", "#define TMA_BLOCKS "),
    Def("matvec.cu", "__device__ __forceinline__ u32 segment_bytes("),
    Def(
        "matvec.cu",
        "__device__ __forceinline__ void bulk_copy_from_any(",
    ),
    Def(
        "matvec.cu",
        "template <class Tile, bool SPREAD, bool PARTS = false, bool QUERY = false>\n__device__ __forceinline__ void matvec_tma_body(",
    ),
    Line("matvec.cu", "#define DEFINE_MATVEC_TMA("),
    Line("matvec.cu", "DEFINE_MATVEC_TMA(matvec_tma_q4_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA(matvec_tma_q5_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA(matvec_tma_iq4_xs,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA(matvec_tma_groups_q6_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA(matvec_tma_q8_0,"),
    Line("matvec.cu", "#define DEFINE_MATVEC_TMA_PARTS("),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_PARTS(matvec_tma_parts_q4_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_PARTS(matvec_tma_parts_q5_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_PARTS(matvec_tma_parts_iq4_xs,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_PARTS(matvec_tma_parts_q6_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_PARTS(matvec_tma_parts_q8_0,"),
    Line("matvec.cu", "#define DEFINE_MATVEC_TMA_QUERY("),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_QUERY(matvec_tma_query_q4_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_QUERY(matvec_tma_query_q5_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_QUERY(matvec_tma_query_iq4_xs,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_QUERY(matvec_tma_query_q6_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_QUERY(matvec_tma_query_q8_0,"),
    Def(
        "matvec.cu",
        "template <class Tile, int TMI_WARPS>\n__device__ __forceinline__ void matvec_tma_items_body(",
    ),
    Line("matvec.cu", "#define DEFINE_MATVEC_TMA_ITEMS("),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_ITEMS(matvec_tma_items_q4_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_ITEMS(matvec_tma_items_q5_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_ITEMS(matvec_tma_items_iq4_xs,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_ITEMS(matvec_tma_items_q6_k,"),
    Line("matvec.cu", "DEFINE_MATVEC_TMA_ITEMS(matvec_tma_items_q8_0,"),
    Line("matvec.cu", "#define TMA6_STAGES "),
    Line("matvec.cu", "#define TMA6_ROW "),
    Line("matvec.cu", "#define TMA6_STAGE "),
    Kernel("matvec.cu", "matvec_tma_q6_k"),
    Line("mla_decode.cu", "#define MLA_HB "),
    Line("mla_decode.cu", "#define MLA_NK "),
    Line("mla_decode.cu", "#define MLA_KP "),
    Line("mla_decode.cu", "#define MLA_THREADS "),
    Line("mla_decode.cu", "#define MLA_DL_MAX "),
    Line("mla_decode.cu", "#define MLA_DR_MAX "),
    Line("mla_decode.cu", "#define MLA_ROWB "),
    Line("mla_decode.cu", "#define MLA_TILEB "),
    Line("mla_decode.cu", "#define MLA_STAGEB "),
    Line("mla_decode.cu", "#define MLA_XS_FLOATS "),
    Line("mla_decode.cu", "#define MLA_MAX_SPLITS "),
    Line("mla_decode.cu", "#define MLA_COMBINE_THREADS "),
    Line("mla_decode.cu", "#define MLA_LOG2E "),
    Line("mla_decode.cu", "#define MLA_LN2 "),
    Def(
        "mla_decode.cu",
        "__device__ __forceinline__ void mla_split2(",
    ),
    Def("mla_decode.cu", "__device__ __forceinline__ int mla_key("),
    Def(
        "mla_decode.cu",
        "__device__ __forceinline__ void mla_copy_key(",
    ),
    Def("mla_decode.cu", "struct MlaQ {"),
    Def("mla_decode.cu", "__device__ __forceinline__ MlaQ mla_q_at("),
    Def("mla_decode.cu", "template <int W>\nstruct MlaWarp {"),
    Def(
        "mla_decode.cu",
        "__device__ __forceinline__ u32 mla_qk_off(",
    ),
    Def(
        "mla_decode.cu",
        "__device__ __forceinline__ u32 mla_pv_off(",
    ),
    Def("mla_decode.cu", "struct MlaSplit {"),
    Def(
        "mla_decode.cu",
        "__device__ __forceinline__ MlaSplit mla_split_of(",
    ),
    Def(
        "mla_decode.cu",
        "template <int W>\n__device__ __forceinline__ void mla_split_body(",
    ),
    Line("mla_decode.cu", "#define MLA_SPLIT("),
    Line("mla_decode.cu", "MLA_SPLIT(mla_decode_split,"),
    Line("mla_decode.cu", "MLA_SPLIT(mla_decode_split16,"),
    Kernel("mla_decode.cu", "mla_decode_combine"),
    Def(
        "matmul.cu",
        "template <typename X>\n__device__ __forceinline__ int enter_span(",
    ),
    Line("matmul.cu", "#define Q4K_T "),
    Line("matmul.cu", "#define Q80_T "),
    Def("matmul.cu", "__device__ __forceinline__ int perm32("),
    Kernel("matmul.cu", "matmul_xprep"),
    Kernel("matmul.cu", "matmul_splitk_sum"),
    Def(
        "matmul.cu",
        "template <int QT, int BM, int BN, int WM, int WN, int STAGES>\nstruct CpCfg {",
    ),
    Def("matmul.cu", "template <int N>\nstruct LiveTiles {"),
    Def(
        "matmul.cu",
        "template <int QT, bool GROUPED, int BM, int BN, int WM, int WN, int STAGES>\n__device__ __forceinline__ void matmul_cp_body(",
    ),
    Line("matmul.cu", "#define MATMUL_CP_KERNEL("),
    Line("matmul.cu", "MATMUL_CP_KERNEL(matmul_cp_q4_k,"),
    Line("matmul.cu", "MATMUL_CP_KERNEL(matmul_cp_q8_0,"),
    Line("matmul.cu", "MATMUL_CP_KERNEL(matmul_cp_spans_q4_k,"),
    Line("matmul.cu", "MATMUL_CP_KERNEL(matmul_cp_spans_q8_0,"),
    Line("matmul.cu", "MATMUL_CP_KERNEL(matmul_cp_spans64_q4_k,"),
    Line("attention.cu", "#define ATT_MMA_BQ "),
    Line("attention.cu", "#define ATT_MMA_THREADS "),
    Kernel("attention.cu", "attention_bf16"),
    Def("attention.cu", "struct AttMmaArgs {"),
    Def(
        "attention.cu",
        "template <int D, int BK>\n__device__ __forceinline__ void att_copy_rows(",
    ),
    Def(
        "attention.cu",
        "template <int DQK, int DV, int BK>\n__device__ __forceinline__ void attention_mma_body(",
    ),
    Line("attention.cu", "#define ATTENTION_MMA("),
    Line("attention.cu", "ATTENTION_MMA(64, 64, 64)"),
    Line("attention.cu", "ATTENTION_MMA(192, 128, 64)"),
    Line("attention.cu", "ATTENTION_MMA(256, 256, 32)"),
    Line("dsa.cu", "#define DSA_BATCH "),
    Def("dsa.cu", "__device__ __forceinline__ u32 order_key("),
    Def("dsa.cu", "__device__ __forceinline__ int warp_sum_first("),
    Def("dsa.cu", "__device__ __forceinline__ int warp_scan("),
    Def("dsa.cu", "__device__ __forceinline__ int block_scan("),
    Line("dsa.cu", "#define TOPK_THREADS "),
    Line("dsa.cu", "#define TOPK_BATCH "),
    Def("dsa.cu", "enum { KEYS_ROW"),
    Def(
        "dsa.cu",
        "template <int SRC>\n__device__ __forceinline__ u32 topk_key(",
    ),
    Def(
        "dsa.cu",
        "template <int THREADS, int SRC>\n__device__ __forceinline__ void topk_count_from(",
    ),
    Def(
        "dsa.cu",
        "template <int THREADS>\n__device__ __forceinline__ void topk_count(",
    ),
    Def(
        "dsa.cu",
        "template <int SRC>\n__device__ __forceinline__ void topk_keys_at(",
    ),
    Def(
        "dsa.cu",
        "template <int SRC, bool WRITE>\n__device__ __forceinline__ void topk_place_from(",
    ),
    Def(
        "dsa.cu",
        "template <bool WRITE>\n__device__ __forceinline__ void topk_place(",
    ),
    Def("dsa.cu", "struct TopkDigit {"),
    Def("dsa.cu", "__device__ __forceinline__ int topk_home_warp("),
    Def("dsa.cu", "__device__ __forceinline__ void topk_warp_digit("),
    Def("dsa.cu", "__device__ __forceinline__ bool topk_take_digit("),
    Def("dsa.cu", "__device__ __forceinline__ bool topk_select("),
    Kernel("dsa.cu", "topk_rows"),
    Line("dsa.cu", "#define TOPK_CLUSTER_DIMS(C) __cluster_dims__"),
    Def(
        "dsa.cu",
        "template <int C>\n__device__ __forceinline__ void topk_rows_cluster(",
    ),
    Kernel("dsa.cu", "topk_rows_cluster4"),
    Kernel("dsa.cu", "topk_rows_cluster8"),
    Line("dsa.cu", "#define DSA_MMA_KEYS "),
    Def(
        "dsa.cu",
        "template <int NT>\n__device__ __forceinline__ void dsa_scores_mma_body(",
    ),
    Line("dsa.cu", "#define DSA_SCORES("),
    Line("dsa.cu", "DSA_SCORES(dsa_scores_mma16,"),
    Line("dsa.cu", "DSA_SCORES(dsa_scores_mma32,"),
    Line("dsa.cu", "DSA_SCORES(dsa_scores_mma64,"),
];

/// The GPU tests' bounds (cuda_kernels): the integer products' F32_OP, MLA decode's, the
/// products of bf16 operands against f64 on the exact values.
const F32_OP: f64 = 1e-10;
const MLA_OP: f64 = 1e-9;
const BF16_MATMUL: f64 = 5e-4;

/// The definition that starts with `head`: up to its matching closing brace (and a `;`).
fn definition<'a>(src: &'a str, head: &str) -> &'a str {
    let start = src
        .find(head)
        .unwrap_or_else(|| panic!("no `{head}` in the kernels"));
    braced_from(src, start)
}

fn braced_from(src: &str, start: usize) -> &str {
    let open = start + src[start..].find('{').unwrap();
    let mut depth = 0;
    for (i, c) in src[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    let end = open + i + 1;
                    let end = if src[end..].starts_with(';') {
                        end + 1
                    } else {
                        end
                    };
                    return &src[start..end];
                }
            }
            _ => {}
        }
    }
    panic!("no closing brace after byte {start}");
}

/// A kernel's definition, from its `extern "C"`.
fn kernel_definition<'a>(src: &'a str, name: &str) -> &'a str {
    let at = src
        .find(&format!(" {name}("))
        .unwrap_or_else(|| panic!("no kernel `{name}`"));
    braced_from(src, src[..at].rfind("extern \"C\"").unwrap())
}

/// A line from its start `head` on, with the lines a trailing backslash continues.
fn line_definition<'a>(src: &'a str, head: &str) -> &'a str {
    let start = src
        .find(head)
        .unwrap_or_else(|| panic!("no `{head}` in the kernels"));
    let mut end = start;
    loop {
        let eol = end + src[end..].find('\n').unwrap();
        if !src[..eol].ends_with('\\') {
            return &src[start..eol];
        }
        end = eol + 1;
    }
}

/// `extern __shared__ __align__(N) T name[];` (the dynamic shared memory) as the emulated
/// block's: `T* name = (T*)dynamic_shared();`.
fn emulated_shared(mut src: String) -> String {
    let head = "extern __shared__ __align__(";
    while let Some(i) = src.find(head) {
        let end = i + src[i..].find("[];").unwrap();
        let decl = &src[i + src[i..].find(") ").unwrap() + 2..end];
        let (ty, var) = decl.rsplit_once(' ').unwrap();
        let with = format!("{ty}* {var} = ({ty}*)dynamic_shared();");
        src.replace_range(i..end + 3, &with);
    }
    src
}

/// Builds tests/warp_emulation/NAME.cpp after block.h and the pieces; None when there is no
/// C++ compiler.
fn build(name: &str, dir: &Path, mla_bk: usize) -> Option<PathBuf> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        println!("SKIPPED: no C++ compiler ({cxx}) for the warp emulation");
        return None;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let here = root.join("tests/warp_emulation");
    // MLA_BK comes before mla_decode.cu as kernels.rs's Family::source puts it.
    let mut src = format!("#include \"block.h\"\n#define MLA_BK {mla_bk}\n");
    for piece in PIECES {
        let (Def(file, head) | Line(file, head) | Kernel(file, head)) = piece;
        let text = std::fs::read_to_string(root.join("kernels").join(file)).unwrap();
        src += match piece {
            Def(..) => definition(&text, head),
            Line(..) => line_definition(&text, head),
            Kernel(..) => kernel_definition(&text, head),
        };
        src += "\n";
    }
    let mut src = emulated_shared(src);
    src += &std::fs::read_to_string(here.join(format!("{name}.cpp"))).unwrap();
    let cpp = dir.join(format!("{name}.cpp"));
    std::fs::write(&cpp, src).unwrap();
    let bin = dir.join(name);
    let compile = |sanitize: bool| {
        let mut c = Command::new(&cxx);
        c.args(["-std=c++20", "-O1", "-pthread", "-I"]).arg(&here);
        if sanitize {
            c.args([
                "-fsanitize=address,alignment",
                "-fno-sanitize-recover=alignment",
                "-fno-omit-frame-pointer",
            ]);
        }
        c.arg(&cpp).arg("-o").arg(&bin).output().unwrap()
    };
    let mut out = compile(true);
    if !out.status.success() {
        println!("{name}: no sanitizers (address, alignment) with {cxx}; built without them");
        out = compile(false);
    }
    assert!(
        out.status.success(),
        "{cxx} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(bin)
}

/// A harness's input: its arguments in the order it reads them (block.h: Input).
#[derive(Default)]
struct Args(Vec<u8>);

impl Args {
    fn i32(mut self, v: i32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn f32(mut self, v: f32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(&(b.len() as u64).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    fn ints(self, v: &[i32]) -> Self {
        let b: Vec<u8> = v.iter().flat_map(|i| i.to_le_bytes()).collect();
        self.bytes(&b)
    }
    fn floats(self, v: &[f32]) -> Self {
        let b: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
        self.bytes(&b)
    }
}

/// Runs a harness on its input, killed after a few minutes (a hang); its printed f32 values.
fn run_harness(bin: &Path, dir: &Path, input: &[u8]) -> Vec<f32> {
    let path = dir.join("input.bin");
    std::fs::write(&path, input).unwrap();
    let mut child = Command::new(bin)
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read as it comes: a full pipe would stop the harness.
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            pipe.read_to_string(&mut text).unwrap();
            text
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(300) {
            child.kill().ok();
            panic!("{} hangs (killed after 300 s)", bin.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    assert!(
        status.success(),
        "{} failed ({status}):\n{err}",
        bin.display()
    );
    out.lines()
        .map(|l| f32::from_bits(u32::from_str_radix(l, 16).unwrap()))
        .collect()
}

/// The harnesses of one test, built in a directory of their own (removed at the end).
struct Emulation {
    dir: PathBuf,
    bin: PathBuf,
}

impl Emulation {
    /// None (after printing SKIPPED) without a C++ compiler.
    fn build(name: &str) -> Option<Emulation> {
        Self::build_with_mla_bk(name, 16)
    }

    /// The same, with mla_decode.cu's key tiles of `mla_bk` keys (kernels.rs,
    /// mla_keys_per_tile).
    fn build_with_mla_bk(name: &str, mla_bk: usize) -> Option<Emulation> {
        // Tests of one process (cargo test's threads) may build the same harness at once.
        static BUILDS: AtomicUsize = AtomicUsize::new(0);
        let n = BUILDS.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("mla-emulation-{name}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bin = build(name, &dir, mla_bk)?;
        Some(Emulation { dir, bin })
    }
    fn run(&self, args: Args) -> Vec<f32> {
        run_harness(&self.bin, &self.dir, &args.0)
    }
}

impl Drop for Emulation {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// Where a block's f16 scales lie: Q4_K's d and dmin first, Q6_K's d last.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::IQ4_XS | GgmlType::Q8_0 | GgmlType::Q5_0 => &[0],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => unreachable!(),
    }
}

fn signed(rng: &mut Rng) -> f32 {
    (2.0 * rng.next_f64() - 1.0) as f32
}

/// The blocks of type ty in nb 256-blocks (the tiles' unit: Q8_0's 8 blocks).
fn blocks_of(ty: GgmlType, nb: usize) -> usize {
    nb * 256 / ty.block_size()
}

/// `rows` rows of nb random blocks (finite scales of mixed sizes).
fn random_rows(ty: GgmlType, rows: usize, nb: usize, rng: &mut Rng) -> Vec<u8> {
    let mut w: Vec<u8> = (0..rows * nb * ty.type_size())
        .map(|_| (128.0 * signed(rng) + 128.0) as u8)
        .collect();
    for block in w.chunks_exact_mut(ty.type_size()) {
        for &at in f16_fields(ty) {
            let v = signed(rng) * 2f32.powi((4.0 * signed(rng)) as i32 - 8);
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    w
}

/// x of mixed magnitudes, its second 256-block zeros (its scale 0).
fn random_x(nb: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..256 * nb)
        .map(|i| signed(rng) * if i % 7 == 0 { 30.0 } else { 1.0 })
        .collect();
    if nb > 1 {
        x[256..512].fill(0.0);
    }
    x
}

/// Every code at its largest (all bits set; Q6_K's scales and Q8_0's values -128): with x at
/// one value, the largest sums the integer path holds (each plane 0 digit 127).
fn largest_rows(ty: GgmlType, rows: usize, nb: usize) -> Vec<u8> {
    let mut w = vec![0xFFu8; rows * nb * ty.type_size()];
    for block in w.chunks_exact_mut(ty.type_size()) {
        if ty == GgmlType::Q6_K {
            block[192..208].fill(0x80);
        }
        if ty == GgmlType::Q8_0 {
            block[2..].fill(0x80);
        }
        for &at in f16_fields(ty) {
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(0.002).to_le_bytes());
        }
    }
    w
}

/// Each row of `w` (rows of x.len() values) times x, in f64 on the engine's dequantization.
fn products(ty: GgmlType, w: &[u8], x: &[f32]) -> Vec<f64> {
    let row_bytes = ty.row_bytes(x.len()).unwrap();
    w.chunks_exact(row_bytes)
        .map(|row| {
            let mut vals = vec![0f32; x.len()];
            quant::dequantize(ty, row, &mut vals).unwrap();
            vals.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum()
        })
        .collect()
}

fn nmse(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if num.is_nan() {
        f64::INFINITY
    } else {
        num / den
    }
}

/// What a kernel's y held before it ran: outputs it must not write keep it.
const UNWRITTEN: f32 = -7.25e30;

/// Checks a kernel's y against the expected values (None: to be left as UNWRITTEN) by nmse.
fn check_outputs(what: &str, got: &[f32], want: &[Option<f64>]) {
    check_outputs_within(what, got, want, F32_OP)
}

fn check_outputs_within(what: &str, got: &[f32], want: &[Option<f64>], bound: f64) {
    assert_eq!(got.len(), want.len(), "{what}: y's length");
    let (mut g, mut w) = (Vec::new(), Vec::new());
    for (i, (&got, want)) in got.iter().zip(want).enumerate() {
        match want {
            Some(v) => {
                g.push(got);
                w.push(*v);
            }
            None => assert!(
                got.to_bits() == UNWRITTEN.to_bits(),
                "{what}: y[{i}] = {got} was written (nothing is due there)"
            ),
        }
    }
    let e = nmse(&g, &w);
    println!(
        "{what}: {} values, nmse {e:.3e} (threshold {bound:.0e})",
        g.len()
    );
    assert!(e <= bound, "{what}: nmse {e:.3e} over {bound:.0e}");
}

/// The harnesses' name for a quant type.
fn type_code(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::Q4_K => 0,
        GgmlType::Q6_K => 1,
        GgmlType::Q5_K => 2,
        GgmlType::IQ4_XS => 3,
        GgmlType::Q8_0 => 4,
        _ => unreachable!(),
    }
}

/// One warp's 16-row tile (the harness tile.cpp) against f64.
fn check_tile(h: &Emulation, ty: GgmlType, what: &str, nb: usize, w: &[u8], x: &[f32]) {
    let mut padded = w.to_vec();
    if ty == GgmlType::Q6_K {
        padded.extend([0; 16]); // TcQ6k::load reads 2 bytes past a block (in a stage, later ones)
    }
    let args = Args::default()
        .i32(type_code(ty))
        .i32(nb as i32)
        .bytes(&padded)
        .floats(x);
    let want: Vec<Option<f64>> = products(ty, w, x).into_iter().map(Some).collect();
    check_outputs(what, &h.run(args), &want);
}

/// Random tiles of k = 256, 2048 (twice) and 7168, and the largest sums at k = 2048.
fn check_tiles(h: &Emulation, ty: GgmlType) {
    for (nb, seed) in [(1, 1), (8, 2), (8, 3), (28, 4)] {
        let mut rng = Rng::new(seed);
        let w = random_rows(ty, 16, blocks_of(ty, nb), &mut rng);
        let x = random_x(nb, &mut rng);
        let what = format!("{ty:?} tile, random k = {}", 256 * nb);
        check_tile(h, ty, &what, nb, &w, &x);
    }
    let what = format!("{ty:?} tile, largest sums, k = 2048");
    let w = largest_rows(ty, 16, blocks_of(ty, 8));
    check_tile(h, ty, &what, 8, &w, &[3.0; 2048]);
}

#[test]
fn tensor_core_tiles_match_f64() {
    let Some(h) = Emulation::build("tile") else {
        return;
    };
    for ty in TMA_TILE_TYPES {
        check_tiles(&h, ty);
    }
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// A launch of matvec_tma_<type>: `rows` x 256 nb matrices, `experts` of them in w (and in w2
/// for a pair), chosen by ids (or item b takes matrix b), a shared expert's pair in sw / sw2.
struct TmaCase {
    what: &'static str,
    rows: usize,
    nb: usize,
    /// 256-blocks of each part of x (None: ops.rs's tma_part_k).
    part_nb: Option<usize>,
    experts: usize,
    ids: Option<Vec<i32>>,
    pair: bool,
    glu: bool,
    shared: bool,
    /// One matrix's parts spread over the blocks: partial p of its rows at y + p * y_part.
    spread: bool,
    grid: u32,
}

fn check_tma(h: &Emulation, ty: GgmlType, c: &TmaCase, seed: u64) {
    let tile = tma_tile(ty).unwrap();
    let k = 256 * c.nb;
    let row_bytes = ty.row_bytes(k).unwrap();
    let mat_bytes = c.rows * row_bytes;
    let mut rng = Rng::new(seed);
    let mut mats = |n: usize| random_rows(ty, n * c.rows, blocks_of(ty, c.nb), &mut rng);
    let w = mats(c.experts);
    let w2 = if c.pair { mats(c.experts) } else { vec![] };
    let (sw, sw2) = match (c.shared, c.pair) {
        (false, _) => (vec![], vec![]),
        (true, false) => (mats(1), vec![]),
        (true, true) => (mats(1), mats(1)),
    };
    let x = random_x(c.nb, &mut rng);
    let ids = c
        .ids
        .clone()
        .unwrap_or_else(|| (0..c.experts as i32).collect());
    let items = if c.pair { 2 * ids.len() } else { ids.len() };
    let kpart = c.part_nb.map_or_else(|| tma_part_k(tile, k), |n| 256 * n);
    // Item b's products: its matrix by its id (b counted from items / 2 in w2 for a pair).
    let item = |b: usize| -> Option<Vec<f64>> {
        let (id, w, sw) = match c.pair && b >= ids.len() {
            false => (ids[b], &w, &sw),
            true => (ids[b - ids.len()], &w2, &sw2),
        };
        match id {
            MOE_SHARED => Some(products(ty, sw, &x)),
            id if id < 0 => None,
            id => {
                let at = id as usize * mat_bytes;
                Some(products(ty, &w[at..at + mat_bytes], &x))
            }
        }
    };
    let outputs = if c.glu { ids.len() } else { items };
    let y_stride = c.rows + 5; // the rows between must stay unwritten
    let mut want = vec![None; outputs * y_stride];
    let parts = (256 * c.nb).div_ceil(kpart);
    if c.spread {
        // Partial p: the rows' products over part p's 256-blocks alone, y_stride apart.
        let (pb, bytes) = (kpart / 256, ty.row_bytes(256).unwrap());
        want = vec![None; parts * y_stride];
        for p in 0..parts {
            let blocks = p * pb..(c.nb).min((p + 1) * pb);
            let part_w: Vec<u8> = w
                .chunks_exact(row_bytes)
                .flat_map(|row| &row[blocks.start * bytes..blocks.end * bytes])
                .copied()
                .collect();
            let part_x = &x[256 * blocks.start..256 * blocks.end];
            for (r, v) in products(ty, &part_w, part_x).into_iter().enumerate() {
                want[p * y_stride + r] = Some(v);
            }
        }
    }
    for b in (0..outputs).filter(|_| !c.spread) {
        let rows = match c.glu {
            true => item(b).zip(item(b + ids.len())).map(|(g, u)| {
                g.iter()
                    .zip(&u)
                    .map(|(&g, &u)| silu(g) * u)
                    .collect::<Vec<_>>()
            }),
            false => item(b),
        };
        for (r, v) in rows.into_iter().flatten().enumerate() {
            want[b * y_stride + r] = Some(v);
        }
    }
    let args = Args::default()
        .i32(type_code(ty))
        .bytes(&w)
        .bytes(&w2)
        .bytes(&sw)
        .bytes(&sw2)
        .i64(mat_bytes as i64)
        .ints(if c.ids.is_some() { &ids } else { &[] })
        .i32(items as i32)
        .i32(c.rows as i32)
        .i32(k as i32)
        .i32(kpart as i32)
        .i64(row_bytes as i64)
        .floats(&x)
        .floats(&vec![UNWRITTEN; want.len()])
        .i64(y_stride as i64)
        .i32(c.glu as i32)
        .i64(if c.spread { y_stride as i64 } else { 0 })
        .i32(c.grid as i32)
        .i32(tma_smem_bytes(tile, kpart) as i32);
    let kernel = if c.spread { tile.spread } else { tile.kernel };
    let what = format!("{kernel} {}", c.what);
    check_outputs(&what, &h.run(args), &want);
}

fn one_matrix(
    what: &'static str,
    rows: usize,
    nb: usize,
    part_nb: Option<usize>,
    grid: u32,
) -> TmaCase {
    TmaCase {
        what,
        rows,
        nb,
        part_nb,
        experts: 1,
        ids: None,
        pair: false,
        glu: false,
        shared: false,
        spread: false,
        grid,
    }
}

/// A token's MoE gate-up pair as the glu form (its silu * up) or as two products.
fn moe_pair(
    what: &'static str,
    rows: usize,
    nb: usize,
    ids: Vec<i32>,
    glu: bool,
    grid: u32,
) -> TmaCase {
    TmaCase {
        experts: 4,
        ids: Some(ids),
        pair: true,
        glu,
        shared: true,
        ..one_matrix(what, rows, nb, None, grid)
    }
}

/// Q4_K's, Q5_K's, IQ4_XS's, Q6_K's and Q8_0's kernels over the same launches, but where
/// IQ4_XS's rows and parts must be a multiple of 2 blocks (136 bytes each) for the bulk copies'
/// 16 bytes: there a block more. Q6_K's rows of 210-byte blocks start anywhere (even) modulo
/// 16, and some of its matrices end off 16 (the copies must not read past them: the sanitizer).
#[test]
fn bulk_copy_kernels_match_f64() {
    let Some(h) = Emulation::build("tma") else {
        return;
    };
    for ty in TMA_TILE_TYPES {
        let even = |nb: usize| aligned_blocks(ty, nb);
        // glu takes k in one part: DeepSeek-V3's 7168, or the tile type's k_max below it.
        let glu_nb = (tma_tile(ty).unwrap().k_max / 256).min(28);
        let cases = [
            one_matrix("40 x 2048, 2 blocks", 40, 8, None, 2),
            one_matrix(
                "a row of 19 256-blocks (IQ4_XS 20) in parts of 10, 3 blocks",
                24,
                even(19),
                Some(even(10)),
                3,
            ),
            one_matrix("20 x 18432 in parts (ops.rs), 1 block", 20, 72, None, 1),
            one_matrix(
                "17 x 7168 (DeepSeek-V3's rows: Q6_K's 8 bytes off 16 every other row), 2 blocks",
                17,
                28,
                None,
                2,
            ),
            moe_pair(
                "MoE gate-up glu of 3 choices of 7168 values (Q8_0: 6144, its k_max), 2 blocks",
                21,
                glu_nb,
                vec![1, 3, MOE_SHARED],
                true,
                2,
            ),
            moe_pair(
                "MoE gate-up glu of 4 choices (one another rank's, the shared expert's last), 3 blocks",
                24,
                8,
                vec![3, -1, 0, MOE_SHARED],
                true,
                3,
            ),
            moe_pair(
                "a pair without glu, the shared expert first, 2 blocks",
                20,
                even(9),
                vec![MOE_SHARED, 2, -1],
                false,
                2,
            ),
            TmaCase {
                experts: 2,
                ids: Some(vec![1, -1, MOE_SHARED]),
                shared: true,
                ..one_matrix("3 choices with the shared expert's single matrix, 5 blocks", 36, 8, None, 5)
            },
            TmaCase {
                spread: true,
                ..one_matrix(
                    "24 x 19 256-blocks (IQ4_XS 20) in parts of 10 spread over 3 blocks (one \
                     without a unit of part 0)",
                    24,
                    even(19),
                    Some(even(10)),
                    3,
                )
            },
            TmaCase {
                spread: true,
                ..one_matrix("40 x 16 256-blocks in parts of 8 spread over 5 blocks", 40, 16, Some(8), 5)
            },
            TmaCase {
                spread: true,
                ..one_matrix(
                    "40 x 36 256-blocks in 4 parts of 10 (the last 6) spread over 7 blocks",
                    40,
                    36,
                    Some(10),
                    7,
                )
            },
            TmaCase {
                spread: true,
                ..one_matrix(
                    "40 x 36 256-blocks in 4 parts spread over 3 blocks (one with two parts)",
                    40,
                    36,
                    Some(10),
                    3,
                )
            },
        ];
        for (i, c) in cases.iter().enumerate() {
            check_tma(&h, ty, c, 10 + i as u64);
        }
    }
}

/// nb rounded up to whole 16-byte rows of type ty's blocks where its kernels need them (the
/// bulk copies').
fn aligned_blocks(ty: GgmlType, nb: usize) -> usize {
    nb.next_multiple_of(tma_tile(ty).unwrap().block_step())
}

/// A launch of matvec_tma_items_<type>: item i = the matrix ids[i] (MOE_SHARED: sw) times its
/// own x.
fn check_tma_items(
    h: &Emulation,
    ty: GgmlType,
    rows: usize,
    nb: usize,
    ids: &[i32],
    grid: u32,
    seed: u64,
) {
    let tile = tma_tile(ty).unwrap();
    let (kernel, warps) = tile.items.unwrap();
    let k = 256 * nb;
    let row_bytes = ty.row_bytes(k).unwrap();
    let mat_bytes = rows * row_bytes;
    let mut rng = Rng::new(seed);
    let w = random_rows(ty, 3 * rows, blocks_of(ty, nb), &mut rng);
    let sw = random_rows(ty, rows, blocks_of(ty, nb), &mut rng);
    let x_stride = k + 4;
    let mut x = vec![0f32; ids.len() * x_stride];
    for xi in x.chunks_exact_mut(x_stride) {
        xi[..k].copy_from_slice(&random_x(nb, &mut rng));
    }
    let y_stride = rows + 3;
    let mut want = vec![None; ids.len() * y_stride];
    for (i, &id) in ids.iter().enumerate() {
        let mat = match id {
            MOE_SHARED => &sw[..],
            id if id < 0 => continue,
            id => &w[id as usize * mat_bytes..][..mat_bytes],
        };
        for (r, v) in products(ty, mat, &x[i * x_stride..][..k])
            .into_iter()
            .enumerate()
        {
            want[i * y_stride + r] = Some(v);
        }
    }
    let args = Args::default()
        .i32(type_code(ty))
        .i32(32 * (warps as i32 + 1))
        .bytes(&w)
        .bytes(&sw)
        .i64(mat_bytes as i64)
        .ints(ids)
        .i32(ids.len() as i32)
        .i32(rows as i32)
        .i32(k as i32)
        .i64(row_bytes as i64)
        .floats(&x)
        .i64(x_stride as i64)
        .floats(&vec![UNWRITTEN; want.len()])
        .i64(y_stride as i64)
        .i32(grid as i32)
        .i32(tmi_smem_bytes(tile, warps, k) as i32);
    let what = format!("{} {rows} x {k}, ids {ids:?}, {grid} blocks", kernel);
    check_outputs(&what, &h.run(args), &want);
}

#[test]
fn bulk_copy_items_kernels_match_f64() {
    let Some(h) = Emulation::build("tma_items") else {
        return;
    };
    let ids = [2, -1, MOE_SHARED, 0, 2];
    for (ty, seed) in [
        (GgmlType::Q4_K, 20),
        (GgmlType::Q5_K, 50),
        (GgmlType::IQ4_XS, 60),
        (GgmlType::Q6_K, 70),
        (GgmlType::Q8_0, 80),
    ] {
        // Q6_K's items kernel takes rows of a multiple of 16 bytes: 8 256-blocks.
        let short = match ty {
            GgmlType::Q6_K => 8,
            _ => aligned_blocks(ty, 6),
        };
        check_tma_items(&h, ty, 40, 8, &ids, 4, seed);
        check_tma_items(&h, ty, 40, short, &ids, 1, seed + 1);
        check_tma_items(&h, ty, 24, 8, &ids[..3], 6, seed + 2);
    }
}

/// A launch of matvec_tma_q6_k over `rows` x 256 nb; with `pick`, also y's argmax (the lm
/// head's greedy pick, `Matvec::pick`) against the lowest index of y's largest value.
fn check_tma_q6k(h: &Emulation, rows: usize, nb: usize, grid: u32, pick: bool, seed: u64) {
    let ty = GgmlType::Q6_K;
    let k = 256 * nb;
    let mut rng = Rng::new(seed);
    let w = random_rows(ty, rows, nb, &mut rng);
    let x = random_x(nb, &mut rng);
    let (work, id) = match pick {
        true => (vec![0u8; 4 * (1 + 2 * grid as usize)], vec![0xffu8; 4]),
        false => (Vec::new(), Vec::new()),
    };
    let args = Args::default()
        .bytes(&w)
        .i32(rows as i32)
        .i32(k as i32)
        .i64(210 * nb as i64)
        .floats(&x)
        .floats(&vec![UNWRITTEN; rows])
        .i32(grid as i32)
        .i32(tma6_smem_bytes(k) as i32)
        .bytes(&work)
        .bytes(&id);
    let want: Vec<Option<f64>> = products(ty, &w, &x).into_iter().map(Some).collect();
    let what = format!("matvec_tma_q6_k {rows} x {k}, {grid} blocks");
    let mut got = h.run(args);
    if pick {
        let id = got.pop().unwrap().to_bits() as i32;
        let top = mla_engine::sampling::argmax(&got);
        println!("{what}: pick {id}, y's argmax {top}");
        assert_eq!(id, top as i32, "{what}: the pick");
    }
    check_outputs(&what, &got, &want);
}

#[test]
fn bulk_copy_q6_k_kernel_matches_f64() {
    let Some(h) = Emulation::build("tma_q6k") else {
        return;
    };
    check_tma_q6k(&h, 37, 9, 3, true, 30); // rows of 1890 bytes: the matrix ends off 16 bytes
    check_tma_q6k(&h, 40, 8, 2, false, 31);
    check_tma_q6k(&h, 20, 12, 1, true, 32);
    check_tma_q6k(&h, 33, 32, 2, false, 33);
}

/// The CUDA-core matrix-vector kernels' Q2_K, Q3_K and Q5_0 pieces (matvec_body, the harness
/// matvec.cpp) against f64: 37 rows (a partial last group of 4), rows of 1, 7 and 28 blocks
/// (Q3_K's 110-byte blocks 2-byte aligned), a group per block and groups sharing blocks
/// (the warps of a group splitting k); Q5_0 (22-byte blocks) as MLA's k_b has it, rows of 6
/// blocks (GLM-5's 192 values: 24 pieces, a lane idle in 4) and of 4 on half warps (DeepSeek's
/// 128, matvec_half_q5_0), with the grids ops.rs gives them.
#[test]
fn cuda_core_q2_k_q3_k_and_q5_0_pieces_match_f64() {
    let Some(h) = Emulation::build("matvec") else {
        return;
    };
    // (harness code, type, rows, blocks a row, grid, seed); Q5_0: 512 rows as one head of
    // k_b, a whole warp a group (4 groups a block) or two groups a half warp (8 a block).
    let mut cases = Vec::new();
    for (code, ty) in [(0, GgmlType::Q2_K), (1, GgmlType::Q3_K)] {
        for (nb, grid, seed) in [(1, 10, 80), (7, 3, 81), (28, 5, 82)] {
            cases.push((code, ty, 37, nb, grid, seed));
        }
    }
    for (code, nb, grid, seed) in [(2, 6, 32, 83), (2, 1, 32, 84), (3, 4, 16, 85)] {
        cases.push((code, GgmlType::Q5_0, 512, nb, grid, seed));
    }
    for (code, ty, rows, nb, grid, seed) in cases {
        let k = nb * ty.block_size();
        let mut rng = Rng::new(seed);
        let w = random_rows(ty, rows, nb, &mut rng);
        let x = random_x(k.div_ceil(256), &mut rng)[..k].to_vec();
        let args = Args::default()
            .i32(code)
            .bytes(&w)
            .i32(rows as i32)
            .i32(k as i32)
            .i64((ty.type_size() * nb) as i64)
            .floats(&x)
            .floats(&vec![UNWRITTEN; rows])
            .i32(grid)
            .i32(4);
        let want: Vec<Option<f64>> = products(ty, &w, &x).into_iter().map(Some).collect();
        let what = format!("matvec {ty:?} {rows} x {k}, code {code}, {grid} blocks");
        check_outputs(&what, &h.run(args), &want);
    }
}

/// A token's q_a, kv_a and indexer key (rows of 256 nb values) with the latent's norms: the
/// inputs the parts harnesses (matvec_tail.cpp, tma_query.cpp) read first, and the f64 twins
/// of what their launches write.
struct LatentCase {
    ty: GgmlType,
    nb: usize,
    /// The query's, kv's (dl + dr) and the key's rows (0: none).
    rows: [usize; 3],
    w: Vec<Vec<u8>>,
    x: Vec<f32>,
    qw: Vec<f32>,
    kvw: Vec<f32>,
    kw: Vec<f32>,
    kb: Vec<f32>,
    inv_freq: Vec<f32>,
}

impl LatentCase {
    const DL: usize = 512;
    const DR: usize = 64;
    const POS: usize = 37;
    const MSCALE: f32 = 1.2;
    const EPS: f32 = 1e-6;
    const K_EPS: f32 = 1e-5;

    fn new(ty: GgmlType, nb: usize, (dq, dk): (usize, usize), seed: u64) -> LatentCase {
        let mut rng = Rng::new(seed);
        let rows = [dq, Self::DL + Self::DR, dk];
        let w = rows
            .iter()
            .map(|&r| random_rows(ty, r, blocks_of(ty, nb), &mut rng))
            .collect();
        let x = random_x(nb, &mut rng);
        let (qw, kvw) = (normals(&mut rng, dq), normals(&mut rng, Self::DL));
        let (kw, kb) = (normals(&mut rng, dk), normals(&mut rng, dk));
        let inv_freq = (0..Self::DR / 2)
            .map(|i| 10000f64.powf(-((2 * i) as f64) / Self::DR as f64) as f32)
            .collect();
        LatentCase {
            ty,
            nb,
            rows,
            w,
            x,
            qw,
            kvw,
            kw,
            kb,
            inv_freq,
        }
    }

    /// The harnesses' first arguments: the type's code (-1: none), the parts' rows, k,
    /// row_bytes, the matrices, x, the norms' weights, inv_freq, dl, dr, pos, mscale, eps,
    /// k_eps.
    fn args(&self, code: i32) -> Args {
        let [dq, dkv, dk] = self.rows;
        Args::default()
            .i32(code)
            .i32(dq as i32)
            .i32(dkv as i32)
            .i32(dk as i32)
            .i32(256 * self.nb as i32)
            .i64(self.ty.row_bytes(256 * self.nb).unwrap() as i64)
            .bytes(&self.w[0])
            .bytes(&self.w[1])
            .bytes(&self.w[2])
            .floats(&self.x)
            .floats(&self.qw)
            .floats(&self.kvw)
            .floats(&self.kw)
            .floats(&self.kb)
            .floats(&self.inv_freq)
            .i32(Self::DL as i32)
            .i32(Self::DR as i32)
            .i32(Self::POS as i32)
            .f32(Self::MSCALE)
            .f32(Self::EPS)
            .f32(Self::K_EPS)
    }

    /// Part i's f64 products.
    fn products(&self, i: usize) -> Vec<f64> {
        products(self.ty, &self.w[i], &self.x)
    }

    /// The cache rows a harness prints after the parts' rows `ys` (kv's and the key's as the
    /// kernels wrote them): the latent's, the key's, then 1 where the rows before the token's
    /// are untouched; against the f64 twins of `ys`.
    /// The three parts' rows, the first of a harness's printed outputs.
    fn parts<'a>(&self, out: &mut Printed<'a>) -> Vec<&'a [f32]> {
        self.rows.iter().map(|&r| out.take(r)).collect()
    }

    fn check_cache_rows(&self, what: &dyn Fn(&str) -> String, ys: &[&[f32]], out: &mut Printed) {
        let rope = (&self.inv_freq[..], Self::POS, Self::MSCALE);
        let want = latent_twin(ys[1], &self.kvw, Self::EPS, rope);
        check_outputs(&what("latent"), out.take(Self::DL + Self::DR), &some(want));
        if self.rows[2] > 0 {
            let want = layernorm_rope_twin(ys[2], (&self.kw, &self.kb), Self::K_EPS, rope);
            check_outputs(&what("key"), out.take(self.rows[2]), &some(want));
        }
        assert_eq!(
            out.take(1),
            [1.0],
            "{}",
            what("the rows before the token's touched")
        );
    }
}

/// A harness's printed values, taken in the order it printed them.
struct Printed<'a> {
    values: &'a [f32],
    at: usize,
}

impl<'a> Printed<'a> {
    fn new(values: &'a [f32]) -> Self {
        Printed { values, at: 0 }
    }

    fn take(&mut self, n: usize) -> &'a [f32] {
        self.at += n;
        &self.values[self.at - n..self.at]
    }
}

fn some(v: Vec<f64>) -> Vec<Option<f64>> {
    v.into_iter().map(Some).collect()
}

/// The parts launches with the latent's norms in their tails (the harness matvec_tail.cpp)
/// against f64: matvec_latent_<type> (matvec_body then parts_tail, with Q2_K rows, a grid over
/// the query's groups of 4 rows, 4 groups a block, as Gpu::matvec_parts launches it) and
/// matvec_tma_parts_<type> for every tile type (grids of fewer blocks than tiles, so that
/// blocks store tiles of two or three matrices and some are last for more than one). The
/// parts' rows, then the last block of each part norms its row (the query; the latent into
/// its cache row, c_kv normed and k_pe roped; the key normed and roped into its cache row) as
/// the f64 twins of those rows say, the rows before the token's untouched and the counters
/// back at zero. GLM-5's widths on a small k, and DeepSeek-V3's without a key.
#[test]
fn parts_tail_norms_the_latent_as_f64() {
    let Some(h) = Emulation::build("matvec_tail") else {
        return;
    };
    let cuda_cores = [(2048, 128, 128, 90), (1536, 0, 97, 91)].map(|c| (GgmlType::Q2_K, 2, c));
    // Each tile type once, GLM-5's and DeepSeek-V3's shapes in turn (the tiles' own loads are
    // bulk_copy_kernels_match_f64's).
    let tma = TMA_TILE_TYPES.into_iter().enumerate().map(|(i, ty)| {
        let shape = [(2048, 128, 41), (1536, 0, 13)][i % 2];
        (
            ty,
            aligned_blocks(ty, 9),
            (shape.0, shape.1, shape.2, 92 + i as u64),
        )
    });
    for (ty, nb, (dq, dk, grid, seed)) in cuda_cores.into_iter().chain(tma) {
        let c = LatentCase::new(ty, nb, (dq, dk), seed);
        let (code, shared) = match tma_tile(ty) {
            Some(tile) => (type_code(ty), tma_smem_bytes(tile, 256 * nb) as i32),
            None => (-1, 0),
        };
        let got = h.run(c.args(code).i32(grid).i32(shared));
        let dkv = c.rows[1];
        let what = |s: &str| format!("{ty} parts tail {dq} + {dkv} + {dk}, {grid} blocks: {s}");
        let mut out = Printed::new(&got);
        let ys = c.parts(&mut out);
        for (i, y) in ys.iter().enumerate().filter(|(_, y)| !y.is_empty()) {
            check_outputs(&what(&format!("part {i}")), y, &some(c.products(i)));
        }
        let want = rmsnorm_twin(ys[0], &c.qw, LatentCase::EPS);
        check_outputs(&what("query"), out.take(dq), &some(want));
        c.check_cache_rows(&what, &ys, &mut out);
        assert_eq!(out.take(3), [0.0; 3], "{}", what("counters left"));
    }
}

/// q-LoRA's pair on the bulk copies (`Gpu::query_projections`, the harness tma_query.cpp):
/// matvec_tma_parts_<type> in its qsq mode, then matvec_tma_query_<type>, for every tile type
/// (GLM-5's and DeepSeek-V3's widths in turn; q_b of 200 rows over 5 blocks): the parts' rows
/// (the query's times its norm's weights), q_b's rows, the normed latent and the cache rows
/// against f64 (q_b's from the f64 norm of the f64 products).
#[test]
fn query_projections_fold_the_norm_as_f64() {
    let Some(h) = Emulation::build("tma_query") else {
        return;
    };
    for (i, ty) in TMA_TILE_TYPES.into_iter().enumerate() {
        let (dq, dk, grid) = [(2048, 128, 41), (1536, 0, 13)][i % 2];
        let nb = aligned_blocks(ty, 9);
        let c = LatentCase::new(ty, nb, (dq, dk), 110 + i as u64);
        let (rows_b, grid_b) = (200, 5);
        let wb = random_rows(
            ty,
            rows_b,
            blocks_of(ty, dq / 256),
            &mut Rng::new(120 + i as u64),
        );
        let tile = tma_tile(ty).unwrap();
        let args = c
            .args(type_code(ty))
            .i32(grid)
            .i32(tma_smem_bytes(tile, 256 * nb) as i32)
            .bytes(&wb)
            .i32(rows_b as i32)
            .i64(ty.row_bytes(dq).unwrap() as i64)
            .i32(grid_b)
            .i32(tma_smem_bytes(tile, dq) as i32);
        let got = h.run(args);
        let dkv = c.rows[1];
        let what = |s: &str| format!("{ty} q-LoRA {dq} + {dkv} + {dk}: {s}");
        let mut out = Printed::new(&got);
        let ys = c.parts(&mut out);
        let q_raw = c.products(0);
        let weighed = q_raw
            .iter()
            .zip(&c.qw)
            .map(|(&q, &w)| q * w as f64)
            .collect();
        check_outputs(&what("the query's rows weighed"), ys[0], &some(weighed));
        for (i, y) in ys.iter().enumerate().skip(1).filter(|(_, y)| !y.is_empty()) {
            check_outputs(&what(&format!("part {i}")), y, &some(c.products(i)));
        }
        let q_f32: Vec<f32> = q_raw.iter().map(|&v| v as f32).collect();
        let normed = rmsnorm_twin(&q_f32, &c.qw, LatentCase::EPS);
        let normed_f32: Vec<f32> = normed.iter().map(|&v| v as f32).collect();
        let want_b = products(ty, &wb, &normed_f32);
        check_outputs(&what("q_b's rows"), out.take(rows_b), &some(want_b));
        check_outputs(&what("the normed latent"), out.take(dq), &some(normed));
        c.check_cache_rows(&what, &ys, &mut out);
    }
}

fn normals(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let (u, v) = (rng.next_f64().max(1e-300), rng.next_f64());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}

/// An MLA decode call of `heads` heads for 2 query tokens after
/// pos0 positions: over every causal key or a random DSA selection, its q_pe roped already or
/// by the kernel (read in place from whole [q_nope | q_pe] heads), `per` keys a split.
struct MlaCase {
    /// Latent and rope widths (DeepSeek-V3's and GLM-5's 512 and 64, or narrower: zero dims
    /// in the cache rows).
    dl: usize,
    dr: usize,
    heads: usize,
    pos0: usize,
    dsa: bool,
    rope: bool,
    per: usize,
}

/// `kernel` (its form code in mla_decode.cpp, heads per block, threads, dynamic shared memory)
/// and mla_decode_combine as Gpu::mla_decode_with launches them, against f64 attention over
/// the f32 values the cache rows split.
fn check_mla_decode(
    h: &Emulation,
    kernel: (&str, i32, usize, u32, usize),
    c: &MlaCase,
    seed: u64,
) -> Vec<f32> {
    let (dl, dr, dn, tokens, scale) = (c.dl, c.dr, 16, 2, 0.07f32);
    let mut rng = Rng::new(seed);
    let s_len = c.pos0 + tokens;
    let q_lat = normals(&mut rng, tokens * c.heads * dl);
    let cache = normals(&mut rng, s_len * (dl + dr));
    let q_whole = normals(&mut rng, tokens * c.heads * (dn + dr));
    let inv_freq: Vec<f32> = (0..dr / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / dr as f32))
        .collect();
    let mscale = 1.1f32;
    // q_pe as the kernel sees it: roped here in f64 from the same f32 angles, or not yet.
    let q_pe: Vec<f32> = match c.rope {
        true => roped_q_pe(&q_whole, c.heads, (dn, dr), c.pos0, &inv_freq, mscale),
        false => q_whole
            .chunks(dn + dr)
            .flat_map(|h| &h[dn..])
            .copied()
            .collect(),
    };
    let n_ids = 40;
    let mut keep = Vec::new();
    for t in 0..tokens {
        let mut chosen: Vec<i32> = (0..=(c.pos0 + t) as i32)
            .filter(|_| rng.next_f64() < 0.3)
            .collect();
        chosen.truncate(n_ids);
        chosen.resize(n_ids, -1);
        keep.extend(chosen);
    }
    let mut want = Vec::new();
    for t in 0..tokens {
        let visible: Vec<usize> = match c.dsa {
            true => keep[t * n_ids..][..n_ids]
                .iter()
                .filter(|&&s| s >= 0)
                .map(|&s| s as usize)
                .collect(),
            false => (0..=c.pos0 + t).collect(),
        };
        for hd in 0..c.heads {
            let ql = &q_lat[(t * c.heads + hd) * dl..][..dl];
            let qp = &q_pe[(t * c.heads + hd) * dr..][..dr];
            let dot = |a: &[f32], b: &[f32]| -> f64 {
                a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
            };
            let scores: Vec<f64> = visible
                .iter()
                .map(|&s| {
                    let row = &cache[s * (dl + dr)..][..dl + dr];
                    (dot(ql, &row[..dl]) + dot(qp, &row[dl..])) * scale as f64
                })
                .collect();
            let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = scores.iter().map(|&x| (x - mx).exp()).collect();
            let sum: f64 = p.iter().sum();
            for d in 0..dl {
                let o: f64 = visible
                    .iter()
                    .zip(&p)
                    .map(|(&s, &p)| p * cache[s * (dl + dr) + d] as f64)
                    .sum();
                want.push(Some(o / sum));
            }
        }
    }
    let rows: Vec<u8> = latent_split(&cache, dl, dr)
        .unwrap()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let n_keys = if c.dsa { n_ids } else { s_len };
    let splits = n_keys.div_ceil(c.per);
    let shape = MlaDecode {
        q_lat: 0,
        ql_tok: 0,
        q_pe: 0,
        qp_tok: 0,
        qp_head: 0,
        qp_rope: (0, 0.0),
        cache: 0,
        dl,
        dr,
        heads: c.heads,
        tokens,
        pos0: c.pos0,
        key_ids: 0,
        n_ids,
        scale,
        out: 0,
        out_tok: 0,
    };
    let (chunks, threads) = mla_combine_shape(132, &shape, splits);
    let (name, form, per_block, split_threads, shared) = kernel;
    let mut args = Args::default()
        .i32(form)
        .floats(&q_lat)
        .i64((c.heads * dl) as i64);
    args = match c.rope {
        true => args
            .floats(&q_whole[dn..])
            .i64((c.heads * (dn + dr)) as i64)
            .i32((dn + dr) as i32)
            .floats(&inv_freq),
        false => args
            .floats(&q_pe)
            .i64((c.heads * dr) as i64)
            .i32(dr as i32)
            .floats(&[]),
    };
    let args = args
        .f32(mscale)
        .bytes(&rows)
        .i32(dl as i32)
        .i32(dr as i32)
        .i32(c.heads as i32)
        .ints(if c.dsa { &keep } else { &[] })
        .i32(n_ids as i32)
        .i32(c.pos0 as i32)
        .i32(c.per as i32)
        .f32(scale)
        .floats(&vec![UNWRITTEN; want.len()])
        .i64((c.heads * dl) as i64)
        .i32(tokens as i32)
        .i32(splits as i32)
        .i32(per_block as i32)
        .i32(split_threads as i32)
        .i32(shared as i32)
        .i32(chunks as i32)
        .i32(threads as i32);
    let what = format!(
        "{name} {} heads of {} + {} after {} positions{}{}, {splits} splits of {}",
        c.heads,
        c.dl,
        c.dr,
        c.pos0,
        if c.dsa { ", DSA" } else { "" },
        if c.rope {
            ", q_pe roped in the kernel"
        } else {
            ""
        },
        c.per
    );
    let got = h.run(args);
    check_outputs_within(&what, &got, &want, MLA_OP);
    got
}

#[test]
fn mla_decode_kernels_on_16_key_tiles_match_f64() {
    check_mla_decode_kernels(16);
}

#[test]
fn mla_decode_kernels_on_32_key_tiles_match_f64() {
    check_mla_decode_kernels(32);
}

/// Both split forms (and the combine) on key tiles of `bk` keys, over splits shorter than a
/// tile, of one and of several, with DSA's invisible keys and empty tiles.
fn check_mla_decode_kernels(bk: usize) {
    let Some(h) = Emulation::build_with_mla_bk("mla_decode", bk) else {
        return;
    };
    let smem = mla_decode_smem_bytes(bk);
    let split = ("mla_decode_split", 0, MLA_HB, MLA_THREADS, smem);
    let split16 = ("mla_decode_split16", 1, 16, MLA_THREADS, smem);
    let case = |heads, pos0, dsa, rope, per| MlaCase {
        dl: 512,
        dr: 64,
        heads,
        pos0,
        dsa,
        rope,
        per,
    };
    // 40 heads: the second block's first head tile has 8, its second none (inactive warps).
    check_mla_decode(&h, split, &case(40, 45, false, false, 32), 40);
    check_mla_decode(&h, split, &case(32, 21, false, true, 64), 41);
    check_mla_decode(&h, split16, &case(16, 45, true, false, 16), 42);
    check_mla_decode(&h, split16, &case(20, 30, false, true, 7), 43);
    // 96 keys in one split, six tiles of 16 or three of 32 (stages refilled); DSA's invisible
    // keys and empty tiles, in splits of 7 and 40 keys; 4 splits of 16 where token 0's last has
    // no key.
    check_mla_decode(&h, split, &case(32, 80, false, true, 96), 44);
    check_mla_decode(&h, split, &case(32, 30, true, true, 7), 45);
    check_mla_decode(&h, split, &case(32, 60, true, false, 40), 46);
    check_mla_decode(&h, split, &case(32, 47, false, false, 16), 47);
    // 82 splits of one key: the combine's groups (16) take whole rounds of 4 splits, then the
    // rest, past the 4 rows each thread loaded before the weights. The combine does not see
    // the tiles, and these 164 blocks are most of the test's time: on one tile size only.
    if bk == 16 {
        check_mla_decode(&h, split, &case(32, 80, false, false, 1), 49);
    }
    let narrow = MlaCase {
        dl: 128,
        dr: 32,
        ..case(32, 40, false, true, 32)
    };
    check_mla_decode(&h, split, &narrow, 48);
}

fn bf16(v: f32) -> f64 {
    half::bf16::from_f32(v).to_f64()
}

/// The weights as the cp.async kernels multiply them, rows of k values in f64: Q4_K rounds
/// d sc and -dmin mn to bf16 and q d sc - dmin mn once more (fma.rn.bf16x2); Q8_0 rounds d to
/// bf16 and d q once more.
fn bf16_operands(ty: GgmlType, w: &[u8]) -> Vec<f64> {
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let mut out = Vec::new();
    for b in w.chunks_exact(ty.type_size()) {
        if ty == GgmlType::Q4_K {
            let (d, dmin) = (f16(&b[0..]), f16(&b[2..]));
            let (sc, mn) = quant::scale_min_k4(&b[4..16]);
            for j in 0..8 {
                let (dl, ml) = (
                    bf16(d * sc[j] as f32) as f32,
                    bf16(-(dmin * mn[j] as f32)) as f32,
                );
                for l in 0..32 {
                    let q = (b[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
                    out.push(bf16(q as f32 * dl + ml));
                }
            }
        } else {
            let d = bf16(f16(&b[0..])) as f32;
            out.extend(b[2..34].iter().map(|&q| bf16(d * q as i8 as f32)));
        }
    }
    out
}

/// One prefill product on the cp.async kernels (and matmul_xprep, matmul_splitk_sum) as
/// ops.rs launches it: y (rows of n) against the f64 product of the operands as the kernel
/// rounds them to bf16 (the f32 sums' bound) and of the engine's dequantization (the GPU
/// tests' bf16 bound). Grouped: spans (expert, first row, count) of matrices n x k apart.
#[allow(clippy::too_many_arguments)]
fn check_matmul_cp(
    h: &Emulation,
    ty: GgmlType,
    (m, n, k): (usize, usize, usize),
    splits: usize,
    row_ids: Option<&[i32]>,
    spans: Option<&[(usize, usize, usize)]>,
    seed: u64,
) {
    let mut rng = Rng::new(seed);
    let experts = spans.map_or(1, |s| s.iter().map(|s| s.0 + 1).max().unwrap());
    let row_bytes = ty.row_bytes(k).unwrap();
    let w = random_rows(ty, experts * n, k / ty.block_size(), &mut rng);
    let x_rows = 320;
    let x: Vec<f32> = (0..x_rows * k)
        .map(|i| signed(&mut rng) * if i % 7 == 0 { 30.0 } else { 1.0 })
        .collect();
    let (wq, xq) = (
        bf16_operands(ty, &w),
        x.iter().map(|&v| bf16(v)).collect::<Vec<_>>(),
    );
    let mut wf = vec![0f32; w.len() / ty.type_size() * ty.block_size()];
    quant::dequantize(ty, &w, &mut wf).unwrap();
    // Output rows: every span's rows (grouped) or m.
    let rows = spans.map_or(m, |s| s.iter().map(|s| s.1 + s.2).max().unwrap());
    let (mut tight, mut exact) = (Vec::new(), Vec::new());
    for r in 0..rows {
        let ex = spans.map_or(0, |s| {
            s.iter().find(|s| r >= s.1 && r < s.1 + s.2).unwrap().0
        });
        let src = row_ids.map_or(r, |ids| ids[r] as usize);
        for j in 0..n {
            let (wr, xr) = ((ex * n + j) * k, src * k);
            tight.push(Some((0..k).map(|i| wq[wr + i] * xq[xr + i]).sum::<f64>()));
            exact.push(Some(
                (0..k)
                    .map(|i| wf[wr + i] as f64 * x[xr + i] as f64)
                    .sum::<f64>(),
            ));
        }
    }
    // ops.rs's choice: Q4_K spans of CP_SPANS64_ROWS rows or more on average take 64-row tiles.
    let wide = ty == GgmlType::Q4_K && spans.is_some_and(|s| rows >= CP_SPANS64_ROWS * s.len());
    let (name, code, threads, bn) = match (spans.is_some(), ty == GgmlType::Q4_K) {
        (true, true) if wide => ("matmul_cp_spans64_q4_k", 4, 128, 128),
        (false, true) => ("matmul_cp_q4_k", 0, 128, 128),
        (false, false) => ("matmul_cp_q8_0", 1, 128, 128),
        (true, true) => ("matmul_cp_spans_q4_k", 2, 128, 128),
        (true, false) => ("matmul_cp_spans_q8_0", 3, 256, 256),
    };
    let big_m = spans.map_or(m, |s| s.iter().map(|s| s.2).max().unwrap());
    let ksteps = (k / 64).div_ceil(splits);
    let args = Args::default()
        .i32(code)
        .bytes(&w)
        .i64(row_bytes as i64)
        .floats(&x)
        .i32(x_rows as i32)
        .ints(row_ids.unwrap_or(&[]))
        .floats(&vec![UNWRITTEN; rows * n])
        .i64(n as i64)
        .i32(big_m as i32)
        .i32(n as i32)
        .i32(k as i32)
        .ints(&span_table(spans.unwrap_or(&[])))
        .i32(spans.map_or(0, |s| s.len()) as i32)
        .i64((n * row_bytes) as i64)
        .i32(m.div_ceil(128) as i32)
        .i32(ksteps as i32)
        .i32((k / 64).div_ceil(ksteps) as i32)
        .i32(threads)
        .i32(bn)
        .i32(matmul_cp_smem_bytes(name) as i32);
    let what = format!(
        "{name} {rows} x {n} x {k}{}{}",
        if splits > 1 {
            format!(", {splits} splits of {ksteps} steps")
        } else {
            String::new()
        },
        if row_ids.is_some() {
            ", rows gathered"
        } else {
            ""
        }
    );
    let got = h.run(args);
    check_outputs_within(&format!("{what} (bf16 operands)"), &got, &tight, F32_OP);
    check_outputs_within(&format!("{what} (dequantized)"), &got, &exact, BF16_MATMUL);
}

#[test]
fn prefill_products_match_f64() {
    let Some(h) = Emulation::build("matmul_cp") else {
        return;
    };
    let mut rng = Rng::new(50);
    let ids: Vec<i32> = (0..320).map(|_| (rng.next_f64() * 320.0) as i32).collect();
    // 200 x 264: 2 x 3 tiles of 128, partial in both; k 512 (8 steps, two Q4_K blocks), or
    // 1024 in 3 splits of 6 steps (a split starts inside a Q4_K block: its header comes with
    // its first step). Grouped: spans of 40 + 1 + 75 rows (two and three 32-row tiles),
    // gathered and consecutive.
    let spans: &[(usize, usize, usize)] = &[(2, 0, 40), (0, 40, 1), (1, 41, 75)];
    for (i, ty) in [GgmlType::Q4_K, GgmlType::Q8_0].into_iter().enumerate() {
        let seed = 60 + 10 * i as u64;
        check_matmul_cp(&h, ty, (200, 264, 512), 1, None, None, seed);
        check_matmul_cp(&h, ty, (200, 264, 1024), 3, None, None, seed + 1);
        check_matmul_cp(&h, ty, (150, 264, 512), 1, Some(&ids), None, seed + 2);
        check_matmul_cp(&h, ty, (0, 264, 512), 1, Some(&ids), Some(spans), seed + 3);
        check_matmul_cp(&h, ty, (0, 264, 512), 1, None, Some(spans), seed + 4);
    }
    // Spans of 65 rows on average: Q4_K's 64-row tiles, with 1, 4, 3 and 2 m16 tiles of rows.
    let wide: &[(usize, usize, usize)] = &[(2, 0, 70), (0, 70, 100), (1, 170, 25)];
    check_matmul_cp(
        &h,
        GgmlType::Q4_K,
        (0, 264, 512),
        1,
        Some(&ids),
        Some(wide),
        90,
    );
    check_matmul_cp(&h, GgmlType::Q4_K, (0, 264, 512), 1, None, Some(wide), 91);
}

/// One prefill attention on the tensor cores (attention_bf16, then attention_mma_<form>) as
/// Gpu::attention_prefill_mma launches it, against the f64 attention of the f32 inputs (the
/// GPU tests' bf16 bound): a wrong fragment, key, mask bit or softmax step gives an nmse near 1.
fn check_attention(h: &Emulation, a: AttentionShape, top_k: Option<usize>, seed: u64) {
    let mut rng = Rng::new(seed);
    let s_len = a.pos0 + a.tokens;
    let dqk = a.dn + a.dr;
    let mut normals = |n: usize| (0..n).map(|_| 2.0 * signed(&mut rng)).collect::<Vec<f32>>();
    let (q, k_nope, k_pe, v) = (
        normals(a.tokens * a.heads * dqk),
        normals(s_len * a.heads * a.dn),
        normals(s_len * a.dr),
        normals(s_len * a.heads * a.dv),
    );
    // A selection: every other visible key, then -1 (DSA's rows, shorter than causal).
    let keep: Vec<i32> = top_k.map_or(Vec::new(), |k| {
        (0..a.tokens)
            .flat_map(|t| {
                let mut row: Vec<i32> = (0..=(a.pos0 + t) as i32).step_by(2).take(k).collect();
                row.resize(k, -1);
                row
            })
            .collect()
    });
    let mask = top_k.map_or(Vec::new(), |k| keep_mask(&keep, k, s_len.div_ceil(32)));
    let scale = 1.0 / (dqk as f32).sqrt();
    let want = attention_want(
        &q,
        &k_nope,
        &k_pe,
        &v,
        a,
        top_k.map(|k| (&keep[..], k)),
        scale,
    );
    let mask_i: Vec<i32> = mask.iter().map(|&w| w as i32).collect();
    // The form ops.rs takes: the smallest whose padded dims hold these.
    let form = ATT_MMA_FORMS
        .iter()
        .position(|f| dqk <= f.1 && a.dv <= f.2)
        .unwrap();
    let (_, dq, dvp, bk) = ATT_MMA_FORMS[form];
    let args = Args::default()
        .i32(form as i32)
        .i32(dq as i32)
        .i32(dvp as i32)
        .i32(attention_mma_smem_bytes(dq, dvp, bk) as i32)
        .floats(&q)
        .floats(&k_nope)
        .floats(&k_pe)
        .floats(&v)
        .ints(&mask_i)
        .i32(a.dn as i32)
        .i32(a.dr as i32)
        .i32(a.dv as i32)
        .i32(a.heads as i32)
        .i32(a.tokens as i32)
        .i32(a.pos0 as i32)
        .f32(scale * std::f32::consts::LOG2_E)
        .floats(&vec![UNWRITTEN; a.tokens * a.heads * a.dv]);
    let got = h.run(args);
    let want: Vec<Option<f64>> = want.into_iter().map(Some).collect();
    let what = format!(
        "{}, {}+{}/{}, {} tokens after {}{}",
        ATT_MMA_FORMS[form].0,
        a.dn,
        a.dr,
        a.dv,
        a.tokens,
        a.pos0,
        if top_k.is_some() { ", DSA" } else { "" }
    );
    check_outputs_within(&what, &got, &want, BF16_MATMUL);
}

#[test]
fn prefill_attention_on_tensor_cores_matches_f64() {
    let Some(h) = Emulation::build("attention") else {
        return;
    };
    let shape = |dn, dr, dv, tokens, pos0| AttentionShape {
        dn,
        dr,
        dv,
        heads: 2,
        tokens,
        pos0,
    };
    // The golden models' heads (64 / 64 form, padded dims) over two query tiles and a
    // prefix; with a DSA mask; DeepSeek's 192 / 128 and GLM-5's 256 / 256 (32-key tiles).
    check_attention(&h, shape(32, 16, 32, 70, 9), None, 80);
    check_attention(&h, shape(48, 16, 64, 40, 50), Some(24), 81);
    check_attention(&h, shape(128, 64, 128, 20, 100), None, 82);
    check_attention(&h, shape(192, 64, 256, 20, 40), Some(16), 83);
}

/// One dsa_scores_mma launch as ops.rs makes it (but `tiles` given): every key of every row
/// against the f64 scores of the f32 inputs, future keys -inf, the stride's padding unwritten.
fn check_dsa_scores(
    h: &Emulation,
    (heads, dim, tokens, pos0): (usize, usize, usize, usize),
    tiles: usize,
    seed: u64,
) {
    let mut rng = Rng::new(seed);
    let s_len = pos0 + tokens;
    let stride = s_len + 3;
    let q = normals(&mut rng, tokens * heads * dim);
    let k = normals(&mut rng, s_len * dim);
    let w = normals(&mut rng, tokens * heads);
    let scale = 0.088f32;
    let (kernel, padded) = dsa_scores_mma_kernel(heads).unwrap();
    let nt = padded / 8;
    let mut got = h.run(
        Args::default()
            .i32(nt as i32)
            .floats(&q)
            .floats(&k)
            .floats(&w)
            .i32(heads as i32)
            .i32(dim as i32)
            .i32(s_len as i32)
            .i32(pos0 as i32)
            .f32(scale)
            .i32(tokens as i32)
            .i32(tiles as i32)
            .i32(dsa_scores_mma_smem_bytes(padded, dim) as i32)
            .floats(&vec![UNWRITTEN; tokens * stride])
            .i64(stride as i64),
    );
    let mut want = Vec::new();
    for t in 0..tokens {
        for s in 0..stride {
            let at = t * stride + s;
            if s < s_len && s > pos0 + t {
                assert_eq!(
                    got[at],
                    f32::NEG_INFINITY,
                    "{kernel}: future key {s} of row {t}"
                );
                got[at] = UNWRITTEN; // checked: out of the nmse
                want.push(None);
                continue;
            }
            want.push((s < s_len).then(|| {
                let kr = &k[s * dim..][..dim];
                (0..heads)
                    .map(|hd| {
                        let qr = &q[(t * heads + hd) * dim..][..dim];
                        let dot: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                        w[t * heads + hd] as f64 * (scale as f64 * dot).max(0.0)
                    })
                    .sum()
            }));
        }
    }
    let what =
        format!("{kernel} {heads}x{dim}, {tokens} rows of {s_len} keys, {tiles} tiles a block");
    check_outputs_within(&what, &got, &want, MLA_OP);
}

#[test]
fn dsa_scores_on_tensor_cores_match_f64() {
    let Some(h) = Emulation::build("dsa_scores") else {
        return;
    };
    // GLM-5's 32 heads of 128 (two tiles a block); 64 heads; 8 heads (padded to 16) of 256 (two
    // rounds of 8 k steps); 20 heads (padded to 32) of 48 (3 k steps), a last tile of 3 keys;
    // a prefill of 40 rows after 10 keys (warps whose keys are all in their row's future).
    check_dsa_scores(&h, (32, 128, 1, 300), 2, 1);
    check_dsa_scores(&h, (16, 64, 40, 10), 1, 5);
    check_dsa_scores(&h, (64, 128, 2, 100), 1, 2);
    check_dsa_scores(&h, (8, 256, 3, 70), 1, 3);
    check_dsa_scores(&h, (20, 48, 2, 129), 3, 4);
}

/// n scores of few values, 8 of every 10 sharing their top bytes: ties at a top-k's boundary.
fn few_values(rng: &mut Rng, n: usize) -> Vec<f32> {
    normals(rng, n)
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            if i % 10 < 8 {
                1.0 + (r.abs() * 4.0).floor() / 64.0
            } else {
                (r * 4.0).floor()
            }
        })
        .collect()
}

/// topk_rows on `rows` rows of `scores` ([rows][stride], row t: the first pos0 + t + 1
/// positions), `cache_keys` keys of shared memory, against the twin's selection.
fn check_topk(
    h: &Emulation,
    scores: &[f32],
    stride: usize,
    pos0: usize,
    k: usize,
    cache_keys: usize,
) {
    let rows = scores.len() / stride;
    let got = h.run(
        Args::default()
            .floats(scores)
            .i64(stride as i64)
            .i32(rows as i32)
            .i32(pos0 as i32)
            .i32(k as i32)
            .i32(cache_keys as i32),
    );
    for t in 0..rows {
        let want = topk_twin(&scores[t * stride..][..stride], pos0 + t + 1, k);
        let row: Vec<i32> = got[t * k..][..k]
            .iter()
            .map(|v| v.to_bits() as i32)
            .collect();
        assert_eq!(
            row,
            want,
            "topk_rows row {t} of {rows} ({} keys, top {k}, {cache_keys} kept)",
            pos0 + t + 1
        );
    }
    println!(
        "topk_rows: {rows} rows of up to {} keys, top {k}, {cache_keys} kept: exact",
        pos0 + rows
    );
}

#[test]
fn topk_rows_matches_its_twin() {
    let Some(h) = Emulation::build("topk") else {
        return;
    };
    let mut rng = Rng::new(9);
    // Decode: the top 2048 of 5000 normal scores, the row kept whole in shared memory, then
    // with 1500 kept (the later passes read the rest from the row).
    let row = normals(&mut rng, 5000);
    check_topk(&h, &row, 5000, 4999, 2048, 5000);
    check_topk(&h, &row, 5000, 4999, 2048, 1500);
    // 20000 keys of few values (the boundary's ties over all three chunks of the placement),
    // kept whole, then 9001 of them (a chunk from the cache and the row both).
    let row: Vec<f32> = normals(&mut rng, 20000)
        .into_iter()
        .map(|r| (r * 3.0).floor())
        .collect();
    check_topk(&h, &row, 20000, 19999, 2048, 20000);
    check_topk(&h, &row, 20000, 19999, 2048, 9001);
    // 8192 and 4000 of them: the placement's 16-byte reads from the cache, all of a thread's
    // keys kept, then some.
    check_topk(&h, &row[..8192], 8192, 8191, 2048, 8192);
    check_topk(&h, &row[..4000], 4000, 3999, 2048, 2100);
    // 8193, the GLM-5 file's rows after 8192 positions: the placement's second pass of a key.
    check_topk(&h, &row[..8193], 8193, 8192, 2048, 8193);
    // Prefill rows of few values, 8 of every 10 sharing their top bytes, and 40 equal maxima:
    // ties at the boundary across the row, taken lowest position first.
    let (rows, pos0) = (3, 1200);
    let stride = pos0 + rows;
    let mut scores = few_values(&mut rng, rows * stride);
    for s in 0..40 {
        scores[stride + 3 * s] = 1e6;
    }
    check_topk(&h, &scores, stride, pos0, 256, stride);
    // Fewer keys than k: all of them, then -1.
    check_topk(&h, &scores[..2 * stride], stride, 10, 256, 11);
}

/// topk_rows_cluster4 / 8 (`blocks`) on one decode row of `row.len()` keys, `cache_keys` keys
/// of each block's stretch in its shared memory, against the twin's selection.
fn check_topk_cluster(h: &Emulation, row: &[f32], k: usize, cache_keys: usize, blocks: usize) {
    let n = row.len();
    let got = h.run(
        Args::default()
            .floats(row)
            .i32(n as i32 - 1)
            .i32(k as i32)
            .i32(cache_keys as i32)
            .i32(blocks as i32),
    );
    let got: Vec<i32> = got.iter().map(|v| v.to_bits() as i32).collect();
    let what = format!("topk_rows_cluster{blocks}: top {k} of {n} keys, {cache_keys} kept a block");
    assert_eq!(got, topk_twin(row, n, k), "{what}");
    println!("{what}: exact");
}

#[test]
fn topk_rows_cluster_matches_its_twin() {
    let Some(h) = Emulation::build("topk_cluster") else {
        return;
    };
    let mut rng = Rng::new(10);
    // The GLM-5 file's rows after 16K-24K positions on 4 blocks: normal scores, each block's
    // stretch kept whole, then partly (the later passes read the rest from the row).
    let row = normals(&mut rng, 16385);
    check_topk_cluster(&h, &row, 2048, 4128, 4);
    check_topk_cluster(&h, &row, 2048, 1000, 4);
    // Few values, 8 of every 10 sharing their top bytes: the boundary's ties across the blocks'
    // stretches (the placement after the blocks before), on 4 and 8 blocks.
    let row = few_values(&mut rng, 24000);
    check_topk_cluster(&h, &row, 2048, 6016, 4);
    check_topk_cluster(&h, &row, 2048, 3008, 8);
    // Fewer keys than k: all of them, then -1 (block 0 alone writes).
    check_topk_cluster(&h, &row[..1500], 2048, 384, 4);
}
