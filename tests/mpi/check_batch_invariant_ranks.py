#!/usr/bin/env python3
"""--batch-invariant under more than two ranks: 4 ranks, attention and MoE TP, `moex bench batch-variance`.

With ring all-reduce (it adds each chunk of a message starting from a different rank, so the order an element
is summed in depends on where it sits in the step's rows) sequences served together get logprobs that differ
from each alone: the check sees that (it can fail). With --batch-invariant, `auto` is pinned to an all-reduce
that adds every element in one order: no step moves. --batch-invariant with ring is refused with one line.
On the exact path (--exact), whose f32 sums the ring's order moves. Every rank also checks that generate() gave
it each token's logprobs (the alone runs), so a rank left without them fails the run.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def run(moex, model, extra):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4", moex, "bench", "batch-variance", "--model",
           model, "--prompts", "6", "-n", "4", "--moe-parallel", "tp", "--attn-parallel", "tp", "--threads", "1",
           "--json", "--exact"] + extra
    env = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1", MOEX_COMM_TUNING="none")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def report(r):
    if r.returncode != 0:
        # mpirun's own banner fills the tail of stderr: show the ranks' lines (errors, terminate, sanitizer
        # reports) first, so an intermittent abort says where it came from.
        lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith("--") and "mpirun" not in l
                 and "Per user-direction" not in l and "non-zero exit code" not in l]
        sys.exit(f"batch-variance exited {r.returncode}:\n" + "\n".join(lines[:30]) + "\nstdout: " + r.stdout[-400:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    moex = os.path.abspath(p.parse_args().moex)
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        subprocess.run([moex, "gen-model", "--preset", "tiny", "--seed", "3", "--out", model], check=True,
                       capture_output=True)
        ring = report(run(moex, model, ["--allreduce-algo", "ring"]))
        pinned = report(run(moex, model, ["--batch-invariant"]))
        refused = run(moex, model, ["--batch-invariant", "--allreduce-algo", "ring"])
    failures = []
    if ring["logprob_differs_steps"] == 0:
        failures.append(f"ring without the flag moved no step, so this check cannot see a difference: {ring}")
    if pinned["logprob_differs_steps"] != 0 or pinned["differ"] != 0:
        failures.append(f"--batch-invariant on 4 ranks still moved: {pinned}")
    if refused.returncode != 2 or "needs an all-reduce that adds every element in one order" not in refused.stderr:
        failures.append(f"--batch-invariant --allreduce-algo ring: exit {refused.returncode}, {refused.stderr[-300:]}")
    print(f"ring: {ring['logprob_differs_steps']} of {ring['same_token_steps']} steps moved; "
          f"--batch-invariant: {pinned['logprob_differs_steps']}")
    if failures:
        sys.exit("\n".join(failures))
    print("PASS")


if __name__ == "__main__":
    main()
