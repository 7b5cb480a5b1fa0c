"""Per-run cgroups: where they can go on this host (a delegated cgroup v2 subtree, or
the v1 pids hierarchy as root) and one cgroup per run under the holder's own tree.
The run's init (native/init.c) sets its limits there and reads its memory verdict.
Lean, like mounts.py: the holder imports it.
"""

from __future__ import annotations

import os

from .mounts import read_file, write_file

__all__ = ["Cgroups", "locate_cgroups", "start_join_grace_period"]


def _own_cgroups() -> dict[str, str]:
    """controller ("" for v2) -> our cgroup path."""
    out = {}
    for line in read_file("/proc/self/cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                out[controller] = parts[2]
    return out


_FS = "/sys/fs/cgroup"


def _v2_root() -> str:
    """Where cgroup v2 is mounted: the cgroup fs itself, or its unified/ on a hybrid host."""
    return _FS if os.path.exists(f"{_FS}/cgroup.controllers") else f"{_FS}/unified"


def locate_cgroups() -> tuple[str, str] | None:
    """Where per-run cgroups can go, changing nothing: ("v2", dir), the nearest ancestor
    of our cgroup v2 that we own and that hands memory and pids to its children (e.g.
    systemd's user@UID.service); ("v1", dir) in the pids hierarchy as root on cgroup v1
    (RLIMIT_NPROC never limits host root, which the kernel backend's runs are); None:
    rlimits only."""
    own = _own_cgroups()
    v2fs = _v2_root()
    if "" in own and os.path.exists(f"{v2fs}/cgroup.controllers"):
        cg = os.path.normpath(f"{v2fs}/{own['']}")
        while cg.startswith(v2fs):
            try:
                if (os.stat(cg).st_uid == os.getuid() and os.access(cg, os.W_OK)
                        and {"memory", "pids"} <= set(read_file(f"{cg}/cgroup.subtree_control").split())):
                    return "v2", cg
            except OSError:
                break
            cg = os.path.dirname(cg)
    if os.geteuid() == 0 and "pids" in own and os.path.exists(f"{_FS}/pids/cgroup.procs"):
        return "v1", os.path.normpath(f"{_FS}/pids/{own['pids']}")
    return None


def start_join_grace_period(kind: str) -> None:
    """Joining a cgroup waits out an RCU grace period (the kernel's cgroup_threadgroup_rwsem),
    holding the cgroup lock, unless another join came just before: 14 ms here, paid by a new
    holder's first init. Called as a holder is started: a detached shell rejoins its own
    cgroup now, so that the wait passes while the holder starts up (about 15 ms)."""
    import subprocess

    own = _own_cgroups()
    procs = f"{_FS}/pids{own['pids']}/cgroup.procs" if kind == "v1" else f"{_v2_root()}{own['']}/cgroup.procs"
    subprocess.run(["sh", "-c", '(echo 0 > "$0") 2>/dev/null &', procs], stdin=subprocess.DEVNULL)


def _rmdir_cgroups(path: str) -> None:
    """Remove a cgroup tree left by a holder that was killed; busy cgroups stay."""
    try:
        with os.scandir(path) as entries:
            subs = sorted((e.path for e in entries if e.is_dir()), reverse=True)
    except FileNotFoundError:
        return
    for sub in subs:
        try:
            os.rmdir(sub)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def _host_pid() -> int:
    """This process's pid in the pid namespace of /proc (the host's: a holder is pid 1 of its own)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[1])
    return os.getpid()


def _owner_alive(name: str) -> bool:
    """Whether the holder named in image-builder-PID-TOKEN still runs (holders of other
    state dirs share the parent cgroup: their empty trees are not stale)."""
    pid = name.split("-")[2] if name.count("-") == 3 else ""
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")


class Cgroups:
    """image-builder-PID-TOKEN/rN, one cgroup per run (joined by its init before the run is
    asked for: joining costs an RCU grace period), and on v2 holder/ for the holder."""

    def __init__(self, kind: str, parent: str):
        with os.scandir(parent) as entries:
            stale = [e.path for e in entries
                     if e.name.startswith("image-builder-") and e.is_dir() and not _owner_alive(e.name)]
        for path in stale:
            _rmdir_cgroups(path)  # of killed holders: only empty cgroups go
        self.root = f"{parent}/image-builder-{_host_pid()}-{os.urandom(4).hex()}"
        os.mkdir(self.root)
        if kind == "v2":  # no internal processes: the holder lives in a leaf, runs in its siblings
            os.mkdir(f"{self.root}/holder")
            write_file(f"{self.root}/holder/cgroup.procs", "0")
            write_file(f"{self.root}/cgroup.subtree_control", "+memory +pids")
        self.kind = kind
        self.counter = 0
        self.trash: list[str] = []
        self.free: list[str] = []  # v1: empty cgroups of ended runs, for the next ones

    def new(self) -> str:
        if self.free:
            return self.free.pop()
        self.counter += 1
        path = f"{self.root}/r{self.counter}"
        os.makedirs(path)  # v1: an older image-builder's holder starting meanwhile may have removed our empty tree
        return path

    def release(self, path: str) -> None:
        """A run's cgroup once its processes are gone. A v1 pids cgroup is kept for the
        next run (making and removing one costs more than a run's other mounts; its init
        sets its limit again); a v2 one is removed, its memory peak and OOM count being
        its whole life's."""
        if self.kind == "v1" and os.path.isdir(path):
            self.free.append(path)
        else:
            self.remove(path)

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
