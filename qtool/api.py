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

from dataclasses import replace

from qtool.calibrate.options import CalibrateOptions, Sampling
from qtool.calibrate.run import CalibrateResult
from qtool.calibrate.run import calibrate as _calibrate
from qtool.evaluate import EvalOptions, evaluate_workdir
from qtool.quantize.options import ExclusionOptions, QuantizeOptions, SensitivityOptions
from qtool.quantize.run import QuantizeResult
from qtool.quantize.run import quantize as _quantize
from qtool.workdir import DEFAULT as DEFAULT_WORKDIR

__all__ = ["calibrate", "quantize", "evaluate", "CalibrateResult", "QuantizeResult", "Sampling", "QuantizeOptions",
           "SensitivityOptions", "ExclusionOptions", "EvalOptions"]


def _say(verbose: bool):
    return print if verbose else (lambda text: None)


def calibrate(model: str, data, config=None, *, method: str = CalibrateOptions.method,
              workdir: str = DEFAULT_WORKDIR, threads: int = CalibrateOptions.threads,
              sampling: Sampling = Sampling(), verbose: bool = True) -> CalibrateResult:
    """Fuse the fp32 `model` (a path) and record activation ranges over `data`; writes fused.onnx and
    calibration.json to `workdir`. `method`: the default range method (every method's ranges are
    kept; `auto`, the default, lets quantize choose by measurement). `sampling`: batch, limit, every,
    budget_gmac as the command's options (qtool.calibrate.options.Sampling). `verbose`: progress bar and
    the lines the command prints (what preprocessing was assumed)."""
    options = CalibrateOptions(config, method, threads, sampling, show_progress=verbose)
    return _calibrate(model, data, options, workdir, say=_say(verbose))


def quantize(workdir: str = DEFAULT_WORKDIR, options: QuantizeOptions | None = None, *,
             verbose: bool = True) -> QuantizeResult:
    """Write the INT8 QDQ model (options.output, default WORKDIR/model.int8.onnx) from the calibration in
    `workdir`, as `options` ask (None: the command's defaults: calibrate's method, portable target,
    output-aware rounding, sensitivity report). For example
    `QuantizeOptions(method="auto", exclude=["/fc/Gemm"], exclusion=ExclusionOptions(enabled=True))`;
    `strict=True`: an optional step that fails raises instead of falling back with a warning;
    `verify=True`: hold about a third of the calibration samples out of the fitting steps and keep each
    step that changes the model only where it measures better on them (report["verified"] holds the
    verdicts). `verbose`: progress bars and the lines the command prints.
    The result has .path, .report (what quantize.json holds), .sensitivity and .exclusion."""
    options = QuantizeOptions() if options is None else options
    if not verbose:
        options = replace(options, progress=False)
    return _quantize(workdir, options, say=_say(verbose))


def evaluate(workdir: str = DEFAULT_WORKDIR, data=None, *, model: str | None = None, int8: str | None = None,
             options: EvalOptions = EvalOptions(), verbose: bool = True) -> dict:
    """The int8 model against its fp32 original on `data` (default: the calibration folder, without
    the calibration images). `options`: EvalOptions(labels=, config=, limit=, threads=, runtime=, ray=), the
    command's options. Returns every figure `qtool eval --json` writes: output_sqnr_db, top1_agreement
    (classifiers), fp32/int8 top-1 and top-5 with labels, size_bytes, latency_ms."""
    return evaluate_workdir(workdir, data, model, int8, options, show_progress=verbose, say=_say(verbose))
