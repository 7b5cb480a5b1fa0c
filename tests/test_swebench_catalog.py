"""`image-builder swebench catalog`: specs from the swebench package, history cut per layer, reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from image_builder.build.catalog import load
from image_builder.build.checkpoints import DEPTH, GAP, place
from image_builder.build.swebench_catalog import REINSTALL_WHEN
from tests.conftest import run_cli
from tests.support.simple_index import serve_index

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "index/data"
MARSHMALLOW = DATA / "swebench_marshmallow.jsonl"
MACHINE = os.uname().machine


def generate(tmp: Path, dataset: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli("swebench", "catalog", str(dataset), "--repos", str(DATA / "repos"), "-o",
                   str(tmp / "swe.yaml"), "--python", "3.9=registry.example/python:3.9",
                   "--cutoff", "2024-07-04", *extra, env=env)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def test_catalog_from_the_specs_layers_history_and_builds_each_instance_once(tmp_path):
    r = generate(tmp_path, MARSHMALLOW)
    assert r.returncode == 0, r.stderr
    assert "2 repository environments, 2 instances (0 left out)" in r.stdout
    # progress on stderr: the repository read, then each version as it is prepared
    assert r.stderr.splitlines() == [f"marshmallow-code/marshmallow: reading {DATA / 'repos/marshmallow.bundle'}",
                                     "marshmallow-code/marshmallow 2.20: 1 instance (1 of 2)",
                                     "marshmallow-code/marshmallow 3.0: 1 instance (2 of 2)"]
    cat = load(tmp_path / "swe.yaml")
    envs = cat.environments
    slug = "marshmallow-code__marshmallow"
    assert list(envs) == ["python-3.9", "python-3.9-cc", f"{slug}-py3.9-history", f"{slug}-2.20-deps", f"{slug}-2.20",
                          f"{slug}-3.0-deps", f"{slug}-3.0"]
    assert envs["python-3.9"].base == "registry.example/python:3.9" and envs["python-3.9"].env["PIP_VERSION"]
    assert envs[f"{slug}-3.0"].parent == f"{slug}-3.0-deps" and envs[f"{slug}-3.0-deps"].parent.endswith("history")
    # From swebench's MAP_REPO_VERSION_TO_SPECS, not from this repository.
    assert envs[f"{slug}-3.0"].env["INSTALL"] == "python -m pip install -e '.[dev]'"
    # ImpossibleBench's variants of 1359 share its instance.
    assert sorted(cat.instances) == [f"{slug}-1343", f"{slug}-1359"]
    inst = cat.instances[f"{slug}-1359"]
    assert inst.environment == f"{slug}-3.0" and inst.workdir == "/testbed" and inst.test_command == "pytest -rA"
    assert inst.context.name == f"{slug}-1359" and inst.env["BASE_COMMIT"] == inst.grader["base_commit"]
    assert inst.grader["log_parser"] == "parse_log_pytest", "SWE-bench's parser for the repository, by name"
    # The interpreter is the environment (tox-current-env links to it), and packages resolve as of the cut-off.
    assert envs["python-3.9"].env["VENV"] == "" and "/opt/venv" not in envs["python-3.9"].env["PATH"]
    assert envs[f"{slug}-3.0-deps"].env["PIP_UPLOADED_PRIOR_TO"] == "2024-07-04T00:00:00Z"
    assert envs["python-3.9"].env["PIP_VERSION"] == "pip==26.0.1", "the pip of Python 3.9 that takes a cut-off"
    assert envs["python-3.9"].env["PYTHON_VERSION"] == "3.9", "a base of another Python fails in one line"
    # A compiler under every environment, as SWE-bench's base image has build-essential (a package without a
    # wheel builds: django's pywatchman), C sources in the repository or not.
    assert envs["python-3.9-cc"].parent == "python-3.9"
    assert [s.name for s in envs["python-3.9-cc"].scripts] == ["build-tools.sh"]
    assert envs[f"{slug}-py3.9-history"].parent == "python-3.9-cc"


def _marshmallow_with(tmp: Path, files: dict[str, str | None], *extra: str, row: dict | None = None) -> dict:
    """A catalog of marshmallow 3.0's instance on a commit adding FILES (None: removing it; its dataset row
    changed by ROW: another repository's spec over marshmallow's history); its environments by name."""
    changed = row or {}
    repo = tmp / changed.get("repo", "marshmallow").split("/")[-1]
    subprocess.run(["git", "clone", "-q", str(DATA / "repos/marshmallow.bundle"), str(repo)], check=True)
    row = [json.loads(line) for line in MARSHMALLOW.read_text().splitlines()][1]
    git(repo, "checkout", "-q", row["base_commit"])
    for name, text in files.items():
        if text is None:
            git(repo, "rm", "-q", name)
            continue
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
        git(repo, "add", name)
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "c")
    head = git(repo, "rev-parse", "HEAD").strip()
    dataset = tmp / "c.jsonl"
    dataset.write_text(json.dumps({**row, "base_commit": head, "environment_setup_commit": head, **changed}) + "\n")
    r = run_cli("swebench", "catalog", str(dataset), "--repos", str(tmp), "-o", str(tmp / "c.yaml"),
                "--python", "3.9=registry.example/python:3.9", "--python", "3.10=registry.example/python:3.10", *extra)
    assert r.returncode == 0, r.stderr
    (tmp / "c.stderr").write_text(r.stderr)
    return load(tmp / "c.yaml").environments


XARRAY_YML = """name: xarray-tests
channels: [conda-forge, nodefaults]
dependencies:
  - python=3.8
  - pip
  - numpy
  - matplotlib-base
  - conda-forge::netcdf4>=1.5
  - pandas=1.1
  - scipy 1.5.*
  - dask >=2.9,<3
  - pytables
  - hdf5
  - iris
  - pint=0.16=pyhd8ed1ab_0
  - numpy
  - pip:
      - numbagg
      - --index-url http://evil.example/simple
      - git+https://evil.example/pkg.git
"""


def test_a_conda_environment_yml_installs_its_packages_by_pypi_name(tmp_path):
    """xarray's spec names ci/requirements/environment.yml: read at the setup commit, conda's match specs become
    pip requirements (renames, fuzzy `=`), the repository's pip options and URLs are not taken, and each
    instance says what of the spec is not carried out."""
    envs = _marshmallow_with(tmp_path, {"ci/requirements/environment.yml": XARRAY_YML}, "--cutoff", "none",
                             row={"repo": "pydata/xarray", "version": "0.12", "instance_id": "pydata__xarray-1"})
    deps = envs["pydata__xarray-0.12-deps"]
    assert deps.parent == "pydata__xarray-py3.10-history" and "numpy==1.23.0" in deps.env["PYTHON_PACKAGES"]
    assert (deps.context / "optional.txt").read_text().splitlines()[1:] == [
        "numpy", "matplotlib", "netcdf4>=1.5", "pandas==1.1.*", "scipy==1.5.*", "dask>=2.9,<3", "tables",
        "scitools-iris", "pint==0.16.*", "numbagg"]
    assert not (deps.context / "requirements.txt").exists()
    stderr = (tmp_path / "c.stderr").read_text()
    note = next(line for line in stderr.splitlines() if line.startswith("note: pydata__xarray-1: not carried out"))
    assert "conda ci/requirements/environment.yml (no --conda-channel)" in note
    assert "; left out hdf5: a conda-only library" in note
    assert "left out --index-url http://evil.example/simple: not a plain requirement" in note
    assert "left out git+https://evil.example/pkg.git: not a plain requirement" in note
    assert "no_use_env" not in stderr, "it only chooses between two conda commands"


def test_with_a_conda_channel_an_environment_yml_is_solved_by_conda(tmp_path):
    """--conda-channel: the deps layer is conda-env.sh against the site's channels (the file's own channels and
    `channel::` prefixes are not followed), its interpreter first on PATH for the layers above, as of the
    cut-off; the file's pip section goes to the environment's pip, URLs and options left out."""
    yml = XARRAY_YML + "  - https://evil.example/linux-64/numpy-9-0.tar.bz2\n"
    envs = _marshmallow_with(tmp_path, {"ci/requirements/environment.yml": yml}, "--cutoff", "2023-06-29",
                             "--conda-channel", "https://conda.example/conda-forge", "--conda-channel",
                             "https://conda.example/extra",
                             row={"repo": "pydata/xarray", "version": "0.12", "instance_id": "pydata__xarray-1"})
    deps = envs["pydata__xarray-0.12-deps"]
    assert [s.name for s in deps.scripts] == ["conda-env.sh"]
    assert deps.env["CONDA_CHANNELS"] == "https://conda.example/conda-forge https://conda.example/extra"
    assert deps.env["CONDA_PYTHON"] == "3.10" and deps.env["CONDA_EXCLUDE_NEWER"] == "2023-06-29T00:00:00Z"
    assert "PYTHON_VERSION" not in envs["python-3.10"].env, "conda brings the interpreter: any base's python3 does"
    assert deps.env["PATH"].startswith("/opt/conda/envs/testbed/bin:")
    assert "numpy==1.23.0" in deps.env["PYTHON_PACKAGES"], "the spec's pip_packages, over the conda environment"
    assert (deps.context / "conda-specs.txt").read_text().splitlines() == [
        "pip", "numpy", "matplotlib-base", "netcdf4>=1.5", "pandas=1.1", "scipy 1.5.*", "dask >=2.9,<3", "pytables",
        "hdf5", "iris", "pint=0.16=pyhd8ed1ab_0", "numpy"], "python is the spec's"
    assert (deps.context / "pip-requirements.txt").read_text() == "numbagg\n"
    assert not (deps.context / "optional.txt").exists()
    stderr = (tmp_path / "c.stderr").read_text()
    assert "left out https://evil.example/linux-64/numpy-9-0.tar.bz2: not a conda match spec" in stderr
    assert "no --conda-channel" not in stderr
    r = run_cli("swebench", "catalog", str(tmp_path / "c.jsonl"), "--repos", str(tmp_path), "-o",
                str(tmp_path / "d.yaml"), "--python", "3.10=x", "--conda-channel", "/srv/conda-forge")
    assert r.returncode == 2 and "expected a channel's http(s):// URL" in r.stderr and "Traceback" not in r.stderr


def test_an_unreadable_environment_yml_leaves_out_its_instances(tmp_path):
    dataset_row = {"repo": "pydata/xarray", "version": "0.12", "instance_id": "pydata__xarray-2"}
    with pytest.raises(AssertionError, match="no instance can be built; first: pydata__xarray-2: ci/requirements/"
                       "environment.yml: no `dependencies` list at "):
        _marshmallow_with(tmp_path, {"ci/requirements/environment.yml": "dependencies: {numpy: 1}\n"},
                          "--cutoff", "none", row=dataset_row)


def test_conda_match_specs_as_pip_requirements():
    from image_builder.build.environment_yml import EnvironmentYmlError, pip_requirements, read_environment_yml
    made = pip_requirements(read_environment_yml(
        "dependencies:\n- numpy=1.17=py38_0\n- \"scipy[version='>=1.0']\"\n- x >=1|<0\n- {other: 1}\n"
        "- geopandas-base\n- msgpack-python\n", "e.yml"))
    assert made.requirements == ("numpy==1.17.*", "scipy", "geopandas", "msgpack")
    assert [x.split(":")[0] for x in made.left_out] == ["{'other'", "x >=1|<0"]
    for bad in ("[1, 2]", "dependencies: 3", ": :"):
        with pytest.raises(EnvironmentYmlError, match="^e.yml: "):
            read_environment_yml(bad, "e.yml")


def test_cutoff_none_resolves_as_of_the_build(tmp_path):
    envs = _marshmallow_with(tmp_path, {"NOTES.txt": "a commit of its own\n"}, "--cutoff", "none")
    assert not any("PIP_UPLOADED_PRIOR_TO" in e.env for e in envs.values()), "--cutoff none"
    assert not any("PIP_FOR_INSTALL" in e.env for e in envs.values()), "no old setuptools pinned"


def test_old_setuptools_build_requirement_installs_with_the_last_pip_that_develops(tmp_path):
    """pylint 2.15 pins setuptools~=62.6 (no PEP 660 hook): pip 25.3+ cannot install it editable; pip 25.2
    falls back to `setup.py develop`, which must link into a directory Debian's interpreter reads."""
    pyproject = '[build-system]\nrequires = ["setuptools~=62.6", "wheel~=0.37.1"]\n'
    envs = _marshmallow_with(tmp_path, {"pyproject.toml": pyproject}, "--cutoff", "none")
    deps = next(e for e in envs.values() if e.name.endswith("-deps"))
    assert deps.env["PIP_FOR_INSTALL"] == "pip==25.2"
    assert deps.env["SETUPTOOLS_USE_DISTUTILS"] == "stdlib"


@pytest.mark.parametrize("version,python,pip_for_install", [("0.22", "3.6", None), ("1.3", "3.9", "pip==25.2")])
def test_no_use_pep517_gets_a_pip_that_has_it_and_runs_on_the_python(tmp_path, version, python, pip_for_install):
    """scikit-learn's install says --no-use-pep517, which pip 25.3 removed: Python 3.9's pip 26 needs pip 25.2
    after the packages; Python 3.6's pip 21.3.1 has the option, and pip 25.2 does not run there (the 0.22
    build failed: `No matching distribution found for pip==25.2`)."""
    row = {"repo": "scikit-learn/scikit-learn", "version": version, "instance_id": "scikit-learn__scikit-learn-1"}
    envs = _marshmallow_with(tmp_path, {"NOTES.txt": "a commit of its own\n"}, "--cutoff", "none",
                             "--python", "3.6=registry.example/python:3.6", row=row)
    deps = next(e for e in envs.values() if e.name.endswith("-deps"))
    assert deps.env.get("PIP_FOR_INSTALL") == pip_for_install
    assert envs[f"python-{python}"].env["PIP_VERSION"] == {"3.6": "pip==21.3.1", "3.9": "pip==26.0.1"}[python]
    assert "--no-use-pep517" in envs[f"scikit-learn__scikit-learn-{version}"].env["INSTALL"]


@pytest.mark.parametrize("bootstraps", [True, False])
def test_a_setup_that_fetches_its_helper_from_an_old_index_gets_it_in_the_deps_layer(tmp_path, bootstraps):
    """astropy 1.3's setup.py runs ah_bootstrap.py, which fetches astropy-helpers with easy_install from
    https://pypi.python.org/simple (no PIP_INDEX_URL, no cut-off; unreachable where only pypi.org is): the
    deps layer installs it, and ah_bootstrap then finds it installed."""
    row = {"repo": "astropy/astropy", "version": "1.3", "instance_id": "astropy__astropy-1"}
    files = {"ah_bootstrap.py": "INDEX_URL = 'https://pypi.python.org/simple'\n"} if bootstraps else {"x.txt": "x\n"}
    envs = _marshmallow_with(tmp_path, files, "--cutoff", "none", "--python", "3.6=registry.example/python:3.6",
                             row=row)
    packages = next(e for e in envs.values() if e.name.endswith("-deps")).env["PYTHON_PACKAGES"].split()
    assert ("astropy-helpers" in packages) is bootstraps
    assert "setuptools==38.2.4" in packages, "the spec's own packages stay"


@pytest.mark.parametrize("pyproject, python, legacy", [(None, "3.9", True), ("[tool.black]\n", "3.9", False),
                                                     (None, "3.6", False)])
def test_a_bootstrapping_setup_with_no_pyproject_installs_in_the_environment(tmp_path, pyproject, python, legacy):
    """astropy 3.0 and 3.1 have ah_bootstrap.py and no pyproject.toml: SWE-bench's pips ran their `setup.py
    develop` in the environment, where the deps layer's astropy-helpers is; pip 26 builds them in isolation,
    where ah_bootstrap finds nothing and fails. A pip that installs them the old way comes after the packages,
    and distutils is Debian's (as for every `setup.py develop` here); not where the checkout has a
    pyproject.toml (those pips built it in isolation too), nor on 3.6, whose pip (21.3.1) does it already."""
    row = {"repo": "astropy/astropy", "version": "3.1" if python == "3.9" else "1.3", "instance_id": "astropy__astropy-2"}
    envs = _marshmallow_with(tmp_path, {"ah_bootstrap.py": "INDEX_URL = 'https://pypi.python.org/simple'\n",
                                        "pyproject.toml": pyproject},
                             "--cutoff", "none", "--python", "3.6=registry.example/python:3.6", row=row)
    deps = next(e for e in envs.values() if e.name.endswith("-deps")).env
    assert "astropy-helpers" in deps["PYTHON_PACKAGES"].split()
    assert deps.get("PIP_FOR_INSTALL") == ("pip==25.0.1" if legacy else None), deps
    assert (deps.get("LEGACY_DEVELOP") == "1") is legacy, "and no config settings, which force an isolated build"
    assert (deps.get("SETUPTOOLS_USE_DISTUTILS") == "stdlib") is legacy


def test_no_layer_holds_a_commit_its_instance_may_not_see(tmp_path):
    """SWE-bench hides every commit after the base commit (the fix among them): the layers an instance
    stacks (history, version, instance) must hold only ancestors of its base commit."""
    assert generate(tmp_path, MARSHMALLOW).returncode == 0
    assert_only_ancestors(tmp_path, load(tmp_path / "swe.yaml"))


def assert_only_ancestors(tmp_path: Path, cat) -> None:
    """Every bundle of an instance's layers holds only its base commit and that commit's ancestors."""
    for inst in cat.instances.values():
        repo = tmp_path / f"check-{inst.id}"
        git(tmp_path, "init", "-q", str(repo))
        env = cat.environments[inst.environment]
        chain = [env]
        while chain[-1].parent:
            chain.append(cat.environments[chain[-1].parent])
        bundles = [e.context / "repo.bundle" for e in reversed(chain) if e.context and (e.context / "repo.bundle").exists()]
        bundles += [inst.context / "commits.bundle"] if (inst.context / "commits.bundle").exists() else []
        assert bundles, "at least the history layer"
        for bundle in bundles:
            git(repo, "fetch", "-q", str(bundle), "+refs/heads/image-builder:refs/heads/image-builder",
                "+refs/tags/*:refs/tags/*")
        base = inst.env["BASE_COMMIT"]
        assert git(repo, "rev-parse", "refs/heads/image-builder").strip() == base
        objects = git(repo, "cat-file", "--batch-all-objects", "--batch-check=%(objecttype) %(objectname)")
        commits = {line.split()[1] for line in objects.splitlines() if line.startswith("commit ")}
        visible = set(git(repo, "rev-list", base).split())
        assert commits and commits <= visible, f"{inst.id}: {len(commits - visible)} commits after its base"


def test_a_dense_version_puts_its_later_instances_on_checkpoints(tmp_path):
    """Instances far along a version's history sit on a checkpoint (an earlier instance's base commit, a layer
    of its own) instead of each holding every commit since the version's merge-base; still no layer holds a
    commit after its instance's base."""
    mirror = tmp_path / "marshmallow"
    subprocess.run(["git", "clone", "-q", "--mirror", str(DATA / "repos/marshmallow.bundle"), str(mirror)], check=True)
    row = [json.loads(line) for line in MARSHMALLOW.read_text().splitlines()][1]
    tip = row["base_commit"]
    first, far, near = (git(mirror, "rev-parse", f"{tip}~{n}").strip() for n in (290, 20, 0))
    assert int(git(mirror, "rev-list", "--count", f"{first}..{far}")) > GAP >= \
        int(git(mirror, "rev-list", "--count", f"{far}..{near}"))
    dataset = tmp_path / "dense.jsonl"
    dataset.write_text("".join(json.dumps({**row, "instance_id": f"marshmallow-code__marshmallow-{i}",
                                           "base_commit": commit}) + "\n"
                               for i, commit in ((3, near), (1, first), (2, far))))
    r = run_cli("swebench", "catalog", str(dataset), "--repos", str(tmp_path), "-o", str(tmp_path / "swe.yaml"),
                "--python", "3.9=registry.example/python:3.9", "--cutoff", "2024-07-04")
    assert r.returncode == 0, r.stderr
    cat = load(tmp_path / "swe.yaml")
    version = "marshmallow-code__marshmallow-3.0"
    checkpoint = cat.environments[f"{version}-at-{far[:12]}"]
    assert checkpoint.parent == version and checkpoint.env["BASE_COMMIT"] == far
    assert checkpoint.env["REINSTALL_WHEN"] and [s.name for s in checkpoint.scripts] == ["swebench-repo.sh"]
    assert {i: inst.environment for i, inst in cat.instances.items()} == {
        "marshmallow-code__marshmallow-1": version, "marshmallow-code__marshmallow-2": checkpoint.name,
        "marshmallow-code__marshmallow-3": checkpoint.name}
    assert_only_ancestors(tmp_path, cat)
    # The near instance's own bundle: only the commits since the checkpoint; the far one's: none.
    near_inst = cat.instances["marshmallow-code__marshmallow-3"]
    verified = subprocess.run(["git", "bundle", "verify", str(near_inst.context / "commits.bundle")], cwd=mirror,
                              capture_output=True, text=True)
    assert verified.returncode == 0, verified.stderr
    required = verified.stdout.partition("requires these")[2].split()[2:]
    assert required and all(subprocess.run(["git", "-C", str(mirror), "merge-base", "--is-ancestor", commit, far]
                                           ).returncode == 0 for commit in required if len(commit) == 40), required
    assert not int(git(mirror, "rev-list", "--count", far, *(f"^{c}" for c in required if len(c) == 40))), \
        "it needs nothing the checkpoint does not hold, and holds no commit of the checkpoint's"
    assert not (cat.instances["marshmallow-code__marshmallow-2"].context / "commits.bundle").exists()


def test_checkpoints_follow_the_line_of_history_and_stack_no_deeper_than_depth():
    """Commits as numbers on one line (c is an ancestor of d when c <= d), but for a branch b1, b2 off 100.
    Checkpoints sit on each other as a Fenwick tree's nodes do: the k-th on the (k & (k-1))-th."""
    branch = {"b1": (100, 30), "b2": (100, 70)}

    def at(c: str) -> tuple[int, int]:  # (position on the line, how far along the branch)
        return branch[c] if c in branch else (int(c), 0)

    def is_ancestor(a: str, b: str) -> bool:
        (pa, ba), (pb, bb) = at(a), at(b)
        return a == b or (ba == 0 and pa <= pb) or (a in branch and b in branch and ba <= bb)

    def count(a: str, b: str) -> int:
        (pa, ba), (pb, bb) = at(a), at(b)
        return pb - pa + bb - ba

    assert GAP == 50 and DEPTH == 6
    line = [str(60 * i) for i in range(4, 81)]  # 240, 300, ...: each past GAP from the one before
    order = ["0", "40", "100", "130", "b1", "b2", "160", *line]
    placed = dict(zip(order, place(order, "0", is_ancestor, count)))
    where = {c: p.commit if p else None for c, p in placed.items()}
    assert where["0"] is None and where["40"] is None, "within GAP of the version's checkout"
    assert where["100"] == "100" and where["130"] == "100", "a new checkpoint, and one sitting on it"
    assert where["b1"] == "100" and where["b2"] == "b2", "a branch off the checkpoint sits on it, then has its own"
    assert placed["b2"].parent is None, "the 2nd of a line sits on the version's environment"
    assert where["160"] == "160" and placed["160"].parent is None, \
        "the line goes on past the branch, whose checkpoint is dropped from it: 160 is the 2nd again"
    assert placed["240"].parent.commit == "160" and placed["300"].parent is None, "the 3rd on the 2nd, the 4th on none"
    depth = lambda p: 1 + depth(p.parent) if p else 0  # noqa: E731
    checkpoints = {p for p in placed.values() if p}
    on_line = [p for p in checkpoints if p.commit not in ("b2",)]
    assert len(on_line) == 2 ** DEPTH - 1 and max(depth(p) for p in checkpoints) == DEPTH, \
        "63 checkpoints on one line, none stacked more than DEPTH deep"
    last = max(on_line, key=lambda p: int(p.commit))
    assert [where[c] for c in line[-5:]] == [last.commit] * 5, "past the 63rd, the last one carries the rest"
    for c, p in placed.items():  # only ancestors below: no instance reads a later commit through a checkpoint
        while p:
            assert is_ancestor(p.commit, c), (c, p.commit)
            p = p.parent


def test_specs_that_cannot_be_honoured_are_reported_per_instance(tmp_path):
    rows = [json.loads(line) for line in MARSHMALLOW.read_text().splitlines()]
    good = rows[1]
    bad = [
        {**good, "instance_id": "nobody__nothing-1", "repo": "nobody/nothing"},
        {**good, "instance_id": "marshmallow-code__marshmallow-9", "version": "0.1"},
        {**good, "instance_id": "matplotlib__matplotlib-1", "repo": "matplotlib/matplotlib", "version": "3.5"},
        {**good, "instance_id": "marshmallow-code__marshmallow-8", "version": "3.1", "base_commit": "0" * 40},
        {**good, "instance_id": "pallets__flask-1", "repo": "pallets/flask", "version": "2.0"},
        {**good, "instance_id": "pallets__flask-2", "repo": "pallets/flask", "version": "2.3"},
        # Hostile rows: a version or repo that would name a path outside the catalog's context folder.
        {**good, "instance_id": "climb-1", "version": "../../../../tmp/x"},
        {**good, "instance_id": "climb-2", "repo": "../.."},
    ]
    dataset = tmp_path / "mixed.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in [good, *bad]))
    fake = tmp_path / "pyenv/versions/3.11.2"  # a Python built here (pyenv's): the line names it
    (fake / "bin").mkdir(parents=True)
    (fake / "bin/python3.11").touch()
    (fake / "lib/python3.11").mkdir(parents=True)
    (fake / "lib/python3.11/os.py").touch()
    r = generate(tmp_path, dataset, env={"PYENV_ROOT": str(tmp_path / "pyenv")})
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("left out: ")]
    assert len(lines) == len(bad), lines
    assert "left out: nobody__nothing-1: swebench has no spec for repository nobody/nothing" in lines
    assert any(line.startswith("left out: marshmallow-code__marshmallow-9: swebench has no spec for "
                               "marshmallow-code/marshmallow version '0.1'") for line in lines)
    no_base = "no base image for Python 3.11: give --python 3.11=REF (an image with Python 3.11), or " \
        "--python-default TEMPLATE; or make one of this host's Python: image-builder base python"
    assert any(line.startswith(f"left out: matplotlib__matplotlib-1: {no_base} {fake}") for line in lines), lines
    assert any(line.startswith("left out: marshmallow-code__marshmallow-8: commit '0000") for line in lines)
    assert any(line.startswith("left out: pallets__flask-1: no repository for pallets/flask") for line in lines)
    assert any(line.startswith(f"left out: pallets__flask-2: {no_base} {fake} -o BASES, then --python "
                               "3.11=oci:BASES:python-3.11") for line in lines), lines
    assert "left out: climb-1: version '../../../../tmp/x' is not a version (letters, digits and . _ + -)" in lines
    assert "left out: climb-2: repo '../..' is not owner/name" in lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed.jsonl", "pyenv", "swe.d", "swe.yaml"], \
        "nothing outside"
    assert sorted(load(tmp_path / "swe.yaml").instances) == [good["instance_id"]], "the rest is built"

    r = run_cli("swebench", "catalog", str(MARSHMALLOW), "--repos", str(DATA / "repos"), "-o",
                str(tmp_path / "none.yaml"))  # no base given: none taken from Docker Hub
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "no instance can be built; first: marshmallow-code__marshmallow-1343: no base image for Python 3.9: " \
           "give --python 3.9=REF" in r.stderr
    assert not (tmp_path / "none.yaml").exists()


def test_rerun_keeps_the_bundles_and_so_the_build_keys(tmp_path):
    assert generate(tmp_path, MARSHMALLOW).returncode == 0
    bundles = sorted((tmp_path / "swe.d").rglob("*.bundle"))
    stamps = [p.stat().st_mtime_ns for p in bundles]
    text = (tmp_path / "swe.yaml").read_text()
    assert generate(tmp_path, MARSHMALLOW).returncode == 0
    assert [p.stat().st_mtime_ns for p in bundles] == stamps
    assert (tmp_path / "swe.yaml").read_text() == text


def test_a_per_task_context_cannot_climb_out_of_its_template(tmp_path):
    """The dataset's fields fill the template: a version of "../../outside" must not bind a host directory
    outside the catalog's context folder into the build."""
    row = json.loads(MARSHMALLOW.read_text().splitlines()[1])
    (tmp_path / "outside").mkdir()
    (tmp_path / "ctx" / "3.0").mkdir(parents=True)
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps({**row, "version": "../../outside"}) + "\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts/s.sh").write_text("true\n")
    catalog = tmp_path / "c.yaml"
    catalog.write_text(
        "scripts_dir: scripts\nenvironments:\n  - {name: e, base: 'docker.io/library/debian:12', scripts: [s.sh]}\n"
        "instance_sets:\n  - {from: d.jsonl, environment: e, context: 'ctx/sub/{version}'}\n")
    r = run_cli("check", str(catalog))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "outside" in r.stderr and "fix the task's fields in the dataset" in r.stderr, r.stderr


def test_relative_paths_make_a_catalog_that_works_from_any_cwd(tmp_path):
    """`--repos repos` relative to the cwd: the repositories are found, and the catalog (its bundles, its
    dataset) checks from elsewhere."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "repos").symlink_to(DATA / "repos")
    (work / "swebench.jsonl").write_text(MARSHMALLOW.read_text())
    r = run_cli("swebench", "catalog", "swebench.jsonl", "--repos", "repos", "-o", "out/swe.yaml",
                "--python", "3.9=registry.example/python:3.9", cwd=work)
    assert r.returncode == 0, r.stderr
    assert "2 repository environments, 2 instances (0 left out)" in r.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run_cli("check", str(work / "out/swe.yaml"), cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert sorted(load(work / "out/swe.yaml").instances) == ["marshmallow-code__marshmallow-1343",
                                                             "marshmallow-code__marshmallow-1359"]


def test_build_only_takes_globs_and_commas(tmp_path):
    from image_builder.build.storebuild import expand_only, select
    assert generate(tmp_path, MARSHMALLOW).returncode == 0
    cat = load(tmp_path / "swe.yaml")
    slug = "marshmallow-code__marshmallow"
    both = [f"{slug}-1343", f"{slug}-1359"]
    assert expand_only(cat, (f"{slug}-13*",)) == frozenset(both)
    assert expand_only(cat, (f"{slug}-1343, {slug}-1359",)) == frozenset(both)
    envs, instances = select(cat, expand_only(cat, (f"*-1359,{slug}-2.20-deps",)), None)
    assert [i.id for i in instances] == [f"{slug}-1359"]
    assert [e.name for e in envs] == ["python-3.9", "python-3.9-cc", f"{slug}-py3.9-history", f"{slug}-2.20-deps",
                                      f"{slug}-3.0-deps", f"{slug}-3.0"]
    r = run_cli("build", str(tmp_path / "swe.yaml"), "--store", str(tmp_path / "store"), "--only", f"{slug}-1343,nope-*")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"Error: --only 'nope-*': no environment or instance in "
                                                 f"{tmp_path / 'swe.yaml'} matches; give a name the catalog declares, "
                                                 "or a glob (quoted) matching some")
    assert not (tmp_path / "store").exists()
    assert "glob" in run_cli("build", "--help").stdout


def test_auto_cutoff_is_the_day_after_the_newest_pinned_release(tmp_path):
    """Read from a real HTTP index serving PEP 691 JSON: the spec's pins decide, else its repository's, else
    its instances' dates (not before its Python's first year), else the table's; an instance made later moves
    it later; answers are cached, so a rerun asks nothing."""
    from types import SimpleNamespace

    from image_builder.build.swebench_catalog import REINSTALL_WHEN, CatalogOptions, Cutoffs, spec_of

    files = {"tox": [("tox-4.16.0-py3-none-any.whl", "2024-07-03T03:29:14Z"), ("tox-4.16.0.tar.gz", "2024-07-03T04:00:00Z")],
             "mpmath": [("mpmath-1.3.0-py3-none-any.whl", "2023-03-07T16:47:09Z")],
             # A wheel spells the name with "_": more_itertools-10.1.0 is more-itertools 10.1.0.
             "more-itertools": [("more_itertools-10.1.0-py3-none-any.whl", "2023-08-03T16:36:29Z")],
             # Python 3.9 came after 1.19.2: its first wheel for it is 1.19.3's (what SWE-bench's conda had, PyPI
             # has only as source).
             "numpy": [("numpy-1.19.2.tar.gz", "2020-09-10T00:00:00Z"),
                       (f"numpy-1.19.2-cp38-cp38-manylinux2010_{MACHINE}.whl", "2020-09-10T00:00:00Z"),
                       (f"numpy-1.19.5-cp39-cp39-manylinux2010_{MACHINE}.whl", "2021-01-05T00:00:00Z"),
                       (f"numpy-1.19.3-cp39-cp39-manylinux2010_{MACHINE}.whl", "2020-10-29T00:00:00Z"),
                       (f"numpy-1.20.0-cp39-cp39-manylinux2010_{MACHINE}.whl", "2021-01-30T00:00:00Z")]}
    asked = []
    server, index = serve_index({name: [{"filename": f, "upload-time": t} for f, t in entries]
                                 for name, entries in files.items()}, asked=asked)
    try:
        table = {"a/pins": {"1": {"python": "3.9", "pip_packages": ["tox==4.16.0", "pytest"]},
                            "2": {"python": "3.9", "pip_packages": ["more-itertools==10.1.0"]}},
                 "b/mp": {"1": {"python": "3.9", "pip_packages": ["mpmath==1.3.0"]},
                          "2": {"python": "3.9", "packages": "pytest"}},
                 "c/none": {"1": {"python": "3.9", "packages": "pytest"}},
                 "d/np": {"1": {"python": "3.9", "packages": "'numpy==1.19.2' pytest"},
                          "2": {"python": "3.8", "packages": "numpy==1.19.2"}}}
        constants = SimpleNamespace(MAP_REPO_VERSION_TO_SPECS=table)
        opts = CatalogOptions(tmp_path / "d.jsonl", tmp_path, tmp_path / "c.yaml",
                              index_url=index)
        cutoffs = Cutoffs(constants, opts, tmp_path / "dates.json")
        def of(repo, version, records=()):
            return cutoffs.of(repo, version, spec_of(constants, repo, version), list(records))
        assert of("a/pins", "1") == "2024-07-04T00:00:00Z"
        assert of("a/pins", "2") == "2023-08-04T00:00:00Z"
        assert of("b/mp", "2") == "2023-03-08T00:00:00Z", "no pins: its repository's newest"
        assert of("c/none", "1") == "2024-07-04T00:00:00Z", "none in its repository, no dates: the table's newest"
        assert of("c/none", "1", [{"created_at": "2023-09-13T17:25:47Z"}, {"created_at": "2022-12-09T18:46:50Z"}]) \
            == "2023-09-14T00:00:00Z", "none in its repository: as its instances were made (before numpy 2)"
        assert of("c/none", "1", [{"created_at": "2019-08-13T00:00:00Z"}]) == "2022-09-02T00:00:00Z", \
            "not before setuptools' editable hooks (pip 26 needs them; the cut-off holds for build requirements)"
        table["c/none"]["2"] = {"python": "3.12", "packages": "pytest"}
        assert of("c/none", "2", [{"created_at": "2023-10-30T00:00:00Z"}]) == "2024-10-02T00:00:00Z", \
            "not before its Python (3.12: 2023-10-02) had a year of wheels"
        assert of("b/mp", "1", [{"created_at": "2025-01-02T10:00:00Z"}]) == "2025-01-03T00:00:00Z"
        # A pin with no wheel for the spec's Python moves to the nearest release of its series that has one.
        numpy = spec_of(constants, "d/np", "1")
        assert cutoffs.with_wheels(numpy, "2021-02-01T00:00:00Z") == (("numpy==1.19.3", "pytest"), [
            "numpy==1.19.2 has no wheel for Python 3.9 on the index: numpy==1.19.3, the nearest release of its "
            "series with one"])
        assert cutoffs.with_wheels(numpy, "2020-10-01T00:00:00Z")[0] == ("numpy==1.19.2", "pytest"), \
            "none before the cut-off: kept (built from source)"
        assert cutoffs.with_wheels(spec_of(constants, "d/np", "2"), None)[0] == ("numpy==1.19.2",), "it has one"
        cutoffs.save()
        before = len(asked)
        again = Cutoffs(constants, opts, tmp_path / "dates.json")
        assert again.of("a/pins", "1", spec_of(constants, "a/pins", "1"), []) == "2024-07-04T00:00:00Z"
        assert again.with_wheels(numpy, None)[0] == ("numpy==1.19.3", "pytest")
        assert len(asked) == before, "answered from the cache"
    finally:
        server.shutdown()

    down = Cutoffs(constants, CatalogOptions(tmp_path / "d.jsonl", tmp_path, tmp_path / "c.yaml",
                                             index_url="http://127.0.0.1:9/simple"), tmp_path / "other.json")
    try:
        down.of("a/pins", "1", spec_of(constants, "a/pins", "1"), [])
        raise AssertionError("an unreachable index must be an error")
    except Exception as e:  # noqa: BLE001 - the one-line SpecError
        assert "give --cutoff DATE, or --cutoff none" in str(e) and type(e).__name__ == "SpecError"


def test_prefixed_catalogs_name_apart_and_declare_equal_python_layers(tmp_path):
    """Two generated catalogs into one store: --prefix keeps their names apart (the store refuses a name two
    catalogs declare), and their Python layers are declared alike, so they share one image by build key."""
    envs = {}
    for prefix in ("lite", "verified"):
        (tmp_path / prefix).mkdir()
        assert generate(tmp_path / prefix, MARSHMALLOW, "--prefix", prefix).returncode == 0
        catalog = load(tmp_path / prefix / "swe.yaml")
        envs[prefix] = catalog.environments
        assert catalog.instances and all(i.environment in envs[prefix] for i in catalog.instances.values())
        assert envs[prefix] and all(name.startswith(f"{prefix}-") for name in envs[prefix]), sorted(envs[prefix])
        assert all(e.parent is None or e.parent.startswith(f"{prefix}-") for e in envs[prefix].values())
    lite, verified = envs["lite"]["lite-python-3.9"], envs["verified"]["verified-python-3.9"]
    assert (lite.base, [s.name for s in lite.scripts], lite.env) == \
        (verified.base, [s.name for s in verified.scripts], verified.env)

    r = generate(tmp_path, MARSHMALLOW, "--prefix", "../x")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--prefix '../x': letters, digits and . _ + - only" in r.stderr and not (tmp_path / "swe.yaml").exists()


def test_eval_commands_are_carried_out_exports_as_the_environment_and_locale_gen_at_build(tmp_path):
    """django 3.x's eval_commands (SWE-bench runs them before each test run): `export LANG=en_US.UTF-8` and
    its kin become the version environment's variables, which the tests and `run` see; the `sed ... &&
    locale-gen` line runs once at build, after Debian's locales package (SWE-bench's base image has it)."""
    envs = _marshmallow_with(tmp_path, {"tests/requirements/py3.txt": "sqlparse\n"},
                             "--python", "3.6=registry.example/python:3.6",
                             row={"repo": "django/django", "version": "3.0", "instance_id": "django__django-1"})
    version = envs["django__django-3.0"]
    assert [s.name for s in version.scripts] == ["apt-packages.sh", "swebench-repo.sh"]
    assert version.env["APT_PACKAGES"] == "locales"
    assert version.env["EVAL_SETUP"] == "sed -i '/en_US.UTF-8/s/^# //g' /etc/locale.gen && locale-gen"
    assert {k: version.env[k] for k in ("LANG", "LANGUAGE", "LC_ALL")} == \
        {"LANG": "en_US.UTF-8", "LANGUAGE": "en_US:en", "LC_ALL": "en_US.UTF-8"}
    assert "eval_commands (" not in (tmp_path / "c.stderr").read_text(), "nothing of them left out"


def test_requirements_pypi_has_yanked_are_replaced_as_swebench_replaces_them(tmp_path):
    """sqlfluff's requirements_dev.txt names types-pkg_resources, whose every release PyPI has yanked: every
    sqlfluff environment failed at pip ("No matching distribution"). SWE-bench's own table
    (REPLACE_REQ_PACKAGES, read from the installed swebench) installs types-setuptools instead: so does the
    catalog, in requirements files and an environment.yml's pip section, with a note per instance."""
    envs = _marshmallow_with(tmp_path, {"requirements_dev.txt": "flake8\ntypes-pkg_resources\ntypes-toml\n"},
                             "--cutoff", "none",
                             row={"repo": "sqlfluff/sqlfluff", "version": "0.6", "instance_id": "sqlfluff__sqlfluff-1"})
    deps = envs["sqlfluff__sqlfluff-0.6-deps"]
    assert (deps.context / "requirements.txt").read_text() == "flake8\ntypes-setuptools\ntypes-toml\n"
    assert "note: sqlfluff__sqlfluff-1: types-pkg_resources is yanked from PyPI: types-setuptools instead" in \
        (tmp_path / "c.stderr").read_text()

    yml = XARRAY_YML.replace("      - numbagg", "      - numbagg\n      - types-pkg_resources==0.1.3")
    envs = _marshmallow_with(tmp_path / "x", {"ci/requirements/environment.yml": yml}, "--cutoff", "none",
                             row={"repo": "pydata/xarray", "version": "0.12", "instance_id": "pydata__xarray-2"})
    optional = (envs["pydata__xarray-0.12-deps"].context / "optional.txt").read_text().split()
    assert "types-setuptools" in optional and not any("pkg_resources" in x for x in optional)


def test_eval_commands_split_into_exports_and_commands():
    from image_builder.build.swebench_catalog import _eval_commands
    assert _eval_commands(["export A=1", "export B='x y'", "export C=$HOME", "export D=1 E=2", "locale-gen",
                           "export 9=x"]) == \
        ((("A", "1"), ("B", "x y")), ("export C=$HOME", "export D=1 E=2", "locale-gen", "export 9=x"))


def test_wheel_tags_that_install_on_a_cpython():
    from image_builder.build.upload_dates import wheel_fits
    fits = [t for t in ("py3-none-any", "py2.py3-none-any", "cp39-cp39-manylinux_2_17_x86_64.manylinux2014_x86_64",
                        "cp36-abi3-manylinux2010_x86_64", "cp39-cp39-linux_x86_64",
                        "cp38-cp38-manylinux2010_x86_64", "cp310-abi3-manylinux2010_x86_64",
                        "cp39-cp39-manylinux2014_aarch64", "cp39-cp39-win_amd64", "py2-none-any")
            if wheel_fits(t, (3, 9), "x86_64")]
    assert fits == ["py3-none-any", "py2.py3-none-any", "cp39-cp39-manylinux_2_17_x86_64.manylinux2014_x86_64",
                    "cp36-abi3-manylinux2010_x86_64", "cp39-cp39-linux_x86_64"]


def marshmallow_line(tmp_path: Path, files: tuple[tuple[str, str], ...]) -> tuple[dict, list[str]]:
    """The marshmallow sample's second row, and a commit on its base commit per (file, text), each on the last:
    the row and [base commit, then those commits]."""
    repo = tmp_path / "marshmallow"
    subprocess.run(["git", "clone", "-q", str(DATA / "repos/marshmallow.bundle"), str(repo)], check=True)
    row = [json.loads(line) for line in MARSHMALLOW.read_text().splitlines()][1]
    git(repo, "checkout", "-q", row["base_commit"])
    heads = [row["base_commit"]]
    for name, text in files:
        (repo / name).write_text(text)
        git(repo, "add", name)
        git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", name)
        heads.append(git(repo, "rev-parse", "HEAD").strip())
    return row, heads


def catalog_of(tmp_path: Path, row: dict, commits: list[str]):
    """The catalog of one instance per commit (marshmallow-N, the version's setup commit the first)."""
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps({**row, "instance_id": f"marshmallow-code__marshmallow-{i}",
                                           "base_commit": c, "environment_setup_commit": commits[0]}) + "\n"
                               for i, c in enumerate(commits)))
    r = run_cli("swebench", "catalog", str(dataset), "--repos", str(tmp_path), "-o", str(tmp_path / "c.yaml"),
                "--python", "3.9=registry.example/python:3.9", "--cutoff", "none")
    assert r.returncode == 0, r.stderr
    return load(tmp_path / "c.yaml")


def test_a_version_whose_instances_share_its_install_files_installs_once_even_if_packages_change(tmp_path):
    """Each instance would run the same install over the same environment: the version's layer does it, even
    where it changes the environment's packages (sphinx's pre_install pins Jinja2<3.0 against the deps
    layer's 3.0.3: 21 MB per instance when each did it); an instance with other install files keeps its own."""
    row, heads = marshmallow_line(tmp_path, (("NOTES.txt", "a\n"), ("src/marshmallow/extra.py", "X = 1\n"),
                                             ("setup.cfg", "[x]\n")))

    def version_env(*commits: str):
        return catalog_of(tmp_path, row, list(commits)).environments["marshmallow-code__marshmallow-3.0"].env

    assert version_env(heads[1], heads[2]).get("INSTALL_AS_INSTANCES") == "1", "a module added: same install"
    assert "INSTALL_AS_INSTANCES" not in version_env(heads[1], heads[3]), "setup.cfg differs: each its own"


def test_instances_that_would_install_alike_share_an_install_layer(tmp_path):
    """A version whose instances differ in their install files left the install to each instance where it
    changes the environment's packages (21-24 MB apiece on sphinx). Two or more alike, whose merge-base has
    their files too, now sit on a layer at that merge-base that installs as they would; one alone keeps the
    untouched version layer, as does every instance of a version with one set of install files."""
    # base, +NOTES (base's install files), +setup.cfg, +module (setup.cfg's files), +setup.py (alone)
    row, heads = marshmallow_line(tmp_path, (("NOTES.txt", "a\n"), ("setup.cfg", "[x]\n"),
                                             ("src/marshmallow/extra.py", "X = 1\n"), ("setup.py", "# changed\n")))
    cat = catalog_of(tmp_path, row, heads)
    version = "marshmallow-code__marshmallow-3.0"
    assert "INSTALL_AS_INSTANCES" not in cat.environments[version].env
    first, second = (f"{version}-installed-at-{heads[n][:12]}" for n in (0, 2))
    for name, at in ((first, heads[0]), (second, heads[2])):
        layer = cat.environments[name]
        assert layer.parent == version and [x.name for x in layer.scripts] == ["swebench-repo.sh"]
        assert (layer.env["BASE_COMMIT"], layer.env["INSTALL_AS_INSTANCES"]) == (at, "1")
    assert {i: inst.environment for i, inst in cat.instances.items()} == {
        "marshmallow-code__marshmallow-0": first, "marshmallow-code__marshmallow-1": first,
        "marshmallow-code__marshmallow-2": second, "marshmallow-code__marshmallow-3": second,
        "marshmallow-code__marshmallow-4": version}
    assert_only_ancestors(tmp_path, cat)
    assert not (cat.instances["marshmallow-code__marshmallow-2"].context / "commits.bundle").exists(), \
        "the install layer holds its commit"


def test_a_specs_file_builds_a_repository_swebench_has_no_spec_for(tmp_path):
    """SWE-Gym's repositories are not in swebench's tables: --specs lays a file of specs in swebench's keys over
    them; its log parser goes to the catalog; a bad file is one line naming the file, repository and key."""
    specs = tmp_path / "specs.yaml"
    specs.write_text('acme/widgets:\n  log_parser: parse_log_pytest_v2\n  requirements_paths: [reqs/test.txt]\n'
                     '  versions:\n    "1.0": {python: "3.9", install: "python -m pip install -e .",\n'
                     '            packages: requirements.txt, pip_packages: [pytest], test_cmd: "pytest -rA -x",\n'
                     '            eval_commands: ["export WIDGETS=1"]}\n')
    envs = _marshmallow_with(tmp_path, {"reqs/test.txt": "six\n"}, "--specs", str(specs), "--cutoff", "none",
                             row={"repo": "acme/widgets", "version": "1.0", "instance_id": "acme__widgets-1"})
    version = envs["acme__widgets-1.0"]
    assert version.env["INSTALL"] == "python -m pip install -e ." and version.env["WIDGETS"] == "1"
    deps = envs["acme__widgets-1.0-deps"]
    assert deps.env["PYTHON_PACKAGES"] == "pytest" and (deps.context / "requirements.txt").read_text() == "six\n"
    inst = load(tmp_path / "c.yaml").instances["acme__widgets-1"]
    assert inst.test_command == "pytest -rA -x" and inst.grader["log_parser"] == "parse_log_pytest_v2"
    assert "and specs.yaml." in (tmp_path / "c.yaml").read_text().splitlines()[0]
    # the install SWE-bench's eval script runs again, for the grader: an editable one after a patch to its
    # metadata or compiled sources
    assert inst.grader["install"] == {"command": "python -m pip install -e .", "when": REINSTALL_WHEN.split()}

    dataset = tmp_path / "c.jsonl"
    for text, message in (
            ("[1]", "expected a mapping of OWNER/NAME"),
            ("acme/widgets: {versions: {1.0: {python: '3.9'}}}", "version 1.0: a version is a quoted string"),
            ("acme/widgets: {versions: {'1.0': {python: '3.9', install: [x]}}}", "install has the wrong type"),
            ("acme/widgets: {versions: {'1.0': {python: '3.9', setup: x}}}", "unknown key 'setup'"),
            ("../x: {versions: {'1.0': {python: '3.9'}}}", "not a repository"),
            ("acme/widgets: {log_parser: 'rm -rf', versions: {'1.0': {python: '3.9'}}}", "log_parser must name")):
        specs.write_text(text)
        r = run_cli("swebench", "catalog", str(dataset), "--repos", str(tmp_path), "-o", str(tmp_path / "bad.yaml"),
                    "--specs", str(specs), "--python", "3.9=registry.example/python:3.9")
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith(f"Error: {specs}") and message in last, last
        assert not (tmp_path / "bad.yaml").exists()


def test_an_install_that_copies_the_package_is_stale_after_any_change(tmp_path):
    """django 2.2's `python setup.py install` (and requests' `pip install .`) copies the package: the tests
    import the copy, so an instance whose base commit differs from its layer's in any file installs again,
    and so does the grader after any candidate patch; the layer's install used to be kept unless setup.py or
    a compiled source changed (the tests then ran the layer's commit's code)."""
    specs = tmp_path / "specs.yaml"
    specs.write_text('acme/widgets:\n  versions:\n    "1.0": {python: "3.9", install: "python setup.py install",\n'
                     '            test_cmd: "pytest -rA"}\n')
    _marshmallow_with(tmp_path, {"widgets.py": "X = 1\n"}, "--specs", str(specs), "--cutoff", "none",
                      row={"repo": "acme/widgets", "version": "1.0", "instance_id": "acme__widgets-1"})
    inst = load(tmp_path / "c.yaml").instances["acme__widgets-1"]
    assert inst.grader["install"] == {"command": "python setup.py install", "when": ["."]}
    assert inst.env["REINSTALL_WHEN"] == "."


def test_a_base_of_another_python_is_one_line_before_anything_is_installed(tmp_path):
    """--python 3.10=REF naming a base whose python3 is 3.9 failed at `pip==26.3` (no such release for 3.9), a
    pip error that names neither the base nor the version; python-venv.sh now says which Python it found."""
    script = Path(__file__).resolve().parents[1] / "env_scripts" / "python-venv.sh"
    found = "%d.%d" % sys.version_info[:2]
    r = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=60, env={
        "PATH": os.environ["PATH"], "PYTHON": sys.executable, "PYTHON_VERSION": "3.10" if found != "3.10" else "3.9",
        "VENV": str(tmp_path / "venv"), "PIP_VERSION": "pip==26.3"})
    assert r.returncode == 1 and not (tmp_path / "venv").exists()
    assert r.stderr.startswith(f"error: this base's {sys.executable} is Python {found}, not the 3.")
    assert "--python 3." in r.stderr and len(r.stderr.splitlines()) == 1


def test_a_repository_lacking_an_object_says_which_and_what_to_do(tmp_path):
    """A mirror that lacks an object (a partial or damaged clone: the fetched pvlib and pydicom here lack large
    data blobs) cannot be bundled; the line names the object and what to do, not git's last word
    ("error: pack-objects died")."""
    repo = tmp_path / "repos" / "widgets"
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "data.bin").write_text("a large data file\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "c0")
    (repo / "mod.py").write_text("X = 1\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "c1")
    blob = git(repo, "rev-parse", "HEAD:data.bin").strip()
    (repo / ".git" / "objects" / blob[:2] / blob[2:]).unlink()
    head = git(repo, "rev-parse", "HEAD").strip()
    specs = tmp_path / "specs.yaml"
    specs.write_text('acme/widgets:\n  versions:\n    "1.0": {python: "3.9", install: "python -m pip install -e ."}\n')
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps({"repo": "acme/widgets", "instance_id": "acme__widgets-1", "base_commit": head,
                                   "version": "1.0", "patch": "", "FAIL_TO_PASS": '["t.py::test_x"]',
                                   "test_patch": "diff --git a/t.py b/t.py\n", "PASS_TO_PASS": "[]"}) + "\n")
    r = run_cli("swebench", "catalog", str(dataset), "--repos", str(tmp_path / "repos"), "-o", str(tmp_path / "c.yaml"),
                "--specs", str(specs), "--cutoff", "none", "--python", "3.9=registry.example/python:3.9")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert f"acme__widgets-1: {repo}: git bundle failed: unable to read {blob} (an object the repository lacks: " \
           "give a complete clone; `git fsck` lists what is missing)" in r.stderr, r.stderr


def test_requirements_includes_are_read_as_swebench_reads_them(tmp_path):
    """A `-r` line names a file beside the requirements file, or above it (matplotlib 3.1-3.4's
    requirements/dev/dev-requirements.txt: `-r ../testing/all.txt`; SWE-bench's URL client resolves the `..`,
    and git's tree paths have none: every include read empty, the environment lacked pytest-xdist and
    pandas); an include outside the repository is not read."""
    from image_builder.build.swebench_catalog import Repository, requirements_text
    from tests.test_checkpoints import GIT, commit
    repo = tmp_path / "mpl"
    repo.mkdir()
    subprocess.run([*GIT, "init", "-q", str(repo)], check=True)
    for folder in ("dev", "testing"):
        (repo / "requirements" / folder).mkdir(parents=True)
    head = commit(repo, {"requirements/dev/dev-requirements.txt": "-r ../testing/all.txt\n-r beside.txt\n"
                                                                  "-r ../../../etc/passwd\n# dev\nipython\n",
                         "requirements/dev/beside.txt": "flake8\n",
                         "requirements/testing/all.txt": "# all\npytest-xdist\npandas\n"}, "base")
    mirror = Repository(repo, tmp_path)
    text = requirements_text(mirror, head, ("requirements/dev/dev-requirements.txt", "requirements.txt"))
    assert text.split() == ["pytest-xdist", "pandas", "flake8", "ipython"]
