#!/usr/bin/env python3
"""An error on one MPI rank (or on all), or ranks that disagree, must end the whole job quickly: non-zero exit
of mpirun, each distinct moex message printed once (one line), nothing left in /dev/shm. One --case per ctest.

Runs itself again in a private mount namespace with its own tmpfs on /dev/shm (when `unshare` is allowed), so
that what other jobs on the machine do there cannot pass or fail the check. Without it, OpenMPI's backing
files go to a private folder instead, which checks the same clean-up."""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HANG_LIMIT_S = 60   # `timeout` kills a hung job: the test fails instead of stalling CI
BOUND_S = 20        # "within seconds", with room for a loaded 2-core CI machine
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]

GEN = ["generate", "--prompt", "hello", "-n", "4"]


def logits(ids="1,2,3"):
    return ["logits", "--ids", ids, "--decode", "2"]


SERVE = ["serve", "--port", "0"]
EP = ["--moe-parallel", "ep", "--attn-parallel", "dp"]  # how a quantized checkpoint loads on several ranks


def other_weights(tensor, rank=1):
    """The line naming the first tensor (in name order) whose bytes differ, with both digests."""
    return rf"rank {rank} differs from rank 0: {tensor} content is XXH3 [0-9a-f]{{16}}, rank 0 has XXH3 [0-9a-f]{{16}}$"


# case -> (rank 0's args, rank 1's args, expected exit code, expected message lines as regexes)
# "{tiny}" etc. are model folders made in setup(); each rank's arguments follow the binary.
CASES = {
    # item A: an error on one rank, or on both
    "bad_flag_one_rank": (GEN + ["--model", "{tiny}"], GEN + ["--model", "{tiny}", "--bogus", "1"], 2,
                          [r"rank 1: The following arguments were not expected"]),
    "bad_value_one_rank": (GEN + ["--model", "{tiny}"], GEN + ["--model", "{tiny}", "--top-p", "5"], 2,
                           [r"rank 1 differs from rank 0: --top-p is 5, rank 0 has 1"]),
    "bad_config_one_rank": (GEN + ["--model", "{tiny}"], GEN + ["--model", "{badcfg}"], 2,
                            [r"rank 1: .*badcfg/config.json: not valid JSON"]),
    "bad_checkpoint_one_rank": (GEN + ["--model", "{tiny}"], GEN + ["--model", "{trunc}"], 2,
                                [r"rank 1: .*trunc/model.safetensors: .*truncated"]),
    # The tokenizer is read before any check: rank 0 is already waiting in a collective (the abort path).
    "bad_tokenizer_one_rank": (GEN + ["--model", "{tiny}"], GEN + ["--model", "{badtok}"], 2,
                               [r"rank 1: .*badtok/tokenizer.json: not valid JSON"]),
    # Same command everywhere; rank 0 alone writes --stats-out, after the forward passes, and fails there
    # while rank 1 has gone on (the abort path, not the start-up check).
    "error_mid_run_one_rank": (logits() + ["--model", "{tiny}", "--stats-out", "{missing}/stats.json"],
                               logits() + ["--model", "{tiny}", "--stats-out", "{missing}/stats.json"], 2,
                               [r"rank 0: --stats-out: cannot write .*no-such-folder/stats.json"]),
    "error_on_both_ranks": (GEN + ["--model", "{tiny}", "--top-p", "5"], GEN + ["--model", "{tiny}", "--top-p", "5"],
                            2, [r"ranks? 0(,1)?: (top_p \()?--top-p\)? must be in \(0, 1\], got 5"]),
    # Both errors in the same start-up check (generate reads the tokenizer and config.json first; a rank whose
    # only fault is in its weights would not get that far once another rank has failed).
    "distinct_errors_on_both_ranks": (GEN + ["--model", "{badcfg}"], GEN + ["--model", "{badtok}"], 2,
                                      [r"rank 0: .*badcfg/config.json: not valid JSON",
                                       r"rank 1: .*badtok/tokenizer.json: not valid JSON"]),
    # item B: ranks that disagree
    "differ_comm_dtype": (logits() + ["--model", "{tiny}"], logits() + ["--model", "{tiny}", "--comm-dtype", "bf16"],
                          2, [r"rank 1 differs from rank 0: --comm-dtype is bf16, rank 0 has f32"]),
    "differ_moe_parallel": (logits() + ["--model", "{tiny}"],
                            logits() + ["--model", "{tiny}", "--moe-parallel", "ep"], 2,
                            [r"rank 1 differs from rank 0: --moe-parallel is ep, rank 0 has auto"]),
    "differ_model_content": (logits() + ["--model", "{tiny}"], logits() + ["--model", "{wider}"], 2,
                             [r"rank 1 differs from rank 0: config.json rope_theta is 500000.0, rank 0 has [0-9.e+]+"]),
    "differ_seed": (GEN + ["--model", "{tiny}", "--seed", "1"], GEN + ["--model", "{tiny}", "--seed", "2"], 2,
                    [r"rank 1 differs from rank 0: --seed is 2, rank 0 has 1"]),
    "differ_ids": (logits("1,2,3") + ["--model", "{tiny}"], logits("1,2,4") + ["--model", "{tiny}"], 2,
                   [r"rank 1 differs from rank 0: --ids is 1,2,4, rank 0 has 1,2,3"]),
    "differ_env": (logits() + ["--model", "{tiny}"], ["-x", "MOEX_COMM_ALGO=allreduce=ring"] + logits() + ["--model", "{tiny}"],
                   2, [r"rank 1 differs from rank 0: MOEX_COMM_ALGO is allreduce=ring, rank 0 has \(not set\)"]),
    # Same config, shapes and tokenizer, other weights (gen-model's seed): only the weights' bytes tell, and each
    # TP rank would compute with its own half of every expert. Each command that loads a model refuses to start.
    "differ_weights": (GEN + ["--model", "{tiny}"], GEN + ["--model", "{tiny2}"], 2,
                       [other_weights(r"tensor lm_head\.weight")]),
    "differ_weights_logits": (logits() + ["--model", "{tiny}"], logits() + ["--model", "{tiny2}"], 2,
                              [other_weights(r"tensor lm_head\.weight")]),
    # Exits instead of serving (a server that started would be killed by the timeout: "hung").
    "differ_weights_serve": (SERVE + ["--model", "{tiny}"], SERVE + ["--model", "{tiny2}"], 2,
                             [other_weights(r"tensor lm_head\.weight")]),
    # Quantized checkpoints of the two (codes and panels.moex), loaded under EP with whole attention.
    "differ_quantized_weights": (logits() + EP + ["--model", "{q1}"], logits() + EP + ["--model", "{q2}"], 2,
                                 [other_weights(r"tensor lm_head\.weight")]),
    # The same codes, one byte of panels.moex changed: the panels are what the load maps.
    "differ_panels": (logits() + EP + ["--model", "{q1}"], logits() + EP + ["--model", "{q1panels}"], 2,
                      [other_weights(r"panels\.moex tensor \S+\.data")]),
    "differ_gguf_weights": (GEN + ["--model", "{gguf1}"], GEN + ["--model", "{gguf2}"], 2,
                            [other_weights(r"tensor blk\.0\.attn_k\.weight")]),
    # Formats chosen at load are flags, compared as every flag is.
    "differ_weights_flag": (logits() + ["--model", "{tiny}", "--weights", "int8"],
                            logits() + ["--model", "{tiny}", "--weights", "bf16"], 2,
                            [r"rank 1 differs from rank 0: --weights is bf16, rank 0 has int8"]),
}


def shm_entries():
    return set(os.listdir("/dev/shm"))


def run_job(cmd, env):
    start = time.monotonic()
    try:
        proc = subprocess.run(["timeout", str(HANG_LIMIT_S)] + cmd, capture_output=True, text=True, env=env)
    except OSError as e:
        sys.exit(f"FAIL: cannot run {cmd[0]}: {e}")
    return proc, time.monotonic() - start


def check_failure(proc, elapsed, code, patterns, shm_before):
    out = proc.stdout + proc.stderr
    print(out[-3000:])
    print(f"exit {proc.returncode} after {elapsed:.1f} s")
    failures = []
    if proc.returncode == 124:
        failures.append(f"the job hung (killed by timeout after {HANG_LIMIT_S} s)")
    elif proc.returncode != code:
        failures.append(f"exit code {proc.returncode}, expected {code}")
    if elapsed > BOUND_S:
        failures.append(f"took {elapsed:.1f} s, bound {BOUND_S} s")
    lines = [l for l in out.splitlines() if l.startswith("moex:")]
    for pattern in patterns:
        hits = [l for l in lines if re.search(pattern, l)]
        if len(hits) != 1:
            failures.append(f"{len(hits)} lines match /{pattern}/, expected exactly 1")
    if len(lines) != len(patterns):
        failures.append(f"{len(lines)} moex lines, expected {len(patterns)}: {lines}")
    left = shm_entries() - shm_before
    if left:
        failures.append(f"left in /dev/shm: {sorted(left)}")
    return failures


def setup(moex, root, needed):
    """The model folders every case may name, and those of `needed` that only some cases name."""
    folders = {}

    def run(*args):
        subprocess.run([moex, *args], check=True, capture_output=True)

    def gen(seed, *extra):
        return lambda path: run("gen-model", "--preset", "tiny", "--seed", seed, *extra, "--out", path)

    makers = {
        "tiny": gen("1"),
        "tiny2": gen("2"),  # same config, shapes and tokenizer; other weights
        "sharded": gen("1", "--max-shard-size", "300KB"),  # tiny's weights in four shards
        "q1": lambda path: run("quantize", "--model", make("tiny"), "--weights", "int8", "--out", path),
        "q2": lambda path: run("quantize", "--model", make("tiny2"), "--weights", "int8", "--out", path),
        "q1panels": lambda path: (shutil.copytree(make("q1"), path), flip_data_byte(os.path.join(path, "panels.moex"))),
        "gguf1": lambda path: run("convert", "--model", make("tiny"), "--out", path),
        "gguf2": lambda path: run("convert", "--model", make("tiny2"), "--out", path),
    }

    def make(name):
        if name not in folders:
            folders[name] = os.path.join(root, name + (".gguf" if name.startswith("gguf") else ""))
            makers[name](folders[name])
        return folders[name]

    tiny = make("tiny")
    for name in needed:  # the others only for the cases that name them (a moex run or two each)
        if name in makers:
            make(name)
    folders["missing"] = os.path.join(root, "no-such-folder")
    for name in ("badcfg", "trunc", "badtok", "copy", "wider"):
        folders[name] = os.path.join(root, name)
        shutil.copytree(tiny, folders[name])
    with open(os.path.join(folders["badcfg"], "config.json"), "w") as f:
        f.write('{"hidden_size": ')
    os.truncate(os.path.join(folders["trunc"], "model.safetensors"), 5000)
    with open(os.path.join(folders["badtok"], "tokenizer.json"), "w") as f:  # what generate reads first
        f.write("not a tokenizer.json\n")
    # Same tensors, one config value changed: weights alone cannot tell these two models apart.
    path = os.path.join(folders["wider"], "config.json")
    with open(path) as f:
        config = json.load(f)
    config["rope_theta"] = 500000.0
    with open(path, "w") as f:
        json.dump(config, f)
    return folders


def flip_data_byte(path):
    """Changes one byte of a safetensors file's first tensor, leaving its header (and so its shapes) alone."""
    with open(path, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header + 100)
        byte = f.read(1)[0]
        f.seek(8 + header + 100)
        f.write(bytes([byte ^ 0x40]))


def mpmd(moex, folders, *ranks):
    """One mpirun of one rank per argument list (rank 0's, rank 1's, ...); a list may start with "-x VAR=..."."""
    command = MPIRUN
    for i, args in enumerate(ranks):
        args = [a.format(**folders) for a in args]
        options = []
        while args and args[0] == "-x":  # mpirun options of this rank's part
            options += args[:2]
            args = args[2:]
        command = command + ([":"] if i else []) + ["-np", "1"] + options + [moex] + args
    return command


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moex", required=True)
    parser.add_argument("--fault-test", help="comm_fault_test binary (cases fault_*)")
    parser.add_argument("--case", required=True)
    parser.add_argument("--in-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    env = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1", OMPI_MCA_btl_vader_single_copy_mechanism="none",
               MOEX_COMM_TUNING="none")
    env.pop("MOEX_COMM_ALGO", None)
    if not args.in_namespace:
        # A private /dev/shm: mount a tmpfs there in a new mount namespace, then run this script in it.
        probe = subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"],
                               capture_output=True)
        if probe.returncode == 0:
            cmd = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh",
                   sys.executable] + sys.argv + ["--in-namespace"]
            sys.exit(subprocess.run(cmd).returncode)
        private = tempfile.mkdtemp(prefix="moex-shm-")
        print(f"(no mount namespace: OpenMPI's backing files go to {private} instead of /dev/shm)")
        env.update(OMPI_MCA_btl_vader_backing_directory=private, OMPI_MCA_osc_sm_backing_directory=private)
        global shm_entries
        shm_entries = lambda: set(os.listdir(private))

    with tempfile.TemporaryDirectory() as root:
        named = " ".join(sum(CASES.get(args.case, ([], []))[:2], []))
        needed = re.findall(r"\{(\w+)\}", named) + {"same_model_other_path": ["sharded"],
                                                       "four_ranks_two_copies": ["tiny2"]}.get(args.case, [])
        folders = setup(args.moex, root, needed)
        before = shm_entries()
        if args.case == "same_model_other_path":
            # Same content under two paths, or in other shards (the weights' bytes are compared per tensor), is the
            # same model: runs, and gives the logits of rank 0's folder alone.
            others = ("tiny", "copy", "sharded")
            outs = []
            for other in others:
                out = os.path.join(root, f"{other}.npy")
                cmd = mpmd(args.moex, folders, logits() + ["--model", "{tiny}", "--out", out],
                           logits() + ["--model", "{" + other + "}", "--out", out])
                proc, elapsed = run_job(cmd, env)
                print(proc.stdout + proc.stderr)
                if proc.returncode != 0:
                    sys.exit(f"FAIL: exit {proc.returncode} with model folders tiny and {other}")
                with open(out, "rb") as f:
                    outs.append(f.read())
            for other, out in zip(others[1:], outs[1:]):
                if out != outs[0]:
                    sys.exit(f"FAIL: the logits differ between the same model in tiny alone and in tiny and {other}")
            if shm_entries() - before:
                sys.exit(f"FAIL: left in /dev/shm: {sorted(shm_entries() - before)}")
            print("PASS")
            return
        if args.case == "four_ranks_two_copies":
            # Ranks 0 to 2 map one folder and share out its hashing (each hashes every third piece); rank 3 maps a
            # copy and hashes it whole: their digests agree only if the shares are put together right. The same
            # model runs; other weights on rank 3 are named as rank 3's.
            job = lambda *names: mpmd(args.moex, folders, *[logits() + ["--model", "{" + name + "}", "--out",
                                                                       os.path.join(root, "l.npy")] for name in names])
            info = dict(env, MOEX_LOG_LEVEL="2")  # which share of its copy each rank hashed
            proc, elapsed = run_job(job("tiny", "tiny", "tiny", "copy"), info)
            print(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                sys.exit(f"FAIL: exit {proc.returncode} with model folders tiny, tiny, tiny and copy")
            shares = re.findall(r"moex: hashed (1/\d+) of the weights", proc.stderr)
            if sorted(shares) != ["1/1", "1/3", "1/3", "1/3"]:
                sys.exit(f"FAIL: the ranks hashed {shares} of their copies, expected 1/3 on ranks 0-2 and 1/1 on rank 3")
            cmd = job("tiny", "tiny", "tiny", "tiny2")
            code, patterns = 2, [other_weights(r"tensor lm_head\.weight", rank=3)]
        elif args.case.startswith("fault_"):
            mode = args.case[len("fault_"):]
            cmd = MPIRUN + ["-np", "3", args.fault_test, mode, "shm"]
            code = 2
            patterns = ([r"rank 1: fault test: the same error"] if mode == "throw" else
                        [r"rank 0: fault test: rank 0's own error", r"ranks 1,2: fault test: the same error"])
        else:
            rank0, rank1, code, patterns = CASES[args.case]
            if rank0[0] == "logits":
                rank0 = rank0 + ["--out", os.path.join(root, "l0.npy")]
                rank1 = rank1 + ["--out", os.path.join(root, "l0.npy")]
            cmd = mpmd(args.moex, folders, rank0, rank1)
        print(" ".join(cmd))
        proc, elapsed = run_job(cmd, env)
        failures = check_failure(proc, elapsed, code, patterns, before)
        if failures:
            for f in failures:
                print("FAIL:", f)
            sys.exit(1)
        print("PASS")


if __name__ == "__main__":
    main()
