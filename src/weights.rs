//! Named weights of one rank, borrowed from the mapped file.
//!
//! `TensorRef` is what a backend receives: a type, a ggml shape and bytes that stay valid as
//! long as the mapped file does. `ModelWeights<W>` holds every tensor the forward pass reads,
//! already made resident by a backend (`W = Backend::Weight`). A tensor-parallel rank builds
//! the same struct from sharded `TensorRef`s (row or column ranges of the full tensors).

use crate::gguf::GgmlType;
use std::fmt;
use std::sync::Arc;

/// Bytes of one tensor, borrowed from an owner (the mapped file, or an owned buffer for
/// tensors rebuilt at load) that this handle keeps alive.
#[derive(Clone)]
pub struct MappedBytes {
    _owner: Arc<dyn std::any::Any + Send + Sync>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the bytes are immutable and owned by `_owner`, which is Send + Sync.
unsafe impl Send for MappedBytes {}
unsafe impl Sync for MappedBytes {}

impl MappedBytes {
    /// Borrows `select(&owner)` for as long as the returned handle lives. The owner must not
    /// mutate those bytes (a memory map or a frozen buffer): they are read without a lock.
    pub fn new<O: Send + Sync + 'static>(owner: Arc<O>, select: impl FnOnce(&O) -> &[u8]) -> Self {
        let bytes = select(&owner);
        let (ptr, len) = (bytes.as_ptr(), bytes.len());
        MappedBytes {
            _owner: owner,
            ptr,
            len,
        }
    }

    /// Bytes owned by this handle (tensors rebuilt at load, like a split legacy attn_kv_b).
    pub fn owned(bytes: Vec<u8>) -> Self {
        MappedBytes::new(Arc::new(bytes), |b| b.as_slice())
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `_owner` keeps the allocation or mapping alive and unchanged (see `new`),
        // and an Arc's contents never move.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// One tensor as a backend receives it.
#[derive(Clone)]
pub struct TensorRef {
    /// The GGUF name, for messages (`blk.3.attn_k_b.weight`).
    pub name: String,
    pub ggml_type: GgmlType,
    /// ggml order: `ne[0]` is the row length. Trailing dimensions of 1 are kept as given.
    pub ne: Vec<usize>,
    pub bytes: MappedBytes,
}

impl TensorRef {
    /// Number of elements.
    pub fn n_elements(&self) -> usize {
        self.ne.iter().product()
    }

    /// Number of rows of `ne[0]` elements (all dimensions after the first).
    pub fn n_rows(&self) -> usize {
        self.ne.iter().skip(1).product()
    }

    /// Bytes per row in the file's format.
    pub fn row_bytes(&self) -> usize {
        self.ggml_type
            .row_bytes(self.ne[0])
            .expect("row length checked against the block size when the TensorRef was made")
    }

    /// An f32 tensor owned by the handle.
    pub fn from_f32(name: &str, ne: Vec<usize>, values: &[f32]) -> TensorRef {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        TensorRef {
            name: name.to_string(),
            ggml_type: GgmlType::F32,
            ne,
            bytes: MappedBytes::owned(bytes),
        }
    }
}

impl fmt::Debug for TensorRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.ggml_type, self.ne)
    }
}
