"""MoEX's tokenizers against Debian's SentencePiece (python3-sentencepiece) on a gen-model checkpoint.

1. tokenizer.model through MoEX (libsentencepiece behind moex::Tokenizer): the same ids as SentencePiece's
   Python binding for every text of corpus.json (BOS first), the same text back for those ids and for
   random id lists.
2. The converted tokenizer.json through MoEX's own BPE (the file gen-model ships beside tokenizer.model, as
   Hugging Face's Mixtral does): the same ids and decodes as SentencePiece, for every text without a special
   token's text in it (SentencePiece reads "<s>" in text as characters; the fast tokenizer as the token)
   and valid UTF-8 (SentencePiece replaces each invalid byte by U+FFFD, a host language hands the fast
   tokenizer one U+FFFD per maximal invalid subsequence), and decodes of id lists without <unk> (the fast
   tokenizer skips it as special; SentencePiece writes " ⁇ ") or starting with the byte piece <0x20> (the
   fast tokenizer's Strip decoder drops that space). Byte pieces included: a run of them that is
   not UTF-8 as a whole decodes as SentencePiece decodes it (the bytes that form characters as text, each
   other byte as U+FFFD) where the fast tokenizer's ByteFallback writes U+FFFD for the whole run: the
   text `moex generate` prints and `moex serve` streams. The tokenizer.json side of the other cases is
   checked against Hugging Face's tokenizers (check_hf.js).

usage: check_sentencepiece.py --probe BIN --model-dir DIR --corpus corpus.json --work DIR
"""
import argparse
import json
import os
import random
import subprocess
import sys

import sentencepiece as spm


def run_probe(probe, path, cases, work, name):
    cases_path = os.path.join(work, f"cases_{name}.json")
    out_path = os.path.join(work, f"moex_{name}.json")
    with open(cases_path, "w") as f:
        json.dump(cases, f)
    subprocess.run([probe, "run", path, cases_path, out_path], check=True)
    with open(out_path) as f:
        return json.load(f)


def valid_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.model_dir, "tokenizer.model"))
    with open(args.corpus) as f:
        texts = json.load(f)["texts"]
    raw = [bytes.fromhex(c["hex"]) if "hex" in c else c["text"].encode("utf-8") for c in texts]
    n = sp.get_piece_size()
    rng = random.Random(7)
    id_lists = [[rng.randrange(n) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    byte = lambda b: sp.piece_to_id(f"<0x{b:02X}>")
    # Byte runs: valid, cut short, never valid, valid bytes before and after broken ones (printable ASCII,
    # a form feed), and between words.
    word = sp.piece_to_id("\u2581the")
    for seq in ([0xE4, 0xBD, 0xA0], [0xE4, 0xBD], [0xFF], [0x41, 0xE4], [0xF0, 0x9F, 0x98, 0x80],
                [0xE8, 0x43, 0x34], [0x45, 0x2A, 0x0C, 0xC3], [0xD2, 0xB0, 0x21, 0xA4], [0xE4, 0xBD, 0x41, 0xC3, 0xA9]):
        id_lists.append([byte(b) for b in seq])
        id_lists.append([word] + [byte(b) for b in seq] + [word])
    cases = {"texts": texts, "id_lists": id_lists}

    failures = []
    specials = [sp.id_to_piece(i) for i in (sp.unk_id(), sp.bos_id(), sp.eos_id())]
    for name, path in (("model", os.path.join(args.model_dir, "tokenizer.model")), ("json", args.model_dir)):
        moex = run_probe(args.probe, path, cases, args.work, name)
        want_file = "tokenizer.model" if name == "model" else "tokenizer.json"
        if not moex["file"].endswith(want_file):
            failures.append(f"{name}: MoEX read {moex['file']}, not {want_file}")
        if moex["vocab_size"] != n or moex["bos_id"] != sp.bos_id() or moex["eos_id"] != sp.eos_id():
            failures.append(f"{name}: vocab/bos/eos {moex['vocab_size']}/{moex['bos_id']}/{moex['eos_id']}, "
                            f"SentencePiece {n}/{sp.bos_id()}/{sp.eos_id()}")
        for i, (text, m) in enumerate(zip(raw, moex["texts"])):
            if name == "json" and (any(s.encode() in text for s in specials) or not valid_utf8(text)):
                continue
            ids = sp.encode(text)
            label = f"{name}: text {i} {text!r}"
            if m["ids_plain"] != ids:
                failures.append(f"{label}: ids MoEX {m['ids_plain']} SentencePiece {ids}")
            if m["ids"] != [sp.bos_id()] + ids:
                failures.append(f"{label}: with BOS MoEX {m['ids']} SentencePiece {[sp.bos_id()] + ids}")
            decoded = sp.decode([sp.bos_id()] + ids).encode("utf-8").hex()
            if m["decoded"] != decoded:
                failures.append(f"{label}: decode MoEX {bytes.fromhex(m['decoded'])!r} "
                                f"SentencePiece {bytes.fromhex(decoded)!r}")
        for ids, m in zip(id_lists, moex["id_lists"]):
            # A list that starts (after control tokens) with the byte piece of a space: the fast tokenizer's
            # Strip decoder drops one leading space whatever piece it came from, SentencePiece only a "▁".
            shown = [i for i in ids if not sp.is_control(i)]
            if name == "json" and (any(sp.is_unknown(i) for i in ids) or shown[:1] == [byte(0x20)]):
                continue
            decoded = sp.decode(ids).encode("utf-8").hex()
            if m["decoded"] != decoded:
                failures.append(f"{name}: ids {ids}: decode MoEX {bytes.fromhex(m['decoded'])!r} "
                                f"SentencePiece {bytes.fromhex(decoded)!r}")
    if failures:
        for f in failures[:25]:
            print("MISMATCH", f)
        print(f"{len(failures)} mismatches against SentencePiece")
        return 1
    print(f"tokenizer.model and tokenizer.json of {args.model_dir}: {len(texts)} texts and {len(id_lists)} id lists "
          f"agree with SentencePiece {spm.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
