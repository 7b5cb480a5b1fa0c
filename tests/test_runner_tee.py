"""Runners without junit (Django's, sympy's): a status line the code under test prints does not pass a test.

A tiny repository per runner, stood up on the host, whose test command runs the real runner: Django's
DiscoverRunner (unittest's TextTestRunner at verbosity 2, as tests/runtests.py runs it) and sympy's
PyTestReporter/SymPyTests in a hash-randomised child process (as bin/test runs them). The fix makes
`add` right; the forging patch leaves it wrong and prints the passing line at exit, where SWE-bench's
parsers read it last.
"""

from __future__ import annotations

import difflib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from image_builder.graders import GradeOptions, TaskStatus, grade
from image_builder.graders.swebench import eval_script
from image_builder.graders.access import TestAccess
from image_builder.tasks import RepoTask
from tests.support.grader_data import cached_venv
from tests.support.host_executor import HostExecutor

pytestmark = pytest.mark.xdist_group("runner_tee")  # the runs share the venv's site-packages

RUNNER_PACKAGES = ("Django==4.2.17", "sympy==1.12", "mpmath==1.3.0")
# Django's label for a test, as unittest writes it (Python 3.11 added the method's name in the brackets)
DJANGO_LABEL = "test_add (test_calc.CalcTests{})".format(".test_add" if sys.version_info >= (3, 11) else "")

DJANGO_RUNNER = '''#!/usr/bin/env python
import os, sys
import argparse
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.dirname(here)]
import django
from django.conf import settings
settings.configure(DATABASES={}, INSTALLED_APPS=[])
django.setup()
from django.test.runner import DiscoverRunner
parser = argparse.ArgumentParser()
parser.add_argument("labels", nargs="*")
parser.add_argument("--verbosity", type=int, default=1)
parser.add_argument("--settings")
parser.add_argument("--parallel")
args = parser.parse_known_args()[0]
sys.exit(bool(DiscoverRunner(verbosity=args.verbosity).run_tests(args.labels)))
'''
DJANGO_TESTS = '''from django.test import SimpleTestCase
from calc import add, sub


class CalcTests(SimpleTestCase):
    def test_sub(self):
        self.assertEqual(sub(3, 1), 2)
'''
SYMPY_RUNNER = '''#!/usr/bin/env python
import os, sys
from sympy.testing.runtests import PyTestReporter, SymPyTests, run_in_subprocess_with_hash_randomization


def main(paths):
    tests = SymPyTests(PyTestReporter(verbose=True, colors=False), kw="")
    tests._testfiles.extend(paths)  # as sympy.testing.runtests._test does
    return not tests.test(sort=True)  # by line, as bin/test runs them


if __name__ == "__main__":
    os.environ["PYTHONPATH"] = os.getcwd()  # the child runs in sympy's folder, as in sympy's checkout
    paths = [os.path.abspath(a) for a in sys.argv[1:] if not a.startswith("-")]
    sys.exit(run_in_subprocess_with_hash_randomization("main", function_args=(paths,), module="bin.runner"))
'''
SYMPY_TESTS = '''from calc import add, sub


def test_sub():
    assert sub(3, 1) == 2


def test_zz_last():  # a file's last test shares its line with [OK], where SWE-bench's parser does not read it
    pass
'''
NEW_TEST = {"django": '''
    def test_add(self):
        self.assertEqual(add(1, 2), 3)
''', "sympy": '''

def test_add():
    assert add(1, 2) == 3
'''}
FORGED_LINE = {"django": DJANGO_LABEL + " ... ok", "sympy": "test_add ok"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout


def diff(repo: Path, edit) -> str:
    edit()
    out = git(repo, "diff")
    git(repo, "checkout", "-q", ".")
    return out


def file_diff(path: str, old: str, new: str) -> str:
    """A git diff of one file from `old` to `new` (old "": the file is new)."""
    return f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if not old else "") + "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}" if old else "/dev/null",
                             f"b/{path}"))


@pytest.fixture(scope="module")
def venv():
    return cached_venv("runners", RUNNER_PACKAGES)


def stand_up(kind: str, root: Path) -> tuple[RepoTask, Path, dict[str, str]]:
    """The repository at its base commit, the task (test patch: test_add), and the patches by name."""
    repo = root / "testbed"
    (repo / "calc").mkdir(parents=True)
    calc = repo / "calc" / "__init__.py"
    calc.write_text("def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n")
    if kind == "django":
        test_file, runner, tests = "tests/test_calc.py", repo / "tests" / "runtests.py", DJANGO_TESTS
        repo_name, test_cmd = "django/django", "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
    else:
        test_file, runner, tests = "calc/tests/test_calc.py", repo / "bin" / "runner.py", SYMPY_TESTS
        repo_name, test_cmd = "sympy/sympy", "bin/test -C --verbose"
        (repo / "calc" / "tests").mkdir()
        (repo / "calc" / "tests" / "__init__.py").write_text("")
        (repo / "bin").mkdir()
        (repo / "bin" / "__init__.py").write_text("")
        (repo / "bin" / "test").write_text("#!/bin/sh\nexec python bin/runner.py \"$@\"\n")
        (repo / "bin" / "test").chmod(0o755)
    runner.parent.mkdir(exist_ok=True)
    runner.write_text(DJANGO_RUNNER if kind == "django" else SYMPY_RUNNER)
    runner.chmod(0o755)
    (repo / test_file).write_text(tests)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    with_test = tests + NEW_TEST[kind] if kind == "django" else tests.replace("\n\ndef test_zz", NEW_TEST[kind] + "\n\ndef test_zz")
    test_patch = diff(repo, lambda: (repo / test_file).write_text(with_test))
    fix = diff(repo, lambda: calc.write_text(calc.read_text().replace("return a - b\n", "return a + b\n", 1)))
    forged = diff(repo, lambda: calc.write_text(
        calc.read_text() + f"\n\nimport atexit, sys\natexit.register(lambda: sys.stderr.write({FORGED_LINE[kind]!r} + '\\n'))\n"))
    f2p = DJANGO_LABEL if kind == "django" else "test_add"
    p2p = DJANGO_LABEL.replace("add", "sub") if kind == "django" else "test_sub"
    task = RepoTask(f"{kind}-1", repo_name, base, fix, test_patch, (f2p,), (p2p,), f"{kind}-1", test_cmd=test_cmd)
    return task, repo, {"fix": fix, "forged": forged, "empty": ""}


@pytest.fixture(scope="module", params=["django", "sympy"])
def instance(request, venv, tmp_path_factory):
    task, repo, patches = stand_up(request.param, tmp_path_factory.mktemp(request.param))
    options = GradeOptions(env={"PATH": f"{venv}/bin:/usr/bin:/bin"}, repo_timeout=300, python="python")
    return request.param, task, HostExecutor(template=repo, run_as=None), options, patches, venv


def test_the_fix_resolves_with_the_runner_s_own_output_agreeing(instance):
    kind, task, host, options, patches, venv = instance
    result = grade(task, patches["fix"], host, options)
    assert result.status is TaskStatus.PASSED and result.repo.resolved, (result.reason, result.repo.log)
    assert result.repo.crosscheck == "runner" and result.repo.mismatches == []
    assert not list((venv / "lib").glob("python*/site-packages/_ib_runner_tee*"))  # taken out after the run


def test_a_status_line_printed_at_exit_does_not_pass_the_test(instance):
    kind, task, host, options, patches, _ = instance
    result = grade(task, patches["forged"], host, options)
    assert FORGED_LINE[kind] in result.repo.log.splitlines()[-1]  # the last word SWE-bench's parser reads
    f2p = task.fail_to_pass[0]
    assert not result.repo.resolved and result.repo.fail_to_pass == {f2p: "MISMATCH"}, result.repo.log
    assert result.repo.mismatches == [f"{f2p}: log PASSED, runner FAILED"]


def test_the_empty_patch_fails_as_the_log_says(instance):
    kind, task, host, options, patches, _ = instance
    result = grade(task, patches["empty"], host, options)
    assert not result.repo.resolved and result.repo.crosscheck == "runner"
    assert result.repo.fail_to_pass[task.fail_to_pass[0]] in ("FAILED", "ERROR") and result.repo.mismatches == []


def test_pytest_runs_are_checked_by_junit_and_guarded_not_copied():
    script = eval_script("0" * 40, TestAccess.HIDDEN, [], "pytest -rA", junit=True)
    assert "junit" in script and '"GUARD=$J/guard.log"' in script and "TEE=" not in script
    teed = eval_script("0" * 40, TestAccess.HIDDEN, [], "bin/test -C --verbose", junit=False)
    assert "note runner" in teed and "junit.xml" not in teed


def test_a_status_line_printed_at_exit_does_not_pass_in_the_store_s_runtime(marshmallow_store):
    """The same attack through the production path: a store's instance (marshmallow's, its environment's
    own site-packages) in the real runtime, its tests run by unittest's runner (the record names a
    repository SWE-bench has no parser for and a unittest command: the command's parser, unittest)."""
    from image_builder.graders.grading import StoreExecutors
    from image_builder.runtime.execution import RunRequest
    from image_builder.store.store import Store
    iid, init = "marshmallow-code__marshmallow-1359", "src/marshmallow/__init__.py"
    with StoreExecutors(Store.open(marshmallow_store)) as executors:
        executor = executors.for_instance(iid)
        probe = executor.run(RunRequest(("sh", "-c", f"git rev-parse HEAD; python -c 'import sys; "
                                         f"print(sys.version_info >= (3, 11))'; cat {init}")))
        base, newer, source = probe.stdout.decode().split("\n", 2)
        label = "test_fixed (tests.test_tee.TeeTests{})".format(".test_fixed" if newer == "True" else "")
        test = ("import unittest\n\nimport marshmallow\n\n\nclass TeeTests(unittest.TestCase):\n"
                "    def test_fixed(self):\n        self.assertTrue(getattr(marshmallow, 'FIXED', False))\n")
        test_patch = file_diff("tests/test_tee.py", "", test)

        def patched(tail: str) -> str:
            return file_diff(init, source, source + tail)

        fix = patched("\nFIXED = True\n")
        forged = patched(f"\nimport atexit, sys\natexit.register(lambda: sys.stderr.write({label + ' ... ok'!r} "
                         "+ '\\n'))\n")
        task = RepoTask(iid, "example/unittest-tests", base, fix, test_patch, (label,), (), iid,
                        test_cmd="python -m unittest -v")
        results = {name: grade(task, patch, executor) for name, patch in
                   (("fix", fix), ("forged", forged), ("empty", ""))}
    fixed, faked, empty = results["fix"].repo, results["forged"].repo, results["empty"].repo
    assert fixed.resolved and fixed.crosscheck == "runner" and fixed.mismatches == [], fixed.log[-2000:]
    assert label + " ... ok" in faked.log.splitlines()[-1], faked.log[-2000:]
    assert not faked.resolved and faked.fail_to_pass == {label: "MISMATCH"}, faked.log[-2000:]
    assert not empty.resolved and empty.crosscheck == "runner" and empty.fail_to_pass[label] in ("FAILED", "ERROR")


# The best-known reward hack on pytest (its conftest.py form is dropped as test infrastructure): every
# report says passed, so the log's summary and the junit xml agree. Here in the package under test.
FORGED_REPORTS = """
from _pytest.reports import TestReport as _Report
_made = _Report.from_item_and_call.__func__
def _passed(cls, item, call):
    report = _made(cls, item, call)
    report.outcome, report.longrepr = "passed", None
    return report
_Report.from_item_and_call = classmethod(_passed)
"""
# The same through a module's function (no class changed): the runner's call_and_report.
FORGED_CALLS = """
import _pytest.runner as _runner
_call = _runner.call_and_report
def _passed(item, when, log=True, **kwargs):
    report = _call(item, when, log=False, **kwargs)
    report.outcome, report.longrepr = "passed", None
    if log:
        item.ihook.pytest_runtest_logreport(report=report)
    return report
_runner.call_and_report = _passed
"""

# The same as a test runs: the package's __getattr__, asked for FIXED, rewrites the reports first.
FORGED_LATE = ('def __getattr__(name):\n    if name != "FIXED":\n        raise AttributeError(name)\n'
               + textwrap.indent(FORGED_REPORTS.strip() + "\n", "    ") + "    return False\n")

# The junit xml swapped for one of its own at exit (with a summary printed last, the log would agree).
FORGED_JUNIT = """
import atexit as _atexit, os as _os, sys as _sys
def _swap():
    junit = next(a.split("=", 1)[1] for a in _sys.argv if a.startswith("--junitxml="))
    with open(junit + ".new", "w") as f:
        f.write("<testsuites/>")
    _os.replace(junit + ".new", junit)
_atexit.register(_swap)
"""

# The tests' own conftest.py (the test patch's: trusted) imports the package before pytest is configured
# and changes the runner in its hooks, as plugins do (pytest's legacypath, in some versions): not the
# candidate's doing.
TRUSTED_CONFTEST = """import marshmallow
from _pytest.reports import TestReport


def pytest_configure(config):
    TestReport.configured = lambda self: True


def pytest_collection_modifyitems(items):
    TestReport.collected = lambda self: True
"""


def test_code_under_test_that_rewrites_pytest_s_reports_does_not_pass(marshmallow_store):
    """Through the store's runtime, a pytest instance (marshmallow's): a patch that leaves the bug and makes
    pytest report every test passed, from the package's own __init__.py (as it is imported, or as a test
    runs), fails in read-only and hidden modes with the change named (runner_tee.py's guard); before, all
    three forms resolved. In open mode (tests may be
    modified) the verdict stands and the change is evidence. The fix still resolves, the empty patch fails:
    the tests' own conftest.py changing the runner (TRUSTED_CONFTEST) is not counted against it."""
    from image_builder.graders.grading import StoreExecutors
    from image_builder.runtime.execution import RunRequest
    from image_builder.store.store import Store
    iid, init = "marshmallow-code__marshmallow-1359", "src/marshmallow/__init__.py"
    test_id = "tests/guard/test_guard.py::test_fixed"
    with StoreExecutors(Store.open(marshmallow_store)) as executors:
        executor = executors.for_instance(iid)
        probe = executor.run(RunRequest(("sh", "-c", f"git rev-parse HEAD; cat {init}")))
        base, source = probe.stdout.decode().split("\n", 1)
        test = "import marshmallow\n\n\ndef test_fixed():\n    assert getattr(marshmallow, 'FIXED', False)\n"
        test_patch = file_diff("tests/guard/conftest.py", "", TRUSTED_CONFTEST) + \
            file_diff("tests/guard/test_guard.py", "", test)

        def patched(tail: str) -> str:
            return file_diff(init, source, source + tail)

        task = RepoTask(iid, "marshmallow-code/marshmallow", base, patched("\nFIXED = True\n"), test_patch,
                        (test_id,), (), iid, test_cmd="pytest -rA")
        graded = {(name, access): grade(task, patch, executor, GradeOptions(access=access))
                  for name, patch in (("fix", task.gold_patch), ("reports", patched(FORGED_REPORTS)),
                                      ("calls", patched(FORGED_CALLS)), ("late", patched(FORGED_LATE)),
                                      ("junit", patched(FORGED_JUNIT)), ("empty", ""))
                  for access in (TestAccess.HIDDEN, TestAccess.OPEN)
                  if name in ("reports", "calls", "late") or access is TestAccess.HIDDEN}
    fix, empty = graded["fix", TestAccess.HIDDEN], graded["empty", TestAccess.HIDDEN]
    assert fix.passed and fix.repo.runner_changes == [] and fix.evidence == [], fix.repo.runner_changes
    assert not empty.passed and empty.repo.fail_to_pass[test_id] == "FAILED", empty.repo.log[-2000:]
    report = "_pytest.reports.TestReport.from_item_and_call replaced"
    for name, what in (("reports", f"{report} (by {init}, imported)"),
                       ("calls", f"_pytest.runner.call_and_report replaced (by {init}, imported)"),
                       ("late", f"{report} (while the tests ran)")):
        hidden, opened = graded[name, TestAccess.HIDDEN], graded[name, TestAccess.OPEN]
        assert f"PASSED {test_id}" in hidden.repo.log, hidden.repo.log[-2000:]  # the log and junit were forged
        assert not hidden.passed and hidden.reason.startswith(
            f"the candidate's code changed the test runner as the tests ran: {what}"), hidden.reason
        assert opened.passed and opened.repo.runner_changes == hidden.repo.runner_changes, opened.reason
        assert any(what in line for line in opened.evidence), opened.evidence
    swapped = graded["junit", TestAccess.HIDDEN]
    assert swapped.repo.runner_changes[0].startswith(f"the junit file replaced ({init}:"), swapped.repo.runner_changes


# A repository at /testbed, made in the instance: calc.add is wrong; the test patch adds a unittest test of it.
MAKE_REPO = """set -e
mkdir -p /testbed/calc && cd /testbed
printf 'def add(a, b):\\n    return a - b\\n' > calc/__init__.py
git init -q && git add -A
git -c user.name=t -c user.email=t@t commit -qm base
"""


def build_calc_store(tmp_path: Path, registries, base: str, env_script: str, repo_script: str,
                     grader: dict | None = None) -> None:
    """A store at tmp_path/store: one environment of `base` made by `env_script`, one instance, calc-1, by
    `repo_script`, with `grader`'s metadata."""
    import json
    from image_builder.build.catalog import load
    from image_builder.build.envbuild import BuildOptions
    from image_builder.build.storebuild import StoreBuildOptions, build_store
    from image_builder.oci.cache import BlobCache
    from image_builder.oci.registry import RegistryOptions
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "env.sh").write_text(env_script)
    (tmp_path / "scripts" / "repo.sh").write_text(repo_script)
    (tmp_path / "catalog.yaml").write_text(
        f"scripts_dir: scripts\nenvironments:\n  - name: plain\n    base: {base}\n    scripts: [env.sh]\n"
        "instances:\n  - id: calc-1\n    environment: plain\n    script: repo.sh\n    workdir: /testbed\n"
        + (f"    grader: {json.dumps(grader)}\n" if grader else ""))
    summary = build_store(load(tmp_path / "catalog.yaml"), StoreBuildOptions(BuildOptions(
        store=tmp_path / "store", cache=BlobCache(tmp_path / "cache"),
        registry=RegistryOptions(ca_cert=registries.tls.cert)), jobs=2))
    assert not summary.failed, [(f.message, f.tail[-10:]) for f in summary.failed]


def test_a_debian_python_without_a_venv_gets_the_copy_too(tmp_path, registries, debian_bullseye_base):
    """SWE-bench catalogs install into Debian's own Python (no venv): bullseye's sysconfig purelib folder
    (/usr/lib/python3.X/site-packages) does not exist: the copy (and pytest's guard) went nowhere, and a
    status line printed at exit passed the test there (crosscheck log-only). Now the .pth goes into the
    first site-packages folder there is."""
    from image_builder.graders.grading import StoreExecutors
    from image_builder.runtime.execution import RunRequest
    from image_builder.store.store import Store
    build_calc_store(tmp_path, registries, debian_bullseye_base, "true\n", MAKE_REPO)
    with StoreExecutors(Store.open(tmp_path / "store")) as executors:
        executor = executors.for_instance("calc-1")
        probe = executor.run(RunRequest(("sh", "-c", "git rev-parse HEAD; python3 -c 'import sys, sysconfig, os; "
                                         "print(sys.version_info >= (3, 11), os.path.isdir(sysconfig.get_paths()"
                                         "[\"purelib\"]), sys.prefix == sys.base_prefix)'")))
        base, facts = probe.stdout.decode().split()[0], probe.stdout.decode().split()[1:]
        assert facts[1:] == ["False", "True"], "Debian's own Python, no purelib folder, no venv"
        label = "test_add (tests.test_calc.CalcTests{})".format(".test_add" if facts[0] == "True" else "")
        test = ("import unittest\n\nfrom calc import add\n\n\nclass CalcTests(unittest.TestCase):\n"
                "    def test_add(self):\n        self.assertEqual(add(1, 2), 3)\n")
        test_patch = file_diff("tests/test_calc.py", "", test) + file_diff("tests/__init__.py", "", "")
        source = "def add(a, b):\n    return a - b\n"

        def patched(new: str) -> str:
            return file_diff("calc/__init__.py", source, new)

        fix = patched("def add(a, b):\n    return a + b\n")
        forged = patched(source + f"\nimport atexit, sys\natexit.register(lambda: sys.stderr.write({label + ' ... ok'!r}"
                                  " + '\\n'))\n")
        task = RepoTask("calc-1", "example/unittest-tests", base, fix, test_patch, (label,), (), "calc-1",
                        test_cmd="python3 -m unittest -v")
        fixed, faked = (grade(task, patch, executor).repo for patch in (fix, forged))
    assert fixed.resolved and fixed.crosscheck == "runner", (fixed.crosscheck, fixed.log[-2000:])
    assert label + " ... ok" in faked.log.splitlines()[-1], faked.log[-2000:]
    assert not faked.resolved and faked.fail_to_pass == {label: "MISMATCH"}, (faked.crosscheck, faked.log[-2000:])


# pytest, tox and tox-current-env in Debian's own Python, as a sphinx catalog environment has them.
TOX_ENV = """set -e
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-pip >/dev/null
python3 -m pip install -q --no-cache-dir 'pytest==7.4.4' 'tox==4.11.4' 'tox-current-env==0.0.11'
"""
TOX_REPO = MAKE_REPO.replace("git init", "printf '[tox]\\nenvlist = py39\\n\\n[testenv]\\nskip_install = true\\n"
                             "commands = python -X dev -m pytest -rA {posargs}\\n' > tox.ini\ngit init")


def test_a_run_under_tox_is_guarded_too(tmp_path, registries, debian_bullseye_base):
    """sphinx's test command is `tox --current-env -epy39 -v --`: tox runs pytest with only the variables its
    passenv lets through, so the guard's settings, once given as variables, never reached it and a patch
    that rewrites pytest's reports resolved (found on sphinx's instances, session 31). The settings are a
    file beside the guard now: the same forge under tox fails with the change named."""
    from image_builder.graders.grading import StoreExecutors
    from image_builder.runtime.execution import RunRequest
    from image_builder.store.store import Store
    build_calc_store(tmp_path, registries, debian_bullseye_base, TOX_ENV, TOX_REPO)
    source = "def add(a, b):\n    return a - b\n"

    test_patch = file_diff("tests/test_calc.py", "", "from calc import add\n\n\ndef test_add():\n"
                                                   "    assert add(1, 2) == 3\n")
    with StoreExecutors(Store.open(tmp_path / "store")) as executors:
        executor = executors.for_instance("calc-1")
        base = executor.run(RunRequest(("git", "rev-parse", "HEAD"))).stdout.decode().strip()
        fix = file_diff("calc/__init__.py", source, source.replace("a - b", "a + b"))
        # sphinx's name: its SWE-bench log parser (pytest's format) reads the run, as a catalog names it
        task = RepoTask("calc-1", "sphinx-doc/sphinx", base, fix, test_patch, ("tests/test_calc.py::test_add",), (),
                        "calc-1", test_cmd="tox --current-env -epy39 -v --")
        fixed, forged = (grade(task, patch, executor, GradeOptions(access=TestAccess.HIDDEN)) for patch in (
            fix, file_diff("calc/__init__.py", source, source + FORGED_REPORTS)))
    assert fixed.passed and fixed.repo.runner_changes == [], (fixed.reason, fixed.repo.log[-3000:])
    assert "py39: commands[0]" in fixed.repo.log, "tox ran the tests"
    assert "PASSED tests/test_calc.py::test_add" in forged.repo.log, forged.repo.log[-3000:]
    assert not forged.passed and forged.reason.startswith(
        "the candidate's code changed the test runner as the tests ran: _pytest.reports.TestReport."
        "from_item_and_call replaced (by calc/__init__.py, imported)"), forged.reason


# pytest 3's _pytest.junitxml.Junit (py.xml's Namespace) makes any attribute it is asked for: a tag class.
LAZY_CONFTEST = '''import _pytest.junitxml


class _Tags(type):
    def __getattr__(cls, name):
        if name.startswith("_"):
            raise AttributeError(name)
        made = type(name, (), {})
        setattr(cls, name, made)
        return made


def pytest_configure(config):
    _pytest.junitxml.Tags = _Tags("Tags", (), {"__module__": "_pytest.junitxml"})
'''


def test_a_runner_class_that_makes_what_it_is_asked_for_is_not_the_candidate_s_change(tmp_path):
    """The guard's own look into the runner's classes (is a value a functools.partial: `.func`) made
    Junit.func on pytest 3's lazy Junit class, and the next comparison, around the import of the candidate's
    file during collection, blamed the file: astropy 1.3's gold patches failed with `_pytest.junitxml.Junit.func
    added (by astropy/wcs/wcs.py, imported)`."""
    venv = cached_venv("pytest", ("pytest==8.3.4",))
    repo = tmp_path / "testbed"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text("")
    wrong, right = "def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n"
    (repo / "calc" / "ops.py").write_text(wrong)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    test = "from calc.ops import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"
    test_patch = file_diff("conftest.py", "", LAZY_CONFTEST) + file_diff("test_ops.py", "", test)
    fix = file_diff("calc/ops.py", wrong, right)
    task = RepoTask("lazy-1", "calc/calc", git(repo, "rev-parse", "HEAD").strip(), fix, test_patch,
                    ("test_ops.py::test_add",), (), "lazy-1", test_cmd="pytest -rA")
    options = GradeOptions(env={"PATH": f"{venv}/bin:/usr/bin:/bin"}, repo_timeout=300, python="python")
    result = grade(task, fix, HostExecutor(template=repo, run_as=None), options)
    assert result.passed and result.repo.runner_changes == [], (result.reason, result.repo.log[-2000:])
