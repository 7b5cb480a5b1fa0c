"""The repository's own SWE-bench parser decides: each family read as SWE-bench reads it, chosen as SWE-bench
chooses it (the catalog's log_parser, then the repository, then the command), and graded to a verdict.

The logs are real runs (tests/fixtures/swebench_logs/README.md says how each was made); each <family>.json
holds what SWE-bench 4.1's own function returned on that log.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from image_builder.graders import swebench_parsers
from image_builder.graders.options import GradeOptions
from image_builder.graders.results import TaskStatus
from image_builder.graders.swebench import GRADER_DIR, RunFacts, grade_repo, judge_facts
from image_builder.graders.swebench_parsers import (ALIASES, BUILTIN, REPO_PARSERS, choose_parser, command_parser,
                                                    runs_pytest)
from image_builder.runtime.execution import RunResult
from image_builder.tasks import RepoTask

LOGS = Path(__file__).resolve().parent / "fixtures" / "swebench_logs"
FIXTURES = ["pytest", "pytest_options", "pytest_v2", "sphinx", "matplotlib", "seaborn", "django", "sympy",
            "sympy_gold"]
SYMPY_CMD = "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose"
DJANGO_CMD = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
SPHINX_CMD = "tox --current-env -epy39 -v --"


def fixture(name: str) -> tuple[str, dict]:
    return (LOGS / f"{name}.log").read_text(), json.loads((LOGS / f"{name}.json").read_text())


def swebench_module():
    module = swebench_parsers.swebench_module()
    if module is None:
        pytest.skip("swebench is not installed")
    return module


@pytest.fixture(params=["swebench", "builtin"])
def source(request, monkeypatch):
    """Grade with SWE-bench's own functions, then with ours alone (as without the package)."""
    if request.param == "swebench":
        swebench_module()
    else:
        monkeypatch.setattr(swebench_parsers, "swebench_module", lambda: None)
    return request.param


# --- each family reads as SWE-bench's own function ------------------------------------------------------------

@pytest.mark.parametrize("name", FIXTURES)
def test_each_family_reads_a_real_log_as_swebench_does(name):
    log, expected = fixture(name)
    family = ALIASES.get(expected["parser"], expected["parser"])
    assert BUILTIN[family](log) == expected["statuses"]
    module = swebench_parsers.swebench_module()
    if module is not None:
        assert getattr(module, expected["parser"])(log, None) == expected["statuses"]


def test_the_fixtures_hold_what_each_format_is_about():
    statuses = {name: fixture(name)[1]["statuses"] for name in FIXTURES}
    assert statuses["sympy"]["test_dup_zz_mignotte_bound"] == "FAILED"
    assert statuses["sympy"]["test_dup_zz_cyclotomic_poly"] == "ERROR"
    assert statuses["sympy_gold"]["test_dup_zz_mignotte_bound"] == "PASSED"
    # a file's last test: its line ends in the file's [OK]/[FAIL], and SWE-bench reads no status there
    assert "test_dmp_irreducible_p" not in statuses["sympy_gold"] and "test_egyptian_fraction" not in statuses["sympy"]
    assert statuses["django"]["test_get_valid_filename (utils_tests.test_text.TestUtilsText.test_get_valid_filename)"] \
        == "FAILED"
    assert statuses["django"]["Regression test for #11764"] == "PASSED"  # a docstring names the test
    assert statuses["pytest_options"]["tests/test_paths.py::test_paths[/mymodule.py]"] == "PASSED"
    assert statuses["matplotlib"] == {"tests/test_buttons.py::test_buttons[1]": "PASSED",
                                      "tests/test_buttons.py::test_buttons[3]": "FAILED"}
    assert statuses["sphinx"]["tests/test_sample.py::TestGroup::test_method"] == "PASSED"  # colour codes out
    assert "tests/test_sample.py::test_xfail" not in statuses["seaborn"]  # passes and failures only


# Pieces of every format the parsers read, and of what trips them: random logs made of them.
PIECES = ["PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS", " - ", "tests/a.py::t[x y]", "tests/a.py::t",
          "test_foo", " ok", " F", " E", " ... ", "... ok", " ... skipped 'x'", " ... FAIL", " ... ERROR", " ... OK",
          " ...  OK", "FAIL:", "ERROR:", "____", " a/b.py:test_x ", "MouseButton.LEFT", "MouseButton.RIGHT",
          "\x1b[32m", "[1m", "\x1b[0m", " PASSED ", "ok", "Internal Server Error: /x/",
          "Testing against Django installed in 'x' (0 silenced).", "System check identified no issues (0 silenced)",
          "--version is equivalent to version", "Applying sites.0002_alter_domain_unique...test_no_migrations",
          "\t", "\r", " ", "  ", ".py:", "[/tmp/x/m.py]", "[//a]", "[a/*]", "_", "x", "t[/a/m.py]", "t[/b/m.py]",
          "[", "]", "b]"]


@pytest.mark.parametrize("family", sorted(BUILTIN))
def test_each_family_reads_random_logs_as_swebench_does(family):
    function = getattr(swebench_module(), family)
    rng, compared = random.Random(family), 0
    for _ in range(3000):
        log = "\n".join("".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))
                        for _ in range(rng.randint(1, 8)))
        try:
            theirs = function(log, None)
        except IndexError:
            continue  # SWE-bench's function fails on a lone "FAILED" (seaborn's, django's "FAIL:"); ours skips it
        assert BUILTIN[family](log) == theirs, repr(log)
        compared += 1
    assert compared > 2500


def test_our_tables_are_swebench_s():
    module = swebench_module()
    assert {repo: fn.__name__ for repo, fn in module.MAP_REPO_TO_PARSER_PY.items()} == REPO_PARSERS
    for alias, family in ALIASES.items():
        assert getattr(module, alias).__name__ == family


# --- which parser decides ---------------------------------------------------------------------------------------

def test_the_catalog_decides_then_the_repository_then_the_command(source):
    chosen = choose_parser("parse_log_sympy", "astropy/astropy", "pytest -rA")
    assert (chosen.name, chosen.family, chosen.chosen_by, chosen.source) == (
        "parse_log_sympy", "parse_log_sympy", "catalog", source)
    by_repo = choose_parser(None, "sympy/sympy", "pytest -rA")
    assert (by_repo.family, by_repo.chosen_by) == ("parse_log_sympy", "repository")
    sphinx = choose_parser("parse_log_sphinx", "sphinx-doc/sphinx", SPHINX_CMD)
    assert (sphinx.name, sphinx.family) == ("parse_log_sphinx", "parse_log_pytest_v2")
    unknown = choose_parser("parse_log_from_the_future", "django/django", DJANGO_CMD)
    assert (unknown.family, unknown.chosen_by) == ("parse_log_django", "repository")
    assert choose_parser({"not": "a name"}, "my/fork", "pytest -rA").chosen_by == "command"
    assert [command_parser(c) for c in ("python -m pytest -x", SYMPY_CMD, DJANGO_CMD, "python -m unittest")] == [
        "parse_log_pytest", "parse_log_sympy", "parse_log_django", "unittest"]


def test_junit_checks_a_run_where_the_runner_is_pytest():
    pytest_v2 = choose_parser("parse_log_pytest_v2", "sphinx-doc/sphinx", SPHINX_CMD)
    assert runs_pytest(SPHINX_CMD, pytest_v2)  # what follows tox's "--" reaches pytest ({posargs})
    assert not runs_pytest("tox -epy39", pytest_v2)
    assert runs_pytest("pytest -rA", choose_parser(None, "pallets/flask", "pytest -rA"))
    sympy = choose_parser("parse_log_sympy", "sympy/sympy", SYMPY_CMD)
    assert not runs_pytest(SYMPY_CMD, sympy) and not runs_pytest("pytest -rA", sympy)
    assert not runs_pytest(DJANGO_CMD, choose_parser(None, "django/django", DJANGO_CMD))


# --- verdicts -----------------------------------------------------------------------------------------------------

class Replay:
    """An instance whose test run printed a recorded log (and pytest wrote a recorded junit): it answers the
    grader's eval script as the script would, with the run's own nonce."""

    def __init__(self, log: str, junit: str | None = None, *, log_parser: str | None = None,
                 test_command: str | None = None):
        self.log, self.junit = log if log.endswith("\n") else log + "\n", junit
        self.log_parser, self.test_command = log_parser, test_command
        self.script = ""

    def run(self, request) -> RunResult:
        self.script = request.files[f"{GRADER_DIR}/eval.sh"].decode()
        nonce = request.files[f"{GRADER_DIR}/nonce"].decode()
        junit = base64.b64encode(self.junit.encode()).decode() if self.junit else "none"
        stdout = f"Checking patch x.py...\n>>>>> {nonce} start\n{self.log}>>>>> {nonce} end\n"
        stderr = "".join(f"@@ {nonce} {note}\n" for note in ("model git apply", "exit 1", f"junit {junit}"))
        return RunResult(exit_code=0, signal=None, timed_out=False, out_of_memory=False, wall_time=1.0,
                         peak_memory_kb=None, stdout=stdout.encode(), stderr=stderr.encode())


def diff_of(path: str) -> str:
    return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-a\n+b\n"


def task(repo: str, test_file: str, fail_to_pass, pass_to_pass=(), **extra) -> RepoTask:
    return RepoTask(f"{repo.replace('/', '__')}-1", repo, "0" * 40, "", diff_of(test_file), tuple(fail_to_pass),
                    tuple(pass_to_pass), f"{repo.replace('/', '__')}-1", **extra)


SYMPY_F2P = ("test_dup_zz_mignotte_bound", "test_dmp_zz_mignotte_bound")
SYMPY_P2P = ("test_dup_trial_division", "test_dup_zz_hensel_step", "test_dmp_zz_wang")


def grade_sympy(log_name: str, log_parser: str | None = "parse_log_sympy", repo: str = "sympy/sympy"):
    replay = Replay(fixture(log_name)[0], log_parser=log_parser, test_command=SYMPY_CMD)
    graded = grade_repo(task(repo, "sympy/polys/tests/test_factortools.py", SYMPY_F2P, SYMPY_P2P), "", replay,
                        GradeOptions())
    return graded, replay


def test_a_sympy_task_whose_catalog_names_parse_log_sympy_resolves(source):
    """sympy-19254's tests on the fixed code: bin/test's `test_x ok` lines, read MISSING by unittest's parser."""
    graded, replay = grade_sympy("sympy_gold")
    assert graded.status is TaskStatus.PASSED and graded.repo.resolved, graded.reason
    assert set(graded.repo.fail_to_pass.values()) == set(graded.repo.pass_to_pass.values()) == {"PASSED"}
    assert graded.repo.crosscheck == "log-only" and "--junitxml" not in replay.script
    assert replay.script.count(SYMPY_CMD) == 1


def test_a_sympy_run_whose_fail_to_pass_test_fails_does_not_resolve(source):
    graded, _ = grade_sympy("sympy")
    assert graded.status is TaskStatus.FAILED and not graded.repo.resolved
    assert graded.repo.fail_to_pass == {"test_dup_zz_mignotte_bound": "FAILED", "test_dmp_zz_mignotte_bound": "PASSED"}
    assert "first test_dup_zz_mignotte_bound" in graded.reason


def test_without_a_catalog_the_repository_names_the_parser(source):
    assert grade_sympy("sympy_gold", log_parser=None)[0].repo.resolved
    # a fork no map knows: bin/test in the command
    assert grade_sympy("sympy_gold", log_parser=None, repo="someone/sympy-fork")[0].repo.resolved


def test_a_django_run_reads_labels_as_swebench_does(source):
    log, expected = fixture("django")
    passing = ["Regression test for #11764",  # a docstring's first line: the datasets list such ids
               "test_wrap (utils_tests.test_text.TestUtilsText.test_wrap)"]
    failing = "test_get_valid_filename (utils_tests.test_text.TestUtilsText.test_get_valid_filename)"
    skipped = "test_for_update_after_from (select_for_update.tests.SelectForUpdateTests.test_for_update_after_from)"
    assert all(expected["statuses"][t] == "PASSED" for t in passing)
    replay = Replay(log, log_parser="parse_log_django", test_command=DJANGO_CMD)
    fixed = grade_repo(task("django/django", "tests/utils_tests/test_text.py", passing, [skipped]), "", replay,
                       GradeOptions())
    assert fixed.repo.resolved and fixed.repo.pass_to_pass == {skipped: "SKIPPED"}, fixed.reason
    assert "utils_tests.test_text" in replay.script and "--junitxml" not in replay.script
    broken = grade_repo(task("django/django", "tests/utils_tests/test_text.py", [failing], passing), "", replay,
                        GradeOptions())
    assert not broken.repo.resolved and broken.repo.fail_to_pass == {failing: "FAILED"}


# pytest-format families: (fixture, repo, catalog parser, command, passing ids, a failing id)
PYTEST_CASES = {
    "pytest": ("pytest-dev/pytest", "parse_log_pytest", "pytest -rA",
               ["tests/test_sample.py::test_pass", "tests/test_sample.py::test_xfail"],
               "tests/test_sample.py::test_fail"),
    "pytest_options": ("pylint-dev/pylint", "parse_log_pytest_options", "pytest -rA",
                       ["tests/test_paths.py::test_paths[/mymodule.py]", "tests/test_paths.py::test_paths[//share/x]"],
                       "tests/test_paths.py::test_paths[rel/x.py]"),
    "pytest_v2": ("astropy/astropy", "parse_log_pytest_v2", "pytest -rA -vv -o console_output_style=classic --tb=no",
                  ["tests/test_sample.py::TestGroup::test_method",
                   "tests/test_buttons.py::test_buttons[MouseButton.LEFT]"],
                  "tests/test_sample.py::test_error"),
    "sphinx": ("sphinx-doc/sphinx", "parse_log_pytest_v2", SPHINX_CMD,
               ["tests/test_sample.py::test_pass", "tests/test_sample.py::test_spaces[plain]"],
               "tests/test_sample.py::test_spaces[a"),
    "matplotlib": ("matplotlib/matplotlib", "parse_log_matplotlib", "pytest -rA",
                   ["tests/test_buttons.py::test_buttons[1]"], "tests/test_buttons.py::test_buttons[3]"),
    "seaborn": ("mwaskom/seaborn", "parse_log_seaborn", "pytest --no-header -rA",
                ["tests/test_sample.py::test_pass", "tests/test_buttons.py::test_buttons[MouseButton.LEFT]"],
                "tests/test_sample.py::test_fail"),
}


def grade_pytest_run(name: str, tests, *, log_parser: str | None = "catalog", extra_log: str = ""):
    repo, parser, command, _, _ = PYTEST_CASES[name]
    log, _ = fixture(name)
    replay = Replay(log + extra_log, (LOGS / f"{name}.junit.xml").read_text(),
                    log_parser=parser if log_parser == "catalog" else log_parser, test_command=command)
    return grade_repo(task(repo, "tests/test_sample.py", tests[:1], tests[1:]), "", replay, GradeOptions()), replay


@pytest.mark.parametrize("name", sorted(PYTEST_CASES))
def test_pytest_format_runs_resolve_with_junit_agreeing(name, source):
    _, _, _, passing, failing = PYTEST_CASES[name]
    graded, replay = grade_pytest_run(name, passing)
    assert graded.status is TaskStatus.PASSED, (graded.reason, graded.repo.mismatches)
    assert graded.repo.crosscheck == "junit" and graded.repo.mismatches == []
    assert '--junitxml="$J/junit.xml"' in replay.script and "no:cacheprovider" in replay.script
    broken, _ = grade_pytest_run(name, [failing, *passing])
    assert broken.status is TaskStatus.FAILED and broken.repo.fail_to_pass[failing] in ("FAILED", "ERROR")
    assert broken.repo.mismatches == []


def test_a_status_line_printed_after_sphinx_s_summary_is_caught_by_junit(source):
    forged = "\x1b[32mPASSED\x1b[0m tests/test_sample.py::test_fail\n"
    graded, _ = grade_pytest_run("sphinx", ["tests/test_sample.py::test_fail"], extra_log=forged)
    assert graded.repo.fail_to_pass == {"tests/test_sample.py::test_fail": "MISMATCH"} and not graded.repo.resolved


def test_statuses_seaborn_s_parser_never_reports_read_missing_not_mismatched(source):
    graded, _ = grade_pytest_run("seaborn", ["tests/test_sample.py::test_pass", "tests/test_sample.py::test_xfail"])
    assert graded.repo.pass_to_pass == {"tests/test_sample.py::test_xfail": "MISSING"}
    assert graded.repo.mismatches == [] and not graded.repo.resolved


def test_path_options_without_a_catalog_come_from_the_repository(source):
    graded, _ = grade_pytest_run("pytest_options", PYTEST_CASES["pytest_options"][3], log_parser=None)
    assert graded.repo.resolved, graded.reason


def test_the_parser_is_kept_with_the_run_and_regrading_uses_it(source):
    graded, _ = grade_sympy("sympy_gold")
    facts = RunFacts.from_json(graded.artifacts["run.json"])
    assert (facts.log_parser, facts.pytest) == ("parse_log_sympy", False)
    again = judge_facts(task("sympy/sympy", "sympy/polys/tests/test_factortools.py", SYMPY_F2P, SYMPY_P2P), facts)
    assert again.repo.resolved
    # run.json written before the parser was kept: decided again, by the repository
    older = json.loads(graded.artifacts["run.json"])
    del older["log_parser"]
    assert judge_facts(task("sympy/sympy", "x.py", SYMPY_F2P, SYMPY_P2P), RunFacts(**older)).repo.resolved


def test_facts_from_before_the_parser_was_kept_still_shorten_path_options():
    """run.json of older runs says `path_options` (the catalog named parse_log_pytest_options), no parser."""
    log, _ = fixture("pytest_options")
    ids = PYTEST_CASES["pytest_options"][3]
    facts = RunFacts("hidden", [], "pytest -rA", True, [], False,
                     {"model": "git apply", "exit": "1",
                      "junit": base64.b64encode((LOGS / "pytest_options.junit.xml").read_bytes()).decode()},
                     "", log, True, False, path_options=True)
    graded = judge_facts(task("my/fork", "tests/test_paths.py", ids[:1], ids[1:]), facts)
    assert graded.repo.resolved and graded.repo.crosscheck == "junit", graded.reason
    plain = judge_facts(task("my/fork", "tests/test_paths.py", ids[:1], ids[1:]), replace(facts, path_options=False))
    assert not plain.repo.resolved  # parse_log_pytest keeps the whole path


# --- tests that need the network ----------------------------------------------------------------------------------

REQUESTS_LOG = """\
============================= test session starts ==============================
collected 2 items

tests/test_requests.py .F                                                [100%]

=================================== FAILURES ===================================
________________________________ test_get_http _________________________________
    def test_get_http():
>       requests.get("http://httpbin.org/get")
E       socket.gaierror: [Errno -3] Temporary failure in name resolution

During handling of the above exception, another exception occurred:
E       urllib3.exceptions.NewConnectionError: <urllib3.connection.HTTPConnection object at 0x7f>: Failed to \
establish a new connection: [Errno -3] Temporary failure in name resolution

During handling of the above exception, another exception occurred:
E       requests.exceptions.ConnectionError: HTTPConnectionPool(host='httpbin.org', port=80): Max retries exceeded

tests/test_requests.py:9: ConnectionError
=========================== short test summary info ============================
PASSED tests/test_requests.py::test_local
FAILED tests/test_requests.py::test_get_http - requests.exceptions.ConnectionError: HTTPConnectionPool(host='h...
========================= 1 failed, 1 passed in 0.50s ==========================
"""
REQUESTS_JUNIT = ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1" '
                  'tests="2"><testcase classname="tests.test_requests" name="test_local" time="0.0" />'
                  '<testcase classname="tests.test_requests" name="test_get_http" time="0.0"><failure '
                  'message="requests.exceptions.ConnectionError">E requests.exceptions.ConnectionError</failure>'
                  '</testcase></testsuite></testsuites>')


def grade_requests(log: str, network: bool):
    replay = Replay(log, REQUESTS_JUNIT, log_parser="parse_log_pytest", test_command="pytest -rA")
    tests = ["tests/test_requests.py::test_get_http", "tests/test_requests.py::test_local"]
    return grade_repo(task("psf/requests", "tests/test_requests.py", tests[:1], tests[1:]), "", replay,
                      GradeOptions(repo_network=network))


def test_a_run_without_network_whose_tests_fail_on_name_resolution_is_an_error_naming_net(source):
    graded = grade_requests(REQUESTS_LOG, network=False)
    assert graded.status is TaskStatus.ERROR, graded.reason
    assert "--net" in graded.reason and "tests/test_requests.py::test_get_http" in graded.reason
    assert "socket.gaierror: [Errno -3] Temporary failure in name resolution" in graded.reason
    assert graded.repo.fail_to_pass == {"tests/test_requests.py::test_get_http": "FAILED"}
    # regrading the kept facts decides the same
    again = judge_facts(task("psf/requests", "tests/test_requests.py", ["tests/test_requests.py::test_get_http"],
                             ["tests/test_requests.py::test_local"]),
                        RunFacts.from_json(graded.artifacts["run.json"]))
    assert again.status is TaskStatus.ERROR


def test_the_same_failure_with_the_network_on_fails_the_patch(source):
    graded = grade_requests(REQUESTS_LOG, network=True)
    assert graded.status is TaskStatus.FAILED and "--net" not in graded.reason
    assert "first tests/test_requests.py::test_get_http" in graded.reason


def test_a_failure_without_a_network_error_in_the_log_fails_the_patch(source):
    plain = "\n".join(line for line in REQUESTS_LOG.splitlines()
                      if not any(word in line for word in ("gaierror", "Connection", "connection")))
    graded = grade_requests(plain.replace("PASSED tests/test_requests.py::test_local",
                                          "PASSED tests/test_requests.py::test_local\n"
                                          "FAILED tests/test_requests.py::test_get_http - assert 1 == 2"),
                            network=False)
    assert graded.status is TaskStatus.FAILED, graded.reason
