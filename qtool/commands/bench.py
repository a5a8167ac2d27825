"""qtool bench: qtool's native int8 runtime vs ONNX Runtime int8 and fp32, in one run."""
from __future__ import annotations

import os

import click

from qtool import outputs
from qtool.commands.common import common_options, echo, say, setup_output, write_json
from qtool.errors import QtoolError
from qtool.limits import MAX_BATCH


@click.command("bench", short_help="Time qtool's int8 runtime against ONNX Runtime int8 and fp32.")
@click.option("--model", "-m", type=click.Path(dir_okay=False),
              help="QDQ int8 ONNX model (default: the one `qtool quantize` wrote in the workdir).")
@click.option("--fp32", type=click.Path(dir_okay=False),
              help="The float original (default: found from the workdir or a sibling without '.int8').")
@click.option("--batch", "-b", "batches", type=click.IntRange(1, MAX_BATCH), multiple=True, help="Batch size; repeat for several (default 1 and 8).")
@click.option("--threads", "-t", default=2, show_default=True, type=click.IntRange(1, 1024), help="Threads for every engine.")
@click.option("--rounds", "-r", default=10, show_default=True, type=click.IntRange(1, 10000),
              help="Interleaved rounds at least; in each the engines run in turn, the order alternating from round "
                   "to round. More rounds follow, two at a time, while a ratio's range is wider than +-10 %.")
@click.option("--max-rounds", default=40, show_default=True, type=click.IntRange(1, 10000),
              help="Rounds at most per batch size (and 90 s at most) when the ranges stay wide.")
@click.option("--round-ms", default=100, show_default=True, type=click.IntRange(0, 600000),
              help="Each engine's timed runs per round last at least this long.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, 100000),
              help="Each engine's timed runs per round at least, at batch 1 (a quarter, at least 1, at larger batches).")
@click.option("--shape", help="Input shape when the model's is dynamic beyond the batch, e.g. 1,3,224,224.")
@click.option("--profile", is_flag=True,
              help="Per-op-type time, GMAC/s and share of the active tier's peak, measured here (native runtime).")
@click.option("--ort-model", "others", type=click.Path(dir_okay=False), multiple=True,
              help="Another ONNX file with the same inputs (e.g. ONNX Runtime's quantize_dynamic output) timed in "
                   "ONNX Runtime in the same rounds; repeat for several.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write all figures as JSON here.")
@common_options
def command(model, fp32, batches, threads, rounds, max_rounds, round_ms, repeats, shape, profile, others, json_path, workdir, quiet,
            verbose, debug):
    """Time qtool's native int8 runtime, ONNX Runtime int8 (same file) and ONNX Runtime fp32.

    Prints the median ms/image of each engine per batch size and each ratio (other engine's time /
    native time: above 1, native is faster) with its 95 % interval. The engines take turns in
    rounds, one run each again and again (after one untimed run of each), the order alternating from
    round to round, so a busy machine slows them alike (rounds are added while a range is wider than +-10 %, up to
    --max-rounds); a ratio is the median of the rounds' ratios, its interval where
    another run's ratio falls 95 % of the time (a bootstrap over the rounds, fixed seed; --json
    also has the median's confidence interval). A ratio whose interval holds 1.0 is printed as a tie.
    Rounds in which other processes kept a quarter of a CPU or more busy are left out, while at
    least half of them remain; the line says so.

    \b
    Example:
      qtool bench                 (the int8 model `qtool quantize` wrote in ./qtool_work, and its fp32 original)
      qtool bench --model qtool_work/model.int8.onnx --fp32 model.onnx --batch 1 --batch 8 --json bench.json
      qtool bench -m model.int8.onnx --rounds 20      (a narrower interval, twice the time)
      qtool bench -m resnet50.int8.onnx --threads 2 --profile
      qtool bench -m enc.int8.onnx --ort-model enc.dynamic.onnx --shape 1,128 --batch 1 --threads 1
    """
    setup_output(quiet, verbose)
    from qtool.runtime.bench import BenchOptions, bench, find_fp32
    from qtool.workdir import Workdir
    given = model is not None
    if model is None:
        q = Workdir(workdir).manifest().get("quantize", {})
        if not q.get("int8_path"):
            raise click.UsageError(f"no int8 model to time: pass --model M.int8.onnx, or run `qtool quantize` first "
                                   f"(nothing quantized in {workdir})")
        model = q["int8_path"]
    if not os.path.isfile(model):
        raise QtoolError(f"{model}: no such file (the int8 model to time)" + (
            f" (recorded by `qtool quantize` in {workdir}; run it again)" if not given else ""))
    if fp32 is None:
        fp32 = find_fp32(model, workdir)
        if fp32:
            say(quiet, f"fp32 model: {fp32}")
        else:
            say(quiet, f"fp32 model: not found (not recorded for {os.path.basename(model)} in {workdir}, no sibling "
                       f"without '.int8'); timing the int8 engines only: pass --fp32 M.onnx to add ONNX Runtime fp32")
    if json_path:  # (before the timing: the one output, never an input)
        try:
            recorded = outputs.recorded(Workdir(workdir).manifest())
        except QtoolError:  # (a damaged manifest: bench writes nothing there, and find_fp32 passes it by)
            recorded = []
        outputs.check(writes=[outputs.File("--json file", json_path)],
                      reads=outputs.model("int8 model", model) + outputs.model("fp32 model", fp32) + recorded
                      + [f for o in others for f in outputs.model("--ort-model", o)])
    dims = None
    if shape:
        try:
            dims = [int(d) for d in shape.replace("x", ",").split(",")]
        except ValueError:
            raise QtoolError(f"--shape {shape}: expected comma-separated integers, e.g. 1,3,224,224") from None
        if any(d < 1 for d in dims):
            raise QtoolError(f"--shape {shape}: every dimension must be 1 or more")
    log = None if quiet else echo
    opts = BenchOptions(tuple(batches) or (1, 8), threads, repeats, dims, profile, rounds=rounds,
                        round_s=round_ms / 1000.0, max_rounds=max_rounds, others=tuple(others))
    r = bench(model, fp32, opts, log=log)
    if profile and not quiet:
        from qtool.runtime.profile import format_table, format_top
        for bs, p in r["profile"].items():
            echo(f"\nprofile, batch {bs} ({threads} threads; % of {p['peak_gmacs']:.0f} GMAC/s = {p['peak']}):")
            echo(format_table(p["by_op"]))
            if threads > 1:
                share = p.get("worker_share")
                echo("  ('1T ms': the same steps on one thread, 'x' its ratio; " + (
                     "no op was large enough to split over the threads)" if share is None else
                     f"the other threads ran {100 * share:.0f} % of the parallel chunks, "
                     f"{100 * (threads - 1) / threads:.0f} % if they always had a CPU)"))
            echo(format_top(p["top"]))
    write_json(json_path, {**r, "batches": {str(k): v for k, v in r["batches"].items()},
                           **({"profile": {str(k): v for k, v in r["profile"].items()}} if profile else {})})
