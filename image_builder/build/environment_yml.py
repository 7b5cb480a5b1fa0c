"""A conda `environment.yml` (SWE-bench's xarray, matplotlib specs): what of it may be taken, for conda's solver
or as pip requirements.

SWE-bench builds such an environment with conda from conda-forge, then pip-installs the spec's pins over it.
With a site's conda channel (`swebench catalog --conda-channel`) the file's match specs go to conda's own
solver (env_scripts/conda-env.sh, py-rattler) as they are. A cluster that reaches PyPI but no conda channel
gets the same packages by name from PyPI, as the specs' plain conda package lists already are ("numpy scipy
cython"): the translation is conda's match-spec syntax to PEP 508, and the few scientific packages
conda-forge names apart from PyPI. What PyPI lacks (hdf5, a compiler metapackage) or has only as a source
build (cartopy against GEOS) is left out at build time, named in the build log (python-venv.sh's optional
requirements), never failing the environment: the spec's pins are what its tests were checked with.

The file is the repository's, so hostile: only plain entries pass. Conda specs with a URL or path are left
out and a `channel::` prefix is dropped (only the site's channels are asked), and the `pip:` section's pip
options (`--index-url`), URLs and editables are left out with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

# conda-forge names PyPI spells otherwise. A "-base" package is the PyPI project without its optional
# dependencies (matplotlib-base, geopandas-base): the rule below, not this table.
# PyPI's `iris` is a placeholder that raises on import (xarray's tests import it to see whether to skip).
RENAMES = {"pytables": "tables", "msgpack-python": "msgpack", "python-graphviz": "graphviz", "pyqt": "PyQt5",
           "pytorch": "torch", "py-xgboost": "xgboost", "iris": "scitools-iris"}
# Not packages of the environment: the interpreter is the spec's, pip is the layer's own.
NOT_PACKAGES = {"python", "pip"}
# conda-forge's libraries and toolchains whose names PyPI gives to other things (or nothing): left out.
CONDA_ONLY = {"hdf5", "libnetcdf", "geos", "proj", "tk", "ffmpeg", "compilers", "c-compiler", "cxx-compiler",
              "fortran-compiler"}
NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
CONDA_SPEC = re.compile(r"^(?:[A-Za-z0-9_.-]+::)?([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$")
VERSION_BOUNDS = re.compile(r"^(?:(?:==|!=|>=|<=|~=|>|<)\s*[A-Za-z0-9.*+!_-]+\s*,?\s*)+$")
BARE_VERSION = re.compile(r"^[0-9][A-Za-z0-9.*+!_-]*$")
PIP_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(?:\[[A-Za-z0-9._,\s-]*\])?\s*"
                             r"(?:(?:==|!=|>=|<=|~=|>|<)\s*[A-Za-z0-9.*+!_-]+\s*,?\s*)*$")


class EnvironmentYmlError(ValueError):
    pass


@dataclass(frozen=True)
class EnvironmentYml:
    """An environment.yml's `dependencies`, what of them can be taken from a hostile repository."""
    conda: tuple[str, ...]  # conda match specs, a channel prefix (`conda-forge::`) dropped: the site's channels
    pip: tuple[str, ...]  # its pip section's plain requirements
    left_out: tuple[str, ...]  # "<entry>: why", one per entry not taken

    def conda_specs(self) -> tuple[str, ...]:
        """The match specs a conda solver takes, the interpreter's left to the spec (SWE-bench: `conda create
        python=X.Y`, or `conda install python=X.Y` after the file)."""
        return tuple(spec for spec in self.conda if _name(spec) != "python")


@dataclass(frozen=True)
class PipRequirements:
    requirements: tuple[str, ...]  # PEP 508, in the file's order: conda packages, then its pip section
    left_out: tuple[str, ...]  # "<entry>: why", one per entry no requirement was made of


def read_environment_yml(text: str, source: str) -> EnvironmentYml:
    """EnvironmentYmlError: not an environment file."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise EnvironmentYmlError(f"{source}: not YAML ({str(e).splitlines()[0]})") from None
    dependencies = doc.get("dependencies") if isinstance(doc, dict) else None
    if not isinstance(dependencies, list):
        raise EnvironmentYmlError(f"{source}: no `dependencies` list")
    conda: list[str] = []
    pip: list[str] = []
    left_out: list[str] = []
    for entry in dependencies:
        if isinstance(entry, dict) and set(entry) == {"pip"} and isinstance(entry["pip"], list):
            for line in entry["pip"]:
                line = str(line).split(" #")[0].strip()
                if PIP_REQUIREMENT.match(line):
                    pip.append(line)
                else:
                    left_out.append(f"{line[:80]}: not a plain requirement (pip options, URLs and editables are "
                                    "not taken from the repository)")
        elif isinstance(entry, str) and CONDA_SPEC.match(entry.strip()) and not re.search(r"[/:\\]", _unprefixed(entry)):
            conda.append(_unprefixed(entry))
        elif isinstance(entry, str):
            left_out.append(f"{entry[:80]}: not a conda match spec (a URL or path is not taken)")
        else:
            left_out.append(f"{str(entry)[:80]}: neither a package nor a pip list")
    return EnvironmentYml(tuple(conda), tuple(pip), tuple(left_out))


def pip_requirements(env: EnvironmentYml) -> PipRequirements:
    """The file's packages as PyPI requirements (no conda channel to solve against)."""
    requirements: list[str] = []
    left_out = list(env.left_out)
    for entry in env.conda:
        made = _from_conda(entry)
        if made and _key(made) in CONDA_ONLY:
            left_out.append(f"{entry[:80]}: a conda-only library (PyPI's project of that name is not it)")
        elif made is None:
            left_out.append(f"{entry[:80]}: not a conda match spec this translates")
        elif made:
            requirements.append(made)
    requirements += env.pip
    seen: set[str] = set()
    unique = [r for r in requirements if not (_key(r) in seen or seen.add(_key(r)))]
    return PipRequirements(tuple(unique), tuple(left_out))


def _unprefixed(spec: str) -> str:
    return spec.strip().split("::", 1)[-1].strip()


def _name(spec: str) -> str:
    m = CONDA_SPEC.match(spec)
    return m.group(1).lower() if m else ""


def _from_conda(spec: str) -> str | None:
    """`numpy`, `numpy>=1.17,<2`, `numpy=1.17` (conda: 1.17.*), `numpy 1.17.*`, `numpy=1.17=py38_0`,
    `conda-forge::numpy` as a pip requirement; "" for the interpreter and pip; None when not translatable."""
    m = CONDA_SPEC.match(spec.split("[")[0].strip())
    if not m:
        return None
    name, rest = m.group(1).lower(), m.group(2).strip()
    if name in NOT_PACKAGES:
        return ""
    name = RENAMES.get(name, name[: -len("-base")] if name.endswith("-base") else name)
    if not NAME.match(name):
        return None
    if not rest:
        return name
    if rest.startswith("=") and not rest.startswith("=="):  # name=VERSION[=BUILD]: conda's fuzzy equality
        version = rest[1:].split("=")[0].strip()
        return f"{name}=={version}" + ("" if "*" in version else ".*") if BARE_VERSION.match(version) else None
    rest = rest.split()[0] if BARE_VERSION.match(rest.split()[0]) else rest  # "1.17.* BUILD": no build
    if BARE_VERSION.match(rest):
        return f"{name}=={rest}"
    bounds = rest.replace(" ", "")
    return f"{name}{bounds}" if "|" not in bounds and VERSION_BOUNDS.match(bounds) else None


def _key(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()
