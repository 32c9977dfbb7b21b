//! `Nccl`: the communicator of CUDA ranks, one GPU per rank, through cudarc's NCCL bindings.
//!
//! Joining a group needs only the group's 128-byte unique id, the rank and the world size
//! (`Nccl::join`). In one process the ranks are threads and share the id directly
//! (`Nccl::group`); across processes or machines, rank 0 makes the id with `NcclId::new` and a
//! TCP rendezvous hands its bytes (`NcclId::bytes`, `NcclId::from_bytes`) to the others before
//! they call `join` (docs/tp.md).
//!
//! Collectives run on the rank's own stream, in order with its kernels: no host round trip.
//! With two ranks NCCL's sum a + b equals b + a exactly, so TP = 2 is as repeatable as `Local`.

use crate::backend::cuda::{Cuda, CudaTensor};
use crate::backend::{Backend, Communicator};
use cudarc::nccl::safe::{Comm, Id, ReduceOp};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A group's unique id (made once, by rank 0).
#[derive(Clone, Copy)]
pub struct NcclId(Id);

impl NcclId {
    pub fn new() -> Result<NcclId, String> {
        Id::new()
            .map(NcclId)
            .map_err(|e| format!("NCCL unique id: {e:?}"))
    }

    /// The 128 bytes to send to the other ranks.
    pub fn bytes(&self) -> [u8; 128] {
        self.0.internal().map(|c| c as u8)
    }

    pub fn from_bytes(bytes: [u8; 128]) -> NcclId {
        NcclId(Id::uninit(bytes.map(|b| b as _)))
    }
}

/// Time spent in collectives: the stream is synchronized before and after each one, so the
/// figure is the collective alone (including waiting for the slowest rank).
#[derive(Default)]
pub struct Clock {
    nanos: AtomicU64,
    calls: AtomicUsize,
}

impl Clock {
    /// (seconds, number of collectives) so far.
    pub fn read(&self) -> (f64, usize) {
        (
            self.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            self.calls.load(Ordering::Relaxed),
        )
    }
}

/// One rank's end of an NCCL group.
pub struct Nccl {
    comm: Comm,
    clock: Option<Arc<Clock>>,
}

// SAFETY: a rank's Comm is used only by the thread running that rank (one collective at a
// time, in program order); NCCL communicators may move between threads.
unsafe impl Send for Nccl {}
unsafe impl Sync for Nccl {}

impl Nccl {
    /// Joins group `id` as `rank` of `world` on `cuda`'s GPU; blocks until every rank joins.
    pub fn join(cuda: &Cuda, rank: usize, world: usize, id: NcclId) -> Result<Nccl, String> {
        let stream = cuda.gpu.stream.clone();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| format!("rank {rank}: {e}"))?;
        let comm = Comm::from_rank(stream, rank, world, id.0)
            .map_err(|e| format!("rank {rank}: NCCL init: {e:?}"))?;
        Ok(Nccl { comm, clock: None })
    }

    /// A group over `gpus` (rank = index) in this process: one joining thread per GPU.
    pub fn group(gpus: &[Cuda]) -> Result<Vec<Nccl>, String> {
        let id = NcclId::new()?;
        let world = gpus.len();
        std::thread::scope(|s| {
            let joins: Vec<_> = gpus
                .iter()
                .enumerate()
                .map(|(rank, g)| s.spawn(move || Nccl::join(g, rank, world, id)))
                .collect();
            joins
                .into_iter()
                .map(|j| j.join().expect("NCCL join thread"))
                .collect()
        })
    }

    /// Times every collective on `clock` (synchronizing the stream around each).
    pub fn timed(mut self, clock: Arc<Clock>) -> Nccl {
        self.clock = Some(clock);
        self
    }

    fn run(&self, cuda: &Cuda, op: impl FnOnce() -> Result<(), String>) {
        let start = self.clock.as_ref().map(|_| {
            cuda.gpu.sync().expect("cuda sync");
            Instant::now()
        });
        op().unwrap_or_else(|e| panic!("NCCL rank {}: {e}", self.comm.rank()));
        if let (Some(start), Some(clock)) = (start, &self.clock) {
            cuda.gpu.sync().expect("cuda sync");
            clock
                .nanos
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            clock.calls.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Communicator<Cuda> for Nccl {
    fn all_reduce(&self, cuda: &Cuda, x: &mut CudaTensor) {
        let stored = x.stored();
        self.run(cuda, || {
            let mut view = x.buf_mut().slice_mut(0..stored);
            self.comm
                .all_reduce_in_place(&mut view, &ReduceOp::Sum)
                .map(|_| ())
                .map_err(|e| format!("all_reduce: {e:?}"))
        });
    }

    fn all_gather_cols(&self, cuda: &Cuda, x: CudaTensor) -> CudaTensor {
        let (rows, cols) = cuda.shape(&x);
        let world = self.comm.world_size();
        // NCCL gathers whole buffers: rank r's [rows, cols] lands at rows r*rows.. of `stacked`.
        let mut stacked = cuda.zeros(world * rows, cols);
        self.run(cuda, || {
            let send = x.buf().slice(0..rows * cols);
            let mut recv = stacked.buf_mut().slice_mut(0..world * rows * cols);
            self.comm
                .all_gather(&send, &mut recv)
                .map(|_| ())
                .map_err(|e| format!("all_gather: {e:?}"))
        });
        let mut full = cuda.zeros(rows, world * cols);
        for r in 0..world {
            let block = cuda.slice(&stacked, r * rows..(r + 1) * rows, 0..cols);
            cuda.write_block(&mut full, 0, r * cols, &block);
        }
        full
    }
}
