"""The mount side of the runtime: a per-user holder process keeps layers mounted,
and each run gets a fresh writable root over them.

Why it is built this way (figures from one of these 2-core VMs):

- Mounting is the expensive part (a squashfuse_ll daemon per layer rootless, a
  loop device as root), so each layer file is mounted once by a holder process
  and shared by every session using it. A read-only overlay per layer stack
  (inst:env) stays mounted too: its dentry cache stays warm, so a run's own
  overlay finds each path in one warm layer instead of asking FUSE again for
  every file Python looks for.
- The holder is pid 1 of its own pid namespace and mounts only in its own mount
  namespace (a slave of the host's, so later host mounts still show). When it
  exits or is killed, even with SIGKILL, the kernel kills its FUSE daemons and
  runs and drops every mount with the namespace: nothing is ever mounted in the
  host's namespace, so nothing can go stale there.
- fork() of a Python process costs 0.4-1 ms here and posix_spawn about 0.5 ms
  less, so the holder forks each run's init ahead of time, off the critical
  path. The init is pid 1 of a fresh pid namespace with its root already built
  (tmpfs upper + overlay, /proc, /dev, pivot_root, privileges dropped); when a
  request arrives it only posix_spawns the command, waits and reports.
- Each init drops into a nested user namespace mapping just root: the run can
  mount, unmount or remount nothing (the layers and the /proc masks stay put),
  real root (kernel backend) keeps no capability on the host, and RLIMIT_NPROC
  counts only the run's own processes (the kernel counts per user namespace),
  which makes it a working fork-bomb limit.

Protocol (SOCK_SEQPACKET on an abstract socket, JSON messages, file
descriptors with SCM_RIGHTS): a session connection sends "open" and stays open
while the session lives; each run opens its own connection, sends "run" with
stdin/stdout/stderr, and the holder passes that connection on to an init,
which answers the client directly.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import gc
import hashlib
import json
import os
import platform
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ImageBuilderError

__all__ = ["RootSpec", "RunnerError", "holder_name", "run_joined"]


class RunnerError(ImageBuilderError):
    """An instance cannot be mounted or a command cannot be started in it; the message
    says what failed and what to do."""


# --- libc -----------------------------------------------------------------------------

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
PR_SET_PDEATHSIG = 1
# statvfs f_flag -> the mount flag a read-only remount must repeat (they are locked in a user namespace)
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
    _ok(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)),
        f"mount {fstype or source} on {target}")


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _ok(_libc.umount2(_b(target), flags), f"umount {target}")


def unshare(flags: int) -> None:
    _ok(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int = 0) -> None:
    _ok(_libc.setns(fd, nstype), "setns")


def pivot_root(new_root: str, put_old: str) -> None:
    nr = _SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"pivot_root: no syscall number known for {platform.machine()}")
    _ok(_libc.syscall(nr, _b(new_root), _b(put_old)), "pivot_root")


def die_with_parent() -> None:
    _ok(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def map_root(uid: int, gid: int) -> None:
    """After unshare(CLONE_NEWUSER): root inside is uid/gid outside. One id each is
    what an unprivileged process may map for itself (setgroups must be denied first)."""
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")


def _bind_readonly(source: str, target: str, flags: int = 0) -> None:
    mount(source, target, None, MS_BIND | flags)
    keep = sum(ms for st, ms in _KEEP_FLAGS if os.statvfs(target).f_flag & st)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def _loopback_up() -> None:
    """A new network namespace has only lo, and it is down; tests still use 127.0.0.1."""
    siocsifflags, iff_up_loopback_running = 0x8914, 0x1 | 0x8 | 0x40
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", iff_up_loopback_running))


# --- layer mounts (holder side) --------------------------------------------------------

_LOOP_SET_FD, _LOOP_SET_STATUS64, _LOOP_CTL_GET_FREE = 0x4C00, 0x4C04, 0x4C82
_LO_FLAGS_AUTOCLEAR = 4
_LOOP_INFO64 = struct.Struct("<QQQQQIIII64s64s32sQQ")  # struct loop_info64, 232 bytes


def _loop_mount(image: str, offset: int, size: int, target: str) -> None:
    """Mount the squashfs at `offset` of `image` read-only through a loop device (root).
    AUTOCLEAR frees the device when the mount goes (or now, if mounting fails)."""
    with open(image, "rb") as backing:  # opened read-only: the loop device is read-only
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(16):
                n = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
                dev = f"/dev/loop{n}"
                fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    try:
                        fcntl.ioctl(fd, _LOOP_SET_FD, backing.fileno())
                    except OSError as e:
                        if e.errno == errno.EBUSY:  # another process took it between the two calls
                            continue
                        raise
                    info = _LOOP_INFO64.pack(0, 0, 0, offset, size, 0, 0, 0, _LO_FLAGS_AUTOCLEAR,
                                             os.fsencode(image)[-63:], b"", b"", 0, 0)
                    fcntl.ioctl(fd, _LOOP_SET_STATUS64, info)
                    mount(dev, target, "squashfs", MS_RDONLY | MS_NOSUID | MS_NODEV)
                    return
                finally:
                    os.close(fd)
            raise OSError(errno.EBUSY, "no free loop device")
        finally:
            os.close(ctl)


def _fuse_mount(image: str, offset: int, target: str) -> None:
    """squashfuse_ll returns once the mount is up; its daemon then belongs to the holder
    (pid 1 here), so it dies with the holder's pid namespace."""
    cmd = ["squashfuse_ll", "-o", f"offset={offset}", image, target]
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=60)
    except FileNotFoundError:
        raise OSError(errno.ENOENT, "squashfuse_ll not found on PATH (install squashfuse)") from None
    if r.returncode:
        lines = r.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {r.returncode}"]
        raise OSError(errno.EIO, f"squashfuse_ll {image}: {lines[-1]}")


@dataclass
class _Mounted:
    """A mount the holder keeps while referenced, and `linger` seconds after."""

    path: str  # relative to the holder's base directory
    parts: tuple[_Mounted, ...] = ()  # layers under a stack's overlay
    refs: int = 0
    idle_since: float = 0.0
    linger: float = 0.0


# --- a run's root (init side) ----------------------------------------------------------

PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")  # writable by uid 0 without capabilities
PROC_MASKED = ("kcore", "keys", "timer_list", "sched_debug")  # host information
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")


@dataclass(frozen=True)
class RootSpec:
    """How to build a run's root: all paths as the holder's mount namespace sees them."""

    base: str  # the holder's private tmpfs: layer mounts, the /dev template, mount points
    lower: str  # the warm read-only overlay of the layer stack, relative to base
    userxattr: bool  # overlay in a user namespace: squashfuse shows trusted.overlay.* as user.overlay.*
    network: bool
    binds: tuple[tuple[str, str, bool], ...] = ()  # (host path, path inside, read-only)
    scratch_mb: int | None = None  # size of the tmpfs under the writable layer
    upper: str | None = None  # a kept upper directory (shell --persist) instead of the tmpfs
    cgroup: str | None = None  # this run's cgroup v2 directory, when delegated


def _inside(rel: str) -> str:
    """A path inside the new root that no symlink of the image can redirect: before
    pivot_root a symlink would resolve against the host's root."""
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
    """In pid 1 of a new pid namespace: build the run's root and move into it, ending
    as root of a nested user namespace that owns nothing. Returns a directory fd of
    the run's cgroup (opened before the host's /sys goes away), if any."""
    unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | (0 if spec.network else CLONE_NEWNET))
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
            os.mkdir(d, mode)
            os.chmod(d, mode)
        _inside(d)
    mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for p in PROC_READONLY:
        if os.path.exists(f"proc/{p}"):
            _bind_readonly(f"proc/{p}", f"proc/{p}", MS_REC)
    for p in PROC_MASKED:
        if os.path.exists(f"proc/{p}"):
            mount(f"{spec.base}/dev/null", f"proc/{p}", None, MS_BIND)
    mount(f"{spec.base}/dev", "dev", None, MS_BIND | MS_REC)
    mount("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    mount("shm", "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777" + size)
    for src, dest, readonly in spec.binds:
        target = _mountpoint(dest, os.path.isdir(src))
        if readonly:
            _bind_readonly(src, target, MS_REC)
        else:
            mount(src, target, None, MS_BIND | MS_REC)
    _ok(_libc.sethostname(b"sandbox", 7), "sethostname")
    if not spec.network:
        _loopback_up()
    cgroup_fd = os.open(spec.cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if spec.cgroup else None
    # pivot_root(".", ".") stacks the old root on the new one; detaching it leaves
    # nothing of the host in this mount namespace to escape to.
    pivot_root(".", ".")
    umount(".")
    os.chdir("/")
    unshare(CLONE_NEWUSER)
    map_root(0, 0)
    return cgroup_fd


# --- running one command (init side) ---------------------------------------------------

DEFAULT_MAX_PROCESSES = 1024
# Signals Python changes at start-up; the command must get the defaults back.
_RESET_SIGNALS = tuple(s for s in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGCHLD, signal.SIGTERM,
                                   signal.SIGQUIT, signal.SIGHUP, signal.SIGTTOU, signal.SIGTTIN, signal.SIGTSTP))


@dataclass
class Job:
    """One command, as the client sends it (the environment is complete: the image's
    variables, then the request's)."""

    argv: list[str]
    env: dict[str, str]
    workdir: str
    files: dict[str, str] = field(default_factory=dict)  # path -> bytes as latin-1 text
    timeout: float | None = None
    memory_mb: int | None = None
    max_processes: int = DEFAULT_MAX_PROCESSES


def _which(name: str, path: str) -> str:
    if "/" in name:
        return name
    for d in path.split(":"):
        candidate = f"{d or '.'}/{name}"
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(errno.ENOENT, "command not found", name)


def _write_files(files: dict[str, str]) -> None:
    for path, text in files.items():
        rel = _inside(path)
        os.makedirs(os.path.dirname(rel) or ".", exist_ok=True)
        fd = os.open(rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, text.encode("latin-1"))
        finally:
            os.close(fd)


def _cgroup_limits(cg: int, job: Job) -> None:
    for name, value in (("memory.max", f"{job.memory_mb}M" if job.memory_mb else "max"),
                        ("memory.swap.max", "0" if job.memory_mb else "max"),
                        ("pids.max", str(job.max_processes))):
        fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=cg)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)


def _cgroup_read(cg: int, name: str) -> str:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=cg)
    except OSError:
        return ""
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


def _spawn(job: Job, stdio: tuple[int, int, int], session: bool, cg: int | None) -> int:
    """Start the command; posix_spawn (vfork) keeps this off the 1 ms fork() path.
    Limits set here are inherited; this init needs nothing more once it waits."""
    os.chdir(job.workdir)
    resource = _resource()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cg is not None:
        _cgroup_limits(cg, job)
        _write_at(cg, "cgroup.procs", "0")
    else:
        resource.setrlimit(resource.RLIMIT_NPROC, (job.max_processes, job.max_processes))
        if job.memory_mb:
            limit = job.memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    actions = [(os.POSIX_SPAWN_DUP2, fd, n) for n, fd in enumerate(stdio)]
    return os.posix_spawn(_which(job.argv[0], job.env.get("PATH", "")), job.argv, job.env, file_actions=actions,
                          setsid=session, setsigdef=_RESET_SIGNALS, setsigmask=())


def _resource():
    import resource  # small, and only the init needs it

    return resource


def _write_at(dir_fd: int, name: str, text: str) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


@dataclass
class Outcome:
    exit_code: int | None
    signal: int | None
    timed_out: bool = False
    peak_memory_kb: int | None = None
    out_of_memory: bool | None = None  # None: no cgroup to tell, the client judges from the output

    def as_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()


def run_job(job: Job, stdio: tuple[int, int, int], *, client: socket.socket | None, cg: int | None,
            session: bool = True) -> Outcome | None:
    """Spawn the command and wait for it, killing everything in this pid namespace on
    timeout (or when the client goes away: then there is nobody to tell, None)."""
    _write_files(job.files)
    try:
        pid = _spawn(job, stdio, session, cg)
    except OSError as e:
        what = "not found" if e.errno == errno.ENOENT else e.strerror
        os.write(stdio[2], f"image-builder: cannot run {job.argv[0]!r}: {what}\n".encode())
        return Outcome(127 if e.errno == errno.ENOENT else 126, None)
    poller = select.poll()
    pidfd = os.pidfd_open(pid)
    poller.register(pidfd, select.POLLIN)
    if client is not None:
        poller.register(client, select.POLLIN)  # readable only at EOF: the client went away
    deadline = None if job.timeout is None else time.monotonic() + job.timeout
    timed_out = False
    while True:
        wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
        events = poller.poll(wait)
        if any(fd == pidfd for fd, _ in events):
            break
        if events:  # the client is gone
            os.kill(-1, signal.SIGKILL)
            return None
        if deadline is not None and time.monotonic() >= deadline:
            # From pid 1, kill(-1) reaches every process in this pid namespace:
            # double forks and daemons too.
            os.kill(-1, signal.SIGKILL)
            timed_out = True
            break
    _, status, usage = os.wait4(pid, 0)
    out = Outcome(os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                  os.WTERMSIG(status) if os.WIFSIGNALED(status) else None, timed_out, usage.ru_maxrss)
    if cg is not None:
        events = dict(line.split() for line in _cgroup_read(cg, "memory.events").splitlines() if line.strip())
        out.out_of_memory = int(events.get("oom_kill", 0)) > 0
        peak = _cgroup_read(cg, "memory.peak").strip()
        if peak.isdigit():
            out.peak_memory_kb = int(peak) // 1024
    return out


def _init_main(spec: RootSpec, ctl: socket.socket) -> None:
    """An init forked ahead of time: build the root, wait for one job, run it, report.
    A setup error is kept and reported to the client the job comes from."""
    die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    error = None
    cg = None
    try:
        cg = enter_root(spec)
    except (OSError, RunnerError) as e:
        error = f"cannot build the instance's root: {e}"
    data, fds, _flags, _addr = socket.recv_fds(ctl, 1 << 16, 8)
    if not data:
        return  # the holder dropped this init
    ctl.close()
    client = socket.socket(fileno=fds[0])
    msg = json.loads(data)
    if "payload" in msg:
        msg["job"] = json.loads(os.pread(fds[4], msg["payload"], 0))
    if error is None:
        try:
            out = run_job(Job(**msg["job"]), (fds[1], fds[2], fds[3]), client=client, cg=cg)
        except (OSError, RunnerError) as e:
            error = f"cannot start {msg['job']['argv'][0]!r}: {e}"
            out = None
            if isinstance(e, FileNotFoundError) and e.filename == msg["job"]["workdir"]:
                error = f"workdir {e.filename} does not exist in the instance; pass an existing workdir"
        if out is not None:
            client.send(out.as_json())
    if error is not None:
        client.send(json.dumps({"error": error}).encode())


# --- cgroups: pids and memory limits that hold for every process of a run --------------


@dataclass(frozen=True)
class Cgroups:
    """One run's cgroups: cgroup v2 (one directory, delegated to us) or v1 as root (a
    pids and a memory directory). Without them, rlimits stand in (see _spawn)."""

    dirs: tuple[str, ...]
    v2: bool


class _CgroupTree:
    """Where the holder makes one cgroup per run: image-builder-PID/rN under the
    directories `find` picked (stale trees of killed holders are removed first)."""

    def __init__(self, parents: tuple[Path, ...], v2: bool):
        self.v2 = v2
        self.roots = tuple(p / f"image-builder-{os.getpid()}" for p in parents)
        for parent in parents:
            for stale in parent.glob("image-builder-*"):
                if not Path(f"/proc/{stale.name.rsplit('-', 1)[1]}").exists():
                    _rmtree_cgroup(stale)
        for root in self.roots:
            root.mkdir()
        if v2:  # no internal processes: the holder lives in a leaf, runs in siblings
            (self.roots[0] / "holder").mkdir()
            (self.roots[0] / "holder" / "cgroup.procs").write_text("0")
            (self.roots[0] / "cgroup.subtree_control").write_text("+memory +pids")
        self.counter = 0

    @classmethod
    def find(cls) -> _CgroupTree | None:
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        own = dict(ln.split(":", 2)[1:] for ln in lines if ln.count(":") >= 2)
        fs = Path("/sys/fs/cgroup")
        v2fs = fs if (fs / "cgroup.controllers").exists() else fs / "unified"
        if "" in own and (v2fs / "cgroup.controllers").exists():
            here = v2fs / own[""].lstrip("/")
            for cg in (here, *here.parents):  # the nearest ancestor we own that hands out memory and pids
                try:
                    ok = os.stat(cg).st_uid == os.getuid() and os.access(cg, os.W_OK) and \
                        {"memory", "pids"} <= set((cg / "cgroup.subtree_control").read_text().split())
                except OSError:
                    break
                if ok:
                    try:
                        return cls((cg,), True)
                    except OSError:
                        break
                if cg == v2fs:
                    break
        if os.geteuid() == 0 and "pids" in own and "memory" in own:
            parents = (fs / "pids" / own["pids"].lstrip("/"), fs / "memory" / own["memory"].lstrip("/"))
            if all((p / "cgroup.procs").exists() for p in parents):
                try:
                    return cls(parents, False)
                except OSError:
                    return None
        return None

    def new(self) -> Cgroups:
        self.counter += 1
        dirs = tuple(root / f"r{self.counter}" for root in self.roots)
        for d in dirs:
            d.mkdir()
        return Cgroups(tuple(str(d) for d in dirs), self.v2)

    @staticmethod
    def remove(cg: Cgroups) -> None:
        for d in cg.dirs:
            try:
                os.rmdir(d)
            except OSError:
                pass  # still busy: goes with the holder's tree later


def _rmtree_cgroup(path: Path) -> None:
    for sub in sorted(path.glob("*/"), reverse=True):
        try:
            sub.rmdir()
        except OSError:
            pass
    try:
        path.rmdir()
    except OSError:
        pass


def _cgroup_write(dir_fd: int, name: str, text: str) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _cgroup_read(dir_fd: int, name: str) -> str:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return ""
    try:
        return os.read(fd, 65536).decode()
    except OSError:
        return ""
    finally:
        os.close(fd)


@dataclass
class _RunCgroups:
    """A run's cgroup directories as seen from inside (opened before pivot_root)."""

    fds: tuple[int, ...]
    v2: bool

    def limit(self, memory_mb: int | None, max_processes: int) -> None:
        mem = str(memory_mb << 20) if memory_mb else None
        if self.v2:
            _cgroup_write(self.fds[0], "pids.max", str(max_processes))
            _cgroup_write(self.fds[0], "memory.max", mem or "max")
            _cgroup_write(self.fds[0], "memory.swap.max", "0" if mem else "max")
        else:
            _cgroup_write(self.fds[0], "pids.max", str(max_processes))
            if mem:
                _cgroup_write(self.fds[1], "memory.limit_in_bytes", mem)
                if _cgroup_read(self.fds[1], "memory.memsw.limit_in_bytes"):
                    _cgroup_write(self.fds[1], "memory.memsw.limit_in_bytes", mem)

    def verdict(self) -> tuple[bool, int | None]:
        """(killed for memory, peak memory in KB)."""
        if self.v2:
            events, peak = _cgroup_read(self.fds[0], "memory.events"), _cgroup_read(self.fds[0], "memory.peak")
        else:
            events, peak = (_cgroup_read(self.fds[1], "memory.oom_control"),
                            _cgroup_read(self.fds[1], "memory.max_usage_in_bytes"))
        counts = dict(ln.split()[:2] for ln in events.splitlines() if len(ln.split()) >= 2)
        peak = peak.strip()
        return int(counts.get("oom_kill", "0")) > 0, int(peak) // 1024 if peak.isdigit() else None


# --- the holder -------------------------------------------------------------------------

MAX_MESSAGE = 1 << 16
_MAX_POOL = 4


def holder_name(state_dir: Path, kernel: bool) -> bytes:
    """The holder's abstract socket name: per user, state dir and backend. Abstract
    sockets vanish with their process, so a dead holder leaves no socket file behind."""
    digest = hashlib.sha256(os.fsencode(state_dir.resolve())).hexdigest()[:16]
    return f"\0image-builder-{os.getuid()}-{digest}-{'kernel' if kernel else 'userns'}".encode()


@dataclass
class _Init:
    pid: int
    ctl: socket.socket | None
    session: str
    network: bool
    cgroup: str | None = None
    running: bool = False


@dataclass
class _Session:
    token: str
    conn: socket.socket
    stack: _Mounted
    spec: dict  # RootSpec fields but network
    linger: float
    pools: dict[bool, deque[_Init]] = field(default_factory=lambda: {True: deque(), False: deque()})
    running: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})


class Holder:
    def __init__(self, kernel: bool, base: Path, cgroups: _Cgroups | None):
        self.kernel = kernel
        self.base = base
        self.cgroups = cgroups
        self.layers: dict[tuple, _Mounted] = {}
        self.stacks: dict[tuple, _Mounted] = {}
        self.sessions: dict[str, _Session] = {}
        self.inits: dict[int, _Init] = {}
        self.counter = 0
        self.pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.conns: set[socket.socket] = set()

    # -- mounts --

    def _name(self, kind: str) -> str:
        self.counter += 1
        path = f"{kind}/{self.counter}"
        os.mkdir(path)
        return path

    def _layer(self, path: str, offset: int, size: int) -> _Mounted:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, offset)
        layer = self.layers.get(key)
        if layer is None:
            target = self._name("l")
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
        key = tuple(id(x) for x in layers)
        stack = self.stacks.get(key)
        if stack is None:
            target = self._name("o")
            # Read-only overlay: top layer first; one layer needs an empty second one.
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

    def _release(self, m: _Mounted, linger: float) -> None:
        m.refs -= 1
        if m.refs == 0:
            m.idle_since, m.linger = time.monotonic(), linger

    def _sweep(self) -> float | None:
        """Unmount what has been idle for its linger time; seconds until the next one is due."""
        now = time.monotonic()
        due = None
        for table in (self.stacks, self.layers):  # stacks first: they hold layers
            for key, m in list(table.items()):
                if m.refs:
                    continue
                left = m.idle_since + m.linger - now
                if left > 0:
                    due = left if due is None else min(due, left)
                    continue
                umount(m.path)
                os.rmdir(m.path)
                del table[key]
                for part in m.parts:
                    self._release(part, m.linger)
                if m.parts:
                    return 0.0  # its layers may be due now
        return due

    # -- sessions and runs --

    def _open(self, conn: socket.socket, msg: dict) -> None:
        layers = [self._layer(*x) for x in msg["layers"]]
        stack = self._stack(layers)
        stack.refs += 1
        token = os.urandom(8).hex()
        spec = {"base": str(self.base), "lower": stack.path, "userxattr": not self.kernel,
                "binds": tuple(tuple(b) for b in msg["binds"]), "scratch_mb": msg.get("scratch_mb")}
        self.sessions[token] = _Session(token, conn, stack, spec, float(msg.get("linger", 0)))
        conn.send(json.dumps({"token": token, "spec": spec, "holder": os.getpid()}).encode())

    def _close_session(self, sess: _Session) -> None:
        del self.sessions[sess.token]
        for pool in sess.pools.values():
            for init in pool:
                os.kill(init.pid, signal.SIGKILL)
                init.ctl.close()
                init.ctl = None
        self._release(sess.stack, sess.linger)

    def _fork_init(self, sess: _Session, network: bool) -> _Init:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cgroup = self.cgroups.new() if self.cgroups else None
        spec = RootSpec(network=network, cgroup=cgroup, **sess.spec)
        unshare(CLONE_NEWPID)  # for the next child only; undone below
        try:
            pid = os.fork()
        except BaseException:
            setns(self.pidns, CLONE_NEWPID)
            raise
        if pid == 0:
            try:
                self._drop_everything_but(child)
                _init_main(spec, child)
            except BaseException as e:  # nobody to report to but the log
                print(f"init: {type(e).__name__}: {e}", file=sys.stderr)
            finally:
                os._exit(0)
        setns(self.pidns, CLONE_NEWPID)
        child.close()
        init = self.inits[pid] = _Init(pid, parent, sess.token, network, cgroup)
        return init

    def _drop_everything_but(self, keep: socket.socket) -> None:
        """In a new init: close the holder's descriptors, so that a client's EOF and a
        dead holder's socket are not kept alive by it."""
        gc.disable()  # no finaliser may close a descriptor number that gets reused
        signal.set_wakeup_fd(-1)
        self.sel.close()
        for s in (self.listener, *self.conns):
            s.close()
        for init in self.inits.values():
            if init.ctl is not None:
                init.ctl.close()
        for fd in (self.wake_r, self.wake_w, self.pidns):
            os.close(fd)

    def _run(self, conn: socket.socket, raw: bytes, msg: dict, fds: list[int]) -> None:
        sess = self.sessions.get(msg.get("token", ""))
        if sess is None:
            conn.send(json.dumps({"error": "the session is closed; open a new one"}).encode())
            return
        network = bool(msg.get("network"))
        pool = sess.pools[network]
        for _attempt in range(2):
            init = pool.popleft() if pool else self._fork_init(sess, network)
            try:
                socket.send_fds(init.ctl, [raw], [conn.fileno(), *fds])
                break
            except OSError:  # that init died before its job: use a fresh one
                init.ctl.close()
                init.ctl = None
        else:
            conn.send(json.dumps({"error": "cannot start a run in the holder; see its log"}).encode())
            return
        init.ctl.close()
        init.ctl = None
        init.running = True
        sess.running[network] += 1

    def _refill(self) -> bool:
        """Fork one init where a pool is short; False when none is."""
        for sess in self.sessions.values():
            for network, pool in sess.pools.items():
                if sess.running[network] + len(pool) and len(pool) < min(_MAX_POOL, 1 + sess.running[network]):
                    pool.append(self._fork_init(sess, network))
                    return True
        return False

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
            if init.cgroup:
                _Cgroups.remove(init.cgroup)
            sess = self.sessions.get(init.session)
            if sess is None:
                continue
            if init.running:
                sess.running[init.network] -= 1
            elif init in sess.pools[init.network]:  # died before any job (killed?): drop it
                sess.pools[init.network].remove(init)
                if init.ctl is not None:
                    init.ctl.close()

    # -- the loop --

    def _on_message(self, conn: socket.socket) -> None:
        try:
            raw, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, 8)
        except OSError:
            raw, fds = b"", []
        sess = next((s for s in self.sessions.values() if s.conn is conn), None)
        if sess is not None or not raw:  # a session connection speaks once: EOF closes it
            if sess is not None:
                self._close_session(sess)
            self._forget(conn, fds)
            return
        try:
            msg = json.loads(raw)
            if msg.get("op") == "open":
                self._open(conn, msg)
                return  # stays registered: its EOF ends the session
            self._run(conn, raw, msg, fds)
        except (OSError, RunnerError, ValueError, KeyError, TypeError) as e:
            try:
                conn.send(json.dumps({"error": str(e)}).encode())
            except OSError:
                pass
        self._forget(conn, fds)

    def _forget(self, conn: socket.socket, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        self.sel.unregister(conn)
        self.conns.discard(conn)
        conn.close()

    def _accept(self, _listener) -> None:
        conn, _ = self.listener.accept()
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            conn.close()
            return
        self.conns.add(conn)
        self.sel.register(conn, selectors.EVENT_READ, self._on_message)

    def serve(self) -> None:
        self.sel.register(self.listener, selectors.EVENT_READ, self._accept)
        self.sel.register(self.wake_r, selectors.EVENT_READ, lambda _fd: self._drain_wakeups())
        idle_since = time.monotonic()
        while True:
            due = self._sweep()
            events = self.sel.select(0 if self._wants_refill() else due)
            for key, _ in events:
                key.data(key.fileobj)
            if not events and not self._refill():
                pass
            if self.sessions or self.inits or self.layers or self.stacks:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= 0:
                return

    def _wants_refill(self) -> bool:
        return any(sess.running[n] + len(p) and len(p) < min(_MAX_POOL, 1 + sess.running[n])
                   for sess in self.sessions.values() for n, p in sess.pools.items())

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        self._reap()


def holder_main(argv: list[str]) -> None:
    """`python -m image_builder.mounts kernel|userns STATE_DIR`: become the holder. The
    first line on stdout is "ready", "busy" (another holder has the name) or "error: ..."."""
    kernel, state_dir = argv[0] == "kernel", Path(argv[1])
    report = os.fdopen(1, "w", buffering=1)
    try:
        if kernel:
            unshare(CLONE_NEWNS)
        else:
            uid, gid = os.getuid(), os.getgid()
            unshare(CLONE_NEWUSER | CLONE_NEWNS)
            map_root(uid, gid)
        mount(None, "/", None, MS_REC | MS_SLAVE)
        unshare(CLONE_NEWPID)
        if os.fork():
            os._exit(0)  # the holder is our child, pid 1 of the new pid namespace
        listener_name = holder_name(state_dir, kernel)
        cgroup_parent = _delegated_cgroup()
        base = state_dir / "mnt"
        base.mkdir(parents=True, exist_ok=True)
        mount("image-builder", str(base), "tmpfs", MS_NOSUID | MS_NODEV, "mode=700")
        os.chdir(base)
        for d in ("l", "o", "s", "e", "dev"):
            os.mkdir(d)
        _dev_template("dev")
        holder = Holder(kernel, base, _Cgroups(cgroup_parent) if cgroup_parent else None)
        try:
            holder.listener.bind(listener_name)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                report.write("busy\n")
                return
            raise
        holder.listener.listen(128)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(holder.wake_w)
    except (OSError, RunnerError) as e:
        report.write(f"error: {e}\n")
        return
    report.write("ready\n")
    report.close()
    os.dup2(os.open(os.devnull, os.O_RDWR), 1)
    holder.serve()


def _dev_template(path: str) -> None:
    """A read-only /dev every run binds: the harmless host nodes and mount points for a
    run's own devpts and shm (block devices never appear)."""
    mount("dev", path, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for name in DEV_NODES:
        os.close(os.open(f"{path}/{name}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666))
        mount(f"/dev/{name}", f"{path}/{name}", None, MS_BIND)
    for d in ("pts", "shm"):
        os.mkdir(f"{path}/{d}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        os.symlink(target, f"{path}/{name}")
    mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")


# --- an interactive command in the caller's session (client side) ----------------------


def run_joined(holder_pid: int, kernel: bool, spec: RootSpec, job: Job) -> int:
    """Run `job` as a child of this process in the holder's namespaces, on this process's
    stdin/stdout/stderr: an interactive shell keeps the caller's terminal as its
    controlling terminal (same session), so job control and Ctrl-C work as usual.
    Returns the exit status (128 + N for signal N)."""
    names = ("mnt",) if kernel else ("user", "mnt")  # the user namespace first: it grants the rest
    ns = [os.open(f"/proc/{holder_pid}/ns/{n}", os.O_RDONLY | os.O_CLOEXEC) for n in names]
    pid = os.fork()
    if pid == 0:
        code = 125
        try:
            for fd in ns:
                setns(fd)
            unshare(CLONE_NEWPID)
            inner = os.fork()
            if inner == 0:
                code = 125
                try:
                    die_with_parent()
                    cg = enter_root(spec)
                    out = run_job(job, (0, 1, 2), client=None, cg=cg, session=False)
                    code = out.exit_code if out.exit_code is not None else 128 + (out.signal or 0)
                except BaseException as e:
                    print(f"image-builder: {e}", file=sys.stderr)
                finally:
                    os._exit(code)
            die_with_parent()
            _, status = os.waitpid(inner, 0)
            code = os.waitstatus_to_exitcode(status)
            code = code if code >= 0 else 128 - code
        except BaseException as e:
            print(f"image-builder: cannot enter the instance: {e}", file=sys.stderr)
        finally:
            os._exit(code)
    for fd in ns:
        os.close(fd)
    # Like system(3): while the command owns the terminal, its signals are not ours.
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGTTOU)}
    try:
        _, status = os.waitpid(pid, 0)
        if os.isatty(0):  # an interactive shell left its own process group in the foreground
            try:
                os.tcsetpgrp(0, os.getpgrp())
            except OSError:
                pass
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    holder_main(sys.argv[1:])
