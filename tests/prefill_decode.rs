//! Expanded prefill and absorbed decode are the same function: the logits of one prefill of N
//! tokens equal those of a prefill of k tokens followed by N - k single-token decode steps.
//! Only float rounding differs (a different association of the same sums), so the bound is a
//! relative error of 1e-5 over all positions' logits.

mod common;

use common::*;
use mla_engine::backend::Backend;
use mla_engine::trace::relative_error;

const BOUND: f64 = 1e-5;

every_golden_file! {
    fn prefill_equals_prefill_then_decode(variant: &str, #[values(1, 2, 5, 13, -1)] k: isize) {
        let model = load(variant);
        let tokens = ref_tokens(&load_ref(variant, 1));
        // -1: all but the last token in the prefill.
        let k = if k < 0 { tokens.len() - 1 } else { k as usize };
        assert!(k < tokens.len());
        let one_prefill = forward_logits(&model, &mut model.new_cache(model.cfg.n_ctx), &tokens);
        let stepped = logits_prefill_then_decode(&model, &tokens, k);
        let err = relative_error(&stepped, &one_prefill);
        assert!(err < BOUND, "{variant} k={k}: relative error {err:.2e}");
    }
}

every_golden_file! {
    /// A prefill in two chunks (the second one expanded over a cache that already holds the first)
    /// equals one prefill: positions, the causal mask and DSA's selection all continue from pos0.
    fn chunked_prefill_equals_one_prefill(variant: &str, #[values(3, 10)] k: usize) {
        let model = load(variant);
        let tokens = ref_tokens(&load_ref(variant, 1));
        let one = forward_logits(&model, &mut model.new_cache(model.cfg.n_ctx), &tokens);
        let mut cache = model.new_cache(model.cfg.n_ctx);
        let mut chunked = forward_logits(&model, &mut cache, &tokens[..k]);
        chunked.extend(forward_logits(&model, &mut cache, &tokens[k..]));
        let err = relative_error(&chunked, &one);
        assert!(err < BOUND, "{variant} k={k}: relative error {err:.2e}");
    }
}

every_golden_file! {
    /// `forward_last` (what generation runs on a prompt) is the last row of `forward`, bit for
    /// bit on the CPU (the same per-row sums), and leaves the cache as `forward` does.
    fn forward_last_is_the_last_row(variant: &str) {
        let model = load(variant);
        let tokens = ref_tokens(&load_ref(variant, 1));
        let vocab = model.cfg.n_vocab;
        let all = forward_logits(&model, &mut model.new_cache(model.cfg.n_ctx), &tokens);
        let mut cache = model.new_cache(model.cfg.n_ctx);
        let last = model.backend.download(&model.forward_last(&mut cache, &tokens).unwrap());
        assert_eq!(last, all[all.len() - vocab..], "{variant}");
        assert_eq!(cache.len, tokens.len());
    }
}
