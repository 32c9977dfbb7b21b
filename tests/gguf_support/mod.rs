//! Shared by the gguf_* tests: a GGUF encoder written from the format description alone (no
//! use of the crate's writer, so that the reader and the writer are each checked against it),
//! a small valid file built with it, and scratch directories.

#![allow(dead_code)]

use std::path::PathBuf;

/// Little-endian bytes, appended field by field.
#[derive(Default)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    pub fn pad_to(&mut self, alignment: usize) -> &mut Self {
        while !self.0.len().is_multiple_of(alignment) {
            self.0.push(0);
        }
        self
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

// GGUF value type ids.
pub const T_U8: u32 = 0;
pub const T_I8: u32 = 1;
pub const T_U16: u32 = 2;
pub const T_I16: u32 = 3;
pub const T_U32: u32 = 4;
pub const T_I32: u32 = 5;
pub const T_F32: u32 = 6;
pub const T_BOOL: u32 = 7;
pub const T_STRING: u32 = 8;
pub const T_ARRAY: u32 = 9;
pub const T_U64: u32 = 10;
pub const T_I64: u32 = 11;
pub const T_F64: u32 = 12;

/// Where things are in `small_file()`, for tests that corrupt it.
pub struct Layout {
    pub bytes: Vec<u8>,
    /// Offset of the tensor count and the metadata count.
    pub tensor_count_at: usize,
    pub kv_count_at: usize,
    /// Offset of the length of the array "test.nested".
    pub nested_len_at: usize,
    /// Offset of the length of the string value of "general.name".
    pub name_len_at: usize,
    /// Offset of the bool value of "test.bool".
    pub bool_at: usize,
    /// Offsets of each tensor entry, and of its ggml type and data offset fields.
    pub tensor_at: [usize; 2],
    pub tensor_type_at: [usize; 2],
    pub tensor_offset_at: [usize; 2],
    /// Where the tensor table ends and the data section starts.
    pub header_end: usize,
    pub data_offset: usize,
}

/// The bytes of tensor "a" (F32, ne [4, 2]): 0.0, 1.0, .. 7.0.
pub fn a_bytes() -> Vec<u8> {
    (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect()
}

/// The bytes of tensor "b" (Q8_0, ne [32]): one block, 34 bytes 100..134.
pub fn b_bytes() -> Vec<u8> {
    (100..134).collect()
}

/// A small valid GGUF v`version` file: every value type (a nested array too), alignment 64, an
/// F32 tensor "a" {4, 2} at data offset 0 and a Q8_0 tensor "b" {32} at data offset 64. The
/// file ends right after "b" (no trailing padding), so every shorter prefix is invalid.
pub fn small_file(version: u32) -> Layout {
    let mut e = Enc::default();
    e.raw(b"GGUF").u32(version);
    let tensor_count_at = e.len();
    e.u64(2);
    let kv_count_at = e.len();
    e.u64(16);
    e.str("general.architecture").u32(T_STRING).str("deepseek2");
    e.str("general.alignment").u32(T_U32).u32(64);
    e.str("general.name").u32(T_STRING);
    let name_len_at = e.len();
    e.str("Tiny ✓");
    e.str("test.u8").u32(T_U8).u8(200);
    e.str("test.i8").u32(T_I8).u8((-100i8) as u8);
    e.str("test.u16").u32(T_U16).raw(&60000u16.to_le_bytes());
    e.str("test.i16").u32(T_I16).raw(&(-30000i16).to_le_bytes());
    e.str("test.u32").u32(T_U32).u32(4_000_000_000);
    e.str("test.i32")
        .u32(T_I32)
        .raw(&(-2_000_000_000i32).to_le_bytes());
    e.str("test.u64").u32(T_U64).u64(1 << 40);
    e.str("test.i64")
        .u32(T_I64)
        .raw(&(-(1i64 << 40)).to_le_bytes());
    e.str("test.f32").u32(T_F32).raw(&0.1f32.to_le_bytes());
    e.str("test.f64").u32(T_F64).raw(&0.1f64.to_le_bytes());
    e.str("test.bool").u32(T_BOOL);
    let bool_at = e.len();
    e.u8(1);
    e.str("test.strings")
        .u32(T_ARRAY)
        .u32(T_STRING)
        .u64(3)
        .str("a")
        .str("")
        .str("ü");
    // [[1, 2], [], [3]] as arrays of i32, then an array of arrays of strings.
    e.str("test.nested").u32(T_ARRAY).u32(T_ARRAY);
    let nested_len_at = e.len();
    e.u64(4);
    e.u32(T_I32).u64(2).u32(1).u32(2);
    // An empty array carries no values, so `Value` cannot say its element type and the
    // writer writes U8; the fixture uses U8 too so the writer's bytes can equal it.
    e.u32(T_U8).u64(0);
    e.u32(T_I32).u64(1).u32(3);
    e.u32(T_ARRAY).u64(1).u32(T_STRING).u64(1).str("deep");

    let mut tensor_at = [0; 2];
    let mut tensor_type_at = [0; 2];
    let mut tensor_offset_at = [0; 2];
    tensor_at[0] = e.len();
    e.str("a").u32(2).u64(4).u64(2);
    tensor_type_at[0] = e.len();
    e.u32(0);
    tensor_offset_at[0] = e.len();
    e.u64(0);
    tensor_at[1] = e.len();
    e.str("b").u32(1).u64(32);
    tensor_type_at[1] = e.len();
    e.u32(8);
    tensor_offset_at[1] = e.len();
    e.u64(64);
    let header_end = e.len();
    e.pad_to(64);
    let data_offset = e.len();
    e.raw(&a_bytes()).pad_to(64).raw(&b_bytes());
    Layout {
        bytes: e.0,
        tensor_count_at,
        kv_count_at,
        nested_len_at,
        name_len_at,
        bool_at,
        tensor_at,
        tensor_type_at,
        tensor_offset_at,
        header_end,
        data_offset,
    }
}

/// A fresh empty directory under the system temp dir, unique to this process and `name`.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mla-gguf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
