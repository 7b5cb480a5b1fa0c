"""A catalog for a whole SWE-bench-format dataset, from the `swebench` package's own specs.

    image-builder swebench catalog DATASET.jsonl --repos DIR -o CATALOG.yaml

Per repository and version the specs (`MAP_REPO_VERSION_TO_SPECS`, read at run
time from the installed `swebench`, never copied here) give a Python, packages,
pip_packages, pre_install, install and a test command. The catalog stacks them
as layers, each stored once however many environments share it:

    python-3.9                     base image + git + pip, into the interpreter itself (no venv)
      python-3.9-cc                a compiler and Python's headers, as SWE-bench's base image has them
      <repo>-<version>-deps        the spec's packages (and its environment.yml's), resolved as of its
                                   cut-off day (equal specs: one image)
        <repo>-<version>           the repository's history up to the merge-base
                                   of its instances' base commits, checked out
                                   there, pre_install, install
          <repo>-<version>-at-<c>  checkpoints: the commits up to one instance's
            ...                    base commit c, checked out (and installed
                                   again where the install files changed), each
                                   on the one before it on the same line
            <instance>             the checkout of base_commit: only the files
                                   that differ, git's index, and the objects
                                   between the nearest checkpoint and base_commit

History is cut where SWE-bench cuts it: an environment holds only commits that
every one of its instances may see (ancestors of each base commit), and an
instance adds only its own base commit's ancestors, so no instance can read a
later commit (the fix) out of `.git`. A checkpoint is itself an instance's base
commit, and only instances whose base commits descend from it sit on it, so the
rule holds through them (checkpoints.py says where they go, and why). Tags come
with the commits they point at (SWE-bench keeps tags older than the base commit;
here: tags reachable from it).
Every instance's repository is pruned to its HEAD's history after its script as
well (repo_history.py, for catalogs written by hand): here it only drops reflogs.

Packages the spec does not pin resolve as on the day after the newest release it
pins (upload_dates.py; the instances' own dates where later; in a repository
that pins nothing, as its instances were made: Cutoffs), recorded in the
catalog as PIP_UPLOADED_PRIOR_TO, so a rebuild next year gives the same
environment. The interpreter is the environment's, as SWE-bench's conda env is:
tox-current-env links `.tox/*/bin/python` to it, and a link to a venv's python
finds no pyvenv.cfg beside it and loses the venv's packages.

A spec whose packages are a conda environment.yml (xarray, matplotlib) is solved
by conda's own solver against the site's channels (--conda-channel: conda-env.sh),
else gets the file's packages by their PyPI names (environment_yml.py), each one
PyPI has as wheels, before the spec's pins: a cluster reaches PyPI more often
than a conda channel; what this leaves out is said per instance and in the log.

The bundles cut this way go into a context directory beside the catalog
(`<catalog>.d/`). Specs that cannot be honoured here (non-Python specs, a Python
with no base image, a missing commit or an unreadable object) are reported per
instance, one line each, and the rest is written.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import importlib.machinery
import importlib.util
import os
import posixpath
import re
import shlex
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from image_builder.build import downloads
from image_builder.build.catalog import ENV_NAME
from image_builder.build.checkpoints import Checkpoint, place
from image_builder.build.environment_yml import EnvironmentYml, EnvironmentYmlError, pip_requirements, \
    read_environment_yml
from image_builder.build.upload_dates import DEFAULT_INDEX, UploadDateError, UploadDates, day_after, iso, \
    parse_time, pins
from image_builder.errors import ImageBuilderError
from image_builder.oci.hostpython import local_pythons
from image_builder.store.files import atomic_write, write_if_changed
from image_builder.store.ids import file_name, id_problem
from image_builder.tasks import RepoTask, load_tasks_with_rows, read_records

# pip per Python: 26 takes a cut-off (--uploaded-prior-to); older Pythons get the newest pip they run, which
# the builder's cut-off index (cutoff_index.py) holds to the cut-off. All have PEP 660 editable installs (>= 21.3).
PIPS = {(3, 10): "pip==26.3", (3, 9): "pip==26.0.1", (3, 8): "pip==25.0.1", (3, 7): "pip==24.0", (3, 6): "pip==21.3.1"}
# What pip 25.3 removed: the --no-use-pep517 option, and `setup.py develop` for an editable install whose
# build backend has no PEP 660 hook (setuptools < 64: pylint 2.15 pins setuptools~=62.6). A spec whose
# install needs one gets pip 25.2 after its packages (its own install is then not cut off).
OLD_PIP_OPTIONS = ("--no-use-pep517",)
PIP_FOR_OLD_OPTIONS = "pip==25.2"
PIP_WITHOUT_OLD_OPTIONS = (25, 3)
# A checkout with no pyproject.toml was installed by SWE-bench's pips (before 25.1) with `setup.py develop`, in
# the environment; pip 25.1+ builds it in isolation, where a setup.py that imports what the environment has
# (ah_bootstrap's astropy-helpers, numpy) finds nothing: astropy 3.0/3.1 failed (`/usr/local/bin/python: No
# module named pip`, ah_bootstrap's last try). Where such a checkout bootstraps (BOOTSTRAPPERS) and the layer's
# pip is 25.1 or newer, pip 25.0.1, the last that installs it so (Python 3.8+), comes after the packages.
PIP_FOR_LEGACY_DEVELOP = "pip==25.0.1"
PIP_WITHOUT_LEGACY_DEVELOP = (25, 1)
OLD_SETUPTOOLS = re.compile(r"[\"']setuptools\s*(?:~=|==|<=|<)\s*(\d+)")
# Setup scripts that fetch their build helper themselves, with setuptools' easy_install from an index written in
# them (ah_bootstrap.py: astropy <= 3.x and its affiliated packages, https://pypi.python.org/simple, which a site
# that reaches only pypi.org cannot reach; neither PIP_INDEX_URL nor the cut-off applies), unless it is installed
# already: the deps layer installs it, as of the cut-off (SWE-bench's clone lacks the git submodule too, and its
# images got the helper from that index). astropy 1.3 failed: `Failed to download and/or install 'astropy-helpers'`.
BOOTSTRAPPERS = {"ah_bootstrap.py": "astropy-helpers"}
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CONDA_PREFIX = "/opt/conda/envs/testbed"  # a conda spec's environment (SWE-bench's: /opt/miniconda3/envs/testbed)
WORKDIR = "/testbed"
COMMIT = re.compile(r"^[0-9a-f]{40}$")
REPO = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
# A version names environments and directories of the context: a plain token, never a path.
VERSION = re.compile(r"^[A-Za-z0-9_+-][A-Za-z0-9._+-]*$")
# What makes an editable install stale (git pathspecs): its metadata, or compiled extensions' sources
# (Cython's, its Tempita templates (scikit-learn's *.pyx.tp), C, C++). An install that copies the package
# (`pip install .`, django 2.2's `setup.py install`: the tests import the copy) is made stale by any file.
REINSTALL_WHEN = "setup.py setup.cfg pyproject.toml *.pyx *.pxd *.pxi *.tp *.c *.cc *.cpp *.h *.hpp"
EDITABLE = re.compile(r"(?:^|\s)(?:-e|--editable)(?:[\s=]|$)|\bsetup\.py\s+develop\b")


class SpecError(ImageBuilderError):
    pass


@dataclass(frozen=True)
class Spec:
    """One entry of SWE-bench's MAP_REPO_VERSION_TO_SPECS, as this builder takes it."""
    python: str
    requirements: tuple[str, ...]  # requirements files to read at environment_setup_commit ("packages")
    packages: tuple[str, ...]  # pip requirements: "packages" given as a list, then pip_packages
    pre_install: tuple[str, ...]
    install: str
    test_cmd: str
    not_run: tuple[str, ...] = ()  # parts of the spec this builder does not carry out (said per instance)
    environment_yml: tuple[str, ...] = ()  # conda environment files to read at environment_setup_commit
    # eval_commands, which SWE-bench runs before each test run: its `export NAME=VALUE` lines become the
    # version environment's variables (so `run` and apptainer see them too), the rest (django 3.x's
    # locale-gen) is system set-up, run once when that environment is built.
    eval_env: tuple[tuple[str, str], ...] = ()
    eval_setup: tuple[str, ...] = ()

    @property
    def version(self) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", self.python)[:2])

    @property
    def pip(self) -> str:
        return next((pip for at_least, pip in PIPS.items() if self.version >= at_least), "")

    @property
    def old_pip_options(self) -> bool:
        return any(o in " ".join((self.install, *self.pre_install)) for o in OLD_PIP_OPTIONS)


def stale_when(install: str) -> str:
    """The pathspecs whose change makes `install` stale (REINSTALL_WHEN, or `.`)."""
    return REINSTALL_WHEN if EDITABLE.search(install) else "."


@dataclass
class Generated:
    catalog: Path
    environments: int = 0
    instances: int = 0
    skipped: list[str] = field(default_factory=list)  # "<instance>: why", one per instance left out
    notes: list[str] = field(default_factory=list)  # "<instance>: what of its spec is not carried out"


def load_swebench() -> types.ModuleType:
    """swebench.harness.constants, without running the package's __init__ (4.x imports docker, the
    harness's imports datasets and modal): only the spec tables are needed."""
    if "swebench.harness.constants" in sys.modules:  # loaded before
        return sys.modules["swebench.harness.constants"]
    found = importlib.util.find_spec("swebench")
    if found is None or not found.submodule_search_locations:
        raise SpecError("the swebench package is not installed: pip install 'image_builder[swebench]' "
                        "(or pip install --no-deps 'swebench>=3,<5')")
    root = Path(list(found.submodule_search_locations)[0])
    for name, where in (("swebench", root), ("swebench.harness", root / "harness")):
        if name not in sys.modules:  # the package, its __init__ not run (find_spec still finds it: inspect_evals asks)
            stub = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, None, is_package=True))
            stub.__path__ = stub.__spec__.submodule_search_locations = [str(where)]
            sys.modules[name] = stub
    try:
        import swebench.harness.constants as constants
    except ImportError as e:
        raise SpecError(f"cannot read swebench's constants ({e}); install swebench>=3,<5") from None
    if not hasattr(constants, "MAP_REPO_VERSION_TO_SPECS"):
        raise SpecError(f"swebench at {root} has no MAP_REPO_VERSION_TO_SPECS (5.x ships Dockerfiles instead of "
                        "specs): pip install --no-deps 'swebench>=3,<5'")
    return constants


def log_parsers() -> dict[str, str]:
    """Repository -> the name of SWE-bench's log parser for it (MAP_REPO_TO_PARSER_PY); {} when the installed
    swebench has no such table (graders then decide by the repository's name, then by the command)."""
    module = log_parser_module()
    return {repo: fn.__name__ for repo, fn in module.MAP_REPO_TO_PARSER_PY.items()} if module else {}


_LOG_PARSERS: list = []  # the module once loaded ([module] or [None])


def log_parser_module() -> types.ModuleType | None:
    """SWE-bench's log_parsers/python.py (its parse_log_* functions and MAP_REPO_TO_PARSER_PY), loaded alone:
    its package imports the harness (datasets, docker), and the file itself only names TestSpec for
    annotations. None when swebench is not installed or its layout differs; loaded once."""
    if _LOG_PARSERS:
        return _LOG_PARSERS[0]
    try:
        constants = load_swebench()
    except SpecError:
        return None  # not cached: an install later in the process is found
    path = Path(constants.__file__).parents[1] / "log_parsers" / "python.py"
    name = "swebench.harness.test_spec.test_spec"
    stub = types.ModuleType(name)
    stub.TestSpec = object
    saved = {n: sys.modules.get(n) for n in (name, "swebench.harness.test_spec")}
    sys.modules.setdefault("swebench.harness.test_spec", types.ModuleType("swebench.harness.test_spec"))
    sys.modules[name] = stub
    module = None
    try:
        spec = importlib.util.spec_from_file_location("image_builder._swebench_log_parsers", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not isinstance(getattr(module, "MAP_REPO_TO_PARSER_PY", None), dict):
            module = None
    except (OSError, ImportError, AttributeError, SyntaxError):
        module = None  # an older or newer layout
    finally:
        for n, saved_module in saved.items():
            if saved_module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = saved_module
    _LOG_PARSERS.append(module)
    return module


def replaced_packages(constants: types.ModuleType) -> tuple[tuple[str, str | None], ...]:
    """swebench's REPLACE_REQ_PACKAGES: requirements PyPI has since yanked whole (sqlfluff's
    `types-pkg_resources`: no version left, every sqlfluff environment fails), each with what SWE-bench installs
    instead (None: nothing). Read as data from its test_spec/python.py, which imports the harness; () where
    this swebench has no such table."""
    harness = Path(constants.__file__).parent
    harness = harness.parent if harness.name == "constants" else harness  # 4.x: a package; 3.x: a module
    for path in (harness / "test_spec" / "python.py", harness / "test_spec.py"):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "REPLACE_REQ_PACKAGES"
                                                    for t in node.targets):
                try:
                    table = ast.literal_eval(node.value)
                    return tuple((old, new) for old, new in table
                                 if isinstance(old, str) and (new is None or isinstance(new, str)))
                except (ValueError, TypeError):
                    return ()
    return ()


def replace_packages(lines: list[str], table: tuple[tuple[str, str | None], ...]) -> tuple[list[str], list[str]]:
    """(the requirement lines with `table` applied as SWE-bench's clean_requirements applies it: the
    package's line, whatever its version specifier, becomes the replacement's bare name or goes; what was
    replaced, a line each)."""
    said: list[str] = []
    for old, new in table:
        pattern = re.compile(rf"^(\s*){re.escape(old)}([<>=!~]=?.*|\s*)$")
        kept = []
        for line in lines:
            if pattern.match(line):
                said.append(f"{line.strip()} is yanked from PyPI: "
                            + (f"{new} instead, as SWE-bench installs it" if new else "left out, as SWE-bench does"))
                if new:
                    kept.append(pattern.sub(lambda m: m.group(1) + new, line))
            else:
                kept.append(line)
        lines = kept
    return lines, said


def spec_of(constants: types.ModuleType, repo: str, version: str) -> Spec | str:
    """The Spec, or why the repository's spec cannot be honoured here."""
    specs = constants.MAP_REPO_VERSION_TO_SPECS.get(repo)
    if specs is None:
        return f"swebench has no spec for repository {repo}"
    raw: dict[str, Any] | None = specs.get(version)
    if raw is None:
        return f"swebench has no spec for {repo} version {version!r} (it has {', '.join(sorted(specs))})"
    if "docker_specs" in raw or "python" not in raw:
        return f"the spec for {repo} {version} is not a Python one (swebench builds it from a Dockerfile)"
    packages = raw.get("packages", "")
    requirements: tuple[str, ...] = ()
    listed: tuple[str, ...] = ()
    environment_yml: tuple[str, ...] = ()
    if packages == "environment.yml":
        environment_yml = tuple(getattr(constants, "MAP_REPO_TO_ENV_YML_PATHS", {}).get(repo) or ("environment.yml",))
    elif packages == "requirements.txt":
        requirements = tuple(getattr(constants, "MAP_REPO_TO_REQS_PATHS", {}).get(repo) or ("requirements.txt",))
    elif packages:  # a conda package list: the same names on PyPI
        listed = tuple(shlex.split(packages))
    test_cmd = raw.get("test_cmd") or "pytest -rA"
    if isinstance(test_cmd, list):
        test_cmd = " && ".join(test_cmd)
    # no_use_env only chooses between two conda commands that make the same environment.
    not_run = [f"{key} ({raw[key]!r})" for key in ("execute_test_as_nonroot",) if raw.get(key)]
    eval_env, eval_setup = _eval_commands(raw.get("eval_commands") or ())
    return Spec(str(raw["python"]), requirements, (*listed, *raw.get("pip_packages", ())),
                tuple(raw.get("pre_install", ())), raw.get("install", ""), test_cmd, tuple(not_run), environment_yml,
                eval_env, eval_setup)


SPEC_KEYS = {"python": str, "packages": str, "pip_packages": list, "pre_install": list, "install": str,
             "test_cmd": (str, list), "eval_commands": list, "execute_test_as_nonroot": bool, "no_use_env": bool}
# Per repository, as swebench's tables hold them: MAP_REPO_TO_REQS_PATHS, MAP_REPO_TO_ENV_YML_PATHS, and
# the name of one of its parse_log_* functions (MAP_REPO_TO_PARSER_PY).
REPO_KEYS = {"requirements_paths": "MAP_REPO_TO_REQS_PATHS", "environment_yml_paths": "MAP_REPO_TO_ENV_YML_PATHS"}
PARSER_NAME = re.compile(r"^parse_log_[a-z0-9_]+$")


def read_specs(path: Path, constants: types.ModuleType) -> tuple[types.SimpleNamespace, dict[str, str],
                                                                 dict[str, tuple[downloads.Download, ...]]]:
    """swebench's tables with a specs file's laid over them, the file's log parsers by repository, and the
    files its builds download (downloads.from_specs) by repository. The file (YAML or JSON) maps OWNER/NAME
    to its versions' specs, in swebench's own keys, beside optional `requirements_paths`,
    `environment_yml_paths`, `log_parser` and `downloads`:

        getmoto/moto:
          log_parser: parse_log_pytest
          versions:
            "4.1": {python: "3.11", install: "python -m pip install -e .", test_cmd: "pytest -n0 -rA"}
    """
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise SpecError(f"{path}: not readable as YAML or JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not doc:
        raise SpecError(f"{path}: expected a mapping of OWNER/NAME to {{versions: ...}}")
    tables = {name: dict(getattr(constants, name, {}) or {}) for name in ("MAP_REPO_VERSION_TO_SPECS",
                                                                         *REPO_KEYS.values())}
    parsers: dict[str, str] = {}
    carried: dict[str, tuple[downloads.Download, ...]] = {}
    for repo, entry in doc.items():
        where = f"{path}: {repo!r}"
        if not isinstance(repo, str) or not REPO.match(repo) or any(p in (".", "..") for p in repo.split("/")):
            raise SpecError(f"{where}: not a repository (OWNER/NAME)")
        if not isinstance(entry, dict) or not isinstance(entry.get("versions"), dict) or not entry["versions"]:
            raise SpecError(f"{where}: give `versions`, a mapping of version to spec")
        unknown = sorted(set(entry) - {"versions", "log_parser", "downloads", *REPO_KEYS})
        if unknown:
            raise SpecError(f"{where}: unknown key {unknown[0]!r} (versions, log_parser, downloads, "
                            f"{', '.join(REPO_KEYS)})")
        if not isinstance(entry.get("downloads", []), list):
            raise SpecError(f"{where}: downloads must be a list of {{name, sha256, urls}}")
        try:
            carried[repo] = tuple(downloads.from_specs(d) for d in entry.get("downloads", []))
        except ValueError as e:
            raise SpecError(f"{where}: downloads: {e}") from None
        for key, table in REPO_KEYS.items():
            if key in entry:
                paths = entry[key]
                if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
                    raise SpecError(f"{where}: {key} must be a list of paths in the repository")
                tables[table][repo] = paths
        if "log_parser" in entry:
            if not isinstance(entry["log_parser"], str) or not PARSER_NAME.match(entry["log_parser"]):
                raise SpecError(f"{where}: log_parser must name one of SWE-bench's parsers (parse_log_pytest, ...)")
            parsers[repo] = entry["log_parser"]
        versions = dict(tables["MAP_REPO_VERSION_TO_SPECS"].get(repo, {}))
        for version, spec in entry["versions"].items():
            at = f"{where} version {version!r}"
            if not isinstance(version, str) or not VERSION.match(version):
                raise SpecError(f"{at}: a version is a quoted string of letters, digits and . _ + - (\"4.1\", "
                                "not 4.1)")
            if not isinstance(spec, dict) or not isinstance(spec.get("python"), str):
                raise SpecError(f"{at}: a spec is a mapping with at least python: \"X.Y\"")
            for key, value in spec.items():
                if key not in SPEC_KEYS:
                    raise SpecError(f"{at}: unknown key {key!r} (swebench's spec keys: {', '.join(SPEC_KEYS)})")
                if not isinstance(value, SPEC_KEYS[key]) or (isinstance(value, list) and
                                                             not all(isinstance(x, str) for x in value)):
                    raise SpecError(f"{at}: {key} has the wrong type (swebench's: {key} is "
                                    f"{'a list of strings' if SPEC_KEYS[key] is list else 'a string'})")
            versions[version] = spec
        tables["MAP_REPO_VERSION_TO_SPECS"][repo] = versions
    return types.SimpleNamespace(**tables), parsers, carried


def _pip_at_least(pip: str, version: tuple[int, int]) -> bool:
    """Whether the pip a Python layer gets (a requirement; "" or a range: the newest) is `version` or newer:
    lacks OLD_PIP_OPTIONS (PIP_WITHOUT_OLD_OPTIONS) or legacy develop (PIP_WITHOUT_LEGACY_DEVELOP). An older one
    (Python 3.6-3.8's) keeps them, and the pips that do (25.0.1, 25.2) run on none of 3.6 and 3.7."""
    pinned = re.fullmatch(r"pip==(\d+)\.(\d+)(?:\.\d+)*", pip.strip())
    return not pinned or (int(pinned[1]), int(pinned[2])) >= version


def _eval_commands(commands) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """(exports, the other commands) of a spec's eval_commands: `export NAME=VALUE` with a plain value is an
    export; anything else (an expansion, several words) stays a command."""
    exports, rest = [], []
    for command in commands:
        try:
            words = shlex.split(command)
        except ValueError:
            words = []
        name, eq, value = words[1].partition("=") if len(words) == 2 and words[0] == "export" else ("", "", "")
        if eq and ENV_NAME.match(name) and not any(c in command for c in "$`"):
            exports.append((name, value))
        else:
            rest.append(command)
    return tuple(exports), tuple(rest)


class Repository:
    """A bare mirror of one repository's source (a bundle or a git directory), for cutting bundles."""

    def __init__(self, source: Path, work: Path, exclude_tags: tuple[str, ...] = ()):
        self.source = source.absolute()  # git clones from another cwd: a relative --repos would not be found
        self.exclude_tags = exclude_tags
        self.git_dir = work / (file_name(source.name) + ".git")
        self._git("clone", "-q", "--mirror", str(self.source), str(self.git_dir), cwd=work)

    def _git(self, *args: str, cwd: Path | None = None) -> str:
        base = ["git", "-c", "core.hooksPath=/dev/null"] + ([] if cwd else ["--git-dir", str(self.git_dir)])
        r = subprocess.run([*base, *args], capture_output=True, text=True, cwd=cwd)
        if r.returncode:
            lines = r.stderr.strip().splitlines() or ["no output"]
            # git's cause comes before its last word ("fatal: unable to read OBJECT", then "error: pack-objects
            # died"): an object the repository lacks, as a partial or damaged clone does
            missing = next((line for line in lines if "unable to read" in line or "missing" in line), None)
            if missing:
                raise SpecError(f"{self.source}: git {args[0]} failed: {missing.removeprefix('fatal: ')} (an "
                                "object the repository lacks: give a complete clone; `git fsck` lists what is "
                                "missing)")
            raise SpecError(f"{self.source}: git {args[0]} failed: {lines[-1]}")
        return r.stdout

    def has_commit(self, commit: str) -> bool:
        return subprocess.run(["git", "--git-dir", str(self.git_dir), "cat-file", "-e", f"{commit}^{{commit}}"],
                              capture_output=True).returncode == 0

    def same_files(self, a: str, b: str, pathspecs: list[str]) -> bool:
        """Whether commits `a` and `b` agree on every file the pathspecs (git's globs) match."""
        return subprocess.run(["git", "--git-dir", str(self.git_dir), "diff", "--quiet", a, b, "--", *pathspecs],
                              capture_output=True).returncode == 0

    def install_files(self, a: str, b: str, when: str) -> str:
        """How commit `b`'s install files (pathspecs `when`) differ from `a`'s: equal for two commits with the same."""
        return self._git("diff", "--raw", "--no-abbrev", a, b, "--", *when.split())

    def is_ancestor(self, a: str, b: str) -> bool:
        return subprocess.run(["git", "--git-dir", str(self.git_dir), "merge-base", "--is-ancestor", a, b],
                              capture_output=True).returncode == 0

    def count(self, a: str, b: str) -> int:
        """The commits in b's history and not in a's."""
        return int(self._git("rev-list", "--count", f"{a}..{b}"))

    def oldest_first(self, commits: list[str]) -> list[str]:
        """The commits by committer date (then name), each once."""
        dates = dict(line.split() for line in self._git("show", "-s", "--format=%H %ct", *set(commits)).splitlines())
        return sorted(set(commits), key=lambda c: (int(dates[c]), c))

    def merge_base(self, commits: list[str]) -> str:
        return commits[0] if len(set(commits)) == 1 else self._git("merge-base", "--octopus", *commits).strip()

    def show(self, commit: str, path: str) -> str | None:
        r = subprocess.run(["git", "--git-dir", str(self.git_dir), "show", f"{commit}:{path}"],
                           capture_output=True)
        return r.stdout.decode("utf-8", "replace") if r.returncode == 0 else None

    def _tags(self, merged: str, not_merged: str | None = None) -> list[str]:
        args = ["tag", "--merged", merged] + (["--no-merged", not_merged] if not_merged else [])
        return [f"refs/tags/{t}" for t in self._git(*args).split()
                if not any(fnmatch.fnmatchcase(t, pattern) for pattern in self.exclude_tags)]

    def bundle(self, dest: Path, head: str, since: str | None = None) -> bool:
        """A bundle of `head`'s history (less `since`'s) and the tags on it, as refs/heads/image-builder;
        False when there is nothing to add (head == since)."""
        if since == head:
            return False
        self._git("update-ref", "refs/heads/image-builder", head)
        refs = ["refs/heads/image-builder", *self._tags(head, since)]
        tmp = dest.with_name(f".{dest.name}.tmp")
        self._git("bundle", "create", "-q", str(tmp), *refs, *([f"^{since}"] if since else []))
        tmp.replace(dest)
        return True


def requirements_text(repo: Repository, commit: str, paths: tuple[str, ...]) -> str | None:
    """The spec's requirements file at `commit`, `-r` includes resolved, as SWE-bench's get_requirements
    reads it (without `-e .`, comments and `.[test]` lines); None when no listed file exists."""
    def keep(line: str) -> bool:
        return not any(line.strip().startswith(x) for x in ("-e .", "#", ".[test"))

    for path in paths:
        text = repo.show(commit, path)
        if text is None:
            continue
        folder = path.rpartition("/")[0]
        lines, included = [], []
        for line in text.splitlines():
            if line.strip().startswith("-r"):
                # `-r ../testing/all.txt` (matplotlib 3.1-3.4's dev-requirements.txt): SWE-bench fetches the
                # URL, whose client resolves the `..`; git's tree paths have none (every include read empty).
                include = posixpath.normpath(f"{folder}/{line.strip()[2:].strip()}".lstrip("/"))
                extra = None if include.startswith("../") else repo.show(commit, include)
                included += [x for x in (extra or "").splitlines() if keep(x)]
            elif keep(line):
                lines.append(line)
        return "\n".join(included + lines) + "\n"
    return None


def _find_source(repos: Path, repo: str) -> Path | None:
    owner, name = repo.split("/")
    for candidate in (f"{name}.bundle", f"{owner}__{name}.bundle", name, f"{name}.git", f"{owner}/{name}",
                      f"{owner}__{name}"):
        if (repos / candidate).exists():
            return repos / candidate
    return None


def slug(repo: str) -> str:
    return repo.replace("/", "__")


@dataclass(frozen=True)
class CatalogOptions:
    dataset: Path
    repos: Path
    out: Path
    python: dict[str, str] = field(default_factory=dict)  # "3.9" -> base image reference
    # A "{python}" template for Pythons without --python; "" (the default): those instances are left out, as a
    # cluster rarely reaches Docker Hub and a build that fails there loses the whole environment late.
    python_default: str = ""
    apt: str = "git"  # Debian packages of every Python layer
    pip: str = ""  # the pip requirement of every Python layer; "" = by Python (PIPS)
    cutoff: str = "auto"  # "auto": from the specs' pins (Cutoffs); "none"; or one date for every environment
    index_url: str = DEFAULT_INDEX  # where upload dates are read (PEP 691 JSON)
    # Tags not to copy (globs): a mirror's own helper tags are not upstream's, and a build tool reading the
    # nearest tag as the version (setuptools_scm) fails on one that is not a version.
    exclude_tags: tuple[str, ...] = ()
    # Put before every environment's name, so that several generated catalogs build into one store: the names
    # differ, and layers that come out equal (a Python, a repository version of two datasets) share one image
    # by their build key, built once.
    prefix: str = ""
    # Conda channels (URLs of a conda-forge mirror) environment.yml specs are solved against; none: their
    # packages come from PyPI by name.
    conda_channels: tuple[str, ...] = ()
    # Specs for repositories (or versions) the swebench package has none for, or over its own: SWE-Gym's
    # repositories, a dataset of one's own (read_specs).
    specs: Path | None = None


def generate(opts: CatalogOptions, progress: Callable[[str], None] = lambda line: None) -> Generated:
    """`progress`: one line per repository read and per repository version prepared (cutting bundles of a
    large history takes minutes)."""
    if opts.prefix and not VERSION.match(opts.prefix):
        raise SpecError(f"--prefix {opts.prefix!r}: letters, digits and . _ + - only (it starts every environment's "
                        "name)")
    named = f"{opts.prefix}-" if opts.prefix else ""
    constants = load_swebench()
    parsers, yanked = log_parsers(), replaced_packages(constants)
    carried: dict[str, tuple[downloads.Download, ...]] = {}  # a specs file's downloads by repository
    if opts.specs:
        constants, named_parsers, carried = read_specs(opts.specs, constants)
        parsers |= named_parsers
    rows = {rid: record for rid, record in read_records(opts.dataset)}
    result = Generated(opts.out)
    # One instance per original task: ImpossibleBench variants share their original's.
    wanted: dict[str, tuple[RepoTask, dict]] = {}
    for row, task in load_tasks_with_rows(opts.dataset):
        if not isinstance(task, RepoTask):
            result.skipped.append(f"{row}: {getattr(task, 'reason', 'not a SWE-bench task')}")
        elif task.original_id not in wanted:
            wanted[task.original_id] = task, rows.get(row) or {}
    groups: dict[tuple[str, str], list[tuple[RepoTask, dict]]] = {}
    for iid, (task, record) in sorted(wanted.items()):
        problem = id_problem(iid)
        if not REPO.match(task.repo) or any(part in (".", "..") for part in task.repo.split("/")):
            problem = f"repo {task.repo!r} is not owner/name"
        elif not VERSION.match(task.version) or len(task.version) > 40:
            problem = f"version {task.version!r} is not a version (letters, digits and . _ + -)"
        if problem:
            result.skipped.append(f"{iid}: {problem}")
            continue
        groups.setdefault((task.repo, task.version), []).append((task, record))

    context = opts.out.with_name(opts.out.stem + ".d")
    cutoffs = Cutoffs(constants, opts, context / "upload-dates.json")
    environments: list[dict] = []
    # (repo, environment, test_cmd, install, pre_install) -> ids
    sets: dict[tuple[str, str, str, str, str], list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="ib-swebench-") as tmp:
        mirrors: dict[str, Repository | str] = {}
        usable: list[Buildable] = []
        for (repo, version), members in groups.items():
            if repo not in mirrors:
                source = _find_source(opts.repos, repo)
                if source:
                    progress(f"{repo}: reading {source}")
                try:
                    mirrors[repo] = Repository(source, Path(tmp), opts.exclude_tags) if source else \
                        f"no repository for {repo} in {opts.repos} (a {repo.split('/')[1]}.bundle or clone)"
                except SpecError as e:
                    mirrors[repo] = str(e)
            found = _usable(constants, yanked, opts, repo, version, members, mirrors[repo])
            if isinstance(found, str):
                result.skipped.extend(f"{t.original_id}: {found}" for t, _ in members)
            else:
                usable.append(found)

        python_envs: set[str] = set()
        # (repo, python) -> its history's merge-base, or why it could not be cut
        histories: dict[tuple[str, str], str | SpecError] = {}
        for done, u in enumerate(usable, 1):
            repo, version, spec, base, mirror, members = u.repo, u.version, u.spec, u.base, u.mirror, u.members
            progress(f"{repo} {version}: {len(members)} instance{'s' if len(members) != 1 else ''} "
                     f"({done} of {len(usable)})")
            python_env = f"{named}python-{spec.python}"
            pip = opts.pip or spec.pip
            if python_env not in python_envs:
                python_envs.add(python_env)
                env = {"APT_PACKAGES": opts.apt, "VENV": "", "PATH": PATH,
                       "PIP_BREAK_SYSTEM_PACKAGES": "1",  # PEP 668: the image is the env
                       "PIP_VERSION": pip}
                if not (u.environment_yml and opts.conda_channels):  # else conda brings the interpreter
                    env["PYTHON_VERSION"] = spec.python
                environments.append({"name": python_env, "base": base, "scripts": ["apt-packages.sh", "python-venv.sh"],
                                     "env": env})
            # Every environment sits on a compiler layer, as every SWE-bench image has build-essential: not only
            # repositories with C sources (astropy) build, their packages may have no wheel (django 4.1's
            # tests/requirements/py3.txt names pywatchman, an sdist with a C extension).
            below = f"{python_env}-cc"
            if below not in python_envs:
                python_envs.add(below)
                environments.append({"name": below, "from": python_env, "scripts": ["build-tools.sh"]})
            added: list[dict] = []
            try:
                # The repository's history shared by all its versions on this Python: up to the merge-base of
                # every one of their instances' base commits (what each of them may see).
                history = f"{named}{slug(repo)}-py{spec.python}-history"
                if (repo, spec.python) not in histories:
                    try:
                        shared = mirror.merge_base([t.base_commit for other in usable
                                                    if other.repo == repo and other.spec.python == spec.python
                                                    for t, _ in other.members])
                        environments.append(_repo_env(history, below, context / "envs" / history, opts.out,
                                                      mirror, shared, None, {}))
                        histories[repo, spec.python] = shared
                    except SpecError as e:  # every version on it is left out, each instance with the reason
                        histories[repo, spec.python] = e
                if isinstance(histories[repo, spec.python], SpecError):
                    raise SpecError(str(histories[repo, spec.python]))
                env_name = f"{named}{slug(repo)}-{version}"
                deps_dir = context / "envs" / f"{env_name}-deps"
                deps_dir.mkdir(parents=True, exist_ok=True)
                write_if_changed(deps_dir / "requirements.txt", u.requirements)
                conda = u.environment_yml if opts.conda_channels else None
                write_if_changed(deps_dir / "conda-specs.txt", _lines(conda.conda_specs()) if conda else None)
                write_if_changed(deps_dir / "pip-requirements.txt", _lines(conda.pip) if conda else None)
                optional = pip_requirements(u.environment_yml) if u.environment_yml and not conda else None
                write_if_changed(deps_dir / "optional.txt", optional and (
                    f"# from {u.environment_yml_path} (conda), as PyPI names\n" + _lines(optional.requirements)))
                left = "".join(f"; left out {x}" for x in (optional or conda).left_out) if u.environment_yml else ""
                if optional:
                    result.notes += [f"{t.original_id}: not carried out: conda {u.environment_yml_path} (no "
                                     f"--conda-channel): its packages from PyPI by name where PyPI has them as "
                                     f"wheels, the rest left out at build, named in its log{left}" for t, _ in members]
                elif left:
                    result.notes += [f"{t.original_id}: not carried out: parts of {u.environment_yml_path}{left}"
                                     for t, _ in members]
                cutoff = cutoffs.of(repo, version, spec, [r for _, r in members])
                packages, moved = cutoffs.with_wheels(spec, cutoff) if not conda else (spec.packages, [])
                setup_commit = _setup_commit(members)
                helpers = [dist for script, dist in BOOTSTRAPPERS.items()
                           if mirror.show(setup_commit, script) is not None]
                packages = [*packages, *(dist for dist in helpers if dist not in packages)]
                pyproject = mirror.show(setup_commit, "pyproject.toml")
                legacy = bool(helpers) and pyproject is None and _pip_at_least(pip, PIP_WITHOUT_LEGACY_DEVELOP)
                result.notes += [f"{t.original_id}: {line}" for line in (*u.replaced, *moved) for t, _ in members]
                deps_env = {"PYTHON_PACKAGES": " ".join(packages)}
                if conda:
                    # SWE-bench's conda environment, solved by conda's own solver (py-rattler) against the site's
                    # channels, as of the cut-off too; its interpreter first on PATH for the layers above.
                    deps_env |= {"CONDA_CHANNELS": " ".join(opts.conda_channels), "CONDA_PYTHON": spec.python,
                                 "PATH": f"{CONDA_PREFIX}/bin:{PATH}", "CONDA_PREFIX_DIR": CONDA_PREFIX,
                                 **({"CONDA_EXCLUDE_NEWER": cutoff} if cutoff else {})}
                if cutoff:  # pip 26 takes it; the builder's cut-off index serves older pips (cutoff_index.py)
                    deps_env["PIP_UPLOADED_PRIOR_TO"] = cutoff
                if spec.old_pip_options or _no_pep660(pyproject) or legacy:
                    if legacy:  # and no config settings, which would force pip 25.0.1's isolated build too
                        deps_env |= {"PIP_FOR_INSTALL": PIP_FOR_LEGACY_DEVELOP, "LEGACY_DEVELOP": "1"}
                    elif _pip_at_least(pip, PIP_WITHOUT_OLD_OPTIONS):
                        deps_env["PIP_FOR_INSTALL"] = PIP_FOR_OLD_OPTIONS
                    if spec.version < (3, 12) and not conda:
                        # `setup.py develop` under setuptools' own distutils links the checkout into
                        # /usr/lib/pythonX.Y/site-packages, which Debian's interpreter does not read (pylint
                        # 2.15: No module named 'pylint'); Debian's distutils picks its dist-packages.
                        deps_env["SETUPTOOLS_USE_DISTUTILS"] = "stdlib"
                added.append({"name": f"{env_name}-deps", "from": history,
                              "scripts": ["conda-env.sh" if conda else "python-venv.sh"],
                              "env": deps_env, "context": _relative(deps_dir, opts.out.parent)})
                merge_base = mirror.merge_base([t.base_commit for t, _ in members])
                version_env = _repo_env(env_name, f"{env_name}-deps", context / "envs" / env_name, opts.out,
                                        mirror, merge_base, histories[repo, spec.python],
                                        {"BASE_COMMIT": merge_base, "PRE_INSTALL": "\n".join(spec.pre_install),
                                         "INSTALL": spec.install})
                # Files the build downloads from hosts a cluster does not reach (downloads.py), carried in.
                wanted = downloads.asked(spec.pre_install, lambda path: mirror.show(setup_commit, path))
                downloads.carry([*wanted, *(d for d in carried.get(repo, ()) if d not in wanted)],
                                context / "downloads", context / "envs" / env_name / "downloads")
                when = stale_when(spec.install)
                if all(mirror.same_files(merge_base, t.base_commit, when.split()) for t, _ in members):
                    # Each instance would install from these same files over the same environment: where the
                    # install changes the environment's packages (sphinx's pre_install pins Jinja2<3.0 against
                    # the deps layer's 3.0.3), it is done once here instead of in every instance (21 MB each).
                    version_env["env"]["INSTALL_AS_INSTANCES"] = "1"
                if spec.eval_setup:
                    version_env["env"]["EVAL_SETUP"] = "\n".join(spec.eval_setup)
                    if "locale-gen" in version_env["env"]["EVAL_SETUP"]:  # SWE-bench's base image has locales
                        version_env["scripts"].insert(0, "apt-packages.sh")
                        version_env["env"]["APT_PACKAGES"] = "locales"
                # An environment's variables are its image's: the tests, `run` and apptainer see them (its own
                # build too, where the locale is generated before anything reads it).
                version_env["env"].update(spec.eval_env)
                added.append(version_env)
                # Checkpoints (checkpoints.py): each instance's layer below, by its base commit.
                order = mirror.oldest_first([t.base_commit for t, _ in members])
                below: dict[str, Checkpoint | None] = dict(zip(order, place(order, merge_base, mirror.is_ancestor,
                                                                            mirror.count)))
                layers: dict[Checkpoint | None, tuple[str, str]] = {None: (env_name, merge_base)}
                for checkpoint in dict.fromkeys(below.values()):  # each after the one it sits on
                    if checkpoint is None:
                        continue
                    name = f"{env_name}-at-{checkpoint.commit[:12]}"
                    parent, since = layers[checkpoint.parent]
                    try:
                        added.append(_repo_env(name, parent, context / "envs" / name, opts.out, mirror,
                                               checkpoint.commit, since, {"BASE_COMMIT": checkpoint.commit,
                                                                          "REINSTALL_WHEN": when}))
                        layers[checkpoint] = name, checkpoint.commit
                    except SpecError:  # an unreadable object: its instances' own bundles say which are left out
                        layers[checkpoint] = layers[checkpoint.parent]
                sits = {t.base_commit: layers[below[t.base_commit]] for t, _ in members}
                if "INSTALL_AS_INSTANCES" not in version_env["env"]:
                    added += _install_layers(env_name, sits, mirror, context, opts.out, when)
            except (SpecError, downloads.DownloadError) as e:
                result.skipped.extend(f"{t.original_id}: {e}" for t, _ in members)
                continue
            environments += added
            built = 0
            for task, _ in members:
                inst_dir = context / "instances" / file_name(task.original_id)
                inst_dir.mkdir(parents=True, exist_ok=True)
                layer, since = sits[task.base_commit]
                try:
                    _bundle_once(mirror, inst_dir / "commits.bundle", task.base_commit, since)
                except SpecError as e:
                    result.skipped.append(f"{task.original_id}: {e}")
                    continue
                built += 1
                sets.setdefault((repo, layer, spec.test_cmd, spec.install, "\n".join(spec.pre_install)), []).append(
                    task.original_id)
                if spec.not_run:
                    result.notes.append(f"{task.original_id}: not carried out: {'; '.join(spec.not_run)}")
            result.environments += 1
            result.instances += built
    cutoffs.save()

    doc = {"environments": environments,
           "instance_sets": [{"from": _relative(opts.dataset, opts.out.parent),
                              "only": {"instance_id": sorted(ids)},
                              "environment": layer, "script": "swebench-instance.sh",
                              "context": _relative(context / "instances", opts.out.parent) + "/{instance_file}",
                              "env": {"BASE_COMMIT": "{base_commit}", "INSTALL": install, "PRE_INSTALL": pre_install,
                                      "REINSTALL_WHEN": stale_when(install)},
                              "workdir": WORKDIR, "test_command": test_cmd, "timeout": 3600,
                              **_grader(parsers.get(repo), install)}
                             for (repo, layer, test_cmd, install, pre_install), ids in sorted(sets.items())]}
    also = f" and {opts.specs.name}" if opts.specs else ""
    header = (f"# Generated by image-builder swebench catalog from {opts.dataset.name} and the specs of swebench "
              f"{_swebench_version()}{also}.\n# {result.environments} repository environments, {result.instances} "
              f"instances; left out: {len(result.skipped)}.\n"
              f"# Cut-offs (PIP_UPLOADED_PRIOR_TO): {cutoffs.origin}.\n")
    if not result.instances:
        raise SpecError(f"{opts.dataset}: no instance can be built; first: {(result.skipped or ['no tasks'])[0]}")
    text = header + yaml.safe_dump(doc, sort_keys=False, width=120)
    atomic_write(opts.out, lambda f: f.write(text.encode()))
    return result


def _install_layers(version: str, sits: dict[str, tuple[str, str]], mirror: Repository, context: Path,
                    catalog: Path, when: str) -> list[dict]:
    """Layers that install once for instances that would each install alike. Where a version's instances
    differ in their install files, an instance whose files are not its layer's, or whose layer left the
    install to each (it would change the environment's packages: sphinx's pre_install pins Jinja2<3.0 against
    the deps layer's 3.0.3), installs in its own overlay: 21-24 MB apiece on sphinx. Two or more on one layer
    (`sits`: base commit -> (layer, its commit), updated here) with the same install files, which their
    merge-base has too, get a layer at that merge-base that installs as they would (INSTALL_AS_INSTANCES),
    and sit on it; the rest keep the untouched layer, as SWE-bench installs each over its environment.
    `when`: the pathspecs that make the install stale."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for commit, (layer, at) in sits.items():
        groups.setdefault((layer, at, mirror.install_files(at, commit, when)), []).append(commit)
    added: list[dict] = []
    for (layer, at, _), commits in groups.items():
        base = mirror.merge_base(commits)
        name = f"{version}-installed-at-{base[:12]}"
        if (len(commits) < 2 or any(env["name"] == name for env in added) or not mirror.is_ancestor(at, base)
                or not all(mirror.same_files(base, c, when.split()) for c in commits)):
            continue
        try:
            added.append(_repo_env(name, layer, context / "envs" / name, catalog, mirror, base, at,
                                   {"BASE_COMMIT": base, "REINSTALL_WHEN": when,
                                    "INSTALL_AS_INSTANCES": "1"}))
        except SpecError:  # an unreadable object: they keep their layer
            continue
        sits.update((c, (name, base)) for c in commits)
    return added


def _grader(log_parser: str | None, install: str) -> dict:
    """An instance set's metadata for graders: SWE-bench's parser for the repository, and the install its
    eval script runs again (graders/swebench.py Reinstall: only after a patch that makes it stale)."""
    grader = {"log_parser": log_parser} if log_parser else {}
    if install.strip():
        grader["install"] = {"command": install, "when": stale_when(install).split()}
    return {"grader": grader} if grader else {}


def _no_pep660(pyproject: str | None) -> bool:
    """Whether the build requirements pin a setuptools older than 64 (no editable hook)."""
    requires = re.search(r"^requires\s*=\s*\[([^\]]*)\]", pyproject or "", re.M)
    m = OLD_SETUPTOOLS.search(requires.group(1)) if requires else None
    return bool(m) and int(m.group(1)) < 64


# When each Python came out: packages a new Python's instances need have wheels for it within about a year
# (numpy's first for 3.9, 1.19.3, came 24 days after 3.9.0).
PYTHON_RELEASED = {(3, 6): "2016-12-23T00:00:00Z", (3, 7): "2018-06-27T00:00:00Z", (3, 8): "2019-10-14T00:00:00Z",
                   (3, 9): "2020-10-05T00:00:00Z", (3, 10): "2021-10-04T00:00:00Z", (3, 11): "2022-10-24T00:00:00Z",
                   (3, 12): "2023-10-02T00:00:00Z", (3, 13): "2024-10-07T00:00:00Z"}


# pip 26 installs editable only through PEP 660 hooks, which setuptools has since 64.0.0 (2022-08-11), settled in
# the weeks after: an earlier cut-off, which holds for build requirements too, fails every setuptools project's
# `pip install -e .` (marshmallow's at 2021-10-06: "missing the 'build_editable' hook").
EDITABLE_HOOKS = "2022-09-01T00:00:00Z"


class Cutoffs:
    """The cut-off day of each repository version: the day after the newest release its spec pins, else
    after the newest its repository's specs pin; a repository that pins nothing resolves as its newest
    instance was made, but not before its Python had been out a year, nor before EDITABLE_HOOKS
    (without instance dates: after the newest any spec of the table pins, the era of the specs). Never
    before the day after its newest instance was made."""

    def __init__(self, constants: types.ModuleType, opts: CatalogOptions, cache: Path):
        self.constants, self.opts = constants, opts
        self.dates = UploadDates(cache, opts.index_url)
        self._pins: dict[str | None, datetime | None] = {}  # repo (None: the whole table) -> newest pin
        if opts.cutoff == "auto":
            self.origin = (f"the day after the newest release each spec pins (a repository that pins nothing: "
                           f"after its newest instance), from {opts.index_url}")
        elif opts.cutoff == "none":
            self.origin = "none (resolved as of the build)"
        else:
            self.origin = f"{opts.cutoff} for every environment (--cutoff)"

    def of(self, repo: str, version: str, spec: Spec, records: list[dict]) -> str | None:
        if self.opts.cutoff == "none":
            return None
        if self.opts.cutoff != "auto":
            return self.opts.cutoff
        made = [parse_time(str(r["created_at"])) for r in records if _is_time(r.get("created_at"))]
        try:
            newest = self.dates.newest(pins(spec.packages)) or self._newest_pin(repo)
            if newest is None and made:
                # A repository none of whose specs pins anything (django, requests, pvlib, pydicom, sqlfluff,
                # astroid): as its instances were made, not as of the table's newest pin (2024-07-04, after
                # numpy 2.0 dropped np.Inf, which pvlib 0.10 uses, and pytest 8 dropped the nose-style setup
                # pydicom 2.1's tests use). Never before its Python had a year of wheels, nor before
                # setuptools had editable installs (the cut-off holds for build requirements too).
                released = PYTHON_RELEASED.get(spec.version[:2])
                newest = max(parse_time(EDITABLE_HOOKS), *([parse_time(released) + timedelta(days=365)]
                                                           if released else []))
            elif newest is None:
                newest = self._newest_pin(None)
        except UploadDateError as e:
            raise SpecError(str(e)) from None
        dates = [d for d in (newest, *made) if d]
        return iso(day_after(max(dates))) if dates else None

    def with_wheels(self, spec: Spec, cutoff: str | None) -> tuple[tuple[str, ...], list[str]]:
        """The spec's packages, each pin that PyPI has only as source for the spec's Python moved to the nearest
        release of its series that has a wheel, and a line per move. SWE-bench installs these lists with
        conda, whose channels have binaries of releases PyPI has only as source (sklearn 1.3 pins numpy 1.19.2,
        whose sdist its Cython 3 cannot build; numpy 1.19.5 has a wheel for Python 3.9). Only with the index
        asked (--cutoff auto)."""
        if self.opts.cutoff != "auto":
            return spec.packages, []
        packages, moved = [], []
        for requirement in spec.packages:
            for name, version in pins([requirement]):
                try:
                    chosen = self.dates.release_with_wheel(name, version, spec.version[:2], os.uname().machine,
                                                           parse_time(cutoff) if cutoff else None)
                except UploadDateError as e:
                    raise SpecError(str(e)) from None
                if chosen != version:
                    requirement = re.sub(rf"==\s*{re.escape(version)}", f"=={chosen}", requirement, count=1)
                    moved.append(f"{name}=={version} has no wheel for Python {spec.python} on the index: "
                                 f"{name}=={chosen}, the nearest release of its series with one")
            packages.append(requirement)
        return tuple(packages), moved

    def _newest_pin(self, repo: str | None) -> datetime | None:
        if repo not in self._pins:
            specs = self.constants.MAP_REPO_VERSION_TO_SPECS
            found = [spec_of(self.constants, r, v) for r in ([repo] if repo else specs) for v in specs.get(r, {})]
            self._pins[repo] = self.dates.newest(p for s in found if isinstance(s, Spec) for p in pins(s.packages))
        return self._pins[repo]

    def save(self) -> None:
        self.dates.save()


def _is_time(value: object) -> bool:
    try:
        return isinstance(value, str) and bool(parse_time(value))
    except ValueError:
        return False


def _setup_commit(members: list[tuple[RepoTask, dict]]) -> str:
    """The commit a version's environment is set up from (SWE-bench's environment_setup_commit)."""
    return str(members[0][1].get("environment_setup_commit") or members[0][0].base_commit)


@dataclass(frozen=True)
class Buildable:
    """One repository version whose spec this builder can honour, with what its deps layer installs."""
    repo: str
    version: str
    spec: Spec
    base: str  # the Python's base image
    mirror: Repository
    members: list[tuple[RepoTask, dict]]  # its instances and their dataset rows
    requirements: str | None = None  # the spec's requirements file, as SWE-bench reads it
    environment_yml: EnvironmentYml | None = None  # the spec's conda environment file
    environment_yml_path: str = ""  # its path in the repository
    replaced: tuple[str, ...] = ()  # what replace_packages replaced in its requirements, a line each


def _usable(constants: types.ModuleType, yanked: tuple[tuple[str, str | None], ...], opts: CatalogOptions, repo: str,
            version: str, members: list, mirror: Repository | str) -> Buildable | str:
    """What one repo and version's layers are made of, or why it cannot be built."""
    spec = spec_of(constants, repo, version)
    if isinstance(spec, str):
        return spec
    base = opts.python.get(spec.python) or (opts.python_default.format(python=spec.python)
                                            if opts.python_default else "")
    if not base:
        local = local_pythons(spec.python)
        made = (f"; or make one of this host's Python: image-builder base python {local[0]} -o BASES, then "
                f"--python {spec.python}=oci:BASES:python-{spec.python}") if local else ""
        return (f"no base image for Python {spec.python}: give --python {spec.python}=REF (an image with Python "
                f"{spec.python}), or --python-default TEMPLATE{made}")
    if isinstance(mirror, str):
        return mirror
    setup_commit = _setup_commit(members)
    for commit in sorted({setup_commit, *(t.base_commit for t, _ in members)}):
        if not COMMIT.match(commit) or not mirror.has_commit(commit):
            return f"commit {commit[:40]!r} is not in {mirror.source}"
    requirements, replaced = None, []
    if spec.requirements:
        requirements = requirements_text(mirror, setup_commit, spec.requirements)
        if requirements is None:
            return f"none of {', '.join(spec.requirements)} exists at {setup_commit[:12]} in {mirror.source}"
        lines, replaced = replace_packages(requirements.splitlines(), yanked)
        requirements = "".join(f"{line}\n" for line in lines)
    environment_yml, environment_yml_path = None, ""
    for path in spec.environment_yml:
        text = mirror.show(setup_commit, path)
        if text is not None:
            try:
                environment_yml, environment_yml_path = read_environment_yml(text, path), path
                pip, more = replace_packages(list(environment_yml.pip), yanked)
                environment_yml, replaced = dataclasses.replace(environment_yml, pip=tuple(pip)), replaced + more
            except EnvironmentYmlError as e:
                return f"{e} at {setup_commit[:12]}"
            break
    else:
        if spec.environment_yml:
            return f"none of {', '.join(spec.environment_yml)} exists at {setup_commit[:12]} in {mirror.source}"
    return Buildable(repo, version, spec, base, mirror, members, requirements, environment_yml, environment_yml_path,
                     tuple(replaced))


def _repo_env(name: str, parent: str, context: Path, catalog: Path, mirror: Repository, head: str,
              since: str | None, env: dict[str, str]) -> dict:
    """An environment adding the commits from `since` to `head` to the repository (swebench-repo.sh)."""
    context.mkdir(parents=True, exist_ok=True)
    _bundle_once(mirror, context / "repo.bundle", head, since)
    return {"name": name, "from": parent, "scripts": ["swebench-repo.sh"],
            "env": {"REPO_BUNDLE": "/build/repo.bundle", **env}, "context": _relative(context, catalog.parent),
            "timeout": 3600}


def _relative(path: Path, start: Path) -> str:
    return os.path.relpath(path.resolve(), start.resolve())


def _lines(items) -> str:
    return "".join(f"{x}\n" for x in items)


def _bundle_once(repo: Repository, dest: Path, head: str, since: str | None = None) -> None:
    """Cut a bundle unless the one there already holds `head` (a rerun keeps its bytes, and the build key)."""
    marker, what = dest.with_suffix(".head"), f"{head} {since or ''} {' '.join(repo.exclude_tags)}"
    if marker.is_file() and marker.read_text() == what and (dest.is_file() or head == since):
        return
    if not repo.bundle(dest, head, since):
        dest.unlink(missing_ok=True)
    marker.write_text(what)


def _swebench_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("swebench")
    except PackageNotFoundError:
        return "(unknown version)"
