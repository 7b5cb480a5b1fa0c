"""The mount side of the runtime: a per-user holder process keeps layers mounted,
and each run gets a fresh writable root over them.

Why it is built this way (figures from one of these 2-core VMs):

- Mounting is the expensive part (a squashfuse_ll daemon per layer rootless, a
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
  namespace for its overlay), and fork() of a Python process costs about 1 ms
  here with its exit. So the holder forks each run's init ahead of time, at a
  session's request, and hands the session the init's control socket: the init
  builds the root (tmpfs upper + overlay, /proc, /dev, pivot_root) and drops
  privileges while the session is busy elsewhere; a run then sends its job to a
  ready init, which posix_spawns the command (vfork: no second fork), waits and
  answers. The holder is not on a run's path. Being pid 1, the init takes every
  process of the run with it when it exits.
- This module stays lean (no dataclasses, pathlib, json, hashlib): the holder
  boots on a cold start and is forked per run; those imports cost 30+ ms and
  3 MB more to copy on every fork here.
- Each init drops into a nested user namespace mapping just root: the run can
  mount, unmount or remount nothing (the layers and /proc masks stay put), real
  root (kernel backend) keeps no capability on the host, and rootless RLIMIT_NPROC
  counts only the run's own processes (the kernel counts per user namespace; host
  root it never counts: there a pids cgroup per run does it).

Protocol (SOCK_SEQPACKET, marshal: both ends are the same interpreter, the
socket name says which; descriptors passed with SCM_RIGHTS):
  session -> holder  {"op": "open", "layers": [(path, offset, size)...], "binds": [(src, dest, ro)...],
                      "linger": s, "scratch_mb": n}        answer {"spec": {...}} or {"error": text}
  session -> holder  {"op": "init", "network": b}          answer {"network": b} + the init's control socket
  session -> init    {"argv", "env", "workdir", "files": {path: bytes}, "timeout", "memory_mb",
                      "max_processes"} + stdin, stdout, stderr (a big job: {"payload": n} + a memfd)
  init -> session    {"exit_code", "signal", "timed_out", "peak_memory_kb", "out_of_memory"} or {"error"}
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import gc
import marshal
import os
import resource
import select
import signal
import socket
import struct
import sys
import time

from .errors import ImageBuilderError

__all__ = ["RootSpec", "RunnerError", "holder_main", "recv_fds", "run_joined", "send_fds"]


class RunnerError(ImageBuilderError):
    """An instance cannot be mounted or a command cannot be started in it; the message
    says what failed and what to do."""


# --- libc -------------------------------------------------------------------------------

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 0x20, 0x400, 0x800, 0x1000, 0x4000
MS_SLAVE, MS_RELATIME = 1 << 19, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
# A read-only remount of a bind mount must repeat these; in a user namespace they are locked.
_KEEP_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
               (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.unshare.argtypes = (ctypes.c_int,)
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)
_libc.sethostname.argtypes = (ctypes.c_char_p, ctypes.c_size_t)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


def _ok(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _ok(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {fstype or source} on {target}")


def umount(target: str) -> None:
    _ok(_libc.umount2(_b(target), MNT_DETACH), f"umount {target}")


def unshare(flags: int) -> None:
    _ok(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int = 0) -> None:
    _ok(_libc.setns(fd, nstype), "setns")


def pivot_root(new_root: str, put_old: str) -> None:
    nr = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError(errno.ENOSYS, f"pivot_root: no syscall number known for {os.uname().machine}")
    _ok(_libc.syscall(nr, _b(new_root), _b(put_old)), "pivot_root")


def _prctl(option: int, value: int) -> None:
    _ok(_libc.prctl(option, value, 0, 0, 0), f"prctl({option})")


def _write(path: str, text: str, dir_fd: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read(path: str, dir_fd: int | None = None) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return ""
    try:
        return os.read(fd, 65536).decode()
    except OSError:
        return ""
    finally:
        os.close(fd)


def map_root(uid: int, gid: int) -> None:
    """After unshare(CLONE_NEWUSER): root inside is uid/gid outside. One id each is
    what an unprivileged process may map for itself (setgroups must be denied first)."""
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")


def _bind_readonly(source: str, target: str) -> None:
    mount(source, target, None, MS_BIND | MS_REC)
    keep = sum(ms for st, ms in _KEEP_FLAGS if os.statvfs(target).f_flag & st)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def _loopback_up() -> None:
    """A new network namespace has only lo, and it is down; tests still use 127.0.0.1."""
    siocsifflags, up_loopback_running = 0x8914, 0x1 | 0x8 | 0x40
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", up_loopback_running))


# --- messages ------------------------------------------------------------------------------

MAX_MESSAGE = 1 << 16
INLINE_JOB = 60_000  # bytes of a job sent in its message; a bigger one goes in a memfd


def send_fds(sock: socket.socket, msg: dict | bytes, fds: list[int] = ()) -> None:
    """Send one message (a dict, or one already marshalled) with descriptors."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([msg if isinstance(msg, bytes) else marshal.dumps(msg)], anc)


def recv_fds(sock: socket.socket, maxfds: int = 8, flags: int = 0) -> tuple[dict | None, list[int]]:
    """One message (None at EOF) and its descriptors, received close-on-exec
    (socket.recv_fds is not: a descriptor leaking into a process forked meanwhile
    would hold a pipe open)."""
    data, anc, mflags, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(maxfds * 4), socket.MSG_CMSG_CLOEXEC | flags)
    fds = array.array("i")
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if mflags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise OSError(errno.EMSGSIZE, "message too long")
    return (marshal.loads(data) if data else None), list(fds)


# --- layer mounts (holder side) ----------------------------------------------------------------

_LOOP_SET_FD, _LOOP_SET_STATUS64, _LOOP_CONFIGURE, _LOOP_CTL_GET_FREE = 0x4C00, 0x4C04, 0x4C0A, 0x4C82
_LO_FLAGS_READ_ONLY, _LO_FLAGS_AUTOCLEAR = 1, 4
_LOOP_INFO64 = struct.Struct("<QQQQQIIII64s64s32sQQ")  # struct loop_info64


def _loop_attach(fd: int, backing: int, info: bytes) -> None:
    """LOOP_CONFIGURE (5.8+) attaches in one step, 0.5 ms here; LOOP_SET_FD then
    LOOP_SET_STATUS64 took 20 ms (the second freezes the device and drops its cache)."""
    try:
        fcntl.ioctl(fd, _LOOP_CONFIGURE, struct.pack("<II", backing, 0) + info + bytes(64))
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTTY):
            raise
        fcntl.ioctl(fd, _LOOP_SET_FD, backing)
        fcntl.ioctl(fd, _LOOP_SET_STATUS64, info)


def _loop_mount(image: str, offset: int, size: int, target: str) -> None:
    """Mount the squashfs at `offset` of `image` read-only through a loop device (root).
    AUTOCLEAR frees the device when the mount goes (or at once, if mounting fails)."""
    info = _LOOP_INFO64.pack(0, 0, 0, offset, size, 0, 0, 0, _LO_FLAGS_READ_ONLY | _LO_FLAGS_AUTOCLEAR,
                             os.fsencode(image)[-63:], b"", b"", 0, 0)
    with open(image, "rb") as backing:  # opened read-only: the loop device is read-only
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(16):
                dev = f"/dev/loop{fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)}"
                fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    try:
                        _loop_attach(fd, backing.fileno(), info)
                    except OSError as e:
                        if e.errno == errno.EBUSY:  # taken by another process meanwhile
                            continue
                        raise
                    mount(dev, target, "squashfs", MS_RDONLY | MS_NOSUID | MS_NODEV)
                    return
                finally:
                    os.close(fd)
            raise OSError(errno.EBUSY, "no free loop device")
        finally:
            os.close(ctl)


def _fuse_mount(image: str, offset: int, target: str) -> None:
    """squashfuse_ll returns once the mount is up; its daemon is then reparented to the
    holder (pid 1 here) and dies with the holder's pid namespace."""
    import subprocess  # only the holder mounts

    cmd = ["squashfuse_ll", "-o", f"offset={offset}", image, target]
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=60)
    except FileNotFoundError:
        raise OSError(errno.ENOENT, "squashfuse_ll not found on PATH (install squashfuse)") from None
    if r.returncode:
        lines = r.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {r.returncode}"]
        raise OSError(errno.EIO, f"squashfuse_ll {image}: {lines[-1]}")


class _Mounted:
    """A mount the holder keeps while referenced, and `linger` seconds after."""

    __slots__ = ("path", "parts", "refs", "idle_since", "linger")

    def __init__(self, path: str, parts: tuple[_Mounted, ...] = ()):
        self.path = path  # relative to the holder's base directory
        self.parts = parts  # the layers under a stack's overlay
        self.refs = 0
        self.idle_since = 0.0
        self.linger = 0.0


# --- cgroups ---------------------------------------------------------------------------------------


def _own_cgroups() -> dict[str, str]:
    """controller ("" for v2) -> our cgroup path."""
    out = {}
    for line in _read("/proc/self/cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                out[controller] = parts[2]
    return out


def locate_cgroups() -> tuple[str, str] | None:
    """Where per-run cgroups can go, changing nothing: ("v2", dir), the nearest ancestor
    of our cgroup v2 that we own and that hands memory and pids to its children (e.g.
    systemd's user@UID.service); ("v1", dir) in the pids hierarchy as root on cgroup v1
    (RLIMIT_NPROC never limits host root, which the kernel backend's runs are); None:
    rlimits only."""
    own = _own_cgroups()
    fs = "/sys/fs/cgroup"
    v2fs = fs if os.path.exists(f"{fs}/cgroup.controllers") else f"{fs}/unified"
    if "" in own and os.path.exists(f"{v2fs}/cgroup.controllers"):
        cg = os.path.normpath(f"{v2fs}/{own['']}")
        while cg.startswith(v2fs):
            try:
                if (os.stat(cg).st_uid == os.getuid() and os.access(cg, os.W_OK)
                        and {"memory", "pids"} <= set(_read(f"{cg}/cgroup.subtree_control").split())):
                    return "v2", cg
            except OSError:
                break
            cg = os.path.dirname(cg)
    if os.geteuid() == 0 and "pids" in own and os.path.exists(f"{fs}/pids/cgroup.procs"):
        return "v1", os.path.normpath(f"{fs}/pids/{own['pids']}")
    return None


def _rmdir_cgroups(path: str) -> None:
    """Remove a cgroup tree left by a holder that was killed; busy cgroups stay."""
    for sub in sorted((e.path for e in os.scandir(path) if e.is_dir()), reverse=True):
        try:
            os.rmdir(sub)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


class _Cgroups:
    """image-builder-TOKEN/rN, one cgroup per run (joined by its init before the run is
    asked for: joining costs an RCU grace period), and on v2 holder/ for the holder."""

    def __init__(self, kind: str, parent: str):
        with os.scandir(parent) as entries:
            for stale in [e.path for e in entries if e.name.startswith("image-builder-") and e.is_dir()]:
                _rmdir_cgroups(stale)  # of killed holders: only empty cgroups go
        self.root = f"{parent}/image-builder-{os.urandom(4).hex()}"
        os.mkdir(self.root)
        if kind == "v2":  # no internal processes: the holder lives in a leaf, runs in its siblings
            os.mkdir(f"{self.root}/holder")
            _write(f"{self.root}/holder/cgroup.procs", "0")
            _write(f"{self.root}/cgroup.subtree_control", "+memory +pids")
        self.counter = 0
        self.trash: list[str] = []

    def new(self) -> str:
        self.counter += 1
        path = f"{self.root}/r{self.counter}"
        os.makedirs(path)  # v1: a holder starting meanwhile may have removed our tree while empty
        return path

    def close(self) -> None:
        self.remove()
        _rmdir_cgroups(self.root)

    def remove(self, path: str | None = None) -> None:
        """Remove a run's cgroup once its processes are gone; retry busy ones later."""
        pending, self.trash = self.trash + ([path] if path else []), []
        for p in pending:
            try:
                os.rmdir(p)
            except FileNotFoundError:
                pass
            except OSError:
                self.trash.append(p)


def _cgroup_limits(cg: int, memory_mb: int | None, max_processes: int) -> bool:
    """Set a run's limits in its cgroup; False if memory is not limited there (v1 pids)."""
    _write("pids.max", str(max_processes), cg)
    if not _read("memory.max", cg):
        return False
    _write("memory.max", str(memory_mb << 20) if memory_mb else "max", cg)
    if _read("memory.swap.max", cg):  # absent without swap accounting
        _write("memory.swap.max", "0" if memory_mb else "max", cg)
    return True


def _cgroup_verdict(cg: int) -> tuple[bool | None, int | None]:
    """(killed for memory, peak memory in KB) of a run's cgroup; None where unknown (v1)."""
    events = _read("memory.events", cg)
    if not events:
        return None, None
    counts = dict(ln.split()[:2] for ln in events.splitlines() if len(ln.split()) >= 2)
    peak = _read("memory.peak", cg).strip()
    return int(counts.get("oom_kill", "0")) > 0, (int(peak) // 1024 if peak.isdigit() else None)


# --- a run's root (init side) --------------------------------------------------------------------

PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")  # writable by uid 0 without capabilities
PROC_MASKED = ("kcore", "keys", "timer_list", "sched_debug")  # host information
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")


class RootSpec:
    """How to build a run's root; paths as the holder's mount namespace sees them."""

    __slots__ = ("base", "lower", "userxattr", "network", "binds", "scratch_mb", "upper", "cgroup", "netns",
                 "console")

    def __init__(self, base: str, lower: str, userxattr: bool, network: bool,
                 binds: tuple[tuple[str, str, bool], ...] = (), scratch_mb: int | None = None,
                 upper: str | None = None, cgroup: str | None = None, netns: int | None = None,
                 console: str | None = None):
        self.base = base  # the holder's private tmpfs: layer mounts, the /dev template, mount points
        self.lower = lower  # the warm read-only overlay of the layer stack, relative to base
        # Rootless: the overlay is in a user namespace (squashfuse shows trusted.overlay.* as
        # user.overlay.*) and root inside is an ordinary user outside.
        self.userxattr = userxattr
        self.network = network
        self.binds = binds  # (host path, path inside, read-only)
        self.scratch_mb = scratch_mb  # size of the tmpfs under the writable layer (default: half the RAM)
        self.upper = upper  # a kept upper directory (shell with persist) instead of the tmpfs
        self.cgroup = cgroup  # this run's cgroup directory (v2, or v1 pids), if any
        self.netns = netns  # a network namespace (fd) to join when not network; None: make one
        self.console = console  # the caller's terminal, shown as /dev/console (a shell's ttyname)


def _inside(rel: str) -> str:
    """A path in the new root, relative to it, that no symlink of the image redirects:
    before pivot_root a symlink would resolve against the host's root."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise RunnerError(f"bad path inside the instance: {rel!r}; use an absolute path without '..'")
    for i in range(1, len(parts) + 1):
        p = "/".join(parts[:i])
        if os.path.islink(p):
            raise RunnerError(f"/{p} is a symlink in the instance; mount on the path it points to instead")
    return "/".join(parts)


def _mountpoint(rel: str, is_dir: bool) -> str:
    path = _inside(rel)
    if not os.path.lexists(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if is_dir:
            os.mkdir(path)
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    return path


def enter_root(spec: RootSpec) -> int | None:
    """In pid 1 of a new pid namespace: build the run's root and move into it, ending as
    root of a nested user namespace that owns nothing. Joins the run's cgroup, if any,
    and returns a descriptor of it (the host's /sys is gone afterwards)."""
    isolated = not spec.network and spec.netns is None
    unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWNET if isolated else 0))
    if spec.netns is not None:
        setns(spec.netns, CLONE_NEWNET)
        os.close(spec.netns)
    elif isolated:
        _loopback_up()
    os.chdir(spec.base)
    size = f",size={spec.scratch_mb}m" if spec.scratch_mb else ""
    mount("scratch", "s", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755" + size)
    if spec.upper:
        upper, work = f"{spec.upper}/upper", f"{spec.upper}/work"
        os.makedirs(upper, exist_ok=True)
        os.makedirs(work, exist_ok=True)
    else:
        upper, work = "s/u", "s/w"
        os.mkdir(upper)
        os.mkdir(work)
    os.mkdir("s/r")
    opts = f"lowerdir={spec.lower},upperdir={upper},workdir={work}" + (",userxattr" if spec.userxattr else "")
    # nodev: a device node in an image must not reach the host's disks; nosuid: nor gain ids.
    mount("overlay", "s/r", "overlay", MS_NOSUID | MS_NODEV, opts)
    os.chdir("s/r")
    for d, mode in (("proc", 0o555), ("dev", 0o755), ("tmp", 0o1777)):
        if not os.path.lexists(d):
            os.mkdir(d)
            os.chmod(d, mode)
        _inside(d)
    mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if not spec.userxattr:  # root inside is host root: its files there are not for the run
        for p in PROC_READONLY:
            if os.path.exists(f"proc/{p}"):
                _bind_readonly(f"proc/{p}", f"proc/{p}")
        for p in PROC_MASKED:
            if os.path.exists(f"proc/{p}"):
                mount(f"{spec.base}/dev/null", f"proc/{p}", None, MS_BIND)
    mount(f"{spec.base}/dev", "dev", None, MS_BIND | MS_REC)
    mount("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    mount("shm", "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777" + size)
    if spec.console:
        mount(spec.console, "dev/console", None, MS_BIND)
    for src, dest, readonly in spec.binds:
        target = _mountpoint(dest, os.path.isdir(src))
        if readonly:
            _bind_readonly(src, target)
        else:
            mount(src, target, None, MS_BIND | MS_REC)
    _ok(_libc.sethostname(b"sandbox", 7), "sethostname")
    cgroup = None
    if spec.cgroup:
        cgroup = os.open(spec.cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        _write("cgroup.procs", "0", cgroup)
    # pivot_root(".", ".") stacks the old root on the new one; detaching it leaves
    # nothing of the host in this mount namespace to escape to.
    pivot_root(".", ".")
    umount(".")
    os.chdir("/")
    unshare(CLONE_NEWUSER)
    map_root(0, 0)
    # Inherited by the command: in any out-of-memory kill, on the host or in a cgroup, a
    # run goes first (and of a run, its biggest process: the command, not this init).
    _write("/proc/self/oom_score_adj", "1000")
    return cgroup


# --- running one command (init side) ---------------------------------------------------------

DEFAULT_MAX_PROCESSES = 1024
IDLE_INIT = 60.0  # seconds a ready init waits for its job before it leaves
# Signals Python changes at start-up; the command gets the defaults back.
_RESET_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGCHLD, signal.SIGTERM, signal.SIGQUIT,
                  signal.SIGHUP, signal.SIGTTOU, signal.SIGTTIN, signal.SIGTSTP)


def _which(name: str, path: str) -> str:
    if "/" in name:
        return name
    for d in path.split(":"):
        candidate = f"{d or '.'}/{name}"
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(errno.ENOENT, "command not found", name)


def _write_files(files: dict[str, bytes]) -> None:
    """Into the run's writable layer, after pivot_root: the image's symlinks lead nowhere
    but inside, so they are followed as the command would."""
    for path, data in files.items():
        if not path.startswith("/"):
            raise RunnerError(f"file path {path!r} must be absolute")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def _spawn(job: dict, stdio: tuple[int, int, int], session: bool, cgroup: int | None) -> int:
    """Start the command with posix_spawn (vfork: no 1 ms fork of this process). Limits
    set on this init are inherited; the init itself needs little once it waits."""
    try:
        os.chdir(job["workdir"])
    except OSError as e:
        raise RunnerError(f"workdir {job['workdir']}: {e.strerror}; pass a directory that exists in the "
                          "instance") from None
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    memory_in_cgroup = cgroup is not None and _cgroup_limits(cgroup, job["memory_mb"], job["max_processes"])
    if cgroup is None:  # counted per user namespace, so per run (but never for host root)
        resource.setrlimit(resource.RLIMIT_NPROC, (job["max_processes"],) * 2)
    if job["memory_mb"] and not memory_in_cgroup:
        resource.setrlimit(resource.RLIMIT_AS, (job["memory_mb"] << 20,) * 2)
    return os.posix_spawn(_which(job["argv"][0], job["env"].get("PATH", "")), job["argv"], job["env"],
                          file_actions=[(os.POSIX_SPAWN_DUP2, fd, n) for n, fd in enumerate(stdio)],
                          setsid=session, setsigdef=_RESET_SIGNALS, setsigmask=())


def run_job(job: dict, stdio: tuple[int, int, int], *, client: socket.socket | None, cgroup: int | None,
            session: bool = True) -> dict | None:
    """As pid 1 of the run: spawn the command and wait for it; on timeout (or when the
    client goes away: then there is nobody to tell, None) kill every process here."""
    _write_files(job["files"])
    try:
        pid = _spawn(job, stdio, session, cgroup)
    except OSError as e:
        what = "command not found" if e.errno == errno.ENOENT else e.strerror
        os.write(stdio[2], f"image-builder: cannot run {job['argv'][0]!r}: {what}\n".encode())
        return {"exit_code": 127 if e.errno == errno.ENOENT else 126, "signal": None, "timed_out": False,
                "peak_memory_kb": None, "out_of_memory": False}
    for fd in stdio:  # the command has them: their EOF must not wait for this init
        if fd > 2:
            os.close(fd)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    if client is not None:
        poller.register(client, select.POLLIN)  # the client sends nothing more: readable means gone
    deadline = None if job["timeout"] is None else time.monotonic() + job["timeout"]
    timed_out = False
    while True:
        wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
        events = poller.poll(wait)
        if any(fd == pidfd for fd, _ in events):
            break
        if events:
            os.kill(-1, signal.SIGKILL)
            return None
        if deadline is not None and time.monotonic() >= deadline:
            # From pid 1, kill(-1) reaches every process of this pid namespace,
            # double forks and daemons included.
            os.kill(-1, signal.SIGKILL)
            timed_out = True
            break
    _, status, usage = os.wait4(pid, 0)
    oom, peak = _cgroup_verdict(cgroup) if cgroup is not None else (None, None)
    return {"exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": timed_out, "peak_memory_kb": peak or usage.ru_maxrss, "out_of_memory": oom}


def _init_main(spec: RootSpec, ctl: socket.socket) -> None:
    """An init forked ahead of time: build the root, wait for one job from the session
    holding the other end of `ctl`, run it, answer there. A setup error is kept and
    given to that session; EOF before a job means the init was not needed."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    error = None
    cgroup = None
    try:
        cgroup = enter_root(spec)
    except (OSError, RunnerError) as e:
        error = f"cannot build the instance's root: {e}"
    # The command runs as the same uid as this init: it could ptrace the init (or read
    # /proc/1/fd) and forge the answer. Non-dumpable, the init can only be traced with
    # CAP_SYS_PTRACE in the namespace its memory was made in: the host's. (Not before
    # enter_root: its own /proc files become root's, uid_map included.)
    _prctl(PR_SET_DUMPABLE, 0)
    if not select.select([ctl], [], [], IDLE_INIT)[0]:
        return  # a spare nobody used: a session that is kept open holds nothing for long
    job, fds = recv_fds(ctl)
    if job is None:
        return
    if "payload" in job:
        job = marshal.loads(os.pread(fds[3], job["payload"], 0))
        os.close(fds[3])
    if error is None:
        try:
            out = run_job(job, (fds[0], fds[1], fds[2]), client=ctl, cgroup=cgroup)
            if out is not None:
                send_fds(ctl, out)
            return
        except (OSError, RunnerError) as e:
            error = str(e) if isinstance(e, RunnerError) else f"cannot start {job['argv'][0]!r}: {e}"
    send_fds(ctl, {"error": error})


# --- the holder -----------------------------------------------------------------------------------

_STARTUP_GRACE = 10.0  # seconds a new holder waits for its first client
_NETNS_BATCH = 4


class _Init:
    __slots__ = ("cgroup", "netns")

    def __init__(self, cgroup: str | None, netns: int | None):
        self.cgroup = cgroup
        self.netns = netns


class _Session:
    __slots__ = ("stack", "spec", "linger")

    def __init__(self, stack: _Mounted, spec: dict, linger: float):
        self.stack = stack
        self.spec = spec  # RootSpec fields but network, cgroup and netns
        self.linger = linger


class Holder:
    """Mounts layers for sessions and forks inits for them (see the module docstring)."""

    def __init__(self, kernel: bool, base: str, cgroups: _Cgroups | None):
        self.kernel = kernel
        self.base = base
        self.cgroups = cgroups
        self.layers: dict[tuple, _Mounted] = {}
        self.stacks: dict[tuple, _Mounted] = {}
        self.sessions: dict[socket.socket, _Session] = {}
        self.inits: dict[int, _Init] = {}
        self.free_netns: list[int] = []
        self.counter = 0
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
            try:
                if self.kernel:
                    _loop_mount(path, offset, size, target)
                else:
                    _fuse_mount(path, offset, target)
            except OSError:
                os.rmdir(target)
                raise
            layer = self.layers[key] = _Mounted(target)
        return layer

    def _stack(self, layers: list[_Mounted]) -> _Mounted:
        key = tuple(x.path for x in layers)
        stack = self.stacks.get(key)
        if stack is None:
            target = self._dir("o")
            # A read-only overlay lists the top layer first; one layer needs an empty second.
            lower = ":".join(x.path for x in reversed(layers)) + (":e" if len(layers) == 1 else "")
            try:
                mount("layers", target, "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV,
                      f"lowerdir={lower}" + ("" if self.kernel else ",userxattr"))
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
                umount(m.path)
                os.rmdir(m.path)
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
        spec = {"base": self.base, "lower": stack.path, "userxattr": not self.kernel,
                "binds": tuple(tuple(b) for b in msg["binds"]), "scratch_mb": msg["scratch_mb"]}
        self.sessions[conn] = _Session(stack, spec, msg["linger"])
        send_fds(conn, {"spec": spec})

    def _netns(self) -> int:
        """An isolated network namespace with lo up. Making one costs about 2.5 ms of CPU
        here (and more to tear down), so each is reused, by one run after another: a run
        holds it alone, and what it leaves behind dies with its processes."""
        if not self.free_netns:
            # A child makes them: without privileges on the host's namespace, a process
            # that leaves it cannot come back.
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                try:
                    for _ in range(_NETNS_BATCH):
                        unshare(CLONE_NEWNET)
                        _loopback_up()
                        fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                        send_fds(child, {}, [fd])
                        os.close(fd)
                finally:
                    os._exit(0)
            child.close()
            try:
                while len(self.free_netns) < _NETNS_BATCH:
                    msg, fds = recv_fds(parent, 1)
                    if msg is None:
                        break
                    self.free_netns.extend(fds)
            finally:
                parent.close()
                os.waitpid(pid, 0)
            if not self.free_netns:
                raise RunnerError("cannot make a network namespace; see holder.log in the state dir")
        return self.free_netns.pop()

    def _fork_init(self, sess: _Session, network: bool) -> socket.socket:
        """A new init for `sess`; returns the session's end of its control socket."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cgroup = self.cgroups.new() if self.cgroups else None
        netns = None if network else self._netns()
        spec = RootSpec(network=network, cgroup=cgroup, netns=netns, **sess.spec)
        unshare(CLONE_NEWPID)  # for the next child only: undone right after the fork
        try:
            pid = os.fork()
        except BaseException:
            setns(self.pidns, CLONE_NEWPID)
            raise
        if pid == 0:
            try:
                self._close_all_but(parent)
                _init_main(spec, child)
            except BaseException as e:  # nobody to report to but the log
                print(f"image-builder init: {type(e).__name__}: {e}", file=sys.stderr)
            finally:
                os._exit(0)
        setns(self.pidns, CLONE_NEWPID)
        child.close()
        self.inits[pid] = _Init(cgroup, netns)
        return parent

    def _close_all_but(self, session_end: socket.socket) -> None:
        """In a new init: close the holder's descriptors (and the session's end of its own
        control socket), so that no EOF anyone waits for is held up by this process."""
        gc.disable()  # no finaliser may close a descriptor number that gets reused
        signal.set_wakeup_fd(-1)
        for s in (self.listener, session_end, *self.conns.values()):
            s.close()
        for fd in (self.wake_r, self.wake_w, self.pidns, *self.free_netns):
            os.close(fd)
        for init in self.inits.values():
            if init.netns is not None:
                os.close(init.netns)

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
            if self.cgroups and init.cgroup:
                self.cgroups.remove(init.cgroup)
            if init.netns is not None:  # every process that used it is gone: reuse it
                self.free_netns.append(init.netns)

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
            elif sess is not None and msg.get("op") == "init":
                network = bool(msg["network"])
                try:
                    ctl = self._fork_init(sess, network)
                except (OSError, RunnerError) as e:  # answered in order, like the others
                    send_fds(conn, {"network": network, "error": str(e)})
                    return
                try:
                    send_fds(conn, {"network": network}, [ctl.fileno()])
                finally:
                    ctl.close()
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
        if sess is not None:  # a session ends with its connection
            del self.sessions[conn]
            self._release(sess.stack, sess.linger)
        self.poller.unregister(conn)
        del self.conns[conn.fileno()]
        conn.close()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
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


def _dev_template(path: str) -> None:
    """A read-only /dev every run binds: the harmless host nodes, and mount points for
    a run's own devpts and shm (block devices never appear)."""
    mount("dev", path, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for name in DEV_NODES:
        os.close(os.open(f"{path}/{name}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666))
        mount(f"/dev/{name}", f"{path}/{name}", None, MS_BIND)
    os.close(os.open(f"{path}/console", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))  # a shell's terminal
    for d in ("pts", "shm"):
        os.mkdir(f"{path}/{d}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        os.symlink(target, f"{path}/{name}")
    mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")


def holder_main(argv: list[str]) -> None:
    """`holder_main(["kernel"|"userns", STATE_DIR, SOCKET_NAME])`: become the holder. The
    first line on stdout is "ready", "busy" (another holder has the name) or "error: ..."."""
    kernel, state_dir, name = argv[0] == "kernel", argv[1], b"\0" + argv[2].encode()
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_RDWR), 1)
    try:
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
        for d in ("l", "o", "s", "e", "dev"):
            os.mkdir(d)
        _dev_template("dev")
        cgroups = None
        if found:
            try:
                cgroups = _Cgroups(*found)
            except OSError as e:
                print(f"image-builder holder: no cgroups ({e}); rlimits only", file=sys.stderr)
        holder = Holder(kernel, base, cgroups)
        try:
            holder.listener.bind(name)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            report.write("busy\n")
            return
        holder.listener.listen(128)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(holder.wake_w)
    except (OSError, RunnerError) as e:
        report.write(f"error: {e}\n")
        return
    report.write("ready\n")
    report.close()
    gc.freeze()  # what the holder has now is shared with every init: keep its pages uncopied
    holder.serve()


# --- an interactive command in the caller's session (client side) ----------------------------------


def run_joined(holder_pid: int, kernel: bool, spec: RootSpec, job: dict) -> int:
    """Run `job` as a child of this process in the holder's namespaces, on this process's
    stdin/stdout/stderr: a shell keeps the caller's terminal as its controlling terminal
    (same session), so job control and Ctrl-C work as usual. Returns the exit status
    (128 + N for signal N)."""
    names = ("mnt",) if kernel else ("user", "mnt")  # the user namespace first: it grants the rest
    ns = [os.open(f"/proc/{holder_pid}/ns/{n}", os.O_RDONLY | os.O_CLOEXEC) for n in names]
    pid = os.fork()
    if pid == 0:
        code = 125
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            for fd in ns:
                setns(fd)
            unshare(CLONE_NEWPID)
            inner = os.fork()
            if inner == 0:
                try:
                    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                    out = run_job(job, (0, 1, 2), client=None, cgroup=enter_root(spec), session=False)
                    code = out["exit_code"] if out["exit_code"] is not None else 128 + out["signal"]
                except BaseException as e:
                    print(f"image-builder: {e}", file=sys.stderr)
                finally:
                    os._exit(code)
            code = os.waitstatus_to_exitcode(os.waitpid(inner, 0)[1])
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
