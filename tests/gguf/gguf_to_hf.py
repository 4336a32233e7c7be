#!/usr/bin/env python3
"""A GGUF file (llama architecture with experts, as `moex convert` and llama.cpp's converter write it) read
and dequantized in numpy, written back as an f32 Hugging Face folder for the PyTorch reference.

Written from the GGUF spec and ggml's block definitions, independently of MoEX's C++ reader:
  Q8_0  blocks of 32: f16 d, 32 x int8 q;            x = d * q
  Q4_0  blocks of 32: f16 d, 16 bytes;               x = d * (q - 8), byte j = element j (low) | j+16 (high)
  Q4_K  blocks of 256: f16 d, f16 dmin, 12 bytes of eight 6-bit (scale, min), 128 bytes of nibbles;
        x = d * sc * q - dmin * m; bytes 32c..32c+31 hold sub-block 2c (low nibble) and 2c+1 (high)
and llama.cpp's rotary layout: attn_q / attn_k store HF row (h * hd/2 + j) of a head at row (2 j + h).
Usage: gguf_to_hf.py FILE.gguf CONFIG.json OUT_DIR
"""
import json
import os
import struct
import sys

import numpy as np

SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
BLOCK = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18), 12: (256, 144)}


class Reader:
    def __init__(self, data):
        self.d, self.p = data, 0

    def take(self, n):
        if self.p + n > len(self.d):
            raise ValueError("truncated")
        b = self.d[self.p:self.p + n]
        self.p += n
        return b

    def fmt(self, f):
        return struct.unpack(f, self.take(struct.calcsize(f)))[0]

    def string(self):
        return self.take(self.fmt("<Q")).decode("utf-8", "surrogateescape")

    def value(self, t):
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.fmt("<I"), self.fmt("<Q")
            return [self.value(et) for _ in range(n)]
        return self.fmt(SCALAR[t])


def read_gguf(path):
    data = open(path, "rb").read()
    r = Reader(data)
    assert r.take(4) == b"GGUF" and r.fmt("<I") == 3
    n_tensors, n_kv = r.fmt("<Q"), r.fmt("<Q")
    meta = {}
    for _ in range(n_kv):
        k = r.string()
        meta[k] = r.value(r.fmt("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        ne = [r.fmt("<Q") for _ in range(r.fmt("<I"))]
        infos.append((name, ne, r.fmt("<I"), r.fmt("<Q")))
    align = meta.get("general.alignment", 32)
    start = (r.p + align - 1) // align * align
    tensors = {}
    for name, ne, t, off in infos:
        n = int(np.prod(ne))
        block, nbytes = BLOCK[t]
        raw = np.frombuffer(data, np.uint8, n // block * nbytes, start + off)
        rows = n // ne[0]
        tensors[name] = dequantize(t, raw, n).reshape(list(reversed(ne)) if len(ne) > 1 else [ne[0]])
        assert tensors[name].size == rows * ne[0]
    return meta, tensors


def f16(b):  # [..., 2] uint8 -> float32
    return b.copy().view(np.float16).astype(np.float32)[..., 0]


def dequantize(t, raw, n):
    if t == 0:
        return raw.view(np.float32).copy()
    if t == 1:
        return raw.view(np.float16).astype(np.float32)
    if t == 30:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if t == 8:
        b = raw.reshape(-1, 34)
        return (f16(b[:, :2])[:, None] * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    if t == 2:
        b = raw.reshape(-1, 18)
        q = b[:, 2:]
        codes = np.concatenate([q & 15, q >> 4], axis=1).astype(np.float32) - 8
        return (f16(b[:, :2])[:, None] * codes).reshape(-1)
    if t == 12:
        b = raw.reshape(-1, 144)
        d, dmin, s, qs = f16(b[:, 0:2]), f16(b[:, 2:4]), b[:, 4:16].astype(np.int32), b[:, 16:]
        sc = np.zeros((len(b), 8), np.float32)
        mn = np.zeros((len(b), 8), np.float32)
        for j in range(8):
            if j < 4:
                sc[:, j], mn[:, j] = s[:, j] & 63, s[:, j + 4] & 63
            else:
                sc[:, j] = (s[:, j + 4] & 15) | ((s[:, j - 4] >> 6) << 4)
                mn[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
        out = np.zeros((len(b), 256), np.float32)
        for c in range(4):
            q = qs[:, 32 * c:32 * c + 32]
            for half, codes in ((0, q & 15), (1, q >> 4)):
                sub = 2 * c + half
                step = (d * sc[:, sub]).astype(np.float32)[:, None]
                off = (dmin * mn[:, sub]).astype(np.float32)[:, None]
                out[:, 64 * c + 32 * half:64 * c + 32 * half + 32] = step * codes.astype(np.float32) - off
        return out.reshape(-1)
    raise ValueError(f"type {t}")


def unpermute(w, n_head):
    # GGUF row (head, j, h) -> HF row (head, h, j)
    rows, cols = w.shape
    hd = rows // n_head
    return w.reshape(n_head, hd // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def main():
    gguf, config_path, out = sys.argv[1:4]
    meta, t = read_gguf(gguf)
    cfg = json.load(open(config_path))
    H, KV, E = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"], meta["llama.expert_count"]
    hf = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"]}
    if "output.weight" in t:
        hf["lm_head.weight"] = t["output.weight"]
    for l in range(meta["llama.block_count"]):
        b, p = f"blk.{l}.", f"model.layers.{l}."
        hf[p + "input_layernorm.weight"] = t[b + "attn_norm.weight"]
        hf[p + "self_attn.q_proj.weight"] = unpermute(t[b + "attn_q.weight"], H)
        hf[p + "self_attn.k_proj.weight"] = unpermute(t[b + "attn_k.weight"], KV)
        hf[p + "self_attn.v_proj.weight"] = t[b + "attn_v.weight"]
        hf[p + "self_attn.o_proj.weight"] = t[b + "attn_output.weight"]
        hf[p + "post_attention_layernorm.weight"] = t[b + "ffn_norm.weight"]
        hf[p + "block_sparse_moe.gate.weight"] = t[b + "ffn_gate_inp.weight"]
        for e in range(E):
            x = p + f"block_sparse_moe.experts.{e}."
            hf[x + "w1.weight"] = t[b + "ffn_gate_exps.weight"][e]
            hf[x + "w3.weight"] = t[b + "ffn_up_exps.weight"][e]
            hf[x + "w2.weight"] = t[b + "ffn_down_exps.weight"][e]
    os.makedirs(out, exist_ok=True)
    cfg["torch_dtype"] = "float32"
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    write_safetensors(os.path.join(out, "model.safetensors"), hf)


if __name__ == "__main__":
    main()
