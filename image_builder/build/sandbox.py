"""Run a command inside a root filesystem: a user namespace, or proot.

The root filesystem, its base image and the scripts are untrusted, and the builder
may run as root: nothing of the host may be reachable from inside.

- `userns`: new user, mount and pid namespaces; root inside is an ordinary user
  outside. Run by an unprivileged user, that is the user (`unshare --map-root-user`);
  run by root, it is BUILD_UID, a uid of no one (the tree is handed to it first), so a
  script that escapes has no more rights on the node than a stranger. The root is
  entered with pivot_root and the host's root detached (no chroot to break out of);
  it gets a /dev of its own (null, zero, full, random, urandom, tty, pts, shm: no
  block devices), a fresh /proc with host-information files masked and /proc/sys
  read-only (runtime.mounts.PROC_MASKED, PROC_READONLY, as for runs), no /sys, and
  no_new_privs. One id is mapped, so a chown to another one (dpkg's maintainer
  scripts) answers success and does nothing (enter.fake_chown_filter). Every mount
  lives in the namespace and vanishes with it. Costs almost nothing over chroot.
- `proot` (no user namespaces): `proot -0`, ptrace-based and slow on syscall-heavy
  work, and no isolation to speak of: a warning says so, and root never gets it.

The command starts from a clean, declared environment, never the host's (host
`PIP_*` variables once broke pip inside a sandbox). The host's CA bundle and
resolv.conf are passed in so pip and git work behind a TLS-inspecting proxy;
they live on a tmpfs and never end up in the image.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from image_builder.errors import ImageBuilderError
from image_builder.oci.trees import walk
from image_builder.runtime.execution import DEFAULT_PATH, Bind
from image_builder.runtime.extract import remove_proot_leftovers
from image_builder.runtime.mounts import DEV_NODES, PROC_MASKED, PROC_READONLY, RUN_UMASK, squashfuse
from image_builder.store.store import builder_mark, dead_builder, remove_tree
from .cutoff_index import cutoff_index
from .enter import PIVOT, fake_chown_filter

CA_IN_SANDBOX = "/tmp/.image-builder/ca.pem"
APT_CONF_IN_SANDBOX = "/tmp/.image-builder/apt.conf"
# Passed through from the host so builds work behind a proxy.
PROXY_VARS = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ftp_proxy")
# The host's name files a build sees over the tree's, so pip and git resolve as on the host and
# `localhost` resolves where the tree has no /etc/hosts, as apptainer binds them.
HOST_NAME_FILES = ("resolv.conf", "hosts")
CA_VARS = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE",
           "NODE_EXTRA_CA_CERTS")
HOST_CA_CANDIDATES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
                      "/etc/ssl/cert.pem")


class SandboxError(ImageBuilderError):
    pass


class BuildBackend(str, enum.Enum):
    USERNS = "userns"
    PROOT = "proot"


# Root builds run as this uid: above every range useradd hands out as subordinate ids
# (SUB_UID_MAX, 600100000), so no user's rootless containers share it.
BUILD_UID = int(os.environ.get("IMAGE_BUILDER_BUILD_UID", "2147000000"))
STAGING = "ib-sandbox-"  # a sandbox's staging folder (run)


@functools.cache
def userns_available() -> bool:
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def detect_backend() -> BuildBackend:
    if os.geteuid() == 0:
        return BuildBackend.USERNS  # root maps the namespace itself: no sysctl can refuse it
    if userns_available():
        return BuildBackend.USERNS
    if shutil.which("proot"):
        return BuildBackend.PROOT
    raise SandboxError("no sandbox backend: not root, user namespaces are disabled and proot is not installed; "
                       "install proot or ask the admin to allow unprivileged user namespaces")


def host_ca_bundle() -> Path | None:
    for candidate in (os.environ.get("SSL_CERT_FILE"), os.environ.get("REQUESTS_CA_BUNDLE"), *HOST_CA_CANDIDATES):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@dataclass(frozen=True)
class SquashImage:
    path: Path  # a .sqfs, or a .sif whose partition starts at offset
    offset: int = 0


@dataclass(frozen=True)
class Overlay:
    """Read-only squashfs layers (bottom first) under a writable upper directory.

    Writes land in `upper` as overlayfs records them (whiteouts as 0:0
    character devices), which is exactly what an instance adds.
    """
    lowers: tuple[SquashImage, ...]
    upper: Path
    work: Path  # overlayfs scratch, in the same directory as upper


@dataclass(frozen=True)
class SandboxSpec:
    root: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of the clean base environment
    workdir: str = "/"
    binds: tuple[Bind, ...] = ()
    host_network_files: bool = True  # resolv.conf, hosts, CA bundle and proxy variables from the host
    overlay: Overlay | None = None  # root is then an empty mount point for the stacked layers


@dataclass(frozen=True)
class Result:
    returncode: int
    timed_out: bool
    seconds: float
    tail: tuple[str, ...]  # the last lines of output (pip's [notice] lines left out)
    around_error: tuple[str, ...] = ()  # the lines around the first error line, if there is one

    @property
    def failure_lines(self) -> tuple[str, ...]:
        """What a failed build shows: the first error in context (a compiler's error comes long before pip's
        closing noise), else the last lines."""
        return self.around_error or self.tail


# A line that reports an error: gcc's `x.c:1: error:`, make's `Error 1`, pip's `ERROR:`, a Python exception.
# Not `-Werror`/`-Wno-error` flags or strerror in configure output.
ERROR_LINE = re.compile(r"(?<![\w-])error:|(?<![\w-])(?:Error|ERROR)(?=[:\s]|$)|\w+Error:")
NOTICE_LINE = re.compile(r"^\s*\[notice\]")  # pip's "A new release of pip is available"
LINES_BEFORE_ERROR, LINES_AFTER_ERROR = 5, 10


def clean_env(spec: SandboxSpec) -> dict[str, str]:
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": os.environ.get("TERM", "dumb"),
           "USER": "root", "LOGNAME": "root"}
    if spec.host_network_files:
        env.update({k: os.environ[k] for k in PROXY_VARS if k in os.environ})
        if host_ca_bundle():
            env.update({k: CA_IN_SANDBOX for k in CA_VARS})
    env["APT_CONFIG"] = APT_CONF_IN_SANDBOX  # one uid is mapped: apt cannot drop to its _apt sandbox user
    if os.environ.get("SOURCE_DATE_EPOCH"):
        env["SOURCE_DATE_EPOCH"] = os.environ["SOURCE_DATE_EPOCH"]
    env.update(spec.env)
    return env


# Mount targets are checked inside the namespace, where an overlay root is
# visible: a symlinked component could point anywhere, so it is refused; a
# missing target is created and logged, so it can be removed after the run.
_TARGET_FN = r"""target() {
  p="$R"
  for c in $(echo "$1" | tr / ' '); do
    p="$p/$c"
    if [ -L "$p" ]; then echo "image-builder: /$1 is a symlink in the image; not mounting over it" >&2; return 1; fi
  done
  if [ ! -e "$p" ]; then
    if [ "$2" = dir ]; then mkdir -p "$p"; else mkdir -p "$(dirname "$p")" && : > "$p"; fi
    echo "$1" >> "$S/created"
  fi
}"""


def _remove_created(root: Path, staging: Path) -> None:
    """Remove the mount points the prelude had to create, if nothing was put in them."""
    try:
        created = (staging / "created").read_text().split()
    except OSError:
        return
    for rel in reversed(created):
        p = root / rel
        try:
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
            elif p.stat().st_size == 0:
                p.unlink()
        except OSError:
            pass  # a script put something there: it belongs to the image now


class _HostPaths:
    """Where the sandbox's side sees host paths. An unprivileged build sees them where
    they are. A root build's sandbox user (BUILD_UID) may not be able to reach them (a
    store under /root): enter.py binds each under the staging directory first."""

    def __init__(self, staging: Path):
        self.staging = staging
        self.binds: list[tuple[str, str]] = []

    def __call__(self, path: Path, name: str) -> str:
        if os.geteuid() != 0:
            return str(path)
        dest = self.staging / "host" / name
        if not dest.parent.exists():
            dest.parent.mkdir()
            dest.parent.chmod(0o755)  # BUILD_UID goes through it, whatever the builder's umask (077: EACCES)
        if path.is_dir():
            dest.mkdir()
        else:
            dest.touch()
        self.binds.append((str(path), str(dest)))
        return str(dest)


def _overlay_lines(spec: SandboxSpec, mount: str, host: _HostPaths) -> list[str]:
    """Mount the lower images and stack them under an overlay at $R (inside the namespace)."""
    ov = spec.overlay
    lines, lowers = [], []
    program = squashfuse()
    if os.sep in program:
        program = host(Path(program), "squashfuse")
    for i, image in enumerate(ov.lowers):
        point, path = f'"$S/lower{i}"', shlex.quote(host(image.path, f"image{i}"))
        lowers.append(f"$S/lower{i}")
        lines.append(f"mkdir {point}")
        # The squashfuse daemon lives in the pid namespace and dies with it.
        lines.append(f"{shlex.quote(program)} -o offset={image.offset} {path} {point}")
    # overlayfs lists the top layer first; its option string cannot hold commas or colons in paths.
    if ov.upper.parent != ov.work.parent:  # overlayfs wants them under one mount: one bind shows both
        raise SandboxError(f"overlay work dir {ov.work} must be beside its upper dir {ov.upper}")
    both = host(ov.upper.parent, "overlay")
    lines += [f"U={shlex.quote(f'{both}/{ov.upper.name}')}", f"W={shlex.quote(f'{both}/{ov.work.name}')}"]
    options = f"lowerdir={':'.join(reversed(lowers))},upperdir=$U,workdir=$W"
    options += ",userxattr"  # overlayfs in a user namespace: user.overlay.* xattrs
    lines.append(f'{mount} -t overlay overlay -o "{options}" "$R"')
    return lines


def _namespace_command(spec: SandboxSpec, argv: list[str], staging: Path) -> list[str]:
    """unshare + a small sh prelude doing the mounts, then enter.PIVOT into the root.
    Host tools by absolute path (they are gone after the pivot)."""
    tool = {t: shutil.which(t) or f"/usr/bin/{t}" for t in ("mount", "unshare")}
    mount = tool["mount"]
    q = shlex.quote
    host = _HostPaths(staging)
    root = host(spec.root, "root")
    lines = ["set -e", f"R={q(root)}", f"S={q(str(staging))}", _TARGET_FN]
    if spec.overlay:
        lines += _overlay_lines(spec, mount, host)
    else:
        lines.append(f'{mount} --bind "$R" "$R"')  # pivot_root wants a mount point
    nodes = " ".join(DEV_NODES)
    lines += ['if target dev dir; then',
              f'  {mount} -t tmpfs -o nosuid,noexec,mode=755,size=64k dev "$R/dev"',
              f'  for n in {nodes}; do : > "$R/dev/$n"; {mount} --bind "/dev/$n" "$R/dev/$n"; done',
              '  mkdir "$R/dev/pts" "$R/dev/shm"',
              f'  {mount} -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$R/dev/pts"',
              f'  {mount} -t tmpfs -o nosuid,nodev,mode=1777 shm "$R/dev/shm"',
              '  ln -s pts/ptmx "$R/dev/ptmx"; ln -s /proc/self/fd "$R/dev/fd"',
              '  ln -s /proc/self/fd/0 "$R/dev/stdin"; ln -s /proc/self/fd/1 "$R/dev/stdout"; '
              'ln -s /proc/self/fd/2 "$R/dev/stderr"',
              'fi',
              'if target proc dir; then',
              f'  {mount} -t proc -o nosuid,nodev,noexec proc "$R/proc"',
              f'  for p in {" ".join(PROC_MASKED)}; do',
              f'    if [ -d "$R/proc/$p" ]; then {mount} -t tmpfs -o ro,nosuid,nodev,noexec,mode=555 mask "$R/proc/$p"',
              f'    elif [ -e "$R/proc/$p" ]; then {mount} --bind /dev/null "$R/proc/$p"; fi',
              '  done',
              f'  for p in {" ".join(PROC_READONLY)}; do',
              f'    if [ -e "$R/proc/$p" ]; then {mount} --bind "$R/proc/$p" "$R/proc/$p" && '
              f'{mount} -o remount,bind,ro,nosuid,nodev,noexec "$R/proc/$p"; fi',
              '  done',
              'fi',
              'target tmp dir',
              f'{mount} -t tmpfs -o nosuid,nodev,mode=1777 tmpfs "$R/tmp"',
              'mkdir "$R/tmp/.image-builder" && cp -a "$S/files/." "$R/tmp/.image-builder/"']
    for name in HOST_NAME_FILES:
        if spec.host_network_files and Path(f"/etc/{name}").exists():
            lines.append(f'if target etc/{name} file; then {mount} --bind /etc/{name} "$R/etc/{name}" && '
                         f'{mount} -o remount,bind,ro "$R/etc/{name}"; fi')
    for i, b in enumerate(spec.binds):
        rel = b.dest.strip("/")
        if ".." in Path(rel).parts:
            raise SandboxError(f"bind target {b.dest!r} leaves the root")
        lines.append(f"target {q(rel)} {'dir' if b.src.is_dir() else 'file'}")
        lines.append(f'{mount} --bind {q(host(b.src, f"bind{i}"))} "$R"/{q(rel)}')
        if b.readonly:
            lines.append(f'{mount} -o remount,bind,ro "$R"/{q(rel)}')
    # The base interpreter: a venv's may lie where the sandbox's user cannot read.
    python = os.path.realpath(sys.executable)
    bpf = fake_chown_filter(os.uname().machine).hex()
    lines.append("exec " + " ".join(q(a) for a in [python, "-S", "-E", "-c", PIVOT, root, spec.workdir, bpf, *argv]))
    inner = [tool["unshare"], "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private",
             "--", "/bin/sh", "-c", "\n".join(lines)]
    if os.geteuid() != 0:
        return _entered("guard", str(os.getpid()), tool["unshare"], "--user", "--map-root-user", *inner[1:])
    pairs = [p for pair in host.binds for p in pair]
    fuse_scratch = ""
    if spec.overlay:  # squashfuse runs as BUILD_UID: enter.py gives it a /dev/fuse it can open
        fuse_scratch = str(staging / "fuse")
        os.mkdir(fuse_scratch, 0o700)
    return _entered("main", str(os.getpid()), str(BUILD_UID), fuse_scratch, str(len(host.binds)), *pairs, *inner)


def _entered(step: str, *args: str) -> list[str]:
    """A step of enter.py with its arguments, run by this interpreter without site (-S) or the caller's
    PYTHON* variables (-E)."""
    boot = (f"import sys; sys.path[:0] = [{str(Path(__file__).resolve().parents[2])!r}]; "
            f"from image_builder.build.enter import {step}; {step}(sys.argv[1:])")
    return [sys.executable, "-S", "-E", "-c", boot, *args]


def _proot_command(spec: SandboxSpec, argv: list[str], tmp: Path) -> list[str]:
    proot = shutil.which("proot")
    if not proot:
        raise SandboxError("the proot backend needs proot on PATH; install it, or use --backend userns")
    cmd = [proot, "-0", "-r", str(spec.root), "-b", "/dev", "-b", "/proc", "-b", "/sys",
           "-b", f"{tmp}:/tmp", "-w", spec.workdir]
    for name in HOST_NAME_FILES:
        if spec.host_network_files and Path(f"/etc/{name}").exists():
            cmd += ["-b", f"/etc/{name}"]
    for b in spec.binds:
        cmd += ["-b", f"{b.src}:{b.dest}"]  # proot has no read-only binds
    return [*cmd, *argv]


def hand_over(tree: Path) -> None:
    """Give `tree` to BUILD_UID, root inside a root build's namespace (entries it
    already owns are only looked at: 40 ms for a 20,000-file tree here). chown clears
    setuid and setgid bits, so modes are put back."""
    for path in (tree, *_walk(tree)):
        st = os.lstat(path)
        if st.st_uid == BUILD_UID and st.st_gid == BUILD_UID:
            continue
        os.lchown(path, BUILD_UID, BUILD_UID)
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISLNK(st.st_mode):
            os.chmod(path, stat.S_IMODE(st.st_mode))


def _walk(tree: Path):
    for dirpath, dirnames, filenames in walk(tree):
        for name in (*dirnames, *filenames):
            yield os.path.join(dirpath, name)


def _stage(staging: Path, spec: SandboxSpec, files: dict[str, Path | bytes]) -> None:
    """Files the sandbox sees under /tmp/.image-builder (a tmpfs, never packed)."""
    staging.mkdir(parents=True, exist_ok=True)
    for rel, src in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, bytes):
            (staging / rel).write_bytes(src)
        else:
            shutil.copyfile(src, staging / rel)
    ca = host_ca_bundle() if spec.host_network_files else None
    if ca:
        shutil.copyfile(ca, staging / "ca.pem")
    (staging / "apt.conf").write_text('APT::Sandbox::User "root";\n')


def run(spec: SandboxSpec, argv: list[str], *, backend: BuildBackend | None = None, timeout: float | None = None,
        log: Path | None = None, echo: bool = False, interactive: bool = False, tail_lines: int = 20,
        files: dict[str, Path | bytes] | None = None) -> Result:
    """Run argv in the sandbox; output goes to `log` (and the terminal with echo).

    On timeout the whole process group is killed; the pid namespace takes any
    daemon or double-forked child with it.
    """
    backend = backend or detect_backend()
    if backend is BuildBackend.PROOT and os.geteuid() == 0:
        raise SandboxError("proot cannot keep a root build off the host; use the userns backend (the default as root)")
    if not spec.overlay and not (spec.root / "bin" / "sh").exists() and not (spec.root / "bin").is_symlink():
        raise SandboxError(f"{spec.root}: no /bin/sh in the root filesystem; is it a Linux image?")
    # Staged beside the root, in the build's work tree: a builder killed outright (SIGKILL, OOM) leaves it
    # there, where the next build sweeps dead builds' trees (store.remove_dead_work), not in /tmp for good.
    # A root build's sandbox user must reach it (_HostPaths): in /tmp where the tree is not (under /root),
    # named by node and builder for the next root build to sweep (remove_dead_staging).
    near = spec.root.parent
    in_tmp = os.geteuid() == 0 and not _others_can_reach(near)
    with tempfile.TemporaryDirectory(prefix=f"{STAGING}{builder_mark()}-" if in_tmp else STAGING,
                                     dir=None if in_tmp else near) as tmp:
        staging = Path(tmp)
        # What the sandbox sees under /tmp/.image-builder: host CA bundle, apt.conf, staged files.
        _stage(staging / "files", spec, files or {})
        if os.geteuid() == 0:  # userns: proot is refused above
            for tree in (staging, *((spec.overlay.upper, spec.overlay.work) if spec.overlay else (spec.root,))):
                hand_over(tree)
        fuse_mounts: list[Path] = []
        try:
            if backend is BuildBackend.PROOT:
                if spec.overlay:
                    fuse_mounts = _fuse_overlay(spec, staging)
                scratch = staging / "tmp"
                scratch.mkdir(mode=0o1777)
                shutil.copytree(staging / "files", scratch / ".image-builder")
                cmd = _entered("guard", str(os.getpid()), *_proot_command(spec, argv, scratch))
            else:
                cmd = _namespace_command(spec, argv, staging)
            env = clean_env(spec)
            with cutoff_index(env) as index_env:  # the step's pips resolve as of its PIP_UPLOADED_PRIOR_TO
                env.update(index_env)
                t0 = time.monotonic()
                if interactive:
                    status = subprocess.Popen(cmd, env=env, umask=RUN_UMASK).wait()
                    return Result(status, False, time.monotonic() - t0, ())
                return _supervise(cmd, env, timeout, log, echo, tail_lines, t0)
        finally:
            for point in reversed(fuse_mounts):
                subprocess.run(["fusermount3", "-u", "-z", str(point)], capture_output=True)
            if backend is BuildBackend.PROOT:  # a proot killed at a timeout, or a killed build's before
                remove_proot_leftovers()
            _remove_created(spec.overlay.upper if spec.overlay else spec.root, staging)


def remove_dead_staging() -> list[str]:
    """Root builds' staging folders in the temporary folder whose builder is gone (killed outright: its
    TemporaryDirectory never cleaned up; two a killed `build -j 2`). Only this node's, only folders of root's
    or handed to BUILD_UID (no user but root can make either: a builder killed before it handed its folder
    over left it root's, which the next build kept for good), only of builders with no process."""
    if os.geteuid() != 0:
        return []
    prefix, removed = f"{STAGING}{socket.gethostname()}@", []
    for entry in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
        pid = entry.name[len(prefix):].split("-", 1)[0]  # STAGING NODE@PID-random (a node's name may hold '-')
        try:
            st = entry.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid in (0, BUILD_UID) and dead_builder(f"{socket.gethostname()}@{pid}"):
            remove_tree(entry)
            removed.append(str(entry))
    return removed


def _others_can_reach(path: Path) -> bool:
    """Whether a user who owns none of path's folders may go through each (o+x all the way down)."""
    path = path.resolve()
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in (path, *path.parents))


def _fuse_overlay(spec: SandboxSpec, staging: Path) -> list[Path]:
    """proot cannot mount: stack the layers on the host with squashfuse and fuse-overlayfs."""
    mounted: list[Path] = []
    try:
        lowers = []
        for i, image in enumerate(spec.overlay.lowers):
            point = staging / f"lower{i}"
            point.mkdir()
            subprocess.run([squashfuse(), "-o", f"offset={image.offset}", str(image.path), str(point)],
                           check=True, capture_output=True)
            mounted.append(point)
            lowers.append(str(point))
        subprocess.run(["fuse-overlayfs", "-o", f"lowerdir={':'.join(reversed(lowers))},"
                        f"upperdir={spec.overlay.upper},workdir={spec.overlay.work}", str(spec.root)],
                       check=True, capture_output=True)
        mounted.append(spec.root)
        return mounted
    except subprocess.CalledProcessError as e:
        for point in reversed(mounted):
            subprocess.run(["fusermount3", "-u", "-z", str(point)], capture_output=True)
        raise SandboxError(f"cannot mount the layers with FUSE: {e.stderr.decode(errors='replace').strip()}; "
                           "is /dev/fuse usable by this user?") from e


# The sandboxes this process runs (their process groups), for halted(); while halted, none starts.
_running: set[int] = set()
_running_lock = threading.Lock()
_halting = False


@contextlib.contextmanager
def halted():
    """Kill every sandbox this process runs and start none until the block ends: what a
    builder does on Ctrl-C or SIGTERM while worker threads run scripts, the block being its
    wait for those workers (without it the wait lasted as long as the slowest script)."""
    global _halting
    with _running_lock:
        _halting = True
        for pgid in _running:
            _kill_group(pgid)
    try:
        yield
    finally:
        with _running_lock:
            _halting = False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_for_group(leader: int, limit: float = 5.0) -> None:
    """Until the processes of `leader`'s group (all of a killed sandbox's: SIGKILL is delivered at once,
    the exit takes a while) are gone, or `limit` seconds: a proot still exiting when the build looked
    for proot's leftovers in /tmp kept them (remove_proot_leftovers). The leader's zombie, not reaped
    yet, keeps its pid, so the group's id cannot be another's meanwhile."""
    deadline = time.monotonic() + limit
    while _other_members(leader) and time.monotonic() < deadline:
        time.sleep(0.01)


def _other_members(leader: int) -> bool:
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if pid != leader and os.getpgid(pid) == leader:
                return True
        except OSError:  # gone meanwhile
            pass
    return False


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    with _running_lock:
        if _halting:
            raise SandboxError("the build is stopping; no new sandbox starts")
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, umask=RUN_UMASK)
        _running.add(proc.pid)
        return proc


def _supervise(cmd, env, timeout, log, echo, tail_lines, t0) -> Result:
    tail: deque[str] = deque(maxlen=tail_lines)
    around_error: list[str] = []
    after = -1  # lines still to keep after the first error line; -1: none seen yet
    timed_out = False
    log_file = open(log, "ab") if log else None
    try:
        proc = _start(cmd, env)
        deadline = t0 + timeout if timeout else None

        def kill(*_):
            _kill_group(proc.pid)

        timer = threading.Timer(max(0.0, deadline - time.monotonic()), kill) if deadline else None
        if timer:
            timer.start()
        try:
            for line in proc.stdout:
                if log_file:
                    log_file.write(line)
                if echo:
                    sys.stderr.buffer.write(line)
                    sys.stderr.flush()
                text = line.decode(errors="replace").rstrip("\n")
                if NOTICE_LINE.match(text):
                    continue
                if after > 0:
                    around_error.append(text)
                    after -= 1
                elif after < 0 and ERROR_LINE.search(text):
                    around_error = [*list(tail)[-LINES_BEFORE_ERROR:], text]
                    after = LINES_AFTER_ERROR
                tail.append(text)
        except BaseException:  # Ctrl-C: take the whole sandbox down with us
            kill()
            raise
        finally:
            if timer:
                timer.cancel()
            # Out of _running before it is reaped: its pid, free after, may name another's group.
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            _wait_for_group(proc.pid)
            with _running_lock:
                _running.discard(proc.pid)
            code = proc.wait()
        timed_out = bool(deadline) and time.monotonic() >= deadline and code != 0
    finally:
        if log_file:
            log_file.close()
    return Result(code, timed_out, time.monotonic() - t0, tuple(tail), tuple(around_error))
