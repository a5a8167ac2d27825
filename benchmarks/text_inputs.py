#!/usr/bin/env python3
"""English sentences from ../shared, tokenized for an encoder by its own tokenizer.json, in the zoo's input format.

The sentences: the zoo's paraphrase set (../shared/zoo/samples/minilm-l3-paraphrase.npz: 40 calibration and
40 evaluation sentences, written in paraphrase pairs, its own split) first, then sentences about ImageNet's
classes (../shared/imagenet-samples/synsets.txt, its split: index % 10 == 0 calibrates), one of a dozen
sentence frames per class, classes evenly spaced over the split. 64 calibration and 240 evaluation
sentences by default; the same sentences for every encoder.

Tokenized with the `tokenizers` package (a benchmark-only environment; qtool never needs it) from the
model folder's tokenizer.json: [1, L] int64 input_ids and attention_mask, token_type_ids for BERT-type
models; L the sentence's own length, or --fixed N (padded to N, the padding masked). One .npz per sentence
and index.json, as ../shared/zoo/inputs.py writes them, so bench_text.py and qtool calibrate read them as
they read the zoo's.

  python benchmarks/text_inputs.py --model-dir DIR --shared ../shared --split eval --out DIR [--fixed 128]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

FRAMES = ("A photo of a {}.", "There is a {} in the middle of the picture.", "I saw a {} on my way home yesterday.",
          "The {} was bigger than I expected.", "Where can I find a {} near here?", "My sister drew a {} for school.",
          "A {} appeared in the documentary last night.", "He took a blurry picture of a {}.",
          "Is that a {} or something else?", "The museum has an old {} on display.",
          "Nobody noticed the {} until it was too late.", "She wrote a short story about a {}.")
ZOO_SENTENCES = os.path.join("zoo", "samples", "minilm-l3-paraphrase.npz")
SYNSETS = os.path.join("imagenet-samples", "synsets.txt")


def zoo_sentences(shared, split):
    with np.load(os.path.join(shared, ZOO_SENTENCES)) as z:
        want = 0 if split == "calib" else 1
        return [(str(t), f"{ZOO_SENTENCES}#{i}") for i, (t, s) in enumerate(zip(z["text"], z["split"])) if s == want]


def class_sentences(shared, split, n):
    with open(os.path.join(shared, SYNSETS), encoding="utf-8") as f:
        names = [line.split(maxsplit=1)[1].strip().replace("_", " ") for line in f if line.strip()]
    pool = [i for i in range(len(names)) if (i % 10 == 0) == (split == "calib")]
    if n > len(pool):
        raise SystemExit(f"{split}: {len(pool)} ImageNet classes, asked for {n}")
    chosen = [pool[(k * len(pool)) // n] for k in range(n)]
    return [(_frame(FRAMES[k % len(FRAMES)], names[i]), f"{SYNSETS}#{i}") for k, i in enumerate(chosen)]


def _frame(frame, name):
    article = "an" if name[0].lower() in "aeiou" else "a"
    return frame.replace("a {}", f"{article} {{}}").replace("A {}", f"{article.capitalize()} {{}}").format(name)


def sentences(shared, split, n):
    zoo = zoo_sentences(shared, split)[:n]
    return zoo + class_sentences(shared, split, n - len(zoo)) if n > len(zoo) else zoo


def tokenizer(model_dir, fixed, pad_id):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=fixed or 512)
    if fixed:
        tok.enable_padding(length=fixed, pad_id=pad_id, pad_token=tok.id_to_token(pad_id) or "[PAD]")
    return tok


def write(model_dir, shared, split, n, out, fixed=0):
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    typed = config.get("model_type") == "bert"
    tok = tokenizer(model_dir, fixed, int(config.get("pad_token_id", 0)))
    os.makedirs(out, exist_ok=True)
    index = dict(model=os.path.basename(os.path.normpath(model_dir)), split=split, n=n, format="npz", inputs={},
                 samples=[])
    lengths = []
    for k, (text, source) in enumerate(sentences(shared, split, n)):
        e = tok.encode(text)
        feeds = {"input_ids": np.array([e.ids], np.int64), "attention_mask": np.array([e.attention_mask], np.int64)}
        if typed:
            feeds["token_type_ids"] = np.array([e.type_ids], np.int64)
        name = f"{split}_{k:04d}.npz"
        np.savez(os.path.join(out, name), **feeds)
        index["samples"].append(dict(file=name, source=source, text=text))
        lengths.append(feeds["input_ids"].shape[1])
    shape = [1, min(lengths) if min(lengths) == max(lengths) else f"{min(lengths)}..{max(lengths)}"]
    index["inputs"] = {nm: dict(shape=shape, dtype="int64") for nm in feeds}
    with open(os.path.join(out, "index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1, ensure_ascii=False)
    return index


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="the encoder's folder: config.json and tokenizer.json")
    p.add_argument("--shared", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared"))
    p.add_argument("--split", choices=["calib", "eval"], required=True)
    p.add_argument("--n", type=int, help="sentences (default: 64 calib, 240 eval)")
    p.add_argument("--fixed", type=int, default=0, help="pad every sentence to this many tokens (0: its own length)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    n = a.n or (64 if a.split == "calib" else 240)
    idx = write(a.model_dir, a.shared, a.split, n, a.out, a.fixed)
    print(f"{a.out}: {idx['n']} {a.split} sentences, {', '.join(idx['inputs'])} {idx['inputs']['input_ids']['shape']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
