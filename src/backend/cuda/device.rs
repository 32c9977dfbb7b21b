//! One GPU: its context and stream, its compiled kernels, and device buffers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use super::error::{check, CudaError};
use super::kernels::{
    chain_clock, family_of, max_dynamic_smem, mla_keys_per_tile, Family, FAMILIES,
};
use super::nvrtc::cached_cubin;

/// A raw device address (CUdeviceptr) handed to a kernel; 0 means "absent" for optional
/// arguments. The caller keeps the buffer it points into alive until the work is done.
pub type DevicePtrRaw = u64;

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    /// Every launch and copy goes to this one stream, in order (but the read-back of picks).
    pub stream: Arc<CudaStream>,
    /// Reads greedy picks back (`read_after`) while `stream` runs the work queued after them.
    pick_stream: Arc<CudaStream>,
    /// "sm_90", "sm_120": the architecture kernels are compiled for.
    pub arch: String,
    /// Keys a shared tile of the MLA decode split kernels as compiled for `arch` (kernels.rs,
    /// mla_keys_per_tile: 32 on sm_90 and sm_100, else 16).
    pub mla_bk: usize,
    pub name: String,
    pub multiprocessors: usize,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// Blocks per SM of (kernel, threads, dynamic shared memory), as the driver computes them.
    occupancy: Mutex<HashMap<(String, u32, usize), usize>>,
    /// Whether kernels launch with programmatic dependent launch (`launch_raw`): sm_90 and
    /// later, unless MLA_PDL=0 (to measure without it, or to rule it out).
    pub dependent_launch: bool,
    /// Whether the Q4_K tensor-core products take their weights by bulk copies
    /// (matvec_tma_q4_k, ops.rs): sm_90 and later, unless MLA_BULK=0 (to measure without).
    pub bulk_copies: bool,
    /// Whether the Q4_K tensor-core products of items with an input each (the MoE downs, MLA's
    /// v_b) take a tile a stage by bulk copies (matvec_tma_items_q4_k, ops.rs): sm_90 and later
    /// with bulk_copies, unless MLA_ITEMS=0 (to measure without).
    pub item_copies: bool,
    /// Whether a decode row's residual add and norm run on a cluster of blocks
    /// (add_rmsnorm_cluster, ops.rs), which alone sums a row given as parts: sm_90 and later.
    pub clusters: bool,
    /// Keys from which a few long rows' DSA top-k (decode) run on a cluster of blocks each
    /// (topk_rows_cluster4 / 8, ops.rs): sm_90 and later, from TOPK_CLUSTER_MIN_KEYS unless
    /// MLA_TOPK_CLUSTER_KEYS says otherwise (to measure where it gains); None: never.
    pub topk_cluster_keys: Option<usize>,
    /// Whether the DSA indexer's scores run on the tensor cores (dsa_scores_mma*, ops.rs) where
    /// the key width is a multiple of 16; `MLA_DSA_MMA=0` keeps them on the f32 kernels.
    pub dsa_mma: bool,
    /// Whether prefill attention of 16 rows or more runs on the tensor cores (ops.rs,
    /// attention_prefill_mma); `MLA_ATT_MMA=0` keeps it on the f32 kernel, to measure it.
    pub attention_mma: bool,
    /// Grow-only scratch of `mla_decode` (its split partials), kept between calls so that
    /// decode does not allocate per layer (ops.rs).
    pub(super) mla_work: Mutex<Option<CudaSlice<f32>>>,
    /// Grow-only per-token counters of `moe_route_f32` (ops.rs), zero between launches: the
    /// kernel's routing block puts its token's back.
    pub(super) route_done: Mutex<Option<CudaSlice<i32>>>,
    /// Grow-only counters of the tensor-core matvec's combine (`Matvec::combine`, ops.rs), zero
    /// between launches: the block that sums a group's rows puts its counter back.
    pub(super) combine_done: Mutex<Option<CudaSlice<i32>>>,
    /// Grow-only counter and per-block pairs of `argmax_row` and of the lm head's pick
    /// (`Matvec::pick`, ops.rs), the counter zero between launches.
    pub(super) argmax_work: Mutex<Option<CudaSlice<i32>>>,
    /// The per-item counters of the parts launches' tails (matvec_latent_<type>,
    /// matvec_tma_parts_<type>: `Gpu::matvec_parts`, ops.rs), zero between launches: the last
    /// block of each item puts its counter back.
    pub(super) latent_done: Mutex<Option<CudaSlice<i32>>>,
    /// The chain clock's stamps and launches, where `kernels::chain_clock` is on.
    chain_clock: Option<ChainClock>,
}

/// CHAIN_CLOCK_STAMPS of kernels/common.cuh.
const CHAIN_CLOCK_STAMPS: usize = 8192;

/// The chain clock (kernels/common.cuh): the buffer every module's `mla_chain_clock` points
/// at ([0] the stamps taken, then (grid id, ns) pairs), and the kernels launched since
/// `chain_clock_start`, in order.
struct ChainClock {
    stamps: CudaSlice<u64>,
    launches: Mutex<Vec<String>>,
}

fn no_chain_clock() -> CudaError {
    CudaError::Shape {
        kernel: "chain clock".into(),
        what: "off: set MLA_CHAIN_CLOCK=1 before the GPU is opened".into(),
    }
}

/// Whether the CUDA driver library can be loaded at all.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen libcuda by its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Every buffer comes from the device's default memory pool (cudarc allocates and frees in
/// stream order). With the pool's default release threshold of zero, each synchronization
/// hands the pool's unused memory back to the driver, and decode synchronizes once a token
/// (the pick's read-back), so the next token's activations would need the driver to map
/// memory again. Keeping all of it makes an allocation a sub-allocation of what the pool
/// already holds: the most any step has had live at once, which later allocations reuse.
/// Measured on an H100 (docs/performance.md, thirtieth look): prefill 1-5% faster, decode the
/// same.
fn keep_pool_memory(ctx: &CudaContext) -> Result<(), CudaError> {
    use cudarc::driver::result::{device, mem_pool};
    use cudarc::driver::sys::CUmemPool_attribute;
    // MLA_KEEP_POOL=0 leaves the default (to measure it).
    if !ctx.has_async_alloc() || std::env::var("MLA_KEEP_POOL").is_ok_and(|v| v == "0") {
        return Ok(());
    }
    let mut keep = u64::MAX;
    // SAFETY: the context's own device, and the attribute's value is a u64.
    unsafe {
        let pool = device::get_default_mem_pool(ctx.cu_device())?;
        mem_pool::set_attribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut keep as *mut u64 as *mut std::ffi::c_void,
        )?;
    }
    Ok(())
}

/// Rows from which a cluster takes a decode row. Its passes cost each of its blocks about what
/// they cost topk_rows' one block over a short row, plus the cluster's barriers and reads, so
/// that its time hardly grows with the row: H200, the GLM-5 file's own rows (ncu) of 12K /
/// 16K / 24K keys take topk_rows 10.2 / 13.2 / 17.6 us, topk_rows_cluster4 11.5 / 11.7 / 12.2
/// (docs/performance.md, fifty-sixth look).
const TOPK_CLUSTER_MIN_KEYS: usize = 16 * 1024;

/// Gpu::topk_cluster_keys on sm_90 and later: MLA_TOPK_CLUSTER_KEYS if set (0: every decode
/// row), else TOPK_CLUSTER_MIN_KEYS.
fn topk_cluster_keys() -> usize {
    std::env::var("MLA_TOPK_CLUSTER_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(TOPK_CLUSTER_MIN_KEYS)
}

impl Gpu {
    /// Opens device `ordinal`, or says why there is none (no driver, no device).
    pub fn new(ordinal: usize) -> Result<Gpu, CudaError> {
        if !driver_available() {
            return Err(CudaError::NoDriver);
        }
        let count = CudaContext::device_count()
            .map_err(|e| CudaError::NoDevice(format!("the driver did not start: {e}")))?;
        if ordinal >= count as usize {
            return Err(CudaError::NoDevice(format!(
                "device {ordinal} asked for, the driver sees {count}"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        // cudarc gives every buffer two events for ordering across streams; all of our work
        // runs in order on `stream` (the pick read-back waits on an event of its own), so the
        // ~4 driver calls per buffer they cost were host time spent on every activation
        // (measured on an H200: host enqueue ~670 us of a ~900-980 us decode token).
        // SAFETY: called before any buffer of this context exists.
        unsafe { ctx.disable_event_tracking() };
        keep_pool_memory(&ctx)?;
        let (major, minor) = ctx.compute_capability()?;
        let multiprocessors =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        let stream = ctx.default_stream();
        let pick_stream = ctx.new_stream()?;
        let dependent_launch = major >= 9 && std::env::var("MLA_PDL").map_or(true, |v| v != "0");
        let chain_clock = if chain_clock() {
            Some(ChainClock {
                stamps: stream.alloc_zeros(1 + 2 * CHAIN_CLOCK_STAMPS)?,
                launches: Mutex::default(),
            })
        } else {
            None
        };
        let bulk_copies = major >= 9 && std::env::var("MLA_BULK").map_or(true, |v| v != "0");
        let arch = format!("sm_{major}{minor}");
        Ok(Gpu {
            dependent_launch,
            bulk_copies,
            clusters: major >= 9,
            topk_cluster_keys: (major >= 9).then(topk_cluster_keys),
            item_copies: std::env::var("MLA_ITEMS").map_or(true, |v| v != "0"),
            dsa_mma: std::env::var("MLA_DSA_MMA").map_or(true, |v| v != "0"),
            attention_mma: std::env::var("MLA_ATT_MMA").map_or(true, |v| v != "0"),
            name: ctx.name()?,
            mla_bk: mla_keys_per_tile(&arch),
            arch,
            multiprocessors,
            stream,
            pick_stream,
            ctx,
            modules: Mutex::default(),
            functions: Mutex::default(),
            occupancy: Mutex::default(),
            mla_work: Mutex::default(),
            route_done: Mutex::default(),
            combine_done: Mutex::default(),
            argmax_work: Mutex::default(),
            latent_done: Mutex::default(),
            chain_clock,
        })
    }

    /// The loaded module of `family`, compiled (or read from the cubin cache) on first use.
    fn module(&self, family: &'static Family) -> Result<Arc<CudaModule>, CudaError> {
        let mut modules = self.modules.lock().unwrap();
        if let Some(m) = modules.get(family.name) {
            return Ok(m.clone());
        }
        let cubin = cached_cubin(family, &self.arch)?;
        let m = self.ctx.load_module(Ptx::from_binary(cubin))?;
        if let Some(clock) = &self.chain_clock {
            let address = self.ptr(&clock.stamps, 0).to_le_bytes();
            let mut global = m.get_global("mla_chain_clock", &self.stream)?;
            self.stream.memcpy_htod(&address, &mut global)?;
        }
        modules.insert(family.name, m.clone());
        Ok(m)
    }

    /// Compiles (or loads from the cache) and loads every kernel family now, so that a missing
    /// NVRTC or a compile error shows at start as an error, not at the first launch.
    pub fn load_all_kernels(&self) -> Result<(), CudaError> {
        for family in FAMILIES {
            self.module(family)?;
        }
        Ok(())
    }

    /// How many blocks of `threads` threads and `smem` bytes of dynamic shared memory of `kernel`
    /// one SM holds at once (registers, shared memory, threads), asked of the driver once.
    pub fn blocks_per_sm(
        &self,
        kernel: &str,
        threads: u32,
        smem: usize,
    ) -> Result<usize, CudaError> {
        let key = (kernel.to_string(), threads, smem);
        if let Some(&n) = self.occupancy.lock().unwrap().get(&key) {
            return Ok(n);
        }
        let f = self.function(kernel)?;
        let n = f.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)? as usize;
        self.occupancy.lock().unwrap().insert(key, n);
        Ok(n)
    }

    /// How many blocks of `kernel` the whole GPU holds at once (at least one per SM): one wave.
    pub fn wave_blocks(&self, kernel: &str, threads: u32, smem: usize) -> Result<usize, CudaError> {
        Ok(self.multiprocessors * self.blocks_per_sm(kernel, threads, smem)?.max(1))
    }

    /// The kernel named `kernel`, compiling (or loading from the cache) its family on first use.
    pub fn function(&self, kernel: &str) -> Result<CudaFunction, CudaError> {
        if let Some(f) = self.functions.lock().unwrap().get(kernel) {
            return Ok(f.clone());
        }
        let family = family_of(kernel).ok_or_else(|| CudaError::Shape {
            kernel: kernel.to_string(),
            what: "no kernel family defines it".into(),
        })?;
        let f = self.module(family)?.load_function(kernel)?;
        let dynamic = max_dynamic_smem(kernel, &self.arch);
        if dynamic > 48 * 1024 {
            // Above 48 KiB a kernel must opt in to dynamic shared memory.
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic as i32,
            )?;
        }
        self.functions
            .lock()
            .unwrap()
            .insert(kernel.to_string(), f.clone());
        Ok(f)
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.clone_htod(host)?)
    }

    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    /// A zeroed buffer of `n` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros(n)?)
    }

    /// A buffer of `n` f32 for a kernel to overwrite whole, without the memset of `zeros`:
    /// uninitialized in release builds; in debug builds (the GPU tests) every byte is 0xff, a
    /// NaN, so an element a kernel fails to write shows up in the stage comparisons.
    pub fn empty(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        // SAFETY: the callers hand the buffer to a kernel that writes every element before
        // anything reads it (checked by the NaN fill under the GPU tests).
        let buf = unsafe { self.stream.alloc::<f32>(n) }?;
        if cfg!(debug_assertions) {
            let (p, _record) = buf.device_ptr(&self.stream);
            // SAFETY: p addresses the n * 4 bytes just allocated on this stream.
            unsafe {
                cudarc::driver::result::memset_d8_async(p, 0xff, n * 4, self.stream.cu_stream())
            }?;
        }
        Ok(buf)
    }

    /// A buffer of `n` i32 for a kernel to overwrite whole (uninitialized).
    pub fn empty_i32(&self, n: usize) -> Result<CudaSlice<i32>, CudaError> {
        // SAFETY: as `empty`: the caller's kernel writes every element before any read.
        Ok(unsafe { self.stream.alloc::<i32>(n.max(1)) }?)
    }

    /// Marks the work queued so far, for `read_after` to wait on.
    pub fn mark(&self) -> Result<CudaEvent, CudaError> {
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        Ok(self.stream.record_event(Some(flags))?)
    }

    /// `buf` once the work before `done` has written it, without waiting for the work queued
    /// after `done`: the copy runs on a stream of its own.
    pub fn read_after<T: DeviceRepr + Default + Clone>(
        &self,
        buf: &CudaSlice<T>,
        done: &CudaEvent,
    ) -> Result<Vec<T>, CudaError> {
        self.pick_stream.wait(done)?;
        let host = self.pick_stream.clone_dtoh(buf)?;
        self.pick_stream.synchronize()?;
        Ok(host)
    }

    /// Waits for all queued work, surfacing any error a kernel raised.
    pub fn sync(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// Notes a launch for the chain clock (nothing without it).
    pub fn chain_clock_note(&self, kernel: &str) {
        if let Some(clock) = &self.chain_clock {
            clock.launches.lock().unwrap().push(kernel.to_string());
        }
    }

    /// The launches noted since `chain_clock_start` so far.
    pub fn chain_clock_launches(&self) -> usize {
        self.chain_clock
            .as_ref()
            .map_or(0, |c| c.launches.lock().unwrap().len())
    }

    /// Starts the chain clock over, in stream order: stamps of work queued before are dropped.
    pub fn chain_clock_start(&self) -> Result<(), CudaError> {
        let clock = self.chain_clock.as_ref().ok_or_else(no_chain_clock)?;
        // SAFETY: the buffer's first 8 bytes (the count), on the stream that uses it.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.ptr(&clock.stamps, 0),
                0,
                8,
                self.stream.cu_stream(),
            )
        }?;
        clock.launches.lock().unwrap().clear();
        Ok(())
    }

    /// Every launch since `chain_clock_start`, in order, with the global timer (ns) when its
    /// stamping thread (common.cuh) was through its wait: the time the launch before it ended,
    /// or for a launch without programmatic dependence, when it began. Waits for the work.
    pub fn chain_clock_read(&self) -> Result<Vec<(String, u64)>, CudaError> {
        let clock = self.chain_clock.as_ref().ok_or_else(no_chain_clock)?;
        self.sync()?;
        let buf = self.download(&clock.stamps)?;
        let taken = buf[0] as usize;
        let launches = clock.launches.lock().unwrap();
        check(taken <= CHAIN_CLOCK_STAMPS, "chain clock", || {
            format!("{taken} stamps, room for {CHAIN_CLOCK_STAMPS}: time fewer launches")
        })?;
        // A launch whose thread waited twice stamped twice under one grid id.
        let mut stamps: Vec<(u64, u64)> = Vec::with_capacity(taken);
        for pair in buf[1..1 + 2 * taken].chunks_exact(2) {
            if stamps.last().is_none_or(|&(grid, _)| grid != pair[0]) {
                stamps.push((pair[0], pair[1]));
            }
        }
        check(stamps.len() == launches.len(), "chain clock", || {
            format!(
                "{} launches stamped, {} noted: a kernel whose stamping thread does not wait \
                 (pdl_wait)",
                stamps.len(),
                launches.len()
            )
        })?;
        Ok(launches
            .iter()
            .zip(stamps)
            .map(|(name, (_, ns))| (name.clone(), ns))
            .collect())
    }

    /// The raw address of element `offset` of `buf`.
    pub fn ptr<T>(&self, buf: &CudaSlice<T>, offset: usize) -> DevicePtrRaw {
        let (p, _record) = buf.device_ptr(&self.stream);
        p + (offset * std::mem::size_of::<T>()) as u64
    }

    /// The address of `n` i32 counters, all zero, from the grow-only buffer in `slot`: a kernel
    /// that counts its blocks in (`moe_route_f32`, the matvec's combine) puts each back to zero.
    pub(super) fn zeroed_counters(
        &self,
        slot: &Mutex<Option<CudaSlice<i32>>>,
        n: usize,
    ) -> Result<DevicePtrRaw, CudaError> {
        let mut counters = slot.lock().unwrap();
        if counters.as_ref().is_none_or(|c| c.len() < n) {
            *counters = None;
            *counters = Some(self.zeros::<i32>(n)?);
        }
        Ok(self.ptr(counters.as_ref().unwrap(), 0))
    }
}

/// Launches `kernel` on `gpu`'s stream: `launch!(gpu, "name", grid, block, smem; args...)`,
/// the arguments in the kernel's order, each by value (scalars, or raw device addresses).
macro_rules! launch {
    ($gpu:expr, $kernel:expr, $grid:expr, $block:expr, $smem:expr; $($arg:expr),* $(,)?) => {{
        let dependent = $gpu.dependent_launch
            && $crate::backend::cuda::kernels::dependent_launch_helps(&$kernel);
        launch!(@dependent dependent, $gpu, $kernel, $grid, $block, $smem; $($arg),*)
    }};
    // `dependent` chosen by the caller (what it knows of the grid).
    (@dependent $dependent:expr, $gpu:expr, $kernel:expr, $grid:expr, $block:expr, $smem:expr;
     $($arg:expr),* $(,)?) => {{
        let f = $gpu.function(&$kernel)?;
        let args: &[&dyn cudarc::driver::DeviceRepr] = &[$(&$arg),*];
        let mut params: Vec<*mut std::ffi::c_void> = args
            .iter()
            .map(|a| *a as *const dyn cudarc::driver::DeviceRepr as *mut std::ffi::c_void)
            .collect();
        // SAFETY: the wrapper calling this passes the arguments its kernel declares, in order
        // and of the declared types, after checking shapes; addresses come from the caller's
        // live buffers.
        unsafe { $gpu.launch_raw(&f, $grid, $block, $smem, &mut params, $dependent) }?;
        $gpu.chain_clock_note(&$kernel);
    }};
}
pub(crate) use launch;

impl Gpu {
    /// Queues `f` with `params` (pointers to each argument's value) on the stream; `dependent`:
    /// with programmatic dependent launch allowed (kernels/common.cuh, pdl_enter), so that its
    /// blocks are on the SMs when the kernel before it ends: decode is a chain of ~80 short
    /// kernels whose launch gaps were a tenth of its time (docs/performance.md).
    ///
    /// # Safety
    /// `params` must match the kernel's parameters in count, order and type.
    pub(crate) unsafe fn launch_raw(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &mut [*mut std::ffi::c_void],
        dependent: bool,
    ) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread()?;
        // SAFETY: a plain C union of integers, all-zero is valid.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: dependent as u32,
        };
        // SAFETY: cfg and params outlive the call; the caller vouches for params.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        Ok(())
    }
}
