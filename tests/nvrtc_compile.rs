//! Every kernel family compiles with NVRTC for the architectures we promise (Ampere, Ada,
//! Hopper, Blackwell SM120), and no kernel needs more than SM120's 99 KiB of shared memory
//! per block, but MLA decode's split kernels where their key tiles grow (sm_90:
//! `shared_memory_limit`). Static shared memory is read from each cubin's ELF sections as the
//! driver counts it (`static_shared_bytes`: without sm_90's system reserve), dynamic shared
//! memory is the largest the launch code ever asks for (kernels.rs).
//!
//! Needs libnvrtc only (no GPU). Without it the test prints SKIPPED and passes, unless
//! MLA_REQUIRE_NVRTC=1 (set by .ci/nvrtc-check, which installs it).

use mla_engine::backend::cuda::kernels::{
    family_of, max_dynamic_smem, mla_decode_smem_bytes, mla_keys_per_tile, shared_memory_limit,
    FAMILIES, SHARED_MEMORY_LIMIT,
};
use mla_engine::backend::cuda::nvrtc::{
    cached_cubin, compile_cubin, nvrtc_available, nvrtc_version, static_shared_bytes,
};
use mla_engine::backend::cuda::ops::KERNEL_TYPES;
use mla_engine::backend::cuda::CudaError;

const ARCHS: [&str; 4] = ["sm_80", "sm_89", "sm_90", "sm_120"];

#[test]
fn every_kernel_compiles_for_every_arch_within_shared_memory() {
    if !nvrtc_available() {
        assert!(
            std::env::var_os("MLA_REQUIRE_NVRTC").is_none(),
            "MLA_REQUIRE_NVRTC is set but libnvrtc could not be loaded"
        );
        // Without the library, compiling is an error that says what to install, not a panic.
        let err = compile_cubin(&FAMILIES[0], "sm_90").unwrap_err();
        assert!(matches!(err, CudaError::NoNvrtc), "{err}");
        println!("SKIPPED: no NVRTC library (libnvrtc.so); run .ci/nvrtc-check ({err})");
        return;
    }
    let (major, minor) = nvrtc_version().unwrap();
    println!("NVRTC {major}.{minor}");
    // One thread per architecture (NVRTC compiles independent programs concurrently); each
    // returns its report, printed in order.
    let reports: Vec<String> = std::thread::scope(|s| {
        let threads: Vec<_> = ARCHS
            .iter()
            .map(|&arch| s.spawn(move || check_arch(arch)))
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a compile thread panicked"))
            .collect()
    });
    for report in reports {
        print!("{report}");
    }
}

/// Compiles every family for `arch` and checks each kernel's shared memory and family; the
/// report lists every kernel.
fn check_arch(arch: &str) -> String {
    let mut report = String::new();
    let mut seen = Vec::new();
    for family in FAMILIES {
        let cubin = compile_cubin(family, arch).unwrap_or_else(|e| panic!("{e}"));
        let kernels = static_shared_bytes(&cubin)
            .unwrap_or_else(|e| panic!("{} for {arch}: {e}", family.name));
        assert!(
            !kernels.is_empty(),
            "{} for {arch}: no kernels in the cubin",
            family.name
        );
        for (kernel, static_bytes) in kernels {
            let total = static_bytes + max_dynamic_smem(&kernel, arch);
            let limit = if kernel.starts_with("mla_decode_split") {
                shared_memory_limit(arch)
            } else {
                SHARED_MEMORY_LIMIT
            };
            report += &format!(
                "{arch} {:12} {kernel:24} shared {total:6} bytes\n",
                family.name
            );
            assert!(
                total <= limit,
                "{arch}: {kernel} needs {total} bytes of shared memory per block \
                 ({static_bytes} static), over {limit}"
            );
            let owner = family_of(&kernel).map(|f| f.name);
            assert_eq!(
                owner,
                Some(family.name),
                "{kernel}: kernels.rs maps it elsewhere"
            );
            seen.push(kernel);
        }
    }
    for ty in KERNEL_TYPES {
        for prefix in ["matvec", "matvec_t", "matmul", "matmul_t", "embed"] {
            let name = format!("{prefix}_{}", ty.name().to_lowercase());
            assert!(seen.contains(&name), "{arch}: {name} missing");
        }
    }
    report
}

/// MLA decode's key tiles grow to 32 keys only where a block holds their shared memory: on
/// Hopper (where they were measured faster) and datacenter Blackwell, not on SM120 or Ada.
#[test]
fn mla_key_tiles_fit_each_arch() {
    for arch in [
        "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "sm_121",
    ] {
        let bk = mla_keys_per_tile(arch);
        assert!(
            mla_decode_smem_bytes(bk) <= shared_memory_limit(arch),
            "{arch}: tiles of {bk} keys take {} bytes",
            mla_decode_smem_bytes(bk)
        );
        let wide = arch == "sm_90" || arch == "sm_100";
        assert_eq!(bk, if wide { 32 } else { 16 }, "{arch}");
    }
}

#[test]
fn cubin_reader_rejects_garbage() {
    assert!(static_shared_bytes(b"not an elf").is_err());
    assert!(static_shared_bytes(b"\x7fELF\x02\x01\x01").is_err());
}

/// The second request for a family's cubin comes from the disk cache, byte for byte.
#[test]
fn cubins_are_cached_on_disk_per_arch() {
    if !nvrtc_available() {
        println!("SKIPPED: no NVRTC library (libnvrtc.so); run .ci/nvrtc-check");
        return;
    }
    let dir = std::env::temp_dir().join(format!("mla-cubin-test-{}", std::process::id()));
    // nextest runs each test in its own process, so this variable is ours alone.
    std::env::set_var("MLA_CUBIN_CACHE", &dir);
    let family = FAMILIES.iter().find(|f| f.name == "norm").unwrap();
    let first = cached_cubin(family, "sm_89").unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "one cache file: {files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("norm-sm_89-") && name.ends_with(".cubin"),
        "{name}"
    );
    // A planted marker proves the second call reads the file instead of compiling.
    let mut planted = first.clone();
    planted.extend_from_slice(b"cached");
    std::fs::write(&files[0], &planted).unwrap();
    assert_eq!(cached_cubin(family, "sm_89").unwrap(), planted);
    std::fs::remove_dir_all(&dir).unwrap();
}
