"""Progress lines and process CPU accounting of the side-by-side benchmark.

:class:`Progress` prints what the run is doing; :func:`proc_cpu` and :func:`measure_idle`
count the CPU an actor's process burns while it should be idle.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import psutil

# ----------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on stderr (a plain line per step when not a terminal)."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._label = ""
        self._last_group = ""

    def _render(self) -> None:
        frac = self.done / self.total
        bar = "#" * int(frac * 30)
        text = (f"[{bar:<30}] {self.done}/{self.total} {self._label} "
                f"{time.monotonic() - self.start:5.1f}s")
        if self.tty:
            self.stream.write("\r" + text[:120].ljust(120))
            self.stream.flush()
        else:
            group = self._label.split(" ")[0]
            if group != self._last_group:
                self._last_group = group
                self.stream.write(text + "\n")
                self.stream.flush()

    def label(self, text: str) -> None:
        self._label = text
        self._render()

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._render()

    def note(self, text: str) -> None:
        """Print a line without breaking the bar."""
        if self.tty:
            self.stream.write("\r" + " " * 120 + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()
        if self.tty:
            self._render()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ----------------------------------------------------------------------------- processes


def proc_cpu(pid: int) -> tuple[float, int] | None:
    """(user+system CPU seconds, thread count) of a process on this host."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            times = proc.cpu_times()
            return times.user + times.system, proc.num_threads()
    except psutil.Error:
        return None


def measure_idle(pids: dict[str, dict[str, int]], window_s: float,
                 settle_s: float = 0.0) -> dict[str, Any]:
    """CPU cores each process used while nothing was sent, over ``window_s`` that start
    ``settle_s`` after the last transfer."""
    time.sleep(settle_s)
    before = {(v, role): proc_cpu(pid) for v, roles in pids.items() for role, pid in roles.items()}
    t0 = time.monotonic()
    time.sleep(window_s)
    wall = time.monotonic() - t0
    out: dict[str, Any] = {}
    for (v, role), b in before.items():
        a = proc_cpu(pids[v][role])
        out.setdefault(v, {})[role] = None if a is None or b is None else {
            "cores": round((a[0] - b[0]) / wall, 3), "threads": a[1], "window_s": round(wall, 3)}
    return out


def pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return True
