//! Writing GGUF files: values, the header, and a file whose tensor data is
//! produced a piece at a time (`omnictl synth` writes many-gigabyte files
//! without holding a tensor in memory).

use std::io::Write;
use std::path::{Path, PathBuf};

use super::{GgmlType, GgufError, Result, Value};

/// The data alignment of the files written here (GGUF's default).
pub const ALIGNMENT: u64 = 32;

/// A GGUF string: its length (u64) and bytes.
pub fn put_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}

/// GGUF's id for a value's type (gguf.h `gguf_type`).
pub fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// A value's bytes, without its type id. An array's element type is its
/// first item's; an empty array is written as one of `U8`.
pub fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.extend(x.to_le_bytes()),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s.as_bytes()),
        Value::Array(items) => {
            out.extend(items.first().map_or(0, value_type).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| put_value(out, i));
        }
    }
}

/// A key and its typed value, as the metadata section holds it.
pub fn put_kv(out: &mut Vec<u8>, key: &str, v: &Value) {
    put_str(out, key.as_bytes());
    out.extend(value_type(v).to_le_bytes());
    put_value(out, v);
}

/// One entry of the tensor table: name, dims, type, data offset.
pub fn put_tensor_info(out: &mut Vec<u8>, name: &str, dims: &[u64], ty: GgmlType, offset: u64) {
    put_str(out, name.as_bytes());
    out.extend((dims.len() as u32).to_le_bytes());
    dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
    out.extend(ty.id().to_le_bytes());
    out.extend(offset.to_le_bytes());
}

/// One tensor of a file to write: its name, ggml dims (ne0 first) and type.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
}

impl TensorSpec {
    /// Bytes of its data, or `None` when a row is not whole blocks.
    pub fn size(&self) -> Option<u64> {
        let rows: u64 = self.dims.iter().skip(1).product();
        Some(self.ggml_type.row_bytes(*self.dims.first()?)? * rows)
    }
}

/// The header of a GGUF v3 file (metadata, tensor table), padded to where
/// the data starts; and the data section's length. Tensors are laid out in
/// the order given, each at a multiple of [`ALIGNMENT`].
pub fn header(kvs: &[(String, Value)], tensors: &[TensorSpec]) -> Result<(Vec<u8>, u64)> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        put_kv(&mut out, k, v);
    }
    let mut offset = 0u64;
    for t in tensors {
        let size = t.size().ok_or_else(|| GgufError::BadRowLength {
            tensor: t.name.clone(),
            ggml_type: t.ggml_type,
            ne0: t.dims.first().copied().unwrap_or(0),
            block_size: t.ggml_type.block_size(),
        })?;
        put_tensor_info(&mut out, &t.name, &t.dims, t.ggml_type, offset);
        offset = (offset + size).next_multiple_of(ALIGNMENT);
    }
    out.resize((out.len() as u64).next_multiple_of(ALIGNMENT) as usize, 0);
    Ok((out, offset))
}

/// Writes a GGUF file whose tensor data `fill` produces: it is called for
/// each tensor in order with the tensor, the byte offset into its data and a
/// buffer to fill (a few MiB at most, whole blocks of its type), so no
/// tensor is ever whole in memory. `progress` gets the bytes
/// written and the total. The file is written beside `path` and renamed into
/// place when whole.
pub fn write_streaming(
    path: &Path,
    kvs: &[(String, Value)],
    tensors: &[TensorSpec],
    fill: &mut dyn FnMut(&TensorSpec, u64, &mut [u8]),
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    const CHUNK: u64 = 4 << 20;
    let io = |source| GgufError::Io {
        path: path.to_path_buf(),
        source,
    };
    let (head, total) = header(kvs, tensors)?;
    let tmp = {
        let mut t = path.as_os_str().to_owned();
        t.push(".partial");
        PathBuf::from(t)
    };
    let file = std::fs::File::create(&tmp).map_err(io)?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
    w.write_all(&head).map_err(io)?;
    let mut buf = Vec::new();
    let mut done = 0u64;
    for t in tensors {
        // Checked by `header`.
        let size = t.size().unwrap_or(0);
        let block = t.ggml_type.type_size();
        let step = (CHUNK / block).max(1) * block;
        let mut at = 0u64;
        while at < size {
            let n = step.min(size - at);
            buf.resize(n as usize, 0);
            fill(t, at, &mut buf);
            w.write_all(&buf).map_err(io)?;
            at += n;
            done += n;
            progress(done, total);
        }
        let pad = size.next_multiple_of(ALIGNMENT) - size;
        w.write_all(&vec![0u8; pad as usize]).map_err(io)?;
        done += pad;
    }
    w.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}
