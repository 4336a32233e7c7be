"""`moex generate` on gen-model's tiny Mixtral (tokenizer.json beside tokenizer.model, as Mixtral ships them)
prints what Debian's SentencePiece (python3-sentencepiece) decodes from the same ids: the prompt and the
greedy continuation (`--print-ids`), where most pieces of the 512-piece vocabulary are byte pieces. A run
of byte pieces that is not UTF-8 as a whole (<0xE8> <0x43> <0x34>) must print the bytes that form
characters as text ("\ufffdC4"), not one U+FFFD per piece as Hugging Face's fast tokenizer decodes it.

  check_generate_bytes.py --moex BIN --workdir DIR [-n 8]
"""
import argparse
import os
import re
import subprocess
import sys

import sentencepiece as spm

PROMPTS = ["hello", "Once upon a time", "The quick brown fox", "42 is the answer", "caf\u00e9 au lait", "x = y + 1;",
           "\u6771\u4eac", "Dear Sir,"]


def broken_run_with_text(sp, ids):
    """Whether `ids` hold a run of byte pieces that is not UTF-8 as a whole but has a character in it."""
    runs, run = [], []
    for i in ids + [-1]:
        if i >= 0 and sp.is_byte(i):
            run.append(int(sp.id_to_piece(i)[3:5], 16))
        elif run:
            runs.append(bytes(run))
            run = []
    for r in runs:
        try:
            r.decode("utf-8")
        except UnicodeDecodeError:
            if r.decode("utf-8", errors="ignore"):
                return True
    return False


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--moex", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("-n", type=int, default=8)
    args = p.parse_args()
    model = os.path.join(args.workdir, "tiny")
    os.makedirs(args.workdir, exist_ok=True)
    subprocess.run([args.moex, "gen-model", "--preset", "tiny", "--seed", "1", "--out", model, "--force"], check=True,
                   stdout=subprocess.DEVNULL)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(model, "tokenizer.model"))
    cmd = [args.moex, "generate", "--model", model, "-n", str(args.n), "--temperature", "0", "--ignore-eos",
           "--print-ids", "--threads", "1"]
    for prompt in PROMPTS:
        cmd += ["--prompt", prompt]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE).stdout.decode("utf-8")
    block = out[: out.index("\nload:") + 1]
    # "[s] TEXT\nids: 1 2 3\n" per prompt; TEXT may hold newlines of its own.
    parts = re.split(r"\nids:((?: \d+)*)\n", block)
    texts, id_lines = parts[0:-1:2], parts[1::2]
    if len(id_lines) != len(PROMPTS) or parts[-1] != "":
        print(f"FAIL: cannot read {len(PROMPTS)} sequences from:\n{block!r}")
        return 1
    failures, exercised = 0, 0
    for s, (prompt, text, id_line) in enumerate(zip(PROMPTS, texts, id_lines)):
        new = [int(i) for i in id_line.split()]
        # <unk> is special to the fast tokenizer (skipped), SentencePiece writes " \u2047 ": left out of both.
        ids = [sp.bos_id()] + sp.encode(prompt) + [i for i in new if not sp.is_unknown(i)]
        want = f"[{s}] " + sp.decode(ids)
        exercised += broken_run_with_text(sp, new)
        ok = text == want
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'}: prompt {s} ids {new}: moex {text!r}" + ("" if ok else f", SentencePiece {want!r}"))
    if exercised == 0:
        print("FAIL: no continuation held a broken byte run with a character in it: the test checked nothing")
        return 1
    print(f"{exercised} of {len(PROMPTS)} continuations held a byte run that is not UTF-8 with characters in it")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
