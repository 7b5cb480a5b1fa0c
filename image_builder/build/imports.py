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

The instance's workdir repository is then pruned as every built instance's is
(repo_history: HEAD and its ancestors only), in the build sandbox over the packed
environment and overlay; what that changes is folded into the overlay.

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
import subprocess
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
from image_builder.pack.overlay import DiffStats, diff_trees, is_whiteout, normalise_upper, prune_upper
from image_builder.pack.sif import partition_offset, write_sif, write_singularity_env
from image_builder.pack.squashfs import SquashOptions, list_layer, list_paths, pack
from image_builder.store.ids import id_problem, shown_id
from image_builder.store.index import EnvRecord, InstanceRecord, write_index
from image_builder.store.store import StorePaths, remove_tree
from .envbuild import LABEL_PREFIX, BuildOptions, clamp_to_epoch, current_key, lower_children
from .instances import InstanceBuild, read_record, write_record
from .repo_history import HISTORY_SCRIPT, STAGED_AS, prune_command, script_digest
from .sandbox import Overlay, SandboxSpec, SquashImage, detect_backend, run as sandbox_run
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
            fresh = {}
            for i in members:  # against the image's own tree, before Apptainer's files are added to it
                fresh[i] = kept.get(i) or _pack_instance(paths, ids[i], images[i], n, lower, work, name, key,
                                                         opts.build.squash)
            _pack_env(paths, key, named_by, lower, env, opts.build.squash)
            for i, build in fresh.items():
                if i not in kept:  # recorded only once pruned: an interrupted import redoes it
                    build = _prune_history(paths, items[i].ref, build, images[i], key, lower, work,
                                           _workdir(items[i], images[i]), opts.build)
                    write_record(paths, build)
                insts[ids[i]] = _instance_record(ids[i], items[i], images[i], name, env, build, paths)
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
    doc = {"env": env_build_key, "image": img.digest, "n": n, "history": script_digest()}
    return "sha256:" + hashlib.sha256(json.dumps(doc).encode()).hexdigest()


def _workdir(item: ImportItem, img: PulledImage) -> str:
    return item.workdir or _config(img).get("WorkingDir") or "/"


def _instance_record(iid: str, item: ImportItem, img: PulledImage, env_name: str, env: dict[str, str],
                     build: InstanceBuild, paths: StorePaths) -> InstanceRecord:
    config = _config(img)
    own_env = {k: v for k, v in img.env.items() if env.get(k) != v}
    command = [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]
    return InstanceRecord(iid, env_name, paths.relative(build.sqfs) if build.sqfs else None, build.sha256,
                          build.size, build.build_key, _workdir(item, img), None,
                          {"image": img.reference, "image_digest": img.digest}, CATALOG, own_env, command,
                          config.get("User") or "")


def _pack_instance(paths: StorePaths, iid: str, img: PulledImage, n: int, lower: Path, work: Path,
                   env_name: str, env_build_key: str, squash: SquashOptions) -> InstanceBuild:
    """The image's difference against its environment's tree, packed (its record is the caller's to write)."""
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
    return build


def _prune_history(paths: StorePaths, ref: str, build: InstanceBuild, img: PulledImage, env_key: str, lower: Path,
                   work: Path, workdir: str, opts: BuildOptions) -> InstanceBuild:
    """The workdir's repository pruned to HEAD and its ancestors (repo_history), in the build sandbox over the
    packed environment and the instance's overlay; what that changed folded into the overlay, repacked."""
    rel = workdir.strip("/")
    if not os.path.lexists(lower / rel / ".git") and not (build.sqfs and list_paths(build.sqfs, f"/{rel}/.git")):
        return build  # no repository there: no sandbox to start
    sif = paths.env_image(env_key)
    lowers = (SquashImage(sif, partition_offset(sif)[0]), *((SquashImage(build.sqfs),) if build.sqfs else ()))
    stem = f"history-{time.monotonic_ns()}"
    changes, scratch, root, tree = (work / f"{stem}-{what}" for what in ("upper", "work", "root", "tree"))
    for d in (changes, scratch, root):
        d.mkdir()
    log = paths.instance_log(build.id)
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        result = sandbox_run(SandboxSpec(root, env=dict(img.env), workdir="/", host_network_files=False,
                                         overlay=Overlay(lowers, changes, scratch)),
                             ["/bin/sh", "-c", prune_command(workdir)], backend=opts.backend or detect_backend(),
                             timeout=600, log=log, files={STAGED_AS: HISTORY_SCRIPT.encode()})
        if result.returncode != 0:
            why = result.tail[-1] if result.tail else f"exit {result.returncode}"
            raise ImageBuilderError(f"{ref}: cannot prune {workdir}/.git to its HEAD and ancestors: {why}; log: {log}")
        stats = normalise_upper(changes, lower_children(lowers))
        if not (stats.entries or stats.whiteouts):
            return build  # nothing beyond HEAD's history: the overlay stands
        tree.mkdir()
        if build.sqfs:
            _unpack_layer(build.sqfs, tree)
        _fold(changes, tree, lower)
        clamp_to_epoch(tree)
        sqfs = paths.instance_sqfs(build.id)
        with item_lock(paths.root, f"inst-{build.id}"):
            pack(tree, sqfs, replace(opts.squash, all_root=True))
        st = sqfs.stat()
        return replace(build, sqfs=sqfs, sha256=sha256_file(sqfs), size=st.st_size, mtime_ns=st.st_mtime_ns)
    finally:
        for d in (changes, scratch, root, tree):
            remove_tree(d)


def _unpack_layer(image: Path, dest: Path) -> None:
    """An overlay layer as it is packed, whiteouts included: unprivileged unsquashfs makes no character
    devices, so they are left out and the whiteouts made from the image's listing."""
    listing = list_layer(image)
    exclude = dest.with_name(f"{dest.name}.exclude")
    exclude.write_text("".join(f"{p}\n" for p, kind in listing.kinds.items() if kind in "bcps"))
    r = subprocess.run(["unsquashfs", "-no-progress", "-quiet", "-no-wildcards", "-f", "-exclude-file", str(exclude),
                        *([] if os.geteuid() == 0 else ["-user-xattrs"]), "-dest", str(dest), str(image)],
                       stdin=subprocess.DEVNULL, capture_output=True)
    exclude.unlink()
    if r.returncode:
        why = (r.stderr or r.stdout).decode(errors="replace").strip().splitlines()[-1:] or [f"exit {r.returncode}"]
        raise ImageBuilderError(f"{image}: cannot unpack the overlay to fold its repository's pruning in: {why[0]}")
    for p in listing.whiteouts:
        os.mknod(dest / p.lstrip("/"), stat.S_IFCHR, os.makedev(0, 0))


def _fold(changes: Path, tree: Path, lower: Path) -> None:
    """`changes` (an overlay upper over `tree` over `lower`) into `tree`: each entry it holds replaces tree's; a
    whiteout stays only where `lower` holds something to hide (a whiteout over nothing shows in a listing of a
    directory no other layer has). Directories are made real top-down, so nothing written goes through a
    symlink of the tree."""
    made = []
    for dirpath, dirnames, filenames in os.walk(changes):
        rel = Path(os.path.relpath(dirpath, changes))
        there = tree / rel
        for name in dirnames:
            dest = there / name
            if os.path.lexists(dest) and (dest.is_symlink() or not dest.is_dir()):
                remove_tree(dest)
            dest.mkdir(exist_ok=True)
            made.append((os.lstat(os.path.join(dirpath, name)), dest))
        for name in filenames:
            src, dest = os.path.join(dirpath, name), there / name
            if os.path.lexists(dest):
                remove_tree(dest)
            if is_whiteout(os.lstat(src)) and not _holds(lower, rel / name):
                continue
            os.rename(src, dest)
    for st, dest in reversed(made):  # deepest first: what goes into a directory changes its times
        os.chmod(dest, stat.S_IMODE(st.st_mode))
        os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns))


def _holds(root: Path, rel: Path) -> bool:
    """Whether the tree `root` has an entry at `rel`, through real directories only (none of its symlinks
    followed)."""
    path = root
    for i, part in enumerate(rel.parts):
        path = path / part
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if i < len(rel.parts) - 1 and not stat.S_ISDIR(st.st_mode):
            return False
    return True


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
