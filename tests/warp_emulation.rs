//! The integer tensor-core products' fragment math (kernels/matvec.cu: `TcQ4k`, and `TcQ6k`
//! with `q6_dot`), checked on the CPU: the kernel's own device functions, cut out of the
//! source, run on one emulated warp (tests/warp_emulation/warp.h: 32 lanes as threads,
//! mma.sync by the PTX ISA's fragment layouts) over random 16-row tiles, against the engine's
//! dequantization (bit for bit gguf-py's, tests/quant.rs) and an f64 dot product. A wrong
//! lane, column, offset or scale gives an nmse near 1; the kernels' exact integer sums ~1e-14.
//! The bound is the GPU tests' for these kernels (cuda_kernels, F32_OP), so that a change of
//! their layout can be checked before a GPU runs it.
//!
//! Needs a C++20 compiler (`$CXX`, else g++); without one the tests print SKIPPED.

use std::path::{Path, PathBuf};
use std::process::Command;

use mla_engine::gguf::ggml_type::GgmlType;
use mla_engine::quant;
use mla_engine::sampling::Rng;

/// The device functions each harness runs, in the order the source defines them (TcQ6k's
/// products weigh their planes by TcQ4k::plane_factors, so every harness takes them all).
const PIECES: &[&str] = &[
    "__device__ __forceinline__ float byte_f(",
    "__device__ __forceinline__ int tc_plane_stride(",
    "__device__ __forceinline__ int tc_scales_len(",
    "struct XDigits {",
    "__device__ __forceinline__ XDigits x_block_digits(",
    "__device__ void tc_prepare_x(",
    "__device__ __forceinline__ void q4k_packed(",
    "struct TcQ4k {",
    "__device__ __forceinline__ void quad_sums(",
    "template <int N>\n__device__ __forceinline__ void lds_words(",
    "struct TcQ6k {",
    "__device__ __forceinline__ void q6_dot(",
];

/// A harness (tests/warp_emulation/NAME.cpp) and the block type its tiles hold.
struct Harness {
    name: &'static str,
    ty: GgmlType,
}

const TC_Q4_K: Harness = Harness {
    name: "tc_q4k",
    ty: GgmlType::Q4_K,
};

const TC_Q6_K: Harness = Harness {
    name: "tc_q6k",
    ty: GgmlType::Q6_K,
};

const F32_OP: f64 = 1e-10;

/// The definition that starts with `head`: up to its matching closing brace (and a `;`).
fn definition<'a>(src: &'a str, head: &str) -> &'a str {
    let start = src
        .find(head)
        .unwrap_or_else(|| panic!("kernels/matvec.cu has no `{head}`"));
    let open = start + src[start..].find('{').unwrap();
    let mut depth = 0;
    for (i, c) in src[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    let end = open + i + 1;
                    let end = if src[end..].starts_with(';') {
                        end + 1
                    } else {
                        end
                    };
                    return &src[start..end];
                }
            }
            _ => {}
        }
    }
    panic!("`{head}` has no closing brace");
}

/// Builds the harness; None when there is no C++ compiler.
fn build(h: &Harness, dir: &Path) -> Option<PathBuf> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        println!("SKIPPED: no C++ compiler ({cxx}) for the warp emulation");
        return None;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let kernel = std::fs::read_to_string(root.join("kernels/matvec.cu")).unwrap();
    let here = root.join("tests/warp_emulation");
    let mut src = String::from("#include \"warp.h\"\n");
    for head in PIECES {
        src += definition(&kernel, head);
        src += "\n";
    }
    src += &std::fs::read_to_string(here.join(format!("{}.cpp", h.name))).unwrap();
    let cpp = dir.join(format!("{}.cpp", h.name));
    std::fs::write(&cpp, src).unwrap();
    let bin = dir.join(h.name);
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-I"])
        .arg(&here)
        .arg(&cpp)
        .arg("-o")
        .arg(&bin)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cxx} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(bin)
}

/// 16 rows of nb blocks of one type, and x.
struct Tile {
    nb: usize,
    w: Vec<u8>,
    x: Vec<f32>,
}

/// Where a block's f16 scales lie: Q4_K's d and dmin first, Q6_K's d last.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => unreachable!(),
    }
}

/// Random blocks (finite scales of mixed sizes), x of mixed magnitudes with one block of zeros
/// (its scale 0).
fn random_tile(ty: GgmlType, nb: usize, seed: u64) -> Tile {
    let mut rng = Rng::new(seed);
    let mut signed = move || (2.0 * rng.next_f64() - 1.0) as f32;
    let mut w: Vec<u8> = (0..16 * nb * ty.type_size())
        .map(|_| (128.0 * signed() + 128.0) as u8)
        .collect();
    for block in w.chunks_exact_mut(ty.type_size()) {
        for &at in f16_fields(ty) {
            let v = signed() * 2f32.powi((4.0 * signed()) as i32 - 8);
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    let mut x: Vec<f32> = (0..256 * nb)
        .map(|i| signed() * if i % 7 == 0 { 30.0 } else { 1.0 })
        .collect();
    if nb > 1 {
        x[256..512].fill(0.0);
    }
    Tile { nb, w, x }
}

/// Every code at its largest (all bits set; Q6_K's scales -128), x at one value: the largest
/// sums the integer path holds (each plane 0 digit 127).
fn largest_tile(ty: GgmlType, nb: usize) -> Tile {
    let mut w = vec![0xFFu8; 16 * nb * ty.type_size()];
    for block in w.chunks_exact_mut(ty.type_size()) {
        if ty == GgmlType::Q6_K {
            block[192..208].fill(0x80);
        }
        for &at in f16_fields(ty) {
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(0.002).to_le_bytes());
        }
    }
    Tile {
        nb,
        w,
        x: vec![3.0; 256 * nb],
    }
}

fn run(bin: &Path, dir: &Path, tile: &Tile) -> Vec<f32> {
    let mut input = (tile.nb as i32).to_le_bytes().to_vec();
    input.extend_from_slice(&tile.w);
    input.extend(tile.x.iter().flat_map(|v| v.to_le_bytes()));
    let path = dir.join("input.bin");
    std::fs::write(&path, input).unwrap();
    let out = Command::new(bin).arg(&path).output().unwrap();
    assert!(out.status.success(), "harness failed: {:?}", out.status);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| f32::from_bits(u32::from_str_radix(l, 16).unwrap()))
        .collect()
}

fn reference(ty: GgmlType, tile: &Tile) -> Vec<f64> {
    let k = 256 * tile.nb;
    tile.w
        .chunks_exact(tile.nb * ty.type_size())
        .map(|row| {
            let mut vals = vec![0f32; k];
            quant::dequantize(ty, row, &mut vals).unwrap();
            vals.iter()
                .zip(&tile.x)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum()
        })
        .collect()
}

fn nmse(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if num.is_nan() {
        f64::INFINITY
    } else {
        num / den
    }
}

/// Random tiles of k = 256, 2048 (twice) and 7168, and the largest sums at k = 2048.
fn check(h: &Harness) {
    let dir = std::env::temp_dir().join(format!("mla-warp-{}-{}", h.name, std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let Some(bin) = build(h, &dir) else { return };
    let mut cases: Vec<(String, Tile)> = [(1, 1), (8, 2), (8, 3), (28, 4)]
        .into_iter()
        .map(|(nb, seed)| {
            (
                format!("random k = {}", 256 * nb),
                random_tile(h.ty, nb, seed),
            )
        })
        .collect();
    cases.push(("largest sums, k = 2048".into(), largest_tile(h.ty, 8)));
    for (what, tile) in &cases {
        let got = run(&bin, &dir, tile);
        let e = nmse(&got, &reference(h.ty, tile));
        println!("{} {what}: nmse {e:.3e} (threshold {F32_OP:.0e})", h.name);
        assert!(
            e <= F32_OP,
            "{} {what}: nmse {e:.3e} over {F32_OP:.0e}",
            h.name
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tensor_core_q4_k_tile_matches_f64() {
    check(&TC_Q4_K);
}

#[test]
fn tensor_core_q6_k_tile_matches_f64() {
    check(&TC_Q6_K);
}
