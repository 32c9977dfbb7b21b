//! The CUDA backend: kernels in `kernels/*.cu`, compiled by NVRTC at run time for the exact
//! `sm_XX` of the device (cached on disk), launched through the driver API (cudarc, libraries
//! loaded at run time, so building needs no CUDA at all); on sm_90 and later with programmatic
//! dependent launch, so each kernel's blocks are waiting on the SMs when the one before ends.
//!
//! [`Cuda`] implements the model's `Backend` trait on top of them. [`device::Gpu`] is one device with its stream and compiled kernels; [`ops`] has one
//! function per kernel; [`nvrtc`] compiles and caches; [`kernels`] lists the families and
//! their shared-memory needs (at most 99 KiB per block everywhere, SM120's limit, but MLA
//! decode's larger key tiles on sm_90 and sm_100; tensor cores only through `mma.sync`, which
//! sm_80 to sm_120 all have).

pub mod backend;
pub mod device;
pub mod error;
pub mod kernels;
pub mod nvrtc;
pub mod ops;

pub use backend::{Cuda, CudaPick, CudaTensor, CudaWeight};
pub use device::{driver_available, DevicePtrRaw, Gpu};
pub use error::CudaError;
