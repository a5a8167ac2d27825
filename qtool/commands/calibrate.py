"""qtool calibrate: record activation ranges of an fp32 model over sample data."""
from __future__ import annotations

import click

from qtool.calibrate.methods import AUTO, METHODS
from qtool.calibrate.options import CalibrateOptions, Sampling
from qtool.calibrate.run import calibrate
from qtool.commands.common import common_options, ray_option, say, setup_output, shown, write_json
from qtool.limits import MAX_BATCH
from qtool.outputs import File


@click.command("calibrate", short_help="Record activation ranges of an fp32 model over sample data.")
@click.option("--model", "-m", required=True, type=click.Path(dir_okay=False), help="fp32 ONNX model.")
@click.option("--data", "-d", required=True, type=click.Path(), help="Folder of sample images, or of .npy files (one sample each, one-input models) or .npz files "
              "(one sample each, one array per model input, named by input); searched recursively, one kind per folder.")
@click.option("--config", "-c", default=None, help="Image preprocessing (not for tensors): a TOML file or a preset name "
              "(efficientnet-lite, imagenet-torchvision, caffe-bgr, tf-inception, ppocr-cls, ppocr-det, ppocr-rec, yolox), sized "
              "to the model's "
              "input. Default: the model's metadata (qtool.config) if it has one, else imagenet-torchvision for a "
              "3-channel input (grey pixels 0-255 for 1 channel); the choice is printed, and a warning says when the "
              "model's first BatchNormalization or its outputs suggest another.")
@click.option("--method", type=click.Choice(sorted(METHODS) + [AUTO]), default=CalibrateOptions.method, show_default=True,
              help="Range method for quantize: auto lets quantize pick the one whose int8 output is closest to fp32 "
                   "on calibration samples; every method's ranges are stored, `quantize --method` can switch.")
@click.option("--batch", default=Sampling.batch, show_default=True, type=click.IntRange(1, MAX_BATCH), help="Images per inference batch.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use at most this many images.")
@click.option("--every", type=click.IntRange(min=1), default=Sampling.every, show_default=True,
              help="Use every N-th image of the sorted folder (e.g. 10 for a 1-in-10 calibration split).")
@click.option("--budget-gmac", type=click.FloatRange(min=0), default=Sampling.budget_gmac, show_default=True,
              help="Compute budget of the calibration pass, in GMAC: a model too heavy for all the samples within "
                   "it (at least 16 are kept) uses fewer, spread evenly over the data, and says so. 0: no budget.")
@click.option("--threads", type=click.IntRange(0, 1024), default=CalibrateOptions.threads, help="ONNX Runtime threads (0 = all cores).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write a summary as JSON here.")
@ray_option
@common_options
def command(model, data, config, method, batch, limit, every, budget_gmac, threads, json_path, ray, workdir, quiet, verbose,
            debug):
    """Stream images or tensors through the fp32 model and record activation ranges.

    Folds BatchNorm and run-time shape arithmetic first, then keeps one fixed-size
    histogram per tensor to quantize (memory does not grow with the number of images),
    and writes the fused graph and calibration table to the working directory.

    \b
    Example:
      qtool calibrate --model resnet50.onnx --data calib_data/ --config imagenet-torchvision
      qtool calibrate --model yolox-det.onnx --data calib_npy/      (tensors, fed as they are)
    """
    setup_output(quiet, verbose)

    def show(r):
        t = r.table
        say(quiet, f"calibrated {t.n_samples} images in {r.seconds:.1f}s "
                   f"({len(t.skipped)} unreadable skipped); {len(t.histograms)} tensors observed")
        if r.fuse_counts:
            say(quiet, "graph cleanup: " + ", ".join(f"{k} x{v}" for k, v in sorted(r.fuse_counts.items())))
        if verbose:  # where the time went: the fixed cost before the first sample, and the pass
            say(quiet, "time: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.phases.items()))
            slow = sorted(((v, k) for k, v in r.fuse_seconds.items() if v >= 0.05), reverse=True)
            if slow:
                say(quiet, "  fuse: " + ", ".join(f"{k} {v:.2f} s" for v, k in slow))
        say(quiet, f"wrote {r.table_path} and {r.fused_path}")
        say(quiet, "next: qtool quantize" + (f" --workdir {workdir}" if workdir != "qtool_work" else ""))
        write_json(json_path, {"n_samples": t.n_samples, "skipped": t.skipped, "seconds": r.seconds,
                               "preprocessing": t.config, "preprocessing_notes": r.notes,
                               "preprocessing_warnings": r.warnings,
                               "tensors": len(t.histograms), "budget": r.budget, "method": t.method, "table": r.table_path,
                               "fused_model": r.fused_path, "graph_cleanup": r.fuse_counts,
                               "phases": r.phases, "fuse_seconds": r.fuse_seconds})

    options = CalibrateOptions(config, method, threads, Sampling(batch, limit, every, budget_gmac),
                               show_progress=not quiet, ray=ray)
    shown(lambda: calibrate(model, data, options, workdir, say=lambda t: say(quiet, t),
                            also_writes=[File("--json file", json_path)] if json_path else []),  # (checked first)
          show)
