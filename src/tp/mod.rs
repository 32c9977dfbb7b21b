//! Tensor parallelism: one model over N ranks, with the logits of one.
//!
//! - [`plan`]: for every tensor of the file, replicated, split by rows (heads, experts,
//!   vocabulary), split by columns, or kept on rank 0; refuses what cannot be split.
//! - [`sharded`]: each rank's [`crate::model::Model`] built from its own shards (views of the
//!   mapped file, copies only for column splits), run in lockstep, one thread per rank.
//! - [`local`] and [`nccl`]: the [`crate::backend::Communicator`]s. The model calls
//!   `all_reduce` after attn_output and after the FFN/MoE, and `all_gather_cols` on the
//!   vocabulary-split logits; it never sees a rank number.
//!
//! Exactness: every split is a partition of a sum (heads of attn_output's input, experts of
//! the MoE, the hidden units of an FFN) or of the outputs (vocabulary), so TP = N computes the
//! same numbers as TP = 1 up to the order of float additions in the two all-reduces.
//!
//! Multi-process and multi-node: NCCL ranks join a group through a 128-byte unique id made by
//! rank 0. Here all ranks are threads of one process and share it directly
//! ([`nccl::NcclId::new`]); [`nccl::Nccl::join`] takes the id, the rank and the world size and
//! nothing else, so a TCP rendezvous plugs in before it without other changes: rank 0 creates
//! the id, listens on an agreed `host:port` and sends the 128 bytes to each of the other
//! `world - 1` ranks that connect; each other rank connects, reads the 128 bytes and calls
//! `join` with them (see docs/tp.md).

pub mod local;
pub mod nccl;
pub mod plan;
pub mod sharded;

pub use local::Local;
pub use plan::{PlanError, RankBytes, ShardPlan, Split};
pub use sharded::{merge_traces, GreedyToken, ShardSource, ShardedCache, ShardedModel, TpError};
