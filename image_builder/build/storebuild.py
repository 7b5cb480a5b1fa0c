"""Building a whole store: environments first, then instances, N at a time.

One failure does not stop the rest (unless fail_fast). Every item is built
under its own file lock, so two builds of one store cooperate instead of
corrupting it: the second waits for an item, then finds it up to date.
Finished items are recorded beside their files (`envs/<name>.json`,
`instances/<id>.json`), so a build killed at any point resumes where it
stopped; the index is written last, from what is finished and verified.
With `--shard K/N` a build writes an index fragment that `merge_fragments`
combines, for cluster admins splitting a store over a job array. Shards build
the environments their instances need, each starting from a different one, so
they build distinct environments at once and wait for the rest; with an
`attempt` id (a Slurm array job's), an environment whose build failed in one
shard is not tried again by the others of the same attempt.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

from image_builder.errors import ImageBuilderError
from image_builder.oci.cache import sha256_file
from image_builder.runtime.extract import remove_proot_leftovers
from image_builder.store.files import atomic_write
from image_builder.store.ids import shown_id
from image_builder.store.index import (EnvRecord, Index, IndexError_, InstanceRecord, Layer, load_json,
                                       parse_index, read_index, write_index)
from image_builder.store.store import StorePaths, remove_dead_work
from .catalog import Catalog, EnvironmentSpec, InstanceSpec
from .envbuild import BuildFailed, BuildOptions, EnvBuild, build_environment, plan_environment
from .instances import InstanceBuild, build_instance
from .sandbox import halted, remove_dead_staging

FRAGMENTS_DIR = "index.d"


@dataclass(frozen=True)
class StoreBuildOptions:
    build: BuildOptions  # store, cache, registry, backend, squash, verbose, force
    jobs: int = 2
    only: frozenset[str] = frozenset()  # instance ids or environment names
    shard: tuple[int, int] | None = None  # (k, n): instances k, k+n, k+2n, ... in id order
    fail_fast: bool = False
    environments_only: bool = False
    attempt: str | None = None  # shared by the shards of one submission (see the module docstring)


@dataclass(frozen=True)
class ItemResult:
    kind: str  # environment | instance
    name: str
    status: str  # built | up to date | failed | skipped
    seconds: float = 0.0
    size: int = 0
    message: str = ""
    log: str | None = None
    tail: tuple[str, ...] = ()  # last lines of a failed script's log


@dataclass
class BuildSummary:
    results: list[ItemResult] = field(default_factory=list)
    seconds: float = 0.0
    index: Path | None = None
    shared: list[tuple[str, list[str]]] = field(default_factory=list)  # (environment, others of its build key)

    @property
    def failed(self) -> list[ItemResult]:
        return [r for r in self.results if r.status == "failed"]

    def count(self, kind: str, status: str) -> int:
        return sum(1 for r in self.results if r.kind == kind and r.status == status)


class Reporter(Protocol):
    def start(self, kind: str, name: str) -> None: ...
    def done(self, result: ItemResult) -> None: ...


class SilentReporter:
    def start(self, kind, name): pass
    def done(self, result): pass


@contextmanager
def item_lock(store: Path, name: str) -> Iterator[None]:
    lock = StorePaths(store).lock(name)  # named as the store names ids: escaped, never outside locks/
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def expand_only(catalog: Catalog, patterns: tuple[str, ...]) -> frozenset[str]:
    """`--only` values: environment or instance names, shell globs of them, several to a value with commas."""
    names = [*catalog.environments, *catalog.instances]
    chosen: set[str] = set()
    for pattern in (p.strip() for value in patterns for p in value.split(",")):
        if not pattern:
            continue
        matched = fnmatch.filter(names, pattern) if any(c in pattern for c in "*?[") else \
            [pattern] if pattern in names else []
        if not matched:
            raise ImageBuilderError(f"--only {pattern!r}: no environment or instance in {catalog.path} matches; "
                                    "give a name the catalog declares, or a glob (quoted) matching some")
        chosen.update(matched)
    return frozenset(chosen)


def select(catalog: Catalog, only: frozenset[str], shard: tuple[int, int] | None, environments_only: bool = False
           ) -> tuple[list[EnvironmentSpec], list[InstanceSpec]]:
    unknown = sorted(only - set(catalog.environments) - set(catalog.instances))
    if unknown:
        raise ImageBuilderError(f"--only {unknown[0]!r}: no such environment or instance in {catalog.path}")
    instances = [catalog.instances[i] for i in sorted(catalog.instances)]
    if only:
        instances = [i for i in instances if i.id in only or i.environment in only]
    if shard:
        k, n = shard
        instances = [inst for pos, inst in enumerate(instances) if pos % n == k]
    wanted = {i.environment for i in instances} | (only & set(catalog.environments))
    if not only and (not shard or shard[0] == 0):
        # A full build has the environments no instance uses, so the N shards together do too: shard 0 builds them.
        wanted |= set(catalog.environments) - {i.environment for i in catalog.instances.values()}
    for name in list(wanted):  # and what they are built on
        while catalog.environments[name].parent:
            name = catalog.environments[name].parent
            wanted.add(name)
    envs = [catalog.environments[n] for n in catalog.environments if n in wanted]
    if shard and envs:  # shard k starts k environments further on: concurrent shards build different ones
        start = shard[0] % len(envs)
        envs = envs[start:] + envs[:start]
    return envs, [] if environments_only else instances


def drop_if_corrupt(sif: Path) -> None:
    """An environment image (.sif or .sqfs) whose bytes no longer match its record is removed, so the
    build makes it again."""
    try:
        old = json.loads(sif.with_suffix(".json").read_text())
        st = sif.stat()
    except (OSError, ValueError):
        return
    if (st.st_size, st.st_mtime_ns) != (old.get("size"), old.get("mtime_ns")) and sha256_file(sif) != old.get("sha256"):
        sif.unlink()
        sif.with_suffix(".json").unlink(missing_ok=True)


def image_record(paths: StorePaths, image: Path, build_key: str) -> Layer:
    """An environment's image file (a .sif, or an overlay) as the index records it, hashed only when it
    changed since the record beside it."""
    sidecar = image.with_suffix(".json")
    st = image.stat()
    try:
        old = json.loads(sidecar.read_text())
        if old["build_key"] == build_key and old["size"] == st.st_size and old["mtime_ns"] == st.st_mtime_ns:
            return Layer(paths.relative(image), old["sha256"], st.st_size)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = sha256_file(image)
    doc = {"build_key": build_key, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest,
           "built_at": int(st.st_mtime)}
    atomic_write(sidecar, lambda f: f.write(json.dumps(doc).encode()))
    return Layer(paths.relative(image), digest, st.st_size)


def _env_record(paths: StorePaths, build: EnvBuild, catalog: str, parent: EnvRecord | None) -> EnvRecord:
    own = image_record(paths, build.image, build.build_key)
    built_at = int(build.image.stat().st_mtime)
    if parent is None:  # the bottom image: the record's own sif
        return EnvRecord(build.name, own.file, own.sha256, own.size, build.base, build.base_digest,
                         build.build_key, built_at, build.env, catalog)
    return replace(parent, name=build.name, build_key=build.build_key, built_at=built_at, env=build.env,
                   catalog=catalog, overlays=(*parent.overlays, own))


def _instance_record(paths: StorePaths, spec: InstanceSpec, build: InstanceBuild, catalog: str) -> InstanceRecord:
    return InstanceRecord(spec.id, spec.environment, paths.relative(build.sqfs) if build.sqfs else None,
                          build.sha256, build.size, build.build_key, spec.workdir, spec.test_command, spec.grader,
                          catalog)


def _failure(kind: str, name: str, t0: float, e: Exception) -> ItemResult:
    if isinstance(e, BuildFailed):
        return ItemResult(kind, name, "failed", time.monotonic() - t0, message=str(e),
                          log=str(e.log) if e.log else None, tail=e.tail)
    return ItemResult(kind, name, "failed", time.monotonic() - t0, message=f"{kind} {name}: {e}")


def build_store(catalog: Catalog, opts: StoreBuildOptions, reporter: Reporter = SilentReporter()) -> BuildSummary:
    t0 = time.monotonic()
    store = opts.build.store
    paths = StorePaths(store)
    store.mkdir(parents=True, exist_ok=True)
    remove_dead_work(store)
    remove_dead_staging()
    remove_proot_leftovers()  # a killed proot build's (its guards take proot down after the builder)
    envs, instances = select(catalog, opts.only, opts.shard, opts.environments_only)
    _check_ownership(store, catalog)
    owner = catalog_id(catalog)
    summary = BuildSummary()
    env_builds: dict[str, EnvBuild] = {}
    env_records: dict[str, EnvRecord] = {}
    inst_records: dict[str, InstanceRecord] = {}
    stop = False

    def build_env(spec: EnvironmentSpec) -> ItemResult:
        start = time.monotonic()
        parent = env_builds.get(spec.parent) if spec.parent else None
        if spec.parent and parent is None:
            return ItemResult("environment", spec.name, "skipped", message=f"environment {spec.parent} failed")
        reporter.start("environment", spec.name)
        try:
            plan = plan_environment(spec, opts.build, parent)
            # Locked by key, not name: names that share a key build one image, once.
            with item_lock(store, f"env-{plan.build_key[7:39]}"):
                failed_in = paths.lock(f"env-{spec.name}", ".failed")
                if opts.attempt and failed_in.exists() and failed_in.read_text() == opts.attempt:
                    raise ImageBuilderError(f"its build failed in another shard of this submission; log: "
                                            f"{paths.env_logs(spec.name)}")
                drop_if_corrupt(plan.image)
                try:
                    build = build_environment(plan, opts.build)
                except BuildFailed:
                    if opts.attempt:
                        failed_in.write_text(opts.attempt)
                    raise
                failed_in.unlink(missing_ok=True)
                env_records[spec.name] = _env_record(paths, build, owner,
                                                     env_records[spec.parent] if spec.parent else None)
            env_builds[spec.name] = build
            own = env_records[spec.name].overlays[-1].size if spec.parent else env_records[spec.name].size
            return ItemResult("environment", spec.name, "built" if build.built else "up to date",
                              time.monotonic() - start, own)
        except ImageBuilderError as e:
            return _failure("environment", spec.name, start, e)

    def build_inst(spec: InstanceSpec) -> ItemResult:
        start = time.monotonic()
        env = env_builds.get(spec.environment)
        if env is None or stop:
            why = "stopped after a failure (--fail-fast)" if stop else f"environment {spec.environment} failed"
            return ItemResult("instance", spec.id, "skipped", message=why)
        reporter.start("instance", spec.id)
        try:
            with item_lock(store, f"inst-{spec.id}"):
                build = build_instance(spec, env, store, backend=opts.build.backend, squash=opts.build.squash,
                                       verbose=opts.build.verbose, force=opts.build.force)
            inst_records[spec.id] = _instance_record(paths, spec, build, owner)
            return ItemResult("instance", spec.id, "built" if build.built else "up to date",
                              time.monotonic() - start, build.size)
        except ImageBuilderError as e:
            return _failure("instance", spec.id, start, e)

    try:
        for work, items in ((build_env, envs), (build_inst, instances)):
            # An environment starts once the one it is built on has finished (built, failed or skipped).
            building = {e.name for e in envs}
            waiting = [e for e in items if isinstance(e, EnvironmentSpec) and e.parent in building]
            with ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
                pending: set[Future] = {pool.submit(work, item) for item in items if item not in waiting}
                try:
                    while pending:
                        finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                        for fut in finished:
                            result = fut.result()
                            summary.results.append(result)
                            reporter.done(result)
                            if result.status == "failed" and opts.fail_fast:
                                stop = True
                            for child in [c for c in waiting if c.parent == result.name]:
                                waiting.remove(child)
                                pending.add(pool.submit(work, child))
                except BaseException:  # Ctrl-C, SIGTERM: the running scripts end now, no item starts
                    stop = True
                    for fut in pending:
                        fut.cancel()
                    with halted():
                        pool.shutdown(wait=True)
                    raise
    finally:  # also on Ctrl-C: record what is finished
        summary.index = _update_index(store, catalog, opts, env_records, inst_records)
        summary.seconds = time.monotonic() - t0
    summary.shared = _shared(envs, env_builds)
    return summary


def _shared(envs: list[EnvironmentSpec], builds: dict[str, EnvBuild]) -> list[tuple[str, list[str]]]:
    """(first name, the others) for each image that several environments of this build share."""
    by_key: dict[str, list[str]] = {}
    for spec in envs:
        if spec.name in builds:
            by_key.setdefault(builds[spec.name].build_key, []).append(spec.name)
    return [(names[0], names[1:]) for names in by_key.values() if len(names) > 1]


def catalog_id(catalog: Catalog) -> str:
    """What the index records as an item's catalog: the catalog file's resolved path. Its name alone
    made two `catalog.yaml` of different folders one owner, each build replacing the other's items."""
    return str(catalog.path.resolve())


def _is_mine(owner: str, catalog: Catalog) -> bool:
    """Whether an item the index records as from catalog `owner` is this catalog's: the same file; or
    recorded by name only (indexes before paths were kept) and named as this one; or a file of this
    name that is gone (the catalog was moved) or holds the same bytes (a copy: another clone of the
    same commit, whose `make demo` shares the demo's stores)."""
    mine = catalog_id(catalog)
    if owner == mine:
        return True
    if "/" not in owner:
        return owner == catalog.path.name
    if Path(owner).name != catalog.path.name:
        return False
    try:
        return Path(owner).read_bytes() == catalog.path.read_bytes()
    except FileNotFoundError:
        return True
    except OSError:  # unreadable: another user's, perhaps; not ours to replace
        return False


def _check_ownership(store: Path, catalog: Catalog) -> None:
    """Two catalogs in one store must not declare the same environment or instance: the second build
    would replace the first's (and a full build of either would drop the other's)."""
    current = current_index(store)
    others = {o for o in {r.catalog for r in (*current.environments.values(), *current.instances.values())}
              if o and not _is_mine(o, catalog)}  # once per owner: _is_mine may read two catalog files
    for kind, declared, held in (("environment", catalog.environments, current.environments),
                                 ("instance", catalog.instances, current.instances)):
        for name in declared:
            owner = held[name].catalog if name in held else ""
            if owner in others:
                raise ImageBuilderError(f"{catalog.path}: {kind} {shown_id(name)} is already in {store} from "
                                        f"catalog {owner}; rename it in one of them (generated ones: swebench "
                                        "catalog --prefix NAME) or build into another store")


def write_fragment(store: Path, name: str, envs: dict[str, EnvRecord], instances: dict[str, InstanceRecord]
                   ) -> Path:
    """index.d/<name>.json, a shard's part of the index: `merge_fragments` joins them."""
    dest = store / FRAGMENTS_DIR / f"{name}.json"
    dest.parent.mkdir(exist_ok=True)
    text = json.dumps(Index(envs, instances).to_json(), indent=1, sort_keys=True)
    atomic_write(dest, lambda f: f.write(text.encode()))
    return dest


def current_index(store: Path) -> Index:
    """The store's index as it is, empty when there is none or it is unreadable (rebuilt from what is known)."""
    try:
        return read_index(store) if (store / "index.json").exists() else Index({}, {})
    except IndexError_:
        return Index({}, {})


def _update_index(store: Path, catalog: Catalog, opts: StoreBuildOptions, envs: dict[str, EnvRecord],
                  instances: dict[str, InstanceRecord]) -> Path:
    if opts.shard:
        return write_fragment(store, f"shard-{opts.shard[0]}-of-{opts.shard[1]}", envs, instances)
    with item_lock(store, "index"):
        current = current_index(store)
        # Items that failed this time keep their last verified build; new builds replace theirs.
        envs = {**current.environments, **envs}
        instances = {**current.instances, **instances}
        if not opts.only:  # a full build: nothing this catalog no longer declares; other catalogs' items stay
            # decided once per owner, not per item: _is_mine may read two catalog files
            mine = {o for o in {v.catalog for v in (*envs.values(), *instances.values())} if _is_mine(o, catalog)}
            envs = {k: v for k, v in envs.items() if k in catalog.environments or v.catalog not in mine}
            instances = {k: v for k, v in instances.items() if k in catalog.instances or v.catalog not in mine}
        instances = {k: v for k, v in instances.items() if v.environment in envs}
        return write_index(store, Index(envs, instances))


def merge_fragments(store: Path) -> tuple[Path, int]:
    """Combine the shards' index fragments into index.json, over what it already holds (another
    catalog's items, an earlier import: a sharded build must not drop them); returns (path,
    fragments merged)."""
    fragments = sorted((store / FRAGMENTS_DIR).glob("shard-*.json"))
    if not fragments:
        raise ImageBuilderError(f"{store / FRAGMENTS_DIR}: no index fragments to merge; build with --shard K/N first")
    parsed = [parse_index(load_json(frag, "index fragment"), str(frag)) for frag in fragments]
    with item_lock(store, "index"):
        current = current_index(store)
        envs, instances = dict(current.environments), dict(current.instances)
        for index in parsed:
            envs.update(index.environments)
            instances.update(index.instances)
        return write_index(store, Index(envs, instances)), len(fragments)


def to_json(summary: BuildSummary) -> dict:
    return {"seconds": summary.seconds, "index": str(summary.index) if summary.index else None,
            "results": [asdict(r) for r in summary.results],
            "shared": [{"environment": first, "same": others} for first, others in summary.shared]}
