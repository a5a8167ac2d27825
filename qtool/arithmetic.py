"""The integer arithmetic a runtime applies to an int8 layer, and which weights it is exact for.

Two arithmetics run the same QDQ model:

  exact           acc = sum((x_u8 - x_zp) * w) + bias in int32: ONNX Runtime on CPUs with
                  VNNI (vpdpbusd), AMX or ARM dot products, ORT with uint8 weights anywhere,
                  and qtool's own kernels everywhere.
  ort-x86-novnni  ONNX Runtime's u8 x s8 Conv/Gemm/MatMul on x86 without VNNI (AVX2 and
                  AVX-512BW without VNNI: AMD Zen 2/3, Intel before Cascade Lake). MLAS
                  multiplies the *raw* uint8 activations with the int8 weights by vpmaddubsw,
                  which adds two neighbouring products into a saturating int16 before they are
                  widened and summed in int32; the zero point comes off afterwards, as
                  x_zp * sum(w). Neighbours are consecutive positions along K in the order the
                  kernel reads it: for Conv (kh, kw, cin) flattened with cin fastest (pairs cross
                  taps when cin is odd; padding reads x_zp), for Gemm/MatMul the reduction axis;
                  pairs start at even K and an odd K is padded with a zero weight. Depthwise
                  convolution sums in int32 and is exact. (Checked bit for bit against ORT 1.32
                  on an AMD EPYC Zen 3: ../shared/ort-x86-avx2, tests/test_arithmetic.py.)

A pair (w_a, w_b) can saturate for some uint8 input only if the weights have the same sign and
|w_a + w_b| > 128: 255 * 128 = 32640 fits in int16, 255 * 129 does not (opposite signs never
exceed 255 * 127). A layer none of whose pairs can is exact under both arithmetics; that is the
constraint the portable target's weights satisfy (qtool/quantize/encoding.py).
"""
from __future__ import annotations

import numpy as np

EXACT = "exact"
ORT_X86_NOVNNI = "ort-x86-novnni"
ARITHMETICS = (EXACT, ORT_X86_NOVNNI)

PAIR_LIMIT = 128  # largest |w_a + w_b| of a same-sign pair that no uint8 input can saturate
I16_MIN, I16_MAX = -(2 ** 15), 2 ** 15 - 1


def check_arithmetic(name: str) -> str:
    if name not in ARITHMETICS:
        raise ValueError(f"unknown arithmetic {name!r}; choose one of {', '.join(ARITHMETICS)}")
    return name


def conv_rows(w: np.ndarray) -> np.ndarray:
    """Conv weight [Cout, Cin_g, K1, ..., Kn] -> [Cout, K1*...*Kn*Cin_g], each row in the K order
    the kernels read (taps, then cin fastest; ORT reorders any rank so): the order in which
    neighbours form pairs."""
    w = np.asarray(w)
    return np.ascontiguousarray(np.moveaxis(w, 1, -1).reshape(w.shape[0], -1))


def is_depthwise(w_shape, group: int) -> bool:
    """One input channel per group and one output per input: ORT's depthwise kernel, exact."""
    return len(w_shape) >= 3 and group > 1 and w_shape[1] == 1 and w_shape[0] == group


def can_saturate(a, b):
    """Whether int weights a and b, neighbours in a pair, can leave int16 for some uint8 input:
    the same sign and |a + b| > 128 (elementwise)."""
    return (np.asarray(a) * np.asarray(b) > 0) & (np.abs(np.asarray(a) + np.asarray(b)) > PAIR_LIMIT)


def pair_sums(rows: np.ndarray) -> np.ndarray:
    """[N, K] int weights -> [N, ceil(K/2)] of the same-sign pair magnitudes |w_a + w_b| (0 for a
    pair of opposite signs or with a zero, which cannot saturate; an odd K pairs its last weight
    with a zero)."""
    r = np.asarray(rows, np.int64)
    if r.shape[1] % 2:
        r = np.pad(r, ((0, 0), (0, 1)))
    a, b = r[:, 0::2], r[:, 1::2]
    return np.where(a * b > 0, np.abs(a + b), 0)


def saturating_pairs(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(output channel, first K index) of every pair of `rows` ([N, K], K order) that some uint8
    input drives out of int16."""
    n, j = np.nonzero(pair_sums(rows) > PAIR_LIMIT)
    return n, 2 * j


def saturation_correction(a: np.ndarray, rows: np.ndarray, pairs) -> np.ndarray:
    """What ORT-x86-novnni adds to the exact accumulators: sum over the saturating `pairs` of
    sat16(a_k w_k + a_k+1 w_k+1) - (a_k w_k + a_k+1 w_k+1). `a` [M, K] raw uint8 activations
    (x_zp where the kernel reads padding), `rows` [N, K] int weights -> int64 [M, N]."""
    n_idx, k0 = pairs
    m, k = a.shape
    out = np.zeros((m, rows.shape[0]), np.int64)
    if len(n_idx) == 0:
        return out
    r = np.asarray(rows, np.int64)
    if k % 2:
        a = np.pad(a, ((0, 0), (0, 1)))
        r = np.pad(r, ((0, 0), (0, 1)))
    order = np.argsort(n_idx, kind="stable")  # pairs grouped by output channel, summed per group
    n_idx, k0 = n_idx[order], k0[order]
    chans, starts = np.unique(n_idx, return_index=True)
    w0, w1 = r[n_idx, k0], r[n_idx, k0 + 1]
    step = max(1, (1 << 22) // len(n_idx))  # bound the [rows, pairs] temporaries
    for s in range(0, m, step):
        blk = a[s:s + step].astype(np.int64)
        p = blk[:, k0] * w0 + blk[:, k0 + 1] * w1
        c = np.clip(p, I16_MIN, I16_MAX) - p
        out[s:s + step, chans] += np.add.reduceat(c, starts, axis=1)
    return out
