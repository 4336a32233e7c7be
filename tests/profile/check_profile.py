#!/usr/bin/env python3
"""`moex profile` end to end on a tiny generated checkpoint.

Checks the --json report (shares add to 100%, every forward-pass zone has time in decode, tokens per
expert add to batch*k per layer per step), the Chrome trace (valid JSON, every B has its E on the same
track, children inside their parents, zones inside steps, warm-up excluded), the human table, and
--profile / --trace on `generate` and `bench decode`. With --mpirun, `moex profile` under 2 ranks instead: one report
per rank plus mean and slowest rank, one trace process per rank.
"""
import argparse
import json
import os
import re
import subprocess
import sys

# No "combine": with tokens replicated the weighted combine is fused into the experts stage (the routing
# weight is applied as each expert's output is added into its token's row); only the dispatch path (dp
# attention + ep) has a combine zone of its own.
FORWARD_ZONES = ["embedding", "attention", "router", "dispatch", "experts", "lm_head"]
LAYER_ZONES = ["attention", "router", "dispatch", "experts"]
BATCH, PROMPT, STEPS, STEP_TOKENS, WARMUP = 3, 9, 5, 4, 2

failures = []


def engine_schedule(batch, prompt, new_tokens, budget, max_seqs):
    """The engine's steps for `batch` equal prompts (docs/serve.md, "Scheduler"; no preemption, no prefix cache):
    each step gives every running decoder its token, then prompt chunks in arrival order up to the budget (a
    chunk leaves room for the decoders behind it), then admits waiting prompts. Returns per kind (a prefill step
    has a prompt row) [steps, rows]."""
    waiting = [{"computed": 0, "length": prompt, "generated": 0} for _ in range(batch)]
    running, kinds = [], {"prefill": [0, 0], "decode": [0, 0]}
    while waiting or running:
        left, rows, prompt_rows = budget, 0, 0
        decoders = sum(1 for s in running if s["length"] - s["computed"] == 1)
        planned = []
        for s in running:
            decoding = s["length"] - s["computed"] == 1
            decoders -= decoding
            take = 1 if decoding else min(s["length"] - s["computed"], left - decoders)
            if take > 0:
                planned.append((s, take))
                left -= take
        while waiting and left > 0 and len(running) < max_seqs:
            s = waiting.pop(0)
            running.append(s)
            planned.append((s, min(s["length"], left)))
            left -= planned[-1][1]
        for s, take in planned:
            rows += take
            if s["computed"] + take <= prompt:
                prompt_rows += take
            s["computed"] += take
            if s["computed"] == s["length"]:  # samples
                s["generated"] += 1
                s["length"] += 1
                if s["generated"] == new_tokens:
                    running.remove(s)
        kind = kinds["prefill" if prompt_rows else "decode"]
        kind[0] += 1
        kind[1] += rows
    return kinds


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def run(cmd, env=None):
    print("+", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if p.returncode != 0:
        sys.exit(f"command failed ({p.returncode}): {' '.join(cmd)}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


SCHEDULE = engine_schedule(BATCH, PROMPT, STEPS + 1, STEP_TOKENS, BATCH)


def check_report(rep, config, label, sampler=True):
    """One rank's report_to_json, from `moex profile` with the module's BATCH/PROMPT/STEPS: the engine's steps
    (SCHEDULE: decode rows ride along the prompt chunks). sampler: the rank that drives the engine (rank 0)."""
    layers, k = config["num_hidden_layers"], config["num_experts_per_tok"]
    phases = rep["phases"]
    for phase, (steps, tokens) in SCHEDULE.items():
        p = phases[phase]
        check(p["steps"] == steps, f"{label} {phase}: {p['steps']} steps, expected {steps} (warm-up excluded?)")
        check(p["tokens"] == tokens, f"{label} {phase}: {p['tokens']} tokens, expected {tokens}")
        shares = [z["share"] for z in p["zones"].values()]
        total = sum(shares) + p["unzoned_share"]
        check(abs(total - 1.0) < 1e-9, f"{label} {phase}: shares add to {total}, not 1")
        check(all(0.0 <= s <= 1.0 for s in shares), f"{label} {phase}: share out of [0,1]: {shares}")
        check(p["unzoned_ns"] >= 0 and p["unzoned_share"] >= 0, f"{label} {phase}: negative 'other'")
        check(p["step_ns"] >= p["wall_ns"] > 0, f"{label} {phase}: step_ns {p['step_ns']} wall_ns {p['wall_ns']}")
        zoned = sum(z["self_ns"] for z in p["zones"].values())
        check(zoned + p["unzoned_ns"] == p["step_ns"], f"{label} {phase}: self times + unzoned != step")
        for name in FORWARD_ZONES:
            z = p["zones"].get(name)
            check(z is not None and z["self_ns"] > 0 and z["calls"] > 0, f"{label} {phase}: zone {name} missing or 0")
        for name in LAYER_ZONES:
            z = p["zones"].get(name, {})
            calls = z.get("calls", 0)  # a zone may open more than once per layer (experts: up, then down)
            check(calls > 0 and calls % (steps * layers) == 0,
                  f"{label} {phase}: {name} calls {calls}, not a multiple of {steps} steps x {layers} layers")
            check(z.get("layers") == layers and z.get("us_per_layer", 0) > 0, f"{label} {phase}: {name} per-layer time")
        tpe = p["tokens_per_expert"]
        check(len(tpe) == layers, f"{label} {phase}: tokens_per_expert has {len(tpe)} layers")
        for layer, counts in enumerate(tpe):
            check(len(counts) == config["num_local_experts"], f"{label} {phase}: layer {layer} expert count")
            check(sum(counts) == tokens * k, f"{label} {phase}: layer {layer} routed {sum(counts)} != {tokens}*{k}")
    d = phases["decode"]["zones"]
    if sampler:
        check("sampling" in d and d["sampling"]["self_ns"] > 0 and d["sampling"]["calls"] == SCHEDULE["decode"][0],
              f"{label} decode: sampling zone")


def check_trace(path, label, ranks=1, decode_steps=SCHEDULE["decode"][0], prefill_steps=None, sampler_ranks=1):
    with open(path) as f:
        trace = json.load(f)  # must parse
    events = trace["traceEvents"]
    stacks, steps, names, pids = {}, {}, set(), set()
    zone_slices = []  # (pid, begin, end, name)
    for e in events:
        ph, key = e["ph"], (e["pid"], e["tid"])
        pids.add(e["pid"])
        if ph == "B":
            stack = stacks.setdefault(key, [])
            if stack:  # a child begins inside its parent
                check(e["ts"] >= stack[-1]["ts"], f"{label}: {e['name']} begins before its parent")
            stack.append(e)
            names.add(e["name"])
        elif ph == "E":
            stack = stacks.get(key, [])
            check(len(stack) > 0, f"{label}: E without B on track {key}")
            if not stack:
                continue
            begin = stack.pop()
            check(e["ts"] >= begin["ts"], f"{label}: {begin['name']} ends before it begins")
            if stack:
                parent = stack[-1]
                parent.setdefault("_children", []).append((begin["ts"], e["ts"], begin["name"]))
            begin["_end"] = e["ts"]
            zone_slices.append((e["pid"], begin["ts"], e["ts"], begin["name"], begin))
        elif ph == "X" and e.get("cat") == "step":
            steps.setdefault(e["pid"], []).append(e)
    for key, stack in stacks.items():
        check(not stack, f"{label}: {len(stack)} B events without E on track {key}")
    for _, b, e, name, begin in zone_slices:  # nested zones lie inside their parents
        for cb, ce, cname in begin.get("_children", []):
            check(b <= cb and ce <= e, f"{label}: {cname} [{cb},{ce}] outside its parent {name} [{b},{e}]")
    check(pids == set(range(ranks)), f"{label}: trace processes {sorted(pids)}, expected {list(range(ranks))}")
    for name in FORWARD_ZONES + (["sampling"] if sampler_ranks else []):
        check(name in names, f"{label}: no {name} slice in the trace")
    for pid in range(ranks):
        mine = steps.get(pid, [])
        n_decode = sum(1 for s in mine if s["name"] == "decode step")
        check(n_decode == decode_steps, f"{label}: rank {pid} has {n_decode} decode steps, expected {decode_steps}")
        if prefill_steps is not None:
            n_prefill = sum(1 for s in mine if s["name"] == "prefill step")
            check(n_prefill == prefill_steps, f"{label}: rank {pid}: {n_prefill} prefill steps != {prefill_steps}")
        # Zones on the step thread lie inside a step. Tolerance: the trace rounds to 1 ns, and a step slice
        # starts a few ns late (mark_step reads the clock again after ScopedStep measured the wall time, and
        # computes begin = that second end - wall), so its first zone may begin just before it.
        spans = sorted((s["ts"], s["ts"] + s["dur"]) for s in mine)
        for p, b, e, name, _ in zone_slices:
            if p != pid:
                continue
            inside = any(sb - 1.0 <= b and e <= se + 0.002 for sb, se in spans)
            check(inside, f"{label}: rank {pid} zone {name} [{b},{e}] outside every step")
    return trace


def table_total_shares(text):
    return [float(m) for m in re.findall(r"^\s+total\s+[\d.]+\s+([\d.]+)%", text, re.M)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moex", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--mpirun", default="", help="check 2 ranks under this mpirun instead of one rank")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    model = os.path.join(args.workdir, "tiny")
    if not os.path.exists(os.path.join(model, "config.json")):
        run([args.moex, "gen-model", "--preset", "tiny", "--seed", "7", "--out", model])
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    shape = ["--batch", str(BATCH), "--prompt-len", str(PROMPT), "--steps", str(STEPS), "--warmup", str(WARMUP),
             "--step-tokens", str(STEP_TOKENS), "--threads", "1"]
    prefill_steps, decode_steps = SCHEDULE["prefill"][0], SCHEDULE["decode"][0]

    if not args.mpirun:  # one rank
        # 1. moex profile --json --trace
        trace_path = os.path.join(args.workdir, "profile.trace.json")
        out = json.loads(run([args.moex, "profile", "--model", model, *shape, "--json", "--trace", trace_path]).stdout)
        check(out["zones_compiled"], "built with MOEX_PROFILE_ZONES=OFF: the zone checks need zones")
        check(out["steps"] == decode_steps and out["batch"] == BATCH, "profile --json: run parameters")
        check_report(out["profile"], config, "profile")
        check_trace(trace_path, "profile trace", decode_steps=decode_steps, prefill_steps=prefill_steps)

        # 2. the human table: per phase, a "total" row at 100%, the expert load per layer
        text = run([args.moex, "profile", "--model", model, *shape]).stdout
        print(text)
        totals = table_total_shares(text)
        check(totals == [100.0, 100.0], f"profile table: total rows {totals}, expected two at 100.0%")
        check("decode expert load" in text and "max/mean" in text, "profile table: expert load per layer")
        for name in FORWARD_ZONES + ["sampling", "other"]:
            check(re.search(rf"^\s+{name}\s", text, re.M) is not None, f"profile table: no {name} row")

        # 3. generate --profile --trace --profile-json
        gen_trace = os.path.join(args.workdir, "generate.trace.json")
        gen_json = os.path.join(args.workdir, "generate.profile.json")
        p = run([args.moex, "generate", "--model", model, "--prompt", "hello world", "-n", "4", "--ignore-eos",
                 "--threads", "1", "--profile", "--trace", gen_trace, "--profile-json", gen_json])
        check(table_total_shares(p.stdout) == [100.0, 100.0], "generate --profile: table missing or not 100%")
        with open(gen_json) as f:
            g = json.load(f)
        check(g["phases"]["decode"]["steps"] == 3, f"generate --profile-json: {g['phases']['decode']['steps']} decode steps")
        check_trace(gen_trace, "generate trace", decode_steps=3)

        # 4. bench decode --json --profile: stdout stays one JSON line, the table goes to stderr
        p = run([args.moex, "bench", "decode", "--model", model, "--steps", "3", "--repeats", "2", "--roofline-mb", "8",
                 "--threads", "1", "--json", "--profile"])
        json.loads(p.stdout)
        check(table_total_shares(p.stderr) == [100.0, 100.0], "bench decode --profile: table on stderr")
        check("decode: 4 steps" in p.stderr, "bench decode --profile: the warm-up run must be excluded (2 runs x 2 steps)")

    # 5. two ranks: per-rank reports, mean, slowest rank; one trace process per rank
    if args.mpirun:
        env = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1", OMPI_MCA_btl_vader_single_copy_mechanism="none",
                   MOEX_COMM_TIMEOUT="60")
        mpi_trace = os.path.join(args.workdir, "profile.np2.trace.json")
        p = run([args.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", args.moex, "profile",
                 "--model", model, *shape, "--json", "--trace", mpi_trace], env=env)
        lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
        check(len(lines) == 1, f"np2: {len(lines)} JSON lines on stdout, expected one (rank 0)")
        out = json.loads(lines[0])
        prof = out["profile"]
        check(out["world"] == 2 and [r["rank"] for r in prof["ranks"]] == [0, 1], "np2: one report per rank")
        for r in prof["ranks"]:
            check_report(r, config, f"np2 rank {r['rank']}", sampler=r["rank"] == 0)  # rank 0 samples every row
        check(prof["slowest_rank"]["decode"] in (0, 1) and prof["mean"]["phases"]["decode"]["steps"] == decode_steps,
              "np2: mean and slowest rank")
        check_trace(mpi_trace, "np2 trace", ranks=2, decode_steps=decode_steps, prefill_steps=prefill_steps)
        text = run([args.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", args.moex, "profile",
                    "--model", model, *shape], env=env).stdout
        check("== rank 1 of 2 ==" in text and "== mean of 2 ranks ==" in text and "slowest rank:" in text,
              "np2 table: per rank, mean, slowest rank")

    if failures:
        sys.exit(f"{len(failures)} check(s) failed")
    print("profile checks passed")


if __name__ == "__main__":
    main()
