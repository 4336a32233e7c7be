#!/usr/bin/env python3
"""`moex bench parallel-sweep` reports the all-reduce algorithms that ran, not a prediction.

A tuning table names ring for ordinary buffers and rd for registered ones at every size (2 ranks). The
engine's f32 prefill all-reduces registered buffers, bf16/fp8 never do (registered memory is fp32 only), so
what ran differs from what a prediction from the message size alone says (ring). Expected per row: f32
prefill reports rd (alone or with ring), every bf16/fp8 row of a TP or EP plan reports ring only, dp-attention
rows report an all-to-all algorithm.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    moex = os.path.abspath(p.parse_args().moex)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        subprocess.run([moex, "gen-model", "--preset", "tiny", "--seed", "5", "--out", model], check=True,
                       capture_output=True)
        table = os.path.join(tmp, "table.json")
        entries = [{"collective": "allreduce", "group_size": 2, "dtype": d, "bytes": 8 << k, "algo": algo,
                    "registered": registered}
                   for k in range(24) for d in ("f32", "bf16", "fp8")
                   for algo, registered in (("ring", False), ("rd", True))]
        with open(table, "w") as f:
            json.dump({"version": 1, "entries": entries}, f)
        env = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1", MOEX_COMM_TUNING=table, MOEX_COMM_TIMEOUT="60")
        r = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", moex, "bench",
                            "parallel-sweep", "--model", model, "--batches", "1", "--steps", "2", "--prefill-len",
                            "16", "--json"], capture_output=True, text=True, timeout=240, env=env)
        if r.returncode != 0:
            sys.exit(f"parallel-sweep exited {r.returncode}: {r.stderr.strip()[-400:]}")
        rows = json.loads(r.stdout[r.stdout.index("{"):])["rows"]
        for row in rows:
            ran = set(row["algorithms_ran"].split("+"))
            what = f"{row['plan']} overlap={row['overlap']} {row['comm_dtype']} {row['workload']}: ran {ran}"
            if "dp-attn" in row["plan"]:
                ok = ran <= {"pairwise", "bruck", "mpi"}
            elif row["comm_dtype"] == "f32" and row["workload"].startswith("prefill"):
                ok = "rd" in ran and ran <= {"rd", "ring"}
            elif row["comm_dtype"] != "f32":
                ok = ran == {"ring"}
            else:
                ok = ran <= {"rd", "ring"}
            print(("ok   " if ok else "FAIL ") + what)
            if not ok:
                failures.append(what)
        if not rows:
            failures.append("no rows")
    if failures:
        sys.exit(f"{len(failures)} check(s) failed")


if __name__ == "__main__":
    main()
