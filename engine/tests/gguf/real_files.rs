//! Real files, when present

use super::*;

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
            assert_eq!(g.tensor_data(t).unwrap().len() as u64, t.size);
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
