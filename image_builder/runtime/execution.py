"""What running one command in an instance takes and gives back.

The runtime implements `Executor` (a mounted instance); graders only use this
interface, so a grader never needs to know how an instance is mounted.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


# The PATH a sandbox starts from when the image sets none.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Bind:
    """A host path shown inside a sandbox (nothing of the host is, unless bound)."""

    src: Path
    dest: str  # absolute path inside
    readonly: bool = True


@dataclass(frozen=True)
class RunRequest:
    argv: tuple[str, ...]
    stdin: bytes | None = None  # given as a regular file on fd 0, as judges do (os.fstat(0).st_size works)
    # Written into the throwaway layer before the run; a relative path is relative to the workdir.
    files: dict[str, bytes] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # on top of the image's environment
    workdir: str | None = None  # default: the instance's workdir from the index
    timeout: float | None = None  # seconds of wall time; the whole process tree is killed
    memory_mb: int | None = None
    max_output: int = 1 << 20  # bytes kept of stdout and of stderr each; the rest is dropped
    network: bool = False
    # The command is a warm interpreter (runtime/zygote.py) whose jobs run in pid namespaces under it:
    # on the kernel backend the init hides its processes from them and resets its pid counter for each
    # (init.c pid_keeper).
    zygote: bool = False

    def placed_files(self, default_workdir: str) -> dict[str, bytes]:
        """`files` by their absolute paths inside (a relative one is under the workdir)."""
        workdir = self.workdir or default_workdir
        return {posixpath.join(workdir, path): data for path, data in self.files.items()}


@dataclass(frozen=True)
class RunResult:
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    timed_out: bool
    out_of_memory: bool
    wall_time: float
    peak_memory_kb: int | None
    stdout: bytes
    stderr: bytes
    truncated: bool = False  # output went over max_output
    start_errno: int | None = None  # the command could not be started (exit code 126 or 127): why

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def exit_status(self) -> int:
        """What a shell would report: the exit code, or 128 + N when signal N killed it."""
        return self.exit_code if self.exit_code is not None else 128 + (self.signal or 0)


class Executor(Protocol):
    def run(self, request: RunRequest) -> RunResult: ...

    def stream(self, request: RunRequest, stdin: int | None = None, stdout: int = 1, stderr: int = 2) -> RunResult:
        """run(), talking through the caller's descriptors as it goes (Session.stream): how a
        grader holds a conversation with a run."""
        ...
