"""Which preprocessing calibration uses, and whether it fits the model: no --config takes the model's
metadata, else assumes the torchvision ImageNet preset (and says so in one line); a preset fits
itself to the model's input size; the stem's BatchNormalization statistics and degenerate fp32
outputs warn when the preprocessing looks wrong; the PP-OCR presets compute what PaddleOCR computes."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import helper
from PIL import Image

from helpers import calibrate_options, init, make_model, save, small_convnet, write_config, write_images
from qtool.calibrate.checks import OutputWatch
from qtool.calibrate.run import calibrate
from qtool.data.config import describe, fit_to_input, load_config
from qtool.errors import QtoolError


def _calibrate(model, data, tmp_path, config=None, **kw):
    said = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = calibrate(str(model), str(data),
                      calibrate_options(config=config, method="minmax", batch=4, show_progress=False, threads=1, **kw),
                      str(tmp_path / "work"), say=said.append)
    return r, said, [str(w.message) for w in caught]


# --- no --config ------------------------------------------------------------------------------------------

def test_no_config_assumes_torchvision_sized_to_the_model_and_says_so(tmp_path):
    net = save(small_convnet(size=16), tmp_path / "net.onnx")
    write_images(tmp_path / "d", 3)
    r, said, _ = _calibrate(net, tmp_path / "d", tmp_path)
    c = r.table.config
    tv = load_config("imagenet-torchvision")
    assert c["mean"] == list(tv.mean) and c["std"] == list(tv.std) and c["color"] == "RGB"
    assert c["size"] == [16, 16] and c["resize_to"] == round(256 * 16 / 224)  # the preset's ratio, at 16
    assert len(said) == 1 and said == r.notes
    line = said[0]
    assert line.startswith("no --config: assumed the torchvision ImageNet preprocessing (imagenet-torchvision)")
    assert "input 'x' [N, 3, 16, 16]" in line and "pass --config PRESET|FILE to change it" in line
    assert "58.395" in line and "shorter side 18" in line and "centre crop 16x16" in line


def _free_size_convnet():
    """small_convnet with height and width free, as detectors (nudenet's YOLOv8) and SLANet export them."""
    m = small_convnet()
    dims = m.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "H", "W"
    return m


def test_int8_model_takes_every_size_where_the_preprocessing_was_only_assumed(tmp_path):
    """With no --config the image size is qtool's guess (224, here sized to nothing the model says): the int8
    model came out accepting that size only, and nudenet's 320x320 YOLOv8 refused its own input size."""
    from qtool.modelio import load_model
    from qtool.ortsession import session
    from qtool.quantize.run import quantize
    net = save(_free_size_convnet(), tmp_path / "net.onnx")
    write_images(tmp_path / "d", 4, h=40, w=40)
    r, said, _ = _calibrate(net, tmp_path / "d", tmp_path)
    assert "(assumed" in r.table.config["source"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize(str(tmp_path / "work"))
    dims = load_model(q.path, check=False).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims[2:]] == ["H", "W"] and not any(d.dim_value for d in dims[2:])
    y = session(q.path, 1).run(None, {"x": np.random.default_rng(0).standard_normal((1, 3, 32, 48)).astype(np.float32)})
    assert y[0].shape == (1, 5)


def test_a_chosen_size_is_written_into_the_model(tmp_path):
    """A --config that names a size is the deployment's: the fused graph and the int8 model take that size."""
    from qtool.modelio import load_model
    net = save(_free_size_convnet(), tmp_path / "net.onnx")
    write_images(tmp_path / "d", 4, h=40, w=40)
    r, _, _ = _calibrate(net, tmp_path / "d", tmp_path, config=write_config(tmp_path / "c.toml", size=24))
    dims = r.fused.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims[2:]] == [24, 24]


def test_no_config_on_a_grey_input_takes_pixels_as_they_are(tmp_path):
    m = small_convnet()
    m.graph.node[0].input[0] = "g"
    w = onnx.numpy_helper.to_array(m.graph.initializer[0])  # stem_w [8, 3, 3, 3] -> one input channel
    m.graph.initializer[0].CopyFrom(init("stem_w", w[:, :1]))
    m.graph.input[0].CopyFrom(helper.make_tensor_value_info("g", onnx.TensorProto.FLOAT, ["N", 1, 16, 16]))
    net = save(m, tmp_path / "grey.onnx")
    write_images(tmp_path / "d", 2)
    r, said, _ = _calibrate(net, tmp_path / "d", tmp_path)
    c = r.table.config
    assert (c["color"], c["mean"], c["std"], c["resize"], c["size"]) == ("GRAY", [0.0], [1.0], "exact", [16, 16])
    assert said[0].startswith("no --config: assumed grey pixels 0-255 as they are")


@pytest.mark.parametrize("channels", [1, 3])
def test_no_config_on_a_text_line_input_keeps_each_images_aspect_ratio(tmp_path, channels):
    """A fixed height and a free width (ddddocr's [1, 1, 64, image_width], a CRNN's [N, 3, 32, W]) reads text
    lines: each image goes to that height in its own aspect ratio, right-padded, never squashed to a square
    (which the model's height refuses: 'pass a matching --config' was all a user got)."""
    m = small_convnet()
    m.graph.node[0].input[0] = "g"
    w = onnx.numpy_helper.to_array(m.graph.initializer[0])
    m.graph.initializer[0].CopyFrom(init("stem_w", w[:, :channels]))
    m.graph.input[0].CopyFrom(helper.make_tensor_value_info("g", onnx.TensorProto.FLOAT, [1, channels, 16, "width"]))
    net = save(m, tmp_path / "line.onnx")
    write_images(tmp_path / "d", 2, w=40)
    write_images(tmp_path / "d", 2, w=90, prefix="wide")
    r, said, _ = _calibrate(net, tmp_path / "d", tmp_path)
    c = r.table.config
    assert (c["resize"], c["size"], c["color"]) == ("height", [16, 107], "GRAY" if channels == 1 else "RGB")
    assert r.table.n_samples == 4 and "keeping its aspect ratio (a text line's geometry)" in said[0]


@pytest.mark.parametrize("meta", ["efficientnet-lite", '[input]\nsize = [16, 16]\n[preprocess]\nresize = "exact"\n'
                                                       'crop = "none"\nmean = [1, 2, 3]\nstd = [4, 5, 6]\n'])
def test_model_metadata_gives_the_preprocessing(tmp_path, meta):
    m = small_convnet()
    helper.set_model_props(m, {"qtool.config": meta})
    net = save(m, tmp_path / "net.onnx")
    write_images(tmp_path / "d", 2)
    r, said, _ = _calibrate(net, tmp_path / "d", tmp_path)
    c = r.table.config
    assert said[0].startswith("preprocessing from the model's metadata (qtool.config: "
                              + ("efficientnet-lite)" if meta == "efficientnet-lite" else "inline TOML)"))
    if meta == "efficientnet-lite":
        assert c["mean"] == [127.0] * 3 and c["interpolation"] == "bicubic" and c["size"] == [16, 16]
    else:
        assert c["mean"] == [1.0, 2.0, 3.0] and c["std"] == [4.0, 5.0, 6.0]


@pytest.mark.parametrize("meta", ["../../etc/passwd", "no-such-preset"])
def test_model_metadata_never_names_a_file(tmp_path, meta):
    m = small_convnet()
    helper.set_model_props(m, {"qtool.config": meta})
    net = save(m, tmp_path / "net.onnx")
    write_images(tmp_path / "d", 2)
    with pytest.raises(QtoolError, match=r"metadata qtool.config: .* is no preset"):
        _calibrate(net, tmp_path / "d", tmp_path)


def test_calibrate_help_says_what_the_default_is():
    from qtool.commands.calibrate import command
    opt = next(p for p in command.params if p.name == "config")
    assert "Default: the model's metadata" in opt.help and "imagenet-torchvision for a 3-channel input" in opt.help


# --- a preset fits the model ------------------------------------------------------------------------------

def test_fit_to_input_keeps_the_preset_ratio():
    c, changes = fit_to_input(load_config("efficientnet-lite"), ["batch", 3, 240, 240])
    assert c.size == (240, 240) and c.resize_to == 274 and c.crop == "center"  # 256 * 240 / 224 = 274.3
    assert changes == ["size 240x240 (the config's is 224x224; shorter side resized to 274, keeping its ratio 256/224)"]
    c, changes = fit_to_input(load_config("ppocr-cls"), [1, 3, 32, 128])  # resized exactly: only the size
    assert c.size == (32, 128) and len(changes) == 1
    c, changes = fit_to_input(load_config("tf-inception"), [None, 3, 224, 224])  # NHWC preset, NCHW model
    assert c.layout == "NCHW" and changes == ["layout NCHW (the config's is NHWC)"]
    c, changes = fit_to_input(load_config("efficientnet-lite"), ["N", 3, "H", "W"])  # dynamic: the preset's
    assert c.size == (224, 224) and changes == []
    assert "shorter side 274 bicubic, centre crop 240x240" in describe(fit_to_input(
        load_config("efficientnet-lite"), [1, 3, 240, 240])[0])


def test_efficientnet_lite_at_240_calibrates_with_the_224_preset(tmp_path):
    """The zoo's EfficientNet-Lite graph at 240x240 (a tiny fake state dict) with --config efficientnet-lite."""
    from test_zoo_efficientnet import fake_state_dict
    from qtool.zoo.efficientnet_lite import efficientnet_lite_graph

    stages = [(1, 1), (1, 2)]
    sd = fake_state_dict(stages, channels=[4, 6], kernels=[3, 3], expands=[1, 2])
    net = save(efficientnet_lite_graph(sd, stages=stages, image_size=240), tmp_path / "lite240.onnx")
    write_images(tmp_path / "d", 2, h=60, w=80)
    r, said, _ = _calibrate(net, tmp_path / "d", tmp_path, config="efficientnet-lite")
    assert r.table.config["size"] == [240, 240] and r.table.config["resize_to"] == 274
    assert said == ["efficientnet-lite: took size 240x240 (the config's is 224x224; shorter side resized to 274, "
                    "keeping its ratio 256/224) from the model's input 'input' [N, 3, 240, 240]"]
    assert r.table.n_samples == 2


# --- the checks -------------------------------------------------------------------------------------------

def _stem_net(tmp_path, images, trained_with: str):
    """Conv -> BatchNormalization -> ... whose BatchNorm statistics are those of `images` under the
    preset `trained_with`, as training would have left them."""
    from helpers import run
    from qtool.data.images import load_image, list_images

    m = small_convnet(size=16)
    cfg = load_config(trained_with)
    cfg.size, cfg.resize_to = (16, 16), 18
    x = np.concatenate([load_image(f, cfg) for f in list_images(images)])
    conv_out = run(make_model([m.graph.node[0]], [t for t in m.graph.initializer if t.name in ("stem_w", "stem_b")],
                              [("x", ["N", 3, 16, 16])], [("stem_c", None)]), {"x": x})[0]
    inits = {t.name: t for t in m.graph.initializer}
    inits["stem_mean"].CopyFrom(init("stem_mean", conv_out.mean(axis=(0, 2, 3))))
    inits["stem_var"].CopyFrom(init("stem_var", conv_out.var(axis=(0, 2, 3))))
    return save(m, tmp_path / f"stem-{trained_with}.onnx")


def test_stem_statistics_say_when_the_assumed_preprocessing_is_wrong(tmp_path):
    write_images(tmp_path / "d", 8, h=40, w=48)
    net = _stem_net(tmp_path, tmp_path / "d", "efficientnet-lite")
    _, said, warned = _calibrate(net, tmp_path / "d", tmp_path)
    assert said[0].startswith("no --config: assumed")
    (w,) = [w for w in warned if "BatchNormalization" in w]
    assert w.startswith("the assumed preprocessing (imagenet-torchvision) may be wrong for this model")
    assert "(stem_bnorm)" in w and w.endswith("pass --config efficientnet-lite if the model was trained that way")
    _, _, warned = _calibrate(net, tmp_path / "d", tmp_path / "2", config="efficientnet-lite")
    assert not [w for w in warned if "BatchNormalization" in w]
    # a model trained on torchvision's normalisation: the assumption fits, nothing to say
    net = _stem_net(tmp_path, tmp_path / "d", "imagenet-torchvision")
    _, _, warned = _calibrate(net, tmp_path / "d", tmp_path / "3")
    assert not [w for w in warned if "BatchNormalization" in w]


def test_degenerate_outputs_warn(tmp_path):
    """Logits in the tens of thousands, every image the same class: the calibration pass says so."""
    m = small_convnet(classes=12)
    inits = {t.name: t for t in m.graph.initializer}
    b = np.zeros(12, np.float32)
    b[7] = 5e4
    inits["fc_b"].CopyFrom(init("fc_b", b))
    net = save(m, tmp_path / "net.onnx")
    write_images(tmp_path / "d", 9)
    r, _, warned = _calibrate(net, tmp_path / "d", tmp_path, config=write_config(tmp_path / "c.toml"))
    (w,) = [w for w in warned if "looks degenerate" in w]
    assert w.startswith("the fp32 model's output 'y' looks degenerate on the calibration data: values up to 5e+04")
    assert "9 of the 9 images get the same class (7)" in w and r.warnings[-1] == w
    import json
    seen = json.load(open(tmp_path / "work" / "manifest.json"))["calibrate"]["fp32_output"]
    assert seen["distinct_top1"] == 1 and seen["samples"] == 9 and seen["max_abs"] > 4e4


def test_output_watch():
    w = OutputWatch("y")
    rng = np.random.default_rng(0)
    w.observe(rng.normal(size=(5, 10)), 0)
    other = OutputWatch("y")
    other.observe(rng.normal(size=(5, 10)), 5)
    w.merge(other)
    assert len(w.top1) == 10 and w.warning() is None
    w.observe(np.full((1, 10), np.nan), 10)
    assert "NaN or infinite values" in w.warning()
    one = OutputWatch("y")
    one.observe(np.tile(np.arange(10.0), (8, 1)), 0)
    assert "8 of the 8 images get the same class (9)" in one.warning()
    few = OutputWatch("y")
    few.observe(np.tile(np.arange(10.0), (3, 1)), 0)  # three images of one class: could be the data
    assert few.warning() is None


# --- the PP-OCR presets: each image its own size (detector), crops right-padded (recognizer) -----------------

def _paddle_det_size(w, h, limit=960):
    """(H, W) by PaddleOCR's DetResizeForTest.resize_image_type0, limit_type "max", as written there."""
    ratio = (float(limit) / h if h > w else float(limit) / w) if max(h, w) > limit else 1.
    rh, rw = int(h * ratio), int(w * ratio)
    return max(int(round(rh / 32) * 32), 32), max(int(round(rw / 32) * 32), 32)


def _ocr_image(tmp_path, name, w, h, seed=0):
    from helpers import picture
    p = str(tmp_path / name)
    picture(np.random.default_rng(seed), h, w).save(p)
    return p


@pytest.mark.parametrize("w,h,want", [(1000, 700, (672, 960)), (640, 480, (480, 640)), (700, 1000, (960, 672)),
                                      (80, 48, (64, 64)),  # 2.5 and 1.5 multiples: Python rounds half to even
                                      (3000, 20, (32, 960))])
def test_ppocr_det_limits_the_longest_side_in_multiples_of_32(tmp_path, w, h, want):
    from qtool.data.images import load_image
    cfg, changes = fit_to_input(load_config("ppocr-det"), ["N", 3, "H", "W"])
    assert changes == [] and want == _paddle_det_size(w, h)
    assert load_image(_ocr_image(tmp_path, "a.png", w, h), cfg).shape == (1, 3) + want


def test_ppocr_det_values_are_bgr_imagenet_mean_std(tmp_path):
    from qtool.data.images import load_image
    p = _ocr_image(tmp_path, "a.png", 64, 32)  # already multiples of 32: no resize
    x = load_image(p, load_config("ppocr-det"))
    bgr = np.asarray(Image.open(p).convert("RGB"), np.float64)[..., ::-1]
    want = (bgr / 255 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]  # PaddleOCR's NormalizeImage, BGR order
    np.testing.assert_allclose(x[0], want.transpose(2, 0, 1), atol=1e-5, rtol=0)
    assert describe(load_config("ppocr-det")).startswith(
        "longest side scaled down to 960 bilinear (never up), sides rounded to multiples of 32, each image its own "
        "size, BGR, (x - 123.675/116.28/103.53) / 58.395/57.12/57.375")
    c, changes = fit_to_input(load_config("ppocr-det"), [1, 3, 640, 640])  # a static input takes one size
    assert (c.resize, c.size) == ("exact", (640, 640)) and changes[0].startswith("resize exact 640x640")


def test_ppocr_rec_keeps_the_ratio_and_pads_with_zeros(tmp_path):
    from qtool.data.images import load_image
    cfg, changes = fit_to_input(load_config("ppocr-rec"), ["N", 3, 48, 320])
    assert changes == [] and cfg.size == (48, 320)
    p = _ocr_image(tmp_path, "crop.png", 100, 20)
    x = load_image(p, cfg)
    assert x.shape == (1, 3, 48, 320)
    content = np.asarray(Image.open(p).convert("RGB").resize((240, 48), Image.BILINEAR), np.float64)[..., ::-1]
    np.testing.assert_allclose(x[0, :, :, :240], ((content / 255 - 0.5) / 0.5).transpose(2, 0, 1), atol=1e-5, rtol=0)
    assert np.all(x[0, :, :, 240:] == 0)  # ceil(48 * 100 / 20) = 240: the rest is padding, 0 after normalising
    wide = load_image(_ocr_image(tmp_path, "wide.png", 1000, 20), cfg)  # 2400 wide at height 48: capped
    assert wide.shape == (1, 3, 48, 320) and np.abs(wide[0, :, :, -1]).max() > 0
    assert "height 48 bilinear keeping the aspect ratio (width at most 320), right-padded to 320" in describe(cfg)


@pytest.mark.parametrize("dims,size", [(["N", 3, 32, "W"], (32, 320)), (["N", 3, "H", "W"], (48, 320)),
                                       ([1, 3, 48, 256], (48, 256))])
def test_ppocr_rec_takes_what_the_model_fixes(tmp_path, dims, size):
    from qtool.data.images import load_image
    cfg, _ = fit_to_input(load_config("ppocr-rec"), dims)
    assert cfg.size == size
    x = load_image(_ocr_image(tmp_path, "crop.png", 100, 20), cfg)
    w = -(-size[0] * 100 // 20)
    assert x.shape == (1, 3) + size and np.abs(x[0, :, :, w - 1]).max() > 0 and np.all(x[0, :, :, w:] == 0)


@pytest.mark.parametrize("pre,word", [({"resize": "limit", "limit_side": 0}, "limit_side"),
                                      ({"resize": "limit", "multiple": 2000}, "multiple"),
                                      ({"resize": "height", "crop": "center"}, "crop must be none"),
                                      ({"resize": "widest"}, "resize must be shorter, exact, none, limit or height")])
def test_ppocr_resize_modes_are_validated(pre, word):
    from qtool.data.config import from_dict
    with pytest.raises(QtoolError, match=word):
        from_dict({"preprocess": {"crop": "none"} | pre}, "bad.toml")


def _ocr_net(height):
    """Conv -> Relu -> Conv -> Relu, a dynamic width (and height unless given): a detector's map, or with
    a height, a recognizer's [N, W/2, 6] sequence (mean over the height, a MatMul per column)."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1] * 4, strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["c2"], ["r2" if height else "y"])]
    inits = [init("w1", rng.normal(0, 0.3, (8, 3, 3, 3))), init("b1", rng.normal(0, 0.1, 8)),
             init("w2", rng.normal(0, 0.3, (8, 8, 3, 3))), init("b2", rng.normal(0, 0.1, 8))]
    if height:
        nodes += [helper.make_node("ReduceMean", ["r2"], ["m"], axes=[2], keepdims=0),
                  helper.make_node("Transpose", ["m"], ["t"], perm=[0, 2, 1]),
                  helper.make_node("MatMul", ["t", "fc"], ["y"])]
        inits.append(init("fc", rng.normal(0, 0.3, (8, 6))))
    return make_model(nodes, inits, [("x", ["N", 3, height or "H", "W"])],
                      [("y", ["N", "T", 6] if height else ["N", 8, "H2", "W2"])])


@pytest.mark.parametrize("preset,height,sizes", [("ppocr-rec", 48, [(100, 20), (40, 30), (600, 24), (18, 36)]),
                                                 ("ppocr-det", None, [(1000, 700), (640, 480), (300, 200)])])
def test_ppocr_presets_calibrate_end_to_end(tmp_path, monkeypatch, capsys, preset, height, sizes):
    """`qtool calibrate --config ppocr-...` on images of different sizes; the fused graph keeps the sizes
    that vary free (a recognizer's width, a detector's height and width)."""
    from qtool import cli
    from qtool.calibrate.table import load_table
    monkeypatch.chdir(tmp_path)
    net = save(_ocr_net(height), tmp_path / "ocr.onnx")
    (tmp_path / "d").mkdir()
    for k, (w, h) in enumerate(sizes):
        _ocr_image(tmp_path / "d", f"{k}.png", w, h, seed=k)
    try:
        cli.main(["calibrate", "--model", net, "--data", "d", "--config", preset, "-w", "work", "--threads", "1"])
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    assert f"calibrated {len(sizes)} images" in capsys.readouterr().out
    t = load_table(str(tmp_path / "work" / "calibration.json"))
    assert t.n_samples == len(sizes) and t.config["resize"] == ("height" if height else "limit")
    assert all(lo < hi for lo, hi in t.ranges["minmax"].values())
    dims = [d.dim_value or None for d in onnx.load(str(tmp_path / "work" / "fused.onnx")).graph.input[0]
            .type.tensor_type.shape.dim]
    assert dims[1:] == [3, height, None]
