"""The per-user holder process: it keeps layers mounted, and starts the inits
(runtime/native/init.c) that give each run a fresh writable root over them.
The sessions talking to it are runtime._HolderSession.

Why it is built this way (figures from one of these 2-core VMs):

- Mounting is the expensive part (a squashfuse daemon per layer rootless, a
  loop device as root), so each layer file is mounted once by a holder process
  and shared by every session using it. A read-only overlay per layer stack
  (inst:env) stays mounted too, with a warm dentry cache: a run's own overlay
  finds every path in one warm layer instead of asking each layer (FUSE) again.
- The holder is pid 1 of its own pid namespace and mounts only in its own mount
  namespace (a slave of the host's, so later host mounts still show). When it
  exits or is killed, even with SIGKILL, the kernel kills its FUSE daemons and
  runs and drops every mount with the namespace: nothing is ever mounted in the
  host's namespace, so nothing can go stale there.
- A run's root needs a new process (pid 1 of a new pid namespace, a new mount
  namespace for its overlay). The holder starts each run's init ahead of time, at
  a session's request, and hands the session the init's control socket: the init
  builds the root (tmpfs upper + overlay, /proc, /dev, pivot_root) and drops
  privileges while the session is busy elsewhere; a run then sends its job to a
  ready init, which posix_spawns the command, waits and answers. The holder is not
  on a run's path. Being pid 1, the init kills every other process of the run when
  the command ends.
- The init is a small static C program started with posix_spawn, not a fork of
  this Python process: a fork cost about 3.7 ms of CPU per root (copy-on-write
  faults on the interpreter's heap and its teardown), the C init 0.1 ms to start.
  Setting up and tearing down a root (a dozen mounts, namespaces) still costs about
  as much CPU as bwrap's; each init serves one run all the same (init.c says why a
  root served twice told a run about the one before).
- This module stays lean (no dataclasses, pathlib, json, hashlib): the holder
  boots on a cold start; those imports cost 30+ ms. It takes the C modules
  _socket and _signal, not socket.py and signal.py (they import enum, functools,
  collections and selectors), and packs descriptors with struct, not array (its
  import loads collections.abc): the holder's start, 22.5-24 ms -> 18.3-20.3 ms
  (spawned to ready, medians of 20, three A/B rounds).
- Each init drops into a nested user namespace mapping just root: the run can
  mount, unmount or remount nothing (the layers and /proc masks stay put), real
  root (kernel backend) keeps no capability on the host, and rootless RLIMIT_NPROC
  counts only the run's own processes (the kernel counts per user namespace; host
  root it never counts: there a pids cgroup per run does it).

Protocol (SOCK_SEQPACKET; descriptors passed with SCM_RIGHTS). Session and holder
speak marshal (the same interpreter at both ends: the socket name says which):
  session -> holder  {"op": "open", "layers": [(path, offset, size)...], "binds": [(src, dest, ro)...],
                      (size -1: path is a directory, bound read-only)
                      "linger": s, "scratch_mb": n,        answer {"spec": {...}} or {"error": text}
                      "layers_at": path or None}           (the layer stack itself bound there, read-only)
  session -> holder  {"op": "init", "network": b}          answer {"network": b} + the init's control socket
                     (with "keep": s, a sandbox's init: its root kept, s seconds idle at most)
Sandboxes that outlive their command (runtime/sandbox.py; the holder keeps a copy of
each kept init's control socket, closed with its session unless parked):
  session -> holder  {"op": "park", "info": {...}}          answer {"id": ID}: the session's kept init
                     and its layers stay after the session closes, until stopped or idle
  client -> holder   {"op": "attach", "id": ID}             answer {"info": {...}} + the control socket
                     (the sandbox is "busy" while this connection lasts)
  client -> holder   {"op": "stop", "id": ID} / {"op": "list"}   answer {} / {"sandboxes": [...]}
Session and init:
  session -> init    encode_job(job) (format in init.c) + stdin, stdout, stderr (a sandbox's: and
                     the socket its answer goes to; a big job: job_message(): its size + a memfd
                     holding it)
  init -> session    marshal {"exit_code", "signal", "timed_out", "peak_memory_kb", "out_of_memory",
                     "start_errno"} or {"error"}; then the init ends with its root (a sandbox's
                     jobs run side by side, each answered on its own socket)
"""

from __future__ import annotations

import _signal as signal
import _socket as socket
import errno
import fcntl
import marshal
import os
import select
import stat
import struct
import sys
import time

from .cgroups import Cgroups, locate_cgroups
from .mounts import (CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER, INIT_MISSING, MS_NODEV, MS_NOSUID,
                     MS_RDONLY, MS_REC, MS_SLAVE, PR_SET_PDEATHSIG, RootSpec, RunnerError, bind_readonly, dev_template,
                     fuse_mount, hold_tree, init_program, loop_mount, map_root, mount, prctl,
                     setns, umount, unshare)
from .statedir import peer

__all__ = ["DEFAULT_MAX_PROCESSES", "IDLE_INIT", "encode_job", "holder_main", "job_message", "memfd_with",
           "recv_fds", "run_joined", "send_fds"]

# --- messages ------------------------------------------------------------------------------

MAX_MESSAGE = 1 << 16
INLINE_JOB = 60_000  # bytes of a job sent in its message; a bigger one goes in a memfd


def memfd_with(data: bytes) -> int:
    """A memfd holding `data`, read from its start: a big job, a command's stdin (a
    regular file, as judges give it: os.fstat(0).st_size works)."""
    fd = os.memfd_create("data", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def send_fds(sock: socket.socket, msg: dict | bytes, fds: list[int] = ()) -> None:
    """Send one message (a dict, or one already marshalled) with descriptors."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
    sock.sendmsg([msg if isinstance(msg, bytes) else marshal.dumps(msg)], anc)


def recv_fds(sock: socket.socket, maxfds: int = 8, flags: int = 0) -> tuple[dict | None, list[int]]:
    """One message (None at EOF) and its descriptors, received close-on-exec
    (socket.recv_fds is not: a descriptor leaking into a process forked meanwhile
    would hold a pipe open)."""
    data, anc, mflags, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(maxfds * 4), socket.MSG_CMSG_CLOEXEC | flags)
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) - len(payload) % 4])
    if mflags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise OSError(errno.EMSGSIZE, "message too long")
    return (marshal.loads(data) if data else None), fds


# --- the inits (native/init.c) -----------------------------------------------------------------

DEFAULT_MAX_PROCESSES = 1024
IDLE_INIT = 60.0  # seconds a ready init waits for its job before it leaves
_JOB_HEADER = struct.Struct("<4sIIIqqqqqq")
# In the holder's socket name (holder_session.holder_name): a holder of an older image_builder,
# still lingering after an upgrade, is not handed jobs in a format its inits do not read.
PROTOCOL = "IBJ6"
MAKE_WORKDIR = 1  # a job's flag: make its workdir where the instance lacks it (init.c)
ZYGOTE = 2  # a job's flag: the command is a warm interpreter (init.c pid_keeper)


def encode_job(job: dict) -> bytes:
    """A job (runtime.build_job) as image-builder-init reads it (the format is in init.c)."""
    parts = [_JOB_HEADER.pack(PROTOCOL.encode(), len(job["argv"]), len(job["env"]), len(job["files"]),
                              -1 if job["timeout"] is None else int(job["timeout"] * 1e6), job["memory_mb"] or 0,
                              job["max_processes"], job.get("uid", -1), job.get("gid", -1),
                              (MAKE_WORKDIR if job.get("make_workdir") else 0) | (ZYGOTE if job.get("zygote") else 0))]
    for text in (job["workdir"], *job["argv"], *(f"{k}={v}" for k, v in job["env"].items()), *job["files"]):
        if "\0" in text:
            raise RunnerError(f"{text[:40]!r}: a NUL character cannot be passed to a command")
    parts += [os.fsencode(text) + b"\0" for text in (job["workdir"], *job["argv"])]
    parts += [os.fsencode(f"{k}={v}") + b"\0" for k, v in job["env"].items()]
    for path, data in job["files"].items():
        parts += [os.fsencode(path) + b"\0", struct.pack("<Q", len(data)), bytes(data)]
    return b"".join(parts)


def job_message(job: bytes) -> tuple[bytes, list[int]]:
    """The message carrying an encoded job, and the descriptors to send after the
    command's stdio (the caller closes them): the job itself, or for a big one its size
    and a memfd holding it."""
    if len(job) <= INLINE_JOB:
        return job, []
    return b"IBJP" + struct.pack("<Q", len(job)), [memfd_with(job)]


def spawn_init(program: str, spec: RootSpec, mode: str, ctl: int, idle: float = IDLE_INIT) -> int:
    """Start image-builder-init for `spec` with `ctl` as its descriptor 3 (and the network
    namespace to join as 4): "session" takes jobs there ("sandbox": keeping its root, for
    `idle` seconds between jobs), "joined" one job, run on this
    process's stdin, stdout and stderr. posix_spawn (vfork): nothing of this process is
    copied. In a new pid namespace when the caller has unshared one."""
    netns = spec.netns
    argv = [program, mode, spec.base, spec.lower, str(int(spec.userxattr)), str(int(spec.network)),
            str(spec.scratch_mb or ""), spec.upper or "", spec.cgroup or "", "-1" if netns is None else "4",
            spec.console or "", str(max(1, int(idle)))]
    for src, dest, readonly in spec.binds:
        argv += [src, dest, str(int(readonly))]
    # Not a session of its own yet: the init makes it as its job comes (init.c first_job says why).
    return spawn_with(program, argv, (ctl, *(() if netns is None else (netns,))))


def spawn_with(program: str, argv: list[str], fds: tuple[int, ...]) -> int:
    """posix_spawn `program` with `fds` as its descriptors 3, 4, ...; the pid."""
    # Above them first: dup2 onto 3 and 4 must not overwrite one of them before it is copied.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in fds]
    try:
        return os.posix_spawn(program, argv, {}, file_actions=[(os.POSIX_SPAWN_DUP2, fd, 3 + i)
                                                                 for i, fd in enumerate(high)])
    finally:
        for fd in high:
            os.close(fd)


# --- the holder -----------------------------------------------------------------------------------

_LAYER_PREFIX = "image-builder-layer-"  # a sandbox's writable layer on disk (Holder._disk_layer)
_LAYER_LOCK = ".held"  # in a rootless one: locked by its holder while it lives


def _remove_tree(path: str) -> None:
    """store.remove_tree (it removes what overlayfs leaves at mode 000), loaded on first use:
    the holder starts without it."""
    from pathlib import Path

    from image_builder.store.store import remove_tree
    remove_tree(Path(path))


def _layer_file(directory: str) -> int:
    """A new, empty file for a sandbox's layer on disk under `directory`, open read-write,
    that no path leads to: made with O_EXCL|O_NOFOLLOW in a directory of its own (mode
    700), then unlinked with it at once. Another user who can write in `directory` (the
    client refuses such a one: sandbox.py) could otherwise swap a path there for a link
    to any file between its making and its use, and have that file formatted."""
    import tempfile

    private = tempfile.mkdtemp(prefix=_LAYER_PREFIX, dir=directory)
    try:
        dfd = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(dfd)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
                raise RunnerError(f"layer dir {directory}: {private} was swapped for another directory; give a "
                                  "directory no other user can write to")
            fd = os.open("layer", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
            os.unlink("layer", dir_fd=dfd)
        finally:
            os.close(dfd)
    finally:
        try:
            os.rmdir(private)
        except OSError:
            pass  # moved or replaced meanwhile (by a user who can write in `directory`): left as it is
    return fd


_STARTUP_GRACE = 10.0  # seconds a new holder waits for its first client
# Ready inits kept for sessions to come, over all the layer stacks: a trainer touching
# thousands of instances must not leave one idle init (its namespaces, mounts and
# tmpfs) per instance for IDLE_INIT seconds. The oldest goes first.
MAX_SPARES = 16
_NETNS_BATCH = 4


class _Mounted:
    """A mount the holder keeps while referenced, and `linger` seconds after."""

    __slots__ = ("path", "parts", "refs", "idle_since", "linger", "hold")

    def __init__(self, path: str, parts: tuple[_Mounted, ...] = (), hold: int = -1):
        self.path = path  # relative to the holder's base directory
        self.parts = parts  # the layers under a stack's overlay
        self.hold = hold  # an unpacked tree's shared flock (extract.hold_tree), while it is mounted
        self.refs = 0
        self.idle_since = 0.0
        self.linger = 0.0


class _Init:
    __slots__ = ("cgroup", "netns", "layer")

    def __init__(self, cgroup: str | None, netns: int | None, layer: str | None = None):
        self.cgroup = cgroup
        self.netns = netns
        self.layer = layer  # a sandbox's writable layer on disk (_disk_layer), removed when the init ends


class _Session:
    __slots__ = ("stack", "spec", "linger", "kept")

    def __init__(self, stack: _Mounted, spec: dict, linger: float):
        self.stack = stack
        self.spec = spec  # RootSpec fields but network, cgroup and netns
        self.linger = linger
        self.kept: list[tuple[int, socket.socket]] = []  # sandbox inits made for it: (pid, control socket)


class _Parked:
    """A sandbox kept past its session (op "park"), for any of this user's clients to attach to."""

    __slots__ = ("stack", "linger", "pid", "ctl", "info", "made")

    def __init__(self, stack: _Mounted, linger: float, pid: int, ctl: socket.socket, info: dict):
        self.stack, self.linger, self.pid, self.ctl, self.info = stack, linger, pid, ctl, info
        self.made = time.time()


class Holder:
    """Mounts layers for sessions and starts inits for them (see the module docstring)."""

    def __init__(self, kernel: bool, base: str, cgroups: Cgroups | None, init_program: str):
        self.kernel = kernel
        self.base = base
        self.init_program = init_program
        self.cgroups = cgroups
        self.layers: dict[tuple, _Mounted] = {}
        self.stacks: dict[tuple, _Mounted] = {}
        self.sessions: dict[socket.socket, _Session] = {}
        self.inits: dict[int, _Init] = {}
        self.parked: dict[str, _Parked] = {}
        self.attached: dict[socket.socket, str] = {}  # a client's connection -> the sandbox it uses
        # A ready init (made when, its control socket) per lingering session spec: a fresh
        # process's session (`image-builder run`, once per command) starts on it instead of
        # waiting 10-20 ms for one to be started and set up (joining a cgroup waits for RCU).
        self.spares: dict[tuple, tuple[float, socket.socket]] = {}
        self.free_netns: list[int] = []
        self.counter = 0
        self.layer_locks: dict[str, int] = {}  # rootless sandbox layers on disk -> the lock held in each
        self.pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.poller = select.poll()
        self.conns: dict[int, socket.socket] = {}

    # -- mounts --

    def _dir(self, kind: str) -> str:
        self.counter += 1
        path = f"{kind}/{self.counter}"
        os.mkdir(path)
        return path

    def _layer(self, path: str, offset: int, size: int) -> _Mounted:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, offset)
        layer = self.layers.get(key)
        if layer is None:
            target = self._dir("l")
            hold = -1
            try:
                if size < 0:  # a directory: an environment unpacked ahead (runtime's unpack_dir)
                    hold = hold_tree(path)
                    bind_readonly(path, target)
                elif self.kernel:
                    loop_mount(path, offset, size, target)
                else:
                    fuse_mount(path, offset, target)
            except OSError:
                os.rmdir(target)
                if hold >= 0:
                    os.close(hold)
                raise
            layer = self.layers[key] = _Mounted(target, hold=hold)
        return layer

    def _stack(self, layers: list[_Mounted]) -> _Mounted:
        key = tuple(x.path for x in layers)
        stack = self.stacks.get(key)
        if stack is None:
            target = self._dir("o")
            # A read-only overlay lists the top layer first; one layer needs an empty second.
            lower = ":".join(x.path for x in reversed(layers)) + (":e" if len(layers) == 1 else "")
            # xino: each layer's inode numbers are its own (every squashfs counts from 1), and the run's overlay
            # above this one sees one lower file system, so without the layer's number in the high bits two
            # files of two layers share (st_dev, st_ino): glibc's dlopen took h5py's h5.so for
            # charset_normalizer's md.so (same pair: "does not define PyInit_md"), and so would tar or cp
            # taking them for hard links. A kernel that refuses the option mounts without it.
            options = f"lowerdir={lower}" + ("" if self.kernel else ",userxattr")
            try:
                try:
                    mount("layers", target, "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV, options + ",xino=on")
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    mount("layers", target, "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV, options)
            except OSError:
                os.rmdir(target)
                raise
            stack = self.stacks[key] = _Mounted(target, tuple(layers))
            for x in layers:
                x.refs += 1
        return stack

    @staticmethod
    def _release(m: _Mounted, linger: float) -> None:
        m.refs -= 1
        if m.refs == 0:
            m.idle_since, m.linger = time.monotonic(), linger

    def _sweep(self) -> float | None:
        """Unmount what has been idle for its linger time; seconds until the next is due."""
        due = None
        for table in (self.stacks, self.layers):  # stacks first: they hold layers
            for key, m in list(table.items()):
                left = m.idle_since + m.linger - time.monotonic()
                if m.refs:
                    continue
                if left > 0:
                    due = left if due is None else min(due, left)
                    continue
                for spec_key in [k for k in self.spares if k[0] == m.path]:
                    self.spares.pop(spec_key)[1].close()  # EOF: the init leaves
                umount(m.path)
                os.rmdir(m.path)
                if m.hold >= 0:
                    os.close(m.hold)
                del table[key]
                for part in m.parts:
                    self._release(part, m.linger)
        if self.cgroups and self.cgroups.trash:
            self.cgroups.remove()
            due = 1.0 if due is None else min(due, 1.0)
        return due

    # -- sessions and inits --

    def _open(self, conn: socket.socket, msg: dict) -> None:
        layers = [self._layer(*x) for x in msg["layers"]]
        stack = self._stack(layers)
        stack.refs += 1
        binds = tuple(tuple(b) for b in msg["binds"])
        if msg.get("layers_at"):  # the layers themselves, read-only, for a warm interpreter's runs (zygote.py)
            binds += ((os.path.join(self.base, stack.path), msg["layers_at"], True),)
        spec = {"base": self.base, "lower": stack.path, "userxattr": not self.kernel,
                "binds": binds, "scratch_mb": msg["scratch_mb"]}
        self.sessions[conn] = _Session(stack, spec, msg["linger"])
        send_fds(conn, {"spec": spec})

    def _fill_netns(self) -> None:
        """Isolated network namespaces with lo up, for the next inits, made ahead of need
        (about 2.5 ms of CPU each here, and more to tear down) by an init in its netns mode
        (native/init.c make_netns: a process that leaves a namespace without privileges over
        the host's cannot come back). Each serves one init only. Where none can be made, inits
        make their own (and say why not)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = spawn_with(self.init_program, [self.init_program, "netns", str(_NETNS_BATCH)], (child.fileno(),))
        finally:
            child.close()
        try:
            while len(self.free_netns) < _NETNS_BATCH:
                _, fds = recv_fds(parent, 1)
                if not fds:
                    break
                self.free_netns.extend(fds)
        finally:
            parent.close()
            os.waitpid(pid, 0)

    @staticmethod
    def _spare_key(sess: _Session) -> tuple:
        return sess.spec["lower"], sess.spec["binds"], sess.spec["scratch_mb"]

    def _start_init(self, sess: _Session, network: bool, keep: float | None = None,
                    layer: tuple[str, int] | None = None) -> socket.socket:
        """A new init for `sess` (`keep`: a sandbox's, idle that long at most, recorded in
        sess.kept; `layer`: its writable layer on disk, (directory, MB)); returns the
        session's end of its control socket."""
        upper = self._disk_layer(*layer) if layer else None
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cgroup = self.cgroups.new() if self.cgroups else None
        # With none in the pool (a new holder), the init makes its own rather than wait for a batch.
        netns = self.free_netns.pop() if not network and self.free_netns else None
        spec = RootSpec(network=network, cgroup=cgroup, netns=netns, upper=upper, **sess.spec)
        try:
            unshare(CLONE_NEWPID)  # for the next child only: undone right after
            try:
                pid = spawn_init(self.init_program, spec, "session" if keep is None else "sandbox", child.fileno(),
                                 IDLE_INIT if keep is None else keep)
            finally:
                setns(self.pidns, CLONE_NEWPID)
        except OSError:
            parent.close()
            if cgroup:
                self.cgroups.release(cgroup)
            if netns is not None:
                self.free_netns.append(netns)
            if upper:
                self._drop_layer(upper)
            raise
        finally:
            child.close()
        self.inits[pid] = _Init(cgroup, netns, upper)
        if keep is not None:
            sess.kept.append((pid, socket.socket(fileno=socket.dup(parent.fileno()))))
        return parent

    def _disk_layer(self, directory: str, size_mb: int) -> str:
        """A sandbox's writable layer on node-local disk under `directory`, for the init's
        kept-layer path: an ext4 of `size_mb` as root (_ext4_layer), a directory rootless
        (_rootless_layer: uncapped, a loop device needs root). Sandbox checked `directory`: an
        absolute path, only root or this user can write to it and its parents."""
        return self._ext4_layer(directory, size_mb) if self.kernel else self._rootless_layer(directory)

    def _ext4_layer(self, directory: str, size_mb: int) -> str:
        """An ext4 of `size_mb` on a loop device, so the layer cannot outgrow it (ENOSPC); its
        file has no name once made (_layer_file), so the space goes back when the last mount
        of it does, however the sandbox ends. mkfs.ext4 without a journal (scratch data): 10 ms
        and 1.2 MB written for 2 GB, 12 ms and 4.4 MB for 20 GB."""
        import shutil  # here: not on the holder's start-up path
        import subprocess

        target = self._dir("d")
        fd = -1
        try:
            fd = _layer_file(directory)
            os.ftruncate(fd, size_mb << 20)  # sparse: blocks are taken as the layer is written
            mkfs = shutil.which("mkfs.ext4", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
            if mkfs is None:
                raise RunnerError("mkfs.ext4 not found (Debian: e2fsprogs): a sandbox's layer on disk needs it")
            # The descriptor, never a path: a path in the layer dir could be swapped for a link.
            made = subprocess.run([mkfs, "-q", "-F", "-O", "^has_journal", "-m", "0", "-E",
                                   "lazy_itable_init=1,nodiscard", f"/proc/self/fd/{fd}"], pass_fds=(fd,),
                                  capture_output=True, text=True)
            if made.returncode != 0:
                raise RunnerError(f"mkfs.ext4 of a layer in {directory}: {made.stderr.strip()[-300:]}")
            loop_mount(fd, 0, 0, target, fstype="ext4", writable=True)
        except BaseException:
            os.rmdir(target)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        return target

    def _rootless_layer(self, directory: str) -> str:
        """A directory in `directory`, removed when the init ends. The holder keeps a lock in
        it (_LAYER_LOCK) while it lives, so the ones a killed holder left (a Slurm job's end)
        are removed by the next sandbox made there (_sweep_layers)."""
        import tempfile

        self._sweep_layers(directory)
        # Made under a name the sweep passes over, locked, then given its own: never swept half-made.
        new = f".{_LAYER_PREFIX}new-"
        making = tempfile.mkdtemp(prefix=new, dir=directory)
        lock = os.open(os.path.join(making, _LAYER_LOCK), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                       os.O_CLOEXEC, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = os.path.join(directory, _LAYER_PREFIX + os.path.basename(making)[len(new):])
        os.rename(making, path)
        self.layer_locks[path] = lock
        return path

    def _drop_layer(self, upper: str) -> None:
        if self.kernel:
            umount(upper)  # the loop device (AUTOCLEAR) and its file go with the last mount of it
            os.rmdir(upper)
        else:
            try:
                _remove_tree(upper)
            finally:
                os.close(self.layer_locks.pop(upper))

    @staticmethod
    def _sweep_layers(directory: str) -> None:
        """Remove the rootless layers in `directory` whose holder is gone (their lock is free)."""
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
                if not name.startswith(_LAYER_PREFIX) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                    continue  # not a layer, or another user's (in a shared /tmp)
                lock = os.open(os.path.join(path, _LAYER_LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # gone meanwhile, or not one of ours
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(lock)
                continue  # its holder lives
            try:
                _remove_tree(path)
            except OSError:
                pass  # the next sweep tries again
            finally:
                os.close(lock)

    def _reap(self) -> None:
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            init = self.inits.pop(pid, None)
            if init is None:
                continue  # a FUSE daemon that ended with its mount
            for sid in [sid for sid, p in self.parked.items() if p.pid == pid]:  # idle, or killed
                self._unpark(sid, ended=True)
            if self.cgroups and init.cgroup:
                self.cgroups.release(init.cgroup)
            if init.netns is not None:  # never another run's: what its sockets left outlives them
                os.close(init.netns)
            if init.layer:
                try:
                    self._drop_layer(init.layer)
                except OSError as e:
                    print(f"image-builder holder: cannot remove the sandbox layer {init.layer}: {e}", file=sys.stderr)

    # -- sandboxes kept past their session --

    def _park(self, conn: socket.socket, sess: _Session, msg: dict) -> None:
        if not sess.kept:
            raise ValueError("park: this session has no sandbox")
        pid, ctl = sess.kept.pop()
        sid = os.urandom(6).hex()
        sess.stack.refs += 1  # the parked sandbox's own hold on the layers
        self.parked[sid] = _Parked(sess.stack, sess.linger, pid, ctl, dict(msg.get("info") or {}))
        send_fds(conn, {"id": sid})

    def _sandbox_op(self, conn: socket.socket, msg: dict) -> None:
        op = msg["op"]
        if op == "list":
            busy = set(self.attached.values())
            send_fds(conn, {"sandboxes": [{"id": sid, "info": p.info, "made": p.made, "busy": sid in busy}
                                          for sid, p in self.parked.items()]})
            return
        sid = str(msg.get("id"))
        p = self.parked.get(sid)
        if p is None:
            raise ValueError(f"no sandbox {sid} (stopped, or idle past its timeout); `image-builder sandbox ls`")
        if op == "stop":
            self._unpark(sid)
            send_fds(conn, {})
            return
        # Its commands go straight to its init, each answered on a socket of its own (init.c),
        # so clients need not take turns; this connection only says the sandbox is in use.
        self.attached[conn] = sid
        send_fds(conn, {"info": p.info}, [p.ctl.fileno()])

    def _unpark(self, sid: str, ended: bool = False) -> None:
        """Stop a parked sandbox (`ended`: its init is already reaped; its pid may be another's now)."""
        p = self.parked.pop(sid)
        if not ended:
            os.kill(p.pid, signal.SIGKILL)  # pid 1 of its namespace: every process of the sandbox goes
        p.ctl.close()
        self._release(p.stack, p.linger)

    # -- the loop --

    def _on_message(self, conn: socket.socket) -> None:
        try:
            msg, fds = recv_fds(conn)
        except (OSError, ValueError, EOFError):
            msg, fds = None, []
        for fd in fds:  # sessions send none
            os.close(fd)
        sess = self.sessions.get(conn)
        try:
            if msg is None:
                raise EOFError
            if sess is None and msg.get("op") == "open":
                self._open(conn, msg)
            elif sess is not None and msg.get("op") == "park":
                self._park(conn, sess, msg)
            elif sess is None and msg.get("op") in ("attach", "stop", "list"):
                self._sandbox_op(conn, msg)
            elif sess is not None and msg.get("op") == "init":
                network, keep, layer = bool(msg["network"]), msg.get("keep"), msg.get("layer")
                keep = None if keep is None else float(keep)
                layer = None if layer is None or keep is None else (str(layer[0]), int(layer[1]))
                made, ctl = self.spares.pop(self._spare_key(sess), (0.0, None)) if not network and keep is None \
                    else (0.0, None)
                if ctl is not None and time.monotonic() - made > IDLE_INIT / 2:  # it leaves soon
                    ctl.close()
                    ctl = None
                try:
                    ctl = ctl or self._start_init(sess, network, keep, layer)
                except (OSError, RunnerError) as e:  # answered in order, like the others
                    send_fds(conn, {"network": network, "error": str(e)})
                    return
                try:
                    send_fds(conn, {"network": network}, [ctl.fileno()])
                finally:
                    ctl.close()
                if not self.free_netns:  # after the answer: the session is not kept waiting
                    self._fill_netns()
            else:
                raise ValueError(f"unexpected message {str(msg)[:80]}")
            return
        except (OSError, RunnerError, ValueError, KeyError, TypeError) as e:
            try:
                send_fds(conn, {"error": str(e)})
            except OSError:
                pass
        except EOFError:
            pass
        self.attached.pop(conn, None)
        if sess is not None:  # a session ends with its connection
            del self.sessions[conn]
            for _pid, ctl in sess.kept:  # its sandboxes end with it (the init sees EOF once the client's copy goes)
                ctl.close()
            self._release(sess.stack, sess.linger)
            if sess.linger and self._spare_key(sess) not in self.spares:
                while len(self.spares) >= MAX_SPARES:  # dicts keep insertion order: the oldest first
                    self.spares.pop(next(iter(self.spares)))[1].close()
                try:
                    self.spares[self._spare_key(sess)] = (time.monotonic(), self._start_init(sess, False))
                except (OSError, RunnerError):
                    pass  # the next session starts its own
        self.poller.unregister(conn)
        del self.conns[conn.fileno()]
        conn.close()

    def _accept(self) -> None:
        conn = socket.socket(fileno=self.listener._accept()[0])
        uid = peer(conn)[1]
        if uid != os.getuid():
            conn.close()
            return
        self.conns[conn.fileno()] = conn
        self.poller.register(conn, select.POLLIN)

    def serve(self) -> None:
        """Until nothing is held: no connection, init or lingering mount."""
        self.poller.register(self.listener, select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)
        grace = time.monotonic() + _STARTUP_GRACE
        while True:
            due = self._sweep()
            if self.conns or self.inits or self.layers or self.stacks:
                grace = 0.0  # after the first client: leave as soon as idle
            else:
                left = grace - time.monotonic()
                if left <= 0:
                    if self.cgroups:
                        self.cgroups.close()
                    return
                due = left if due is None else min(due, left)
            for fd, _ in self.poller.poll(None if due is None else int(due * 1000) + 1):
                if fd == self.listener.fileno():
                    self._accept()
                elif fd == self.wake_r:
                    try:
                        while os.read(self.wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    self._reap()
                elif fd in self.conns:
                    self._on_message(self.conns[fd])


def holder_main(argv: list[str]) -> None:
    """`holder_main(["kernel"|"userns", STATE_DIR, SOCKET_NAME])`: become the holder. The
    first line on stdout is "ready", "busy" (another holder has the name) or "error: ..."."""
    kernel, state_dir, name = argv[0] == "kernel", argv[1], b"\0" + argv[2].encode()
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_RDWR), 1)
    try:
        program = init_program()
        if program is None:
            raise RunnerError(INIT_MISSING)
        found = locate_cgroups()
        if kernel:
            unshare(CLONE_NEWNS)
        else:
            uid, gid = os.getuid(), os.getgid()
            unshare(CLONE_NEWUSER | CLONE_NEWNS)
            map_root(uid, gid)
        mount(None, "/", None, MS_REC | MS_SLAVE)
        unshare(CLONE_NEWPID)
        if os.fork():
            os._exit(0)  # the holder is the child: pid 1 of the new pid namespace
        base = os.path.join(state_dir, "mnt")
        os.makedirs(base, exist_ok=True)
        mount("image-builder", base, "tmpfs", MS_NOSUID | MS_NODEV, "mode=700")
        os.chdir(base)
        for d in ("l", "o", "s", "e", "d", "dev"):
            os.mkdir(d)
        dev_template("dev")
        holder = Holder(kernel, base, None, program)
        try:
            holder.listener.bind(name)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            report.write("busy\n")
            return
        if found:  # only once the name is ours: a holder that loses the race touches nothing
            try:
                holder.cgroups = Cgroups(*found)
            except OSError as e:
                print(f"image-builder holder: no cgroups ({e}); rlimits only", file=sys.stderr)
        holder.listener.listen(128)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(holder.wake_w)
    except (OSError, RunnerError) as e:
        report.write(f"error: {e}\n")
        return
    report.write("ready\n")
    report.close()
    holder.serve()


# --- an interactive command in the caller's session (client side) ----------------------------------


def run_joined(holder_pid: int, kernel: bool, spec: RootSpec, job: dict) -> int:
    """Run `job` as a child of this process in the holder's namespaces, on this process's
    stdin/stdout/stderr: a shell keeps the caller's terminal as its controlling terminal
    (same session), so job control and Ctrl-C work as usual. Returns the exit status
    (128 + N for signal N)."""
    program = init_program()
    if program is None:
        raise RunnerError(INIT_MISSING)
    names = ("mnt",) if kernel else ("user", "mnt")  # the user namespace first: it grants the rest
    ns = [os.open(f"/proc/{holder_pid}/ns/{n}", os.O_RDONLY | os.O_CLOEXEC) for n in names]
    job_bytes = encode_job(job)
    pid = os.fork()
    if pid == 0:
        code = 125
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            for fd in ns:
                setns(fd)
            unshare(CLONE_NEWPID)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            send_fds(ours, *job_message(job_bytes))
            init = spawn_init(program, spec, "joined", theirs.fileno())
            code = os.waitstatus_to_exitcode(os.waitpid(init, 0)[1])
            code = code if code >= 0 else 128 - code
        except BaseException as e:
            print(f"image-builder: cannot enter the instance: {e}", file=sys.stderr)
        finally:
            os._exit(code)
    for fd in ns:
        os.close(fd)
    # Like system(3): while the command has the terminal, its signals are not ours.
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGTTOU)}
    try:
        status = os.waitpid(pid, 0)[1]
        if os.isatty(0):  # an interactive shell left its own process group in the foreground
            try:
                os.tcsetpgrp(0, os.getpgrp())
            except OSError:
                pass
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return os.waitstatus_to_exitcode(status)
