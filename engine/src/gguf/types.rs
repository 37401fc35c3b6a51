//! What a GGUF file holds: ggml tensor types, metadata values, tensor infos.

use std::fmt;

/// Declares [`GgmlType`] from one table so ids, names and block layouts cannot drift apart.
macro_rules! ggml_types {
    ($($variant:ident = $id:literal, $name:literal, $block:literal, $size:literal;)*) => {
        /// A ggml tensor element type, with its on-disk id and block layout.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum GgmlType { $($variant = $id),* }

        impl GgmlType {
            /// Every type this reader knows, in id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$variant),*];

            /// The type with on-disk id `id`; `None` for unknown and removed ids (Q4_2, Q4_3, ...).
            pub fn from_id(id: u32) -> Option<Self> {
                match id {
                    $($id => Some(Self::$variant),)*
                    _ => None,
                }
            }

            /// llama.cpp's name for the type, e.g. `"q4_K"`, `"bf16"`.
            pub fn name(self) -> &'static str {
                match self { $(Self::$variant => $name),* }
            }

            /// Elements per quantization block (1 for plain scalar types).
            pub fn block_size(self) -> u64 {
                match self { $(Self::$variant => $block),* }
            }

            /// Bytes per block.
            pub fn type_size(self) -> u64 {
                match self { $(Self::$variant => $size),* }
            }
        }
    };
}

ggml_types! {
    F32 = 0, "f32", 1, 4;
    F16 = 1, "f16", 1, 2;
    Q4_0 = 2, "q4_0", 32, 18;
    Q4_1 = 3, "q4_1", 32, 20;
    Q5_0 = 6, "q5_0", 32, 22;
    Q5_1 = 7, "q5_1", 32, 24;
    Q8_0 = 8, "q8_0", 32, 34;
    Q8_1 = 9, "q8_1", 32, 36;
    Q2_K = 10, "q2_K", 256, 84;
    Q3_K = 11, "q3_K", 256, 110;
    Q4_K = 12, "q4_K", 256, 144;
    Q5_K = 13, "q5_K", 256, 176;
    Q6_K = 14, "q6_K", 256, 210;
    Q8_K = 15, "q8_K", 256, 292;
    IQ2_XXS = 16, "iq2_xxs", 256, 66;
    IQ2_XS = 17, "iq2_xs", 256, 74;
    IQ3_XXS = 18, "iq3_xxs", 256, 98;
    IQ1_S = 19, "iq1_s", 256, 50;
    IQ4_NL = 20, "iq4_nl", 32, 18;
    IQ3_S = 21, "iq3_s", 256, 110;
    IQ2_S = 22, "iq2_s", 256, 82;
    IQ4_XS = 23, "iq4_xs", 256, 136;
    I8 = 24, "i8", 1, 1;
    I16 = 25, "i16", 1, 2;
    I32 = 26, "i32", 1, 4;
    I64 = 27, "i64", 1, 8;
    F64 = 28, "f64", 1, 8;
    IQ1_M = 29, "iq1_m", 256, 56;
    BF16 = 30, "bf16", 1, 2;
    TQ1_0 = 34, "tq1_0", 256, 54;
    TQ2_0 = 35, "tq2_0", 256, 66;
    MXFP4 = 39, "mxfp4", 32, 17;
}

impl GgmlType {
    /// The on-disk type id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Bytes taken by `n` consecutive elements; `None` unless `n` is a whole number of blocks.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A metadata value. Arrays hold elements of a single type (possibly arrays themselves).
#[derive(Debug, Clone, PartialEq)]
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

impl Value {
    /// Any integer that is non-negative. Writers disagree on signedness for counts and ids,
    /// so every integer type is accepted as long as the value itself fits.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer that fits in an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// Floats (an `F64` is narrowed, as llama.cpp keeps hyperparameters in `f32`) and
    /// integers small enough to be exact in an `f32`.
    pub fn as_f32(&self) -> Option<f32> {
        const EXACT: i64 = 1 << f32::MANTISSA_DIGITS;
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => self
                .as_i64()
                .filter(|v| (-EXACT..=EXACT).contains(v))
                .map(|v| v as f32),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
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

    /// The GGUF name of the value's type, e.g. `"u32"`, `"string"`, `"array"`.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// Type plus value for error messages, without dumping long strings or arrays.
    pub(super) fn describe(&self) -> String {
        match self {
            Value::String(_) => "a string".into(),
            Value::Array(a) => match a.first() {
                Some(first) => format!("an array of {} {}", a.len(), first.type_name()),
                None => "an empty array".into(),
            },
            Value::Bool(v) => format!("bool {v}"),
            Value::F32(v) => format!("f32 {v}"),
            Value::F64(v) => format!("f64 {v}"),
            v => match (v.as_i64(), v.as_u64()) {
                (Some(i), _) => format!("{} {i}", v.type_name()),
                (None, Some(u)) => format!("{} {u}", v.type_name()),
                (None, None) => v.type_name().into(),
            },
        }
    }
}

/// One tensor's description from the header, validated against the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml `ne`: element counts, innermost (contiguous) dimension first.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute offset of the data in its file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub size: u64,
    /// Which file of a split model holds the data (0 for a single file).
    pub part: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        // Parsing proved the product fits; saturate for hand-built infos instead of panicking.
        self.dims.iter().fold(1u64, |n, &d| n.saturating_mul(d))
    }

    /// The block index `N` of a `blk.N.*` tensor, or `None` for non-layer tensors.
    pub fn layer(&self) -> Option<u32> {
        let (n, _) = self.name.strip_prefix("blk.")?.split_once('.')?;
        // `u32::from_str` accepts a leading '+', which is not a layer name.
        if !n.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        n.parse().ok()
    }
}
