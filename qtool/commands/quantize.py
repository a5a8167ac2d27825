"""qtool quantize: write the INT8 QDQ model from the calibration table."""
from __future__ import annotations

import click

from qtool.calibrate.table import FLAT
from qtool.calibrate.methods import AUTO, METHODS
from qtool.commands.common import common_options, ray_option, say, setup_output, shown, write_json
from qtool.outputs import File
from qtool.quantize.encoding import DEFAULT_TARGET, TARGETS
from qtool.quantize.options import ExclusionOptions, QuantizeOptions, SensitivityOptions
from qtool.tasks import NAMES, TASKS


LOW_SQNR_DB = 10.0  # output SQNR on calibration images below which the user is told to check the model


def far_from_fp32(report: dict, excluded_sensitive: bool) -> str | None:
    """One warning line where the int8 output measured on the calibration images is far from fp32's.
    Low SQNR alone does not make a model unusable (a detector's boxes can survive 5 dB of noise in its
    raw scores), so it asks for the judgement by meaning, and names the option that may help."""
    cost = report.get("target_cost")
    if not cost or cost["output_sqnr_db"] >= LOW_SQNR_DB:
        return None
    hint = ("" if excluded_sensitive else
            "; `qtool quantize --exclude-sensitive` keeps the layers that cost most in fp32")
    return (f"warning: the int8 output is far from fp32's on {cost['samples']} calibration images "
            f"({cost['output_sqnr_db']:.1f} dB SQNR, below {LOW_SQNR_DB:g}): check what it means with "
            f"`qtool eval` (classes agreed, boxes, text read) before using it{hint}")


@click.command("quantize", short_help="Write the INT8 QDQ model and the sensitivity report.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="Where to write the int8 model "
              "(default: WORKDIR/model.int8.onnx).")
@click.option("--model", "-m", type=click.Path(dir_okay=False), help="The fp32 model (default: the calibrated one).")
@click.option("--table", type=click.Path(dir_okay=False), help="Calibration table (default: WORKDIR/calibration.json).")
@click.option("--method", type=click.Choice(sorted(METHODS) + [AUTO] + [m + FLAT for m in sorted(METHODS)]), default=None,
              help="Range method (default: calibrate's, auto unless chosen there); auto picks the one whose int8 "
                   "output is closest to fp32 on a few calibration samples. METHOD+flat: that method, with the "
                   "range of a tensor read only by hard-swish/HardSigmoid/Relu/Clip stopped where they go flat.")
@click.option("--exclude", multiple=True, help="Keep this node in fp32 (repeatable; names from `qtool inspect`).")
@click.option("--no-bias-correction", is_flag=True, help="Do not correct biases for weight rounding.")
@click.option("--exclude-sensitive", is_flag=True, help="Keep the most sensitive layers in fp32 until the target is met.")
@click.option("--target-agreement", type=click.FloatRange(0, 1, min_open=True), default=0.995, show_default=True,
              help="With --exclude-sensitive: top-1 agreement with fp32 to reach on held-back calibration images "
                   "(an encoder's: mean cosine to fp32 and nearest-neighbour agreement).")
@click.option("--max-drop", type=click.FloatRange(0, 100), default=None, help="With --exclude-sensitive and labels: largest accuracy "
              "drop in points to accept (instead of --target-agreement).")
@click.option("--max-excluded", type=click.IntRange(min=0), default=ExclusionOptions.max_excluded, show_default=True,
              help="At most this many layers kept in fp32 (a block tried whole counts each of its layers).")
@click.option("--labels", type=click.Path(dir_okay=False), help="Labels file for --max-drop (else class folders).")
@click.option("--sensitivity-samples", type=click.IntRange(min=1), default=None,
              help="Calibration images used for the per-layer sensitivity report (default: 64; for a model with "
                   "large outputs, such as a detector, as few as 4: about 65536 output values in all).")
@click.option("--no-sensitivity", is_flag=True, help="Skip the sensitivity report.")
@click.option("--rounding", type=click.Choice(["output", "nearest"]), default=None,
              help="Weight rounding: 'output' rounds each weight down or up to lower its layer's output error on "
                   "calibration images (the default); 'nearest' rounds to the nearest step.")
@click.option("--tune-ranges/--no-tune-ranges", default=False, show_default=True,
              help="Choose each activation's clip range by the model output on calibration images.")
@click.option("--target", type=click.Choice(list(TARGETS)), default=DEFAULT_TARGET, show_default=True,
              help="The CPUs the model must give the exact int8 result on. portable: every ONNX Runtime CPU path "
                   "(x86 with or without VNNI, AMX, ARM) at full int8 speed; vnni: CPUs with VNNI/AMX/ARM dot "
                   "products and qtool's runtime (ONNX Runtime on x86 without VNNI loses accuracy); u8-weights: "
                   "exact everywhere, slower in ONNX Runtime without VNNI.")
@click.option("--strict", is_flag=True, help="An optional step that fails (method choice, output-aware rounding, range "
              "tuning, sensitivity, exclusion, target cost) is an error; without it, the step falls back with one "
              "warning and the model is still written.")
@click.option("--verify", is_flag=True, help="Hold about a third of the calibration samples out of the steps fitted on "
              "them and keep each step that changes the model (method choice with channel balancing, input grid, "
              "encoding choice, output-aware rounding, range tuning, the guard) only where it measures better "
              "on them, by what the output means (off by default: a few held-out samples rarely show a step's "
              "gain beyond their noise; see docs/cli.md).")
@click.option("--task", type=click.Choice(NAMES, case_sensitive=False), default=None,
              help=f"What the output quantize judges by means, where the guess is wrong ({', '.join(TASKS)}): "
                   "'encoder' judges --exclude-sensitive's target by the vectors' cosine to fp32 and nearest "
                   "neighbours, not by top-1.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the quantize summary as JSON here.")
@ray_option
@common_options
def command(output, model, table, method, exclude, no_bias_correction, exclude_sensitive, target_agreement, max_drop,
            max_excluded, labels, sensitivity_samples, no_sensitivity, rounding, tune_ranges, target, strict, verify, task,
            json_path, ray, workdir, quiet, verbose, debug):
    """Write an INT8 ONNX model (QDQ: uint8 activations, int8 per-channel weights).

    Ops without an int8 rule stay fp32 and are listed. On a sample of the calibration
    images it measures each layer's sensitivity (sensitivity.json and .html in the working
    directory); --exclude-sensitive keeps the worst layers in fp32 until a target is met.

    The default target, portable, writes int8 weights that ONNX Runtime computes exactly on
    every CPU, including x86 CPUs without VNNI (where it adds weight pairs in a saturating
    int16); --target vnni writes plain int8 weights for CPUs that have VNNI.

    \b
    Example:
      qtool quantize --exclude-sensitive
      qtool quantize --method percentile --exclude /_fc/Gemm -o model.int8.onnx
      qtool quantize --rounding nearest --tune-ranges --no-sensitivity
      qtool quantize --target vnni
      qtool quantize --verify
    """
    setup_output(quiet, verbose)
    if no_sensitivity and exclude_sensitive:
        raise click.UsageError("--exclude-sensitive needs the sensitivity analysis; drop --no-sensitivity")
    if (sensitivity_samples is not None and sensitivity_samples < 1) or max_excluded < 0 or not 0 < target_agreement <= 1:
        raise click.UsageError("--sensitivity-samples >= 1, --max-excluded >= 0 and 0 < --target-agreement <= 1")
    from qtool.quantize import report  # (here: `qtool calibrate` need not import quantize's pipeline)
    from qtool.quantize.run import quantize

    options = QuantizeOptions(
        model=model, table=table, output=output, method=method, exclude=exclude,
        bias_correction=not no_bias_correction, rounding=None if rounding is None else rounding == "output",
        tune_ranges=tune_ranges, target=target, strict=strict, verify=verify, progress=not quiet, task=task,
        sensitivity=SensitivityOptions(not no_sensitivity, sensitivity_samples),
        exclusion=ExclusionOptions(exclude_sensitive, target_agreement, max_drop, max_excluded, labels), ray=ray)

    def show(r):
        lines = []
        if r.sensitivity:
            lines += report.sensitivity_lines(r.sensitivity)
        if r.exclusion is not None:
            lines += report.exclusion_lines(r.exclusion, options.exclude)
        for line in lines + report.summary_lines(r.report, r.seconds, target):
            say(quiet, line)
        warning = far_from_fp32(r.report, exclude_sensitive)
        if warning:
            click.echo(warning, err=True)  # even with -q: the model written may not be usable as it is
            r.report["warnings"] = r.report.get("warnings", []) + [warning]
        for line in report.fp32_lines(r.output, verbose) + report.written_lines(r.report, r.path):
            say(quiet, line)
        write_json(json_path, r.report)

    shown(lambda: quantize(workdir, options, say=lambda t: say(quiet, t),
                           also_writes=[File("--json file", json_path)] if json_path else []),  # (checked first)
          show)
