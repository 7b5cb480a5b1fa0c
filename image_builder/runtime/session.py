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
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .execution import DEFAULT_PATH, RunRequest, RunResult
from .holder import job_message, memfd_with, recv_fds
from .mounts import RunnerError

if TYPE_CHECKING:
    from ..store.store import ResolvedInstance

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
    # sha256 of env_sif, then of each overlay, as the store's index records them ("sha256:..."):
    # open_session checks them once per node (checked.py); () checks nothing.
    digests: tuple[str, ...] = ()

    @classmethod
    def of(cls, resolved: ResolvedInstance) -> InstanceLayers:
        """An instance as the store resolves it, with its digests."""
        return cls(resolved.env_sif, resolved.overlays, resolved.env, resolved.workdir, resolved.digests)


class Backend(str, enum.Enum):
    KERNEL = "kernel"
    USERNS = "userns"
    APPTAINER = "apptainer"
    EXTRACT = "extract"



# --- running a job and collecting what it says ------------------------------------------------


def build_job(layers: InstanceLayers, request: RunRequest, max_processes: int) -> dict:
    """What an init runs (holder.py, "session -> init"): the environment is complete,
    the image's variables, then the request's. The instance's own workdir is made where the
    instance lacks it (a catalog's /task for tasks that add no files), as Docker makes a
    missing WORKDIR; another one asked for (a sandbox exec's cwd) must exist, as for
    `docker exec -w`."""
    if not request.argv:
        raise RunnerError("empty argv: give the command to run")
    workdir = request.workdir or layers.workdir
    files = request.placed_files(layers.workdir)
    return {"argv": list(request.argv), "env": {"PATH": DEFAULT_PATH, "HOME": "/root", **layers.env, **request.env},
            "workdir": workdir, "make_workdir": workdir == layers.workdir, "files": files,
            "timeout": request.timeout, "memory_mb": request.memory_mb, "max_processes": max_processes,
            "zygote": request.zygote}


def stdin_fd(data: bytes | None) -> int:
    """A regular file (memfd) holding the input, as judges give it: os.fstat(0).st_size works.
    Inside Session.stream, without data: the stream's stdin."""
    relay = getattr(_streaming, "relay", None)
    if data is None and relay is not None and relay.stdin is not None:
        import fcntl

        return fcntl.fcntl(relay.stdin, fcntl.F_DUPFD_CLOEXEC, 0)
    return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) if data is None else memfd_with(data)


def job_descriptors(job: bytes, stdin: bytes | None) -> tuple[bytes, list[int], int, int]:
    """What an encoded job goes to an init with (holder.py, "session -> init"): its message,
    the descriptors to pass with it (stdin, the write ends of stdout and stderr, a big job's
    memfd: the caller closes them once sent), and the read ends of stdout and stderr."""
    fds: list[int] = []
    try:
        fds.append(stdin_fd(stdin))
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        fds += [out_w, out_r]
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        fds += [err_w, err_r]
        msg, payload = job_message(job)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return msg, [fds[0], out_w, err_w, *payload], out_r, err_r


# --- streaming: Session.stream ------------------------------------------------------------------

_STDERR_TAIL = 4096  # bytes of a streamed stderr kept for the out-of-memory verdict (build_result)


class OutputCapped(Exception):
    """A streamed run wrote more than its max_output to `stream` ("stdout" or "stderr");
    the run was stopped."""

    def __init__(self, stream: str, limit: int):
        super().__init__(f"{stream} went over {limit} bytes")
        self.stream = stream
        self.limit = limit


class RunCancelled(Exception):
    """A streamed run's `cancel` descriptor became readable; the run was stopped."""


@dataclass
class _Relay:
    stdin: int | None  # what the run gets as stdin (see stdin_for_run), or None: /dev/null
    stdout: int
    stderr: int
    cancel: int | None = None  # readable: stop the run (RunCancelled)
    used: bool = False  # collect() passed the output on (a backend may answer without running anything)


# Session.stream's relay for the calling thread. Backends call collect() and stdin_fd()
# from the thread that called run(), so every backend streams without knowing it, and
# runs from other threads (an Executor's) keep collecting into memory.
_streaming = threading.local()


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:  # a terminal left non-blocking by another program: wait for room
            select.select([], [fd], [])


def _own_socketpair(fd: int) -> bool:
    """An unnamed Unix socket this process made (socketpair): a channel to the run (warm.py's
    zygote takes its jobs on one), reaching nothing but this process."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        peer = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return (sock.family == socket.AF_UNIX and not sock.getsockname() and not sock.getpeername()
                and struct.unpack("3i", peer)[0] == os.getpid())
    except OSError:
        return False
    finally:
        sock.close()


def stdin_for_run(fd: int | None) -> tuple[int | None, object]:
    """What a streamed run may be given of this process's `fd` as its stdin, and what to
    call when it is over. Never the host's own file or device: a regular file could be
    reopened for writing through /proc/self/fd/0 from inside, a terminal takes TIOCSTI
    (typing into the user's shell), a socket reaches the host's network. So: a pipe as
    it is (streams, as in a shell pipeline), as is a socketpair this process made
    (_own_socketpair), a terminal or /dev/null as /dev/null, a regular file copied to an
    unlinked temporary file (a regular file, as judges want; on disk, not in memory),
    anything else copied into a pipe by a thread."""
    if fd is None:
        return None, lambda: None
    try:
        st = os.fstat(fd)
    except OSError:  # closed: nothing to read
        return None, lambda: None
    if os.isatty(fd) or (stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat(os.devnull).st_rdev):
        return None, lambda: None
    if stat.S_ISFIFO(st.st_mode) or (stat.S_ISSOCK(st.st_mode) and _own_socketpair(fd)):
        return fd, lambda: None
    if stat.S_ISREG(st.st_mode):
        import tempfile

        spool = tempfile.TemporaryFile()  # O_TMPFILE where it can: never has a name another user could open
        try:
            while True:
                try:
                    n = os.sendfile(spool.fileno(), fd, None, 1 << 30)
                except OSError:  # a file system without sendfile: plain copies, 1 MiB at a time
                    n = os.write(spool.fileno(), os.read(fd, 1 << 20))
                if not n:
                    break
            spool.seek(0)
        except OSError as e:
            spool.close()
            raise RunnerError(f"cannot copy stdin for the run: {e}") from None
        return spool.fileno(), spool.close
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    stop_r, stop_w = os.pipe2(os.O_CLOEXEC)

    def pump() -> None:
        try:
            while select.select([fd, stop_r], [], [])[0] == [fd]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                _write_all(write_end, memoryview(chunk))
        except OSError:  # the run closed its stdin (EPIPE), or ours went away
            pass
        finally:
            os.close(write_end)
            os.close(stop_r)

    thread = threading.Thread(target=pump, name="image-builder-stdin", daemon=True)
    thread.start()

    def stop() -> None:
        os.close(read_end)  # a pump stuck writing gets EPIPE
        os.close(stop_w)  # one waiting for input wakes; either closes its ends
        thread.join(1.0)

    return read_end, stop


@dataclass
class Captured:
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    reply: dict | None = None


def collect(out_r: int, err_r: int, max_output: int, deadline: float | None,
            conn: socket.socket | None = None, done=None, until_reply: bool = False) -> Captured:
    """Drain stdout and stderr (keeping max_output bytes of each) until both close and,
    with `conn`, a reply arrived; TimeoutError at `deadline`. `until_reply`: stop at the
    reply with what was written by then (a sandbox's command has ended; what it left in
    the background may hold the pipes open for long). `done()` is called while
    nothing happens (the extract backend watches its command there). Inside
    Session.stream, the output goes to the stream's descriptors instead (stderr's tail
    kept), and OutputCapped is raised past max_output of either (0: no limit): the
    caller's cleanup on an exception stops the run, as it does for a Ctrl-C."""
    got = Captured()
    bufs = {out_r: got.stdout, err_r: got.stderr}
    relay = getattr(_streaming, "relay", None)
    sinks = {out_r: relay.stdout, err_r: relay.stderr} if relay else {}
    if relay:
        relay.used = True
    sent = {out_r: 0, err_r: 0}
    poller = select.poll()
    for fd in (out_r, err_r) + ((conn.fileno(),) if conn else ()):
        poller.register(fd, select.POLLIN)
    if relay and relay.cancel is not None:
        poller.register(relay.cancel, select.POLLIN)
    pending = len(bufs) + (1 if conn else 0)
    replied = False
    while pending:
        wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        if replied:
            wait = 0
        if done is not None:
            wait = 20 if wait is None else min(wait, 20)
        events = poller.poll(wait)
        if not events and replied:
            break
        if not events:
            if done is not None:
                done()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError
        for fd, _ in events:
            if relay and fd == relay.cancel:
                raise RunCancelled
            if conn is not None and fd == conn.fileno():
                try:
                    reply = recv_fds(conn, 0)[0]
                except OSError:  # reset: no reply, as at EOF
                    reply = None
                got.reply = reply or got.reply
                poller.unregister(fd)
                pending -= 1
                replied = until_reply
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                poller.unregister(fd)
                pending -= 1
                continue
            if relay:
                _relay(chunk, fd, sinks[fd], sent, max_output, "stdout" if fd == out_r else "stderr")
                if fd == err_r:
                    got.stderr += chunk
                    del got.stderr[:-_STDERR_TAIL]
                continue
            buf = bufs[fd]
            room = max_output - len(buf)
            if len(chunk) > room:
                got.truncated = True
                chunk = chunk[:max(room, 0)]
            buf += chunk
    return got


def _relay(chunk: bytes, fd: int, sink: int, sent: dict[int, int], limit: int, name: str) -> None:
    """Pass `chunk` of stream `fd` on to `sink`, up to `limit` bytes in all (0: no limit)."""
    room = limit - sent[fd] if limit else len(chunk)
    _write_all(sink, memoryview(chunk)[:max(room, 0)])
    sent[fd] += len(chunk)
    if len(chunk) > room:
        raise OutputCapped(name, limit)


def build_result(got: Captured, request: RunRequest, wall: float, exit_code: int | None, sig: int | None,
                 timed_out: bool, peak_kb: int | None, oom: bool | None, start_errno: int | None = None) -> RunResult:
    if oom is None:  # rlimits only: a memory limit was set and the run died saying it ran out
        oom = bool(request.memory_mb) and not timed_out and exit_code != 0 and \
            any(m in got.stderr[-4096:] for m in _OOM_MARKERS)
    return RunResult(exit_code, sig, timed_out, oom, wall, peak_kb, bytes(got.stdout), bytes(got.stderr),
                     got.truncated, start_errno)


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

    def stream(self, request: RunRequest, stdin: int | None = None, stdout: int = 1, stderr: int = 2,
               cancel: int | None = None) -> RunResult:
        """run(), with the output passed on to the descriptors `stdout` and `stderr` as it
        comes instead of kept (a command line's way: memory stays flat whatever the run
        prints). Past request.max_output bytes of either (0: no limit) the run is stopped
        and OutputCapped raised; when the descriptor `cancel` becomes readable, likewise
        with RunCancelled (how warm.py stops a zygote that no longer answers). `stdin`
        (without request.stdin): a descriptor to read the input from as the run does (see
        stdin_for_run for what the run is given of it). The result's stdout is empty and
        its stderr the last 4 KiB. Output descriptors that stop taking data (EPIPE) end
        the run with BrokenPipeError."""
        if request.stdin is not None:
            stdin = None
        given, release = stdin_for_run(stdin)
        relay = _streaming.relay = _Relay(given, stdout, stderr, cancel)
        try:
            result = self.run(request)
        finally:
            _streaming.relay = None
            release()
        if not relay.used:  # answered without collect(), e.g. extract's "command not found": pass that on
            _write_all(stdout, memoryview(result.stdout))
            _write_all(stderr, memoryview(result.stderr))
        return result

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

