"""The kernel side of the runtime: namespaces and mounts through libc, layer mounts
(a loop device as root, squashfuse rootless), and a run's root
(tmpfs upper and overlay over the layers, /proc, /dev, pivot_root). The holder
(image_builder.holder) and its inits are built from these.

This module stays lean (no dataclasses, pathlib, json, hashlib): the holder boots on
a cold start and is forked per run; those imports cost 30+ ms and 3 MB more to copy
on every fork here.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import sys

from .errors import ImageBuilderError

__all__ = ["RootSpec", "RunnerError", "bind_readonly", "dev_template", "enter_root", "fuse_mount", "hold_tree",
           "loop_mount", "loopback_up", "map_root", "mount", "prctl", "read_file", "setns", "squashfuse", "umount",
           "unshare", "write_file"]


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


def prctl(option: int, value: int) -> None:
    _ok(_libc.prctl(option, value, 0, 0, 0), f"prctl({option})")


def write_file(path: str, text: str, dir_fd: int | None = None) -> None:
    """Small files of /proc and /sys, in one write."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_file(path: str, dir_fd: int | None = None) -> str:
    """A small file of /proc or /sys; "" where there is none."""
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
    write_file("/proc/self/setgroups", "deny")
    write_file("/proc/self/uid_map", f"0 {uid} 1")
    write_file("/proc/self/gid_map", f"0 {gid} 1")


def bind_readonly(source: str, target: str) -> None:
    mount(source, target, None, MS_BIND | MS_REC)
    keep = sum(ms for st, ms in _KEEP_FLAGS if os.statvfs(target).f_flag & st)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def loopback_up() -> None:
    """A new network namespace has only lo, and it is down; tests still use 127.0.0.1."""
    siocsifflags, up_loopback_running = 0x8914, 0x1 | 0x8 | 0x40
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", up_loopback_running))


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


def loop_mount(image: str, offset: int, size: int, target: str) -> None:
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


SQUASHFUSE_ENV = "IMAGE_BUILDER_SQUASHFUSE"


def squashfuse() -> str:
    """The program that mounts images rootless: $IMAGE_BUILDER_SQUASHFUSE if set, else
    squashfuse_cached (image_builder/native, built by `make` beside this interpreter, or
    on PATH), else Debian's squashfuse_ll. Same command line; squashfuse_cached lets the
    kernel cache opens, directories and symlinks, which short runs spend most FUSE
    round trips on."""
    chosen = os.environ.get(SQUASHFUSE_ENV)
    if chosen:
        return chosen
    beside = os.path.join(os.path.dirname(sys.executable), "squashfuse_cached")
    if os.access(beside, os.X_OK):
        return beside
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if directory and os.access(os.path.join(directory, "squashfuse_cached"), os.X_OK):
            return os.path.join(directory, "squashfuse_cached")
    return "squashfuse_ll"


def hold_tree(tree: str | os.PathLike) -> int:
    """A shared flock on an unpacked tree (extract.extracted_layer), for whoever uses it:
    a session, the holder that bind-mounts it. While the fd is open, no extraction drops
    the tree as stale."""
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def fuse_mount(image: str, offset: int, target: str) -> None:
    """squashfuse returns once the mount is up; its daemon is then reparented to the
    holder (pid 1 here) and dies with the holder's pid namespace."""
    import subprocess  # only the holder mounts

    program = squashfuse()
    cmd = [program, "-o", f"offset={offset}", image, target]
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=60)
    except FileNotFoundError:
        raise OSError(errno.ENOENT, f"{program} not found (install squashfuse, or unset ${SQUASHFUSE_ENV})") from None
    if r.returncode:
        lines = r.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {r.returncode}"]
        raise OSError(errno.EIO, f"{os.path.basename(program)} {image}: {lines[-1]}")


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


def enter_root(spec: RootSpec) -> tuple[int | None, int]:
    """In pid 1 of a new pid namespace: build the run's root and move into it, ending as
    root of a nested user namespace that owns nothing. Joins the run's cgroup, if any.
    Returns descriptors of that cgroup (the host's /sys is gone afterwards) and of the
    writable layer's upper directory (out of reach by path afterwards)."""
    isolated = not spec.network and spec.netns is None
    unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWNET if isolated else 0))
    if spec.netns is not None:
        setns(spec.netns, CLONE_NEWNET)
        os.close(spec.netns)
    elif isolated:
        loopback_up()
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
    upper_fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    os.chdir("s/r")
    for d, mode in (("proc", 0o555), ("dev", 0o755), ("tmp", 0o1777)):
        if not os.path.lexists(d):
            os.mkdir(d)
            os.chmod(d, mode)
        _inside(d)
    if not spec.upper:  # emptied after each run (holder._empty_tmp): a run that wrote only there leaves no trace
        mount("tmp", "tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777" + size)
    mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if not spec.userxattr:  # root inside is host root: its files there are not for the run
        for p in PROC_READONLY:
            if os.path.exists(f"proc/{p}"):
                bind_readonly(f"proc/{p}", f"proc/{p}")
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
            bind_readonly(src, target)
        else:
            mount(src, target, None, MS_BIND | MS_REC)
    _ok(_libc.sethostname(b"sandbox", 7), "sethostname")
    cgroup = None
    if spec.cgroup:
        cgroup = os.open(spec.cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        write_file("cgroup.procs", "0", cgroup)
    # pivot_root(".", ".") stacks the old root on the new one; detaching it leaves
    # nothing of the host in this mount namespace to escape to.
    pivot_root(".", ".")
    umount(".")
    os.chdir("/")
    unshare(CLONE_NEWUSER)
    map_root(0, 0)
    # Inherited by the command: in any out-of-memory kill, on the host or in a cgroup, a
    # run goes first (and of a run, its biggest process: the command, not this init).
    write_file("/proc/self/oom_score_adj", "1000")
    return cgroup, upper_fd



def dev_template(path: str) -> None:
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

