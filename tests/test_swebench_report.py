"""SWE-bench's report files from our results: per instance as its get_eval_report returns, and the run's as its
make_run_report writes.

The results are graded as `grade` grades them (grade_prediction) from replayed real sympy runs
(tests/fixtures/swebench_logs: sympy_gold.log, the fixed code; sympy.log, the broken one); SWE-bench 4.1's own
get_eval_report reads the same logs for the comparison.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from image_builder.graders.grade import TaskIndex, grade_prediction
from image_builder.graders.grading import discard_results
from image_builder.graders.options import GradeOptions
from image_builder.graders.predictions import Prediction
from image_builder.graders.results import GradeResult, TaskStatus, write_jsonl
from image_builder.graders.swebench import GRADER_DIR
from image_builder.graders.swebench_report import (report_dir, run_report_path, swebench_reports,
                                                   write_swebench_reports)
from image_builder.runtime.execution import RunResult
from image_builder.tasks import RepoTask
from tests.conftest import run_cli
from tests.test_swebench_parsers import SYMPY_CMD, SYMPY_F2P, SYMPY_P2P, Replay, diff_of, fixture

# In the unresolved task's P2P beside the fixture's passing ones: an ERROR in sympy.log, and a test the log
# does not name (MISSING).
ERRORED, ABSENT = "test_dup_zz_cyclotomic_poly", "test_not_in_the_log"
PATCH = diff_of("sympy/polys/factortools.py")


def sympy_task(number: int, extra_p2p: tuple[str, ...] = ()) -> RepoTask:
    return RepoTask(f"sympy__sympy-{number}", "sympy/sympy", "0" * 40, "",
                    diff_of("sympy/polys/tests/test_factortools.py"), SYMPY_F2P, (*SYMPY_P2P, *extra_p2p),
                    f"sympy__sympy-{number}", "1.7")


class PatchRefused(Replay):
    """A run whose candidate patch does not apply: the eval script's note, no test output."""

    def run(self, request) -> RunResult:
        nonce = request.files[f"{GRADER_DIR}/nonce"].decode()
        return RunResult(exit_code=0, signal=None, timed_out=False, out_of_memory=False, wall_time=1.0,
                         peak_memory_kb=None, stdout=b"error: patch failed\n",
                         stderr=f"@@ {nonce} model-failed\n@@ {nonce} exit 0\n".encode())


def replay(log: str) -> Replay:
    return Replay(log, log_parser="parse_log_sympy", test_command=SYMPY_CMD)


def graded(task: RepoTask, patch: str, replay: Replay) -> GradeResult:
    return grade_prediction(Prediction(task.task_id, patch), TaskIndex([task]), lambda t: replay, GradeOptions())


@pytest.fixture(scope="module")
def run():
    """resolved (1), unresolved (2), empty patch (3), patch does not apply (4), an id no task has, and a task
    without a prediction (6)."""
    gold, broken = fixture("sympy_gold")[0], fixture("sympy")[0]
    tasks = {n: sympy_task(n, (ERRORED, ABSENT) if n == 2 else ()) for n in (1, 2, 3, 4, 6)}
    results = [graded(tasks[1], PATCH, replay(gold)),
               graded(tasks[2], PATCH, replay(broken)),
               graded(tasks[3], "", replay(broken)),
               graded(tasks[4], PATCH, PatchRefused("")),
               grade_prediction(Prediction("sympy__sympy-5", PATCH), TaskIndex(tasks.values()), lambda t: None)]
    return SimpleNamespace(tasks=tasks, results=results, logs={1: gold, 2: broken})


def test_the_results_are_what_each_case_needs(run):
    assert [r.status for r in run.results] == [TaskStatus.PASSED, TaskStatus.FAILED, TaskStatus.FAILED,
                                               TaskStatus.PATCH_FAILED, TaskStatus.UNKNOWN_TASK]
    unresolved = run.results[1].repo.pass_to_pass
    assert (unresolved[ERRORED], unresolved[ABSENT]) == ("ERROR", "MISSING")


def swebench_eval_report(task: RepoTask, patch: str, log: str, tmp_path) -> dict:
    """SWE-bench's own get_eval_report on the run's log, as its harness writes it (between its markers)."""
    from image_builder.build.swebench_catalog import load_swebench
    try:
        load_swebench()
        from swebench.harness import grading
    except Exception as exc:  # noqa: BLE001 - any other swebench layout: the shape tests below still run
        pytest.skip(f"swebench's harness cannot be loaded: {exc}")
    path = tmp_path / f"{task.task_id}.log"
    path.write_text(f"{grading.START_TEST_OUTPUT}\n{log}\n{grading.END_TEST_OUTPUT}\n")
    spec = SimpleNamespace(instance_id=task.task_id, repo=task.repo, version=task.version,
                           FAIL_TO_PASS=list(task.fail_to_pass), PASS_TO_PASS=list(task.pass_to_pass))
    return grading.get_eval_report(spec, {"instance_id": task.task_id, "model_patch": patch}, str(path), True)


@pytest.mark.parametrize("number", [1, 2])
def test_an_instance_report_is_swebench_s_for_the_same_log(run, number, tmp_path):
    ours = swebench_reports(run.results).instances[f"sympy__sympy-{number}"]
    assert ours == swebench_eval_report(run.tasks[number], PATCH, run.logs[number], tmp_path)


def test_the_instance_reports_say_resolved_and_which_tests_failed(run):
    instances = swebench_reports(run.results).instances
    assert sorted(instances) == ["sympy__sympy-1", "sympy__sympy-2"]  # SWE-bench writes none for empty or error
    resolved, unresolved = instances["sympy__sympy-1"]["sympy__sympy-1"], instances["sympy__sympy-2"]["sympy__sympy-2"]
    assert resolved["resolved"] and not unresolved["resolved"]
    assert set(resolved) == {"patch_is_None", "patch_exists", "patch_successfully_applied", "resolved",
                             "tests_status"}
    assert set(resolved["tests_status"]) == {"FAIL_TO_PASS", "PASS_TO_PASS", "FAIL_TO_FAIL", "PASS_TO_FAIL"}
    assert unresolved["tests_status"]["FAIL_TO_PASS"] == {"success": ["test_dmp_zz_mignotte_bound"],
                                                          "failure": ["test_dup_zz_mignotte_bound"]}
    assert unresolved["tests_status"]["PASS_TO_PASS"]["failure"] == [ERRORED, ABSENT]
    assert resolved["tests_status"]["PASS_TO_PASS"] == {"success": list(SYMPY_P2P), "failure": []}


def test_the_run_report_counts_as_make_run_report(run):
    report = swebench_reports(run.results, [t.task_id for t in run.tasks.values()]).run
    assert asdict(report) == {
        "total_instances": 5, "submitted_instances": 5, "completed_instances": 2, "resolved_instances": 1,
        "unresolved_instances": 1, "empty_patch_instances": 1, "error_instances": 1,
        "completed_ids": ["sympy__sympy-1", "sympy__sympy-2"], "incomplete_ids": ["sympy__sympy-6"],
        "empty_patch_ids": ["sympy__sympy-3"],
        "submitted_ids": [f"sympy__sympy-{n}" for n in range(1, 6)],
        "resolved_ids": ["sympy__sympy-1"], "unresolved_ids": ["sympy__sympy-2"], "error_ids": ["sympy__sympy-4"],
        "schema_version": 2}
    # without the tasks: the instances graded are the dataset
    alone = swebench_reports(run.results).run
    assert (alone.total_instances, alone.incomplete_ids) == (4, [])


def test_a_timed_out_run_is_an_error_as_in_swebench_s_harness(run):
    timed_out = GradeResult.from_dict(run.results[1].to_dict())
    timed_out.repo.timed_out = True
    report = swebench_reports([timed_out]).run
    assert (report.error_ids, report.completed_ids) == (["sympy__sympy-2"], [])


def test_results_of_other_kinds_give_no_swebench_report(tmp_path):
    assert write_swebench_reports([GradeResult("t", "assert", TaskStatus.PASSED)], tmp_path / "r.jsonl") is None
    assert list(tmp_path.iterdir()) == []


def test_the_cli_writes_the_reports_from_a_results_file(run, tmp_path):
    results = write_jsonl(run.results, tmp_path / "results.jsonl")
    stale = report_dir(results) / "sympy__sympy-9"  # an earlier run's instance: gone once the reports are rewritten
    stale.mkdir(parents=True)
    done = run_cli("results", "swebench", str(results))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in report_dir(results).iterdir()) == ["sympy__sympy-1", "sympy__sympy-2"]
    for number in (1, 2):
        written = json.loads((report_dir(results) / f"sympy__sympy-{number}" / "report.json").read_text())
        assert written == swebench_reports(run.results).instances[f"sympy__sympy-{number}"]
    run_report = json.loads(run_report_path(results).read_text())
    assert (run_report["resolved_ids"], run_report["error_ids"]) == (["sympy__sympy-1"], ["sympy__sympy-4"])
    assert str(run_report_path(results)) in done.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    discard_results(results)  # grade --overwrite: the reports go with the results
    assert list(tmp_path.iterdir()) == []
