//! The GGUF container: header, metadata, tensor table, split sets, mmap. No model knowledge.
//!
//! # The format, in short
//!
//! A GGUF file is a header followed by one data section. Everything is little-endian.
//!
//! ```text
//! "GGUF"                 4 bytes of magic
//! version                u32: 3 (2 is still met; it differs from 3 only in allowing
//!                        big-endian files, which we refuse)
//! tensor count           u64
//! metadata count         u64
//! metadata entries       key (string), value type (u32), value
//! tensor entries         name (string), n_dims (u32, at most 4), ne (n_dims x u64),
//!                        ggml type (u32), offset (u64, relative to the data section)
//! padding                zeros up to a multiple of the alignment
//! data section           the tensors' bytes, each starting at a multiple of the alignment
//! ```
//!
//! A string is a u64 byte length and that many bytes of UTF-8 (no terminator). A value is one of
//! 13 types: the eight integers u8..i64, f32, f64, a bool (one byte, 0 or 1), a string, or an
//! array (element type u32, count u64, then the elements; arrays of arrays are allowed and
//! each inner array carries its own element type). The alignment is the metadata key
//! `general.alignment` (a power of two), or 32 when absent.
//!
//! A tensor's `ne` lists its dimensions fastest first: `ne[0]` elements are contiguous (a row),
//! so numpy's shape is `ne` reversed. Its size in bytes follows from its ggml type: rows are
//! cut into blocks of `block_size` elements stored in `type_size` bytes each (see
//! [`GgmlType`]), so `ne[0]` must be a whole number of blocks. Nothing in the file states the
//! size: a reader computes it, which is why every type's geometry is known here even when the
//! quant layer cannot compute with it.
//!
//! Large models are cut into a split set, `NAME-00001-of-0000N.gguf` .. `NAME-0000N-of-0000N.gguf`.
//! Each shard is a complete GGUF file with its own tensor table and data section, carrying
//! `split.no` (0-based), `split.count` and `split.tensors.count` (over the whole set); only the
//! first shard carries the model's metadata.
//!
//! # This module
//!
//! [`GgufFile::open`] maps each file (memmap2) and parses only the headers; tensor bytes are
//! handed out as slices of the mapping ([`GgufFile::tensor_data`]) and are read from disk when
//! touched, so opening a 50 GB set costs what reading its headers costs. The parser
//! (`parse.rs`) trusts nothing: reads are bounds-checked, counts are checked against the bytes
//! left before anything is allocated, tensor sizes come from the ggml geometry and tensor data
//! must lie inside the file without overlapping. Every failure is a [`GgufError`] naming the
//! file, the offset and the field. [`GgufWriter`] writes files as a stream, tensor by tensor.

mod error;
mod file;
pub mod ggml_type;
mod parse;
mod tensor;
mod value;
mod writer;

pub use error::GgufError;
pub use file::{GgufFile, Shard, ShardName, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT};
pub use ggml_type::GgmlType;
pub use parse::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH};
pub use tensor::{tensor_bytes, TensorInfo, MAX_DIMS};
pub use value::{Value, ValueType};
pub use writer::{split_shard_path, GgufWriter, VERSION};

/// The engine shares one opened file between threads (in an `Arc`) and borrows tensor bytes.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<GgufFile>()
};
