//! Expanded prefill and absorbed decode are the same function: the logits of one prefill of N
//! tokens equal those of a prefill of k tokens followed by N - k single-token decode steps.
//! Only float rounding differs (a different association of the same sums), so the bound is a
//! relative error of 1e-5 over all positions' logits.

mod common;

use common::*;
use mla_engine::backend::Backend;
use mla_engine::model::Taps;
use mla_engine::trace::relative_error;
use rstest::rstest;

const BOUND: f64 = 1e-5;

#[rstest]
fn prefill_equals_prefill_then_decode(
    #[values(
        "ds3.f32",
        "ds3.q8_0",
        "ds3.q4_k_m",
        "ds3.mix",
        "ds3.legacy-q8_0",
        "glm5.q8_0",
        "v2lite.q8_0"
    )]
    variant: &str,
    #[values(1, 2, 5, 13, -1)] k: isize,
) {
    let model = load(variant);
    let tokens = ref_tokens(&load_ref(variant, 1));
    // -1: all but the last token in the prefill.
    let k = if k < 0 { tokens.len() - 1 } else { k as usize };
    assert!(k < tokens.len());
    let mut cache = model.new_cache(model.cfg.n_ctx);
    let one_prefill = model.backend.download(
        &model
            .forward(&mut cache, &tokens, &mut Taps::none())
            .unwrap(),
    );
    let stepped = logits_prefill_then_decode(&model, &tokens, k);
    let err = relative_error(&stepped, &one_prefill);
    assert!(err < BOUND, "{variant} k={k}: relative error {err:.2e}");
}

/// A prefill in two chunks (the second one expanded over a cache that already holds the first)
/// equals one prefill: positions, the causal mask and DSA's selection all continue from pos0.
#[rstest]
fn chunked_prefill_equals_one_prefill(
    #[values(
        "ds3.f32",
        "ds3.q8_0",
        "ds3.q4_k_m",
        "ds3.mix",
        "ds3.legacy-q8_0",
        "glm5.q8_0",
        "v2lite.q8_0"
    )]
    variant: &str,
    #[values(3, 10)] k: usize,
) {
    let model = load(variant);
    let tokens = ref_tokens(&load_ref(variant, 1));
    let mut cache = model.new_cache(model.cfg.n_ctx);
    let one = model.backend.download(
        &model
            .forward(&mut cache, &tokens, &mut Taps::none())
            .unwrap(),
    );
    let mut cache = model.new_cache(model.cfg.n_ctx);
    let mut chunked = model.backend.download(
        &model
            .forward(&mut cache, &tokens[..k], &mut Taps::none())
            .unwrap(),
    );
    chunked.extend(
        model.backend.download(
            &model
                .forward(&mut cache, &tokens[k..], &mut Taps::none())
                .unwrap(),
        ),
    );
    let err = relative_error(&chunked, &one);
    assert!(err < BOUND, "{variant} k={k}: relative error {err:.2e}");
}
