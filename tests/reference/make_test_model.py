#!/usr/bin/python3
"""Writes a small random Mixtral checkpoint in Hugging Face layout (config.json + safetensors).

It exists to test mixtral_ref.py and safetensors loaders without any downloaded model; the C++
side has its own `moex gen-model`.

Usage:
  /usr/bin/python3 tests/reference/make_test_model.py --out DIR [--hidden 64] [--intermediate 128]
      [--layers 2] [--heads 4] [--kv-heads 2] [--head-dim D] [--experts 4] [--top-k 2]
      [--vocab 128] [--seed 0] [--dtype bf16|f16|f32] [--shards 1] [--tie-embeddings]
      [--no-norm-topk-prob]
"""

import argparse
import json
import os
import struct

import numpy as np

SAFETENSORS_NAMES = {"bf16": "BF16", "f16": "F16", "f32": "F32"}
TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


def float32_to_bf16_bits(values):
    """float32 -> bf16 bit patterns (uint16), rounding to nearest, ties to even (finite inputs)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    round_to_even = 0x7FFF + ((bits >> 16) & 1)
    return ((bits + round_to_even) >> 16).astype(np.uint16)


def encode(values, dtype):
    """Little-endian bytes of float32 `values` stored as dtype ('bf16', 'f16' or 'f32')."""
    if dtype == "bf16":
        return float32_to_bf16_bits(values).astype("<u2").tobytes()
    if dtype == "f16":
        return np.asarray(values, dtype="<f2").tobytes()
    return np.asarray(values, dtype="<f4").tobytes()


def write_safetensors(path, tensors, dtype):
    """Writes {name: float32 array} as one safetensors file, every tensor stored as dtype."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, values in tensors.items():
        blob = encode(values, dtype)
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(values.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    # The reference writer pads the header with spaces so the data starts 8-byte aligned.
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for blob in blobs:
            f.write(blob)


def make_config(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=None,
                experts=4, top_k=2, vocab=128, tie_embeddings=False, norm_topk_prob=True):
    """An HF MixtralConfig dict; head_dim and norm_topk_prob appear only when not the default,
    so readers are exercised on both the present and the absent field."""
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_local_experts": experts,
        "num_experts_per_tok": top_k,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tie_embeddings,
        "hidden_act": "silu",
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    if not norm_topk_prob:
        config["norm_topk_prob"] = False
    return config


def make_weights(config, seed=0):
    """{HF tensor name: float32 array}, scaled so activations and logits stay O(1)."""
    rng = np.random.default_rng(seed)
    d, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim") or d // config["num_attention_heads"]
    q_dim, kv_dim = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def linear(out_features, in_features):
        return (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(
            np.float32)

    def norm_weight():
        # Not all ones, so a loader or kernel that skips the weight is caught.
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((vocab, d)).astype(np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm_weight()
        weights[p + "self_attn.q_proj.weight"] = linear(q_dim, d)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_dim, d)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_dim, d)
        weights[p + "self_attn.o_proj.weight"] = linear(d, q_dim)
        weights[p + "post_attention_layernorm.weight"] = norm_weight()
        weights[p + "block_sparse_moe.gate.weight"] = linear(config["num_local_experts"], d)
        for j in range(config["num_local_experts"]):
            e = f"{p}block_sparse_moe.experts.{j}."
            weights[e + "w1.weight"] = linear(inter, d)
            weights[e + "w3.weight"] = linear(inter, d)
            weights[e + "w2.weight"] = linear(d, inter)
    weights["model.norm.weight"] = norm_weight()
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(vocab, d)
    return weights


def write_model(out_dir, config, weights, dtype="bf16", shards=1):
    """Writes config.json and model.safetensors, or `shards` files plus the HF index."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(config, torch_dtype=TORCH_DTYPE_NAMES[dtype]), f, indent=2)
        f.write("\n")
    if shards == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), weights, dtype)
        return
    names = list(weights)
    weight_map = {}
    for s, shard_idx in enumerate(np.array_split(np.arange(len(names)), shards)):
        shard_names = [names[i] for i in shard_idx]
        file_name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(os.path.join(out_dir, file_name),
                          {n: weights[n] for n in shard_names}, dtype)
        weight_map.update({n: file_name for n in shard_names})
    bytes_per_value = 4 if dtype == "f32" else 2
    index = {"metadata": {"total_size": sum(w.size for w in weights.values()) * bytes_per_value},
             "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=None, help="default hidden / heads")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(SAFETENSORS_NAMES), default="bf16")
    parser.add_argument("--shards", type=int, default=1, help="files; > 1 writes an HF index")
    parser.add_argument("--tie-embeddings", action="store_true", help="omit lm_head.weight")
    parser.add_argument("--no-norm-topk-prob", action="store_true",
                        help="Qwen-MoE routing: top-k of softmax over all experts")
    args = parser.parse_args()
    if args.shards < 1:
        parser.error("--shards must be >= 1")
    config = make_config(args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads,
                         args.head_dim, args.experts, args.top_k, args.vocab, args.tie_embeddings,
                         not args.no_norm_topk_prob)
    write_model(args.out, config, make_weights(config, args.seed), args.dtype, args.shards)


if __name__ == "__main__":
    main()
