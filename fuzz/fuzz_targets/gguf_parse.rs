//! Fuzzes the GGUF parser: any bytes must parse or give an error, never panic; whatever parses
//! must write back (with our writer) into a file that parses to the same metadata, tensor table
//! and tensor bytes.

#![no_main]

use std::io::Cursor;

use libfuzzer_sys::fuzz_target;

// The module's own source, compiled here alone (it depends only on memmap2 and thiserror).
#[path = "../../src/gguf/mod.rs"]
#[allow(dead_code, unused_imports)]
mod gguf;

use gguf::{GgufFile, GgufWriter};

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else { return };

    let alignment = file.shards()[0].alignment;
    let sink = Cursor::new(Vec::new());
    let mut w = GgufWriter::with_sink(sink, "roundtrip.gguf", alignment).expect("alignment was valid");
    for (key, value) in file.metadata() {
        w.add_kv(key, value.clone()).expect("parsed metadata writes back");
    }
    for t in file.tensors() {
        w.add_tensor(&t.name, t.ggml_type, &t.ne).expect("parsed tensor declares");
    }
    for t in file.tensors() {
        w.write_tensor(&t.name, file.tensor_data(t)).expect("parsed tensor writes back");
    }
    let bytes = w.finish().expect("finish").into_inner();

    let again = GgufFile::from_bytes("roundtrip.gguf", bytes).expect("written file parses");
    assert_eq!(again.metadata().len(), file.metadata().len());
    for ((k1, v1), (k2, v2)) in file.metadata().iter().zip(again.metadata()) {
        assert!(k1 == k2 && v1.bits_eq(v2), "{k1}: {v1} became {k2}: {v2}");
    }
    assert_eq!(again.tensors().len(), file.tensors().len());
    for (t1, t2) in file.tensors().iter().zip(again.tensors()) {
        assert_eq!((&t1.name, t1.ggml_type, &t1.ne, t1.n_bytes), (&t2.name, t2.ggml_type, &t2.ne, t2.n_bytes));
        assert_eq!(file.tensor_data(t1), again.tensor_data(t2));
    }
});
