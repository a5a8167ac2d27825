"""`qtool eval` on a working directory: every path not given taken from it, checked against what it
records, the calibration samples held out, the headline figures recorded in its manifest."""
from __future__ import annotations

import os
from dataclasses import replace

from qtool.data.images import list_images
from qtool.evaluate.images import evaluate
from qtool.evaluate.options import EvalOptions
from qtool.evaluate.tensors import evaluate_tensors


def evaluate_workdir(workdir: str | None = None, data=None, model: str | None = None, int8_path: str | None = None,
                     options: EvalOptions = EvalOptions(), show_progress: bool = True, say=print,
                     also_writes=()) -> dict:
    """`qtool eval`: the int8 model against its fp32 original, every path not given taken from the
    working directory (the calibrated model and its data and preprocessing, the quantized model).
    `data`: a folder of images or of .npy/.npz files, or an iterable of input dicts (or of arrays, for
    a one-input model). Images and tensors the ranges were fitted to are left out when `data` is the
    calibration folder. Records the headline figures in the manifest. Paths taken from the working
    directory are checked against the sha256 recorded for them, and the int8 model against the fp32
    model it records it came from. What it writes (the manifest, and `also_writes`: outputs.File, as the
    command's --json) is checked against what it reads, and writable, before the evaluation; should the
    manifest fail to be written anyway, the LateWriteError raised carries the figures."""
    from qtool.workdir import Workdir

    wd = Workdir(workdir)
    with wd.lock():  # no other run rewrites the working directory while this one reads it
        model, int8_path, data, options = _inputs(wd, data, model, int8_path, options, also_writes)
        return _evaluate(wd, data, model, int8_path, options, show_progress, say)


def _inputs(wd, data, model, int8_path, options: EvalOptions, also_writes) -> tuple:
    """(fp32 model, int8 model, data, options with calibrate's preprocessing), each taken from the working
    directory where not given and checked there; what will be written checked writable."""
    from qtool import outputs
    from qtool.errors import QtoolError
    from qtool.modelio import model_hash
    from qtool.workdir import MANIFEST

    cal = wd.manifest().get("calibrate", {})
    if model is None or options.config is None or data is None:
        cal = wd.require("calibrate", "calibrate")
    if int8_path is None:  # the int8 model recorded here: still the file quantize wrote, from this calibration
        q = wd.require("quantize", "quantize")
        int8_path = q["int8_path"]
        wd.verify(int8_path, q["int8_sha256"], "quantize", "int8 model")
        if model is None and q["model_sha256"] != cal["model_sha256"]:
            raise QtoolError(f"{int8_path}: quantized from another calibration than the one in {wd.path}; run "
                             f"`qtool quantize` again")
    if model is None and model_hash(cal["model_path"]) != cal["model_sha256"]:
        raise QtoolError(f"{cal['model_path']}: the model changed since `qtool calibrate` recorded it; run "
                         f"`qtool calibrate` again")
    model = model or cal["model_path"]
    data = cal["data"] if data is None else data
    outputs.check(writes=list(also_writes) + [outputs.File("manifest", wd.file(MANIFEST))],
                  reads=outputs.model("fp32 model", model) + outputs.model("int8 model", int8_path)
                  + outputs.data("data folder", data) + [outputs.File("labels file", options.labels)]
                  + outputs.config("--config file", options.config) + outputs.recorded(wd.manifest()))
    if options.runtime != "ort":
        try:
            import qtool.runtime  # noqa: F401
        except ImportError as e:
            raise QtoolError(f"--runtime {options.runtime}: the native runtime is not available ({e})") from None
    if options.config is None:
        options = replace(options, config=cal.get("config"))
    return model, int8_path, data, options


def _evaluate(wd, data, model: str, int8_path: str, options: EvalOptions, show_progress: bool, say) -> dict:
    from qtool.data.tensors import classify_folder, list_tensor_files
    from qtool.errors import QtoolError

    if not isinstance(data, (str, os.PathLike)):
        r = evaluate_tensors(model, int8_path, data, options)
        return _record(wd, r, {"n_samples": r["n_samples"], "output_sqnr_db": r["output_sqnr_db"]})
    data = os.fspath(data)
    if data == "(python iterable)":
        raise QtoolError("calibration data was a Python iterable; pass data (a folder or an iterable) to evaluate on")
    kind = classify_folder(data)
    images = kind == "images"
    files = list_images(data) if images else list_tensor_files(data, "." + kind)
    files = _held_out(wd, data, files, "images" if images else "samples", options.limit, say)
    if not images:
        r = evaluate_tensors(model, int8_path, data, options, files=files)
        return _record(wd, r, {"n_samples": r["n_samples"], "output_sqnr_db": r["output_sqnr_db"],
                               "outputs": {k: v.get("sqnr_db") for k, v in r["outputs"].items()}})  # (a ZipMap has none)
    r = evaluate(model, int8_path, data, options, files=files, show_progress=show_progress)
    return _record(wd, r, {k: r[k] for k in ("n_images", "top1_agreement", "output_sqnr_db") if k in r}
                   | ({"top1_delta_pt": r["top1_delta_pt"]} if "top1_delta_pt" in r else {}))


def _held_out(wd, data: str, files: list, what: str, limit: int | None, say) -> list:
    """`files` without the calibration samples, when `data` is the calibration folder: never score on the
    samples the ranges were fitted to (all of them, said so, when nothing else is left)."""
    cal = wd.manifest().get("calibrate", {})
    calib = set(cal.get("files", [])) if os.path.abspath(data) == cal.get("data") else set()
    if not calib:
        return files
    held_out = [f for f in files if os.path.abspath(f) not in calib]
    if held_out:
        say(f"evaluating on {_count(len(held_out), limit, what)} of {data} (the {len(calib)} calibration {what} "
            f"excluded)")
        return held_out
    say(f"note: every {what[:-1]} in {data} was used for calibration; evaluating on them (pass --data with "
        f"held-out {what} for an unbiased figure)")
    return files


def _record(wd, r: dict, entry: dict) -> dict:
    """The headline figures into the manifest; a failure there is a LateWriteError carrying `r`."""
    from qtool.errors import LateWriteError, QtoolError
    try:
        wd.update(eval=entry)
    except QtoolError as e:
        raise LateWriteError(str(e), r) from None
    return r


def _count(n: int, limit: int | None, what: str) -> str:
    """'900 images', or with a limit of 200 '200 of the 900 images'."""
    return f"{limit} of the {n} {what}" if limit is not None and 0 <= limit < n else f"{n} {what}"
