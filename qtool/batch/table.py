"""The batch's one table, as Markdown (for a reader) and JSON (every figure, for a script), each written to
a temporary file and renamed into place."""
from __future__ import annotations

import json
from importlib.metadata import version

from qtool.batch.catalogue import STEPS
from qtool.modelio import atomic_write_text, json_safe

HEAD = ["model", "status"] + [f"{s} s / MB" for s in STEPS] + ["int8 / fp32 size", "SQNR dB", "top-1 agreement",
                                                               "reason"]


def _step(row: dict, step: str) -> str:
    s = row["steps"].get(step)
    return "-" if s is None else f"{s['seconds']:.1f} / {s['peak_mb']:.0f}"


def _bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _db(sqnr) -> str:
    """eval's SQNR as the table shows it: "exact" where int8 equals fp32 (eval.json holds +inf as 1e308,
    modelio.json_safe)."""
    if sqnr is None:
        return "-"
    return "exact" if sqnr >= 1e300 else f"{sqnr:.1f}"


def cells(row: dict) -> list:
    size, ev = row.get("size"), row.get("eval") or {}
    sqnr, agree = ev.get("output_sqnr_db"), ev.get("top1_agreement")
    return ([row["name"], row["status"]] + [_step(row, s) for s in STEPS]
            + [f"{_bytes(size['int8'])} / {_bytes(size['fp32'])} ({100 * size['ratio']:.1f} %)" if size else "-",
               _db(sqnr), "-" if agree is None else f"{agree:.4f}",
               f"{row['step']}: {row['reason']}" if row["step"] else row["reason"]])


def markdown(rows: list, catalogue: str) -> str:
    ok = sum(r["status"] == "ok" for r in rows)
    lines = [f"qtool batch {catalogue}: {ok} of {len(rows)} models ok", "",
             "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def document(rows: list, catalogue: str, where: str, phases: dict | None = None) -> dict:
    """The JSON table: `where` says how the jobs ran (local, jobs N; or ray); `phases`: the driver's seconds
    per phase (plan, ray start, jobs, ray stop)."""
    return {"qtool": version("qtool"), "catalogue": catalogue, "ran": where,
            "ok": sum(r["status"] == "ok" for r in rows), "models": len(rows), "phases": phases or {}, "rows": rows}


def write(rows: list, catalogue: str, where: str, paths: dict, phases: dict | None = None) -> None:
    """paths: {"markdown": path, "json": path}."""
    atomic_write_text(paths["json"], json.dumps(json_safe(document(rows, catalogue, where, phases)), indent=1) + "\n")
    atomic_write_text(paths["markdown"], markdown(rows, catalogue))
