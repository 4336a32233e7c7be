"""The expert weight formats of `moex --weights`, written from their definitions (src/moex/kernels/packed.h):
what a weight becomes after quantization, and what the activations become before the kernels read them.

Shares no code with the engine. The quantizers compute in float32 as the definitions do (absmax, scale
= absmax / 127, q = round-half-even(w * (127 / absmax)), ...), so the codes are the ones MoEX picks;
dequantized weights are returned in float64 for the reference's float64 forward pass.

  bf16   w rounded to bf16 (round-half-even); activations rounded to bf16 before each product
  int8   per output row: scale = absmax / 127, q = clamp(rne(w * (127 / absmax)), -127, 127), w' = q * scale;
         activations f32 (weight-only); where the engine runs int8 on s16 codes (`moex info`: int8=avx512vnni,
         VNNI CPUs without AMX) each token's K groups of 128 become s16 codes first: scale = absmax / 32767,
         q = clamp(rne(x * (32767 / absmax)), -32767, 32767) (int16_token_groups; the drivers ask `moex info`
         and set MOEX_REF_INT8_ACTIVATIONS=s16 for the reference, engine_int8_activations)
  int8-w8a8  weights as int8; activations per token (row): scale = absmax / 127, q = clamp(rne(x * (127 / absmax)),
         -127, 127), x' = q * scale (vpdpbusd sums the codes exactly)
  int4   per output row and group of G input columns, symmetric: the range includes 0, scale = max(-lo, hi) / 7,
         q = clamp(rne(w / scale) + 8, 0, 15), w' = (q - 8) * scale; activations rounded to bf16
  int4-w4a8  weights as int4; activations as int8-w8a8's but per token and group of G input columns (the
         weights' groups), each group with its own absmax / 127 scale
  fp8    per 128x128 block: scale = absmax / 448, w' = e4m3(w / scale) * scale (e4m3: round-half-even to
         3 mantissa bits, subnormals below 2^-6, saturating at 448); activations f32
"""
import os

import numpy as np
import torch

FORMATS = ("bf16", "int8", "int8-w8a8", "int4", "int4-w4a8", "fp8")


def round_bf16(x):
    """Values rounded to the nearest bf16 (ties to even), in x's dtype."""
    bits = x.to(torch.float32).numpy().view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return torch.from_numpy(rounded.astype(np.uint32).view(np.float32).copy()).to(x.dtype)


def _f32(w):
    return w.to(torch.float32)


def int8_rows(w):
    w = _f32(w)
    absmax = w.abs().amax(dim=1, keepdim=True)
    inv = torch.where(absmax > 0, torch.tensor(127.0, dtype=torch.float32) / absmax, torch.zeros_like(absmax))
    q = torch.clamp(torch.round(w * inv), -127, 127)  # torch.round: half to even
    scale = absmax / torch.tensor(127.0, dtype=torch.float32)
    return q.double() * scale.double()


def int8_tokens(x):
    """W8A8's activations: each row (token) quantized to s8 codes with its own scale, in x's dtype."""
    x32 = _f32(x)
    absmax = x32.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(absmax > 0, torch.tensor(127.0, dtype=torch.float32) / absmax, torch.zeros_like(absmax))
    q = torch.clamp(torch.round(x32 * inv), -127, 127)
    scale = absmax / torch.tensor(127.0, dtype=torch.float32)
    return (q.double() * scale.double()).to(x.dtype)


def int8_token_groups(x, group):
    """W4A8's activations: each token's columns c0..c0+group quantized as int8_tokens quantizes a row."""
    out = torch.empty_like(x)
    for c0 in range(0, x.shape[-1], group):
        out[..., c0:c0 + group] = int8_tokens(x[..., c0:c0 + group])
    return out


def int16_token_groups(x, group=128):
    """int8's activations on VNNI CPUs without AMX: each token's columns c0..c0+group as s16 codes with the
    group's absmax / 32767 scale (x86/packed_int8_avx512vnni.cc), in x's dtype."""
    out = torch.empty_like(x)
    for c0 in range(0, x.shape[-1], group):
        x32 = _f32(x[..., c0:c0 + group])
        absmax = x32.abs().amax(dim=-1, keepdim=True)
        inv = torch.where(absmax > 0, torch.tensor(32767.0, dtype=torch.float32) / absmax, torch.zeros_like(absmax))
        q = torch.clamp(torch.round(x32 * inv), -32767, 32767)
        scale = absmax / torch.tensor(32767.0, dtype=torch.float32)
        out[..., c0:c0 + group] = (q.double() * scale.double()).to(x.dtype)
    return out


def engine_int8_activations(moex, env=None):
    """'s16' where the engine (binary `moex`, under env) runs int8 on s16 activation codes, else 'f32': from the
    packed kernels line of `moex info` (int8=avx512vnni)."""
    import subprocess
    info = subprocess.run([moex, "info"], capture_output=True, text=True, check=True, env=env).stdout
    return "s16" if "int8=avx512vnni" in info else "f32"


def int4_groups(w, group):
    w = _f32(w)
    out = torch.empty(w.shape, dtype=torch.float64)
    for c0 in range(0, w.shape[1], group):
        block = w[:, c0:c0 + group]
        lo = torch.clamp(block.amin(dim=1, keepdim=True), max=0.0)
        hi = torch.clamp(block.amax(dim=1, keepdim=True), min=0.0)
        scale = torch.maximum(-lo, hi) / torch.tensor(7.0, dtype=torch.float32)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.where(scale > 0, torch.round(block / safe) + 8, torch.full_like(block, 8.0))
        q = torch.clamp(q, 0, 15)
        out[:, c0:c0 + group] = (q.double() - 8) * scale.double()
    return out


def e4m3(v):
    """float64 numpy values -> the nearest e4m3 values (ties to even), saturating at +-448."""
    a = np.abs(v)
    _, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1): exact, unlike floor(log2(a)) just below a power of two
    exponent = np.maximum(e.astype(np.float64) - 1, -6)  # below 2^-6 the subnormals share the step 2^-9
    step = np.exp2(exponent - 3)
    q = np.round(a / step) * step  # np.round: half to even; a / step is exact (powers of two)
    return np.sign(v) * np.minimum(q, 448.0)


def fp8_blocks(w):
    w = _f32(w)
    out = np.empty(w.shape, dtype=np.float64)
    for r0 in range(0, w.shape[0], 128):
        for c0 in range(0, w.shape[1], 128):
            block = w[r0:r0 + 128, c0:c0 + 128]
            absmax = block.abs().max()
            scale = absmax / torch.tensor(448.0, dtype=torch.float32)
            if float(scale) > 0:
                scaled = (block / scale).double().numpy()  # the float32 quotient, as the quantizer forms it
                out[r0:r0 + 128, c0:c0 + 128] = e4m3(scaled) * float(scale)
            else:
                out[r0:r0 + 128, c0:c0 + 128] = 0.0
    return torch.from_numpy(out)


def dequantize(w, fmt, group=128):
    """Expert weight w [out, in] as MoEX holds it under --weights fmt, float64."""
    if fmt == "bf16":
        return round_bf16(_f32(w)).double()
    if fmt in ("int8", "int8-w8a8"):
        return int8_rows(w)
    if fmt in ("int4", "int4-w4a8"):
        return int4_groups(w, group)
    if fmt == "fp8":
        return fp8_blocks(w)
    raise ValueError(f"unknown expert weight format {fmt!r} (one of {', '.join(FORMATS)})")


def activation_rounding(fmt, group=128):
    """What the format's kernels do to their input activations (gate/up's x and down's h)."""
    if fmt in ("bf16", "int4", "fp8"):
        return round_bf16
    if fmt == "int8-w8a8":
        return int8_tokens
    if fmt == "int4-w4a8":
        return lambda x: int8_token_groups(x, group)
    if fmt == "int8" and os.environ.get("MOEX_REF_INT8_ACTIVATIONS", "f32") == "s16":
        return int16_token_groups
    return lambda x: x


# ---------------------------------------------------------------------------------------------
# Quantized checkpoints, read from the files (`moex quantize` writes them; DeepSeek-style fp8 is written
# below). Dequantized here from the stored codes and scales by the conventions' definitions, sharing no code
# with MoEX:
#   compressed-tensors int-quantized  weight I8 [out, in], weight_scale [out, 1]:       w = q * scale[row];
#                                     with input_activations (int8, strategy token, dynamic: W8A8) each
#                                     token's input becomes int8 codes first, as int8_tokens defines
#   compressed-tensors pack-quantized weight_packed I32 [out, ceil(in/8)]: code c of a row is bits 4(c%8)..
#                                     of word c//8, stored as signed + 8; weight_scale [out, in/G];
#                                     weight_zero_point I32 [ceil(out/8), in/G] (asymmetric only, packed
#                                     along rows the same way): w = (q - zp) * scale[row, c//G]
#   compressed-tensors float-quantized weight F8_E4M3, weight_scale [out/128, in/128]: w = e4m3(q) * scale
#   fp8 blocks (DeepSeek-V3)          weight F8_E4M3, weight_scale_inv F32 [out/128, in/128]: the same
# ---------------------------------------------------------------------------------------------

import json as _json
import math as _math
import os as _os
import re as _re
import struct as _struct

_RAW = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "I8": "i1", "I32": "<i4", "I64": "<i8", "F8_E4M3": "u1", "U8": "u1"}


def e4m3_decode(codes):
    """uint8 e4m3fn codes -> float64 values (NaN for S.1111.111), from the format's definition."""
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp, man = (c >> 3) & 15, c & 7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * np.exp2(exp - 7.0))
    value = np.where((exp == 15) & (man == 7), np.nan, value)
    return sign * value


def e4m3_encode(values):
    """float64 values that are exactly e4m3 (e4m3() above) -> their uint8 codes."""
    table = e4m3_decode(np.arange(256, dtype=np.uint8))
    lookup = {float(v): i for i, v in enumerate(table) if not np.isnan(v) and i != 0x80}
    return np.array([lookup[float(v)] for v in values.ravel()], dtype=np.uint8).reshape(values.shape)


def read_raw_safetensors(path):
    """{name: numpy array in its stored dtype} of one file (BF16 as uint16 bits)."""
    with open(path, "rb") as f:
        (n,) = _struct.unpack("<Q", f.read(8))
        header = _json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = np.dtype(_RAW[info["dtype"]])
        begin, end = info["data_offsets"]
        count = _math.prod(info["shape"])
        assert end - begin == count * dt.itemsize, f"{path}: {name} has the wrong byte count"
        out[name] = (info["dtype"], np.frombuffer(data, dtype=dt, count=count, offset=begin).reshape(info["shape"]))
    return out


def read_raw_checkpoint(model_dir):
    index = _os.path.join(model_dir, "model.safetensors.index.json")
    if _os.path.exists(index):
        files = sorted(set(_json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        out.update(read_raw_safetensors(_os.path.join(model_dir, f)))
    return out


def _floats(entry):
    dtype, a = entry
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def _unpack_int4(words, count, axis):
    """int32 words holding 8 nibbles each (nibble i at bits 4i) -> unsigned codes, unpacked along `axis`."""
    w = words.view(np.uint32)
    nibbles = np.stack([(w >> (4 * i)) & 15 for i in range(8)], axis=axis + 1)  # [..., words, 8, ...]
    shape = list(w.shape)
    shape[axis] *= 8
    codes = nibbles.reshape(shape)
    return np.take(codes, range(count), axis=axis).astype(np.int64)


def dequantize_checkpoint(model_dir):
    """(tensors {name: float64 torch tensor} with every quantized module's `.weight` dequantized,
    {module: format name} of the quantized modules) for a checkpoint with a quantization_config."""
    config = _json.load(open(_os.path.join(model_dir, "config.json")))
    q = config["quantization_config"]
    raw = read_raw_checkpoint(model_dir)
    tensors, formats = {}, {}
    schemes = {}
    w8a8 = False  # an int-quantized group with int8 input activations per token (llm-compressor's W8A8)
    if q["quant_method"] == "compressed-tensors":
        for group in q["config_groups"].values():
            schemes[group.get("format") or q["format"]] = group["weights"]
            act = group.get("input_activations")
            if act:
                assert act["num_bits"] == 8 and act["strategy"] == "token" and act["dynamic"], act
                w8a8 = True
    modules = sorted({n.rsplit(".", 1)[0] for n in raw})
    done = set()
    for m in modules:
        scale_inv = raw.get(m + ".weight_scale_inv")
        if m + ".weight_packed" in raw:  # pack-quantized int4
            rows, cols = (int(v) for v in raw[m + ".weight_shape"][1])
            args = schemes["pack-quantized"]
            g = args["group_size"]
            codes = _unpack_int4(raw[m + ".weight_packed"][1], cols, axis=1)  # [rows, cols], signed + 8
            scale = _floats(raw[m + ".weight_scale"])                         # [rows, cols / g]
            if args.get("symmetric", True):
                zero = np.full(scale.shape, 8, dtype=np.int64)
            else:
                zero = _unpack_int4(raw[m + ".weight_zero_point"][1], rows, axis=0)
            col_group = np.arange(cols) // g
            w = (codes - zero[:, col_group]) * scale[:, col_group]
            formats[m] = "int4"
            done.update({m + ".weight_packed", m + ".weight_scale", m + ".weight_shape", m + ".weight_zero_point"})
        elif m + ".weight" in raw and raw[m + ".weight"][0] == "I8":  # int-quantized int8 per channel
            codes = raw[m + ".weight"][1].astype(np.int64)
            scale = _floats(raw[m + ".weight_scale"]).reshape(-1, 1)
            w = codes * scale
            formats[m] = "int8-w8a8" if w8a8 else "int8"
            done.update({m + ".weight", m + ".weight_scale"})
        elif m + ".weight" in raw and raw[m + ".weight"][0] == "F8_E4M3":  # fp8 per 128x128 block
            name = ".weight_scale_inv" if scale_inv is not None else ".weight_scale"
            values = e4m3_decode(raw[m + ".weight"][1])
            scale = _floats(raw[m + name])
            rows, cols = values.shape
            w = values * np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:rows, :cols]
            formats[m] = "fp8"
            done.update({m + ".weight", m + name})
        else:
            continue
        tensors[m + ".weight"] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float64))
    for name, entry in raw.items():
        if name not in done:
            tensors[name] = torch.from_numpy(_floats(entry))
    return tensors, formats


def write_safetensors(path, arrays):
    """{name: (dtype name, numpy array)} -> one safetensors file (names sorted, header padded to 8)."""
    header, offset, blobs = {}, 0, []
    for name in sorted(arrays):
        dtype, a = arrays[name]
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    text = _json.dumps(header, separators=(",", ":"))
    text += " " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(_struct.pack("<Q", len(text)))
        f.write(text.encode())
        for b in blobs:
            f.write(b)


FP8_MODULE = _re.compile(r".*\.(self_attn\.[qkvo]_proj|experts\.\d+\.w[123])$")


def write_fp8_blocks_checkpoint(src_dir, out_dir):
    """A DeepSeek-V3-style FP8 copy of a bf16/f32 checkpoint: experts and attention projections as F8_E4M3
    with weight_scale_inv F32 per 128x128 block (scale = absmax / 448, code = e4m3(w / scale)), the rest as
    stored; config.json with quant_method "fp8", weight_block_size [128, 128]."""
    _os.makedirs(out_dir, exist_ok=True)
    raw = read_raw_checkpoint(src_dir)
    out = {}
    for name, (dtype, a) in raw.items():
        m = name[:-len(".weight")] if name.endswith(".weight") else None
        if m is None or not FP8_MODULE.match(m):
            out[name] = (dtype, a)
            continue
        w = torch.from_numpy(_floats((dtype, a)).astype(np.float32))
        rows, cols = w.shape
        codes = np.zeros((rows, cols), dtype=np.uint8)
        scales = np.zeros(((rows + 127) // 128, (cols + 127) // 128), dtype=np.float32)
        for r0 in range(0, rows, 128):
            for c0 in range(0, cols, 128):
                block = w[r0:r0 + 128, c0:c0 + 128]
                scale = block.abs().max() / torch.tensor(448.0, dtype=torch.float32)
                scales[r0 // 128, c0 // 128] = float(scale)
                if float(scale) > 0:
                    codes[r0:r0 + 128, c0:c0 + 128] = e4m3_encode(e4m3((block / scale).double().numpy()))
        out[m + ".weight"] = ("F8_E4M3", codes)
        out[m + ".weight_scale_inv"] = ("F32", scales)
    write_safetensors(_os.path.join(out_dir, "model.safetensors"), out)
    config = _json.load(open(_os.path.join(src_dir, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    with open(_os.path.join(out_dir, "config.json"), "w") as f:
        _json.dump(config, f, indent=2)
    for side in ("tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        if _os.path.exists(_os.path.join(src_dir, side)):
            with open(_os.path.join(src_dir, side), "rb") as a, open(_os.path.join(out_dir, side), "wb") as b:
                b.write(a.read())
