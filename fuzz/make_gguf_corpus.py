#!/usr/bin/env python3
"""Writes the `gguf` fuzz target's seed corpus (fuzz/corpus/gguf/): tiny GGUF
files, a few hundred bytes to a few KB each, so that the fuzzer starts from
every value type, several tensor types, one valid model of each supported
architecture (shapes as `engine/src/model/<arch>.rs` checks them) and some
near-misses (truncated, wrong magic or version, misaligned or out-of-file
tensors). Deterministic: running it again rewrites the same bytes.

    python3 fuzz/make_gguf_corpus.py
"""

import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "gguf")

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f",
          BOOL: "?", U64: "Q", I64: "q", F64: "d"}
# ggml type id -> (block size, bytes per block)
GGML = {"F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q8_0": (8, 32, 34),
        "Q4_K": (12, 256, 144), "BF16": (30, 1, 2)}


def gstr(b):
    if isinstance(b, str):
        b = b.encode()
    return struct.pack("<Q", len(b)) + b


def value(ty, v):
    if ty == STRING:
        return gstr(v)
    if ty == ARRAY:
        elem, items = v
        out = struct.pack("<IQ", elem, len(items))
        return out + b"".join(value(elem, x) for x in items)
    return struct.pack("<" + SCALAR[ty], v)


def gguf(kvs, tensors, version=3, alignment=32):
    """kvs: [(key, type, value)]; tensors: [(name, dims, ggml type name)], zero data."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, ty, v in kvs:
        out += gstr(key) + struct.pack("<I", ty) + value(ty, v)
    offset, infos, sizes = 0, b"", []
    for name, dims, tname in tensors:
        tid, block, block_bytes = GGML[tname]
        n = 1
        for d in dims:
            n *= d
        size = n // block * block_bytes
        infos += gstr(name) + struct.pack("<I", len(dims))
        infos += b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", tid, offset)
        sizes.append((offset, size))
        offset = (offset + size + alignment - 1) // alignment * alignment
    out += infos
    data_start = (len(out) + alignment - 1) // alignment * alignment
    out += b"\0" * (data_start - len(out))
    data = bytearray(offset)
    for i, (off, size) in enumerate(sizes):
        # A little non-zero data, so tensor views are not all alike.
        data[off:off + min(size, 4)] = bytes([i + 1] * min(size, 4))
    return out + bytes(data)


def tokenizer(n_vocab, template=None):
    kvs = [
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, ["<s>", "</s>", "a", "b"][:n_vocab])),
        ("tokenizer.ggml.bos_token_id", U32, 0),
        ("tokenizer.ggml.eos_token_id", U32, 1),
    ]
    if template is not None:
        kvs.append(("tokenizer.chat_template", STRING, template))
    return kvs


# Tiny shapes shared by the models: 4-wide embeddings, 2 query heads of 2.
E, V, FF = 4, 4, 8


def model(arch, n_layer, keys, layer, tied=False, template=None, extra=()):
    kvs = [("general.architecture", STRING, arch), ("general.name", STRING, "tiny-" + arch)]
    kvs += [(f"{arch}.{k}", ty, v) for k, ty, v in [
        ("block_count", U32, n_layer),
        ("context_length", U32, 64),
        ("embedding_length", U32, E),
        ("attention.head_count", U32, 2),
        ("attention.layer_norm_rms_epsilon", F32, 1e-6),
    ] + keys]
    kvs += tokenizer(V, template)
    tensors = [("token_embd.weight", [E, V], "F32"), ("output_norm.weight", [E], "F32")]
    if not tied:
        tensors.append(("output.weight", [E, V], "F32"))
    for il in range(n_layer):
        tensors += [(f"blk.{il}.{name}", dims, t) for name, dims, t in layer(il)]
    return gguf(kvs, tensors + list(extra))


def f32(*specs):
    return [(name, dims, "F32") for name, dims in specs]


def qwen2_layer(kv_heads):
    q, kv = 4, 2 * kv_heads
    return lambda il: f32(
        ("attn_norm.weight", [E]), ("attn_q.weight", [E, q]), ("attn_k.weight", [E, kv]),
        ("attn_v.weight", [E, kv]), ("attn_q.bias", [q]), ("attn_k.bias", [kv]),
        ("attn_v.bias", [kv]), ("attn_output.weight", [q, E]), ("ffn_norm.weight", [E]),
        ("ffn_gate.weight", [E, FF]), ("ffn_up.weight", [E, FF]), ("ffn_down.weight", [FF, E]))


def qwen3_attention():
    return f32(
        ("attn_norm.weight", [E]), ("attn_q.weight", [E, 4]), ("attn_k.weight", [E, 2]),
        ("attn_v.weight", [E, 2]), ("attn_output.weight", [4, E]),
        ("attn_k_norm.weight", [2]), ("attn_q_norm.weight", [2]), ("ffn_norm.weight", [E]))


def gemma3_layer(il):
    return f32(
        ("attn_norm.weight", [E]), ("attn_q.weight", [E, 4]), ("attn_k.weight", [E, 2]),
        ("attn_v.weight", [E, 2]), ("attn_q_norm.weight", [2]), ("attn_k_norm.weight", [2]),
        ("attn_output.weight", [4, E]), ("post_attention_norm.weight", [E]),
        ("ffn_norm.weight", [E]), ("ffn_gate.weight", [E, FF]), ("ffn_up.weight", [E, FF]),
        ("ffn_down.weight", [FF, E]), ("post_ffw_norm.weight", [E]))


def experts(n, f):
    return f32(("ffn_gate_inp.weight", [E, n]), ("ffn_gate_exps.weight", [E, f, n]),
               ("ffn_down_exps.weight", [f, E, n]), ("ffn_up_exps.weight", [E, f, n]))


def deepseek2_layer(absorbed, q_lora):
    nope, rope, kv_lora, h = 2, 2, 4, 2
    v = 4 if absorbed else 2

    def layer(il):
        t = f32(("attn_norm.weight", [E]))
        if q_lora:
            t += f32(("attn_q_a.weight", [E, q_lora]), ("attn_q_a_norm.weight", [q_lora]),
                     ("attn_q_b.weight", [q_lora, h * (nope + rope)]))
        else:
            t += f32(("attn_q.weight", [E, h * (nope + rope)]))
        t += f32(("attn_kv_a_mqa.weight", [E, kv_lora + rope]), ("attn_kv_a_norm.weight", [kv_lora]))
        if absorbed:
            t += f32(("attn_k_b.weight", [nope, kv_lora, h]), ("attn_v_b.weight", [kv_lora, v, h]))
        else:
            t += f32(("attn_kv_b.weight", [kv_lora, h * (nope + v)]))
        t += f32(("attn_output.weight", [h * v, E]), ("ffn_norm.weight", [E]))
        if il == 0:  # the leading dense block
            t += f32(("ffn_gate.weight", [E, FF]), ("ffn_down.weight", [FF, E]), ("ffn_up.weight", [E, FF]))
        else:
            t += experts(4, 2) + f32(("exp_probs_b.bias", [4]), ("ffn_gate_shexp.weight", [E, 2]),
                                     ("ffn_down_shexp.weight", [2, E]), ("ffn_up_shexp.weight", [E, 2]))
        return t
    return layer


def deepseek2(absorbed):
    keys = [
        ("feed_forward_length", U32, FF), ("leading_dense_block_count", U32, 1),
        ("attention.kv_lora_rank", U32, 4), ("rope.dimension_count", U32, 2),
        ("expert_count", U32, 4), ("expert_used_count", U32, 2),
        ("expert_feed_forward_length", U32, 2), ("expert_shared_count", U32, 1),
        ("expert_gating_func", U32, 2), ("expert_weights_norm", BOOL, True),
        ("expert_weights_scale", F32, 2.5), ("expert_group_count", U32, 2),
        ("expert_group_used_count", U32, 1),
        ("rope.scaling.type", STRING, "yarn"), ("rope.scaling.factor", F32, 4.0),
        ("rope.scaling.original_context_length", U32, 16),
        ("rope.scaling.yarn_log_multiplier", F32, 0.1),
    ]
    if absorbed:
        keys += [("attention.head_count_kv", U32, 1), ("attention.key_length", U32, 6),
                 ("attention.value_length", U32, 4), ("attention.key_length_mla", U32, 4),
                 ("attention.value_length_mla", U32, 4)]
        return model("deepseek2", 2, keys, deepseek2_layer(True, 0))
    keys += [("attention.head_count_kv", U32, 2), ("attention.key_length", U32, 4),
             ("attention.value_length", U32, 2), ("attention.q_lora_rank", U32, 2)]
    return model("deepseek2", 2, keys, deepseek2_layer(False, 2))


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def models():
    yield "model-qwen2.gguf", model(
        "qwen2", 2, [("feed_forward_length", U32, FF), ("attention.head_count_kv", U32, 1),
                     ("rope.freq_base", F32, 1e6)],
        qwen2_layer(1), template=CHATML)
    yield "model-llama.gguf", model(
        "llama", 1, [("feed_forward_length", U32, FF), ("attention.head_count_kv", U32, 2),
                     ("rope.dimension_count", U32, 2), ("rope.scaling.type", STRING, "linear"),
                     ("rope.scaling.factor", F32, 2.0)],
        qwen2_layer(2), tied=True)
    yield "model-gemma3.gguf", model(
        "gemma3", 2, [("feed_forward_length", U32, FF), ("attention.head_count_kv", U32, 1),
                      ("attention.key_length", U32, 2), ("attention.value_length", U32, 2),
                      ("attention.sliding_window", U32, 4),
                      ("attention.sliding_window_pattern", ARRAY, (BOOL, [True, False])),
                      ("rope.freq_base_swa", F32, 1e4), ("final_logit_softcapping", F32, 30.0)],
        gemma3_layer, tied=True)
    yield "model-qwen3.gguf", model(
        "qwen3", 1, [("feed_forward_length", ARRAY, (U32, [FF])),
                     ("attention.head_count_kv", ARRAY, (U32, [1]))],
        lambda il: qwen3_attention() + f32(("ffn_gate.weight", [E, FF]), ("ffn_down.weight", [FF, E]),
                                           ("ffn_up.weight", [E, FF])))
    yield "model-qwen3moe.gguf", model(
        "qwen3moe", 1, [("attention.head_count_kv", U32, 1), ("expert_count", U32, 4),
                        ("expert_used_count", U32, 2), ("expert_feed_forward_length", U32, 2)],
        lambda il: qwen3_attention() + experts(4, 2))
    yield "model-deepseek2-mla.gguf", deepseek2(True)
    yield "model-deepseek2-legacy.gguf", deepseek2(False)


def structures():
    yield "empty-v3.gguf", gguf([], [])
    yield "empty-v2.gguf", gguf([], [], version=2)
    every = [
        ("u8", U8, 7), ("i8", I8, -7), ("u16", U16, 700), ("i16", I16, -700),
        ("u32", U32, 70000), ("i32", I32, -70000), ("f32", F32, 0.5), ("bool", BOOL, True),
        ("string", STRING, "caf\u00e9"), ("u64", U64, 1 << 40), ("i64", I64, -(1 << 40)),
        ("f64", F64, 0.25), ("array.u32", ARRAY, (U32, [1, 2, 3])),
        ("array.string", ARRAY, (STRING, ["a", "", "\u00e9"])),
        ("array.nested", ARRAY, (ARRAY, [(I8, [1, -1]), (F32, [])])),
        ("general.alignment", U32, 64),
    ]
    yield "every-value-type.gguf", gguf(every, [], alignment=64)
    tensors = [("token_embd.weight", [32, 2], "Q8_0"), ("blk.0.a.weight", [256], "Q4_K"),
               ("blk.0.b.weight", [2, 3, 1, 2], "F16"), ("blk.1.c.weight", [32], "Q4_0"),
               ("blk.1.d", [3], "BF16"), ("output.weight", [1], "F32")]
    yield "tensor-types.gguf", gguf([("general.architecture", STRING, "llama")], tensors)


def near_misses(valid):
    yield "truncated.gguf", valid[: len(valid) // 2]
    yield "bad-magic.gguf", b"GGML" + valid[4:]
    yield "version-1.gguf", valid[:4] + struct.pack("<I", 1) + valid[8:]
    yield "big-endian.gguf", valid[:4] + struct.pack(">I", 3) + valid[8:]
    one = [("general.architecture", STRING, "qwen2")]
    past_end = gguf(one, [("t", [64], "F32")])
    yield "tensor-past-end.gguf", past_end[: len(past_end) - 4]
    out = bytearray(gguf(one, [("t", [4], "F32"), ("u", [4], "F32")]))
    # The second tensor's relative offset (the last u64 of the infos) is 32; make it 8.
    at = out.index(gstr("u")) + 9 + 4 + 8 + 4
    out[at:at + 8] = struct.pack("<Q", 8)
    yield "misaligned-tensor.gguf", bytes(out)
    yield "duplicate-key.gguf", gguf(one + one, [])
    yield "unsupported-arch.gguf", gguf([("general.architecture", STRING, "deepseek3_2")], [])


def main():
    os.makedirs(OUT, exist_ok=True)
    files = dict(models())
    files.update(structures())
    files.update(near_misses(files["model-llama.gguf"]))
    for name, data in sorted(files.items()):
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    total = sum(len(d) for d in files.values())
    print(f"{len(files)} files, {total} bytes in {OUT}")


if __name__ == "__main__":
    main()
