#!/usr/bin/python3
"""MoEX expert capacity against the PyTorch reference, on a checkpoint with a skewed router.

Generates a model with `moex gen-model --router-skew` (once, into --workdir), then on one random prompt:
  1. capacity factor C (default 1.0): `moex logits --capacity-factor C --stats-out` against
     mixtral_ref.py --capacity-factor C --stats-out. Logits agree within --tol relative to the largest
     logit (prompt and greedy decode rows); per layer, MoEX's drops equal sum over experts of
     max(0, routed - capacity) and equal the reference's drops, expert by expert; some layer drops.
  2. dropless: MoEX and the reference without capacity agree, MoEX reports zero drops, and a capacity
     factor of E/k (capacity = T: nothing can overflow) gives exactly the dropless logits.
  3. every --router-fusion mode gives the same logits as the default.
"""
import argparse
import json
import math
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


def rel_diff(a, b):
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--gen-args", default="--preset tiny --seed 21 --router-skew 1.5",
                   help="arguments for moex gen-model (must include --router-skew)")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--decode", type=int, default=4)
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    model = os.path.join(args.workdir, "model")
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.exists(os.path.join(model, "config.json")):
        run([args.moex, "gen-model", *args.gen_args.split(), "--out", model])
    config = json.load(open(os.path.join(model, "config.json")))
    num_experts, k = config["num_local_experts"], config["num_experts_per_tok"]
    rng = np.random.default_rng(args.seed)
    ids = ",".join(str(i) for i in rng.integers(3, config["vocab_size"], size=args.prompt_len))
    failures = []

    def moex_logits(name, *flags):
        out, stats = os.path.join(args.workdir, name + ".npy"), os.path.join(args.workdir, name + ".json")
        run([args.moex, "logits", "--model", model, "--ids", ids, "--decode", str(args.decode), "--out", out,
             "--stats-out", stats, "--exact", *flags])
        return np.load(out), json.load(open(stats))

    def ref_logits(name, *flags):
        out, stats = os.path.join(args.workdir, name + ".npy"), os.path.join(args.workdir, name + ".json")
        run([sys.executable, os.path.join(HERE, "mixtral_ref.py"), "--model", model, "--ids", ids, "--decode",
             str(args.decode), "--out", out, "--stats-out", stats, *flags])
        return np.load(out), json.load(open(stats))

    def expect_close(what, ours, theirs, tol):
        if ours.shape != theirs.shape:
            failures.append(f"{what}: shape {ours.shape} != {theirs.shape}")
            return
        rel = rel_diff(ours, theirs)
        print(f"{what}: max |diff| / max |logit| = {rel:.3e} (tol {tol:g})")
        if not rel <= tol:
            failures.append(f"{what}: {rel:.3e} > {tol:g}")

    # 1. With capacity.
    factor = str(args.capacity_factor)
    ours, our_stats = moex_logits("moex_capacity", "--capacity-factor", factor)
    theirs, ref_stats = ref_logits("ref_capacity", "--capacity-factor", factor)
    expect_close(f"capacity factor {factor}", ours, theirs, args.tol)
    capacity = math.ceil(k * args.prompt_len / num_experts * args.capacity_factor)
    if our_stats["capacity"] != capacity or ref_stats["capacity"] != capacity:
        failures.append(f"capacity: moex {our_stats['capacity']}, reference {ref_stats['capacity']}, "
                        f"formula {capacity}")
    total_drops = 0
    for layer, (mine, ref) in enumerate(zip(our_stats["layers"], ref_stats["layers"], strict=True)):
        routed = mine["tokens_per_expert"]
        overflow = sum(max(0, c - capacity) for c in routed)
        print(f"layer {layer}: routed {routed} capacity {capacity} -> moex drops {mine['drops']} "
              f"(overflow {overflow}), reference drops {ref['drops']}")
        if routed != ref["tokens_per_expert"]:
            failures.append(f"layer {layer}: routed per expert {routed} != reference {ref['tokens_per_expert']}")
        if not mine["drops"] == overflow == ref["drops"]:
            failures.append(f"layer {layer}: drops moex {mine['drops']}, overflow {overflow}, reference {ref['drops']}")
        if mine["drops_per_expert"] != ref["drops_per_expert"]:
            failures.append(f"layer {layer}: drops per expert {mine['drops_per_expert']} != "
                            f"reference {ref['drops_per_expert']}")
        if [min(c, capacity) for c in routed] != mine["kept_per_expert"]:
            failures.append(f"layer {layer}: kept per expert {mine['kept_per_expert']} != min(routed, capacity)")
        total_drops += mine["drops"]
    if total_drops == 0:
        failures.append("no layer dropped anything: the router is not skewed enough to test capacity")

    # 2. Dropless.
    dropless, dropless_stats = moex_logits("moex_dropless")
    ref_dropless, _ = ref_logits("ref_dropless")
    expect_close("dropless", dropless, ref_dropless, args.tol)
    if any(layer["drops"] for layer in dropless_stats["layers"]):
        failures.append("dropless run reported drops")
    roomy, roomy_stats = moex_logits("moex_roomy", "--capacity-factor", str(num_experts / k))
    expect_close(f"capacity factor E/k = {num_experts / k:g} vs dropless", roomy, dropless, 1e-6)
    if any(layer["drops"] for layer in roomy_stats["layers"]):
        failures.append("capacity = T reported drops")
    if rel_diff(ours, dropless) < 1e-6:
        failures.append("capacity made no difference to the logits")

    # 3. Router fusion modes.
    for mode in ("none", "topk_softmax"):
        fused, _ = moex_logits("moex_" + mode, "--capacity-factor", factor, "--router-fusion", mode)
        expect_close(f"router fusion {mode} vs full", fused, ours, 1e-6)

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
