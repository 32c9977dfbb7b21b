//! What each launch of a decode step adds to the chain as it runs (`xtask bench --chain-clock`).
//!
//! ncu times kernels one at a time, caches flushed, none overlapping the next, so its sum
//! overstates a decode step of ~50 short launches that programmatic dependent launch runs
//! back to back. The chain clock (kernels/common.cuh, `Gpu::chain_clock_read`) stamps, per
//! launch, when its wait returned: when the launch before it ended. A launch's share of the
//! step is then the stamp of the launch after it minus its own: from the end of the one
//! before to its own end, its tail and the hand-over included, its overlap with the one before
//! left out, and the steps' shares add up to the step's time. The stamping thread is the
//! grid's first unless its kernel waits late there (the MoE gate-up's block 0 takes a group of
//! the shared expert before it waits for the router; the first block whose first group is
//! routed stamps instead). The stamps cost a launch one atomic and two stores; compare the
//! step's time with the bench's plain decode.

use anyhow::{bail, Result};

/// What the launches of consecutive decode steps added to the chain.
pub struct Chain {
    /// Step 0's launches in order, (kernel, us added), the mean over the steps that launched
    /// the same kernels (the latent attention's form and splits change with the context).
    pub launches: Vec<(String, f64)>,
    /// The steps `launches` averages.
    pub same_steps: usize,
    /// Per kernel, the most time first: (kernel, launches a step, us a step), over all steps.
    pub by_kernel: Vec<(String, f64, f64)>,
    /// The mean time from a step's first stamp to the next step's.
    pub step_us: f64,
    /// The steps measured.
    pub steps: usize,
}

impl Chain {
    /// From the stamps of consecutive steps ((kernel, ns), in launch order) and the index where
    /// each step's launches begin. The last step only ends the one before (its last launch has
    /// no successor), so at least two are needed.
    pub fn from_stamps(stamps: &[(String, u64)], step_starts: &[usize]) -> Result<Chain> {
        if step_starts.len() < 2 || *step_starts.last().unwrap() >= stamps.len() {
            bail!("the chain clock needs two steps or more, the last with a stamp");
        }
        let steps = step_starts.len() - 1;
        // What launch g added: the next launch's stamp minus its own.
        let added = |g: usize| stamps[g + 1].1.saturating_sub(stamps[g].1) as f64 / 1e3;
        let step = |i: usize| step_starts[i]..step_starts[i + 1];
        let first = &stamps[step(0)];
        let mut in_order = vec![0.0; first.len()];
        let mut same_steps = 0;
        let mut by_kernel: Vec<(String, f64, f64)> = Vec::new();
        for i in 0..steps {
            let range = step(i);
            let launches = &stamps[range.clone()];
            if launches.len() == first.len() && launches.iter().zip(first).all(|(a, b)| a.0 == b.0)
            {
                same_steps += 1;
                for (j, sum) in in_order.iter_mut().enumerate() {
                    *sum += added(range.start + j);
                }
            }
            for g in range {
                let name = &stamps[g].0;
                match by_kernel.iter_mut().find(|r| r.0 == *name) {
                    Some(r) => (r.1, r.2) = (r.1 + 1.0, r.2 + added(g)),
                    None => by_kernel.push((name.clone(), 1.0, added(g))),
                }
            }
        }
        for r in &mut by_kernel {
            (r.1, r.2) = (r.1 / steps as f64, r.2 / steps as f64);
        }
        by_kernel.sort_by(|a, b| b.2.total_cmp(&a.2));
        let span = stamps[step_starts[steps]].1 - stamps[step_starts[0]].1;
        Ok(Chain {
            launches: first
                .iter()
                .zip(in_order)
                .map(|((name, _), us)| (name.clone(), us / same_steps as f64))
                .collect(),
            same_steps,
            by_kernel,
            step_us: span as f64 / 1e3 / steps as f64,
            steps,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamps(steps: &[&[(&str, u64)]]) -> (Vec<(String, u64)>, Vec<usize>) {
        let mut all = Vec::new();
        let mut starts = Vec::new();
        for s in steps {
            starts.push(all.len());
            all.extend(s.iter().map(|&(n, t)| (n.to_string(), t)));
        }
        (all, starts)
    }

    #[test]
    fn a_launch_adds_the_time_to_the_next_stamp_and_the_steps_add_up() {
        // Two steps of embed -> matvec -> argmax, the second 2 us slower in its matvec; a third
        // step only ends the second.
        let (all, starts) = stamps(&[
            &[("embed", 0), ("matvec", 3_000), ("argmax", 13_000)],
            &[("embed", 15_000), ("matvec", 18_000), ("argmax", 30_000)],
            &[("embed", 32_000)],
        ]);
        let chain = Chain::from_stamps(&all, &starts).unwrap();
        assert_eq!((chain.steps, chain.same_steps), (2, 2));
        let want = [("embed", 3.0), ("matvec", 11.0), ("argmax", 2.0)];
        for ((name, us), (want_name, want_us)) in chain.launches.iter().zip(want) {
            assert_eq!(name, want_name);
            assert!(
                (us - want_us).abs() < 1e-9,
                "{name}: {us} against {want_us}"
            );
        }
        assert!((chain.step_us - 16.0).abs() < 1e-9);
        let added: f64 = chain.launches.iter().map(|l| l.1).sum();
        assert!((added - chain.step_us).abs() < 1e-9);
    }

    #[test]
    fn launches_of_one_kernel_add_up_by_kernel() {
        let (all, starts) = stamps(&[
            &[
                ("norm", 0),
                ("matvec", 1_000),
                ("norm", 5_000),
                ("matvec", 6_000),
            ],
            &[("norm", 10_000)],
        ]);
        let by = Chain::from_stamps(&all, &starts).unwrap().by_kernel;
        assert_eq!(by[0], ("matvec".to_string(), 2.0, 8.0));
        assert_eq!(by[1], ("norm".to_string(), 2.0, 2.0));
    }

    #[test]
    fn steps_that_launch_other_kernels_count_per_kernel_only() {
        // Step 1 takes a combine after its attention (a longer context: more splits).
        let (all, starts) = stamps(&[
            &[("embed", 0), ("attention", 1_000)],
            &[("embed", 5_000), ("attention", 6_000), ("combine", 9_000)],
            &[("embed", 10_000)],
        ]);
        let chain = Chain::from_stamps(&all, &starts).unwrap();
        assert_eq!((chain.steps, chain.same_steps), (2, 1));
        assert_eq!(chain.launches[1], ("attention".to_string(), 4.0));
        let combine = chain.by_kernel.iter().find(|r| r.0 == "combine").unwrap();
        assert_eq!(*combine, ("combine".to_string(), 0.5, 0.5));
        assert!((chain.step_us - 5.0).abs() < 1e-9);
        let (all, starts) = stamps(&[&[("embed", 0)]]);
        assert!(Chain::from_stamps(&all, &starts).is_err());
    }
}
