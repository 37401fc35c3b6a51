//! Reading the header, metadata and tensor table, every length bounded before it is
//! allocated and every offset checked against the file.

use super::types::GgmlType;
use super::types::TensorInfo;
use super::types::Value;
use super::GgufError;
use super::Header;
use super::Result;
use super::DEFAULT_ALIGNMENT;
use super::MAX_ARRAY_DEPTH;
use super::MAX_DIMS;
use super::MIN_KV_BYTES;
use super::MIN_TENSOR_INFO_BYTES;
use std::collections::HashMap;

pub(super) fn required<T>(key: &str, value: Result<Option<T>>) -> Result<T> {
    value?.ok_or_else(|| GgufError::MissingKey { key: key.into() })
}

pub(super) fn parse_header(buf: &[u8]) -> Result<Header> {
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
    let mut kv_spans = Vec::with_capacity(n_kv);
    for i in 0..n_kv {
        let start = r.pos;
        let key = r.utf8(&format!("metadata key #{i}"))?;
        let what = format!("metadata value '{key}'");
        let type_id = r.u32(&what)?;
        let value = r.value(type_id, &what, 0)?;
        if key_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(GgufError::DuplicateKey { key });
        }
        metadata.push((key, value));
        kv_spans.push(start..r.pos);
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
            part: 0,
        };
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
        kv_spans,
        key_index,
        tensors,
        tensor_index,
    })
}

/// Bounds every layer index by the tensor count (of the whole model, for a
/// split one), which keeps `layer_bytes` from allocating for a bogus
/// `blk.4000000000`.
pub(super) fn check_layers(tensors: &[TensorInfo]) -> Result<()> {
    let n_tensors = tensors.len();
    match tensors
        .iter()
        .find_map(|t| Some((t, t.layer().filter(|&l| l as usize >= n_tensors)?)))
    {
        Some((t, layer)) => Err(GgufError::LayerOutOfRange {
            tensor: t.name.clone(),
            layer,
            n_tensors,
        }),
        None => Ok(()),
    }
}

/// Bytes of a tensor: whole rows of blocks, with every product checked.
pub(super) fn tensor_size(name: &str, dims: &[u64], ggml_type: GgmlType) -> Result<u64> {
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
pub(super) fn magic_hint(buf: &[u8]) -> &'static str {
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
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn remaining(&self) -> u64 {
        self.buf.len().saturating_sub(self.pos) as u64
    }

    pub(super) fn truncated(&self, needed: u64, what: &str) -> GgufError {
        GgufError::Truncated {
            what: what.into(),
            offset: self.pos as u64,
            needed,
            file_size: self.buf.len() as u64,
        }
    }

    pub(super) fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let bytes = usize::try_from(n)
            .ok()
            .and_then(|n| self.buf.get(self.pos..)?.get(..n))
            .ok_or_else(|| self.truncated(n, what))?;
        self.pos += bytes.len();
        Ok(bytes)
    }

    pub(super) fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let bytes = self
            .buf
            .get(self.pos..)
            .and_then(<[u8]>::first_chunk::<N>)
            .ok_or_else(|| self.truncated(N as u64, what))?;
        self.pos += N;
        Ok(*bytes)
    }

    pub(super) fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Checks that `count` items of at least `min_bytes` each fit in the rest of the file before
    /// anything is allocated for them, so allocations stay proportional to the file size.
    pub(super) fn count(&self, count: u64, min_bytes: u64, what: &str) -> Result<usize> {
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
    pub(super) fn string(&mut self, what: &str) -> Result<&'a [u8]> {
        let len = self.u64(what)?;
        self.take(len, what)
    }

    /// A string that must be valid UTF-8 (keys and tensor names are looked up by exact text).
    pub(super) fn utf8(&mut self, what: &str) -> Result<String> {
        let offset = self.pos as u64;
        let bytes = self.string(what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| GgufError::InvalidUtf8 {
                what: what.into(),
                offset,
            })
    }

    pub(super) fn value(&mut self, type_id: u32, what: &str, depth: u32) -> Result<Value> {
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
pub(super) fn min_value_bytes(type_id: u32) -> Option<u64> {
    match type_id {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        8 | 10..=12 => Some(8),
        9 => Some(12),
        _ => None,
    }
}
