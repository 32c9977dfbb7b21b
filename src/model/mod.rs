//! The forward pass. (being written)
