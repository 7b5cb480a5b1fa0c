"""The per-user holder process: it keeps layers mounted, and forks the inits that
give each run a fresh writable root over them (built from image_builder.mounts).
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
  namespace for its overlay), and fork() of a Python process costs about 1 ms
  here with its exit. So the holder forks each run's init ahead of time, at a
  session's request, and hands the session the init's control socket: the init
  builds the root (tmpfs upper + overlay, /proc, /dev, pivot_root) and drops
  privileges while the session is busy elsewhere; a run then sends its job to a
  ready init, which posix_spawns the command (vfork: no second fork), waits and
  answers. The holder is not on a run's path. Being pid 1, the init kills every
  other process of the run when the command ends.
- Setting up and tearing down a root costs about 3 ms of CPU here (fork and exit
  of a Python process, a dozen mounts, namespaces), about as much as bwrap's: a
  run that left its root untouched (see _init_main) gets the same init back for
  its next run, which then costs a message and a posix_spawn.
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
                      (size -1: path is a directory, bound read-only)
                      "linger": s, "scratch_mb": n}        answer {"spec": {...}} or {"error": text}
  session -> holder  {"op": "init", "network": b}          answer {"network": b} + the init's control socket
  session -> init    {"argv", "env", "workdir", "files": {path: bytes}, "timeout", "memory_mb",
                      "max_processes"} + stdin, stdout, stderr (a big job: {"payload": n} + a memfd)
  init -> session    {"exit_code", "signal", "timed_out", "peak_memory_kb", "out_of_memory", "reusable"}
                     or {"error"}; after "reusable": true the session may send the next job on the socket
"""

from __future__ import annotations

import array
import errno
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

from .cgroups import Cgroups, cgroup_limits, cgroup_verdict, locate_cgroups
from .mounts import (CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER, MS_NODEV, MS_NOSUID, MS_RDONLY, MS_REC,
                     MS_SLAVE, PR_SET_DUMPABLE, PR_SET_PDEATHSIG, RootSpec, RunnerError, bind_readonly, dev_template,
                     enter_root, fuse_mount, hold_tree, loop_mount, loopback_up, map_root, mount, prctl, setns,
                     umount, unshare)

__all__ = ["DEFAULT_MAX_PROCESSES", "IDLE_INIT", "INLINE_JOB", "holder_main", "recv_fds", "run_joined", "send_fds"]

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
    memory_in_cgroup = cgroup is not None and cgroup_limits(cgroup, job["memory_mb"], job["max_processes"])
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
    _end_all()
    oom, peak = cgroup_verdict(cgroup) if cgroup is not None else (None, None)
    return {"exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": timed_out, "peak_memory_kb": peak or usage.ru_maxrss, "out_of_memory": oom}


def _end_all() -> None:
    """From pid 1: kill every other process of the run (double forks and daemons too) and
    reap them, so none outlives its run or holds its output open."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:  # nothing left
        return
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


SCRATCH_DIRS = ("/tmp", "/dev/shm")  # tmpfs of a run's own (mounts.enter_root)


def _traces(upper: int) -> tuple:
    """What a run could leave for the next run in the same root: entries, owner, mode,
    xattrs and times of the writable layer's top, the same but times of /tmp and
    /dev/shm (tmpfs of their own, emptied after each run), SysV IPC objects, and keys
    (counted per user of this user namespace). What else it could change, it cannot: it
    owns no namespace."""
    marks = []
    for fd, times in ((upper, True), *((d, False) for d in SCRATCH_DIRS)):
        st = os.stat(fd)
        marks += [os.listdir(fd), os.listxattr(fd), st.st_mode, st.st_uid, st.st_gid]
        marks += [st.st_mtime_ns, st.st_ctime_ns] if times else []
    for name in ("sysvipc/shm", "sysvipc/msg", "sysvipc/sem", "key-users"):
        try:
            with open(f"/proc/{name}", "rb") as f:
                marks.append(f.read())
        except FileNotFoundError:  # a kernel without SysV IPC or keys: nothing to leave there
            marks.append(b"")
    return tuple(map(str, marks))


def _empty(dir_fd: int, dev: int) -> None:
    """Remove everything under a directory of file system `dev`, following no symlink and
    entering no other file system (the run's processes are gone: nothing adds entries
    meanwhile). Whatever fails leaves the root unreusable."""
    for name in os.listdir(dir_fd):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except IsADirectoryError:
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                if os.fstat(sub).st_dev != dev:
                    raise OSError(errno.EXDEV, "a mount point", name) from None
                _empty(sub, dev)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=dir_fd)


def _empty_scratch(spec: RootSpec) -> bool:
    """Empty the run's /tmp and /dev/shm (tmpfs of their own) for a next run in this
    root; False if something stays, or if a host path is bound there (never emptied)."""
    bound = [os.path.normpath("/" + dest.lstrip("/")).rstrip("/") + "/" for _, dest, _ in spec.binds]
    if spec.upper or any(b.startswith(d + "/") or (d + "/").startswith(b) for b in bound for d in SCRATCH_DIRS):
        return False
    for path in SCRATCH_DIRS:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            _empty(fd, os.fstat(fd).st_dev)
        except (OSError, RecursionError):
            return False
        finally:
            os.close(fd)
    return True


def _init_main(spec: RootSpec, ctl: socket.socket) -> None:
    """An init forked ahead of time: build the root, wait for a job from the session
    holding the other end of `ctl`, run it, answer there. A setup error is kept and
    given to that session; EOF before a job means the init was not needed.

    A run that left its root as it found it (it wrote nothing but in /tmp or /dev/shm,
    which are emptied: a test that only reads, `python3 -c pass`, a grader's case whose
    files are in /tmp) and all of whose processes are gone leaves nothing a next run
    could see, so the init offers itself for another job ("reusable"), saving the fork,
    the mounts and their teardown. Not under cgroup v2 memory accounting, whose peak and
    OOM counters are the cgroup's whole life."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    error = None
    cgroup = upper = None
    try:
        cgroup, upper = enter_root(spec)
    except (OSError, RunnerError) as e:
        error = f"cannot build the instance's root: {e}"
    # The command runs as the same uid as this init: it could ptrace the init (or read
    # /proc/1/fd) and forge the answer. Non-dumpable, the init can only be traced with
    # CAP_SYS_PTRACE in the namespace its memory was made in: the host's. (Not before
    # enter_root: its own /proc files become root's, uid_map included.)
    prctl(PR_SET_DUMPABLE, 0)
    pristine = _traces(upper) if error is None else None
    while True:
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
            except (OSError, RunnerError) as e:
                error = str(e) if isinstance(e, RunnerError) else f"cannot start {job['argv'][0]!r}: {e}"
        if error is not None:
            send_fds(ctl, {"error": error})
            return
        if out is None:
            return
        out["reusable"] = (not out["timed_out"] and out["out_of_memory"] is None and _empty_scratch(spec)
                           and _traces(upper) == pristine)
        send_fds(ctl, out)
        if not out["reusable"]:
            return


# --- the holder -----------------------------------------------------------------------------------

_STARTUP_GRACE = 10.0  # seconds a new holder waits for its first client
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

    def __init__(self, kernel: bool, base: str, cgroups: Cgroups | None):
        self.kernel = kernel
        self.base = base
        self.cgroups = cgroups
        self.layers: dict[tuple, _Mounted] = {}
        self.stacks: dict[tuple, _Mounted] = {}
        self.sessions: dict[socket.socket, _Session] = {}
        self.inits: dict[int, _Init] = {}
        # A ready init (made when, its control socket) per lingering session spec: a fresh
        # process's session (`image-builder run`, once per command) starts on it instead of
        # waiting 10-20 ms for one to be forked and set up (joining a cgroup waits for RCU).
        self.spares: dict[tuple, tuple[float, socket.socket]] = {}
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
        spec = {"base": self.base, "lower": stack.path, "userxattr": not self.kernel,
                "binds": tuple(tuple(b) for b in msg["binds"]), "scratch_mb": msg["scratch_mb"]}
        self.sessions[conn] = _Session(stack, spec, msg["linger"])
        send_fds(conn, {"spec": spec})

    def _fill_netns(self) -> None:
        """Isolated network namespaces with lo up, for the next inits. Making one costs
        about 2.5 ms of CPU here (and more to tear down), so each is reused, by one run
        after another: a run holds it alone, and what it leaves behind dies with its
        processes. Where none can be made, inits make their own (and say why not)."""
        # A child makes them: without privileges on the host's namespace, a process that
        # leaves it cannot come back.
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                for _ in range(_NETNS_BATCH):
                    unshare(CLONE_NEWNET)
                    loopback_up()
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

    @staticmethod
    def _spare_key(sess: _Session) -> tuple:
        return sess.spec["lower"], sess.spec["binds"], sess.spec["scratch_mb"]

    def _fork_init(self, sess: _Session, network: bool) -> socket.socket:
        """A new init for `sess`; returns the session's end of its control socket."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cgroup = self.cgroups.new() if self.cgroups else None
        # With none in the pool (a new holder), the init makes its own rather than wait for a batch.
        netns = self.free_netns.pop() if not network and self.free_netns else None
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
        for s in (self.listener, session_end, *self.conns.values(), *(ctl for _, ctl in self.spares.values())):
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
                made, ctl = self.spares.pop(self._spare_key(sess), (0.0, None)) if not network else (0.0, None)
                if ctl is not None and time.monotonic() - made > IDLE_INIT / 2:  # it leaves soon
                    ctl.close()
                    ctl = None
                try:
                    ctl = ctl or self._fork_init(sess, network)
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
        if sess is not None:  # a session ends with its connection
            del self.sessions[conn]
            self._release(sess.stack, sess.linger)
            if sess.linger and self._spare_key(sess) not in self.spares:
                try:
                    self.spares[self._spare_key(sess)] = (time.monotonic(), self._fork_init(sess, False))
                except (OSError, RunnerError):
                    pass  # the next session forks its own
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
        dev_template("dev")
        holder = Holder(kernel, base, None)
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
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            for fd in ns:
                setns(fd)
            unshare(CLONE_NEWPID)
            inner = os.fork()
            if inner == 0:
                try:
                    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                    cgroup, upper = enter_root(spec)
                    os.close(upper)
                    out = run_job(job, (0, 1, 2), client=None, cgroup=cgroup, session=False)
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
