#!/usr/bin/python3
"""Independent PyTorch reference for Mixtral-architecture MoE models: the MoEX correctness oracle.

Written from the Hugging Face `modeling_mixtral.py` definition plus the capacity semantics fixed in
DESIGN.md section 3. It shares no code with the C++ engine, so agreement between the two means
something. Clarity beats speed: there is no KV cache, every decode step recomputes the sequence.

Usage:
  /usr/bin/python3 tests/reference/mixtral_ref.py --model DIR --ids 1,2,3 [--decode N]
      [--capacity-factor C] [--dtype float64|float32] --out LOGITS.npy
      [--tokens-out TOKENS.txt] [--stats-out STATS.json]
      [--expert-weights bf16|int8|int8-w8a8|int4|int4-w4a8|fp8 [--group-size G]]

--expert-weights models `moex --weights`: the experts' weights quantized and dequantized as MoEX does,
and their input activations rounded as its kernels round them (quantize_ref.py).

--out holds float32 logits [len(ids) + N, V]: one row per prompt position, then one row per
greedily decoded token at that token's position. Row len(ids)-1 predicts decoded token 1; row
len(ids)+j-1 holds the logits at the position of decoded token j. Equivalently, the file equals the
logits of one forward pass over prompt + all N decoded tokens (when dropless).

Capacity is applied per forward call, as a KV-cached engine running this one sequence would: the
prompt is one call of len(ids) tokens, each decode step a call of one token. --stats-out describes
the prompt call only.
"""

import argparse
import dataclasses
import json
import math
import os
import struct
import sys

import numpy as np
import torch

# Raw storage of each supported safetensors dtype; BF16 has no numpy type, so its bits are read as
# uint16 and widened by hand.
SAFETENSORS_DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}

COMPUTE_DTYPES = {"float64": torch.float64, "float32": torch.float32}


# ---------------------------------------------------------------------------------------------
# Checkpoint loading
# ---------------------------------------------------------------------------------------------

def bf16_bits_to_float32(bits):
    """uint16 bf16 bit patterns -> float32 values (bf16 is the top half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def read_safetensors(path):
    """Every tensor of one .safetensors file as {name: float32 torch tensor}.

    Layout: u64 little-endian header length, a JSON header mapping each name to
    {dtype, shape, data_offsets: [begin, end)} (offsets relative to the end of the header), data.
    """
    with open(path, "rb") as f:
        header_len_bytes = f.read(8)
        if len(header_len_bytes) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", header_len_bytes)
        header = json.loads(f.read(header_len))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}; "
                             f"supported: {', '.join(SAFETENSORS_DTYPES)}")
        storage = SAFETENSORS_DTYPES[info["dtype"]]
        shape = [int(n) for n in info["shape"]]
        numel = math.prod(shape)
        begin, end = info["data_offsets"]
        if end - begin != numel * storage.itemsize or end > len(data):
            raise ValueError(f"{path}: tensor {name} data_offsets [{begin}, {end}) do not fit "
                             f"shape {shape} of {info['dtype']} in {len(data)} data bytes")
        raw = np.frombuffer(data, dtype=storage, count=numel, offset=begin)
        values = bf16_bits_to_float32(raw) if info["dtype"] == "BF16" else raw.astype(np.float32)
        tensors[name] = torch.from_numpy(values.reshape(shape).copy())
    return tensors


def read_checkpoint(model_dir):
    """All tensors of a checkpoint: model.safetensors, or the shards named by the HF index."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    single_path = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(read_safetensors(os.path.join(model_dir, shard)))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{index_path}: shards lack {len(missing)} indexed tensors, "
                             f"first {missing[0]}")
        return tensors
    if os.path.exists(single_path):
        return read_safetensors(single_path)
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


@dataclasses.dataclass
class MixtralConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # True (Mixtral): softmax over the k chosen logits. False (Qwen-MoE): top-k of the softmax
    # over all experts, not renormalised.
    norm_topk_prob: bool
    sliding_window: int = None

    REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_local_experts", "num_experts_per_tok",
                       "vocab_size")

    @classmethod
    def from_json(cls, path):
        with open(path) as f:
            return cls.from_dict(json.load(f), source=path)

    @classmethod
    def from_dict(cls, raw, source="config"):
        """From the fields of an HF config.json; `source` names it in error messages."""
        if raw.get("rope_scaling") is not None:
            raise ValueError(f"{source}: rope_scaling is not supported by the reference")
        missing = [f for f in cls.REQUIRED_FIELDS if f not in raw]
        if missing:
            raise ValueError(f"{source}: lacks required field {missing[0]}")
        heads = raw["num_attention_heads"]
        # Optional fields take MixtralConfig's defaults.
        cfg = cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            num_local_experts=raw["num_local_experts"],
            num_experts_per_tok=raw["num_experts_per_tok"],
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=raw.get("rope_theta", 1e6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096 * 32),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            norm_topk_prob=raw.get("norm_topk_prob", True),
            sliding_window=raw.get("sliding_window"),
        )
        if heads % cfg.num_key_value_heads != 0:
            raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {cfg.num_key_value_heads}")
        if not 1 <= cfg.num_experts_per_tok <= cfg.num_local_experts:
            raise ValueError(f"{source}: num_experts_per_tok {cfg.num_experts_per_tok} must be in "
                             f"[1, num_local_experts={cfg.num_local_experts}]")
        return cfg


class MixtralRef:
    """Config plus weights in the compute dtype. Linear weights keep HF's [out, in] layout."""

    def __init__(self, cfg, tensors, dtype=torch.float64):
        self.cfg = cfg
        self.dtype = dtype

        def take(name, shape):
            if name not in tensors:
                raise ValueError(f"checkpoint lacks tensor {name}")
            t = tensors[name]
            if list(t.shape) != list(shape):
                raise ValueError(f"tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
            return t.to(dtype)

        d, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q_dim, kv_dim = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        num_experts = cfg.num_local_experts
        self.embed = take("model.embed_tokens.weight", [cfg.vocab_size, d])
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            e = p + "block_sparse_moe.experts."
            self.layers.append({
                "attn_norm": take(p + "input_layernorm.weight", [d]),
                "wq": take(p + "self_attn.q_proj.weight", [q_dim, d]),
                "wk": take(p + "self_attn.k_proj.weight", [kv_dim, d]),
                "wv": take(p + "self_attn.v_proj.weight", [kv_dim, d]),
                "wo": take(p + "self_attn.o_proj.weight", [d, q_dim]),
                "ffn_norm": take(p + "post_attention_layernorm.weight", [d]),
                "gate": take(p + "block_sparse_moe.gate.weight", [num_experts, d]),
                "w1": [take(f"{e}{j}.w1.weight", [inter, d]) for j in range(num_experts)],
                "w3": [take(f"{e}{j}.w3.weight", [inter, d]) for j in range(num_experts)],
                "w2": [take(f"{e}{j}.w2.weight", [d, inter]) for j in range(num_experts)],
            })
        self.norm = take("model.norm.weight", [d])
        if "lm_head.weight" not in tensors and cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight", [cfg.vocab_size, d])


def load_model(model_dir, dtype=torch.float64):
    """Loads config.json and the safetensors weights of an HF-layout Mixtral checkpoint."""
    cfg = MixtralConfig.from_json(os.path.join(model_dir, "config.json"))
    return MixtralRef(cfg, read_checkpoint(model_dir), dtype)


def quantize_experts(model, fmt, group=128):
    """Every expert's weights as `moex --weights fmt` holds them, and its activation rounding."""
    import quantize_ref
    for layer in model.layers:
        for name in ("w1", "w3", "w2"):
            layer[name] = [quantize_ref.dequantize(w, fmt, group).to(model.dtype) for w in layer[name]]
        layer["expert_act"] = quantize_ref.activation_rounding(fmt, group)


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_cos_sin(num_positions, head_dim, theta, dtype):
    """cos, sin [T, head_dim] for positions 0..T-1, each frequency repeated in both halves (HF)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim)
    freqs = torch.outer(torch.arange(num_positions, dtype=dtype), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    """HF rotate-half convention: dims i and i + head_dim/2 form one rotated pair."""
    return x * cos + rotate_half(x) * sin


def attention(x, layer, cfg, cos, sin):
    """Causal GQA self-attention over x [T, d] at positions 0..T-1 -> [T, d]."""
    num_tokens = x.shape[0]
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = (x @ layer["wq"].t()).view(num_tokens, heads, hd).transpose(0, 1)     # [H, T, hd]
    k = (x @ layer["wk"].t()).view(num_tokens, kv_heads, hd).transpose(0, 1)  # [KV, T, hd]
    v = (x @ layer["wv"].t()).view(num_tokens, kv_heads, hd).transpose(0, 1)  # [KV, T, hd]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # repeat_interleave makes query head h read kv head h // (H / KV).
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)                              # [H, T, T]
    future = torch.ones(num_tokens, num_tokens, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = (probs @ v).transpose(0, 1).reshape(num_tokens, heads * hd)
    return out @ layer["wo"].t()


def route(router_logits, k, norm_topk_prob=True):
    """Top-k routing of router_logits [T, E] -> (expert_ids [T, k], weights [T, k]).

    Experts are listed best first; among equal logits the lower expert index wins.
    """
    # A stable ascending sort of the negated logits keeps equal logits in index order.
    expert_ids = torch.sort(-router_logits, dim=-1, stable=True).indices[:, :k]
    if norm_topk_prob:
        weights = torch.softmax(router_logits.gather(-1, expert_ids), dim=-1)
    else:
        weights = torch.softmax(router_logits, dim=-1).gather(-1, expert_ids)
    return expert_ids, weights


def expert_capacity(k, num_tokens, num_experts, capacity_factor):
    """DESIGN.md §3: ceil(k * T / E * capacity_factor), or None (dropless) for a factor <= 0."""
    if capacity_factor is None or capacity_factor <= 0:
        return None
    return math.ceil(k * num_tokens / num_experts * capacity_factor)


def capacity_keep_mask(expert_ids, num_experts, capacity):
    """Which assignments [T, k] each expert accepts when it takes at most `capacity` of them.

    Priority is choice-major (DeepSpeed's order): every token's 1st choice in token order, then
    every 2nd choice, ...; so 2nd choices are dropped before 1st choices.
    """
    num_tokens, k = expert_ids.shape
    if capacity is None:
        return torch.ones(num_tokens, k, dtype=torch.bool)
    in_priority_order = expert_ids.t().reshape(-1)
    one_hot = torch.nn.functional.one_hot(in_priority_order, num_experts)
    # 0-based place of each assignment in its expert's queue.
    place_in_queue = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
    return (place_in_queue < capacity).view(k, num_tokens).t()


def expert_ffn(x, w1, w3, w2, act=lambda v: v):
    """SwiGLU expert: w2(silu(w1 x) * (w3 x)); `act` is what the kernels do to each product's input."""
    x = act(x)
    return act(torch.nn.functional.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def moe(x, layer, cfg, capacity_factor=None, call_lengths=None):
    """Sparse MoE block over x [T, d] -> (out [T, d], stats).

    call_lengths splits the tokens into the engine's forward calls; capacity is per call.
    stats: tokens_per_expert (routed assignments, before capacity), drops_per_expert, drops.
    """
    num_tokens = x.shape[0]
    num_experts, k = cfg.num_local_experts, cfg.num_experts_per_tok
    expert_ids, weights = route(x @ layer["gate"].t(), k, cfg.norm_topk_prob)

    keep_per_call, start = [], 0
    for length in call_lengths or [num_tokens]:
        call_ids = expert_ids[start:start + length]
        capacity = expert_capacity(k, length, num_experts, capacity_factor)
        keep_per_call.append(capacity_keep_mask(call_ids, num_experts, capacity))
        start += length
    keep = torch.cat(keep_per_call)

    out = torch.zeros_like(x)
    for e in range(num_experts):
        token_idx, slot = torch.nonzero((expert_ids == e) & keep, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        y = expert_ffn(x[token_idx], layer["w1"][e], layer["w3"][e], layer["w2"][e],
                       layer.get("expert_act", lambda v: v))
        out.index_add_(0, token_idx, y * weights[token_idx, slot].unsqueeze(-1))

    drops_per_expert = torch.bincount(expert_ids[~keep], minlength=num_experts)
    stats = {
        "tokens_per_expert": torch.bincount(expert_ids.reshape(-1), minlength=num_experts).tolist(),
        "drops_per_expert": drops_per_expert.tolist(),
        "drops": int(drops_per_expert.sum()),
    }
    return out, stats


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

def forward(model, ids, capacity_factor=None, call_lengths=None):
    """Logits [T, V] for token ids at positions 0..T-1, plus per-layer MoE stats.

    call_lengths splits the T tokens into the consecutive forward calls of a KV-cached engine
    (default: one call). Attention is causal, so recomputing everything gives the engine's numbers;
    only MoE capacity depends on the split. Stats are summed over the calls.
    """
    cfg = model.cfg
    ids = list(ids)
    if not ids:
        raise ValueError("need at least one token id")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    if len(ids) > cfg.max_position_embeddings:
        raise ValueError(f"{len(ids)} tokens exceed max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    # Without a window the reference would silently disagree with HF past it.
    if cfg.sliding_window is not None and len(ids) > cfg.sliding_window:
        raise ValueError(f"{len(ids)} tokens exceed sliding_window {cfg.sliding_window}, "
                         f"which the reference does not implement")
    if call_lengths is not None and sum(call_lengths) != len(ids):
        raise ValueError(f"call_lengths sum to {sum(call_lengths)}, not {len(ids)} tokens")

    cos, sin = rope_cos_sin(len(ids), cfg.head_dim, cfg.rope_theta, model.dtype)
    x = model.embed[torch.tensor(ids)]
    layer_stats = []
    for layer in model.layers:
        x = x + attention(rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps), layer, cfg, cos, sin)
        moe_out, stats = moe(rms_norm(x, layer["ffn_norm"], cfg.rms_norm_eps), layer, cfg,
                             capacity_factor, call_lengths)
        x = x + moe_out
        layer_stats.append(stats)
    logits = rms_norm(x, model.norm, cfg.rms_norm_eps) @ model.lm_head.t()
    return logits, layer_stats


def logits_for(model, ids, capacity_factor=None):
    """Logits [len(ids), V] of one forward call over ids."""
    return forward(model, ids, capacity_factor)[0]


def moe_drop_stats(model, ids, capacity_factor=None):
    """Per-layer {tokens_per_expert, drops_per_expert, drops} of one forward call over ids."""
    return forward(model, ids, capacity_factor)[1]


def greedy_decode(model, prompt, num_steps, capacity_factor=None):
    """(logits [P + N, V], N greedy tokens), rows as described in the module docstring."""
    seq = list(prompt)
    logits, _ = forward(model, seq, capacity_factor)
    rows, tokens = [logits], []
    for _ in range(num_steps):
        # argmax returns the first maximum, so ties go to the lower token id.
        tokens.append(int(torch.argmax(rows[-1][-1])))
        seq.append(tokens[-1])
        call_lengths = [len(prompt)] + [1] * len(tokens)
        rows.append(forward(model, seq, capacity_factor, call_lengths)[0][-1:])
    return torch.cat(rows), tokens


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Mixtral reference logits (PyTorch); see the module docstring for row layout.")
    parser.add_argument("--model", required=True, help="HF-layout checkpoint directory")
    parser.add_argument("--ids", required=True, help="comma-separated prompt token ids, e.g. 1,2,3")
    parser.add_argument("--decode", type=int, default=0, metavar="N", help="greedy decode steps")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="expert capacity factor; omitted or <= 0 means dropless")
    parser.add_argument("--dtype", choices=sorted(COMPUTE_DTYPES), default="float64",
                        help="compute dtype (default float64, the tight oracle)")
    parser.add_argument("--out", required=True, help="float32 .npy logits [len(ids) + N, V]")
    parser.add_argument("--tokens-out", help="greedy tokens, one per line")
    parser.add_argument("--stats-out", help="JSON MoE load and drop stats of the prompt call")
    parser.add_argument("--expert-weights", choices=["bf16", "int8", "int8-w8a8", "int4", "int4-w4a8", "fp8"],
                        help="model moex --weights: experts quantized as MoEX quantizes them")
    parser.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128], help="int4 group size")
    args = parser.parse_args(argv)
    if args.decode < 0:
        parser.error("--decode must be >= 0")
    try:
        args.ids = [int(tok) for tok in args.ids.split(",")]
    except ValueError:
        parser.error(f"--ids must be comma-separated integers, got {args.ids!r}")
    return args


def main(argv=None):
    args = parse_args(argv)
    model = load_model(args.model, COMPUTE_DTYPES[args.dtype])
    if args.expert_weights:
        quantize_experts(model, args.expert_weights, args.group_size)
    logits, tokens = greedy_decode(model, args.ids, args.decode, args.capacity_factor)
    np.save(args.out, logits.to(torch.float32).numpy())
    if args.tokens_out:
        with open(args.tokens_out, "w") as f:
            f.writelines(f"{tok}\n" for tok in tokens)
    if args.stats_out:
        cfg = model.cfg
        report = {
            "num_tokens": len(args.ids),
            "capacity_factor": args.capacity_factor,
            "capacity": expert_capacity(cfg.num_experts_per_tok, len(args.ids),
                                        cfg.num_local_experts, args.capacity_factor),
            "layers": moe_drop_stats(model, args.ids, args.capacity_factor),
        }
        with open(args.stats_out, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"mixtral_ref: {err}")
