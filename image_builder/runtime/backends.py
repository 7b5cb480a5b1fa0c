"""Which backend runs an instance here, why (doctor), and opening a session on it.

detect_backend() takes the first that works here; doctor() says why:

- kernel (root): squashfs loop mounts (the .sif partition at its offset, each .sqfs)
  under kernel overlayfs. Runs are host uid 0 inside a user namespace of their own,
  so /proc's writable-by-root files are masked and the process limit is a pids cgroup
  (RLIMIT_NPROC never counts host root).
- userns (rootless, the HPC default): squashfuse in a user namespace, kernel
  overlayfs there (5.11+, `userxattr`: squashfuse shows trusted.overlay.* as
  user.overlay.*). With squashfuse_cached (mounts.squashfuse) the kernel caches opens,
  directories and symlinks; with plain squashfuse_ll every open() of an image file is
  a FUSE round trip, and Python starts slower than on the kernel backend.
- apptainer (apptainer.py): `apptainer exec --overlay inst.sqfs:ro env.sif`
  per run (apptainer_command).
- extract (extract.py; no FUSE, no user namespaces): each layer unsquashed
  once into a cache, copied into a tree per session (its writable layer, shared by the
  session's runs), run under proot. Slow; it cannot turn the network off nor bind
  read-only, and says so instead of pretending.

open_session() is the entry point: it picks the backend and hands the layers to it
(holder_session.py for kernel and userns).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .cgroups import locate_cgroups
from .execution import Bind
from .holder import DEFAULT_MAX_PROCESSES
from .holder_session import UNPACK_DIR_ENV, HolderSession
from .mounts import INIT_MISSING, ZYGOTE_LIBRARY_MISSING, RunnerError, init_program, squashfuse, zygote_library
from .session import Backend, InstanceLayers, Session
from .statedir import default_state_dir, private_dir


@dataclass(frozen=True)
class DoctorLine:
    check: str
    ok: bool
    detail: str


# --- what this host can do ------------------------------------------------------------------


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        got = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", name.replace(".", "/")).read_text().strip()
    except OSError:
        return None


def _userns_blocker() -> str | None:
    """Why unprivileged user namespaces with overlayfs cannot work here (cheap checks), or None."""
    if _sysctl("kernel.unprivileged_userns_clone") == "0":
        return "kernel.unprivileged_userns_clone is 0 (ask the admin to set it to 1)"
    if _sysctl("user.max_user_namespaces") == "0":
        return "user.max_user_namespaces is 0 (ask the admin to raise it)"
    if _sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
        return "AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns=1)"
    if not _kernel_at_least(5, 11):
        return f"kernel {os.uname().release} is older than 5.11: no overlayfs in user namespaces"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is missing or not read-writable by this user (HPC hosts usually make it mode 666)"
    program = squashfuse()
    if not (os.access(program, os.X_OK) if os.sep in program else _which(program)):
        return f"{program} is not installed (apt-get install squashfuse)"
    return None if init_program() else INIT_MISSING


def _kernel_blocker() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control (loop devices)"
    return None if init_program() else INIT_MISSING


def _which(tool: str) -> str | None:
    import shutil

    return shutil.which(tool)


def _extract_blocker() -> str | None:
    missing = [t for t in ("unsquashfs", "proot") if not _which(t)]
    return f"{' and '.join(missing)} not installed" if missing else None


def detect_backend() -> Backend:
    """The best backend this host supports: kernel as root, else userns, apptainer, extract."""
    if _kernel_blocker() is None:
        return Backend.KERNEL
    if _userns_blocker() is None:
        return Backend.USERNS
    if _which("apptainer"):
        return Backend.APPTAINER
    if _extract_blocker() is None:
        return Backend.EXTRACT
    raise RunnerError(f"no runtime backend works here: user namespaces: {_userns_blocker()}; extract: "
                      f"{_extract_blocker()}; install squashfuse, or proot and squashfs-tools")


def doctor() -> list[DoctorLine]:
    """What this host supports for running instances, and why."""
    lines = [DoctorLine("user", True, f"uid {os.getuid()}" + (" (root)" if os.geteuid() == 0 else ""))]
    lines.append(DoctorLine("kernel", _kernel_at_least(5, 11), os.uname().release
                            + ("" if _kernel_at_least(5, 11) else ": overlayfs in user namespaces needs 5.11")))
    for backend, blocker in ((Backend.KERNEL, _kernel_blocker()), (Backend.USERNS, _userns_blocker()),
                             (Backend.EXTRACT, _extract_blocker())):
        lines.append(DoctorLine(f"backend {backend.value}", blocker is None, blocker or "usable"))
    program = squashfuse()
    fast = os.path.basename(program) == "squashfuse_cached"
    lines.append(DoctorLine("squashfuse", True, program + (": the kernel caches opens, directories and symlinks" if fast
                            else ": every open() is a FUSE round trip; `make` builds the faster squashfuse_cached")))
    init = init_program()
    lines.append(DoctorLine("init", bool(init), init or INIT_MISSING))
    library = zygote_library()
    lines.append(DoctorLine("warm interpreters", bool(library), library or ZYGOTE_LIBRARY_MISSING))
    apptainer = _which("apptainer")
    lines.append(DoctorLine("backend apptainer", bool(apptainer), apptainer or "not installed"))
    cg = locate_cgroups()
    if cg and cg[0] == "v2":
        limits = f"cgroup v2 under {cg[1]}: per-run process and memory limits; out-of-memory kills are reported"
    elif cg:
        limits = (f"cgroup v1 pids under {cg[1]}: per-run process limit; RLIMIT_AS for memory, out-of-memory is "
                  "judged from the output")
    else:
        limits = ("RLIMIT_NPROC and RLIMIT_AS per run (RLIMIT_NPROC counts per user namespace); out-of-memory is "
                  "judged from the output")
    lines.append(DoctorLine("limits", True, limits))
    try:
        lines.append(DoctorLine("chosen", True, detect_backend().value))
    except RunnerError as e:
        lines.append(DoctorLine("chosen", False, str(e)))
    return lines



# --- entry points ------------------------------------------------------------------------------------


def checked_state_dir(layers: InstanceLayers, state_dir: Path | None) -> Path:
    """The private state dir for sessions on `layers`, once their images are found and
    (with digests) checked on this node."""
    if not Path(layers.env_sif).is_file():
        raise RunnerError(f"environment image {layers.env_sif} not found; build or pull it first")
    state_dir = Path(private_dir(state_dir or default_state_dir()))
    if layers.digests:
        from .checked import check_layers

        check_layers(layers, state_dir)
    return state_dir


def open_session(layers: InstanceLayers, *, backend: Backend | None = None, state_dir: Path | None = None,
                 binds: tuple[Bind, ...] = (), max_processes: int = DEFAULT_MAX_PROCESSES, linger: float = 0.0,
                 scratch_mb: int | None = None, unpack_dir: Path | None = None,
                 layers_at: str | None = None) -> Session:
    """Mount `layers` (warm: a layer already mounted for this user is reused) for many runs.

    `binds`: host paths to show inside. `max_processes`: per run. `linger`: seconds the
    mounts stay after the last session using them closes, so the next one starts warm
    (a CLI running one command per process wants this). `scratch_mb`: a cap on each of a
    run's writable layer, /tmp and /dev/shm (they share the run's memory limit, or 4 GB
    without one: native/init.c's DEFAULT_SCRATCH_MB). `unpack_dir` (default
    $IMAGE_BUILDER_UNPACK_DIR): userns only, unpack the environment image there once (a
    node-local disk: about the image's size uncompressed) and use it instead of
    squashfuse: with plain squashfuse_ll, whose round trip on every open() slows short
    runs by a third, this wins; squashfuse_cached comes close without it. `state_dir`
    (default: default_state_dir()) must be this user's, mode 700 (private_dir).
    `layers_at`: the layers themselves, read-only, at that path in every run (a warm
    interpreter's, warm.py, which builds its jobs' roots on them); kernel and userns only."""
    backend = backend or detect_backend()
    if backend is not Backend.APPTAINER or layers.digests:  # holder, trees, checked layers
        state_dir = checked_state_dir(layers, state_dir)
    elif not Path(layers.env_sif).is_file():
        raise RunnerError(f"environment image {layers.env_sif} not found; build or pull it first")
    if backend in (Backend.KERNEL, Backend.USERNS):
        unpack_dir = unpack_dir or os.environ.get(UNPACK_DIR_ENV) or None
        return HolderSession(layers, backend, state_dir, tuple(binds), max_processes, linger, scratch_mb,
                              Path(unpack_dir) if unpack_dir else None, layers_at=layers_at)
    if layers_at is not None:
        raise RunnerError(f"the {backend.value} backend cannot show a run its layers; use kernel or userns")
    if backend is Backend.APPTAINER:
        from .apptainer import ApptainerSession

        return ApptainerSession(layers, tuple(binds), max_processes)
    from .extract import ExtractSession

    return ExtractSession(layers, state_dir, tuple(binds), max_processes)

