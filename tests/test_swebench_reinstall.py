"""The install SWE-bench's eval script runs again after the candidate patch, through the store's runtime.

SWE-bench runs the spec's install before the tests of every evaluation: a patch to setup.py, to a compiled
extension's sources or, where the install copies the package (django 2.2's `setup.py install`, `pip install
.`), to any file of it is tested as installed. The grader used to run the tests over the environment's
install of the base commit: such a fix never reached the tests (scikit-learn 1.3.0 -> 1.3.1, whose .py files
need its changed Cython: every test an import error). Now it installs again where the patch makes the
install stale (the catalog's `grader.install`), and install_check.py fails a run whose install changed
anything beyond the project's own installed files: the candidate's setup.py runs before the test runner.
"""

from __future__ import annotations

import pytest

from image_builder.graders import GradeOptions, grade
from image_builder.graders.access import TestAccess
from image_builder.tasks import RepoTask
from tests.test_checkpoints import GIT, PROJECT, build, bundle, commit, wheel
from tests.test_runner_tee import FORGED_REPORTS, build_calc_store, file_diff

pytestmark = pytest.mark.xdist_group("reinstall")

ENV = """set -e
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-setuptools python3-pytest >/dev/null
"""
SETUP = "from setuptools import setup\nsetup(name='calc-pkg', version='1.0', packages=['calc'], " \
        "package_dir={'': 'src'})\n"
SOURCE = "def add(a, b):\n    return a - b\n"
# A src layout: the checkout is not on the tests' sys.path, they import the installed copy (an egg).
REPO = f"""set -e
mkdir -p /testbed/src/calc && cd /testbed
cat > setup.py <<'EOF'
{SETUP}EOF
cat > src/calc/__init__.py <<'EOF'
{SOURCE}EOF
git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm base
python3 setup.py -q install
rm -rf build  # distutils copies a source newer by whole seconds: a grade in the second after the build kept the old
"""
GRADER = {"install": {"command": "python3 setup.py -q install", "when": ["."]}}
TEST_PATCH = file_diff("tests/test_calc.py", "", "from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n")
FIX = file_diff("src/calc/__init__.py", SOURCE, SOURCE.replace("a - b", "a + b"))


def setup_running(code: str) -> str:
    """A patch that leaves the bug and makes setup.py run `code` when it is installed."""
    return file_diff("setup.py", SETUP, f"import os, site, sys\n{code}\n{SETUP}")


@pytest.fixture(scope="module")
def graded(tmp_path_factory, registries, debian_bullseye_base):
    from image_builder.graders.grading import StoreExecutors
    from image_builder.runtime.execution import RunRequest
    from image_builder.store.store import Store
    tmp = tmp_path_factory.mktemp("reinstall")
    build_calc_store(tmp, registries, debian_bullseye_base, ENV, REPO, grader=GRADER)
    executors = StoreExecutors(Store.open(tmp / "store"))
    executor = executors.for_instance("calc-1")
    base = executor.run(RunRequest(("git", "rev-parse", "HEAD"))).stdout.decode().strip()
    task = RepoTask("calc-1", "example/installed", base, FIX, TEST_PATCH, ("tests/test_calc.py::test_add",), (),
                    "calc-1", test_cmd="python3 -m pytest -rA")
    yield lambda patch: grade(task, patch, executor, GradeOptions(access=TestAccess.HIDDEN))
    executors.close()


def test_a_fix_to_an_installed_copy_is_installed_before_the_tests(graded):
    """Before: the tests imported the base commit's egg, the fix failed as the empty patch does."""
    fixed, empty = graded(FIX), graded("")
    assert fixed.passed and fixed.repo.reinstall_exit_code == 0, (fixed.repo.runner_changes, fixed.repo.apply_log[-2000:])
    assert fixed.repo.runner_changes == [], fixed.repo.runner_changes
    assert not empty.passed and empty.repo.reinstall_exit_code is None, "nothing to install again"


# pytest's reports rewritten by a module every interpreter imports at start: before collection, where the
# runner guard takes its first look, so only the install check can see it.
PTH_FORGE = f"""import _pytest
d = os.path.dirname(os.path.dirname(_pytest.__file__))
open(os.path.join(d, 'zz_forge.py'), 'w').write({FORGED_REPORTS!r})
open(os.path.join(d, 'zz_forge.pth'), 'w').write('import zz_forge\\n')"""
# The same written into pytest's own module on disk.
DISK_FORGE = f"""import _pytest.reports
open(_pytest.reports.__file__, 'a').write({FORGED_REPORTS!r})"""
# The watcher stopped before it can answer.
KILL_CHECK = """for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        if b'install_check' in open('/proc/%s/cmdline' % pid, 'rb').read():
            os.kill(int(pid), 9)
    except OSError:
        pass"""


@pytest.mark.parametrize("code, first", [
    (PTH_FORGE, "the install added /usr/lib/python3/dist-packages/zz_forge.py"),
    (DISK_FORGE, "the install changed /usr/lib/python3/dist-packages/_pytest/reports.py"),
    (KILL_CHECK, "the install check gave no answer"),
], ids=["pth", "pytest-on-disk", "check-killed"])
def test_an_install_that_changes_the_runners_environment_fails(graded, code, first):
    """The candidate's setup.py runs before the tests: what it changes beyond the project's own installed
    files fails the run, named (without the check, the two forges resolved the task with the bug left)."""
    forged = graded(setup_running(code))
    assert not forged.passed, (forged.reason, forged.repo.log[-2000:])
    assert forged.reason.startswith("the candidate's install changed the test runner's environment: " + first), \
        (forged.reason, forged.repo.apply_log[-2000:])


# test_checkpoints' project, built by its own backend (which needs `lib` in its isolated build environment,
# as a setuptools project needs setuptools there), here from the checkout's proj/__init__.py and needing
# nothing installed; the version layer finds lib among the context's wheels.
BACKEND = PROJECT["backend.py"].replace('"proj/__init__.py": ""', '"proj/__init__.py": open("proj/__init__.py").read()') \
    .replace("\\nRequires-Dist: tool", "")
ISOLATED = """
environments:
  - name: py
    base: BASE
    scripts: [python-venv.sh]
    env: {VENV: /opt/venv, PATH: "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
          PYTHON_PACKAGES: "pytest==8.3.4"}
  - name: v
    from: py
    scripts: [swebench-repo.sh]
    context: v
    env: {REPO_BUNDLE: /build/repo.bundle, BASE_COMMIT: C0, INSTALL: "python -m pip install .",
          PIP_FIND_LINKS: /build/wheels, PIP_NO_INDEX: "1"}
instances:
  - id: proj-1
    environment: v
    script: swebench-instance.sh
    context: i
    env: {BASE_COMMIT: C0, REINSTALL_WHEN: ".", INSTALL: "python -m pip install ."}
    workdir: /testbed
    grader: {install: {command: "python -m pip install .", when: ["."]}}
"""


def test_an_isolated_build_installs_again_offline_from_the_kept_wheels(tmp_path, registries, debian_base):
    """`pip install .` builds in an isolated environment whose requirements pip downloads: offline (every
    grade but `--net`) the install failed and the tests ran over the base commit's copy. The version layer
    keeps them as wheels (swebench-repo.sh keep_build_wheels) where the grader's pip looks."""
    import subprocess
    from image_builder.graders.grading import StoreExecutors
    from image_builder.runtime.execution import RunRequest
    from image_builder.store.store import Store
    repo = tmp_path / "repo"
    subprocess.run([*GIT, "init", "-q", str(repo)], check=True)
    (repo / "proj").mkdir()
    c0 = commit(repo, {**PROJECT, "backend.py": BACKEND, "proj/__init__.py": "VALUE = 1\n"}, "c0")
    bundle(repo, tmp_path / "v/repo.bundle", c0)
    bundle(repo, tmp_path / "i/commits.bundle", c0)
    wheel(tmp_path / "v/wheels", "lib", "1.0")
    build(tmp_path, registries, ISOLATED, {"BASE": debian_base, "C0": c0})
    test_patch = file_diff("tests/test_proj.py", "", "from proj import VALUE\n\n\ndef test_value():\n"
                                                     "    assert VALUE == 2\n")
    fix = file_diff("proj/__init__.py", "VALUE = 1\n", "VALUE = 2\n")
    task = RepoTask("proj-1", "example/isolated", c0, fix, test_patch, ("tests/test_proj.py::test_value",), (),
                    "proj-1", test_cmd="pytest -rA")
    with StoreExecutors(Store.open(tmp_path / "store")) as executors:
        executor = executors.for_instance("proj-1")
        kept = executor.run(RunRequest(("ls", "/opt/image-builder/build-wheels"))).stdout.decode().split()
        fixed = grade(task, fix, executor, GradeOptions(access=TestAccess.HIDDEN))
    assert fixed.passed and fixed.repo.reinstall_exit_code == 0, (fixed.reason, fixed.repo.apply_log[-2000:])
    assert fixed.repo.runner_changes == [], fixed.repo.runner_changes
    assert kept == ["lib-1.0-py3-none-any.whl"], kept


def test_a_pth_import_line_that_moves_to_a_new_file_is_not_new(tmp_path, monkeypatch):
    """setuptools names a namespace package's -nspkg.pth by the version, which a reinstall changes: the same
    import line in a file of a new name is the code that ran before (matplotlib's mpl_toolkits: every
    reinstall failed as 'the install added to ...-nspkg.pth'); a line no .pth had is still new."""
    from image_builder.graders import install_check
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    line = "import sys, types, os;p = os.path.join('/testbed/lib', *('mpl_toolkits',))"
    (site_dir / "matplotlib-3.6.2-nspkg.pth").write_text(line + "\n")
    monkeypatch.setattr(install_check, "site_dirs", lambda: [str(site_dir)])
    stock = install_check.Stock(str(tmp_path / "testbed"))
    (site_dir / "matplotlib-3.6.2-nspkg.pth").unlink()
    (site_dir / "matplotlib-3.7.0.dev0+g0cbcf81-nspkg.pth").write_text(line + "\n")
    assert stock.changes() == []
    (site_dir / "aa.pth").write_text("import zz_forge\n")
    assert stock.changes() == [f"the install added to {site_dir / 'aa.pth'}: import zz_forge"]
