"""What each output of a model is taken to be before its values are seen: from the graph (a recurrent layer's
last states, an encoder's vectors and the model's attention mask) and from the user (--task)."""
from __future__ import annotations

from dataclasses import dataclass

from qtool.encoders import EncoderOutput, encoder_outputs, mask_input
from qtool.evaluate.states import recurrent_states
from qtool.tasks import parse_tasks, task_for


@dataclass(frozen=True)
class Meaning:
    state: bool = False  # a recurrent layer's last state (states.recurrent_states): vectors, no classes
    encoder: EncoderOutput | None = None  # the graph shows an encoder's vectors (encoders.encoder_outputs)
    task: str | None = None  # what the user says it is (tasks.TASKS); None: guessed
    mask: str | None = None  # the model's attention-mask input (encoders.mask_input), to pool token states over


def output_meanings(model, names: list, tasks=()) -> dict:
    """output name -> Meaning, for `names` of `model`; `tasks`: the user's --task entries (tasks.parse_tasks)."""
    given = parse_tasks(tasks)
    states, encoders, mask = recurrent_states(model), encoder_outputs(model), mask_input(model)
    return {n: Meaning(n in states, encoders.get(n), task_for(given, n), mask) for n in names}
