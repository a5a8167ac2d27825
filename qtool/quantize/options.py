"""What the user chose for `quantize`, declared once: the CLI and the Python API build one
QuantizeOptions and pass it whole; the pipeline's steps read it.

    from qtool.quantize.options import ExclusionOptions, QuantizeOptions
    QuantizeOptions(method="auto", target="vnni", exclusion=ExclusionOptions(enabled=True, max_excluded=3))
"""
from __future__ import annotations

from dataclasses import dataclass, field

from qtool.quantize.encoding import DEFAULT_TARGET
from qtool.tasks import task_name

USER_EXCLUDED = "excluded by the user (--exclude)"


@dataclass(frozen=True)
class SensitivityOptions:
    """The per-layer sensitivity report (sensitivity.json and .html)."""
    enabled: bool = True
    samples: int | None = None  # calibration images it measures on; None: split.sensitivity_samples(the model)


@dataclass(frozen=True)
class ExclusionOptions:
    """--exclude-sensitive: keep the most sensitive layers fp32 until a target holds (exclude.py)."""
    enabled: bool = False
    target_agreement: float = 0.995
    max_drop: float | None = None  # accuracy drop in points to accept instead, where labels are known
    max_excluded: int = 8  # layers kept fp32 at most (a block counts each of its layers: exclude.BLOCKS)
    labels: str | None = None  # labels file for max_drop (else the calibration folder's class folders, if any)


@dataclass(frozen=True)
class QuantizeOptions:
    """Every choice of one `quantize` run. `model`, `table`: the fp32 model and the calibration table
    (None: the working directory's); `output`: the int8 model (None: WORKDIR/model.int8.onnx).
    `method`: None keeps calibrate's; auto, minmax, percentile, entropy, mse (METHOD+flat too).
    `exclude`: node names kept fp32. `rounding`: output-aware weight rounding (None: on, the default).
    `tune_ranges`: activation ranges chosen at the output (None: off). `target` (encoding.TARGETS).
    `strict`: an optional step that fails is an error, not a fallback with a warning. `verify`: hold
    samples out of the fitting steps and keep each step only where it measures better on them.
    `progress`: progress bars. `task`: what the output quantize judges by means, where the guess is wrong
    (qtool.tasks; None: guessed): "encoder" judges --exclude-sensitive's target by the vectors' cosine and
    nearest neighbours. `ray`: the simulated experiments (sensitivity, range tuning) on a Ray cluster
    (distributed/cluster.py: "local", "auto" or "ray://host:port"); the same int8 model as one process."""
    model: str | None = None
    table: str | None = None
    output: str | None = None
    method: str | None = None
    exclude: tuple = ()
    bias_correction: bool = True
    rounding: bool | None = None
    tune_ranges: bool | None = None
    target: str = DEFAULT_TARGET
    strict: bool = False
    verify: bool = False
    progress: bool = True
    task: str | None = None
    sensitivity: SensitivityOptions = field(default_factory=SensitivityOptions)
    exclusion: ExclusionOptions = field(default_factory=ExclusionOptions)
    ray: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "exclude", tuple(dict.fromkeys(self.exclude)))  # (a list given: a tuple, each once)
        if self.task is not None:  # (an alias given: the task it names; an unknown word: ValueError)
            object.__setattr__(self, "task", task_name(self.task))

    @property
    def sensitivity_on(self) -> bool:
        """The sensitivity analysis runs: asked for, or needed by --exclude-sensitive."""
        return self.sensitivity.enabled or self.exclusion.enabled

    def user_exclusions(self) -> dict:
        """node -> reason, for the nodes the user keeps fp32."""
        return {n: USER_EXCLUDED for n in self.exclude}


# run.quantize without options (a library call inside a script, a test): no sensitivity report, no bars
BARE = QuantizeOptions(sensitivity=SensitivityOptions(enabled=False), progress=False)
