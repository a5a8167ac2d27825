"""How many threads numpy's BLAS may use, for a stretch of qtool's own work.

quantize's numpy matrix products are many and small (a layer's [C, K] x [K, K] gradient, one
batch's patch covariance) and run between ONNX Runtime calls that have their own threads.
OpenBLAS's threads wait for work by spinning and yielding: on a 2-core machine with two other busy
processes, PP-OCRv5's recognizer spent 343 s in output-aware rounding with OpenBLAS on 2 threads
and 10 s on one (7.6 s and 6.4 s idle). So quantize runs its numpy on one BLAS thread.

No dependency for it: the BLAS library numpy loaded is found in the process's mapped files and told
through its own C call (what threadpoolctl does). A BLAS this does not know is left alone.
"""
from __future__ import annotations

import contextlib
import ctypes
import os

# (file name contains, (setter, getter) symbol pairs tried in order)
_KNOWN = (
    ("openblas", (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
                  ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
                  ("openblas_set_num_threads", "openblas_get_num_threads"))),
    ("mkl_rt", (("MKL_Set_Num_Threads", "MKL_Get_Max_Threads"),)),
)
_controls: list | None = None


def _loaded_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    except OSError:  # not Linux: the BLAS is left as it is
        return []
    return sorted(p for p in paths if ".so" in os.path.basename(p))


def _find() -> list:
    """(set(n), get()) of each BLAS library this process has loaded, found once."""
    global _controls
    if _controls is None:
        import numpy  # noqa: F401  (numpy loads its BLAS on import)
        found = []
        for path in _loaded_libraries():
            name = os.path.basename(path).lower()
            for key, pairs in _KNOWN:
                if key not in name:
                    continue
                try:
                    lib = ctypes.CDLL(path)
                except OSError:
                    continue
                for setter, getter in pairs:
                    if hasattr(lib, setter) and hasattr(lib, getter):
                        found.append((getattr(lib, setter), getattr(lib, getter)))
                        break
        _controls = found
    return _controls


def threads() -> list[int]:
    """The thread count of each BLAS found (empty: none found)."""
    return [int(get()) for _, get in _find()]


@contextlib.contextmanager
def blas_threads(n: int = 1):
    """numpy's BLAS on `n` threads inside the block, as it was after."""
    controls = _find()
    before = [int(get()) for _, get in controls]
    for set_, _ in controls:
        set_(ctypes.c_int(n))
    try:
        yield
    finally:
        for (set_, _), b in zip(controls, before):
            set_(ctypes.c_int(b))
