"""Mutated models for the fuzz test (tests/test_fuzz.py): small real-shaped models, each edited at random
(shapes, dtypes, attributes, dangling names, huge dims, ...), run through inspect, calibrate, quantize
and the native runtime. A case ends in success or a QtoolError (one line); anything else is a failure.

Replay one case:  python tests/fuzz_models.py SEED CASE   (prints what was mutated and what happened)
"""
from __future__ import annotations

import os
import sys
import tempfile
import traceback

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import make_model, small_convnet  # noqa: E402

HUGE = [0, -1, -7, 1 << 31, 1 << 40, (1 << 63) - 1, 3, 1]


# ---------------------------------------------------------------- base models (tiny, real-shaped)

def _mlp(rng):
    """x [N, 12] -> MatMul -> Add -> Relu -> MatMul -> Softmax."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["z"], name="mm2"),
             helper.make_node("Softmax", ["z"], ["y"], name="softmax", axis=-1)]
    inits = [numpy_helper.from_array(rng.standard_normal((12, 16)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w2")]
    return make_model(nodes, inits, [("x", ["N", 12])], [("y", ["N", 4])])


def _detector(rng):
    """x [1, 3, 8, 8] -> Conv s2 -> Relu -> MaxPool / AveragePool -> Concat -> Reshape (from Shape arithmetic)
    -> Transpose: the run-time shape arithmetic that fold_constants folds."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p1"], name="maxpool", kernel_shape=[2, 2], strides=[1, 1],
                              pads=[0, 0, 1, 1]),
             helper.make_node("AveragePool", ["r"], ["p2"], name="avgpool", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["p1", "p2"], ["cat"], name="concat", axis=1),
             helper.make_node("Shape", ["cat"], ["shp"], name="shape"),
             helper.make_node("Gather", ["shp", "i0"], ["n"], name="gather", axis=0),
             helper.make_node("Concat", ["n", "minus1", "four"], ["newshape"], name="concat_shape", axis=0),
             helper.make_node("Reshape", ["cat", "newshape"], ["rs"], name="reshape"),
             helper.make_node("Transpose", ["rs"], ["y"], name="transpose", perm=[0, 2, 1])]
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3, "w"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32) * 0.1, "b"),
             numpy_helper.from_array(np.array([0], np.int64), "i0"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
             numpy_helper.from_array(np.array([4], np.int64), "four")]
    return make_model(nodes, inits, [("x", [1, 3, 8, 8])], [("y", [1, 4, None])])


def _convnet(rng):
    return small_convnet(seed=int(rng.integers(1000)), size=8, classes=3)


BASES = [_convnet, _mlp, _detector]


# ---------------------------------------------------------------- mutations

def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))] if len(seq) else None


def m_init_dims(m, rng):
    t = _pick(rng, m.graph.initializer)
    d = list(t.dims) or [1]
    k = int(rng.integers(len(d)))
    d[k] = int(_pick(rng, [0, 1, 2, d[k] + 1, d[k] * 30, 1 << 33]))
    del t.dims[:]
    t.dims.extend(d)
    return f"initializer {t.name} dims -> {d} (data unchanged)"


def m_init_reshape(m, rng):
    t = _pick(rng, m.graph.initializer)
    a = numpy_helper.to_array(t).reshape(-1)
    shape = _pick(rng, [(a.size,), (1, a.size), (a.size, 1, 1), ()]) if a.size == 1 or rng.random() < 0.5 else (a.size,)
    if shape == () and a.size != 1:
        shape = (a.size,)
    t.CopyFrom(numpy_helper.from_array(a.reshape(shape), t.name))
    return f"initializer {t.name} reshaped to {shape}"


def m_init_dtype(m, rng):
    t = _pick(rng, m.graph.initializer)
    dt = int(_pick(rng, [TensorProto.INT64, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.INT8,
                        TensorProto.UINT8, TensorProto.BOOL, TensorProto.STRING, 999]))
    if rng.random() < 0.5 and dt not in (TensorProto.STRING, 999):
        a = numpy_helper.to_array(t)
        t.CopyFrom(numpy_helper.from_array(a.astype(helper.tensor_dtype_to_np_dtype(dt)), t.name))
        return f"initializer {t.name} converted to type {dt}"
    t.data_type = dt
    return f"initializer {t.name} data_type -> {dt} (bytes unchanged)"


def m_init_nonfinite(m, rng):
    floats = [t for t in m.graph.initializer if t.data_type == TensorProto.FLOAT]
    t = _pick(rng, floats)
    if t is None:
        return "no float initializer"
    a = numpy_helper.to_array(t).copy()
    a.reshape(-1)[int(rng.integers(max(a.size, 1)))] = _pick(rng, [np.nan, np.inf, -np.inf, 1e38])
    t.CopyFrom(numpy_helper.from_array(a, t.name))
    return f"initializer {t.name}: a NaN/inf/1e38"


def m_input(m, rng):
    i = m.graph.input[0]
    tt = i.type.tensor_type
    r = rng.random()
    if r < 0.3:
        tt.elem_type = int(_pick(rng, [TensorProto.DOUBLE, TensorProto.INT64, TensorProto.UINT8, TensorProto.FLOAT16]))
        return f"input elem_type -> {tt.elem_type}"
    dims = tt.shape.dim
    if r < 0.5 and len(dims):
        del dims[int(rng.integers(len(dims)))]
        return "input loses a dim"
    if r < 0.6:
        dims.add().dim_value = 2
        return "input gains a dim"
    if len(dims):
        d = dims[int(rng.integers(len(dims)))]
        v = int(_pick(rng, HUGE))
        d.Clear()
        if v > 0:
            d.dim_value = v
        else:
            d.dim_param = "Z"
        return f"input dim -> {v}"
    return "input unchanged"


def m_attr(m, rng):
    nodes = [n for n in m.graph.node if len(n.attribute)]
    n = _pick(rng, nodes)
    if n is None:
        return "no attribute"
    a = _pick(rng, n.attribute)
    r = rng.random()
    if r < 0.2:
        n.attribute.remove(a)
        return f"{n.name}.{a.name} removed"
    if a.type == onnx.AttributeProto.INT:
        a.i = int(_pick(rng, [0, -1, -5, 2, 7, 1 << 31, 1 << 40]))
        return f"{n.name}.{a.name} = {a.i}"
    if a.type == onnx.AttributeProto.INTS:
        vals = list(a.ints)
        if r < 0.5 or not vals:
            vals = vals + [int(_pick(rng, [1, 0, -1, 3]))]
        else:
            vals[int(rng.integers(len(vals)))] = int(_pick(rng, [0, -1, -3, 1 << 20, 1 << 40, 100]))
        a.ints[:] = vals
        return f"{n.name}.{a.name} = {vals}"
    if a.type == onnx.AttributeProto.FLOAT:
        a.f = float(_pick(rng, [np.nan, np.inf, -1.0, 0.0, 1e30]))
        return f"{n.name}.{a.name} = {a.f}"
    if a.type == onnx.AttributeProto.TENSOR:
        a.t.dims[:] = [int(_pick(rng, [0, 7, 1 << 20]))]
        return f"{n.name}.{a.name} tensor dims changed"
    n.attribute.append(helper.make_attribute("bogus_attr", 3))
    return f"{n.name} gets an unknown attribute"


def m_dangling(m, rng):
    n = _pick(rng, m.graph.node)
    r = rng.random()
    if r < 0.4 and len(n.input):
        k = int(rng.integers(len(n.input)))
        n.input[k] = "no_such_tensor"
        return f"{n.name} input {k} dangling"
    if r < 0.6 and len(n.input):
        later = [o for nn in m.graph.node[list(m.graph.node).index(n):] for o in nn.output]
        n.input[int(rng.integers(len(n.input)))] = _pick(rng, later)
        return f"{n.name} reads a later output (a cycle or a forward edge)"
    if r < 0.8:
        other = _pick(rng, [o for nn in m.graph.node for o in nn.output])
        n.output[0] = other
        return f"{n.name} output renamed to an existing name {other}"
    m.graph.output[0].name = "not_produced"
    return "graph output not produced"


def m_huge(m, rng):
    """Insert ConstantOfShape / Expand / Tile / Range of a huge size into the output (through a ReduceSum)."""
    side = int(_pick(rng, [1 << 17, 1 << 20, 3000, 1 << 31]))
    g = m.graph
    g.initializer.append(numpy_helper.from_array(np.array([side, side], np.int64), "huge_shape"))
    op = _pick(rng, ["ConstantOfShape", "Expand", "Tile", "Range"])
    if op == "ConstantOfShape":
        g.node.append(helper.make_node("ConstantOfShape", ["huge_shape"], ["huge"], name="huge",
                                       value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])))
    elif op == "Expand":
        g.initializer.append(numpy_helper.from_array(np.ones(1, np.float32), "one"))
        g.node.append(helper.make_node("Expand", ["one", "huge_shape"], ["huge"], name="huge"))
    elif op == "Tile":
        g.initializer.append(numpy_helper.from_array(np.ones((1, 1), np.float32), "one"))
        g.node.append(helper.make_node("Tile", ["one", "huge_shape"], ["huge"], name="huge"))
    else:
        g.initializer.extend([numpy_helper.from_array(np.array(0, np.float32), "r0"),
                              numpy_helper.from_array(np.array(float(side) * side, np.float32), "r1"),
                              numpy_helper.from_array(np.array(1, np.float32), "r2")])
        g.node.append(helper.make_node("Range", ["r0", "r1", "r2"], ["huge"], name="huge"))
    out = g.output[0].name
    g.node.extend([helper.make_node("ReduceSum", ["huge"], ["hs"], name="hs", keepdims=0),
                   helper.make_node("Add", [out, "hs"], ["y_huge"], name="add_huge")])
    g.output[0].name = "y_huge"
    return f"{op} of {side} x {side} added to the output"


def m_reshape_huge(m, rng):
    shapes = [t for t in m.graph.initializer if t.data_type == TensorProto.INT64]
    t = _pick(rng, shapes)
    if t is None:
        return "no int64 initializer"
    a = numpy_helper.to_array(t).copy().reshape(-1)
    if a.size:
        a[int(rng.integers(a.size))] = int(_pick(rng, [1 << 40, -5, 0, (1 << 63) - 1]))
    t.CopyFrom(numpy_helper.from_array(a.reshape(numpy_helper.to_array(t).shape), t.name))
    return f"int64 initializer {t.name} -> {a.tolist()}"


def m_op_type(m, rng):
    n = _pick(rng, m.graph.node)
    old = n.op_type
    n.op_type = _pick(rng, ["Relu", "Sigmoid", "MatMul", "Conv", "Add", "Identity", "NoSuchOp", "Gemm", "Softmax"])
    return f"{n.name}: {old} -> {n.op_type}"


def m_remove_node(m, rng):
    n = _pick(rng, m.graph.node)
    m.graph.node.remove(n)
    return f"{n.name} removed"


def m_swap_inputs(m, rng):
    n = _pick(rng, [n for n in m.graph.node if len(n.input) >= 2])
    if n is None:
        return "nothing to swap"
    a, b = n.input[0], n.input[1]
    n.input[0], n.input[1] = b, a
    return f"{n.name}: inputs swapped"


def m_opset(m, rng):
    v = int(_pick(rng, [1, 7, 9, 11, 12, 13, 17, 21, 30]))
    m.opset_import[0].version = v
    return f"opset -> {v}"


def m_domain(m, rng):
    n = _pick(rng, m.graph.node)
    n.domain = _pick(rng, ["com.microsoft", "custom.evil", "ai.onnx.ml"])
    return f"{n.name}: domain {n.domain}"


def m_attr_soft(m, rng):
    """An attribute changed to another value that may well be valid (strides 2, pads 2, axis 0, alpha 0.3...)."""
    nodes = [n for n in m.graph.node if len(n.attribute)]
    n = _pick(rng, nodes)
    if n is None:
        return "no attribute"
    a = _pick(rng, n.attribute)
    if a.type == onnx.AttributeProto.INT:
        a.i = int(_pick(rng, [0, 1, 2, -1]))
    elif a.type == onnx.AttributeProto.INTS:
        a.ints[:] = [int(_pick(rng, [0, 1, 2])) if v >= 0 else v for v in a.ints]
    elif a.type == onnx.AttributeProto.FLOAT:
        a.f = float(_pick(rng, [0.0, 0.3, 1e-5, 2.0]))
    return f"{n.name}.{a.name} -> {onnx.helper.get_attribute_value(a)}"


def m_weights_scaled(m, rng):
    """A float initializer scaled by 1e-30 .. 1e30, or set to one value (a dead or exploding channel)."""
    t = _pick(rng, [t for t in m.graph.initializer if t.data_type == TensorProto.FLOAT])
    if t is None:
        return "no float initializer"
    a = numpy_helper.to_array(t).astype(np.float64)
    a = a * float(_pick(rng, [1e-30, 1e-8, 1e8, 1e30])) if rng.random() < 0.7 else np.full_like(a, 0.0)
    t.CopyFrom(numpy_helper.from_array(a.astype(np.float32), t.name))
    return f"initializer {t.name} scaled"


SOFT = [m_attr_soft, m_weights_scaled, m_init_nonfinite, m_opset, m_init_reshape]
MUTATIONS = [m_init_dims, m_init_reshape, m_init_dtype, m_init_nonfinite, m_input, m_attr, m_attr, m_dangling,
             m_huge, m_reshape_huge, m_op_type, m_remove_node, m_swap_inputs, m_opset, m_domain]


_INT8 = {}  # base name -> its QDQ int8 model (made once per process)


def int8_base(base, root: str) -> onnx.ModelProto:
    """The base model quantized by qtool itself (the untouched int8 model the int8 cases mutate)."""
    if base.__name__ not in _INT8:
        from qtool.calibrate.run import calibrate
        from qtool.calibrate.options import CalibrateOptions, Sampling
        from qtool.quantize.run import quantize
        d = tempfile.mkdtemp(prefix=f"int8{base.__name__}-", dir=root)
        path = os.path.join(d, "fp32.onnx")
        onnx.save(base(np.random.default_rng(7)), path)
        calibrate(path, feeds_for(base.__name__, np.random.default_rng(8), 4),
                  CalibrateOptions(config=None, method="minmax", threads=1,
                                   sampling=Sampling(batch=2), show_progress=False),
                  workdir=d)
        q = quantize(d, say=lambda *a: None)
        _INT8[base.__name__] = onnx.load(q.path)
    m = onnx.ModelProto()
    m.CopyFrom(_INT8[base.__name__])
    return m


def is_int8_case(case: int) -> bool:
    """Every third case mutates the int8 model qtool wrote, for the runtime (and ORT) to read."""
    return case % 3 == 2


def mutated(seed: int, case: int, root: str | None = None):
    """(model, base name, list of what was mutated) for one case: deterministic in (seed, case)."""
    rng = np.random.default_rng([seed, case])
    base = BASES[case % len(BASES)]
    m = int8_base(base, root or tempfile.gettempdir()) if is_int8_case(case) else base(rng)
    done = ["(int8 model)"] if is_int8_case(case) else []
    soft = rng.random() < 0.4  # some cases only get edits a model may well survive: the later steps see them
    pool = SOFT if soft else MUTATIONS
    for _ in range(int(rng.integers(1, 3 if soft else 4))):
        try:
            done.append(pool[int(rng.integers(len(pool)))](m, rng))
        except Exception as e:  # a mutation that does not apply to this model
            done.append(f"(mutation skipped: {type(e).__name__})")
    return m, base.__name__, done


def feeds_for(base: str, rng, n: int = 3) -> list:
    shape = {"_convnet": (1, 3, 8, 8), "_mlp": (2, 12), "_detector": (1, 3, 8, 8)}[base]
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


# ---------------------------------------------------------------- one case through every step

def run_case(seed: int, case: int, root: str) -> dict:
    """-> {"case", "mutations", "steps": {step: "ok" | "error: ..." }, "failure": traceback or None}."""
    import warnings
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions, Sampling
    from qtool.errors import QtoolError
    from qtool.inspect import inspect_model
    from qtool.quantize.run import quantize
    from qtool.runtime import NativeSession

    m, base, done = mutated(seed, case, root)
    rng = np.random.default_rng([seed, case, 1])
    d = tempfile.mkdtemp(prefix=f"case{case}-", dir=root)
    path = os.path.join(d, "model.onnx")
    with open(path, "wb") as f:
        f.write(m.SerializeToString())
    feeds = feeds_for(base, rng)
    res = {"case": case, "base": base, "mutations": done, "steps": {}, "failure": None}

    def step(name, fn):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = fn()
            res["steps"][name] = "ok"
            return out
        except QtoolError as e:
            msg = str(e)
            if "\n" in msg or not msg.strip():
                res["failure"] = f"{name}: QtoolError message is not one line: {msg!r}"
            res["steps"][name] = "error: " + msg
        except BaseException:
            res["failure"] = f"{name}: " + traceback.format_exc()
        return None

    step("inspect", lambda: inspect_model(path))
    if res["failure"]:
        return res
    if is_int8_case(case):  # an int8 model: what bench and eval do with it
        from qtool.ortsession import session
        s = step("runtime load", lambda: NativeSession(path, threads=1))
        if s is not None and not res["failure"]:
            step("runtime run", lambda: s.run(None, feeds[0]))
        if not res["failure"]:
            o = step("ort load", lambda: session(path, 1))
            if o is not None and not res["failure"]:
                step("ort run", lambda: o.run(None, feeds[0]))
        return res
    wd = os.path.join(d, "work")
    cal = step("calibrate", lambda: calibrate(path, feeds,
                                              CalibrateOptions(config=None, method="minmax", threads=1,
                                                               sampling=Sampling(batch=2), show_progress=False),
                                              workdir=wd))
    q = None
    if cal is not None and not res["failure"]:
        q = step("quantize", lambda: quantize(wd, say=lambda *a: None))
    if not res["failure"]:
        target = q.path if q is not None else path
        s = step("runtime load", lambda: NativeSession(target, threads=1))
        if s is not None and not res["failure"]:
            step("runtime run", lambda: s.run(None, feeds[0]))
    return res


if __name__ == "__main__":
    seed, case = int(sys.argv[1]), int(sys.argv[2])
    with tempfile.TemporaryDirectory() as root:
        r = run_case(seed, case, root)
    print(f"case {case} (seed {seed}, base {r['base']}): {'; '.join(r['mutations'])}")
    for k, v in r["steps"].items():
        print(f"  {k}: {v[:300]}")
    if r["failure"]:
        print(r["failure"])
        sys.exit(1)
