#!/usr/bin/env python3
"""EPLB (docs/moe.md, "Expert load balancing") end to end under mpirun.

On a generated checkpoint with a skewed router: `profile --record-load`, `plan-experts`, then `moex logits` over
EP ranks with --eplb and the placement, against the same run without EPLB (and against one rank, within
check_plans' tolerance). With top-2 routing the logits must be bit for bit those of plain EP: a replica computes
the same rows with the same weights, and each token's output is the sum of its two experts' terms onto zeros (the
all-reduce at tp attention, the sender's combine at dp attention), which no placement can reorder. With top-k > 2
(--tol-topk) a token's experts can sit on ranks in another order, so the sum may round differently: compared within
the tolerance and with identical greedy tokens. Also checks that the placement raises the measured balancedness
(profile's tokens per EP rank) and that bad placement files and existing outputs are refused with one line, exit 2.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
ENV = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1", OMPI_MCA_btl_vader_single_copy_mechanism="none",
           MOEX_COMM_TUNING="none")


def run(cmd, timeout=300):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout} s: {' '.join(cmd)}"
    return r.returncode, r.stdout + r.stderr


def must(cmd, timeout=300):
    code, out = run(cmd, timeout)
    if code != 0:
        sys.exit(f"failed ({code}): {' '.join(cmd)}\n{out}")
    return out


def balancedness(report):
    """Per MoE layer, mean/max of the tokens per EP rank over the decode phase (the ranks' mean report)."""
    prof = report["profile"]
    mean = prof["mean"] if "mean" in prof else prof
    rows = mean["phases"]["decode"]["tokens_per_rank"]
    return [sum(r) / len(r) / max(r) for r in rows if r and max(r) > 0]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--gen-args", required=True)
    p.add_argument("--ranks", default="2")
    p.add_argument("--exact", action="store_true", help="top-2: EPLB logits must equal plain EP's bit for bit")
    p.add_argument("--tol", type=float, default=1e-3)
    args = p.parse_args()
    moex = os.path.abspath(args.moex)
    work = args.workdir
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        must([moex, "gen-model", *args.gen_args.split(), "--out", model])
    config = json.load(open(os.path.join(model, "config.json")))
    vocab = config["vocab_size"]
    experts = config.get("num_local_experts", config.get("num_experts"))
    ids = ",".join(str(i) for i in np.random.default_rng(5).integers(3, vocab, size=20))
    common = ["logits", "--model", model, "--ids", ids, "--decode", "12", "--threads", "1", "--exact"]
    failures = []

    def logits(tag, launcher, extra):
        out = os.path.join(work, tag + ".npy")
        must([*launcher, moex, *common, "--out", out, "--tokens-out", out + ".tokens", *extra])
        return np.load(out), open(out + ".tokens").read().split()

    single, single_tokens = logits("single", [], [])
    load = os.path.join(work, "load.json")
    for f in [load]:
        if os.path.exists(f):
            os.remove(f)
    must([moex, "profile", "--model", model, "--threads", "1", "--batch", "4", "--prompt-len", "16", "--steps", "8",
          "--warmup", "0", "--exact", "--record-load", load])
    recorded = json.load(open(load))
    assert recorded["format"] == "moex-expert-load", recorded
    # Refused without --force, one line, exit 2.
    code, out = run([moex, "profile", "--model", model, "--threads", "1", "--steps", "1", "--record-load", load])
    if code != 2 or "exists" not in out:
        failures.append(f"profile --record-load over an existing file: exit {code}: {out.strip()}")

    for n in [int(x) for x in args.ranks.split(",")]:
        mpi = [*MPIRUN, "-np", str(n)]
        placement = os.path.join(work, f"placement-{n}.json")
        if os.path.exists(placement):
            os.remove(placement)
        print(must([moex, "plan-experts", "--model", model, "--load", load, "--ranks", str(n),
                    "--redundant-experts", "1", "--out", placement]), end="")
        code, out = run([moex, "plan-experts", "--model", model, "--load", load, "--ranks", str(n),
                         "--redundant-experts", "1", "--out", placement])
        if code != 2 or "exists" not in out or len(out.strip().splitlines()) != 1:
            failures.append(f"plan-experts over an existing --out: exit {code}: {out.strip()}")
        layers = json.load(open(placement))["layers"]
        if not any(len(set(l)) < len(l) for l in layers if l):
            failures.append(f"{n} ranks: the placement replicates no expert")
        for attn in ["tp", "dp"]:
            par = ["--moe-parallel", "ep", "--attn-parallel", attn]
            base, base_tokens = logits(f"ep{n}-{attn}", mpi, par)
            # "online": starts from the uniform placement and rebalances from the measured load every 3 steps,
            # mid-stream (the experts move between steps 3 and 4, 6 and 7, ...).
            for tag, extra in [("placed", ["--eplb", "--redundant-experts", "1", "--expert-placement", placement]),
                               ("uniform", ["--eplb", "--redundant-experts", "1"]),
                               ("online", ["--eplb", "--redundant-experts", "1", "--eplb-interval", "3"])]:
                got, tokens = logits(f"ep{n}-{attn}-eplb-{tag}", mpi, par + extra)
                name = f"{n} ranks, attention {attn}, EPLB {tag}"
                diff = float(np.max(np.abs(got - base)))
                scale = float(np.max(np.abs(single)))
                if tokens != base_tokens:
                    failures.append(f"{name}: greedy tokens differ from plain EP")
                if args.exact and not np.array_equal(got, base):
                    failures.append(f"{name}: logits differ from plain EP by {diff:g} (expected bit-identical)")
                elif diff > args.tol * scale:
                    failures.append(f"{name}: logits differ from plain EP by {diff:g} > {args.tol} x {scale:g}")
                ref = float(np.max(np.abs(got - single)))
                if ref > args.tol * scale:
                    failures.append(f"{name}: logits differ from one rank by {ref:g} > {args.tol} x {scale:g}")
                print(f"{name}: max |EPLB - EP| = {diff:g}, max |EPLB - 1 rank| = {ref:g}")
        # The measured balance: tokens per EP rank of a decode run, plain EP against the placement.
        prof = ["profile", "--model", model, "--threads", "1", "--batch", "8", "--prompt-len", "8", "--steps", "6",
                "--warmup", "0", "--exact", "--json", "--moe-parallel", "ep"]
        before = balancedness(json.loads(must([*mpi, moex, *prof]).strip().splitlines()[-1]))
        after = balancedness(json.loads(must([*mpi, moex, *prof, "--eplb", "--redundant-experts", "1",
                                              "--expert-placement", placement]).strip().splitlines()[-1]))
        # Online: the rebalance ran (a zone), moved experts, and raised the balance as the static placement does.
        online = json.loads(must([*mpi, moex, *prof, "--eplb", "--redundant-experts", "1", "--eplb-interval", "2"])
                            .strip().splitlines()[-1])
        zones = (online["profile"]["mean"] if "mean" in online["profile"] else online["profile"])["phases"]["decode"]["zones"]
        if online["eplb_rebalances"] < 2 or online["eplb_experts_moved"] < 1 or "rebalance" not in zones:
            failures.append(f"{n} ranks, --eplb-interval 2: rebalances {online['eplb_rebalances']}, experts moved "
                            f"{online['eplb_experts_moved']}, zones {sorted(zones)}")
        after_online = balancedness(online)
        print(f"{n} ranks: online rebalancing: {online['eplb_rebalances']} rebalances, "
              f"{online['eplb_experts_moved']} experts read on rank 0, balancedness {['%.3f' % b for b in after_online]}")
        print(f"{n} ranks: measured balancedness per layer before {['%.3f' % b for b in before]}, "
              f"after {['%.3f' % b for b in after]}")
        if not before or len(before) != len(after) or np.mean(after) <= np.mean(before):
            failures.append(f"{n} ranks: EPLB did not raise the measured balancedness ({before} -> {after})")
        # Bad placements: one line, exit 2.
        bad = os.path.join(work, "bad.json")
        for text, expect in [("{", "not JSON"),
                             (json.dumps({"format": "moex-expert-placement", "experts": experts,
                                          "ranks": n + 1, "slots_per_rank": 5, "layers": []}), "placement"),
                             (open(placement).read().replace("[", "[99,", 2), "expert")]:
            open(bad, "w").write(text)
            code, out = run([*mpi, moex, *common, "--out", os.path.join(work, "x.npy"), *par, "--eplb",
                             "--redundant-experts", "1", "--expert-placement", bad])
            lines = [l for l in out.strip().splitlines() if "moex: error" in l]
            if code != 2 or not lines or expect not in out:
                failures.append(f"bad placement {text[:40]!r}: exit {code}: {out.strip()[:300]}")
        code, out = run([moex, *common, "--out", os.path.join(work, "x.npy"), "--eplb"])
        if code != 2 or "--moe-parallel ep" not in out:
            failures.append(f"--eplb on one rank without ep: exit {code}: {out.strip()[:300]}")
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))
    print("all EPLB checks passed")


if __name__ == "__main__":
    main()
