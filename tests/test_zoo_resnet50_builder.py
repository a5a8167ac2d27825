"""benchmarks/resnet50_builder.py at a reduced width and image size (the full model takes seconds)."""
import collections
import importlib.util
import os

import numpy as np
import onnx
import onnxruntime as ort

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "resnet50_builder.py")
_spec = importlib.util.spec_from_file_location("resnet50_builder", _PATH)
rb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rb)


def test_small_resnet50_structure_and_ranges(tmp_path):
    out = tmp_path / "r.onnx"
    rb.build_resnet50(out, seed=3, image_size=64, calib_images=4, base_width=8)
    m = onnx.load(str(out))
    ops = collections.Counter(n.op_type for n in m.graph.node)
    assert (ops["Conv"], ops["BatchNormalization"], ops["Relu"], ops["Add"]) == (53, 53, 49, 16)
    assert ops["MaxPool"] == ops["GlobalAveragePool"] == ops["Gemm"] == 1
    assert all(len(n.input) == 2 for n in m.graph.node if n.op_type == "Conv")  # no conv bias
    # v1.5: the stride sits on the 3x3 conv of the first bottleneck of layers 2-4
    strides = {n.name: list(n.attribute[[a.name for a in n.attribute].index("strides")].ints)
               for n in m.graph.node if n.op_type == "Conv"}
    assert strides["layer2.0.conv2"] == [2, 2] and strides["layer2.0.conv1"] == [1, 1]
    assert strides["layer1.0.conv2"] == [1, 1] and strides["layer4.0.downsample.0"] == [2, 2]
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}
    assert not np.allclose(inits["layer3.2.bn2.running_var"], 1.0)  # statistics were calibrated
    assert inits["layer3.2.bn3.weight"].max() <= 0.5
    x = rb.synthetic_images(np.random.default_rng(7), 3, 64)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"input": x})[0]
    assert y.shape == (3, 1000) and np.isfinite(y).all()
    assert 0.3 < y.std() < 10
    lines = rb.activation_report(out, x)
    assert len(lines) == 7 and "finite True" in lines[-1]


def test_seed_makes_it_reproducible(tmp_path):
    a = rb.build_resnet50_model(seed=1, image_size=32, calib_images=2, base_width=4)
    b = rb.build_resnet50_model(seed=1, image_size=32, calib_images=2, base_width=4)
    c = rb.build_resnet50_model(seed=2, image_size=32, calib_images=2, base_width=4)
    assert a.SerializeToString() == b.SerializeToString() != c.SerializeToString()
