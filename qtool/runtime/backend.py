"""Which kernel implementation the runtime calls: the native extension (qtool.kernels),
else its numpy reference (qtool.kernels.reference), else the runtime's own numpy stand-in.
All three share the signatures of qtool/kernels/API.md."""
from __future__ import annotations

import os

_REQUIRED = ("pack_conv2d", "conv2d", "pack_gemm", "gemm", "add", "maxpool2d", "avgpool2d",
             "global_avgpool", "concat")


def _complete(mod):
    return all(hasattr(mod, f) for f in _REQUIRED)


def load_backend(prefer: str | None = None):
    """-> (module, name). prefer: 'native' | 'reference' | 'numpy' | None (best available);
    env QTOOL_RUNTIME_BACKEND sets the default."""
    prefer = prefer or os.environ.get("QTOOL_RUNTIME_BACKEND") or None
    order = ["native", "reference", "numpy"]
    if prefer:
        order = order[order.index(prefer):]
    for name in order:
        try:
            if name == "native":
                import qtool.kernels as mod
                if not hasattr(mod, "_native") and not getattr(mod, "NATIVE", False):
                    import qtool.kernels._native  # noqa: F401  (raises if not built)
            elif name == "reference":
                from qtool.kernels import reference as mod
            else:
                from qtool.runtime import npkernels as mod
        except ImportError:
            continue
        if _complete(mod):
            return mod, name
    from qtool.runtime import npkernels
    return npkernels, "numpy"


def pool_spin_us(mod) -> float | None:
    """How long the backend's idle pool workers spin before sleeping (None: no pool)."""
    try:
        return mod.get_spin_us()
    except AttributeError:  # the numpy backends, or an extension built before the pool had a timed spin
        return None


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    import platform
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_info(mod) -> dict:
    try:
        return mod.info()
    except Exception:  # the reference module may have no info()
        return {"isa": "numpy", "supported": {}, "num_threads": 1}


def conv_multiplier(mod, x_scale, w_scales, y_scale):
    import numpy as np
    f = getattr(mod, "conv_multiplier", None)
    if f is not None:
        return np.asarray(f(x_scale, w_scales, y_scale), np.float32)
    return ((np.float32(x_scale) * np.asarray(w_scales, np.float32)).astype(np.float32) / np.float32(y_scale)).astype(np.float32)
