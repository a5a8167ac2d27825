"""qtool quantize: write the INT8 QDQ model from the calibration table."""
from __future__ import annotations

import click

from qtool.calibrate.methods import METHODS
from qtool.commands.common import common_options, say, setup_output, write_json
from qtool.quantize.run import fp32_ops_of, quantize


@click.command("quantize")
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="Where to write the int8 model "
              "(default: WORKDIR/model.int8.onnx).")
@click.option("--model", "-m", type=click.Path(dir_okay=False), help="The fp32 model (default: the calibrated one).")
@click.option("--table", type=click.Path(dir_okay=False), help="Calibration table (default: WORKDIR/calibration.json).")
@click.option("--method", type=click.Choice(sorted(METHODS)), default=None, help="Range method (default: calibrate's).")
@click.option("--exclude", multiple=True, help="Keep this node in fp32 (repeatable; names from `qtool inspect`).")
@click.option("--no-bias-correction", is_flag=True, help="Do not correct biases for weight rounding.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the quantize summary as JSON here.")
@common_options
def command(output, model, table, method, exclude, no_bias_correction, json_path, workdir, quiet, verbose, debug):
    """Write an INT8 ONNX model (QDQ: uint8 activations, int8 per-channel weights).

    Ops without an int8 rule stay fp32 and are listed.

    \b
    Example:
      qtool quantize
      qtool quantize --method percentile --exclude /_fc/Gemm -o model.int8.onnx
    """
    setup_output(quiet, verbose)
    ex = {n: "excluded by the user (--exclude)" for n in exclude}
    r = quantize(workdir, model, table, output, method, ex, not no_bias_correction)
    s = r.report["summary"]
    say(quiet, f"quantized in {r.seconds:.1f}s with {r.report['method']} ranges: {s.get('int8', 0)} ops int8, "
               f"{s.get('passthrough', 0)} pass int8 through, {s.get('fused', 0)} activations fused, "
               f"{s.get('fp32', 0)} stay fp32")
    for op, reasons in sorted(fp32_ops_of(r.output).items()):
        say(quiet, f"  fp32: {op} x{len(reasons)} ({reasons[0]})")
    for note in r.output.notes:
        if verbose or "opset" in note:
            say(quiet, f"  note: {note}")
    sb = r.report["size_bytes"]
    say(quiet, f"wrote {r.path} ({sb['int8'] / 1e6:.2f} MB, {100 * sb['int8'] / sb['fp32']:.1f}% of fp32)")
    say(quiet, "next: qtool eval --compare fp32 --data DIR")
    write_json(json_path, r.report)
