"""Run a command inside a root filesystem: chroot, user namespace or proot.

- `chroot` (root): a new mount and pid namespace, then chroot. Every mount
  lives in that namespace, so it vanishes with it: nothing is left mounted
  after a failure, a timeout or Ctrl-C.
- `userns` (unprivileged, where user namespaces are allowed): the same, in a
  new user namespace mapping the caller to root. Costs almost nothing over chroot.
- `proot` (anything else): `proot -0`, ptrace-based and slow on syscall-heavy work.

The command starts from a clean, declared environment, never the host's (host
`PIP_*` variables once broke pip inside a sandbox). The host's CA bundle and
resolv.conf are passed in so pip and git work behind a TLS-inspecting proxy;
they live on a tmpfs and never end up in the image.
"""

from __future__ import annotations

import enum
import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from image_builder.errors import ImageBuilderError
from image_builder.runtime.execution import DEFAULT_PATH, Bind
from image_builder.runtime.mounts import squashfuse

CA_IN_SANDBOX = "/tmp/.image-builder/ca.pem"
APT_CONF_IN_SANDBOX = "/tmp/.image-builder/apt.conf"
# Passed through from the host so builds work behind a proxy.
PROXY_VARS = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ftp_proxy")
CA_VARS = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE",
           "NODE_EXTRA_CA_CERTS")
HOST_CA_CANDIDATES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
                      "/etc/ssl/cert.pem")


class SandboxError(ImageBuilderError):
    pass


class BuildBackend(str, enum.Enum):
    CHROOT = "chroot"
    USERNS = "userns"
    PROOT = "proot"


@functools.cache
def userns_available() -> bool:
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def detect_backend() -> BuildBackend:
    if os.geteuid() == 0:
        return BuildBackend.CHROOT
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
    work: Path  # overlayfs scratch, on the same filesystem as upper


@dataclass(frozen=True)
class SandboxSpec:
    root: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of the clean base environment
    workdir: str = "/"
    binds: tuple[Bind, ...] = ()
    host_network_files: bool = True  # resolv.conf, CA bundle and proxy variables from the host
    overlay: Overlay | None = None  # root is then an empty mount point for the stacked layers


@dataclass(frozen=True)
class Result:
    returncode: int
    timed_out: bool
    seconds: float
    tail: tuple[str, ...]  # the last lines of output


def clean_env(spec: SandboxSpec, backend: BuildBackend) -> dict[str, str]:
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": os.environ.get("TERM", "dumb"),
           "USER": "root", "LOGNAME": "root"}
    if spec.host_network_files:
        env.update({k: os.environ[k] for k in PROXY_VARS if k in os.environ})
        if host_ca_bundle():
            env.update({k: CA_IN_SANDBOX for k in CA_VARS})
    if backend is not BuildBackend.CHROOT:
        # One uid is mapped: apt cannot drop to its _apt sandbox user.
        env["APT_CONFIG"] = APT_CONF_IN_SANDBOX
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


def _overlay_lines(spec: SandboxSpec, backend: BuildBackend, mount: str) -> list[str]:
    """Mount the lower images and stack them under an overlay at $R (inside the namespace)."""
    ov = spec.overlay
    lines, lowers = [], []
    for i, image in enumerate(ov.lowers):
        point, path = f'"$S/lower{i}"', shlex.quote(str(image.path))
        lowers.append(f"$S/lower{i}")
        lines.append(f"mkdir {point}")
        if backend is BuildBackend.CHROOT:
            lines.append(f"{mount} -t squashfs -o loop,ro,offset={image.offset} {path} {point}")
        else:  # the squashfuse daemon lives in the pid namespace and dies with it
            lines.append(f"{shlex.quote(squashfuse())} -o offset={image.offset} {path} {point}")
    # overlayfs lists the top layer first; its option string cannot hold commas or colons in paths.
    lines += [f"U={shlex.quote(str(ov.upper))}", f"W={shlex.quote(str(ov.work))}"]
    options = f"lowerdir={':'.join(reversed(lowers))},upperdir=$U,workdir=$W"
    options += ",userxattr" if backend is BuildBackend.USERNS else ""  # unprivileged overlay: user.overlay.* xattrs
    lines.append(f'{mount} -t overlay overlay -o "{options}" "$R"')
    return lines


def _namespace_command(spec: SandboxSpec, backend: BuildBackend, argv: list[str], staging: Path) -> list[str]:
    """unshare + a small sh prelude doing the mounts, then chroot. Host tools by absolute path."""
    tool = {t: shutil.which(t) or f"/usr/bin/{t}" for t in ("mount", "chroot", "unshare")}
    mount = tool["mount"]
    q = shlex.quote
    lines = ["set -e", f"R={q(str(spec.root))}", f"S={q(str(staging))}", _TARGET_FN]
    if spec.overlay:
        lines += _overlay_lines(spec, backend, mount)
    lines += ['if target dev dir; then ' + f'{mount} --rbind /dev "$R/dev"; fi',
              'if target proc dir; then ' + f'{mount} -t proc proc "$R/proc"; fi',
              'if target sys dir; then ' + f'{mount} --rbind /sys "$R/sys"; '
              + f'{mount} -o remount,bind,ro "$R/sys" 2>/dev/null || true; fi',
              'target tmp dir',
              f'{mount} -t tmpfs -o mode=1777 tmpfs "$R/tmp"',
              'mkdir "$R/tmp/.image-builder" && cp -a "$S/files/." "$R/tmp/.image-builder/"']
    if spec.host_network_files and Path("/etc/resolv.conf").exists():
        lines.append(f'if target etc/resolv.conf file; then {mount} --bind /etc/resolv.conf "$R/etc/resolv.conf"; fi')
    for b in spec.binds:
        rel = b.dest.strip("/")
        if ".." in Path(rel).parts:
            raise SandboxError(f"bind target {b.dest!r} leaves the root")
        lines.append(f"target {q(rel)} {'dir' if b.src.is_dir() else 'file'}")
        lines.append(f'{mount} --bind {q(str(b.src))} "$R"/{q(rel)}')
        if b.readonly:
            lines.append(f'{mount} -o remount,bind,ro "$R"/{q(rel)}')
    lines.append(f'cd "$R" && exec {tool["chroot"]} "$R" /bin/sh -c \'cd "$0" && exec "$@"\' '
                 + " ".join(q(a) for a in [spec.workdir, *argv]))
    userns = ["--user", "--map-root-user"] if backend is BuildBackend.USERNS else []
    return [tool["unshare"], *userns, "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private",
            "--", "/bin/sh", "-c", "\n".join(lines)]


def _proot_command(spec: SandboxSpec, argv: list[str], tmp: Path) -> list[str]:
    cmd = ["proot", "-0", "-r", str(spec.root), "-b", "/dev", "-b", "/proc", "-b", "/sys",
           "-b", f"{tmp}:/tmp", "-w", spec.workdir]
    if spec.host_network_files and Path("/etc/resolv.conf").exists():
        cmd += ["-b", "/etc/resolv.conf"]
    for b in spec.binds:
        cmd += ["-b", f"{b.src}:{b.dest}"]  # proot has no read-only binds
    return [*cmd, *argv]


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
    if not spec.overlay and not (spec.root / "bin" / "sh").exists() and not (spec.root / "bin").is_symlink():
        raise SandboxError(f"{spec.root}: no /bin/sh in the root filesystem; is it a Linux image?")
    with tempfile.TemporaryDirectory(prefix="ib-sandbox-") as tmp:
        staging = Path(tmp)
        # What the sandbox sees under /tmp/.image-builder: host CA bundle, apt.conf, staged files.
        _stage(staging / "files", spec, files or {})
        fuse_mounts: list[Path] = []
        try:
            if backend is BuildBackend.PROOT:
                if spec.overlay:
                    fuse_mounts = _fuse_overlay(spec, staging)
                scratch = staging / "tmp"
                scratch.mkdir(mode=0o1777)
                shutil.copytree(staging / "files", scratch / ".image-builder")
                cmd = _proot_command(spec, argv, scratch)
            else:
                cmd = _namespace_command(spec, backend, argv, staging)
            env = clean_env(spec, backend)
            t0 = time.monotonic()
            if interactive:
                return Result(subprocess.Popen(cmd, env=env).wait(), False, time.monotonic() - t0, ())
            return _supervise(cmd, env, timeout, log, echo, tail_lines, t0)
        finally:
            for point in reversed(fuse_mounts):
                subprocess.run(["fusermount3", "-u", "-z", str(point)], capture_output=True)
            _remove_created(spec.overlay.upper if spec.overlay else spec.root, staging)


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


def _supervise(cmd, env, timeout, log, echo, tail_lines, t0) -> Result:
    tail: deque[str] = deque(maxlen=tail_lines)
    timed_out = False
    log_file = open(log, "ab") if log else None
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = t0 + timeout if timeout else None

        def kill(*_):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

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
                tail.append(line.decode(errors="replace").rstrip("\n"))
            code = proc.wait()
        except BaseException:  # Ctrl-C: take the whole sandbox down with us
            kill()
            proc.wait()
            raise
        finally:
            if timer:
                timer.cancel()
        timed_out = bool(deadline) and time.monotonic() >= deadline and code != 0
    finally:
        if log_file:
            log_file.close()
    return Result(code, timed_out, time.monotonic() - t0, tuple(tail))
