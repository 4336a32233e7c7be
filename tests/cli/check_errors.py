#!/usr/bin/env python3
"""Bad input gets one clear line on stderr and a non-zero exit, never a crash or a hang.

Each case breaks one thing in a copy of a good checkpoint (or passes one bad flag) and checks the exit
code, that stderr is a single line naming the problem, and that nothing crashed (signals, sanitizer
reports).
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    args = p.parse_args()
    args.moex = os.path.abspath(args.moex)
    good = os.path.join(args.workdir, "good")
    if not os.path.exists(os.path.join(good, "config.json")):
        subprocess.run([args.moex, "gen-model", "--preset", "tiny", "--seed", "5", "--out", good], check=True,
                       capture_output=True)
    config = json.load(open(os.path.join(good, "config.json")))
    weights = open(os.path.join(good, "model.safetensors"), "rb").read()
    header_len = struct.unpack("<Q", weights[:8])[0]

    def variant(name, config_edit=None, weights_bytes=None, drop_weights=False):
        d = os.path.join(args.workdir, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        c = dict(config)
        if config_edit:
            config_edit(c)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
        if not drop_weights:
            with open(os.path.join(d, "model.safetensors"), "wb") as f:
                f.write(weights if weights_bytes is None else weights_bytes)
        return d

    def pop(key):
        return lambda c: c.pop(key)

    def put(key, value):
        return lambda c: c.__setitem__(key, value)

    def header_edit(fn):
        h = json.loads(weights[8:8 + header_len])
        fn(h)
        raw = json.dumps(h).encode()
        raw += b" " * ((8 - len(raw) % 8) % 8)
        return struct.pack("<Q", len(raw)) + raw + weights[8 + header_len:]

    first = sorted(k for k in json.loads(weights[8:8 + header_len]) if k != "__metadata__")[0]

    def shift_offsets(h):
        h[first]["data_offsets"] = [h[first]["data_offsets"][0] + 2, h[first]["data_offsets"][1] + 2]

    def grow_shape(h):
        h[first]["shape"] = [s * 2 for s in h[first]["shape"]]

    def bad_dtype(h):
        h[first]["dtype"] = "Q7"

    def drop_tensor(h):
        del h["model.norm.weight"]

    cases = [
        # (name, expected substring in the message, argv)
        ("model_type", "model_type", ["logits", "--model", variant("mt", put("model_type", "llama")), "--ids", "1", "--out", "x.npy"]),
        ("heads_divisibility", "not divisible", ["logits", "--model", variant("hd", lambda c: (c.update(hidden_size=65), c.pop("head_dim"))), "--ids", "1", "--out", "x.npy"]),
        ("missing_field", "hidden_size", ["logits", "--model", variant("mf", pop("hidden_size")), "--ids", "1", "--out", "x.npy"]),
        ("unknown_field", "unknown field", ["logits", "--model", variant("uf", put("moe_shared_expert", 4)), "--ids", "1", "--out", "x.npy"]),
        ("kv_heads", "num_key_value_heads", ["logits", "--model", variant("kv", put("num_key_value_heads", 3)), "--ids", "1", "--out", "x.npy"]),
        ("config_not_json", "not valid JSON", ["logits", "--model", variant("nj", put("x", 1)), "--ids", "1", "--out", "x.npy"]),
        ("truncated_weights", "truncated", ["logits", "--model", variant("tr", weights_bytes=weights[:len(weights) // 2]), "--ids", "1", "--out", "x.npy"]),
        ("tiny_file", "too short", ["logits", "--model", variant("ts", weights_bytes=weights[:5]), "--ids", "1", "--out", "x.npy"]),
        ("huge_header_length", "header length", ["logits", "--model", variant("hh", weights_bytes=struct.pack("<Q", 1 << 60) + weights[8:]), "--ids", "1", "--out", "x.npy"]),
        ("garbage_header", "JSON", ["logits", "--model", variant("gh", weights_bytes=weights[:8] + b"{" * header_len + weights[8 + header_len:]), "--ids", "1", "--out", "x.npy"]),
        ("overlapping_offsets", "overlap", ["logits", "--model", variant("ov", weights_bytes=header_edit(shift_offsets)), "--ids", "1", "--out", "x.npy"]),
        ("shape_vs_bytes", "bytes", ["logits", "--model", variant("sb", weights_bytes=header_edit(grow_shape)), "--ids", "1", "--out", "x.npy"]),
        ("unknown_dtype", "dtype", ["logits", "--model", variant("ud", weights_bytes=header_edit(bad_dtype)), "--ids", "1", "--out", "x.npy"]),
        ("missing_tensor", "model.norm.weight", ["logits", "--model", variant("mi", weights_bytes=header_edit(drop_tensor)), "--ids", "1", "--out", "x.npy"]),
        ("no_weights", "model.safetensors", ["logits", "--model", variant("nw", drop_weights=True), "--ids", "1", "--out", "x.npy"]),
        ("no_model_dir", "cannot read", ["logits", "--model", os.path.join(args.workdir, "nowhere"), "--ids", "1", "--out", "x.npy"]),
        ("token_out_of_vocab", "outside the vocabulary", ["logits", "--model", good, "--ids", f"1,{config['vocab_size']}", "--out", "x.npy"]),
        ("bad_ids", "--ids", ["logits", "--model", good, "--ids", "1,x,3", "--out", "x.npy"]),
        ("too_long_for_cache", "--max-seq-len", ["logits", "--model", good, "--ids", "1,2,3", "--decode", "10", "--max-seq-len", "8", "--out", "x.npy"]),
        ("unknown_flag", "--bogus", ["logits", "--model", good, "--ids", "1", "--out", "x.npy", "--bogus"]),
        ("bad_router_fusion", "valid: none, topk_softmax, full", ["logits", "--model", good, "--ids", "1", "--out", "x.npy", "--router-fusion", "fast"]),
        ("bad_top_p", "--top-p", ["generate", "--model", good, "--prompt", "hi", "--top-p", "1.5"]),
        ("unknown_command", "frobnicate", ["frobnicate"]),
    ]
    # config_not_json: write broken JSON over the variant's config.
    with open(os.path.join(args.workdir, "nj", "config.json"), "w") as f:
        f.write('{"model_type": "mixtral", ')

    passed = failed = 0
    for name, needle, argv in cases:
        try:
            r = subprocess.run([args.moex, *argv], capture_output=True, text=True, timeout=60, cwd=args.workdir)
        except subprocess.TimeoutExpired:
            print(f"FAIL {name}: hung for 60 s")
            failed += 1
            continue
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        problems = []
        if r.returncode != 2:
            problems.append(f"exit code {r.returncode}, expected 2")
        if len(lines) != 1:
            problems.append(f"stderr has {len(lines)} lines, expected 1")
        if needle not in r.stderr:
            problems.append(f"message does not mention {needle!r}")
        if problems:
            failed += 1
            print(f"FAIL {name}: {'; '.join(problems)}\n  stderr: {r.stderr.strip()[:500]}")
        else:
            passed += 1
            print(f"ok   {name}: {lines[0]}")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
