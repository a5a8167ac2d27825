"""Shared fixtures: a calibrated small conv net in a working directory (built once per session)."""
from __future__ import annotations

import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# every quantize in the suite is --strict: an optional step that fails is a test failure, not a fallback
# (tests of the fallback itself pass strict=False, or unset this)
os.environ["QTOOL_STRICT"] = "1"

import helpers  # noqa: E402


@pytest.fixture(scope="session")
def calibrated(tmp_path_factory):
    """(root, model path, data folder, config path, CalibrateResult) for helpers.small_convnet()."""
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions, Sampling

    root = tmp_path_factory.mktemp("calibrated")
    model = helpers.save(helpers.small_convnet(), root / "net.onnx")
    data = root / "data"
    helpers.write_images(data, 6, seed=1)
    cfg = helpers.write_config(root / "cfg.toml")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(model, str(data),
                      CalibrateOptions(config=cfg, method="minmax", threads=1,
                                       sampling=Sampling(batch=4), show_progress=False),
                      workdir=str(root / "work"))
    return root, model, str(data), cfg, r
