#!/usr/bin/env python3
"""Every parallel plan gives the single-rank answer.

For one generated checkpoint, runs `moex logits` on one rank, then under `mpirun -np N` for each plan
(tp, ep with tp attention, ep with dp attention, tp x ep, with and without overlap) and checks that the
logits agree within --tol relative to the largest logit and that the greedy tokens are identical
(fp32 communication). With --lossy it also runs bf16 and fp8 communication, requires identical greedy
tokens and reports the logit error.
"""
import argparse
import os
import subprocess
import sys

import numpy as np

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]


def run(cmd, timeout=300):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    return r.returncode == 0, r.stdout + r.stderr


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--gen-args", required=True)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--lossy", action="store_true")
    args = p.parse_args()
    moex = os.path.abspath(args.moex)
    model = os.path.join(args.workdir, "model")
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.exists(os.path.join(model, "config.json")):
        ok, out = run([moex, "gen-model", *args.gen_args.split(), "--out", model])
        if not ok:
            sys.exit(out)
    import json
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    ids = ",".join(str(i) for i in np.random.default_rng(3).integers(3, vocab, size=args.prompt_len))
    common = ["logits", "--model", model, "--ids", ids, "--decode", str(args.decode), "--threads", "1", "--exact"]

    def logits(tag, launcher, extra):
        out = os.path.join(args.workdir, tag + ".npy")
        ok, text = run([*launcher, moex, *common, "--out", out, "--tokens-out", out + ".tokens", *extra])
        if not ok:
            return None, None, text
        return np.load(out), open(out + ".tokens").read().split(), text

    base, base_tokens, text = logits("single", [], [])
    if base is None:
        sys.exit("single-rank run failed:\n" + text)
    plans = []
    for n in [int(x) for x in args.ranks.split(",")]:
        plans += [(n, "tp", ["--moe-parallel", "tp"]),
                  (n, "tp-overlap", ["--moe-parallel", "tp", "--overlap"]),
                  (n, "ep", ["--moe-parallel", "ep"]),
                  (n, "ep-dp-attention", ["--moe-parallel", "ep", "--attn-parallel", "dp"])]
        if n == 4:
            plans += [(n, "tp2xep2", ["--moe-parallel", "tpxep", "--tp", "2", "--ep", "2"]),
                      (n, "tp2xep2-overlap", ["--moe-parallel", "tpxep", "--tp", "2", "--ep", "2", "--overlap"])]
        if args.lossy:
            for dtype in ["bf16", "fp8"]:
                plans += [(n, f"tp-{dtype}", ["--moe-parallel", "tp", "--comm-dtype", dtype]),
                          (n, f"ep-dp-attention-{dtype}", ["--moe-parallel", "ep", "--attn-parallel", "dp",
                                                           "--comm-dtype", dtype])]
    passed = failed = 0
    # Plans the model cannot take: a clear error naming the constraint, a non-zero exit, no hang.
    impossible = [(3, ["--moe-parallel", "ep", "--attn-parallel", "dp"], "cannot be split evenly over 3 EP ranks"),
                  (3, ["--moe-parallel", "tp"], "cannot be split evenly over 3 TP ranks"),
                  (2, ["--moe-parallel", "tpxep", "--tp", "2", "--ep", "2"], "must equal the number of ranks"),
                  (2, ["--moe-parallel", "tp", "--attn-parallel", "dp"], "--attn-parallel dp needs --moe-parallel ep")]
    for n, extra, needle in impossible:
        ok, text = run([*MPIRUN, "-np", str(n), moex, *common, "--out", os.path.join(args.workdir, "x.npy"), *extra],
                       timeout=120)
        if ok is False and needle in text:
            passed += 1
            print(f"ok   np={n} {' '.join(extra)}: refused ({needle})")
        else:
            failed += 1
            print(f"FAIL np={n} {' '.join(extra)}: expected an error mentioning {needle!r}\n{(text or '')[-1000:]}")
    # `generate` with a batch whose sequences are spread over the ranks (dp attention: 3 sequences on 2
    # and 4 ranks, so some ranks run out of work early) prints the single-rank greedy text.
    gen = ["generate", "--model", model, "--threads", "1", "-n", "8", "--ignore-eos", "--exact",
           "--prompt", "The old man", "--prompt", "A quiet river runs", "--prompt", "Seven"]
    ok, single_text = run([moex, *gen])
    single_lines = [l for l in single_text.splitlines() if l.startswith("[")]
    for n in [int(x) for x in args.ranks.split(",")]:
        for extra in (["--moe-parallel", "ep", "--attn-parallel", "dp"], ["--moe-parallel", "tp"]):
            ok2, text = run([*MPIRUN, "-np", str(n), moex, *gen, *extra], timeout=180)
            lines = [l for l in (text or "").splitlines() if l.startswith("[")]
            if ok and ok2 and lines == single_lines and len(lines) == 3:
                passed += 1
                print(f"ok   np={n} generate {' '.join(extra)}: same text as one rank")
            else:
                failed += 1
                print(f"FAIL np={n} generate {' '.join(extra)}:\n{(text or '')[-1500:]}\nexpected:\n{single_text}")
    for n, name, extra in plans:
        got, tokens, text = logits(f"np{n}-{name}", [*MPIRUN, "-np", str(n)], extra)
        lossy = "-bf16" in name or "-fp8" in name
        if got is None:
            print(f"FAIL np={n} {name}: run failed\n{text[-2000:]}")
            failed += 1
            continue
        rel = float(np.abs(got.astype(np.float64) - base).max() / np.abs(base).max())
        problems = []
        if not lossy and rel > args.tol:
            problems.append(f"logit error {rel:.2e} > {args.tol}")
        if tokens != base_tokens:
            problems.append("greedy tokens differ: " + " ".join(tokens))
        if problems:
            failed += 1
            print(f"FAIL np={n} {name}: " + "; ".join(problems))
        else:
            passed += 1
            print(f"ok   np={n} {name}: max logit error {rel:.2e} relative to the largest logit, greedy tokens identical")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
