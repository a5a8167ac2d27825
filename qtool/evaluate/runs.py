"""Where eval runs its models over the batches: here, or over a Ray cluster (sharded.py), with the same
outputs, handed back in the batches' order. The figures are added up by the caller from those outputs in
that order, so they are the same bits wherever the models ran.

A batch comes as (names, feeds, whether the exact-arithmetic check takes it: ExactCheck.wants, asked in
order as the batch is handed out) and goes back as (names, feeds, Outputs)."""
from __future__ import annotations

from dataclasses import dataclass

from qtool.evaluate.exact import exact_output


@dataclass
class Outputs:
    """One batch through the engines: every output of each ONNX Runtime model, the native runtime's first
    output (--runtime native/both), the exact arithmetic's (exact.exact_output) where the check takes it."""
    fp32: list
    int8: list
    native: object = None
    exact: object = None


@dataclass(frozen=True)
class Engines:
    """What a batch runs through, as one process makes it: the models (paths every worker sees), ONNX
    Runtime's threads per session, its arena (False: memory back after each run), the outputs asked, whether
    the native runtime runs (--runtime native/both), whether the int8 model runs first (the tensors path,
    which times each run)."""
    fp32_path: str
    int8_path: str
    threads: int
    arena: bool
    names: tuple
    native: bool = False
    int8_first: bool = False


class Here:
    """The engines in this process: the sessions the caller made (`times`: timing.RunTimes, each ONNX
    Runtime run timed)."""

    def __init__(self, engines: Engines, sf, sq, native=None, exact_session=None, times=None):
        self.engines, self.sf, self.sq, self.native, self.exact_session = engines, sf, sq, native, exact_session
        self.times = times

    def run(self, feeds: dict, exact: bool) -> Outputs:
        return run_batch(self.engines, (self.sf, self.sq, self.native, self.exact_session), feeds, exact, self.times)

    def outputs(self, batches):
        """(names, feeds, want exact) -> (names, feeds, Outputs), in order."""
        for names, feeds, exact in batches:
            yield names, feeds, self.run(feeds, exact)


def run_batch(engines: Engines, sessions: tuple, feeds: dict, exact: bool, times=None) -> Outputs:
    """`sessions`: (fp32, int8, native or None, the exact check's native session or None)."""
    sf, sq, native, exact_session = sessions
    names = list(engines.names)
    run = (lambda key, s: times.run(key, s, names, feeds)) if times is not None else (lambda key, s: s.run(names, feeds))
    if engines.int8_first:
        outs_q = run("ort_int8", sq)
        outs_f = run("ort_fp32", sf)
    else:
        outs_f, outs_q = run("ort_fp32", sf), run("ort_int8", sq)
    out = Outputs(outs_f, outs_q)
    if exact and exact_session is not None:
        out.exact = exact_output(exact_session, feeds)
    if native is not None:
        out.native = native.run([names[0]], feeds)[0]
    return out
