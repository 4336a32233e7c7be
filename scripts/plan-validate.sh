#!/usr/bin/env bash
# moex plan against measurement on this machine: calibrates a cluster file, runs `bench parallel-sweep` at
# 1, 2 and 4 ranks, predicts the same plans and prints predicted / measured per plan and batch (docs/plan.md,
# "Validation"). Run it on a quiet machine: both the calibration and the sweep time the cores.
#   scripts/plan-validate.sh [OUT_DIR]   (MOEX=build/moex MODEL=models/mini RANKS="1 2 4" BATCHES=1,16,64)
set -euo pipefail
cd "$(dirname "$0")/.."
MOEX=${MOEX:-build/moex}
MODEL=${MODEL:-models/mini}
RANKS=${RANKS:-"1 2 4"}
BATCHES=${BATCHES:-1,16,64}
OUT=${1:-plan-validation}
mkdir -p "$OUT"
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
max=1
for n in $RANKS; do (( n > max )) && max=$n; done
# The sweep runs one thread per rank, so the file describes ranks of one thread: as many devices as ranks.
"${MPIRUN[@]}" -np 2 "$MOEX" plan calibrate --out "$OUT/cluster.json" --devices-per-host "$max" --force
for n in $RANKS; do
  # As stored, exact path: the sweep's overlap rows need it, and the planner prices it as the f32 FMA loop.
  "${MPIRUN[@]}" -np "$n" "$MOEX" bench parallel-sweep --model "$MODEL" --batches "$BATCHES" --steps 8 \
    --weights as-stored --dense-weights as-stored --json > "$OUT/measured-$n.json"
  for b in ${BATCHES//,/ }; do
    "$MOEX" plan --model "$MODEL" --cluster "$OUT/cluster.json" --ranks "$n" --weights as-stored \
      --comm-dtype f32,bf16,fp8 --batch "$b" --context 12 --json > "$OUT/predicted-$n-b$b.json"
  done
done
python3 - "$OUT" $RANKS <<'EOF'
import json, sys
out, ranks = sys.argv[1], sys.argv[2:]
print(f"{'ranks':>5} {'plan':<16} {'comm':<5} {'batch':>5} {'measured tok/s':>14} {'predicted':>10} {'pred/meas':>9} "
      f"{'comm % meas':>11} {'pred':>6}")
worst_rate, worst_share = 0.0, 0.0
for n in ranks:
    measured = json.load(open(f"{out}/measured-{n}.json"))["rows"]
    for row in measured:
        if row["overlap"] or not row["workload"].startswith("decode b="):
            continue
        b = int(row["workload"].split("=")[1])
        pred = json.load(open(f"{out}/predicted-{n}-b{b}.json"))["plans"]
        name = row["plan"] if n != "1" else "TP=1"
        match = [p for p in pred if p["plan"] == name and p["comm_dtype"] == row["comm_dtype"]]
        if not match:
            continue
        p = match[0]
        ratio = p["tokens_per_s"] / row["tokens_per_s"]
        worst_rate = max(worst_rate, abs(ratio - 1))
        worst_share = max(worst_share, abs(p["comm_share"] - row["comm_share"]))
        print(f"{n:>5} {row['plan']:<16} {row['comm_dtype']:<5} {b:>5} {row['tokens_per_s']:>14.1f} "
              f"{p['tokens_per_s']:>10.1f} {ratio:>9.2f} {100 * row['comm_share']:>10.1f}% {100 * p['comm_share']:>5.1f}%")
print(f"worst: tokens/s off by {100 * worst_rate:.0f}%, comm share by {100 * worst_share:.1f} points")
EOF
