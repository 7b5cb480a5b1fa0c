"""Importing prebuilt images (SWE-bench's sweb.eval.*, SWE-Gym, R2E-Gym, ...) into a deduplicated store.

    image-builder import REF... --store STORE [--from-file LIST] [--env-layers N] [--id-from TEMPLATE]

Each image is pulled through the blob cache (registry, or disk: oci:DIR:TAG and
the other local sources), so layers two images share download once and a rerun
downloads nothing. Images are split at a layer boundary: below it, the
environment, packed once per distinct layer prefix (envs/<key>.sif, its key the
prefix's layer digests); above it, what the image adds, packed as the
instance's overlay (instances/<id>.sqfs). By default the boundary is the longest
prefix the image shares with another image of the import (SWE-bench's base +
environment layers, when two instances of one environment are imported); an
image that shares nothing is its own environment with no overlay.

The overlay is what the image's own layers change in its environment's tree,
applied over that tree through an overlay mount in a child's mount namespace (the
kernel makes the whiteouts; _upper_by_overlay), less what the environment already
holds as it is (pack/overlay.py prune_upper): an instance layer that re-adds a
checkout the environment holds costs only the files that changed. Where no overlay
can be mounted, the image is flattened whole and compared (diff_trees): the same
overlay, slower. The image config's Env, WorkingDir and Entrypoint + Cmd are
the instance's environment, workdir and default command in the index.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from image_builder import __version__
from image_builder.errors import ImageBuilderError
from image_builder.oci.cache import sha256_file
from image_builder.oci.image import PulledImage
from image_builder.oci.layers import LayerError, flatten
from image_builder.oci.pull import pull
from image_builder.pack.overlay import DiffStats, diff_trees, normalise_upper, prune_upper
from image_builder.pack.sif import write_sif, write_singularity_env
from image_builder.pack.squashfs import SquashOptions, pack
from image_builder.store.ids import id_problem, shown_id
from image_builder.store.index import EnvRecord, InstanceRecord, write_index
from image_builder.store.store import StorePaths, remove_tree
from .envbuild import LABEL_PREFIX, BuildOptions, clamp_to_epoch, current_key
from .instances import InstanceBuild, read_record, write_record
from .storebuild import current_index, image_record, item_lock, write_fragment

CATALOG = "import"  # the records' catalog field: a build of a catalog leaves imported items alone
SWEBENCH_ESCAPE = "_1776_"  # SWE-bench's image names write an instance id's "__" so (Docker Hub refuses "__")


@dataclass(frozen=True)
class ImportItem:
    """One image to import: a reference, and optionally the instance id and workdir it gets."""
    ref: str
    instance_id: str | None = None
    workdir: str | None = None


@dataclass(frozen=True)
class ImportOptions:
    build: BuildOptions
    # The first N layers are the environment: (glob over the reference or None for every image, N), first match
    env_layers: tuple[tuple[str | None, int], ...] = ()
    id_from: str | None = None  # "docker.io/swebench/sweb.eval.x86_64.{instance_id}:latest"
    jobs: int = 2
    shard: tuple[int, int] | None = None  # (k, n): instances k, k+n, ... in id order, into an index fragment


@dataclass
class ImportSummary:
    environments: dict[str, list[str]] = field(default_factory=dict)  # environment name -> its instance ids
    image_bytes: int = 0  # the images' layer blobs, as pulled
    fetched_bytes: int = 0  # of those, what this import downloaded (the rest was in the cache)
    store_bytes: int = 0  # what the import's environments and overlays weigh
    users: dict[str, str] = field(default_factory=dict)  # instance id -> its image's User, where not root
    seconds: float = 0.0
    index: Path | None = None


def read_list(path: Path) -> list[ImportItem]:
    """`REF [INSTANCE_ID [WORKDIR]]` per line; blank lines and # comments skipped."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ImageBuilderError(f"{path}: cannot read the image list ({e})") from None
    items = []
    for n, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 3:
            raise ImageBuilderError(f"{path}:{n}: expected REF [INSTANCE_ID [WORKDIR]], got {len(words)} fields")
        items.append(ImportItem(*words))
    return items


def id_from(template: str, ref: str) -> str | None:
    """The {instance_id} a reference holds by the template (SWE-bench's `_1776_` read back as `__`)."""
    pattern = "".join(f"(?P<{part[1:-1]}>[^/:@]+)" if re.fullmatch(r"\{[A-Za-z_]\w*\}", part) else re.escape(part)
                      for part in re.split(r"(\{[A-Za-z_]\w*\})", template))
    found = re.fullmatch(pattern, ref)
    if not found or "instance_id" not in found.groupdict():
        return None
    return found["instance_id"].replace(SWEBENCH_ESCAPE, "__")


def _default_id(ref: str) -> str:
    name = ref.rsplit("/", 1)[-1].split("@", 1)[0]
    name, _, tag = name.partition(":")
    return name if tag in ("", "latest") else f"{name}:{tag}"


def split_points(refs: list[str], images: list[PulledImage], env_layers: tuple[tuple[str | None, int], ...] = ()
                 ) -> list[int]:
    """How many bottom layers of each image are its environment: by the first --env-layers rule that names it,
    else the longest prefix it shares with another image."""
    digests = [tuple(layer.digest for layer in img.layers) for img in images]
    points = []
    for i, mine in enumerate(digests):
        rule = next((n for pattern, n in env_layers if pattern is None or fnmatch.fnmatchcase(refs[i], pattern)),
                    None)
        if rule is not None:
            points.append(min(rule, len(mine)))
            continue
        shared = 0
        for j, other in enumerate(digests):
            if i != j and other != mine:  # an identical image is the same instance twice, not a sibling
                n = 0
                while n < min(len(mine), len(other)) and mine[n] == other[n]:
                    n += 1
                shared = max(shared, n)
        points.append(shared or len(mine))
    return points


def _cached_bytes(cache_root: Path) -> int:
    """What the blob cache holds: its growth over an import is what the import downloaded."""
    blobs = cache_root / "blobs" / "sha256"
    return sum(p.stat().st_size for p in blobs.iterdir()) if blobs.is_dir() else 0


def env_key(img: PulledImage, n: int) -> str:
    doc = {"builder": __version__, "import": [layer.digest for layer in img.layers[:n]]}
    return "sha256:" + hashlib.sha256(json.dumps(doc).encode()).hexdigest()


def _config(img: PulledImage) -> dict:
    return img.config.get("config") or {}


def import_images(items: list[ImportItem], opts: ImportOptions) -> ImportSummary:
    t0 = time.monotonic()
    store = opts.build.store
    paths = StorePaths(store)
    store.mkdir(parents=True, exist_ok=True)
    ids = []
    for item in items:
        iid = item.instance_id or (id_from(opts.id_from, item.ref) if opts.id_from else None) or _default_id(item.ref)
        if opts.id_from and not item.instance_id and id_from(opts.id_from, item.ref) is None:
            raise ImageBuilderError(f"{item.ref}: does not match --id-from {opts.id_from!r}")
        if problem := id_problem(iid):
            raise ImageBuilderError(f"{item.ref}: instance id {shown_id(iid)} {problem}")
        ids.append(iid)
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ImageBuilderError(f"two images would be instance {shown_id(dup)}: give ids (--from-file REF ID)")
    before = _cached_bytes(opts.build.cache.root)
    mine = set(range(len(items)))
    if opts.shard:  # every shard splits as one import would: from all the manifests, not only its images'
        k, n = opts.shard
        mine = {i for pos, i in enumerate(sorted(range(len(items)), key=lambda i: ids[i])) if pos % n == k}

    def fetch(i: int) -> PulledImage:
        return pull(items[i].ref, cache=opts.build.cache, options=opts.build.registry, layers=i in mine)

    with ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        images = list(pool.map(fetch, range(len(items))))
    points = split_points([it.ref for it in items], images, opts.env_layers)
    summary = ImportSummary(image_bytes=sum(layer.size for i in mine for layer in images[i].layers),
                            fetched_bytes=max(0, _cached_bytes(opts.build.cache.root) - before))
    groups: dict[str, list[int]] = {}
    for i, (img, n) in enumerate(zip(images, points)):
        groups.setdefault(env_key(img, n), []).append(i)

    envs: dict[str, EnvRecord] = {}
    insts: dict[str, InstanceRecord] = {}
    for key, everyone in groups.items():
        members = [i for i in everyone if i in mine]
        if not members:
            continue
        # What the environment says of itself comes from all the images that share it, never from
        # the ones a shard happens to hold: every shard (and one whole import) packs the same file.
        # Its variables are those they all set alike; the image of the lowest id names its base.
        named_by = images[min(everyone, key=lambda i: ids[i])]
        env = {k: v for k, v in named_by.env.items() if all(images[i].env.get(k) == v for i in everyone)}
        first, n = images[members[0]], points[members[0]]  # the layers this process pulled
        name = f"import-{key[7:19]}"
        summary.environments[name] = [ids[i] for i in members]
        # A rerun packs nothing: each instance's record names its image, split and environment.
        kept = {i: read_record(paths, ids[i]) for i in members}
        kept = {i: r for i, r in kept.items() if r and r.build_key == _instance_key(key, images[i], n)}
        if len(kept) == len(members) and current_key(paths.env_image(key)) == key:
            insts.update((ids[i], _instance_record(ids[i], items[i], images[i], name, env, r, paths))
                         for i, r in kept.items())
            envs[name] = _env_record(paths, name, key, named_by, env)
            continue
        work = paths.work(f"env-{name}")
        remove_tree(work)
        try:
            lower = work / "env"
            flatten([layer.path for layer in first.layers[:n]], lower, rootless=True)
            for i in members:  # against the image's own tree, before Apptainer's files are added to it
                build = kept.get(i) or _pack_instance(paths, ids[i], images[i], n, lower, work, name, key,
                                                      opts.build.squash)
                insts[ids[i]] = _instance_record(ids[i], items[i], images[i], name, env, build, paths)
            _pack_env(paths, key, named_by, lower, env, opts.build.squash)
            envs[name] = _env_record(paths, name, key, named_by, env)
        finally:
            remove_tree(work)
    summary.store_bytes = sum(e.size for e in envs.values()) + sum(i.size for i in insts.values())
    summary.users = {iid: rec.user for iid, rec in sorted(insts.items())
                     if rec.user and rec.user.split(":")[0] not in ("root", "0")}
    summary.index = _merge_index(store, envs, insts, opts.shard)
    summary.seconds = time.monotonic() - t0
    return summary


def _pack_env(paths: StorePaths, key: str, img: PulledImage, tree: Path, env: dict[str, str],
              squash: SquashOptions) -> None:
    sif = paths.env_image(key)
    with item_lock(paths.root, f"env-{key[7:39]}"):
        if current_key(sif) != key:  # missing, or not what it should be: (re)made
            labels = {LABEL_PREFIX + "build-key": key, LABEL_PREFIX + "base": img.reference,
                      LABEL_PREFIX + "version": __version__}
            write_singularity_env(tree, env, labels=labels)
            clamp_to_epoch(tree)  # Apptainer's files are new: the same images make the same bytes
            sif.parent.mkdir(parents=True, exist_ok=True)
            write_sif(sif, tree, deffile=f"Bootstrap: docker\nFrom: {img.reference}@{img.digest}\n"
                                         f"# imported by image-builder {__version__}: its bottom layers\n",
                      labels=labels, squash=replace(squash, all_root=True), extra_json={"image-builder.env.json": env})


def _env_record(paths: StorePaths, name: str, key: str, img: PulledImage, env: dict[str, str]) -> EnvRecord:
    sif = image_record(paths, paths.env_image(key), key)  # hashed only when it changed since its record
    return EnvRecord(name, sif.file, sif.sha256, sif.size, img.reference, img.digest, key,
                     int(paths.env_image(key).stat().st_mtime), env, CATALOG)


def _instance_key(env_build_key: str, img: PulledImage, n: int) -> str:
    return "sha256:" + hashlib.sha256(json.dumps({"env": env_build_key, "image": img.digest, "n": n}).encode()
                                      ).hexdigest()


def _instance_record(iid: str, item: ImportItem, img: PulledImage, env_name: str, env: dict[str, str],
                     build: InstanceBuild, paths: StorePaths) -> InstanceRecord:
    config = _config(img)
    own_env = {k: v for k, v in img.env.items() if env.get(k) != v}
    command = [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]
    workdir = item.workdir or config.get("WorkingDir") or "/"
    return InstanceRecord(iid, env_name, paths.relative(build.sqfs) if build.sqfs else None, build.sha256,
                          build.size, build.build_key, workdir, None,
                          {"image": img.reference, "image_digest": img.digest}, CATALOG, own_env, command,
                          config.get("User") or "")


def _pack_instance(paths: StorePaths, iid: str, img: PulledImage, n: int, lower: Path, work: Path,
                   env_name: str, env_build_key: str, squash: SquashOptions) -> InstanceBuild:
    """The image's difference against its environment's tree, packed; its record written beside it."""
    key = _instance_key(env_build_key, img, n)
    build = InstanceBuild(iid, env_name, None, None, 0, key, True, 0.0)
    if n < len(img.layers):
        full, upper = work / f"full-{time.monotonic_ns()}", work / f"upper-{time.monotonic_ns()}"
        try:
            stats = _upper_by_overlay([layer.path for layer in img.layers[n:]], lower, upper)
            if stats is None:  # no overlay mount here: the whole image flattened, and compared
                remove_tree(upper)
                flatten([layer.path for layer in img.layers], full, rootless=True)
                stats = diff_trees(lower, full, upper)
            clamp_to_epoch(upper)  # as for built instances: same inputs, same bytes
            if stats.entries or stats.whiteouts:
                sqfs = paths.instance_sqfs(iid)
                sqfs.parent.mkdir(parents=True, exist_ok=True)
                with item_lock(paths.root, f"inst-{iid}"):
                    pack(upper, sqfs, replace(squash, all_root=True))
                st = sqfs.stat()
                build = InstanceBuild(iid, env_name, sqfs, sha256_file(sqfs), st.st_size, key, True, 0.0,
                                      st.st_mtime_ns)
        finally:
            remove_tree(full)
            remove_tree(upper)
    paths.instance_sqfs(iid).parent.mkdir(parents=True, exist_ok=True)
    write_record(paths, build)
    return build


def _upper_by_overlay(layers: list[Path], lower: Path, upper: Path) -> DiffStats | None:
    """`layers` (an image's own, above its environment) applied over the environment's tree
    `lower` through an overlay mount, in a mount namespace of a child process (a user
    namespace too, rootless): the kernel turns deletions into whiteouts in `upper`, and
    only what the layers add is written, not the whole image again (bench/imports.py).
    Then in Apptainer's overlay form, less what `lower` already holds (prune_upper). None
    where no overlay can be mounted (an old kernel, a work directory on NFS): the caller
    flattens the whole image instead."""
    from image_builder.runtime.mounts import CLONE_NEWNS, CLONE_NEWUSER, MS_PRIVATE, MS_REC, map_root, mount, unshare

    work = upper.parent
    merged, scratch = work / f"{upper.name}.merged", work / f"{upper.name}.work"
    for d in (upper, merged, scratch):
        d.mkdir()
    top = os.lstat(lower)  # the merged root is upper's: it must be the environment's until a layer says otherwise
    os.chmod(upper, stat.S_IMODE(top.st_mode))
    os.utime(upper, ns=(top.st_atime_ns, top.st_mtime_ns))
    uid, gid, root = os.getuid(), os.getgid(), os.geteuid() == 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: mount, apply, report in one line, leave (its namespace, and the mount, go with it)
        code, text = 0, b""
        try:
            os.close(r)
            try:
                unshare(CLONE_NEWNS if root else CLONE_NEWUSER | CLONE_NEWNS)
                if not root:
                    map_root(uid, gid)
                mount(None, "/", None, MS_REC | MS_PRIVATE)
                os.chdir(work)  # relative names: a store path may hold the ',' and ':' of mount options
                mount("overlay", merged.name, "overlay", 0,
                      f"lowerdir={os.path.relpath(lower, work)},upperdir={upper.name},workdir={scratch.name},"
                      f"redirect_dir=nofollow,index=off,metacopy=off{'' if root else ',userxattr'}")
            except OSError as e:
                code, text = 3, str(e).encode()
            else:
                flatten(layers, Path(merged.name), rootless=True)
        except LayerError as e:
            code, text = 2, str(e).encode()
        except BaseException as e:  # noqa: BLE001 - a child reports everything and leaves
            code, text = 1, f"{type(e).__name__}: {e}".encode()
        finally:
            os.write(w, text[:8000])
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        text = pipe.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    remove_tree(merged)
    remove_tree(scratch)
    if code == 3:
        return None
    if code == 2:
        raise LayerError(text)
    if code != 0:
        raise ImageBuilderError(f"applying the image's layers over its environment: {text or f'exit {code}'}")
    normalise_upper(upper, lambda rel: os.listdir(lower / rel) if (lower / rel).is_dir() else [])
    return prune_upper(upper, lower)


def _merge_index(store: Path, envs: dict[str, EnvRecord], insts: dict[str, InstanceRecord],
                 shard: tuple[int, int] | None) -> Path:
    if shard:  # a fragment, as a sharded build writes: `image-builder index merge` joins them
        return write_fragment(store, f"shard-{shard[0]}-of-{shard[1]}-import", envs, insts)
    with item_lock(store, "index"):
        current = current_index(store)
        for iid in insts:
            if iid in current.instances and current.instances[iid].catalog not in ("", CATALOG):
                raise ImageBuilderError(f"instance {shown_id(iid)} is already in {store} from catalog "
                                        f"{current.instances[iid].catalog}; import it under another id")
        return write_index(store, replace(current, environments={**current.environments, **envs},
                                          instances={**current.instances, **insts}))
