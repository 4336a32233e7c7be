#!/usr/bin/env python3
"""Files: nothing the user owns is destroyed or half-written, and no mix of two models loads.

Drives the real `moex` binary on tiny models (sharded with --max-shard-size) and checks, against the bytes
on disk (numpy's own reading of safetensors, byte comparisons), never against moex's earlier output:
  * gen-model refuses a non-empty --out without --force, and leaves it byte for byte as it was;
  * gen-model --force replaces the model with new files: a reader that has the old shard mapped keeps
    reading the old bytes (no SIGBUS, no new bytes), other files in the folder are kept;
  * a gen-model killed mid-write leaves the old model intact (or the complete new one), loadable;
  * shards of two runs, a wrong index total_size, leftover weight files: refused with one line;
  * logits refuses to write onto a file of the model folder or twice onto one file; outputs that cannot be
    written (/dev/full) are an error and leave the user's files as they were; /dev/stdout still works;
  * --router-skew is bounded and the largest allowed skew writes finite weights;
  * --check-weights names the tensor holding a NaN, and NaN logits are an error naming the position.
"""
import argparse
import glob
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np

FAILURES = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        FAILURES.append(what)
    return ok


def run(argv, timeout=300):
    p = subprocess.run(argv, capture_output=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr.decode(errors="replace")


def one_line_error(name, result, needle):
    """Non-zero exit (not a signal), exactly one line on stderr, naming `needle`."""
    rc, _, err = result
    lines = [l for l in err.splitlines() if l.strip()]
    ok = rc > 0 and len(lines) == 1 and needle.lower() in err.lower()
    return check(ok, f"{name}: exit {rc}, stderr {err.strip()!r} (want one line naming {needle!r})")


def snapshot(folder):
    """Every file's bytes, by name (the independent record of what the folder held)."""
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, n))}


def read_safetensors(path):
    """name -> (dtype, shape, raw bytes), by the format's definition."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], raw[8 + n + b:8 + n + e])
    return out


def as_float(dtype, blob):
    if dtype == "BF16":
        return (np.frombuffer(blob, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(blob, dtype=np.float32)


def moex_and_fresh_workdir(doc):
    """The --moex binary and the --workdir, emptied: the arguments of the tests here."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    args = p.parse_args()
    work = os.path.abspath(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    return os.path.abspath(args.moex), work


def main():
    moex, work = moex_and_fresh_workdir(__doc__)
    shard = ["--max-shard-size", "300KB"]  # tiny is ~1.3 MB: 5 shards

    def gen(out, seed, *extra):
        return run([moex, "gen-model", "--preset", "tiny", "--seed", str(seed), "--out", out, *shard, *extra])

    def logits(model, out, *extra):
        return run([moex, "logits", "--model", model, "--ids", "1,2,3", "--decode", "2", "--out", out, *extra])

    def loads(model):
        return logits(model, os.path.join(work, "probe.npy"))[0] == 0

    # --- gen-model onto a non-empty folder ---------------------------------------------------------
    a = os.path.join(work, "a")
    check(gen(a, 1)[0] == 0, "gen-model writes a sharded tiny model into a new folder")
    shards = sorted(glob.glob(os.path.join(a, "model-*-of-*.safetensors")))
    check(len(shards) > 1, f"--max-shard-size 300KB gives several shards ({len(shards)})")
    with open(os.path.join(a, "notes.txt"), "w") as f:
        f.write("the user's own file\n")
    before = snapshot(a)
    one_line_error("gen-model onto a non-empty folder without --force", gen(a, 2), "--force")
    check(snapshot(a) == before, "the refused folder is byte for byte as it was")

    # --- --force: new inodes, a reader of the old mapping survives ---------------------------------
    reader_code = r"""
import mmap, sys, hashlib
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
want = hashlib.sha256(m[:]).hexdigest()
print("mapped", flush=True)
sys.stdin.readline()
got = hashlib.sha256(m[:]).hexdigest()  # SIGBUS here if the file was truncated under the mapping
sys.exit(0 if got == want else 3)
"""
    reader = subprocess.Popen([sys.executable, "-c", reader_code, shards[0]], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    reader.stdout.readline()
    old_logits = os.path.join(work, "old.npy")
    logits(a, old_logits)
    rc = gen(a, 2, "--force")[0]
    check(rc == 0, f"gen-model --force replaces the model (exit {rc})")
    reader.stdin.write("go\n")
    reader.stdin.flush()
    reader_rc = reader.wait(timeout=60)
    check(rc == 0 and reader_rc == 0, f"a reader holding the old shard mapped still reads the old bytes after the "
                                      f"rewrite (exit {reader_rc}; -7 = SIGBUS, 3 = bytes changed under it)")
    ref2 = os.path.join(work, "ref2")
    gen(ref2, 2)
    after = snapshot(a)
    check(after.get("notes.txt") == before["notes.txt"], "--force keeps the user's other files")
    after.pop("notes.txt", None)
    check(after == snapshot(ref2), "after --force the folder holds exactly the new model (same bytes as a fresh run)")
    check(not glob.glob(a + ".gen-model-tmp-*"), "no staging folder is left after a completed run")
    new_logits = os.path.join(work, "new.npy")
    check(logits(a, new_logits)[0] == 0 and not np.array_equal(np.load(old_logits), np.load(new_logits)),
          "the replaced model loads and gives other logits than the old one")

    # --- gen-model killed mid-write over an existing model -----------------------------------------
    big = os.path.join(work, "big")
    big_args = ["--preset", "small", "--layers", "12", "--max-shard-size", "4MB", "--threads", "1"]
    run([moex, "gen-model", *big_args, "--seed", "1", "--out", big])
    big_before = snapshot(big)
    def identity(path):
        try:
            st = os.stat(path)
            return st.st_ino, st.st_mtime_ns, st.st_size
        except FileNotFoundError:
            return None
    stats = {n: identity(os.path.join(big, n)) for n in big_before}
    victim = subprocess.Popen([moex, "gen-model", *big_args, "--seed", "2", "--out", big, "--force"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    seen = None
    while time.time() < deadline and victim.poll() is None:
        staged = [d for d in glob.glob(big + ".gen-model-tmp-*") if any(".safetensors" in n for n in os.listdir(d))]
        changed = [n for n in big_before if identity(os.path.join(big, n)) != stats[n]]
        if staged or changed:
            seen = "staging folder" if staged else "a changed file in --out"
            break
        time.sleep(0.001)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    check(seen is not None, f"gen-model was killed mid-write (after it wrote {seen})")
    now = snapshot(big)
    ref_big = os.path.join(work, "ref_big")
    run([moex, "gen-model", *big_args, "--seed", "2", "--out", ref_big])
    intact = now == big_before
    complete = now == snapshot(ref_big)
    check(intact or complete, f"after the kill --out holds the old model intact ({intact}) or the complete new one "
                              f"({complete}), never a mix")
    check(loads(big), "and it loads")
    for d in glob.glob(big + ".gen-model-tmp-*"):
        shutil.rmtree(d)

    # --- folders mixing two checkpoints ------------------------------------------------------------
    m1, m2 = os.path.join(work, "m1"), os.path.join(work, "m2")
    gen(m1, 1)
    gen(m2, 2)
    names = sorted(os.path.basename(s) for s in glob.glob(os.path.join(m1, "model-*-of-*.safetensors")))

    def mixed(name, edit):
        d = os.path.join(work, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(m1, d)
        edit(d)
        return d

    d = mixed("mix_seed", lambda d: shutil.copy(os.path.join(m2, names[1]), os.path.join(d, names[1])))
    one_line_error("a shard of another seed (same names and sizes)", logits(d, os.path.join(work, "x.npy")),
                   "another checkpoint")
    d = mixed("mix_index", lambda d: shutil.copy(os.path.join(m2, "model.safetensors.index.json"), d))
    one_line_error("the index of another seed", logits(d, os.path.join(work, "x.npy")), "another checkpoint")

    def bump_total(d):
        path = os.path.join(d, "model.safetensors.index.json")
        index = json.load(open(path))
        index["metadata"]["total_size"] += 2
        json.dump(index, open(path, "w"))
    d = mixed("mix_total", bump_total)
    one_line_error("an index whose total_size is not the shards' tensor bytes", logits(d, os.path.join(work, "x.npy")),
                   "total_size")

    single = os.path.join(work, "single")
    run([moex, "gen-model", "--preset", "tiny", "--seed", "1", "--out", single])
    d = mixed("leftover_shard", lambda d: None)
    shutil.rmtree(d)
    shutil.copytree(single, d)
    shutil.copy(os.path.join(m2, names[0]), d)
    one_line_error("a single-file model with a leftover shard beside it", logits(d, os.path.join(work, "x.npy")),
                   names[0])
    d = mixed("leftover_single", lambda d: shutil.copy(os.path.join(single, "model.safetensors"), d))
    one_line_error("a sharded model with a leftover model.safetensors beside it", logits(d, os.path.join(work, "x.npy")),
                   "model.safetensors")

    # --- logits outputs ----------------------------------------------------------------------------
    model_before = snapshot(single)
    one_line_error("logits --out onto the model's own model.safetensors",
                   logits(single, os.path.join(single, "model.safetensors")), "model folder")
    link = os.path.join(work, "link.npy")
    os.symlink(os.path.join(single, "config.json"), link)
    one_line_error("logits --out onto a symlink to the model's config.json", logits(single, link), "model folder")
    one_line_error("logits --stats-out onto a shard of the model", logits(a, os.path.join(work, "s.npy"),
                   "--stats-out", os.path.join(a, names[0])), "model folder")
    check(snapshot(single) == model_before, "the model files are untouched")
    same = os.path.join(work, "same.txt")
    one_line_error("--out X --tokens-out X", logits(single, same, "--tokens-out", same), "same file")
    check(not os.path.exists(same), "and X was not written")

    keep = os.path.join(work, "keep.npy")
    with open(keep, "wb") as f:
        f.write(b"the user's earlier result")
    one_line_error("--out /dev/full", logits(single, "/dev/full"), "/dev/full")
    one_line_error("--tokens-out /dev/full", logits(single, keep, "--tokens-out", "/dev/full"), "/dev/full")
    check(open(keep, "rb").read() == b"the user's earlier result",
          "a run whose --tokens-out failed leaves --out as it was (outputs are renamed in only when all are written)")
    one_line_error("--stats-out /dev/full", logits(single, keep, "--stats-out", "/dev/full"), "/dev/full")
    check(not [n for n in os.listdir(work) if "-tmp-" in n], "no temporary output files are left behind")
    rc, out, _ = logits(single, "/dev/stdout")
    check(rc == 0 and out.startswith(b"\x93NUMPY"), "--out /dev/stdout still writes the .npy to stdout")
    rc, _, _ = logits(single, keep, "--tokens-out", os.path.join(work, "tokens.txt"))
    check(rc == 0 and np.load(keep).shape == (5, 512) and
          len(open(os.path.join(work, "tokens.txt")).read().split()) == 2, "outputs onto existing files are replaced")

    # --- router skew, non-finite weights -----------------------------------------------------------
    one_line_error("gen-model --router-skew 1000", gen(os.path.join(work, "skew1000"), 1, "--router-skew", "1000"),
                   "--router-skew")
    check(not os.path.exists(os.path.join(work, "skew1000")), "and nothing was written")
    _, help_text, _ = run([moex, "gen-model", "--help"])
    check(b"at most 16" in help_text, "gen-model --help states the bound of --router-skew")
    skew = os.path.join(work, "skew16")
    rc = run([moex, "gen-model", "--preset", "tiny", "--seed", "1", "--router-skew", "16", "--out", skew])[0]
    finite = rc == 0 and all(np.isfinite(as_float(t, b)).all()
                             for t, _, b in read_safetensors(os.path.join(skew, "model.safetensors")).values())
    check(finite, "--router-skew 16 (the bound) writes only finite weights")
    check(loads(skew), "and the model gives finite logits")

    def inject_nan(name, tensor, element):
        d = os.path.join(work, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(single, d)
        path = os.path.join(d, "model.safetensors")
        raw = bytearray(open(path, "rb").read())
        n = struct.unpack("<Q", raw[:8])[0]
        info = json.loads(raw[8:8 + n])[tensor]
        assert info["dtype"] == "BF16"
        at = 8 + n + info["data_offsets"][0] + 2 * element
        raw[at:at + 2] = struct.pack("<H", 0x7FC0)  # a quiet NaN in bf16
        open(path, "wb").write(raw)
        return d

    d = inject_nan("nan_norm", "model.norm.weight", 3)
    one_line_error("--check-weights on a NaN in model.norm.weight",
                   logits(d, os.path.join(work, "x.npy"), "--check-weights"), "model.norm.weight")
    one_line_error("logits without --check-weights: NaN logits are an error naming the position",
                   logits(d, os.path.join(work, "nan.npy")), "position 0")
    check(not os.path.exists(os.path.join(work, "nan.npy")), "and no .npy of NaN was written")
    expert = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    d = inject_nan("nan_expert", expert, 1000)
    one_line_error("--check-weights on a NaN in an expert no token may reach",
                   logits(d, os.path.join(work, "x.npy"), "--check-weights"), expert)
    check(logits(single, os.path.join(work, "x.npy"), "--check-weights")[0] == 0,
          "--check-weights accepts a healthy model")

    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed")
        return 1
    print("all file-safety checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
