"""qtool eval: compare the int8 model with its fp32 original."""
from __future__ import annotations

import click

from qtool.commands.common import common_options, ray_option, say, setup_output, shown, write_json
from qtool.outputs import File
from qtool.tasks import NAMES, TASKS, parse_tasks


def _tasks(ctx, param, value):
    try:
        parse_tasks(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return tuple(value)


@click.command("eval", short_help="Compare the int8 model with its fp32 original.")
@click.option("--compare", type=click.Choice(["fp32"]), default="fp32", show_default=True, help="What to compare against.")
@click.option("--data", "-d", type=click.Path(), help="Evaluation images (default: the calibration folder).")
@click.option("--labels", type=click.Path(dir_okay=False), help="Class names one per line in class-index order; an "
              "image's class is the entry its file name starts with before '_'. Without it, class folders are used.")
@click.option("--model", "-m", type=click.Path(dir_okay=False), help="fp32 model (default: the calibrated one).")
@click.option("--int8", "int8_path", type=click.Path(dir_okay=False), help="int8 model (default: the quantized one).")
@click.option("--config", "-c", default=None, help="Preprocessing (default: calibrate's).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use at most this many images.")
@click.option("--runtime", type=click.Choice(["ort", "native", "both"]), default="ort", show_default=True,
              help="Run the int8 model on ONNX Runtime, qtool's native kernels, or both.")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(1, 1024),
              help="Threads for each engine (ONNX Runtime fp32 and int8, qtool's runtime).")
@click.option("--task", multiple=True, metavar="[OUTPUT=]TASK", callback=_tasks,
              help=f"What the outputs (or OUTPUT) mean, where the guess printed is wrong: {', '.join(TASKS)} "
                   f"(also {', '.join(n for n in NAMES if n not in TASKS)}). Repeatable.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write all figures as JSON here.")
@ray_option
@common_options
def command(compare, data, labels, model, int8_path, config, limit, runtime, threads, task, json_path, ray, workdir,
            quiet, verbose, debug):
    """Accuracy, top-1 agreement, output SQNR, size and latency of int8 vs fp32.

    \b
    Example:
      qtool eval --compare fp32
      qtool eval --data ../shared/imagenet-samples --labels ../shared/imagenet-samples/synsets.txt --json eval.json
      qtool eval --data sentences/ --task encoder
      qtool eval --ray auto         (the runs over the samples on a Ray cluster; the latency timed here)
    """
    setup_output(quiet, verbose)

    def show(r):
        say(quiet, render(r) if "n_images" in r else render_outputs(r))
        _warn_runtime(r)
        write_json(json_path, r)

    from qtool.evaluate import EvalOptions, evaluate_workdir  # (here: the other commands need not import eval)

    options = EvalOptions(labels=labels, config=config, limit=limit, threads=threads, runtime=runtime, task=task,
                          ray=ray)
    shown(lambda: evaluate_workdir(workdir, data, model, int8_path, options, show_progress=not quiet,
                                   say=lambda t: say(quiet, t),
                                   also_writes=[File("--json file", json_path)] if json_path else []),  # (checked first)
          show)


def _warn_runtime(r: dict) -> None:
    """Said even with -q: the numbers above are not what the model computes elsewhere."""
    from qtool.evaluate import check_warning
    line = check_warning(r.get("runtime_check"))
    if line:
        click.echo(line, err=True)


def render_outputs(r: dict) -> str:
    """The .npy path's report: one line per output, then size and latency."""
    lines = [f"{r['n_samples']} samples; per output, int8 vs fp32:"] + _output_lines(r) + _task_line(r)
    sb = r["size_bytes"]
    lines.append(f"model size {sb['fp32'] / 1e6:.2f} MB fp32 -> {sb['int8'] / 1e6:.2f} MB int8 "
                 f"({100 * r['size_ratio']:.1f}%)")
    lat = r.get("latency_ms")
    if lat:
        lines.append(f"ORT latency (ms, b=1): fp32 {lat['ort_fp32']:.2f}, int8 {lat['ort_int8']:.2f} "
                     f"({lat['ort_fp32'] / lat['ort_int8']:.2f}x)")
    return "\n".join(lines)


def _output_lines(r: dict) -> list[str]:
    """One line per output: SQNR, max abs error, and agreement where the output's shape says what it is."""
    lines = []
    for name, o in r.get("outputs", {}).items():
        shape = "[" + ", ".join(str(d) for d in o["shape"] or []) + "]"  # (a "?" where samples differ in size)
        if "equal_fraction" in o:  # (strings)
            lines.append(f"  {name} {shape}: text, {100 * o['equal_fraction']:.1f} % of strings equal")
            continue
        if "labels_equal" in o:  # (integers: ids, tags, class numbers)
            lines.append(f"  {name} {shape}: ids, {100 * o['labels_equal']:.1f} % equal, samples equal throughout "
                         f"{100 * o['samples_equal']:.1f} %")
            continue
        mm = o.get("shape_mismatch")
        if mm:
            lines.append(f"  WARNING {name}: the int8 model's output has shape {mm['int8']} where fp32's has {mm['fp32']} "
                         f"({mm['batches']} batches not compared)")
        if o.get("sqnr_db") is None:
            continue
        text = f"  {name} {shape}: SQNR {o['sqnr_db']:.1f} dB, max |error| {o['max_abs_error']:.4g}"
        if "top1_agreement" in o:
            text += ", " + _agreement(o)
        if "encoder" in o:
            text += ", " + _encoder(o["encoder"])
        cos = o.get("cosine")
        if cos and "top_rows_agreement" not in o and "top1_agreement" not in o:  # (vectors, not classes: JSON has both)
            text += (f", cosine to fp32 {cos['mean']:.4f} (min {cos['min']:.4f}"
                     + (", unit-length embeddings)" if cos["unit_length"] else ")"))
        if "top_rows_agreement" in o:
            text += ", top-scoring rows shared: " + ", ".join(
                f"{k} {v:.2f}" for k, v in o["top_rows_agreement"].items())
            text += f" (max |error| in the top 10 rows {o['top10_rows_max_abs_error']:.4g})"
        nf = o.get("not_finite")
        if nf:
            text += f"; over the finite values ({nf['positions']} NaN/inf left out"
            text += f", {nf['finite_in_one_only']} of them finite in one model only)" if nf["finite_in_one_only"] else ")"
        lines.append(text)
    return lines


def _task_line(r: dict) -> list[str]:
    """One line: what each output was judged as, and whether guessed (the why is in --json: task_from)."""
    outs = {n: o for n, o in r.get("outputs", {}).items() if "task" in o}
    if not outs:
        return []
    told = any(o["task_from"] == "--task" for o in outs.values())
    return [f"judged as ({'--task where given, else ' if told else ''}guessed from the graph and fp32's values; "
            f"--task [OUTPUT=]TASK to say otherwise): "
            + ", ".join(f"{n} {o['task']}" + (" (--task)" if o["task_from"] == "--task" else "") for n, o in outs.items())]


def _encoder(e: dict) -> str:
    """An encoder's figures over the evaluation set, one vector per sample."""
    cos = e["cosine"] or {"mean": float("nan"), "worst": float("nan")}
    sp = "-" if e["pair_spearman"] is None else f"{e['pair_spearman']:.4f}"
    text = (f"as an encoder over {e['samples']} samples ({e['vectors']}): cosine to fp32 {cos['mean']:.4f} "
            f"(worst {cos['worst']:.4f}), nearest neighbour unchanged {e['neighbour_agreement']:.4f}, Spearman of "
            f"pair similarities {sp}, vector SQNR {e['sqnr_db']:.1f} dB")
    tok = e.get("token_cosine")
    if tok:
        text += f"; per real token cosine {tok['mean']:.4f} (worst {tok['worst']:.4f})"
    return text


def _agreement(o: dict) -> str:
    if o.get("agreement_over") == "positions":
        text = (f"top-1 agreement per position {o['top1_agreement']:.4f}, sequences equal at every position "
                f"{o['sequence_agreement']:.4f}")
        if "ctc_text_agreement" in o:
            text += f", texts equal after greedy CTC decoding {o['ctc_text_agreement']:.4f} (blank {o['ctc_blank']})"
        return text
    return f"top-1 agreement {o['top1_agreement']:.4f}"


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
    skipped = f" ({len(r['skipped'])} unreadable skipped)" if r["skipped"] else ""
    if r.get("left_out"):
        skipped += f" ({r['left_out']} left out: the model's batch is fixed, a last partial batch cannot run)"
    if "top1_agreement" in r:
        lines.append(f"{_agreement(r)} over {r['n_images']} images{skipped}")
    else:
        first = next(iter(r.get("outputs", {}).values()), {})
        if "top_rows_agreement" in first:
            lines.append(f"{r['n_images']} images{skipped}; detections: top-scoring rows shared with fp32 "
                         + ", ".join(f"{k} {v:.2f}" for k, v in first["top_rows_agreement"].items()))
        elif "encoder" in first:
            lines.append(f"{r['n_images']} images{skipped}; {_encoder(first['encoder'])}")
        elif first.get("cosine", {}).get("unit_length"):
            lines.append(f"{r['n_images']} images{skipped}; embeddings (vectors of length 1): cosine to fp32 "
                         f"{first['cosine']['mean']:.4f}, lowest {first['cosine']['min']:.4f}")
        else:
            lines.append(f"{r['n_images']} images{skipped}; no top-1 agreement: the first output is neither classes "
                         "nor a sequence of distributions (judge it by the SQNR below, or by what it means)")
    if r["output_sqnr_db"] is None:
        lines.append("output SQNR: none (the int8 output's shape differs from fp32's, see below)")
    else:
        lines.append(f"output SQNR {r['output_sqnr_db']:.1f} dB, max |error| {r['max_abs_error']:.4g}")
    if len(r.get("outputs", {})) > 1 or any(o.get("shape_mismatch") for o in r.get("outputs", {}).values()):
        lines += _output_lines(r)
    lines += _task_line(r)
    if "native" in r:
        n = r["native"]
        if "top1_agreement_vs_ort_int8" in n:
            lines.append(f"native runtime: agreement with ORT int8 {n['top1_agreement_vs_ort_int8']:.4f}, "
                         f"with fp32 {n['top1_agreement_vs_fp32']:.4f}")
        else:
            lines.append(f"native runtime: max |difference| from ORT int8 {n['max_abs_diff_vs_ort_int8']:.4g}")
    return "\n".join(lines)

