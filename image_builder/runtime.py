"""Run commands in an instance's layers without Docker: a session keeps the layers
mounted, each run gets a fresh throwaway writable layer.

    with open_session(InstanceLayers(env_sif, (inst_sqfs,), env, "/testbed")) as s:
        result = s.run(RunRequest(("python3", "-c", "print(1)"), timeout=10))

Backends (detect_backend() takes the first that works here; doctor() says why):

- kernel (root): squashfs loop mounts (the .sif partition at its offset, each .sqfs)
  under kernel overlayfs. Runs are host uid 0 inside a user namespace of their own,
  so /proc's writable-by-root files are masked and the process limit is a pids cgroup
  (RLIMIT_NPROC never counts host root).
- userns (rootless, the HPC default): squashfuse_ll in a user namespace, kernel
  overlayfs there (5.11+, `userxattr`: squashfuse shows trusted.overlay.* as
  user.overlay.*). Every open() of an image file is a FUSE round trip: Python starts
  slower than on the kernel backend.
- apptainer: `apptainer exec --overlay inst.sqfs:ro env.sif` per run (apptainer_command).
- extract (no FUSE, no user namespaces): each layer unsquashed once into a cache,
  copied into a tree per session (its writable layer, shared by the session's runs),
  run under proot. Slow; it cannot turn the network off nor bind read-only, and says
  so instead of pretending.

kernel and userns share one design, in image_builder.mounts: a per-user holder
process keeps each layer mounted once, and runs are handed to inits whose root is
already built. For every run: new mount, pid, ipc, uts and (unless network=True)
network namespaces; the layers read-only under a tmpfs upper (so /tmp is private
too); host paths only where bound; the image's environment, then the request's,
never the host's; stdin as a regular file; the timeout kills the whole pid
namespace; memory and process limits from a cgroup where one is delegated (v2) or
owned (root), else RLIMIT_AS and RLIMIT_NPROC. With RLIMIT_AS only, out_of_memory
is judged from what the run printed (MemoryError, bad_alloc, ...), and
peak_memory_kb is the command's ru_maxrss, which starts at its init's own size
(about 11 MB: posix_spawn's child shares the init's memory until exec).
"""


from __future__ import annotations

import enum
import marshal
import os
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .execution import RunRequest, RunResult
from .mounts import DEFAULT_MAX_PROCESSES, IDLE_INIT, INLINE_JOB, RootSpec, RunnerError, recv_fds, send_fds

__all__ = [
    "Backend",
    "Bind",
    "DoctorLine",
    "InstanceLayers",
    "RunnerError",
    "Session",
    "apptainer_command",
    "detect_backend",
    "doctor",
    "open_session",
    "run",
]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_REPORT_GRACE = 30.0  # seconds past a run's timeout before its silence is an error
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


@dataclass(frozen=True)
class Bind:
    """A host path shown inside the instance (nothing of the host is, unless bound)."""

    src: Path
    dest: str  # absolute path inside the instance
    readonly: bool = True


@dataclass(frozen=True)
class DoctorLine:
    check: str
    ok: bool
    detail: str


def default_state_dir() -> Path:
    """Per user, on local disk: $XDG_RUNTIME_DIR/image_builder, else /tmp/image_builder-UID."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir and os.path.isdir(runtime_dir):
        return Path(runtime_dir) / "image_builder"
    return Path(f"/tmp/image_builder-{os.getuid()}")


# --- what this host can do ------------------------------------------------------------------


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        got = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", name.replace(".", "/")).read_text().strip()
    except OSError:
        return None


def _userns_blocker() -> str | None:
    """Why unprivileged user namespaces with overlayfs cannot work here (cheap checks), or None."""
    if _sysctl("kernel.unprivileged_userns_clone") == "0":
        return "kernel.unprivileged_userns_clone is 0 (ask the admin to set it to 1)"
    if _sysctl("user.max_user_namespaces") == "0":
        return "user.max_user_namespaces is 0 (ask the admin to raise it)"
    if _sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
        return "AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns=1)"
    if not _kernel_at_least(5, 11):
        return f"kernel {os.uname().release} is older than 5.11: no overlayfs in user namespaces"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is missing or not read-writable by this user (HPC hosts usually make it mode 666)"
    if not _which("squashfuse_ll"):
        return "squashfuse_ll is not installed (apt-get install squashfuse)"
    return None


def _kernel_blocker() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control (loop devices)"
    return None


def _which(tool: str) -> str | None:
    import shutil

    return shutil.which(tool)


def _extract_blocker() -> str | None:
    missing = [t for t in ("unsquashfs", "proot") if not _which(t)]
    return f"{' and '.join(missing)} not installed" if missing else None


def detect_backend() -> Backend:
    """The best backend this host supports: kernel as root, else userns, apptainer, extract."""
    if _kernel_blocker() is None:
        return Backend.KERNEL
    if _userns_blocker() is None:
        return Backend.USERNS
    if _which("apptainer"):
        return Backend.APPTAINER
    if _extract_blocker() is None:
        return Backend.EXTRACT
    raise RunnerError(f"no runtime backend works here: user namespaces: {_userns_blocker()}; extract: "
                      f"{_extract_blocker()}; install squashfuse, or proot and squashfs-tools")


def doctor() -> list[DoctorLine]:
    """What this host supports for running instances, and why."""
    from .mounts import locate_cgroups

    lines = [DoctorLine("user", True, f"uid {os.getuid()}" + (" (root)" if os.geteuid() == 0 else ""))]
    lines.append(DoctorLine("kernel", _kernel_at_least(5, 11), os.uname().release
                            + ("" if _kernel_at_least(5, 11) else ": overlayfs in user namespaces needs 5.11")))
    for backend, blocker in ((Backend.KERNEL, _kernel_blocker()), (Backend.USERNS, _userns_blocker()),
                             (Backend.EXTRACT, _extract_blocker())):
        lines.append(DoctorLine(f"backend {backend.value}", blocker is None, blocker or "usable"))
    apptainer = _which("apptainer")
    lines.append(DoctorLine("backend apptainer", bool(apptainer), apptainer or "not installed"))
    cg = locate_cgroups()
    if cg and cg[0] == "v2":
        limits = f"cgroup v2 under {cg[1]}: per-run process and memory limits; out-of-memory kills are reported"
    elif cg:
        limits = (f"cgroup v1 pids under {cg[1]}: per-run process limit; RLIMIT_AS for memory, out-of-memory is "
                  "judged from the output")
    else:
        limits = ("RLIMIT_NPROC and RLIMIT_AS per run (RLIMIT_NPROC counts per user namespace); out-of-memory is "
                  "judged from the output")
    lines.append(DoctorLine("limits", True, limits))
    try:
        lines.append(DoctorLine("chosen", True, detect_backend().value))
    except RunnerError as e:
        lines.append(DoctorLine("chosen", False, str(e)))
    return lines


# --- running a job and collecting what it says ------------------------------------------------


def _job(layers: InstanceLayers, request: RunRequest, max_processes: int) -> dict:
    """What an init runs (mounts.py, "session -> init"): the environment is complete,
    the image's variables, then the request's."""
    if not request.argv:
        raise RunnerError("empty argv: give the command to run")
    return {"argv": list(request.argv), "env": {"PATH": DEFAULT_PATH, "HOME": "/root", **layers.env, **request.env},
            "workdir": request.workdir or layers.workdir, "files": dict(request.files),
            "timeout": request.timeout, "memory_mb": request.memory_mb, "max_processes": max_processes}


def _stdin_fd(data: bytes | None) -> int:
    """A regular file (memfd) holding the input, as judges give it: os.fstat(0).st_size works."""
    if data is None:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@dataclass
class _Captured:
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    reply: dict | None = None


def _collect(out_r: int, err_r: int, max_output: int, deadline: float | None,
             conn: socket.socket | None = None, done=None) -> _Captured:
    """Drain stdout and stderr (keeping max_output bytes of each) until both close and,
    with `conn`, a reply arrived; TimeoutError at `deadline`. `done()` is called while
    nothing happens (the extract backend watches its command there)."""
    got = _Captured()
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


def _result(got: _Captured, request: RunRequest, wall: float, exit_code: int | None, sig: int | None,
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


def holder_name(state_dir: Path, kernel: bool) -> str:
    """The holder's abstract socket name: per user, state dir, backend and interpreter
    (messages are marshal). An abstract socket vanishes with its process: a dead holder
    leaves no socket file behind."""
    import zlib

    key = f"{os.path.realpath(state_dir)}:{sys.version}:{'kernel' if kernel else 'userns'}"
    return f"image-builder-{os.getuid()}-{zlib.crc32(key.encode()):08x}-{'kernel' if kernel else 'userns'}"


def _connect(name: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(b"\0" + name.encode())
        uid = _peer(conn)[1]
    except OSError:
        conn.close()
        raise
    if uid != os.getuid():
        conn.close()
        raise RunnerError(f"the holder socket @{name} belongs to uid {uid}, not to us; use another state_dir")
    return conn


def _peer(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end."""
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))


def _start_holder(state_dir: Path, kernel: bool, name: str) -> None:
    import subprocess

    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[1])
    # -S: no site-packages scan; the holder needs the standard library and this package only.
    boot = f"import sys; sys.path[:0] = [{root!r}]; from image_builder.mounts import holder_main; " \
           "holder_main(sys.argv[1:])"
    with open(state_dir / "holder.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-S", "-E", "-c", boot, "kernel" if kernel else "userns",
                                 str(state_dir), name], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=log, start_new_session=True, cwd="/")
    line = proc.stdout.readline().decode(errors="replace").strip()
    proc.stdout.close()
    proc.wait()
    if not line or line.startswith("error:"):
        why = line[6:].strip() if line else f"it died; see {state_dir}/holder.log"
        raise RunnerError(f"cannot start the mount holder: {why}; run `image-builder doctor`")


class _HolderSession(Session):
    """kernel and userns: the layers are mounted by the per-user holder (mounts.py). The
    session keeps spare inits (one per run in flight), asked for ahead of need, so a
    run only sends its job to a ready init and reads the answer."""

    def __init__(self, layers: InstanceLayers, backend: Backend, state_dir: Path, binds: tuple[Bind, ...],
                 max_processes: int, linger: float, scratch_mb: int | None):
        import threading

        from .sif import SifError, partition_offset

        super().__init__(layers, max_processes)
        self.backend = backend
        self._kernel = backend is Backend.KERNEL
        try:
            offset, size = partition_offset(layers.env_sif)
        except SifError as e:
            raise RunnerError(str(e)) from None
        refs = [(str(Path(layers.env_sif).resolve()), offset, size)]
        for o in layers.overlays:
            if not os.access(o, os.R_OK):
                raise RunnerError(f"cannot read instance layer {o}; check the path and its permissions")
            refs.append((str(Path(o).resolve()), 0, 0))
        for b in binds:
            if not os.path.exists(b.src):
                raise RunnerError(f"bind source {b.src} does not exist; create it or drop the bind")
        name = holder_name(state_dir, self._kernel)
        msg = {"op": "open", "layers": refs, "linger": float(linger), "scratch_mb": scratch_mb,
               "binds": [(str(Path(b.src).resolve()), b.dest, b.readonly) for b in binds]}
        self._conn = None
        for _attempt in range(3):
            try:
                conn = _connect(name)
            except (ConnectionRefusedError, FileNotFoundError):
                _start_holder(state_dir, self._kernel, name)
                continue
            try:
                send_fds(conn, msg)
                reply = recv_fds(conn, 0)[0]
            except OSError:
                reply = None
            if reply is None:  # it was just leaving: start another
                conn.close()
                continue
            if "error" in reply:
                conn.close()
                raise RunnerError(f"cannot mount the instance: {reply['error']}")
            self._conn = conn
            break
        else:
            raise RunnerError(f"cannot reach the mount holder; see {state_dir}/holder.log")
        self._spec = reply["spec"]
        self._holder_pid = _peer(conn)[0]
        self._lock = threading.Lock()
        self._ready: dict[bool, list[tuple[float, socket.socket]]] = {False: [], True: []}  # (received, init)
        self._asked = {False: 0, True: 0}
        self._busy = {False: 0, True: 0}
        with self._lock:
            self._ask(False)  # the first init gets ready while the caller prepares its run

    # -- spare inits (all under self._lock) --

    def _ask(self, network: bool) -> None:
        send_fds(self._conn, {"op": "init", "network": network})
        self._asked[network] += 1

    def _receive(self, block: bool) -> bool:
        try:
            reply, fds = recv_fds(self._conn, 1, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        if reply is None:
            raise RunnerError("the mount holder is gone (killed?); open a new session")
        self._asked[reply["network"]] -= 1
        if "error" in reply:
            raise RunnerError(f"cannot prepare a run: {reply['error']}")
        self._ready[reply["network"]].append((time.monotonic(), socket.socket(fileno=fds[0])))
        return True

    def _take(self, network: bool) -> socket.socket:
        with self._lock:
            if self._conn is None:
                raise RunnerError("the session is closed; open a new one")
            while self._receive(block=False):
                pass
            ready = self._ready[network]
            while ready and time.monotonic() - ready[0][0] > IDLE_INIT / 2:  # it leaves soon: not for a run
                ready.pop(0)[1].close()
            while not ready:
                if not self._asked[network]:
                    self._ask(network)
                self._receive(block=True)
            ctl = ready.pop(0)[1]
            self._busy[network] += 1
            while len(self._ready[network]) + self._asked[network] < self._busy[network]:
                self._ask(network)  # a spare for each run in flight: its next one
            return ctl

    def _done(self, network: bool) -> None:
        with self._lock:
            self._busy[network] -= 1

    def _send(self, job: bytes, fds: list[int], network: bool) -> socket.socket:
        """Hand the job to a ready init (one killed meanwhile is passed over)."""
        msg = {"payload": len(job)} if len(job) > INLINE_JOB else job
        for _attempt in range(8):
            ctl = self._take(network)
            try:
                send_fds(ctl, msg, fds)
                return ctl
            except OSError:
                ctl.close()
                self._done(network)
        raise RunnerError("no init took the run: they all died; see holder.log in the state dir")

    def run(self, request: RunRequest) -> RunResult:
        job = marshal.dumps(_job(self.layers, request, self.max_processes))
        ctl = out_r = err_r = None
        try:
            fds = [_stdin_fd(request.stdin)]
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            fds += [out_w, err_w]
            try:
                if len(job) > INLINE_JOB:
                    fds.append(_stdin_fd(job))
                t0 = time.monotonic()
                ctl = self._send(job, fds, request.network)
            finally:
                for fd in fds:
                    os.close(fd)
            deadline = None if request.timeout is None else t0 + request.timeout + _REPORT_GRACE
            try:
                got = _collect(out_r, err_r, request.max_output, deadline, ctl)
            except TimeoutError:
                raise RunnerError("the run did not report back after its timeout; see holder.log in the "
                                  "state dir") from None
            wall = time.monotonic() - t0
        finally:
            if ctl is not None:
                ctl.close()  # also how a Ctrl-C here stops the run: the init sees us go
                self._done(request.network)
            for fd in (out_r, err_r):
                if fd is not None:
                    os.close(fd)
        reply = got.reply
        if reply is None:
            raise RunnerError("the run ended without a report (its init was killed); see holder.log in the "
                              "state dir")
        if "error" in reply:
            raise RunnerError(reply["error"])
        return _result(got, request, wall, reply["exit_code"], reply["signal"], reply["timed_out"],
                       reply["peak_memory_kb"], reply["out_of_memory"])

    def shell(self, argv: tuple[str, ...] = ("/bin/sh",), persist: Path | None = None, *,
              network: bool = False) -> int:
        from .mounts import run_joined

        upper = None
        if persist is not None:
            Path(persist).mkdir(parents=True, exist_ok=True)
            upper = str(Path(persist).resolve())
        console = os.ttyname(0) if os.isatty(0) else None
        spec = RootSpec(network=network, upper=upper, console=console,
                        **{**self._spec, "binds": tuple(self._spec["binds"])})
        env = {"TERM": os.environ.get("TERM", "xterm")}
        job = _job(self.layers, RunRequest(tuple(argv), env=env), self.max_processes)
        return run_joined(self._holder_pid, self._kernel, spec, job)

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            for ready in self._ready.values():
                for _, ctl in ready:
                    ctl.close()
                ready.clear()
        if conn is not None:
            conn.close()  # the holder releases the layers (after the linger time)


# --- apptainer ---------------------------------------------------------------------------------


def apptainer_command(layers: InstanceLayers, request: RunRequest, *, binds: tuple[Bind, ...] = (),
                      files_dir: Path | None = None) -> list[str]:
    """`apptainer exec --containall --overlay inst.sqfs:ro env.sif CMD`, with the request's
    options mapped. `files_dir` holds request.files staged on the host (bound in). A
    variable whose value has a comma goes in as APPTAINERENV_NAME through `env`:
    --env splits on commas (apptainer/singularity#6088)."""
    prefix, cmd = [], ["apptainer", "exec", "--containall", "--writable-tmpfs", "--pwd",
                       request.workdir or layers.workdir]
    for overlay in layers.overlays:  # bottom to top: the last one given is the top layer
        cmd += ["--overlay", f"{overlay}:ro"]
    if not request.network:
        cmd += ["--net", "--network", "none"]
    if request.memory_mb:
        cmd += ["--memory", f"{request.memory_mb}M"]
    for b in binds:
        cmd += ["--bind", f"{b.src}:{b.dest}:{'ro' if b.readonly else 'rw'}"]
    for path in request.files:
        if files_dir is None:
            raise RunnerError("request.files needs files_dir, a host directory holding them")
        cmd += ["--bind", f"{files_dir}/{path.lstrip('/')}:{path}:rw"]
    for key, value in {**layers.env, **request.env}.items():
        if "," in value:
            prefix.append(f"APPTAINERENV_{key}={value}")
        else:
            cmd += ["--env", f"{key}={value}"]
    return [*(["env", *prefix] if prefix else []), *cmd, str(layers.env_sif), *request.argv]


class _ApptainerSession(Session):
    """Each run is one `apptainer exec`: Apptainer mounts per run (no warm mounts), and
    limits processes and memory only where it has cgroups."""

    backend = Backend.APPTAINER

    def __init__(self, layers: InstanceLayers, binds: tuple[Bind, ...], max_processes: int):
        super().__init__(layers, max_processes)
        self.binds = binds

    def run(self, request: RunRequest) -> RunResult:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="ib-apptainer-") as staged:
            for path, data in request.files.items():
                host = Path(staged, path.lstrip("/"))
                host.parent.mkdir(parents=True, exist_ok=True)
                host.write_bytes(data)
            cmd = apptainer_command(self.layers, request, binds=self.binds, files_dir=Path(staged))
            return _run_process(cmd, request, dict(os.environ))

    def shell(self, argv: tuple[str, ...] = ("/bin/sh",), persist: Path | None = None, *,
              network: bool = False) -> int:
        import subprocess

        if persist is not None:
            raise RunnerError("the apptainer backend keeps no upper directory; drop persist")
        cmd = apptainer_command(self.layers, RunRequest(tuple(argv), network=network), binds=self.binds)
        return subprocess.call(cmd)


def _run_process(cmd: list[str], request: RunRequest, env: dict[str, str]) -> RunResult:
    """A host command (apptainer) with the request's stdin, output capture and timeout;
    the process group is killed at the timeout."""
    import signal
    import subprocess

    stdin = _stdin_fd(request.stdin)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=out_w, stderr=err_w, env=env, start_new_session=True)
    finally:
        for fd in (stdin, out_w, err_w):
            os.close(fd)
    timed_out = False
    try:
        deadline = None if request.timeout is None else t0 + request.timeout
        try:
            got = _collect(out_r, err_r, request.max_output, deadline)
        except TimeoutError:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            got = _Captured()
        status = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        os.close(out_r)
        os.close(err_r)
    sig = -status if status < 0 else None
    return _result(got, request, time.monotonic() - t0, None if sig else status, sig, timed_out, None, None)


# --- extract (no FUSE, no user namespaces) --------------------------------------------------------

# Unprivileged unsquashfs can create neither the whiteouts (character devices 0:0) nor
# the trusted.overlay.opaque xattrs of an overlay layer: they are read from the image
# itself, its directory tree only (file data is unsquashfs's job).

_SUPERBLOCK = struct.Struct("<IIIIIHHHHHHQQQQQQQQ")
_DIR_ENTRY_KINDS = {1: "d", 2: "f", 3: "l", 4: "b", 5: "c", 6: "p", 7: "s"}
_XATTR_PREFIXES = {0: "user.", 1: "trusted.", 2: "security."}


@dataclass
class LayerListing:
    """What an overlay layer holds besides file data."""

    kinds: dict[str, str] = field(default_factory=dict)  # path -> d f l b c p s
    whiteouts: list[str] = field(default_factory=list)  # paths the layer deletes
    opaque: list[str] = field(default_factory=list)  # directories whose lower contents it hides


def _decompressor(comp: int):
    import lzma
    import zlib

    if comp == 1:
        return zlib.decompress
    if comp in (2, 4):
        return lzma.decompress
    if comp == 6:
        import zstandard

        return lambda raw: zstandard.ZstdDecompressor().decompressobj().decompress(raw)
    raise RunnerError(f"squashfs compression id {comp} (lzo or lz4) cannot be read here; pack with zstd, "
                      "gzip or xz")


def list_layer(image: Path, offset: int = 0) -> LayerListing:
    """The directory tree of the squashfs at `offset` in `image`."""
    with open(image, "rb") as f:
        f.seek(offset)
        sb = _SUPERBLOCK.unpack(f.read(_SUPERBLOCK.size))
        root_ref, xattr_table, inode_table, dir_table = sb[11], sb[14], sb[15], sb[16]
        decompress = _decompressor(sb[5])
        blocks: dict[int, tuple[bytes, int]] = {}

        def read(pos: int, off: int, n: int) -> tuple[bytes, int, int]:
            """n bytes of a metadata stream from block `pos` (absolute), offset `off`."""
            out = bytearray()
            while len(out) < n:
                if pos not in blocks:
                    f.seek(pos)
                    (head,) = struct.unpack("<H", f.read(2))
                    raw = f.read(head & 0x7FFF)
                    blocks[pos] = (raw if head & 0x8000 else decompress(raw), pos + 2 + (head & 0x7FFF))
                data, nxt = blocks[pos]
                chunk = data[off: off + n - len(out)]
                out += chunk
                off += len(chunk)
                if off >= len(data):
                    pos, off = nxt, 0
            return bytes(out), pos, off

        def inode(ref: int) -> tuple[int, bytes]:
            head, pos, off = read(offset + inode_table + (ref >> 16), ref & 0xFFFF, 16)
            kind = struct.unpack_from("<H", head)[0]
            size = {1: 16, 8: 24, 4: 8, 5: 8, 11: 12, 12: 12}.get(kind, 0)
            return kind, read(pos, off, size)[0]

        def opaque(xattr_index: int) -> bool:
            if xattr_index == 0xFFFFFFFF or xattr_table == 0xFFFFFFFFFFFFFFFF:
                return False
            f.seek(offset + xattr_table)
            kv_start = struct.unpack("<Q", f.read(8))[0]
            f.seek(offset + xattr_table + 16 + (xattr_index * 16 // 8192) * 8)
            id_block = struct.unpack("<Q", f.read(8))[0]
            ref, count, _size = struct.unpack("<QII", read(offset + id_block, xattr_index * 16 % 8192, 16)[0])
            pos, off = offset + kv_start + (ref >> 16), ref & 0xFFFF
            for _ in range(count):
                head, pos, off = read(pos, off, 4)
                kind, name_size = struct.unpack("<HH", head)
                name, pos, off = read(pos, off, name_size)
                head, pos, off = read(pos, off, 4)
                value, pos, off = read(pos, off, struct.unpack("<I", head)[0])
                if kind & 0x100:  # stored out of line: value is a reference to it
                    ref2 = struct.unpack("<Q", value)[0]
                    head, p2, o2 = read(offset + kv_start + (ref2 >> 16), ref2 & 0xFFFF, 4)
                    value = read(p2, o2, struct.unpack("<I", head)[0])[0]
                full = _XATTR_PREFIXES.get(kind & 0xFF, "?") + name.decode(errors="replace")
                if full in ("trusted.overlay.opaque", "user.overlay.opaque") and value == b"y":
                    return True
            return False

        listing = LayerListing()
        todo = [(root_ref, "")]
        while todo:
            ref, prefix = todo.pop()
            kind, body = inode(ref)
            if kind == 1:
                block, _nlink, size, block_off, _parent = struct.unpack("<IIHHI", body)
                xattr = 0xFFFFFFFF
            else:
                _nlink, size, block, _parent, _index, block_off, xattr = struct.unpack("<IIIIHHI", body)
            if prefix and opaque(xattr):
                listing.opaque.append(prefix)
            left, pos, off = size - 3, offset + dir_table + block, block_off
            while left > 0:
                head, pos, off = read(pos, off, 12)
                count, start, _base = struct.unpack("<III", head)
                left -= 12
                for _ in range(count + 1):
                    head, pos, off = read(pos, off, 8)
                    entry_off, _delta, etype, name_size = struct.unpack("<HhHH", head)
                    name, pos, off = read(pos, off, name_size + 1)
                    left -= 8 + name_size + 1
                    path = f"{prefix}/{os.fsdecode(name)}" if prefix else os.fsdecode(name)
                    child = (start << 16) | entry_off
                    kind = _DIR_ENTRY_KINDS.get(etype, "?")
                    listing.kinds[path] = kind
                    if kind == "d":
                        todo.append((child, path))
                    elif kind == "c" and struct.unpack("<II", inode(child)[1][:8])[1] == 0:
                        listing.whiteouts.append(path)
        return listing


def _layer_key(image: Path, offset: int) -> str:
    import hashlib

    st = os.stat(image)
    ident = f"{os.path.realpath(image)}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{offset}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def _make_writable_rmtree(path: Path) -> None:
    """rmtree that also gets through directories extracted without write permission."""
    import shutil
    import stat

    def retry(func, p, _exc):
        for d in (os.path.dirname(p), p):
            if os.path.isdir(d) and not os.path.islink(d):
                os.chmod(d, os.stat(d).st_mode | stat.S_IRWXU)
        func(p)

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=retry)


def extracted_layer(cache: Path, image: Path, offset: int = 0) -> tuple[Path, LayerListing]:
    """The layer unsquashed into `cache` (made once; the listing is kept next to it and
    every listed path checked to exist before the copy is trusted)."""
    import subprocess

    final = cache / _layer_key(image, offset)
    if (final / "listing.marshal").is_file():
        return final / "tree", LayerListing(**marshal.loads((final / "listing.marshal").read_bytes()))
    listing = list_layer(image, offset)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    _make_writable_rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        specials = [p for p, k in listing.kinds.items() if k in "bcps"]  # not creatable unprivileged
        (tmp / "exclude").write_text("".join(f"{p}\n" for p in specials))
        r = subprocess.run(["unsquashfs", "-no-progress", "-quiet", "-no-xattrs", "-no-wildcards", "-offset",
                            str(offset), "-exclude-file", str(tmp / "exclude"), "-dest", str(tmp / "tree"),
                            str(image)], stdin=subprocess.DEVNULL, capture_output=True)
        missing = [p for p, k in listing.kinds.items() if k not in "bcps" and not os.path.lexists(tmp / "tree" / p)]
        if r.returncode or missing:
            why = (r.stderr or r.stdout).decode(errors="replace").strip().splitlines()[-1:] or [f"missing {missing[0]}"]
            raise RunnerError(f"cannot extract {image}: {why[0]}; check the free space under {cache}")
        (tmp / "listing.marshal").write_bytes(marshal.dumps(listing.__dict__))
        try:
            tmp.rename(final)
        except OSError:  # another process made it meanwhile
            _make_writable_rmtree(tmp)
    except BaseException:
        _make_writable_rmtree(tmp)
        raise
    return final / "tree", listing


def _inside_tree(root: Path, rel: str) -> Path:
    """root/rel, refusing a path that a symlink of the tree would lead out of it."""
    path = root
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            raise RunnerError(f"bad path {rel!r} in a layer; the image is malformed")
        if path != root and os.path.islink(path):
            raise RunnerError(f"{rel}: a symlink in the tree is in the way; the image is malformed")
        path = path / part
    return path


def _resolve_in(root: Path, path: str) -> Path | None:
    """Where `path` leads in the tree at `root`, following symlinks as a chroot would;
    None if nothing is there."""
    todo = [p for p in path.split("/") if p not in ("", ".")]
    parts: list[str] = []
    for _ in range(4096):
        if not todo:
            return root.joinpath(*parts)
        part = todo.pop(0)
        if part == "..":
            parts = parts[:-1]
            continue
        here = root.joinpath(*parts, part)
        if os.path.islink(here):
            target = os.readlink(here)
            parts = [] if target.startswith("/") else parts
            todo = [p for p in target.split("/") if p not in ("", ".")] + todo
        elif os.path.lexists(here):
            parts.append(part)
        else:
            return None
    return None  # a symlink loop


def _remove(path: Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        _make_writable_rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def apply_layer(root: Path, tree: Path, listing: LayerListing) -> None:
    """Put an extracted layer over `root` as overlayfs would show it: a path whose type
    changes is replaced, opaque directories lose their lower contents, whiteouts delete."""
    import subprocess

    for rel in sorted(listing.kinds):  # parents first: a replaced symlink cannot mislead a child
        kind = listing.kinds[rel]
        if kind in "bcps":
            continue
        dest = _inside_tree(root, rel)
        if os.path.lexists(dest) and (kind == "d") != (os.path.isdir(dest) and not os.path.islink(dest)):
            _remove(dest)
    for rel in listing.opaque:
        dest = _inside_tree(root, rel)
        if os.path.isdir(dest) and not os.path.islink(dest):
            for child in os.listdir(dest):
                _remove(dest / child)
    for rel in listing.whiteouts:
        _remove(_inside_tree(root, rel))
    # --remove-destination: never write through a symlink the lower layer left there.
    r = subprocess.run(["cp", "-a", "--reflink=auto", "--remove-destination", f"{tree}/.", f"{root}/"],
                       capture_output=True)
    if r.returncode:
        raise RunnerError(f"cannot copy layer {tree} into {root}: {r.stderr.decode(errors='replace').strip()}")


def _user_tasks() -> int:
    """Processes and threads of this uid: RLIMIT_NPROC counts them all, host-wide."""
    n, uid = 0, os.getuid()
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


def _traced_by(tracer: int) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and f"TracerPid:\t{tracer}\n" in Path(f"/proc/{pid}/status").read_text():
                found.append(int(pid))
        except OSError:
            pass
    return found


# proot 5.1 (Debian 12) does not translate these newer path syscalls: statx would show
# the host's files (coreutils' ls and stat use it). Failing them with ENOSYS makes libc
# and coreutils fall back to the older calls, which proot translates.
_UNTRANSLATED = {"x86_64": (0xC000003E, (332, 437, 439)), "aarch64": (0xC00000B7, (291, 437, 439))}


def _seccomp_program() -> bytes | None:
    """A BPF filter returning ENOSYS for _UNTRANSLATED (other architectures: None)."""
    arch = _UNTRANSLATED.get(os.uname().machine)
    if arch is None:
        return None
    audit_arch, numbers = arch
    ld, jeq, ret = 0x20, 0x15, 0x06
    allow, enosys = 0x7FFF0000, 0x00050000 | 38
    n = len(numbers)
    prog = [(ld, 0, 0, 4), (jeq, 0, n + 2, audit_arch), (ld, 0, 0, 0)]  # another arch: allow
    prog += [(jeq, n - i, 0, nr) for i, nr in enumerate(numbers)]  # a match jumps to the ENOSYS return
    prog += [(ret, 0, 0, allow), (ret, 0, 0, enosys)]
    return b"".join(struct.pack("<HBBI", *insn) for insn in prog)


def _deny_untranslated(program: bytes):
    """preexec_fn for proot: install the filter (inherited by proot and every tracee)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(program)
    fprog = struct.pack("<HxxxxxxQ", len(program) // 8, ctypes.addressof(buf))
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2

    def install() -> None:
        if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) or \
                libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.c_char_p(fprog), 0, 0):
            raise OSError(ctypes.get_errno(), "cannot install the seccomp filter for proot")

    install.keep = (buf, fprog)  # alive until the child has used them
    return install


def _kill_proot(proc) -> None:
    """proot leaves its tracees running when it dies: stop it (its tracees then stop at
    their next traced event), kill every process it traces, then proot."""
    import signal

    try:
        os.kill(proc.pid, signal.SIGSTOP)
    except ProcessLookupError:
        return
    for _ in range(50):
        traced = _traced_by(proc.pid)
        if not traced:
            break
        for pid in traced:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


class _ExtractSession(Session):
    """No FUSE, no user namespaces: each layer unsquashed once into a cache, copied into
    a tree per session (the writable layer: runs of a session share it), run under proot
    (ptrace: 2x slower on Python start-up, far more on syscall-heavy work). There is no
    namespace to kill or isolate with: the network cannot be turned off, binds cannot be
    read-only, and processes can outlive a runner killed with SIGKILL."""

    backend = Backend.EXTRACT

    def __init__(self, layers: InstanceLayers, state_dir: Path, binds: tuple[Bind, ...], max_processes: int):
        from .sif import SifError, partition_offset

        super().__init__(layers, max_processes)
        if any(b.readonly for b in binds):
            raise RunnerError("the extract backend cannot bind read-only (proot has no read-only binds); "
                              "pass readonly=False or use a host with user namespaces")
        self.binds = binds
        cache = state_dir / "extract"
        self._sessions = cache / "sessions"
        self._sessions.mkdir(parents=True, exist_ok=True)
        for stale in self._sessions.iterdir():  # of runners that were killed
            pid = stale.name.split("-")[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                _kill_running_from(stale)
                _make_writable_rmtree(stale)
        try:
            offset, _size = partition_offset(layers.env_sif)
        except SifError as e:
            raise RunnerError(str(e)) from None
        self._layers = [extracted_layer(cache / "layers", Path(layers.env_sif), offset)]
        self._layers += [extracted_layer(cache / "layers", Path(o)) for o in layers.overlays]
        self._dir = self._sessions / f"{os.getpid()}-{os.urandom(4).hex()}"
        self._root = self._build(self._dir / "root")

    def _build(self, root: Path) -> Path:
        import subprocess

        if not root.exists():
            root.mkdir(parents=True)
            env_tree = self._layers[0][0]
            r = subprocess.run(["cp", "-a", "--reflink=auto", f"{env_tree}/.", f"{root}/"], capture_output=True)
            if r.returncode:
                raise RunnerError(f"cannot copy {env_tree}: {r.stderr.decode(errors='replace').strip()}")
            for tree, listing in self._layers[1:]:
                apply_layer(root, tree, listing)
        return root

    def _proot(self, root: Path, job: dict, tmp: str) -> list[str]:
        import shutil

        proot = shutil.which("proot")
        if proot is None:
            raise RunnerError("proot is not installed (apt-get install proot)")
        cmd = [proot, "-0", "-r", str(root), "-w", job["workdir"], "-b", "/dev", "-b", "/proc", "-b", f"{tmp}:/tmp"]
        for b in self.binds:
            cmd += ["-b", f"{Path(b.src).resolve()}:{b.dest}"]
        return [*cmd, *job["argv"]]

    def _found(self, job: dict) -> bool:
        """Whether argv[0] is in the tree (on the job's PATH), as the other backends check."""
        name = job["argv"][0]
        dirs = [""] if "/" in name else job["env"].get("PATH", "").split(":")
        return any(_resolve_in(self._root, os.path.join(job["workdir"], d, name)) is not None for d in dirs)

    def run(self, request: RunRequest) -> RunResult:
        import shutil
        import tempfile

        if not request.network:
            raise RunnerError("the extract backend cannot turn the network off (no namespaces here); pass "
                              "network=True to run with the host's network, or use a host with user namespaces")
        job = _job(self.layers, request, self.max_processes)
        for path, data in job["files"].items():
            dest = _inside_tree(self._root, path.strip("/"))
            dest.parent.mkdir(parents=True, exist_ok=True)
            _remove(dest)
            dest.write_bytes(data)
        if not self._found(job):
            msg = f"image-builder: cannot run {job['argv'][0]!r}: command not found\n".encode()
            return RunResult(127, None, False, False, 0.0, None, b"", msg[:request.max_output],
                             len(msg) > request.max_output)
        tmp = tempfile.mkdtemp(prefix="ib-tmp-", dir=self._dir)
        os.chmod(tmp, 0o1777)
        limits = ["prlimit", f"--nproc={_user_tasks() + self.max_processes}", "--core=0"]
        if request.memory_mb:
            limits.append(f"--as={request.memory_mb << 20}")
        try:
            return _run_proot([*limits, "--", *self._proot(self._root, job, tmp)], request, job["env"], self._dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def shell(self, argv: tuple[str, ...] = ("/bin/sh",), persist: Path | None = None, *,
              network: bool = False) -> int:
        import subprocess

        if not network:
            raise RunnerError("the extract backend cannot turn the network off; pass network=True")
        root = self._build(Path(persist) / "root") if persist is not None else self._root
        job = _job(self.layers, RunRequest(tuple(argv), env={"TERM": os.environ.get("TERM", "xterm")}),
                   self.max_processes)
        tmp = self._dir / "shell-tmp"
        tmp.mkdir(mode=0o1777, exist_ok=True)
        program = _seccomp_program()
        return subprocess.call(self._proot(root, job, str(tmp)), env=job["env"],
                               preexec_fn=_deny_untranslated(program) if program else None)

    def close(self) -> None:
        _kill_running_from(self._dir)
        _make_writable_rmtree(self._dir)


def _kill_running_from(session_dir: Path) -> None:
    """Kill what a session's prooted runs left, found even after its runner was killed:
    every run records its proot's pid in the session directory, and each process proot
    starts runs proot's loader, /tmp/prooted-PID-*."""
    proots = [int(f.name[6:]) for f in session_dir.glob("proot-*") if f.name[6:].isdigit()]
    if not proots:
        return
    loaders = tuple(f"/tmp/prooted-{pid}-" for pid in proots)
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.readlink(f"/proc/{pid}/exe").startswith(loaders):
                os.kill(int(pid), 9)
        except OSError:
            pass
    for pid in proots:
        try:
            if str(session_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, 9)
        except OSError:
            pass


def _run_proot(cmd: list[str], request: RunRequest, env: dict[str, str], session_dir: Path) -> RunResult:
    """Run proot like the other backends run an init: the run ends when the command
    does (its leftover processes are killed), or at the timeout."""
    import subprocess

    stdin = _stdin_fd(request.stdin)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    program = _seccomp_program()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=out_w, stderr=err_w, env=env, start_new_session=True,
                                preexec_fn=_deny_untranslated(program) if program else None)
    finally:
        for fd in (stdin, out_w, err_w):
            os.close(fd)
    record = session_dir / f"proot-{proc.pid}"  # for _kill_running_from, should this runner be killed
    record.touch()

    def command_done() -> None:
        """proot's only child is the command: once it is gone (or not yet there, and
        then nothing is traced), what it left running goes too, and proot exits with
        the command's status."""
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            return
        if not children:
            for pid in _traced_by(proc.pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass

    timed_out = False
    try:
        deadline = None if request.timeout is None else t0 + request.timeout
        try:
            got = _collect(out_r, err_r, request.max_output, deadline, done=command_done)
        except TimeoutError:
            timed_out = True
            _kill_proot(proc)
            got = _Captured()
        status = proc.wait()
    except BaseException:
        _kill_proot(proc)
        raise
    finally:
        os.close(out_r)
        os.close(err_r)
    record.unlink()
    sig = None
    marker = b"proot info: pid "
    if status == 255 and marker in got.stderr:  # proot says which signal killed the command
        line = got.stderr[got.stderr.rindex(marker):].split(b"\n", 1)[0]
        if b"terminated with signal " in line:
            sig = int(line.rsplit(b" ", 1)[1])
            got.stderr = got.stderr.replace(line + b"\n", b"")
    if timed_out:
        sig = 9
    return _result(got, request, time.monotonic() - t0, None if sig else status, sig, timed_out, None, None)


# --- entry points ------------------------------------------------------------------------------------


def open_session(layers: InstanceLayers, *, backend: Backend | None = None, state_dir: Path | None = None,
                 binds: tuple[Bind, ...] = (), max_processes: int = DEFAULT_MAX_PROCESSES, linger: float = 0.0,
                 scratch_mb: int | None = None) -> Session:
    """Mount `layers` (warm: a layer already mounted for this user is reused) for many runs.

    `binds`: host paths to show inside. `max_processes`: per run. `linger`: seconds the
    mounts stay after the last session using them closes, so the next one starts warm
    (a CLI running one command per process wants this). `scratch_mb`: size of each
    run's writable layer (default half the RAM)."""
    backend = backend or detect_backend()
    if not Path(layers.env_sif).is_file():
        raise RunnerError(f"environment image {layers.env_sif} not found; build or pull it first")
    state_dir = Path(state_dir) if state_dir else default_state_dir()
    if backend in (Backend.KERNEL, Backend.USERNS):
        return _HolderSession(layers, backend, state_dir, tuple(binds), max_processes, linger, scratch_mb)
    if backend is Backend.APPTAINER:
        return _ApptainerSession(layers, tuple(binds), max_processes)
    return _ExtractSession(layers, state_dir, tuple(binds), max_processes)


def run(layers: InstanceLayers, request: RunRequest, backend: Backend | None = None) -> RunResult:
    """One command in a session of its own."""
    with open_session(layers, backend=backend) as session:
        return session.run(request)
