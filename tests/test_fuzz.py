"""Fuzz: FUZZ_CASES mutated models (tests/fuzz_models.py) through inspect, calibrate, quantize and the native
runtime. Every case must end in success or a one-line QtoolError: a traceback (any other exception), a
hang (over CASE_SECONDS) or a crash (the worker process dies) fails the test, which prints the seed and
the cases to replay (`python tests/fuzz_models.py SEED CASE`).

The cases run in-process in WORKERS worker processes, each under a 2 GB address-space limit (a model
that makes qtool allocate without bound fails its case, not the machine). QTOOL_FUZZ_SEED picks another
seed (default fixed, so CI is repeatable); QTOOL_FUZZ_CASES another number of cases.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
from multiprocessing.connection import wait


SEED = int(os.environ.get("QTOOL_FUZZ_SEED", "12"))
FUZZ_CASES = int(os.environ.get("QTOOL_FUZZ_CASES", "300"))
WORKERS = 2
CASE_SECONDS = 60.0
LIMIT = 2 << 30


def _worker(conn, seed, root):
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))
    devnull = os.open(os.devnull, os.O_WRONLY)  # ORT and tqdm chatter
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fuzz_models import run_case
    import qtool.calibrate.run, qtool.quantize.run, qtool.runtime  # noqa: F401,E401  (imported once)
    conn.send(("ready", None))
    while True:
        case = conn.recv()
        if case is None:
            return
        conn.send(("done", run_case(seed, case, root)))


class _Slot:
    def __init__(self, ctx, seed, root):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, seed, root), daemon=True)
        self.proc.start()
        child.close()
        self.case, self.started, self.ready = None, None, False

    def give(self, case):
        self.case, self.started = case, time.time()
        self.conn.send(case)

    def stop(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


def run_fuzz(seed: int, cases: list, workers: int = WORKERS) -> tuple[dict, list]:
    """-> ({case: result dict}, [failure lines])"""
    ctx = mp.get_context("forkserver")
    results, failures = {}, []
    todo = list(cases)
    with tempfile.TemporaryDirectory(prefix="qtool-fuzz-") as root:
        slots = [_Slot(ctx, seed, root) for _ in range(min(workers, len(todo)))]
        try:
            while todo or any(s.case is not None for s in slots):
                for s in slots:
                    if s.ready and s.case is None and todo:
                        s.give(todo.pop(0))
                ready = wait([s.conn for s in slots], timeout=0.5)
                for s in list(slots):
                    if s.conn in ready:
                        try:
                            kind, r = s.conn.recv()
                        except EOFError:  # died: a crash
                            if s.case is None:
                                raise RuntimeError(f"a fuzz worker died before taking a case (exit code "
                                                   f"{s.proc.exitcode})") from None
                            failures.append(f"case {s.case}: CRASH (worker exit code {s.proc.exitcode})")
                            results[s.case] = {"case": s.case, "failure": "crash"}
                            s.stop()
                            slots[slots.index(s)] = _Slot(ctx, seed, root)
                            continue
                        if kind == "ready":
                            s.ready = True
                        else:
                            results[s.case] = r
                            if r["failure"]:
                                failures.append(f"case {s.case} ({'; '.join(r['mutations'])}):\n{r['failure']}")
                            s.case = None
                    elif s.case is not None and time.time() - s.started > CASE_SECONDS:
                        failures.append(f"case {s.case}: HANG (over {CASE_SECONDS:.0f} s)")
                        results[s.case] = {"case": s.case, "failure": "hang"}
                        s.stop()
                        slots[slots.index(s)] = _Slot(ctx, seed, root)
        finally:
            for s in slots:
                try:
                    s.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
                s.proc.join(timeout=5)
                s.stop()
    return results, failures


def test_mutated_models_end_in_success_or_one_line_error():
    t0 = time.time()
    results, failures = run_fuzz(SEED, list(range(FUZZ_CASES)))
    outcome = {"ok": 0, "error": 0}
    for r in results.values():
        if not r.get("failure"):
            outcome["ok" if all(v == "ok" for v in r["steps"].values()) else "error"] += 1
    print(f"fuzz seed {SEED}: {len(results)} cases in {time.time() - t0:.0f}s: {outcome['ok']} ran every step, "
          f"{outcome['error']} stopped with a one-line error, {len(failures)} failed")
    assert len(results) == FUZZ_CASES
    assert not failures, (f"fuzz seed {SEED} (replay: python tests/fuzz_models.py {SEED} CASE):\n"
                          + "\n\n".join(failures[:10]))
    # the mutations must leave enough models that go all the way, or the later steps are barely fuzzed
    assert outcome["ok"] >= FUZZ_CASES // 10, outcome
