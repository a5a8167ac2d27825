"""How many samples eval runs at once: fewer where one sample's activations are large."""
from __future__ import annotations

import numpy as np

from qtool import graph as G

EVAL_MEMORY = 1 << 30  # about what the fp32 and int8 sessions' activations may take together


def eval_batch(model, data, path: str, files: list | None, batch: int) -> int:
    """Samples per run for a folder of tensors: fewer where one sample's activations are large (afis's
    fingerprint network: 31 MB tensors, each ORT session 2.0 GB at 8 samples, 0.33 GB at 1; eval peaked
    at 3.9 GB). About 8 x its largest tensor per sample and session, from shape inference on the first."""
    from qtool.data.tensors import tensor_source
    try:
        probe = tensor_source(data, model, path, batch=1, files=files, limit=1)
        _, feeds = next(iter(probe.batches()))
    except Exception:  # (a shape inference that cannot follow the graph: the default batch)
        return batch
    return batch_for_memory(model, feeds, batch)


def batch_for_memory(model, feeds: dict, batch: int) -> int:
    """`batch`, or fewer where one sample's (`feeds`) largest tensor is large: about 8 x it per sample and
    session within EVAL_MEMORY."""
    from qtool.limits import elems
    try:
        dims = G.inferred_shapes(model, {k: np.shape(v) for k, v in feeds.items()}).values()
        largest = max((elems(d) * 4 for d in dims if d and all(isinstance(x, int) for x in d)), default=0)
    except Exception:  # (a shape inference that cannot follow the graph: the default batch)
        return batch
    return int(max(1, min(batch, EVAL_MEMORY // (2 * 8 * largest)))) if largest else batch
