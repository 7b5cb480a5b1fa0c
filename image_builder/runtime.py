"""Run commands in an instance's layers without Docker: a session keeps the layers
mounted, each run gets a fresh throwaway writable layer.

    with open_session(InstanceLayers(env_sif, (inst_sqfs,), env, "/testbed")) as s:
        result = s.run(RunRequest(("python3", "-c", "print(1)"), timeout=10))

Backends (detect_backend() takes the first that works here; doctor() says why):

- kernel (root): squashfs loop mounts (the .sif partition at its offset, each .sqfs)
  under kernel overlayfs. Runs are host uid 0 inside a user namespace of their own,
  so /proc's writable-by-root files are masked and the process limit is a pids cgroup
  (RLIMIT_NPROC never counts host root).
- userns (rootless, the HPC default): squashfuse in a user namespace, kernel
  overlayfs there (5.11+, `userxattr`: squashfuse shows trusted.overlay.* as
  user.overlay.*). With squashfuse_cached (mounts.squashfuse) the kernel caches opens,
  directories and symlinks; with plain squashfuse_ll every open() of an image file is
  a FUSE round trip, and Python starts slower than on the kernel backend.
- apptainer (image_builder.apptainer): `apptainer exec --overlay inst.sqfs:ro env.sif`
  per run (apptainer_command).
- extract (image_builder.extract; no FUSE, no user namespaces): each layer unsquashed
  once into a cache, copied into a tree per session (its writable layer, shared by the
  session's runs), run under proot. Slow; it cannot turn the network off nor bind
  read-only, and says so instead of pretending.

kernel and userns share one design, in image_builder.holder (on the primitives of
image_builder.mounts): a per-user holder process keeps each layer mounted once, and
runs are handed to inits (image_builder/native/init.c) whose root is already built;
their sessions are here. For
every run: new mount, pid, ipc, uts and (unless network=True) network namespaces;
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
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .execution import DEFAULT_PATH, Bind, RunRequest, RunResult
from .holder import (DEFAULT_MAX_PROCESSES, IDLE_INIT, encode_job, job_message, memfd_with, recv_fds, run_joined,
                     send_fds)
from .cgroups import locate_cgroups, start_join_grace_period
from .mounts import INIT_MISSING, RootSpec, RunnerError, init_program, squashfuse

__all__ = [
    "Backend",
    "Bind",
    "DoctorLine",
    "InstanceLayers",
    "RunnerError",
    "Session",
    "detect_backend",
    "doctor",
    "open_session",
    "run",
]

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
    program = squashfuse()
    if not (os.access(program, os.X_OK) if os.sep in program else _which(program)):
        return f"{program} is not installed (apt-get install squashfuse)"
    return None if init_program() else INIT_MISSING


def _kernel_blocker() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control (loop devices)"
    return None if init_program() else INIT_MISSING


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
    lines = [DoctorLine("user", True, f"uid {os.getuid()}" + (" (root)" if os.geteuid() == 0 else ""))]
    lines.append(DoctorLine("kernel", _kernel_at_least(5, 11), os.uname().release
                            + ("" if _kernel_at_least(5, 11) else ": overlayfs in user namespaces needs 5.11")))
    for backend, blocker in ((Backend.KERNEL, _kernel_blocker()), (Backend.USERNS, _userns_blocker()),
                             (Backend.EXTRACT, _extract_blocker())):
        lines.append(DoctorLine(f"backend {backend.value}", blocker is None, blocker or "usable"))
    program = squashfuse()
    fast = os.path.basename(program) == "squashfuse_cached"
    lines.append(DoctorLine("squashfuse", True, program + (": the kernel caches opens, directories and symlinks" if fast
                            else ": every open() is a FUSE round trip; `make` builds the faster squashfuse_cached")))
    init = init_program()
    lines.append(DoctorLine("init", bool(init), init or INIT_MISSING))
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


# --- kernel and userns: sessions on the holder -----------------------------------------------------


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
    cgroups = locate_cgroups()
    if cgroups:
        start_join_grace_period(cgroups[0])
    root = str(Path(__file__).resolve().parents[1])
    # -S: no site-packages scan; the holder needs the standard library and this package only.
    boot = f"import sys; sys.path[:0] = [{root!r}]; from image_builder.holder import holder_main; " \
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


def _unpacked(cache: Path, env_sif: Path, offset: int):
    """The environment's squashfs unpacked under `cache` (once per image), held (see
    extract.ExtractedLayer) until released."""
    from .extract import extracted_layer

    layer = extracted_layer(cache, env_sif, offset)
    if layer.listing.whiteouts or layer.listing.opaque:  # a flattened environment has none; overlays need them
        layer.release()
        raise RunnerError(f"{env_sif} holds overlay whiteouts: it cannot be used unpacked; drop unpack_dir")
    return layer


def _open_on_holder(state_dir: Path, kernel: bool, msg: dict) -> tuple[socket.socket, dict]:
    """Send a session's open to the holder (started if none runs): its connection and reply."""
    name = holder_name(state_dir, kernel)
    for _attempt in range(3):
        try:
            conn = _connect(name)
        except (ConnectionRefusedError, FileNotFoundError):
            _start_holder(state_dir, kernel, name)
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
        return conn, reply
    raise RunnerError(f"cannot reach the mount holder; see {state_dir}/holder.log")


class _HolderSession(Session):
    """kernel and userns: the layers are mounted by the per-user holder (holder.py). The
    session keeps spare inits (one per run in flight), asked for ahead of need, so a
    run only sends its job to a ready init and reads the answer."""

    def __init__(self, layers: InstanceLayers, backend: Backend, state_dir: Path, binds: tuple[Bind, ...],
                 max_processes: int, linger: float, scratch_mb: int | None, unpack_dir: Path | None):
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
        unpacked = None
        if unpack_dir is not None and not self._kernel:
            unpacked = _unpacked(Path(unpack_dir), Path(layers.env_sif), offset)
            refs[0] = (str(unpacked.tree), 0, -1)
        msg = {"op": "open", "layers": refs, "linger": float(linger), "scratch_mb": scratch_mb,
               "binds": [(str(Path(b.src).resolve()), b.dest, b.readonly) for b in binds]}
        try:
            conn, reply = _open_on_holder(state_dir, self._kernel, msg)
        finally:
            if unpacked is not None:
                unpacked.release()  # the holder holds the tree from its mount on
        self._conn = conn
        self._spec = reply["spec"]
        self._holder_pid = _peer(conn)[0]
        self._lock = threading.Lock()
        self._ready: dict[bool, list[tuple[float, socket.socket]]] = {False: [], True: []}  # (received, init)
        self._asked = {False: 0, True: 0}
        self._busy = {False: 0, True: 0}
        # Inits whose last run left their root untouched, by (network, memory limit): the limits a
        # job sets on its init cannot be raised again, so an init only takes jobs like its first.
        self._reused: dict[tuple[bool, int | None], list[tuple[float, socket.socket]]] = {}
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

    def _take_reused(self, key: tuple[bool, int | None]) -> socket.socket | None:
        with self._lock:
            reused = self._reused.get(key, [])
            while reused:
                since, ctl = reused.pop()  # the last one back: the warmest
                if time.monotonic() - since < IDLE_INIT / 2:
                    self._busy[key[0]] += 1
                    return ctl
                ctl.close()
            return None

    def _done(self, network: bool, reusable: tuple[tuple[bool, int | None], socket.socket] | None = None) -> None:
        with self._lock:
            self._busy[network] -= 1
            if reusable and self._conn is not None:
                self._reused.setdefault(reusable[0], []).append((time.monotonic(), reusable[1]))
            elif reusable:
                reusable[1].close()

    def _send(self, msg: bytes, fds: list[int], network: bool, key: tuple[bool, int | None]) -> socket.socket:
        """Hand the job's message to an init whose last run left it untouched, else to a
        ready one (one killed meanwhile is passed over)."""
        for _attempt in range(8):
            ctl = self._take_reused(key) or self._take(network)
            try:
                send_fds(ctl, msg, fds)
                return ctl
            except OSError:
                ctl.close()
                self._done(network)
        raise RunnerError("no init took the run: they all died; see holder.log in the state dir")

    def run(self, request: RunRequest) -> RunResult:
        job = encode_job(build_job(self.layers, request, self.max_processes))
        key = (request.network, request.memory_mb)
        ctl = out_r = err_r = got = None
        try:
            fds = [stdin_fd(request.stdin)]
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            fds += [out_w, err_w]
            try:
                msg, payload = job_message(job)
                fds += payload
                t0 = time.monotonic()
                ctl = self._send(msg, fds, request.network, key)
            finally:
                for fd in fds:
                    os.close(fd)
            deadline = None if request.timeout is None else t0 + request.timeout + _REPORT_GRACE
            try:
                got = collect(out_r, err_r, request.max_output, deadline, ctl)
            except TimeoutError:
                raise RunnerError("the run did not report back after its timeout; see holder.log in the "
                                  "state dir") from None
            wall = time.monotonic() - t0
        finally:
            if ctl is not None:
                if got is not None and got.reply and got.reply.get("reusable"):
                    self._done(request.network, (key, ctl))
                else:
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
        return build_result(got, request, wall, reply["exit_code"], reply["signal"], reply["timed_out"],
                       reply["peak_memory_kb"], reply["out_of_memory"])

    def shell(self, argv: tuple[str, ...] = ("/bin/sh",), persist: Path | None = None, *,
              network: bool = False) -> int:
        upper = None
        if persist is not None:
            Path(persist).mkdir(parents=True, exist_ok=True)
            upper = str(Path(persist).resolve())
        console = os.ttyname(0) if os.isatty(0) else None
        spec = RootSpec(network=network, upper=upper, console=console,
                        **{**self._spec, "binds": tuple(self._spec["binds"])})
        env = {"TERM": os.environ.get("TERM", "xterm")}
        job = build_job(self.layers, RunRequest(tuple(argv), env=env), self.max_processes)
        return run_joined(self._holder_pid, self._kernel, spec, job)

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            for ready in (*self._ready.values(), *self._reused.values()):
                for _, ctl in ready:
                    ctl.close()
                ready.clear()
        if conn is not None:
            conn.close()  # the holder releases the layers (after the linger time)

# --- entry points ------------------------------------------------------------------------------------


def open_session(layers: InstanceLayers, *, backend: Backend | None = None, state_dir: Path | None = None,
                 binds: tuple[Bind, ...] = (), max_processes: int = DEFAULT_MAX_PROCESSES, linger: float = 0.0,
                 scratch_mb: int | None = None, unpack_dir: Path | None = None) -> Session:
    """Mount `layers` (warm: a layer already mounted for this user is reused) for many runs.

    `binds`: host paths to show inside. `max_processes`: per run. `linger`: seconds the
    mounts stay after the last session using them closes, so the next one starts warm
    (a CLI running one command per process wants this). `scratch_mb`: size of each
    run's writable layer (default half the RAM). `unpack_dir` (default
    $IMAGE_BUILDER_UNPACK_DIR): userns only, unpack the environment image there once (a
    node-local disk: about the image's size uncompressed) and use it instead of
    squashfuse: with plain squashfuse_ll, whose round trip on every open() slows short
    runs by a third, this wins; squashfuse_cached comes close without it."""
    backend = backend or detect_backend()
    if not Path(layers.env_sif).is_file():
        raise RunnerError(f"environment image {layers.env_sif} not found; build or pull it first")
    state_dir = Path(state_dir) if state_dir else default_state_dir()
    if backend in (Backend.KERNEL, Backend.USERNS):
        unpack_dir = unpack_dir or os.environ.get("IMAGE_BUILDER_UNPACK_DIR") or None
        return _HolderSession(layers, backend, state_dir, tuple(binds), max_processes, linger, scratch_mb,
                              Path(unpack_dir) if unpack_dir else None)
    if backend is Backend.APPTAINER:
        from .apptainer import ApptainerSession

        return ApptainerSession(layers, tuple(binds), max_processes)
    from .extract import ExtractSession

    return ExtractSession(layers, state_dir, tuple(binds), max_processes)


def run(layers: InstanceLayers, request: RunRequest, backend: Backend | None = None) -> RunResult:
    """One command in a session of its own."""
    with open_session(layers, backend=backend) as session:
        return session.run(request)
