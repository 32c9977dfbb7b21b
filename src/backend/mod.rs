//! Backends. (being written)
