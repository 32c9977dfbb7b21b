//! Every stage of every golden file and prompt against the transformers references (computed
//! on each file's own dequantized weights), greedy continuations token for token, and insta
//! summaries of the logits.

mod common;

use common::*;
use mla_engine::trace::{compare, Comparison, StageData};

/// Relative error allowed for a stage: max(1e-5, 4 x the reference's own f32 noise).
fn tolerance(variant: &str, prompt: usize, stage: &str) -> f64 {
    let noise = manifest_noise(variant, prompt, stage).unwrap_or(0.0);
    (4.0 * noise).max(1e-5)
}

/// Names in a reference file that are not stages of the forward pass.
const NOT_STAGES: &[&str] = &["tokens", "greedy", "llamacpp_logits"];

every_golden_file! {
    fn every_stage_matches_the_reference(variant: &str, #[values(0, 1)] prompt: usize) {
        let model = load(variant);
        let reference = load_ref(variant, prompt);
        let ours = traced_prefill(&model, &ref_tokens(&reference));

        let comparisons = compare(&ours, &reference);
        let compared = comparisons.len();
        let mut failures = Vec::new();
        for name in reference
            .names()
            .iter()
            .filter(|n| !NOT_STAGES.contains(&n.as_str()))
        {
            if ours.get(name).is_none() {
                failures.push(format!("{name}: not produced by the engine"));
            }
        }
        for (name, cmp) in &comparisons {
            let tol = tolerance(variant, prompt, name);
            let bad = match cmp {
                Comparison::Relative(e) => *e > tol,
                Comparison::Ids { differ, .. } => *differ > 0,
                Comparison::Mismatch(_) => true,
            };
            if bad {
                failures.push(format!("{name}: {cmp:?} (tolerance {tol:.1e})"));
            }
        }
        let worst = comparisons
            .iter()
            .filter_map(|(n, c)| match c {
                Comparison::Relative(e) => Some((*e, n)),
                _ => None,
            })
            .max_by(|a, b| a.0.total_cmp(&b.0));
        eprintln!("{variant} p{prompt}: {compared} stages, worst {worst:?}");
        assert!(
            compared > 20,
            "{variant} p{prompt}: only {compared} stages compared"
        );
        assert!(
            failures.is_empty(),
            "{variant} p{prompt}:\n{}",
            failures.join("\n")
        );
    }
}

every_golden_file! {
    fn greedy_continuation_matches_the_reference(variant: &str, #[values(0, 1)] prompt: usize) {
        let model = load(variant);
        let reference = load_ref(variant, prompt);
        let expected = ref_ids(&reference, "greedy");
        let ours = greedy(&model, &ref_tokens(&reference), expected.len());
        assert_eq!(ours, expected, "{variant} p{prompt}");
    }
}

every_golden_file! {
    /// Shape, mean, std, argmax and top-5 ids of the last position's logits, as a readable
    /// snapshot (the numbers themselves are checked against the stored tensors above).
    fn logits_summary(variant: &str) {
        let model = load(variant);
        let reference = load_ref(variant, 0);
        let ours = traced_prefill(&model, &ref_tokens(&reference));
        let logits = ours.get("logits").unwrap();
        let StageData::F32(v) = &logits.data else {
            panic!("f32 logits")
        };
        let vocab = logits.shape[1];
        let last = &v[v.len() - vocab..];
        let mean = last.iter().map(|x| *x as f64).sum::<f64>() / vocab as f64;
        let variance = last.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / vocab as f64;
        let std = variance.sqrt();
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| last[b].total_cmp(&last[a]));
        let summary = format!(
            "shape {:?}\nmean {:.3}\nstd {:.3}\nargmax {}\ntop5 {:?}",
            logits.shape,
            mean,
            std,
            order[0],
            &order[..5]
        );
        insta::assert_snapshot!(format!("logits_{}", variant.replace('.', "_")), summary);
    }
}
