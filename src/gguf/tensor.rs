//! A tensor's entry in the tensor table, and its byte size from the ggml block geometry.

use super::GgmlType;

/// ggml allows at most this many dimensions.
pub const MAX_DIMS: usize = 4;

/// One tensor of a file or split set. Its bytes are `GgufFile::tensor_data(&info)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub ggml_type: GgmlType,
    /// Dimensions in ggml order: `ne[0]` is contiguous (the row); numpy's shape is `ne` reversed.
    pub ne: Vec<u64>,
    /// Index into `GgufFile::shards()`.
    pub shard: usize,
    /// Absolute byte offset of the data in its shard's file.
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// Elements per row (`ne[0]`; 1 for a tensor without dimensions).
    pub fn row_len(&self) -> usize {
        self.ne.first().map_or(1, |&n| n as usize)
    }

    /// Number of rows: the product of `ne[1..]`.
    pub fn n_rows(&self) -> usize {
        self.ne.iter().skip(1).product::<u64>() as usize
    }
}

/// Bytes of a tensor of type `ty` and dimensions `ne`, or (expected, found) saying why the shape
/// is impossible: a row that is not a whole number of blocks, or a dimension or element count
/// past what ggml can index (i64).
pub fn tensor_bytes(ty: GgmlType, ne: &[u64]) -> Result<u64, (String, String)> {
    let shape = || format!("{ty} tensor with ne {ne:?}");
    if ne.iter().any(|&n| n > i64::MAX as u64) {
        return Err(("each dimension below 2^63".into(), shape()));
    }
    let fits_i64 = |n: Option<u64>| n.filter(|&n| n <= i64::MAX as u64);
    let n_elements = fits_i64(ne.iter().try_fold(1u64, |acc, &n| acc.checked_mul(n)));
    let n_rows = fits_i64(
        ne.iter()
            .skip(1)
            .try_fold(1u64, |acc, &n| acc.checked_mul(n)),
    );
    let (Some(_), Some(n_rows)) = (n_elements, n_rows) else {
        return Err(("an element count below 2^63".into(), shape()));
    };
    let row_len = ne.first().copied().unwrap_or(1);
    let block = ty.block_size() as u64;
    if row_len % block != 0 {
        return Err((
            format!("ne[0] a multiple of {ty}'s block size {block}"),
            shape(),
        ));
    }
    // Up to 8 bytes per element (F64, I64): 2^62 elements already overflow u64.
    (row_len / block)
        .checked_mul(ty.type_size() as u64)
        .and_then(|row_bytes| row_bytes.checked_mul(n_rows))
        .ok_or_else(|| ("a byte size below 2^64".into(), shape()))
}
