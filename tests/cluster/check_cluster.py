#!/usr/bin/env python3
"""MoEX across hosts: 2 network-namespace hosts made by scripts/cluster.sh, one rank on each, ranks talking TCP
over the bridge. Checks that
  - `moex info` under mpirun prints the rank -> host map once: 2 hosts, one rank each;
  - the host map and its two levels (intra-host, inter-host groups) hold with 2 ranks per host, and every
    all-reduce (two-level ones included) and all-to-all(v) is right over TCP (comm_collectives_test hosts);
  - `moex logits` with TP and with EP across the hosts (one rank each), and with TP on 2 ranks per host (two-level
    all-reduces), equals one rank's (the tolerance and greedy-token check of tests/parallel/check_plans.py);
  - a job ends in bounded time with one line naming what failed when one host's rank is killed (mpirun's
    line naming the host), stops alive (SIGSTOP: the comm watchdog's, MOEX_COMM_TIMEOUT over TCP, naming the
    host it waits for), or its host's link goes down: with the watchdog firing first (its line; mpirun's kill
    order to the lost host's orted then fails after cluster.sh's login namespace's few TCP retries) and with
    the watchdog above the keepalive (OpenMPI's lost-daemon message naming the host, from the TCP keepalive
    that cluster.sh mpirun sets); a serve job whose peer host's link goes down during a request prints the
    watchdog's line (`moex serve: error: ...`) and ends;
  - nothing is left behind: no namespace, bridge, veth or address of the test's prefix.
Needs root and network namespaces; without them it skips (exit 77). The hosts are removed on every exit
(signals included); hosts of the test's prefix left by a killed earlier run are removed first. A lock
serialises concurrent runs (other worktrees on the machine), which share the prefix and subnet."""
import argparse
import fcntl
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

SKIP = 77
PREFIX = "moexct-h"   # not cluster.sh's default, so a user's own cluster is never touched
SUBNET = "10.213.42"
LOCK = "/run/lock/moex-cluster-test.lock"
HOSTS_FILE = f"/run/moex-cluster/{PREFIX}.hosts"
WORK_PREFIX = "moex-cluster-test-"  # the run's model and logits, under the temporary folder
TOL = 1e-3            # tests/parallel/check_plans.py: max |diff| relative to the largest logit
BOUND_S = 25          # a failure must end the job within this: keepalive 10 s or comm timeout 4 s, + slack
HANG_LIMIT_S = 60     # a job that hangs is killed after this: the test fails instead of stalling CI
COMM_TIMEOUT_S = "4"
# The link-down case that lets OpenMPI's keepalive (~10 s) find the lost host before the watchdog fires.
KEEPALIVE_FIRST_COMM_TIMEOUT_S = "30"

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
CLUSTER = os.path.join(SCRIPTS, "cluster.sh")
ENV = dict(os.environ, MOEX_CLUSTER_PREFIX=PREFIX, MOEX_CLUSTER_SUBNET=SUBNET, MOEX_COMM_TUNING="none",
           MOEX_COMM_TIMEOUT=COMM_TIMEOUT_S, OMPI_MCA_mpi_yield_when_idle="1",
           OMPI_MCA_btl_vader_single_copy_mechanism="none")
ENV.pop("MOEX_COMM_ALGO", None)
# What the ranks on the hosts need from this environment: like ssh, the agent starts them with a bare one.
FORWARD = ["-x", "MOEX_COMM_TUNING", "-x", "MOEX_COMM_TIMEOUT"]
failures = []


def start(cmd, env=ENV):
    try:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
    except OSError as e:
        sys.exit(f"FAIL: cannot run {cmd[0]}: {e}")


def kill_in_hosts():
    """SIGKILL to whatever runs inside the test's hosts (orteds, ranks): all of it was started by this test."""
    for h in (PREFIX + "0", PREFIX + "1"):
        pids = subprocess.run(["ip", "netns", "pids", h], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


def finish(proc, limit):
    """Waits up to `limit` s for proc to exit, then for its output. Returns (output, True if it had to be
    killed); proc.ended_at is when it exited (or was killed). A hung mpirun is killed with its process group.
    Processes inside the hosts can hold the output pipe after mpirun has exited (the agent runs each orted in
    its host, where ssh would be a local process that ends with its connection: the orted of a host whose link
    is down lingers until its own TCP gives up); they are killed once mpirun is gone."""
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=limit)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        hung = True
    proc.ended_at = time.monotonic()
    reader.join(timeout=5)
    if reader.is_alive():
        kill_in_hosts()
        reader.join(timeout=30)
    out = "".join(chunks)
    return (out + f"\n(killed: no end after {limit} s)", True) if hung else (out, False)


def run(cmd, timeout=HANG_LIMIT_S):
    begin = time.monotonic()
    proc = start(cmd)
    out, hung = finish(proc, timeout)
    return subprocess.CompletedProcess(cmd, -9 if hung else proc.returncode, out, ""), time.monotonic() - begin


def cluster(*args, timeout=60):
    return run(["bash", CLUSTER, *args], timeout)


def mpirun(*args, timeout=HANG_LIMIT_S):
    return cluster("mpirun", *FORWARD, *args, timeout=timeout)


def check(ok, what, detail=""):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)
        if detail:
            print(detail[-3000:])


def leftovers(run_netns_before=True):
    """What of the test's prefix exists on this machine: namespaces, links, addresses, cluster.sh's hostfile,
    and /run/netns (ip netns's mount point) when it did not exist before the test."""
    found = [HOSTS_FILE] if os.path.exists(HOSTS_FILE) else []
    if not run_netns_before and os.path.exists("/run/netns"):
        found.append("/run/netns")
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [l.split()[0] for l in ns.splitlines() if l.startswith(PREFIX)]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += [m for m in re.findall(r"^\d+: ([^:@]+)", links, re.M) if m.startswith(PREFIX)]
    addrs = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True).stdout
    found += [l.split()[3] for l in addrs.splitlines() if f" {SUBNET}." in l]
    return found


def can_run():
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, a bridge)"
    for tool in ("ip", "tc", "unshare", "mpirun"):
        if not shutil.which(tool):
            return f"{tool} not found (scripts/install-deps.sh installs iproute2 and openmpi-bin)"
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return "network/UTS namespaces are unavailable here: " + probe.stderr.strip()
    return None


def rank_pid(host):
    """The moex rank running in `host`'s namespace, or None."""
    pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "moex":
                    return int(pid)
        except OSError:
            pass
    return None


def cpu_seconds(pid):
    """User + system CPU time of process pid (0 when there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, IndexError, ValueError):
        return 0.0


def failing_job(cmd, fault, expect_line, env):
    """Starts `cmd` (a long mpirun job), lets it run, applies fault(); the job must end non-zero within
    BOUND_S of the fault with exactly one line matching expect_line."""
    proc = start(cmd, env)
    # The fault must meet the ranks decoding (a rank stopped inside MPI_Init would stall its peer where no
    # watchdog runs): wait until rank 1 has used 1 s of CPU, far more than start-up and loading take.
    deadline = time.monotonic() + 60
    while cpu_seconds(rank_pid(PREFIX + "1")) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is not None or cpu_seconds(rank_pid(PREFIX + "1")) < 1:
        out, _ = finish(proc, 10)
        return f"the job was not running at the time of the fault (exit {proc.returncode}):\n{out}"
    what = fault()
    begin = time.monotonic()
    out, hung = finish(proc, HANG_LIMIT_S)
    elapsed = proc.ended_at - begin
    print(out[-1500:])
    print(f"{what}: exit {proc.returncode} {elapsed:.1f} s after the fault")
    if hung:
        return f"the job hung (killed after {HANG_LIMIT_S} s)"
    problems = []
    if proc.returncode == 0:
        problems.append("the job did not fail")
    if elapsed > BOUND_S:
        problems.append(f"took {elapsed:.1f} s after the fault, bound {BOUND_S} s")
    hits = [l for l in out.splitlines() if re.search(expect_line, l)]
    if len(hits) != 1:
        problems.append(f"{len(hits)} lines match /{expect_line}/, expected 1")
    return "; ".join(problems)


def serve_across_hosts(moex, model):
    """moex serve on 2 hosts (rank 0 owns HTTP on host 0): a greedy completion through host 0's address,
    then SIGTERM to mpirun ends the job."""
    begin = time.monotonic()
    proc, base, ready = start_serve(moex, model, 256)
    answer, detail = None, ""
    if ready:
        try:
            answer = complete(base, 8, 30)
        except (OSError, ValueError) as e:
            detail = f"completion failed: {e}"
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)  # mpirun alone (cluster.sh execs it), as a user's kill would
    out, hung = finish(proc, 30)
    usage = (answer or {}).get("usage", {})
    check(ready and usage.get("completion_tokens") == 8 and "moe ep=2" in out,
          f"serve across 2 hosts (default plan: ep=2): a greedy completion of 8 tokens through {SUBNET}.1 "
          f"({time.monotonic() - begin:.1f} s)", detail + "\n" + out)
    # mpirun ends a job it is signalled to stop with exit 1 on one host too (OpenMPI 4.1): bounded, not clean.
    check(not hung, f"SIGTERM to mpirun ends the served job (exit {proc.returncode})", out)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--moex", required=True)
    parser.add_argument("--collectives-test", required=True, help="comm_collectives_test binary")
    args = parser.parse_args()
    moex = os.path.abspath(args.moex)

    reason = can_run()
    if reason:
        print(f"SKIP: {reason}")
        sys.exit(SKIP)
    # Every way out removes the hosts: SIGTERM/SIGINT/SIGHUP (ctest, ^C, a closed terminal) become an exit
    # that runs the `finally` below. SIGKILL cannot be caught: the next run removes what it left.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: sys.exit(128 + s))
    os.makedirs(os.path.dirname(LOCK), exist_ok=True)
    lock = open(LOCK, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    proc, _ = cluster("down")
    check(proc.returncode == 0 and not leftovers(), "hosts of an earlier run removed",
          proc.stdout + proc.stderr + str(leftovers()))
    run_netns_before = os.path.exists("/run/netns")
    try:
        proc, _ = cluster("up", "2")
        if proc.returncode != 0:
            check(False, "cluster.sh up 2", proc.stdout + proc.stderr)
            return
        print(proc.stdout.strip())
        for stale in glob.glob(os.path.join(tempfile.gettempdir(), WORK_PREFIX + "*")):
            shutil.rmtree(stale, ignore_errors=True)  # a killed run's (the lock makes it no one else's)
        with tempfile.TemporaryDirectory(prefix=WORK_PREFIX) as root:
            os.chmod(root, 0o755)
            run_checks(moex, args.collectives_test, root)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the clean-up itself is not interrupted
        proc, _ = cluster("down")
        left = leftovers(run_netns_before)
        check(proc.returncode == 0 and not left, "cluster.sh down leaves nothing behind",
              proc.stdout + proc.stderr + f"\nleft: {left}")
        fcntl.flock(lock, fcntl.LOCK_UN)


def run_checks(moex, collectives_test, root):
    model = os.path.join(root, "tiny")
    proc, _ = run([moex, "gen-model", "--preset", "tiny", "--seed", "11", "--out", model])
    if proc.returncode != 0:
        check(False, "gen-model tiny", proc.stdout + proc.stderr)
        return

    proc, t = mpirun("-np", "2", moex, "info")
    lines = [l.strip() for l in proc.stdout.splitlines()]
    map_ok = (proc.returncode == 0 and lines.count("ranks:        2 on 2 hosts") == 1 and
              f"host 0 {PREFIX}0: rank 0" in lines and f"host 1 {PREFIX}1: rank 1" in lines and
              sum(l.startswith("cpu features:") for l in lines) == 1)
    check(map_ok, f"moex info: 2 hosts, rank 0 on {PREFIX}0 and rank 1 on {PREFIX}1, printed once ({t:.1f} s)",
          proc.stdout + proc.stderr)

    proc, t = mpirun("-np", "4", "--map-by", "ppr:2:node", collectives_test, "hosts", "2")
    check(proc.returncode == 0 and "4 ranks, 0 failures" in proc.stdout,
          f"2 hosts x 2 ranks: host map, intra-host and inter-host groups; every all-reduce (the two-level ones "
          f"first) against the exact sum and MPI_Allreduce, every all-to-all(v) ({t:.1f} s)", proc.stdout + proc.stderr)

    ids = "5,17,42,9,33,71,2,60,11,28"
    common = ["logits", "--model", model, "--ids", ids, "--decode", "8", "--threads", "1", "--exact"]

    def logits(tag, launch):
        out = os.path.join(root, tag + ".npy")
        proc, t = launch(*common, "--out", out, "--tokens-out", out + ".tokens")
        if proc.returncode != 0:
            return None, None, t, proc.stdout + proc.stderr
        with open(out + ".tokens") as f:
            return np.load(out), f.read().split(), t, proc.stdout  # its "plan:" line

    base, base_tokens, _, text = logits("one-rank", lambda *a: run([moex, *a]))
    if base is None:
        check(False, "one-rank logits", text)
        return
    # 2 hosts x 1 rank each plan; 2 x 2 with the default plan, which must be TP inside each host x EP across
    # them, and whose world all-reduces auto runs in two levels (the cost model's pick there,
    # CommSelector.CostModelPicksTwoLevelsAcrossHosts).
    for plan, ranks in (("tp", 1), ("ep", 1), ("auto", 2)):
        tag = plan if ranks == 1 else f"{plan} 2x{ranks}"
        got, tokens, t, text = logits(tag.replace(" ", "-"), lambda *a: mpirun(
            "-np", str(2 * ranks), "--map-by", f"ppr:{ranks}:node", moex, *a, "--moe-parallel", plan))
        if got is None:
            check(False, f"{tag} across 2 hosts: run failed", text)
            continue
        if plan == "auto":
            check("plan: moe tp=2 x ep=2," in text, "the default plan on 2 hosts x 2 ranks is TP inside x EP across",
                  text)
        rel = float(np.abs(got.astype(np.float64) - base).max() / np.abs(base).max())
        check(rel <= TOL and tokens == base_tokens,
              f"{tag} across 2 hosts: max logit error {rel:.2e} (tolerance {TOL}), greedy tokens "
              f"{'identical' if tokens == base_tokens else 'differ'} ({t:.1f} s)")

    serve_across_hosts(moex, model)

    # A job that decodes far longer than it takes to start and apply the fault (~20 s here: 32 sequences of 4000
    # tokens), so that the fault, not its end, meets a running job; once a rank is lost it cannot finish.
    prompts = [a for i in range(32) for a in ("--prompt", f"sequence {i}")]
    long_job = ["bash", CLUSTER, "mpirun", *FORWARD, "-np", "2", moex, "generate", "--model", model, *prompts,
                "-n", "4000", "--max-seq-len", "4096", "--ignore-eos", "--threads", "1", "--moe-parallel", "tp"]

    def signal_rank(sig):
        def fault():
            pid = rank_pid(PREFIX + "1")
            os.kill(pid, sig)
            return f"rank 1 (pid {pid} in {PREFIX}1) sent {signal.Signals(sig).name}"
        return fault

    problems = failing_job(long_job, signal_rank(signal.SIGKILL),
                           rf"process rank 1 with PID \d+ on node {PREFIX}1 exited on signal 9", ENV)
    check(not problems, f"a rank killed on {PREFIX}1 ends the job; mpirun names the host", problems)

    problems = failing_job(long_job, signal_rank(signal.SIGSTOP), r"^moex: error: .*on host " + PREFIX + "0 waited " +
                           COMM_TIMEOUT_S + r" s with no progress from its peers \(still waiting for rank 1 on host " +
                           PREFIX + r"1\)", ENV)
    check(not problems, f"a rank stopped alive on {PREFIX}1 ends the job; the comm watchdog's line names the host",
          problems)

    def cut_link():
        subprocess.run(["ip", "-n", PREFIX + "1", "link", "set", "eth0", "down"], check=True)
        return f"{PREFIX}1's link set down"

    watchdog_line = (r"waited " + COMM_TIMEOUT_S + r" s with no progress from its peers \(still waiting for rank 1 "
                     r"on host " + PREFIX + r"1\)")
    problems = failing_job(long_job, cut_link, r"^moex: error: .*" + watchdog_line, ENV)
    restore_link()
    check(not problems, f"{PREFIX}1's link down, the watchdog first: the job ends; its line names the host", problems)
    problems = failing_job(long_job, cut_link, rf"Remote daemon: .* on node {PREFIX}1$",
                           dict(ENV, MOEX_COMM_TIMEOUT=KEEPALIVE_FIRST_COMM_TIMEOUT_S))
    restore_link()
    check(not problems, f"{PREFIX}1's link down, the keepalive first: the job ends; OpenMPI names the lost host",
          problems)
    serve_link_down(moex, model, cut_link, watchdog_line)


def restore_link():
    """Host 1's link up again for the next job, and nothing left of the last one in the hosts."""
    kill_in_hosts()
    subprocess.run(["ip", "-n", PREFIX + "1", "link", "set", "eth0", "up"], check=True)


def start_serve(moex, model, max_model_len, port_offset=0):
    """moex serve on 2 hosts, rank 0's HTTP on host 0: (mpirun's process, base URL, True once /health answers).
    Each serve job of a run takes its own port: an earlier one's may still be held (TIME_WAIT)."""
    port = 18000 + (os.getpid() % 500) * 2 + port_offset
    base = f"http://{SUBNET}.1:{port}"
    proc = start(["bash", CLUSTER, "mpirun", *FORWARD, "-np", "2", moex, "serve", "--model", model, "--threads", "1",
                  "--host", "0.0.0.0", "--port", str(port), "--max-model-len", str(max_model_len)])
    begin = time.monotonic()
    ready = False
    while not ready and proc.poll() is None and time.monotonic() - begin < HANG_LIMIT_S:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                ready = r.status == 200
        except OSError:
            time.sleep(0.3)
    return proc, base, ready


def complete(base, max_tokens, timeout):
    body = json.dumps({"model": "tiny", "prompt": "Hello world", "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.load(r)


def serve_link_down(moex, model, cut_link, watchdog_line):
    """A served request in flight when host 1's link goes down: rank 0's watchdog prints its line (naming the
    host) as serve's error, and the job ends within BOUND_S."""
    proc, base, ready = start_serve(moex, model, 4096, port_offset=1)
    if not ready:
        out, _ = finish(proc, 10)
        check(False, "serve for the link-down case did not start", out)
        return
    # 8 requests of 4000 tokens decode far longer than the fault takes (one of 3000 ended within 1.5 s once, the
    # server then idle: its empty steps notice nothing and the keepalive's line came instead); they fail with the job.
    for _ in range(8):
        threading.Thread(target=lambda: complete(base, 4000, HANG_LIMIT_S), daemon=True).start()
    time.sleep(1.5)
    what = cut_link()
    begin = time.monotonic()
    out, hung = finish(proc, HANG_LIMIT_S)
    elapsed = proc.ended_at - begin
    restore_link()
    hits = [l for l in out.splitlines() if re.search(r"^moex serve: error: .*" + watchdog_line, l)]
    print(f"serve: {what}: exit {proc.returncode} {elapsed:.1f} s after the fault")
    check(not hung and proc.returncode != 0 and elapsed <= BOUND_S and len(hits) == 1,
          f"serve with a request in flight, {PREFIX}1's link down: one line of serve's naming the host, "
          f"the job ends ({elapsed:.1f} s, bound {BOUND_S} s)", out)


if __name__ == "__main__":
    main()
    print(f"{len(failures)} failed" if failures else "PASS")
    sys.exit(1 if failures else 0)
