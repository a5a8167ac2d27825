"""The working directory that joins the steps: calibrate -> quantize -> eval.

Each step records what it wrote in manifest.json; the next step reads it, so
`qtool quantize` and `qtool eval` need no paths. A missing step is one clear line.

Every entry records the sha256 of what the step read and wrote (calibrate: the model, the fused
graph, the table; quantize: the table, the int8 model), and a step that reads an artifact checks
it against the hash recorded for it: a table or int8 model rewritten by a later run, a run killed
between writing a file and the manifest, or a hand-edited manifest is one error, never a silent
mix of two models. A step that writes holds an exclusive lock on the folder for its whole run,
so two runs cannot interleave their files; the lock dies with the process (kill -9 included),
and the temporary files such a process leaves are removed by the next run, from the registry it
kept of them (tempfiles.py), never by their names' pattern.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os

from qtool import tempfiles
from qtool.errors import QtoolError
from qtool.limits import regular_file
from qtool.modelio import atomic_write_text, check_writable, file_hash

DEFAULT = "qtool_work"
MANIFEST = "manifest.json"

# what each entry must hold (key -> type), checked whenever a step reads it
ENTRY_KEYS = {
    "calibrate": {"model_path": str, "model_sha256": str, "fused_path": str, "table_path": str, "table_sha256": str},
    "quantize": {"int8_path": str, "int8_sha256": str, "table_sha256": str, "model_sha256": str},
}

_held: dict = {}  # realpath -> [fd, depth]: the locks this process holds (re-entrant)


class Workdir:
    def __init__(self, path: str | None = None):
        self.path = os.path.abspath(path or DEFAULT)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def manifest(self) -> dict:
        p = self.file(MANIFEST)
        if not os.path.lexists(p):
            return {}
        regular_file(p, "manifest")
        try:
            with open(p, encoding="utf-8") as f:
                m = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise QtoolError(f"{p}: manifest is not valid JSON; delete the folder and run `qtool calibrate` again") from None
        except OSError as e:
            raise QtoolError(f"{p}: cannot read the manifest ({e.strerror or e})") from None
        if not isinstance(m, dict):
            raise QtoolError(f"{p}: manifest is a JSON {type(m).__name__}, not an object; delete the folder and run "
                             f"`qtool calibrate` again")
        for key, v in m.items():
            if not isinstance(v, dict):
                raise QtoolError(f"{p}: manifest entry '{key}' is a {type(v).__name__}, not an object; run "
                                 f"`qtool {key if key in ENTRY_KEYS else 'calibrate'}` again")
        return m

    def update(self, drop=(), **entries) -> dict:
        """Add or replace entries; `drop`: entries that no longer hold (a new calibration makes the
        int8 model of the previous one stale)."""
        with self.lock():
            m = self.manifest()
            for k in drop:
                m.pop(k, None)
            m.update(entries)
            atomic_write_text(self.file(MANIFEST), json.dumps(m, indent=2))
            return m

    def require(self, key: str, command: str, manifest: dict | None = None) -> dict:
        """The manifest entry written by an earlier step, or an error saying which step to run.
        `manifest`: the manifest as the caller already read it."""
        m = self.manifest() if manifest is None else manifest
        if key not in m:
            raise QtoolError(f"{self.path}: nothing from `qtool {command}` here yet; run `qtool {command}` first "
                             f"(or pass the paths explicitly)")
        entry = m[key]
        for k, t in ENTRY_KEYS.get(key, {}).items():
            if not isinstance(entry.get(k), t):
                raise QtoolError(f"{self.file(MANIFEST)}: entry '{key}' lacks '{k}' (written by another qtool "
                                 f"version, or edited); run `qtool {command}` again")
        for k, v in entry.items():
            if k.endswith("path") and isinstance(v, str) and not os.path.exists(v):
                raise QtoolError(f"{v}: recorded by `qtool {command}` but missing; run `qtool {command}` again")
        return entry

    def verify(self, path: str, sha256: str, command: str, what: str, digest: str | None = None) -> None:
        """`path` still holds what `qtool command` recorded (its sha256), or one error. `digest`: the
        sha256 of the bytes already read from `path` (the caller parses those, not the file again)."""
        if (file_hash(path) if digest is None else digest) != sha256:
            raise QtoolError(f"{path}: the {what} changed since `qtool {command}` recorded it in {self.file(MANIFEST)} "
                             f"(another run, an interrupted one, or an edit); run `qtool {command}` again")

    @contextlib.contextmanager
    def lock(self, create: bool = False):
        """Hold the folder exclusively for a step that writes into it (re-entrant within a process).
        `create`: make the folder first, and check now that files can be written in it, before any
        long work (a read-only filesystem, or a path under a file, is one error at once). A folder made
        here and still empty when the step ends (it failed before writing anything) is removed."""
        created = create and not os.path.exists(self.path)
        try:
            with self._lock(create):
                yield self
        finally:
            if created:
                with contextlib.suppress(OSError):
                    os.rmdir(self.path)  # only succeeds when empty

    @contextlib.contextmanager
    def _lock(self, create: bool):
        if create:
            if os.path.exists(self.path) and not os.path.isdir(self.path):
                raise QtoolError(f"{self.path}: the working directory is a file, not a folder")
            try:
                os.makedirs(self.path, exist_ok=True)
            except OSError as e:
                raise QtoolError(f"{self.path}: cannot create the working directory ({e.strerror or e})") from None
            check_writable(self.file(MANIFEST), "working directory")
        if not os.path.isdir(self.path):
            yield self
            return
        key = os.path.realpath(self.path)
        held = _held.get(key)
        if held is not None:
            held[1] += 1
            try:
                yield self
            finally:
                held[1] -= 1
            return
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise QtoolError(f"{self.path}: another qtool run is using this working directory; wait for it to "
                             f"finish, or pass another --workdir") from None
        except OSError:
            pass  # a filesystem without locks: the hashes still catch a mix of two runs
        _held[key] = [fd, 1]
        try:
            tempfiles.claim(self.path)
            yield self
        finally:
            tempfiles.release(self.path)
            del _held[key]
            os.close(fd)
