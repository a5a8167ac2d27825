"""What a calibration is asked to do, declared once: the command and the Python API build a
CalibrateOptions, and calibrate (run.py) passes it down whole."""
from __future__ import annotations

from dataclasses import dataclass, field

from qtool.calibrate.budget import DEFAULT_GMAC
from qtool.calibrate.methods import AUTO, DEFAULT_METHOD, METHODS
from qtool.errors import UsageError
from qtool.limits import MAX_BATCH


@dataclass(frozen=True)
class Sampling:
    """Which of the data's samples the pass reads, and how many at a time. `every`: every N-th sample of
    the sorted folder (index % N == 0), e.g. a fixed calibration split; `limit`: at most this many;
    `budget_gmac`: a heavy model calibrates on fewer samples, spread over the data (budget.py; 0: all)."""
    batch: int = 4
    limit: int | None = None
    every: int = 1
    budget_gmac: float = DEFAULT_GMAC


@dataclass(frozen=True)
class CalibrateOptions:
    """`config` (images only): a preset name, a TOML path, a dict or a Preprocess; None takes the model's
    metadata, else assumes the torchvision ImageNet preset for a 3-channel input, sized to the model
    (data/config.py). `method`: the default range method recorded for quantize (every method's ranges are
    kept). `threads`: ONNX Runtime threads (0: all cores, up to 8). `ray`: the pass sharded over a Ray
    cluster (distributed/cluster.py: "local", "auto" or "ray://host:port"); the same table as one process."""
    config: object = None
    method: str = DEFAULT_METHOD
    threads: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    show_progress: bool = True
    ray: str | None = None

    def check(self) -> None:
        """One UsageError for the first option out of range (the command's click types check the same)."""
        if self.method not in METHODS and self.method != AUTO:
            raise UsageError(f"unknown calibration method '{self.method}' (choose from {', '.join(METHODS)}, {AUTO})")
        s = self.sampling
        check_counts(batch=s.batch, limit=s.limit, every=s.every, threads=self.threads)
        b = s.budget_gmac
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not b >= 0:
            raise UsageError(f"--budget-gmac must be 0 (no budget) or more, not {b!r}")


def check_counts(**options) -> None:
    """Numeric options: batch 1..MAX_BATCH, limit None or >= 1, every >= 1, threads >= 0."""
    for name, v in options.items():
        if name == "limit" and v is None:
            continue
        lo, hi = {"batch": (1, MAX_BATCH), "threads": (0, 1024)}.get(name, (1, None))
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise UsageError(f"--{name} must be an integer {'from ' + str(lo) + ' to ' + str(hi) if hi else str(lo) + ' or more'}"
                             f", not {v!r}")
