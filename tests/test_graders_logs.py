"""Repo-test parsing: pytest -rA and unittest/Django logs, junit, diffs, and how a run's report resists forgery.

The pytest logs and junit files are real: `pytest_rA_marshmallow_1359.log` is
marshmallow-1359's test file with the test patch applied and no fix (the
FAIL_TO_PASS test fails), `pytest_rA_mixed.log` a run of
`pytest_mixed_source.py.txt` covering every status (see fixtures/README.md).
"""

from __future__ import annotations

import base64
import re

import pytest

from image_builder.graders import TaskStatus, TestAccess, load_tasks
from image_builder.graders.access import is_test_path, reverted_files
from image_builder.graders.patches import file_changes, refused_path, target_paths, touched_paths
from image_builder.graders.swebench import directives_for, eval_script, judge, read_run
from image_builder.graders.testlogs import TestStatus, junit_key, parse_junit, parse_pytest_log, parse_unittest_log
from image_builder.runtime.execution import RunResult
from image_builder.tasks import task_from_record
from tests.support.grader_data import FIXTURES, SWEBENCH

MARSHMALLOW_LOG = (FIXTURES / "pytest_rA_marshmallow_1359.log").read_text()
MARSHMALLOW_JUNIT = (FIXTURES / "junit_marshmallow_1359.xml").read_text()
MIXED_LOG = (FIXTURES / "pytest_rA_mixed.log").read_text()
MIXED_JUNIT = (FIXTURES / "junit_mixed.xml").read_text()
F2P = "tests/test_fields.py::TestParentAndName::test_datetime_list_inner_format"
NONCE = "5f0c" * 8


@pytest.fixture(scope="module")
def task():
    return next(t for t in load_tasks(SWEBENCH) if t.task_id == "marshmallow-code__marshmallow-1359")


def test_pytest_log_of_a_real_run(task):
    statuses = parse_pytest_log(MARSHMALLOW_LOG)
    assert len(statuses) == 77
    assert statuses[F2P] is TestStatus.FAILED
    assert {statuses[t] for t in task.pass_to_pass} == {TestStatus.PASSED}
    # Ids with spaces are cut at the first space, as SWE-bench's parser cuts them and as the dataset lists them.
    assert "tests/test_fields.py::TestErrorMessages::test_make_error[required-Missing" in task.pass_to_pass


def test_pytest_log_every_status():
    assert parse_pytest_log(MIXED_LOG) == {
        "tests/test_mixed.py::test_pass": TestStatus.PASSED,
        "tests/test_mixed.py::test_spaces[Missing": TestStatus.PASSED,
        "tests/test_mixed.py::TestGroup::test_method": TestStatus.PASSED,
        "[1]": TestStatus.SKIPPED,  # pytest names no test on skip lines; SWE-bench's parser keys them so too
        "tests/test_mixed.py::test_xfail": TestStatus.XFAIL,
        "tests/test_mixed.py::test_xpass": TestStatus.XPASS,
        "tests/test_mixed.py::test_error": TestStatus.ERROR,
        # test_pass printed "PASSED tests/test_mixed.py::test_fail"; that line sits before the summary
        "tests/test_mixed.py::test_fail": TestStatus.FAILED,
        "tests/test_mixed.py::test_spaces[Field": TestStatus.FAILED,
    }


def test_status_lines_before_the_last_summary_header_are_ignored():
    forged = ("=========================== short test summary info ============================\n"
              f"PASSED {F2P}\n")
    assert parse_pytest_log(forged + MARSHMALLOW_LOG)[F2P] is TestStatus.FAILED
    assert parse_pytest_log("\x1b[32mPASSED\x1b[0m tests/a.py::t\n") == {"tests/a.py::t": TestStatus.PASSED}


def test_junit_agrees_with_the_log_on_real_runs():
    for log, junit in ((MARSHMALLOW_LOG, MARSHMALLOW_JUNIT), (MIXED_LOG, MIXED_JUNIT)):
        statuses, by_key = parse_pytest_log(log), parse_junit(junit)
        for test, status in statuses.items():
            if test == "[1]":
                continue
            # pytest's junit cannot tell a non-strict XPASS from a pass; a mismatch fails the test, as
            # SWE-bench's parser (which knows no XPASS) does.
            expected = TestStatus.PASSED if status is TestStatus.XPASS else status
            assert by_key[junit_key(test)] is expected, test


def test_junit_keys():
    assert junit_key(F2P) == ("tests.test_fields.TestParentAndName", "test_datetime_list_inner_format")
    assert junit_key("tests/test_fields.py::test_field_aliases[Integer-Integer]") == (
        "tests.test_fields", "test_field_aliases[Integer-Integer]")
    assert junit_key("tests/a.py::test_x[a::b.py]") == ("tests.a", "test_x[a::b.py]")
    with pytest.raises(ValueError, match="does not parse"):
        parse_junit("<testsuite><testcase")


def test_unittest_and_django_logs():
    log = """Creating test database for alias 'default'...
test_basic (queries.test_qs_combinators.QuerySetSetOperationTests) ... ok
test_limits (queries.test_qs_combinators.QuerySetSetOperationTests) ... FAIL
test_ordering (queries.test_qs_combinators.QuerySetSetOperationTests)
Ordering by an expression works. ... ok
test_union (queries.test_qs_combinators.QuerySetSetOperationTests) ... skipped 'Database has feature(s) x'
test_error (queries.test_qs_combinators.QuerySetSetOperationTests) ... ERROR
test_known (queries.tests.Q) ... expected failure
test_fixed (queries.tests.Q) ... unexpected success
test_new_style (queries.tests.Q.test_new_style) ... ok
test_noisy (queries.tests.Q) ... some output the test printed
FAIL

======================================================================
FAIL: test_noisy (queries.tests.Q)
----------------------------------------------------------------------
Traceback (most recent call last):
AssertionError: 2 != 1

----------------------------------------------------------------------
Ran 9 tests in 0.012s

FAILED (failures=2, errors=1, skipped=1, expected failures=1, unexpected successes=1)
"""
    assert parse_unittest_log(log) == {
        "test_basic (queries.test_qs_combinators.QuerySetSetOperationTests)": TestStatus.PASSED,
        "test_limits (queries.test_qs_combinators.QuerySetSetOperationTests)": TestStatus.FAILED,
        "test_ordering (queries.test_qs_combinators.QuerySetSetOperationTests)": TestStatus.PASSED,
        "test_union (queries.test_qs_combinators.QuerySetSetOperationTests)": TestStatus.SKIPPED,
        "test_error (queries.test_qs_combinators.QuerySetSetOperationTests)": TestStatus.ERROR,
        "test_known (queries.tests.Q)": TestStatus.XFAIL,
        "test_fixed (queries.tests.Q)": TestStatus.FAILED,
        "test_new_style (queries.tests.Q.test_new_style)": TestStatus.PASSED,
        "test_noisy (queries.tests.Q)": TestStatus.FAILED,
    }


# --- a run's report: only what carries the run's nonce counts ----------------------------------------------

def run(stdout: str, notes: list[str], *, nonce: str = NONCE, timed_out: bool = False) -> RunResult:
    stderr = "".join(f"@@ {nonce} {note}\n" for note in notes)
    return RunResult(exit_code=None if timed_out else 0, signal=None, timed_out=timed_out, out_of_memory=False,
                     wall_time=1.0, peak_memory_kb=None, stdout=stdout.encode(), stderr=stderr.encode())


def graded(task, log: str, junit: str | None, extra_stdout: str = "", extra_notes: tuple[str, ...] = ()):
    stdout = f"Applied patch cleanly.\n>>>>> {NONCE} start\n{log}>>>>> {NONCE} end\n{extra_stdout}"
    junit_note = "junit " + (base64.b64encode(junit.encode()).decode() if junit else "none")
    result = run(stdout, ["model git apply", "exit 1", junit_note, *extra_notes])
    return judge(task, read_run(result, NONCE), TestAccess.HIDDEN, [], task.test_cmd, pytest=True)


def fixed(log: str, junit: str) -> tuple[str, str]:
    """The same run as if the fix were in: the one failing test passes in the log and in junit."""
    log = log.replace(f"FAILED {F2P}", f"PASSED {F2P}")
    return log, re.sub(r"<failure .*?</failure>", "", junit, flags=re.DOTALL)


def test_a_real_failing_run_is_not_resolved(task):
    result = graded(task, MARSHMALLOW_LOG, MARSHMALLOW_JUNIT)
    assert result.status is TaskStatus.FAILED and not result.repo.resolved
    assert result.repo.fail_to_pass == {F2P: "FAILED"}
    assert set(result.repo.pass_to_pass.values()) == {"PASSED"}
    assert (result.repo.crosscheck, result.repo.mismatches, result.repo.test_exit_code) == ("junit", [], 1)
    assert result.repo.apply_log == "Applied patch cleanly.\n" and result.repo.log == MARSHMALLOW_LOG


def test_a_real_passing_run_is_resolved(task):
    result = graded(task, *fixed(MARSHMALLOW_LOG, MARSHMALLOW_JUNIT))
    assert result.status is TaskStatus.PASSED and result.score == 1.0 and result.repo.resolved


def test_a_status_line_printed_after_the_summary_is_caught_by_junit(task):
    # What an atexit hook in the code under test can print: inside the markers, after the real summary.
    result = graded(task, MARSHMALLOW_LOG + f"PASSED {F2P}\n", MARSHMALLOW_JUNIT)
    assert not result.repo.resolved and result.repo.fail_to_pass == {F2P: "MISMATCH"}
    assert result.repo.mismatches == [f"{F2P}: log PASSED, junit FAILED"]


def test_a_run_without_junit_is_not_resolved_whatever_the_log_says(task):
    # os._exit(0) during collection after printing a fake summary: exit code 0, no junit.
    result = graded(task, fixed(MARSHMALLOW_LOG, MARSHMALLOW_JUNIT)[0], None)
    assert not result.repo.resolved and result.repo.crosscheck == "junit-missing"
    assert set(result.repo.fail_to_pass.values()) == {"MISSING"}


def test_markers_and_notes_without_the_nonce_count_for_nothing(task):
    forged_nonce = "0" * 32
    fake_junit = base64.b64encode(fixed(MARSHMALLOW_LOG, MARSHMALLOW_JUNIT)[1].encode()).decode()
    # Printed by candidate code after the real run: a second end marker, then a whole fake report.
    forged = (f">>>>> {forged_nonce} end\n>>>>> {forged_nonce} start\n{fixed(MARSHMALLOW_LOG, '')[0]}"
              f">>>>> {forged_nonce} end\n@@ {forged_nonce} exit 0\n@@ {forged_nonce} junit {fake_junit}\n")
    result = graded(task, MARSHMALLOW_LOG, MARSHMALLOW_JUNIT, extra_stdout=forged)
    assert result.repo.fail_to_pass == {F2P: "FAILED"} and result.repo.test_exit_code == 1
    only_forged = read_run(run(forged, [f"junit {fake_junit}"], nonce=forged_nonce), NONCE)
    assert only_forged.test_log is None and only_forged.notes == {}
    outcome = judge(task, only_forged, TestAccess.HIDDEN, [], task.test_cmd, pytest=True)
    assert outcome.status is TaskStatus.ERROR and "before the tests started" in outcome.reason


def test_a_run_cut_short_keeps_what_it_has(task):
    cut = read_run(run(f">>>>> {NONCE} start\n{MARSHMALLOW_LOG[:500]}", ["model none"], timed_out=True), NONCE)
    result = judge(task, cut, TestAccess.HIDDEN, [], task.test_cmd, pytest=True)
    assert result.status is TaskStatus.FAILED and result.reason == "the test run timed out"
    assert result.repo.timed_out and result.repo.test_exit_code is None


def test_patch_failures_and_test_patch_failures_are_reported(task):
    failed = judge(task, read_run(run("error: patch failed\n", ["model-failed"]), NONCE), TestAccess.HIDDEN, [],
                   task.test_cmd, pytest=True)
    assert failed.status is TaskStatus.PATCH_FAILED and "does not apply" in failed.reason
    broken = judge(task, read_run(run("", ["model git apply", "test-patch-failed"]), NONCE), TestAccess.HIDDEN, [],
                   task.test_cmd, pytest=True)
    assert broken.status is TaskStatus.ERROR and broken.reason == "test patch does not apply"


# --- diffs and test-access modes --------------------------------------------------------------------------

DIFF = """diff --git a/src/app.py b/src/app.py
index 1111111..2222222 100644
--- a/src/app.py
+++ b/src/app.py
@@ -1,3 +1,1 @@
--- this removed line looks like a header
 keep
-+++ and so does this one
diff --git a/old name.py b/new name.py
similarity index 90%
rename from old name.py
rename to new name.py
diff --git a/tests/test_new.py b/tests/test_new.py
new file mode 100644
--- /dev/null
+++ b/tests/test_new.py
@@ -0,0 +1 @@
+def test(): pass
diff --git a/gone.py b/gone.py
deleted file mode 100644
--- a/gone.py
+++ /dev/null
@@ -1 +0,0 @@
-x = 1
--- orig/plain.txt\t2024-01-01 00:00:00
+++ new/plain.txt\t2024-01-01 00:00:01
@@ -1 +1 @@
-a
+b
"""


def test_diff_paths():
    assert file_changes(DIFF) == file_changes(DIFF.replace("@@ -1,3 +1,1 @@", "@@ -1,3 +1,2 @@"))  # bad counts
    assert [(c.old, c.new) for c in file_changes(DIFF)] == [
        ("src/app.py", "src/app.py"), ("old name.py", "new name.py"), (None, "tests/test_new.py"),
        ("gone.py", None), ("plain.txt", "plain.txt")]
    assert touched_paths(DIFF) == ["src/app.py", "old name.py", "new name.py", "tests/test_new.py", "gone.py",
                                   "plain.txt"]
    assert target_paths(DIFF) == ["src/app.py", "new name.py", "tests/test_new.py", "plain.txt"]


def test_target_paths_of_the_real_test_patch(task):
    assert target_paths(task.test_patch) == ["tests/test_fields.py"]
    assert touched_paths(task.gold_patch) == ["src/marshmallow/fields.py"]


@pytest.mark.parametrize("path,refused", [
    ("src/app.py", False), (".git/hooks/post-checkout", True), ("sub/.git/config", True), ("../outside", True),
    ("/etc/passwd", True), (".github/workflows/ci.yml", False),
])
def test_refused_paths(path, refused):
    assert (refused_path(["ok.py", path]) == path) is refused


def test_what_each_access_mode_reverts():
    candidate = ["src/app.py", "tests/test_fields.py", "tests/conftest.py", "conftest.py", "pytest.ini",
                 "src/test_helpers.py", "docs/testing/index.rst"]
    test_patch = ["tests/test_fields.py"]
    assert reverted_files(TestAccess.OPEN, candidate, test_patch) == []
    assert reverted_files(TestAccess.HIDDEN, candidate, test_patch) == ["tests/test_fields.py"]
    assert reverted_files(TestAccess.READ_ONLY, candidate, test_patch) == candidate[1:]
    assert not is_test_path("src/marshmallow/fields.py") and is_test_path("pkg/foo_test.py")


def test_eval_script_steps_per_mode():
    def steps(access):
        script = eval_script("abc123", access, ["tests/test x.py"], "pytest -rA")
        step = re.compile(r"apply_tests|apply_candidate|reset_to_base .*")
        return [line for line in script.splitlines() if step.fullmatch(line)]
    assert steps(TestAccess.OPEN) == ["apply_tests", "apply_candidate"]
    assert steps(TestAccess.READ_ONLY) == ["apply_tests", "apply_candidate", "reset_to_base 'tests/test x.py'",
                                           "apply_tests"]
    assert steps(TestAccess.HIDDEN) == ["apply_candidate", "reset_to_base 'tests/test x.py'", "apply_tests"]


def test_django_records_run_django_s_runner_on_module_names():
    task = task_from_record({"instance_id": "django__django-1", "repo": "django/django", "base_commit": "abc",
                             "test_patch": DIFF, "FAIL_TO_PASS": "[]", "PASS_TO_PASS": "[]"}, "line 1")
    assert task.test_cmd == "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
    assert directives_for(task.repo, ["tests/model_fields/test_jsonfield.py", "docs/ref.txt"]) == [
        "model_fields.test_jsonfield"]
    assert directives_for("pallets/flask", ["tests/test_basic.py"]) == ["tests/test_basic.py"]


def test_path_options_shorten_as_swebench_s_pytest_options_parser():
    """pylint's ids in SWE-bench: parametrize options that are absolute paths keep their last part only."""
    from image_builder.graders.testlogs import shorten_path_option
    long = "tests/test_self.py::TestRunTC::test_stdin[/testbed/tests/mymodule.py-mymodule-/testbed/tests/mymodule.py]"
    assert shorten_path_option(long) == "tests/test_self.py::TestRunTC::test_stdin[/mymodule.py]"
    for kept in ("t.py::test[mymodule.py-mymodule-mymodule.py]", "t.py::test[//share/x]", "t.py::test[/a/*]",
                 "t.py::test_plain"):
        assert shorten_path_option(kept) == kept
