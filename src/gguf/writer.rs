//! `GgufWriter`: writes a GGUF v3 file as a stream, one tensor at a time.
//!
//! Declare everything first (`add_kv`, `add_tensor`), then stream each tensor's bytes in the
//! declared order (`write_tensor`, or `write_tensor_part` for a tensor too large to hold, or
//! `skip_tensor` to leave it as zeros without writing them: a hole in a sparse file), then
//! `finish`. Memory use is the header plus what the caller passes in.
//!
//! Split sets: write each shard with its own writer at `split_shard_path(prefix, no, count)`,
//! call `add_split_keys` on each, and give the model's metadata to shard 0 only.

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::file::{ShardName, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT};
use super::parse::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_ARRAY_DEPTH};
use super::tensor::{tensor_bytes, MAX_DIMS};
use super::{GgmlType, GgufError, Value, ValueType};

/// The version this writer produces.
pub const VERSION: u32 = 3;

/// A tensor as declared: where its data goes, relative to the data section.
struct Declared {
    name: String,
    ggml_type: GgmlType,
    ne: Vec<u64>,
    offset: u64,
    n_bytes: u64,
}

pub struct GgufWriter<W: Write + Seek = BufWriter<File>> {
    sink: W,
    /// The output's name in errors.
    path: PathBuf,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<Declared>,
    /// Size of the data section as declared so far (each tensor padded to the alignment).
    data_len: u64,
    header_written: bool,
    /// The tensor being streamed (index into `tensors`) and how many of its bytes are written.
    next: usize,
    written: u64,
    /// Where the output is, and where the sink is: behind `pos` after a skip (a hole).
    pos: u64,
    sink_pos: u64,
}

impl GgufWriter<BufWriter<File>> {
    /// Creates (or truncates) the file at `path`. `alignment` (a power of two) is where each
    /// tensor's data starts; it is written as `general.alignment` unless it is the default 32.
    pub fn new(path: impl AsRef<Path>, alignment: u64) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|source| GgufError::Io {
            path: path.into(),
            action: "create",
            source,
        })?;
        GgufWriter::with_sink(BufWriter::with_capacity(1 << 20, file), path, alignment)
    }
}

impl<W: Write + Seek> GgufWriter<W> {
    /// A writer into any seekable sink (a `Cursor<Vec<u8>>` in tests); `name` names it in errors.
    pub fn with_sink(sink: W, name: impl Into<PathBuf>, alignment: u64) -> Result<Self, GgufError> {
        let mut writer = GgufWriter {
            sink,
            path: name.into(),
            alignment,
            metadata: Vec::new(),
            tensors: Vec::new(),
            data_len: 0,
            header_written: false,
            next: 0,
            written: 0,
            pos: 0,
            sink_pos: 0,
        };
        if alignment == 0 || alignment > u32::MAX as u64 || !alignment.is_power_of_two() {
            let found = alignment.to_string();
            return Err(writer.misuse(
                "alignment",
                "a power of two that fits in u32".into(),
                found,
            ));
        }
        writer.alignment = alignment;
        Ok(writer)
    }

    fn misuse(&self, field: &str, expected: String, found: String) -> GgufError {
        let (path, offset, field) = (self.path.clone(), self.pos, field.into());
        GgufError::Write {
            path,
            offset,
            field,
            expected,
            found,
        }
    }

    fn io(&self, source: std::io::Error) -> GgufError {
        GgufError::Io {
            path: self.path.clone(),
            action: "write",
            source,
        }
    }

    fn check_declaring(&self, field: &str) -> Result<(), GgufError> {
        if self.header_written {
            let found = "the header already written".into();
            return Err(self.misuse(field, "declarations before any data".into(), found));
        }
        Ok(())
    }

    /// Adds a metadata key. Arrays must hold values of one type (arrays inside may differ);
    /// an empty array is written with element type U8.
    pub fn add_kv(&mut self, key: &str, value: Value) -> Result<(), GgufError> {
        let field = format!("metadata {key:?}");
        self.check_declaring(&field)?;
        if self.metadata.iter().any(|(k, _)| k == key) {
            return Err(self.misuse(
                &field,
                "a key not added before".into(),
                "a second value".into(),
            ));
        }
        if let Some(found) = mixed_array(&value) {
            return Err(self.misuse(&field, "arrays whose elements share one type".into(), found));
        }
        if array_depth(&value) > MAX_ARRAY_DEPTH {
            let expected = format!("arrays nested at most {MAX_ARRAY_DEPTH} deep");
            return Err(self.misuse(&field, expected, format!("{} levels", array_depth(&value))));
        }
        if key == ALIGNMENT_KEY && value.as_integer() != Some(self.alignment as i128) {
            let expected = format!("the writer's alignment {}", self.alignment);
            return Err(self.misuse(&field, expected, value.to_string()));
        }
        self.metadata.push((key.into(), value));
        Ok(())
    }

    /// Adds `split.no` (0-based), `split.count` and `split.tensors.count` (over all shards).
    pub fn add_split_keys(
        &mut self,
        no: usize,
        count: usize,
        total_tensors: usize,
    ) -> Result<(), GgufError> {
        let (Ok(no16), Ok(count16), Ok(total32)) = (
            u16::try_from(no),
            u16::try_from(count),
            i32::try_from(total_tensors),
        ) else {
            let found = format!("split {no} of {count}, {total_tensors} tensors");
            return Err(self.misuse(
                "split keys",
                "u16 shard numbers and an i32 tensor count".into(),
                found,
            ));
        };
        self.add_kv(SPLIT_NO, Value::U16(no16))?;
        self.add_kv(SPLIT_COUNT, Value::U16(count16))?;
        self.add_kv(SPLIT_TENSORS_COUNT, Value::I32(total32))
    }

    /// Declares the next tensor of the table (`ne` in ggml order, `ne[0]` contiguous).
    pub fn add_tensor(
        &mut self,
        name: &str,
        ggml_type: GgmlType,
        ne: &[u64],
    ) -> Result<(), GgufError> {
        let field = format!("tensor {name:?}");
        self.check_declaring(&field)?;
        if ne.len() > MAX_DIMS {
            return Err(self.misuse(
                &field,
                format!("at most {MAX_DIMS} dimensions"),
                format!("{ne:?}"),
            ));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(self.misuse(
                &field,
                "a name not declared before".into(),
                "a second tensor".into(),
            ));
        }
        let n_bytes = tensor_bytes(ggml_type, ne)
            .map_err(|(expected, found)| self.misuse(&field, expected, found))?;
        let offset = self.data_len;
        self.data_len = offset
            .checked_add(n_bytes)
            .map(|end| end.div_ceil(self.alignment) * self.alignment)
            .ok_or_else(|| {
                self.misuse(
                    &field,
                    "a data section below 2^64 bytes".into(),
                    n_bytes.to_string(),
                )
            })?;
        self.tensors.push(Declared {
            name: name.into(),
            ggml_type,
            ne: ne.into(),
            offset,
            n_bytes,
        });
        Ok(())
    }

    /// Writes the header and the tensor table; after this nothing more can be declared. Called
    /// by the first tensor write if not before.
    pub fn write_header(&mut self) -> Result<(), GgufError> {
        if self.header_written {
            return Ok(());
        }
        if self.alignment != DEFAULT_ALIGNMENT
            && !self.metadata.iter().any(|(k, _)| k == ALIGNMENT_KEY)
        {
            self.metadata
                .push((ALIGNMENT_KEY.into(), Value::U32(self.alignment as u32)));
        }
        let mut header = Vec::new();
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut header, key);
            header.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut header, value);
        }
        for t in &self.tensors {
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for &n in &t.ne {
                header.extend_from_slice(&n.to_le_bytes());
            }
            header.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            header.extend_from_slice(&t.offset.to_le_bytes());
        }
        let data_offset = (header.len() as u64).div_ceil(self.alignment) * self.alignment;
        self.sink.write_all(&header).map_err(|e| self.io(e))?;
        write_zeros(&mut self.sink, data_offset - header.len() as u64).map_err(|e| self.io(e))?;
        self.pos = data_offset;
        self.sink_pos = data_offset;
        self.header_written = true;
        Ok(())
    }

    /// The tensor to be written next, checked against `name` and against a partial write.
    fn start_tensor(&mut self, name: &str) -> Result<&Declared, GgufError> {
        self.write_header()?;
        let field = format!("tensor {name:?}");
        let expected = match self.tensors.get(self.next) {
            Some(t) if t.name == name && self.written == 0 => return Ok(&self.tensors[self.next]),
            Some(t) if self.written == 0 => format!("tensor {:?} (declared next)", t.name),
            Some(t) => format!("the rest of tensor {:?}", t.name),
            None => "no more tensors (all declared ones are written)".into(),
        };
        Err(self.misuse(&field, expected, format!("tensor {name:?}")))
    }

    /// Writes the whole of the next declared tensor, which must be `name` and `bytes.len()` long.
    pub fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<(), GgufError> {
        let n_bytes = self.start_tensor(name)?.n_bytes;
        if bytes.len() as u64 != n_bytes {
            let expected = format!("{n_bytes} bytes (from its type and shape)");
            return Err(self.misuse(
                &format!("tensor {name:?} data"),
                expected,
                format!("{} bytes", bytes.len()),
            ));
        }
        self.write_tensor_part(bytes)
    }

    /// Appends bytes to the tensor being streamed; it is complete (and padded) when its
    /// declared size is reached.
    pub fn write_tensor_part(&mut self, bytes: &[u8]) -> Result<(), GgufError> {
        self.write_header()?;
        let Some(t) = self.tensors.get(self.next) else {
            let found = format!("{} more bytes", bytes.len());
            return Err(self.misuse(
                "tensor data",
                "no more data (all tensors are written)".into(),
                found,
            ));
        };
        let left = t.n_bytes - self.written;
        if bytes.len() as u64 > left {
            let field = format!("tensor {:?} data", t.name);
            return Err(self.misuse(
                &field,
                format!("at most {left} more bytes"),
                format!("{} bytes", bytes.len()),
            ));
        }
        self.sync_position()?;
        self.sink.write_all(bytes).map_err(|e| self.io(e))?;
        self.pos += bytes.len() as u64;
        self.sink_pos = self.pos;
        self.written += bytes.len() as u64;
        if self.written == self.tensors[self.next].n_bytes {
            self.end_tensor(false)?;
        }
        Ok(())
    }

    /// Leaves the next declared tensor (`name`) as zeros without writing it: on disk it is a
    /// hole, so a sparse file of any size costs no space.
    pub fn skip_tensor(&mut self, name: &str) -> Result<(), GgufError> {
        let n_bytes = self.start_tensor(name)?.n_bytes;
        self.pos += n_bytes;
        self.written = n_bytes;
        self.end_tensor(true)
    }

    /// Pads the finished tensor to the alignment and moves on to the next one.
    fn end_tensor(&mut self, skipped: bool) -> Result<(), GgufError> {
        let t = &self.tensors[self.next];
        let pad = (t.n_bytes.div_ceil(self.alignment) * self.alignment) - t.n_bytes;
        if !skipped {
            write_zeros(&mut self.sink, pad).map_err(|e| self.io(e))?;
            self.sink_pos += pad;
        }
        self.pos += pad;
        self.next += 1;
        self.written = 0;
        Ok(())
    }

    /// After a skip the sink is behind `pos`: seek there (seeking past the end makes a hole).
    fn sync_position(&mut self) -> Result<(), GgufError> {
        if self.sink_pos != self.pos {
            self.sink
                .seek(SeekFrom::Start(self.pos))
                .map_err(|e| self.io(e))?;
            self.sink_pos = self.pos;
        }
        Ok(())
    }

    /// Checks that every declared tensor was written, makes the output its full length and
    /// flushes it. Returns the sink.
    pub fn finish(mut self) -> Result<W, GgufError> {
        self.write_header()?;
        if let Some(t) = self.tensors.get(self.next) {
            let found = format!("finish() before tensor {:?} was complete", t.name);
            return Err(self.misuse("tensor data", "every declared tensor written".into(), found));
        }
        if self.sink_pos < self.pos {
            // A seek alone does not extend a file: write its last byte, which is in the hole.
            self.sink
                .seek(SeekFrom::Start(self.pos - 1))
                .map_err(|e| self.io(e))?;
            self.sink.write_all(&[0]).map_err(|e| self.io(e))?;
        }
        self.sink.flush().map_err(|e| self.io(e))?;
        Ok(self.sink)
    }
}

/// The path of shard `no` (0-based, as in `split.no`) of `count`: `PREFIX-0000k-of-0000N.gguf`
/// with k = no + 1.
pub fn split_shard_path(prefix: impl AsRef<Path>, no: usize, count: usize) -> PathBuf {
    let name = ShardName {
        prefix: String::new(),
        no: no as u64 + 1,
        count: count as u64,
        width: 5,
    };
    let mut path = OsString::from(prefix.as_ref());
    path.push(name.with_no(no as u64 + 1));
    PathBuf::from(path)
}

/// Describes the first array (at any depth) whose elements have different types.
fn mixed_array(value: &Value) -> Option<String> {
    let Value::Array(items) = value else {
        return None;
    };
    let first = items.first()?.value_type();
    if let Some(other) = items.iter().find(|v| v.value_type() != first) {
        return Some(format!(
            "an array of {first} holding a {}",
            other.value_type()
        ));
    }
    items.iter().find_map(mixed_array)
}

/// How many arrays deep a value is (0 for a scalar).
fn array_depth(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(array_depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(*v as u8),
        Value::String(s) => put_string(out, s),
        Value::Array(items) => {
            let elem = items.first().map_or(ValueType::U8, Value::value_type);
            out.extend_from_slice(&elem.id().to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}

fn write_zeros(sink: &mut impl Write, mut n: u64) -> std::io::Result<()> {
    const ZEROS: [u8; 4096] = [0; 4096];
    while n > 0 {
        let chunk = n.min(ZEROS.len() as u64) as usize;
        sink.write_all(&ZEROS[..chunk])?;
        n -= chunk as u64;
    }
    Ok(())
}
