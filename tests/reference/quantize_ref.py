"""The expert weight formats of `moex --weights`, written from their definitions (src/moex/kernels/packed.h):
what a weight becomes after quantization, and what the activations become before the kernels read them.

Shares no code with the engine. The quantizers compute in float32 as the definitions do (absmax, scale
= absmax / 127, q = round-half-even(w * (127 / absmax)), ...), so the codes are the ones MoEX picks;
dequantized weights are returned in float64 for the reference's float64 forward pass.

  bf16   w rounded to bf16 (round-half-even); activations rounded to bf16 before each product
  int8   per output row: scale = absmax / 127, q = clamp(rne(w * (127 / absmax)), -127, 127), w' = q * scale;
         activations f32 (weight-only)
  int8-w8a8  weights as int8; activations per token (row): scale = absmax / 127, q = clamp(rne(x * (127 / absmax)),
         -127, 127), x' = q * scale (vpdpbusd sums the codes exactly)
  int4   per output row and group of G input columns, symmetric: the range includes 0, scale = max(-lo, hi) / 7,
         q = clamp(rne(w / scale) + 8, 0, 15), w' = (q - 8) * scale; activations rounded to bf16
  fp8    per 128x128 block: scale = absmax / 448, w' = e4m3(w / scale) * scale (e4m3: round-half-even to
         3 mantissa bits, subnormals below 2^-6, saturating at 448); activations f32
"""
import numpy as np
import torch

FORMATS = ("bf16", "int8", "int8-w8a8", "int4", "fp8")


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
    if fmt == "int4":
        return int4_groups(w, group)
    if fmt == "fp8":
        return fp8_blocks(w)
    raise ValueError(f"unknown expert weight format {fmt!r} (one of {', '.join(FORMATS)})")


def activation_rounding(fmt):
    """What the format's kernels do to their input activations (gate/up's x and down's h)."""
    if fmt in ("bf16", "int4"):
        return round_bf16
    if fmt == "int8-w8a8":
        return int8_tokens
    return lambda x: x
