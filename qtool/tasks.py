"""What a user may say an output means (`--task` on eval and quantize), where qtool's guess is wrong.

The names are those of eval's kinds (qtool/evaluate/kinds/): each says which figures an output gets. A few
other words people use lead to them (ALIASES).
"""
from __future__ import annotations

TASKS = {
    "classifier": "class scores: top-1 agreement over the last axis (per sample for [N, C], per position for "
                  "[N, T, C])",
    "sequence": "a distribution at each position [N, T, C]: top-1 per position, and texts after greedy CTC "
                "decoding where it looks like CTC",
    "detector": "rows of boxes and scores [N, R, K] (or [N, K, R]): the top-scoring rows shared",
    "encoder": "vectors: token states [N, T, H] mean-pooled over the attention mask, or one vector per sample: "
               "cosine, nearest-neighbour agreement, rank correlation of pair similarities",
    "maps": "values judged by their magnitude alone (SQNR, max |error|): maps, features, regressions",
}
ALIASES = {"classes": "classifier", "ctc": "sequence", "tagger": "sequence", "detection": "detector",
           "embedding": "encoder", "embeddings": "encoder", "vectors": "encoder", "regression": "maps"}
NAMES = tuple(TASKS) + tuple(ALIASES)


def task_name(word: str) -> str:
    """The task a word names (an alias leads to its task); ValueError for none."""
    w = word.strip().lower()
    if w in TASKS:
        return w
    if w in ALIASES:
        return ALIASES[w]
    raise ValueError(f"unknown task {word!r}; choose one of {', '.join(TASKS)} (or {', '.join(ALIASES)})")


def parse_tasks(specs) -> dict:
    """{output name, or "" for every output: task} from entries "TASK" or "OUTPUT=TASK" (a string or an
    iterable of them); ValueError for an unknown task. An output named by itself wins over "" (every output)."""
    if isinstance(specs, str):
        specs = [specs]
    out = {}
    for s in specs or ():
        name, _, word = s.rpartition("=")
        out[name] = task_name(word)
    return out


def task_for(tasks: dict, output: str) -> str | None:
    """The task the user gave `output` (by name, else for every output), or None: guessed."""
    return tasks.get(output, tasks.get(""))
