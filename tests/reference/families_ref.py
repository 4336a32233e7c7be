#!/usr/bin/python3
"""Independent PyTorch reference for the MoE families other than Mixtral: qwen2_moe, qwen3_moe, olmoe, dots1.

Written from Hugging Face's modelling files (modeling_qwen2_moe.py, modeling_qwen3_moe.py, modeling_olmoe.py,
modeling_dots1.py); it shares no code with the C++ engine. The checkpoint reader and the plain layers
(RMSNorm, rotate-half RoPE) are mixtral_ref.py's, which follows the same HF conventions. Like mixtral_ref.py
there is no KV cache: every decode step recomputes the sequence. Dropless only (no capacity factor).

What each family adds to a Llama-style decoder (HF's code, in this file's words):
  qwen2_moe  q/k/v_proj with biases; MoE: softmax over all experts, top-k, renormalised only with
             norm_topk_prob; plus a shared expert (an MLP of shared_expert_intermediate_size) times
             sigmoid(shared_expert_gate(x)); layers in mlp_only_layers, or with (l + 1) % decoder_sparse_step
             != 0, are a dense MLP of intermediate_size.
  qwen3_moe  no biases; q_norm / k_norm: RMSNorm over each head's head_dim before RoPE; the same MoE
             without a shared expert.
  olmoe      q_norm / k_norm: RMSNorm over the whole q (H*hd) and k (KV*hd) projections before the split
             into heads; the same router; experts of intermediate_size.
  dots1      qwen3's attention; layers below first_k_dense_replace are dense; MoE: sigmoid scores, the
             choice over scores + e_score_correction_bias with grouped top-k (groups scored by the sum of
             their two best, topk_group kept, the others' choice scores set to 0), weights = the sigmoid
             scores of the chosen (renormalised with norm_topk_prob, + 1e-20) times routed_scaling_factor;
             plus shared experts (one MLP of moe_intermediate_size * n_shared_experts), ungated.

Usage (rows as in mixtral_ref.py: prompt positions, then one row per greedy decode step):
  /usr/bin/python3 tests/reference/families_ref.py --model DIR --ids 1,2,3 [--decode N]
      [--dtype float64|float32] --out LOGITS.npy [--tokens-out TOKENS.txt] [--ablate PART]
      [--expert-weights bf16|int8|int4|fp8 [--group-size G]]   (as mixtral_ref.py; shared/dense MLPs stay as stored)

--ablate skips one part of the model (qk_norm, qkv_bias, shared_gate, shared_expert, correction_bias,
groups, scaling, dense_layers): the tests use it to show that a reference without that part disagrees
with MoEX, i.e. that the comparison would catch MoEX skipping it.
"""

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mixtral_ref import COMPUTE_DTYPES, apply_rope, read_checkpoint, rms_norm, rope_cos_sin  # noqa: E402

FAMILIES = ("qwen2_moe", "qwen3_moe", "olmoe", "dots1")
ABLATIONS = ("qk_norm", "qkv_bias", "shared_gate", "shared_expert", "correction_bias", "groups", "scaling",
             "dense_layers")


@dataclasses.dataclass
class FamilyConfig:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    top_k: int
    expert_intermediate: int       # per routed expert
    dense_intermediate: int        # dense MLP layers (0: none)
    shared_intermediate: int       # shared expert(s) (0: none)
    norm_topk_prob: bool
    qkv_bias: bool = False
    qk_norm: str = "none"          # none | per_head | whole
    shared_gate: bool = False
    sigmoid_router: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    mlp_only_layers: tuple = ()
    decoder_sparse_step: int = 1
    first_k_dense_replace: int = 0

    def moe_layer(self, layer):
        """HF's rule for which decoder layers hold the sparse MoE block."""
        if self.model_type == "dots1":
            return layer >= self.first_k_dense_replace
        if self.model_type in ("qwen2_moe", "qwen3_moe"):
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        return True

    @classmethod
    def from_json(cls, path):
        with open(path) as f:
            raw = json.load(f)
        mt = raw.get("model_type")
        if mt not in FAMILIES:
            raise ValueError(f"{path}: model_type {mt!r} is not one of {', '.join(FAMILIES)}")
        if raw.get("rope_scaling") is not None:
            raise ValueError(f"{path}: rope_scaling is not supported by the reference")
        if raw.get("attention_bias"):
            raise ValueError(f"{path}: attention_bias is not supported by the reference")
        heads = raw["num_attention_heads"]
        head_dim = raw["hidden_size"] // heads
        if mt in ("qwen3_moe", "dots1") and raw.get("head_dim"):
            head_dim = raw["head_dim"]
        common = dict(
            model_type=mt, hidden_size=raw["hidden_size"], num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim, vocab_size=raw["vocab_size"], rms_norm_eps=raw["rms_norm_eps"],
            rope_theta=raw["rope_theta"], max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=raw.get("tie_word_embeddings", False), top_k=raw["num_experts_per_tok"],
            norm_topk_prob=raw["norm_topk_prob"])
        if mt == "qwen2_moe":
            return cls(**common, num_experts=raw["num_experts"], expert_intermediate=raw["moe_intermediate_size"],
                       dense_intermediate=raw["intermediate_size"],
                       shared_intermediate=raw["shared_expert_intermediate_size"], qkv_bias=raw.get("qkv_bias", True),
                       shared_gate=True, mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
                       decoder_sparse_step=raw.get("decoder_sparse_step", 1))
        if mt == "qwen3_moe":
            return cls(**common, num_experts=raw["num_experts"], expert_intermediate=raw["moe_intermediate_size"],
                       dense_intermediate=raw["intermediate_size"], shared_intermediate=0, qk_norm="per_head",
                       mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
                       decoder_sparse_step=raw.get("decoder_sparse_step", 1))
        if mt == "olmoe":
            if raw.get("clip_qkv") is not None:
                raise ValueError(f"{path}: clip_qkv is not supported by the reference")
            return cls(**common, num_experts=raw["num_experts"], expert_intermediate=raw["intermediate_size"],
                       dense_intermediate=0, shared_intermediate=0, qk_norm="whole")
        return cls(**common, num_experts=raw["n_routed_experts"], expert_intermediate=raw["moe_intermediate_size"],
                   dense_intermediate=raw["intermediate_size"],
                   shared_intermediate=raw["moe_intermediate_size"] * raw["n_shared_experts"], qk_norm="per_head",
                   sigmoid_router=True, n_group=raw["n_group"], topk_group=raw["topk_group"],
                   routed_scaling_factor=raw["routed_scaling_factor"],
                   first_k_dense_replace=raw["first_k_dense_replace"])


def load_model(model_dir, dtype):
    """(cfg, weights): weights as {name: tensor in dtype}, every name and shape checked on use."""
    cfg = FamilyConfig.from_json(os.path.join(model_dir, "config.json"))
    return cfg, {name: t.to(dtype) for name, t in read_checkpoint(model_dir).items()}


class Weights:
    def __init__(self, tensors):
        self.tensors = tensors

    def __call__(self, name, shape):
        if name not in self.tensors:
            raise ValueError(f"checkpoint lacks tensor {name}")
        t = self.tensors[name]
        if list(t.shape) != list(shape):
            raise ValueError(f"tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        return t


def mlp(x, w, prefix, d, width, quant=None):
    """HF's <Family>MLP: down(silu(gate(x)) * up(x)).

    quant (fmt, group) models `moex --weights fmt` for a routed expert: its weights dequantized as MoEX
    quantizes them, its inputs rounded as the kernels round them (quantize_ref.py, as in mixtral_ref.py).
    """
    gate = w(prefix + "gate_proj.weight", [width, d])
    up = w(prefix + "up_proj.weight", [width, d])
    down = w(prefix + "down_proj.weight", [d, width])
    act = lambda v: v  # noqa: E731
    if quant:
        import quantize_ref
        gate, up, down = (quantize_ref.dequantize(m, *quant).to(m.dtype) for m in (gate, up, down))
        act = quantize_ref.activation_rounding(*quant)
    x = act(x)
    return act(torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def attention(x, w, p, cfg, cos, sin, ablate):
    T, H, KV, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    d = cfg.hidden_size
    q = x @ w(p + "q_proj.weight", [H * hd, d]).t()
    k = x @ w(p + "k_proj.weight", [KV * hd, d]).t()
    v = x @ w(p + "v_proj.weight", [KV * hd, d]).t()
    if cfg.qkv_bias and ablate != "qkv_bias":
        q = q + w(p + "q_proj.bias", [H * hd])
        k = k + w(p + "k_proj.bias", [KV * hd])
        v = v + w(p + "v_proj.bias", [KV * hd])
    if cfg.qk_norm == "whole" and ablate != "qk_norm":  # olmoe: before the split into heads
        q = rms_norm(q, w(p + "q_norm.weight", [H * hd]), cfg.rms_norm_eps)
        k = rms_norm(k, w(p + "k_norm.weight", [KV * hd]), cfg.rms_norm_eps)
    q, k, v = q.view(T, H, hd), k.view(T, KV, hd), v.view(T, KV, hd)
    if cfg.qk_norm == "per_head" and ablate != "qk_norm":  # qwen3_moe, dots1: over each head's hd
        q = rms_norm(q, w(p + "q_norm.weight", [hd]), cfg.rms_norm_eps)
        k = rms_norm(k, w(p + "k_norm.weight", [hd]), cfg.rms_norm_eps)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)   # [heads, T, hd]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    group = H // KV
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = (probs @ v).transpose(0, 1).reshape(T, H * hd)
    return out @ w(p + "o_proj.weight", [d, H * hd]).t()


def descending(values):
    """Indices of values [T, E] from largest to smallest, lower index first among equals."""
    return torch.sort(-values, dim=-1, stable=True).indices


def route_softmax(logits, cfg):
    """qwen2_moe / qwen3_moe / olmoe: softmax over all experts, top-k, renormalised with norm_topk_prob."""
    probs = torch.softmax(logits, dim=-1)
    ids = descending(logits)[:, :cfg.top_k]
    weights = probs.gather(-1, ids)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def route_sigmoid_grouped(logits, bias, cfg, ablate):
    """dots1 / DeepSeek-V3 (HF Dots1TopkRouter): see the module docstring."""
    scores = logits.sigmoid()
    choice = scores + (0 if ablate == "correction_bias" else bias)
    E, groups = cfg.num_experts, cfg.n_group
    if groups > 1 and ablate != "groups":
        grouped = choice.view(-1, groups, E // groups)
        group_scores = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)   # [T, groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, descending(group_scores)[:, :cfg.topk_group], True)
        mask = keep.unsqueeze(-1).expand(-1, groups, E // groups).reshape(-1, E)
        choice = choice.masked_fill(~mask, 0.0)
    ids = descending(choice)[:, :cfg.top_k]
    weights = scores.gather(-1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if ablate != "scaling":
        weights = weights * cfg.routed_scaling_factor
    return ids, weights


def moe_block(x, w, layer, cfg, ablate, quant=None):
    d, E = cfg.hidden_size, cfg.num_experts
    prefix = f"model.layers.{layer}.mlp."
    logits = x @ w(prefix + "gate.weight", [E, d]).t()
    if cfg.sigmoid_router:
        ids, weights = route_sigmoid_grouped(logits, w(prefix + "gate.e_score_correction_bias", [E]), cfg, ablate)
    else:
        ids, weights = route_softmax(logits, cfg)
    out = torch.zeros_like(x)
    for e in range(E):
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        y = mlp(x[token_idx], w, f"{prefix}experts.{e}.", d, cfg.expert_intermediate, quant)
        out.index_add_(0, token_idx, y * weights[token_idx, slot].unsqueeze(-1))
    if cfg.shared_intermediate and ablate != "shared_expert":
        name = "shared_expert." if cfg.model_type == "qwen2_moe" else "shared_experts."
        shared = mlp(x, w, prefix + name, d, cfg.shared_intermediate)
        if cfg.shared_gate and ablate != "shared_gate":
            shared = torch.sigmoid(x @ w(prefix + "shared_expert_gate.weight", [1, d]).t()) * shared
        out = out + shared
    return out


def forward(cfg, tensors, ids, ablate=None, quant=None):
    """Logits [T, V] of token ids at positions 0..T-1."""
    w = Weights(tensors)
    if not ids or any(not 0 <= i < cfg.vocab_size for i in ids):
        raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
    if len(ids) > cfg.max_position_embeddings:
        raise ValueError(f"{len(ids)} tokens exceed max_position_embeddings {cfg.max_position_embeddings}")
    d = cfg.hidden_size
    dtype = tensors["model.embed_tokens.weight"].dtype
    cos, sin = rope_cos_sin(len(ids), cfg.head_dim, cfg.rope_theta, dtype)
    x = w("model.embed_tokens.weight", [cfg.vocab_size, d])[torch.tensor(ids)]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = rms_norm(x, w(p + "input_layernorm.weight", [d]), cfg.rms_norm_eps)
        x = x + attention(h, w, p + "self_attn.", cfg, cos, sin, ablate)
        h = rms_norm(x, w(p + "post_attention_layernorm.weight", [d]), cfg.rms_norm_eps)
        if cfg.moe_layer(layer):
            x = x + moe_block(h, w, layer, cfg, ablate, quant)
        elif ablate != "dense_layers":
            x = x + mlp(h, w, p + "mlp.", d, cfg.dense_intermediate)
    lm_head = tensors.get("lm_head.weight")
    if lm_head is None and cfg.tie_word_embeddings:
        lm_head = tensors["model.embed_tokens.weight"]
    return rms_norm(x, w("model.norm.weight", [d]), cfg.rms_norm_eps) @ Weights({"lm_head.weight": lm_head})(
        "lm_head.weight", [cfg.vocab_size, d]).t()


def greedy_decode(cfg, tensors, prompt, steps, ablate=None, quant=None):
    seq = list(prompt)
    rows, tokens = [forward(cfg, tensors, seq, ablate, quant)], []
    for _ in range(steps):
        tokens.append(int(torch.argmax(rows[-1][-1])))  # first maximum: ties go to the lower id
        seq.append(tokens[-1])
        rows.append(forward(cfg, tensors, seq, ablate, quant)[-1:])
    return torch.cat(rows), tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description="MoE family reference logits (PyTorch); see the docstring.")
    parser.add_argument("--model", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--decode", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(COMPUTE_DTYPES), default="float64")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens-out")
    parser.add_argument("--ablate", choices=ABLATIONS)
    parser.add_argument("--expert-weights", choices=["bf16", "int8", "int4", "fp8"],
                        help="model moex --weights: routed experts quantized as MoEX quantizes them")
    parser.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128], help="int4 group size")
    args = parser.parse_args(argv)
    if args.decode < 0:
        parser.error("--decode must be >= 0")
    ids = [int(t) for t in args.ids.split(",")]
    cfg, tensors = load_model(args.model, COMPUTE_DTYPES[args.dtype])
    quant = (args.expert_weights, args.group_size) if args.expert_weights else None
    logits, tokens = greedy_decode(cfg, tensors, ids, args.decode, args.ablate, quant)
    np.save(args.out, logits.to(torch.float32).numpy())
    if args.tokens_out:
        with open(args.tokens_out, "w") as f:
            f.writelines(f"{t}\n" for t in tokens)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, KeyError) as err:
        sys.exit(f"families_ref: {err}")
