"""A recurrent layer's last states among a model's outputs: vectors, never classes."""
from __future__ import annotations

from qtool import graph as G

RECURRENT = ("LSTM", "GRU", "RNN")
STATE_CARRIERS = ("Identity", "Squeeze", "Unsqueeze", "Reshape", "Transpose", "Flatten")


def recurrent_states(model) -> set:
    """The graph outputs that are a recurrent layer's last states (its outputs 1 and 2: Y_h, Y_c), directly or
    through ops that only reshape them: a streaming model's carried state, vectors with no classes."""
    prod = G.producers(model)
    states = set()
    for o in model.graph.output:
        t = o.name
        while t in prod and prod[t].op_type in STATE_CARRIERS:
            t = prod[t].input[0]
        n = prod.get(t)
        if n is not None and n.op_type in RECURRENT and list(n.output).index(t) >= 1:
            states.add(o.name)
    return states
