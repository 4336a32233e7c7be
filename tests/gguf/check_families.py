#!/usr/bin/env python3
"""GGUF for every family MoEX runs besides Mixtral (check_llama.py covers Mixtral's "llama" files):
qwen2moe, qwen3moe, olmoe and dots1, each from its `gen-model --preset <family>-tiny` f32 checkpoint.

For each family:
  exact      MoEX's logits (prefill and greedy decode) from the converted f32 GGUF equal, bit for bit, its
             logits from the safetensors folder: the same f32 values reach the same kernels, so any
             difference is a wrongly mapped tensor or config key.
  reference  the same logits against the PyTorch reference (tests/reference/families_ref.py, from HF's
             modelling code, float64) on the source folder: max |moex - ref| / max |ref| <= 1e-4 (the
             f32-vs-f64 gap the reference.* tests allow), and the same greedy tokens.
             qwen3-moe-tiny also as bf16 (checkpoint and file), also bit for bit.
  ep         `mpirun -np 2 moex logits --moe-parallel ep --attn-parallel dp` on the GGUF equals one rank to 1e-5.
  llama.cpp  node-llama-cpp 3.21.1 (prebuilt llama.cpp) loads the f32 file (and qwen3moe's q8_0) and its next-token
             log-probabilities agree with MoEX's on the same file: median over positions of the max over the
             vocabulary of |delta log-prob| <= 5e-3 for f32 (llama.cpp keeps its KV cache in f16, 2^-11
             relative; measured 1.0e-3..1.3e-3 for the four architectures), <= 0.25 for q8_0 (llama.cpp also
             rounds activations to Q8_0 blocks: see check_llama.py; measured 0.09..0.12, about the q8_0 file's
             own distance from the f32 file), greedy tokens identical for f32.
             A wrong key or tensor moves log-probabilities by O(1): leaving the group keys out of a dots1
             file (n_group 4 -> 1) moved llama.cpp's by 0.2..2.2 at every position.
What llama.cpp cannot load is checked by MoEX only, and the llama.cpp comparison uses a variant of the
preset it can load (docs/model.md): qwen2-moe-tiny's dense layer (llama.cpp's qwen2moe needs a router in
every layer) is dropped with --layers 1; olmoe and dots1 get as many KV heads as heads (llama.cpp sizes
their k_proj / k_norm so, as the published models have it).
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference"))

# family preset -> (gen-model flags of the checkpoint MoEX is checked on, flags of llama.cpp's variant or None
# when it is the same checkpoint)
FAMILIES = {
    "qwen2-moe-tiny": ([], ["--layers", "1"]),
    "qwen3-moe-tiny": ([], None),
    "olmoe-tiny": (["--kv-heads", "4"], None),
    "dots1-tiny": (["--kv-heads", "4"], None),
}
LLAMA_TOL = {"f32": 5e-3, "q8_0": 0.25}
REF_TOL = 1e-4
EP_TOL = 1e-5


from llama_cpp_common import llama_logprobs, log_softmax, run  # noqa: E402  (shared by the GGUF checks)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp (no Node.js >= 20)")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--decode", type=int, default=3)
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    import families_ref  # torch is imported once for every family
    import torch

    failures = []
    moex = args.moex

    def logits(model, ids, out, *extra, ranks=1):
        launcher = [] if ranks == 1 else ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks)]
        run([*launcher, moex, "logits", "--model", model, "--ids", ",".join(map(str, ids)), "--out", out,
             "--threads", "1", "--exact", *extra])
        return np.load(out)

    def convert(src, gguf, t):
        run([moex, "convert", "--model", src, "--out", gguf, "--type", t, "--force"])

    for preset in args.families.split(","):
        flags, llama_flags = FAMILIES[preset]
        w = os.path.join(args.workdir, preset)
        src = w + "-src"
        run([moex, "gen-model", "--preset", preset, "--dtype", "f32", "--seed", "7", *flags, "--out", src, "--force"])
        vocab = json.load(open(os.path.join(src, "config.json")))["vocab_size"]
        rng = np.random.default_rng(11)
        ids = [int(t) for t in rng.integers(3, vocab, size=args.prompt_len)]
        gguf = w + "-f32.gguf"
        convert(src, gguf, "f32")
        dec = ["--decode", str(args.decode)]
        from_st = logits(src, ids, w + "-st.npy", *dec)
        from_gguf = logits(gguf, ids, w + "-gguf.npy", *dec)
        exact = float(np.abs(from_st - from_gguf).max())
        cfg, tensors = families_ref.load_model(src, torch.float64)
        ref, ref_tokens = families_ref.greedy_decode(cfg, tensors, ids, args.decode)
        ref = ref.numpy()
        rel = float(np.abs(from_gguf.astype(np.float64) - ref).max() / np.abs(ref).max())
        ours_tokens = [int(t) for t in from_gguf[len(ids) - 1:].argmax(-1)][:args.decode]
        tokens_same = ours_tokens == [int(t) for t in ref_tokens][:args.decode]
        ep = logits(gguf, ids, w + "-ep.npy", *dec, "--moe-parallel", "ep", "--attn-parallel", "dp", ranks=2)
        d_ep = float(np.abs(ep - from_gguf).max())
        print(f"{preset}: gguf vs safetensors {exact:.1e} (must be 0); vs reference {rel:.2e} (tol {REF_TOL:.0e}), "
              f"greedy tokens {'agree' if tokens_same else 'DIFFER'}; EP 2 ranks vs 1 {d_ep:.1e} (tol {EP_TOL:.0e})")
        if exact != 0.0:
            failures.append(f"{preset}: GGUF logits differ from safetensors by {exact:.2e}")
        if not rel <= REF_TOL:
            failures.append(f"{preset}: GGUF logits differ from the reference by {rel:.2e} (relative)")
        if not tokens_same:
            failures.append(f"{preset}: greedy tokens {ours_tokens} differ from the reference's {list(ref_tokens)}")
        if not d_ep <= EP_TOL:
            failures.append(f"{preset}: EP on 2 ranks differs from 1 rank by {d_ep:.2e}")
        if preset == "qwen3-moe-tiny":  # bf16 tensors stay views into the mapping, as safetensors' (any family)
            bsrc = w + "-bf16-src"
            run([moex, "gen-model", "--preset", preset, "--dtype", "bf16", "--seed", "7", *flags, "--out", bsrc, "--force"])
            convert(bsrc, w + "-bf16.gguf", "bf16")
            b_st, b_gguf = logits(bsrc, ids, w + "-bf16-st.npy", *dec), logits(w + "-bf16.gguf", ids, w + "-bf16-gguf.npy", *dec)
            d_bf16 = float(np.abs(b_st - b_gguf).max())
            print(f"  bf16: gguf vs safetensors {d_bf16:.1e} (must be 0)")
            if d_bf16 != 0.0:
                failures.append(f"{preset}: bf16 GGUF logits differ from safetensors by {d_bf16:.2e}")
        if args.no_llama:
            continue
        lsrc = src
        if llama_flags is not None:
            lsrc = w + "-llama-src"
            run([moex, "gen-model", "--preset", preset, "--dtype", "f32", "--seed", "7", *flags, *llama_flags,
                 "--out", lsrc, "--force"])
        base = None
        # q8_0 once (qwen3-moe-tiny): the block formats are the same code for every architecture, which
        # check_llama.py covers type by type; the architecture's part, the mapping, is the f32 check.
        for t in ("f32", "q8_0") if preset == "qwen3-moe-tiny" else ("f32",):
            lg = f"{w}-llama-{t}.gguf"
            convert(lsrc, lg, t)
            ours = log_softmax(logits(lg, ids, f"{w}-llama-{t}.npy"))
            theirs = llama_logprobs(lg, ids, vocab)
            d = float(np.median(np.abs(ours - theirs).max(-1)))
            greedy = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
            if base is None:
                base = ours
            drift = float(np.median(np.abs(ours - base).max(-1)))
            print(f"  llama.cpp {t:4s}: moex vs llama.cpp {d:.2e} (tol {LLAMA_TOL[t]:g}), greedy agree {greedy:.0%}; "
                  f"this file vs f32 {drift:.2e}")
            if not d <= LLAMA_TOL[t]:
                failures.append(f"{preset} {t}: MoEX and llama.cpp differ by {d:.2e} > {LLAMA_TOL[t]:g}")
            if t == "f32" and greedy < 1.0:
                failures.append(f"{preset} {t}: greedy tokens agree with llama.cpp at only {greedy:.0%} of positions")
    for f in failures:
        print("FAIL:", f)
    print(f"{len(args.families.split(','))} families, {len(failures)} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
