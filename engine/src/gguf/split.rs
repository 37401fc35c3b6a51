//! Split models: llama.cpp's `gguf-split` layout, in which a model too big
//! for one file is `PREFIX-00001-of-0000N.gguf` … `PREFIX-0000N-of-0000N.gguf`.
//! Every part is a GGUF file with `split.no` (0-based), `split.count` and
//! `split.tensors.count` (the model's tensors, all parts together); the
//! first part also holds the model's metadata, the others only those three
//! keys. Each part holds some of the tensors, in the model's order.
//!
//! [`open`] reads every part of one as one [`Gguf`], checking each before
//! anything is mapped for good. [`write`] makes the parts (or, with one
//! part, the whole file again): `omnictl split` and `omnictl merge`.

use super::parse;
use super::write::{put_kv, put_tensor_info};
use super::{
    Gguf, GgufError, Header, OnceLock, Part, Result, TensorInfo, Value, DEFAULT_ALIGNMENT,
};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

pub const KEY_NO: &str = "split.no";
pub const KEY_COUNT: &str = "split.count";
pub const KEY_TENSORS: &str = "split.tensors.count";

/// The name of part `i` (0-based) of `n` of the split model `prefix`, as
/// llama.cpp names them.
pub fn part_path(prefix: &Path, i: usize, n: usize) -> PathBuf {
    let mut name = prefix.as_os_str().to_owned();
    name.push(format!("-{:05}-of-{:05}.gguf", i + 1, n));
    PathBuf::from(name)
}

/// `PREFIX` of a part named `PREFIX-0000K-of-0000N.gguf`, with K and N.
pub fn prefix_of(path: &Path) -> Option<(PathBuf, usize, usize)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, n) = stem.rsplit_once("-of-")?;
    let (prefix, k) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(k) || !digits(n) || prefix.is_empty() {
        return None;
    }
    Some((
        path.with_file_name(prefix),
        k.parse().ok()?,
        n.parse().ok()?,
    ))
}

/// The first part of the split model `path` names a part of (by its
/// name), else `path`: llama.cpp's loader wants the first part.
pub fn first_part(path: &Path) -> PathBuf {
    match prefix_of(path) {
        Some((prefix, _, n)) if n > 1 => part_path(&prefix, 0, n),
        _ => path.to_path_buf(),
    }
}

/// `split.count` of a file's header: 1 when it is no part of a split model.
pub(super) fn count_of(header: &Header) -> Result<u64> {
    header.opt_u64(KEY_COUNT).map(|c| c.unwrap_or(1))
}

/// Why a part does not belong with the others, naming it.
fn bad_part(path: &Path, why: impl Into<String>) -> GgufError {
    GgufError::SplitPart {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

/// Opens every part of the split model `given` is a part of (`opened`: its
/// file, size and header, already read): each must be there, whole, and of
/// this model (the same `split.count` and `split.tensors.count`, its own
/// `split.no`, no tensor twice, the tensors adding up).
pub(super) fn open(given: &Path, opened: (std::fs::File, u64, Header)) -> Result<Gguf> {
    let header = &opened.2;
    let n = count_of(header)?;
    let tensors_count = header.opt_u64(KEY_TENSORS)?;
    let no = header.opt_u64(KEY_NO)?;
    let (Some(no), Some(tensors_count)) = (no, tensors_count) else {
        return Err(bad_part(
            given,
            format!("it says split.count = {n} but lacks {KEY_NO} or {KEY_TENSORS}"),
        ));
    };
    if n > 9999 || no >= n {
        return Err(bad_part(
            given,
            format!("split.no {no} of split.count {n} is not a part of a split model"),
        ));
    }
    let n = n as usize;
    let Some((prefix, k, named_n)) = prefix_of(given) else {
        return Err(bad_part(
            given,
            format!(
                "it is part {} of {n} of a split model, but its name does not end in -{:05}-of-{n:05}.gguf, so the other parts cannot be found",
                no + 1,
                no + 1
            ),
        ));
    };
    if (k, named_n) != (no as usize + 1, n) {
        return Err(bad_part(
            given,
            format!(
                "its name says part {k} of {named_n}, its metadata part {} of {n}",
                no + 1
            ),
        ));
    }
    let mut given_part = Some(opened);
    let mut parts = Vec::with_capacity(n);
    let mut first: Option<Header> = None;
    let mut tensors: Vec<TensorInfo> = Vec::new();
    for i in 0..n {
        let path = part_path(&prefix, i, n);
        if !path.exists() {
            return Err(bad_part(
                &path,
                format!("part {} of {n} of {} is missing", i + 1, given.display()),
            ));
        }
        // The part `given` is was read already; the others are read here
        // (mapped to parse, unmapped again: mapped for good when their
        // tensors are read).
        let (file, size, h) = match given_part.take_if(|_| i as u64 == no) {
            Some(read) => read,
            None => {
                let (file, backing, h) = Gguf::parse_file(&path)
                    .map_err(|e| bad_part(&path, format!("part {} of {n}: {e}", i + 1)))?;
                (file, backing.bytes().len() as u64, h)
            }
        };
        let (count, this_no, this_tensors) =
            (count_of(&h)?, h.opt_u64(KEY_NO)?, h.opt_u64(KEY_TENSORS)?);
        if count != n as u64 || this_no != Some(i as u64) || this_tensors != Some(tensors_count) {
            return Err(bad_part(
                &path,
                format!(
                    "it is not part {} of {n} of this model: it says split.no {}, split.count {count}, split.tensors.count {} (this model: {tensors_count} tensors); a part of another split model?",
                    i + 1,
                    this_no.map_or("none".into(), |v| v.to_string()),
                    this_tensors.map_or("none".into(), |v| v.to_string()),
                ),
            ));
        }
        if i > 0 {
            const ARCH: &str = "general.architecture";
            if let Some(arch) = h.get(ARCH) {
                if first
                    .as_ref()
                    .and_then(|f| f.get(ARCH))
                    .is_some_and(|o| o != arch)
                {
                    return Err(bad_part(
                        &path,
                        format!("it is a {arch:?} model's part, not this model's"),
                    ));
                }
            }
        }
        tensors.extend(h.tensors.iter().cloned().map(|mut t| {
            t.part = i;
            t
        }));
        parts.push(Part {
            path: Some(path),
            file: Some(file),
            size,
            bytes: OnceLock::new(),
        });
        if i == 0 {
            first = Some(h);
        }
    }
    if tensors.len() as u64 != tensors_count {
        return Err(bad_part(
            given,
            format!(
                "the {n} parts hold {} tensors, but split.tensors.count says {tensors_count}",
                tensors.len()
            ),
        ));
    }
    let mut tensor_index = HashMap::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if tensor_index.insert(t.name.clone(), i).is_some() {
            return Err(bad_part(
                parts[t.part].path.as_deref().unwrap_or(given),
                format!("tensor '{}' is in two parts", t.name),
            ));
        }
    }
    parse::check_layers(&tensors)?;
    let Some(first) = first else {
        return Err(bad_part(given, "a split model of no parts"));
    };
    Ok(Gguf {
        parts,
        header: Header {
            tensors,
            tensor_index,
            ..first
        },
    })
}

/// How to cut a model into parts, in its tensor order.
#[derive(Clone, Copy, Debug)]
pub enum SplitBy {
    /// About this many parts of about equal bytes.
    Parts(usize),
    /// At most this many tensors per part (gguf-split's default is 128).
    MaxTensors(usize),
    /// At most this many bytes of tensor data per part (a tensor larger
    /// than this is a part alone).
    MaxBytes(u64),
}

/// Which tensors (indices into `g.tensors()`) go in which part.
pub fn plan(g: &Gguf, by: SplitBy) -> std::result::Result<Vec<Vec<usize>>, String> {
    let tensors = g.tensors();
    let n = tensors.len();
    if n == 0 {
        return Err("the model has no tensors to split".into());
    }
    let mut parts: Vec<Vec<usize>> = vec![Vec::new()];
    match by {
        SplitBy::Parts(k) => {
            if k == 0 || k > n {
                return Err(format!(
                    "cannot make {k} parts of {n} tensors: give 1 to {n} parts"
                ));
            }
            // Each part aims at an equal share of the bytes not yet in a
            // part, so one large tensor (a token embedding) does not leave
            // the parts after it unbalanced; a part ends where the next
            // tensor would take it further past its aim than short of it.
            let mut left_bytes: u64 = tensors.iter().map(|t| t.size).sum();
            let mut current = 0u64;
            for (i, t) in tensors.iter().enumerate() {
                let parts_left = (k - parts.len() + 1) as u64;
                let aim = left_bytes / parts_left;
                let tensors_left = n - i;
                let to_come = k - parts.len();
                let last = parts.len() - 1;
                if !parts[last].is_empty()
                    && parts.len() < k
                    && (current + t.size / 2 > aim || tensors_left <= to_come)
                {
                    left_bytes -= current;
                    current = 0;
                    parts.push(Vec::new());
                }
                if let Some(p) = parts.last_mut() {
                    p.push(i);
                }
                current += t.size;
            }
        }
        SplitBy::MaxTensors(m) => {
            if m == 0 {
                return Err("--max-tensors must be at least 1".into());
            }
            parts = (0..n)
                .collect::<Vec<_>>()
                .chunks(m)
                .map(<[_]>::to_vec)
                .collect();
        }
        SplitBy::MaxBytes(b) => {
            let mut bytes = 0u64;
            for (i, t) in tensors.iter().enumerate() {
                let last = parts.len() - 1;
                if !parts[last].is_empty() && bytes + t.size > b {
                    parts.push(Vec::new());
                    bytes = 0;
                }
                if let Some(p) = parts.last_mut() {
                    p.push(i);
                }
                bytes += t.size;
            }
        }
    }
    if parts.len() > 9999 {
        return Err(format!(
            "{} parts: llama.cpp's names allow 9999 at most",
            parts.len()
        ));
    }
    Ok(parts)
}

/// Writes `g` as the files `outs` (one per entry of `parts`, each the
/// tensor indices it holds, in order): with several, a split model in
/// llama.cpp's layout; with one, a single file (the split keys left out,
/// so merging the parts of a file gives back its bytes). `progress` gets
/// the tensor bytes written so far and the total. Each file is written
/// beside its name and renamed into place when whole.
pub fn write(
    g: &Gguf,
    parts: &[Vec<usize>],
    outs: &[PathBuf],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let total: u64 = g.tensors().iter().map(|t| t.size).sum();
    let mut done = 0u64;
    let n = parts.len();
    for (i, (part, out)) in parts.iter().zip(outs).enumerate() {
        let io = |source| GgufError::Io {
            path: out.clone(),
            source,
        };
        let tmp = {
            let mut t = out.as_os_str().to_owned();
            t.push(".partial");
            PathBuf::from(t)
        };
        let file = std::fs::File::create(&tmp).map_err(io)?;
        let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
        // The model's metadata goes in the first file only, as gguf-split
        // writes it; the first file keeps the model's alignment.
        let (kvs, alignment): (Vec<&[u8]>, u64) = if i == 0 {
            (g.raw_metadata_without_split(), g.alignment())
        } else {
            (Vec::new(), u64::from(DEFAULT_ALIGNMENT))
        };
        let mut split_kvs = Vec::new();
        if n > 1 {
            put_kv(&mut split_kvs, KEY_NO, &Value::U16(i as u16));
            put_kv(&mut split_kvs, KEY_COUNT, &Value::U16(n as u16));
            put_kv(
                &mut split_kvs,
                KEY_TENSORS,
                &Value::I32(g.tensors().len() as i32),
            );
        }
        let mut head = Vec::new();
        head.extend_from_slice(b"GGUF");
        head.extend_from_slice(&g.version().to_le_bytes());
        head.extend_from_slice(&(part.len() as u64).to_le_bytes());
        head.extend_from_slice(&((kvs.len() + if n > 1 { 3 } else { 0 }) as u64).to_le_bytes());
        for kv in &kvs {
            head.extend_from_slice(kv);
        }
        head.extend_from_slice(&split_kvs);
        let mut offset = 0u64;
        for &t in part {
            let t = &g.tensors()[t];
            put_tensor_info(&mut head, &t.name, &t.dims, t.ggml_type, offset);
            offset = (offset + t.size).next_multiple_of(alignment);
        }
        head.resize((head.len() as u64).next_multiple_of(alignment) as usize, 0);
        w.write_all(&head).map_err(io)?;
        for &t in part {
            let t = &g.tensors()[t];
            let data = g.tensor_data(t)?;
            w.write_all(data).map_err(io)?;
            let pad = (t.size.next_multiple_of(alignment) - t.size) as usize;
            w.write_all(&vec![0u8; pad]).map_err(io)?;
            done += t.size;
            progress(done, total);
        }
        w.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)?;
        std::fs::rename(&tmp, out).map_err(io)?;
    }
    Ok(())
}

impl Gguf {
    /// The metadata entries as the (first) file encodes them, the split
    /// keys left out.
    fn raw_metadata_without_split(&self) -> Vec<&[u8]> {
        let Ok(bytes) = self.part_bytes(0) else {
            return Vec::new();
        };
        self.header
            .metadata
            .iter()
            .zip(&self.header.kv_spans)
            .filter(|((k, _), _)| ![KEY_NO, KEY_COUNT, KEY_TENSORS].contains(&k.as_str()))
            .filter_map(|(_, span)| bytes.get(span.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_names_are_llama_cpps() {
        let p = part_path(Path::new("/m/r1"), 0, 9);
        assert_eq!(p, Path::new("/m/r1-00001-of-00009.gguf"));
        assert_eq!(prefix_of(&p), Some((PathBuf::from("/m/r1"), 1, 9)));
        assert_eq!(prefix_of(Path::new("/m/r1.gguf")), None);
        assert_eq!(
            first_part(Path::new("/m/r1-00004-of-00009.gguf")),
            Path::new("/m/r1-00001-of-00009.gguf")
        );
        assert_eq!(first_part(Path::new("/m/r1.gguf")), Path::new("/m/r1.gguf"));
        assert_eq!(prefix_of(Path::new("/m/r1-1-of-9.gguf")), None);
        assert_eq!(prefix_of(Path::new("/m/-00001-of-00009.gguf")), None);
    }
}
