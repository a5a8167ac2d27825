"""The exact-arithmetic check: does this machine's ONNX Runtime compute, in int8, what the QDQ model defines?
ORT's int8 output is compared with qtool's runtime (exact int32 sums) on the first samples of the evaluation."""
from __future__ import annotations

import numpy as np

from qtool.arithmetic import ORT_X86_NOVNNI
from qtool.graph import total_macs
from qtool.metrics import agreement_kind
from qtool.modelio import provenance


CHECK_SAMPLES = 32  # samples on which ORT's int8 output is compared with the exact int8 arithmetic
CHECK_MIN_DB = 50.0  # below this SQNR between ORT int8 and exact int8, ORT's arithmetic differs (not float noise)
# ... where every compute op is int8. Where some run in float (layers kept fp32), float rounding decides
# which side of a quantization step a value lands on downstream, and the two legitimately differ:
# EfficientNet-Lite0 with 5 layers fp32, 31.7 dB (ORT's own float and int8 paths differ by 29-30 dB
# on any Lite0 model), where saturating int16 pairs cost 9-14 dB (arithmetic.py)
CHECK_MIN_DB_WITH_FLOAT_OPS = 20.0
# The check stops taking samples once the ones it took hold this many multiply-accumulates (it always takes
# one batch): counted, not timed, so that the same files give the same eval.json whatever the machine's load
# (a 20 s clock checked CRAFT, 437 GMAC a page, on 2 or 3 pages as the load went). Where the model's work
# cannot be counted (shapes ONNX cannot infer), CHECK_SAMPLES_UNCOUNTED samples at most.
CHECK_GMACS = 600.0
CHECK_SAMPLES_UNCOUNTED = 8


class ExactCheck:
    """ORT's int8 output against the exact int8 arithmetic (qtool's runtime) on the first samples:
    does the int8 path of this machine's ONNX Runtime compute what the QDQ model defines?"""

    def __init__(self, int8_path: str, threads: int, n: int = CHECK_SAMPLES, native=None):
        """`native`: a NativeSession of the model already made (exact arithmetic) to reuse."""
        self.n, self.rows, self.error = n, {"ort": [], "exact": []}, ""
        self.target = provenance(int8_path).get("target")
        self.session = native
        self.float_ops, self.samples, self.gmacs = 0, 0, 0.0
        self.int8_path, self._model, self._macs = int8_path, None, {}  # input shapes -> MACs (None: uncounted)
        if native is None:
            try:
                from qtool.runtime import NativeSession
                self.session = NativeSession(int8_path, threads=threads)  # exact int32 sums
            except Exception as e:  # a model the runtime cannot load: say so, do not fail eval
                self._give_up(e)
        if self.session is not None:
            self.float_ops = sum(st.kernel.startswith("numpy") for st in self.session.program.steps)

    def _give_up(self, e: Exception) -> None:
        self.session, self.error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def add(self, feeds: dict, ort_out: list, samples: int | None = None) -> None:
        """A whole batch (a model may take its batch whole only) of `samples` samples (None: axis 0 of
        the feed), until n samples are in: its exact output computed here."""
        if self.wants(feeds, samples):
            self.take(exact_output(self.session, feeds), ort_out)

    def wants(self, feeds: dict, samples: int | None = None) -> bool:
        """Whether the check takes this batch, the next one in order, which is then counted as taken: asked
        once per batch in the batches' order, its exact output (exact_output: computed here, or by a worker
        holding the same model, evaluate/sharded.py) then given to `take` in that order."""
        if self.session is None or self.samples >= self.n or self._spent():
            return False
        # (axis 0 of the feed is not always samples: a tagger's [chars, 1] counted 49 for one sentence)
        self.samples += samples if samples is not None else len(next(iter(feeds.values()))) if feeds else 1
        macs = self._batch_macs(feeds)
        self.gmacs = float("nan") if macs is None or self.gmacs != self.gmacs else self.gmacs + macs / 1e9
        return True

    def take(self, exact, ort_out: list) -> None:
        """The exact output of a batch `wants` took (or the exception that stopped it) beside ORT's."""
        if self.session is None:  # (given up on an earlier batch)
            return
        if isinstance(exact, Exception):  # the runtime fails on this model: no check, eval goes on
            self._give_up(exact)
            return
        if np.shape(exact) != np.shape(ort_out[0]):  # (a runtime bug to report, not a reason to stop eval)
            self._give_up(ValueError(f"the native runtime wrote shape {list(np.shape(exact))} where ONNX Runtime "
                                     f"wrote {list(np.shape(ort_out[0]))}"))
            return
        # each batch kept in its own shape: samples of a model with free input sizes differ in length
        self.rows["exact"].append(np.asarray(exact, np.float64))
        self.rows["ort"].append(np.asarray(ort_out[0], np.float64))

    def _spent(self) -> bool:
        """Whether the samples taken hold the check's budget: CHECK_GMACS, or where the work is not counted
        (gmacs NaN), CHECK_SAMPLES_UNCOUNTED samples."""
        if self.gmacs != self.gmacs:
            return self.samples >= CHECK_SAMPLES_UNCOUNTED
        return self.gmacs >= CHECK_GMACS

    def _batch_macs(self, feeds: dict) -> int | None:
        """The int8 model's multiply-accumulates for this batch (its Conv, Gemm and MatMul nodes at the
        feed's shapes), counted once per set of shapes; None where they cannot be counted."""
        key = tuple(sorted((k, tuple(np.shape(v))) for k, v in feeds.items()))
        if key not in self._macs:
            try:
                if self._model is None:
                    import onnx
                    self._model = onnx.load(self.int8_path, load_external_data=False)
                self._macs[key] = total_macs(self._model, dict(key))
            except Exception:  # (shapes ONNX's inference cannot follow: the uncounted bound applies)
                self._macs[key] = None
        return self._macs[key]

    def result(self) -> dict:
        if self.session is None or not self.rows["ort"]:
            return {"checked": 0, "error": self.error or "no samples"}
        a = np.concatenate([x.ravel() for x in self.rows["exact"]])
        b = np.concatenate([x.ravel() for x in self.rows["ort"]])
        both = np.isfinite(a) & np.isfinite(b)
        if not both.all():  # (NaN where the model masks entries by design: compared where both are finite)
            a, b = a[both], b[both]
        from qtool.metrics import sqnr_db
        from qtool.ort_arithmetic import ort_int8_arithmetic
        db = sqnr_db(a, b) if a.size else float("inf")
        floor = CHECK_MIN_DB_WITH_FLOAT_OPS if self.float_ops else CHECK_MIN_DB
        r = {"checked": self.samples, "sqnr_ort_vs_exact_db": db,
             "max_abs_diff": float(np.abs(a - b).max()) if a.size else 0.0,
             "ort_int8_arithmetic": ort_int8_arithmetic(), "exact": bool(db >= floor), "target": self.target,
             "float_ops": self.float_ops, "min_sqnr_db": floor}
        if all(agreement_kind(x.shape) is not None for x in self.rows["ort"]):
            same = [x.reshape(-1, x.shape[-1]).argmax(1) == y.reshape(-1, y.shape[-1]).argmax(1)
                    for x, y in zip(self.rows["exact"], self.rows["ort"])]
            r["top1_agreement_ort_vs_exact"] = float(np.concatenate(same).mean())
        return r


def exact_output(session, feeds: dict):
    """The exact int8 arithmetic's first output for `feeds` (`session`: qtool's runtime on the int8 model),
    or the exception that stopped it."""
    try:
        return session.run(None, feeds)[0]
    except Exception as e:  # (ExactCheck.take gives the check up on it; eval goes on)
        return e


PAIR_EXACT = ("portable", "u8-weights", "7bit")  # targets exact under the x86-without-VNNI arithmetic


def check_warning(c: dict) -> str | None:
    """The one line `qtool eval` prints when ORT's int8 output is not the exact int8 result, or when that
    could not be checked (qtool's runtime cannot run the model: without the line, "not checked" read as
    "checked, exact")."""
    if c and not c.get("checked") and c.get("error") and c["error"] != "no samples":
        return (f"note: not checked whether ONNX Runtime's int8 output here is the exact int8 result: qtool's "
                f"runtime could not run the model ({c['error'][:200]})")
    if not c or c.get("exact", True) or not c.get("checked"):
        return None
    agree = f"top-1 agreement {c['top1_agreement_ort_vs_exact']:.4f}, " if "top1_agreement_ort_vs_exact" in c else ""
    head = (f"warning: on this CPU ONNX Runtime's int8 output is not the exact int8 result ({agree}SQNR "
            f"{c['sqnr_ort_vs_exact_db']:.1f} dB between the two on {c['checked']} samples)")
    if c.get("ort_int8_arithmetic") == ORT_X86_NOVNNI and c.get("target") not in PAIR_EXACT:
        return (f"{head}: its int8 path here adds weight pairs in a saturating int16 (no VNNI); the figures above "
                f"are what this CPU gives. Fix: `qtool quantize --target portable` (exact on every CPU), or run the "
                f"model on qtool's runtime")
    return (f"{head}, which neither this ONNX Runtime's known arithmetic ({c.get('ort_int8_arithmetic')}) nor the "
            f"model's target ({c.get('target') or 'not a qtool model'}) explains; the figures above are what this "
            f"CPU gives; qtool's runtime gives the exact result")
