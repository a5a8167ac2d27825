"""What a new user meets in the first hour (issue 13): every phase of `quantize --exclude-sensitive`
says what it does under a bar with a total; messages that count images say the right number;
inspect on an int8 model or a batch-dynamic one; the Python API; help and conventions."""
from __future__ import annotations

import inspect as pyinspect
import json
import re

import numpy as np
import onnx
import pytest

from helpers import save, small_convnet, write_config, write_images
from qtool import cli
from test_cli import project, qtool  # noqa: F401  (the fixture and the in-process runner)


def _bars(err: str) -> dict:
    """tqdm's displays on stderr: description -> the last 'n/total' shown ('n' alone when it had no total)."""
    out = {}
    for piece in re.split(r"[\r\n]", err):
        m = re.match(r"\s*([a-z][a-z0-9 +()-]*?):\s+(?:\d+%\|[^|]*\|\s+)?([\d.]+(?:/[\d.]+)?)", piece)
        if m:
            out[m.group(1)] = m.group(2)
    return out


# --- item 4: every phase of --exclude-sensitive ----------------------------------------------------------

def test_exclude_sensitive_says_each_phase_under_a_bar_with_a_total(project, capsys):
    assert qtool("calibrate", "--model", "net.onnx", "--data", "data", "--config", "cfg.toml", "-q") == 0
    capsys.readouterr()
    assert qtool("quantize", "--exclude-sensitive", "--max-excluded", "2", "--target-agreement", "1.0",
                 "--tune-ranges") == 0
    cap = capsys.readouterr()
    out = cap.out
    phases = ["decoding 12 calibration images and running fp32 on them once", "method auto: ",
              "output-aware rounding: input covariances of every layer on 12 calibration images",
              "rounding the weights of", "tuning activation ranges at the output on 12 calibration images",
              "sensitivity: each of", "exclude-sensitive: keeping layers fp32 (at most 2) until top-1 agreement >= 1.0",
              "measuring what target portable costs against plain int8 weights"]
    at = [out.find(p) for p in phases]
    assert all(a >= 0 for a in at), [p for p, a in zip(phases, at) if a < 0]
    assert at == sorted(at)  # said in the order they run
    bars = _bars(cap.err)
    for desc in ("decode + fp32", "method choice", "covariances", "round weights", "tune ranges", "sensitivity",
                 "exclude-sensitive (at most)", "target cost"):
        assert desc in bars and "/" in bars[desc], (desc, bars)  # shown, with a total (so an ETA)
    assert bars["decode + fp32"].endswith("/24") and bars["covariances"].endswith("/12")
    assert not [v for v in bars.values() if "." in v]  # whole steps, not 13.999999999999998/29
    # item 5: twelve images, all used for sensitivity: none held back, and said so (not "only 0 held back")
    assert "only 0" not in out
    assert "the sensitivity analysis used all 12 calibration images, so none is held back" in out
    assert "checked on 12 calibration images, not held back" in out and "held-back images" not in out


def test_range_search_tells_its_exact_total(tmp_path):
    """The bar's total is first the most the search can take, then (after the first probes) exact."""
    from test_tuning import _calibrated, _outlier_channel_chain
    from qtool.ortsession import run_first_output
    from qtool.quantize.context import QuantizeContext
    from qtool.quantize.range_search import probe_count, search_ranges
    from qtool.quantize.samples import SampleSet

    rng = np.random.default_rng(3)
    xs = rng.standard_normal((8, 4, 6, 6)).astype(np.float32)
    r = _calibrated(_outlier_channel_chain(rng), tmp_path, [{"x": xs[k:k + 4]} for k in range(0, 8, 4)])
    ctx = QuantizeContext(r.fused, r.table, "minmax")
    done, told = [], []
    search_ranges(ctx, SampleSet(list(range(8)), {"x": xs}, run_first_output(r.fused, [{"x": xs}])),
                  done.append, told.append)
    assert len(told) == 1 and sum(done) == told[0] <= probe_count(ctx)


# --- item 5: messages ------------------------------------------------------------------------------------

def test_fp32_summary_lists_every_rank():
    from qtool.quantize.report import reasons_text
    r = [f"kept fp32 by --exclude-sensitive (rank {k})" for k in (1, 10, 2, 4, 3)]
    assert reasons_text(r) == "kept fp32 by --exclude-sensitive, sensitivity ranks 1, 2, 3, 4, 10"
    assert reasons_text(["no int8 rule for this op"] * 3) == "no int8 rule for this op"
    assert reasons_text(["excluded by the user (--exclude)", "kept fp32 by --exclude-sensitive (rank 7)"]) == \
        "excluded by the user (--exclude) x1; kept fp32 by --exclude-sensitive, sensitivity rank 7 x1"


def test_eval_limit_says_how_many_it_evaluates(project, capsys):
    assert qtool("calibrate", "--model", "net.onnx", "--data", "data", "--config", "cfg.toml", "--every", "2",
                 "-q") == 0
    assert qtool("quantize", "-q", "--no-sensitivity") == 0
    capsys.readouterr()
    assert qtool("eval", "--limit", "2", "--json", "e.json") == 0
    out = capsys.readouterr().out
    assert re.search(r"evaluating on 2 of the 6 images of \S*data \(the 6 calibration images excluded\)", out)
    assert json.load(open("e.json"))["n_images"] == 2


# --- item 6: inspect --------------------------------------------------------------------------------------

def test_inspect_says_a_model_is_already_int8(project, capsys):
    assert qtool("calibrate", "--model", "net.onnx", "--data", "data", "--config", "cfg.toml", "-q") == 0
    assert qtool("quantize", "-q", "--no-sensitivity") == 0
    capsys.readouterr()
    assert qtool("inspect", "qtool_work/model.int8.onnx") == 0
    out = capsys.readouterr().out
    assert re.search(r"already int8 \(QDQ: DequantizeLinear x\d+, QuantizeLinear x\d+\): qtool quantizes fp32 "
                     r"models", out)
    assert "weight is not a constant" not in out and "stay fp32" not in out
    assert qtool("calibrate", "--model", "qtool_work/model.int8.onnx", "--data", "data", "-w", "w2") == 1
    assert "already int8" in capsys.readouterr().err


def test_inspect_counts_macs_at_batch_one_when_only_the_batch_is_dynamic(tmp_path, capsys):
    from qtool.inspect import inspect_model
    model = save(small_convnet(size=16), tmp_path / "m.onnx")  # input [N, 3, 16, 16]
    r = inspect_model(model)
    at2 = inspect_model(model, ["2,3,16,16"])
    assert r.macs_batch_one and r.macs * 2 == at2.macs and not at2.macs_batch_one
    assert qtool("inspect", model) == 0
    assert "GMAC per sample (batch 1)" in capsys.readouterr().out


# --- item 8: the Python API ------------------------------------------------------------------------------

def test_python_api_calibrate_quantize_evaluate_from_plain_arrays(tmp_path, capsys):
    from qtool import api
    model = save(small_convnet(size=16), tmp_path / "net.onnx")
    rng = np.random.default_rng(0)
    batches = [rng.uniform(-1, 1, (4, 3, 16, 16)).astype(np.float32) for _ in range(3)]  # as a loader gives them
    wd = str(tmp_path / "work")
    cal = api.calibrate(model, batches, workdir=wd, verbose=False)
    assert cal.table.n_samples == 12 and cal.table.method == "auto"
    q = api.quantize(wd, verbose=False)
    assert q.report["method"] == "minmax" and q.report["target"] == "portable"
    onnx.checker.check_model(onnx.load(q.path))
    one_at_a_time = (x for b in batches for x in b)  # single samples [C, H, W] work too
    r = api.evaluate(workdir=wd, data=one_at_a_time, verbose=False)
    assert r["n_samples"] == 12 and r["output_sqnr_db"] > 15
    assert capsys.readouterr().out == ""  # verbose=False: silent
    from qtool.errors import QtoolError
    with pytest.raises(QtoolError, match=r"sample 0: expected an array for input 'x'.*\(data, label\) pair"):
        api.calibrate(model, [(batches[0], 1)], workdir=wd, verbose=False)


def test_api_defaults_are_the_cli_defaults():
    from qtool import api
    from qtool.calibrate.options import CalibrateOptions
    from qtool.commands import calibrate as cal_cmd, quantize as q_cmd
    cli_default = {p.name: p.default for p in cal_cmd.command.params}
    assert pyinspect.signature(api.calibrate).parameters["method"].default == cli_default["method"] == "auto"
    assert CalibrateOptions().method == "auto"
    q_default = {p.name: p.default for p in q_cmd.command.params}
    opts = api.QuantizeOptions()  # (what api.quantize takes without options)
    assert opts.target == q_default["target"]
    assert opts.sensitivity.samples == q_default["sensitivity_samples"]
    assert opts.exclusion.target_agreement == q_default["target_agreement"]
    assert opts.exclusion.max_excluded == q_default["max_excluded"]
    assert opts.rounding is q_default["rounding"] is None  # None: output-aware, in both
    assert len(pyinspect.signature(api.quantize).parameters) <= 8


def test_readme_api_section_runs_as_written(tmp_path, monkeypatch):
    """The README's Python example, with its names bound to a tiny model and arrays."""
    import os
    text = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    block = text.split("## Python API")[1].split("```python")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    save(small_convnet(size=16), tmp_path / "model.onnx")
    rng = np.random.default_rng(1)
    env = {"calib_batches": [rng.uniform(-1, 1, (4, 3, 16, 16)).astype(np.float32) for _ in range(2)],
           "val_batches": [rng.uniform(-1, 1, (4, 3, 16, 16)).astype(np.float32) for _ in range(2)]}
    exec(compile(block, "README.md", "exec"), env)  # noqa: S102 - the project's own README
    assert os.path.exists(tmp_path / "work" / "model.int8.onnx")


# --- item 9: help and conventions -------------------------------------------------------------------------

def test_top_level_help_does_not_cut_descriptions(capsys):
    assert qtool("--help") == 0
    lines = capsys.readouterr().out.split("Commands:")[1].strip().splitlines()
    assert len(lines) == len(cli.cli.commands)
    assert not any(ln.rstrip().endswith("...") for ln in lines), lines


@pytest.mark.parametrize("cmd", sorted(cli.cli.commands))
def test_every_command_takes_quiet_verbose_debug_and_every_option_has_help(cmd):
    c = cli.cli.commands[cmd]
    opts = {o for p in c.params for o in p.opts}
    assert {"-q", "--quiet", "-v", "--verbose", "--debug"} <= opts
    bare = [p.name for p in c.params if isinstance(p, __import__("click").Option) and not p.help]
    assert not bare, f"{cmd}: options without help: {bare}"


def test_info_quiet_prints_nothing_and_inspect_quiet_too(tmp_path, capsys):
    model = save(small_convnet(), tmp_path / "m.onnx")
    assert qtool("info", "-q") == 0 and qtool("inspect", model, "-q") == 0
    assert capsys.readouterr().out == ""
    assert qtool("info", "-v") == 0 and "kernel ISA" in capsys.readouterr().out
