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

from contextlib import contextmanager
from dataclasses import replace

from qtool.blas import blas_threads
from qtool.distributed.cluster import RETRIES, cpus, fetched, gather, next_done, node_id, put, ray_cluster
from qtool.quantize.simulate import Run, Simulator

PARTS_PER_WORKER = 2  # parts of a run per worker: the larger ones first, the small ones even out the end


class ExperimentWorker:
    """An actor: the context and samples of the experiments under way, and their Simulator, kept while
    the same ones come."""

    def __init__(self):
        self.key, self.sim, self.samples = None, None, None

    def node(self) -> str:
        return node_id()

    def run(self, ctx: list, samples: list, reduce: list, part: Run, output) -> list:
        """`ctx`, `samples`, `reduce`: boxed (cluster.put) -> what reduce makes of each variant's output."""
        key = (ctx[0].hex(), samples[0].hex(), reduce[0].hex(), output)
        if key != self.key:
            self.key, self.sim, self.samples = None, None, None  # (the previous ones go before the next come)
            self.samples, self.reduce = fetched(samples), fetched(reduce)
            self.sim = Simulator(fetched(ctx), output)
            self.key = key
        with blas_threads(1):  # (as quantize runs: blas.py)
            return self.sim.run_part(self.samples, part, self.reduce)


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
        self.nodes = set(gather([w.node.remote() for w in self.workers], "quantize's experiments"))

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
            done, pending = next_done(pending, self.nodes, "quantize's experiments")
            r, ks, part = parts[refs[done[0]]]
            for k, y in zip(ks, gather(done, "quantize's experiments", self.nodes)[0]):
                out[r][k] = y
            if progress:
                progress(float(len(ks)))
        return out


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
