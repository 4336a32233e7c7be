#!/usr/bin/env python3
"""`moex bench quality` against its definition: for one prompt, KL(P_stored || P_format) per position and the
top-1 agreement, computed here in numpy (float64) from `moex logits` of the as-stored model and of the format,
must equal what the benchmark reports; and a coarser format must not look better than a finer one.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return r.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    args = p.parse_args()
    model = os.path.join(args.workdir, "model")
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.exists(os.path.join(model, "config.json")):
        run([args.moex, "gen-model", "--preset", "tiny", "--seed", "21", "--out", model])
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    ids = ",".join(str(i) for i in np.random.default_rng(3).integers(3, vocab, size=40))
    base = os.path.join(args.workdir, "base.npy")
    run([args.moex, "logits", "--model", model, "--ids", ids, "--out", base, "--exact"])
    lp_base = np.load(base).astype(np.float64)
    lp_base -= np.log(np.exp(lp_base - lp_base.max(1, keepdims=True)).sum(1, keepdims=True)) + lp_base.max(1, keepdims=True)
    failures, kl_means = [], {}
    for fmt in ("int8", "int4"):
        out = os.path.join(args.workdir, fmt + ".npy")
        run([args.moex, "logits", "--model", model, "--ids", ids, "--out", out, "--weights", fmt,
             "--dense-weights", "as-stored", "--kv-cache-dtype", "f32"])
        q = np.load(out).astype(np.float64)
        top1 = 100.0 * np.mean(np.argmax(q, 1) == np.argmax(lp_base, 1))
        q -= np.log(np.exp(q - q.max(1, keepdims=True)).sum(1, keepdims=True)) + q.max(1, keepdims=True)
        kl = np.maximum((np.exp(lp_base) * (lp_base - q)).sum(1), 0)
        report = json.loads(run([args.moex, "bench", "quality", "--model", model, "--weights", fmt, "--dense-weights", "as-stored",
                                  "--kv-cache-dtype", "f32", "--ids", ids, "--json"]))
        kl_means[fmt] = report["kl_mean"]
        print(f"{fmt}: numpy KL mean {kl.mean():.6e}, max {kl.max():.6e}, top-1 {top1:.2f}% | bench quality "
              f"{report['kl_mean']:.6e}, {report['kl_max']:.6e}, {report['top1_agree_percent']:.2f}%")
        if report["positions"] != len(kl):
            failures.append(f"{fmt}: {report['positions']} positions, expected {len(kl)}")
        if not np.isclose(report["kl_mean"], kl.mean(), rtol=1e-4, atol=1e-9) or not np.isclose(
                report["kl_max"], kl.max(), rtol=1e-4, atol=1e-9):
            failures.append(f"{fmt}: KL differs from the definition")
        if abs(report["top1_agree_percent"] - top1) > 1e-9:
            failures.append(f"{fmt}: top-1 agreement differs")
        # The stored model's gap between its two best logits, everywhere and where the format's top-1 differs.
        two = np.sort(lp_base, 1)[:, -2:]
        gaps = two[:, 1] - two[:, 0]
        flips = gaps[np.argmax(q, 1) != np.argmax(lp_base, 1)]
        flip_max = flips.max() if len(flips) else 0.0
        want = {"top2_gap_median": np.sort(gaps)[len(gaps) // 2], "flip_top2_gap_max": flip_max,
                "top1_prob_median": np.sort(np.exp(two[:, 1]))[len(gaps) // 2]}
        for key, value in want.items():
            if not np.isclose(report[key], value, rtol=1e-4, atol=1e-6):
                failures.append(f"{fmt}: {key} {report[key]} differs from numpy's {value}")
        if report["positions_above_flip_gap_max"] != int((gaps > flip_max).sum()):
            failures.append(f"{fmt}: positions_above_flip_gap_max differs")
    if not kl_means["int4"] > kl_means["int8"] > 0:
        failures.append(f"KL int4 {kl_means['int4']} should exceed int8 {kl_means['int8']} > 0")
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
