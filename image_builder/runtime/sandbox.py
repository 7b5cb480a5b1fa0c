"""A sandbox that lasts: one instance root kept from command to command, for an agent
that works in it for many turns (the agents/ stage puts tasks and scoring on top).

    with open_sandbox(InstanceLayers(env_sif, (inst_sqfs,), env, "/testbed")) as box:
        box.exec(["sh", "-c", "python3 -m http.server 8000 >/tmp/log 2>&1 &"])
        box.exec(["curl", "-s", "localhost:8000"])   # the server is still there
        box.write_file("fix.py", b"...")            # relative: under the workdir

It is a run's root (session.py says what a run gets) whose init (native/init.c,
"sandbox" mode) takes one job after another without tearing the root down: files,
installed packages and background processes stay until close(). Every exec is its own
process group; its timeout kills that group, not what earlier execs left running. The
limits hold for the sandbox as a whole: memory (its cgroup where one is delegated,
else each exec's RLIMIT_AS), processes (RLIMIT_NPROC counts the sandbox's user
namespace), and the writable layer: a tmpfs sized by `disk_mb` (memory, never the
store's file system), or with `layer_dir` (a node-local disk) a file system of its own
there: an ext4 of `disk_mb` on a loop device (kernel backend; ENOSPC past it), or a
directory, uncapped (rootless: a loop device needs root). Either goes when the
sandbox does (a rootless one a killed holder left, with the next sandbox made
there). Commands run as root of the sandbox's user namespace, or with exec's `user`
as a user of the instance's /etc/passwd (kernel backend only: there the namespace also
maps 65535 uids, onto a host range no account uses; rootless, it can map root only).
Execs may run side by side (from threads: an agent's parallel tool calls).

When the holder or the init dies, the next call raises SandboxUnavailable instead
of hanging: the init dies with its holder (PR_SET_PDEATHSIG) and the socket says so.
"""

from __future__ import annotations

import io
import os
import posixpath
import select
import socket
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from .execution import Bind, RunRequest, RunResult
from .holder import DEFAULT_MAX_PROCESSES, encode_job, send_fds
from .mounts import RunnerError
from .session import (Backend, InstanceLayers, OutputCapped, Session, build_job, build_result, collect,
                      job_descriptors)

if TYPE_CHECKING:
    import tarfile

DEFAULT_IDLE = 3600.0  # seconds a sandbox waits for its next command before it ends
FILE_LIMIT = 100 << 20  # bytes read_file and download return at most (Inspect's read_file limit)
_REPORT_GRACE = 5.0  # seconds past an exec's timeout its answer may take (the kill, the reaping)
LAYER_DIR_ENV = "IMAGE_BUILDER_LAYER_DIR"  # the default layer_dir: a node-local disk
DEFAULT_DISK_LAYER_MB = 10240  # a layer on disk without disk_mb: sparse, so only what is written is used
ROOT_USERS = (None, "root", "0")  # root of the sandbox's user namespace, as every command runs by default
MAPPED_IDS = 65535  # uids and gids 1..65535 map to host ids as root (native/init.c's USERS)
_HELPER_TIMEOUT = 600.0  # seconds for a file helper: a fifo planted where a file was expected must not hang us

# read_file/write_file through the sandbox's own shell: a symlink the agent planted is
# followed as the agent's own processes would follow it, never by a privileged process.
_READ = ('[ -e "$1" ] || exit 3; [ -d "$1" ] && exit 4; [ -r "$1" ] || exit 5; exec cat -- "$1"')
_WRITE = ('[ -d "$1" ] && exit 4; d=$(dirname -- "$1"); mkdir -p -- "$d" || exit 5; '
          'cat > "$1" || exit 5')


class SandboxUnavailable(RunnerError):
    """The sandbox is gone: closed, idle past its timeout, or its holder or init killed."""


class UserUnsupported(RunnerError):
    """exec's `user` cannot be had in this sandbox: rootless, only root is mapped."""


class UnknownUser(RunnerError):
    """exec's `user` is not in the instance's /etc/passwd."""


class Sandbox:
    """A live instance root (see the module docstring); a context manager."""

    def __init__(self, layers: InstanceLayers, *, backend: Backend | None = None, state_dir: Path | None = None,
                 binds: tuple[Bind, ...] = (), network: bool = False, memory_mb: int | None = None,
                 max_processes: int = DEFAULT_MAX_PROCESSES, disk_mb: int | None = None,
                 idle: float = DEFAULT_IDLE, unpack_dir: Path | None = None, layer_dir: Path | None = None):
        from .backends import checked_state_dir
        from .statedir import check_ancestors
        from .holder_session import HolderSession

        backend = _sandbox_backend(backend)
        layer_dir = layer_dir or os.environ.get(LAYER_DIR_ENV) or None
        layer = None
        if layer_dir:
            layer_dir = Path(layer_dir).resolve()
            if not layer_dir.is_dir():
                raise RunnerError(f"layer dir {layer_dir}: not an existing directory")
            if backend is Backend.USERNS and disk_mb:
                raise RunnerError(f"a size (--disk, disk_mb) for a layer on disk ({layer_dir}) needs the kernel "
                                  "backend (root: a loop device); rootless, drop the size (the layer is uncapped "
                                  f"there) or the layer dir (a tmpfs of that size; unset {LAYER_DIR_ENV})")
            # The holder makes the layer there: another user who could swap what it makes for
            # a link would have it format or write a file of ours (as root: any file).
            check_ancestors(layer_dir, f"give a directory of yours no other user can write to (mkdir -m 700 "
                                       f"{layer_dir}/$USER), or unset {LAYER_DIR_ENV}", "layer dir", itself=True)
            layer = (layer_dir, disk_mb or DEFAULT_DISK_LAYER_MB)
            disk_mb = None  # the tmpfs then holds only mount points and /dev/shm: the run's memory bounds them
        self._limits(layers, backend, network, memory_mb, max_processes)
        self._lease: socket.socket | None = None
        self._ctl: socket.socket | None = None
        self.id: str | None = None  # once parked
        self.info: dict = {}  # park()'s, as attach() gets it back
        self.state_dir = state_dir = checked_state_dir(layers, state_dir)
        self._session: HolderSession | None = HolderSession(layers, backend, state_dir, tuple(binds), max_processes,
                                                            0.0, disk_mb, unpack_dir, first_init=False)
        try:
            self._ctl = self._session.kept_init(network, idle, layer)
            first = self.exec(["true"])  # builds the root: its errors surface here, not at the agent's first call
        except BaseException:
            self.close()
            raise
        if first.exit_code != 0:
            self.close()
            raise RunnerError(f"the sandbox cannot run commands: {first.stderr.decode(errors='replace').strip()}")

    def _limits(self, layers: InstanceLayers, backend: Backend, network: bool, memory_mb: int | None,
                max_processes: int) -> None:
        self.layers, self.backend, self.network = layers, backend, network
        self.memory_mb, self.max_processes = memory_mb, max_processes
        self._lock = threading.Lock()

    # -- kept past this process: `image-builder sandbox` --

    def park(self, info: dict | None = None) -> str:
        """Keep the sandbox running after this object (and process) is gone, held by the
        node's holder until stop_sandbox() or its idle timeout; its id, for attach().
        `info` (plain data) comes back with attach()."""
        if self._session is None:
            raise RunnerError(f"sandbox {self.id} is already kept")
        lay = self.layers
        self.id = self._session.park({
            "layers": {"env_sif": str(lay.env_sif), "overlays": [str(o) for o in lay.overlays], "env": dict(lay.env),
                       "workdir": lay.workdir},
            "network": self.network, "memory_mb": self.memory_mb, "max_processes": self.max_processes,
            "backend": self.backend.value, **(info or {})})
        return self.id

    @classmethod
    def attach(cls, sandbox_id: str, *, backend: Backend | None = None, state_dir: Path | None = None):
        """A kept sandbox (park()) to use from this process (others may use it at the same
        time). close() lets go of it (stop_sandbox ends it)."""
        from .holder_session import NoHolder, holder_request

        backend, state_dir = _holder_of(backend, state_dir)
        try:
            conn, reply, fds = holder_request(state_dir, backend is Backend.KERNEL,
                                              {"op": "attach", "id": sandbox_id}, 1)
        except NoHolder:
            raise SandboxUnavailable(f"no sandbox {sandbox_id} (stopped, or idle past its timeout; none runs for "
                                     f"this user and the {backend.value} backend); `image-builder sandbox ls`"
                                     ) from None
        info = reply["info"]
        lay = info["layers"]
        box = cls.__new__(cls)
        box._limits(InstanceLayers(Path(lay["env_sif"]), tuple(Path(o) for o in lay["overlays"]), lay["env"],
                                   lay["workdir"]), backend, info["network"], info["memory_mb"], info["max_processes"])
        box._session, box._lease, box.id, box.info, box.state_dir = None, conn, sandbox_id, info, state_dir
        box._ctl = socket.socket(fileno=fds[0])
        return box

    # -- commands --

    def exec(self, argv: list[str] | tuple[str, ...], input: bytes | str | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, user: str | None = None, timeout: float | None = None,
             max_output: int = 1 << 20) -> RunResult:
        """Run `argv` in the sandbox and wait for it (not for what it leaves in the
        background). `cwd` relative to the workdir; `env` over the image's. The result's
        `truncated` says output went over `max_output` bytes (of stdout or stderr)."""
        ids, env = (-1, -1), dict(env or {})
        if user not in ROOT_USERS:
            uid, gid, home = self._user(str(user))
            ids = (uid, gid)
            env.setdefault("HOME", home)  # as `docker exec --user` sets it
        if isinstance(input, str):
            input = input.encode()
        workdir = posixpath.join(self.layers.workdir, cwd) if cwd else None
        return self._run(RunRequest(tuple(argv), stdin=input, env=env, workdir=workdir, timeout=timeout,
                                    max_output=max_output), ids)

    def _user(self, user: str) -> tuple[int, int, str]:
        """uid, gid and home of `user` (a name, or a uid) in the instance's /etc/passwd as it is now."""
        if self.backend is not Backend.KERNEL:
            raise UserUnsupported(f"user {user!r}: a rootless sandbox runs commands as root only (its user "
                                  "namespace can map no other user); run as root for other users")
        try:
            passwd = self.read_file("/etc/passwd", limit=16 << 20)
        except (OSError, UnicodeDecodeError, OutputCapped):
            passwd = ""
        for line in passwd.splitlines():
            f = line.split(":")
            if len(f) >= 7 and user in (f[0], f[2]) and f[2].isdigit() and f[3].isdigit():
                uid, gid = int(f[2]), int(f[3])
                if uid > MAPPED_IDS or gid > MAPPED_IDS:
                    raise UserUnsupported(f"user {user!r}: uid {uid}, gid {gid}; the sandbox maps ids up to "
                                          f"{MAPPED_IDS} only")
                return uid, gid, f[5] or "/"
        raise UnknownUser(f"unable to find user {user!r}: no matching entry in the sandbox's /etc/passwd")

    def run(self, request: RunRequest) -> RunResult:
        """exec() of a RunRequest (the Executor interface graders use); the sandbox's own
        memory limit and network stand for the request's, and its files are not written.
        Safe to call from several threads at once: the commands run side by side."""
        return self._run(request, (-1, -1))

    def _run(self, request: RunRequest, ids: tuple[int, int]) -> RunResult:
        if request.files:
            raise RunnerError("a sandbox's commands take no files: write_file() them first")
        request = replace(request, memory_mb=self.memory_mb, network=self.network)
        with self._lock:
            if self._ctl is None:
                raise SandboxUnavailable("the sandbox is closed")
            ctl = self._ctl
        job = encode_job({**build_job(self.layers, request, self.max_processes), "uid": ids[0], "gid": ids[1]})
        out_r = err_r = None
        # The init answers each job on a socket of its own: answers to commands run side by
        # side need no sorting out, and shutting it stops that command (init.c).
        answer, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            msg, fds, out_r, err_r = job_descriptors(job, request.stdin)
            try:
                t0 = time.monotonic()
                try:
                    send_fds(ctl, msg, [*fds[:3], theirs.fileno(), *fds[3:]])
                except OSError:
                    self._gone()
            finally:
                theirs.close()
                for fd in fds:
                    os.close(fd)
            deadline = None if request.timeout is None else t0 + request.timeout + _REPORT_GRACE
            try:
                got = collect(out_r, err_r, request.max_output, deadline, answer, until_reply=True)
            except TimeoutError:
                self._gone("it did not answer after the command's timeout")
            except BaseException:
                _cancel(answer)  # a Ctrl-C, or a streamed run's output over its cap
                raise
            wall = time.monotonic() - t0
        finally:
            answer.close()
            for fd in (out_r, err_r):
                if fd is not None:
                    os.close(fd)
        reply = got.reply
        if reply is None:
            self._gone()
        if "error" in reply:
            raise RunnerError(reply["error"])
        return build_result(got, request, wall, reply["exit_code"], reply["signal"], reply["timed_out"],
                            reply["peak_memory_kb"], reply["out_of_memory"], reply["start_errno"])

    # stream(): run() with the output passed on as it comes (Session.stream, the same relay).
    stream = Session.stream

    def _drop(self) -> None:
        ctl, self._ctl = self._ctl, None
        if ctl is not None:
            ctl.close()  # the init sees EOF and ends: every process of the sandbox with it

    def _gone(self, why: str = "its init or holder was killed, or it sat idle past its timeout") -> None:
        self._drop()
        raise SandboxUnavailable(f"the sandbox is gone: {why}; start a new one")

    # -- files --

    def _path(self, path: str) -> str:
        return posixpath.join(self.layers.workdir, path)

    def read_file(self, path: str, text: bool = True, limit: int = FILE_LIMIT) -> str | bytes:
        """The file's bytes (text: decoded as UTF-8, newlines as they are).
        FileNotFoundError, IsADirectoryError, PermissionError as for a local file;
        OutputCapped past `limit` bytes; UnicodeDecodeError for text that is not UTF-8."""
        full = self._path(path)
        r = self.exec(["sh", "-c", _READ, "read_file", full], max_output=limit, timeout=_HELPER_TIMEOUT)
        _raise_for(r, full)
        if r.truncated:
            raise OutputCapped(full, limit)
        return r.stdout.decode() if text else r.stdout

    def write_file(self, path: str, data: str | bytes) -> None:
        """Write `data` exactly (str as UTF-8; CRLF kept), making missing parents."""
        full = self._path(path)
        r = self.exec(["sh", "-c", _WRITE, "write_file", full], input=data.encode() if isinstance(data, str) else data,
                      timeout=_HELPER_TIMEOUT)
        _raise_for(r, full)

    def upload(self, host_path: str | os.PathLike, path: str) -> None:
        """Copy a host file or tree to `path` (made if missing; a tree's contents go in it)."""
        host = Path(host_path)
        full = self._path(path)
        if host.is_file():
            self.write_file(full, host.read_bytes())
            return
        if not host.is_dir():
            raise FileNotFoundError(f"{host}: no such file or directory on the host")
        import tarfile  # here, as in _untar_confined: `sandbox exec`'s fresh process never needs it (4 ms)

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for child in sorted(host.iterdir()):
                tar.add(child, arcname=child.name)
        r = self.exec(["sh", "-c", 'mkdir -p -- "$1" && exec tar -x -C "$1" -f -', "upload", full],
                      input=buf.getvalue(), timeout=_HELPER_TIMEOUT)
        _raise_for(r, full)

    def download(self, path: str, host_path: str | os.PathLike, limit: int = FILE_LIMIT) -> None:
        """Copy the sandbox's file or tree at `path` to `host_path` on the host (which must
        not exist). Regular files, directories and symlinks only, and symlinks only where they
        lead inside host_path; nothing is written through one (_untar_confined): whatever
        the sandbox's tar sends, nothing outside host_path is touched."""
        full = self._path(path)
        r = self.exec(["sh", "-c", '[ -e "$1" ] || exit 3; cd "$(dirname -- "$1")" && '
                       'exec tar -c -f - -- "$(basename -- "$1")"', "download", full], max_output=limit,
                      timeout=_HELPER_TIMEOUT)
        _raise_for(r, full)
        if r.truncated:
            raise OutputCapped(full, limit)
        _untar_confined(r.stdout, Path(host_path))

    # -- the end --

    def close(self) -> None:
        """End the sandbox: every process in it is killed and its writable layer freed;
        a parked or attached one is only let go (stop_sandbox ends it)."""
        with self._lock:
            self._drop()
        if self._session is not None:
            self._session.close()
        if self._lease is not None:
            self._lease.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _sandbox_backend(backend: Backend | None) -> Backend:
    from .backends import detect_backend

    backend = backend or detect_backend()
    if backend not in (Backend.KERNEL, Backend.USERNS):
        raise RunnerError(f"a sandbox needs the kernel or userns backend, not {backend.value}; "
                          "see `image-builder doctor`")
    return backend


def _holder_of(backend: Backend | None, state_dir: Path | None) -> tuple[Backend, Path]:
    """The backend and this user's state dir, where a parked sandbox's holder is found."""
    from .statedir import default_state_dir, private_dir

    return _sandbox_backend(backend), Path(private_dir(state_dir or default_state_dir()))


def kept_sandboxes(*, backend: Backend | None = None, state_dir: Path | None = None) -> list[dict]:
    """The parked sandboxes of this user: id, info (park's), made (epoch seconds), busy."""
    from .holder_session import NoHolder, holder_request

    backend, state_dir = _holder_of(backend, state_dir)
    try:
        conn, reply, _ = holder_request(state_dir, backend is Backend.KERNEL, {"op": "list"})
    except NoHolder:
        return []
    conn.close()
    return reply["sandboxes"]


def stop_sandbox(sandbox_id: str, *, backend: Backend | None = None, state_dir: Path | None = None) -> None:
    """End a parked sandbox: every process in it is killed, its writable layer freed."""
    from .holder_session import holder_request

    backend, state_dir = _holder_of(backend, state_dir)
    conn, _, _ = holder_request(state_dir, backend is Backend.KERNEL, {"op": "stop", "id": sandbox_id})
    conn.close()


def _cancel(answer: socket.socket) -> None:
    """Stop a running command: shut the job's answer socket, and the init kills its
    process group (other commands run on); its answer is waited for up to 10 s, so that
    it is gone when this returns."""
    try:
        answer.shutdown(socket.SHUT_WR)
        select.select([answer], [], [], 10.0)
    except OSError:
        pass


def _raise_for(r: RunResult, path: str) -> None:
    """The local error a file helper's exit status stands for."""
    if r.exit_code == 0:
        return
    if r.exit_code == 3:
        raise FileNotFoundError(2, "No such file or directory", path)
    if r.exit_code == 4:
        raise IsADirectoryError(21, "Is a directory", path)
    if r.exit_code == 5 or b"ermission denied" in r.stderr or b"Read-only file system" in r.stderr:
        raise PermissionError(13, "Permission denied", path)
    why = r.stderr.decode(errors="replace").strip().splitlines()
    raise RunnerError(f"{path}: {why[-1] if why else f'exit status {r.exit_code}'}")


def _untar_confined(data: bytes, dest: Path) -> None:
    """Unpack a tar made inside a sandbox at `dest` (which must not exist): names confined
    (no absolute path, no ..), regular files, directories and symlinks only, modes without
    set-id bits. The archive is the sandbox's to forge (its own `tar` made it), so each
    entry is made through directories opened one by one with O_NOFOLLOW (_open_parent):
    none goes through a symlink, one this archive made included. Symlinks are kept where
    they lead inside `dest` (all made, then resolved); the others are removed and refused."""
    if dest.exists() or dest.is_symlink():
        raise FileExistsError(17, "File exists", str(dest))
    dest.parent.mkdir(parents=True, exist_ok=True)
    links: list[tuple[str, str, Path]] = []  # entry, link target, where it is made
    import tarfile

    base = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
            top = {m.name.split("/", 1)[0] for m in members}
            for m in members:
                parts = PurePosixPath(m.name).parts
                if not parts or PurePosixPath(m.name).is_absolute() or ".." in parts or len(top) != 1:
                    raise RunnerError(f"download: refusing the entry {m.name!r}")
                names = (dest.name, *parts[1:])  # the archive's top is dest
                parent = _open_parent(base, names[:-1], m.name)
                try:
                    _make_entry(tar, m, parent, names[-1])
                finally:
                    os.close(parent)
                if m.issym():
                    links.append((m.name, m.linkname, dest.joinpath(*parts[1:])))
    finally:
        os.close(base)
        outside = _drop_links_outside(dest, links)  # an entry refused midway leaves none either
    if outside:
        name, target, _ = outside[0]
        raise RunnerError(f"download: refusing the entry {name!r}: a symlink to {target!r}, which leads outside "
                          f"{dest}" + (f" (and {len(outside) - 1} more such symlinks)" if len(outside) > 1 else ""))


def _drop_links_outside(dest: Path, links: list[tuple[str, str, Path]]) -> list[tuple[str, str, Path]]:
    """Remove the symlinks made under `dest` that lead outside it; those links. Resolved
    once all are made: a later link can change where an earlier one leads."""
    inside = os.path.join(os.path.realpath(dest.parent), dest.name)  # dest itself may be one of the links
    outside = [(name, target, path) for name, target, path in links
               if os.path.commonpath([inside, os.path.realpath(path)]) != inside]
    for _, _, path in outside:
        os.unlink(path)  # its parents are directories this download made (_open_parent)
    return outside


def _open_parent(base: int, names: tuple[str, ...], entry: str) -> int:
    """The directory `names` below `base`, made where missing, each opened with O_NOFOLLOW:
    a symlink (or file) on the way refuses `entry`."""
    fd = os.dup(base)
    for i, name in enumerate(names):
        try:
            below = _made_dir(name, fd, 0o755)
        except OSError:
            through = "/".join(PurePosixPath(entry).parts[:i + 1])
            raise RunnerError(f"download: refusing the entry {entry!r}: it would go through {through!r}, which "
                              "is not a directory (a symlink?)") from None
        finally:
            os.close(fd)
        fd = below
    return fd


def _made_dir(name: str, parent: int, mode: int) -> int:
    """The directory `name` in `parent`, made where missing, open; OSError where `name` is
    something else (a symlink is never followed)."""
    try:
        os.mkdir(name, mode, dir_fd=parent)
    except FileExistsError:
        pass
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)


def _make_entry(tar: tarfile.TarFile, m: tarfile.TarInfo, parent: int, name: str) -> None:
    """One entry of _untar_confined, as `name` in the directory `parent`."""
    if m.isdir():
        try:
            fd = _made_dir(name, parent, 0o700)
        except OSError:
            raise RunnerError(f"download: refusing the entry {m.name!r}: a file or symlink of that name came "
                              "before it") from None
        try:
            os.fchmod(fd, m.mode & 0o777 | stat.S_IRWXU)
        finally:
            os.close(fd)
        return
    try:
        if m.isfile():
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=parent)
            with open(fd, "wb") as f, tar.extractfile(m) as src:
                f.write(src.read())
                os.fchmod(f.fileno(), m.mode & 0o777)
        elif m.issym():
            os.symlink(m.linkname, name, dir_fd=parent)
        else:
            raise RunnerError(f"download: {m.name!r} is not a file, directory or symlink")
    except FileExistsError:
        raise RunnerError(f"download: refusing the entry {m.name!r}: an entry of that name came before it") from None
