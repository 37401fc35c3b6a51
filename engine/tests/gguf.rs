mod common;

use common::{put_str, put_value, value_type};
use omni_engine::gguf::*;

use std::collections::BTreeMap;

// ---------------------------------------------------------------------------------------------
// A minimal GGUF writer, so tests control every byte of the files they parse.
// ---------------------------------------------------------------------------------------------

struct RawTensor {
    name: Vec<u8>,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
    offset: Option<u64>,
}

struct Builder {
    version: u32,
    alignment: u64,
    n_kv: u64,
    kvs: Vec<u8>,
    tensors: Vec<RawTensor>,
}

impl Builder {
    fn new(version: u32) -> Self {
        Builder {
            version,
            alignment: 32,
            n_kv: 0,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    fn kv(self, key: &str, v: Value) -> Self {
        let mut payload = Vec::new();
        put_value(&mut payload, &v);
        let mut b = self.kv_raw(key.as_bytes(), value_type(&v), &payload);
        // Lay data out the way the file declares (invalid values are left for error tests).
        b.alignment = match (&v, key) {
            (Value::U32(a), "general.alignment") if a.is_power_of_two() => u64::from(*a),
            _ => b.alignment,
        };
        b
    }

    /// A key/value with hand-made type id and payload, for malformed entries.
    fn kv_raw(mut self, key: &[u8], type_id: u32, payload: &[u8]) -> Self {
        put_str(&mut self.kvs, key);
        self.kvs.extend(type_id.to_le_bytes());
        self.kvs.extend(payload);
        self.n_kv += 1;
        self
    }

    fn tensor(self, name: impl AsRef<[u8]>, dims: &[u64], type_id: u32, data: Vec<u8>) -> Self {
        self.tensor_at(name, dims, type_id, data, None)
    }

    /// A tensor whose relative data offset is forced instead of laid out automatically.
    fn tensor_at(
        mut self,
        name: impl AsRef<[u8]>,
        dims: &[u64],
        type_id: u32,
        data: Vec<u8>,
        offset: Option<u64>,
    ) -> Self {
        self.tensors.push(RawTensor {
            name: name.as_ref().to_vec(),
            dims: dims.to_vec(),
            type_id,
            data,
            offset,
        });
        self
    }

    fn build(&self) -> Vec<u8> {
        let align = |n: u64| n.div_ceil(self.alignment) * self.alignment;
        let mut offsets = Vec::new();
        let mut next = 0;
        for t in &self.tensors {
            let off = t.offset.unwrap_or(next);
            offsets.push(off);
            next = align(off + t.data.len() as u64);
        }

        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kvs);
        for (t, off) in self.tensors.iter().zip(&offsets) {
            put_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(t.type_id.to_le_bytes());
            out.extend(off.to_le_bytes());
        }
        let data_start = align(out.len() as u64) as usize;
        for (t, off) in self.tensors.iter().zip(&offsets) {
            out.resize(data_start + *off as usize, 0);
            out.extend(&t.data);
        }
        out
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn string(s: &str) -> Value {
    Value::String(s.into())
}

/// One value of every type, including nested and empty arrays.
fn all_values() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", string("llama")),
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60_000)),
        ("t.i16", Value::I16(-30_000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.u64", Value::U64(u64::MAX)),
        ("t.i64", Value::I64(i64::MIN)),
        ("t.f32", Value::F32(1.5)),
        ("t.f64", Value::F64(-2.25)),
        ("t.true", Value::Bool(true)),
        ("t.false", Value::Bool(false)),
        ("t.string", string("héllo ✓")),
        ("t.empty_string", string("")),
        (
            "t.u32_array",
            Value::Array(vec![Value::U32(1), Value::U32(2), Value::U32(3)]),
        ),
        (
            "t.str_array",
            Value::Array(vec![string("a"), string(""), string("<|im_end|>")]),
        ),
        (
            "t.nested",
            Value::Array(vec![
                Value::Array(vec![Value::U8(1), Value::U8(2)]),
                Value::Array(vec![Value::U8(3)]),
            ]),
        ),
        ("t.empty_array", Value::Array(vec![])),
        (
            "t.f64_array",
            Value::Array(vec![Value::F64(0.5), Value::F64(-1e300)]),
        ),
    ]
}

/// Four tensors of different types and sizes, so offsets need padding between them.
fn sample_tensors(b: Builder) -> Builder {
    b.tensor("token_embd.weight", &[4, 3], 0, pattern(48, 1)) // F32: 12 * 4
        .tensor("blk.0.attn_q.weight", &[64, 2], 8, pattern(136, 2)) // Q8_0: 4 blocks * 34
        .tensor("blk.1.ffn_up.weight", &[256, 1, 1], 12, pattern(144, 3)) // Q4_K: 1 block
        .tensor("output_norm.weight", &[5], 1, pattern(10, 4)) // F16: 5 * 2
}

fn sample_file(version: u32) -> Vec<u8> {
    let b = all_values()
        .into_iter()
        .fold(Builder::new(version), |b, (k, v)| b.kv(k, v));
    sample_tensors(b).build()
}

fn parse(bytes: Vec<u8>) -> Gguf {
    Gguf::from_bytes(bytes).expect("valid file must parse")
}

fn parse_err(bytes: Vec<u8>) -> GgufError {
    Gguf::from_bytes(bytes).expect_err("malformed file must be rejected")
}

/// Asserts the error message mentions every fact in `facts`.
fn assert_mentions(err: &GgufError, facts: &[&str]) {
    let msg = err.to_string();
    for fact in facts {
        assert!(
            msg.contains(fact),
            "message {msg:?} should mention {fact:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Well-formed files
// ---------------------------------------------------------------------------------------------

fn check_sample(g: &Gguf, version: u32) {
    assert_eq!(g.version(), version);
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.file_size(), g.bytes().len() as u64);

    let expected = all_values();
    let keys: Vec<&str> = g.metadata().iter().map(|(k, _)| k.as_str()).collect();
    let expected_keys: Vec<&str> = expected.iter().map(|(k, _)| *k).collect();
    assert_eq!(keys, expected_keys, "metadata keeps file order");
    for (key, value) in &expected {
        assert_eq!(g.get(key), Some(value), "value of {key}");
    }
    assert_eq!(g.get("absent"), None);

    // Data starts right after the tensor infos, rounded up to the alignment.
    assert!(g.data_offset().is_multiple_of(32));
    let expected_tensors = [
        ("token_embd.weight", vec![4, 3], GgmlType::F32, 0, 48, 1),
        (
            "blk.0.attn_q.weight",
            vec![64, 2],
            GgmlType::Q8_0,
            64,
            136,
            2,
        ),
        (
            "blk.1.ffn_up.weight",
            vec![256, 1, 1],
            GgmlType::Q4_K,
            224,
            144,
            3,
        ),
        ("output_norm.weight", vec![5], GgmlType::F16, 384, 10, 4),
    ];
    assert_eq!(g.tensors().len(), expected_tensors.len());
    for (t, (name, dims, ty, rel, size, seed)) in g.tensors().iter().zip(expected_tensors) {
        assert_eq!(t.name, name);
        assert_eq!(t.dims, dims, "{name}");
        assert_eq!(t.ggml_type, ty, "{name}");
        assert_eq!(t.offset, g.data_offset() + rel, "{name}");
        assert_eq!(t.size, size, "{name}");
        assert_eq!(g.tensor_data(t), pattern(size as usize, seed), "{name}");
        assert_eq!(g.tensor(name), Some(t));
    }
    assert_eq!(g.tensor("missing"), None);
    assert_eq!(
        g.file_size(),
        g.data_offset() + 394,
        "no bytes after the last tensor"
    );
    assert_eq!(g.tensors()[0].n_elements(), 12);
    assert_eq!(g.layer_bytes(), vec![136, 144]);
    assert_eq!(g.non_layer_bytes(), 48 + 10);
}

#[test]
fn parses_v3_file_with_every_value_type() {
    check_sample(&parse(sample_file(3)), 3);
}

#[test]
fn parses_v2_file() {
    check_sample(&parse(sample_file(2)), 2);
}

#[test]
fn open_maps_the_same_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sample.gguf");
    std::fs::write(&path, sample_file(3)).unwrap();
    check_sample(&Gguf::open(&path).unwrap(), 3);

    // An empty file maps fine and is then rejected as truncated.
    std::fs::write(&path, b"").unwrap();
    let err = Gguf::open(&path).unwrap_err();
    assert!(
        matches!(err, GgufError::Truncated { offset: 0, .. }),
        "{err}"
    );
}

#[test]
fn open_missing_file_names_the_path() {
    let err = Gguf::open("/nonexistent/dir/model.gguf").unwrap_err();
    assert!(matches!(err, GgufError::Io { .. }), "{err}");
    assert_mentions(&err, &["/nonexistent/dir/model.gguf"]);
}

#[test]
fn custom_alignment_64() {
    let b = Builder::new(3)
        .kv("general.architecture", string("qwen2"))
        .kv("general.alignment", Value::U32(64));
    let g = parse(sample_tensors(b).build());
    assert_eq!(g.alignment(), 64);
    assert!(g.data_offset().is_multiple_of(64));
    let rel: Vec<u64> = g
        .tensors()
        .iter()
        .map(|t| t.offset - g.data_offset())
        .collect();
    assert_eq!(rel, [0, 64, 256, 448]);
    for (t, seed) in g.tensors().iter().zip(1..) {
        assert_eq!(
            g.tensor_data(t),
            pattern(t.size as usize, seed),
            "{}",
            t.name
        );
    }
}

#[test]
fn file_without_tensors() {
    let g = parse(
        Builder::new(3)
            .kv("general.architecture", string("llama"))
            .build(),
    );
    assert!(g.tensors().is_empty());
    assert!(g.layer_bytes().is_empty());
    assert_eq!(g.non_layer_bytes(), 0);
}

#[test]
fn typed_getters() {
    let g = parse(sample_file(3));
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.get_u32("t.u32").unwrap(), 4_000_000_000);
    assert_eq!(
        g.get_u32("t.u8").unwrap(),
        200,
        "small unsigned types widen"
    );
    assert_eq!(g.get_u64("t.u64").unwrap(), u64::MAX);
    assert_eq!(g.get_f32("t.f32").unwrap(), 1.5);
    assert_eq!(g.get_f32("t.f64").unwrap(), -2.25, "f64 narrows to f32");
    assert_eq!(
        g.get_f32("t.u16").unwrap(),
        60_000.0,
        "exact integers convert"
    );
    assert!(g.get_bool("t.true").unwrap());
    assert!(!g.get_bool("t.false").unwrap());
    assert_eq!(g.get_str("t.string").unwrap(), "héllo ✓");
    assert_eq!(
        g.get_str_array("t.str_array").unwrap(),
        ["a", "", "<|im_end|>"]
    );
    assert_eq!(
        g.get_str_array("t.empty_array").unwrap(),
        Vec::<&str>::new()
    );

    assert_eq!(g.opt_u32("t.u32").unwrap(), Some(4_000_000_000));
    assert_eq!(g.opt_u32("absent").unwrap(), None);
    assert_eq!(g.opt_f32("absent").unwrap(), None);
    assert_eq!(g.opt_str("absent").unwrap(), None);
    assert_eq!(g.opt_bool("absent").unwrap(), None);
    assert_eq!(g.opt_u64("absent").unwrap(), None);
    assert_eq!(g.opt_str_array("absent").unwrap(), None);

    let v = g.get("t.i64").unwrap();
    assert_eq!(
        (v.as_i64(), v.as_u64(), v.type_name()),
        (Some(i64::MIN), None, "i64")
    );
    let v = g.get("t.u64").unwrap();
    assert_eq!(
        (v.as_u64(), v.as_i64(), v.as_f32()),
        (Some(u64::MAX), None, None)
    );
    assert_eq!(g.get("t.nested").unwrap().as_array().unwrap().len(), 2);
    assert_eq!(g.get("t.string").unwrap().as_u64(), None);
}

#[test]
fn missing_key_and_wrong_type() {
    let g = parse(sample_file(3));
    let err = g.get_u32("llama.block_count").unwrap_err();
    assert!(matches!(&err, GgufError::MissingKey { key } if key == "llama.block_count"));
    assert_mentions(&err, &["llama.block_count"]);

    let err = g.get_u32("general.architecture").unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::WrongType {
                expected: "a u32",
                ..
            }
        ),
        "{err}"
    );
    assert_mentions(&err, &["general.architecture", "u32", "string"]);

    // Integers convert only when the value fits.
    let err = g.get_u32("t.u64").unwrap_err();
    assert!(matches!(err, GgufError::WrongType { .. }), "{err}");
    assert_mentions(&err, &["t.u64", "18446744073709551615"]);
    assert_mentions(&g.get_u64("t.i8").unwrap_err(), &["t.i8", "i8 -100"]);
    assert_mentions(
        &g.get_str_array("t.u32_array").unwrap_err(),
        &["array of 3 u32"],
    );
    // An optional key that is present with the wrong type is still an error.
    assert!(g.opt_str("t.u32").is_err());
    assert!(g.opt_bool("t.u8").is_err());
    assert!(g.opt_f32("t.string").is_err());
}

#[test]
fn architecture_gate() {
    let file = |arch: &str| {
        parse(
            Builder::new(3)
                .kv("general.architecture", string(arch))
                .build(),
        )
    };
    assert_eq!(
        file("qwen2")
            .check_architecture(SUPPORTED_ARCHITECTURES)
            .unwrap(),
        "qwen2"
    );
    let err = file("deepseek3_2")
        .check_architecture(SUPPORTED_ARCHITECTURES)
        .unwrap_err();
    assert!(matches!(err, GgufError::UnsupportedArchitecture { .. }));
    assert_eq!(
        err.to_string(),
        "model architecture 'deepseek3_2' is not supported; supported: llama, qwen2, gemma3, qwen3, qwen3moe, deepseek2"
    );
    let no_arch = parse(Builder::new(3).build());
    assert!(matches!(
        no_arch.architecture(),
        Err(GgufError::MissingKey { .. })
    ));
}

#[test]
fn ggml_type_table() {
    assert_eq!(GgmlType::ALL.len(), 32);
    for &t in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(t.id()), Some(t));
        assert_eq!(t.row_bytes(t.block_size()), Some(t.type_size()), "{t}");
    }
    for removed in [4, 5, 31, 32, 33, 36, 37, 38, 40, u32::MAX] {
        assert_eq!(GgmlType::from_id(removed), None, "id {removed}");
    }
    assert_eq!(GgmlType::Q4_K.name(), "q4_K");
    assert_eq!(GgmlType::BF16.to_string(), "bf16");
    assert_eq!(GgmlType::IQ2_XXS.name(), "iq2_xxs");
    assert_eq!(GgmlType::MXFP4.id(), 39);
    assert_eq!(GgmlType::Q4_K.row_bytes(512), Some(288));
    assert_eq!(GgmlType::Q4_K.row_bytes(100), None);
    assert_eq!(GgmlType::Q6_K.row_bytes(896 * 256), Some(896 * 210));
    assert_eq!(GgmlType::F16.row_bytes(7), Some(14));
}

#[test]
fn layer_parsing() {
    let info = |name: &str| TensorInfo {
        name: name.into(),
        dims: vec![1],
        ggml_type: GgmlType::F32,
        offset: 0,
        size: 4,
    };
    assert_eq!(info("blk.12.attn_q.weight").layer(), Some(12));
    assert_eq!(info("blk.0.ffn_down_exps.weight").layer(), Some(0));
    for name in [
        "output.weight",
        "blk.x.y",
        "blk.+1.y",
        "blk.3",
        "blk..y",
        "xblk.1.y",
    ] {
        assert_eq!(info(name).layer(), None, "{name}");
    }
}

// ---------------------------------------------------------------------------------------------
// Malformed files: each gets its own error, naming the culprit
// ---------------------------------------------------------------------------------------------

#[test]
fn bad_magic() {
    let mut bytes = sample_file(3);
    bytes[..4].copy_from_slice(b"ABCD");
    let err = parse_err(bytes);
    assert!(matches!(err, GgufError::BadMagic { found, .. } if &found == b"ABCD"));
    assert_mentions(&err, &["ABCD", "GGUF"]);

    let legacy = parse_err(b"tjgg\x01\x00\x00\x00".to_vec());
    assert_mentions(&legacy, &["tjgg", "GGJT"]);
    let lfs = parse_err(b"version https://git-lfs.github.com/spec/v1\n".to_vec());
    assert_mentions(&lfs, &["Git LFS"]);
    let html = parse_err(b"<!DOCTYPE html>".to_vec());
    assert_mentions(&html, &["HTML"]);
    let binary = parse_err(vec![0, 0xff, 7, 0x80]);
    assert_mentions(&binary, &[r"\x00\xff\x07\x80"]);
}

#[test]
fn unsupported_versions() {
    for version in [0u32, 1, 4, 0x0300_0000] {
        let mut bytes = sample_file(3);
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        let err = parse_err(bytes);
        assert!(
            matches!(err, GgufError::UnsupportedVersion { version: v, .. } if v == version),
            "{err}"
        );
        assert_mentions(&err, &[&format!("version {version}")]);
    }
    let mut bytes = sample_file(3);
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert_mentions(&parse_err(bytes), &["big-endian"]);
}

#[test]
fn every_truncated_prefix_is_an_error() {
    let bytes = sample_file(3);
    for len in 0..bytes.len() {
        match Gguf::from_bytes(bytes[..len].to_vec()) {
            Err(
                GgufError::Truncated { .. }
                | GgufError::CountTooLarge { .. }
                | GgufError::TensorPastEnd { .. },
            ) => {}
            other => panic!("prefix of {len} bytes gave {other:?}"),
        }
    }
    let err = parse_err(bytes[..bytes.len() - 1].to_vec());
    assert_mentions(
        &err,
        &["output_norm.weight", &(bytes.len() - 1).to_string()],
    );

    // Cut inside the first key: its 20 bytes start at offset 32.
    let bytes = Builder::new(3)
        .kv("general.architecture", string("llama"))
        .build();
    let err = parse_err(bytes[..40].to_vec());
    assert!(matches!(
        err,
        GgufError::Truncated {
            offset: 32,
            needed: 20,
            file_size: 40,
            ..
        }
    ));
    assert_mentions(
        &err,
        &["metadata key #0", "20 bytes at offset 32", "40 bytes"],
    );
}

#[test]
fn tensor_past_end_of_file() {
    // Declares 1000 f32s but stores only 16 bytes.
    let bytes = Builder::new(3)
        .tensor("blk.0.big.weight", &[1000], 0, vec![0; 16])
        .build();
    let file_size = bytes.len() as u64;
    let err = parse_err(bytes);
    let GgufError::TensorPastEnd { tensor, end, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(tensor, "blk.0.big.weight");
    assert_eq!(*end, file_size - 16 + 4000);
    assert_mentions(
        &err,
        &["blk.0.big.weight", &end.to_string(), &file_size.to_string()],
    );

    // An offset so large that offset + size overflows is just as far past the end. The offset
    // field follows the 24-byte header, name (8 + 1), n_dims (4), one dim (8) and type (4).
    let mut bytes = Builder::new(3).tensor("t", &[8], 0, vec![0; 32]).build();
    bytes[49..57].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    let err = parse_err(bytes);
    assert!(
        matches!(err, GgufError::TensorPastEnd { end: u64::MAX, .. }),
        "{err}"
    );
}

#[test]
fn unknown_tensor_type() {
    for type_id in [31, 4, 1000] {
        let err = parse_err(
            Builder::new(3)
                .tensor("odd.weight", &[32], type_id, vec![0; 64])
                .build(),
        );
        assert!(
            matches!(&err, GgufError::UnknownTensorType { tensor, type_id: t } if tensor == "odd.weight" && *t == type_id),
            "{err}"
        );
        assert_mentions(&err, &["odd.weight", &type_id.to_string()]);
    }
}

#[test]
fn unknown_value_type() {
    let err = parse_err(Builder::new(3).kv_raw(b"weird.key", 13, &[0; 8]).build());
    assert!(
        matches!(err, GgufError::UnknownValueType { type_id: 13, .. }),
        "{err}"
    );
    assert_mentions(&err, &["weird.key", "13"]);

    // Array element types are checked too, even for empty arrays.
    let mut payload = 99u32.to_le_bytes().to_vec();
    payload.extend(0u64.to_le_bytes());
    let err = parse_err(Builder::new(3).kv_raw(b"weird.array", 9, &payload).build());
    assert!(
        matches!(err, GgufError::UnknownValueType { type_id: 99, .. }),
        "{err}"
    );
    assert_mentions(&err, &["weird.array", "99"]);
}

#[test]
fn n_dims_out_of_range() {
    for dims in [&[1u64, 1, 1, 1, 1][..], &[]] {
        let err = parse_err(Builder::new(3).tensor("w", dims, 0, vec![0; 4]).build());
        assert!(
            matches!(err, GgufError::BadDimCount { n_dims, .. } if n_dims as usize == dims.len()),
            "{err}"
        );
        assert_mentions(
            &err,
            &["'w'", &format!("{} dimensions", dims.len()), "1..=4"],
        );
    }
}

#[test]
fn huge_lengths_are_rejected_without_allocating() {
    let mut payload = 0u32.to_le_bytes().to_vec(); // array of u8 ...
    payload.extend(u64::MAX.to_le_bytes()); // ... with u64::MAX elements
    let err = parse_err(
        Builder::new(3)
            .kv_raw(b"tokenizer.ggml.tokens", 9, &payload)
            .build(),
    );
    assert!(
        matches!(
            err,
            GgufError::CountTooLarge {
                count: u64::MAX,
                ..
            }
        ),
        "{err}"
    );
    assert_mentions(&err, &["tokenizer.ggml.tokens", "18446744073709551615"]);

    // A string value claiming more bytes than the file has.
    let err = parse_err(
        Builder::new(3)
            .kv_raw(b"s", 8, &(1u64 << 40).to_le_bytes())
            .build(),
    );
    assert!(
        matches!(err, GgufError::Truncated { needed, .. } if needed == 1 << 40),
        "{err}"
    );
    assert_mentions(&err, &["'s'", "1099511627776"]);

    // Header counts that the rest of the file cannot hold.
    for (at, what) in [(8, "tensor count"), (16, "metadata key/value count")] {
        let mut bytes = sample_file(3);
        bytes[at..at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        let err = parse_err(bytes);
        assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
        assert_mentions(&err, &[what, "9223372036854775807"]);
    }
}

#[test]
fn duplicates() {
    let err = parse_err(
        Builder::new(3)
            .kv("a.key", Value::U8(1))
            .kv("a.key", Value::U8(2))
            .build(),
    );
    assert!(matches!(&err, GgufError::DuplicateKey { key } if key == "a.key"));
    assert_mentions(&err, &["a.key"]);

    let err = parse_err(
        Builder::new(3)
            .tensor("same", &[1], 0, vec![0; 4])
            .tensor("same", &[1], 0, vec![0; 4])
            .build(),
    );
    assert!(matches!(&err, GgufError::DuplicateTensor { tensor } if tensor == "same"));
}

#[test]
fn alignment_must_be_a_u32_power_of_two() {
    for bad in [0, 3, 48] {
        let err = parse_err(
            Builder::new(3)
                .kv("general.alignment", Value::U32(bad))
                .build(),
        );
        assert!(matches!(err, GgufError::BadAlignment { alignment } if alignment == bad));
        assert_mentions(&err, &[&bad.to_string(), "power of two"]);
    }
    let err = parse_err(
        Builder::new(3)
            .kv("general.alignment", Value::U64(32))
            .build(),
    );
    assert!(matches!(err, GgufError::WrongType { .. }), "{err}");
    assert_mentions(&err, &["general.alignment", "u32", "u64 32"]);
}

#[test]
fn misaligned_tensor_offset() {
    let err = parse_err(
        Builder::new(3)
            .tensor_at("w", &[4], 0, vec![0; 16], Some(16))
            .build(),
    );
    assert!(matches!(
        err,
        GgufError::MisalignedTensor {
            offset: 16,
            alignment: 32,
            ..
        }
    ));
    assert_mentions(&err, &["'w'", "16", "32"]);
}

#[test]
fn row_length_must_be_whole_blocks() {
    let err = parse_err(
        Builder::new(3)
            .tensor("blk.0.q", &[100, 2], 12, vec![0; 288])
            .build(),
    );
    assert!(
        matches!(
            err,
            GgufError::BadRowLength {
                ne0: 100,
                block_size: 256,
                ..
            }
        ),
        "{err}"
    );
    assert_mentions(&err, &["blk.0.q", "100", "q4_K", "256"]);
}

#[test]
fn dims_overflow() {
    for dims in [&[u64::MAX, 2][..], &[1 << 62, 1], &[1 << 32, 1 << 32, 2]] {
        let err = parse_err(Builder::new(3).tensor("huge", dims, 0, vec![]).build());
        assert!(
            matches!(err, GgufError::DimsOverflow { .. }),
            "{dims:?}: {err}"
        );
        assert_mentions(&err, &["huge", &format!("{dims:?}")]);
    }
}

#[test]
fn array_nesting_is_bounded() {
    // Written by hand: building (and dropping) a 100k-deep `Value` would itself recurse.
    let nested = |levels: usize| {
        let mut payload = Vec::new();
        for level in 1..=levels {
            let elem_type: u32 = if level < levels { 9 } else { 0 };
            payload.extend(elem_type.to_le_bytes());
            payload.extend(1u64.to_le_bytes());
        }
        payload.push(7);
        Builder::new(3).kv_raw(b"deep", 9, &payload).build()
    };
    let g = parse(nested(16));
    let mut v = g.get("deep").unwrap();
    for _ in 0..16 {
        v = &v.as_array().unwrap()[0];
    }
    assert_eq!(v, &Value::U8(7));
    let err = parse_err(nested(17));
    assert!(matches!(err, GgufError::ArrayTooDeep { .. }), "{err}");
    assert_mentions(&err, &["deep", "16"]);
    // Far deeper nesting (a stack overflow if unchecked) fails the same way.
    assert!(matches!(
        parse_err(nested(100_000)),
        GgufError::ArrayTooDeep { .. }
    ));
}

#[test]
fn utf8_rules() {
    let err = parse_err(Builder::new(3).kv_raw(b"bad\xffkey", 0, &[1]).build());
    assert!(
        matches!(err, GgufError::InvalidUtf8 { offset: 24, .. }),
        "{err}"
    );
    assert_mentions(&err, &["metadata key #0", "offset 24"]);

    let err = parse_err(
        Builder::new(3)
            .tensor(b"w\xc3", &[1], 0, vec![0; 4])
            .build(),
    );
    assert!(matches!(err, GgufError::InvalidUtf8 { .. }), "{err}");
    assert_mentions(&err, &["name of tensor #0"]);

    // String values are decoded lossily: real vocabularies contain partial UTF-8 sequences.
    let mut payload = 3u64.to_le_bytes().to_vec();
    payload.extend(b"a\xffb");
    let g = parse(Builder::new(3).kv_raw(b"s", 8, &payload).build());
    assert_eq!(g.get_str("s").unwrap(), "a\u{fffd}b");
}

#[test]
fn layer_index_is_bounded_by_tensor_count() {
    let err = parse_err(
        Builder::new(3)
            .tensor("blk.4000000000.w", &[1], 0, vec![0; 4])
            .build(),
    );
    assert!(
        matches!(
            err,
            GgufError::LayerOutOfRange {
                layer: 4_000_000_000,
                ..
            }
        ),
        "{err}"
    );
    assert_mentions(&err, &["blk.4000000000.w", "1 tensors"]);
}

// ---------------------------------------------------------------------------------------------
// Garbage input must produce errors, never panics
// ---------------------------------------------------------------------------------------------

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Whatever parses must also be safe to query.
fn exercise(bytes: Vec<u8>) {
    if let Ok(g) = Gguf::from_bytes(bytes) {
        for t in g.tensors() {
            assert_eq!(g.tensor_data(t).len() as u64, t.size);
        }
        g.layer_bytes();
        g.non_layer_bytes();
        let _ = g.check_architecture(SUPPORTED_ARCHITECTURES);
    }
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for i in 0..200u32 {
        let len = rng.below(2048) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if i.is_multiple_of(2) {
            // A valid header with small counts, so the parser gets past the first checks.
            let mut header = b"GGUF".to_vec();
            header.extend(3u32.to_le_bytes());
            header.extend(rng.below(4).to_le_bytes());
            header.extend(rng.below(4).to_le_bytes());
            header.append(&mut bytes);
            bytes = header;
        }
        exercise(bytes);
    }
}

#[test]
fn mutated_files_never_panic() {
    let original = sample_file(3);
    let mut rng = XorShift(42);
    for _ in 0..3000 {
        let mut bytes = original.clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(bytes.len() as u64) as usize;
            bytes[at] = match rng.below(3) {
                0 => rng.next() as u8,
                1 => 0xff,
                _ => bytes[at] ^ (1 << rng.below(8)),
            };
        }
        exercise(bytes);
    }
}

// ---------------------------------------------------------------------------------------------
// Real files, when present
// ---------------------------------------------------------------------------------------------

/// Compares one metadata value with its entry in `gguf_metadata_dump.json`, where floats are
/// f32s widened to f64 and long arrays are summarised as "<array of N>".
fn assert_matches_dump(key: &str, value: &Value, expected: &serde_json::Value) {
    use serde_json::Value as J;
    match expected {
        J::Bool(b) => assert_eq!(value.as_bool(), Some(*b), "{key}"),
        J::Number(n) if n.is_f64() => {
            assert!(
                matches!(value, Value::F32(_) | Value::F64(_)),
                "{key}: {value:?}"
            );
            assert_eq!(value.as_f32().map(f64::from), n.as_f64(), "{key}");
        }
        J::Number(n) => assert_eq!(value.as_i64(), n.as_i64(), "{key}"),
        J::String(s) => match s
            .strip_prefix("<array of ")
            .and_then(|s| s.strip_suffix('>'))
        {
            Some(len) => assert_eq!(
                value.as_array().map(<[Value]>::len),
                Some(len.parse().unwrap()),
                "{key}"
            ),
            None => assert_eq!(value.as_str(), Some(s.as_str()), "{key}"),
        },
        other => panic!("{key}: unexpected dump value {other}"),
    }
}

#[test]
fn synthetic_fixtures_match_metadata_dump() {
    let dir = common::fixtures_dir().join("synthetic");
    let dump: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("gguf_metadata_dump.json")).unwrap(),
    )
    .unwrap();
    let files = dump.as_object().unwrap();
    assert!(!files.is_empty());
    for (file, expected) in files {
        let g = Gguf::open(dir.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(
            Some(g.file_size()),
            expected["size_bytes"].as_u64(),
            "{file}"
        );

        let keys = expected["metadata"].as_object().unwrap();
        assert_eq!(g.metadata().len(), keys.len(), "{file}: key count");
        for (key, value) in keys {
            let actual = g
                .get(key)
                .unwrap_or_else(|| panic!("{file}: missing {key}"));
            assert_matches_dump(key, actual, value);
        }

        let tensors = expected["tensors"].as_array().unwrap();
        assert_eq!(g.tensors().len(), tensors.len(), "{file}: tensor count");
        for (t, e) in g.tensors().iter().zip(tensors) {
            assert_eq!(t.name, e["name"].as_str().unwrap(), "{file}: tensor order");
            assert_eq!(
                format!("{:?}", t.ggml_type),
                e["ggml_type"].as_str().unwrap()
            );
            let ne: Vec<u64> = e["ne"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            assert_eq!(t.dims, ne, "{file}: {}", t.name);
            assert_eq!(g.tensor_data(t).len() as u64, t.size);
        }
        let arch = g.architecture().unwrap().to_owned();
        assert_eq!(
            g.layer_bytes().len() as u64,
            g.get_u64(&format!("{arch}.block_count")).unwrap(),
            "{file}"
        );
    }
}

#[test]
fn unsupported_architecture_fixture() {
    let path = common::fixtures_dir().join("synthetic/tiny-deepseek3_2-unsupported-f32.gguf");
    let g = Gguf::open(&path).unwrap();
    let err = g.check_architecture(SUPPORTED_ARCHITECTURES).unwrap_err();
    assert!(matches!(err, GgufError::UnsupportedArchitecture { .. }));
    assert_mentions(
        &err,
        &[
            "deepseek3_2",
            "supported: llama, qwen2, gemma3, qwen3, qwen3moe, deepseek2",
        ],
    );
}

#[test]
fn real_models() {
    for (file, arch, n_layers) in [
        ("gemma3-270m-q4_k_m.gguf", "gemma3", 18),
        ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen2", 24),
    ] {
        let path = common::model(file);
        let g = Gguf::open(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(g.check_architecture(SUPPORTED_ARCHITECTURES).unwrap(), arch);
        let total = g.tensors().iter().map(|t| t.size).sum::<u64>();
        assert!(g.data_offset() + total <= g.file_size(), "{file}");

        let layers = g.layer_bytes();
        assert_eq!(layers.len(), n_layers, "{file}");
        assert!(layers.iter().all(|&b| b > 0), "{file}: {layers:?}");
        assert_eq!(layers.iter().sum::<u64>() + g.non_layer_bytes(), total);
        assert_eq!(
            g.get_u32(&format!("{arch}.block_count")).unwrap() as usize,
            n_layers
        );

        let mut types = BTreeMap::<&str, (usize, u64)>::new();
        for t in g.tensors() {
            let entry = types.entry(t.ggml_type.name()).or_default();
            entry.0 += 1;
            entry.1 += t.size;
        }
        eprintln!(
            "{file}: v{}, {} keys, {} tensors, data at {}, {} layers of {}..={} bytes, \
             {} non-layer bytes; types (count, bytes): {types:?}",
            g.version(),
            g.metadata().len(),
            g.tensors().len(),
            g.data_offset(),
            layers.len(),
            layers.iter().min().unwrap(),
            layers.iter().max().unwrap(),
            g.non_layer_bytes(),
        );
    }
}
