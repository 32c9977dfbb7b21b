//! Kernel compilation: NVRTC turns a family's CUDA C++ into a cubin for one exact `sm_XX`, and
//! a disk cache keeps it, so the toolkit is never needed at build time and a second start
//! skips the compiler.
//!
//! The cache lives in `$MLA_CUBIN_CACHE`, else `$XDG_CACHE_HOME/mla-engine/cubin`, else
//! `~/.cache/mla-engine/cubin`; a file is named by family, arch and a hash of the source, the
//! options and the NVRTC version, so an edit or a new compiler never reuses a stale cubin.

use std::ffi::{c_char, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result as nvrtc, sys};

use super::error::CudaError;
use super::kernels::Family;

/// Options for every compile: the exact architecture, device code by default, IEEE math (the
/// kernels are checked against f32/f64 twins; no fast-math approximations).
fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-default-device".into(),
        "-lineinfo".into(),
    ]
}

/// Whether libnvrtc can be loaded (cudarc would panic on first use otherwise).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { sys::is_culib_present() }
}

/// The loaded NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|_| CudaError::NoNvrtc)?;
    Ok((major, minor))
}

/// Compiles `family` for `arch` ("sm_90") to a cubin, without the cache.
pub fn compile_cubin(family: &Family, arch: &str) -> Result<Vec<u8>, CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let compile_err = |error: String, log: String| CudaError::Compile {
        family: family.name,
        arch: arch.into(),
        error,
        log,
    };
    let src = CString::new(family.source(arch)).expect("kernel sources hold no NUL");
    let name = CString::new(format!("{}.cu", family.name)).expect("no NUL");
    let prog = nvrtc::create_program(&src, Some(&name))
        .map_err(|e| compile_err(format!("{e:?}"), String::new()))?;
    // SAFETY: `prog` is a live program until destroy_program below; buffers are sized by the
    // size queries that precede each copy.
    let result = unsafe {
        match nvrtc::compile_program(prog, &options(arch)) {
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|raw| {
                        let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
                        String::from_utf8_lossy(&bytes)
                            .trim_end_matches('\0')
                            .to_string()
                    })
                    .unwrap_or_default();
                Err(compile_err(format!("{e:?}"), log))
            }
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| compile_err(format!("nvrtcGetCUBINSize: {e:?}"), String::new()))?;
                let mut cubin = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char)
                    .result()
                    .map_err(|e| compile_err(format!("nvrtcGetCUBIN: {e:?}"), String::new()))?;
                Ok(cubin)
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MLA_CUBIN_CACHE") {
        return Some(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(p).join("mla-engine/cubin"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/mla-engine/cubin"))
}

/// FNV-1a, 64 bit: a hash that stays the same across Rust releases (unlike DefaultHasher).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in *p {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The cubin of `family` for `arch`, from the disk cache when present, else compiled and
/// stored. A cache that cannot be written only costs a recompile next time.
pub fn cached_cubin(family: &Family, arch: &str) -> Result<Vec<u8>, CudaError> {
    let (major, minor) = nvrtc_version()?;
    let key = fnv1a(&[
        family.source(arch).as_bytes(),
        options(arch).join(" ").as_bytes(),
        format!("{major}.{minor}").as_bytes(),
    ]);
    let path = cache_dir().map(|d| d.join(format!("{}-{arch}-{key:016x}.cubin", family.name)));
    if let Some(path) = &path {
        if let Ok(bytes) = std::fs::read(path) {
            return Ok(bytes);
        }
    }
    let cubin = compile_cubin(family, arch)?;
    if let Some(path) = &path {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&tmp, &cubin))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            eprintln!("warning: cubin cache {}: {e}", path.display());
        }
    }
    Ok(cubin)
}

/// The system's shared memory a block of sm_90 and later holds besides its own: NVRTC's cubins
/// for those architectures (those with a `.nv.shared.reserved.0` section) start every
/// kernel's `.nv.shared.K` with it, and the driver counts neither it as the kernel's static
/// shared memory nor it against the per-block limit (an H100, driver 580: a 3200-byte
/// section, `CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES` 2176, dynamic shared memory accepted up to
/// the opt-in limit less 2176; docs/performance.md, forty-fifth look).
const RESERVED_SHARED_BYTES: usize = 1024;

/// Static shared memory per kernel of a cubin as the driver counts it against the per-block
/// limit, read from its ELF section table: for kernel K the size of the section
/// `.nv.shared.K` (absent when K declares none), less RESERVED_SHARED_BYTES where the cubin
/// has the reserve. Returns (kernel, bytes) for every kernel (every unmangled `.text.K`
/// section).
pub fn static_shared_bytes(cubin: &[u8]) -> Result<Vec<(String, usize)>, String> {
    let u16_at = |o: usize| {
        cubin
            .get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
    };
    let u32_at = |o: usize| {
        cubin
            .get(o..o + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize)
    };
    let u64_at = |o: usize| {
        cubin
            .get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
    };
    if cubin.get(0..5) != Some(b"\x7fELF\x02") {
        return Err("not a 64-bit ELF file".into());
    }
    let short = || "ELF header truncated".to_string();
    let shoff = u64_at(0x28).ok_or_else(short)?;
    let shentsize = u16_at(0x3a).ok_or_else(short)?;
    let shnum = u16_at(0x3c).ok_or_else(short)?;
    let shstrndx = u16_at(0x3e).ok_or_else(short)?;
    let section = |i: usize| -> Result<(usize, usize, usize), String> {
        let o = shoff + i * shentsize;
        let bad = || format!("section header {i} out of bounds");
        Ok((
            u32_at(o).ok_or_else(bad)?,
            u64_at(o + 24).ok_or_else(bad)?,
            u64_at(o + 32).ok_or_else(bad)?,
        ))
    };
    let (_, strtab_off, strtab_size) = section(shstrndx)?;
    let name_of = |off: usize| -> Result<String, String> {
        let start = strtab_off + off;
        let bytes = cubin
            .get(start..strtab_off + strtab_size)
            .ok_or("section name out of bounds")?;
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        Ok(String::from_utf8_lossy(&bytes[..end]).into_owned())
    };
    let mut kernels = Vec::new();
    let mut shared = Vec::new();
    let mut reserve = 0;
    for i in 0..shnum {
        let (name_off, _, size) = section(i)?;
        let name = name_of(name_off)?;
        if name == ".nv.shared.reserved.0" {
            reserve = RESERVED_SHARED_BYTES;
        } else if let Some(k) = name.strip_prefix(".text.") {
            // Our kernels are extern "C"; mangled names are device functions left uninlined.
            if !k.starts_with("_Z") {
                kernels.push(k.to_string());
            }
        } else if let Some(k) = name.strip_prefix(".nv.shared.") {
            shared.push((k.to_string(), size));
        }
    }
    Ok(kernels
        .into_iter()
        .map(|k| {
            let bytes = shared.iter().find(|(s, _)| *s == k).map_or(0, |s| s.1);
            (k, bytes.saturating_sub(reserve))
        })
        .collect())
}
