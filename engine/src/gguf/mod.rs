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

mod parse;
pub mod split;
mod types;
pub mod write;

use memmap2::Mmap;
use parse::{parse_header, required};
use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
pub use types::{GgmlType, TensorInfo, Value};

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
    #[error("split model part {}: {why}", path.display())]
    SplitPart { path: PathBuf, why: String },
    #[error("model architecture '{arch}' is not supported; supported: {supported}")]
    UnsupportedArchitecture { arch: String, supported: String },
}

type Result<T, E = GgufError> = std::result::Result<T, E>;

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

/// Maps `file` (read-only) for reading.
fn map(file: &File, path: &Path) -> Result<Backing> {
    // SAFETY: the file is opened read-only and the mapping is only ever read. Mmap is unsafe
    // because another process could modify or truncate the file while it is mapped; model
    // files are treated as immutable, and changing one while it is loaded is the user's
    // responsibility (as with llama.cpp, which maps model files the same way).
    unsafe { Mmap::map(file) }
        .map(Backing::Mmap)
        .map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })
}

/// One file of a model: the only one, or a part of a split model. A part
/// is mapped when its tensors' bytes are first asked for, so a process
/// maps only the parts that hold the tensors it uses.
struct Part {
    /// `None` for a file held in memory ([`Gguf::from_bytes`]).
    path: Option<PathBuf>,
    file: Option<File>,
    size: u64,
    bytes: OnceLock<Backing>,
}

impl Part {
    fn bytes(&self) -> Result<&[u8]> {
        if let Some(b) = self.bytes.get() {
            return Ok(b.bytes());
        }
        let (Some(file), Some(path)) = (&self.file, &self.path) else {
            return Ok(&[]);
        };
        let mapped = map(file, path)?;
        Ok(self.bytes.get_or_init(|| mapped).bytes())
    }
}

/// A parsed, validated GGUF model: one file, or every part of a split one
/// (see [`split`]), read as one.
pub struct Gguf {
    parts: Vec<Part>,
    header: Header,
}

/// Everything parsed from the header, kept apart from the bytes because parsing borrows them.
/// For a split model: the first part's metadata and every part's tensors.
struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    /// Where each metadata entry lies in the (first) file, as it is encoded.
    kv_spans: Vec<std::ops::Range<usize>>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl Header {
    fn get(&self, key: &str) -> Option<&Value> {
        let &i = self.key_index.get(key)?;
        self.metadata.get(i).map(|(_, v)| v)
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

    fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.lookup(key, "a u64", Value::as_u64)
    }
}

impl fmt::Debug for Gguf {
    // The backing bytes are deliberately left out: they can be gigabytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.header.version)
            .field("parts", &self.parts.len())
            .field("file_size", &self.file_size())
            .field("data_offset", &self.header.data_offset)
            .field("metadata_keys", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl Gguf {
    /// Parses the model at `path`: the file, or, when it is a part of a
    /// split model (`split.count` > 1), every part, found by the
    /// `PREFIX-00001-of-0000N.gguf` names beside it. Every part is checked
    /// before this returns; none stays mapped until its bytes are asked for.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let (file, backing, header) = Self::parse_file(path)?;
        if split::count_of(&header)? > 1 {
            let size = backing.bytes().len() as u64;
            return split::open(path, (file, size, header));
        }
        parse::check_layers(&header.tensors)?;
        let part = Part {
            path: Some(path.to_path_buf()),
            file: Some(file),
            size: backing.bytes().len() as u64,
            bytes: OnceLock::from(backing),
        };
        Ok(Gguf {
            parts: vec![part],
            header,
        })
    }

    /// Opens, maps and parses one file, as it is.
    fn parse_file(path: &Path) -> Result<(File, Backing, Header)> {
        let file = File::open(path).map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let backing = map(&file, path)?;
        let header = parse_header(backing.bytes())?;
        Ok((file, backing, header))
    }

    /// Parses a GGUF image held in memory (same validation as [`Gguf::open`];
    /// a part of a split model is read alone).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        let header = parse_header(&bytes)?;
        parse::check_layers(&header.tensors)?;
        let part = Part {
            path: None,
            file: None,
            size: bytes.len() as u64,
            bytes: OnceLock::from(Backing::Owned(bytes)),
        };
        Ok(Gguf {
            parts: vec![part],
            header,
        })
    }

    /// The files of the model, in order (one unless it is split); `None`
    /// for one held in memory.
    pub fn paths(&self) -> Vec<Option<&Path>> {
        self.parts.iter().map(|p| p.path.as_deref()).collect()
    }

    /// Whether part `i`'s bytes are mapped (it held a tensor asked for).
    pub fn is_mapped(&self, part: usize) -> bool {
        self.parts
            .get(part)
            .is_some_and(|p| p.bytes.get().is_some())
    }

    /// The whole of file `part` (mapping it if it is not yet).
    pub fn part_bytes(&self, part: usize) -> Result<&[u8]> {
        match self.parts.get(part) {
            Some(p) => p.bytes(),
            None => Ok(&[]),
        }
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// Alignment of the data section and of every tensor offset.
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Absolute file offset where the data section starts (in the first
    /// file of a split model).
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    /// Bytes of the model's files, all parts together.
    pub fn file_size(&self) -> u64 {
        self.parts.iter().map(|p| p.size).sum()
    }

    /// The number of files: 1, or a split model's part count.
    pub fn n_parts(&self) -> usize {
        self.parts.len()
    }

    /// All metadata entries, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.header.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.header.get(key)
    }

    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.header
            .lookup(key, "a u32", |v| v.as_u64()?.try_into().ok())
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.header.opt_u64(key)
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.header.lookup(key, "an f32", Value::as_f32)
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.header.lookup(key, "a bool", Value::as_bool)
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.header.lookup(key, "a string", Value::as_str)
    }

    pub fn opt_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.header.lookup(key, "an array of strings", |v| {
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

    /// The tensor's bytes, borrowed from the mapping of its file (mapped
    /// now if it is not yet). Infos from this model always lie inside it;
    /// an info that does not (e.g. one from another file) yields an empty
    /// slice.
    pub fn tensor_data(&self, tensor: &TensorInfo) -> Result<&[u8]> {
        let bytes = self.part_bytes(tensor.part)?;
        let range = usize::try_from(tensor.offset)
            .ok()
            .zip(usize::try_from(tensor.size).ok())
            .and_then(|(start, len)| Some(start..start.checked_add(len)?));
        Ok(range.and_then(|r| bytes.get(r)).unwrap_or_default())
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
