//! Malformed files: each gets its own error, naming the culprit

use super::*;

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
