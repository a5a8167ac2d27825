"""qtool from Python: the three steps as functions, for a training script or a notebook.

    from qtool.api import calibrate, quantize, evaluate

    calibrate("model.onnx", data=calib_batches, workdir="work")   # arrays [N, C, H, W] float32, or a folder
    q = quantize(workdir="work")                                   # q.path: the int8 model
    r = evaluate(workdir="work", data=val_batches)                 # r["output_sqnr_db"], r["top1_agreement"]

Each function does what the command of the same name does, with the same defaults (range
method minmax, portable target, sensitivity report on 64 calibration images), and joins the
next one through the working directory. `data` is a folder (images, .npy or .npz files) or any
iterable: of arrays for a one-input model (one sample [C, H, W] or a batch [N, C, H, W] each),
or of {input name: array} dicts. Arrays must be float32 (float inputs) and already preprocessed;
images in a folder are preprocessed by `config` (a preset name or TOML path; None: the model's
metadata, else the torchvision ImageNet preset, said in one line). Errors are qtool.errors.QtoolError.

Samples from an iterable are not kept: quantize's steps that re-read calibration samples
(sensitivity, output-aware rounding, range tuning, --exclude-sensitive) need a folder, and say so.
"""
from __future__ import annotations

from qtool.calibrate.methods import DEFAULT_METHOD
from qtool.calibrate.run import CalibrateResult
from qtool.calibrate.run import calibrate as _calibrate
from qtool.evaluate import EvalOptions, evaluate_workdir
from qtool.quantize.encoding import DEFAULT_TARGET
from qtool.quantize.run import QuantizeResult, SensitivityOptions
from qtool.quantize.run import quantize as _quantize
from qtool.workdir import DEFAULT as DEFAULT_WORKDIR

__all__ = ["calibrate", "quantize", "evaluate", "CalibrateResult", "QuantizeResult", "EvalOptions"]


def _say(verbose: bool):
    return print if verbose else (lambda text: None)


def calibrate(model: str, data, config=None, *, method: str = DEFAULT_METHOD, workdir: str = DEFAULT_WORKDIR,
              limit: int | None = None, every: int = 1, batch: int = 4, threads: int = 0,
              verbose: bool = True) -> CalibrateResult:
    """Fuse the fp32 `model` (a path) and record activation ranges over `data`; writes fused.onnx and
    calibration.json to `workdir`. `method`: the default range method (every method's ranges are
    kept; `auto`, the default, lets quantize choose by measurement). `verbose`: progress bar and the lines the command prints (what preprocessing was assumed)."""
    return _calibrate(model, data, config, method, workdir, batch, limit, show_progress=verbose, threads=threads,
                      every=every, say=_say(verbose))


def quantize(workdir: str = DEFAULT_WORKDIR, *, output: str | None = None, method: str | None = None,
             exclude=(), exclude_sensitive: bool = False, target_agreement: float = 0.995,
             max_drop: float | None = None, max_excluded: int = 5, labels: str | None = None,
             sensitivity: bool = True, sensitivity_samples: int | None = None, bias_correction: bool = True,
             rounding: str | None = None, tune_ranges: bool | None = None, target: str = DEFAULT_TARGET,
             model: str | None = None, table: str | None = None, verbose: bool = True,
             strict: bool = False, verify: bool = False) -> QuantizeResult:
    """Write the INT8 QDQ model (`output`, default WORKDIR/model.int8.onnx) from the calibration in
    `workdir`. `method`: None keeps calibrate's, or minmax/percentile/entropy/mse/auto. `exclude`:
    node names to keep fp32. `rounding`: "output" (None: the default) or "nearest". `strict`: an
    optional step that fails raises instead of falling back with a warning. `verify`: hold about a
    third of the calibration samples out of the fitting steps and keep each step that changes the model
    only where it measures better on them (off by default; report["verified"] holds the verdicts).
    The result has .path, .report (what quantize.json holds), .sensitivity and .exclusion."""
    ex = {n: "excluded by the user (--exclude)" for n in exclude}
    opts = SensitivityOptions(sensitivity or exclude_sensitive, sensitivity_samples, exclude_sensitive,
                              target_agreement, max_drop, max_excluded, labels, show_progress=verbose)
    return _quantize(workdir, model, table, output, method, ex, bias_correction, opts, say=_say(verbose),
                     rounding=None if rounding is None else rounding == "output", tune_ranges=tune_ranges,
                     target=target, strict=strict, verify=verify)


def evaluate(workdir: str = DEFAULT_WORKDIR, data=None, *, model: str | None = None, int8: str | None = None,
             options: EvalOptions = EvalOptions(), verbose: bool = True) -> dict:
    """The int8 model against its fp32 original on `data` (default: the calibration folder, without
    the calibration images). `options`: EvalOptions(labels=, config=, limit=, threads=, runtime=), the
    command's options. Returns every figure `qtool eval --json` writes: output_sqnr_db, top1_agreement
    (classifiers), fp32/int8 top-1 and top-5 with labels, size_bytes, latency_ms."""
    return evaluate_workdir(workdir, data, model, int8, options, show_progress=verbose, say=_say(verbose))
