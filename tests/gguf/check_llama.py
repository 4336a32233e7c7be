#!/usr/bin/env python3
"""GGUF files written by `moex convert`, proved right by llama.cpp itself (node-llama-cpp's prebuilt CPU build).

One generated f32 Mixtral checkpoint (hidden 256, so every matrix holds whole Q4_K super-blocks) is converted
to each --type. For every file, llama.cpp loads it and gives its next-token log-probabilities at every
position of a random prompt; MoEX gives its logits on the same file; the PyTorch reference
(tests/reference/mixtral_ref.py, from HF's modelling code) gives the logits of the source checkpoint.
Compared as log-softmax (llama.cpp returns probabilities): the largest difference over the vocabulary at
each position, its median over the positions against llama.cpp (max against the reference):

  moex(file) vs llama.cpp(file)   the same weights read by two engines. llama.cpp's CPU backend keeps its KV
                                  cache in f16 and rounds activations to the weights' type before each dot
                                  product (f16 / bf16, or Q8_0 / Q8_K blocks for quantized weights), which
                                  MoEX (f32 activations) does not: that is the whole expected difference.
  moex(file) vs reference         f32 and bf16: the reference on the source checkpoint must agree to 1e-4
                                  (bf16 is converted from a bf16 checkpoint of the same seed, so the file
                                  holds exactly the source's weights). f16 and the quantized types: the
                                  reference on the file's weights as gguf_to_hf.py reads and dequantizes
                                  them in numpy (written from the spec and ggml's block definitions,
                                  independently of MoEX's reader), also to 1e-4: what is left is f32 against
                                  the reference's f64 arithmetic (measured ~1.5e-6 for every type).
Also: llama.cpp's tokenizer on the file's vocabulary gives SentencePiece's ids for the source tokenizer.model;
MoEX under EP on 2 ranks matches as on one; ranks given different files are one error.
A wrongly converted file (rotary permutation, block layout, tensor order) moves the log-probabilities by O(1),
far above every tolerance, and flips the greedy tokens; each check also asserts that the engines agree much
more closely with each other than the file agrees with the f32 original, so a loose tolerance cannot hide it.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REF = os.path.join(HERE, "..", "reference", "mixtral_ref.py")

# Allowed median over positions of max-over-vocabulary |delta log-prob| between MoEX and llama.cpp on the
# same file. f32: llama.cpp's f16 KV cache (2^-11 relative per K/V element). f16 / bf16: activations rounded
# to f16 (2^-11) or bf16 (2^-8) in every matmul. Quantized types: llama.cpp quantizes the activations too,
# to Q8_0 blocks of 32 (Q8_K blocks of 256 for Q4_K), and gen-model's checkpoints carry a bias channel
# (x[0] ~ 11 against ~0.7 elsewhere, tools/lib/synthetic.h), so a block's step is ~13% of a typical
# activation: O(0.1) in log-probabilities, as large as Q8_0's own weight rounding. Measured (seed 31):
# f32 2.0e-3, f16 2.4e-3, bf16 1.5e-2, q8_0 0.10, q4_0 0.10, q4_K 0.29; the tolerances are ~2.5x those.
# For Q4_0 / Q4_K the weights' own rounding moves the answer by ~2, so agreeing to 0.1-0.3 is only possible
# when both engines read the same weights (checked: the engines' difference must be below a quarter of it).
LLAMA_TOL = {"f32": 5e-3, "f16": 6e-3, "bf16": 4e-2, "q8_0": 0.25, "q4_0": 0.25, "q4_K": 0.75}
GREEDY_MIN = {"f32": 1.0, "f16": 1.0, "bf16": 1.0, "q8_0": 0.85, "q4_0": 0.8, "q4_K": 0.8}

from llama_cpp_common import llama_logprobs, log_softmax, run  # noqa: E402  (shared by the GGUF checks)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--types", default="f32,bf16,f16,q8_0,q4_0,q4_K")
    p.add_argument("--prompt-len", type=int, default=24)
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    refs, srcs = {}, {}
    for dtype in ("f32", "bf16"):
        srcs[dtype] = os.path.join(args.workdir, "src-" + dtype)
        run([args.moex, "gen-model", "--preset", "tiny", "--dtype", dtype, "--hidden", "256", "--intermediate", "512",
             "--seed", "31", "--out", srcs[dtype], "--force"])
    vocab = json.load(open(os.path.join(srcs["f32"], "config.json")))["vocab_size"]
    rng = np.random.default_rng(5)
    ids = [1] + [int(t) for t in rng.integers(3, vocab, size=args.prompt_len - 1)]
    ids_arg = ",".join(map(str, ids))
    for dtype, src in srcs.items():
        path = os.path.join(args.workdir, f"ref-{dtype}.npy")
        run([sys.executable, REF, "--model", src, "--ids", ids_arg, "--out", path])
        refs[dtype] = log_softmax(np.load(path))

    failures = []
    base = None  # MoEX on the f32 file: how far each type's weights move the answer
    for t in args.types.split(","):
        gguf = os.path.join(args.workdir, f"model-{t}.gguf")
        src = "bf16" if t == "bf16" else "f32"
        run([args.moex, "convert", "--model", srcs[src], "--out", gguf, "--type", t, "--force"])
        ours_path = os.path.join(args.workdir, f"moex-{t}.npy")
        run([args.moex, "logits", "--model", gguf, "--ids", ids_arg, "--out", ours_path, "--threads", "1", "--exact"])
        ours = log_softmax(np.load(ours_path))
        theirs = llama_logprobs(gguf, ids, vocab)
        d_llama = np.median(np.abs(ours - theirs).max(-1))
        greedy_same = (ours.argmax(-1) == theirs.argmax(-1)).mean()
        d_ref = np.abs(ours - refs[src]).max()
        if base is None and t == "f32":
            base = ours
        d_quant = np.median(np.abs(ours - base).max(-1)) if base is not None else float("nan")
        print(f"{t:5s} moex vs llama.cpp {d_llama:.2e} (tol {LLAMA_TOL[t]:.0e}), greedy tokens agree {greedy_same:.0%}; "
              f"moex vs reference({src} source) {d_ref:.2e}; this file vs the f32 file {d_quant:.2e}")
        if d_llama > LLAMA_TOL[t]:
            failures.append(f"{t}: MoEX and llama.cpp differ by {d_llama:.2e} > {LLAMA_TOL[t]:.0e}")
        if greedy_same < GREEDY_MIN[t]:
            failures.append(f"{t}: greedy tokens agree at only {greedy_same:.0%} of positions (< {GREEDY_MIN[t]:.0%})")
        if t in ("f32", "bf16") and d_ref > 1e-4:
            failures.append(f"{t}: MoEX on the GGUF differs from the reference on the source by {d_ref:.2e} > 1e-4")
        if t not in ("f32", "bf16"):
            deq, deq_ref = os.path.join(args.workdir, f"dequantized-{t}"), os.path.join(args.workdir, f"ref-deq-{t}.npy")
            run([sys.executable, os.path.join(HERE, "gguf_to_hf.py"), gguf, os.path.join(srcs["f32"], "config.json"), deq])
            run([sys.executable, REF, "--model", deq, "--ids", ids_arg, "--out", deq_ref])
            d_deq = np.abs(ours - log_softmax(np.load(deq_ref))).max()
            print(f"      moex vs reference on the file's weights dequantized in numpy {d_deq:.2e} (tol 1e-4)")
            if d_deq > 1e-4:
                failures.append(f"{t}: MoEX differs from the reference on the numpy-dequantized weights by {d_deq:.2e}")
        if t in ("q4_0", "q4_K") and not d_llama < d_quant / 4:
            failures.append(f"{t}: the engines differ ({d_llama:.2e}) by more than a quarter of what {t} itself "
                            f"changes ({d_quant:.2e}): they do not read the same weights")
    # The vocabulary: llama.cpp's tokenizer on the f32 file against SentencePiece (python3-sentencepiece) on the
    # source's tokenizer.model, on texts with Unicode, whitespace runs, digits and bytes outside the pieces.
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(srcs["f32"], "tokenizer.model"))
    texts = ["Once upon a time, there was a dragon.", "  two  spaces\tand a tab\nnew line", "digits 1234567 and 3.14",
             "Unicode: héllo wörld, 日本語, emoji 🙂", "Zürich's naïve café", "x"]
    cmd = ["node", os.path.join(HERE, "llama_eval.mjs"), os.path.join(args.workdir, "model-f32.gguf")]
    for text in texts:
        cmd += ["--text", text]
    got = json.loads(run(cmd, cwd=HERE))["tokenized"]
    for text, ids_llama in zip(texts, got):
        if ids_llama != sp.encode(text):
            failures.append(f"llama.cpp tokenizes {text!r} as {ids_llama}, SentencePiece as {sp.encode(text)}")
    print(f"tokenizer: llama.cpp and SentencePiece agree on {sum(a == sp.encode(t) for t, a in zip(texts, got))} "
          f"of {len(texts)} texts")

    # Expert parallelism on 2 ranks reads the file as one rank does: against the reference (f32) and llama.cpp
    # (q4_K) with the single-rank tolerances. Ranks given different files are one error before loading.
    mpi = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
    types = args.types.split(",")
    for t in [t for t in ("f32", "q4_K") if t in types]:
        gguf, out = os.path.join(args.workdir, f"model-{t}.gguf"), os.path.join(args.workdir, f"moex-ep-{t}.npy")
        run([*mpi, "-np", "2", args.moex, "logits", "--model", gguf, "--ids", ids_arg, "--out", out,
             "--moe-parallel", "ep", "--ep", "2", "--threads", "1", "--exact"], timeout=300)
        ep = log_softmax(np.load(out))
        if t == "f32":
            d = np.abs(ep - refs["f32"]).max()
            print(f"f32 under EP on 2 ranks: moex vs reference {d:.2e} (tol 1e-4)")
            if d > 1e-4:
                failures.append(f"f32 under EP: MoEX differs from the reference by {d:.2e}")
        else:
            d = np.median(np.abs(ep - llama_logprobs(gguf, ids, vocab)).max(-1))
            print(f"{t} under EP on 2 ranks: moex vs llama.cpp {d:.2e} (tol {LLAMA_TOL[t]:.0e})")
            if d > LLAMA_TOL[t]:
                failures.append(f"{t} under EP: MoEX and llama.cpp differ by {d:.2e}")
            d = np.abs(ep - log_softmax(np.load(os.path.join(args.workdir, f"ref-deq-{t}.npy")))).max()
            print(f"{t} under EP on 2 ranks: moex vs reference on the numpy-dequantized weights {d:.2e} (tol 1e-4)")
            if d > 1e-4:
                failures.append(f"{t} under EP: MoEX differs from the reference on the dequantized weights by {d:.2e}")
    if "f32" in types and "q8_0" in types:
        files = [os.path.join(args.workdir, f"model-{t}.gguf") for t in ("f32", "q8_0")]
        cmd = [*mpi, "-np", "1", args.moex, "logits", "--model", files[0], "--ids", ids_arg, "--out", os.devnull, ":",
               "-np", "1", args.moex, "logits", "--model", files[1], "--ids", ids_arg, "--out", os.devnull]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        print(f"ranks given different GGUF files: exit {r.returncode}: {r.stderr.strip().splitlines()[:1]}")
        if r.returncode != 2 or "differs from rank 0" not in r.stderr:
            failures.append(f"ranks given different GGUF files: exit {r.returncode}, stderr {r.stderr!r}")
    if failures:
        sys.exit("FAIL:\n  " + "\n  ".join(failures))
    print("OK: llama.cpp loads every file and agrees with MoEX within the stated tolerances")


if __name__ == "__main__":
    main()
