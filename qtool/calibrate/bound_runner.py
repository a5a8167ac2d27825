"""ONNX Runtime runs of the observing graph into output buffers bound once per batch size (BoundRunner)."""
from __future__ import annotations

import numpy as np

from qtool.errors import QtoolError


class BoundRunner:
    """Runs the session into output buffers allocated once per batch size.

    Letting ONNX Runtime allocate fresh outputs for every run costs more than the
    inference itself when dozens of activations are read out (allocation, page faults,
    copies); bound buffers are written in place. The first run, and any whose outputs
    do not scale with the batch, goes the ordinary way."""

    def __init__(self, sess, names: list):
        self.sess, self.names = sess, names
        self.shapes = {}  # per-sample input shapes -> per-sample output shapes (None: not batch-major)
        self.per_sample_bytes = None
        self.bufs = {}  # (input shapes, batch) -> (io_binding, [arrays])

    def run(self, feeds: dict) -> list:
        n = len(next(iter(feeds.values()))) if feeds else 1
        sig = tuple((k, np.shape(v)[1:]) for k, v in sorted(feeds.items()))
        if sig not in self.shapes:
            outs = self.sess.run(self.names, feeds)
            # (a sequence output, SplitToSequence's or an If's, comes back as a list of arrays)
            # (the largest of the input shapes met: a larger image later must not overfill the slices)
            self.per_sample_bytes = max(self.per_sample_bytes or 0,
                                        max(1, sum(getattr(o, "nbytes", 0) for o in outs) // max(n, 1)))
            if n < 2:
                # one sample tells nothing: a transformer's position embeddings are [1, T, C] whatever the batch
                return outs
            batch_major = all(isinstance(o, np.ndarray) and o.ndim >= 1 and o.shape[0] == n for o in outs)
            self.shapes[sig] = [o.shape[1:] for o in outs] if batch_major else None
            return outs
        if self.shapes[sig] is None or any(np.asarray(v).dtype.kind in "OSU" for v in feeds.values()):
            # (ONNX Runtime binds no string tensor: a model that takes text runs the ordinary way)
            return self.sess.run(self.names, feeds)
        key = (sig, n)
        fresh = key not in self.bufs
        if fresh:
            if len(self.bufs) >= 2:  # a new batch size or image size: drop the old buffers
                self.bufs.clear()
            arrays = [None if name in feeds else np.empty((n,) + tuple(sh), np.float32)
                      for name, sh in zip(self.names, self.shapes[sig])]
            io = self.sess.io_binding()
            for name, arr in zip(self.names, arrays):
                if arr is not None:  # a model input read back as an output is served from the feed
                    io.bind_output(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)
                else:
                    io.bind_output(name, "cpu")
            self.bufs[key] = [io, arrays, set()]
        io, arrays, fetch = self.bufs[key]
        for name, value in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(value))
        try:
            self.sess.run_with_iobinding(io)
        except QtoolError:
            # an output whose length the data decides (a Loop that stops at an end token: SLANet's
            # decoder) no longer fits the buffer the first batch sized: ordinary runs from here on
            self.shapes[sig] = None
            self.bufs.clear()
            return self.sess.run(self.names, feeds)
        if fresh:
            # ONNX Runtime may hand back its own tensor instead of filling a bound buffer:
            # those outputs are read from the binding on every run
            for i, (ov, arr) in enumerate(zip(io.get_outputs(), arrays)):
                if arr is not None and ov.data_ptr() != arr.ctypes.data:
                    fetch.add(i)
        if not fetch:
            return [feeds[nm] if a is None else a for nm, a in zip(self.names, arrays)]
        got = io.get_outputs()
        return [feeds[nm] if a is None else (got[i].numpy() if i in fetch else a)
                for i, (nm, a) in enumerate(zip(self.names, arrays))]
