//! mla-engine: a small, readable inference engine for MLA + MoE models stored as GGUF.
//!
//! The tour, in the order a token flows: [`gguf`] maps the file (one file or a split set) and
//! hands out tensors as borrowed bytes; [`quant`] knows every block format and dequantizes or
//! dots a quantized row without materializing it; [`config`] reads the model's hyperparameters
//! from the metadata and refuses what it cannot run; [`weights`] names the tensors of one rank;
//! [`tokenizer`] rebuilds the BPE tokenizer from the metadata; [`model`] is the forward pass,
//! written once against the [`backend::Backend`] trait (MLA prefill and decode, DSA, MoE);
//! [`backend`] runs it on the CPU (the f32 reference) or on CUDA; [`tp`] shards it over ranks;
//! [`trace`] names every activation so two runs can be diffed stage by stage; [`sampling`]
//! turns logits into tokens.

pub mod backend;
pub mod config;
pub mod gguf;
pub mod model;
pub mod quant;
pub mod sampling;
pub mod tokenizer;
pub mod tp;
pub mod trace;
pub mod weights;
