"""The working directory that joins the steps: calibrate -> quantize -> eval.

Each step records what it wrote in manifest.json; the next step reads it, so
`qtool quantize` and `qtool eval` need no paths. A missing step is one clear line.
"""
from __future__ import annotations

import json
import os

from qtool.errors import QtoolError
from qtool.modelio import atomic_write_text

DEFAULT = "qtool_work"
MANIFEST = "manifest.json"


class Workdir:
    def __init__(self, path: str | None = None):
        self.path = os.path.abspath(path or DEFAULT)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def manifest(self) -> dict:
        p = self.file(MANIFEST)
        if not os.path.exists(p):
            return {}
        try:
            with open(p, encoding="utf-8") as f:
                return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise QtoolError(f"{p}: manifest is not valid JSON; delete the folder and run `qtool calibrate` again") from None

    def update(self, **entries) -> dict:
        os.makedirs(self.path, exist_ok=True)
        m = self.manifest()
        m.update(entries)
        atomic_write_text(self.file(MANIFEST), json.dumps(m, indent=2))
        return m

    def require(self, key: str, command: str) -> dict:
        """The manifest entry written by an earlier step, or an error saying which step to run."""
        m = self.manifest()
        if key not in m:
            raise QtoolError(f"{self.path}: nothing from `qtool {command}` here yet; run `qtool {command}` first "
                             f"(or pass the paths explicitly)")
        entry = m[key]
        for k, v in (entry.items() if isinstance(entry, dict) else []):
            if k.endswith("path") and isinstance(v, str) and not os.path.exists(v):
                raise QtoolError(f"{v}: recorded by `qtool {command}` but missing; run `qtool {command}` again")
        return entry
