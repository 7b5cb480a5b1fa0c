"""The build sandbox's privilege steps (sandbox.py runs them):

- `map` (root builds, run as root with `python -S`): in a private mount namespace, bind
  the host paths the build needs (the tree, the context, the images) where BUILD_UID can
  reach them (a store under /root is not), give BUILD_UID a /dev/fuse of its own (below),
  then fork a child into a new user namespace,
  map its root to BUILD_UID from here (the parent keeps the host's CAP_SETUID, which the
  map needs; `unshare --map-users` would need newuidmap, which Debian leaves to the
  uidmap package) and exec the rest of the sandbox as that root.
- PIVOT (every build, inside the namespaces, after the mounts): make the tree the root of
  the mount namespace and detach the host's, set no_new_privs, load the seccomp filter
  that fakes ownership changes (fake_chown_filter), exec the command. It
  replaces chroot, so the double-chroot breakout finds nothing to break out to. It is
  source for `python -S -E -c`, run by the base interpreter: it imports nothing of this
  package, which BUILD_UID may not be able to read.
- `watch` (both): the sandbox dies with the builder, however the builder dies (SIGKILL,
  the OOM killer, a node's scheduler): its first process asks the kernel for SIGTERM when
  the builder goes and then kills its process group. Else a script ran on unwatched
  (met: `kill` of a build left its script running and writing into the work tree).
  A root build's `map` process is that first process; an unprivileged build's is `guard`.
"""

from __future__ import annotations

import os
import signal
import stat
import struct
import sys

from image_builder.runtime.mounts import CLONE_NEWNS, CLONE_NEWUSER, MS_BIND, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, \
    MS_REC, mount, prctl, unshare, write_file

PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1

# argv: ROOT WORKDIR FILTER COMMAND... (FILTER: a seccomp program in hex, or "")
PIVOT = r"""
import ctypes, os, sys
root, workdir, bpf, argv = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), sys.argv[4:]
libc = ctypes.CDLL(None, use_errno=True)
number = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "riscv64": 41, "s390x": 217}.get(os.uname().machine)
def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        sys.stderr.write(f"image-builder sandbox: {what}: {os.strerror(err)}\n")
        os._exit(125)
if number is None:
    check(-1, f"pivot_root on {os.uname().machine}")
os.chdir(root)
check(libc.syscall(number, b".", b"."), f"pivot_root {root}")  # the old root now lies over the new
check(libc.umount2(b".", 2), "detaching the host's root")  # MNT_DETACH
os.chdir("/")
check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
if bpf:
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    code = ctypes.create_string_buffer(bpf, len(bpf))
    check(libc.prctl(22, 2, ctypes.byref(Prog(len(bpf) // 8, ctypes.addressof(code))), 0, 0), "seccomp")
try:
    os.chdir(workdir)
    os.execv(argv[0], argv)
except OSError as e:
    sys.stderr.write(f"image-builder sandbox: {argv[0]} in {workdir}: {e.strerror}\n")
    os._exit(127)
"""

# A user namespace that maps one id (root) refuses every change of ownership to another id with EINVAL:
# dpkg unpacking a file of a system group, a maintainer script's `chown root:staff` (fontconfig-config's
# postinst, which graphviz and texlive pull in: sphinx 8.x's and matplotlib's pre_install failed on it).
# As Charliecloud's seccomp mode does, the build's processes have chown, fchown, lchown and fchownat
# answer success without doing anything: the files stay root's, as a one-id image has them anyway.
# AUDIT_ARCH_* and the system call numbers, by `uname -m` (32-bit programs on x86_64 use i386's).
_CHOWN_CALLS = {"x86_64": ((0xC000003E, (92, 93, 94, 260)),  # chown fchown lchown fchownat
                           (0x40000003, (16, 95, 182, 198, 207, 212, 298))),  # i386's, with the *32 ones
                "aarch64": ((0xC00000B7, (54, 55)),)}  # fchownat fchown (no chown, lchown)
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_RET_ALLOW, _RET_SUCCESS = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ERRNO with errno 0: returns 0, does nothing


def fake_chown_filter(machine: str) -> bytes:
    """The seccomp program (struct sock_filter[]) PIVOT loads; b"" on an architecture not listed."""
    insns: list[tuple[int, int, int, int]] = []
    for arch, calls in _CHOWN_CALLS.get(machine, ()):
        insns.append((_LD_W_ABS, 0, 0, 4))  # seccomp_data.arch
        insns.append((_JEQ_K, 0, len(calls) + 2, arch))  # another arch: on to the next block
        insns.append((_LD_W_ABS, 0, 0, 0))  # seccomp_data.nr
        insns += [(_JEQ_K, -1, 0, nr) for nr in calls]  # -1: to the last instruction, below
        insns.append((_RET_K, 0, 0, _RET_ALLOW))
    if not insns:
        return b""
    insns += [(_RET_K, 0, 0, _RET_ALLOW), (_RET_K, 0, 0, _RET_SUCCESS)]
    last = len(insns) - 1
    return b"".join(struct.pack("=HBBI", code, last - i - 1 if jt == -1 else jt, jf, k)
                    for i, (code, jt, jf, k) in enumerate(insns))


def _fail(what: str) -> None:
    sys.stderr.write(f"image-builder sandbox: {what}\n")
    os._exit(125)


def _fuse_device_for(uid: int, scratch: str) -> None:
    """An overlay build mounts its lower images with squashfuse as BUILD_UID, root of its
    user namespace: it must be that root who mounts them, so their files are root's inside
    (the kernel's squashfs, mounted here, would show them as unmapped ids, and squashfs has
    no idmapped mounts). /dev/fuse is mode 600 as Debian installs it, which BUILD_UID
    cannot open; rather than change the host's device, this namespace gets its own node
    for the same device, owned by BUILD_UID, on a tmpfs mounted here (a device node works
    on it: it is not a user namespace's mount) and bound over /dev/fuse."""
    try:
        rdev = os.stat("/dev/fuse").st_rdev
    except FileNotFoundError:
        return  # the build fails later in one line (squashfuse: no /dev/fuse)
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=700,size=16k")
    node = os.path.join(scratch, "fuse")
    os.mknod(node, stat.S_IFCHR | 0o600, rdev)
    os.chown(node, uid, uid)
    mount(node, "/dev/fuse", None, MS_BIND)


_child = 0  # this process's one child, once forked


def _watch(builder: int) -> None:
    """SIGTERM to us when `builder` ends (the kernel sends it when the thread that started us
    ends: sandbox.run waits in that thread), and on it SIGKILL to our process group (sandbox.run
    starts us as a session's leader; an interactive shell shares the builder's, so then to the
    child alone). A userns sandbox's pid namespace then takes every process of it; proot's
    tracees outlive proot's death, so the group matters there."""
    def take_down(*_):
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)
        if _child:
            os.kill(_child, signal.SIGKILL)
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, take_down)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != builder:  # it ended before we asked
        take_down()


def _fork_exec(argv: list[str], before_exec=None) -> int:
    """Fork, run `before_exec` then exec argv in the child; the parent gets its pid."""
    global _child
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            if before_exec:
                before_exec()
            os.execv(argv[0], argv)
        except OSError as e:
            _fail(f"cannot start {argv[0]}: {e}")
    _child = pid
    return pid


def _exit_as(pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def guard(args: list[str]) -> None:
    """BUILDER COMMAND...: run COMMAND, taken down with the builder (see _watch)."""
    _watch(int(args[0]))
    _exit_as(_fork_exec(args[1:]))


def map_and_exec(uid: int, binds: list[tuple[str, str]], fuse_scratch: str, argv: list[str]) -> None:
    try:
        unshare(CLONE_NEWNS)
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        for src, dest in binds:
            mount(src, dest, None, MS_BIND | MS_REC)
        if fuse_scratch:
            _fuse_device_for(uid, fuse_scratch)
    except OSError as e:
        _fail(f"cannot show the build its files: {e}")
    parent_r, child_w = os.pipe()
    child_r, parent_w = os.pipe()

    def enter_userns():
        try:
            os.close(parent_r)
            os.close(parent_w)
            unshare(CLONE_NEWUSER)
            os.write(child_w, b"u")
            if os.read(child_r, 1) != b"m":
                os._exit(125)
            os.setgroups([])  # the host's supplementary groups grant nothing inside
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
            prctl(PR_SET_NO_NEW_PRIVS, 1)
        except OSError as e:
            _fail(f"cannot enter a user namespace: {e}")

    pid = _fork_exec(argv, enter_userns)
    os.close(child_r)
    os.close(child_w)
    try:
        if os.read(parent_r, 1) != b"u":
            raise OSError("the child died before unsharing")
        for name in ("uid_map", "gid_map"):
            write_file(f"/proc/{pid}/{name}", f"0 {uid} 1")
        os.write(parent_w, b"m")
    except OSError as e:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        _fail(f"cannot map root to uid {uid}: {e}")
    os.close(parent_w)
    _exit_as(pid)


def main(args: list[str]) -> None:
    """BUILDER UID FUSE_SCRATCH N SRC1 DEST1 ... SRCN DESTN COMMAND... (BUILDER: the builder's
    pid; FUSE_SCRATCH: an empty directory for BUILD_UID's /dev/fuse, or "" where the build
    mounts no image)"""
    builder, uid, fuse_scratch, n = int(args[0]), int(args[1]), args[2], int(args[3])
    _watch(builder)
    pairs = args[4:4 + 2 * n]
    map_and_exec(uid, list(zip(pairs[::2], pairs[1::2])), fuse_scratch, args[4 + 2 * n:])
