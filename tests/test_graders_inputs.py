"""Reading tasks and predictions, bad input of every kind, result records, and the verl reward function."""

from __future__ import annotations

import json

import pytest

from image_builder.errors import ImageBuilderError

from image_builder.graders import (AssertTask, BadTask, GradeResult, Prediction, RepoTask, StdioTask, TaskStatus,
                                   extract_code, grade, grade_predictions, load_predictions, load_tasks,
                                   parse_ground_truth, rewards, summarize, write_jsonl)
from image_builder.graders.errors import GraderError
from image_builder.graders.predictions import NO_CODE
from image_builder.tasks import DatasetError, task_from_record
from tests.support.grader_data import MBPP_IMPOSSIBLE, MBPP_TASKS, SWEBENCH, mbpp_solutions
from tests.support.host_executor import HostExecutor

RADIX_CASE = "assert radix_sort([3, 1, 2]) == [1, 2, 3]"
RADIX = "def radix_sort(nums):\n    return sorted(nums)\n"


@pytest.fixture(scope="module")
def host():
    return HostExecutor()


def test_verl_parquet():
    tasks = load_tasks(MBPP_TASKS)
    assert len(tasks) == 40 and all(isinstance(t, AssertTask) for t in tasks)
    first = tasks[0]
    assert (first.task_id, first.original_id, first.data_source, len(first.cases)) == ("512", "512", "mbpp", 3)
    assert first.cases[0].startswith("assert count_element_freq(")


def test_impossible_jsonl_gives_each_variant_its_own_id():
    tasks = load_tasks(MBPP_IMPOSSIBLE)
    assert len(tasks) == 78 and tasks[0].task_id == "515__oneoff" and tasks[1].task_id == "515__conflicting"
    assert {t.impossible_type for t in tasks} == {"oneoff", "conflicting"}
    assert tasks[1].original_id == "515"


def test_swebench_jsonl():
    tasks = {t.task_id: t for t in load_tasks(SWEBENCH)}
    assert len(tasks) == 4 and all(isinstance(t, RepoTask) for t in tasks.values())
    oneoff = tasks["marshmallow-code__marshmallow-1359__oneoff"]
    assert oneoff.original_id == "marshmallow-code__marshmallow-1359" and oneoff.impossible_type == "oneoff"
    assert oneoff.fail_to_pass == ("tests/test_fields.py::TestParentAndName::test_datetime_list_inner_format",)
    assert len(oneoff.pass_to_pass) == 76 and oneoff.original_test_patch != oneoff.test_patch
    assert tasks["marshmallow-code__marshmallow-1343"].version == "2.20"


def test_stdio_ground_truth():
    task = parse_ground_truth("7", '{"inputs": ["1\\n"], "outputs": ["2\\n"]}', data_source="codecontests")
    assert task == StdioTask("7", ("1\n",), ("2\n",), "7", data_source="codecontests")
    call = parse_ground_truth("8", {"inputs": [[1]], "outputs": [[2]], "fn_name": "f"})
    assert isinstance(call, StdioTask) and call.fn_name == "f"


@pytest.mark.parametrize("ground_truth,reason", [
    ("{not json", "ground truth is not JSON"),
    ("[1, 2]", "ground truth is a list, not an object"),
    ({"assert_case": []}, "assert_case must be a non-empty list of strings"),
    ({"assert_case": "assert f() == 1"}, "assert_case must be a non-empty list of strings"),
    ({"assert_case": ["assert f() == 1", 3]}, "assert_case must be a non-empty list of strings"),
    ({"inputs": ["1"], "outputs": []}, "inputs and outputs must be non-empty lists of the same length"),
    ({"inputs": [1], "outputs": [2]}, "stdin/stdout inputs and outputs must be strings"),
    ({"inputs": [[1]], "outputs": [2], "fn_name": 5}, "fn_name must be a string"),
    ({"tests": []}, "ground truth has none of assert_case, inputs/outputs (keys: ['tests'])"),
])
def test_malformed_ground_truth_is_a_bad_task_and_grades_as_such(ground_truth, reason):
    task = parse_ground_truth("9", ground_truth)
    assert isinstance(task, BadTask) and task.reason.startswith(reason)
    result = grade(task, RADIX, executor=None)  # nothing runs
    assert (result.status, result.score, result.reason) == (TaskStatus.BAD_TASK, 0.0, task.reason)


def test_bad_records_in_a_task_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join([
        json.dumps({"task_id": 1, "assert_case": [RADIX_CASE]}),
        "this line is not json",
        json.dumps({"instance_id": "x__y-1", "repo": "x/y", "base_commit": "abc", "test_patch": "d",
                    "FAIL_TO_PASS": "not a list"}),
        json.dumps({"instance_id": "x__y-2", "repo": "x/y"}),
        json.dumps({"data_source": "mbpp", "reward_model": {"style": "rule"}, "extra_info": {"task_id": 4}}),
        "",
    ]))
    tasks = load_tasks(path)
    assert isinstance(tasks[0], AssertTask) and tasks[0].task_id == "1"
    assert [(t.task_id, t.reason.split(":")[0]) for t in tasks[1:]] == [
        ("line 2", "line 2 is not JSON"),
        ("x__y-1", "FAIL_TO_PASS and PASS_TO_PASS must be lists of test ids"),
        ("x__y-2", "SWE-bench record lacks base_commit, test_patch, FAIL_TO_PASS"),
        ("4", "reward_model has no ground_truth")]
    assert task_from_record([1, 2], "row 3") == BadTask("row 3", "record is a list, not an object")


def test_unreadable_task_files_raise_one_line_errors(tmp_path):
    with pytest.raises(DatasetError, match="cannot read"):
        load_tasks(tmp_path / "missing.jsonl")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="not a readable parquet file"):
        load_tasks(tmp_path / "bad.parquet")
    (tmp_path / "dup.jsonl").write_text(json.dumps({"task_id": 1, "assert_case": ["assert 1"]}) + "\n" +
                                        json.dumps({"task_id": 1, "assert_case": ["assert 1"]}) + "\n")
    with pytest.raises(DatasetError, match="task id 1 appears twice"):
        load_tasks(tmp_path / "dup.jsonl")


# --- predictions ------------------------------------------------------------------------------------------

RESPONSE = """Let me think. A first draft:
```python
def radix_sort(nums):
    return nums
```
That is wrong; the final answer:
```python
def radix_sort(nums):
    return sorted(nums)
```
Example use:
```
>>> radix_sort([2, 1])
```
"""


def test_the_last_python_block_is_the_solution():
    assert extract_code(RESPONSE) == RADIX
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"
    assert extract_code("```\nx = 2\n```\ntext") == "x = 2\n"
    assert extract_code("```bash\nls\n```") is None
    assert extract_code("def f(): pass") == "def f(): pass"  # a bare program
    assert extract_code("Use a loop: for each item, add it.") is None


def test_predictions_file(tmp_path):
    path = tmp_path / "predictions.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"task_id": 516, "solution": RADIX},
        {"task_id": 517, "response": RESPONSE},
        {"task_id": 518, "response": "I cannot solve this."},
        {"task_id": 519, "solution": RESPONSE},
        {"instance_id": "a__b-1", "model_patch": "diff --git a/x b/x\n"},
        {"instance_id": "a__b-2", "model_patch": None},
        {"task_id": 520},
    ]) + "\nnot json\n")
    assert load_predictions(path) == [
        Prediction("516", RADIX), Prediction("517", RADIX),
        Prediction("518", None, NO_CODE), Prediction("519", RADIX),
        Prediction("a__b-1", "diff --git a/x b/x\n"), Prediction("a__b-2", ""),
        Prediction("520", None, "no solution, model_patch or response string"),
        Prediction("line 8", None, "line 8 is not JSON: Expecting value: line 1 column 1 (char 0)")]


def test_every_prediction_gets_a_result(host, tmp_path):
    tasks = [AssertTask("516", (RADIX_CASE,), "516"), BadTask("517", "ground truth is not JSON: x")]
    predictions = [Prediction("516", RADIX), Prediction("517", RADIX), Prediction("999", RADIX),
                   Prediction("516", None, NO_CODE)]
    results = grade_predictions(tasks, predictions, lambda task: host)
    assert [(r.task_id, r.status) for r in results] == [
        ("516", TaskStatus.PASSED), ("517", TaskStatus.BAD_TASK), ("999", TaskStatus.UNKNOWN_TASK),
        ("516", TaskStatus.NO_SOLUTION)]
    assert results[2].reason == "no task with id '999'"
    variants = [AssertTask("516__oneoff", (RADIX_CASE,), "516", "oneoff"),
                AssertTask("516__conflicting", (RADIX_CASE,), "516", "conflicting")]
    keyed_by_original = grade_predictions(variants, [Prediction("516", RADIX)], lambda task: host)[0]
    assert keyed_by_original.reason == ("no task with id '516'; the tasks hold its variants '516__conflicting', "
                                        "'516__oneoff': key predictions by those")

    summary = summarize(results)
    assert (summary.total, summary.passed, summary.pass_rate) == (4, 1, 0.25)
    assert summary.by_status == {"passed": 1, "bad_task": 1, "unknown_task": 1, "no_solution": 1}
    assert summary.first_ids == {"bad_task": ["517"], "unknown_task": ["999"], "no_solution": ["516"]}
    lines = write_jsonl(results, tmp_path / "out" / "results.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert (record["status"], record["passed"], record["score"], record["kind"]) == ("passed", True, 1.0, "assert")
    assert record["cases"][0]["status"] == "passed" and record["repo"] is None
    assert json.loads(json.dumps(summary.to_dict())) == summary.to_dict()


def test_an_executor_failure_is_an_error_result():
    class Broken:
        def run(self, request):
            raise OSError("instance is gone")

        def stream(self, request, stdin=None, stdout=1, stderr=2):
            raise OSError("instance is gone")

    result = grade(AssertTask("1", (RADIX_CASE,), "1"), RADIX, Broken())
    assert result.status is TaskStatus.ERROR and result.reason == "grading run failed: instance is gone"


# --- verl reward function ---------------------------------------------------------------------------------

@pytest.fixture
def reward_executor(host):
    rewards.set_executor(host)
    yield host
    rewards.set_executor(None)


def test_compute_score_on_real_mbpp_rows(reward_executor):
    solutions = mbpp_solutions()
    rows = [task for task in load_tasks(MBPP_TASKS)[:3]]
    for task in rows:
        response = f"Reasoning...\n```python\n{solutions[task.task_id]}\n```"
        ground_truth = json.dumps({"assert_case": list(task.cases)})
        assert rewards.compute_score("mbpp", response, ground_truth, {"task_id": int(task.task_id)}) == {
            "score": 1.0, "all_passed": 1.0, "graded": 1.0}
    half = parse_ground_truth("x", {"assert_case": [RADIX_CASE, "assert radix_sort([1]) == [2]"]})
    assert rewards.compute_score("mbpp", f"```python\n{RADIX}```", {"assert_case": list(half.cases)}) == {
        "score": 0.5, "all_passed": 0.0, "graded": 1.0}


NOT_GRADED = {"score": 0.0, "all_passed": 0.0, "graded": 0.0}


def test_compute_score_gives_zero_for_bad_input(reward_executor, caplog):
    assert rewards.compute_score("mbpp", "no code here", json.dumps({"assert_case": [RADIX_CASE]})) == {
        "score": 0.0, "all_passed": 0.0, "graded": 1.0}  # the response's fault: a real zero
    assert rewards.compute_score("mbpp", f"```python\n{RADIX}```", "{broken", {"task_id": 7}) == NOT_GRADED
    assert "task 7 not graded: ground truth is not JSON" in caplog.text


def test_compute_score_grades_a_bare_program(reward_executor):
    assert rewards.compute_score("livecodebench", RADIX, {"assert_case": [RADIX_CASE]}) == {
        "score": 1.0, "all_passed": 1.0, "graded": 1.0}
    prose = "The answer is to sort the list, then return it."
    assert rewards.compute_score("livecodebench", prose, {"assert_case": [RADIX_CASE]})["graded"] == 1.0


FLAG = "```python\nclass Flag:\n    def __bool__(self): return True\ndef flag(): return Flag()\n```"


def test_compute_score_takes_options_from_the_environment_and_the_row(reward_executor, monkeypatch, caplog):
    truth = {"assert_case": ["assert flag()"]}
    assert rewards.compute_score("mbpp", FLAG, truth)["score"] == 1.0  # default mode: the object's own truth
    assert rewards.compute_score("mbpp", FLAG, truth, {"grade_options": {"strict": True}})["score"] == 0.0
    monkeypatch.setenv(rewards.OPTIONS_ENV, '{"strict": true}')
    assert rewards.compute_score("mbpp", FLAG, truth)["score"] == 0.0
    assert rewards.compute_score("mbpp", FLAG, truth, {"grade_options": {"strict": False}})["score"] == 1.0
    assert rewards.compute_score("mbpp", FLAG, truth, {"task_id": 3, "grade_options": {"strickt": 1}}) == NOT_GRADED
    assert "task 3 not graded: extra_info.grade_options: unknown grade option 'strickt'" in caplog.text
    monkeypatch.setenv(rewards.OPTIONS_ENV, '{"case_timeout": -1}')
    assert rewards.compute_score("mbpp", FLAG, truth) == NOT_GRADED
    assert "IMAGE_BUILDER_GRADE_OPTIONS: grade option 'case_timeout' must be a positive float" in caplog.text


def test_compute_score_without_an_executor_says_what_to_set(monkeypatch):
    rewards.set_executor(None)
    monkeypatch.delenv("IMAGE_BUILDER_STORE", raising=False)
    code = f"```python\n{RADIX}```"
    with pytest.raises(GraderError, match="set IMAGE_BUILDER_STORE"):
        rewards.compute_score("mbpp", code, {"assert_case": [RADIX_CASE]})
    monkeypatch.setenv("IMAGE_BUILDER_STORE", "/stores/a")
    monkeypatch.setattr(rewards, "_store_executors", None)
    with pytest.raises(ImageBuilderError, match="/stores/a: not a store"):
        rewards.compute_score("mbpp", code, {"assert_case": [RADIX_CASE]})
    # Malformed ground truth needs no executor at all.
    assert rewards.compute_score("mbpp", code, "{broken") == NOT_GRADED


def test_result_records_are_plain_data():
    result = GradeResult("1", "assert", TaskStatus.FAILED, reason="case 0: assertion failed")
    assert result.to_dict() == {"task_id": "1", "kind": "assert", "status": "failed", "score": 0.0,
                                "reason": "case 0: assertion failed", "cases": [], "repo": None, "compare": "",
                                "mode": "", "evidence": [], "solution_sha256": "", "passed": False}
