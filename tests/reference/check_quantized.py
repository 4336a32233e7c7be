#!/usr/bin/env python3
"""MoEX on a quantized checkpoint against the PyTorch reference that reads the same files itself.

1. `moex gen-model` writes a bf16/f32 checkpoint (once, into --workdir/model).
2. The quantized checkpoint: `moex quantize --weights F` (compressed-tensors), or, with --source fp8-blocks,
   a DeepSeek-V3-style FP8 copy written here in Python (quantize_ref.write_fp8_blocks_checkpoint).
3. `moex logits` on the quantized checkpoint; mixtral_ref.py's forward pass on the weights that
   quantize_ref.dequantize_checkpoint reads from the files (codes times scales, by the conventions'
   definitions), with the activations of int4 modules rounded to bf16 as MoEX's int4 kernel rounds them.
4. Every logit within --tol of the reference (relative to its largest), the greedy tokens identical; and the
   test must be able to fail: MoEX's logits must be more than --tol away from the unquantized model's.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mixtral_ref  # noqa: E402
import quantize_ref  # noqa: E402


def run(cmd, env=None):
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)}\n{result.stdout}{result.stderr}")
    return result.stdout if env is None else (result.stdout, result.stderr)


class RoundedInput:
    """Stands in for W [out, in] in mixtral_ref's `x @ W.t()`: rounds x first, as the int4 and fp8 kernels do."""

    def __init__(self, w, act):
        self.w, self.act = w, act

    def t(self):
        return self

    def __rmatmul__(self, x):
        return self.act(x) @ self.w.t()


def reference_model(model_dir):
    """MixtralRef over the dequantized files, each quantized module with its kernel's activation rounding (int4,
    fp8: bf16; int8-w8a8: int8 codes per token; int8: none)."""
    tensors, formats = quantize_ref.dequantize_checkpoint(model_dir)
    cfg = mixtral_ref.MixtralConfig.from_json(os.path.join(model_dir, "config.json"))
    model = mixtral_ref.MixtralRef(cfg, tensors, torch.float64)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        fmt = formats.get(p + "block_sparse_moe.experts.0.w1")
        if fmt in ("int4", "fp8", "int8-w8a8"):
            layer["expert_act"] = quantize_ref.activation_rounding(fmt)
        for key, proj in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            fmt = formats.get(p + "self_attn." + proj)
            if fmt in ("int4", "fp8", "int8-w8a8"):
                layer[key] = RoundedInput(layer[key], quantize_ref.activation_rounding(fmt))
    return model, formats


def at_load_reference(model_dir, fmt, group):
    """The unquantized checkpoint with experts, attention projections and lm_head quantized by quantize_ref (as
    `--weights F --dense-weights F` does at load), each with its kernel's activation rounding."""
    model = mixtral_ref.load_model(model_dir, torch.float64)
    act = quantize_ref.activation_rounding(fmt, group)
    formats = {}

    def q(w):
        return quantize_ref.dequantize(w, fmt, group).to(torch.float64)

    for i, layer in enumerate(model.layers):
        for name in ("w1", "w3", "w2"):
            layer[name] = [q(w) for w in layer[name]]
        layer["expert_act"] = act
        for key in ("wq", "wk", "wv", "wo"):
            layer[key] = RoundedInput(q(layer[key]), act)
            formats[f"{i}.{key}"] = fmt
    model.lm_head = RoundedInput(q(model.lm_head), act)
    formats["lm_head"] = fmt
    return model, formats


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--gen-args", required=True)
    p.add_argument("--source", choices=["quantize", "fp8-blocks", "at-load"], default="quantize",
                   help="at-load: MoEX quantizes at load (--weights F --dense-weights F in --moex-args) and the "
                        "reference quantizes the same modules with quantize_ref's own quantizers (--format F)")
    p.add_argument("--format", choices=list(quantize_ref.FORMATS), help="at-load: the format")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--quantize-args", default="", help="flags for moex quantize, e.g. '--weights int4 --group-size 32'")
    p.add_argument("--moex-args", default="", help="extra flags for moex logits")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--tol", type=float, required=True)
    p.add_argument("--s16-tol", type=float, default=None,
                   help="the tolerance instead where the engine runs int8 on s16 activation codes (quantize_ref.py): "
                        "an activation whose f32 and f64 values round to neighbouring codes moves by absmax/32767")
    args = p.parse_args()
    # int8's activations as this engine's kernels take them (quantize_ref.py: s16 codes on VNNI CPUs without AMX).
    os.environ["MOEX_REF_INT8_ACTIVATIONS"] = quantize_ref.engine_int8_activations(args.moex)
    if args.s16_tol is not None and os.environ["MOEX_REF_INT8_ACTIVATIONS"] == "s16":
        args.tol = args.s16_tol

    model = os.path.join(args.workdir, "model")
    quant = os.path.join(args.workdir, "quantized")
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.exists(os.path.join(model, "config.json")):
        run([args.moex, "gen-model", *args.gen_args.split(), "--out", model])
    if args.source == "quantize":
        print(run([args.moex, "quantize", "--model", model, *args.quantize_args.split(), "--out", quant, "--force"]), end="")
    elif args.source == "fp8-blocks":
        quantize_ref.write_fp8_blocks_checkpoint(model, quant)
        if os.path.exists(os.path.join(quant, "panels.moex")):
            os.remove(os.path.join(quant, "panels.moex"))
        print(run([args.moex, "pack", "--model", quant]), end="")  # panels.moex beside a checkpoint from elsewhere
    else:
        quant = model
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    ids = [int(i) for i in np.random.default_rng(0).integers(3, vocab, size=args.prompt_len)]

    ours = os.path.join(args.workdir, "moex.npy")
    launcher = [] if args.ranks == 1 else ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.ranks)]

    # An f32 KV cache as the reference keeps (the default bf16 one would round K and V) unless the test names one.
    moex_args = args.moex_args.split()
    if "--kv-cache-dtype" not in moex_args and "--exact" not in moex_args:
        moex_args += ["--kv-cache-dtype", "f32"]

    def moex_logits():
        _, err = run([*launcher, args.moex, "logits", "--model", quant, "--ids", ",".join(map(str, ids)), "--decode",
                      str(args.decode), "--out", ours, "--tokens-out", ours + ".tokens", *moex_args],
                     env={**os.environ, "MOEX_LOG_LEVEL": "2"})
        return np.load(ours).astype(np.float64), [int(t) for t in open(ours + ".tokens").read().split()], err

    # moex quantize writes panels.moex (the matrices already packed; moex pack beside the Python-written fp8
    # checkpoint), which a load maps: both that load and one that packs from the stored codes (the file moved
    # aside) must match the reference.
    runs = []
    panels = os.path.join(quant, "panels.moex")
    if args.source in ("quantize", "fp8-blocks"):
        if not os.path.exists(panels):
            sys.exit(f"FAILED: moex {'quantize' if args.source == 'quantize' else 'pack'} wrote no {panels}")
        a, t_ours, err = moex_logits()
        if "mapping the packed panels" not in err:
            sys.exit(f"FAILED: the load did not map {panels}:\n{err}")
        runs.append(("panels.moex mapped", a, t_ours))
        os.rename(panels, panels + ".aside")
        try:
            a, t_ours, err = moex_logits()
        finally:
            os.rename(panels + ".aside", panels)
        runs.append(("packed at load", a, t_ours))
    else:
        a, t_ours, _ = moex_logits()
        runs.append(("", a, t_ours))

    if args.source == "at-load":
        ref, formats = at_load_reference(model, args.format, args.group_size)
    else:
        ref, formats = reference_model(quant)
    kinds = sorted(set(formats.values()))
    print(f"reference reads {len(formats)} quantized modules ({', '.join(kinds)}) from {quant}")
    b, t_ref = mixtral_ref.greedy_decode(ref, ids, args.decode)
    b = b.numpy()
    failures = []
    for tag, a, t_ours in runs:
        label = f" ({tag})" if tag else ""
        if a.shape != b.shape:
            failures.append(f"shape {a.shape} != reference {b.shape}{label}")
            continue
        rel = float(np.abs(a - b).max() / np.abs(b).max())
        print(f"logits [{a.shape[0]} x {a.shape[1]}]{label}: max |moex - ref| / max |ref| = {rel:.3e} "
              f"(tol {args.tol})")
        if not rel <= args.tol:
            failures.append(f"relative error {rel:.3e} > {args.tol}{label}")
        if t_ours != t_ref:
            failures.append(f"greedy tokens {t_ours} differ from the reference's {t_ref}{label}")
    # The same comparison against the unquantized model (same prompt, greedy continuation of MoEX's tokens)
    # must fail, or the test could not tell a quantized checkpoint from the original.
    plain = mixtral_ref.load_model(model, torch.float64)
    rows = mixtral_ref.forward(plain, ids + t_ours)[0].numpy()
    rows = rows[: a.shape[0]]
    unq = float(np.abs(a - rows).max() / np.abs(rows).max())
    print(f"against the unquantized model: {unq:.3e} (must exceed the tolerance {args.tol})")
    if not unq > args.tol:
        failures.append(f"the unquantized model is within {args.tol} too ({unq:.3e}): the test cannot fail")
    for f in failures:
        print("FAIL:", f)
    print(f"{1 + 2 * len(runs) - len(failures)} passed, {len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
