"""qtool.zoo.torch_archive: PyTorch checkpoints read without torch and without running pickle code.

Archives are built here by hand: a fake ``torch`` module (only for the duration of
pickling) gives the standard pickler the same globals torch.save writes, and the
containers (zip, legacy) are assembled with zipfile / raw bytes.
"""
import collections
import contextlib
import io
import os
import pickle
import struct
import sys
import types
import zipfile

import numpy as np
import pytest

from qtool.zoo.torch_archive import (LEGACY_MAGIC, LEGACY_PROTOCOL, TorchArchiveError, load,
                                     load_state_dict, write_state_dict)

STORAGE_NAMES = {np.dtype("float32"): "FloatStorage", np.dtype("float16"): "HalfStorage",
                 np.dtype("int64"): "LongStorage", np.dtype("float64"): "DoubleStorage",
                 np.dtype("uint16"): "BFloat16Storage"}


@contextlib.contextmanager
def fake_torch():
    """Temporarily installs modules torch / torch._utils with the names torch.save pickles."""
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):  # never called: only its name is pickled
        raise AssertionError

    def _rebuild_parameter(*args):
        raise AssertionError

    for f in (_rebuild_tensor_v2, _rebuild_parameter):
        f.__module__, f.__qualname__ = "torch._utils", f.__name__
        setattr(utils, f.__name__, f)
    for name in set(STORAGE_NAMES.values()):
        setattr(torch, name, type(name, (), {"__module__": "torch"}))
    torch._utils = utils
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    sys.modules.update({"torch": torch, "torch._utils": utils})
    try:
        yield torch
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


class Storage:
    def __init__(self, key, values: np.ndarray):
        self.key, self.values = key, np.ascontiguousarray(values).ravel()


class Tensor:
    """Pickles as torch does: _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)."""

    def __init__(self, storage, offset, size, stride, parameter=False):
        self.args = (storage, offset, tuple(size), tuple(stride))
        self.parameter = parameter

    def __reduce__(self):
        utils = sys.modules["torch._utils"]
        t = (utils._rebuild_tensor_v2, self.args + (False, collections.OrderedDict()))
        if self.parameter:
            return (utils._rebuild_parameter, (_Reduced(t), True, collections.OrderedDict()))
        return t


class _Reduced:
    def __init__(self, rv):
        self.rv = rv

    def __reduce__(self):
        return self.rv


def _pickle(obj, persistent_id, torch_module):
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=2)
    p.persistent_id = persistent_id
    p.dump(obj)
    return buf.getvalue()


def make_zip(path, obj, storages, archive="mymodel"):
    with fake_torch() as torch:
        def pid(o):
            if isinstance(o, Storage):
                return ("storage", getattr(torch, STORAGE_NAMES[o.values.dtype]), o.key, "cpu", o.values.size)
            return None
        data = _pickle(obj, pid, torch)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{archive}/data.pkl", data)
        zf.writestr(f"{archive}/byteorder", "little")
        for s in storages:
            zf.writestr(f"{archive}/data/{s.key}", s.values.astype(s.values.dtype.newbyteorder("<")).tobytes())
        zf.writestr(f"{archive}/version", "3\n")


def make_legacy(path, obj, storages, views=None):
    """views: {Storage: (root Storage, element offset)} for the legacy view_metadata."""
    views = views or {}
    with fake_torch() as torch:
        def pid(o):
            if not isinstance(o, Storage):
                return None
            if o in views:
                root, off = views[o]
                return ("storage", getattr(torch, STORAGE_NAMES[root.values.dtype]), root.key, "cpu",
                        root.values.size, (o.key, off, o.values.size))
            return ("storage", getattr(torch, STORAGE_NAMES[o.values.dtype]), o.key, "cpu", o.values.size, None)
        data = _pickle(obj, pid, torch)
    with open(path, "wb") as f:
        for head in (LEGACY_MAGIC, LEGACY_PROTOCOL,
                     {"protocol_version": LEGACY_PROTOCOL, "little_endian": True,
                      "type_sizes": {"short": 2, "int": 4, "long": 4}}):
            f.write(pickle.dumps(head, protocol=2))
        f.write(data)
        f.write(pickle.dumps([s.key for s in storages], protocol=2))
        for s in storages:
            f.write(struct.pack("<q", s.values.size))
            f.write(s.values.tobytes())


# ---------------------------------------------------------------- reading tensors


def test_write_state_dict_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    sd = collections.OrderedDict([
        ("conv.weight", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)),
        ("conv.bias", rng.standard_normal(4).astype(np.float16)),
        ("bn.num_batches_tracked", np.array(7, dtype=np.int64)),
        ("big", np.array([2 ** 40, -3], dtype=np.int64)),
        ("empty", np.zeros((0, 5), dtype=np.float32)),
        ("fc.weight", rng.standard_normal((10, 6)).astype(np.float32).T),  # non-contiguous input
    ])
    p = tmp_path / "w.pth"
    write_state_dict(p, sd)
    got = load_state_dict(p)
    assert list(got) == list(sd)
    for k in sd:
        assert got[k].dtype == sd[k].dtype and got[k].shape == sd[k].shape, k
        np.testing.assert_array_equal(got[k], sd[k])
        assert got[k].flags.writeable


def test_zip_strides_offsets_and_shared_storage(tmp_path):
    base = np.arange(24, dtype=np.float32)
    st = Storage("0", base)
    half = Storage("1", np.arange(6, dtype=np.float16) / 4)
    longs = Storage("2", np.array([5, -1, 2 ** 33], dtype=np.int64))
    sd = collections.OrderedDict([
        ("a", Tensor(st, 0, (2, 3, 4), (12, 4, 1))),
        ("a_t", Tensor(st, 0, (4, 6), (1, 4))),            # transposed view, same storage
        ("a_slice", Tensor(st, 5, (2, 2), (12, 2))),        # offset + strides
        ("h", Tensor(half, 2, (2, 2), (2, 1), parameter=True)),
        ("n", Tensor(longs, 2, (), ())),                     # 0-d at an offset
        ("meta", {"not": "a tensor"}),
    ])
    sd_obj = collections.OrderedDict(sd)
    p = tmp_path / "x.pt"
    make_zip(p, sd_obj, [st, half, longs])
    got = load_state_dict(p)
    np.testing.assert_array_equal(got["a"], base.reshape(2, 3, 4))
    np.testing.assert_array_equal(got["a_t"], base.reshape(6, 4).T)
    np.testing.assert_array_equal(got["a_slice"], np.array([[5, 7], [17, 19]], np.float32))
    np.testing.assert_array_equal(got["h"], (np.arange(6, dtype=np.float16) / 4)[2:].reshape(2, 2))
    assert got["h"].dtype == np.float16
    assert got["n"].shape == () and got["n"].dtype == np.int64 and int(got["n"]) == 2 ** 33
    assert "meta" not in got
    # the full tree keeps non-tensor entries
    assert load(p)["meta"] == {"not": "a tensor"}


def test_bfloat16_is_widened_to_float32(tmp_path):
    vals = np.array([1.5, -2.0, 3.140625], dtype=np.float32)
    st = Storage("0", (vals.view(np.uint32) >> 16).astype(np.uint16))
    p = tmp_path / "bf.pt"
    make_zip(p, {"w": Tensor(st, 0, (3,), (1,))}, [st])
    got = load_state_dict(p)["w"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, vals)


def test_wrapped_training_checkpoint_is_unwrapped(tmp_path):
    st = Storage("0", np.ones(3, np.float32))
    p = tmp_path / "ckpt.pth"
    make_zip(p, {"epoch": 3, "state_dict": {"w": Tensor(st, 0, (3,), (1,))}}, [st])
    assert list(load_state_dict(p)) == ["w"]


def test_legacy_format_with_views(tmp_path):
    root = Storage("100", np.arange(10, dtype=np.float32))
    view = Storage("101", np.arange(4, 8, dtype=np.float32))
    other = Storage("200", np.array([1, 2, 3], dtype=np.int64))
    sd = collections.OrderedDict([
        ("w", Tensor(root, 1, (3, 3), (3, 1))),
        ("v", Tensor(view, 1, (3,), (1,))),              # offset inside a view of root at 4
        ("i", Tensor(other, 0, (3,), (1,), parameter=True)),
    ])
    p = tmp_path / "legacy.pth"
    make_legacy(p, sd, [root, other], views={view: (root, 4)})
    got = load_state_dict(p)
    np.testing.assert_array_equal(got["w"], np.arange(1, 10, dtype=np.float32).reshape(3, 3))
    np.testing.assert_array_equal(got["v"], np.array([5, 6, 7], np.float32))
    np.testing.assert_array_equal(got["i"], np.array([1, 2, 3]))


# ---------------------------------------------------------------- refusing


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class EvalEvil:
    def __reduce__(self):
        return (eval, ("__import__('os').getcwd()",))


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_malicious_global_is_refused_and_never_runs(tmp_path, fmt):
    marker = tmp_path / "pwned"
    st = Storage("0", np.ones(2, np.float32))
    obj = collections.OrderedDict([("w", Tensor(st, 0, (2,), (1,))), ("x", Evil(marker))])
    p = tmp_path / f"evil.{fmt}"
    (make_zip if fmt == "zip" else make_legacy)(p, obj, [st])
    with pytest.raises(TorchArchiveError) as e:
        load_state_dict(p)
    msg = str(e.value)
    assert str(p) in msg and "system" in msg and "refused" in msg
    assert not marker.exists()


def test_eval_and_bare_pickles_are_refused(tmp_path):
    p = tmp_path / "eval.pt"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"w": EvalEvil()}, protocol=2))
    with pytest.raises(TorchArchiveError, match=r"(builtins|__builtin__)\.eval"):
        load(p)
    # a plain pickle (no torch container) is not a checkpoint: its first object is not the magic
    q = tmp_path / "plain.pkl"
    q.write_bytes(pickle.dumps(Evil(tmp_path / "pwned2"), protocol=2))
    with pytest.raises(TorchArchiveError):
        load(q)
    assert not (tmp_path / "pwned2").exists()


def test_tensor_outside_its_storage_is_refused(tmp_path):
    st = Storage("0", np.zeros(4, np.float32))
    p = tmp_path / "oob.pt"
    make_zip(p, {"w": Tensor(st, 2, (2, 2), (2, 1))}, [st])
    with pytest.raises(TorchArchiveError, match="reaches element"):
        load(p)


def test_garbage_and_missing_files(tmp_path):
    p = tmp_path / "junk.pth"
    p.write_bytes(b"\x00\x01 not a pickle at all")
    with pytest.raises(TorchArchiveError):
        load(p)
    with pytest.raises(TorchArchiveError, match="cannot read"):
        load(tmp_path / "absent.pth")
    z = tmp_path / "nopkl.pt"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("a/constants.pkl", b"")
    with pytest.raises(TorchArchiveError, match="TorchScript"):
        load(z)


@pytest.mark.parametrize("payload", [
    b"ctorch\nFloatStorage\n}X\x05\x00\x00\x00dtypeK\x01sb.",            # BUILD with a dict state
    b"ctorch\nFloatStorage\nN}X\x05\x00\x00\x00dtypeK\x01s\x86b.",       # BUILD with (None, slotstate)
    b"ctorch._utils\n_rebuild_tensor_v2\nN}X\x02\x00\x00\x00fnK\x01s\x86b.",
    b"ccollections\nOrderedDict\n}X\x07\x00\x00\x00__len__K\x01sb.",     # BUILD on the class itself
])
def test_allowed_globals_cannot_be_modified_by_a_pickle(tmp_path, payload):
    p = tmp_path / "build.pt"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02" + payload)
    with pytest.raises(TorchArchiveError):
        load(p)
    # the reader still works afterwards, with float32 storages
    ok = tmp_path / "ok.pt"
    write_state_dict(ok, {"w": np.arange(3, dtype=np.float32)})
    got = load_state_dict(ok)["w"]
    assert got.dtype == np.float32 and got.tolist() == [0.0, 1.0, 2.0]


def test_storage_size_is_checked_before_reading(tmp_path):
    st = Storage("0", np.ones(4, np.float32))
    p = tmp_path / "short.pt"
    make_zip(p, {"w": Tensor(st, 0, (4,), (1,))}, [st])
    q = tmp_path / "bad.pt"
    with zipfile.ZipFile(p) as src, zipfile.ZipFile(q, "w", zipfile.ZIP_DEFLATED) as dst:
        for n in src.namelist():
            dst.writestr(n, src.read(n) if not n.endswith("data/0") else bytes(1 << 20))
    with pytest.raises(TorchArchiveError, match="holds 1048576 bytes"):
        load(q)
