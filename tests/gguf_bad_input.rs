//! Bad input never panics: every truncation, flipped header bytes, forged offsets and counts
//! each give a typed error naming the file, the offset and the field.

mod gguf_support;

use gguf_support::*;
use mla_engine::gguf::{GgufError, GgufFile};

const NAME: &str = "bad.gguf";

fn parse(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(NAME, bytes.to_vec())
}

fn parse_err(bytes: &[u8]) -> GgufError {
    parse(bytes).expect_err("bad input must be refused")
}

/// The byte offset an error names (every error the parser gives has one).
fn offset_of(e: &GgufError) -> u64 {
    match e {
        GgufError::Truncated { offset, .. }
        | GgufError::Invalid { offset, .. }
        | GgufError::CountTooLarge { offset, .. }
        | GgufError::TensorOutOfBounds { offset, .. }
        | GgufError::TensorOverlap { offset, .. }
        | GgufError::DuplicateKey { offset, .. }
        | GgufError::DuplicateTensor { offset, .. }
        | GgufError::WrongType { offset, .. }
        | GgufError::ShardMismatch { offset, .. }
        | GgufError::Write { offset, .. } => *offset,
        other => panic!("parser error without an offset: {other}"),
    }
}

fn patch_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn patch_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

#[test]
fn truncation_at_every_byte_offset() {
    let layout = small_file(3);
    let full = &layout.bytes;
    assert!(parse(full).is_ok());
    for cut in 0..full.len() {
        let err = parse_err(&full[..cut]);
        let msg = err.to_string();
        assert!(msg.starts_with("bad.gguf: "), "cut {cut}: {msg}");
        let cut = cut as u64;
        match &err {
            // Inside the header: the read that runs off the end says where it started and how
            // much was left, or a count is refused because its items cannot fit in what is left.
            GgufError::Truncated {
                offset,
                needed,
                available,
                field,
                ..
            } => {
                // Cut in the padding: the data section would start past the end.
                assert!(cut < layout.data_offset as u64, "cut {cut}: {msg}");
                if cut >= layout.header_end as u64 {
                    assert_eq!(field, "padding before the data section");
                }
                assert_eq!(offset + available, cut, "{msg}");
                assert!(needed > available && !field.is_empty(), "{msg}");
            }
            GgufError::CountTooLarge {
                offset,
                needed,
                available,
                ..
            } => {
                assert!(cut < layout.header_end as u64, "cut {cut}: {msg}");
                assert_eq!(offset + 8 + available, cut, "{msg}");
                assert!(*needed > *available as u128, "{msg}");
            }
            // In the data: the header is whole but a tensor's data is cut off.
            GgufError::TensorOutOfBounds {
                tensor,
                file_len,
                end,
                offset,
                ..
            } => {
                assert!(cut >= layout.data_offset as u64, "cut {cut}: {msg}");
                assert_eq!(*file_len, cut);
                assert!(*end > cut);
                let a_complete = cut >= layout.data_offset as u64 + 32;
                let expected = if a_complete { "b" } else { "a" };
                assert_eq!(tensor, expected, "cut {cut}: {msg}");
                assert_eq!(*offset as usize, layout.tensor_at[a_complete as usize]);
            }
            other => panic!("cut {cut}: unexpected {other}"),
        }
    }
}

#[test]
fn truncated_files_on_disk() {
    let dir = scratch_dir("truncated");
    let full = small_file(3).bytes;
    for cut in [0, 3, 4, 23, 100, full.len() - 1] {
        let path = dir.join(format!("cut{cut}.gguf"));
        std::fs::write(&path, &full[..cut]).unwrap();
        let err = GgufFile::open(&path).unwrap_err();
        assert!(
            err.to_string().contains(&format!("cut{cut}.gguf: offset ")),
            "{err}"
        );
    }
    let err = GgufFile::open(dir.join("absent.gguf")).unwrap_err();
    assert!(
        matches!(&err, GgufError::Io { action: "open", .. }),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn flipped_bytes_at_every_header_byte() {
    let layout = small_file(3);
    let (mut refused, mut accepted) = (0, 0);
    for at in 0..layout.header_end {
        for mask in [0x01u8, 0x80, 0xff] {
            let mut bytes = layout.bytes.clone();
            bytes[at] ^= mask;
            match parse(&bytes) {
                Ok(_) => accepted += 1,
                Err(e) => {
                    refused += 1;
                    let msg = e.to_string();
                    assert!(
                        msg.starts_with("bad.gguf: offset "),
                        "byte {at} ^ {mask:#x}: {msg}"
                    );
                    assert!(
                        offset_of(&e) <= bytes.len() as u64,
                        "byte {at} ^ {mask:#x}: {msg}"
                    );
                }
            }
        }
    }
    // Flips inside values (a number, a letter of a string) leave a valid file; flips of
    // lengths, counts, types and the magic do not. Most flips must be caught.
    println!("{refused} flips refused, {accepted} accepted");
    assert!(refused > accepted, "{refused} refused, {accepted} accepted");
}

#[test]
fn bad_magic_and_version() {
    let layout = small_file(3);
    let mut bytes = layout.bytes.clone();
    bytes[0] = b'X';
    let err = parse_err(&bytes);
    assert!(
        matches!(&err, GgufError::Invalid { offset: 0, field, .. } if field == "magic"),
        "{err}"
    );

    for (version, hint) in [(1, "GGUF v1"), (3u32.swap_bytes(), "big-endian"), (4, "")] {
        let mut bytes = layout.bytes.clone();
        patch_u32(&mut bytes, 4, version);
        let err = parse_err(&bytes);
        assert!(
            matches!(&err, GgufError::Invalid { offset: 4, field, expected, found, .. }
                if field == "version" && expected == "version 2 or 3" && found.contains(hint)),
            "{err}"
        );
    }
}

#[test]
fn tensor_offset_past_the_end() {
    let layout = small_file(3);
    let mut bytes = layout.bytes.clone();
    patch_u64(&mut bytes, layout.tensor_offset_at[1], 1 << 20);
    let err = parse_err(&bytes);
    let data = layout.data_offset as u64;
    assert!(
        matches!(&err, GgufError::TensorOutOfBounds { tensor, start, end, file_len, offset, .. }
            if tensor == "b" && *start == data + (1 << 20) && *end == start + 34
            && *file_len == bytes.len() as u64 && *offset as usize == layout.tensor_at[1]),
        "{err}"
    );
    // An offset so large that offset + size overflows u64.
    patch_u64(&mut bytes, layout.tensor_offset_at[1], u64::MAX - 63);
    let err = parse_err(&bytes);
    assert!(
        matches!(&err, GgufError::TensorOutOfBounds { tensor, .. } if tensor == "b"),
        "{err}"
    );
}

#[test]
fn overlapping_tensors() {
    let layout = small_file(3);
    let mut bytes = layout.bytes.clone();
    patch_u64(&mut bytes, layout.tensor_offset_at[1], 0);
    let err = parse_err(&bytes);
    let data = layout.data_offset as u64;
    assert!(
        matches!(&err, GgufError::TensorOverlap { tensor, other, start, end, other_start, other_end, .. }
            if tensor == "b" && other == "a" && *start == data && *end == data + 34
            && *other_start == data && *other_end == data + 32),
        "{err}"
    );
    assert!(err.to_string().contains("overlaps tensor \"a\""), "{err}");
}

#[test]
fn misaligned_tensor_offset() {
    let layout = small_file(3);
    let mut bytes = layout.bytes.clone();
    patch_u64(&mut bytes, layout.tensor_offset_at[1], 96);
    let err = parse_err(&bytes);
    assert!(
        matches!(&err, GgufError::Invalid { offset, field, expected, found, .. }
            if *offset as usize == layout.tensor_offset_at[1] && field == "tensor \"b\" offset"
            && expected == "a multiple of the alignment 64" && found == "96"),
        "{err}"
    );
}

#[test]
fn absurd_counts_are_refused_without_allocating() {
    let layout = small_file(3);
    let big = 1u64 << 60;

    let mut bytes = layout.bytes.clone();
    patch_u64(&mut bytes, layout.nested_len_at, big);
    let err = parse_err(&bytes);
    assert!(
        matches!(&err, GgufError::CountTooLarge { offset, field, count, needed, .. }
            if *offset as usize == layout.nested_len_at && field == "metadata \"test.nested\" value length"
            && *count == big && *needed == big as u128 * 12),
        "{err}"
    );

    let mut bytes = layout.bytes.clone();
    patch_u64(&mut bytes, layout.tensor_count_at, big);
    let err = parse_err(&bytes);
    assert!(
        matches!(&err, GgufError::CountTooLarge { offset: 8, field, count, .. } if field == "tensor count" && *count == big),
        "{err}"
    );

    let mut bytes = layout.bytes.clone();
    patch_u64(&mut bytes, layout.kv_count_at, u64::MAX);
    let err = parse_err(&bytes);
    assert!(
        matches!(&err, GgufError::CountTooLarge { offset: 16, field, count: u64::MAX, .. } if field == "metadata count"),
        "{err}"
    );

    for len in [big, u64::MAX] {
        let mut bytes = layout.bytes.clone();
        patch_u64(&mut bytes, layout.name_len_at, len);
        let err = parse_err(&bytes);
        assert!(
            matches!(&err, GgufError::Truncated { offset, field, needed, .. }
                if *offset as usize == layout.name_len_at + 8 && field == "metadata \"general.name\" value" && *needed == len),
            "{err}"
        );
    }
}

/// A file with no tensors and the given metadata entries (already encoded).
fn kv_file(n_kv: u64, entries: &Enc) -> Vec<u8> {
    let mut e = Enc::default();
    e.raw(b"GGUF").u32(3).u64(0).u64(n_kv).raw(&entries.0);
    e.0
}

/// A file with `n_tensors` tensor entries (already encoded), no metadata, and the data section's
/// start padded to the default alignment of 32 but nothing in it.
fn tensors_file(n_tensors: u64, entries: &Enc) -> Vec<u8> {
    let mut e = Enc::default();
    e.raw(b"GGUF")
        .u32(3)
        .u64(n_tensors)
        .u64(0)
        .raw(&entries.0)
        .pad_to(32);
    e.0
}

/// A file with one tensor entry (already encoded), no metadata, and 4096 bytes of data.
fn tensor_file(entry: &Enc) -> Vec<u8> {
    let mut bytes = tensors_file(1, entry);
    bytes.resize(bytes.len() + 4096, 0);
    bytes
}

#[test]
fn deeply_nested_arrays_are_refused() {
    let mut kv = Enc::default();
    kv.str("deep").u32(T_ARRAY);
    for _ in 0..100 {
        kv.u32(T_ARRAY).u64(1);
    }
    kv.u32(T_U8).u64(0);
    let err = parse_err(&kv_file(1, &kv));
    assert!(
        matches!(&err, GgufError::Invalid { field, expected, .. }
            if field == "metadata \"deep\" value[0][0][0][0][0][0][0][0]" && expected == "arrays nested at most 8 deep"),
        "{err}"
    );
}

#[test]
fn invalid_values() {
    let layout = small_file(3);
    let mut bytes = layout.bytes.clone();
    bytes[layout.bool_at] = 2;
    let err = parse_err(&bytes);
    assert!(
        matches!(&err, GgufError::Invalid { offset, field, expected, found, .. }
            if *offset as usize == layout.bool_at && field == "metadata \"test.bool\" value"
            && expected == "a bool (0 or 1)" && found == "2"),
        "{err}"
    );

    let mut kv = Enc::default();
    kv.str("k").u32(13).u8(0);
    let err = parse_err(&kv_file(1, &kv));
    assert!(
        matches!(&err, GgufError::Invalid { offset: 33, field, found, .. } if field == "metadata \"k\" value type" && found == "13"),
        "{err}"
    );

    let mut kv = Enc::default();
    kv.u64(2).raw(&[b'a', 0xff]).u32(T_U8).u8(0);
    let err = parse_err(&kv_file(1, &kv));
    assert!(
        matches!(&err, GgufError::Invalid { offset: 32, field, expected, found, .. }
            if field == "metadata[0] key" && expected == "UTF-8 text" && found == "invalid byte 0xff at 33"),
        "{err}"
    );

    let mut kv = Enc::default();
    kv.str("k").u32(T_U8).u8(1).str("k").u32(T_U8).u8(2);
    let err = parse_err(&kv_file(2, &kv));
    assert!(
        matches!(&err, GgufError::DuplicateKey { offset: 38, key, .. } if key == "k"),
        "{err}"
    );
}

#[test]
fn bad_alignment() {
    for (value, found) in [(3u32, "U32 3"), (0, "U32 0")] {
        let mut kv = Enc::default();
        kv.str("general.alignment").u32(T_U32).u32(value);
        let err = parse_err(&kv_file(1, &kv));
        assert!(
            matches!(&err, GgufError::Invalid { offset: 53, field, found: f, .. }
                if field == "metadata \"general.alignment\"" && f == found),
            "{err}"
        );
    }
}

#[test]
fn invalid_tensor_entries() {
    // Each: (n_dims, ne, ggml type id) and the field and expectation the error must name.
    let cases: [(u32, &[u64], u32, &str, &str); 6] = [
        (
            5,
            &[1, 1, 1, 1, 1],
            0,
            "tensor \"t\" n_dims",
            "at most 4 dimensions",
        ),
        (1, &[32], 4, "tensor \"t\" type", "a ggml type id"),
        (
            1,
            &[33],
            8,
            "tensor \"t\" shape",
            "ne[0] a multiple of Q8_0's block size 32",
        ),
        (
            2,
            &[1 << 32, 1 << 32],
            0,
            "tensor \"t\" shape",
            "an element count below 2^63",
        ),
        (
            2,
            &[1 << 63, 0],
            0,
            "tensor \"t\" shape",
            "each dimension below 2^63",
        ),
        // Found by the fuzzer: 2^62 F32 elements are countable but their bytes are not.
        (
            1,
            &[1 << 62],
            0,
            "tensor \"t\" shape",
            "a byte size below 2^64",
        ),
    ];
    for (n_dims, ne, type_id, field_expected, expected_expected) in cases {
        let mut entry = Enc::default();
        entry.str("t").u32(n_dims);
        for &n in ne {
            entry.u64(n);
        }
        entry.u32(type_id).u64(0);
        let err = parse_err(&tensor_file(&entry));
        assert!(
            matches!(&err, GgufError::Invalid { field, expected, .. } if field == field_expected && expected == expected_expected),
            "{err}"
        );
    }

    let mut entries = Enc::default();
    entries.str("t").u32(1).u64(8).u32(0).u64(0);
    entries.str("t").u32(1).u64(8).u32(0).u64(32);
    let mut bytes = tensors_file(2, &entries);
    bytes.extend([0; 64]);
    let err = parse_err(&bytes);
    assert!(
        matches!(&err, GgufError::DuplicateTensor { offset: 57, tensor, .. } if tensor == "t"),
        "{err}"
    );
}

#[test]
fn empty_tensors_may_share_an_offset() {
    let mut entries = Enc::default();
    entries.str("e1").u32(2).u64(0).u64(4).u32(0).u64(0);
    entries.str("e2").u32(1).u64(0).u32(0).u64(0);
    let f = parse(&tensors_file(2, &entries)).unwrap();
    assert_eq!(
        f.tensors().iter().map(|t| t.n_bytes).collect::<Vec<_>>(),
        [0, 0]
    );
    assert_eq!(f.tensor_data(&f.tensors()[0]), &[] as &[u8]);
}

/// Inputs on which the fuzzer (fuzz/fuzz_targets/gguf_parse.rs) once crashed the parser. Each
/// must now be refused with an error naming the file and an offset.
#[test]
fn fuzz_regressions() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gguf_fuzz_regressions");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let err = GgufFile::open(&path).expect_err("each regression input is invalid");
        let name = path.file_name().unwrap().to_str().unwrap();
        assert!(
            err.to_string().contains(&format!("{name}: offset ")),
            "{err}"
        );
        n += 1;
    }
    assert!(n >= 1);
}
