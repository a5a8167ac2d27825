"""sensitivity.html: escaped names, a self-contained page, and (where Chromium exists) a real render."""
import os
import shutil
import subprocess

import pytest

from qtool.report.sensitivity_html import render

EVIL = '<script>alert("x")</script>&"\''


def _report(n=12):
    layers = [dict(name=f"/block.{k}/Conv" if k != 3 else EVIL, op_type="Conv", order=k, rank=n - k,
                   output_sqnr_db=30.0 + k, top1_agreement=1.0, kl=1e-4, weight_sqnr_db=44.0, clip_fraction=0.001)
              for k in range(n)]
    curve = [dict(excluded=[], agreement=0.98, predicted_agreement=0.985, sqnr_db=24.0, accuracy_drop_pt=None,
                  ort_int8_ms=2.5, added=""),
             dict(excluded=[EVIL], agreement=0.99, predicted_agreement=0.99, sqnr_db=25.5, accuracy_drop_pt=None,
                  ort_int8_ms=2.7, added=EVIL)]
    return {"meta": {"model": "m<b>.onnx", "method": "minmax", "samples": 64, "seconds": 1.5}, "layers": layers,
            "excluded": {EVIL: "kept fp32 by --exclude-sensitive (rank 9)"},
            "exclusion": {"curve": curve, "reached": False, "target": "top-1 agreement >= 0.995"},
            "fp32_ops": [{"name": "soft<max>", "op_type": "Softmax", "reason": "no int8 rule"}]}


def test_model_names_are_escaped_everywhere():
    page = render(_report())
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert" in page
    assert "m&lt;b&gt;.onnx" in page and "soft&lt;max&gt;" in page
    # the only scripts are the page's own two
    assert page.count("<script") == 2


def test_page_is_self_contained():
    page = render(_report())
    for ref in ("http://", "https://", "src=", "@import", "url("):
        assert ref not in page.replace("http://www.w3.org/2000/svg", ""), ref
    assert "<svg" in page and 'class="sortable"' in page
    assert "Target NOT reached" in page


@pytest.mark.skipif(not shutil.which("chromium"), reason="headless Chromium not installed (apt-get install chromium)")
def test_renders_in_headless_chromium(tmp_path):
    html = tmp_path / "sensitivity.html"
    html.write_text(render(_report()), encoding="utf-8")
    base = ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-network",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(base + ["--dump-dom", html.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<rect") >= 12  # one bar per layer
    assert dom.count("<tr") >= 12 + 2  # table rows after the page's scripts ran
    png = tmp_path / "shot.png"
    subprocess.run(base + ["--window-size=1200,1600", f"--screenshot={png}", html.as_uri()], capture_output=True,
                   timeout=120)
    assert png.exists() and os.path.getsize(png) > 20_000  # a page with charts, not a blank one
