"""Sentence encoders int8: qtool's default beside ONNX Runtime's quantizers, judged as encoders (issue 47).

For each encoder (an ONNX file and folders of tokenized sentences in the zoo's input format: one .npz per
sentence with input_ids / attention_mask / token_type_ids as the model takes them, and index.json), it
builds five systems from the same files:

  fp32             the model as given (the reference)
  qtool            `qtool calibrate` on the calibration folder, then the default `qtool quantize`
  ort-dyn-tensor   onnxruntime.quantization.quantize_dynamic, s8 weights per tensor
  ort-dyn-channel  quantize_dynamic, s8 weights per output channel (what most PyPI packages ship)
  ort-static       quantize_static, QDQ, u8 activations, s8 per-channel weights, MinMax, after quant_pre_process

and judges each on the evaluation sentences the way a search index would see it: the sentence vector
(the model's pooled output where it has one, else its token states mean-pooled over the attention mask),
its cosine to fp32's (mean and worst), whether each sentence's nearest other sentence is unchanged
(top-1 neighbour agreement), the Spearman rank correlation of all pair similarities against fp32's, the
worst output SQNR, and the file's size against fp32's. Latency is ONNX Runtime's, batch 1, at 32 and 128
tokens, 1 and 2 threads, the systems timed in alternation so that the machine's load falls on all alike;
the ratio column is each system's median over ORT dynamic per-channel's (on 1 thread also of the CPU time
per run, which other jobs on the machine move far less than the wall time), printed one line per cell
with the load average.

  python benchmarks/bench_text.py --model ENC.onnx --calib DIR --eval DIR --out DIR [--name NAME]
  python benchmarks/bench_text.py --zoo minilm-l3-paraphrase --shared ../shared   (the zoo's encoder,
        fetched and its inputs made where missing: $QTOOL_ZOO or --zoo-dir)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zoo import ort_quantize, ort_session, samples  # noqa: E402  (the zoo bench's ORT anchor, one copy)
import results_io  # noqa: E402
from qtool.runtime.bench import ort_session as bench_session  # noqa: E402  (ORT without spinning workers)

SYSTEMS = ("fp32", "qtool", "ort-dyn-tensor", "ort-dyn-channel", "ort-static")
LATENCY_TOKENS = (32, 128)
LATENCY_THREADS = (1, 2)


# ---- the systems

def build_qtool(model, calib, work, qtool):
    subprocess.run(qtool + ["calibrate", "--model", model, "--data", calib, "-w", work, "-q"], check=True)
    subprocess.run(qtool + ["quantize", "-w", work, "-q"], check=True)
    return os.path.join(work, "model.int8.onnx")


def build_ort_dynamic(model, out, per_channel):
    from onnxruntime.quantization import QuantType, quantize_dynamic
    quantize_dynamic(model, out, weight_type=QuantType.QInt8, per_channel=per_channel)
    return out


def build_systems(model, calib, out, qtool):
    names = [i.name for i in ort_session(model, 1).get_inputs()]
    made = {"fp32": model}
    steps = {
        "qtool": lambda: build_qtool(model, calib, os.path.join(out, "qtool"), qtool),
        "ort-dyn-tensor": lambda: build_ort_dynamic(model, os.path.join(out, "ort-dyn-tensor.onnx"), False),
        "ort-dyn-channel": lambda: build_ort_dynamic(model, os.path.join(out, "ort-dyn-channel.onnx"), True),
        "ort-static": lambda: ort_quantize(model, calib, _fresh(os.path.join(out, "ort-static")), names),
    }
    seconds = {}
    for name, build in steps.items():
        t0 = time.perf_counter()
        made[name] = build()
        seconds[name] = round(time.perf_counter() - t0, 1)
    return made, seconds


def _fresh(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


# ---- the judge

def sentence_vectors(outputs, names, feeds, pooled):
    """One vector per sentence: the output named `pooled`, else the first [1, L, H] output mean-pooled over
    the attention mask (sentence-transformers' pooling), else the first float output flattened."""
    if pooled:
        return outputs[names.index(pooled)].reshape(-1)
    mask = feeds.get("attention_mask")
    for y in outputs:
        if y.dtype == np.float32 and y.ndim == 3 and y.shape[0] == 1:
            m = np.ones(y.shape[1], np.float32) if mask is None else mask.reshape(-1).astype(np.float32)
            return (y[0] * m[:, None]).sum(0) / max(m.sum(), 1e-9)
    return next(y for y in outputs if y.dtype == np.float32).reshape(-1)


def run_all(path, feeds_list, pooled):
    s = ort_session(path, 1)
    names = [o.name for o in s.get_outputs()]
    vectors, outputs = [], []
    for feeds in feeds_list:
        ys = s.run(None, feeds)
        vectors.append(sentence_vectors(ys, names, feeds, pooled))
        outputs.append([np.asarray(y, np.float64) for y in ys])
    return np.stack(vectors).astype(np.float64), outputs


def _unit(v):
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def _ranks(x):
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    # ties share their mean rank, as Spearman's coefficient defines it
    vals, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    if len(vals) < len(x):
        sums = np.bincount(inv, weights=r)
        r = (sums / counts)[inv]
    return r


def spearman(a, b):
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / np.sqrt((ra * ra).sum() * (rb * rb).sum()))


def worst_sqnr(ref, got):
    """Per float output, SQNR over all sentences together; the worst output's, in dB."""
    worst = float("inf")
    for k in range(len(ref[0])):
        r = np.concatenate([o[k].ravel() for o in ref])
        g = np.concatenate([o[k].ravel() for o in got])
        if r.dtype.kind != "f" or r.size != g.size:
            continue
        noise = float(((r - g) ** 2).sum())
        worst = min(worst, float("inf") if noise == 0 else 10 * np.log10(float((r * r).sum()) / noise))
    return worst


def judge(ref_vectors, ref_outputs, vectors, outputs):
    a, b = _unit(ref_vectors), _unit(vectors)
    cos = (a * b).sum(1)
    sim_a, sim_b = a @ a.T, b @ b.T
    np.fill_diagonal(sim_a, -np.inf)
    np.fill_diagonal(sim_b, -np.inf)
    upper = np.triu_indices(len(a), 1)
    return {"cosine_mean": round(float(cos.mean()), 4), "cosine_min": round(float(cos.min()), 4),
            "top1_neighbour": round(float((sim_a.argmax(1) == sim_b.argmax(1)).mean()), 4),
            "spearman": round(spearman(sim_a[upper], sim_b[upper]), 4),
            "sqnr_db": round(worst_sqnr(ref_outputs, outputs), 1)}


# ---- latency

def latency_feeds(model, example, tokens):
    """A batch-1 input of `tokens` tokens: the example sentence's ids repeated, its mask all ones; a model of a
    fixed length gets them padded to it as its own inputs are (the padding masked)."""
    out = {}
    keep = example.get("attention_mask", np.ones_like(next(iter(example.values())))).reshape(-1).astype(bool)
    for i in ort_session(model, 1).get_inputs():
        x = example[i.name].reshape(-1)
        real = x[keep]
        reps = int(np.ceil(tokens / max(len(real), 1)))
        row = np.tile(real, reps)[:tokens] if i.name == "input_ids" else np.resize(real, tokens)
        if i.name == "attention_mask":
            row = np.ones(tokens, x.dtype)
        fixed = i.shape[-1] if isinstance(i.shape[-1], int) else 0
        if fixed > tokens:
            row = np.concatenate([row, np.full(fixed - tokens, x[~keep][0] if (~keep).any() else 0, x.dtype)])
        out[i.name] = row.reshape(1, -1).astype(x.dtype)
    return out


def latency(paths, example, rounds, warmup=3):
    """Median ms per system at each (tokens, threads), the systems run in alternation, round by round."""
    table = {}
    for tokens in LATENCY_TOKENS:
        feeds = latency_feeds(paths["fp32"], example, tokens)
        for threads in LATENCY_THREADS:
            # (idle workers sleep, as in `qtool bench`: with ORT's default spinning, the sessions timed in turn
            # each ran beside the previous one's spinning workers, and on 2 threads every system measured slower
            # than on one: the zoo MiniLM's fp32 15.7 -> 22-27 ms at 128 tokens)
            sessions = {n: bench_session(p, threads) for n, p in paths.items()}
            times = {n: [] for n in sessions}
            cpu = {n: [] for n in sessions}
            for r in range(warmup + rounds):
                for n, s in sessions.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    s.run(None, feeds)
                    if r >= warmup:
                        times[n].append(time.perf_counter() - t0)
                        cpu[n].append(time.process_time() - c0)
            for n, t in times.items():
                table.setdefault(n, {})[f"{tokens}tok_{threads}t_ms"] = round(1000 * statistics.median(t), 3)
                if threads == 1:  # (one thread: its CPU time is its latency without the other jobs' share of the cores)
                    table[n][f"{tokens}tok_1t_cpu_ms"] = round(1000 * statistics.median(cpu[n]), 3)
    return table


# ---- the run

def bench(a):
    os.makedirs(a.out, exist_ok=True)
    qtool = a.qtool.split() if a.qtool else [sys.executable, "-m", "qtool"]
    paths, build_s = build_systems(a.model, a.calib, a.out, qtool)
    feeds_list = list(samples(a.eval))
    ref_v, ref_o = run_all(paths["fp32"], feeds_list, a.pooled)
    fp32_size = os.path.getsize(paths["fp32"])
    load = [round(v, 1) for v in os.getloadavg()]
    lat = latency(paths, feeds_list[0], a.rounds) if a.rounds else {}
    load = load + [round(v, 1) for v in os.getloadavg()]
    rows = []
    for name in SYSTEMS:
        v, o = (ref_v, ref_o) if name == "fp32" else run_all(paths[name], feeds_list, a.pooled)
        row = {"model": a.name, "system": name, "size": round(os.path.getsize(paths[name]) / fp32_size, 3),
               **judge(ref_v, ref_o, v, o), **lat.get(name, {}), "build_s": build_s.get(name, 0.0)}
        rows.append(row)
    base = next(r for r in rows if r["system"] == "ort-dyn-channel")
    for r in rows:
        for key in [k for k in r if k.endswith("_ms")]:
            r[key.replace("_ms", "_vs_ortdyn")] = round(r[key] / base[key], 2)
    return {"model": a.name, "sentences": len(feeds_list), "rows": rows,
            "load_average": f"{load[0]} before, {load[3]} after (1-minute)" if a.rounds else None}


def table(result):
    keys = ["system", "size", "cosine_mean", "cosine_min", "top1_neighbour", "spearman", "sqnr_db"]
    lat = [k for k in result["rows"][0] if k.endswith("_ms")]
    lines = [f"{result['model']}: {result['sentences']} evaluation sentences",
             " | ".join(keys + lat + [k.replace('_ms', '_vs_ortdyn') for k in lat])]
    for r in result["rows"]:
        lines.append(" | ".join(str(r.get(k)) for k in keys + lat + [k.replace('_ms', '_vs_ortdyn') for k in lat]))
    return "\n".join(lines)


def latency_ratios(result, system="qtool"):
    """One line per (tokens, threads): `system`'s median ms over ORT dynamic per-channel's, and the load average
    the timing ran under (the ratio is what to read on a shared machine)."""
    row = next((r for r in result["rows"] if r["system"] == system), None)
    if row is None or not any(k.endswith("_vs_ortdyn") for k in row):
        return []
    base = next(r for r in result["rows"] if r["system"] == "ort-dyn-channel")
    lines = [f"{system} latency / ORT dynamic per-channel (ONNX Runtime, batch 1, systems in alternation; load average "
             f"{result.get('load_average', '?')}):"]
    for tokens in LATENCY_TOKENS:
        for threads in LATENCY_THREADS:
            k = f"{tokens}tok_{threads}t"
            if f"{k}_vs_ortdyn" in row:
                line = (f"  {tokens:>3} tokens, {threads} thread{'s' if threads > 1 else ''}: {row[k + '_vs_ortdyn']:.2f}"
                        f"  ({row[k + '_ms']:.2f} ms vs {base[k + '_ms']:.2f} ms)")
                if f"{k}_cpu_vs_ortdyn" in row:
                    line += (f"; CPU time {row[k + '_cpu_vs_ortdyn']:.2f} ({row[k + '_cpu_ms']:.2f} ms vs "
                             f"{base[k + '_cpu_ms']:.2f} ms)")
                lines.append(line)
    return lines


def zoo_paths(a):
    """The zoo encoder's model and inputs, fetched and made by the zoo's own scripts where missing."""
    zoo_dir = a.zoo_dir or os.environ.get("QTOOL_ZOO") or os.path.join(a.out, "zoo-cache")
    data = a.data_dir or os.path.join(a.out, "data")
    zoo_py = os.path.join(a.shared, "zoo")
    env = {**os.environ, "QTOOL_ZOO": zoo_dir}
    model = os.path.join(zoo_dir, f"{a.zoo}.onnx")
    if not os.path.isfile(model):
        subprocess.run([sys.executable, os.path.join(zoo_py, "fetch.py"), "--dest", zoo_dir, a.zoo], check=True, env=env)
    dirs = {}
    for split, n in (("calib", a.calib_n), ("eval", a.eval_n)):
        dirs[split] = os.path.join(data, a.zoo, f"{split}-{n}")
        if not os.path.isfile(os.path.join(dirs[split], "index.json")):
            subprocess.run([sys.executable, os.path.join(zoo_py, "inputs.py"), a.zoo, "--split", split, "--n", str(n),
                            "--out", dirs[split]], check=True, env=env)
    return model, dirs["calib"], dirs["eval"]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model")
    p.add_argument("--calib")
    p.add_argument("--eval")
    p.add_argument("--name")
    p.add_argument("--zoo", help="a zoo encoder's name (its model and inputs from ../shared/zoo)")
    p.add_argument("--shared", default=os.path.join(results_io.ROOT, "..", "shared"))
    p.add_argument("--zoo-dir")
    p.add_argument("--data-dir")
    p.add_argument("--calib-n", type=int, default=40)
    p.add_argument("--eval-n", type=int, default=40)
    p.add_argument("--pooled", help="the output that is already the sentence vector (default: mean pooling)")
    p.add_argument("--out", default="bench_out/text")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per latency cell (0: no latency)")
    p.add_argument("--qtool", help="the qtool command (default: this Python's -m qtool)")
    p.add_argument("--json", help="write the result here too")
    p.add_argument("--results", action="store_true", help="write benchmarks/results/text-NAME.json")
    a = p.parse_args(argv)
    if a.zoo:
        a.model, a.calib, a.eval = zoo_paths(a)
        a.name = a.name or a.zoo
    if not (a.model and a.calib and a.eval):
        p.error("give --model, --calib and --eval, or --zoo NAME")
    a.name = a.name or os.path.splitext(os.path.basename(a.model))[0]
    return a


def main(argv=None):
    a = parse(argv)
    result = bench(a)
    print(table(result))
    print("\n".join(latency_ratios(result)))
    text = json.dumps(result, indent=1)
    with open(os.path.join(a.out, f"text-{a.name}.json"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if a.results:
        cols = [(k, k) for k in result["rows"][0]]
        results_io.write(f"text-{a.name}", "bench_text.py", f"python benchmarks/bench_text.py --zoo {a.name}", cols,
                         result["rows"], results_io.provenance(),
                         title=f"Sentence encoder {a.name}: int8 judged as an encoder",
                         about="cosine to fp32, top-1 neighbour agreement, Spearman of pair similarities, SQNR, "
                               "size vs fp32, ORT latency at batch 1 (ratio to ORT dynamic per-channel)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
