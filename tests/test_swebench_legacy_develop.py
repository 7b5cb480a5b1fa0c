"""A bootstrapping checkout (ah_bootstrap.py, no pyproject.toml) from `swebench catalog` to verdicts, for real.

astropy 1.x-3.x's setup.py imports what only the environment has (astropy-helpers, numpy): SWE-bench's pips
ran its `setup.py develop` in the environment; pip 26 builds it in isolation, where the import fails. The
catalog gives such a checkout pip 25.0.1 and LEGACY_DEVELOP (swebench_catalog.py, PIP_FOR_LEGACY_DEVELOP):
the environment's install (swebench-repo.sh) and the grader's install after a patch to setup.py
(graders/swebench.py) must both leave out the config settings that would force the isolated build again.
A repository of a few lines stands for astropy: its setup.py imports astropy_helpers, and its fix adds a
console script, which only an install makes.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from image_builder.build.catalog import load
from image_builder.build.envbuild import BuildOptions
from image_builder.oci.cache import BlobCache
from image_builder.oci.registry import RegistryOptions
from tests.conftest import run_cli
from tests.test_checkpoints import GIT, commit
from tests.test_grading import build_and_grade_gold_and_empty
from tests.test_runner_tee import file_diff

SETUP = """import astropy_helpers  # the environment's: an isolated build has setuptools alone
from setuptools import setup
setup(name="helped", version="1.0", py_modules=["helped"])
"""
FIXED_SETUP = SETUP.replace('py_modules=["helped"]',
                            'py_modules=["helped"],\n      entry_points={"console_scripts": ["helped=helped:main"]}')
SOURCE = "def add(a, b):\n    return a - b\n"
FIXED_SOURCE = "import sys\n\n\ndef add(a, b):\n    return a + b\n\n\n" \
               "def main():\n    print(add(*map(int, sys.argv[1:3])))\n"
TESTS = """import subprocess

from helped import add


def test_add():
    assert add(1, 2) == 3


def test_script():
    assert subprocess.run(["helped", "1", "2"], capture_output=True, text=True).stdout.strip() == "3"
"""
SPECS = """acme/helped:
  log_parser: parse_log_pytest
  versions:
    "1.0": {python: "3.9", install: "python -m pip install -e .", pip_packages: [pytest], test_cmd: "pytest -rA"}
"""


@pytest.mark.timeout(900)
def test_a_bootstrapping_checkout_installs_and_reinstalls_in_its_environment(tmp_path, registries,
                                                                             debian_bullseye_base):
    repo = tmp_path / "repos/helped"
    repo.mkdir(parents=True)
    subprocess.run([*GIT, "init", "-q", str(repo)], check=True)
    base = commit(repo, {"ah_bootstrap.py": "INDEX_URL = 'https://pypi.python.org/simple'\n", "setup.py": SETUP,
                         "helped.py": SOURCE}, "base")
    fix = file_diff("helped.py", SOURCE, FIXED_SOURCE) + file_diff("setup.py", SETUP, FIXED_SETUP)
    row = {"repo": "acme/helped", "instance_id": "acme__helped-1", "version": "1.0", "base_commit": base,
           "environment_setup_commit": base, "created_at": "2021-06-01T00:00:00Z", "patch": fix,
           "test_patch": file_diff("tests/test_helped.py", "", TESTS), "problem_statement": "add subtracts",
           "FAIL_TO_PASS": json.dumps(["tests/test_helped.py::test_add", "tests/test_helped.py::test_script"]),
           "PASS_TO_PASS": "[]"}
    dataset = tmp_path / "helped.jsonl"
    dataset.write_text(json.dumps(row) + "\n")
    (tmp_path / "specs.yaml").write_text(SPECS)
    r = run_cli("swebench", "catalog", str(dataset), "--repos", str(tmp_path / "repos"), "-o",
                str(tmp_path / "swe.yaml"), "--specs", str(tmp_path / "specs.yaml"),
                "--python", f"3.9={debian_bullseye_base}")
    assert r.returncode == 0, r.stderr
    catalog = load(tmp_path / "swe.yaml")
    assert catalog.environments["acme__helped-1.0-deps"].env.get("LEGACY_DEVELOP") == "1"
    build = BuildOptions(store=tmp_path / "store", cache=BlobCache(tmp_path / "cache"),
                         registry=RegistryOptions(ca_cert=registries.tls.cert))
    verdicts = build_and_grade_gold_and_empty(catalog, build, dataset, row["instance_id"], fix, tmp_path)
    gold = verdicts["gold"]["repo"]
    assert gold["resolved"] and gold["reinstall_exit_code"] == 0, verdicts["gold"]
    assert not verdicts["empty"]["repo"]["resolved"]
