"""Environment builds: base image + environment scripts -> one `.sif`, or over
another environment (`from:`) -> one `.sqfs` overlay of what the scripts added.

pull the base -> flatten it into a work tree -> run each script in the sandbox
-> write Apptainer's environment files -> pack the SIF (write, verify, rename).
A `from:` environment mounts its parent's layers read-only under an upper
directory instead, and packs the upper: N environments on one Python base
store that base once.

An environment is addressed by its build key: a hash of the base manifest
digest (or the parent's key), the scripts' contents, the variables, the build
context and the builder version. The key names the file (envs/<key>.sif), so
two environments that would build the same image share one, and an image is
rebuilt only when its key changes. The key is also in the SIF's labels (an
overlay's is in the record beside it). A failed build keeps its tree under
`failed/` for `image-builder debug`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from image_builder import __version__
from image_builder.errors import ImageBuilderError
from image_builder.oci.cache import BlobCache
from image_builder.oci.layers import flatten
from image_builder.oci.local import is_local
from image_builder.oci.pull import pull
from image_builder.oci.registry import RegistryOptions
from image_builder.oci.trees import walk
from image_builder.pack.overlay import normalise_upper
from image_builder.pack.sif import SifError, partition_offset, read_sif, write_sif, write_singularity_env
from image_builder.pack.squashfs import SquashOptions, list_paths, pack, source_date_epoch
from image_builder.progress import NullProgress, Progress
from image_builder.store.store import StorePaths, remove_tree
from .catalog import EnvironmentSpec
from .sandbox import BuildBackend, Bind, Overlay, SandboxSpec, SquashImage, detect_backend, run as sandbox_run

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
    sif: Path  # the bottom image: this environment's, or the root's of its `from:` chain
    overlays: tuple[Path, ...]  # a `from:` chain's layers over the sif, bottom to top (this one's last)
    build_key: str
    base: str
    base_digest: str
    env: dict[str, str]  # the image's environment: base image variables, then the catalog's (parent's first)
    built: bool  # False: the existing image was up to date
    seconds: float

    @property
    def layers(self) -> tuple[Path, ...]:
        return (self.sif, *self.overlays)

    @property
    def image(self) -> Path:
        """The file this environment itself adds: its .sif, or its overlay over the parent."""
        return self.layers[-1]


def tree_digest(root: Path) -> str:
    """Names, modes and contents of a directory tree, in a stable order."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in walk(root):
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


def current_key(image: Path) -> str | None:
    """The build key of an existing image, None if absent or unreadable: a SIF's labels hold it; an
    overlay's record beside it does, trusted while the file has the recorded size."""
    try:
        if image.suffix == ".sif":
            return read_sif(image).labels().get(LABEL_PREFIX + "build-key")
        record = json.loads(image.with_suffix(".json").read_text())
        return record["build_key"] if image.stat().st_size == record["size"] else None
    except (SifError, OSError, ValueError, KeyError, TypeError):
        return None


def layer_images(layers: tuple[Path, ...]) -> tuple[SquashImage, ...]:
    """An environment's layers as the build sandbox mounts them: the SIF's partition, then the overlays."""
    offset, _ = partition_offset(layers[0])
    return (SquashImage(layers[0], offset), *(SquashImage(p) for p in layers[1:]))


def lower_children(images: tuple[SquashImage, ...]) -> Callable[[str], list[str]]:
    """Names directly under a directory of the layers below (for opaque directories and those under them; a
    name some upper layer hid is listed too, and only costs a whiteout that hides nothing). An opaque
    directory's whole subtree is listed once (unsquashfs -l lists recursively), its subdirectories' names
    taken from that listing."""
    listed: dict[str, list[str]] = {}  # an opaque directory -> every path the layers hold under it

    def children(rel_dir: str) -> list[str]:
        root = next((r for r in listed if rel_dir == r or rel_dir.startswith(f"{r}/")), None)
        if root is None:
            root = rel_dir
            listed[root] = [p for image in images for p in list_paths(image.path, rel_dir, image.offset)]
        prefix = f"/{rel_dir}/"
        return sorted({p[len(prefix):].split("/")[0] for p in listed[root]
                       if p.startswith(prefix) and p[len(prefix):]})
    return children


def deffile(spec: EnvironmentSpec, base: str, digest: str, env: dict[str, str], backend: BuildBackend) -> str:
    """An Apptainer-definition-like record of how the image was made."""
    if is_local(base):  # Apptainer's bootstrap agents have skopeo's names too (oci, oci-archive, docker-archive)
        scheme, _, where = base.partition(":")
        source = [f"Bootstrap: {scheme}", f"From: {where}  # {digest}"]
    else:
        source = ["Bootstrap: docker", f"From: {base}@{digest}" if not base.startswith("https://") else f"From: {base}"]
    lines = [*source, f"# built by image-builder {__version__} ({backend.value} backend)", "", "%environment"]
    lines += [f"    export {k}={json.dumps(v)}" for k, v in env.items()]
    for path in spec.scripts:
        lines += ["", f"%post  # {path.name}", path.read_text()]
    return "\n".join(lines) + "\n"


def clamp_mtimes(root: Path, epoch: int | None) -> None:
    """Files newer than SOURCE_DATE_EPOCH get it as mtime (like tar --clamp-mtime).

    Unlike stamping every file, this keeps the base's timestamp-checked .pyc
    files valid; builds run with SOURCE_DATE_EPOCH set, so pip writes
    hash-checked .pyc files that do not care about mtimes. Walked with or without
    an epoch: a tree past oci.trees' bounds (a build script's) is refused here, in
    one line (TreeError), not by the tools after us.
    """
    for dirpath, dirnames, filenames in walk(root):
        if epoch is None:
            continue
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if os.lstat(p).st_mtime > epoch:
                os.utime(p, (epoch, epoch), follow_symlinks=False)
    if epoch is not None:
        os.utime(root, (epoch, epoch))


@dataclass(frozen=True)
class EnvPlan:
    """What an environment build will make, known before any work: its key names its file."""
    spec: EnvironmentSpec
    build_key: str
    image: Path  # envs/<key>.sif, or envs/<key>.sqfs over the parent's layers
    env: dict[str, str]
    base_digest: str
    parent: EnvBuild | None
    base_layers: tuple[Path, ...] = ()  # the pulled base's layer blobs (no parent)


def plan_environment(spec: EnvironmentSpec, opts: BuildOptions, parent: EnvBuild | None = None,
                     progress: Progress = NullProgress()) -> EnvPlan:
    paths = StorePaths(opts.store)
    if parent is not None:  # the parent's key stands for its base: a changed parent rebuilds its children
        key = build_key(spec, parent.build_key)
        return EnvPlan(spec, key, paths.env_image(key, ".sqfs"), {**parent.env, **spec.env}, parent.base_digest,
                       parent)
    image = pull(spec.base, cache=opts.cache, options=opts.registry, progress=progress)
    key = build_key(spec, image.digest)
    return EnvPlan(spec, key, paths.env_image(key), {**image.env, **spec.env}, image.digest, None,
                   tuple(layer.path for layer in image.layers))


def build_environment(plan: EnvPlan, opts: BuildOptions) -> EnvBuild:
    t0 = time.monotonic()
    spec, key, env, parent = plan.spec, plan.build_key, plan.env, plan.parent
    paths = StorePaths(opts.store)
    layers = (*parent.layers, plan.image) if parent else (plan.image,)
    result = EnvBuild(spec.name, layers[0], layers[1:], key, spec.base, plan.base_digest, env, True, 0.0)
    if not opts.force and current_key(plan.image) == key:
        return replace_seconds(result, t0, built=False)

    backend = opts.backend or detect_backend()
    work = paths.work(spec.name)
    remove_tree(work)
    rootfs = work / "rootfs"
    logs = paths.env_logs(spec.name)
    remove_tree(logs)
    logs.mkdir(parents=True)
    labels = {LABEL_PREFIX + "build-key": key, LABEL_PREFIX + "base": spec.base,
              LABEL_PREFIX + "base-digest": plan.base_digest, LABEL_PREFIX + "scripts": json.dumps(script_digests(spec)),
              LABEL_PREFIX + "version": __version__}
    plan.image.parent.mkdir(parents=True, exist_ok=True)
    try:
        if parent:
            _build_overlay(plan, parent, work, env, labels, backend, paths, opts)
        else:
            # Rootless even as root: no device node of an untrusted layer reaches the tree.
            flatten(list(plan.base_layers), rootfs, rootless=True)
            run_scripts(spec, SandboxSpec(rootfs, env=env, workdir="/", binds=_binds(spec)), backend, paths,
                        opts.verbose)
            write_singularity_env(rootfs, env, labels=labels)
            clamp_to_epoch(rootfs)
            # The tree belongs to the sandbox's uid (the builder's, or BUILD_UID): inside the image, root's.
            write_sif(plan.image, rootfs, deffile=deffile(spec, spec.base, plan.base_digest, env, backend),
                      labels=labels, squash=replace(opts.squash, all_root=True),
                      extra_json={"image-builder.env.json": env})
    except BaseException as e:
        keep_failed(paths.failed_env(spec.name), work, env, backend, parent.layers if parent else (),
                    spec.context)
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


def _build_overlay(plan: EnvPlan, parent: EnvBuild, work: Path, env: dict[str, str], labels: dict[str, str],
                   backend: BuildBackend, paths: StorePaths, opts: BuildOptions) -> None:
    """A `from:` environment: the scripts run over the parent's layers (mounted read-only, as the runtime
    mounts them) and what they wrote, in Apptainer's overlay form, is this environment's layer."""
    upper, scratch, merged = work / "upper", work / "scratch", work / "rootfs"
    for d in (upper, scratch, merged):
        d.mkdir(parents=True)
    lowers = layer_images(parent.layers)
    sandbox = SandboxSpec(merged, env=env, workdir="/", binds=_binds(plan.spec),
                          overlay=Overlay(lowers, upper, scratch))
    run_scripts(plan.spec, sandbox, backend, paths, opts.verbose)
    normalise_upper(upper, lower_children(lowers))
    write_singularity_env(upper, env, labels=labels)  # over the parent's: Apptainer reads the merged root
    clamp_to_epoch(upper)
    pack(upper, plan.image, replace(opts.squash, all_root=True))


def clamp_to_epoch(tree: Path) -> None:
    """clamp_mtimes to SOURCE_DATE_EPOCH when it is set (the same inputs make the same bytes); the tree's
    bounds checked either way."""
    clamp_mtimes(tree, source_date_epoch())


def replace_seconds(result: EnvBuild, t0: float, built: bool = True) -> EnvBuild:
    return replace(result, built=built, seconds=time.monotonic() - t0)


def _binds(spec: EnvironmentSpec) -> tuple[Bind, ...]:
    return (Bind(spec.context, "/build", readonly=True),) if spec.context else ()


def run_scripts(spec: EnvironmentSpec, sandbox: SandboxSpec, backend: BuildBackend, paths: StorePaths,
                verbose: bool) -> None:
    for i, script in enumerate(spec.scripts, 1):
        log = paths.env_logs(spec.name) / f"{i:02d}-{script.name}.log"
        staged = {f"scripts/{script.name}": script}
        result = sandbox_run(sandbox, ["/bin/sh", f"{SCRIPTS_IN_SANDBOX}/{script.name}"],
                             backend=backend, timeout=spec.timeout, log=log, echo=verbose, files=staged)
        if result.returncode != 0:
            why = f"timed out after {spec.timeout:g} s" if result.timed_out else f"exited {result.returncode}"
            raise BuildFailed(f"environment {spec.name}: script {script.name} {why}; log: {log}; "
                              f"debug with: image-builder debug {spec.name} --store {paths.root}",
                              log=log, tail=result.failure_lines)


def keep_failed(dest: Path, work: Path, env: dict[str, str], backend: BuildBackend, layers: tuple[Path, ...],
                context: Path | None) -> None:
    """Move a failed build's tree (an environment's or an instance's) to `dest` under failed/ with what
    `debug` needs to reopen it: the root filesystem, or for a build over layers (a `from:` environment, an
    instance) its upper directory and the layers to mount under it.

    Best effort: it runs while reporting another failure (maybe a full disk),
    and must not replace that failure with its own.
    """
    record = {"backend": backend.value, "env": env, "context": str(context) if context else None,
              "layers": [str(p) for p in layers], "failed_at": int(time.time())}
    try:
        remove_tree(dest)
        kept = ("upper", "scratch") if layers else ("rootfs",)
        if not all((work / name).exists() for name in kept):
            return
        dest.mkdir(parents=True)
        for name in kept:
            os.replace(work / name, dest / name)  # same filesystem: a rename, no space needed
        (dest / "build.json").write_text(json.dumps(record, indent=2))
    except OSError:
        pass


@dataclass(frozen=True)
class FailedBuild:
    name: str
    where: Path  # failed/{envs,instances}/<name>: rootfs/, or upper/ and scratch/ over `layers`
    backend: BuildBackend
    env: dict[str, str]
    context: Path | None
    layers: tuple[Path, ...] = ()


def failed_build(store: Path, name: str) -> FailedBuild:
    """The failed build of environment or instance `name` (an environment's first)."""
    for where in (StorePaths(store).failed_env(name), StorePaths(store).failed_instance(name)):
        try:
            record = json.loads((where / "build.json").read_text())
            break
        except (OSError, ValueError):
            continue
    else:
        raise ImageBuilderError(f"no failed build of {name!r} in {store}/failed (only failed builds of "
                                "environments and instances are kept for debugging, until `image-builder gc`)")
    return FailedBuild(name, where, BuildBackend(record["backend"]), record["env"],
                       Path(record["context"]) if record.get("context") else None,
                       tuple(Path(p) for p in record.get("layers") or ()))


def debug_shell(failed: FailedBuild, backend: BuildBackend | None = None) -> int:
    """An interactive shell in a failed build's tree, with the build's environment."""
    binds = (Bind(failed.context, "/build", readonly=True),) if failed.context else ()
    root = failed.where / "rootfs"
    overlay = None
    if failed.layers:  # the upper over the parent's layers again: the shell sees what the scripts saw
        root.mkdir(exist_ok=True)
        overlay = Overlay(layer_images(failed.layers), failed.where / "upper", failed.where / "scratch")
    shell = "/bin/sh" if overlay or not (root / "bin/bash").exists() else "/bin/bash"
    spec = SandboxSpec(root, env=failed.env, workdir="/", binds=binds, overlay=overlay)
    return sandbox_run(spec, [shell], backend=backend or failed.backend, interactive=True).returncode
