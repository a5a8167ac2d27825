"""qtool eval: compare the int8 model with its fp32 original."""
from __future__ import annotations

import os

import click

from qtool.data.images import list_images
from qtool.data.tensors import classify_folder, list_tensor_files
from qtool.commands.common import common_options, say, setup_output, write_json
from qtool.errors import QtoolError
from qtool.evaluate import check_warning, evaluate, evaluate_tensors
from qtool.workdir import Workdir


@click.command("eval")
@click.option("--compare", type=click.Choice(["fp32"]), default="fp32", show_default=True, help="What to compare against.")
@click.option("--data", "-d", type=click.Path(), help="Evaluation images (default: the calibration folder).")
@click.option("--labels", type=click.Path(dir_okay=False), help="Class names one per line in class-index order; an "
              "image's class is the entry its file name starts with before '_'. Without it, class folders are used.")
@click.option("--model", "-m", type=click.Path(dir_okay=False), help="fp32 model (default: the calibrated one).")
@click.option("--int8", "int8_path", type=click.Path(dir_okay=False), help="int8 model (default: the quantized one).")
@click.option("--config", "-c", default=None, help="Preprocessing (default: calibrate's).")
@click.option("--limit", type=int, default=None, help="Use at most this many images.")
@click.option("--runtime", type=click.Choice(["ort", "native", "both"]), default="ort", show_default=True,
              help="Run the int8 model on ONNX Runtime, qtool's native kernels, or both.")
@click.option("--threads", default=2, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write all figures as JSON here.")
@common_options
def command(compare, data, labels, model, int8_path, config, limit, runtime, threads, json_path, workdir, quiet,
            verbose, debug):
    """Accuracy, top-1 agreement, output SQNR, size and latency of int8 vs fp32.

    \b
    Example:
      qtool eval --compare fp32
      qtool eval --data ../shared/imagenet-samples --labels ../shared/imagenet-samples/synsets.txt --json eval.json
    """
    setup_output(quiet, verbose)
    wd = Workdir(workdir)
    m = wd.manifest()
    cal = m.get("calibrate", {})
    if model is None or config is None or data is None:
        cal = cal or wd.require("calibrate", "calibrate")
    if int8_path is None:
        int8_path = wd.require("quantize", "quantize")["int8_path"]
    model = model or cal["model_path"]
    data = data or cal["data"]
    cfg = config if config is not None else cal.get("config")
    if runtime != "ort":
        try:
            import qtool.runtime  # noqa: F401
        except ImportError as e:
            raise QtoolError(f"--runtime {runtime}: the native runtime is not available ({e})") from None
    if not isinstance(data, str) or data == "(python iterable)":
        raise QtoolError("calibration data was a Python iterable; pass --data with a folder to evaluate on")
    kind = classify_folder(data)
    if kind != "images":
        _eval_tensors(model, int8_path, data, kind, cal, limit, threads, json_path, wd, quiet)
        return
    files = list_images(data)
    calib = set(cal.get("files", [])) if os.path.abspath(data) == cal.get("data") else set()
    if calib:
        # never score on the images the ranges were fitted to
        held_out = [f for f in files if os.path.abspath(f) not in calib]
        if held_out:
            files = held_out
            say(quiet, f"evaluating on {len(files)} images of {data} (the {len(calib)} calibration images excluded)")
        else:
            say(quiet, f"note: every image in {data} was used for calibration; evaluating on them "
                       f"(pass --data with held-out images for an unbiased figure)")
    r = evaluate(model, int8_path, data, cfg, labels, limit, files=files, threads=threads, show_progress=not quiet,
                 runtime=runtime)
    say(quiet, render(r))
    _warn_runtime(r)
    write_json(json_path, r)
    wd.update(eval={k: r[k] for k in ("n_images", "top1_agreement", "output_sqnr_db") if k in r}
              | ({"top1_delta_pt": r["top1_delta_pt"]} if "top1_delta_pt" in r else {}))


def _eval_tensors(model, int8_path, data, kind, cal, limit, threads, json_path, wd, quiet):
    """No labels, no preprocessing: every output of int8 vs fp32 on .npy/.npz samples."""
    files = list_tensor_files(data, "." + kind)
    calib = set(cal.get("files", [])) if os.path.abspath(data) == cal.get("data") else set()
    held_out = [f for f in files if os.path.abspath(f) not in calib]
    if calib and held_out:
        files = held_out
        say(quiet, f"evaluating on {len(files)} samples of {data} (the {len(calib)} calibration samples excluded)")
    elif calib:
        say(quiet, f"note: every sample in {data} was used for calibration; evaluating on them "
                   f"(pass --data with held-out samples for an unbiased figure)")
    r = evaluate_tensors(model, int8_path, data, limit, files=files, threads=threads)
    say(quiet, render_outputs(r))
    _warn_runtime(r)
    write_json(json_path, r)
    wd.update(eval={"n_samples": r["n_samples"], "output_sqnr_db": r["output_sqnr_db"],
                    "outputs": {k: v["sqnr_db"] for k, v in r["outputs"].items()}})


def _warn_runtime(r: dict) -> None:
    """Said even with -q: the numbers above are not what the model computes elsewhere."""
    line = check_warning(r.get("runtime_check"))
    if line:
        click.echo(line, err=True)


def render_outputs(r: dict) -> str:
    """One line per output: SQNR, max abs error, and agreement where the output's shape says what it is."""
    lines = [f"{r['n_samples']} samples; per output, int8 vs fp32:"]
    for name, o in r.get("outputs", {}).items():
        text = f"  {name} {o['shape']}: SQNR {o['sqnr_db']:.1f} dB, max |error| {o['max_abs_error']:.4g}"
        if "top1_agreement" in o:
            text += f", top-1 agreement {o['top1_agreement']:.4f}"
        if "top_rows_agreement" in o:
            text += ", top-scoring rows shared: " + ", ".join(
                f"{k} {v:.2f}" for k, v in o["top_rows_agreement"].items())
            text += f" (max |error| in the top 10 rows {o['top10_rows_max_abs_error']:.4g})"
        lines.append(text)
    sb = r["size_bytes"]
    lines.append(f"model size {sb['fp32'] / 1e6:.2f} MB fp32 -> {sb['int8'] / 1e6:.2f} MB int8 "
                 f"({100 * r['size_ratio']:.1f}%)")
    lat = r.get("latency_ms")
    if lat:
        lines.append(f"ORT latency (ms, b=1): fp32 {lat['ort_fp32']:.2f}, int8 {lat['ort_int8']:.2f} "
                     f"({lat['ort_fp32'] / lat['ort_int8']:.2f}x)")
    return "\n".join(lines)


def render(r: dict) -> str:
    lines = [f"{'':22}{'fp32':>12}{'int8':>12}{'delta':>10}"]
    if "fp32" in r:
        for k in ("top1", "top5"):
            lines.append(f"{k + ' accuracy':22}{r['fp32'][k]:>12.4f}{r['int8'][k]:>12.4f}"
                         f"{100 * (r['int8'][k] - r['fp32'][k]):>+9.2f}pt")
    sb = r["size_bytes"]
    lines.append(f"{'model size (MB)':22}{sb['fp32'] / 1e6:>12.2f}{sb['int8'] / 1e6:>12.2f}{100 * r['size_ratio']:>9.1f}%")
    lat = r.get("latency_ms")
    if lat:
        lines.append(f"{'ORT latency (ms, b=1)':22}{lat['ort_fp32']:>12.2f}{lat['ort_int8']:>12.2f}"
                     f"{lat['ort_fp32'] / lat['ort_int8']:>9.2f}x")
        if "native_int8" in lat:
            lines.append(f"{'native int8 (ms, b=1)':22}{'':>12}{lat['native_int8']:>12.2f}"
                         f"{lat['ort_int8'] / lat['native_int8']:>9.2f}x vs ORT int8")
    lines.append(f"top-1 agreement {r['top1_agreement']:.4f} over {r['n_images']} images"
                 + (f" ({len(r['skipped'])} unreadable skipped)" if r["skipped"] else ""))
    lines.append(f"output SQNR {r['output_sqnr_db']:.1f} dB, max |error| {r['max_abs_error']:.4g}")
    if len(r.get("outputs", {})) > 1:
        lines += render_outputs(r).splitlines()[1:-2 if r.get("latency_ms") else -1]
    if "native" in r:
        n = r["native"]
        lines.append(f"native runtime: agreement with ORT int8 {n['top1_agreement_vs_ort_int8']:.4f}, "
                     f"with fp32 {n['top1_agreement_vs_fp32']:.4f}")
    return "\n".join(lines)
