#!/usr/bin/env python3
"""Quantized checkpoints and `moex quantize` on bad input: one line naming the problem, exit code 2, and
nothing the user owns overwritten.

Each case breaks one thing in a copy of a good quantized checkpoint (written by `moex quantize`) or passes
one bad flag.
"""
import argparse
import functools
import json
import os
import shutil
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
import quantize_ref  # noqa: E402

import one_line_error  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    args = p.parse_args()
    moex, work = os.path.abspath(args.moex), os.path.abspath(args.workdir)
    os.makedirs(work, exist_ok=True)
    good = os.path.join(work, "good")
    if not os.path.exists(os.path.join(good, "config.json")):
        subprocess.run([moex, "gen-model", "--preset", "tiny", "--seed", "5", "--out", good], check=True,
                       capture_output=True)
    quant = {}
    for fmt, extra in (("int8", []), ("int4", ["--group-size", "32"])):
        quant[fmt] = os.path.join(work, "q" + fmt)
        subprocess.run([moex, "quantize", "--model", good, "--weights", fmt, *extra, "--out", quant[fmt], "--force"],
                       check=True, capture_output=True)
    failures = []

    expect_error = functools.partial(one_line_error.expect_error, failures)

    def variant(name, src, config_edit=None, tensors_edit=None, keep_panels=False):
        d = os.path.join(work, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
        if config_edit:
            c = json.load(open(os.path.join(d, "config.json")))
            config_edit(c["quantization_config"])
            json.dump(c, open(os.path.join(d, "config.json"), "w"))
        if tensors_edit:
            raw = quantize_ref.read_raw_checkpoint(d)
            tensors_edit(raw)
            quantize_ref.write_safetensors(os.path.join(d, "model.safetensors"), raw)
        # Whoever edits a quantized checkpoint deletes its panels.moex (docs/kernels.md); kept, it is refused
        # (the "stale panels.moex" case below).
        if (config_edit or tensors_edit) and keep_panels is False and os.path.exists(os.path.join(d, "panels.moex")):
            os.remove(os.path.join(d, "panels.moex"))
        return d

    logits = lambda d, *extra: [moex, "logits", "--model", d, "--ids", "1,2,3", "--out", os.path.join(work, "x.npy"),
                                *extra]
    e0 = "model.layers.0.block_sparse_moe.experts.0."

    # moex quantize's own flags and files.
    keep = os.path.join(work, "occupied")
    os.makedirs(keep, exist_ok=True)
    open(os.path.join(keep, "notes.txt"), "w").write("mine")
    expect_error("quantize into a non-empty folder", [moex, "quantize", "--model", good, "--weights", "int8", "--out", keep],
                 "not empty", "--force")
    if open(os.path.join(keep, "notes.txt")).read() != "mine":
        failures.append("quantize touched a file of a non-empty --out")
    expect_error("quantize over its own model", [moex, "quantize", "--model", good, "--weights", "int8", "--out", good,
                                                 "--force"], "--model")
    expect_error("quantize a quantized checkpoint", [moex, "quantize", "--model", quant["int8"], "--weights", "int4",
                                                     "--out", os.path.join(work, "qq")], "quantized already")
    expect_error("quantize --group-size without int4", [moex, "quantize", "--model", good, "--weights", "int8",
                                                        "--group-size", "32", "--out", os.path.join(work, "qg")],
                 "--group-size")
    # With --force the notes beside a model are kept and the model is replaced.
    r = subprocess.run([moex, "quantize", "--model", good, "--weights", "int8", "--out", keep, "--force"],
                       capture_output=True, text=True)
    if r.returncode != 0 or open(os.path.join(keep, "notes.txt")).read() != "mine" or not os.path.exists(
            os.path.join(keep, "model.safetensors")):
        failures.append(f"quantize --force into a folder with notes: exit {r.returncode}, {r.stderr}")
    else:
        print("ok   quantize --force keeps the other files of --out")

    # Loading: the configuration.
    def set_field(key, value):
        return lambda q: q.__setitem__(key, value)

    def set_weights(key, value):
        return lambda q: q["config_groups"]["group_0"]["weights"].__setitem__(key, value)

    expect_error("unknown quantization field", logits(variant("unknown", quant["int8"], set_field("smoothing", 1))),
                 "unknown field", "smoothing")
    expect_error("unknown quant_method", logits(variant("gptq", quant["int8"], set_field("quant_method", "gptq"))),
                 "quant_method", "gptq")
    expect_error("3-bit weights", logits(variant("bits3", quant["int4"], set_weights("num_bits", 3))), "3-bit")
    expect_error("unsupported group size", logits(variant("g48", quant["int4"], set_weights("group_size", 48))),
                 "group_size 48")
    expect_error("activation quantization",
                 logits(variant("w8a8", quant["int8"],
                                lambda q: q["config_groups"]["group_0"].__setitem__("input_activations", {"num_bits": 8}))),
                 "input_activations")
    expect_error("static activation quantization",
                 logits(variant("w8a8static", quant["int8"],
                                lambda q: q["config_groups"]["group_0"].__setitem__(
                                    "input_activations", {"num_bits": 8, "type": "int", "symmetric": True,
                                                          "strategy": "token", "dynamic": False}))),
                 "input_activations", "dynamic")
    expect_error("actorder", logits(variant("actorder", quant["int4"], set_weights("actorder", "group"))), "actorder")
    expect_error("not compressed", logits(variant("frozen", quant["int8"], set_field("quantization_status", "frozen"))),
                 "quantization_status")
    expect_error("bad regex", logits(variant("regex", quant["int8"], set_field("ignore", ["re:("]))), "regular expression")
    expect_error("asymmetric without zero points",
                 logits(variant("asym", quant["int4"], set_weights("symmetric", False))), "weight_zero_point")
    # Loading: the tensors.
    expect_error("missing scale", logits(variant("noscale", quant["int8"], tensors_edit=lambda t: t.pop(e0 + "w1.weight_scale"))),
                 "w1.weight_scale", "missing")

    def nan_scale(t):
        dtype, a = t[e0 + "w2.weight_scale"]
        a = a.copy()
        a[0, 0] = float("nan")
        t[e0 + "w2.weight_scale"] = (dtype, a)

    expect_error("NaN scale", logits(variant("nanscale", quant["int8"], tensors_edit=nan_scale)), "w2.weight_scale", "scale")

    def wrong_shape(t):
        dtype, a = t[e0 + "w3.weight_packed"]
        t[e0 + "w3.weight_packed"] = (dtype, a[:, :-1].copy())

    expect_error("packed codes of the wrong shape", logits(variant("packshape", quant["int4"], tensors_edit=wrong_shape)),
                 "w3.weight_packed")
    def add_g_idx(t):
        rows, cols = t[e0 + "w1.weight_shape"][1]
        t[e0 + "w1.weight_g_idx"] = ("I32", np.arange(int(cols), dtype=np.int32) // 32)

    expect_error("act-order permutation", logits(variant("gidx", quant["int4"], tensors_edit=add_g_idx)), "weight_g_idx")
    # panels.moex, the packed matrices moex quantize writes beside the checkpoint.
    def read_st(path):
        raw = open(path, "rb").read()
        n = int.from_bytes(raw[:8], "little")
        return json.loads(raw[8:8 + n]), raw[8 + n:]

    def write_st(path, header, data):
        text = json.dumps(header, separators=(",", ":"))
        text += " " * (-(8 + len(text)) % 4096)
        open(path, "wb").write(len(text).to_bytes(8, "little") + text.encode() + data)

    def panels_edit(name, src, edit):
        d = variant(name, src)
        path = os.path.join(d, "panels.moex")
        header, data = read_st(path)
        data = edit(header, data)
        write_st(path, header, data)
        return d

    if not os.path.exists(os.path.join(quant["int8"], "panels.moex")):
        failures.append("moex quantize wrote no panels.moex")
    expect_error("stale panels.moex (a shard rewritten)",
                 logits(variant("stale", quant["int8"], tensors_edit=lambda t: None, keep_panels=True)),
                 "panels.moex", "packed from other weights")
    expect_error("stale panels.moex (quantization_config edited)",
                 logits(variant("stalecfg", quant["int4"], set_weights("symmetric", False), keep_panels=True)),
                 "panels.moex", "quantization_config")
    d = variant("truncated", quant["int8"])
    with open(os.path.join(d, "panels.moex"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(d, "panels.moex")) // 2)
    expect_error("truncated panels.moex", logits(d), "panels.moex")

    def shrink(header, data):  # one buffer 64 bytes short, the later offsets moved down
        name = e0 + "down.scales"
        b, e = header[name]["data_offsets"]
        header[name]["shape"] = [header[name]["shape"][0] - 16]
        for k, v in header.items():
            if k != "__metadata__" and v["data_offsets"][0] >= e:
                v["data_offsets"] = [v["data_offsets"][0] - 64, v["data_offsets"][1] - 64]
        header[name]["data_offsets"] = [b, e - 64]
        return data[:e - 64] + data[e:]

    expect_error("panels.moex buffer of the wrong size", logits(panels_edit("shrunk", quant["int8"], shrink)),
                 "panels.moex", e0 + "down.scales")
    expect_error("panels.moex without a matrix",
                 logits(panels_edit("nomatrix", quant["int4"], lambda h, data: (h.pop(e0 + "gate_up.offsets")["data_offsets"], data)[1])),
                 "panels.moex", e0 + "gate_up.offsets", "missing")

    def old_layout(header, data):
        header["__metadata__"]["moex_panels_layout"] = "0"
        return data

    d = panels_edit("oldlayout", quant["int8"], old_layout)
    r = subprocess.run(logits(d), capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or "panel layout 0" not in r.stderr:
        failures.append(f"panels.moex of another layout version: exit {r.returncode}, stderr {r.stderr!r} (wanted a "
                        "warning and a load that packs)")
    else:
        print("ok   panels.moex of another layout version: " + r.stderr.strip().splitlines()[0])
    # moex pack: an existing panels.moex replaced only with --force (a bf16 checkpoint's panels: cli.panels).
    expect_error("pack to a folder", [moex, "pack", "--model", quant["int8"], "--out", work], "is a folder")
    before = open(os.path.join(quant["int8"], "panels.moex"), "rb").read()
    expect_error("pack over an existing panels.moex", [moex, "pack", "--model", quant["int8"]], "exists", "--force")
    if open(os.path.join(quant["int8"], "panels.moex"), "rb").read() != before:
        failures.append("moex pack without --force changed the existing panels.moex")
    r = subprocess.run([moex, "pack", "--model", quant["int8"], "--force"], capture_output=True, text=True)
    if r.returncode != 0 or open(os.path.join(quant["int8"], "panels.moex"), "rb").read() != before:
        failures.append(f"moex pack --force did not rewrite the same panels.moex: exit {r.returncode}, {r.stderr}")
    else:
        print("ok   moex pack --force writes the panels.moex moex quantize wrote, byte for byte")
    # Flags against a quantized checkpoint.
    expect_error("--weights on a quantized checkpoint", logits(quant["int8"], "--weights", "int4"), "stored quantized")
    expect_error("--dense-weights on a quantized checkpoint", logits(quant["int8"], "--dense-weights", "fp8"),
                 "stored quantized")
    # DeepSeek-style fp8.
    fp8 = os.path.join(work, "fp8blocks")
    quantize_ref.write_fp8_blocks_checkpoint(good, fp8)
    expect_error("fp8 block size 64", logits(variant("fp8b64", fp8, set_field("weight_block_size", [64, 64]))),
                 "weight_block_size")
    expect_error("fp8 static activations", logits(variant("fp8static", fp8, set_field("activation_scheme", "static"))),
                 "activation_scheme")
    expect_error("fp8 weight without scale_inv",
                 logits(variant("fp8noscale", fp8, tensors_edit=lambda t: t.pop(e0 + "w1.weight_scale_inv"))),
                 "weight_scale_inv")

    for f in failures:
        print("FAIL:", f)
    print(f"{len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
