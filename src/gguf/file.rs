//! `GgufFile`: one file or a whole split set, memory-mapped, with typed metadata accessors.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Deref;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::parse::{parse_header, Header};
use super::{GgufError, TensorInfo, Value};

pub const SPLIT_NO: &str = "split.no";
pub const SPLIT_COUNT: &str = "split.count";
pub const SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// One file of an opened set (a single file is a set of one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    pub path: PathBuf,
    pub file_size: u64,
    pub n_tensors: usize,
    /// Where this file's data section starts.
    pub data_offset: u64,
    pub alignment: u64,
}

/// A GGUF file or split set. Tensor bytes stay in the page cache until touched: opening reads
/// only the headers.
pub struct GgufFile {
    version: u32,
    /// Shard 0's metadata in file order, and where each value starts (for errors).
    metadata: Vec<(String, Value)>,
    value_offsets: Vec<u64>,
    key_index: HashMap<String, usize>,
    /// The tensors of all shards, shard by shard, each in its file's table order.
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    shards: Vec<Shard>,
    /// The bytes of each shard, parallel to `shards`.
    bytes: Vec<Bytes>,
}

/// A summary: the bytes and the metadata values would drown a debug print.
impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("shards", &self.shards)
            .finish()
    }
}

/// A shard's bytes: mapped from disk, or held in memory (`GgufFile::from_bytes`).
enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A shard read from disk, before it joins its set.
struct Loaded {
    path: PathBuf,
    bytes: Bytes,
    header: Header,
}

impl Loaded {
    fn read(path: &Path) -> Result<Loaded, GgufError> {
        let io = |action, source| GgufError::Io {
            path: path.into(),
            action,
            source,
        };
        let file = File::open(path).map_err(|e| io("open", e))?;
        // SAFETY: the mapping is read-only and private to this process; like every mmap reader
        // we rely on nobody truncating the file while it is open (that would fault, not corrupt).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| io("map", e))?;
        let header = parse_header(&map, path)?;
        Ok(Loaded {
            path: path.into(),
            bytes: Bytes::Mapped(map),
            header,
        })
    }

    /// An integer split key of this shard, if present.
    fn split_key(&self, key: &str) -> Result<Option<(u64, u64)>, GgufError> {
        let Some((value, offset)) = self.header.find(key) else {
            return Ok(None);
        };
        match value.as_integer().and_then(|v| u64::try_from(v).ok()) {
            Some(v) => Ok(Some((v, offset))),
            None => Err(GgufError::WrongType {
                path: self.path.clone(),
                offset,
                key: key.into(),
                expected: "a non-negative integer",
                found: value.to_string(),
            }),
        }
    }
}

impl GgufFile {
    /// Opens a GGUF file. A shard `NAME-0000k-of-0000N.gguf` of a split set (a file whose
    /// `split.count` is above 1) opens the whole set, from any of its shards.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let opened = Loaded::read(path.as_ref())?;
        match opened.split_key(SPLIT_COUNT)? {
            Some((count, _)) if count > 1 => Self::open_split_set(opened, count),
            _ => Self::assemble(vec![opened]),
        }
    }

    /// Parses a single file held in memory; `name` stands for its path in errors. Split keys are
    /// not followed. For tests and fuzzing.
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        let path = name.into();
        let header = parse_header(&bytes, &path)?;
        Self::assemble(vec![Loaded {
            path,
            bytes: Bytes::Owned(bytes),
            header,
        }])
    }

    fn open_split_set(opened: Loaded, count: u64) -> Result<GgufFile, GgufError> {
        let (_, count_at) = opened
            .header
            .find(SPLIT_COUNT)
            .expect("split.count was read");
        let mismatch = |path: &Path, offset, field: &str, expected: String, found: String| {
            GgufError::ShardMismatch {
                path: path.into(),
                offset,
                field: field.into(),
                expected,
                found,
            }
        };
        let file_name = opened
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("");
        let Some(name) = ShardName::parse(file_name) else {
            let expected =
                format!("a shard of a split set of {count} named NAME-0000k-of-0000N.gguf");
            return Err(mismatch(
                &opened.path,
                count_at,
                "file name",
                expected,
                format!("{file_name:?}"),
            ));
        };
        if name.count != count {
            let expected = format!("{} (from the file name)", name.count);
            return Err(mismatch(
                &opened.path,
                count_at,
                SPLIT_COUNT,
                expected,
                count.to_string(),
            ));
        }

        let opened_path = opened.path.clone();
        let mut opened = Some(opened);
        let mut shards = Vec::with_capacity(count as usize);
        for no in 0..count {
            let path = opened_path.with_file_name(name.with_no(no + 1));
            let shard = if no + 1 == name.no {
                opened.take().expect("the opened shard is used once")
            } else {
                Loaded::read(&path).map_err(|e| match e {
                    GgufError::Io { source, .. }
                        if source.kind() == std::io::ErrorKind::NotFound =>
                    {
                        let (opened, no, count) =
                            (opened_path.clone(), no as usize + 1, count as usize);
                        GgufError::MissingShard {
                            path: path.clone(),
                            opened,
                            no,
                            count,
                        }
                    }
                    other => other,
                })?
            };
            let (shard_count, count_at) = shard.split_key(SPLIT_COUNT)?.unwrap_or((1, 0));
            if shard_count != count {
                return Err(mismatch(
                    &shard.path,
                    count_at,
                    SPLIT_COUNT,
                    count.to_string(),
                    shard_count.to_string(),
                ));
            }
            let Some((shard_no, no_at)) = shard.split_key(SPLIT_NO)? else {
                return Err(GgufError::MissingKey {
                    path: shard.path,
                    key: SPLIT_NO.into(),
                });
            };
            if shard_no != no {
                let expected = format!("{no} (0-based, from the file name)");
                return Err(mismatch(
                    &shard.path,
                    no_at,
                    SPLIT_NO,
                    expected,
                    shard_no.to_string(),
                ));
            }
            shards.push(shard);
        }

        let total: usize = shards.iter().map(|s| s.header.tensors.len()).sum();
        if let Some((expected_total, at)) = shards[0].split_key(SPLIT_TENSORS_COUNT)? {
            if expected_total != total as u64 {
                let found = format!("{total} tensors in the {count} shards");
                return Err(mismatch(
                    &shards[0].path,
                    at,
                    SPLIT_TENSORS_COUNT,
                    expected_total.to_string(),
                    found,
                ));
            }
        }
        Self::assemble(shards)
    }

    /// Joins parsed shards (in order) into one file: metadata from the first, tensors from all.
    fn assemble(loaded: Vec<Loaded>) -> Result<GgufFile, GgufError> {
        let mut tensors: Vec<TensorInfo> = Vec::new();
        let mut tensor_index: HashMap<String, usize> = HashMap::new();
        let mut shards = Vec::with_capacity(loaded.len());
        let mut bytes = Vec::with_capacity(loaded.len());
        let mut first = None;
        for (shard_no, shard) in loaded.into_iter().enumerate() {
            let Loaded {
                path,
                bytes: shard_bytes,
                header,
            } = shard;
            shards.push(Shard {
                path: path.clone(),
                file_size: shard_bytes.len() as u64,
                n_tensors: header.tensors.len(),
                data_offset: header.data_offset,
                alignment: header.alignment,
            });
            bytes.push(shard_bytes);
            for (mut t, entry_at) in header.tensors {
                if let Some(&i) = tensor_index.get(&t.name) {
                    return Err(GgufError::DuplicateTensor {
                        path,
                        offset: entry_at,
                        tensor: t.name,
                        first_path: shards[tensors[i].shard].path.clone(),
                    });
                }
                t.shard = shard_no;
                tensor_index.insert(t.name.clone(), tensors.len());
                tensors.push(t);
            }
            if first.is_none() {
                first = Some((header.version, header.metadata, header.value_offsets));
            }
        }
        let (version, metadata, value_offsets) = first.expect("at least one shard");
        let key_index = metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        Ok(GgufFile {
            version,
            metadata,
            value_offsets,
            key_index,
            tensors,
            tensor_index,
            shards,
            bytes,
        })
    }

    /// Shard 0's GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Shard 0's metadata, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The value of `key` and where it starts in shard 0, or MissingKey.
    fn lookup(&self, key: &str) -> Result<(&Value, u64), GgufError> {
        match self.key_index.get(key) {
            Some(&i) => Ok((&self.metadata[i].1, self.value_offsets[i])),
            None => Err(GgufError::MissingKey {
                path: self.shards[0].path.clone(),
                key: key.into(),
            }),
        }
    }

    fn wrong_type(
        &self,
        key: &str,
        offset: u64,
        expected: &'static str,
        found: &Value,
    ) -> GgufError {
        let found = found.to_string();
        GgufError::WrongType {
            path: self.shards[0].path.clone(),
            offset,
            key: key.into(),
            expected,
            found,
        }
    }

    /// An integer value converted to `T`: any integer type is accepted if the value fits,
    /// because writers disagree on widths (u32 vs i32 vs u64).
    fn get_integer<T: TryFrom<i128>>(
        &self,
        key: &str,
        expected: &'static str,
    ) -> Result<T, GgufError> {
        let (value, offset) = self.lookup(key)?;
        value
            .as_integer()
            .and_then(|v| T::try_from(v).ok())
            .ok_or_else(|| self.wrong_type(key, offset, expected, value))
    }

    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.get_integer(key, "an integer that fits in u32")
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.get_integer(key, "an integer that fits in u64")
    }

    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        self.get_integer(key, "an integer that fits in i64")
    }

    pub fn get_usize(&self, key: &str) -> Result<usize, GgufError> {
        self.get_integer(key, "an integer that fits in usize")
    }

    /// An F32 value (an F64 is rounded to f32).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        match self.lookup(key)? {
            (Value::F32(v), _) => Ok(*v),
            (Value::F64(v), _) => Ok(*v as f32),
            (value, offset) => Err(self.wrong_type(key, offset, "F32 or F64", value)),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.lookup(key)? {
            (Value::Bool(v), _) => Ok(*v),
            (value, offset) => Err(self.wrong_type(key, offset, "Bool", value)),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.lookup(key)? {
            (Value::String(v), _) => Ok(v),
            (value, offset) => Err(self.wrong_type(key, offset, "String", value)),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value], GgufError> {
        match self.lookup(key)? {
            (Value::Array(v), _) => Ok(v),
            (value, offset) => Err(self.wrong_type(key, offset, "Array", value)),
        }
    }

    /// All tensors of all shards, shard by shard.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's bytes, borrowed from the mapping (no copy; pages load when touched).
    /// `t` must come from this file; its bounds were checked when the file was opened.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        &self.bytes[t.shard][t.offset as usize..(t.offset + t.n_bytes) as usize]
    }

    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }
}

/// The parts of a shard's file name `NAME-0000k-of-0000N.gguf` (k is 1-based).
pub struct ShardName {
    pub prefix: String,
    pub no: u64,
    pub count: u64,
    /// Digits of k and N (5 for every tool we know of).
    pub width: usize,
}

impl ShardName {
    pub fn parse(file_name: &str) -> Option<ShardName> {
        let stem = file_name.strip_suffix(".gguf")?;
        let (rest, count) = stem.rsplit_once("-of-")?;
        let (prefix, no) = rest.rsplit_once('-')?;
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(no) || !digits(count) || no.len() != count.len() {
            return None;
        }
        let (no, count, width) = (no.parse().ok()?, count.parse().ok()?, count.len());
        (no >= 1 && no <= count).then(|| ShardName {
            prefix: prefix.into(),
            no,
            count,
            width,
        })
    }

    /// The file name of shard `no` (1-based) of this set.
    pub fn with_no(&self, no: u64) -> String {
        format!(
            "{}-{:0w$}-of-{:0w$}.gguf",
            self.prefix,
            no,
            self.count,
            w = self.width
        )
    }
}
