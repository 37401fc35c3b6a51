//! Well-formed files

use super::*;

fn check_sample(g: &Gguf, version: u32) {
    assert_eq!(g.version(), version);
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.file_size(), g.part_bytes(0).unwrap().len() as u64);

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
        assert_eq!(
            g.tensor_data(t).unwrap(),
            pattern(size as usize, seed),
            "{name}"
        );
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
            g.tensor_data(t).unwrap(),
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
        part: 0,
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
