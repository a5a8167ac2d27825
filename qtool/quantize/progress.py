"""Progress bars of quantize's steps (tqdm, off with -q or from the Python API's verbose=False)."""
from __future__ import annotations

from tqdm import tqdm


def bar(total, unit: str, desc: str, show: bool):
    return tqdm(total=total, unit=unit, desc=desc, disable=not show, leave=False)


def whole(bar):
    """bar.update for progress told in fractions (the simulator reports a share of a variant per
    slice of samples): the bar moves by whole steps, so it reads 14/29, not 13.999999999999998/29."""
    done = [0.0, 0]

    def update(k):
        done[0] += k
        step = int(done[0] + 1e-9) - done[1]
        if step > 0:
            done[1] += step
            bar.update(step)
    return update
