//! The GGUF reader on any bytes: a file is parsed or refused with an error, and
//! whatever it accepts holds up under every accessor a loader uses. With the
//! `model` feature the accepted files also go through `ModelFile` (the
//! architecture's hyper-parameters and tensor shapes) and its chat template.
#![no_main]

use libfuzzer_sys::fuzz_target;
use omni_engine::gguf::{Gguf, SUPPORTED_ARCHITECTURES};

fuzz_target!(|data: &[u8]| {
    let g = match Gguf::from_bytes(data.to_vec()) {
        Ok(g) => g,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let _ = format!("{g:?}");
    assert!(matches!(g.version(), 2 | 3));
    assert!(g.alignment().is_power_of_two());
    assert!(g.data_offset().is_multiple_of(g.alignment()));
    assert_eq!(g.file_size(), data.len() as u64);

    for (key, value) in g.metadata() {
        // The same entry (not an equal one: a NaN is not equal to itself).
        assert!(g.get(key).is_some_and(|v| std::ptr::eq(v, value)));
        let _ = (value.as_i64(), value.as_f32(), value.type_name());
        // Typed getters either convert or name the key and the type found.
        let errors = [
            g.opt_u32(key).err(),
            g.opt_u64(key).err(),
            g.opt_f32(key).err(),
            g.opt_bool(key).err(),
            g.opt_str(key).err(),
            g.opt_str_array(key).err(),
        ];
        for e in errors.into_iter().flatten() {
            assert!(e.to_string().contains(key.as_str()), "{e}");
        }
    }
    let _ = g
        .check_architecture(SUPPORTED_ARCHITECTURES)
        .map_err(|e| e.to_string());

    for t in g.tensors() {
        assert!(g.tensor(&t.name).is_some_and(|u| std::ptr::eq(u, t)));
        // Parsing proved every tensor lies inside the file.
        assert_eq!(g.tensor_data(t).unwrap().len() as u64, t.size);
        assert!(t.offset >= g.data_offset());
        let _ = (t.n_elements(), t.layer());
    }
    let layers: u64 = g.layer_bytes().iter().sum();
    let total: u64 = g.tensors().iter().map(|t| t.size).sum();
    assert_eq!(layers + g.non_layer_bytes(), total);

    #[cfg(feature = "model")]
    model(g);
});

/// What a worker or the coordinator does next with a file: validate it as a model.
#[cfg(feature = "model")]
fn model(g: Gguf) {
    let m = match omni_engine::ModelFile::from_gguf(g, std::path::Path::new("fuzz.gguf")) {
        Ok(m) => m,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let hp = &m.hparams;
    let _ = (hp.kv_bytes_per_token_layer(), m.expert_layers());
    for il in 0..hp.n_layer {
        let _ = (
            m.expert_weight_bytes(il),
            hp.rope_for_layer(il),
            hp.is_swa(il),
        );
    }
    let _ = m.range_weight_bytes(&omni_engine::LayerRange {
        embed: true,
        layers: 0..hp.n_layer,
        head: true,
    });
    // The template is compiled (a syntax error is an error), never rendered: a
    // file's template is code, and may loop for as long as it likes.
    let _ = m.chat_template().map_err(|e| e.to_string());
}
