//! [`Cuda`]: the [`Backend`] trait on one GPU. Activations are f32 device matrices; weights
//! stay in the file's block format on the device (vectors, a few KiB each, are dequantized to
//! f32 at load). Small batches (decode) take the matrix-vector kernels in f32; larger ones
//! (prefill) the tensor-core kernels with bf16 operands and f32 accumulation.
//!
//! The trait's methods return values, not errors: a failing launch here is a bug or a dead
//! device, and panics with the kernel's message (shapes come from a validated config).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaSlice};

use super::device::{DevicePtrRaw, Gpu};
use super::error::CudaError;
use super::kernels::LATENT_DIMS;
use super::ops::{
    latent_fits, route_f32_takes, AttentionPrefill, Combine, EmbedRows, KeyRowsNorm, LatentNorm,
    Matmul, Matvec, MatvecPart, MlaDecode, MoeRouter, PairRope, RowsNorm, KERNEL_TYPES,
};
use crate::backend::{
    latent_projections_apart, lora_query, Backend, BackendError, IndexKeys, LatentProjections,
    Rope, Tokens, WeightRole,
};
use crate::config::{Gating, MoeConfig};
use crate::gguf::ggml_type::GgmlType;
use crate::weights::{DenseFfn, TensorRef};

/// From this many rows on, products run on the tensor cores (bf16 operands); below, in f32
/// matrix-vector kernels that read each weight row once per token.
pub const MATMUL_MIN_ROWS: usize = 16;

pub struct Cuda {
    pub gpu: Gpu,
    /// Device bytes held by loaded weights.
    weight_bytes: AtomicUsize,
    /// Small f32 vectors the model hands over on every call (rope frequencies, router bias),
    /// uploaded once by content (`constant`): a copy between two kernels costs the stream a
    /// few microseconds and breaks the chain of dependent launches.
    constants: Mutex<HashMap<Vec<u32>, CudaSlice<f32>>>,
}

/// A greedy pick: the id the argmax kernel (or the lm head's launch) writes, and the mark
/// after it that the read-back waits for.
pub struct CudaPick {
    /// [1]
    id: Arc<CudaSlice<i32>>,
    done: CudaEvent,
}

/// An activation `[rows, cols]`, f32, row-major; or, with `parts` > 1, the sum in order of
/// that many [rows, cols] parts stored one after the other, summed where `add_rms_norm` reads
/// them (`Cuda::p` refuses such a tensor): the partial sums of a decode product whose k its
/// blocks took in parts (`Gpu::spread_parts`, from `residual_linear`), or with `weights` a
/// decode token's expert outputs times the router's weights (`moe_routed`: the MoE combine in
/// the residual add's launch).
pub struct CudaTensor {
    /// [parts * rows * cols] (at least one element: a zero-sized allocation has no address).
    buf: CudaSlice<f32>,
    rows: usize,
    cols: usize,
    parts: usize,
    /// [parts]: each part's weight in the sum (a part of weight 0 is not added); None: 1.
    weights: Option<CudaSlice<f32>>,
    /// [1]: the index of the largest value of a one-row tensor, where the launch that wrote it
    /// found that too (`linear` on the lm head: `Matvec::pick`), for `argmax_pick`.
    argmax: Option<Arc<CudaSlice<i32>>>,
}

impl CudaTensor {
    /// The device buffer (at least rows * cols values), for collectives (`crate::tp::nccl`).
    pub fn buf(&self) -> &CudaSlice<f32> {
        assert!(self.whole(), "a tensor of parts to sum");
        &self.buf
    }

    /// Whether the tensor is its values as they are (not parts to sum).
    fn whole(&self) -> bool {
        self.parts == 1 && self.weights.is_none()
    }

    /// The device buffer, `stored()` values, for collectives: an all-reduce sums parts as they
    /// are (each over the ranks; their weights, the same on every rank, apply after).
    pub fn buf_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.buf
    }

    /// The values stored: rows * cols of each part.
    pub fn stored(&self) -> usize {
        self.parts * self.rows * self.cols
    }
}

/// One layer's latent cache in the format the MLA decode kernel copies as it is (kernels/
/// common.cuh, `ops::latent_split`): per position LATENT_DIMS bf16 hi parts and as many lo
/// parts, the bytes of LATENT_DIMS f32 values, so `rows` is a [capacity, LATENT_DIMS] tensor
/// whose f32 words are not values.
pub struct CudaLatent {
    rows: CudaTensor,
    kv_lora: usize,
    dr: usize,
}

/// A weight in the file's format (`ty`, ggml shape `ne`); vectors are F32.
pub struct CudaWeight {
    name: String,
    ty: GgmlType,
    ne: Vec<usize>,
    /// The tensor's blocks as in the file (vectors: f32 values), row after row.
    data: CudaSlice<u8>,
}

impl CudaWeight {
    /// Bytes of one row of `ne[0]` elements.
    fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.ne[0]).expect("checked at load")
    }
    /// ne[i], 1 past the stored dimensions.
    fn dim(&self, i: usize) -> usize {
        self.ne.get(i).copied().unwrap_or(1)
    }
}

fn ok<T>(r: Result<T, CudaError>, op: &str) -> T {
    r.unwrap_or_else(|e| panic!("cuda {op}: {e}"))
}

impl Cuda {
    /// Opens GPU `ordinal` and readies every kernel (compiled by NVRTC for its exact `sm_XX`
    /// on first use, from the disk cache after): a missing driver, device or NVRTC is an error
    /// here, before any weight is loaded.
    pub fn new(ordinal: usize) -> Result<Cuda, CudaError> {
        let gpu = Gpu::new(ordinal)?;
        gpu.load_all_kernels()?;
        Ok(Cuda {
            gpu,
            weight_bytes: AtomicUsize::new(0),
            constants: Mutex::default(),
        })
    }

    /// Device bytes held by the weights loaded so far.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes.load(Ordering::Relaxed)
    }

    /// A [rows, cols] activation that the next kernel writes whole (`Gpu::empty`).
    fn empty(&self, rows: usize, cols: usize) -> CudaTensor {
        self.empty_parts(rows, cols, 1)
    }

    /// `parts` partials of a [rows, cols] activation (`CudaTensor`), written whole next.
    fn empty_parts(&self, rows: usize, cols: usize, parts: usize) -> CudaTensor {
        // At least one element: a zero-sized device allocation has no address.
        CudaTensor {
            buf: ok(self.gpu.empty((parts * rows * cols).max(1)), "alloc"),
            rows,
            cols,
            parts,
            weights: None,
            argmax: None,
        }
    }

    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> (usize, usize) {
        ok(
            self.gpu.ctx.mem_get_info().map_err(CudaError::from),
            "mem_get_info",
        )
    }

    /// The device address of element `offset` of an activation (a whole one: the kernels but
    /// add_rmsnorm do not sum parts).
    fn p(&self, x: &CudaTensor, offset: usize) -> DevicePtrRaw {
        assert!(
            x.whole(),
            "a tensor of parts to sum where a whole one is needed"
        );
        self.gpu.ptr(&x.buf, offset)
    }

    /// The device address of a weight's first byte.
    fn w(&self, w: &CudaWeight) -> DevicePtrRaw {
        self.gpu.ptr(&w.data, 0)
    }

    fn upload_i32(&self, v: &[i32]) -> CudaSlice<i32> {
        ok(self.gpu.upload(v), "upload")
    }

    /// The device address of a copy of `v`, uploaded on its first use and kept (by content)
    /// for the backend's lifetime.
    fn constant(&self, v: &[f32]) -> DevicePtrRaw {
        let key: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        let mut kept = self.constants.lock().unwrap();
        let buf = kept
            .entry(key)
            .or_insert_with(|| ok(self.gpu.upload(v), "upload"));
        self.gpu.ptr(buf, 0)
    }

    /// y [n, rows] = W x over `n` inputs for one matrix at `w` (rows of k elements), either
    /// on tensor cores or as matrix-vector products.
    #[allow(clippy::too_many_arguments)]
    fn product(
        &self,
        ty: GgmlType,
        w: DevicePtrRaw,
        rows: usize,
        k: usize,
        x: DevicePtrRaw,
        x_stride: usize,
        n: usize,
        y: DevicePtrRaw,
        y_stride: usize,
    ) {
        if n >= MATMUL_MIN_ROWS && k.is_multiple_of(32) && rows.is_multiple_of(8) {
            let a = Matmul::plain(ty, w, (x, x_stride), (y, y_stride), (n, rows, k));
            ok(self.gpu.matmul(&a), "matmul");
        } else {
            let a = Matvec {
                x_stride,
                y_stride,
                batch: n,
                ..Matvec::single(ty, w, (x, y), (rows, k))
            };
            ok(self.gpu.matvec(&a), "matvec");
        }
    }
}

impl Backend for Cuda {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Ids = CudaSlice<i32>;
    type Latent = CudaLatent;
    type Pick = CudaPick;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn load_weight(&self, t: &TensorRef, role: WeightRole) -> Result<CudaWeight, BackendError> {
        let device = |e: CudaError| BackendError::Device {
            backend: "cuda",
            reason: format!("{}: {e}", t.name),
        };
        let (ty, data) = if role == WeightRole::Vector {
            let mut v = vec![0f32; t.n_elements()];
            crate::quant::dequantize(t.ggml_type, t.bytes.as_slice(), &mut v).map_err(|e| {
                BackendError::BadWeight {
                    tensor: t.name.clone(),
                    reason: e.to_string(),
                }
            })?;
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            (GgmlType::F32, self.gpu.upload(&bytes).map_err(device)?)
        } else {
            if !KERNEL_TYPES.contains(&t.ggml_type) {
                return Err(BackendError::UnsupportedType {
                    tensor: t.name.clone(),
                    ggml_type: t.ggml_type,
                    backend: "cuda",
                });
            }
            if !t.ne[0].is_multiple_of(8) {
                return Err(BackendError::BadWeight {
                    tensor: t.name.clone(),
                    reason: format!(
                        "rows of {} elements: the CUDA kernels need a multiple of 8",
                        t.ne[0]
                    ),
                });
            }
            (
                t.ggml_type,
                self.gpu.upload(t.bytes.as_slice()).map_err(device)?,
            )
        };
        self.weight_bytes.fetch_add(data.len(), Ordering::Relaxed);
        Ok(CudaWeight {
            name: t.name.clone(),
            ty,
            ne: t.ne.clone(),
            data,
        })
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> CudaTensor {
        assert_eq!(
            data.len(),
            rows * cols,
            "upload: {} values for [{rows}, {cols}]",
            data.len()
        );
        CudaTensor {
            buf: ok(self.gpu.upload(data), "upload"),
            rows,
            cols,
            parts: 1,
            weights: None,
            argmax: None,
        }
    }

    fn download(&self, x: &CudaTensor) -> Vec<f32> {
        let stored = ok(self.gpu.download(&x.buf), "download");
        let n = x.rows * x.cols;
        if x.whole() {
            return stored;
        }
        // The parts' sum in order, as add_rmsnorm_cluster adds them.
        let weights = x
            .weights
            .as_ref()
            .map(|w| ok(self.gpu.download(w), "download"));
        let mut sum = vec![-0.0f32; n];
        for (p, part) in stored[..x.parts * n].chunks_exact(n).enumerate() {
            let c = weights.as_ref().map_or(1.0, |w| w[p]);
            if c != 0.0 {
                sum.iter_mut()
                    .zip(part)
                    .for_each(|(s, &v)| *s = c.mul_add(v, *s));
            }
        }
        sum
    }

    fn shape(&self, x: &CudaTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn zeros(&self, rows: usize, cols: usize) -> CudaTensor {
        // At least one element: a zero-sized device allocation has no address.
        CudaTensor {
            buf: ok(self.gpu.zeros((rows * cols).max(1)), "alloc"),
            rows,
            cols,
            parts: 1,
            weights: None,
            argmax: None,
        }
    }

    fn latent_cache(&self, capacity: usize, kv_lora: usize, dr: usize) -> CudaLatent {
        ok(latent_fits("latent cache", kv_lora, dr), "latent cache");
        CudaLatent {
            rows: self.zeros(capacity, LATENT_DIMS),
            kv_lora,
            dr,
        }
    }

    fn latent_bytes(&self, cache: &CudaLatent) -> usize {
        4 * cache.rows.rows * cache.rows.cols
    }

    fn latent_rows(&self, cache: &CudaLatent, rows: Range<usize>) -> (CudaTensor, CudaTensor) {
        assert!(
            rows.end <= cache.rows.rows,
            "latent_rows: {rows:?} of {}",
            cache.rows.rows
        );
        let n = rows.len();
        let (c_kv, k_pe) = (self.empty(n, cache.kv_lora), self.empty(n, cache.dr));
        ok(
            self.gpu.latent_rows(
                self.p(&cache.rows, rows.start * LATENT_DIMS),
                n,
                (cache.kv_lora, cache.dr),
                self.p(&c_kv, 0),
                self.p(&k_pe, 0),
            ),
            "latent_rows",
        );
        (c_kv, k_pe)
    }

    fn slice(&self, x: &CudaTensor, rows: Range<usize>, cols: Range<usize>) -> CudaTensor {
        assert!(
            rows.end <= x.rows && cols.end <= x.cols,
            "slice out of [{}, {}]",
            x.rows,
            x.cols
        );
        let (n, w) = (rows.len(), cols.len());
        let y = self.empty(n, w);
        let src = self.p(x, rows.start * x.cols + cols.start);
        ok(
            self.gpu
                .copy_block(src, x.cols, 0, self.p(&y, 0), w, 0, n, 1, w),
            "slice",
        );
        y
    }

    fn head_columns(&self, x: &CudaTensor, heads: usize, cols: Range<usize>) -> CudaTensor {
        let d = x.cols / heads;
        assert!(
            d * heads == x.cols && cols.end <= d,
            "head_columns: {} cols, {heads} heads",
            x.cols
        );
        let w = cols.len();
        let y = self.empty(x.rows, heads * w);
        let src = self.p(x, cols.start);
        ok(
            self.gpu.copy_block(
                src,
                x.cols,
                d,
                self.p(&y, 0),
                heads * w,
                w,
                x.rows,
                heads,
                w,
            ),
            "head_columns",
        );
        y
    }

    fn write_block(&self, dst: &mut CudaTensor, row0: usize, col0: usize, src: &CudaTensor) {
        assert!(
            row0 + src.rows <= dst.rows && col0 + src.cols <= dst.cols,
            "write_block out of bounds"
        );
        let d = self.p(dst, row0 * dst.cols + col0);
        ok(
            self.gpu.copy_block(
                self.p(src, 0),
                src.cols,
                0,
                d,
                dst.cols,
                0,
                src.rows,
                1,
                src.cols,
            ),
            "write_block",
        );
    }

    fn embed(&self, table: &CudaWeight, tokens: &[u32]) -> CudaTensor {
        self.embed_rows(table, &Tokens::Ids(tokens), None).0
    }

    fn embed_pick(&self, table: &CudaWeight, pick: &CudaPick) -> CudaTensor {
        self.embed_rows(table, &Tokens::Pick(pick), None).0
    }

    fn embed_norm(
        &self,
        table: &CudaWeight,
        tokens: &Tokens<'_, Self>,
        w: &CudaWeight,
        eps: f32,
    ) -> (CudaTensor, CudaTensor) {
        if !Gpu::embed_norms(table.ne[0]) {
            let (x, _) = self.embed_rows(table, tokens, None);
            let h = self.rms_norm(&x, w, eps);
            return (x, h);
        }
        let (x, h) = self.embed_rows(table, tokens, Some((w, eps)));
        (x, h.expect("normed in the launch"))
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaWeight, eps: f32) -> CudaTensor {
        let y = self.empty(x.rows, x.cols);
        ok(
            self.gpu.rmsnorm(
                self.p(x, 0),
                x.cols,
                self.w(w),
                self.p(&y, 0),
                x.cols,
                x.rows,
                x.cols,
                eps,
            ),
            "rmsnorm",
        );
        y
    }

    fn layer_norm(&self, x: &CudaTensor, w: &CudaWeight, b: &CudaWeight, eps: f32) -> CudaTensor {
        let y = self.empty(x.rows, x.cols);
        ok(
            self.gpu.layernorm(
                self.p(x, 0),
                x.cols,
                self.w(w),
                self.w(b),
                self.p(&y, 0),
                x.cols,
                x.rows,
                x.cols,
                eps,
                None,
            ),
            "layernorm",
        );
        y
    }

    fn index_key_append(&self, row0: usize, k: IndexKeys<'_, Self>, rope: &Rope) {
        let rows = self.index_key_rows(row0, k);
        let rope = PairRope {
            dims: rope.rot_dims(),
            pos0: row0,
            inv_freq: self.constant(&rope.inv_freq),
            mscale: rope.cos_sin_scale,
        };
        let (d, n) = (rows.width, rows.rows);
        ok(
            self.gpu.layernorm(
                rows.x,
                d,
                rows.w,
                rows.b,
                rows.y,
                d,
                n,
                d,
                rows.eps,
                Some(rope),
            ),
            "index_key_append",
        );
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols), "add_assign shapes");
        ok(
            self.gpu
                .add_inplace(self.p(x, 0), self.p(y, 0), x.rows * x.cols),
            "add_inplace",
        );
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        r: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
    ) -> CudaTensor {
        assert_eq!((x.rows, x.cols), (r.rows, r.cols), "add_rms_norm shapes");
        let y = self.empty(x.rows, x.cols);
        ok(
            self.gpu.add_rmsnorm(
                self.p(x, 0),
                (
                    self.gpu.ptr(&r.buf, 0),
                    r.parts,
                    r.weights.as_ref().map_or(0, |w| self.gpu.ptr(w, 0)),
                ),
                self.w(w),
                self.p(&y, 0),
                x.rows,
                x.cols,
                eps,
            ),
            "add_rmsnorm",
        );
        y
    }

    fn latent_append(
        &self,
        cache: &mut CudaLatent,
        row0: usize,
        kv: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        rope: &Rope,
        query: Option<(&CudaTensor, &CudaWeight)>,
        index_keys: Option<IndexKeys<'_, Self>>,
    ) -> Option<CudaTensor> {
        let (latent, q_a) = self.latent_norm(cache, row0, kv, (w, eps), rope, query, index_keys);
        ok(
            self.gpu.latent_norm_rope(kv.rows, &latent),
            "latent_norm_rope",
        );
        q_a
    }

    fn latent_projections(
        &self,
        x: &CudaTensor,
        p: LatentProjections<'_, Self>,
        cache: &mut CudaLatent,
        row0: usize,
        rope: &Rope,
    ) -> (CudaTensor, Option<CudaTensor>) {
        let ws = p.weights();
        if !self.takes_parts(x, &ws) {
            return latent_projections_apart(self, x, p, cache, row0, rope);
        }
        // One token: the products in one launch, whose last blocks norm their rows where its
        // kernel takes them (Gpu::matvec_parts: one hand-over fewer a layer, where
        // latent_norm_rope took 4.2-4.5 us of a GLM-5 layer on an H100; docs/performance.md,
        // thirty-fifth look), else latent_norm_rope after it.
        let ys: Vec<CudaTensor> = ws.iter().map(|w| self.empty(1, w.dim(1))).collect();
        let index_keys = p.index.zip(ys.get(2)).map(|(ix, x_k)| ix.with_keys(x_k));
        let query = p.q_lora.map(|(norm, _)| (&ys[0], norm));
        let (latent, q_a) = self.latent_norm(
            cache,
            row0,
            &ys[1],
            (p.kv_norm, p.eps),
            rope,
            query,
            index_keys,
        );
        let (ty, k) = (ws[0].ty, x.cols);
        if let Some((_, q_b)) = p.q_lora.filter(|_| q_a.is_some()) {
            // q_b on the bulk copies: the query's norm in its product and the cache rows in its
            // last block, so that its wait waits for no tail (docs/performance.md,
            // thirty-seventh look).
            let (q_k, q_rows) = (q_b.ne[0], q_b.dim(1));
            let x_q = (self.p(&ys[0], 0), 0);
            let mut b_mat = Matvec::single(q_b.ty, self.w(q_b), x_q, (q_rows, q_k));
            if self.gpu.query_takes(ty, k, &b_mat, &latent) {
                let q = self.empty(1, q_rows);
                b_mat.y = self.p(&q, 0);
                ok(
                    self.gpu.query_projections(
                        (ty, k),
                        self.p(x, 0),
                        &self.parts_of(&ws, &ys),
                        &latent,
                        &b_mat,
                    ),
                    "latent_projections",
                );
                return (q, q_a);
            }
        }
        let tail = self.gpu.parts_tail_takes(ty, k, &latent);
        ok(
            self.gpu.matvec_parts(
                ty,
                k,
                self.p(x, 0),
                &self.parts_of(&ws, &ys),
                tail.then_some(&latent),
            ),
            "latent_projections",
        );
        if !tail {
            ok(self.gpu.latent_norm_rope(1, &latent), "latent_norm_rope");
        }
        let x_q = ys.into_iter().next().unwrap();
        (lora_query(self, p.q_lora, x_q, q_a.as_ref()), q_a)
    }

    fn swiglu(&self, gate: &CudaTensor, up: &CudaTensor) -> CudaTensor {
        assert_eq!((gate.rows, gate.cols), (up.rows, up.cols), "swiglu shapes");
        let y = self.empty(gate.rows, gate.cols);
        ok(
            self.gpu.silu_mul(
                self.p(gate, 0),
                self.p(up, 0),
                self.p(&y, 0),
                gate.rows * gate.cols,
            ),
            "silu_mul",
        );
        y
    }

    fn rope(&self, x: &mut CudaTensor, heads: usize, col0: usize, pos0: usize, rope: &Rope) {
        self.rope_into(x, heads, col0, pos0, rope, (0, 0));
    }

    fn rope_columns(
        &self,
        x: &mut CudaTensor,
        heads: usize,
        col0: usize,
        pos0: usize,
        rope: &Rope,
    ) -> CudaTensor {
        let w = heads * rope.rot_dims();
        let y = self.empty(x.rows, w);
        self.rope_into(x, heads, col0, pos0, rope, (self.p(&y, 0), w));
        y
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight) -> CudaTensor {
        let (k, rows) = (w.ne[0], w.dim(1));
        assert_eq!(x.cols, k, "linear {}: x has {} columns", w.name, x.cols);
        let y = self.empty(x.rows, rows);
        // The lm head of one token finds its largest value in its own launch: a greedy pick
        // after it (argmax_pick) then takes that instead of a launch of its own (argmax_row,
        // ~5.4 us of an H100's decode step).
        let mut a = Matvec::single(w.ty, self.w(w), (self.p(x, 0), self.p(&y, 0)), (rows, k));
        if x.rows == 1 && self.gpu.takes_pick(&a) {
            let id = ok(self.gpu.empty_i32(1), "alloc");
            a.pick = self.gpu.ptr(&id, 0);
            ok(self.gpu.matvec(&a), "matvec");
            return CudaTensor {
                argmax: Some(Arc::new(id)),
                ..y
            };
        }
        self.product(
            w.ty,
            self.w(w),
            rows,
            k,
            self.p(x, 0),
            k,
            x.rows,
            self.p(&y, 0),
            rows,
        );
        y
    }

    fn residual_linear(&self, x: &CudaTensor, w: &CudaWeight) -> CudaTensor {
        let (k, rows) = (w.ne[0], w.dim(1));
        if x.rows != 1 {
            return self.linear(x, w);
        }
        assert_eq!(x.cols, k, "linear {}: x has {} columns", w.name, x.cols);
        // Decode: where the kernel spreads k's parts over its blocks, y is their partials.
        let mut a = Matvec::single(w.ty, self.w(w), (self.p(x, 0), 0), (rows, k));
        let parts = ok(self.gpu.spread_parts(&a), "matvec");
        let y = self.empty_parts(1, rows, parts);
        a.y = self.gpu.ptr(&y.buf, 0);
        a.y_part = if parts > 1 { rows } else { 0 };
        ok(self.gpu.matvec(&a), "matvec");
        y
    }

    fn linears(&self, x: &CudaTensor, ws: &[&CudaWeight]) -> Vec<CudaTensor> {
        if !self.takes_parts(x, ws) {
            return ws.iter().map(|w| self.linear(x, w)).collect();
        }
        let ys: Vec<CudaTensor> = ws.iter().map(|w| self.empty(1, w.dim(1))).collect();
        ok(
            self.gpu.matvec_parts(
                ws[0].ty,
                x.cols,
                self.p(x, 0),
                &self.parts_of(ws, &ys),
                None,
            ),
            "linears",
        );
        ys
    }

    fn swiglu_linear(&self, x: &CudaTensor, gate: &CudaWeight, up: &CudaWeight) -> CudaTensor {
        let (n, k, f) = (x.rows, gate.ne[0], gate.dim(1));
        assert_eq!(x.cols, k, "linear {}: x has {} columns", gate.name, x.cols);
        // Decode: gate and up in one launch where the tensor-core kernel takes the pair (item
        // t: gate for token t, item n + t: up; lab, H200: GLM-5 dense 2 x 22.4 -> 34.6 us), the
        // silu * up in the same launch (glu), or as the two parts of one CUDA-core launch (the
        // shared expert).
        let mut both = Matvec {
            batch: 2 * n,
            pair: self.w(up),
            glu: true,
            ..Matvec::single(gate.ty, self.w(gate), (self.p(x, 0), 0), (f, k))
        };
        let same = gate.ty == up.ty && (up.ne[0], up.dim(1)) == (k, f);
        if n < MATMUL_MIN_ROWS && same && self.gpu.takes_pair(&both) {
            let y = self.empty(n, f);
            both.y = self.p(&y, 0);
            ok(self.gpu.matvec(&both), "gate, up and silu");
            return y;
        }
        if !(same && self.takes_parts(x, &[gate, up])) {
            return self.swiglu(&self.linear(x, gate), &self.linear(x, up));
        }
        let gu = self.empty(2 * n, f);
        let parts = [(gate, 0), (up, f)].map(|(w, at)| MatvecPart {
            w: self.w(w),
            rows: f,
            y: self.p(&gu, at),
        });
        ok(
            self.gpu
                .matvec_parts(gate.ty, k, self.p(x, 0), &parts, None),
            "gate and up",
        );
        let y = self.empty(n, f);
        let (g, u) = (self.p(&gu, 0), self.p(&gu, n * f));
        ok(self.gpu.silu_mul(g, u, self.p(&y, 0), n * f), "silu_mul");
        y
    }

    fn head_matmul(&self, x: &CudaTensor, w: &CudaWeight, transpose: bool) -> CudaTensor {
        // Head h's input: columns h * din .. of x, or all of x (din wide) for every head.
        let din = if transpose { w.dim(1) } else { w.ne[0] };
        let head_stride = if x.cols == din { 0 } else { din };
        self.head_product(x, 0, head_stride, w, transpose)
    }

    fn head_matmul_cols(
        &self,
        x: &CudaTensor,
        heads: usize,
        cols: Range<usize>,
        w: &CudaWeight,
        transpose: bool,
    ) -> CudaTensor {
        let d = x.cols / heads;
        assert!(
            d * heads == x.cols && cols.end <= d,
            "head_matmul_cols: {} cols, {heads} heads",
            x.cols
        );
        // The kernels read x rows as float4: in place when each head's slice is 16-byte
        // aligned, else through a copy.
        if !d.is_multiple_of(4) || !cols.start.is_multiple_of(4) {
            return self.head_matmul(&self.head_columns(x, heads, cols.clone()), w, transpose);
        }
        let din = if transpose { w.dim(1) } else { w.ne[0] };
        assert_eq!(
            cols.len(),
            din,
            "head_matmul_cols {}: {} columns",
            w.name,
            cols.len()
        );
        self.head_product(x, cols.start, d, w, transpose)
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k_nope: &CudaTensor,
        k_pe: &CudaTensor,
        v: &CudaTensor,
        pos0: usize,
        scale: f32,
        keep: Option<&CudaSlice<i32>>,
    ) -> CudaTensor {
        let n = q.rows;
        let dr = k_pe.cols;
        let heads = (q.cols - k_nope.cols) / dr;
        let (dn, dv) = (k_nope.cols / heads, v.cols / heads);
        let s_len = pos0 + n;
        let words = s_len.div_ceil(32);
        // The selection as a bit mask per query row [n, words].
        let mask = keep.map(|keep| {
            let bits: CudaSlice<u32> = ok(self.gpu.zeros(n * words), "alloc");
            let ids = self.gpu.ptr(keep, 0);
            let rows_k = (n, keep.len() / n);
            let made = self
                .gpu
                .keep_mask(ids, rows_k, s_len, words, self.gpu.ptr(&bits, 0));
            ok(made, "keep_mask");
            bits
        });
        let out = self.empty(n, heads * dv);
        let a = AttentionPrefill {
            q: self.p(q, 0),
            q_tok: q.cols,
            q_head: dn + dr,
            ka: self.p(k_nope, 0),
            ka_tok: k_nope.cols,
            ka_head: dn,
            dka: dn,
            kb: self.p(k_pe, 0),
            kb_tok: dr,
            kb_head: 0,
            dkb: dr,
            v: self.p(v, 0),
            v_tok: v.cols,
            v_head: dv,
            dv,
            out: self.p(&out, 0),
            o_tok: heads * dv,
            o_head: dv,
            mask: mask.as_ref().map_or(0, |m| self.gpu.ptr(m, 0)),
            mask_words: words,
            tokens: n,
            heads,
            pos0,
            scale,
        };
        // The bf16 path (as the products: MATMUL_MIN_ROWS rows or more) on the tensor cores.
        let mma = n >= MATMUL_MIN_ROWS && ok(self.gpu.attention_prefill_mma(&a), "attention");
        if !mma {
            ok(self.gpu.attention_prefill(&a), "attention");
        }
        out
    }

    fn latent_attention(
        &self,
        q_lat: &CudaTensor,
        q: &CudaTensor,
        heads: usize,
        rope: Option<&Rope>,
        cache: &CudaLatent,
        pos0: usize,
        scale: f32,
        keep: Option<&CudaSlice<i32>>,
    ) -> CudaTensor {
        let n = q_lat.rows;
        let (dl, dr, head) = (cache.kv_lora, cache.dr, q.cols / heads);
        assert_eq!(
            (heads * dl, heads * head),
            (q_lat.cols, q.cols),
            "latent_attention: {heads} heads"
        );
        let out = self.empty(n, heads * dl);
        let a = MlaDecode {
            q_lat: self.p(q_lat, 0),
            ql_tok: q_lat.cols,
            q_pe: self.p(q, head - dr),
            qp_tok: q.cols,
            qp_head: head,
            qp_rope: rope.map_or((0, 0.0), |r| (self.constant(&r.inv_freq), r.cos_sin_scale)),
            cache: self.p(&cache.rows, 0),
            dl,
            dr,
            heads,
            tokens: n,
            pos0,
            key_ids: keep.map_or(0, |i| self.gpu.ptr(i, 0)),
            n_ids: keep.map_or(0, |k| k.len() / n.max(1)),
            scale,
            out: self.p(&out, 0),
            out_tok: heads * dl,
        };
        ok(self.gpu.mla_decode(&a), "latent_attention");
        out
    }

    fn dsa_topk(
        &self,
        q: &CudaTensor,
        keys: &CudaTensor,
        head_weights: &CudaTensor,
        pos0: usize,
        scale: f32,
        top_k: usize,
    ) -> CudaSlice<i32> {
        let n = q.rows;
        let (nh, d) = (head_weights.cols, keys.cols);
        let s_len = pos0 + n;
        let scores = self.zeros(n, s_len);
        ok(
            self.gpu.dsa_scores(
                self.p(q, 0),
                self.p(keys, 0),
                self.p(head_weights, 0),
                nh,
                d,
                n,
                s_len,
                pos0,
                scale,
                self.p(&scores, 0),
                s_len,
            ),
            "dsa_scores",
        );
        let out: CudaSlice<i32> = ok(self.gpu.zeros(n * top_k), "alloc");
        ok(
            self.gpu.topk_rows(
                self.p(&scores, 0),
                s_len,
                n,
                pos0,
                top_k,
                self.gpu.ptr(&out, 0),
            ),
            "topk_rows",
        );
        out
    }

    fn ids_to_host(&self, ids: &CudaSlice<i32>) -> Vec<i32> {
        ok(self.gpu.download(ids), "download")
    }

    fn moe_experts(
        &self,
        x: &CudaTensor,
        gate: &CudaWeight,
        up: &CudaWeight,
        down: &CudaWeight,
        ids: &[u32],
        weights: &[f32],
        k: usize,
    ) -> CudaTensor {
        let (n, e) = (x.rows, x.cols);
        let f = gate.dim(1);
        let rows = n * k;
        let (gate_bytes, down_bytes) = (f * gate.row_bytes(), e * down.row_bytes());
        let d_out = self.empty(rows, e);
        // Row r of the expert outputs belongs to (token, choice) slots[t * k + j] == r.
        let slots: Vec<i32>;
        if n < MATMUL_MIN_ROWS {
            let eids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
            let ids = self.upload_i32(&eids);
            self.experts_per_choice(x, (gate, up, down), None, &ids, k, &d_out, None);
            slots = (0..rows as i32).collect();
        } else {
            // Group the (token, choice) pairs by expert: each expert's tokens are gathered by
            // the tensor-core kernel through row_ids, its outputs land in consecutive rows.
            let g_out = self.empty(rows, f);
            let u_out = self.empty(rows, f);
            let n_exp = gate.dim(2);
            let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); n_exp];
            for (slot, &id) in ids.iter().enumerate() {
                by_expert[id as usize].push(slot);
            }
            let mut order: Vec<usize> = Vec::with_capacity(rows); // slot of each output row
            let mut token_of_row = Vec::with_capacity(rows);
            let mut spans = Vec::new(); // (expert, first row, count)
            for (ex, list) in by_expert.iter().enumerate() {
                if !list.is_empty() {
                    spans.push((ex, order.len(), list.len()));
                    order.extend(list);
                    token_of_row.extend(list.iter().map(|&s| (s / k) as i32));
                }
            }
            let dtok = self.upload_i32(&token_of_row);
            let mut slot_rows = vec![0i32; rows];
            for (r, &s) in order.iter().enumerate() {
                slot_rows[s] = r as i32;
            }
            slots = slot_rows;
            // One grouped launch per product for all experts: block z takes span z.
            let table: Vec<i32> = spans
                .iter()
                .flat_map(|&(ex, r0, count)| [ex as i32, r0 as i32, count as i32])
                .collect();
            let dspans = self.upload_i32(&table);
            let max_count = spans.iter().map(|s| s.2).max().unwrap_or(0);
            let grouped = |w: &CudaWeight,
                           bytes: usize,
                           nn,
                           kk,
                           (x, x_stride, x_rows): (DevicePtrRaw, usize, usize),
                           row_ids,
                           y: &CudaTensor| Matmul {
                row_ids,
                x_rows,
                spans: self.gpu.ptr(&dspans, 0),
                n_spans: spans.len(),
                span_rows: rows,
                mat_stride: bytes,
                ..Matmul::plain(
                    w.ty,
                    self.w(w),
                    (x, x_stride),
                    (self.p(y, 0), nn),
                    (max_count, nn, kk),
                )
            };
            let tok = self.gpu.ptr(&dtok, 0);
            for (w, out, what) in [(gate, &g_out, "moe gate"), (up, &u_out, "moe up")] {
                let a = grouped(w, gate_bytes, f, e, (self.p(x, 0), e, n), tok, out);
                ok(self.gpu.matmul(&a), what);
            }
            ok(
                self.gpu.silu_mul(
                    self.p(&g_out, 0),
                    self.p(&u_out, 0),
                    self.p(&g_out, 0),
                    rows * f,
                ),
                "moe silu",
            );
            ok(
                self.gpu.matmul(&grouped(
                    down,
                    down_bytes,
                    e,
                    f,
                    (self.p(&g_out, 0), f, rows),
                    0,
                    &d_out,
                )),
                "moe down",
            );
        }
        let (dslots, dw) = (
            self.upload_i32(&slots),
            ok(self.gpu.upload(weights), "upload"),
        );
        self.combine(&d_out, Some(&dslots), &dw, n, k)
    }

    fn argmax_pick(&self, logits: &CudaTensor) -> CudaPick {
        let (rows, cols) = (logits.rows, logits.cols);
        let id = match &logits.argmax {
            Some(id) => id.clone(),
            None => {
                let id = ok(self.gpu.empty_i32(1), "alloc");
                let last = self.p(logits, (rows - 1) * cols);
                ok(
                    self.gpu.argmax_row(last, cols, self.gpu.ptr(&id, 0)),
                    "argmax",
                );
                Arc::new(id)
            }
        };
        let done = ok(self.gpu.mark(), "event");
        CudaPick { id, done }
    }

    fn pick_id(&self, pick: &CudaPick) -> u32 {
        ok(self.gpu.read_after(&pick.id, &pick.done), "download")[0] as u32
    }

    fn moe_routed(
        &self,
        x: &CudaTensor,
        router_w: &CudaWeight,
        bias: Option<&[f32]>,
        m: &MoeConfig,
        held: &Range<usize>,
        (gate, up, down): (&CudaWeight, &CudaWeight, &CudaWeight),
        shared: Option<&DenseFfn<CudaWeight>>,
    ) -> Option<(CudaTensor, bool)> {
        let n = x.rows;
        let all_held = *held == (0..m.n_expert);
        if n >= MATMUL_MIN_ROWS && !all_held {
            return None; // a TP rank's prefill: routed and grouped on the host (moe_experts)
        }
        let k = m.n_used;
        // Decode: the shared expert as choice k + 1 of every token where the tensor-core
        // products take it (saves its four launches: gate and up, silu, down, the add).
        let with_shared = n < MATMUL_MIN_ROWS
            && all_held
            && shared.is_some_and(|s| self.shared_as_choice(x, (gate, up, down), s, k + 1));
        let row = k + with_shared as usize; // choices per token
        let dids = ok(self.gpu.empty_i32(n * row), "alloc");
        let dw = self.empty(n, row);
        let dim = router_w.ne[0];
        assert_eq!(
            x.cols, dim,
            "router {}: x has {} columns",
            router_w.name, x.cols
        );
        // Decode with an f32 router: the product and the choice in one launch.
        let (xp, wp) = (self.p(x, 0), self.w(router_w));
        let fused =
            n < MATMUL_MIN_ROWS && router_w.ty == GgmlType::F32 && route_f32_takes(dim, xp, wp);
        let logits = if fused {
            self.empty(n, m.n_expert) // the kernel writes them
        } else {
            self.linear(x, router_w)
        };
        let router = MoeRouter {
            logits: self.p(&logits, 0),
            bias: bias.map_or(0, |b| self.constant(b)),
            n_exp: m.n_expert,
            k,
            gating: match m.gating {
                Gating::Softmax => 1,
                Gating::Sigmoid => 2,
            },
            n_group: m.n_group,
            group_used: m.n_group_used,
            norm: m.weights_norm,
            scale: m.weights_scale,
            tokens: n,
            held: held.clone(),
            shared: with_shared,
            ids: self.gpu.ptr(&dids, 0),
            weights: self.p(&dw, 0),
        };
        if fused {
            ok(self.gpu.moe_route_f32(&router, (xp, wp, dim)), "moe route");
        } else {
            ok(self.gpu.moe_router(&router), "moe router");
        }
        if n >= MATMUL_MIN_ROWS {
            // Prefill: the choices come to the host (n * k ids, not n * n_expert logits) to be
            // grouped by expert for the tensor-core products.
            let ids: Vec<u32> = ok(self.gpu.download(&dids), "download")
                .into_iter()
                .map(|e| e as u32)
                .collect();
            let weights = self.download(&dw);
            let out = self.moe_experts(x, gate, up, down, &ids, &weights, k);
            return Some((out, false));
        }
        let d_out = self.empty(n * row, x.cols);
        // Whether the output goes to the caller as it is (no shared expert added to it there).
        let whole_output = with_shared || shared.is_none();
        let shared = shared.filter(|_| with_shared);
        // The combine in the down product's launch where every choice runs here.
        let out = all_held.then(|| self.empty(n, x.cols));
        let combine = out.as_ref().map(|out| Combine {
            weights: self.p(&dw, 0),
            out: self.p(out, 0),
            choices: row,
        });
        if self.experts_per_choice(x, (gate, up, down), shared, &dids, row, &d_out, combine) {
            return Some((
                out.expect("a combine only where every choice is held"),
                with_shared,
            ));
        }
        if n == 1 && all_held && whole_output && self.gpu.clusters {
            // One token: its choices' rows are the parts of the output, weighted by the router
            // where the next residual add reads them (the combine in that launch).
            let out = CudaTensor {
                buf: d_out.buf,
                rows: 1,
                cols: x.cols,
                parts: row,
                weights: Some(dw.buf),
                argmax: None,
            };
            return Some((out, with_shared));
        }
        Some((self.combine(&d_out, None, &dw.buf, n, row), with_shared))
    }
}

impl Cuda {
    /// `rope` of x, the rotated values also to `copy` (address, row stride) when not 0.
    fn rope_into(
        &self,
        x: &mut CudaTensor,
        heads: usize,
        col0: usize,
        pos0: usize,
        rope: &Rope,
        copy: (DevicePtrRaw, usize),
    ) {
        let head = x.cols / heads;
        ok(
            self.gpu.rope_pairs(
                self.p(x, col0),
                x.cols,
                head,
                x.rows,
                heads,
                rope.rot_dims(),
                pos0,
                self.constant(&rope.inv_freq),
                rope.cos_sin_scale,
                copy,
            ),
            "rope",
        );
    }

    /// Where `index_key_append` reads and writes `k`'s rows (the first at row0 of its cache).
    fn index_key_rows(&self, row0: usize, k: IndexKeys<'_, Self>) -> KeyRowsNorm {
        let d = k.keys.cols;
        assert!(
            k.x_k.cols == d && row0 + k.x_k.rows <= k.keys.rows,
            "index_key_append: [{}, {}] into rows {row0}.. of [{}, {d}]",
            k.x_k.rows,
            k.x_k.cols,
            k.keys.rows
        );
        KeyRowsNorm {
            x: self.p(k.x_k, 0),
            w: self.w(k.norm.0),
            b: self.w(k.norm.1),
            y: self.p(k.keys, row0 * d),
            rows: k.x_k.rows,
            width: d,
            eps: k.eps,
        }
    }

    /// The embedding rows of `tokens` and, with `norm`, their RMSNorm in the same launch.
    fn embed_rows(
        &self,
        table: &CudaWeight,
        tokens: &Tokens<'_, Self>,
        norm: Option<(&CudaWeight, f32)>,
    ) -> (CudaTensor, Option<CudaTensor>) {
        let e = table.ne[0];
        let dids;
        let (rows, n) = match tokens {
            Tokens::Ids([token]) => (EmbedRows::One(*token), 1),
            Tokens::Ids(ids) => {
                let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
                dids = self.upload_i32(&ids);
                (EmbedRows::Ids(self.gpu.ptr(&dids, 0), ids.len()), ids.len())
            }
            Tokens::Pick(pick) => (EmbedRows::Ids(self.gpu.ptr(&pick.id, 0), 1), 1),
        };
        let y = self.empty(n, e);
        let h = norm.map(|_| self.empty(n, e));
        let rows_norm = norm.zip(h.as_ref()).map(|((w, eps), h)| {
            let norm = RowsNorm {
                x: self.p(&y, 0),
                w: self.w(w),
                y: self.p(h, 0),
                width: e,
            };
            (norm, eps)
        });
        let embedded = self.gpu.embed(
            table.ty,
            self.w(table),
            e,
            rows,
            self.p(&y, 0),
            rows_norm.as_ref().map(|(n, eps)| (n, *eps)),
        );
        ok(embedded, "embed");
        (y, h)
    }

    /// The matrices of a parts launch and their outputs.
    fn parts_of(&self, ws: &[&CudaWeight], ys: &[CudaTensor]) -> Vec<MatvecPart> {
        ws.iter()
            .zip(ys)
            .map(|(w, y)| MatvecPart {
                w: self.w(w),
                rows: w.dim(1),
                y: self.p(y, 0),
            })
            .collect()
    }

    /// `latent_append`'s norms of the rows of kv (and of the query and index keys) into
    /// `cache` from row0, as `LatentNorm` (ops.rs) gives them to a launch, and the query's
    /// output.
    #[allow(clippy::too_many_arguments)]
    fn latent_norm(
        &self,
        cache: &CudaLatent,
        row0: usize,
        kv: &CudaTensor,
        (w, eps): (&CudaWeight, f32),
        rope: &Rope,
        query: Option<(&CudaTensor, &CudaWeight)>,
        index_keys: Option<IndexKeys<'_, Self>>,
    ) -> (LatentNorm, Option<CudaTensor>) {
        let dr = rope.rot_dims();
        assert!(
            (kv.cols, dr) == (cache.kv_lora + cache.dr, cache.dr)
                && row0 + kv.rows <= cache.rows.rows,
            "latent_append: [{}, {}] at row {row0} of {} positions of {} + {}",
            kv.rows,
            kv.cols,
            cache.rows.rows,
            cache.kv_lora,
            cache.dr
        );
        let q_out = query.map(|(x, _)| {
            assert_eq!(x.rows, kv.rows, "latent_append: query rows");
            self.empty(x.rows, x.cols)
        });
        let q_norm = query.zip(q_out.as_ref()).map(|((x, qw), y)| RowsNorm {
            x: self.p(x, 0),
            w: self.w(qw),
            y: self.p(y, 0),
            width: x.cols,
        });
        let keys = index_keys.map(|k| {
            assert_eq!(k.x_k.rows, kv.rows, "latent_append: index key rows");
            self.index_key_rows(row0, k)
        });
        let latent = LatentNorm::new(
            self.p(kv, 0),
            self.w(w),
            self.p(&cache.rows, row0 * LATENT_DIMS),
            kv.rows,
            (cache.kv_lora, dr),
            row0,
            (self.constant(&rope.inv_freq), rope.cos_sin_scale),
            eps,
            q_norm.as_ref(),
            keys.as_ref(),
        );
        (ok(latent, "latent_norm_rope"), q_out)
    }

    /// Whether `linears(x, ws)` runs as one parts launch (`Gpu::matvec_parts`): one token, two
    /// or three matrices of one type and row length that each run on the CUDA-core kernel.
    fn takes_parts(&self, x: &CudaTensor, ws: &[&CudaWeight]) -> bool {
        x.rows == 1
            && (2..=3).contains(&ws.len())
            && ws.iter().all(|w| {
                let a = Matvec::single(w.ty, self.w(w), (0, 0), (w.dim(1), w.ne[0]));
                w.ty == ws[0].ty && w.ne[0] == x.cols && self.gpu.on_cuda_cores(&a)
            })
    }

    /// Per-head products (`Backend::head_matmul`) where head h reads its input row at
    /// `x[t, col0 + h * head_stride ..]` (`head_stride` 0: one input shared by every head).
    /// x's rows must hold `heads * head_stride` columns for the matrix-vector path's item
    /// stride (x is [n, heads * head_stride] or [n, din] when shared).
    fn head_product(
        &self,
        x: &CudaTensor,
        col0: usize,
        head_stride: usize,
        w: &CudaWeight,
        transpose: bool,
    ) -> CudaTensor {
        // Head h is a matrix of b rows and a columns, b * row_bytes apart.
        let (a, b, heads) = (w.ne[0], w.dim(1), w.dim(2));
        let head_bytes = b * w.row_bytes();
        let (din, dout) = if transpose { (b, a) } else { (a, b) };
        let shared = head_stride == 0;
        assert!(
            if shared {
                col0 + din <= x.cols
            } else {
                x.cols == heads * head_stride && col0 + din <= head_stride
            },
            "head_matmul {}: x has {} columns",
            w.name,
            x.cols
        );
        let n = x.rows;
        let y = self.empty(n, heads * dout);
        if n < MATMUL_MIN_ROWS || din % 32 != 0 {
            // One f32 matrix-vector item per (token, head), matrix index = head; item
            // b = t * heads + h reads x + col0 + (b / x_group) * x_stride. One token (decode)
            // needs no ids: item h is matrix h, and a copy to the device between two kernels
            // would stall the chain of programmatic launches twice a layer.
            let dids = (n > 1).then(|| {
                let ids: Vec<i32> = (0..n * heads).map(|i| (i % heads) as i32).collect();
                self.upload_i32(&ids)
            });
            let (x_group, x_stride) = if shared {
                (heads, x.cols)
            } else {
                (1, head_stride)
            };
            let mv = Matvec {
                ty: w.ty,
                w: self.w(w),
                mat_stride: head_bytes,
                ids: dids.as_ref().map_or(0, |d| self.gpu.ptr(d, 0)),
                rows: b,
                k: a,
                x: self.p(x, col0),
                x_group,
                x_stride,
                y: self.p(&y, 0),
                y_stride: dout,
                batch: n * heads,
                transposed: transpose,
                pair: 0,
                glu: false,
                combine: None,
                shared: (0, 0),
                y_part: 0,
                pick: 0,
            };
            ok(self.gpu.matvec(&mv), "head_matmul");
            return y;
        }
        // All heads in one batched launch: head h is matrix h, its x columns
        // col0 + h * head_stride, its y columns h * dout.
        let mm = Matmul {
            transposed: transpose,
            n_spans: heads,
            mat_stride: head_bytes,
            x_mat_stride: head_stride,
            y_mat_stride: dout,
            ..Matmul::plain(
                w.ty,
                self.w(w),
                (self.p(x, col0), x.cols),
                (self.p(&y, 0), heads * dout),
                (n, dout, din),
            )
        };
        ok(self.gpu.matmul(&mm), "head_matmul");
        y
    }

    /// Decode-sized MoE: row t * k + j of `d_out` [n * k, E] = expert ids[t * k + j] (on the
    /// device; MOE_SHARED: the shared expert, where `shared` is given) applied to token t, as
    /// batched matrix-vector products (gate and up, silu, down). An id of -1 (a choice another
    /// rank holds) leaves its rows unwritten: the matvec skips such items. Gate, up and the
    /// silu run as one launch where the kernel takes the pair (measured on an H200: GLM-5
    /// experts 2 x 23.7 -> 39.2 us for the pair), else one after the other. With `combine`
    /// (every choice held), the down product sums each token's rows in its own launch where the
    /// kernel takes it: returns whether it did (else `d_out` holds the rows to combine).
    #[allow(clippy::too_many_arguments)]
    fn experts_per_choice(
        &self,
        x: &CudaTensor,
        (gate, up, down): (&CudaWeight, &CudaWeight, &CudaWeight),
        shared: Option<&DenseFfn<CudaWeight>>,
        ids: &CudaSlice<i32>,
        k: usize,
        d_out: &CudaTensor,
        combine: Option<Combine>,
    ) -> bool {
        let rows = x.rows * k;
        let f = gate.dim(1);
        // Gate outputs in rows 0 .. rows, up outputs after them.
        let gu_out = self.empty(2 * rows, f);
        let g_out = self.p(&gu_out, 0);
        let (gate_item, both, down_item) = self.expert_items(
            x,
            (gate, up, down),
            shared,
            self.gpu.ptr(ids, 0),
            k,
            (g_out, self.p(d_out, 0)),
        );
        if gate.ty == up.ty && self.gpu.takes_pair(&both) {
            ok(self.gpu.matvec(&both), "moe gate, up and silu");
        } else {
            ok(self.gpu.matvec(&gate_item), "moe gate");
            let up_item = Matvec {
                w: self.w(up),
                y: self.p(&gu_out, rows * f),
                shared: (both.shared.1, 0),
                ..gate_item
            };
            ok(self.gpu.matvec(&up_item), "moe up");
            ok(
                self.gpu
                    .silu_mul(g_out, self.p(&gu_out, rows * f), g_out, rows * f),
                "moe silu",
            );
        }
        let combined = Matvec {
            combine,
            ..down_item
        };
        if combine.is_some() && self.gpu.takes_combine(&combined) {
            ok(self.gpu.matvec(&combined), "moe down and combine");
            return true;
        }
        ok(self.gpu.matvec(&down_item), "moe down");
        false
    }

    /// The launches of `experts_per_choice` for `k` choices per token: the gate experts (into
    /// `gu_out`), gate and up as a pair with the silu (silu(gate) * up into `gu_out`), the down
    /// experts (from `gu_out` into `d_out`).
    fn expert_items(
        &self,
        x: &CudaTensor,
        (gate, up, down): (&CudaWeight, &CudaWeight, &CudaWeight),
        shared: Option<&DenseFfn<CudaWeight>>,
        ids: DevicePtrRaw,
        k: usize,
        (gu_out, d_out): (DevicePtrRaw, DevicePtrRaw),
    ) -> (Matvec, Matvec, Matvec) {
        let (e, f, rows) = (x.cols, gate.dim(1), x.rows * k);
        let sw = |w: fn(&DenseFfn<CudaWeight>) -> &CudaWeight| shared.map_or(0, |s| self.w(w(s)));
        let item =
            |w: &CudaWeight, (rows_w, k_w): (usize, usize), x, x_group, x_stride, y| Matvec {
                ty: w.ty,
                w: self.w(w),
                mat_stride: rows_w * w.row_bytes(),
                ids,
                rows: rows_w,
                k: k_w,
                x,
                x_group,
                x_stride,
                y,
                y_stride: rows_w,
                batch: rows,
                transposed: false,
                pair: 0,
                glu: false,
                combine: None,
                shared: (0, 0),
                y_part: 0,
                pick: 0,
            };
        let gate_item = Matvec {
            shared: (sw(|s| &s.gate), 0),
            ..item(gate, (f, e), self.p(x, 0), k, e, gu_out)
        };
        let both = Matvec {
            pair: self.w(up),
            glu: true,
            batch: 2 * rows,
            shared: (sw(|s| &s.gate), sw(|s| &s.up)),
            ..gate_item
        };
        let down_item = Matvec {
            shared: (sw(|s| &s.down), 0),
            ..item(down, (e, f), gu_out, 1, f, d_out)
        };
        (gate_item, both, down_item)
    }

    /// Whether the shared expert can run as choice `k` of every token of `x` (ids MOE_SHARED):
    /// its matrices of the experts' types and shapes, and the gate-up pair and the down product
    /// on the tensor-core kernels, which take a shared matrix.
    fn shared_as_choice(
        &self,
        x: &CudaTensor,
        experts: (&CudaWeight, &CudaWeight, &CudaWeight),
        s: &DenseFfn<CudaWeight>,
        k: usize,
    ) -> bool {
        let like = |a: &CudaWeight, b: &CudaWeight| {
            a.ty == b.ty && (a.ne[0], a.dim(1)) == (b.ne[0], b.dim(1))
        };
        let (gate, up, down) = experts;
        if !(like(&s.gate, gate) && like(&s.up, up) && like(&s.down, down) && gate.ty == up.ty) {
            return false;
        }
        // Any nonzero id address, no outputs: the kernel choice only asks whether there are ids.
        let (_, both, down_item) = self.expert_items(x, experts, Some(s), 1, k, (0, 0));
        self.gpu.takes_pair(&both)
            && self.gpu.takes_shared(&both)
            && self.gpu.takes_shared(&down_item)
    }

    /// out [n, E] = sum_j weights[t, j] * d_out[slots[t, j]] (moe_combine); no slots: row
    /// t k + j.
    fn combine(
        &self,
        d_out: &CudaTensor,
        slots: Option<&CudaSlice<i32>>,
        weights: &CudaSlice<f32>,
        n: usize,
        k: usize,
    ) -> CudaTensor {
        let e = d_out.cols;
        let out = self.empty(n, e);
        ok(
            self.gpu.moe_combine(
                self.p(d_out, 0),
                slots.map_or(0, |s| self.gpu.ptr(s, 0)),
                self.gpu.ptr(weights, 0),
                n,
                k,
                e,
                self.p(&out, 0),
            ),
            "moe combine",
        );
        out
    }
}
