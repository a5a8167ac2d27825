"""`quantize`: fused graph + calibration table -> INT8 QDQ model and its report, in the working directory.

It reads the inputs and checks the options against them (what stays fp32 whatever the steps find, which
steps can run on this model), runs the pipeline (pipeline.py), and writes the reports (report.py)."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

from qtool import graph as G
from qtool import outputs
from qtool.blas import blas_threads
from qtool.calibrate.methods import AUTO
from qtool.calibrate.run import FUSED
from qtool.calibrate.table import FLAT
from qtool.errors import LateWriteError, QtoolError
from qtool.plan import make_plan
from qtool.quantize.context import QuantizeContext
from qtool.quantize.encoding import TARGETS
from qtool.quantize.inputs import calibration_files, load_inputs
from qtool.quantize.optional import OptionalSteps
from qtool.quantize.options import BARE, QuantizeOptions
from qtool.quantize.pipeline import FALLBACKS, LAYER_FALLBACKS, run_pipeline
from qtool.quantize.qdq import QuantizeOutput
from qtool.quantize.report import quantize_report, write_reports, writes
from qtool.quantize.split import SampleSplit, sensitivity_samples
from qtool.quantize.state import QuantizeRun, Switches
from qtool.quantize.unbounded import unbounded_exclusions
from qtool.workdir import Workdir

STRICT_ENV = "QTOOL_STRICT"  # "1": every quantize is --strict (the test suite sets it: no bug hides behind a fallback)


@dataclass
class QuantizeResult:
    output: QuantizeOutput
    path: str
    report: dict
    seconds: float
    sensitivity: dict | None = None
    exclusion: object = None
    tuning: object = None  # Tuning: the rounding covariances and tuned ranges the model was built with


def quantize(workdir: str | Workdir | None = None, options: QuantizeOptions | None = None, say=print,
             also_writes=()) -> QuantizeResult:
    """The int8 model from the calibration in `workdir`, as `options` (options.py; None: BARE, no
    sensitivity report and no bars) ask. Every experiment is scored with the exact int8 arithmetic the
    target promises, whatever CPU this is; an optional step that fails falls back with a warning
    (optional.py), or with options.strict is an error.
    The working directory is held for the whole run; what the run will write (there, options.output, and
    `also_writes`: outputs.File, as the command's --json) is checked against what it reads, and
    writable, once the inputs are known and before any long work (outputs.py)."""
    wd = workdir if isinstance(workdir, Workdir) else Workdir(workdir)
    options = BARE if options is None else options
    with wd.lock(create=True), blas_threads(1), _experiments(options.ray) as where:  # blas.py: why one thread
        return _quantize(wd, options, say, also_writes, where)


@contextmanager
def _experiments(address: str | None):
    """Where the simulated experiments run (QuantizeContext.experiments): None here, else on the Ray
    cluster at `address`, connected for the whole run (Ray is imported only then)."""
    if address is None:
        yield None
        return
    from qtool.quantize.sharded import on_cluster
    with on_cluster(address) as where:
        yield where


def _quantize(wd: Workdir, options: QuantizeOptions, say, also_writes, where=None) -> QuantizeResult:
    t0 = time.time()
    manifest = wd.manifest()
    inputs = load_inputs(wd, options.model, options.table, manifest)
    _check_writes(wd, options, inputs, manifest, also_writes)
    run = _start(wd, options, inputs, manifest, say)
    run.ctx.experiments = where
    run.quantize = quantize
    run_pipeline(run)
    if run.ctx.resized:
        say(f"note: int8 changed the output's size on up to {100 * run.ctx.resized:.0f} % of the samples an "
            f"experiment ran (a size that follows the values, as a duration predictor's); those counted as wholly wrong")
    report = quantize_report(run)
    result = QuantizeResult(run.out, run.path, report, time.time() - t0, run.sensitivity, run.exclusion, run.tuning)
    try:  # (the model is written: should a report or the manifest fail now, the figures are still shown)
        write_reports(run, report)
    except QtoolError as e:
        raise LateWriteError(str(e), result) from None
    result.seconds = time.time() - t0
    return result


def _check_writes(wd: Workdir, options: QuantizeOptions, inputs, manifest: dict, also_writes) -> None:
    """Every output against every input, and writable, before the long work."""
    table_path = inputs.table_path
    outputs.check(writes=list(also_writes) + writes(wd, options.output, options.sensitivity_on),
                  reads=outputs.model("fp32 model", inputs.model_path)
                  + [outputs.File("calibration table", table_path),
                     outputs.File("fused graph", os.path.join(os.path.dirname(os.path.abspath(table_path)), FUSED)),
                     outputs.File("labels file", options.exclusion.labels)]
                  + outputs.data("calibration data folder", manifest.get("calibrate", {}).get("data"))
                  + outputs.recorded(manifest))


def _user_exclusions(options: QuantizeOptions, inputs, say) -> dict:
    """node -> reason of what stays fp32 whatever the steps find: the user's --exclude (checked against
    the graph), and the ops around tensors no range can hold."""
    exclude = options.user_exclusions()
    names = {n.name for n in inputs.fused.graph.node}
    unknown = [n for n in exclude if n not in names]
    if unknown:
        raise QtoolError(f"--exclude: no node named {', '.join(repr(u) for u in unknown)} in the fused graph "
                         f"(`qtool inspect` lists the names)")
    if options.target not in TARGETS:
        raise QtoolError(f"--target: no target named {options.target!r}; choose one of {', '.join(TARGETS)}")
    unbounded, held = unbounded_exclusions(inputs.fused, inputs.table)
    if unbounded:
        names = ", ".join(f"'{t}' ({why})" for t, why in list(held.items())[:3])
        say(f"note: {len(unbounded)} op(s) stay fp32 around {len(held)} tensor(s) no range can hold: {names}"
            f"{', ...' if len(held) > 3 else ''}")
        exclude = {**unbounded, **exclude}  # (a user's own reason for a node wins)
    return exclude


def _method(options: QuantizeOptions, inputs, say) -> str | None:
    """The range method asked for, METHOD+flat resolved to METHOD where no tensor is read only by an
    activation flat beyond a point; one the table does not hold is an error."""
    method, table = options.method, inputs.table
    if method and method.endswith(FLAT) and method not in table.ranges:
        say(f"note: no tensor of this model is read only by an activation flat beyond a point; {method} is "
            f"{method[:-len(FLAT)]}")
        method = method[:-len(FLAT)]
    if method and method != AUTO and method not in table.ranges:
        raise QtoolError(f"{inputs.table_path}: the calibration table holds no '{method}' ranges (it holds "
                         f"{', '.join(table.ranges) or 'none'}); choose one of those, or run `qtool calibrate` again")
    return method


def _switches(options: QuantizeOptions, inputs, main_int8: bool, say) -> Switches:
    """Which sample-reading steps the options and the model allow (the budget may turn more off)."""
    exclusion = bool(options.sensitivity_on and options.exclusion.enabled)
    on = Switches(auto=(options.method or inputs.table.method) == AUTO,
                  rounding=True if options.rounding is None else options.rounding,
                  tune_ranges=bool(options.tune_ranges), sensitivity=options.sensitivity_on, exclusion=exclusion,
                  # (--exclude-sensitive goes on into the If branches where the main graph has no int8 layer
                  # to keep fp32: Silero VAD's whole network sits in one; else the main graph's search is the one)
                  branch_exclusion=exclusion and not main_int8)
    if not main_int8 and not any(G._subgraphs(n) for n in inputs.fused.graph.node):
        # nothing to measure: every step compares int8 against fp32 (luscinia's 194 MB tree ensemble ran fp32
        # on 32 samples, rounding, sensitivity and the target's cost for 114 s at 7.4 GB, to write the model
        # it was given)
        say("note: no op of this model runs in int8; method choice, rounding, sensitivity and exclusion skipped")
        return replace(on, auto=False, rounding=False, tune_ranges=False, sensitivity=False, exclusion=False)
    if not main_int8:  # (the samples still decide which If branches to quantize; each runs these steps itself)
        say("note: no op of the main graph runs in int8; its method choice and sensitivity skipped "
            "(If branches every sample takes are quantized as models of their own)")
        return replace(on, auto=False, sensitivity=False)  # (rounding and range tuning: the branches' options)
    return on


def _start(wd: Workdir, options: QuantizeOptions, inputs, manifest: dict, say) -> QuantizeRun:
    """The run the pipeline walks: the options checked against the inputs, the experiments' context,
    the calibration files and their split."""
    exclude = _user_exclusions(options, inputs, say)
    method = _method(options, inputs, say)
    table = inputs.table
    auto = (options.method or table.method) == AUTO
    ctx = QuantizeContext(inputs.fused, table, table.range_method if auto else (method or table.method),
                          options.target, options.bias_correction, exclude, task=options.task)
    files = calibration_files(manifest)
    main_int8 = bool(make_plan(inputs.fused, exclude).int8_nodes)
    on = _switches(options, inputs, main_int8, say)
    if not main_int8 and not any(G._subgraphs(n) for n in inputs.fused.graph.node):
        files = []
    split = SampleSplit.of(files, options.sensitivity.samples or sensitivity_samples(inputs.fused),
                           verify=options.verify)
    steps = OptionalSteps(FALLBACKS, LAYER_FALLBACKS, options.strict or os.environ.get(STRICT_ENV) == "1")
    # (--verify: the model before method choice and balancing, the fallback they are verified against)
    return QuantizeRun(options, wd, manifest, inputs, ctx, steps, say, files, on, split, method, main_int8,
                       plain=replace(ctx) if options.verify else None)
