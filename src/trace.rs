//! Named stage taps: the one list of stage names, a recorder the model writes into, and the
//! comparison that finds where two runs part ways.
//!
//! A stage is `[tokens, ...]` f32 (ids as i32) named `L{i}.{stage}` inside layers and plainly
//! outside (`embed`, `final_norm`, `logits`). golden/README.md documents each one; golden/'s
//! capture script writes the same names, so an engine trace and a reference diff directly.
//! Recording the same name again appends rows: a prefill of k tokens followed by decode steps
//! yields the same trace as one prefill of all tokens.

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::Path;

/// Stages outside the layers, before them.
pub const PRE_STAGES: &[&str] = &["embed"];
/// Stages of every layer, in forward order (`L{i}.` prefixed).
pub const LAYER_STAGES: &[&str] = &[
    "attn_norm",
    "q",
    "q_pe",
    "c_kv",
    "k_pe",
    "dsa_topk",
    "attn_core",
    "attn_out",
    "h_attn",
    "ffn_norm",
    "ffn_out",
    "router_logits",
    "topk_ids",
    "topk_weights",
    "moe_out",
    "shared_out",
    "h_out",
];
/// Stages after the layers.
pub const POST_STAGES: &[&str] = &["final_norm", "logits"];

/// Every stage name of a model with `n_layer` layers, in forward order.
pub fn stage_order(n_layer: usize) -> Vec<String> {
    let mut names: Vec<String> = PRE_STAGES.iter().map(|s| s.to_string()).collect();
    for il in 0..n_layer {
        names.extend(LAYER_STAGES.iter().map(|s| format!("L{il}.{s}")));
    }
    names.extend(POST_STAGES.iter().map(|s| s.to_string()));
    names
}

/// Rank of `name` in forward order (unknown names sort last, alphabetically).
fn order_key(name: &str) -> (usize, usize, usize) {
    if let Some(i) = PRE_STAGES.iter().position(|s| *s == name) {
        return (0, 0, i);
    }
    if let Some(i) = POST_STAGES.iter().position(|s| *s == name) {
        return (2, 0, i);
    }
    if let Some((layer, stage)) = name.strip_prefix('L').and_then(|r| r.split_once('.')) {
        if let (Ok(il), Some(i)) = (
            layer.parse::<usize>(),
            LAYER_STAGES.iter().position(|s| *s == stage),
        ) {
            return (1, il, i);
        }
    }
    (3, 0, 0)
}

#[derive(Clone, Debug, PartialEq)]
pub enum StageData {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

/// One recorded stage: `[rows, cols]` (1-D stages have cols = 0 and `shape` of length 1).
#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    pub shape: Vec<usize>,
    pub data: StageData,
}

impl Stage {
    pub fn f32(&self) -> Option<&[f32]> {
        match &self.data {
            StageData::F32(v) => Some(v),
            StageData::I32(_) => None,
        }
    }

    pub fn i32(&self) -> Option<&[i32]> {
        match &self.data {
            StageData::I32(v) => Some(v),
            StageData::F32(_) => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{}: {source}", .path.display())]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a safetensors file: {reason}", .path.display())]
    Format {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("{}: tensor {name}: dtype {dtype}, expected F32 or I32", .path.display())]
    Dtype {
        path: std::path::PathBuf,
        name: String,
        dtype: String,
    },
}

/// Recorded stages by name, in the order first recorded.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    names: Vec<String>,
    stages: HashMap<String, Stage>,
}

impl Trace {
    pub fn new() -> Trace {
        Trace::default()
    }

    /// Records `[rows, cols]` under `name`, appending rows if the name was recorded before.
    pub fn record(&mut self, name: &str, rows: usize, cols: usize, data: StageData) {
        if let Some(stage) = self.stages.get_mut(name) {
            stage.shape[0] += rows;
            match (&mut stage.data, data) {
                (StageData::F32(a), StageData::F32(b)) => a.extend(b),
                (StageData::I32(a), StageData::I32(b)) => a.extend(b),
                _ => panic!("stage {name} recorded with two dtypes"),
            }
            return;
        }
        self.names.push(name.to_string());
        self.stages.insert(
            name.to_string(),
            Stage {
                shape: vec![rows, cols],
                data,
            },
        );
    }

    pub fn get(&self, name: &str) -> Option<&Stage> {
        self.stages.get(name)
    }

    /// Names in the order recorded (or stored).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn save(&self, path: &Path) -> Result<(), TraceError> {
        let bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = self
            .names
            .iter()
            .map(|n| {
                let s = &self.stages[n];
                let (dtype, raw) = match &s.data {
                    StageData::F32(v) => {
                        (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect())
                    }
                    StageData::I32(v) => {
                        (Dtype::I32, v.iter().flat_map(|x| x.to_le_bytes()).collect())
                    }
                };
                (n.clone(), dtype, s.shape.clone(), raw)
            })
            .collect();
        let views = bytes.iter().map(|(n, dtype, shape, raw)| {
            (
                n.clone(),
                TensorView::new(*dtype, shape.clone(), raw).expect("shape matches the data"),
            )
        });
        let out = safetensors::serialize(views, None).map_err(|e| TraceError::Format {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        std::fs::write(path, out).map_err(|source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Loads every F32 / I32 tensor of a safetensors file, names sorted in forward order.
    pub fn load(path: &Path) -> Result<Trace, TraceError> {
        let bytes = std::fs::read(path).map_err(|source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| TraceError::Format {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let mut trace = Trace::new();
        let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
        names.sort_by(|a, b| order_key(a).cmp(&order_key(b)).then(a.cmp(b)));
        for name in names {
            let t = st.tensor(&name).expect("listed name");
            let data = match t.dtype() {
                Dtype::F32 => StageData::F32(
                    t.data()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                ),
                Dtype::I32 => StageData::I32(
                    t.data()
                        .chunks_exact(4)
                        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                ),
                other => {
                    return Err(TraceError::Dtype {
                        path: path.to_path_buf(),
                        name,
                        dtype: format!("{other:?}"),
                    })
                }
            };
            trace.names.push(name.clone());
            trace.stages.insert(
                name,
                Stage {
                    shape: t.shape().to_vec(),
                    data,
                },
            );
        }
        Ok(trace)
    }
}

/// ||a - b|| / ||b|| in f64 (||a - b|| when b is zero).
pub fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}

/// How one stage of A compares with the same stage of B.
#[derive(Clone, Debug, PartialEq)]
pub enum Comparison {
    /// f32 stages: relative error of A against B.
    Relative(f64),
    /// i32 stages: how many entries differ.
    Ids { differ: usize, total: usize },
    /// Shapes or dtypes differ.
    Mismatch(String),
}

impl Comparison {
    /// Beyond `threshold` (ids: any difference).
    pub fn diverges(&self, threshold: f64) -> bool {
        match self {
            Comparison::Relative(e) => e.is_nan() || *e > threshold,
            Comparison::Ids { differ, .. } => *differ > 0,
            Comparison::Mismatch(_) => true,
        }
    }
}

pub fn compare_stage(a: &Stage, b: &Stage) -> Comparison {
    if a.shape != b.shape {
        return Comparison::Mismatch(format!("shape {:?} vs {:?}", a.shape, b.shape));
    }
    match (&a.data, &b.data) {
        (StageData::F32(x), StageData::F32(y)) => Comparison::Relative(relative_error(x, y)),
        (StageData::I32(x), StageData::I32(y)) => Comparison::Ids {
            differ: x.iter().zip(y).filter(|(p, q)| p != q).count(),
            total: x.len(),
        },
        _ => Comparison::Mismatch("dtype f32 vs i32".into()),
    }
}

/// Every stage present in both traces, in forward order, with its comparison.
pub fn compare(a: &Trace, b: &Trace) -> Vec<(String, Comparison)> {
    let mut names: Vec<&String> = a
        .names
        .iter()
        .filter(|n| b.stages.contains_key(*n))
        .collect();
    names.sort_by(|x, y| order_key(x).cmp(&order_key(y)).then(x.cmp(y)));
    names
        .into_iter()
        .map(|n| (n.clone(), compare_stage(&a.stages[n], &b.stages[n])))
        .collect()
}

/// The first stage (forward order) whose comparison diverges beyond `threshold`.
pub fn first_divergence(rows: &[(String, Comparison)], threshold: f64) -> Option<&str> {
    rows.iter()
        .find(|(_, c)| c.diverges(threshold))
        .map(|(n, _)| n.as_str())
}
