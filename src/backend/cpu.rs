//! The CPU backend: the f32 reference every other backend is checked against.
//!
//! Activations are plain row-major `Vec<f32>`; quantized weights stay in the file's blocks and
//! each row is dotted in place with `quant::dot` (only the small per-head k_b / v_b matrices
//! and the vectors are dequantized, once, at load). Work is spread with rayon over output
//! rows, heads and experts. Sums that decide softmax weights use f64.

use super::{Backend, BackendError, IndexKeys, Rope, WeightRole};
use crate::gguf::GgmlType;
use crate::quant;
use crate::weights::{MappedBytes, TensorRef};
use rayon::prelude::*;
use std::ops::Range;

/// The CPU backend. Threads come from rayon's global pool.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

/// An activation matrix `[rows, cols]`, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    /// [rows * cols]
    pub data: Vec<f32>,
}

impl Mat {
    fn zeros(rows: usize, cols: usize) -> Mat {
        Mat {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        }
    }

    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// A weight: the file's bytes, plus an f32 copy for `Heads` and `Vector` roles.
pub struct CpuWeight {
    ggml_type: GgmlType,
    /// ggml order, `ne[0]` the row length.
    ne: Vec<usize>,
    bytes: MappedBytes,
    /// Dequantized values [n_elements] (Heads and Vector roles only).
    values: Option<Vec<f32>>,
}

impl CpuWeight {
    fn row_bytes(&self) -> usize {
        self.ggml_type
            .row_bytes(self.ne[0])
            .expect("checked at load")
    }

    /// Row `r` of the weight viewed as a stack of rows of `ne[0]` elements.
    fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes.as_slice()[r * rb..(r + 1) * rb]
    }

    fn values(&self) -> &[f32] {
        self.values
            .as_deref()
            .expect("only Heads and Vector weights are dequantized")
    }
}

/// `y[t] = W x[t]` for the rows `rows` of `w` (a contiguous block of a stack of matrices):
/// returns [n, rows.len()].
fn matmul_rows(x: &Mat, w: &CpuWeight, rows: Range<usize>) -> Mat {
    let n = x.rows;
    let out = rows.len();
    // Parallel over output rows; each row of the weight is read once for all tokens.
    let columns: Vec<Vec<f32>> = rows
        .into_par_iter()
        .map(|r| {
            let row = w.row(r);
            (0..n)
                .map(|t| quant::dot(w.ggml_type, row, x.row(t)))
                .collect()
        })
        .collect();
    let mut y = Mat::zeros(n, out);
    for (j, col) in columns.iter().enumerate() {
        for (t, v) in col.iter().enumerate() {
            y.data[t * out + j] = *v;
        }
    }
    y
}

/// The DSA indexer's scores of query t of q [n, nh*d] (position pos0 + t) against the keys
/// [>= pos0 + n, d] it may see, positions 0..=pos0 + t: sum over heads h of
/// head_weights[t, h] relu(scale q_h . k). (Public for the GPU tests, which judge the GPU's
/// near-tie choices by them.)
pub fn dsa_scores(
    q: &Mat,
    keys: &Mat,
    head_weights: &Mat,
    t: usize,
    pos0: usize,
    scale: f32,
) -> Vec<f64> {
    let d = keys.cols;
    let (qt, wt) = (q.row(t), head_weights.row(t));
    (0..=pos0 + t)
        .map(|s| {
            (0..head_weights.cols)
                .map(|h| {
                    let dotp = dot64(&qt[h * d..(h + 1) * d], keys.row(s)) as f32;
                    wt[h] as f64 * (dotp * scale).max(0.0) as f64
                })
                .sum::<f64>()
        })
        .collect()
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Which keys query `t` (at position `pos`) may see: causal, then the DSA selection if any.
fn visible_keys(pos: usize, t: usize, keep: Option<&[i32]>, n_queries: usize) -> Vec<usize> {
    match keep {
        None => (0..=pos).collect(),
        Some(keep) => {
            let top_k = keep.len() / n_queries;
            let mut keys: Vec<usize> = keep[t * top_k..(t + 1) * top_k]
                .iter()
                .filter(|&&s| s >= 0 && s as usize <= pos)
                .map(|&s| s as usize)
                .collect();
            keys.sort_unstable();
            keys.dedup();
            keys
        }
    }
}

/// Softmax over `scores` in f64, returned as weights.
fn softmax64(scores: &[f64]) -> Vec<f64> {
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// Attention's output for one query and head: the softmax of `scores` (one per key) weighting
/// the keys' value rows, summed in f64 into `out` [dv].
fn softmax_weighted_values<'a>(
    out: &mut [f32],
    keys: &[usize],
    scores: &[f64],
    value_row: impl Fn(usize) -> &'a [f32],
) {
    let p = softmax64(scores);
    let mut acc = vec![0.0f64; out.len()];
    for (&s, ps) in keys.iter().zip(&p) {
        for (a, v) in acc.iter_mut().zip(value_row(s)) {
            *a += ps * *v as f64;
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = a as f32;
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// One layer's latent cache: `values` [capacity, kv_lora + dr] rows `[c_kv | k_pe]`, in f32.
pub struct CpuLatent {
    values: Mat,
    kv_lora: usize,
}

impl Backend for Cpu {
    type Tensor = Mat;
    type Weight = CpuWeight;
    type Ids = Vec<i32>;
    type Latent = CpuLatent;
    type Pick = u32;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn load_weight(&self, t: &TensorRef, role: WeightRole) -> Result<CpuWeight, BackendError> {
        if !quant::supported(t.ggml_type) {
            return Err(BackendError::UnsupportedType {
                tensor: t.name.clone(),
                ggml_type: t.ggml_type,
                backend: "cpu",
            });
        }
        let expected = t.ggml_type.row_bytes(t.ne[0]).map(|rb| rb * t.n_rows());
        if expected != Some(t.bytes.as_slice().len()) {
            return Err(BackendError::BadWeight {
                tensor: t.name.clone(),
                reason: format!(
                    "{} bytes for {} {:?}, expected {:?}",
                    t.bytes.as_slice().len(),
                    t.ggml_type,
                    t.ne,
                    expected
                ),
            });
        }
        let values = match role {
            WeightRole::Matrix => None,
            WeightRole::Heads | WeightRole::Vector => {
                let mut v = vec![0.0f32; t.n_elements()];
                quant::dequantize(t.ggml_type, t.bytes.as_slice(), &mut v).map_err(|e| {
                    BackendError::BadWeight {
                        tensor: t.name.clone(),
                        reason: e.to_string(),
                    }
                })?;
                Some(v)
            }
        };
        // Trailing dimensions of 1 may be absent in the file: {dn, kv_lora} is {dn, kv_lora, 1}.
        let mut ne = t.ne.clone();
        ne.resize(ne.len().max(3), 1);
        Ok(CpuWeight {
            ggml_type: t.ggml_type,
            ne,
            bytes: t.bytes.clone(),
            values,
        })
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Mat {
        assert_eq!(data.len(), rows * cols);
        Mat {
            rows,
            cols,
            data: data.to_vec(),
        }
    }

    fn download(&self, x: &Mat) -> Vec<f32> {
        x.data.clone()
    }

    fn shape(&self, x: &Mat) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn zeros(&self, rows: usize, cols: usize) -> Mat {
        Mat::zeros(rows, cols)
    }

    fn latent_cache(&self, capacity: usize, kv_lora: usize, dr: usize) -> CpuLatent {
        CpuLatent {
            values: Mat::zeros(capacity, kv_lora + dr),
            kv_lora,
        }
    }

    fn latent_bytes(&self, cache: &CpuLatent) -> usize {
        4 * cache.values.data.len()
    }

    fn latent_rows(&self, cache: &CpuLatent, rows: Range<usize>) -> (Mat, Mat) {
        let (c, width) = (&cache.values, cache.values.cols);
        (
            self.slice(c, rows.clone(), 0..cache.kv_lora),
            self.slice(c, rows, cache.kv_lora..width),
        )
    }

    fn latent_append(
        &self,
        cache: &mut CpuLatent,
        row0: usize,
        kv: &Mat,
        w: &CpuWeight,
        eps: f32,
        rope: &Rope,
        query: Option<(&Mat, &CpuWeight)>,
        index_keys: Option<IndexKeys<'_, Self>>,
    ) -> Option<Mat> {
        if let Some(k) = index_keys {
            self.index_key_append(row0, k, rope);
        }
        let (n, width) = (kv.rows, kv.cols);
        let kv_lora = cache.kv_lora;
        let c_kv = self.rms_norm(&self.slice(kv, 0..n, 0..kv_lora), w, eps);
        let mut k_pe = self.slice(kv, 0..n, kv_lora..width);
        self.rope(&mut k_pe, 1, 0, row0, rope);
        self.write_block(&mut cache.values, row0, 0, &c_kv);
        self.write_block(&mut cache.values, row0, kv_lora, &k_pe);
        query.map(|(x, w)| self.rms_norm(x, w, eps))
    }

    fn slice(&self, x: &Mat, rows: Range<usize>, cols: Range<usize>) -> Mat {
        let mut y = Mat::zeros(rows.len(), cols.len());
        for (i, r) in rows.enumerate() {
            y.data[i * y.cols..(i + 1) * y.cols].copy_from_slice(&x.row(r)[cols.clone()]);
        }
        y
    }

    fn head_columns(&self, x: &Mat, heads: usize, cols: Range<usize>) -> Mat {
        let d = x.cols / heads;
        let w = cols.len();
        let mut y = Mat::zeros(x.rows, heads * w);
        for r in 0..x.rows {
            for h in 0..heads {
                let src = &x.row(r)[h * d + cols.start..h * d + cols.end];
                y.data[r * y.cols + h * w..r * y.cols + (h + 1) * w].copy_from_slice(src);
            }
        }
        y
    }

    fn write_block(&self, dst: &mut Mat, row0: usize, col0: usize, src: &Mat) {
        for r in 0..src.rows {
            let at = (row0 + r) * dst.cols + col0;
            dst.data[at..at + src.cols].copy_from_slice(src.row(r));
        }
    }

    fn embed(&self, table: &CpuWeight, tokens: &[u32]) -> Mat {
        let e = table.ne[0];
        let mut y = Mat::zeros(tokens.len(), e);
        for (t, &id) in tokens.iter().enumerate() {
            quant::dequantize(
                table.ggml_type,
                table.row(id as usize),
                &mut y.data[t * e..(t + 1) * e],
            )
            .expect("embedding type checked at load");
        }
        y
    }

    fn embed_pick(&self, table: &CpuWeight, pick: &u32) -> Mat {
        self.embed(table, &[*pick])
    }

    fn rms_norm(&self, x: &Mat, w: &CpuWeight, eps: f32) -> Mat {
        let w = w.values();
        let mut y = x.clone();
        y.data.par_chunks_mut(x.cols).for_each(|row| {
            let ms = row.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / row.len() as f64;
            let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
            for (v, g) in row.iter_mut().zip(w) {
                *v = *v * inv * g;
            }
        });
        y
    }

    fn layer_norm(&self, x: &Mat, w: &CpuWeight, b: &CpuWeight, eps: f32) -> Mat {
        let (w, b) = (w.values(), b.values());
        let mut y = x.clone();
        y.data.par_chunks_mut(x.cols).for_each(|row| {
            let n = row.len() as f64;
            let mean = row.iter().map(|v| *v as f64).sum::<f64>() / n;
            let var = row.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / n;
            let inv = 1.0 / (var + eps as f64).sqrt();
            for ((v, g), bias) in row.iter_mut().zip(w).zip(b) {
                *v = ((*v as f64 - mean) * inv) as f32 * g + bias;
            }
        });
        y
    }

    fn add_assign(&self, x: &mut Mat, y: &Mat) {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols));
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
    }

    fn swiglu(&self, gate: &Mat, up: &Mat) -> Mat {
        let data = gate
            .data
            .iter()
            .zip(&up.data)
            .map(|(g, u)| silu(*g) * u)
            .collect();
        Mat {
            rows: gate.rows,
            cols: gate.cols,
            data,
        }
    }

    fn rope(&self, x: &mut Mat, heads: usize, col0: usize, pos0: usize, rope: &Rope) {
        let d = x.cols / heads;
        let cols = x.cols;
        for (r, row) in x.data.chunks_mut(cols).enumerate() {
            let pos = (pos0 + r) as f32;
            for (i, inv_freq) in rope.inv_freq.iter().enumerate() {
                let angle = pos * inv_freq;
                let (c, s) = (
                    angle.cos() * rope.cos_sin_scale,
                    angle.sin() * rope.cos_sin_scale,
                );
                for h in 0..heads {
                    let at = h * d + col0 + 2 * i;
                    let (a, b) = (row[at], row[at + 1]);
                    row[at] = a * c - b * s;
                    row[at + 1] = b * c + a * s;
                }
            }
        }
    }

    fn linear(&self, x: &Mat, w: &CpuWeight) -> Mat {
        assert_eq!(x.cols, w.ne[0], "linear: input width vs weight row length");
        matmul_rows(x, w, 0..w.ne[1])
    }

    fn head_matmul(&self, x: &Mat, w: &CpuWeight, transpose: bool) -> Mat {
        let (a, b, heads) = (w.ne[0], w.ne[1], w.ne[2]);
        let m = w.values();
        let (d_in, d_out) = if transpose { (b, a) } else { (a, b) };
        let shared = x.cols == d_in;
        assert!(shared || x.cols == heads * d_in, "head_matmul: input width");
        let mut y = Mat::zeros(x.rows, heads * d_out);
        y.data
            .par_chunks_mut(heads * d_out)
            .enumerate()
            .for_each(|(t, out)| {
                for h in 0..heads {
                    let xin = if shared {
                        x.row(t)
                    } else {
                        &x.row(t)[h * d_in..(h + 1) * d_in]
                    };
                    let mh = &m[h * a * b..(h + 1) * a * b]; // [b rows][a cols]
                    let o = &mut out[h * d_out..(h + 1) * d_out];
                    if transpose {
                        // o[j] = sum_i M[i, j] x[i]
                        for (i, xi) in xin.iter().enumerate() {
                            for (oj, mij) in o.iter_mut().zip(&mh[i * a..(i + 1) * a]) {
                                *oj += mij * xi;
                            }
                        }
                    } else {
                        for (i, oi) in o.iter_mut().enumerate() {
                            *oi = dot64(&mh[i * a..(i + 1) * a], xin) as f32;
                        }
                    }
                }
            });
        y
    }

    fn attention(
        &self,
        q: &Mat,
        k_nope: &Mat,
        k_pe: &Mat,
        v: &Mat,
        pos0: usize,
        scale: f32,
        keep: Option<&Vec<i32>>,
    ) -> Mat {
        let n = q.rows;
        let dr = k_pe.cols;
        // q is H*(dn+dr) wide and k_nope H*dn: the difference is H*dr.
        let heads = (q.cols - k_nope.cols) / dr;
        let dn = k_nope.cols / heads;
        let dv = v.cols / heads;
        let mut y = Mat::zeros(n, heads * dv);
        y.data.par_chunks_mut(dv).enumerate().for_each(|(th, out)| {
            let (t, h) = (th / heads, th % heads);
            let qh = &q.row(t)[h * (dn + dr)..(h + 1) * (dn + dr)];
            let keys = visible_keys(pos0 + t, t, keep.map(Vec::as_slice), n);
            let scores: Vec<f64> = keys
                .iter()
                .map(|&s| {
                    let kn = &k_nope.row(s)[h * dn..(h + 1) * dn];
                    (dot64(&qh[..dn], kn) + dot64(&qh[dn..], k_pe.row(s))) * scale as f64
                })
                .collect();
            softmax_weighted_values(out, &keys, &scores, |s| &v.row(s)[h * dv..(h + 1) * dv]);
        });
        y
    }

    fn latent_attention(
        &self,
        q_lat: &Mat,
        q: &Mat,
        heads: usize,
        rope: Option<&Rope>,
        cache: &CpuLatent,
        pos0: usize,
        scale: f32,
        keep: Option<&Vec<i32>>,
    ) -> Mat {
        let n = q_lat.rows;
        let kv_lora = q_lat.cols / heads;
        let cache = &cache.values;
        let dr = cache.cols - kv_lora;
        let dn = q.cols / heads - dr;
        let mut q_pe = self.head_columns(q, heads, dn..dn + dr);
        if let Some(rope) = rope {
            self.rope(&mut q_pe, heads, 0, pos0, rope);
        }
        let mut y = Mat::zeros(n, heads * kv_lora);
        y.data
            .par_chunks_mut(kv_lora)
            .enumerate()
            .for_each(|(th, out)| {
                let (t, h) = (th / heads, th % heads);
                let ql = &q_lat.row(t)[h * kv_lora..(h + 1) * kv_lora];
                let qp = &q_pe.row(t)[h * dr..(h + 1) * dr];
                let keys = visible_keys(pos0 + t, t, keep.map(Vec::as_slice), n);
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&s| {
                        let row = cache.row(s);
                        (dot64(ql, &row[..kv_lora]) + dot64(qp, &row[kv_lora..])) * scale as f64
                    })
                    .collect();
                // The latent cache row is both key and value: its first kv_lora columns.
                softmax_weighted_values(out, &keys, &scores, |s| &cache.row(s)[..kv_lora]);
            });
        y
    }

    fn dsa_topk(
        &self,
        q: &Mat,
        keys: &Mat,
        head_weights: &Mat,
        pos0: usize,
        scale: f32,
        top_k: usize,
    ) -> Vec<i32> {
        (0..q.rows)
            .into_par_iter()
            .flat_map_iter(|t| {
                let mut ranked: Vec<(f64, usize)> =
                    dsa_scores(q, keys, head_weights, t, pos0, scale)
                        .into_iter()
                        .enumerate()
                        .map(|(s, v)| (v, s))
                        .collect();
                // Best first; equal scores keep the lower position.
                ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let mut kept: Vec<i32> =
                    ranked.iter().take(top_k).map(|&(_, s)| s as i32).collect();
                kept.sort_unstable();
                kept.resize(top_k, -1);
                kept
            })
            .collect()
    }

    fn ids_to_host(&self, ids: &Vec<i32>) -> Vec<i32> {
        ids.clone()
    }

    fn argmax_pick(&self, logits: &Mat) -> u32 {
        let cols = logits.cols;
        crate::sampling::argmax(&logits.data[logits.data.len() - cols..]) as u32
    }

    fn pick_id(&self, pick: &u32) -> u32 {
        *pick
    }

    fn moe_experts(
        &self,
        x: &Mat,
        gate: &CpuWeight,
        up: &CpuWeight,
        down: &CpuWeight,
        ids: &[u32],
        weights: &[f32],
        k: usize,
    ) -> Mat {
        let (e, f) = (gate.ne[0], gate.ne[1]);
        let n = x.rows;
        // One (token, slot) pair per task: the expert's whole FFN for that token.
        let outs: Vec<Vec<f32>> = (0..n * k)
            .into_par_iter()
            .map(|tj| {
                let (t, expert) = (tj / k, ids[tj] as usize);
                let xt = x.row(t);
                let hidden: Vec<f32> = (0..f)
                    .map(|i| {
                        let r = expert * f + i;
                        let g = quant::dot(gate.ggml_type, gate.row(r), xt);
                        let u = quant::dot(up.ggml_type, up.row(r), xt);
                        silu(g) * u
                    })
                    .collect();
                (0..e)
                    .map(|o| {
                        quant::dot(down.ggml_type, down.row(expert * e + o), &hidden) * weights[tj]
                    })
                    .collect()
            })
            .collect();
        let mut y = Mat::zeros(n, e);
        for (tj, out) in outs.iter().enumerate() {
            let t = tj / k;
            for (a, b) in y.data[t * e..(t + 1) * e].iter_mut().zip(out) {
                *a += b;
            }
        }
        y
    }
}
