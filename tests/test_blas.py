"""qtool.blas: numpy's BLAS thread count set for a block and restored after it."""
import numpy as np
import pytest

from qtool import blas


def test_blas_threads_apply_inside_the_block_and_restore_after():
    before = blas.threads()
    if not before:
        pytest.skip("no BLAS library qtool knows is loaded")
    a = np.random.default_rng(0).standard_normal((64, 64))
    with blas.blas_threads(1):
        assert blas.threads() == [1] * len(before)
        inside = a @ a
    assert blas.threads() == before
    np.testing.assert_allclose(inside, a @ a)


def test_blas_threads_restore_after_an_error():
    before = blas.threads()
    with pytest.raises(RuntimeError), blas.blas_threads(1):
        raise RuntimeError("inside")
    assert blas.threads() == before


def test_quantize_runs_on_one_blas_thread(monkeypatch, tmp_path):
    from qtool.quantize import run
    seen = []
    monkeypatch.setattr(run, "_quantize", lambda *a, **k: seen.append(blas.threads()))
    run.quantize(workdir=str(tmp_path))
    assert seen and all(n == 1 for n in seen[0])
