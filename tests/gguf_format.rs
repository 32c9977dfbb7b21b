//! The GGUF reader and writer against an encoding written from the format description
//! (tests/gguf_support), plus split sets.

mod gguf_support;

use std::io::Cursor;

use gguf_support::*;
use mla_engine::gguf::{split_shard_path, GgmlType, GgufError, GgufFile, GgufWriter, Value};

fn open_small(version: u32) -> GgufFile {
    GgufFile::from_bytes("small.gguf", small_file(version).bytes).unwrap()
}

#[test]
fn reads_every_value_type_in_v2_and_v3() {
    for version in [2, 3] {
        let f = open_small(version);
        assert_eq!(f.version(), version);
        let keys: Vec<&str> = f.metadata().iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys[..3],
            ["general.architecture", "general.alignment", "general.name"]
        );
        assert_eq!(f.metadata().len(), 16);
        assert_eq!(f.get_str("general.name").unwrap(), "Tiny ✓");
        assert_eq!(f.get("test.u8"), Some(&Value::U8(200)));
        assert_eq!(f.get("test.i8"), Some(&Value::I8(-100)));
        assert_eq!(f.get("test.u16"), Some(&Value::U16(60000)));
        assert_eq!(f.get("test.i16"), Some(&Value::I16(-30000)));
        assert_eq!(f.get("test.u32"), Some(&Value::U32(4_000_000_000)));
        assert_eq!(f.get("test.i32"), Some(&Value::I32(-2_000_000_000)));
        assert_eq!(f.get("test.u64"), Some(&Value::U64(1 << 40)));
        assert_eq!(f.get("test.i64"), Some(&Value::I64(-(1 << 40))));
        assert_eq!(f.get("test.f32"), Some(&Value::F32(0.1)));
        assert_eq!(f.get("test.f64"), Some(&Value::F64(0.1)));
        assert!(f.get_bool("test.bool").unwrap());
        let strings = f.get_array("test.strings").unwrap();
        assert_eq!(
            strings,
            [
                Value::String("a".into()),
                Value::String("".into()),
                Value::String("ü".into())
            ]
        );
        let nested = f.get_array("test.nested").unwrap();
        let ints = |v: &[i32]| Value::Array(v.iter().map(|&i| Value::I32(i)).collect());
        let deep = Value::Array(vec![Value::Array(vec![Value::String("deep".into())])]);
        assert_eq!(nested, [ints(&[1, 2]), ints(&[]), ints(&[3]), deep]);
    }
}

#[test]
fn tensor_table_alignment_and_borrowed_data() {
    let layout = small_file(3);
    let f = GgufFile::from_bytes("small.gguf", layout.bytes.clone()).unwrap();
    assert_eq!(layout.data_offset % 64, 0);
    assert_eq!(f.shards().len(), 1);
    assert_eq!(f.shards()[0].data_offset, layout.data_offset as u64);
    assert_eq!(f.shards()[0].alignment, 64);
    assert_eq!(f.shards()[0].file_size, layout.bytes.len() as u64);
    let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);

    let a = f.tensor("a").unwrap();
    assert_eq!(
        (a.ggml_type, a.ne.as_slice(), a.n_bytes),
        (GgmlType::F32, &[4u64, 2][..], 32)
    );
    assert_eq!((a.n_elements(), a.row_len(), a.n_rows()), (8, 4, 2));
    assert_eq!(a.offset, layout.data_offset as u64);
    assert_eq!(f.tensor_data(a), a_bytes());

    let b = f.tensor("b").unwrap();
    assert_eq!(
        (b.ggml_type, b.n_bytes, b.offset),
        (GgmlType::Q8_0, 34, layout.data_offset as u64 + 64)
    );
    assert_eq!((b.row_len(), b.n_rows()), (32, 1));
    assert_eq!(f.tensor_data(b), b_bytes());
    assert!(f.tensor("c").is_none());
}

#[test]
fn opens_from_disk_with_mmap() {
    let dir = scratch_dir("disk");
    let path = dir.join("small.gguf");
    std::fs::write(&path, small_file(3).bytes).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.shards()[0].path, path);
    assert_eq!(f.tensor_data(f.tensor("b").unwrap()), b_bytes());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn integer_getters_widen_and_errors_name_key_and_type() {
    let f = open_small(3);
    assert_eq!(f.get_u32("test.u8").unwrap(), 200);
    assert_eq!(f.get_u64("test.u16").unwrap(), 60000);
    assert_eq!(f.get_i64("test.i32").unwrap(), -2_000_000_000);
    assert_eq!(f.get_u32("test.u64").ok(), None);
    assert_eq!(f.get_u64("test.u64").unwrap(), 1 << 40);
    assert_eq!(f.get_usize("general.alignment").unwrap(), 64);
    assert_eq!(f.get_f32("test.f64").unwrap(), 0.1f32);

    let err = f.get_u32("test.i32").unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, GgufError::WrongType { key, found, .. } if key == "test.i32" && found == "I32 -2000000000")
    );
    assert!(msg.contains("small.gguf") && msg.contains("u32"), "{msg}");

    let err = f.get_str("test.f32").unwrap_err();
    assert!(
        matches!(&err, GgufError::WrongType { key, expected: "String", found, .. } if key == "test.f32" && found == "F32 0.1")
    );
    let err = f.get_bool("test.strings").unwrap_err();
    assert!(
        matches!(&err, GgufError::WrongType { found, .. } if found == "Array of 3 String"),
        "{err}"
    );
    let err = f.get_u32("general.missing").unwrap_err();
    assert!(matches!(&err, GgufError::MissingKey { key, .. } if key == "general.missing"));
    assert_eq!(
        err.to_string(),
        "small.gguf: metadata key \"general.missing\" is missing"
    );
}

#[test]
fn wrong_type_error_gives_the_value_offset() {
    let layout = small_file(3);
    let f = GgufFile::from_bytes("small.gguf", layout.bytes).unwrap();
    match f.get_u32("test.bool").unwrap_err() {
        GgufError::WrongType { offset, .. } => assert_eq!(offset as usize, layout.bool_at),
        other => panic!("{other}"),
    }
}

/// Builds with our writer the same file `small_file(3)` describes: the bytes must be identical.
fn small_file_by_writer() -> Vec<u8> {
    let mut w = GgufWriter::with_sink(Cursor::new(Vec::new()), "w.gguf", 64).unwrap();
    let f = open_small(3);
    for (k, v) in f.metadata() {
        w.add_kv(k, v.clone()).unwrap();
    }
    w.add_tensor("a", GgmlType::F32, &[4, 2]).unwrap();
    w.add_tensor("b", GgmlType::Q8_0, &[32]).unwrap();
    w.write_header().unwrap();
    w.write_tensor("a", &a_bytes()).unwrap();
    // Stream "b" in two parts.
    w.write_tensor_part(&b_bytes()[..10]).unwrap();
    w.write_tensor_part(&b_bytes()[10..]).unwrap();
    w.finish().unwrap().into_inner()
}

#[test]
fn writer_matches_the_independent_encoding() {
    let expected = small_file(3).bytes;
    let written = small_file_by_writer();
    // The writer pads after the last tensor too; the hand encoding stops right after it.
    assert_eq!(written.len(), expected.len().div_ceil(64) * 64);
    assert_eq!(written[..expected.len()], expected[..]);
    assert!(written[expected.len()..].iter().all(|&b| b == 0));
}

#[test]
fn writer_adds_alignment_key_and_skips_make_zeros() {
    let mut w = GgufWriter::with_sink(Cursor::new(Vec::new()), "w.gguf", 128).unwrap();
    w.add_kv("general.architecture", Value::String("x".into()))
        .unwrap();
    w.add_tensor("zeros", GgmlType::F16, &[100, 3]).unwrap();
    w.add_tensor("ones", GgmlType::I8, &[5]).unwrap();
    w.add_tensor("more_zeros", GgmlType::Q4_K, &[256, 2])
        .unwrap();
    w.skip_tensor("zeros").unwrap();
    w.write_tensor("ones", &[1; 5]).unwrap();
    w.skip_tensor("more_zeros").unwrap();
    let bytes = w.finish().unwrap().into_inner();
    let f = GgufFile::from_bytes("w.gguf", bytes.clone()).unwrap();
    assert_eq!(f.get("general.alignment"), Some(&Value::U32(128)));
    let offsets: Vec<u64> = f
        .tensors()
        .iter()
        .map(|t| t.offset - f.shards()[0].data_offset)
        .collect();
    assert_eq!(offsets, [0, 640, 768]);
    assert_eq!(f.tensor_data(&f.tensors()[0]), vec![0u8; 600]);
    assert_eq!(f.tensor_data(&f.tensors()[1]), [1; 5]);
    assert_eq!(f.tensor_data(&f.tensors()[2]), vec![0u8; 288]);
    assert_eq!(bytes.len() as u64, f.shards()[0].data_offset + 768 + 384);
}

#[test]
fn writer_refuses_misuse() {
    let mut w = GgufWriter::with_sink(Cursor::new(Vec::new()), "w.gguf", 32).unwrap();
    let mixed = Value::Array(vec![Value::U8(1), Value::String("x".into())]);
    let err = w.add_kv("bad", mixed).unwrap_err();
    assert!(
        err.to_string().contains("an array of U8 holding a String"),
        "{err}"
    );
    assert!(w.add_kv("general.alignment", Value::U32(64)).is_err());
    let err = w.add_tensor("q", GgmlType::Q4_K, &[100]).unwrap_err();
    assert!(err.to_string().contains("block size 256"), "{err}");
    w.add_tensor("t", GgmlType::F32, &[2]).unwrap();
    w.add_tensor("u", GgmlType::F32, &[2]).unwrap();
    let err = w.write_tensor("u", &[0; 8]).unwrap_err();
    assert!(
        matches!(&err, GgufError::Write { expected, .. } if expected.contains("\"t\" (declared next)")),
        "{err}"
    );
    let err = w.write_tensor("t", &[0; 7]).unwrap_err();
    assert!(
        matches!(&err, GgufError::Write { expected, found, .. } if expected.starts_with("8 bytes") && found == "7 bytes")
    );
    assert!(w.add_kv("late", Value::U8(0)).is_err());
    w.write_tensor("t", &[0; 8]).unwrap();
    let err = w.finish().unwrap_err();
    assert!(
        err.to_string().contains("before tensor \"u\" was complete"),
        "{err}"
    );
    assert!(GgufWriter::with_sink(Cursor::new(Vec::new()), "w.gguf", 48).is_err());
}

/// Writes a split set of `count` shards with two F32 tensors each ("t{no}.x" = [no; 4] and
/// "t{no}.y"), the model metadata on shard 0 only. Returns the shard paths.
fn write_split_set(dir: &std::path::Path, count: usize) -> Vec<std::path::PathBuf> {
    (0..count)
        .map(|no| {
            let path = split_shard_path(dir.join("model"), no, count);
            let mut w = GgufWriter::new(&path, 32).unwrap();
            if no == 0 {
                w.add_kv("general.architecture", Value::String("deepseek2".into()))
                    .unwrap();
            }
            w.add_split_keys(no, count, 2 * count).unwrap();
            w.add_tensor(&format!("t{no}.x"), GgmlType::F32, &[4])
                .unwrap();
            w.add_tensor(&format!("t{no}.y"), GgmlType::F32, &[1])
                .unwrap();
            w.write_tensor(&format!("t{no}.x"), &[no as u8; 16])
                .unwrap();
            w.write_tensor(&format!("t{no}.y"), &[0xAB; 4]).unwrap();
            w.finish().unwrap();
            path
        })
        .collect()
}

#[test]
fn split_set_opens_from_any_shard() {
    let dir = scratch_dir("split");
    let paths = write_split_set(&dir, 3);
    assert!(paths[1].ends_with("model-00002-of-00003.gguf"));
    for opened in &paths {
        let f = GgufFile::open(opened).unwrap();
        assert_eq!(
            f.shards().iter().map(|s| &s.path).collect::<Vec<_>>(),
            paths.iter().collect::<Vec<_>>()
        );
        assert_eq!(f.get_str("general.architecture").unwrap(), "deepseek2");
        assert_eq!(f.get_u32("split.no").unwrap(), 0);
        let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["t0.x", "t0.y", "t1.x", "t1.y", "t2.x", "t2.y"]);
        for (no, shard) in f.shards().iter().enumerate() {
            assert_eq!(shard.n_tensors, 2);
            let x = f.tensor(&format!("t{no}.x")).unwrap();
            assert_eq!(x.shard, no);
            assert_eq!(f.tensor_data(x), [no as u8; 16]);
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn split_set_missing_shard() {
    let dir = scratch_dir("split-missing");
    let paths = write_split_set(&dir, 3);
    std::fs::remove_file(&paths[2]).unwrap();
    let err = GgufFile::open(&paths[0]).unwrap_err();
    assert!(
        matches!(&err, GgufError::MissingShard { path, no: 3, count: 3, .. } if path == &paths[2]),
        "{err}"
    );
    assert!(
        err.to_string().contains("model-00003-of-00003.gguf"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn split_set_mismatched_shard() {
    let dir = scratch_dir("split-mismatch");
    let paths = write_split_set(&dir, 3);
    // Replace shard 2 by a shard of a 4-shard set.
    let four = scratch_dir("split-mismatch-4");
    let other = write_split_set(&four, 4);
    std::fs::copy(&other[1], &paths[1]).unwrap();
    let err = GgufFile::open(&paths[2]).unwrap_err();
    assert!(
        matches!(&err, GgufError::ShardMismatch { path, field, expected, found, .. }
            if path == &paths[1] && field == "split.count" && expected == "3" && found == "4"),
        "{err}"
    );
    std::fs::remove_dir_all(four).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn split_set_wrong_shard_number_and_tensor_total() {
    let dir = scratch_dir("split-no");
    let paths = write_split_set(&dir, 2);
    std::fs::copy(&paths[0], &paths[1]).unwrap();
    let err = GgufFile::open(&paths[0]).unwrap_err();
    assert!(
        matches!(&err, GgufError::ShardMismatch { path, field, found, .. } if path == &paths[1] && field == "split.no" && found == "0"),
        "{err}"
    );

    // A set whose shard 0 announces the wrong total.
    let path = |no| split_shard_path(dir.join("total"), no, 2);
    for no in 0..2 {
        let mut w = GgufWriter::new(path(no), 32).unwrap();
        w.add_split_keys(no, 2, 5).unwrap();
        w.finish().unwrap();
    }
    let err = GgufFile::open(path(1)).unwrap_err();
    assert!(
        matches!(&err, GgufError::ShardMismatch { field, expected, .. } if field == "split.tensors.count" && expected == "5"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn split_set_duplicate_tensor_across_shards() {
    let dir = scratch_dir("split-dup");
    let path = |no| split_shard_path(dir.join("dup"), no, 2);
    for no in 0..2 {
        let mut w = GgufWriter::new(path(no), 32).unwrap();
        w.add_split_keys(no, 2, 2).unwrap();
        w.add_tensor("same", GgmlType::F32, &[1]).unwrap();
        w.write_tensor("same", &[0; 4]).unwrap();
        w.finish().unwrap();
    }
    let err = GgufFile::open(path(0)).unwrap_err();
    assert!(
        matches!(&err, GgufError::DuplicateTensor { path: p, first_path, tensor, .. }
            if p == &path(1) && first_path == &path(0) && tensor == "same"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn split_set_badly_named_shard() {
    let dir = scratch_dir("split-name");
    let paths = write_split_set(&dir, 2);
    let renamed = dir.join("model.gguf");
    std::fs::rename(&paths[0], &renamed).unwrap();
    let err = GgufFile::open(&renamed).unwrap_err();
    assert!(
        matches!(&err, GgufError::ShardMismatch { field, .. } if field == "file name"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn writer_skip_of_an_empty_last_tensor_keeps_the_data_before_it() {
    let mut w = GgufWriter::with_sink(Cursor::new(Vec::new()), "w.gguf", 32).unwrap();
    w.add_tensor("full", GgmlType::F32, &[8]).unwrap();
    w.add_tensor("empty", GgmlType::F32, &[0]).unwrap();
    w.write_tensor("full", &[7; 32]).unwrap();
    w.skip_tensor("empty").unwrap();
    let f = GgufFile::from_bytes("w.gguf", w.finish().unwrap().into_inner()).unwrap();
    assert_eq!(f.tensor_data(f.tensor("full").unwrap()), [7; 32]);
}
