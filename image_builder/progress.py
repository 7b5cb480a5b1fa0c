"""Download progress: rich bars on a terminal, plain log lines elsewhere.

rich is imported only when bars are drawn: the run path must start fast.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Protocol


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class Progress(Protocol):
    def start(self, key: str, total: int | None, label: str) -> None: ...
    def advance(self, key: str, n: int) -> None: ...
    def restart(self, key: str) -> None: ...
    def finish(self, key: str, note: str, size: int) -> None: ...


class NullProgress:
    """Also the base of the others: every progress is a context manager."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def start(self, key, total, label): pass
    def advance(self, key, n): pass
    def restart(self, key): pass
    def finish(self, key, note, size): pass


class LogProgress(NullProgress):
    """One line when a blob starts and one when it ends, for logs and CI."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self._started: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def _say(self, text: str) -> None:
        with self._lock:
            print(text, file=self.stream, flush=True)

    def start(self, key, total, label):
        self._started[key] = (label, time.monotonic())
        self._say(f"fetching {label} ({human_bytes(total) if total else 'size unknown'})")

    def advance(self, key, n):
        pass

    def restart(self, key):
        self._say(f"restarting {self._started.get(key, (key, 0))[0]} from the beginning")

    def finish(self, key, note, size):
        label, t0 = self._started.pop(key, (key[7:19], None))
        if t0 is None:
            self._say(f"{label}: {note}")
        else:
            dt = max(time.monotonic() - t0, 1e-6)
            self._say(f"{label}: {note}, {human_bytes(size)} in {dt:.1f}s ({human_bytes(size / dt)}/s)")


class RichProgress(NullProgress):
    """Bars with bytes and speed; use as a context manager."""

    def __init__(self):
        from rich.progress import (BarColumn, DownloadColumn, Progress as RP, TextColumn,
                                   TransferSpeedColumn)
        self._rp = RP(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), transient=False)
        self._tasks: dict[str, int] = {}

    def __enter__(self):
        self._rp.start()
        return self

    def __exit__(self, *exc):
        self._rp.stop()

    def start(self, key, total, label):
        self._tasks[key] = self._rp.add_task(label, total=total)

    def advance(self, key, n):
        self._rp.advance(self._tasks[key], n)

    def restart(self, key):
        self._rp.reset(self._tasks[key])

    def finish(self, key, note, size):
        if key not in self._tasks:
            self._tasks[key] = self._rp.add_task(key[7:19], total=size or 1)
        self._rp.update(self._tasks[key], description=f"{self._rp.tasks[self._tasks[key]].description} {note}",
                        completed=size or 1, total=size or 1)


class BuildLog:
    """Store builds off a terminal: one line per finished item (`quiet`: only those built or failed)."""

    def __init__(self, stream=None, quiet: bool = False):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self._lock = threading.Lock()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def start(self, kind, name):
        pass

    def done(self, result):
        if self.quiet and result.status == "up to date":
            return
        note = f": {result.message}" if result.message else ""
        with self._lock:
            print(f"{result.kind} {result.name}: {result.status} ({result.seconds:.1f}s){note}",
                  file=self.stream, flush=True)


class BuildProgress:
    """Store builds on a terminal: an overall bar, one line per running job, failures as they happen."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RP, SpinnerColumn, TextColumn, \
            TimeElapsedColumn
        self._rp = RP(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn())
        self._overall = self._rp.add_task("store", total=total)
        self._running: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def __enter__(self):
        self._rp.start()
        return self

    def __exit__(self, *exc):
        self._rp.stop()

    def start(self, kind, name):
        with self._lock:
            self._running[(kind, name)] = self._rp.add_task(f"  {kind} {name}", total=None)

    def done(self, result):
        with self._lock:
            task = self._running.pop((result.kind, result.name), None)
            if task is not None:
                self._rp.remove_task(task)
            self._rp.advance(self._overall)
            if result.status == "failed":
                self._rp.console.print(f"[red]failed[/red] {result.kind} {result.name}: {result.message}")
