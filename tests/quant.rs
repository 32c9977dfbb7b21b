//! Block formats against gguf-py: golden/quant/{TYPE}.safetensors holds random blocks (`blocks`)
//! and gguf-py 0.19's dequantization of them (`values`), written by golden/quant_fixtures.py.

use std::path::Path;

use mla_engine::gguf::ggml_type::GgmlType;
use mla_engine::quant;
use rstest::rstest;
use safetensors::SafeTensors;

/// (blocks, values) of one type's fixture.
fn fixture(t: GgmlType) -> (Vec<u8>, Vec<f32>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("golden/quant/{t}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let blocks = st.tensor("blocks").unwrap().data().to_vec();
    let values = st
        .tensor("values")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (blocks, values)
}

/// A small deterministic generator (xorshift64*), uniform in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40; // 24 random bits
        bits as f32 / (1u32 << 23) as f32 - 1.0
    }
}

/// An rstest with one case per supported type (those of golden/quant/), wrapped around a test
/// function of one argument `t: GgmlType`.
macro_rules! every_supported_type {
    (
        $(#[$($attr:tt)*])*
        fn $name:ident($t:ident: GgmlType) { $($body:tt)* }
    ) => {
        $(#[$($attr)*])*
        #[rstest]
        #[case::f32(GgmlType::F32)]
        #[case::f16(GgmlType::F16)]
        #[case::bf16(GgmlType::BF16)]
        #[case::q4_0(GgmlType::Q4_0)]
        #[case::q4_1(GgmlType::Q4_1)]
        #[case::q5_0(GgmlType::Q5_0)]
        #[case::q5_1(GgmlType::Q5_1)]
        #[case::q8_0(GgmlType::Q8_0)]
        #[case::q2_k(GgmlType::Q2_K)]
        #[case::q3_k(GgmlType::Q3_K)]
        #[case::q4_k(GgmlType::Q4_K)]
        #[case::q5_k(GgmlType::Q5_K)]
        #[case::q6_k(GgmlType::Q6_K)]
        #[case::iq4_nl(GgmlType::IQ4_NL)]
        #[case::iq4_xs(GgmlType::IQ4_XS)]
        fn $name(#[case] $t: GgmlType) {
            $($body)*
        }
    };
}

every_supported_type! {
    fn dequantize_is_bit_exact_with_gguf_py(t: GgmlType) {
        let (blocks, expected) = fixture(t);
        assert_eq!(t.row_bytes(expected.len()), Some(blocks.len()));
        let mut got = vec![f32::NAN; expected.len()];
        quant::dequantize(t, &blocks, &mut got).unwrap();
        let mismatches: Vec<usize> = (0..got.len())
            .filter(|&i| got[i].to_bits() != expected[i].to_bits())
            .collect();
        assert!(
            mismatches.is_empty(),
            "{t}: {} of {} values differ, first at {}: got {:e}, gguf-py {:e}",
            mismatches.len(),
            got.len(),
            mismatches[0],
            got[mismatches[0]],
            expected[mismatches[0]]
        );
    }
}

/// Byte offset of the f16 `d` of the formats whose element is `scale part - min part`; a block
/// with `d` zeroed dequantizes to its min part alone (exactly: 0 * q - m = -m).
fn d_offset_of_min_formats(t: GgmlType) -> Option<usize> {
    match t {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => Some(0),
        GgmlType::Q2_K => Some(80),
        _ => None,
    }
}

every_supported_type! {
    /// `dot` against the f64 dot of the dequantized row. Whatever order and grouping `dot` sums in
    /// (per block, per sub-block, factored scales), each term a_i x_i = (s_i - m_i) x_i, with s_i
    /// the scale part and m_i the min part (both exact products of the stored fields), passes
    /// through at most n + 16 f32 roundings (product, block sum, scale, min, block and row
    /// accumulation), so by Higham's bound
    ///     |dot - sum a_i x_i| <= gamma_{n+16} * sum (|s_i| + |m_i|) |x_i|,
    /// gamma_k = k u / (1 - k u), u = 2^-24, where |s_i| + |m_i| <= |a_i| + 2 |m_i| (one more u
    /// covers a_i's own rounding, already inside the 16 spare steps).
    fn dot_is_within_rounding_of_f64_dot(t: GgmlType) {
        let (blocks, values) = fixture(t);
        let bs = t.block_size();
        let ts = t.type_size();
        let n_blocks = blocks.len() / ts;
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ t.id() as u64);
        // Row lengths in blocks (floats: in elements): one, odd counts, the whole fixture.
        let lengths: &[usize] = if bs == 1 {
            &[1, 7, 8, 63, 64, 65, 1000, 4096]
        } else {
            &[1, 2, 3, 5, 8, 13, 64]
        };
        for &len in lengths {
            // Rows start at different blocks so that each length sees different data.
            let first = (len * 7) % (n_blocks - len + 1);
            let row = &blocks[first * ts..(first + len) * ts];
            let a = &values[first * bs..(first + len) * bs];
            let n = a.len();
            let x: Vec<f32> = (0..n).map(|_| rng.next_f32()).collect();

            let mins = match d_offset_of_min_formats(t) {
                Some(off) => {
                    let mut zeroed = row.to_vec();
                    for b in zeroed.chunks_exact_mut(ts) {
                        b[off..off + 2].fill(0);
                    }
                    let mut m = vec![0f32; n];
                    quant::dequantize(t, &zeroed, &mut m).unwrap();
                    m
                }
                None => vec![0f32; n],
            };

            let exact: f64 = a.iter().zip(&x).map(|(&a, &x)| a as f64 * x as f64).sum();
            let magnitude: f64 = (0..n)
                .map(|i| (a[i].abs() as f64 + 2.0 * mins[i].abs() as f64) * x[i].abs() as f64)
                .sum();
            let u = f32::EPSILON as f64 / 2.0;
            let k = (n + 16) as f64;
            let bound = k * u / (1.0 - k * u) * magnitude;

            let got = quant::dot(t, row, &x) as f64;
            assert!(
                (got - exact).abs() <= bound,
                "{t}, {n} elements: dot {got:e}, f64 {exact:e}, error {:e} > bound {bound:e}",
                (got - exact).abs()
            );
        }
    }
}

const SUPPORTED_NAMES: &str =
    "F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16";

#[rstest]
#[case::iq2_xxs(GgmlType::IQ2_XXS)]
#[case::q8_k(GgmlType::Q8_K)]
#[case::tq1_0(GgmlType::TQ1_0)]
#[case::mxfp4(GgmlType::MXFP4)]
#[case::f64(GgmlType::F64)]
fn unsupported_types_are_refused_by_name(#[case] t: GgmlType) {
    assert!(!quant::supported(t));
    let err = quant::check_supported(t).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("tensor type {t} is not supported; supported types: {SUPPORTED_NAMES}")
    );
    let bytes = vec![0u8; t.type_size()];
    let mut out = vec![0f32; t.block_size()];
    assert_eq!(quant::dequantize(t, &bytes, &mut out), Err(err));
}

#[test]
fn supported_list_is_the_fifteen_types() {
    let names: Vec<&str> = quant::SUPPORTED.iter().map(|t| t.name()).collect();
    assert_eq!(names.join(", "), SUPPORTED_NAMES);
    assert!(quant::SUPPORTED.iter().all(|&t| quant::supported(t)));
    assert!(quant::SUPPORTED
        .iter()
        .all(|&t| quant::check_supported(t).is_ok()));
}

#[test]
fn wrong_lengths_are_errors() {
    let t = GgmlType::Q4_K;
    let mut out = vec![0f32; 256];
    // One byte short of a block.
    let err = quant::dequantize(t, &[0u8; 143], &mut out).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Q4_K: cannot dequantize 143 bytes into 256 values \
         (a block is 256 values in 144 bytes)"
    );
    // Not a whole number of blocks.
    let mut out = vec![0f32; 128];
    let err = quant::dequantize(t, &[0u8; 72], &mut out).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Q4_K: cannot dequantize 72 bytes into 128 values \
         (a block is 256 values in 144 bytes)"
    );
}

/// Nanoseconds this thread has spent on a CPU (Linux: /proc/thread-self/schedstat), so that a
/// measurement on a shared, busy machine does not count the time other processes ran.
fn thread_cpu_ns() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    stat.split_whitespace().next().unwrap().parse().unwrap()
}

/// Single-core throughput of `dot` over a DeepSeek-sized matrix (7168-wide rows, 32 MiB of
/// quantized bytes, so it streams from memory as in decode), in quantized bytes per second of
/// this thread's CPU time. Run with
/// `cargo test --release --test quant -- --ignored --nocapture dot_throughput`.
#[test]
#[ignore = "a measurement, not a check; run in release"]
fn dot_throughput() {
    for &t in quant::SUPPORTED {
        let (blocks, _) = fixture(t);
        let cols = 7168;
        let row_bytes = t.row_bytes(cols).unwrap();
        let rows = (32 << 20) / row_bytes;
        let matrix: Vec<u8> = blocks
            .iter()
            .copied()
            .cycle()
            .take(rows * row_bytes)
            .collect();
        let mut rng = Rng(1);
        let x: Vec<f32> = (0..cols).map(|_| rng.next_f32()).collect();
        // The kernel updates the CPU-time counter only at scheduler ticks (a few ms), so each
        // measurement repeats whole passes until 250 ms have passed.
        let mut best_pass = f64::INFINITY; // seconds per pass over the matrix
        let mut sink = 0f32;
        for _ in 0..3 {
            let start = thread_cpu_ns();
            let mut passes = 0;
            while thread_cpu_ns() - start < 250_000_000 {
                for row in matrix.chunks_exact(row_bytes) {
                    sink += quant::dot(t, row, &x);
                }
                passes += 1;
            }
            let pass = (thread_cpu_ns() - start) as f64 * 1e-9 / passes as f64;
            best_pass = best_pass.min(pass);
        }
        println!(
            "{t:>6}: {:5.2} GB/s of quantized bytes, {:5.2} Gelem/s ({rows} x {cols}, best of 3; sink {sink:.1})",
            matrix.len() as f64 / best_pass / 1e9,
            (rows * cols) as f64 / best_pass / 1e9
        );
    }
}
