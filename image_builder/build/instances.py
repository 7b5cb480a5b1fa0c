"""Instance builds: what one task adds over its environment, as a `.sqfs` overlay.

The environment's layers (its `.sif` partition, and the overlays of a `from:`
chain) are mounted read-only as the lower layers (the very images the runtime
will mount, not a leftover tree), an empty
upper directory on top; the task's files are copied in and its script runs in
the sandbox. Whatever the script wrote, and nothing else, is in the upper
directory: normalised to Apptainer's overlay form and packed, it costs only
what the instance adds.

Each `.sqfs` has a record beside it (`<id>.json`: build key, digest, size),
written after the image is verified. A rerun trusts a record whose key
matches and whose file has the recorded size, so an interrupted store build
resumes where it stopped and a no-op rebuild packs nothing.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from image_builder import __version__
from image_builder.errors import ImageBuilderError
from image_builder.oci.cache import sha256_file
from image_builder.pack.overlay import normalise_upper
from image_builder.pack.squashfs import SquashOptions, pack
from image_builder.store.files import atomic_write
from image_builder.store.store import StorePaths, remove_tree
from .catalog import InstanceSpec
from .envbuild import (BuildFailed, EnvBuild, clamp_to_epoch, keep_failed, layer_images, lower_children,
                       tree_digest)
from .repo_history import HISTORY_SCRIPT, STAGED_AS, prune_command, script_digest
from .sandbox import BuildBackend, Bind, Overlay, SandboxSpec, detect_backend, run as sandbox_run

FILES_IN_SANDBOX = "/tmp/.image-builder/instance-files"
SCRIPT_IN_SANDBOX = "/tmp/.image-builder/instance.sh"


@dataclass(frozen=True)
class InstanceBuild:
    id: str
    environment: str
    sqfs: Path | None  # None: the instance adds nothing (no script, no files)
    sha256: str | None
    size: int
    build_key: str
    built: bool
    seconds: float
    mtime_ns: int = 0  # of the .sqfs when recorded: a changed file is re-hashed before it is trusted


def _file_digest(src: Path | bytes) -> str:
    data = src if isinstance(src, bytes) else src.read_bytes()
    return hashlib.sha256(data).hexdigest()


def instance_key(spec: InstanceSpec, env: EnvBuild) -> str:
    doc = {"builder": __version__, "environment": env.build_key,
           "script": _file_digest(spec.script) if spec.script else None, "env": sorted(spec.env.items()),
           "files": sorted((dest, _file_digest(src)) for dest, src in spec.files.items()), "workdir": spec.workdir,
           "context": tree_digest(spec.context) if spec.context else None, "history": script_digest()}
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def record_path(paths: StorePaths, instance_id: str) -> Path:
    return paths.instance_sqfs(instance_id).with_suffix(".json")


def read_record(paths: StorePaths, instance_id: str) -> InstanceBuild | None:
    try:
        doc = json.loads(record_path(paths, instance_id).read_text())
        build = InstanceBuild(**{**doc, "sqfs": paths.root / doc["sqfs"] if doc["sqfs"] else None})
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if build.sqfs:
        try:
            st = build.sqfs.stat()
        except OSError:
            return None  # the image is gone: not built
        if st.st_size != build.size:
            return None
        if st.st_mtime_ns != build.mtime_ns and sha256_file(build.sqfs) != build.sha256:
            return None  # changed since it was recorded, and not for the same bytes: corrupt
    return build


def write_record(paths: StorePaths, build: InstanceBuild) -> None:
    doc = asdict(build)
    doc["sqfs"] = paths.relative(build.sqfs) if build.sqfs else None
    atomic_write(record_path(paths, build.id), lambda f: f.write(json.dumps(doc, indent=1).encode()))


# Failed instance builds kept for `debug`, the newest: a broken spec or dataset fails all its instances, and a
# store of thousands would keep an upper layer of each (sphinx's: 23.6 MB).
FAILED_KEPT = 16


def make_room_for_failed(directory: Path, kept: int = FAILED_KEPT) -> None:
    """Remove the oldest failed builds in `directory` but the newest kept - 1, so one more fits."""
    found = []
    try:
        for entry in directory.iterdir():
            try:
                found.append((entry.stat().st_mtime_ns, entry))
            except OSError:  # removed meanwhile by another build
                pass
    except OSError:
        return
    for _, old in sorted(found)[:max(0, len(found) - kept + 1)]:
        remove_tree(old)


def build_instance(spec: InstanceSpec, env: EnvBuild, store: Path, *, backend: BuildBackend | None = None,
                   squash: SquashOptions = SquashOptions(), verbose: bool = False, force: bool = False) -> InstanceBuild:
    t0 = time.monotonic()
    paths = StorePaths(store)
    key = instance_key(spec, env)
    existing = read_record(paths, spec.id)
    if existing and existing.build_key == key and not force:
        return replace(existing, built=False, seconds=time.monotonic() - t0)
    paths.instance_sqfs(spec.id).parent.mkdir(parents=True, exist_ok=True)
    if not spec.script and not spec.files:
        build = InstanceBuild(spec.id, spec.environment, None, None, 0, key, True, time.monotonic() - t0)
        write_record(paths, build)
        return build

    backend = backend or detect_backend()
    work = paths.work(f"inst-{spec.id}")
    remove_tree(work)
    upper, scratch, merged = work / "upper", work / "scratch", work / "merged"  # keep_failed's names
    for d in (upper, scratch, merged):
        d.mkdir(parents=True)
    lowers = layer_images(env.layers)
    log = paths.instance_log(spec.id)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    staged = {f"instance-files/{dest}": src for dest, src in spec.files.items()}
    staged[STAGED_AS] = HISTORY_SCRIPT.encode()
    if spec.script:
        staged["instance.sh"] = spec.script
    steps = [f"if [ -d {FILES_IN_SANDBOX} ]; then cp -a {FILES_IN_SANDBOX}/. /; fi"]
    if spec.script:
        workdir = shlex.quote(spec.workdir)
        steps.append(f"mkdir -p {workdir} && cd {workdir} && /bin/sh {SCRIPT_IN_SANDBOX}")
    steps.append(prune_command(spec.workdir))  # the workdir's repository: HEAD and its ancestors only (repo_history)
    binds = (Bind(spec.context, "/build"),) if spec.context else ()
    sandbox = SandboxSpec(merged, env={**env.env, **spec.env}, workdir="/", binds=binds,
                          overlay=Overlay(lowers, upper, scratch))
    dest = paths.instance_sqfs(spec.id)
    try:
        result = sandbox_run(sandbox, ["/bin/sh", "-ec", " && ".join(steps)], backend=backend,
                             timeout=spec.timeout, log=log, echo=verbose, files=staged)
        if result.returncode != 0:
            why = f"timed out after {spec.timeout:g} s" if result.timed_out else f"exited {result.returncode}"
            make_room_for_failed(paths.failed_instance(spec.id).parent)
            keep_failed(paths.failed_instance(spec.id), work, sandbox.env, backend, env.layers, spec.context)
            raise BuildFailed(f"instance {spec.id}: script {spec.script.name if spec.script else '(files)'} "
                              f"{why}; log: {log}; debug with: image-builder debug {spec.id} --store {paths.root}",
                              log=log, tail=result.failure_lines)
        normalise_upper(upper, lower_children(lowers))
        clamp_to_epoch(upper)  # as for environments: the same inputs make the same bytes
        pack(upper, dest, replace(squash, all_root=True))  # written by the sandbox's uid: root's inside
        st = dest.stat()
        build = InstanceBuild(spec.id, spec.environment, dest, sha256_file(dest), st.st_size, key, True,
                              time.monotonic() - t0, st.st_mtime_ns)
        write_record(paths, build)
        return build
    except BuildFailed:
        raise
    except (ImageBuilderError, OSError) as e:
        raise BuildFailed(f"instance {spec.id}: {e}", log=log) from e
    finally:
        remove_tree(work)
