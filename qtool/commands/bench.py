"""qtool bench: qtool's native int8 runtime vs ONNX Runtime int8 and fp32, in one run."""
from __future__ import annotations

import click

from qtool.commands.common import common_options, say, setup_output, write_json
from qtool.errors import QtoolError


@click.command("bench")
@click.option("--model", "-m", required=True, type=click.Path(dir_okay=False), help="QDQ int8 ONNX model.")
@click.option("--fp32", type=click.Path(dir_okay=False),
              help="The float original (default: found from the workdir or a sibling without '.int8').")
@click.option("--batch", "-b", "batches", type=int, multiple=True, help="Batch size; repeat for several (default 1 and 8).")
@click.option("--threads", "-t", default=2, show_default=True, help="Threads for every engine.")
@click.option("--repeats", default=20, show_default=True, help="Minimum timed runs at batch 1 (a quarter at larger batches).")
@click.option("--shape", help="Input shape when the model's is dynamic beyond the batch, e.g. 1,3,224,224.")
@click.option("--profile", is_flag=True,
              help="Per-op-type time, GMAC/s and share of the active tier's peak, measured here (native runtime).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write all figures as JSON here.")
@common_options
def command(model, fp32, batches, threads, repeats, shape, profile, json_path, workdir, quiet, verbose, debug):
    """Time qtool's native int8 runtime, ONNX Runtime int8 (same file) and ONNX Runtime fp32.

    Prints the median ms/image of each engine per batch size and the ratios; the engines take
    turns in short blocks (each after an untimed run), so a busy machine slows them alike.

    \b
    Example:
      qtool bench --model qtool_work/model.int8.onnx --fp32 model.onnx --batch 1 --batch 8 --json bench.json
      qtool bench -m resnet50.int8.onnx --threads 2 --profile
    """
    setup_output(quiet, verbose)
    from qtool.runtime.bench import bench, find_fp32
    if fp32 is None:
        fp32 = find_fp32(model, workdir)
        if fp32:
            say(quiet, f"fp32 model: {fp32}")
        else:
            say(quiet, "fp32 model: not found (pass --fp32); timing the int8 engines only")
    dims = None
    if shape:
        try:
            dims = [int(d) for d in shape.replace("x", ",").split(",")]
        except ValueError:
            raise QtoolError(f"--shape {shape}: expected comma-separated integers, e.g. 1,3,224,224") from None
    log = None if quiet else click.echo
    r = bench(model, fp32, tuple(batches) or (1, 8), threads, repeats, dims, profile, log=log)
    if profile and not quiet:
        from qtool.runtime.profile import format_table, format_top
        for bs, p in r["profile"].items():
            click.echo(f"\nprofile, batch {bs} ({threads} threads; % of {p['peak_gmacs']:.0f} GMAC/s = {p['peak']}):")
            click.echo(format_table(p["by_op"]))
            click.echo(format_top(p["top"]))
    write_json(json_path, {**r, "batches": {str(k): v for k, v in r["batches"].items()},
                           **({"profile": {str(k): v for k, v in r["profile"].items()}} if profile else {})})
