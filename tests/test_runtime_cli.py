"""`qtool bench` and `qtool info` end to end on a tiny quantized model."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("onnxruntime")

from qtool.cli import cli, main  # noqa: E402
from tests.test_runtime import RNG, _cnn, _quantize  # noqa: E402


def test_info():
    r = CliRunner().invoke(cli, ["info"])
    assert r.exit_code == 0, r.output
    assert "qtool 0.1.0" in r.output and "onnxruntime" in r.output and "kernel" in r.output
    r = CliRunner().invoke(cli, ["info", "--json"])
    assert "kernels" in json.loads(r.output)


def test_help_has_examples():
    for cmd in ("bench", "info"):
        r = CliRunner().invoke(cli, [cmd, "--help"])
        assert r.exit_code == 0 and "Example:" in r.output and f"qtool {cmd}" in r.output


def test_bench_json(tmp_path):
    import onnx
    m = _cnn()
    onnx.save(m, tmp_path / "m.onnx")
    path = _quantize(m, tmp_path, (1, 3, 20, 20))  # writes m.int8.onnx next to m.onnx
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(cli, ["bench", "--model", path, "--batch", "1", "--batch", "2", "--repeats", "3",
                                 "--shape", "1,3,20,20", "--profile", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "m.onnx" in r.output  # the fp32 sibling was found
    d = json.loads(out.read_text())
    for bs in ("1", "2"):
        b = d["batches"][bs]
        assert b["native_ms"] > 0 and b["ort_int8_ms"] > 0 and b["ort_fp32_ms"] > 0
        # the whole model's MACs at native's time, as a share of the measured peak
        p = b["peak"]
        assert p["gmacs_per_image"] == pytest.approx(d["model_gmacs_per_image"]) and p["peak_gmacs"] > 0
        assert p["gmacs_per_s"] == pytest.approx(p["gmacs_per_image"] / (b["native_ms"] / 1000))
        assert 0 < p["share"] == pytest.approx(p["gmacs_per_s"] / d["peak_gmacs"])
    assert "% of the peak" in r.output
    assert d["profile"]["1"]["by_op"][-1]["op"] == "total"
    # on 2 threads (the default) each op type's one-thread time sits beside it, and the workers' share
    prof = d["profile"]["1"]
    total = prof["by_op"][-1]
    assert total["ms_1t"] > 0 and total["scaling"] == pytest.approx(total["ms_1t"] / total["ms"])
    assert prof["worker_share"] is None or 0 <= prof["worker_share"] <= 1
    assert "1T ms" in r.output and ("of the parallel chunks" in r.output or "large enough to split" in r.output)


def test_bench_missing_model_is_one_line_error(tmp_path, capsys, monkeypatch):
    """The int8 file is checked before the fp32 model is looked for (no 'fp32 model: not found' first)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--model", str(tmp_path / "nope.int8.onnx")])
    assert e.value.code == 1
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and "nope.int8.onnx: no such file (the int8 model to time)" in err[0]
    assert cap.out == ""
    # no --model and nothing quantized in the workdir: misuse, and it says what to pass
    with pytest.raises(SystemExit) as e:
        main(["bench"])
    assert e.value.code == 2
    assert "no int8 model to time: pass --model M.int8.onnx, or run `qtool quantize` first" in capsys.readouterr().err
