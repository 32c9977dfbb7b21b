//! Metadata values: the 13 GGUF value types and their on-disk ids.

use std::fmt;

/// One metadata value. Arrays hold values of one type (arrays of arrays may differ inside).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

/// The type tag written before every value (and before the elements of an array).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// The type with this on-disk id (0..=12, in the order of the enum).
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        const BY_ID: [ValueType; 13] = [
            U8, I8, U16, I16, U32, I32, F32, Bool, String, Array, U64, I64, F64,
        ];
        BY_ID.get(id as usize).copied()
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// Bytes the smallest value of this type takes on disk: the fixed size of a scalar, the
    /// length prefix of a string, the element type and count of an array. Counts read from
    /// the file are checked against the bytes left using this, before anything is allocated.
    pub fn min_encoded_len(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            String => 8,
            Array => 12,
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
        }
    }

    /// Any integer value, widened; None for floats, bools, strings and arrays.
    pub fn as_integer(&self) -> Option<i128> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::I8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::U64(v) => Some(v.into()),
            Value::I64(v) => Some(v.into()),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// Two values are the same bits: like `==`, except that a NaN equals the same NaN.
    pub fn bits_eq(&self, other: &Value) -> bool {
        match (self, other) {
            (Value::F32(a), Value::F32(b)) => a.to_bits() == b.to_bits(),
            (Value::F64(a), Value::F64(b)) => a.to_bits() == b.to_bits(),
            (Value::Array(a), Value::Array(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.bits_eq(y))
            }
            _ => self == other,
        }
    }
}

/// A short description for error messages: the type and, for scalars, the value
/// ("I32 -1", "String \"llama\"", "Array of 3 U32").
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::String(s) if s.chars().count() > 40 => {
                let head: String = s.chars().take(40).collect();
                write!(f, "String {head:?}...")
            }
            Value::String(s) => write!(f, "String {s:?}"),
            Value::Array(a) => match a.first() {
                Some(first) => write!(f, "Array of {} {}", a.len(), first.value_type()),
                None => write!(f, "Array of 0"),
            },
            Value::U8(v) => write!(f, "U8 {v}"),
            Value::I8(v) => write!(f, "I8 {v}"),
            Value::U16(v) => write!(f, "U16 {v}"),
            Value::I16(v) => write!(f, "I16 {v}"),
            Value::U32(v) => write!(f, "U32 {v}"),
            Value::I32(v) => write!(f, "I32 {v}"),
            Value::U64(v) => write!(f, "U64 {v}"),
            Value::I64(v) => write!(f, "I64 {v}"),
            Value::F32(v) => write!(f, "F32 {v}"),
            Value::F64(v) => write!(f, "F64 {v}"),
            Value::Bool(v) => write!(f, "Bool {v}"),
        }
    }
}
