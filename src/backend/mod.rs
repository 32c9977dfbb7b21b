//! Backends. (being written)

pub mod cuda;
