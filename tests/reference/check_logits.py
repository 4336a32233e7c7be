#!/usr/bin/env python3
"""MoEX against the PyTorch reference on one generated checkpoint.

Generates the model with `moex gen-model` (once, into --workdir), runs `moex logits` and
the PyTorch reference of its family (mixtral_ref.py or families_ref.py) on the same random prompt, and checks that every logit agrees within --tol relative to
the largest logit and that the greedy decode tokens are identical.
"""
import argparse
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd):
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)}\n{result.stdout}{result.stderr}")
    return result.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--gen-args", required=True, help="arguments for moex gen-model, e.g. '--preset tiny'")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--s16-tol", type=float, default=None,
                   help="the tolerance instead where the engine runs int8 on s16 activation codes (quantize_ref.py): "
                        "an activation whose f32 and f64 values round to neighbouring codes moves by absmax/32767")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moex-args", default="", help="extra flags for moex logits")
    p.add_argument("--ref-args", default="", help="extra flags for mixtral_ref.py")
    p.add_argument("--expect-mismatch", action="store_true",
                   help="pass only when the logits disagree (with a deliberately incomplete reference, --ref-args)")
    p.add_argument("--ranks", type=int, default=1, help="run moex under mpirun -np RANKS (with a plan in --moex-args)")
    args = p.parse_args()

    model = os.path.join(args.workdir, "model")
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.exists(os.path.join(model, "config.json")):
        run([args.moex, "gen-model", *args.gen_args.split(), "--out", model])
    import json
    config = json.load(open(os.path.join(model, "config.json")))
    vocab = config["vocab_size"]
    # Mixtral's reference, or the other families' (families_ref.py), by the checkpoint's model_type.
    reference = "mixtral_ref.py" if config["model_type"] == "mixtral" else "families_ref.py"
    rng = np.random.default_rng(args.seed)
    ids = ",".join(str(i) for i in rng.integers(3, vocab, size=args.prompt_len))

    ours, theirs = os.path.join(args.workdir, "moex.npy"), os.path.join(args.workdir, "ref.npy")
    ours_tok, theirs_tok = ours + ".tokens", theirs + ".tokens"
    launcher = [] if args.ranks == 1 else ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.ranks)]
    # The exact path unless the test names a format: `--exact` (f32 activations, the weights as stored, an f32
    # KV cache), or with --weights F the dense layers as stored (the reference quantizes the experts only; moex's
    # default would pack them to bf16 too) and an f32 KV cache (the reference keeps K and V in f32; the default
    # bf16 cache would round them).
    moex_args = args.moex_args.split()
    if "--weights" not in moex_args:
        moex_args.append("--exact")
    else:
        if "--dense-weights" not in moex_args:
            moex_args += ["--dense-weights", "as-stored"]
        if "--kv-cache-dtype" not in moex_args:
            moex_args += ["--kv-cache-dtype", "f32"]
    run([*launcher, args.moex, "logits", "--model", model, "--ids", ids, "--decode", str(args.decode), "--out", ours,
         "--tokens-out", ours_tok, *moex_args])
    # int8's activations as this engine's kernels take them (quantize_ref.py: s16 codes on VNNI CPUs without AMX).
    sys.path.insert(0, HERE)
    import quantize_ref
    os.environ["MOEX_REF_INT8_ACTIVATIONS"] = quantize_ref.engine_int8_activations(args.moex)
    if args.s16_tol is not None and os.environ["MOEX_REF_INT8_ACTIVATIONS"] == "s16":
        args.tol = args.s16_tol
    run([sys.executable, os.path.join(HERE, reference), "--model", model, "--ids", ids, "--decode",
         str(args.decode), "--out", theirs, "--tokens-out", theirs_tok, *args.ref_args.split()])

    a, b = np.load(ours), np.load(theirs)
    failures = []
    if a.shape != b.shape:
        failures.append(f"shape {a.shape} != reference {b.shape}")
    else:
        rel = float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())
        print(f"logits [{a.shape[0]} positions x {a.shape[1]}]: max |moex - ref| / max |ref| = {rel:.3e} (tol {args.tol})")
        if not rel <= args.tol:
            failures.append(f"relative error {rel:.3e} > {args.tol}")
    t_ours, t_ref = open(ours_tok).read().split(), open(theirs_tok).read().split()
    print(f"greedy tokens: moex {' '.join(t_ours)}")
    if t_ours != t_ref:
        failures.append(f"greedy tokens differ from the reference: {' '.join(t_ref)}")
    if args.expect_mismatch:
        # Runs that fail exit 1 above; here only a disagreement passes.
        print("disagrees with the incomplete reference, as it must" if failures else
              "FAIL: agrees with a reference that lacks a part of the model: the comparison cannot see that part")
        sys.exit(0 if failures else 1)
    for f in failures:
        print("FAIL:", f)
    print(f"{2 - len(failures)} passed, {len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
