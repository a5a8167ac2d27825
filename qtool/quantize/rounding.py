"""Weight rounding chosen by the layer's output error instead of to the nearest integer.

Rounding each weight to the nearest step minimises the error of each weight alone. What the
model sees is the layer's output error, dW x: for one output channel its mean square over the
calibration inputs is dw^T H dw, with H the covariance of the input patch the channel reads
(the mean part, dw . E[x], is removed afterwards by bias correction). Each weight may round
down or up (|dw| stays below one step, the format does not change); a few sweeps of exact
coordinate descent over those choices lower dw^T H dw, starting from nearest rounding, so it
never does worse than nearest on the calibration inputs (AdaRound, Nagel et al. 2020, poses
the same objective and relaxes it; here the binary choice is searched directly).

H is estimated from sampled patches; with few samples it is shrunk toward its diagonal
(weight K / (K + N) on the diagonal, K inputs per channel, N samples), under which nearest
rounding is already optimal: little data, little change.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from qtool import qparams as Q
from qtool.arithmetic import can_saturate
from qtool.encoders import mask_input, real_tokens
from qtool.quantize.encoding import project

try:  # the descent in C (src/rounding.c); the numpy loops below are its reference and the fallback
    from qtool.quantize import _rounding as _native
except ImportError:  # pragma: no cover - exercised when the extension is not built
    _native = None

SWEEPS = 4
MAX_POSITIONS = 1024  # sampled output positions per image and layer, at most
POSITIONS_PER_INPUT = 16  # and about this many per input of a patch (32 images: 512 samples per input), at least
MIN_POSITIONS = 64


class InputCovariance:
    """Streaming mean and centred sum of products of the patch vectors one layer's output channels
    read, per group. Patches come shifted by about their mean (the caller subtracts a per-channel
    mean before cutting them, where it is one pass over a smaller tensor) and are multiplied in
    float32 (BLAS sgemm: twice dgemm's speed, no float64 copy of tens of megabytes); each batch is
    merged in float64 by Chan et al.'s pairwise update. Centring is what keeps float32 from
    cancelling where a mean dwarfs the spread."""

    def __init__(self, groups: int, k: int):
        self.n = 0
        self.mean = np.zeros((groups, k))
        self.m2 = np.zeros((groups, k, k))

    def add(self, patches: np.ndarray, shift: np.ndarray | None = None) -> None:
        """`patches`: [G, N, K] float, each the patch minus `shift` ([G, K]; None: not shifted)."""
        g, n_b, k = patches.shape
        if n_b == 0:
            return
        p = np.ascontiguousarray(patches, np.float32)
        if shift is None:  # centre here
            shift = p.mean(axis=1, dtype=np.float64).astype(np.float32)
            p = p - shift[:, None, :]
        s1 = np.matmul(np.ones((g, 1, n_b), np.float32), p)[:, 0, :].astype(np.float64)  # (BLAS, not a strided sum)
        s2 = np.matmul(p.transpose(0, 2, 1), p)  # (BLAS: numpy's einsum here is 30x slower)
        mean_b = s1 / n_b + np.asarray(shift, np.float64)
        n = self.n + n_b
        delta = mean_b - self.mean
        self.m2 += s2
        self.m2 -= s1[:, :, None] * s1[:, None, :] / n_b  # (about the batch's own mean)
        self.m2 += delta[:, :, None] * delta[:, None, :] * (self.n * n_b / n)
        self.mean += delta * (n_b / n)
        self.n = n

    def hessian(self) -> np.ndarray:
        """[G, K, K] covariance, shrunk toward its diagonal when samples are few. Made in place of the
        accumulator, which it spends: two copies of every layer's covariance, up to COVARIANCES_BYTES
        each, took quantize to 3.3 GB on a 262-layer U-Net (czann)."""
        h, self.m2 = self.m2, None
        h /= max(self.n, 1)
        k = h.shape[-1]
        a = k / (k + self.n)
        idx = np.arange(k)
        diag = h[:, idx, idx]  # (a copy: fancy indexing)
        h *= 1 - a
        h[:, idx, idx] = diag
        return h


def conv_patches(x: np.ndarray, kernel, strides, pads, groups: int, rng, max_positions=MAX_POSITIONS,
                 shift: np.ndarray | None = None) -> np.ndarray:
    """[G, N, Cin_g * kh * kw] patches of `x` [B, Cin, H, W] at sampled output positions, in the
    order of w[o].ravel() for a weight [Cout, Cin_g, kh, kw]; with `shift` [Cin], patches of x - shift
    (padding included: it reads -shift). At most `max_positions` per image, and about
    POSITIONS_PER_INPUT per input of a patch: a depthwise layer's 9 inputs need far fewer than 1024."""
    b, cin, h, w = x.shape
    kh, kw = kernel
    sh, sw = strides
    pt, pl, pb, pr = pads
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    if shift is not None:
        xp -= np.asarray(shift, xp.dtype)[None, :, None, None]
    oh = (h + pt + pb - kh) // sh + 1
    ow = (w + pl + pr - kw) // sw + 1
    n = min(max_positions, max(MIN_POSITIONS, POSITIONS_PER_INPUT * (cin // groups) * kh * kw), oh * ow)
    cg = cin // groups
    out = np.empty((groups, b * n, cg * kh * kw), xp.dtype)
    for i in range(b):
        pos = rng.choice(oh * ow, n, replace=False) if n < oh * ow else np.arange(oh * ow)
        r0, c0 = (pos // ow) * sh, (pos % ow) * sw
        rr = r0[:, None, None] + np.arange(kh)[None, :, None]
        cc = c0[:, None, None] + np.arange(kw)[None, None, :]
        p = xp[i][:, rr, cc]  # [Cin, n, kh, kw]
        out[:, i * n:(i + 1) * n] = p.reshape(groups, cg, n, kh * kw).transpose(0, 2, 1, 3).reshape(groups, n, -1)
    # contiguous [G, N, K]: each group's [N, K] matrix is one BLAS operand (strided, numpy's generic
    # matmul loop took 2.5x longer on a depthwise layer)
    return out


def round_weights(w: np.ndarray, scale: np.ndarray, axis: int, hessian: np.ndarray | None,
                  sweeps: int = SWEEPS, partners: np.ndarray | None = None, w_max: int = Q.W_MAX) -> np.ndarray:
    """int8 weights (same shape as `w`) minimising sum over output channels of dw^T H_g dw, each
    weight rounded down or up. `hessian` [G, K, K]; w's output channels split evenly into G groups,
    each reading K inputs: Conv [Cout, Cin_g, kh, kw] (axis 0), or a [K, N] / [N, K] matrix.
    With `partners` (encoding.pair_partners) the result is pair-safe: see round_pair_safe."""
    if partners is not None:
        return round_pair_safe(w, scale, axis, hessian, partners, sweeps)
    wm = np.moveaxis(np.asarray(w, np.float64), axis, 0)
    cout = wm.shape[0]
    wm = wm.reshape(cout, -1)
    s = np.asarray(scale, np.float64).reshape(cout, 1)
    g = hessian.shape[0]
    v = wm / s
    v = np.where(np.abs(v - np.rint(v)) < 1e-4, np.rint(v), v)  # (a channel's largest weight sits on +-127)
    lo = np.clip(np.floor(v), -w_max, w_max)
    hi = np.clip(np.ceil(v), -w_max, w_max)
    q = Q.quantize_weight(wm, scale.reshape(-1), 0, w_max).astype(np.float64)  # nearest, half to even
    k = wm.shape[1]
    q = q.reshape(g, cout // g, k)
    lo, hi, wg, sg = (a.reshape(g, cout // g, -1) for a in (lo, hi, wm, np.broadcast_to(s, (cout, 1))))
    grad = np.matmul(q * sg - wg, hessian)
    descend(q, grad, hessian, sg[:, :, 0], sweeps, Moves(lo=lo, hi=hi))
    q = q.reshape(cout, *np.moveaxis(np.asarray(w), axis, 0).shape[1:])
    return np.moveaxis(q, 0, axis).astype(np.int8)


def round_pair_safe(w: np.ndarray, scale: np.ndarray, axis: int, hessian: np.ndarray | None,
                    partners: np.ndarray, sweeps: int = SWEEPS) -> np.ndarray:
    """int8 weights at `scale` in which no same-sign pair of ONNX Runtime's K order sums past 128
    (encoding.py). Start: nearest rounding, each offending pair trimmed to 128. With `hessian`,
    exact coordinate descent on dw^T H dw then moves single weights by one step (staying within
    a step of their unrounded value, or moving toward it) and shifts one step between the two
    weights of a pair at the limit, only ever to a pair-safe point: never worse than the start."""
    wm = np.moveaxis(np.asarray(w, np.float64), axis, 0)
    shape = wm.shape
    cout = shape[0]
    wm = wm.reshape(cout, -1)
    s = np.asarray(scale, np.float64).reshape(cout, 1)
    v = wm / s
    q = project(v, np.clip(np.rint(v), -Q.W_MAX, Q.W_MAX), partners).astype(np.float64)
    if hessian is not None:
        q = _descend_pair_safe(q, v, wm, s, hessian, partners, sweeps)
    return np.moveaxis(q.reshape(shape), 0, axis).astype(np.int8)


def _descend_pair_safe(q, v, wm, s, hessian, partners, sweeps):
    g = hessian.shape[0]
    cout, k = q.shape
    q, v, wg = (np.ascontiguousarray(a.reshape(g, cout // g, k)) for a in (q, v, wm))
    sg = np.ascontiguousarray(np.broadcast_to(s, (cout, 1)).reshape(g, cout // g, 1)[:, :, 0])
    grad = np.matmul(q * sg[:, :, None] - wg, hessian)
    descend(q, grad, hessian, sg, sweeps, Moves(v=v, partners=partners))
    return q.reshape(cout, k)


@dataclass(frozen=True)
class Moves:
    """Where the descent may move each weight: to `lo` or `hi` (plain rounding: the grid points either
    side of w / s), or one step at a time staying pair-safe (`v`: w / s, `partners`: encoding.pair_partners)."""
    lo: np.ndarray | None = None
    hi: np.ndarray | None = None
    v: np.ndarray | None = None
    partners: np.ndarray | None = None


def descend(q, grad, hessian, s, sweeps: int, moves: Moves, native: bool | None = None, threads: int = 0) -> None:
    """The coordinate descent on q [G, C, K] (float64, in place; grad = (q s - w) H kept current),
    each weight moved as `moves` allow.
    `native`: the C loop (None: when built), else the numpy reference; both give the same bits."""
    lo, hi, v, partners = moves.lo, moves.hi, moves.v, moves.partners
    use = _native is not None if native is None else native
    if not use:
        if partners is None:
            return _descend_reference(q, grad, lo, hi, s, hessian, sweeps)
        return _descend_pair_safe_reference(q, grad, v, s, hessian, partners, sweeps)
    g, c, k = q.shape
    f64 = lambda a: None if a is None else np.ascontiguousarray(a, np.float64)  # noqa: E731
    p = None if partners is None else np.ascontiguousarray(partners, np.int64)
    # the C loop reads every array as C-contiguous float64: a transposed weight (a MatMul's [K, N]
    # read per output channel) arrives as a strided view, so q and grad go through copies
    qc, gc = f64(q), f64(grad)
    _native.descend(qc, gc, f64(lo), f64(hi), f64(v), f64(s), f64(hessian), p, g, c, k, sweeps,
                    threads or min(os.cpu_count() or 1, 4))
    if qc is not q:
        q[...] = qc
    if gc is not grad:
        grad[...] = gc


def _descend_reference(q, grad, lo, hi, sg, hessian, sweeps):
    """numpy: every channel at once, weight after weight."""
    hd = np.einsum("gkk->gk", hessian)  # [G, K]
    for _ in range(sweeps):
        changed = False
        for j in range(q.shape[2]):
            alt = lo[:, :, j] + hi[:, :, j] - q[:, :, j]
            d = (alt - q[:, :, j]) * sg
            gain = 2 * d * grad[:, :, j] + d * d * hd[:, j][:, None]
            take = (gain < -1e-18) & (d != 0)
            if take.any():
                changed = True
                q[:, :, j] = np.where(take, alt, q[:, :, j])
                gi, ci = np.nonzero(take)  # only the channels that moved change their gradient
                grad[gi, ci, :] += d[gi, ci][:, None] * hessian[gi, j, :]
        if not changed:
            break


def _descend_pair_safe_reference(q, grad, v, sg, hessian, partners, sweeps):
    """numpy: every channel at once, weight after weight, then pair after pair."""
    k = q.shape[2]
    hd = np.einsum("gkk->gk", hessian)
    pairs = [(a, int(partners[a])) for a in range(k) if partners[a] > a]

    def safe(x, y):
        return ~can_saturate(x, y)

    def apply(j, take, d):
        q[:, :, j] = np.where(take, q[:, :, j] + d, q[:, :, j])
        gi, ci = np.nonzero(take)  # only the channels that moved change their gradient
        grad[gi, ci, :] += (d * sg)[gi, ci][:, None] * hessian[gi, j, :]

    for _ in range(sweeps):
        changed = False
        for j in range(k):
            p = partners[j]
            best_gain, best_d = np.zeros_like(sg), np.zeros_like(sg)
            for d in (-1.0, 1.0):
                alt = q[:, :, j] + d
                ok = (np.abs(alt) <= Q.W_MAX) & ((np.abs(alt - v[:, :, j]) < 1)
                                                 | (np.abs(alt - v[:, :, j]) < np.abs(q[:, :, j] - v[:, :, j])))
                if p >= 0:
                    ok &= safe(alt, q[:, :, p])
                dd = d * sg
                gain = np.where(ok, 2 * dd * grad[:, :, j] + dd * dd * hd[:, j][:, None], 0.0)
                better = gain < best_gain
                best_gain, best_d = np.where(better, gain, best_gain), np.where(better, d, best_d)
            take = best_gain < -1e-18
            if take.any():
                changed = True
                apply(j, take, best_d)
        for a, b in pairs:  # one step from one weight of a pair at the limit to the other
            qa, qb = q[:, :, a].copy(), q[:, :, b].copy()
            best_gain, best_d = np.zeros_like(sg), np.zeros_like(sg)
            for d in (-1.0, 1.0):
                na, nb = qa + d, qb - d
                ok = (np.abs(na) <= Q.W_MAX) & (np.abs(nb) <= Q.W_MAX) & safe(na, nb) & (qa * qb > 0)
                da, db = d * sg, -d * sg
                gain = (2 * da * grad[:, :, a] + 2 * db * grad[:, :, b] + da * da * hd[:, a][:, None]
                        + db * db * hd[:, b][:, None] + 2 * da * db * hessian[:, a, b][:, None])
                gain = np.where(ok, gain, 0.0)
                better = gain < best_gain
                best_gain, best_d = np.where(better, gain, best_gain), np.where(better, d, best_d)
            take = best_gain < -1e-18
            if take.any():
                changed = True
                apply(a, take, best_d)
                apply(b, take, -best_d)
        if not changed:
            break


# memory and time bounds: a layer beyond them keeps nearest rounding (VGG16's first Gemm reads 25088
# inputs: its covariance alone would be 4.7 GB, its descent hours)
MAX_COVARIANCE_BYTES = 256 << 20  # one layer's [G, K, K] float64 covariance
COVARIANCES_BYTES = 1 << 30  # every layer's together
MAX_DESCENT_WORK = 2e10  # output channels x K x K: the descent's cost per sweep, at most
ACTIVATIONS_BYTES = 256 << 20  # layer inputs fetched from one run of the fp32 graph


def rounding_layers(fused, exclude: dict | None = None) -> tuple:
    """({node name: (input tensor, InputCovariance, conv geometry or None)} of the int8 layers whose
    weights output-aware rounding can round, {node name: why not} of those it leaves to nearest)."""
    from qtool import graph as G
    from qtool.plan import make_plan
    from qtool.rules import RULES

    plan = make_plan(fused, exclude)
    inits = G.initializers(fused)
    layers, skipped, total = {}, {}, 0
    for node in fused.graph.node:
        if node.name not in plan.weight_inputs:
            continue
        spec = RULES[node.op_type].weight(node, fused)
        if spec is None:
            continue
        w = inits[node.input[spec[0]]]
        if node.op_type == "Conv":
            if len(w.dims) != 4 or any(d != 1 for d in G.attr(node, "dilations", [1, 1])):
                continue
            groups = G.attr(node, "group", 1)
            kh, kw = w.dims[2], w.dims[3]
            g, k, cout = groups, w.dims[1] * kh * kw, w.dims[0]
            conv = dict(kernel=(kh, kw), strides=tuple(G.attr(node, "strides", [1, 1])),
                        pads=tuple(G.attr(node, "pads", [0, 0, 0, 0])), groups=groups)
        elif len(w.dims) == 2 and not G.attr(node, "transA", 0):
            g, k, cout = 1, (w.dims[1] if spec[1] == 0 else w.dims[0]), w.dims[spec[1]]
            conv = None
        else:
            continue
        size = 8 * g * k * k
        if size > MAX_COVARIANCE_BYTES or cout * k * k > MAX_DESCENT_WORK:
            skipped[node.name] = f"{k} inputs per output channel: too large to round by output error"
            continue
        if total + size > COVARIANCES_BYTES:
            skipped[node.name] = "the covariances of the layers before it filled the memory budget"
            continue
        total += size
        layers[node.name] = (plan.weight_inputs[node.name], InputCovariance(g, k), conv)
    return layers, skipped


def fetch_groups(fused, names: list, one: dict) -> list:
    """`names` in groups whose values for one sample (the feed `one`) fit ACTIVATIONS_BYTES together,
    each with the samples per run that keep it there: [(names, samples per run)]. A tensor of
    unknown size goes alone, one sample at a time."""
    from qtool import graph as G

    shapes = G.inferred_shapes(fused, {k: v.shape for k, v in one.items()})
    groups, cur, used = [], [], 0
    for n in names:
        dims = shapes.get(n)
        size = 4 * int(np.prod(dims)) if dims and all(d for d in dims) else None
        if size is None:
            groups.append(([n], 1))
            continue
        if cur and used + size > ACTIVATIONS_BYTES:
            groups.append((cur, max(1, ACTIVATIONS_BYTES // used)))
            cur, used = [], 0
        cur.append(n)
        used += size
    if cur:
        groups.append((cur, max(1, ACTIVATIONS_BYTES // max(used, 1))))
    return groups


def _slices(feeds, step: int):
    """(input dict, samples in it) of at most `step` samples at a time, from a SampleSet or a list of
    input dicts [N, ...]."""
    from qtool.quantize.samples import SampleSet
    if isinstance(feeds, SampleSet):
        step = 1 if feeds.stacked else feeds.batch if feeds.fixed_batch else step
        for a, b in feeds.spans(step):
            yield feeds.feed(a, b), b - a
        return
    for feed in feeds:
        n = len(next(iter(feed.values())))
        for a in range(0, n, step):
            yield {k: v[a:a + step] for k, v in feed.items()}, min(step, n - a)


SEED = 0  # the patches sampled from large convolution inputs (conv_patches)
CHUNK = 4  # samples per run, at most


def layer_hessians(fused, feeds, exclude: dict | None = None, threads: int = 0, progress=None, on_error=None,
                   skipped: dict | None = None, only: frozenset | None = None) -> dict:
    """node name -> [G, K, K] input covariance of every int8 layer with a weight, from the fp32
    graph run on calibration `feeds` (a SampleSet, or a list of input dicts), at most CHUNK samples at a time (fewer
    where the layer inputs are large: ACTIVATIONS_BYTES; a model whose layer inputs do not fit
    it at once runs once per group of them); `progress(k)` is told of k more samples.
    `on_error(layer, exception)`: a layer whose covariance fails is told and left out (nearest
    rounding); without it the exception propagates. `skipped` gets the layers left to nearest
    rounding by the bounds (rounding_layers). `only`: the covariances of these layers alone (a Ray worker's
    share, quantize/sharded.py); every other convolution's positions are drawn all the same, so that each
    covariance is the one the whole run makes."""
    from qtool.ortsession import session, with_outputs

    layers, too_big = rounding_layers(fused, exclude)
    if skipped is not None:
        skipped.update(too_big)
    if not layers or not len(feeds):
        return {}
    names = sorted({x for x, _, _ in layers.values()})
    groups = fetch_groups(fused, names, next(_slices(feeds, 1))[0])
    mask_name = mask_input(fused)
    rng = np.random.default_rng(SEED)
    failed = set()
    for gi, (group, per_run) in enumerate(groups):
        sess = session(with_outputs(fused, group), threads)
        mine = [(name, x, acc, conv) for name, (x, acc, conv) in layers.items() if x in group]
        step = max(1, min(CHUNK, per_run))
        for feed, n in _slices(feeds, step):
            outs = dict(zip(group, sess.run(group, feed)))
            for name, x_name, acc, conv in mine:
                if name in failed:
                    continue
                try:
                    if only is None or name in only:
                        _add(acc, _real_tokens(outs[x_name], feed.get(mask_name), conv), conv, rng)
                    elif conv is not None and outs[x_name].ndim == 4:  # (its draws, without its sums)
                        conv_patches(outs[x_name], rng=rng, **conv)
                except Exception as e:
                    if on_error is None:
                        raise
                    failed.add(name)
                    on_error(name, e)
            del outs
            if progress:
                progress(n / len(groups))
        del sess
    # fewer samples than inputs per channel: the estimate is mostly its diagonal, where nearest rounding is optimal
    return {name: acc.hessian() for name, (_, acc, _) in layers.items()
            if name not in failed and (only is None or name in only) and acc.n >= acc.mean.shape[1]}


def _real_tokens(x: np.ndarray, mask, conv: dict | None) -> np.ndarray:
    """A dense layer's token states [N, T, K] of the real tokens only [M, K], where the attention mask says
    which they are: a padded position's output is masked away downstream, so its input must not pull the
    rounding (sentences padded to a fixed 128 tokens are mostly padding: 12 real tokens of 128). Else x."""
    if conv is not None or mask is None or x.ndim != 3:
        return x
    real = real_tokens(mask, x.shape)
    return x if real is None or real.all() else x[real]


def _add(acc: InputCovariance, x: np.ndarray, conv: dict | None, rng) -> None:
    """One run's input `x` of a layer into its covariance."""
    if conv is None:
        acc.add(x.reshape(1, -1, x.shape[-1]))  # (centred there)
    elif x.ndim == 4:
        c = x.mean(axis=(0, 2, 3))  # each input channel's mean: the patches come centred
        groups, (kh, kw) = conv["groups"], conv["kernel"]
        acc.add(conv_patches(x, rng=rng, shift=c, **conv), np.repeat(c.reshape(groups, -1), kh * kw, axis=1))
