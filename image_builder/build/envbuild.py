"""Environment builds: base image + environment scripts -> one `.sif`.

pull the base -> flatten it into a work tree -> run each script in the sandbox
-> write Apptainer's environment files -> pack the SIF (write, verify, rename).

An environment is rebuilt only when its build key changes: a hash of the base
manifest digest, the scripts' contents, the variables, the build context and
the builder version. The key is stored in the SIF's labels, so the image
describes itself and no other state is needed. A failed build keeps its root
filesystem under `failed/` for `image-builder debug`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from image_builder import __version__
from image_builder.errors import ImageBuilderError
from image_builder.oci.cache import BlobCache
from image_builder.oci.layers import flatten
from image_builder.oci.pull import pull
from image_builder.oci.registry import RegistryOptions
from image_builder.pack.sif import SifError, read_sif, write_sif, write_singularity_env
from image_builder.pack.squashfs import SquashOptions, source_date_epoch
from image_builder.progress import NullProgress, Progress
from image_builder.store.store import StorePaths, remove_tree
from .catalog import EnvironmentSpec
from .sandbox import BuildBackend, Bind, SandboxSpec, detect_backend, run as sandbox_run

LABEL_PREFIX = "org.image-builder."
SCRIPTS_IN_SANDBOX = "/tmp/.image-builder/scripts"


class BuildFailed(ImageBuilderError):
    def __init__(self, message: str, *, log: Path | None = None, tail: tuple[str, ...] = ()):
        super().__init__(message)
        self.log, self.tail = log, tail


@dataclass(frozen=True)
class BuildOptions:
    store: Path
    cache: BlobCache = field(default_factory=BlobCache)
    registry: RegistryOptions = RegistryOptions()
    backend: BuildBackend | None = None
    squash: SquashOptions = SquashOptions()
    verbose: bool = False  # echo script output live
    force: bool = False  # rebuild even if the key is unchanged

    def __post_init__(self):
        # Absolute: the build sandbox's working directory is not ours (a relative store made every
        # environment build fail with "chroot: cannot change root directory to 'store/work/...'").
        object.__setattr__(self, "store", Path(self.store).absolute())


@dataclass(frozen=True)
class EnvBuild:
    name: str
    sif: Path
    build_key: str
    base: str
    base_digest: str
    env: dict[str, str]  # the image's environment: base image variables, then the catalog's
    built: bool  # False: the existing image was up to date
    seconds: float


def tree_digest(root: Path) -> str:
    """Names, modes and contents of a directory tree, in a stable order."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            h.update(f"{p.relative_to(root)}\0{p.lstat().st_mode:o}\0".encode())
            h.update(os.readlink(p).encode() if p.is_symlink() else hashlib.sha256(p.read_bytes()).digest())
    return "sha256:" + h.hexdigest()


def script_digests(spec: EnvironmentSpec) -> list[tuple[str, str]]:
    return [(p.name, "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()) for p in spec.scripts]


def build_key(spec: EnvironmentSpec, base_digest: str) -> str:
    doc = {"builder": __version__, "base": base_digest, "scripts": script_digests(spec),
           "env": sorted(spec.env.items()), "context": tree_digest(spec.context) if spec.context else None}
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def current_key(sif: Path) -> str | None:
    """The build key recorded in an existing SIF, None if absent or unreadable."""
    try:
        return read_sif(sif).labels().get(LABEL_PREFIX + "build-key")
    except (SifError, OSError):
        return None


def deffile(spec: EnvironmentSpec, base: str, digest: str, env: dict[str, str], backend: BuildBackend) -> str:
    """An Apptainer-definition-like record of how the image was made."""
    lines = ["Bootstrap: docker", f"From: {base}@{digest}" if not base.startswith("https://") else f"From: {base}",
             f"# built by image-builder {__version__} ({backend.value} backend)", "", "%environment"]
    lines += [f"    export {k}={json.dumps(v)}" for k, v in env.items()]
    for path in spec.scripts:
        lines += ["", f"%post  # {path.name}", path.read_text()]
    return "\n".join(lines) + "\n"


def clamp_mtimes(root: Path, epoch: int) -> None:
    """Files newer than SOURCE_DATE_EPOCH get it as mtime (like tar --clamp-mtime).

    Unlike stamping every file, this keeps the base's timestamp-checked .pyc
    files valid; builds run with SOURCE_DATE_EPOCH set, so pip writes
    hash-checked .pyc files that do not care about mtimes.
    """
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if os.lstat(p).st_mtime > epoch:
                os.utime(p, (epoch, epoch), follow_symlinks=False)
    os.utime(root, (epoch, epoch))


def build_environment(spec: EnvironmentSpec, opts: BuildOptions, progress: Progress = NullProgress()) -> EnvBuild:
    t0 = time.monotonic()
    paths = StorePaths(opts.store)
    image = pull(spec.base, cache=opts.cache, options=opts.registry, progress=progress)
    key = build_key(spec, image.digest)
    env = {**image.env, **spec.env}
    sif = paths.env_sif(spec.name)
    result = EnvBuild(spec.name, sif, key, spec.base, image.digest, env, True, 0.0)
    if not opts.force and current_key(sif) == key:
        return replace_seconds(result, t0, built=False)

    backend = opts.backend or detect_backend()
    work = paths.work(spec.name)
    remove_tree(work)
    rootfs = work / "rootfs"
    logs = paths.env_logs(spec.name)
    remove_tree(logs)
    logs.mkdir(parents=True)
    labels = {LABEL_PREFIX + "build-key": key, LABEL_PREFIX + "environment": spec.name,
              LABEL_PREFIX + "base": spec.base, LABEL_PREFIX + "base-digest": image.digest,
              LABEL_PREFIX + "scripts": json.dumps(script_digests(spec)), LABEL_PREFIX + "version": __version__}
    try:
        # Rootless even as root: no device node of an untrusted layer reaches the tree.
        flatten([layer.path for layer in image.layers], rootfs, rootless=True)
        run_scripts(spec, rootfs, env, backend, paths, opts.verbose)
        write_singularity_env(rootfs, env, labels=labels)
        epoch = source_date_epoch()
        if epoch is not None:
            clamp_mtimes(rootfs, epoch)
        # The tree belongs to the sandbox's uid (the builder's, or BUILD_UID): inside the image, root's.
        squash = replace(opts.squash, all_root=True)
        sif.parent.mkdir(parents=True, exist_ok=True)
        write_sif(sif, rootfs, deffile=deffile(spec, spec.base, image.digest, env, backend), labels=labels,
                  squash=squash, extra_json={"image-builder.env.json": env})
    except BaseException as e:
        keep_failed(paths, spec, rootfs, env, backend)
        if isinstance(e, BuildFailed):
            raise
        if isinstance(e, (ImageBuilderError, OSError)):
            why = f"{e.strerror} ({e.filename})" if isinstance(e, OSError) and e.strerror else str(e)
            raise BuildFailed(f"environment {spec.name}: {why}") from e
        raise
    finally:
        remove_tree(work)
    remove_tree(paths.failed_env(spec.name))
    return replace_seconds(result, t0)


def replace_seconds(result: EnvBuild, t0: float, built: bool = True) -> EnvBuild:
    return replace(result, built=built, seconds=time.monotonic() - t0)


def sandbox_spec(spec: EnvironmentSpec, rootfs: Path, env: dict[str, str]) -> SandboxSpec:
    binds = (Bind(spec.context, "/build", readonly=True),) if spec.context else ()
    return SandboxSpec(rootfs, env=env, workdir="/", binds=binds)


def run_scripts(spec: EnvironmentSpec, rootfs: Path, env: dict[str, str], backend: BuildBackend, paths: StorePaths,
                verbose: bool) -> None:
    for i, script in enumerate(spec.scripts, 1):
        log = paths.env_logs(spec.name) / f"{i:02d}-{script.name}.log"
        staged = {f"scripts/{script.name}": script}
        result = sandbox_run(sandbox_spec(spec, rootfs, env), ["/bin/sh", f"{SCRIPTS_IN_SANDBOX}/{script.name}"],
                             backend=backend, timeout=spec.timeout, log=log, echo=verbose, files=staged)
        if result.returncode != 0:
            why = f"timed out after {spec.timeout:g} s" if result.timed_out else f"exited {result.returncode}"
            raise BuildFailed(f"environment {spec.name}: script {script.name} {why}; log: {log}; "
                              f"debug with: image-builder debug {spec.name} --store {paths.root}",
                              log=log, tail=result.tail)


def keep_failed(paths: StorePaths, spec: EnvironmentSpec, rootfs: Path, env: dict[str, str],
                backend: BuildBackend) -> None:
    """Move a failed build's tree to failed/ with what `debug` needs to reopen it.

    Best effort: it runs while reporting another failure (maybe a full disk),
    and must not replace that failure with its own.
    """
    dest = paths.failed_env(spec.name)
    record = {"environment": spec.name, "backend": backend.value, "env": env,
              "context": str(spec.context) if spec.context else None, "scripts": [str(p) for p in spec.scripts],
              "failed_at": int(time.time())}
    try:
        remove_tree(dest)
        if not rootfs.exists():
            return
        dest.mkdir(parents=True)
        os.replace(rootfs, dest / "rootfs")  # same filesystem: a rename, no space needed
        (dest / "build.json").write_text(json.dumps(record, indent=2))
    except OSError:
        pass


@dataclass(frozen=True)
class FailedBuild:
    name: str
    rootfs: Path
    backend: BuildBackend
    env: dict[str, str]
    context: Path | None


def failed_build(store: Path, name: str) -> FailedBuild:
    where = StorePaths(store).failed_env(name)
    try:
        record = json.loads((where / "build.json").read_text())
    except (OSError, ValueError) as e:
        raise ImageBuilderError(f"no failed build of {name!r} in {store}/failed/envs "
                                "(only failed builds are kept for debugging)") from e
    return FailedBuild(name, where / "rootfs", BuildBackend(record["backend"]), record["env"],
                       Path(record["context"]) if record.get("context") else None)


def debug_shell(failed: FailedBuild, backend: BuildBackend | None = None) -> int:
    """An interactive shell in a failed build's tree, with the build's environment."""
    binds = (Bind(failed.context, "/build", readonly=True),) if failed.context else ()
    shell = "/bin/bash" if (failed.rootfs / "bin/bash").exists() else "/bin/sh"
    spec = SandboxSpec(failed.rootfs, env=failed.env, workdir="/", binds=binds)
    return sandbox_run(spec, [shell], backend=backend or failed.backend, interactive=True).returncode


def to_json(build: EnvBuild) -> dict:
    d = asdict(build)
    d["sif"] = str(build.sif)
    return d
