"""The loop over tensor data (a .npy/.npz folder, or an iterable of input dicts): every output of int8
against fp32, each run timed (at one sample a run, those are the latencies)."""
from __future__ import annotations

import os

from qtool import graph as G
from qtool.evaluate.batching import eval_batch
from qtool.evaluate.exact import ExactCheck
from qtool.evaluate.options import EvalOptions
from qtool.evaluate.meaning import output_meanings
from qtool.evaluate.runs import Engines
from qtool.evaluate.stats import OutputStats, headline
from qtool.evaluate.timing import RunTimes, ort_latency
from qtool.evaluate.where import engines_at
from qtool.modelio import check_pair, load_model, model_bytes
from qtool.ortsession import session

TENSOR_BATCH = 8  # samples per run, fewer where one sample's activations are large (batching.eval_batch)


def evaluate_tensors(fp32_path: str, int8_path: str, data, options: EvalOptions = EvalOptions(),
                     files: list | None = None) -> dict:
    """Every output of int8 vs fp32 over tensor data (a .npy/.npz folder or an iterable of input dicts)."""
    from qtool.data.tensors import tensor_source
    from qtool.errors import QtoolError
    fp32 = load_model(fp32_path)
    batch = TENSOR_BATCH
    if isinstance(data, (str, os.PathLike)):
        batch = eval_batch(fp32, data, fp32_path, files, batch)
    # (a model nothing of which runs in int8 has no int8 arithmetic to check: luscinia's 194 MB tree ensemble
    # took a third copy in the runtime for it, eval peaked at 5.9 GB)
    int8 = load_model(int8_path, check=False)
    int8_ops = bool(G.quantized_ops(int8))
    if G.samples_interact(int8):
        batch = 1
    del int8
    check_pair(fp32_path, int8_path)
    src = tensor_source(data, fp32, fp32_path, batch=batch, files=files, limit=options.limit)
    if src is None:
        raise QtoolError(f"{data}: holds images; evaluate them with a preprocessing config")
    sf, sq = session(fp32_path, options.threads), session(int8_path, options.threads)
    names = [o.name for o in sf.get_outputs()]
    meanings = output_meanings(fp32, names, options.task)
    stats = {n: OutputStats(n, meaning=meanings[n]) for n in names}
    mask = next((m.mask for m in meanings.values() if m.mask), None)  # (the attention mask, an encoder pools over)
    exact = ExactCheck(int8_path, options.threads) if options.check and int8_ops else None
    sample, n_samples = None, 0
    times = RunTimes()  # (with --ray the runs are the workers': the latency is timed here afterwards)
    engines = Engines(os.path.abspath(fp32_path), os.path.abspath(int8_path), options.threads, True, tuple(names),
                      int8_first=True)
    batches = ((batch_names, feeds, exact is not None and exact.wants(feeds, _samples_in(src, batch_names, feeds)))
               for batch_names, feeds in src.batches())
    with engines_at(options.ray, engines, (sf, sq, None, exact.session if exact else None), times) as where:
        for batch_names, feeds, outs in where.outputs(batches):
            n_batch = _samples_in(src, batch_names, feeds)
            if exact is not None and outs.exact is not None:
                exact.take(outs.exact, outs.int8)
            for name, a, b in zip(names, outs.fp32, outs.int8):
                stats[name].add(a, b, n_batch, feeds.get(mask) if mask else None)
            n_samples += n_batch
            sample = sample or feeds
    if n_samples == 0:
        raise QtoolError("no evaluation samples")
    outs = {n: s.result() for n, s in stats.items()}
    first = headline([outs[n] for n in names])
    size = {"fp32": model_bytes(fp32_path), "int8": model_bytes(int8_path)}
    res = {"n_samples": n_samples, "data_kind": src.kind, "fp32_model": os.path.abspath(fp32_path),
           "int8_model": os.path.abspath(int8_path), "outputs": outs,
           "output_sqnr_db": first["sqnr_db"], "max_abs_error": first["max_abs_error"], "size_bytes": size}
    for k in ("top1_agreement", "encoder"):  # (an encoder's figures: its vectors over the set)
        if k in first:
            res[k] = first[k]
    if exact is not None:
        res["runtime_check"] = exact.result()
    res["size_ratio"] = size["int8"] / size["fp32"]
    if options.latency and sample is not None:  # (a sample fed whole where samples are not stacked: a state [2, N, C])
        one = sample if src.batch == 1 else {k: v[:1] for k, v in sample.items()}
        # the runs above, the first one (warm-up) left out
        res["latency_ms"] = times.latency_ms() if src.batch == 1 and times.enough() else ort_latency(sf, sq, one)
    return res


def _samples_in(src, batch_names: list, feeds: dict) -> int:
    """A file is one sample, whatever its axis 0 holds; an iterable's item may be a batch."""
    return len(batch_names) if src.kind in ("npy", "npz") else len(next(iter(feeds.values())))
