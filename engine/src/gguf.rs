//! Strict reader for GGUF model files (the llama.cpp container format, versions 2 and 3).
//!
//! A GGUF file is a small header (metadata key/values and a table of tensor descriptions)
//! followed by an aligned data section holding the raw tensor bytes. [`Gguf`] memory-maps the
//! file, parses and validates the header once, and then hands out zero-copy slices of tensor data,
//! so a multi-gigabyte model costs nothing until its pages are actually touched.
//!
//! The parser treats the file as untrusted input: every length and count is checked against the
//! bytes that remain before anything is allocated, all arithmetic on file-supplied numbers is
//! checked, and every tensor is proven to lie inside the file. Malformed input produces a
//! [`GgufError`] naming what was wrong, where, and the limit it broke; it never panics.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

/// Architectures the engine can run; pass to [`Gguf::check_architecture`].
pub const SUPPORTED_ARCHITECTURES: &[&str] =
    &["llama", "qwen2", "gemma3", "qwen3", "qwen3moe", "deepseek2"];

/// Alignment of the data section when `general.alignment` is absent (llama.cpp's default).
pub const DEFAULT_ALIGNMENT: u32 = 32;

/// ggml tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;

/// Nested arrays are legal but never deep in practice; the limit keeps a hostile file from
/// overflowing the stack through recursion.
const MAX_ARRAY_DEPTH: u32 = 16;

/// Smallest possible encodings, used to reject counts the remaining bytes cannot hold:
/// a key/value is an empty key (8), a type (4) and a one-byte value; a tensor info is an empty
/// name (8), n_dims (4), one dim (8), a type (4) and an offset (8).
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;

/// Everything that can go wrong while opening or querying a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open GGUF file '{}': {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file: magic bytes are b\"{}\", expected b\"GGUF\"{hint}", found.escape_ascii())]
    BadMagic { found: [u8; 4], hint: &'static str },
    #[error("unsupported GGUF version {version} (supported: 2, 3){hint}")]
    UnsupportedVersion { version: u32, hint: &'static str },
    #[error(
        "GGUF file truncated: reading {what} needs {needed} bytes at offset {offset}, but the file is {file_size} bytes"
    )]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        file_size: u64,
    },
    #[error(
        "{what} is {count}, but at {min_bytes} bytes or more each they cannot fit in the {remaining} bytes left after offset {offset}"
    )]
    CountTooLarge {
        what: String,
        count: u64,
        min_bytes: u64,
        remaining: u64,
        offset: u64,
    },
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error("duplicate metadata key '{key}'")]
    DuplicateKey { key: String },
    #[error(
        "unknown metadata value type {type_id} in {what} at offset {offset} (known types: 0..=12)"
    )]
    UnknownValueType {
        what: String,
        type_id: u32,
        offset: u64,
    },
    #[error("{what} nests arrays deeper than the limit of {MAX_ARRAY_DEPTH}")]
    ArrayTooDeep { what: String },
    #[error("general.alignment is {alignment}; it must be a non-zero power of two")]
    BadAlignment { alignment: u32 },
    #[error("tensor '{tensor}' has {n_dims} dimensions; ggml supports 1..={MAX_DIMS}")]
    BadDimCount { tensor: String, n_dims: u32 },
    #[error("tensor '{tensor}' has unknown ggml type id {type_id}")]
    UnknownTensorType { tensor: String, type_id: u32 },
    #[error("tensor '{tensor}': size of dims {dims:?} overflows 64 bits")]
    DimsOverflow { tensor: String, dims: Vec<u64> },
    #[error(
        "tensor '{tensor}': row length {ne0} is not a multiple of the {ggml_type} block size {block_size}"
    )]
    BadRowLength {
        tensor: String,
        ggml_type: GgmlType,
        ne0: u64,
        block_size: u64,
    },
    #[error("duplicate tensor name '{tensor}'")]
    DuplicateTensor { tensor: String },
    #[error("tensor '{tensor}' is in layer {layer}, but the file has only {n_tensors} tensors")]
    LayerOutOfRange {
        tensor: String,
        layer: u32,
        n_tensors: usize,
    },
    #[error("tensor '{tensor}' offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor '{tensor}' data ends at offset {end}, past the end of the file ({file_size} bytes)"
    )]
    TensorPastEnd {
        tensor: String,
        end: u64,
        file_size: u64,
    },
    #[error("missing required metadata key '{key}'")]
    MissingKey { key: String },
    #[error("metadata key '{key}' should be {expected}, but is {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("model architecture '{arch}' is not supported; supported: {supported}")]
    UnsupportedArchitecture { arch: String, supported: String },
}

type Result<T, E = GgufError> = std::result::Result<T, E>;

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
    fn describe(&self) -> String {
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
    /// Absolute offset of the data in the file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub size: u64,
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

/// The bytes behind a [`Gguf`]: a read-only mapping of a file, or an owned buffer.
enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A parsed, validated GGUF file.
pub struct Gguf {
    backing: Backing,
    header: Header,
}

/// Everything parsed from the header, kept apart from `backing` because parsing borrows it.
struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl fmt::Debug for Gguf {
    // The backing bytes are deliberately left out: they can be gigabytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.header.version)
            .field("file_size", &self.file_size())
            .field("data_offset", &self.header.data_offset)
            .field("metadata_keys", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl Gguf {
    /// Memory-maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the file is opened read-only and the mapping is only ever read. Mmap is unsafe
        // because another process could modify or truncate the file while it is mapped; model
        // files are treated as immutable, and changing one while it is loaded is the user's
        // responsibility (as with llama.cpp, which maps model files the same way).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(Backing::Mmap(map))
    }

    /// Parses a GGUF image held in memory (same validation as [`Gguf::open`]).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Backing::Owned(bytes))
    }

    fn parse(backing: Backing) -> Result<Self> {
        let header = parse_header(backing.bytes())?;
        Ok(Gguf { backing, header })
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// Alignment of the data section and of every tensor offset.
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Absolute file offset where the data section starts.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    pub fn file_size(&self) -> u64 {
        self.bytes().len() as u64
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// All metadata entries, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.header.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        let &i = self.header.key_index.get(key)?;
        self.header.metadata.get(i).map(|(_, v)| v)
    }

    /// Shared body of the typed getters: absent is `Ok(None)`, present but not convertible is
    /// `WrongType`, so optional keys still catch files that store them with the wrong type.
    fn lookup<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        convert: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<Option<T>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        convert(value)
            .map(Some)
            .ok_or_else(|| GgufError::WrongType {
                key: key.into(),
                expected,
                found: value.describe(),
            })
    }

    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.lookup(key, "a u32", |v| v.as_u64()?.try_into().ok())
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.lookup(key, "a u64", Value::as_u64)
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.lookup(key, "an f32", Value::as_f32)
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.lookup(key, "a bool", Value::as_bool)
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.lookup(key, "a string", Value::as_str)
    }

    pub fn opt_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.lookup(key, "an array of strings", |v| {
            v.as_array()?.iter().map(Value::as_str).collect()
        })
    }

    pub fn get_u32(&self, key: &str) -> Result<u32> {
        required(key, self.opt_u32(key))
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        required(key, self.opt_u64(key))
    }

    pub fn get_f32(&self, key: &str) -> Result<f32> {
        required(key, self.opt_f32(key))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        required(key, self.opt_bool(key))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        required(key, self.opt_str(key))
    }

    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        required(key, self.opt_str_array(key))
    }

    /// `general.architecture`, which every model file must have.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// The architecture, if it is one of `supported` (usually [`SUPPORTED_ARCHITECTURES`]).
    pub fn check_architecture(&self, supported: &[&str]) -> Result<&str> {
        let arch = self.architecture()?;
        if supported.contains(&arch) {
            Ok(arch)
        } else {
            Err(GgufError::UnsupportedArchitecture {
                arch: arch.into(),
                supported: supported.join(", "),
            })
        }
    }

    /// All tensors, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        let h = &self.header;
        h.tensors.get(*h.tensor_index.get(name)?)
    }

    /// The tensor's bytes, borrowed from the mapping. Infos from this file always lie inside it;
    /// an info that does not (e.g. one from another file) yields an empty slice.
    pub fn tensor_data(&self, tensor: &TensorInfo) -> &[u8] {
        let range = usize::try_from(tensor.offset)
            .ok()
            .zip(usize::try_from(tensor.size).ok())
            .and_then(|(start, len)| Some(start..start.checked_add(len)?));
        range.and_then(|r| self.bytes().get(r)).unwrap_or_default()
    }

    /// Bytes of all `blk.N.*` tensors, indexed by layer `N` (length = highest `N` + 1).
    pub fn layer_bytes(&self) -> Vec<u64> {
        // Parsing bounded every layer index by the tensor count, so this allocation is small.
        let n_layers = self
            .tensors()
            .iter()
            .filter_map(TensorInfo::layer)
            .max()
            .map_or(0, |max| max as usize + 1);
        let mut out = vec![0u64; n_layers];
        for t in self.tensors() {
            if let Some(slot) = t.layer().and_then(|l| out.get_mut(l as usize)) {
                *slot = slot.saturating_add(t.size);
            }
        }
        out
    }

    /// Bytes of all tensors outside the `blk.N.*` layers (embeddings, output head, norms).
    pub fn non_layer_bytes(&self) -> u64 {
        self.tensors()
            .iter()
            .filter(|t| t.layer().is_none())
            .fold(0, |sum, t| sum.saturating_add(t.size))
    }
}

fn required<T>(key: &str, value: Result<Option<T>>) -> Result<T> {
    value?.ok_or_else(|| GgufError::MissingKey { key: key.into() })
}

fn parse_header(buf: &[u8]) -> Result<Header> {
    let mut r = Reader { buf, pos: 0 };
    let file_size = buf.len() as u64;

    let magic: [u8; 4] = r.array("magic")?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic {
            found: magic,
            hint: magic_hint(buf),
        });
    }
    let version = r.u32("version")?;
    if !matches!(version, 2 | 3) {
        let hint = match version {
            // A byte-swapped 2 or 3 means the writer used big-endian integers.
            _ if matches!(version.swap_bytes(), 2 | 3) => {
                "; this looks like a big-endian GGUF, only little-endian files are supported"
            }
            1 => "; version 1 predates August 2023, re-convert the model with a current llama.cpp",
            _ => "",
        };
        return Err(GgufError::UnsupportedVersion { version, hint });
    }
    let tensor_count = r.u64("tensor count")?;
    let kv_count = r.u64("metadata key/value count")?;

    let n_kv = r.count(kv_count, MIN_KV_BYTES, "metadata key/value count")?;
    let mut metadata = Vec::with_capacity(n_kv);
    let mut key_index = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = r.utf8(&format!("metadata key #{i}"))?;
        let what = format!("metadata value '{key}'");
        let type_id = r.u32(&what)?;
        let value = r.value(type_id, &what, 0)?;
        if key_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(GgufError::DuplicateKey { key });
        }
        metadata.push((key, value));
    }

    // llama.cpp insists on a u32 here, so no integer coercion.
    let alignment = match key_index
        .get("general.alignment")
        .and_then(|&i| metadata.get(i))
    {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if a.is_power_of_two() => *a,
        Some((_, Value::U32(a))) => return Err(GgufError::BadAlignment { alignment: *a }),
        Some((key, v)) => {
            return Err(GgufError::WrongType {
                key: key.clone(),
                expected: "a u32",
                found: v.describe(),
            });
        }
    };
    let alignment = u64::from(alignment);

    let n_tensors = r.count(tensor_count, MIN_TENSOR_INFO_BYTES, "tensor count")?;
    let mut tensors = Vec::with_capacity(n_tensors);
    let mut tensor_index = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = r.utf8(&format!("name of tensor #{i}"))?;
        let what = format!("info of tensor '{name}'");
        let n_dims = r.u32(&what)?;
        if !(1..=MAX_DIMS).contains(&n_dims) {
            return Err(GgufError::BadDimCount {
                tensor: name,
                n_dims,
            });
        }
        let dims = (0..n_dims)
            .map(|_| r.u64(&what))
            .collect::<Result<Vec<_>>>()?;
        let type_id = r.u32(&what)?;
        let Some(ggml_type) = GgmlType::from_id(type_id) else {
            return Err(GgufError::UnknownTensorType {
                tensor: name,
                type_id,
            });
        };
        let rel_offset = r.u64(&what)?;
        let size = tensor_size(&name, &dims, ggml_type)?;
        let info = TensorInfo {
            name,
            dims,
            ggml_type,
            offset: rel_offset, // made absolute below, once the data section start is known
            size,
        };
        // Bounding layer indices keeps `layer_bytes` from allocating for a bogus `blk.4000000000`.
        if let Some(layer) = info.layer().filter(|&l| l as usize >= n_tensors) {
            return Err(GgufError::LayerOutOfRange {
                tensor: info.name,
                layer,
                n_tensors,
            });
        }
        if tensor_index.insert(info.name.clone(), i).is_some() {
            return Err(GgufError::DuplicateTensor { tensor: info.name });
        }
        tensors.push(info);
    }

    // The data section starts at the next multiple of the alignment after the tensor infos.
    let data_offset = (r.pos as u64)
        .checked_next_multiple_of(alignment)
        .unwrap_or(u64::MAX);

    for t in &mut tensors {
        if !t.offset.is_multiple_of(alignment) {
            return Err(GgufError::MisalignedTensor {
                tensor: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        // Saturation is enough: a saturated end is u64::MAX, which is always past the end.
        t.offset = data_offset.saturating_add(t.offset);
        let end = t.offset.saturating_add(t.size);
        if end > file_size {
            return Err(GgufError::TensorPastEnd {
                tensor: t.name.clone(),
                end,
                file_size,
            });
        }
    }

    Ok(Header {
        version,
        alignment,
        data_offset,
        metadata,
        key_index,
        tensors,
        tensor_index,
    })
}

/// Bytes of a tensor: whole rows of blocks, with every product checked.
fn tensor_size(name: &str, dims: &[u64], ggml_type: GgmlType) -> Result<u64> {
    let ne0 = dims.first().copied().unwrap_or(1);
    let block_size = ggml_type.block_size();
    if !ne0.is_multiple_of(block_size) {
        return Err(GgufError::BadRowLength {
            tensor: name.into(),
            ggml_type,
            ne0,
            block_size,
        });
    }
    dims.iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .and_then(|n| ggml_type.row_bytes(n))
        // ggml stores sizes and strides as signed 64-bit numbers.
        .filter(|&size| i64::try_from(size).is_ok())
        .ok_or_else(|| GgufError::DimsOverflow {
            tensor: name.into(),
            dims: dims.to_vec(),
        })
}

/// A guess at what a non-GGUF file is, so the error tells the user what went wrong.
fn magic_hint(buf: &[u8]) -> &'static str {
    match buf {
        // Legacy ggml formats wrote their magic as a little-endian u32.
        [b'l' | b'f' | b't', b'm' | b'j', b'g', b'g', ..] => {
            "; this looks like a legacy GGML/GGJT model, convert it to GGUF"
        }
        [b'v', b'e', b'r', b's', b'i', b'o', b'n', b' ', ..] => {
            "; this looks like a Git LFS pointer file, fetch the real file with `git lfs pull`"
        }
        [b'<', ..] | [b'{', ..] => {
            "; this looks like an HTML/JSON text file, maybe a failed download"
        }
        [b'P', b'K', 3, 4, ..] => "; this looks like a zip archive (a PyTorch checkpoint?)",
        // safetensors: a u64 header length followed by a JSON object.
        [_, _, _, _, _, _, _, _, b'{', ..] => "; this looks like a safetensors file",
        _ => "",
    }
}

/// A cursor over the file that turns every short read into a [`GgufError::Truncated`].
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> u64 {
        self.buf.len().saturating_sub(self.pos) as u64
    }

    fn truncated(&self, needed: u64, what: &str) -> GgufError {
        GgufError::Truncated {
            what: what.into(),
            offset: self.pos as u64,
            needed,
            file_size: self.buf.len() as u64,
        }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let bytes = usize::try_from(n)
            .ok()
            .and_then(|n| self.buf.get(self.pos..)?.get(..n))
            .ok_or_else(|| self.truncated(n, what))?;
        self.pos += bytes.len();
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let bytes = self
            .buf
            .get(self.pos..)
            .and_then(<[u8]>::first_chunk::<N>)
            .ok_or_else(|| self.truncated(N as u64, what))?;
        self.pos += N;
        Ok(*bytes)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Checks that `count` items of at least `min_bytes` each fit in the rest of the file before
    /// anything is allocated for them, so allocations stay proportional to the file size.
    fn count(&self, count: u64, min_bytes: u64, what: &str) -> Result<usize> {
        count
            .checked_mul(min_bytes)
            .filter(|&needed| needed <= self.remaining())
            .and_then(|_| usize::try_from(count).ok())
            .ok_or_else(|| GgufError::CountTooLarge {
                what: what.into(),
                count,
                min_bytes,
                remaining: self.remaining(),
                offset: self.pos as u64,
            })
    }

    /// A length-prefixed string; `take` refuses lengths past the end of the file.
    fn string(&mut self, what: &str) -> Result<&'a [u8]> {
        let len = self.u64(what)?;
        self.take(len, what)
    }

    /// A string that must be valid UTF-8 (keys and tensor names are looked up by exact text).
    fn utf8(&mut self, what: &str) -> Result<String> {
        let offset = self.pos as u64;
        let bytes = self.string(what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| GgufError::InvalidUtf8 {
                what: what.into(),
                offset,
            })
    }

    fn value(&mut self, type_id: u32, what: &str, depth: u32) -> Result<Value> {
        Ok(match type_id {
            0 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            1 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => Value::Bool(self.array::<1>(what)? != [0]),
            // Token strings in real vocabularies are sometimes not valid UTF-8 (partial byte
            // sequences); keep them readable rather than rejecting the whole model.
            8 => Value::String(String::from_utf8_lossy(self.string(what)?).into_owned()),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::ArrayTooDeep { what: what.into() });
                }
                let type_offset = self.pos as u64;
                let elem_type = self.u32(what)?;
                let count = self.u64(what)?;
                let min_bytes =
                    min_value_bytes(elem_type).ok_or_else(|| GgufError::UnknownValueType {
                        what: what.into(),
                        type_id: elem_type,
                        offset: type_offset,
                    })?;
                let n = self.count(count, min_bytes, &format!("element count of {what}"))?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem_type, what, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            _ => {
                return Err(GgufError::UnknownValueType {
                    what: what.into(),
                    type_id,
                    // The type id was the last thing read.
                    offset: (self.pos as u64).saturating_sub(4),
                });
            }
        })
    }
}

/// Smallest encoding of one value of `type_id` (strings: the length; arrays: type + count).
fn min_value_bytes(type_id: u32) -> Option<u64> {
    match type_id {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        8 | 10..=12 => Some(8),
        9 => Some(12),
        _ => None,
    }
}
