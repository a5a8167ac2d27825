"""An If branch that every calibration sample takes is quantized as a model of its own.

Exporters put whole networks inside an If: Silero VAD holds its 16 kHz and its 8 kHz network in the
two branches of If(sr == 16000), and nothing of it sits in the main graph. ONNX Runtime cannot read
a branch's tensors out, so calibration cannot see them; but the branch is a graph whose inputs are
the outer tensors it reads by name, and those can be read out. So: run the fp32 graph on the
calibration samples, reading the If's condition and the outer tensors the branch reads; where every
sample takes the same branch, make that branch a model (its outer reads its inputs, the outer weights
it reads its initializers), calibrate and quantize it with the same pipeline and options, on those
outer tensors, and put its int8 graph back as the branch. The branch no sample took stays fp32: no
calibration sample tells its ranges.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
from onnx import helper

from qtool import graph as G
from qtool.modelio import save_model
from qtool.plan import elem_types


def taken_branches(model: onnx.ModelProto, samples) -> list:
    """[(If node, "then_branch" | "else_branch", {outer tensor: [one array per sample]})] of the main
    graph's If nodes whose branch is the same for every sample in `samples` (a SampleSet)."""
    from qtool.ortsession import session, with_outputs
    ifs = [n for n in model.graph.node if n.op_type == "If"]
    if not ifs or not len(samples):
        return []
    inits = {t.name for t in model.graph.initializer}
    reads = {n.name: sorted(G.node_reads(n) - {n.input[0]} - inits) for n in ifs}
    names = list(dict.fromkeys([n.input[0] for n in ifs] + [t for n in ifs for t in reads[n.name]]))
    inputs = {i.name for i in G.real_inputs(model)}
    fetch = [t for t in names if t not in inputs]
    sess = session(with_outputs(model, fetch), 1, where="an If's condition")
    got = {t: [] for t in names}
    for a in range(len(samples)):
        feed = samples.feed(a, a + 1)
        vals = dict(zip(fetch, sess.run(fetch, feed))) if fetch else {}
        vals.update({k: v for k, v in feed.items() if k in got})
        for t in names:
            got[t].append(vals[t])
    out = []
    for n in ifs:
        cond = {bool(np.asarray(c).reshape(-1)[0]) for c in got[n.input[0]]}
        if len(cond) == 1:
            out.append((n, "then_branch" if cond.pop() else "else_branch", {t: got[t] for t in reads[n.name]}))
    return out


def branch_model(model: onnx.ModelProto, node, which: str, outer: dict) -> onnx.ModelProto:
    """The branch `which` of If `node` as a model: the outer tensors it reads are its inputs (shaped as
    their values `outer` (tensor -> one array per sample) are: a dim that differs between samples is
    dynamic), the outer weights it reads its initializers."""
    g = next(a.g for a in node.attribute if a.name == which)
    types = elem_types(model)
    inits = {t.name: t for t in model.graph.initializer}
    reads = set().union(*(G.node_reads(n) for n in g.node)) if g.node else set()
    sub = helper.make_graph(list(g.node), f"{node.name}.{which}",
                            [helper.make_tensor_value_info(t, types.get(t, onnx.TensorProto.FLOAT), _dims(outer[t]))
                             for t in sorted(outer)],
                            list(g.output),
                            list(g.initializer) + [inits[t] for t in sorted(reads & set(inits))])
    m = helper.make_model(sub, opset_imports=model.opset_import)
    m.ir_version = max(model.ir_version, 8)
    vague = [o for o in m.graph.output if not (o.type.HasField("tensor_type") and o.type.tensor_type.HasField("shape"))]
    if vague:  # (a branch may leave its outputs untyped and unshaped; a model may not: one run tells them)
        from qtool.ortsession import session
        outs = session(m, 1, where=f"{node.name}'s {which}").run(None, {t: np.asarray(v[0]) for t, v in outer.items()})
        got = {o.name: y for o, y in zip(m.graph.output, outs)}
        for o in vague:
            y = np.asarray(got[o.name])
            o.CopyFrom(helper.make_tensor_value_info(o.name, helper.np_dtype_to_tensor_dtype(y.dtype), [None] * y.ndim))
    return m


def _dims(values: list) -> list:
    shapes = {np.shape(v) for v in values}
    if len({len(sh) for sh in shapes}) != 1:
        return None
    return [sh[0] if len(set(sh)) == 1 else None for sh in zip(*shapes)]


def _rename(g: onnx.GraphProto, names: dict) -> None:
    """Every name in `names` renamed in `g` and the graphs nested in it: what nodes write and read,
    initializers, outputs."""
    for t in g.initializer:
        t.name = names.get(t.name, t.name)
    for o in g.output:
        o.name = names.get(o.name, o.name)
    for n in g.node:
        n.input[:] = [names.get(i, i) for i in n.input]
        n.output[:] = [names.get(o, o) for o in n.output]
        for sub in G._subgraphs(n):
            _rename(sub, names)


def put_back(model: onnx.ModelProto, node_name: str, which: str, int8: onnx.ModelProto) -> None:
    """The branch `which` of If `node_name` in `model` becomes `int8`'s graph (its inputs outer reads again).
    Names the int8 graph made that the outer graph also holds (both quantized a tensor `h`: `h_quantized`)
    are prefixed with the branch's: a model's names are one namespace across its graphs."""
    node = next(n for n in model.graph.node if n.name == node_name)
    attr = next(a for a in node.attribute if a.name == which)
    g = onnx.GraphProto()
    g.CopyFrom(int8.graph)
    g.name = attr.g.name
    reads = {i.name for i in g.input}
    del g.input[:]
    del g.value_info[:]
    outer = {o for n in model.graph.node for o in n.output} | {t.name for t in model.graph.initializer} \
        | {i.name for i in model.graph.input}
    made = {o for n in g.node for o in n.output} | {t.name for t in g.initializer}
    _rename(g, {t: f"{node_name}.{which}/{t}" for t in (made & outer) - reads})
    attr.g.CopyFrom(g)
    have = {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")}
    want = max(o.version for o in int8.opset_import if o.domain in ("", "ai.onnx"))
    if have and max(have) < want:  # (the branch's QDQ needs per-axis DequantizeLinear: opset 13)
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = want


def quantize_branches(model: onnx.ModelProto, fused: onnx.ModelProto, samples, workdir: str, quantize,
                      say=print) -> list:
    """Quantize in `model` (the int8 main graph, changed in place) every If branch of `fused` that all
    `samples` take, each in its own working directory under `workdir`, by `quantize(working directory)`
    (-> QuantizeResult: the run's quantize with the branch's options; a branch's own Ifs are handled
    there, the same way). -> [(If node, branch, its QuantizeResult)]."""
    from qtool.calibrate.run import calibrate
    from qtool.calibrate.options import CalibrateOptions

    done = []
    for node, which, outer in taken_branches(fused, samples):
        if not outer:  # reads no tensor of the graph around it: constants only, nothing to calibrate
            continue
        names = sorted(outer)
        sub = branch_model(fused, node, which, outer)
        folder = os.path.join(workdir, "subgraphs", f"{len(done)}-{which}")
        data = os.path.join(folder, "data")
        os.makedirs(data, exist_ok=True)
        for k in range(len(samples)):
            np.savez(os.path.join(data, f"s{k:04d}.npz"), **{t: np.asarray(outer[t][k]) for t in names})
        path = os.path.join(folder, "branch.onnx")
        save_model(sub, path)
        with warnings.catch_warnings():  # (what the branch's own steps would say: its summary is said here)
            warnings.simplefilter("ignore")
            calibrate(path, data, CalibrateOptions(show_progress=False), workdir=os.path.join(folder, "work"),
                      say=lambda text: None)
            q = quantize(os.path.join(folder, "work"))
        s = q.report["summary"]
        kept = "" if q.exclusion is None else (
            f"; --exclude-sensitive there kept {len(q.exclusion.excluded)} layer(s) fp32"
            + (f": {', '.join(sorted(q.exclusion.excluded))}" if q.exclusion.excluded else "")
            + ("" if q.exclusion.reached else " (its target not reached)"))
        if not s.get("int8", 0) and not q.report.get("subgraphs"):
            if kept:  # (the search kept every layer fp32: the branch stays as it is, and the user is told)
                say(f"{node.name} ({which}) stays fp32{kept}")
            continue  # (nothing in it has an int8 rule: the branch stays as it is)
        put_back(model, node.name, which, onnx.load(q.path))
        say(f"{node.name} ({which}, taken by every calibration sample) quantized as a model of its own: "
            f"{s.get('int8', 0)} ops int8, {s.get('fp32', 0)} fp32{kept}")
        done.append((node.name, which, q))
    if done:  # (the outer weights a quantized branch read went into its own model, int8 there: unread now, they
        # would stay in the file as fp32: silero-vad's op18 export, 110.9 % of fp32's size)
        G.remove_unused_initializers(model)
    return done

