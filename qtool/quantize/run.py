"""`quantize`: fused graph + calibration table -> INT8 QDQ model and its report, in the working directory."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import onnx

from qtool.calibrate.run import FUSED, TABLE
from qtool.calibrate.table import load_table
from qtool.errors import QtoolError
from qtool.fuse import fuse_model
from qtool.modelio import atomic_write_text, load_model, model_hash, save_model
from qtool.quantize.qdq import QuantizeOutput, quantize_graph
from qtool.workdir import Workdir

INT8 = "model.int8.onnx"
REPORT = "quantize.json"


@dataclass
class QuantizeResult:
    output: QuantizeOutput
    path: str
    report: dict
    seconds: float


def load_inputs(workdir: str | None, model: str | None, table_path: str | None):
    """(fused graph, table, original model path) from explicit paths or the working directory."""
    wd = Workdir(workdir)
    if table_path is None:
        entry = wd.manifest().get("calibrate")
        table_path = entry["table_path"] if entry else None
        if table_path is None:
            if model is not None:
                raise QtoolError(f"{wd.path}: no calibration table; run `qtool calibrate --model {model} --data DIR` "
                                 f"first (or pass --table)")
            wd.require("calibrate", "calibrate")
    table = load_table(table_path)
    if model is not None:
        if model_hash(model) != table.model_sha256:
            raise QtoolError(f"{table_path}: calibration table was made for another model "
                             f"({table.model_path}), not {model}; run `qtool calibrate` on this model")
        fused = fuse_model(load_model(model), _pins(table)).model
        return fused, table, model
    fused_path = os.path.join(os.path.dirname(os.path.abspath(table_path)), FUSED)
    if not os.path.exists(fused_path) or model_hash(fused_path) != table.fused_sha256:
        if not os.path.exists(table.model_path):
            raise QtoolError(f"{fused_path}: fused graph missing or changed, and the original model "
                             f"{table.model_path} is gone; run `qtool calibrate` again")
        if model_hash(table.model_path) != table.model_sha256:
            raise QtoolError(f"{table.model_path}: the model changed since calibration; run `qtool calibrate` again")
        return fuse_model(load_model(table.model_path), _pins(table)).model, table, table.model_path
    return load_model(fused_path, check=False), table, table.model_path


def _pins(table) -> dict:
    c = table.config
    if not c or not table.input_name:
        return {}
    h, w = c["size"]
    ch = 1 if c.get("color") == "GRAY" else 3
    return {table.input_name: [None, ch, h, w] if c.get("layout", "NCHW") == "NCHW" else [None, h, w, ch]}


def quantize(workdir: str | None = None, model: str | None = None, table_path: str | None = None,
             output: str | None = None, method: str | None = None, exclude: dict | None = None,
             bias_correction: bool = True) -> QuantizeResult:
    t0 = time.time()
    fused, table, model_path = load_inputs(workdir, model, table_path)
    exclude = dict(exclude or {})
    names = {n.name for n in fused.graph.node}
    unknown = [n for n in exclude if n not in names]
    if unknown:
        raise QtoolError(f"--exclude: no node named {', '.join(repr(u) for u in unknown)} in the fused graph "
                         f"(`qtool inspect` lists the names)")
    out = quantize_graph(fused, table, method or table.method, exclude, bias_correction)
    wd = Workdir(workdir)
    path = output or wd.file(INT8)
    save_model(out.model, path)
    report = {
        "model": model_path, "int8_model": os.path.abspath(path), "method": method or table.method,
        "bias_correction": bias_correction,
        "summary": out.plan.summary(),
        "excluded": exclude,
        "nodes": [d.__dict__ for d in out.plan.decisions],
        "notes": out.notes,
        "layers": {k: v.__dict__ for k, v in out.layers.items()},
        "size_bytes": {"fp32": os.path.getsize(model_path), "int8": os.path.getsize(path)},
    }
    atomic_write_text(wd.file(REPORT), json.dumps(report, indent=1))
    wd.update(quantize={"int8_path": os.path.abspath(path), "report_path": wd.file(REPORT),
                        "method": report["method"], "excluded": exclude, "bias_correction": bias_correction})
    return QuantizeResult(out, path, report, time.time() - t0)


def fp32_ops_of(out: QuantizeOutput) -> dict:
    c = {}
    for d in out.plan.decisions:
        if d.status == "fp32":
            c.setdefault(d.op_type, []).append(d.reason)
    return c


__all__ = ["quantize", "QuantizeResult", "INT8", "REPORT", "onnx"]
