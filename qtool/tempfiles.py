"""qtool's own temporary files: named so no user would choose the name, and removed only where qtool
can prove it made them.

Every file qtool writes goes first to a temporary file beside it, then is renamed into place (never a
half-written file). The temporary file is `.qtool-tmp-<random>.<name>`, created exclusively (O_EXCL).
A run that fails removes its own; a run killed outright (SIGKILL, power loss) leaves it behind.

Who removes those? Not a sweep by pattern: `.tmp-<dead pid>-*` swept that way deleted a user's
`.tmp-99999-notes.txt` (issue 51). Only in a working directory, which a run holds under its lock
(workdir.py), is there a registry, `.qtool-temp-files`: a temporary file's name is appended to it
*before* the file is created, so every file qtool may leave there is listed. The next run that takes
the lock removes the files listed (only names of this module's form, in that folder, regular files),
then the registry. Elsewhere (a `--json out/eval.json`, an `-o` outside the working directory) a file
left by a killed run stays: qtool cannot prove it made it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import tempfile

from qtool.errors import QtoolError

PREFIX = ".qtool-tmp-"
REGISTRY = ".qtool-temp-files"
_NAME_KEEP = 100  # characters of the final file's name kept in the temporary one's (NAME_MAX is 255)

_held: dict = {}  # realpath of a folder this process holds (a locked working directory) -> its registry path


def _folder(path: str) -> str:
    return os.path.dirname(os.path.abspath(path)) or "."


def make(path: str) -> tuple:
    """(fd, temporary path) of a new file beside `path`, registered first if its folder is a held
    working directory. The folder is made if missing. OSError as the system raises it."""
    d = _folder(path)
    os.makedirs(d, exist_ok=True)
    registry = _held.get(os.path.realpath(d))
    if registry is None:
        return tempfile.mkstemp(prefix=PREFIX, suffix="." + os.path.basename(path)[-_NAME_KEEP:], dir=d)
    # the name is chosen and recorded before the file exists: a kill between the two leaves a listed
    # name with no file, never a file that is not listed
    for _ in range(100):
        name = PREFIX + secrets.token_hex(8) + "." + os.path.basename(path)[-_NAME_KEEP:]
        _append(registry, name)
        try:
            fd = os.open(os.path.join(d, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except FileExistsError:
            continue
        return fd, os.path.join(d, name)
    raise FileExistsError(f"{d}: no free temporary file name")


def _append(registry: str, name: str) -> None:
    """One name onto the registry, which must be a file of its own: never through a symlink or into a file
    with another name too (a hard link), either of which would write into some other file."""
    fd = os.open(registry, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise OSError(errno.EPERM, "the temporary-file registry is not a file of its own", registry)
        os.write(fd, (name + "\n").encode("utf-8"))
    finally:
        os.close(fd)


def claim(folder: str) -> list:
    """This process now holds `folder` (a working directory, under its lock): remove what the registry
    left by an earlier run lists, and keep a registry for this run. -> the files removed. A registry
    that is a symlink, a hard link or no file is an error: qtool neither follows nor removes it."""
    key = os.path.realpath(folder)
    registry = os.path.join(key, REGISTRY)
    if os.path.lexists(registry):
        st = os.lstat(registry)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise QtoolError(f"{registry}: qtool keeps the list of its temporary files here, but this is not a "
                             f"file of its own (a symlink, a hard link or a folder); remove it")
    removed = _sweep(key, registry)
    _held[key] = registry
    return removed


def release(folder: str) -> None:
    """The hold on `folder` ends: every temporary file this run made there was renamed or removed (the
    writers remove theirs on any failure), so the registry goes; one still there stays listed."""
    key = os.path.realpath(folder)
    registry = _held.pop(key, None)
    if registry is not None:
        _sweep(key, registry, keep_unknown=True)


def _sweep(folder: str, registry: str, keep_unknown: bool = False) -> list:
    """Remove the registered temporary files still present in `folder`, then the registry.
    `keep_unknown`: used at release, where nothing should be left: should a file be, the registry stays."""
    try:
        with open(registry, encoding="utf-8", errors="replace") as f:
            names = f.read().splitlines()
    except FileNotFoundError:
        return []
    except OSError:
        return []
    removed, left = [], False
    for name in set(names):
        if not name.startswith(PREFIX) or "/" in name or "\\" in name or "\0" in name:
            continue  # not a name this module makes (a damaged or hand-edited registry): never removed
        p = os.path.join(folder, name)
        if not os.path.lexists(p):
            continue
        if keep_unknown or os.path.islink(p) or not os.path.isfile(p):
            left = True
            continue
        try:
            os.unlink(p)
            removed.append(p)
        except OSError:
            left = True
    if not left:
        with contextlib.suppress(OSError):
            os.unlink(registry)
    return removed
