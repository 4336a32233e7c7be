#!/usr/bin/env python3
"""panels.moex for a bf16 checkpoint (`moex pack`; model/panels_file.h, docs/kernels.md "panels.moex").

- the default path's logits with the panels mapped equal, bit for bit, those of the same load packing at load, and
  the mapped bytes are what runs (a panels copy with lm_head's panels altered changes the logits);
- nothing is written into the model folder by a load; `moex pack --out PATH` + `--panels PATH` serve a read-only
  folder (and, when the test is not root, `moex pack` into a read-only folder is one line naming --out);
- a stale file (a shard's mtime changed), a truncated one, one of another weight path (int8 panels for a bf16
  load, bf16 panels named for an int8 load) and an existing file without --force: one line, exit 2;
  bf16 panels beside a load of another path (--weights int8) are left alone (the load packs int8 as without them);
- under --tp 2 and --moe-parallel ep (mpirun, when there), the logits with the panels equal those without.
"""
import argparse
import functools
import json
import os
import shutil
import stat
import struct
import subprocess
import sys

import numpy as np

import one_line_error

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--skip-ranks", action="store_true",
                   help="leave out the mpirun cases (a sanitizer build: LeakSanitizer fails on OpenMPI's own allocations)")
    args = p.parse_args()
    moex, work = os.path.abspath(args.moex), os.path.abspath(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    model = os.path.join(work, "model")
    subprocess.run([moex, "gen-model", "--preset", "tiny", "--seed", "7", "--out", model], check=True, capture_output=True)
    failures = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    def logits(name, d, *extra, launcher=()):
        out = os.path.join(work, name + ".npy")
        r = subprocess.run([*launcher, moex, "logits", "--model", d, "--ids", "1,2,3,4,5", "--out", out, *extra],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, MOEX_LOG_LEVEL="2"))
        if r.returncode != 0:
            failures.append(f"{name}: exit {r.returncode}: {r.stderr.strip()}")
            print(f"FAIL {name}: {r.stderr.strip()}")
            return None, r.stderr
        return np.load(out), r.stderr

    def same(a, b):
        return a is not None and b is not None and a.shape == b.shape and a.tobytes() == b.tobytes()

    expect_error = functools.partial(one_line_error.expect_error, failures)

    listing = lambda d: sorted(os.listdir(d))
    before = listing(model)
    packed, _ = logits("packed", model)  # --weights auto, no panels: packed to bf16 at load
    exact, _ = logits("exact", model, "--exact")
    check(listing(model) == before, "a load writes nothing into the model folder")
    check(packed is not None and exact is not None and not same(packed, exact),
          "the default path is bf16 (its logits differ from --exact's), so the panels below are exercised")

    # moex pack beside the checkpoint; the load maps it.
    r = subprocess.run([moex, "pack", "--model", model], capture_output=True, text=True)
    panels = os.path.join(model, "panels.moex")
    check(r.returncode == 0 and os.path.exists(panels), "moex pack writes panels.moex beside a bf16 checkpoint: " +
          r.stdout.strip().replace("\n", " | "))
    mapped, err = logits("mapped", model)
    check("mapping the packed panels" in err, "the load maps panels.moex")
    check(same(packed, mapped), "mapped bf16 panels give the logits of packing at load, bit for bit")
    none, err = logits("none", model, "--panels", "none")
    check(same(packed, none) and "mapping" not in err, "--panels none packs at load")
    expect_error("pack over an existing file", [moex, "pack", "--model", model], "exists", "--force")

    # The mapped bytes are what runs: lm_head's panels altered in a copy change the logits.
    altered = os.path.join(work, "altered.moex")
    shutil.copyfile(panels, altered)
    with open(altered, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        begin, end = header["lm_head.data"]["data_offsets"]
        f.seek(8 + n + begin)
        f.write(bytes(min(4096, end - begin)))  # zeros: the first rows' weights
    changed, _ = logits("altered", model, "--panels", altered)
    check(changed is not None and not same(changed, packed), "a load with --panels runs the mapped bytes")

    # A read-only folder: the panels elsewhere (--out), named at load (--panels).
    ro = os.path.join(work, "ro")
    shutil.copytree(model, ro, ignore=shutil.ignore_patterns("panels.moex"))  # copy2: mtimes kept
    elsewhere = os.path.join(work, "cache", "ro.panels.moex")
    os.makedirs(os.path.dirname(elsewhere))
    os.chmod(ro, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    try:
        if os.geteuid() != 0:  # root writes through a folder's permission bits; access() then says writable
            expect_error("pack into a read-only folder", [moex, "pack", "--model", ro], "read-only", "--out", "--panels")
        r = subprocess.run([moex, "pack", "--model", ro, "--out", elsewhere], capture_output=True, text=True)
        check(r.returncode == 0 and os.path.exists(elsewhere), "moex pack --out writes the panels outside the folder")
        check("panels.moex" not in listing(ro), "moex pack --out writes nothing into the model folder")
        ro_mapped, err = logits("ro", ro, "--panels", elsewhere)
        check("mapping the packed panels" in err and same(ro_mapped, packed), "--panels PATH maps them: the same logits")
    finally:
        os.chmod(ro, 0o755)
    expect_error("--panels of a missing file", [moex, "logits", "--model", model, "--ids", "1", "--out",
                                                os.path.join(work, "x.npy"), "--panels", os.path.join(work, "nope")],
                 "does not exist", "moex pack")

    # Stale: a shard rewritten in place keeps its header; its mtime moves.
    stale = os.path.join(work, "stale")
    shutil.copytree(model, stale)
    shard = os.path.join(stale, "model.safetensors")
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    expect_error("stale panels.moex", [moex, "logits", "--model", stale, "--ids", "1", "--out", os.path.join(work, "x.npy")],
                 "panels.moex", "changed", "moex pack --model", "--force")
    expect_error("stale --panels", [moex, "logits", "--model", stale, "--ids", "1", "--out", os.path.join(work, "x.npy"),
                                    "--panels", panels], "changed", "moex pack")

    # Truncated.
    truncated = os.path.join(work, "truncated.moex")
    with open(panels, "rb") as f, open(truncated, "wb") as g:
        g.write(f.read(os.path.getsize(panels) // 2))
    expect_error("truncated --panels", [moex, "logits", "--model", model, "--ids", "1", "--out", os.path.join(work, "x.npy"),
                                        "--panels", truncated], "truncated.moex", "moex pack")

    # Another weight path: int8 at load leaves the bf16 panels beside it alone, and refuses them when named.
    int8, err = logits("int8", model, "--weights", "int8", "--dense-weights", "int8")
    int8_none, _ = logits("int8-none", model, "--weights", "int8", "--dense-weights", "int8", "--panels", "none")
    check(same(int8, int8_none) and "mapping" not in err, "--weights int8 packs int8 beside bf16 panels")
    expect_error("bf16 panels for an int8 load", [moex, "logits", "--model", model, "--ids", "1", "--out",
                                                  os.path.join(work, "x.npy"), "--weights", "int8", "--dense-weights",
                                                  "int8", "--panels", panels], "bf16 panels", "int8")
    quant = os.path.join(work, "q8")
    subprocess.run([moex, "quantize", "--model", model, "--weights", "int8", "--out", quant], check=True,
                   capture_output=True)
    expect_error("quantized panels for a bf16 load", [moex, "logits", "--model", model, "--ids", "1", "--out",
                                                      os.path.join(work, "x.npy"), "--panels",
                                                      os.path.join(quant, "panels.moex")], "quantized", "bf16 panels")
    expect_error("bf16 panels beside a quantized checkpoint", [moex, "logits", "--model", quant, "--ids", "1", "--out",
                                                               os.path.join(work, "x.npy"), "--panels", panels],
                 "bf16 panels", "quantized")

    # Two ranks: the slices a rank holds under TP are packed at load, whole matrices mapped; EP maps its experts.
    if shutil.which("mpirun") and not args.skip_ranks:
        # An f32 KV cache here: with the default bf16 one, TP's other order of summation rounds the cached keys and
        # values differently from one rank's, which is not what this compares.
        one_rank, _ = logits("one-rank-f32-kv", model, "--kv-cache-dtype", "f32")
        for plan in (["--tp", "2"], ["--moe-parallel", "ep", "--attn-parallel", "dp"]):
            name = "-".join(a.strip("-") for a in plan)
            plan = plan + ["--kv-cache-dtype", "f32"]
            with_panels, err = logits(name, model, *plan, launcher=MPIRUN)
            without, _ = logits(name + "-none", model, *plan, "--panels", "none", launcher=MPIRUN)
            check(same(with_panels, without) and "mapping the packed panels" in err,
                  f"{' '.join(plan)} on 2 ranks: the logits with the panels mapped equal those packed at load")
            check(with_panels is not None and np.allclose(with_panels, one_rank, atol=1e-3, rtol=0),
                  f"{' '.join(plan)} on 2 ranks: within 1e-3 of one rank's")
    else:
        print("skip two ranks: " + ("--skip-ranks" if args.skip_ranks else "no mpirun"))

    if failures:
        print(f"\n{len(failures)} FAILED")
        for f in failures:
            print("  " + f)
        sys.exit(1)
    print("all ok")


if __name__ == "__main__":
    main()
