"""The session types every backend shares: what the store resolves for an instance
(InstanceLayers), which backend runs it (Backend), a Session keeping the layers mounted
for many runs, and collecting a run's output into a RunResult.

    with open_session(InstanceLayers(env_sif, (inst_sqfs,), env, "/testbed")) as s:
        result = s.run(RunRequest(("python3", "-c", "print(1)"), timeout=10))

For every run (kernel and userns; apptainer and extract do what they can, and say
what they cannot): new mount, pid, ipc, uts and (unless network=True) network namespaces;
the layers read-only under a tmpfs upper; /tmp and /dev/shm tmpfs of the run's own,
emptied after it (a run that wrote only there leaves its root to the next); host paths only
where bound; the image's environment, then the request's, never the host's; stdin as
a regular file; the timeout kills the whole pid namespace; memory and process limits
from a cgroup where one is delegated (v2) or owned (root), else RLIMIT_AS and
RLIMIT_NPROC. With RLIMIT_AS only, out_of_memory is judged from what the run printed
(MemoryError, bad_alloc, ...), and peak_memory_kb is the command's ru_maxrss.
"""

from __future__ import annotations

import enum
import os
import select
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from .execution import DEFAULT_PATH, RunRequest, RunResult
from .holder import memfd_with, recv_fds
from .mounts import RunnerError

# What a failed allocation prints, by language: with only RLIMIT_AS to go by, the output is the evidence.
_OOM_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory",
                b"memory allocation of", b"Out of memory")


@dataclass(frozen=True)
class InstanceLayers:
    """What the store resolves for an instance, in mount order."""

    env_sif: Path  # environment image (.sif; its primary partition is the squashfs root)
    overlays: tuple[Path, ...]  # instance .sqfs layers, bottom to top (usually one)
    env: dict[str, str]  # image environment variables
    workdir: str = "/"


class Backend(str, enum.Enum):
    KERNEL = "kernel"
    USERNS = "userns"
    APPTAINER = "apptainer"
    EXTRACT = "extract"



# --- running a job and collecting what it says ------------------------------------------------


def build_job(layers: InstanceLayers, request: RunRequest, max_processes: int) -> dict:
    """What an init runs (holder.py, "session -> init"): the environment is complete,
    the image's variables, then the request's."""
    if not request.argv:
        raise RunnerError("empty argv: give the command to run")
    workdir = request.workdir or layers.workdir
    files = request.placed_files(layers.workdir)
    return {"argv": list(request.argv), "env": {"PATH": DEFAULT_PATH, "HOME": "/root", **layers.env, **request.env},
            "workdir": workdir, "files": files,
            "timeout": request.timeout, "memory_mb": request.memory_mb, "max_processes": max_processes}


def stdin_fd(data: bytes | None) -> int:
    """A regular file (memfd) holding the input, as judges give it: os.fstat(0).st_size works."""
    return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) if data is None else memfd_with(data)


@dataclass
class Captured:
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    reply: dict | None = None


def collect(out_r: int, err_r: int, max_output: int, deadline: float | None,
            conn: socket.socket | None = None, done=None) -> Captured:
    """Drain stdout and stderr (keeping max_output bytes of each) until both close and,
    with `conn`, a reply arrived; TimeoutError at `deadline`. `done()` is called while
    nothing happens (the extract backend watches its command there)."""
    got = Captured()
    bufs = {out_r: got.stdout, err_r: got.stderr}
    poller = select.poll()
    for fd in (out_r, err_r) + ((conn.fileno(),) if conn else ()):
        poller.register(fd, select.POLLIN)
    pending = len(bufs) + (1 if conn else 0)
    while pending:
        wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        if done is not None:
            wait = 20 if wait is None else min(wait, 20)
        events = poller.poll(wait)
        if not events:
            if done is not None:
                done()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError
        for fd, _ in events:
            if conn is not None and fd == conn.fileno():
                try:
                    got.reply = recv_fds(conn, 0)[0] or got.reply
                except OSError:  # reset: no reply, as at EOF
                    pass
                poller.unregister(fd)
                pending -= 1
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                poller.unregister(fd)
                pending -= 1
                continue
            buf = bufs[fd]
            room = max_output - len(buf)
            if len(chunk) > room:
                got.truncated = True
                chunk = chunk[:max(room, 0)]
            buf += chunk
    return got


def build_result(got: Captured, request: RunRequest, wall: float, exit_code: int | None, sig: int | None,
                 timed_out: bool, peak_kb: int | None, oom: bool | None) -> RunResult:
    if oom is None:  # rlimits only: a memory limit was set and the run died saying it ran out
        oom = bool(request.memory_mb) and not timed_out and exit_code != 0 and \
            any(m in got.stderr[-4096:] for m in _OOM_MARKERS)
    return RunResult(exit_code, sig, timed_out, oom, wall, peak_kb, bytes(got.stdout), bytes(got.stderr),
                     got.truncated)


# --- sessions ----------------------------------------------------------------------------------


class Session:
    """An instance's layers kept mounted for many runs; a context manager. run() may be
    called from many threads at once (execution.Executor)."""

    backend: Backend

    def __init__(self, layers: InstanceLayers, max_processes: int):
        self.layers = layers
        self.max_processes = max_processes

    def run(self, request: RunRequest) -> RunResult:
        raise NotImplementedError

    def shell(self, argv: tuple[str, ...] = ("/bin/sh",), persist: Path | None = None, *,
              network: bool = False) -> int:
        """An interactive command on this process's terminal, over a writable throwaway
        layer (with `persist`, the upper directory is kept there and reused). Returns
        its exit status."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

