"""Grader test data (index/data, tests/fixtures), and the marshmallow instance stood up on the host.

The marshmallow instance is what the SWE-bench store image holds: the repo at
base_commit, and a Python with the test dependencies (setup.py's `tests`
extra: pytest, pytz, simplejson). The venv is built once with pip from PyPI
and cached in ~/.cache/image_builder-tests; marshmallow itself is imported
from the run's own checkout (PYTHONPATH=src), as an editable install would.
"""

from __future__ import annotations

import ast
import builtins
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DATA = Path(__file__).resolve().parents[2] / "index" / "data"  # the sample data the shipped catalogs use
MBPP_TASKS = DATA / "mbpp_train_40.parquet"
MBPP_SOLUTIONS = DATA / "mbpp_train_40_solutions.jsonl"
MBPP_IMPOSSIBLE = DATA / "mbpp_train_40_impossible.jsonl"
SWEBENCH = DATA / "swebench_marshmallow.jsonl"
MARSHMALLOW_BUNDLE = DATA / "repos" / "marshmallow.bundle"
TEST_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "image_builder-tests"
MARSHMALLOW_DEPS = ("pytest", "pytz", "simplejson")


def mbpp_solutions() -> dict[str, str]:
    return {str(r["task_id"]): r["solution"] for r in map(json.loads, MBPP_SOLUTIONS.read_text().splitlines())}


def function_name(case: str) -> str:
    """The function an assert case calls: its first call of a name that is not a builtin."""
    for node in ast.walk(ast.parse(case)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not hasattr(builtins, node.func.id):
            return node.func.id
    raise ValueError(f"no function call in {case!r}")


def marshmallow_venv() -> Path:
    """A venv with marshmallow 3.0's test dependencies."""
    return cached_venv("marshmallow", MARSHMALLOW_DEPS)


def cached_venv(name: str, packages: tuple[str, ...]) -> Path:
    """A venv with `packages` from PyPI, built once (under a lock) and reused; a new list, a new venv."""
    venv = TEST_CACHE / f"venv-{name}"
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with open(TEST_CACHE / f"venv-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = venv / ".complete"
        if not stamp.exists() or stamp.read_text() != " ".join(packages):
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *packages], check=True)
            stamp.write_text(" ".join(packages))
    return venv


def marshmallow_checkout(directory: Path, base_commit: str) -> Path:
    """The repo at base_commit, cloned from the bundle: the instance's /testbed."""
    repo = directory / "testbed"
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(MARSHMALLOW_BUNDLE), str(repo)], check=True,
                   capture_output=True)
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", base_commit], check=True)
    return repo


def diff_after(repo: Path, base_patches: list[str], edit) -> str:
    """A candidate patch as `git diff` shows it against the workspace the candidate saw:
    `repo` with `base_patches` applied, then changed by `edit(repo)`."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for patch in base_patches:
        subprocess.run(["git", "-C", str(repo), "apply", "-"], input=patch.encode(), check=True)
    subprocess.run(["git", "-C", str(repo), "commit", "-qam", "workspace as handed to the candidate", "--allow-empty"],
                   check=True, env=env)
    edit(repo)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    return subprocess.run(["git", "-C", str(repo), "diff", "--cached"], check=True, capture_output=True,
                          text=True).stdout
