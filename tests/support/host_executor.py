"""An `Executor` that runs each request on this host, for grader tests before the sandbox runtime exists.

Each run gets a fresh temporary directory (a copy of `template` when given, like
an instance's throwaway layer over its image) and runs as a real process tree:

- in new pid and network namespaces (`unshare`), so a timeout or the end of the
  main process kills every descendant, including ones that called setsid();
- under a tiny init (`_INIT` below) that reaps orphans, drops root to `run_as`
  and sets the rlimits: RLIMIT_AS for memory_mb, RLIMIT_NPROC so a fork bomb
  stops at `max_processes` (root ignores RLIMIT_NPROC, hence the uid change;
  the cap counts every process of that uid, so concurrent runs share it);
  it reports the main process's wait status on a pipe, because pid 1 of a
  namespace cannot be killed by its own signals and so cannot mirror them;
- stdin is a regular file on fd 0, as judges give it; stdout and stderr are
  drained to the end but only the first `max_output` bytes of each are kept.

Paths in `files` and `workdir` are relative (the temp dir stands for the instance's
workdir: the host's own tree is not the instance's), or under /tmp: each run has a
/tmp of its own (a directory of the temp dir, bound over /tmp in a mount namespace),
as in the sandbox.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from image_builder.errors import ImageBuilderError
from image_builder.runtime.execution import RunRequest, RunResult

# A uid of its own, not nobody: RLIMIT_NPROC counts every process of the uid, and other test
# suites on the same host run as nobody. One per xdist worker (gw0, gw1, ...): a fork bomb on
# one worker fills its uid's budget, which another worker's runs must not share.
SANDBOX_UID = 60321 + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# argv: status_fd  uid|-  nproc|-  as_bytes|-  tmp  cmd...
_INIT = r"""
import ctypes, os, resource, sys
status_fd = int(sys.argv[1])
uid, nproc, address_space, tmp = sys.argv[2:6]
cmd = sys.argv[6:]
# The run's own /tmp, bound here, in this mount namespace, once this interpreter is loaded: it
# may itself live under the host's /tmp.
if ctypes.CDLL(None, use_errno=True).mount(tmp.encode(), b"/tmp", None, 4096, None) != 0:  # MS_BIND
    os.write(2, ("cannot bind %s over /tmp: %s\n" % (tmp, os.strerror(ctypes.get_errno()))).encode())
    os._exit(126)
child = os.fork()
if child == 0:
    os.close(status_fd)
    if address_space != "-":
        resource.setrlimit(resource.RLIMIT_AS, (int(address_space),) * 2)
    if nproc != "-":
        resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc),) * 2)
    if uid != "-":
        os.setgroups([])
        os.setgid(int(uid))
        os.setuid(int(uid))
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        os.write(2, ("cannot run %s: %s\n" % (cmd[0], exc.strerror)).encode())
        os._exit(127)
while True:
    pid, status, usage = os.wait4(-1, 0)
    if pid == child:
        os.write(status_fd, ("%d %d" % (status, usage.ru_maxrss)).encode())
        break
"""


class HostExecutorError(ImageBuilderError):
    pass


class HostExecutor:
    def __init__(self, template: Path | None = None, env: dict[str, str] | None = None,
                 run_as: int | None = SANDBOX_UID, max_processes: int = 256):
        """`run_as` applies when started as root (None keeps root: only for trusted code);
        unprivileged callers run in a user namespace as themselves, without the process cap."""
        self.template = template
        self.env = dict(env or {})
        self.root = os.geteuid() == 0
        self.run_as = run_as if self.root else None
        self.max_processes = max_processes

    def run(self, request: RunRequest) -> RunResult:
        return self.stream(request, None, None, None)

    def stream(self, request: RunRequest, stdin: int | None = None, stdout: int | None = 1,
               stderr: int | None = 2) -> RunResult:
        """As Session.stream: the run talks through these descriptors (None: kept, as run() does)."""
        run_dir = Path(tempfile.mkdtemp(prefix="ib-host-run-", dir="/var/tmp"))  # not under the /tmp it hides
        run_dir.chmod(0o711)  # the run's user reaches work/ through it; stdin stays root's, passed as an open fd
        try:
            return self._run_in(run_dir, request, stdin, stdout, stderr)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    def _run_in(self, run_dir: Path, request: RunRequest, stdin_fd: int | None, stdout_fd: int | None,
                stderr_fd: int | None) -> RunResult:
        work = run_dir / "work"
        if self.template is not None:
            shutil.copytree(self.template, work, symlinks=True)
        else:
            work.mkdir()
        tmp = run_dir / "tmp"
        tmp.mkdir(mode=0o1777)
        tmp.chmod(0o1777)
        for name, content in request.files.items():
            target = _inside(work, tmp, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        cwd = _inside(work, tmp, request.workdir) if request.workdir else work
        if self.run_as is not None:
            _chown_tree(work, self.run_as)
            _chown_tree(tmp, self.run_as)
        stdin_path = run_dir / "stdin"
        stdin_path.write_bytes(request.stdin or b"")
        env = {"PATH": BASE_PATH, "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               **self.env, **request.env}
        status_read, status_write = os.pipe()
        try:
            with open(stdin_path, "rb") as stdin:
                start = time.monotonic()
                given = stdin if request.stdin is not None or stdin_fd is None else stdin_fd
                proc = subprocess.Popen(self._argv(request, status_write, tmp), cwd=cwd, env=env, stdin=given,
                                        stdout=subprocess.PIPE if stdout_fd is None else stdout_fd,
                                        stderr=subprocess.PIPE if stderr_fd is None else stderr_fd,
                                        pass_fds=(status_write,), start_new_session=True)
        except OSError:
            os.close(status_read)
            raise
        finally:
            os.close(status_write)
        readers = [_CappedReader(pipe, request.max_output) for pipe in (proc.stdout, proc.stderr) if pipe]
        timed_out = False
        try:
            proc.wait(timeout=request.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            proc.wait()
        wall = time.monotonic() - start
        for reader in readers:
            reader.join()
        with os.fdopen(status_read, "rb") as status_pipe:
            report = status_pipe.read().decode()
        stdout, stderr = (readers[0].data, readers[1].data) if readers else (b"", b"")
        exit_code, sig, peak = _decode(report, timed_out)
        return RunResult(exit_code=exit_code, signal=sig, timed_out=timed_out,
                         out_of_memory=exit_code not in (0, None) and b"MemoryError" in stderr[-4096:],
                         wall_time=wall, peak_memory_kb=peak, stdout=stdout, stderr=stderr,
                         truncated=any(reader.truncated for reader in readers))

    def _argv(self, request: RunRequest, status_fd: int, tmp: Path) -> list[str]:
        ns = ["unshare", "--pid", "--mount", "--fork", "--kill-child"]
        if not self.root:
            ns[1:1] = ["--user", "--map-root-user"]
        if not request.network:
            ns.append("--net")
        uid = "-" if self.run_as is None else str(self.run_as)
        nproc = "-" if self.run_as is None else str(self.max_processes)
        address_space = "-" if request.memory_mb is None else str(request.memory_mb << 20)
        init = [sys.executable, "-I", "-S", "-c", _INIT, str(status_fd), uid, nproc, address_space, str(tmp)]
        return [*ns, "--", *init, *request.argv]


class _CappedReader:
    """Drains a pipe to EOF in a thread, keeping only the first `cap` bytes."""

    def __init__(self, pipe, cap: int):
        self.pipe, self.cap = pipe, cap
        self.chunks: list[bytes] = []
        self.kept = 0
        self.truncated = False
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        with self.pipe:
            while chunk := self.pipe.read1(1 << 16):
                room = self.cap - self.kept
                if len(chunk) > room:
                    self.truncated = True
                    chunk = chunk[:max(room, 0)]
                if chunk:
                    self.chunks.append(chunk)
                    self.kept += len(chunk)

    def join(self) -> None:
        self.thread.join()

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


def _inside(root: Path, tmp: Path, name: str) -> Path:
    path = Path(name)
    if ".." in path.parts or (path.is_absolute() and path.parts[1:2] != ("tmp",)):
        raise HostExecutorError(f"host executor takes only paths relative to the workdir or under /tmp, not {name!r}")
    return tmp.joinpath(*path.parts[2:]) if path.is_absolute() else root / path


def _chown_tree(root: Path, uid: int) -> None:
    for directory, dirs, files in os.walk(root):
        os.chown(directory, uid, uid)
        for name in dirs + files:
            os.chown(os.path.join(directory, name), uid, uid, follow_symlinks=False)


def _kill_group(proc: subprocess.Popen) -> None:
    # Killing unshare makes it SIGKILL the namespace's init, which takes every process in it along.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _decode(report: str, timed_out: bool) -> tuple[int | None, int | None, int | None]:
    if not report:  # init never reported: killed on timeout, or could not start
        return None, signal.SIGKILL if timed_out else None, None
    status, peak = (int(x) for x in report.split())
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status), peak
    return os.WEXITSTATUS(status), None, peak
