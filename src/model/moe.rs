//! Mixture of experts: the router picks k experts per token, their outputs are summed with
//! the router's weights, and the shared expert is added unweighted.
//!
//! Routing is the step where subtle bugs hide (bias used for weights, groups masked with 0
//! instead of -inf, top-k over the group mask), so its reference is written plainly here and
//! runs on the host for the CPU backend, for traces and for a tensor-parallel rank's prefill.
//! The CUDA backend routes on the GPU (kernels/moe.cu: `moe_route_f32`, the router product and
//! the choice in one launch for decode, `moe_router` on given logits; held to `route` by their
//! test and by prefill == decode), which spares a host round trip per MoE layer.

use super::{dense_ffn, Model, Taps};
use crate::backend::Backend;
use crate::config::{Gating, MoeConfig};
use crate::weights::Moe;
use std::ops::Range;

/// The chosen experts of `n` tokens: `ids` and `weights` [n * k], by descending selection score.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

/// Routes tokens from their router logits [n * n_expert].
///
/// - scores: sigmoid (DeepSeek-V3, GLM-5) or softmax (V2) of the logits, in f32;
/// - selection: scores + selection bias (noaux_tc), for choosing only;
/// - groups: a group's score is the sum of its two best selection values (sigmoid) or its best
///   one (softmax, V2's group-limited greedy); the best `n_group_used` groups stay, the others
///   are set to -inf;
/// - the k best experts by selection value; their weights are the unbiased scores, normalized
///   to sum 1 if `weights_norm`, times `weights_scale`.
pub fn route(logits: &[f32], bias: Option<&[f32]>, m: &MoeConfig) -> Routing {
    let x = m.n_expert;
    let n = logits.len() / x;
    let mut routing = Routing {
        ids: Vec::with_capacity(n * m.n_used),
        weights: Vec::with_capacity(n * m.n_used),
    };
    for l in logits.chunks_exact(x) {
        let scores: Vec<f32> = match m.gating {
            Gating::Sigmoid => l.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
            Gating::Softmax => {
                let max = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = l.iter().map(|v| (v - max).exp()).collect();
                let sum: f32 = e.iter().sum();
                e.iter().map(|v| v / sum).collect()
            }
        };
        let mut choice: Vec<f32> = match bias {
            Some(bias) => scores.iter().zip(bias).map(|(s, b)| s + b).collect(),
            None => scores.clone(),
        };
        if m.n_group > 1 && m.n_group_used < m.n_group {
            let per_group = x / m.n_group;
            let group_score = |g: usize| {
                let top = best(&choice[g * per_group..(g + 1) * per_group], 2);
                let v = |i: usize| choice[g * per_group + top[i]];
                match m.gating {
                    Gating::Sigmoid => v(0) + v(1),
                    Gating::Softmax => v(0),
                }
            };
            let kept = best(
                &(0..m.n_group).map(group_score).collect::<Vec<_>>(),
                m.n_group_used,
            );
            for g in (0..m.n_group).filter(|g| !kept.contains(g)) {
                choice[g * per_group..(g + 1) * per_group].fill(f32::NEG_INFINITY);
            }
        }
        let chosen = best(&choice, m.n_used);
        let mut weights: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
        if m.weights_norm {
            let sum = weights.iter().sum::<f32>() + 1e-20;
            weights.iter_mut().for_each(|w| *w /= sum);
        }
        weights.iter_mut().for_each(|w| *w *= m.weights_scale);
        routing.ids.extend(chosen.iter().map(|&e| e as u32));
        routing.weights.extend(weights);
    }
    routing
}

/// Indices of the `k` largest values, largest first; equal values keep the lower index.
fn best(values: &[f32], k: usize) -> Vec<usize> {
    // A total order (ties by index), so selecting the k first and sorting only them gives
    // exactly the head of a full sort, in O(n) instead of O(n log n) per token.
    let first = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    let mut order: Vec<usize> = (0..values.len()).collect();
    if k == 0 {
        return Vec::new();
    }
    if k < order.len() {
        order.select_nth_unstable_by(k - 1, first);
        order.truncate(k);
    }
    order.sort_by(first);
    order
}

/// The choices among the experts this rank holds (`held`: all of them at TP = 1, where this
/// returns the routing unchanged), renumbered from `held.start`, `k_held` per token: tokens with
/// fewer held choices are padded with expert 0 at weight 0, which adds exactly 0 (expert
/// outputs are finite). The other choices are computed by the ranks that hold them and arrive
/// through the all-reduce. Returns (ids, weights, k_held).
fn held_choices(r: &Routing, held: &Range<usize>, k: usize) -> (Vec<u32>, Vec<f32>, usize) {
    let per_token: Vec<Vec<(u32, f32)>> = r
        .ids
        .chunks_exact(k)
        .zip(r.weights.chunks_exact(k))
        .map(|(ids, ws)| {
            ids.iter()
                .zip(ws)
                .filter(|(&e, _)| held.contains(&(e as usize)))
                .map(|(&e, &w)| (e - held.start as u32, w))
                .collect()
        })
        .collect();
    let k_held = per_token.iter().map(Vec::len).max().unwrap_or(0);
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for choices in &per_token {
        for j in 0..k_held {
            let (e, w) = choices.get(j).copied().unwrap_or((0, 0.0));
            ids.push(e);
            weights.push(w);
        }
    }
    (ids, weights, k_held)
}

/// The MoE block of layer `il` for `x` (ffn_norm output, [n, E]): routed experts plus the
/// shared expert, [n, E].
pub fn forward<B: Backend>(
    model: &Model<B>,
    il: usize,
    w: &Moe<B::Weight>,
    x: &B::Tensor,
    taps: &mut Taps,
) -> B::Tensor {
    let b = &model.backend;
    let m = model.cfg.moe.as_ref().expect("MoE layer in a MoE model");

    let bias = w.selection_bias.as_deref();
    let on_device = if taps.on() {
        None // the trace records the logits and the reference routing, below
    } else {
        let experts = (&w.gate_exps, &w.up_exps, &w.down_exps);
        b.moe_routed(
            x,
            &w.router,
            bias,
            m,
            &w.experts,
            experts,
            w.shared.as_ref(),
        )
    };
    let (mut out, with_shared) = match on_device {
        Some(routed) => routed,
        None => {
            let logits = b.linear(x, &w.router); // [n, n_expert]
            taps.tensor(b, || format!("L{il}.router_logits"), &logits);
            (routed_on_host(model, il, w, x, &logits, taps), false)
        }
    };
    if with_shared {
        return out; // the backend ran the shared expert as one more choice
    }
    taps.tensor(b, || format!("L{il}.moe_out"), &out);
    if let Some(shared) = &w.shared {
        let s = dense_ffn(b, shared, x);
        taps.tensor(b, || format!("L{il}.shared_out"), &s);
        b.add_assign(&mut out, &s);
    }
    out
}

/// The routed experts with the routing computed here, on the host: [n, E].
fn routed_on_host<B: Backend>(
    model: &Model<B>,
    il: usize,
    w: &Moe<B::Weight>,
    x: &B::Tensor,
    logits: &B::Tensor,
    taps: &mut Taps,
) -> B::Tensor {
    let b = &model.backend;
    let m = model.cfg.moe.as_ref().expect("MoE layer in a MoE model");
    let n = b.shape(x).0;
    let r = route(&b.download(logits), w.selection_bias.as_deref(), m);
    if taps.on() {
        let ids: Vec<i32> = r.ids.iter().map(|&e| e as i32).collect();
        taps.ids(|| format!("L{il}.topk_ids"), n, &ids);
        taps.host_f32(|| format!("L{il}.topk_weights"), n, &r.weights);
    }

    let (ids, weights, k) = held_choices(&r, &w.experts, m.n_used);
    if k == 0 {
        b.zeros(n, model.cfg.n_embd)
    } else {
        b.moe_experts(x, &w.gate_exps, &w.up_exps, &w.down_exps, &ids, &weights, k)
    }
}

#[cfg(test)]
mod tests {
    use super::best;

    #[test]
    fn best_is_the_head_of_a_full_sort_ties_by_index() {
        let mut seed = 12345u32;
        for n in [1, 2, 7, 32, 256] {
            // Few distinct values (ties everywhere), an infinity and a -inf among them.
            let values: Vec<f32> = (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                    match seed >> 29 {
                        0 => f32::NEG_INFINITY,
                        1 => f32::INFINITY,
                        r => r as f32 * 0.5,
                    }
                })
                .collect();
            let mut full: Vec<usize> = (0..n).collect();
            full.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
            for k in 0..=n {
                assert_eq!(best(&values, k), full[..k], "n {n} k {k}");
            }
        }
    }
}
