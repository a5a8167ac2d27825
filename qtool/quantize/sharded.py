"""quantize's simulated experiments (simulate.py: sensitivity, range tuning) over a Ray cluster, with
the results one process gets.

One process runs its variants in runs that share an fp32 prefix, each variant in the session of its cut
(the variants starting at one cut share it). Here each run is split into parts, a part holding whole
cuts (every variant starting there), and the parts go to workers: actors that hold the samples and the
quantize context, put in the object store once per set of experiments and fetched once per worker.
A part builds the sessions one process builds for its cuts and the same prefix (the whole run's, not
only its own), so each variant's output is computed by the same graphs, on the same batches, as in
one process: the figures, and so every choice made from them, are the same."""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import replace

from qtool.blas import blas_threads
from qtool.distributed.cluster import RETRIES, cpus, fetched, gather, next_done, node_id, put, ray_cluster
from qtool.quantize.rounding import layer_hessians, rounding_layers
from qtool.quantize.simulate import Run, Simulator

PARTS_PER_WORKER = 2  # parts of a run per worker: the larger ones first, the small ones even out the end
WHAT = "quantize's experiments"


class ExperimentWorker:
    """An actor: what the experiments under way share (the context, the samples, ...: fetched once from the
    object store and kept while the same ones come), and their Simulator."""

    def __init__(self):
        self.held, self.sim, self.cache = {}, None, (None, {})

    def node(self) -> str:
        return node_id()

    def _get(self, slot: str, boxed: list):
        """The value of `boxed` (cluster.put), fetched on its first use in `slot` (the previous one goes first)."""
        key = boxed[0].hex()
        if self.held.get(slot, (None,))[0] != key:
            self.held.pop(slot, None)
            self.held[slot] = (key, fetched(boxed))
        return self.held[slot][1]

    def run(self, ctx: list, samples: list, reduce: list, part: Run, output) -> list:
        """`ctx`, `samples`, `reduce`: boxed (cluster.put) -> what reduce makes of each variant's output."""
        key = (ctx[0].hex(), output)
        if self.sim is None or self.sim[0] != key:
            self.sim = None
            self.sim = (key, Simulator(self._get("ctx", ctx), output))
        samples, reduce = self._get("samples", samples), self._get("reduce", reduce)
        with blas_threads(1):  # (as quantize runs: blas.py)
            return self.sim[1].run_part(samples, part, reduce)

    def score(self, ctx: list, samples: list, exclude: dict, threads) -> tuple:
        """ctx.score(samples, exclude, threads) as the driver's context computes it -> (the output, the share
        of samples whose output size changed, the QuantizeOutput, [(layer, exception)] whose output-aware
        rounding failed in the build: QuantizeContext.on_error, told on the driver)."""
        base = self._get("score ctx", ctx)
        if self.cache[0] != ctx[0].hex():  # (the weights quantized by this worker's builds, kept for its next ones)
            self.cache = (ctx[0].hex(), dict(base.weight_cache))
        failed = []
        c = replace(base, **ctx_failed(base, failed, self.cache[1]))
        with blas_threads(1):
            y, q = c.score(self._get("score samples", samples), exclude, threads)
        return y, c.resized, q, failed

    def covariances(self, fused: list, samples: list, only: frozenset, threads: int) -> tuple:
        """rounding.layer_hessians of the layers `only` (`fused`, `samples`: boxed) -> (their covariances,
        the layers whose covariance failed: [(layer, exception)])."""
        failed = []
        with blas_threads(1):
            h = layer_hessians(self._get("fused", fused), self._get("covariance samples", samples), threads=threads,
                               on_error=lambda layer, e: failed.append((layer, e)), only=only)
        return h, failed

    def fit(self, ctx: list) -> tuple:
        """The weight-cache entries of the layers ctx.hessians holds (rounded by their output error in a build
        of the whole model, the other layers to nearest) -> (entries, [(layer, exception)] whose rounding failed)."""
        c = fetched(ctx)
        mine, failed = set(c.hessians), []
        c = replace(c, **ctx_failed(c, failed, dict(c.weight_cache)))
        with blas_threads(1):
            c.build()
        return {k: v for k, v in c.weight_cache.items() if _layer_of(k) in mine}, failed


def ctx_failed(ctx, failed: list, cache: dict) -> dict:
    """replace() arguments giving a copy of `ctx` the weight cache `cache`, and hessians of its own whose
    on_error notes (layer, exception) in `failed` and rounds that layer to nearest from then on, as the
    driver's (steps/rounding.py) does."""
    hessians = dict(ctx.hessians) if ctx.hessians else ctx.hessians

    def on_error(layer, e):
        failed.append((layer, e))
        if hessians:
            hessians.pop(layer, None)

    return dict(weight_cache=cache, hessians=hessians, on_error=on_error, experiments=None)


def _layer_of(key) -> str | None:
    """The layer a weight-cache key belongs to (qdq.layer_weights: (node, ...), or a pair-safe scale's
    ("pair-safe scale", weight, axis, node or None))."""
    return key[3] if key[0] == "pair-safe scale" else key[0]


@contextmanager
def on_cluster(address: str | None):
    """Experiments on the cluster at `address` (cluster.ray_cluster) for the length of the block."""
    with ray_cluster(address) as ray:
        yield Experiments(ray)


class Experiments:
    """QuantizeContext.experiments for a run of quantize on a Ray cluster (connected: cluster.ray_cluster)."""

    def __init__(self, ray):
        actor = ray.remote(num_cpus=1, max_restarts=RETRIES, max_task_retries=RETRIES)(ExperimentWorker)
        self.workers = [actor.remote() for _ in range(cpus())]
        self.nodes = set(gather([w.node.remote() for w in self.workers], WHAT))

    def run(self, sim: Simulator, samples, runs: list, reduce, progress=None) -> list:
        """Simulator.run's runs over the workers -> for each run, what `reduce` makes of each variant's output."""
        ctx = replace(sim.ctx, weight_cache=dict(sim.ctx.weight_cache), on_error=None, experiments=None)
        boxes = put(ctx), put(samples), put(reduce)
        parts = [(r, ks, p) for r, run in enumerate(runs) for ks, p in split(run, len(self.workers) * PARTS_PER_WORKER)]
        refs = {self.workers[k % len(self.workers)].run.remote(*boxes, part, sim.output): k
                for k, (_, _, part) in enumerate(parts)}
        out = [[None] * len(run.variants) for run in runs]
        pending = list(refs)
        while pending:
            done, pending = next_done(pending, self.nodes, WHAT)
            r, ks, part = parts[refs[done[0]]]
            for k, y in zip(ks, gather(done, WHAT, self.nodes)[0]):
                out[r][k] = y
            if progress:
                progress(float(len(ks)))
        return out

    def hessians(self, fused, samples, progress=None, on_error=None, skipped: dict | None = None) -> dict:
        """rounding.layer_hessians over the workers, each accumulating the covariances of its share of the
        layers (about equal in size) over all the samples, drawing every layer's sampled positions as one
        process does: the same covariances. Should any layer's fail, the pass runs here instead (its failure
        changes the draws after it), as one process runs it."""
        layers, too_big = rounding_layers(fused)
        size = {name: acc.m2.size for name, (_, acc, _) in layers.items()}
        shares = [frozenset(p) for p in fit_parts(size, list(layers), len(self.workers)) if p]
        if len(shares) < 2 or not len(samples):
            return layer_hessians(fused, samples, progress=progress, on_error=on_error, skipped=skipped)
        boxes = put(fused), put(samples)
        threads = min(os.cpu_count() or 1, 8)  # (the ONNX Runtime threads one process runs the fp32 graph on here)
        refs = [self.workers[k].covariances.remote(*boxes, share, threads) for k, share in enumerate(shares)]
        got = gather(refs, WHAT, self.nodes)
        if any(failed for _, failed in got):
            return layer_hessians(fused, samples, progress=progress, on_error=on_error, skipped=skipped)
        if skipped is not None:
            skipped.update(too_big)
        if progress:
            progress(float(len(samples)))
        merged = {k: v for h, _ in got for k, v in h.items()}
        return {name: merged[name] for name in layers if name in merged}  # (in one process's order)

    def scorer(self, ctx, samples) -> "Scorer":
        """ctx.score over the workers for models built from `ctx` (as it is now) on `samples`: the exclusion
        search's (exclude.py), the context and samples put in the object store once for all its models."""
        return Scorer(self, put(replace(ctx, weight_cache=dict(ctx.weight_cache), on_error=None, experiments=None)),
                      put(samples))

    def fit(self, ctx, layers: list) -> None:
        """Output-aware rounding of `layers` (steps/rounding.round_all) on the workers, in parts of about equal
        work, each a build of the model rounding its layers: every entry of ctx.weight_cache the driver's own
        build would make for them is put there, so that build finds them; a layer whose rounding failed is
        told to ctx.on_error, in the layers' order."""
        parts = [p for p in fit_parts(ctx.hessians, layers, len(self.workers)) if p]
        refs = [self.workers[k % len(self.workers)].fit.remote(put(replace(
            ctx, hessians={n: ctx.hessians[n] for n in part}, weight_cache=dict(ctx.weight_cache), on_error=None,
            experiments=None))) for k, part in enumerate(parts)]
        failed = {}
        for entries, bad in gather(refs, WHAT, self.nodes):
            for key in sorted(entries, key=repr):
                ctx.weight_cache[key] = entries[key]
            failed.update(bad)
        for layer in layers:
            if layer in failed and ctx.on_error is not None:
                ctx.on_error(layer, failed[layer])


class Scorer:
    def __init__(self, experiments: Experiments, ctx: list, samples: list):
        self.experiments, self.ctx, self.samples = experiments, ctx, samples

    def score_all(self, excludes: list, threads) -> list:
        """[(output, share of samples resized, QuantizeOutput, [(layer, exception)])] of each exclusion, in order."""
        workers = self.experiments.workers
        refs = [workers[k % len(workers)].score.remote(self.ctx, self.samples, e, threads) for k, e in enumerate(excludes)]
        return gather(refs, WHAT, self.experiments.nodes)


def fit_parts(size: dict, layers: list, n: int) -> list:
    """`layers` in n parts of about equal work (`size`: layer -> its covariance's size, or the covariance:
    the work of its accumulation and of its descent per channel), the largest first, each into the lightest
    part; each part in the layers' order."""
    order = {name: k for k, name in enumerate(layers)}
    work = {name: int(getattr(size[name], "size", size[name])) for name in layers}
    bins = [[] for _ in range(max(1, n))]
    load = [0] * len(bins)
    for name in sorted(layers, key=lambda x: (-work[x], order[x])):
        k = min(range(len(bins)), key=lambda b: (load[b], b))
        bins[k].append(name)
        load[k] += work[name]
    return [sorted(b, key=order.get) for b in bins]


def split(run: Run, n: int) -> list:
    """`run` in up to n parts of whole cuts, about even in variants, each with the run's prefix
    -> [(the indices of the run's variants it holds, the part as a Run)]."""
    cuts = sorted(set(run.cut_of))
    at = {c: [k for k, c2 in enumerate(run.cut_of) if c2 == c] for c in cuts}
    bins = [[] for _ in range(min(n, len(cuts)))]
    for c in sorted(cuts, key=lambda c: (-len(at[c]), c)):  # largest first, into the lightest part
        min(bins, key=lambda b: (sum(len(at[x]) for x in b), len(b))).append(c)
    parts = []
    for b in bins:
        ks = sorted(k for c in b for k in at[c])
        parts.append((ks, Run([run.variants[k] for k in ks], [run.cut_of[k] for k in ks], tuple(cuts))))
    return parts
