//! `Local`: tensor-parallel ranks as threads of one process (the CPU backend and the tests).
//!
//! Each collective is a rendezvous of all ranks: every rank puts its part in its slot, waits
//! for the others, and builds the result from the slots in rank order, so the sums do not
//! depend on which thread came first: a run is bit-for-bit repeatable. Works with any backend
//! (parts go through host memory). A rank that fails breaks the group (`abort`): every rank
//! waiting in a collective, or entering one later, panics instead of waiting forever.

use crate::backend::{Backend, Communicator};
use std::sync::{Arc, Condvar, Mutex, RwLock};

/// One rank's end of an in-process group.
pub struct Local {
    rank: usize,
    group: Arc<Group>,
}

struct Group {
    /// Per rank, its part of the collective in progress (row-major host values).
    slots: Vec<RwLock<Vec<f32>>>,
    barrier: Rendezvous,
}

/// A reusable barrier of `n` threads that a failed rank can break.
struct Rendezvous {
    n: usize,
    state: Mutex<RendezvousState>,
    turn: Condvar,
}

struct RendezvousState {
    arrived: usize,
    generation: u64,
    broken: bool,
}

impl Rendezvous {
    fn new(n: usize) -> Rendezvous {
        Rendezvous {
            n,
            state: Mutex::new(RendezvousState {
                arrived: 0,
                generation: 0,
                broken: false,
            }),
            turn: Condvar::new(),
        }
    }

    /// Waits until all `n` threads arrive; panics if a rank broke the group.
    fn wait(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.n {
            s.arrived = 0;
            s.generation += 1;
            self.turn.notify_all();
        } else {
            while s.generation == generation && !s.broken {
                s = self.turn.wait(s).unwrap_or_else(|e| e.into_inner());
            }
        }
        if s.broken {
            drop(s);
            panic!("{BROKEN}");
        }
    }

    fn r#break(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).broken = true;
        self.turn.notify_all();
    }
}

/// What the other ranks of a broken group panic with (`ShardedModel` reports the first rank's
/// own failure instead).
pub const BROKEN: &str = "another tensor-parallel rank failed";

impl Local {
    /// A group of `n` ranks: element r is rank r's communicator.
    pub fn group(n: usize) -> Vec<Local> {
        let group = Arc::new(Group {
            slots: (0..n).map(|_| RwLock::new(Vec::new())).collect(),
            barrier: Rendezvous::new(n),
        });
        (0..n)
            .map(|rank| Local {
                rank,
                group: group.clone(),
            })
            .collect()
    }

    /// Publishes this rank's part, waits for every rank's, lets `combine` read all parts (in
    /// rank order), then waits again so no slot is overwritten while another rank reads it.
    fn exchange<T>(&self, part: Vec<f32>, combine: impl FnOnce(&[&[f32]]) -> T) -> T {
        *self.group.slots[self.rank]
            .write()
            .unwrap_or_else(|e| e.into_inner()) = part;
        self.group.barrier.wait();
        let out = {
            let guards: Vec<_> = (self.group.slots.iter())
                .map(|s| s.read().unwrap_or_else(|e| e.into_inner()))
                .collect();
            let parts: Vec<&[f32]> = guards.iter().map(|g| g.as_slice()).collect();
            combine(&parts)
        };
        self.group.barrier.wait();
        out
    }
}

impl<B: Backend> Communicator<B> for Local {
    fn all_reduce(&self, backend: &B, x: &mut B::Tensor) {
        let (rows, cols) = backend.shape(x);
        let sum = self.exchange(backend.download(x), |parts| {
            let mut sum = parts[0].to_vec();
            for p in &parts[1..] {
                sum.iter_mut().zip(p.iter()).for_each(|(s, v)| *s += v);
            }
            sum
        });
        *x = backend.upload(&sum, rows, cols);
    }

    fn all_gather_cols(&self, backend: &B, x: B::Tensor) -> B::Tensor {
        let (rows, cols) = backend.shape(&x);
        let full = self.exchange(backend.download(&x), |parts| {
            let mut full = Vec::with_capacity(rows * cols * parts.len());
            for r in 0..rows {
                for p in parts {
                    full.extend_from_slice(&p[r * cols..(r + 1) * cols]);
                }
            }
            full
        });
        backend.upload(&full, rows, cols * self.group.slots.len())
    }

    fn abort(&self) {
        self.group.barrier.r#break();
    }
}
