#!/usr/bin/env python3
"""GGUF through the real binary: bad files are one error line and exit 2, and `moex convert` never
overwrites without --force, leaves nothing behind when it fails, and replaces a file by a new inode."""
import argparse
import os
import subprocess
import sys

failures = []


def moex(args, *cmd):
    return subprocess.run([args.moex, *cmd], capture_output=True, text=True, timeout=300)


def expect_error(args, cause, *cmd):
    r = moex(args, *cmd)
    lines = r.stderr.strip().splitlines()
    ok = r.returncode == 2 and len(lines) == 1 and lines[0].startswith("moex: error:") and cause in lines[0]
    print(f"{'ok  ' if ok else 'FAIL'} exit {r.returncode}: {' '.join(cmd[:3])}...: {lines[:2]}")
    if not ok:
        failures.append(f"{' '.join(cmd)}: wanted exit 2 and one line with {cause!r}, got {r.returncode} {r.stderr!r}")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    args = p.parse_args()
    w = args.workdir
    os.makedirs(w, exist_ok=True)
    src, good = os.path.join(w, "src"), os.path.join(w, "good.gguf")
    subprocess.run([args.moex, "gen-model", "--preset", "tiny", "--seed", "3", "--out", src, "--force"], check=True,
                   capture_output=True)
    if os.path.exists(good):
        os.unlink(good)
    r = moex(args, "convert", "--model", src, "--out", good, "--type", "q8_0")
    if r.returncode != 0:
        sys.exit(f"FAIL: convert: {r.stderr}")
    data = open(good, "rb").read()
    gen = ["generate", "-n", "2", "--prompt", "hi", "--model"]
    cases = {
        "truncated.gguf": (data[: len(data) // 2], "truncated"),
        "header-only.gguf": (data[:100], "truncated"),
        "text.gguf": (b"not a gguf file at all\n", "not a GGUF file"),
        "v2.gguf": (data[:4] + b"\x02" + data[5:], "version 2"),
        "empty.gguf": (b"", "not a GGUF file"),
    }
    for name, (blob, cause) in cases.items():
        path = os.path.join(w, name)
        open(path, "wb").write(blob)
        expect_error(args, cause, *gen, path)
        expect_error(args, cause, "logits", "--ids", "1,2", "--out", os.path.join(w, "x.npy"), "--model", path)
    expect_error(args, "No such file", *gen, os.path.join(w, "missing.gguf"))
    expect_error(args, "not a GGUF file", *gen, os.path.join(src, "config.json"))  # a file is never a folder

    # convert's file safety
    before = os.stat(good)
    expect_error(args, "pass --force", "convert", "--model", src, "--out", good)
    if os.stat(good).st_mtime_ns != before.st_mtime_ns or open(good, "rb").read() != data:
        failures.append("convert without --force changed the existing file")
    expect_error(args, "--type q5_1", "convert", "--model", src, "--out", os.path.join(w, "a.gguf"), "--type", "q5_1")
    expect_error(args, "must name a .gguf file", "convert", "--model", src, "--out", os.path.join(w, "a.bin"))
    expect_error(args, "not a model folder", "convert", "--model", os.path.join(w, "nope"), "--out", os.path.join(w, "a.gguf"))
    broken = os.path.join(w, "broken-src")
    os.makedirs(broken, exist_ok=True)
    open(os.path.join(broken, "config.json"), "w").write(open(os.path.join(src, "config.json")).read())
    expect_error(args, "model.safetensors", "convert", "--model", broken, "--out", os.path.join(w, "b.gguf"))
    leftovers = [f for f in os.listdir(w) if "convert-tmp" in f]
    if leftovers or os.path.exists(os.path.join(w, "b.gguf")):
        failures.append(f"a failed convert left files behind: {leftovers}")
    r = moex(args, "convert", "--model", src, "--out", good, "--type", "q4_0", "--force")
    if r.returncode != 0 or os.stat(good).st_ino == before.st_ino:
        failures.append(f"convert --force did not replace the file by a new one: {r.returncode} {r.stderr}")
    expect_error(args, "refusing to overwrite", "logits", "--model", good, "--ids", "1,2", "--out", good)
    if failures:
        sys.exit("FAIL:\n  " + "\n  ".join(failures))
    print("OK")


if __name__ == "__main__":
    main()
