//! Parsing one GGUF file's header (everything before the data section) from its bytes.
//!
//! Every read is bounds-checked against the bytes that are really there, and every count read
//! from the file is checked against the bytes left before anything is allocated for it, so a
//! forged header costs an error, never a panic or a huge allocation.

use std::collections::HashMap;
use std::path::Path;

use super::tensor::{tensor_bytes, MAX_DIMS};
use super::value::{Value, ValueType};
use super::{GgmlType, GgufError, TensorInfo};

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Real files nest arrays at most once; deeper nesting would only let a forged file recurse
/// (and overflow the stack) a few bytes at a time.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Smallest possible tensor-table entry: empty name (8), n_dims (4), type (4), offset (8).
const MIN_TENSOR_ENTRY: u64 = 24;
/// Smallest possible metadata entry: empty key (8), type (4), a one-byte value (1).
const MIN_KV_ENTRY: u64 = 13;

/// The parsed header of one file. Tensor offsets are already absolute in this file.
pub struct Header {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    /// Where each metadata value starts (parallel to `metadata`), for error messages.
    pub value_offsets: Vec<u64>,
    /// Each tensor with the offset of its tensor-table entry, for error messages.
    pub tensors: Vec<(TensorInfo, u64)>,
    pub alignment: u64,
    pub data_offset: u64,
}

impl Header {
    /// The value of `key` and where it starts.
    pub fn find(&self, key: &str) -> Option<(&Value, u64)> {
        let i = self.metadata.iter().position(|(k, _)| k == key)?;
        Some((&self.metadata[i].1, self.value_offsets[i]))
    }
}

/// Parses the header of the file `path` (used only to name it in errors) whose bytes are `bytes`.
pub fn parse_header(bytes: &[u8], path: &Path) -> Result<Header, GgufError> {
    let mut c = Cursor {
        bytes,
        pos: 0,
        path,
    };

    let magic: [u8; 4] = c.array(&|| "magic".into())?;
    if &magic != MAGIC {
        return Err(c.invalid(
            0,
            "magic".into(),
            "the bytes \"GGUF\"",
            format!("{magic:02x?}"),
        ));
    }
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        let hint = match version {
            1 => " (GGUF v1, which no current tool writes)",
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => " (a big-endian file?)",
            _ => "",
        };
        return Err(c.invalid(
            4,
            "version".into(),
            "version 2 or 3",
            format!("{version}{hint}"),
        ));
    }

    let tensor_count_at = c.at();
    let tensor_count = c.u64(&|| "tensor count".into())?;
    c.check_count(
        tensor_count,
        MIN_TENSOR_ENTRY,
        tensor_count_at,
        "tensor count",
    )?;
    let kv_count_at = c.at();
    let kv_count = c.u64(&|| "metadata count".into())?;
    c.check_count(kv_count, MIN_KV_ENTRY, kv_count_at, "metadata count")?;

    let mut metadata = Vec::with_capacity(kv_count as usize);
    let mut value_offsets = Vec::with_capacity(kv_count as usize);
    let mut keys = HashMap::new();
    for i in 0..kv_count {
        let entry_at = c.at();
        let key = c.string(&|| format!("metadata[{i}] key"))?;
        if keys.insert(key.clone(), ()).is_some() {
            return Err(GgufError::DuplicateKey {
                path: path.into(),
                offset: entry_at,
                key,
            });
        }
        let ty = c.value_type(&|| format!("metadata {key:?} value type"))?;
        value_offsets.push(c.at());
        metadata.push((
            key.clone(),
            c.value(ty, 0, &|| format!("metadata {key:?} value"))?,
        ));
    }

    let alignment = match metadata.iter().position(|(k, _)| k == ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(i) => match metadata[i].1.as_integer() {
            Some(a) if a > 0 && a <= u32::MAX as i128 && (a as u64).is_power_of_two() => a as u64,
            _ => {
                return Err(c.invalid(
                    value_offsets[i],
                    format!("metadata {ALIGNMENT_KEY:?}"),
                    "a power of two that fits in u32",
                    metadata[i].1.to_string(),
                ))
            }
        },
    };

    let mut tensors = Vec::with_capacity(tensor_count as usize);
    let mut names: HashMap<String, ()> = HashMap::new();
    for i in 0..tensor_count {
        let entry_at = c.at();
        let name = c.string(&|| format!("tensor[{i}] name"))?;
        let dims_at = c.at();
        let n_dims = c.u32(&|| format!("tensor {name:?} n_dims"))?;
        if n_dims as usize > MAX_DIMS {
            let expected = format!("at most {MAX_DIMS} dimensions");
            return Err(c.invalid(
                dims_at,
                format!("tensor {name:?} n_dims"),
                &expected,
                n_dims.to_string(),
            ));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            ne.push(c.u64(&|| format!("tensor {name:?} ne[{d}]"))?);
        }
        let type_at = c.at();
        let type_id = c.u32(&|| format!("tensor {name:?} type"))?;
        let Some(ggml_type) = GgmlType::from_id(type_id) else {
            let field = format!("tensor {name:?} type");
            return Err(c.invalid(type_at, field, "a ggml type id", type_id.to_string()));
        };
        let offset_at = c.at();
        let offset = c.u64(&|| format!("tensor {name:?} offset"))?;
        let n_bytes = tensor_bytes(ggml_type, &ne).map_err(|(expected, found)| {
            c.invalid(dims_at, format!("tensor {name:?} shape"), &expected, found)
        })?;
        if offset % alignment != 0 {
            let expected = format!("a multiple of the alignment {alignment}");
            return Err(c.invalid(
                offset_at,
                format!("tensor {name:?} offset"),
                &expected,
                offset.to_string(),
            ));
        }
        if names.insert(name.clone(), ()).is_some() {
            let (path, first_path) = (path.into(), path.into());
            return Err(GgufError::DuplicateTensor {
                path,
                offset: entry_at,
                tensor: name,
                first_path,
            });
        }
        let info = TensorInfo {
            name,
            ggml_type,
            ne,
            shard: 0,
            offset,
            n_bytes,
        };
        tensors.push((info, entry_at));
    }

    // The data section starts at the next multiple of the alignment (alignment <= 2^31 and the
    // header is inside the file, so this cannot overflow), and that start must be in the file
    // even when there are no tensors: writers pad the header, and a writer copying this file
    // need not allocate a forged 2^31 bytes of padding.
    let header_end = c.at();
    let data_offset = header_end.div_ceil(alignment) * alignment;
    c.take(data_offset - header_end, &|| {
        "padding before the data section".into()
    })?;
    let file_len = bytes.len() as u64;
    for (t, entry_at) in &mut tensors {
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => t.offset = start,
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    path: path.into(),
                    offset: *entry_at,
                    tensor: t.name.clone(),
                    start: data_offset.saturating_add(t.offset),
                    end: data_offset
                        .saturating_add(t.offset)
                        .saturating_add(t.n_bytes),
                    file_len,
                })
            }
        }
    }
    check_overlaps(&tensors, path)?;

    Ok(Header {
        version,
        metadata,
        value_offsets,
        tensors,
        alignment,
        data_offset,
    })
}

/// Tensors must not share bytes (empty tensors may sit anywhere).
fn check_overlaps(tensors: &[(TensorInfo, u64)], path: &Path) -> Result<(), GgufError> {
    let mut by_start: Vec<&(TensorInfo, u64)> =
        tensors.iter().filter(|(t, _)| t.n_bytes > 0).collect();
    by_start.sort_by_key(|(t, _)| t.offset);
    // The tensor reaching furthest so far: any later start below its end overlaps it.
    let mut furthest: Option<&TensorInfo> = None;
    for (t, entry_at) in by_start {
        if let Some(prev) = furthest {
            if t.offset < prev.offset + prev.n_bytes {
                return Err(GgufError::TensorOverlap {
                    path: path.into(),
                    offset: *entry_at,
                    tensor: t.name.clone(),
                    start: t.offset,
                    end: t.offset + t.n_bytes,
                    other: prev.name.clone(),
                    other_start: prev.offset,
                    other_end: prev.offset + prev.n_bytes,
                });
            }
        }
        if furthest.is_none_or(|p| t.offset + t.n_bytes > p.offset + p.n_bytes) {
            furthest = Some(t);
        }
    }
    Ok(())
}

/// A read position in a file's bytes. `field` arguments name what is being read; they are
/// closures so that the name is only formatted when there is an error to report.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

type Field<'f> = &'f dyn Fn() -> String;

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn at(&self) -> u64 {
        self.pos as u64
    }

    fn invalid(&self, offset: u64, field: String, expected: &str, found: String) -> GgufError {
        let (path, expected) = (self.path.into(), expected.into());
        GgufError::Invalid {
            path,
            offset,
            field,
            expected,
            found,
        }
    }

    fn take(&mut self, n: u64, field: Field) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                path: self.path.into(),
                offset: self.pos as u64,
                field: field(),
                needed: n,
                available: self.remaining(),
            });
        }
        let taken = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self, field: Field) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, field)?);
        Ok(out)
    }

    fn u32(&mut self, field: Field) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: Field) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    /// Fails unless `count` items of at least `min_each` bytes fit in what is left.
    fn check_count(
        &self,
        count: u64,
        min_each: u64,
        count_at: u64,
        field: &str,
    ) -> Result<(), GgufError> {
        let needed = count as u128 * min_each as u128;
        if needed > self.remaining() as u128 {
            return Err(GgufError::CountTooLarge {
                path: self.path.into(),
                offset: count_at,
                field: field.into(),
                count,
                needed,
                available: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, field: Field) -> Result<String, GgufError> {
        let len = self.u64(&|| format!("{} length", field()))?;
        let text_at = self.at();
        let bytes = self.take(len, field)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => {
                let found = format!(
                    "invalid byte {:#04x} at {}",
                    bytes[e.valid_up_to()],
                    text_at + e.valid_up_to() as u64
                );
                Err(self.invalid(text_at, field(), "UTF-8 text", found))
            }
        }
    }

    fn value_type(&mut self, field: Field) -> Result<ValueType, GgufError> {
        let at = self.at();
        let id = self.u32(field)?;
        ValueType::from_id(id)
            .ok_or_else(|| self.invalid(at, field(), "a value type id 0..=12", id.to_string()))
    }

    fn value(&mut self, ty: ValueType, depth: usize, field: Field) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(field)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(field)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(field)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(field)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(field)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(field)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(field)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(field)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(field)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(field)?)),
            ValueType::Bool => {
                let at = self.at();
                match self.array::<1>(field)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => return Err(self.invalid(at, field(), "a bool (0 or 1)", b.to_string())),
                }
            }
            ValueType::String => Value::String(self.string(field)?),
            ValueType::Array => {
                let at = self.at();
                if depth >= MAX_ARRAY_DEPTH {
                    let expected = format!("arrays nested at most {MAX_ARRAY_DEPTH} deep");
                    return Err(self.invalid(at, field(), &expected, "deeper nesting".into()));
                }
                let elem = self.value_type(&|| format!("{} element type", field()))?;
                let count_at = self.at();
                let count = self.u64(&|| format!("{} length", field()))?;
                self.check_count(
                    count,
                    elem.min_encoded_len(),
                    count_at,
                    &format!("{} length", field()),
                )?;
                let mut items = Vec::with_capacity(count as usize);
                for j in 0..count {
                    items.push(self.value(elem, depth + 1, &|| format!("{}[{j}]", field()))?);
                }
                Value::Array(items)
            }
        })
    }
}
