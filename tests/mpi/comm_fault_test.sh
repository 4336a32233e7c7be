#!/bin/bash
# usage: comm_fault_test.sh MPIEXEC BINARY MODE ALGO  — the job must end non-zero within the bound, with
# a message that says what happened.
set -u
mpiexec=$1 binary=$2 mode=$3 algo=$4
bound=25
start=$(date +%s)
out=$(MOEX_COMM_TIMEOUT=3 timeout 60 "$mpiexec" --allow-run-as-root --oversubscribe -np 3 "$binary" "$mode" "$algo" 2>&1)
rc=$?
elapsed=$(( $(date +%s) - start ))
echo "$out" | tail -20
echo "exit code $rc after ${elapsed}s"
[ "$rc" -ne 0 ] || { echo "FAIL: the job did not fail"; exit 1; }
[ "$rc" -ne 124 ] || { echo "FAIL: the job hung (killed by timeout)"; exit 1; }
[ "$elapsed" -le "$bound" ] || { echo "FAIL: took ${elapsed}s, bound ${bound}s"; exit 1; }
if [ "$mode" = exit ]; then
  echo "$out" | grep -q -E "exited|non-zero status|exit code" || { echo "FAIL: no message about the dead rank"; exit 1; }
else
  echo "$out" | grep -q "no progress from its peers\|shared-memory barrier" || { echo "FAIL: no watchdog message"; exit 1; }
fi
echo PASS
