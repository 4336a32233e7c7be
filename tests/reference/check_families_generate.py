"""`moex generate` with text prompts on a byte-level family checkpoint, end to end, against independent parts:
Hugging Face's `tokenizers` (npm) encodes each prompt from the tokenizer.json gen-model wrote, the PyTorch
reference (families_ref.py) decodes greedily from those ids, and `tokenizers` decodes prompt + continuation
(special tokens skipped). MoEX's printed text must equal that, prompt by prompt.

  check_families_generate.py --moex BIN --modules NODE_MODULES --workdir DIR [--preset qwen3-moe-tiny] [-n 12]
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = ["Hello, world! 123", "The old caf\u00e9 in \u6771\u4eac  had 42 doors"]

# encode / decode through Hugging Face's tokenizers; argv: modules, tokenizer.json, JSON request.
NODE_HELPER = r"""
const path = require('path');
const { Tokenizer } = require(path.join(path.resolve(process.argv[1]), 'tokenizers'));
(async () => {
  const tok = Tokenizer.fromFile(process.argv[2]);
  const req = JSON.parse(process.argv[3]);
  const out = {};
  if (req.encode !== undefined) out.ids = Array.from((await tok.encode(req.encode, null, { addSpecialTokens: true })).getIds());
  if (req.decode !== undefined) out.text = await tok.decode(req.decode, true);
  process.stdout.write(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout


def hf(modules, tokenizer, request):
    return json.loads(run(["node", "-e", NODE_HELPER, modules, tokenizer, json.dumps(request)]))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--modules", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="qwen3-moe-tiny")
    p.add_argument("-n", type=int, default=12)
    args = p.parse_args()
    model = os.path.join(args.workdir, "model")
    os.makedirs(args.workdir, exist_ok=True)
    run([args.moex, "gen-model", "--preset", args.preset, "--seed", "7", "--out", model, "--force"])
    tokenizer = os.path.join(model, "tokenizer.json")
    eos = json.load(open(os.path.join(model, "config.json")))["eos_token_id"]

    expected = []
    for s, prompt in enumerate(PROMPTS):
        ids = hf(args.modules, tokenizer, {"encode": prompt})["ids"]
        tokens_file = os.path.join(args.workdir, f"ref{s}.tokens")
        run([sys.executable, os.path.join(HERE, "families_ref.py"), "--model", model, "--ids", ",".join(map(str, ids)),
             "--decode", str(args.n), "--out", os.path.join(args.workdir, f"ref{s}.npy"), "--tokens-out", tokens_file])
        tokens = [int(t) for t in open(tokens_file).read().split()]
        if eos in tokens:  # generation stops at EOS (decode skips it)
            tokens = tokens[: tokens.index(eos) + 1]
        expected.append(hf(args.modules, tokenizer, {"decode": ids + tokens})["text"])
        print(f"prompt {s}: {len(ids)} ids, reference continuation {tokens}")

    cmd = [args.moex, "generate", "--model", model, "-n", str(args.n), "--temperature", "0", "--exact"]
    for prompt in PROMPTS:
        cmd += ["--prompt", prompt]
    # The continuation may hold newlines: the printed block is "[s] TEXT\n" per prompt, then the timings.
    out = run(cmd)
    want = "".join(f"[{s}] {text}\n" for s, text in enumerate(expected))
    ok = out.startswith(want) and out[len(want):].startswith("load:")
    print(("ok: " if ok else "FAIL: moex printed\n") + repr(out.split("load:")[0]) + ("" if ok else "\nexpected\n" + repr(want)))
    failures = 0 if ok else 1
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
