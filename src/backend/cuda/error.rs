//! What can go wrong on the CUDA path, as sentences a user can act on.

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "no CUDA driver: libcuda could not be loaded (install the NVIDIA driver, or use \
         --backend cpu)"
    )]
    NoDriver,
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error(
        "NVRTC not found: libnvrtc could not be loaded (install the CUDA toolkit's runtime \
         compiler, e.g. `pip install nvidia-cuda-nvrtc`, and put its lib folder on \
         LD_LIBRARY_PATH)"
    )]
    NoNvrtc,
    #[error("NVRTC failed to compile kernels/{family}.cu for {arch}: {error}\n{log}")]
    Compile {
        family: &'static str,
        arch: String,
        error: String,
        log: String,
    },
    #[error("kernel {kernel}: {what}")]
    Shape { kernel: String, what: String },
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
}

/// Fails with a [`CudaError::Shape`] naming the kernel when `ok` is false.
pub(crate) fn check(
    ok: bool,
    kernel: &str,
    what: impl FnOnce() -> String,
) -> Result<(), CudaError> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape {
            kernel: kernel.to_string(),
            what: what(),
        })
    }
}
