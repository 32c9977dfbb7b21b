//! The GGUF container: header, metadata, tensor table, split sets, mmap. No model knowledge.

pub mod ggml_type;

pub use ggml_type::GgmlType;
