#[path = "../common/mod.rs"]
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

mod garbage;
mod malformed;
mod real_files;
mod split;
mod well_formed;
