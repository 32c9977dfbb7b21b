//! Everything that can go wrong reading or writing a GGUF file. Each error names the file, the
//! byte offset (where the file has one) and the field, and says what was expected.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: cannot {action}: {source}", .path.display())]
    Io {
        path: PathBuf,
        /// "open", "map", "write", ...
        action: &'static str,
        source: std::io::Error,
    },

    #[error(
        "{}: offset {offset}: {field}: the file ends {available} bytes later, expected {needed} bytes",
        .path.display()
    )]
    Truncated {
        path: PathBuf,
        offset: u64,
        field: String,
        needed: u64,
        available: u64,
    },

    #[error("{}: offset {offset}: {field}: expected {expected}, found {found}", .path.display())]
    Invalid {
        path: PathBuf,
        offset: u64,
        field: String,
        expected: String,
        found: String,
    },

    /// A count (of tensors, keys, array elements, string bytes) that cannot fit in what is
    /// left of the file. Checked before allocating, so a forged 2^60 costs nothing.
    #[error(
        "{}: offset {offset}: {field}: count {count} needs at least {needed} bytes, only {available} are left in the file",
        .path.display()
    )]
    CountTooLarge {
        path: PathBuf,
        offset: u64,
        field: String,
        count: u64,
        needed: u128,
        available: u64,
    },

    #[error(
        "{}: offset {offset}: tensor {tensor:?}: data [{start}, {end}) lies past the end of the file ({file_len} bytes)",
        .path.display()
    )]
    TensorOutOfBounds {
        path: PathBuf,
        /// Where the tensor's entry in the tensor table starts.
        offset: u64,
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },

    #[error(
        "{}: offset {offset}: tensor {tensor:?}: data [{start}, {end}) overlaps tensor {other:?} at [{other_start}, {other_end}), expected disjoint tensors",
        .path.display()
    )]
    TensorOverlap {
        path: PathBuf,
        offset: u64,
        tensor: String,
        start: u64,
        end: u64,
        other: String,
        other_start: u64,
        other_end: u64,
    },

    #[error("{}: offset {offset}: key {key:?} appears twice, expected unique keys", .path.display())]
    DuplicateKey {
        path: PathBuf,
        offset: u64,
        key: String,
    },

    #[error(
        "{}: offset {offset}: tensor {tensor:?} is already defined in {}, expected unique tensor names",
        .path.display(), .first_path.display()
    )]
    DuplicateTensor {
        path: PathBuf,
        offset: u64,
        tensor: String,
        first_path: PathBuf,
    },

    #[error("{}: metadata key {key:?} is missing", .path.display())]
    MissingKey { path: PathBuf, key: String },

    #[error("{}: offset {offset}: metadata key {key:?}: expected {expected}, found {found}", .path.display())]
    WrongType {
        path: PathBuf,
        /// Where the value starts.
        offset: u64,
        key: String,
        expected: &'static str,
        found: String,
    },

    #[error(
        "{}: shard {no} of {count} of the split set is missing (opened from {})",
        .path.display(), .opened.display()
    )]
    MissingShard {
        /// The shard that should exist.
        path: PathBuf,
        /// The shard the set was opened from.
        opened: PathBuf,
        no: usize,
        count: usize,
    },

    /// A shard that disagrees with the rest of its split set (its name, split.no, split.count,
    /// or the total tensor count).
    #[error("{}: offset {offset}: {field}: expected {expected}, found {found}", .path.display())]
    ShardMismatch {
        path: PathBuf,
        offset: u64,
        field: String,
        expected: String,
        found: String,
    },

    /// The writer was used out of order or given data that does not match what was declared.
    #[error("{}: offset {offset}: {field}: expected {expected}, found {found}", .path.display())]
    Write {
        path: PathBuf,
        offset: u64,
        field: String,
        expected: String,
        found: String,
    },
}
