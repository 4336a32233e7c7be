#!/usr/bin/env python3
"""`moex tune-comm` and `moex bench-comm` end to end, and that `auto` follows the tuning table.

Under `mpirun -np 2` (small sizes, few samples, so it stays quick on 2 cores):
  - tune-comm writes a table with one allreduce entry per (dtype, size) — fp32 once on ordinary and once on
    registered memory — and alltoall entries, into --out
    or, without --out, into $MOEX_CACHE_DIR/comm-tuning.json;
  - bench-comm --json checks every result (all rows "correct") and reports what auto ran: the table's winner;
  - with a hand-written table naming ring (then rd) at every size, auto runs exactly that algorithm, also
    when the table is in the older format that lists runners-up ("alternates", now ignored); with
    separate winners for registered memory, bench-comm --registered runs those; from the default location
    too; MOEX_COMM_TUNING=none ignores the default table;
  - a corrupt table is one error line naming the file, exit 2.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
FAILURES = []


def run(cmd, env=None, timeout=240):
    full_env = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1", MOEX_COMM_TIMEOUT="60")
    full_env.pop("MOEX_COMM_TUNING", None)
    full_env.update(env or {})
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    return r.returncode, r.stdout, r.stderr


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def bench(moex, env=None, extra=()):
    # Four sizes (8..64 bytes) are enough to see which algorithm auto picks; every bench-comm and tune-comm
    # run is one mpirun whose collectives cost a scheduler tick each on a loaded 2-core host, so keep them few.
    code, out, err = run([*MPIRUN, moex, "bench-comm", "--max-bytes", "64", "--iters", "2", "--warmup", "1",
                          "--algos", "ring,rd,shm", "--json", *extra], env)
    if code != 0:
        check(False, f"bench-comm {' '.join(extra)} exits 0 (got {code}): {err.strip()[-300:]}")
        return None
    return json.loads(out)


def auto_ran(doc):
    return {row["bytes"]: row["ran"] for row in doc["results"] if row["algo"] == "auto"}


def write_table(path, algo, registered_algo=None, alternates=None):
    entries = [{"collective": "allreduce", "group_size": 2, "dtype": "f32", "bytes": 8 << k, "algo": algo,
                "time_us": 1.0} for k in range(10)]
    if alternates is not None:
        entries = [dict(e, alternates=list(alternates)) for e in entries]
    if registered_algo:
        entries += [dict(e, algo=registered_algo, registered=True) for e in entries]
    with open(path, "w") as f:
        json.dump({"version": 1, "entries": entries}, f)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    moex = os.path.abspath(p.parse_args().moex)
    with tempfile.TemporaryDirectory() as tmp:
        table = os.path.join(tmp, "table.json")
        code, out, err = run([*MPIRUN, moex, "tune-comm", "--out", table, "--max-bytes", "512", "--iters", "2",
                              "--dtypes", "f32,fp8"])
        check(code == 0, f"tune-comm exits 0 ({err.strip()[-300:]})")
        doc = json.load(open(table)) if code == 0 else {"entries": []}
        allreduce = [e for e in doc["entries"] if e["collective"] == "allreduce"]
        for registered in (False, True):
            sizes = [e["bytes"] for e in allreduce if e["dtype"] == "f32" and e["registered"] == registered]
            check(sorted(sizes) == [8 << k for k in range(7)],
                  f"tune-comm: one f32 entry per size 8..512, registered={registered} (got {sizes})")
        check({e["dtype"] for e in allreduce} == {"f32", "fp8"}, "tune-comm: f32 and fp8 entries")
        check(not any(e["registered"] for e in allreduce if e["dtype"] == "fp8"), "tune-comm: fp8 not registered")
        check(any(e["collective"] == "alltoall" for e in doc["entries"]), "tune-comm: alltoall entries")
        check(all(e["group_size"] == 2 for e in doc["entries"]), "tune-comm: group size 2")
        check(not any("alternates" in e for e in doc["entries"]), "tune-comm: no runners-up stored")

        doc = bench(moex, extra=("--comm-tuning", table))
        if doc:
            check(all(row["correct"] for row in doc["results"]), "bench-comm: every result correct")
            tuned = {e["bytes"]: e["algo"] for e in allreduce if e["dtype"] == "f32" and not e["registered"]}
            ran = auto_ran(doc)
            check(all(ran[b] == tuned[b] for b in ran), f"auto runs the measured winner: {ran} vs {tuned}")
            check(any(row["algo"] == "copy" for row in doc["results"]), "bench-comm: copy probe rows")

        for algo in ("ring", "rd"):
            write_table(table, algo)
            doc = bench(moex, extra=("--comm-tuning", table))
            ran = auto_ran(doc) if doc else {}
            check(ran and set(ran.values()) == {algo}, f"table naming {algo}: auto runs {algo} (got {ran})")

        # A table from before runners-up were dropped: they are ignored, auto runs the winner at every size.
        write_table(table, "rd", alternates=("ring", "shm"))
        doc = bench(moex, extra=("--comm-tuning", table))
        ran = auto_ran(doc) if doc else {}
        check(ran and set(ran.values()) == {"rd"}, f"table with alternates: auto runs the winner rd (got {ran})")

        write_table(table, "ring", registered_algo="rd")
        doc = bench(moex, extra=("--comm-tuning", table, "--registered"))
        ran = auto_ran(doc) if doc else {}
        check(ran and set(ran.values()) == {"rd"}, f"registered memory: auto runs the registered winner (got {ran})")
        doc = bench(moex, extra=("--comm-tuning", table))
        ran = auto_ran(doc) if doc else {}
        check(ran and set(ran.values()) == {"ring"}, f"ordinary memory: auto runs the ordinary winner (got {ran})")

        cache = os.path.join(tmp, "cache")
        code, _, err = run([*MPIRUN, moex, "tune-comm", "--max-bytes", "64", "--iters", "2", "--dtypes", "f32"],
                           {"MOEX_CACHE_DIR": cache})
        check(code == 0 and os.path.exists(os.path.join(cache, "comm-tuning.json")),
              f"tune-comm without --out writes $MOEX_CACHE_DIR/comm-tuning.json ({err.strip()[-200:]})")
        write_table(os.path.join(cache, "comm-tuning.json"), "rd")
        doc = bench(moex, {"MOEX_CACHE_DIR": cache})
        ran = auto_ran(doc) if doc else {}
        check(ran and set(ran.values()) == {"rd"}, f"auto reads the default table (got {ran})")
        doc = bench(moex, {"MOEX_CACHE_DIR": cache, "MOEX_COMM_TUNING": "none"})
        ran = auto_ran(doc) if doc else {}
        check(ran and "rd" not in set(ran.values()), f"MOEX_COMM_TUNING=none ignores it (got {ran})")

        with open(table, "w") as f:
            f.write('{"entries": [ {"collective": "allreduce", "group_size": 2, "bytes": 8, "algo": "warp"} ]}')
        code, out, err = run([moex, "bench-comm", "--comm-tuning", table, "--max-bytes", "8"])
        lines = err.strip().splitlines()
        check(code == 2 and len(lines) == 1 and table in lines[0] and "warp" in lines[0],
              f"bad table: one line naming the file and the algorithm, exit 2 (got {code}: {err.strip()})")
    if FAILURES:
        sys.exit(f"{len(FAILURES)} check(s) failed")


if __name__ == "__main__":
    main()
