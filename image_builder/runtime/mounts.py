"""The holder's side of the runtime: namespaces and mounts through libc, layer mounts
(a loop device as root, squashfuse rootless), the /dev every run binds, and what an
init needs to build a run's root (RootSpec; the init itself is runtime/native/init.c).

This module stays lean (no dataclasses, pathlib, json, hashlib): the holder boots on
a cold start; those imports cost 30+ ms.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import sys
import time

from image_builder.errors import ImageBuilderError

__all__ = ["INIT_MISSING", "ZYGOTE_LIBRARY_MISSING", "RootSpec", "RunnerError", "bind_readonly", "dev_template",
           "fuse_mount", "hold_tree", "init_program", "loop_mount", "map_root", "mount", "prctl", "read_file", "setns",
           "squashfuse", "umount", "unshare", "write_file", "zygote_library"]


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
MS_PRIVATE, MS_SLAVE, MS_RELATIME = 1 << 18, 1 << 19, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
# A read-only remount of a bind mount must repeat these; in a user namespace they are locked.
_KEEP_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
               (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.unshare.argtypes = (ctypes.c_int,)
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)
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


def loop_mount(image: str | int, offset: int, size: int, target: str, *, fstype: str = "squashfs",
               writable: bool = False) -> None:
    """Mount the file system at `offset` of `image` (a path, or a descriptor open on a file
    with no path: a sandbox's ext4 layer) through a loop device (root): read-only (a
    squashfs layer) unless `writable`. AUTOCLEAR frees the device when the mount goes (or
    at once, if mounting fails)."""
    name = image if isinstance(image, str) else os.readlink(f"/proc/self/fd/{image}")
    info = _LOOP_INFO64.pack(0, 0, 0, offset, size, 0, 0, 0,
                             (0 if writable else _LO_FLAGS_READ_ONLY) | _LO_FLAGS_AUTOCLEAR,
                             os.fsencode(name)[-63:], b"", b"", 0, 0)
    # The loop device is as writable as this; a descriptor stays the caller's to close.
    with open(image, "r+b" if writable else "rb", closefd=isinstance(image, str)) as backing:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(16):
                dev = f"/dev/loop{fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)}"
                fd = os.open(dev, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
                try:
                    try:
                        _loop_attach(fd, backing.fileno(), info)
                    except OSError as e:
                        if e.errno == errno.EBUSY:  # taken by another process meanwhile
                            continue
                        raise
                    mount(dev, target, fstype, (0 if writable else MS_RDONLY) | MS_NOSUID | MS_NODEV)
                    return
                finally:
                    os.close(fd)
            raise OSError(errno.EBUSY, "no free loop device")
        finally:
            os.close(ctl)


SQUASHFUSE_ENV = "IMAGE_BUILDER_SQUASHFUSE"
INIT_ENV = "IMAGE_BUILDER_INIT"
# Every run's and build script's umask, Docker's (runc's default for a container's process), not the caller's:
# an HPC site's 077 gave test suites other file modes than the reference harnesses' containers, and a build's
# files modes no other user of the store could read. native/init.c has the same (RUN_UMASK).
RUN_UMASK = 0o022
INIT_MISSING = ("image-builder-init not found (built by `make` from image_builder/runtime/native/init.c into the venv; "
                f"or set ${INIT_ENV})")
ZYGOTE_LIBRARY = "image-builder-zygote.so"
ZYGOTE_LIBRARY_MISSING = (f"{ZYGOTE_LIBRARY} not found beside image-builder-init (built by `make` from "
                          "image_builder/runtime/native/zygote_root.c): runs start fresh interpreters")


def _native(name: str) -> str | None:
    """A program of runtime/native: built by `make` beside this interpreter, or on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK):
        return beside
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if directory and os.access(os.path.join(directory, name), os.X_OK):
            return os.path.join(directory, name)
    return None


def squashfuse() -> str:
    """The program that mounts images rootless: $IMAGE_BUILDER_SQUASHFUSE if set, else
    squashfuse_cached, else Debian's squashfuse_ll. Same command line; squashfuse_cached
    lets the kernel cache opens, directories and symlinks, which short runs spend most
    FUSE round trips on."""
    return os.environ.get(SQUASHFUSE_ENV) or _native("squashfuse_cached") or "squashfuse_ll"


def init_program() -> str | None:
    """image-builder-init, every run's pid 1: $IMAGE_BUILDER_INIT if set, else the built one."""
    chosen = os.environ.get(INIT_ENV)
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    return _native("image-builder-init")


def zygote_library() -> str | None:
    """image-builder-zygote.so (native/zygote_root.c), which a warm interpreter's jobs enter their roots
    with (zygote.py): built by `make` beside image-builder-init, and looked for there."""
    init = init_program()
    path = os.path.join(os.path.dirname(init), ZYGOTE_LIBRARY) if init else None
    return path if path and os.access(path, os.R_OK) else None


def hold_tree(tree: str | os.PathLike) -> int:
    """A shared flock on an unpacked tree (extract.extracted_layer), for whoever uses it:
    a session, the holder that bind-mounts it. While the fd is open, no extraction drops
    the tree as stale."""
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def fuse_mount(image: str, offset: int, target: str, timeout: float = 60.0) -> None:
    """squashfuse returns once the mount is up; its daemon is then reparented to the
    holder (pid 1 here) and dies with the holder's pid namespace."""
    import select  # a C module; subprocess was 6-10 ms of a rootless holder's cold open (and its imports)

    program = squashfuse()
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.posix_spawnp(program, [program, "-o", f"offset={offset}", image, target], os.environ,
                              file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                                            (os.POSIX_SPAWN_DUP2, err_w, 2)])
    except FileNotFoundError:
        os.close(err_r)
        raise OSError(errno.ENOENT, f"{program} not found (install squashfuse, or unset ${SQUASHFUSE_ENV})") from None
    finally:
        os.close(err_w)
    # Its stderr ends when the mount is up (the daemon's stdio is /dev/null: fuse_daemonize) or it failed.
    err, poller, deadline = b"", select.poll(), time.monotonic() + timeout
    poller.register(err_r, select.POLLIN)
    try:
        while (left := deadline - time.monotonic()) > 0:
            if poller.poll(int(left * 1000) + 1):
                chunk = os.read(err_r, 65536)
                if not chunk:
                    break
                err = (err + chunk)[-65536:]
        else:
            os.kill(pid, 9)  # SIGKILL
            err += f"\nno mount after {timeout:.0f} s".encode()
    finally:
        os.close(err_r)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code:
        lines = err.decode(errors="replace").strip().splitlines() or [f"exit status {code}"]
        raise OSError(errno.EIO, f"{os.path.basename(program)} {image}: {lines[-1]}")


# --- a run's root: what its init (native/init.c) is given -------------------------------------

DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
# /proc files that tell of the host, hidden (runc's maskedPaths, the page-frame tables, kernel memory layout),
# and those writable by uid 0, read-only (runc's readonlyPaths). native/init.c has the same
# lists for runs; the build sandbox uses these (tests/test_envbuild.py checks they agree).
PROC_MASKED = ("acpi", "asound", "kcore", "keys", "latency_stats", "timer_list", "timer_stats", "sched_debug",
               "scsi", "kpageflags", "kpagecount", "kpagecgroup", "interrupts", "slabinfo", "vmallocinfo",
               "pagetypeinfo")
PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")


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
        self.scratch_mb = scratch_mb  # caps each tmpfs of a root (init.c sizes them from the memory limit)
        self.upper = upper  # a kept upper directory (shell with persist) instead of the tmpfs
        self.cgroup = cgroup  # this run's cgroup directory (v2, or v1 pids), if any
        self.netns = netns  # a network namespace (fd) to join when not network; None: make one
        self.console = console  # the caller's terminal, shown as /dev/console (a shell's ttyname)


def dev_template(path: str) -> None:
    """A read-only /dev every run binds: the harmless host nodes, and mount points for
    a run's own devpts and shm (block devices never appear)."""
    mount("dev", path, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for name in DEV_NODES:
        os.close(os.open(f"{path}/{name}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666))
        # Read-only binds (copies keep it: the runs' /dev, the /proc files masked with null): the nodes are the
        # host's, and root of a run is the host's root in the kernel backend; a writable bind let a run chmod
        # the host's /dev/null, and carry a count from run to run in its times. Reading and writing a device
        # is not writing its file system: they still work.
        bind_readonly(f"/dev/{name}", f"{path}/{name}")
    os.close(os.open(f"{path}/console", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))  # a shell's terminal
    for d in ("pts", "shm"):
        os.mkdir(f"{path}/{d}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        os.symlink(target, f"{path}/{name}")
    mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")

