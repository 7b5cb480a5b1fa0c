"""index.json: what a store holds, and the fast lookup graders resolve through.

`index.json` at the store root is the canonical record (described by
`index/schema.json`, checked field by field when read). Paths in it are
relative to the store, so a store can be copied or rsynced and still resolve.

Graders resolve one instance at a time, often from a fresh process, on stores
of 100,000 instances: parsing the whole JSON each time would cost seconds.
So every write also produces `index.sqlite`, a keyed copy stamped with the
JSON file's size, mtime and inode; a resolve checks the stamp with one stat
and answers with one query, or falls back to the JSON when the copy is stale.

This module imports nothing heavy: it is on the grader's start-up path.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from image_builder import __version__
from image_builder.errors import ImageBuilderError
from .files import atomic_write
from .ids import id_problem, shown_id

SCHEMA_VERSION = 1
INDEX_NAME = "index.json"
LOOKUP_NAME = "index.sqlite"


class IndexError_(ImageBuilderError):
    pass


@dataclass(frozen=True)
class Layer:
    """An environment's overlay: what an environment built `from:` another adds over it."""
    file: str  # relative to the store: envs/<build key>.sqfs (or the .sif, for what a build made)
    sha256: str
    size: int


@dataclass(frozen=True)
class EnvRecord:
    name: str
    sif: str  # relative to the store: the bottom image (of the root of a `from:` chain)
    sha256: str
    size: int
    base: str
    base_digest: str
    build_key: str
    built_at: int
    env: dict[str, str] = field(default_factory=dict)
    catalog: str = ""  # the declaring catalog's resolved path (a file name or "" in older indexes)
    overlays: tuple[Layer, ...] = ()  # over the sif, bottom to top: the chain's own layers

    @property
    def files(self) -> tuple[str, ...]:
        return (self.sif, *(layer.file for layer in self.overlays))

    @property
    def digests(self) -> tuple[str, ...]:
        return (self.sha256, *(layer.sha256 for layer in self.overlays))


@dataclass(frozen=True)
class InstanceRecord:
    id: str
    environment: str
    sqfs: str | None  # relative to the store; None when the instance adds nothing
    sha256: str | None
    size: int
    build_key: str
    workdir: str = "/"
    test_command: str | None = None
    grader: dict = field(default_factory=dict)  # what the catalog gave for graders (dataset fields, ...)
    catalog: str = ""  # as EnvRecord.catalog
    env: dict[str, str] = field(default_factory=dict)  # over the environment's (an imported image's own Env)
    command: list[str] = field(default_factory=list)  # an imported image's Entrypoint + Cmd
    # An imported image's User, as its config gives it: recorded for harnesses that pass it
    # on. Commands run as root of the sandbox, and every file is root's (its user namespace
    # maps root only), so it is not applied.
    user: str = ""


@dataclass(frozen=True)
class Index:
    environments: dict[str, EnvRecord]
    instances: dict[str, InstanceRecord]
    builder_version: str = __version__
    created: int = field(default_factory=lambda: int(time.time()))

    def file_sizes(self) -> dict[str, int]:
        """Every image file the index names, once (environments share files), with its size."""
        sizes = {}
        for env in self.environments.values():
            sizes[env.sif] = env.size
            sizes.update((layer.file, layer.size) for layer in env.overlays)
        sizes.update((inst.sqfs, inst.size) for inst in self.instances.values() if inst.sqfs)
        return sizes

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "builder_version": self.builder_version, "created": self.created,
                "environments": {k: asdict(v) for k, v in sorted(self.environments.items())},
                "instances": {k: asdict(v) for k, v in sorted(self.instances.items())}}


def _check(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise IndexError_(f"{where}: {what}")


_ENV_TYPES = {"name": str, "sif": str, "sha256": str, "size": int, "base": str, "base_digest": str,
              "build_key": str, "built_at": int, "env": dict, "catalog": str, "overlays": (list, tuple)}
_LAYER_TYPES = {"file": str, "sha256": str, "size": int}
_INST_TYPES = {"id": str, "environment": str, "sqfs": (str, type(None)), "sha256": (str, type(None)), "size": int,
               "build_key": str, "workdir": str, "test_command": (str, type(None)), "grader": dict, "catalog": str,
               "env": dict, "command": list, "user": str}


def _record(cls, types: dict, doc: object, where: str):
    _check(isinstance(doc, dict), where, "must be an object")
    for key in sorted(set(doc) - set(types))[:1]:
        raise IndexError_(f"{where}: unknown field {key!r}")
    for key, typ in types.items():
        if key in doc:
            _check(isinstance(doc[key], typ) and not isinstance(doc[key], bool), f"{where}.{key}",
                   f"wrong type {type(doc[key]).__name__}")
    try:
        return cls(**doc)
    except TypeError as e:
        raise IndexError_(f"{where}: {e}") from e


def _store_path(rel: str | None, directory: str, suffix: str, where: str) -> None:
    """A path the index records must name a file in the store's `directory`: graders mount it, verify hashes it."""
    if rel is None:
        return
    parts = rel.split("/")
    _check(len(parts) == 2 and parts[0] == directory and parts[1].endswith(suffix) and len(parts[1]) > len(suffix)
           and not parts[1].startswith(".") and "\0" not in rel, where,
           f"{rel!r} is not a file {directory}/NAME{suffix} of the store; the index is damaged or was not "
           "written by image-builder: rebuild it (image-builder build CATALOG --store STORE)")


def _no_nul(value: str | None, where: str) -> None:
    _check(value is None or "\0" not in value, where, "holds a NUL character")


def _env(doc: object, where: str) -> EnvRecord:
    rec = _record(EnvRecord, _ENV_TYPES, doc, where)
    layers = tuple(_record(Layer, _LAYER_TYPES, layer, f"{where}.overlays[{i}]") for i, layer in enumerate(rec.overlays))
    for i, layer in enumerate(layers):
        _store_path(layer.file, "envs", ".sqfs", f"{where}.overlays[{i}].file")
        _check(layer.size >= 0, f"{where}.overlays[{i}].size", "is negative")
    return replace(rec, overlays=layers)


def _checked_env(rec: EnvRecord, key: str, where: str) -> EnvRecord:
    problem = id_problem(key)
    _check(problem is None, where, f"environment name {shown_id(key)} {problem}")
    _check(rec.name == key, f"{where}.name", f"is {rec.name!r}, not the key {key!r}")
    _store_path(rec.sif, "envs", ".sif", f"{where}.sif")
    _check(rec.size >= 0, f"{where}.size", "is negative")
    _check_env(rec.env, f"{where}.env")
    return rec


def _check_env(env: dict, where: str) -> None:
    for k, v in env.items():  # the runtime puts these in every run's environment
        _check(isinstance(k, str) and k and "=" not in k and "\0" not in k and isinstance(v, str) and "\0" not in v,
               where, f"{k!r}: variables must be NAME: string, without '=' in NAME or NUL")


def _checked_instance(rec: InstanceRecord, key: str, where: str) -> InstanceRecord:
    problem = id_problem(key)
    _check(problem is None, where, f"instance id {shown_id(key)} {problem}")
    _check(rec.id == key, f"{where}.id", f"is {rec.id!r}, not the key {key!r}")
    _store_path(rec.sqfs, "instances", ".sqfs", f"{where}.sqfs")
    _check(rec.size >= 0, f"{where}.size", "is negative")
    _no_nul(rec.workdir, f"{where}.workdir")
    _no_nul(rec.test_command, f"{where}.test_command")
    _no_nul(rec.user, f"{where}.user")
    _check_env(rec.env, f"{where}.env")
    _check(all(isinstance(a, str) and "\0" not in a for a in rec.command), f"{where}.command",
           "must be a list of strings without NUL")
    return rec


def _mapping(doc: dict, key: str, where: str) -> dict:
    value = doc.get(key) or {}
    _check(isinstance(value, dict), f"{where}.{key}", f"must be an object, not a {type(value).__name__}")
    return value


def parse_index(doc: object, where: str) -> Index:
    """Check a parsed index.json against the schema (index/schema.json) and build the records."""
    _check(isinstance(doc, dict), where, "must be a JSON object")
    version = doc.get("schema_version")
    _check(version == SCHEMA_VERSION, f"{where}.schema_version",
           f"is {version!r}; this image-builder reads version {SCHEMA_VERSION}: upgrade it or rebuild the index")
    for key in sorted(set(doc) - {"schema_version", "builder_version", "created", "environments", "instances"})[:1]:
        raise IndexError_(f"{where}: unknown field {key!r}")
    created, builder = doc.get("created", 0), doc.get("builder_version", "")
    _check(isinstance(created, int) and not isinstance(created, bool), f"{where}.created", "must be an integer")
    _check(isinstance(builder, str), f"{where}.builder_version", "must be a string")
    envs = {k: _checked_env(_env(v, f"{where}.environments[{shown_id(k)}]"), k, f"{where}.environments[{shown_id(k)}]")
            for k, v in _mapping(doc, "environments", where).items()}
    insts = {k: _checked_instance(_record(InstanceRecord, _INST_TYPES, v, f"{where}.instances[{shown_id(k)}]"), k,
                                  f"{where}.instances[{shown_id(k)}]")
             for k, v in _mapping(doc, "instances", where).items()}
    for k, inst in insts.items():
        _check(inst.environment in envs, f"{where}.instances[{k!r}].environment",
               f"names {inst.environment!r}, which the index does not hold")
    return Index(envs, insts, builder, created)


def load_json(path: Path, what: str = "file") -> object:
    """A JSON file of the store, or an IndexError_ of one line: not UTF-8, not JSON, or nested too deep."""
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        why = "nested too deeply" if isinstance(e, RecursionError) else " ".join(str(e).split())
        raise IndexError_(f"{path}: not a valid JSON {what} ({why}); rebuild with image-builder build") from e


def read_index(store: Path) -> Index:
    path = Path(store) / INDEX_NAME
    try:
        doc = load_json(path, "index")
    except FileNotFoundError:
        raise IndexError_(f"{path}: no index; build the store first (image-builder build CATALOG --store "
                          f"{store})") from None
    except OSError as e:
        raise IndexError_(f"{path}: cannot read the index: {e.strerror}") from None
    return parse_index(doc, str(path))


def _stamp(st: os.stat_result) -> str:
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def index_stamp(store: Path) -> str:
    """What changes whenever index.json is written anew (OSError where it cannot be read)."""
    return _stamp(os.stat(Path(store) / INDEX_NAME))


def write_index(store: Path, index: Index) -> Path:
    """index.json (temp, fsync, rename), then its lookup copy stamped with the new file's identity."""
    store = Path(store)
    dest = store / INDEX_NAME
    data = json.dumps(index.to_json(), indent=1, sort_keys=True).encode()
    atomic_write(dest, lambda f: f.write(data))
    _write_lookup(store, index, _stamp(dest.stat()))
    return dest


def _write_lookup(store: Path, index: Index, stamp: str) -> None:
    import tempfile  # not on the run path, which only reads

    fd, tmp = tempfile.mkstemp(dir=store, prefix=f".{LOOKUP_NAME}.")
    os.close(fd)
    try:
        db = sqlite3.connect(tmp)
        db.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;"
                         "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT);"
                         "CREATE TABLE env(name TEXT PRIMARY KEY, doc TEXT);"
                         "CREATE TABLE inst(id TEXT PRIMARY KEY, doc TEXT);")
        db.execute("INSERT INTO meta VALUES ('stamp', ?)", (stamp,))
        db.executemany("INSERT INTO env VALUES (?, ?)",
                       ((k, json.dumps(asdict(v))) for k, v in index.environments.items()))
        db.executemany("INSERT INTO inst VALUES (?, ?)",
                       ((k, json.dumps(asdict(v))) for k, v in index.instances.items()))
        db.commit()
        db.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, store / LOOKUP_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def lookup(store: Path, instance_id: str) -> tuple[InstanceRecord, EnvRecord] | None:
    """The records of one instance from index.sqlite; None if the copy is missing or stale."""
    store = Path(store)
    try:
        stamp = index_stamp(store)
        db = sqlite3.connect(f"file:{store / LOOKUP_NAME}?mode=ro", uri=True)
    except (OSError, sqlite3.Error):
        return None
    try:
        row = db.execute("SELECT value FROM meta WHERE key='stamp'").fetchone()
        if not row or row[0] != stamp:
            return None
        inst = db.execute("SELECT doc FROM inst WHERE id=?", (instance_id,)).fetchone()
        if inst is None:
            raise KeyError(instance_id)
        # A derived copy, checked as the JSON is: a damaged or tampered row falls back to index.json.
        record = _checked_instance(_record(InstanceRecord, _INST_TYPES, json.loads(inst[0]), LOOKUP_NAME),
                                   instance_id, LOOKUP_NAME)
        env = db.execute("SELECT doc FROM env WHERE name=?", (record.environment,)).fetchone()
        if env is None:
            return None
        return record, _checked_env(_env(json.loads(env[0]), LOOKUP_NAME), record.environment, LOOKUP_NAME)
    except (sqlite3.Error, ValueError, RecursionError, TypeError, IndexError_):
        return None
    finally:
        db.close()
