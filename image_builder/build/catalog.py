"""Catalogs: what a store holds, declared in YAML and validated before any work.

    bases:                      # optional aliases, overridable on the command line
      py311: docker.io/library/python:3.11-slim-bookworm
    environments:
      - name: mbpp-py311
        base: py311             # an alias, an image reference, https://...#sha256=, or oci:DIR[:TAG],
                                # oci-archive:FILE, docker-archive:FILE, tar:FILE, dir:DIR (oci/local.py)
      - name: mbpp-tools
        from: mbpp-py311        # built on an environment declared above: stored as an overlay over it
        scripts: [python-venv.sh]          # from env_scripts/, run in order
        env: {PYTHON_PACKAGES: "pytest"}  # given to the scripts
        context: contexts/mbpp  # optional, read-only at /build in the sandbox
    instances:
      - id: mbpp-602
        environment: mbpp-py311
        script: instance.sh     # optional, from env_scripts/
        env: {...}
        files: {task/prompt.txt: files/602.txt}  # instance path -> file beside the catalog
        workdir: /testbed
        test_command: "pytest -q"
        grader: {...}           # metadata kept in the index for graders

Every error names the file and line, and what to do. This mirrors SWE-bench's
split between the spec of an environment and the scripts made from it: the
catalog is the spec, `env_scripts/` holds the scripts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from image_builder.errors import ImageBuilderError
from image_builder.oci.local import LocalImageError, is_local, resolve_path, split
from image_builder.oci.reference import ReferenceError, parse as parse_reference
from image_builder.store.ids import id_problem, shown_id

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Instance paths (workdir) reach the sandbox's shell unquoted: plain characters only.
WORKDIR = re.compile(r"^/[A-Za-z0-9._+@%=,:/-]*$")
DEFAULT_TIMEOUT = 3600.0
GRADER_MAX_NODES = 100_000  # YAML aliases can make a small file a huge (or cyclic) value


class CatalogError(ImageBuilderError):
    pass


@dataclass(frozen=True)
class Where:
    file: Path
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class EnvironmentSpec:
    name: str
    base: str  # an image reference or an https rootfs tarball URL (a child's: its parent's base)
    scripts: tuple[Path, ...]
    env: dict[str, str]
    context: Path | None
    timeout: float  # seconds per script
    where: Where
    parent: str | None = None  # `from:`: the environment this one is built on


@dataclass(frozen=True)
class InstanceSpec:
    id: str
    environment: str
    script: Path | None
    env: dict[str, str]
    files: dict[str, Path | bytes]  # path inside the instance -> source file or content
    workdir: str
    test_command: str | None
    grader: dict[str, Any]
    timeout: float
    where: Where
    context: Path | None = None  # read-only at /build while the instance builds


@dataclass(frozen=True)
class Catalog:
    path: Path
    scripts_dir: Path
    environments: dict[str, EnvironmentSpec]
    instances: dict[str, InstanceSpec] = field(default_factory=dict)


class _Node(dict):
    """A mapping that remembers the line of each key, for error messages."""
    line: int = 0
    key_lines: dict


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        mapping = _Node(super().construct_mapping(node, deep=True))
        mapping.line = node.start_mark.line + 1
        mapping.key_lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if hasattr(k, "value")}
        return mapping


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _Loader.construct_mapping)


class _Checker:
    def __init__(self, path: Path):
        self.path = path

    def fail(self, node: Any, key: str | None, what: str) -> CatalogError:
        line = getattr(node, "key_lines", {}).get(key) or getattr(node, "line", 1)
        return CatalogError(f"{self.path}:{line}: {what}")

    def mapping(self, node: Any, where: str, allowed: set[str], required: set[str] = frozenset()) -> _Node:
        if not isinstance(node, dict):
            raise self.fail(node, None, f"{where} must be a mapping")
        unknown = sorted(set(node) - allowed, key=str)  # keys may be numbers, null, ...
        if unknown:
            raise self.fail(node, unknown[0], f"{where}: unknown key {unknown[0]!r} "
                                              f"(allowed: {', '.join(sorted(allowed))})")
        for key in sorted(required - set(node)):
            raise self.fail(node, None, f"{where}: missing required key {key!r}")
        return node

    def string(self, node: _Node, key: str, where: str) -> str:
        value = node.get(key)
        if not isinstance(value, str) or not value.strip():
            raise self.fail(node, key, f"{where}.{key} must be a non-empty string")
        if "\0" in value:
            raise self.fail(node, key, f"{where}.{key} {value!r} holds a NUL character")
        return value

    def ident(self, node: _Node, key: str, where: str) -> str:
        """An environment name or instance id: it names files in the store (store.id_problem)."""
        value = node.get(key)
        problem = id_problem(value)
        if problem:
            raise self.fail(node, key, f"{where}.{key} {shown_id(value)} is not a valid id: it {problem}")
        return value

    def env(self, node: _Node, where: str) -> dict[str, str]:
        value = node.get("env", {}) or {}
        if not isinstance(value, dict):
            raise self.fail(node, "env", f"{where}.env must be a mapping of NAME: value")
        for k, v in value.items():
            if not isinstance(k, str) or not ENV_NAME.match(k):
                raise self.fail(value, k, f"{where}.env: {k!r} is not a valid variable name")
            if not isinstance(v, (str, int, float, bool)):
                raise self.fail(value, k, f"{where}.env.{k} must be a string or number")
            if isinstance(v, str) and "\0" in v:  # no process environment can hold it
                raise self.fail(value, k, f"{where}.env.{k} holds a NUL character")
        return {k: str(v) for k, v in value.items()}

    def timeout(self, node: _Node, where: str) -> float:
        value = node.get("timeout", DEFAULT_TIMEOUT)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise self.fail(node, "timeout", f"{where}.timeout must be a positive number of seconds")
        return float(value)

    def workdir(self, node: _Node, where: str) -> str:
        value = node.get("workdir", "/")
        if not isinstance(value, str) or not WORKDIR.match(value) or ".." in value.split("/"):
            raise self.fail(node, "workdir", f"{where}.workdir {value!r} must be an absolute path in the instance "
                                             "of letters, digits and . _ + @ % = , : / - (no '..')")
        return value

    def files(self, catalog: Path, node: _Node, where: str) -> dict[str, Path]:
        """Instance path -> file beside the catalog. The path stays inside the instance: the build stages these
        files on the host, under the sandbox's staging directory."""
        files = node.get("files") or {}
        if not isinstance(files, dict):
            raise self.fail(node, "files", f"{where}.files must map instance paths to files beside the catalog")
        resolved = {}
        for dest, src in files.items():
            parts = dest.lstrip("/").split("/") if isinstance(dest, str) else []
            if not parts or "\0" in dest or any(p in ("", ".", "..") for p in parts):
                raise self.fail(files, dest, f"{where}.files: {dest!r} must be a path in the instance, "
                                             "like task/input.txt (no empty, '.' or '..' parts)")
            if not isinstance(src, str) or not src or "\0" in src:
                raise self.fail(files, dest, f"{where}.files.{dest}: name a file beside the catalog (a path "
                                             "without NUL)")
            src_path = (catalog.parent / src).resolve()
            if not src_path.is_file():
                raise self.fail(files, dest, f"{where}.files.{dest}: no file {src_path}")
            resolved["/".join(parts)] = src_path
        return resolved

    def grader(self, node: _Node, where: str) -> dict:
        """Metadata for graders, kept in index.json: JSON values only, of a bounded size."""
        grader = node.get("grader") or {}
        if not isinstance(grader, dict):
            raise self.fail(node, "grader", f"{where}.grader must be a mapping")
        count, stack = 0, [grader]
        while stack:
            value = stack.pop()
            count += 1
            if count > GRADER_MAX_NODES:
                raise self.fail(node, "grader", f"{where}.grader has more than {GRADER_MAX_NODES} values "
                                                "(or refers to itself)")
            if isinstance(value, dict):
                if not all(isinstance(k, str) for k in value):
                    raise self.fail(node, "grader", f"{where}.grader: mapping keys must be strings")
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
            elif isinstance(value, float) and not math.isfinite(value) or \
                    not isinstance(value, (str, int, float, bool, type(None))):
                raise self.fail(node, "grader", f"{where}.grader: {value!r} is not a JSON value "
                                                "(strings, numbers, booleans, null, lists, mappings)")
        return dict(grader)

    def context(self, catalog: Path, node: _Node, where: str) -> Path | None:
        """A build context directory beside the catalog, or None."""
        if node.get("context") is None:
            return None
        context = (catalog.parent / self.string(node, "context", where)).resolve()
        if not context.is_dir():
            raise self.fail(node, "context", f"{where}.context: no directory {context}")
        return context

    def script(self, scripts_dir: Path, node: _Node, key: str, name: Any, where: str) -> Path:
        if not isinstance(name, str) or "/" in name or "\0" in name or name in ("", ".", ".."):
            raise self.fail(node, key, f"{where}: {name!r} is not a script name: name a file in {scripts_dir}")
        path = scripts_dir / name
        if not path.is_file():
            available = ", ".join(sorted(p.name for p in scripts_dir.glob("*") if p.is_file())) or "none"
            raise self.fail(node, key, f"{where}: no script {name!r} in {scripts_dir} (available: {available})")
        return path


SHIPPED_SCRIPTS = Path(__file__).resolve().parents[2] / "env_scripts"  # this checkout's env_scripts/


def load(path: Path | str, *, scripts_dir: Path | None = None, bases: dict[str, str] | None = None) -> Catalog:
    """Read and validate a catalog; `bases` overrides its `bases:` aliases."""
    path = Path(path)
    doc = _read_yaml(path)
    c = _Checker(path)
    top = c.mapping(doc, "catalog", {"bases", "environments", "instances", "instance_sets", "scripts_dir"},
                    {"environments"})
    if scripts_dir is None and "scripts_dir" in top:
        scripts_dir = (path.parent / c.string(top, "scripts_dir", "catalog")).resolve()
    elif scripts_dir is None:  # beside the catalog's folder, as for index/; else the shipped ones
        beside = (path.parent / "../env_scripts").resolve()
        scripts_dir = beside if beside.is_dir() else SHIPPED_SCRIPTS
    aliases = top.get("bases") or {}
    if not isinstance(aliases, dict):
        raise c.fail(top, "bases", "bases must be a mapping of alias: image reference")
    for alias, ref in aliases.items():
        if not isinstance(ref, str) or not ref.strip() or "\0" in ref:
            raise c.fail(aliases, alias, f"bases: alias {alias!r} must name an image reference (a string)")
    aliases = {**aliases, **(bases or {})}

    environments: dict[str, EnvironmentSpec] = {}
    envs = top.get("environments")
    if not isinstance(envs, list) or not envs:
        raise c.fail(top, "environments", "environments must be a non-empty list")
    for i, node in enumerate(envs):
        where = f"environments[{i}]"
        c.mapping(node, where, {"name", "base", "from", "scripts", "env", "context", "timeout"}, {"name", "scripts"})
        name = c.ident(node, "name", where)
        if name in environments:
            raise c.fail(node, "name", f"{where}: duplicate environment name {name!r} "
                                       f"(first at line {environments[name].where.line})")
        if ("base" in node) == ("from" in node):
            raise c.fail(node, "name", f"{where}: give either base (an image) or from (an environment above)")
        parent = c.string(node, "from", where) if "from" in node else None
        if parent is not None and parent not in environments:  # declared above: no cycles, builds in order
            raise c.fail(node, "from", f"{where}.from: no environment {parent!r} above this one "
                                       f"(declared: {', '.join(environments) or 'none'})")
        base = environments[parent].base if parent else aliases.get(c.string(node, "base", where), node["base"])
        if not parent and is_local(base):  # a path relative to the catalog
            try:
                base = resolve_path(base, path.parent)
                if not split(base)[1].exists():
                    raise ReferenceError(f"{base}: no such file or directory")
            except (ReferenceError, LocalImageError) as e:
                raise c.fail(node, "base", f"{where}.base: {e}") from e
        elif not parent and not base.startswith("https://"):
            try:
                parse_reference(base)
            except ReferenceError as e:
                raise c.fail(node, "base", f"{where}.base: {e}") from e
        scripts = node["scripts"]
        if isinstance(scripts, str):
            scripts = [scripts]
        if not isinstance(scripts, list) or not scripts:
            raise c.fail(node, "scripts", f"{where}.scripts must be a non-empty list of script names")
        environments[name] = EnvironmentSpec(
            name, base, tuple(c.script(scripts_dir, node, "scripts", s, where) for s in scripts),
            c.env(node, where), c.context(path, node, where), c.timeout(node, where), Where(path, node.line), parent)

    instances: dict[str, InstanceSpec] = {}
    for key in ("instances", "instance_sets"):
        if not isinstance(top.get(key) or [], list):
            raise c.fail(top, key, f"{key} must be a list")
    for i, node in enumerate(top.get("instances") or []):
        where = f"instances[{i}]"
        c.mapping(node, where, {"id", "environment", "script", "env", "files", "workdir", "test_command",
                                "grader", "timeout", "context"}, {"id", "environment"})
        iid = c.ident(node, "id", where)
        if iid in instances:
            raise c.fail(node, "id", f"{where}: duplicate instance id {iid!r} (first at line {instances[iid].where.line})")
        env_name = c.string(node, "environment", where)
        if env_name not in environments:
            raise c.fail(node, "environment", f"{where}: unknown environment {env_name!r} "
                                              f"(declared: {', '.join(environments)})")
        script = c.script(scripts_dir, node, "script", node["script"], where) if node.get("script") else None
        test_command = node.get("test_command")
        if test_command is not None and (not isinstance(test_command, str) or "\0" in test_command):
            raise c.fail(node, "test_command", f"{where}.test_command must be a string (without NUL)")
        instances[iid] = InstanceSpec(iid, env_name, script, c.env(node, where), c.files(path, node, where),
                                      c.workdir(node, where), test_command, c.grader(node, where),
                                      c.timeout(node, where), Where(path, node.line), c.context(path, node, where))
    for i, node in enumerate(top.get("instance_sets") or []):
        for spec in _instance_set(c, path, scripts_dir, node, f"instance_sets[{i}]", environments):
            if spec.id in instances:
                raise c.fail(node, "from", f"instance_sets[{i}]: instance {spec.id!r} is already declared "
                                           f"(line {instances[spec.id].where.line})")
            instances[spec.id] = spec
    return Catalog(path, scripts_dir, environments, instances)


def _read_yaml(path: Path) -> Any:
    """The catalog's YAML document, or a CatalogError of one line naming the file and line."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CatalogError(f"{path}: cannot read catalog: {e.strerror}") from e
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise CatalogError(f"{path}:{line}: not UTF-8 text (byte {e.start}): a catalog is a YAML file") from None
    try:
        return yaml.load(text, Loader=_Loader)
    except RecursionError:
        raise CatalogError(f"{path}: nested too deeply to be a catalog") from None
    except yaml.reader.ReaderError as e:  # characters YAML refuses (NUL, other controls)
        raise CatalogError(f"{path}:{text[:e.position].count(chr(10)) + 1}: not valid YAML: character "
                           f"{chr(e.character)!r} is not allowed") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        why = " ".join(str(getattr(e, "problem", None) or e).split())  # one line
        raise CatalogError(f"{path}:{mark.line + 1 if mark else 1}: not valid YAML: {why}") from e


def _only(c: _Checker, node: Any, where: str, found: list) -> list:
    """The drafts whose template fields match every `only:` entry (rows that cannot be instances at all
    still fail the set: there is nothing to match them by)."""
    wanted = node["only"]
    if not isinstance(wanted, dict) or not wanted:
        raise c.fail(node, "only", f"{where}.only must map template fields to a value or a list of values")
    rules = {}
    for field_name, values in wanted.items():
        values = [values] if isinstance(values, str) else values
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            raise c.fail(wanted, field_name, f"{where}.only.{field_name} must be a string or a list of strings")
        rules[field_name] = set(values)
    fields = set().union(*(d.fields for d in found)) if found else set()
    for field_name in rules:
        if found and field_name not in fields:
            raise c.fail(wanted, field_name, f"{where}.only: no field {field_name!r} in the dataset's tasks "
                                             f"(they have: {', '.join(sorted(fields))})")
    kept = [d for d in found if all(d.fields.get(k) in v for k, v in rules.items())]
    if not kept:
        raise c.fail(node, "only", f"{where}.only: no task of the dataset matches")
    return kept


def _instance_set(c: _Checker, path: Path, scripts_dir: Path, node: Any, where: str,
                  environments: dict[str, EnvironmentSpec]) -> list[InstanceSpec]:
    """One instance per task of a dataset file (see datasets.py)."""
    from image_builder.errors import ImageBuilderError as _Err
    from .datasets import drafts, fill
    c.mapping(node, where, {"from", "environment", "script", "env", "context", "workdir", "test_command",
                            "timeout", "only", "grader"}, {"from", "environment"})
    extra_grader = c.grader(node, where)  # added to each task's (e.g. the repository's log parser)
    source = (path.parent / c.string(node, "from", where)).resolve()
    try:
        found, bad = drafts(source)
    except _Err as e:
        raise c.fail(node, "from", f"{where}.from: {e}") from e
    if "only" in node:  # the rows wanted: {field: value or [values]}, e.g. {repo: pytest-dev/pytest}
        found = _only(c, node, where, found)
    if bad:
        raise c.fail(node, "from", f"{where}.from: {len(bad)} tasks of {source} cannot be instances; first, "
                                   f"{bad[0]}")
    script = c.script(scripts_dir, node, "script", node["script"], where) if node.get("script") else None
    # A context may be a template, one directory per task ("instances/{instance_file}"): each instance's
    # build key then covers its own files only.
    per_task = "{" in (c.string(node, "context", where) if node.get("context") is not None else "")
    context = None if per_task else c.context(path, node, where)
    workdir = c.workdir(node, where)
    env_template, env_vars = c.string(node, "environment", where), c.env(node, where)
    if node.get("test_command") is not None and not isinstance(node["test_command"], str):
        raise c.fail(node, "test_command", f"{where}.test_command must be a string")
    specs = []
    for d in found:
        try:
            env_name = fill(env_template, d.fields)
            env = {k: fill(v, d.fields) for k, v in env_vars.items()}
            test_command = fill(node["test_command"], d.fields) if node.get("test_command") else None
            task_context = (path.parent / fill(node["context"], d.fields)).resolve() if per_task else context
        except (KeyError, ValueError) as e:
            raise c.fail(node, "environment", f"{where}: {e.args[0]}") from None
        if per_task:  # the dataset's fields choose a directory under the template's fixed part, never above it
            fixed = (path.parent / node["context"].partition("{")[0]).resolve()
            if not task_context.is_relative_to(fixed) or task_context == fixed:
                raise c.fail(node, "context", f"{where}.context: task {d.id} names {task_context}, outside {fixed}; "
                                              "fix the task's fields in the dataset")
            if not task_context.is_dir():
                raise c.fail(node, "context", f"{where}.context: no directory {task_context} for task {d.id}")
        if any("\0" in v for v in (env_name, test_command or "", *env.values())):
            raise c.fail(node, "env", f"{where}: task {d.id} puts a NUL character in its templates; "
                                      "fix the task in the dataset")
        if env_name not in environments:
            raise c.fail(node, "environment", f"{where}: task {d.id} needs environment {env_name!r}, "
                                              f"which the catalog does not declare")
        specs.append(InstanceSpec(d.id, env_name, script, env, dict(d.files), workdir,
                                  test_command, {**d.grader, **extra_grader}, c.timeout(node, where),
                                  Where(path, node.line),
                                  task_context))
    return specs
