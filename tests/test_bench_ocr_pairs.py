"""benchmarks/bench_ocr.py: a variant is compared word for word with fp32, not only by its accuracy."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_ocr.py")
_spec = importlib.util.spec_from_file_location("bench_ocr", _PATH)
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)

BOX = [[0, 0], [40, 0], [40, 10], [0, 10]]
BOX2 = [[0, 20], [40, 20], [40, 30], [0, 30]]
LABELS = {"a.jpg": [{"text": "cat", "box": [0, 0, 40, 10]}, {"text": "dog", "box": [0, 20, 40, 30]}],
          "b.jpg": [{"text": "owl", "box": [0, 0, 40, 10]}]}


def _e2e(a, b, c):
    return B.score_e2e(LABELS, {"b.jpg": [[BOX, c, 0.9]], "a.jpg": [[BOX, a, 0.9], [BOX2, b, 0.9]]})


def test_equal_accuracy_can_hide_flips_either_way():
    fp32, int8 = _e2e("cat", "dog", "0wl"), _e2e("cat", "d0g", "owl")
    assert fp32["word_acc"] == int8["word_acc"] == 2 / 3
    assert fp32["read_mask"] == "110" and int8["read_mask"] == "101"  # (images in name order)
    base = {"e2e": fp32, "crops": B.score_crops({"x": "cat", "y": "dog"}, {"x": ["cat", 0.9], "y": ["dog", 0.9]})}
    v = {"e2e": int8, "crops": B.score_crops({"x": "cat", "y": "dog"}, {"x": ["cat", 0.9], "y": ["Dog", 0.9]})}
    assert B.against_fp32(v, base) == {"e2e_lost": 1, "e2e_gained": 1, "crops_changed": 1}
    assert B.against_fp32(base, base) is None
    v["vs_fp32"], v["name"] = B.against_fp32(v, base), "int8"
    assert "-1/+1, 1" in B.variant_cells(v, base)
