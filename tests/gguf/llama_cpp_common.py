"""Helpers the GGUF checks share: run a command, log-softmax, and llama.cpp's log-probabilities of a prompt
(node-llama-cpp through llama_eval.mjs)."""
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def llama_logprobs(gguf, ids, vocab):
    out = json.loads(run(["node", os.path.join(HERE, "llama_eval.mjs"), gguf, "--ids", ",".join(map(str, ids))],
                         cwd=HERE))
    lp = np.full((len(ids), vocab), -np.inf)
    for i, probs in enumerate(out["positions"]):
        for token, p in probs:
            lp[i, token] = np.log(p) if p > 0 else -np.inf
    if not np.isfinite(lp).all():
        sys.exit(f"FAIL: llama.cpp gave no probability for some tokens of {gguf}")
    return lp
