"""kernel and userns: sessions on the per-user mount holder (holder.py, on the
primitives of mounts.py). The holder keeps each layer mounted once, and runs are handed
to inits (native/init.c) whose root is already built.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import time
from pathlib import Path

from .cgroups import locate_cgroups, start_join_grace_period
from .execution import Bind, RunRequest, RunResult
from .holder import IDLE_INIT, PROTOCOL, encode_job, recv_fds, run_joined, send_fds
from .mounts import RootSpec, RunnerError
from .session import Backend, InstanceLayers, Session, build_job, build_result, collect, job_descriptors
from .statedir import TOKEN, open_log, peer, private_dir, read_token

_REPORT_GRACE = 30.0  # seconds past a run's timeout before its silence is an error

UNPACK_DIR_ENV = "IMAGE_BUILDER_UNPACK_DIR"  # the default unpack_dir
_NAME_ENV = "IMAGE_BUILDER_HOLDER_SOCKET"  # how the name reaches the holder: argv is public, environ is not


class _Squatted(Exception):
    """The holder's socket name is taken by a process that is not our holder."""


def new_token(state_dir: Path, stale: str | None) -> str:
    """Replace the token `stale` (None: none yet) with a random one, unless another
    process did meanwhile: then theirs, so that both start the same holder."""
    import fcntl
    import secrets

    lock = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = read_token(state_dir)
        if current is not None and current != stale:
            return current
        token = secrets.token_hex(16)
        tmp = Path(state_dir, f"{TOKEN}.{os.getpid()}")
        try:
            os.unlink(tmp)  # a crashed writer's, with our pid
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, Path(state_dir, TOKEN))
        return token
    finally:
        os.close(lock)


def holder_name(state_dir: Path, kernel: bool, token: str | None = None) -> str:
    """The holder's abstract socket name: per user, backend, interpreter (messages are
    marshal) and job format, with the state dir's secret token (made on first use), so that another
    user cannot bind the name before the holder does. An abstract socket vanishes with
    its process: a dead holder leaves no socket file behind."""
    import zlib

    token = token or read_token(state_dir) or new_token(state_dir, None)
    kind = "kernel" if kernel else "userns"
    key = f"{sys.version}:{kind}:{PROTOCOL}"
    return f"image-builder-{os.getuid()}-{token}-{zlib.crc32(key.encode()):08x}-{kind}"


def _connect(name: str) -> socket.socket:
    """A connection to our holder at `name`: ConnectionRefusedError when nothing listens
    there, _Squatted when another user's socket (or one of another type) has the name."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(b"\0" + name.encode())
        uid = peer(conn)[1]
    except OSError as e:
        conn.close()
        # A socket of another type with the name (older kernels: one abstract namespace for every type).
        if e.errno == errno.EPROTOTYPE:
            raise _Squatted(f"a socket of another type holds @{name}") from None
        raise
    if uid != os.getuid():
        conn.close()
        raise _Squatted(f"@{name} is held by uid {uid}")
    return conn


def _note(state_dir: Path, text: str) -> None:
    fd = open_log(state_dir)
    try:
        os.write(fd, f"image-builder: {text}\n".encode())
    finally:
        os.close(fd)


def _start_holder(state_dir: Path, kernel: bool, name: str) -> str:
    """Start a holder for `name`; "ready", or "busy" when the name was already taken."""
    import subprocess

    root = str(Path(__file__).resolve().parents[2])
    # -S: no site-packages scan; the holder needs the standard library and this package only.
    boot = f"import os, sys; sys.path[:0] = [{root!r}]; from image_builder.runtime.holder import holder_main; " \
           f"holder_main(sys.argv[1:] + [os.environ.pop({_NAME_ENV!r})])"
    log = open_log(state_dir)
    try:
        proc = subprocess.Popen([sys.executable, "-S", "-E", "-c", boot, "kernel" if kernel else "userns",
                                 str(state_dir)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=log, start_new_session=True, cwd="/", env={**os.environ, _NAME_ENV: name})
    finally:
        os.close(log)
    cgroups = locate_cgroups()
    if cgroups:  # while the holder starts up, not before it (2 ms of this process's time)
        start_join_grace_period(cgroups[0])
    line = proc.stdout.readline().decode(errors="replace").strip()
    proc.stdout.close()
    proc.wait()
    if not line or line.startswith("error:"):
        why = line[6:].strip() if line else f"it died; see {state_dir}/holder.log"
        raise RunnerError(f"cannot start the mount holder: {why}; run `image-builder doctor`")
    return line


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
    """Send a session's open to the holder (started if none runs): its connection and
    reply. A name found taken by someone else is given up for a new token's."""
    token = read_token(state_dir) or new_token(state_dir, None)
    for _attempt in range(6):
        name = holder_name(state_dir, kernel, token)
        try:
            try:
                conn = _connect(name)
            except (ConnectionRefusedError, FileNotFoundError):
                if _start_holder(state_dir, kernel, name) == "busy":
                    conn = _connect_soon(name)  # ours, just started by another process; or a squatter's
                else:
                    continue
        except _Squatted as e:
            _note(state_dir, f"{e}; the holder moves to a new name")
            token = new_token(state_dir, token)
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


def _connect_soon(name: str, wait: float = 2.0) -> socket.socket:
    """The holder at `name` once it listens (a new holder binds its name a moment before
    it listens); _Squatted if nothing listens there by then: a bound socket that never
    listens is someone else's."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return _connect(name)
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise _Squatted(f"@{name} is bound but nothing listens there") from None
            time.sleep(0.02)


class HolderSession(Session):
    """kernel and userns: the layers are mounted by the per-user holder (holder.py). The
    session keeps spare inits (one per run in flight), asked for ahead of need, so a
    run only sends its job to a ready init and reads the answer."""

    def __init__(self, layers: InstanceLayers, backend: Backend, state_dir: Path, binds: tuple[Bind, ...],
                 max_processes: int, linger: float, scratch_mb: int | None, unpack_dir: Path | None,
                 first_init: bool = True, layers_at: str | None = None):
        import threading

        from image_builder.pack.sif import SifError, partition_offset

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
            # Trees are found there by a name anyone who can read the image can compute: one put there by
            # another user would be the environment.
            unpack_dir = private_dir(unpack_dir, "unpack dir", f"give a directory of yours no other user can "
                                     f"write to (mkdir -m 700 DIR), or unset {UNPACK_DIR_ENV}")
            unpacked = _unpacked(Path(unpack_dir), Path(layers.env_sif), offset)
            refs[0] = (str(unpacked.tree), 0, -1)
        msg = {"op": "open", "layers": refs, "linger": float(linger), "scratch_mb": scratch_mb,
               "binds": [(str(Path(b.src).resolve()), b.dest, b.readonly) for b in binds], "layers_at": layers_at}
        try:
            conn, reply = _open_on_holder(state_dir, self._kernel, msg)
        finally:
            if unpacked is not None:
                unpacked.release()  # the holder holds the tree from its mount on
        self._conn = conn
        self._spec = reply["spec"]
        self._holder_pid = peer(conn)[0]
        self._lock = threading.Lock()
        self._ready: dict[bool, list[tuple[float, socket.socket]]] = {False: [], True: []}  # (received, init)
        self._asked = {False: 0, True: 0}
        self._busy = {False: 0, True: 0}
        self._flying: set[socket.socket] = set()  # the control sockets of the runs in flight
        if first_init:
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
            self._flying.add(ctl)
            while len(self._ready[network]) + self._asked[network] < self._busy[network]:
                self._ask(network)  # a spare for each run in flight: its next one
            return ctl

    def _done(self, network: bool, ctl: socket.socket) -> None:
        with self._lock:
            self._busy[network] -= 1
            self._flying.discard(ctl)
        ctl.close()

    def _send(self, msg: bytes, fds: list[int], network: bool) -> socket.socket:
        """Hand the job's message to a ready init (one killed meanwhile is passed over):
        each serves one run, in a root of its own (init.c says why)."""
        for _attempt in range(8):
            ctl = self._take(network)
            try:
                send_fds(ctl, msg, fds)
                return ctl
            except OSError:
                self._done(network, ctl)
        raise RunnerError("no init took the run: they all died; see holder.log in the state dir")

    def run(self, request: RunRequest) -> RunResult:
        job = encode_job(build_job(self.layers, request, self.max_processes))
        ctl = out_r = err_r = got = None
        try:
            msg, fds, out_r, err_r = job_descriptors(job, request.stdin)
            try:
                t0 = time.monotonic()
                ctl = self._send(msg, fds, request.network)
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
                self._done(request.network, ctl)  # closed: also how a Ctrl-C here stops the run (the init sees us go)
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
                       reply["peak_memory_kb"], reply["out_of_memory"], reply["start_errno"])

    def kept_init(self, network: bool, idle: float, layer: tuple[Path, int] | None = None) -> socket.socket:
        """The control socket of a new init whose root is kept from job to job (a
        sandbox's: runtime/sandbox.py), idle `idle` seconds at most; `layer`: its
        writable layer on disk (directory, MB: holder._disk_layer), else a tmpfs."""
        with self._lock:
            if self._conn is None:
                raise RunnerError("the session is closed; open a new one")
            while self._asked[False] or self._asked[True]:  # answers come in order: take those first
                self._receive(block=True)
            send_fds(self._conn, {"op": "init", "network": network, "keep": float(idle),
                                  "layer": None if layer is None else (str(layer[0]), int(layer[1]))})
            reply, fds = recv_fds(self._conn, 1)
        if reply is None:
            raise RunnerError("the mount holder is gone (killed?); open a new sandbox")
        if "error" in reply:
            raise RunnerError(f"cannot start the sandbox: {reply['error']}")
        return socket.socket(fileno=fds[0])

    def park(self, info: dict) -> str:
        """Keep this session's sandbox (its last kept_init) after the session closes; its id."""
        with self._lock:
            send_fds(self._conn, {"op": "park", "info": info})
            reply = recv_fds(self._conn, 0)[0]
        if not reply or "error" in reply:
            raise RunnerError(f"cannot keep the sandbox: {(reply or {}).get('error', 'the holder is gone')}")
        return reply["id"]

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
        """Also stops the runs in flight (their callers get RunnerError): each one's init sees its control
        socket shut, as when its caller goes."""
        with self._lock:
            conn, self._conn = self._conn, None
            for ready in self._ready.values():
                for _, ctl in ready:
                    ctl.close()
                ready.clear()
            for ctl in self._flying:
                try:
                    ctl.shutdown(socket.SHUT_RDWR)  # not closed: its run's thread still polls it
                except OSError:
                    pass
        if conn is not None:
            conn.close()  # the holder releases the layers (after the linger time)


class NoHolder(RunnerError):
    """No mount holder runs for this user and backend: nothing is mounted, no sandbox kept."""


def holder_request(state_dir: Path, kernel: bool, msg: dict, fds: int = 0) -> tuple[socket.socket, dict, list[int]]:
    """Send `msg` to the running holder (none is started: NoHolder); its connection,
    answer and descriptors."""
    token = read_token(state_dir)
    try:
        if token is None:
            raise ConnectionRefusedError
        conn = _connect(holder_name(state_dir, kernel, token))
    except (ConnectionRefusedError, FileNotFoundError, _Squatted):
        raise NoHolder("no sandbox is running (no mount holder for this user and backend)") from None
    try:
        send_fds(conn, msg)
        reply, got = recv_fds(conn, fds)
    except OSError:
        conn.close()
        raise RunnerError("the mount holder went away; see holder.log in the state dir") from None
    if reply is None or "error" in reply:
        conn.close()
        raise RunnerError((reply or {}).get("error", "the mount holder went away"))
    return conn, reply, got
