"""The extract backend, for hosts with neither FUSE nor user namespaces: each layer is
unsquashed once into a cache and copied into a tree per session, where commands run
under proot (see ExtractSession for what that cannot do)."""

from __future__ import annotations

import contextlib
import fcntl
import marshal
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from image_builder.oci.trees import remove
from image_builder.pack.squashfs import LayerListing, list_layer
from .execution import Bind, RunRequest, RunResult
from .mounts import RUN_UMASK, RunnerError, hold_tree
from .session import Backend, Captured, InstanceLayers, Session, build_job, build_result, collect, stdin_fd


def _layer_key(image: Path, offset: int) -> str:
    import hashlib

    st = os.stat(image)
    ident = f"{os.path.realpath(image)}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{offset}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


@dataclass
class ExtractedLayer:
    """A layer unsquashed in the cache, held: while `hold` (a shared flock on the tree)
    is open, no later extraction drops the tree as stale."""

    tree: Path
    listing: LayerListing
    hold: int

    def release(self) -> None:
        os.close(self.hold)


def extracted_layer(cache: Path, image: Path, offset: int = 0) -> ExtractedLayer:
    """The layer unsquashed into `cache` (made once; the listing is kept next to it and
    every listed path checked to exist before the copy is trusted), held for the caller.
    Making one drops the unheld trees of images replaced or removed since."""
    while True:
        final = cache / _layer_key(image, offset)
        if not (final / "listing.marshal").is_file():
            _extract(final, image, offset)
            _drop_replaced(cache)
        try:
            hold = hold_tree(final / "tree")
        except FileNotFoundError:
            continue  # dropped meanwhile: the image was replaced, make the new one
        if (final / "listing.marshal").is_file():
            listing = LayerListing(**marshal.loads((final / "listing.marshal").read_bytes()))
            return ExtractedLayer(final / "tree", listing, hold)
        os.close(hold)


def _extract(final: Path, image: Path, offset: int) -> None:
    import subprocess

    listing = list_layer(image, offset)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    remove(tmp)
    tmp.mkdir(parents=True)
    try:
        specials = [p for p, k in listing.kinds.items() if k in "bcps"]  # not creatable unprivileged
        (tmp / "exclude").write_text("".join(f"{p}\n" for p in specials))
        r = subprocess.run(["unsquashfs", "-no-progress", "-quiet", "-no-xattrs", "-no-wildcards", "-offset",
                            str(offset), "-exclude-file", str(tmp / "exclude"), "-dest", str(tmp / "tree"),
                            str(image)], stdin=subprocess.DEVNULL, capture_output=True)
        missing = [p for p, k in listing.kinds.items() if k not in "bcps" and not os.path.lexists(tmp / "tree" / p)]
        if r.returncode or missing:
            why = (r.stderr or r.stdout).decode(errors="replace").strip().splitlines()[-1:] or [f"missing {missing[0]}"]
            raise RunnerError(f"cannot extract {image}: {why[0]}; check the free space under {final.parent}")
        (tmp / "source").write_text(f"{os.path.realpath(image)}\n{offset}\n")
        (tmp / "listing.marshal").write_bytes(marshal.dumps(listing.__dict__))
        try:
            tmp.rename(final)
        except OSError:  # another process made it meanwhile
            remove(tmp)
    except BaseException:
        remove(tmp)
        raise


def _drop_replaced(cache: Path) -> None:
    """Remove the trees whose image is gone or is another file now (an environment
    rebuilt in place), unless someone holds them. A tree is hundreds of MB."""
    for entry in cache.iterdir():
        if ".tmp-" in entry.name:
            continue  # being made or being removed
        try:
            image, offset = (entry / "source").read_text().split()
        except (OSError, ValueError):
            continue  # being made, or not ours to judge
        try:
            if _layer_key(Path(image), int(offset)) == entry.name:
                continue
        except FileNotFoundError:
            pass  # the image is gone
        try:
            fd = os.open(entry / "tree", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # in use
        try:  # renamed under the lock: a user that opened it meanwhile finds no listing and looks again
            doomed = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
            entry.rename(doomed)
        except OSError:
            continue
        finally:
            os.close(fd)
        remove(doomed)


def _inside_tree(root: Path, rel: str) -> Path:
    """root/rel, refusing a path that a symlink of the tree would lead out of it."""
    path = root
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            raise RunnerError(f"bad path {rel!r} in a layer; the image is malformed")
        if path != root and os.path.islink(path):
            raise RunnerError(f"{rel}: a symlink in the tree is in the way; the image is malformed")
        path = path / part
    return path


def _resolve_in(root: Path, path: str) -> Path | None:
    """Where `path` leads in the tree at `root`, following symlinks as a chroot would;
    None if nothing is there."""
    todo = [p for p in path.split("/") if p not in ("", ".")]
    parts: list[str] = []
    for _ in range(4096):
        if not todo:
            return root.joinpath(*parts)
        part = todo.pop(0)
        if part == "..":
            parts = parts[:-1]
            continue
        here = root.joinpath(*parts, part)
        if os.path.islink(here):
            target = os.readlink(here)
            parts = [] if target.startswith("/") else parts
            todo = [p for p in target.split("/") if p not in ("", ".")] + todo
        elif os.path.lexists(here):
            parts.append(part)
        else:
            return None
    return None  # a symlink loop


def apply_extracted_layer(root: Path, tree: Path, listing: LayerListing) -> None:
    """Put an extracted layer over `root` as overlayfs would show it: a path whose type
    changes is replaced, opaque directories lose their lower contents, whiteouts delete."""
    import subprocess

    for rel in sorted(listing.kinds):  # parents first: a replaced symlink cannot mislead a child
        kind = listing.kinds[rel]
        if kind in "bcps":
            continue
        dest = _inside_tree(root, rel)
        if os.path.lexists(dest) and (kind == "d") != (os.path.isdir(dest) and not os.path.islink(dest)):
            remove(dest)
    for rel in listing.opaque:
        dest = _inside_tree(root, rel)
        if os.path.isdir(dest) and not os.path.islink(dest):
            for child in os.listdir(dest):
                remove(dest / child)
    for rel in listing.whiteouts:
        remove(_inside_tree(root, rel))
    # --remove-destination: never write through a symlink the lower layer left there.
    r = subprocess.run(["cp", "-a", "--reflink=auto", "--remove-destination", f"{tree}/.", f"{root}/"],
                       capture_output=True)
    if r.returncode:
        raise RunnerError(f"cannot copy layer {tree} into {root}: {r.stderr.decode(errors='replace').strip()}")


def _user_tasks() -> int:
    """Processes and threads of this uid: RLIMIT_NPROC counts them all, host-wide."""
    n, uid = 0, os.getuid()
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


def _traced_by(tracer: int) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and f"TracerPid:\t{tracer}\n" in Path(f"/proc/{pid}/status").read_text():
                found.append(int(pid))
        except OSError:
            pass
    return found


def remove_proot_leftovers() -> None:
    """Remove what dead proots of this user left in /tmp. proot keeps its loader (prooted-PID-*) and
    glue folders (proot-PID-*) there and removes them as it exits; killed outright (a run's timeout, a
    killed builder) it leaves them for good: two a run of the extract tests, four a run of the whole
    suite, until /tmp held 256 (Debian's proot 5.1 takes no other folder: it reads no PROOT_TMP_DIR).
    PID is that of the proot that made the name, alive while it runs, so a PID with no process is a dead
    proot's (a new process with that PID makes names of its own, which are not touched)."""
    uid = os.geteuid()
    try:
        entries = list(os.scandir("/tmp"))
    except OSError:
        return
    for entry in entries:
        kind, _, rest = entry.name.partition("-")
        pid = rest.partition("-")[0]
        if kind not in ("proot", "prooted") or not pid.isdigit():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid or os.path.exists(f"/proc/{pid}"):
                continue
            remove(entry.path)
        except OSError:
            pass


# proot 5.1 (Debian 12) does not translate these newer path syscalls: statx would show
# the host's files (coreutils' ls and stat use it). Failing them with ENOSYS makes libc
# and coreutils fall back to the older calls, which proot translates.
_UNTRANSLATED = {"x86_64": (0xC000003E, (332, 437, 439)), "aarch64": (0xC00000B7, (291, 437, 439))}


def _seccomp_program() -> bytes | None:
    """A BPF filter returning ENOSYS for _UNTRANSLATED (other architectures: None)."""
    arch = _UNTRANSLATED.get(os.uname().machine)
    if arch is None:
        return None
    audit_arch, numbers = arch
    ld, jeq, ret = 0x20, 0x15, 0x06
    allow, enosys = 0x7FFF0000, 0x00050000 | 38
    n = len(numbers)
    prog = [(ld, 0, 0, 4), (jeq, 0, n + 2, audit_arch), (ld, 0, 0, 0)]  # another arch: allow
    prog += [(jeq, n - i, 0, nr) for i, nr in enumerate(numbers)]  # a match jumps to the ENOSYS return
    prog += [(ret, 0, 0, allow), (ret, 0, 0, enosys)]
    return b"".join(struct.pack("<HBBI", *insn) for insn in prog)


def _deny_untranslated(program: bytes):
    """preexec_fn for proot: install the filter (inherited by proot and every tracee)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(program)
    fprog = struct.pack("<HxxxxxxQ", len(program) // 8, ctypes.addressof(buf))
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2

    def install() -> None:
        if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) or \
                libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.c_char_p(fprog), 0, 0):
            raise OSError(ctypes.get_errno(), "cannot install the seccomp filter for proot")

    install.keep = (buf, fprog)  # alive until the child has used them
    return install


def _kill_proot(proc) -> None:
    """proot leaves its tracees running when it dies: stop it (its tracees then stop at
    their next traced event), kill every process it traces, then proot."""
    import signal

    try:
        os.kill(proc.pid, signal.SIGSTOP)
    except ProcessLookupError:
        return
    for _ in range(50):
        traced = _traced_by(proc.pid)
        if not traced:
            break
        for pid in traced:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    remove_proot_leftovers()


class ExtractSession(Session):
    """No FUSE, no user namespaces: each layer unsquashed once into a cache, copied into
    a tree per session (the writable layer: runs of a session share it), run under proot
    (ptrace: 2x slower on Python start-up, far more on syscall-heavy work). There is no
    namespace to kill or isolate with: the network cannot be turned off, binds cannot be
    read-only, and processes can outlive a runner killed with SIGKILL."""

    backend = Backend.EXTRACT

    def __init__(self, layers: InstanceLayers, state_dir: Path, binds: tuple[Bind, ...], max_processes: int):
        from image_builder.pack.sif import SifError, partition_offset

        super().__init__(layers, max_processes)
        if any(b.readonly for b in binds):
            raise RunnerError("the extract backend cannot bind read-only (proot has no read-only binds); "
                              "pass readonly=False or use a host with user namespaces")
        self.binds = binds
        cache = state_dir / "extract"
        self._sessions = cache / "sessions"
        self._sessions.mkdir(parents=True, exist_ok=True)
        for stale in self._sessions.iterdir():  # of runners that were killed
            pid = stale.name.split("-")[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                _kill_running_from(stale)
                remove(stale)
        remove_proot_leftovers()
        try:
            offset, _size = partition_offset(layers.env_sif)
        except SifError as e:
            raise RunnerError(str(e)) from None
        self._layers: list[ExtractedLayer] = []
        self._dir = self._sessions / f"{os.getpid()}-{os.urandom(4).hex()}"
        try:
            for image, at in ((Path(layers.env_sif), offset), *((Path(o), 0) for o in layers.overlays)):
                self._layers.append(extracted_layer(cache / "layers", image, at))
            self._root = self._build(self._dir / "root")
        except BaseException:
            self._release_layers()
            raise

    def _build(self, root: Path) -> Path:
        import subprocess

        if not root.exists():
            root.mkdir(parents=True)
            env_tree = self._layers[0].tree
            r = subprocess.run(["cp", "-a", "--reflink=auto", f"{env_tree}/.", f"{root}/"], capture_output=True)
            if r.returncode:
                raise RunnerError(f"cannot copy {env_tree}: {r.stderr.decode(errors='replace').strip()}")
            for layer in self._layers[1:]:
                apply_extracted_layer(root, layer.tree, layer.listing)
        return root

    def _proot(self, root: Path, job: dict, tmp: str) -> list[str]:
        import shutil

        proot = shutil.which("proot")
        if proot is None:
            raise RunnerError("proot is not installed (apt-get install proot)")
        cmd = [proot, "-0", "-r", str(root), "-w", job["workdir"], "-b", "/dev", "-b", "/proc", "-b", f"{tmp}:/tmp"]
        if os.path.isfile("/etc/hosts"):  # the host's network, so its names (`localhost`), as apptainer binds them
            cmd += ["-b", "/etc/hosts"]
        for b in self.binds:
            cmd += ["-b", f"{Path(b.src).resolve()}:{b.dest}"]
        return [*cmd, *job["argv"]]

    def _found(self, job: dict) -> bool:
        """Whether argv[0] is in the tree (on the job's PATH), as the other backends check."""
        name = job["argv"][0]
        dirs = [""] if "/" in name else job["env"].get("PATH", "").split(":")
        return any(_resolve_in(self._root, os.path.join(job["workdir"], d, name)) is not None for d in dirs)

    def run(self, request: RunRequest) -> RunResult:
        import tempfile

        if not request.network:
            raise RunnerError("the extract backend cannot turn the network off (no namespaces here); pass "
                              "network=True to run with the host's network, or use a host with user namespaces")
        job = build_job(self.layers, request, self.max_processes)
        if job["make_workdir"] and _resolve_in(self._root, job["workdir"]) is None:  # as init.c makes it
            _inside_tree(self._root, job["workdir"].strip("/")).mkdir(parents=True)
        for path, data in job["files"].items():
            dest = _inside_tree(self._root, path.strip("/"))
            dest.parent.mkdir(parents=True, exist_ok=True)
            remove(dest)
            dest.write_bytes(data)
        if not self._found(job):
            msg = f"image-builder: cannot run {job['argv'][0]!r}: command not found\n".encode()
            return RunResult(127, None, False, False, 0.0, None, b"", msg[:request.max_output],
                             len(msg) > request.max_output)
        tmp = tempfile.mkdtemp(prefix="ib-tmp-", dir=self._dir)
        os.chmod(tmp, 0o1777)
        limits = ["prlimit", f"--nproc={_user_tasks() + self.max_processes}", "--core=0"]
        if request.memory_mb:
            limits.append(f"--as={request.memory_mb << 20}")
        try:
            return _run_proot([*limits, "--", *self._proot(self._root, job, tmp)], request, job["env"], self._dir)
        finally:
            with contextlib.suppress(OSError):
                remove(tmp)  # the job's /tmp: a candidate's tree, of any depth

    def shell(self, argv: tuple[str, ...] = ("/bin/sh",), persist: Path | None = None, *,
              network: bool = False) -> int:
        import subprocess

        if not network:
            raise RunnerError("the extract backend cannot turn the network off; pass network=True")
        root = self._build(Path(persist) / "root") if persist is not None else self._root
        job = build_job(self.layers, RunRequest(tuple(argv), env={"TERM": os.environ.get("TERM", "xterm")}),
                   self.max_processes)
        tmp = self._dir / "shell-tmp"
        tmp.mkdir(mode=0o1777, exist_ok=True)
        program = _seccomp_program()
        return subprocess.call(self._proot(root, job, str(tmp)), env=job["env"],
                               preexec_fn=_deny_untranslated(program) if program else None)

    def close(self) -> None:
        _kill_running_from(self._dir)
        remove(self._dir)
        self._release_layers()

    def _release_layers(self) -> None:
        for layer in self._layers:
            layer.release()
        self._layers = []


def _kill_running_from(session_dir: Path) -> None:
    """Kill what a session's prooted runs left, found even after its runner was killed:
    every run records its proot's pid in the session directory, and each process proot
    starts runs proot's loader, /tmp/prooted-PID-*."""
    proots = [int(f.name[6:]) for f in session_dir.glob("proot-*") if f.name[6:].isdigit()]
    if not proots:
        return
    loaders = tuple(f"/tmp/prooted-{pid}-" for pid in proots)
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.readlink(f"/proc/{pid}/exe").startswith(loaders):
                os.kill(int(pid), 9)
        except OSError:
            pass
    for pid in proots:
        try:
            if str(session_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, 9)
        except OSError:
            pass


def _run_proot(cmd: list[str], request: RunRequest, env: dict[str, str], session_dir: Path) -> RunResult:
    """Run proot like the other backends run an init: the run ends when the command
    does (its leftover processes are killed), or at the timeout."""
    import subprocess

    stdin = stdin_fd(request.stdin)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    program = _seccomp_program()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=out_w, stderr=err_w, env=env, start_new_session=True,
                                umask=RUN_UMASK, preexec_fn=_deny_untranslated(program) if program else None)
    finally:
        for fd in (stdin, out_w, err_w):
            os.close(fd)
    record = session_dir / f"proot-{proc.pid}"  # for _kill_running_from, should this runner be killed
    record.touch()

    def command_done() -> None:
        """proot's only child is the command: once it is gone (or not yet there, and
        then nothing is traced), what it left running goes too, and proot exits with
        the command's status."""
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            return
        if not children:
            for pid in _traced_by(proc.pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass

    timed_out = False
    try:
        deadline = None if request.timeout is None else t0 + request.timeout
        try:
            got = collect(out_r, err_r, request.max_output, deadline, done=command_done)
        except TimeoutError:
            timed_out = True
            _kill_proot(proc)
            got = Captured()
        status = proc.wait()
    except BaseException:
        _kill_proot(proc)
        raise
    finally:
        os.close(out_r)
        os.close(err_r)
    record.unlink()
    sig = None
    marker = b"proot info: pid "
    if status == 255 and marker in got.stderr:  # proot says which signal killed the command
        line = got.stderr[got.stderr.rindex(marker):].split(b"\n", 1)[0]
        if b"terminated with signal " in line:
            sig = int(line.rsplit(b" ", 1)[1])
            got.stderr = got.stderr.replace(line + b"\n", b"")
    if timed_out:
        sig = 9
    return build_result(got, request, time.monotonic() - t0, None if sig else status, sig, timed_out, None, None)

