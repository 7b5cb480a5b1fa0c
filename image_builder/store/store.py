"""Where a store keeps its files.

    STORE/
      index.json                 what the store holds (see index/schema.json)
      envs/<key>.sif             one image per distinct environment, named by its build key
      envs/<key>.sqfs            what an environment built `from:` another adds over it
      instances/<id>.sqfs        one overlay per instance
      logs/envs/<name>/          build logs, one file per script
      logs/instances/<id>.log
      failed/envs/<name>/        a failed build's root filesystem, kept for `debug`
      work/                      builds in progress (removed when they end)

Every path the index records is relative to STORE, so a store can be copied
or rsynced to a shared filesystem and still resolve.

Ids (environment names, instance ids) become file names here (StorePaths) and
nowhere else, by the rule of ids.py, checked where ids are read (catalogs,
datasets, the index) and again here.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from image_builder.errors import ImageBuilderError
from image_builder.oci.trees import remove
from .ids import MAX_FILE_NAME, file_name, id_problem, shown_id
from .index import INDEX_NAME, Index, IndexError_, index_stamp, lookup, read_index

def _path_name(ident: str) -> str:
    # The last check before an id touches the filesystem, for callers that did not validate (CLI arguments).
    problem = id_problem(ident, MAX_FILE_NAME + 16)  # room for the "inst-"/"env-" of work trees and locks
    if problem:
        raise ImageBuilderError(f"{shown_id(ident)} is not a valid environment or instance id: it {problem}")
    return file_name(ident)


def remove_tree(path: Path) -> None:
    """rm -rf `path`, of any depth (what a build script or a sandbox left), read-only directories too
    (overlayfs leaves its work directory's `work/` at mode 000, which its unprivileged owner cannot even
    list): oci.trees.remove."""
    if path.name in ("", ".."):  # "", ".", "/" or "x/..": never a tree of ours, always a caller's bug
        raise ImageBuilderError(f"refusing to remove {str(path)!r}")
    remove(path)


def builder_mark() -> str:
    """This build process as the names of what it leaves behind carry it (a work tree, a sandbox's staging):
    NODE@PID, for a later build to tell whether it is gone (dead_builder)."""
    return f"{socket.gethostname()}@{os.getpid()}"


def dead_builder(mark: str) -> bool:
    """Whether NODE@PID names a build process of this node that has no process: only this node's (on a shared
    filesystem another node's build may be alive)."""
    host, _, pid = mark.rpartition("@")
    return host == socket.gethostname() and pid.isdigit() and not Path(f"/proc/{pid}").exists()


def remove_dead_work(root: Path) -> list[str]:
    """Work trees of builds whose process is gone (killed, node rebooted); returns what went."""
    removed = []
    work = root / "work"
    for entry in work.iterdir() if work.is_dir() else ():
        if dead_builder("@".join(entry.name.split("@")[-2:])):  # NAME@NODE@PID
            remove_tree(entry)
            removed.append(str(entry.relative_to(root)))
    return removed


@dataclass(frozen=True)
class StorePaths:
    root: Path

    def env_image(self, build_key: str, suffix: str = ".sif") -> Path:
        """Environments are stored by build key: names with one key share one file (128 bits of it name the
        file; the full key is in the image's labels and is what a rebuild compares)."""
        algorithm, _, digest = build_key.partition(":")
        if algorithm != "sha256" or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            raise ImageBuilderError(f"{build_key!r} is not a build key")
        return self.root / "envs" / f"{digest[:32]}{suffix}"

    def instance_sqfs(self, instance_id: str) -> Path:
        return self.root / "instances" / f"{_path_name(instance_id)}.sqfs"

    def env_logs(self, name: str) -> Path:
        return self.root / "logs" / "envs" / _path_name(name)

    def instance_log(self, instance_id: str) -> Path:
        return self.root / "logs" / "instances" / f"{_path_name(instance_id)}.log"

    def failed_env(self, name: str) -> Path:
        return self.root / "failed" / "envs" / _path_name(name)

    def failed_instance(self, instance_id: str) -> Path:
        return self.root / "failed" / "instances" / _path_name(instance_id)

    def work(self, name: str) -> Path:
        return self.root / "work" / f"{_path_name(name)}@{builder_mark()}"

    def lock(self, name: str, suffix: str = ".lock") -> Path:
        """locks/<name>.lock: per-item build locks ("env-NAME", "inst-ID", "index")."""
        return self.root / "locks" / f"{_path_name(name)}{suffix}"

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.root))


@dataclass(frozen=True)
class ResolvedInstance:
    """An instance's layers in mount order, and what a grader needs to run it."""
    id: str
    environment: str
    env_sif: Path
    overlays: tuple[Path, ...]  # the environment's own layers, then the instance's, bottom to top
    env: dict[str, str]
    workdir: str
    test_command: str | None
    grader: dict
    digests: tuple[str, ...] = ()  # sha256 of env_sif, then of each overlay, as the index records them
    command: tuple[str, ...] = ()  # the default command (an imported image's), run when none is given
    user: str = ""  # an imported image's User (InstanceRecord.user)

    @property
    def layers(self) -> tuple[Path, ...]:
        return (self.env_sif, *self.overlays)


class UnknownInstance(ImageBuilderError, KeyError):
    def __str__(self) -> str:
        return self.args[0]


RESOLVED_KEPT = 4096  # instances a Store keeps resolved


class Store:
    """A built store, opened for reading: `Store.open(path).resolve(instance_id)`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.paths = StorePaths(self.root)
        self._index: Index | None = None
        self._resolved: dict[str, tuple[str, ResolvedInstance]] = {}  # id -> (index_stamp, its resolution)
        self._resolved_lock = threading.Lock()

    @classmethod
    def open(cls, path: Path | str) -> Store:
        store = cls(Path(path))
        try:
            found = (store.root / INDEX_NAME).is_file()
        except OSError as e:  # a store of another user's: not readable by this one
            raise IndexError_(f"{store.root}: cannot read its {INDEX_NAME} ({e.strerror}); its owner can share it "
                              f"with `chmod -R a+rX {store.root}`") from None
        if not found:
            raise IndexError_(f"{store.root}: not a store (no {INDEX_NAME}); build one with "
                              f"image-builder build CATALOG --store {store.root}")
        return store

    @property
    def index(self) -> Index:
        if self._index is None:
            self._index = read_index(self.root)
        return self._index

    def resolve(self, instance_id: str) -> ResolvedInstance:
        """The instance's layers and grader data. Kept while index.json is not written anew (RESOLVED_KEPT
        of them): a trainer grades the same tasks over and over, and a lookup cost the grader 0.7 ms of CPU
        a task, a tenth of an MBPP case's."""
        try:
            stamp = index_stamp(self.root)
        except OSError:
            stamp = None
        with self._resolved_lock:
            kept = self._resolved.get(instance_id)
        if kept is not None and kept[0] == stamp:
            return kept[1]
        resolved = self._resolve(instance_id)
        if stamp is not None:
            with self._resolved_lock:
                if len(self._resolved) >= RESOLVED_KEPT:
                    del self._resolved[next(iter(self._resolved))]  # the first kept
                self._resolved[instance_id] = (stamp, resolved)
        return resolved

    def _resolve(self, instance_id: str) -> ResolvedInstance:
        unknown = UnknownInstance(f"no instance {instance_id!r} in {self.root}; "
                                  "`image-builder ls` lists what the store holds")
        try:
            found = lookup(self.root, instance_id)  # None: the lookup copy is missing or stale
        except KeyError:
            raise unknown from None
        if found is None:
            inst = self.index.instances.get(instance_id)
            if inst is None:
                raise unknown
            found = inst, self.index.environments[inst.environment]
        inst, env = found
        files = (*env.files, *((inst.sqfs,) if inst.sqfs else ()))
        digests = (*env.digests, *((inst.sha256,) if inst.sqfs else ()))
        return ResolvedInstance(inst.id, inst.environment, self.root / files[0], tuple(self.root / f for f in files[1:]),
                                {**env.env, **inst.env}, inst.workdir, inst.test_command, inst.grader, digests,
                                tuple(inst.command), inst.user)


@dataclass
class VerifyReport:
    checked: int = 0
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    orphaned: list[str] = field(default_factory=list)
    history: list[str] = field(default_factory=list)  # "<id>: what its repository holds beyond its base commit"

    @property
    def ok(self) -> bool:
        return not (self.missing or self.corrupt or self.history)


def _store_files(root: Path) -> set[str]:
    """Image files in the store's image directories, relative to the store."""
    found = set()
    for sub, suffix in (("envs", ".sif"), ("envs", ".sqfs"), ("instances", ".sqfs")):
        for p in (root / sub).glob(f"*{suffix}") if (root / sub).is_dir() else ():
            found.add(f"{sub}/{p.name}")
    return found


def verify(store: Store) -> VerifyReport:
    """Re-hash every file the index names; list the image files it does not name. (`history` is
    filled by build.repo_history.check_histories, which runs each instance.)"""
    from image_builder.oci.cache import sha256_file
    report = VerifyReport()
    index = store.index
    expected = {f: d for r in index.environments.values() for f, d in zip(r.files, r.digests)}
    expected.update({r.sqfs: r.sha256 for r in index.instances.values() if r.sqfs})
    for rel, digest in sorted(expected.items()):
        report.checked += 1
        path = store.root / rel
        if not path.is_file():
            report.missing.append(rel)
        elif sha256_file(path) != digest:
            report.corrupt.append(rel)
    report.orphaned = sorted(_store_files(store.root) - set(expected))
    return report


def gc(store: Store, *, keep_failed: bool = False) -> list[str]:
    """Remove what the index no longer references: image files and their records, temporary
    files, work trees of dead builds, and (unless keep_failed) failed builds. Returns what went."""
    removed = []
    index = store.index
    referenced = {f for r in index.environments.values() for f in r.files}
    referenced |= {r.sqfs for r in index.instances.values() if r.sqfs}
    for rel in sorted(_store_files(store.root) - referenced):
        for p in (store.root / rel, (store.root / rel).with_suffix(".json")):
            if p.exists():
                p.unlink()
                removed.append(str(p.relative_to(store.root)))
    # An id may itself hold ".tmp-": what the index names, and its record, is never a temporary.
    keep = referenced | {str(Path(rel).with_suffix(".json")) for rel in referenced}
    keep |= {store.paths.relative(store.paths.instance_sqfs(i).with_suffix(".json")) for i in index.instances}
    for sub in ("envs", "instances"):
        temporaries = set()
        if (store.root / sub).is_dir():
            temporaries = {*(store.root / sub).glob(".*"), *(store.root / sub).glob("*.tmp-*")}
        for p in sorted(temporaries):  # temporary files of interrupted writes
            if str(p.relative_to(store.root)) not in keep:
                remove_tree(p)
                removed.append(str(p.relative_to(store.root)))
    removed += remove_dead_work(store.root)
    failed = store.root / "failed"
    if failed.is_dir() and not keep_failed:
        for entry in sorted(failed.glob("*/*")):
            remove_tree(entry)
            removed.append(str(entry.relative_to(store.root)))
    return removed
