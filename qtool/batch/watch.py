"""One child process run to its end under a memory limit and a time limit, measured: exit code, wall
time, peak resident memory of its whole process tree.

The child starts in a session of its own, so every process it spawns (ONNX Runtime's are threads, but a
step may start helpers) carries the session's id; a thread samples the resident memory of that session
from /proc every POLL_S seconds and kills the whole session past the limit. The peak is the highest
sample, or the kernel's own count of the child's peak (ru_maxrss) when that is higher: a peak shorter
than a sampling interval is still counted, though it may escape the kill. Standard library only: the
zoo benchmark's parent process imports this without numpy or onnx.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

try:  # Linux: a child asks to be killed when the process that started it dies (a Ray worker killed
    # mid-job, whose task Ray re-runs: the orphaned step must not go on writing in the folder the re-run empties)
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None
PR_SET_PDEATHSIG = 1
POLL_S = 0.1
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 2 ** 20
TAIL = 20000  # characters of each output stream kept


@dataclass(frozen=True)
class Bounds:
    """Kill the child past memory_mb of resident memory (its tree) or timeout_s seconds (None: no limit);
    `cancel`, when set, kills it too (the batch was interrupted)."""
    memory_mb: float | None = None
    timeout_s: float | None = None
    cancel: threading.Event | None = None


@dataclass
class Run:
    """What one child did."""
    cmd: list
    rc: int | None = None
    seconds: float = 0.0
    peak_mb: float = 0.0
    killed: str = ""
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.killed

    def why(self) -> str:
        """One line: what killed it, else the last line it printed on stderr (qtool's one-line error)."""
        if self.killed:
            return f"killed: {self.killed}"
        lines = [s.strip() for s in self.stderr.replace("\r", "\n").splitlines() if s.strip()]
        last = lines[-1] if lines else f"exit {self.rc}"
        for prefix in ("qtool: error: ", "qtool: "):  # (the table says what failed; qtool's prefix adds nothing)
            if last.startswith(prefix):
                last = last[len(prefix):]
                break
        return last[:300]

    def record(self) -> dict:
        return {"command": " ".join(self.cmd), "rc": self.rc, "seconds": round(self.seconds, 2),
                "peak_mb": round(self.peak_mb, 1), "killed": self.killed, "stderr_tail": self.stderr[-2000:]}


def session_rss(sid: int) -> int:
    """Resident bytes of every process in session `sid`."""
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it exited while we looked
        if int(fields[3]) == sid:
            total += int(fields[21]) * PAGE
    return total


def _watch(run: Run, pid: int, t0: float, bounds: Bounds, stop: threading.Event) -> None:
    while not stop.wait(POLL_S):
        rss = session_rss(pid)
        run.peak_mb = max(run.peak_mb, rss / MB)
        if bounds.memory_mb is not None and rss > bounds.memory_mb * MB:
            run.killed = f"memory above {bounds.memory_mb:g} MB"
        elif bounds.timeout_s is not None and time.monotonic() - t0 > bounds.timeout_s:
            run.killed = f"time above {bounds.timeout_s:g} s"
        elif bounds.cancel is not None and bounds.cancel.is_set():
            run.killed = "interrupted"
        else:
            continue
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def _die_with_parent() -> None:
    """In the child, between fork and exec: SIGKILL when the thread that started it ends (it waits for the
    child, so only when its process dies)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_watched(cmd: list, bounds: Bounds = Bounds(), env: dict | None = None, cwd: str | None = None) -> Run:
    """Runs `cmd` to its end, or until `bounds` kill it; never raises for what the child does."""
    run = Run([str(c) for c in cmd])
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        p = subprocess.Popen(run.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=cwd,
                             start_new_session=True, preexec_fn=_die_with_parent if _prctl else None)
        stop = threading.Event()
        w = threading.Thread(target=_watch, args=(run, p.pid, t0, bounds, stop), daemon=True)
        w.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        except BaseException:  # Ctrl-C: the child has its own session, so the terminal's signal missed it
            os.killpg(p.pid, signal.SIGKILL)
            os.waitpid(p.pid, 0)
            raise
        finally:
            stop.set()
            w.join()
        run.seconds = time.monotonic() - t0
        p.returncode = run.rc = os.waitstatus_to_exitcode(status)
        run.peak_mb = max(run.peak_mb, usage.ru_maxrss / 1024)  # (KB)
        for f, attr in ((out, "stdout"), (err, "stderr")):
            f.seek(0)
            setattr(run, attr, f.read().decode(errors="replace")[-TAIL:])
    return run
