"""Stdin/stdout and call-based grading on small made-up problems, the comparison modes, and
fidelity to a host check of 30 CodeContests problems."""

from __future__ import annotations

import base64
import json
import os
import pickle
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from image_builder.graders import BadTask, CaseStatus, GradeOptions, StdioTask, TaskStatus, grade, parse_ground_truth
from image_builder.graders.stdio import compare_output, compare_stdout, default_compare
from image_builder.runtime.execution import RunRequest
from image_builder.tasks import load_tasks, task_from_record
from tests.conftest import ROOT
from tests.support.host_executor import HostExecutor

DATA = ROOT / "index/data"


@pytest.fixture(scope="module", params=["host", "warm"])
def host(request):
    """Each behaviour on the host (tests/support) and in the store's runtime, where every test's run is
    a clone of a warm interpreter (runtime/warm.py)."""
    if request.param == "host":
        yield HostExecutor()
        return
    from image_builder.graders.grading import StoreExecutors
    from image_builder.store.store import Store
    with StoreExecutors(Store.open(request.getfixturevalue("mbpp_store"))) as executors:
        yield executors.for_instance("512")


def test_tests_run_warm_in_the_store(mbpp_store):
    from image_builder.graders.grading import StoreExecutors
    from image_builder.store.store import Store
    with StoreExecutors(Store.open(mbpp_store)) as executors:
        result = grade(SUMS, SUMS_BY_INPUT, executors.for_instance("512"), GradeOptions())
        pools = [p for pools in executors._warm.values() for p in pools.pools.values()]
        assert result.score == 1.0
        assert len(pools) == 1 and not pools[0].failed and len(pools[0]._idle) == 1  # one zygote served both


# Sum of each line's two integers, one answer a line.
SUMS = parse_ground_truth("sums", json.dumps({"inputs": ["2\n1 2\n3 4\n", "1\n-5 5\n"], "outputs": ["3\n7\n", "0\n"]}))
SUMS_BY_INPUT = "n = int(input())\nfor _ in range(n):\n    a, b = map(int, input().split())\n    print(a + b)\n"


def test_a_correct_solution_passes_every_test(host):
    result = grade(SUMS, SUMS_BY_INPUT, host)
    assert (result.status, result.score, result.kind) == (TaskStatus.PASSED, 1.0, "stdio")


def test_stdin_is_a_regular_file_for_solutions_that_size_it(host):
    # Judges give stdin as a file, and real solutions read exactly st_size bytes from fd 0.
    sized = ("import os\n"
             "data = os.read(0, os.fstat(0).st_size).split()\n"
             "n = int(data[0])\n"
             "print('\\n'.join(str(int(data[1 + 2 * i]) + int(data[2 + 2 * i])) for i in range(n)))\n")
    assert grade(SUMS, sized, host).score == 1.0


def test_whitespace_and_decimal_formatting_are_forgiven(host):
    halves = parse_ground_truth("halves", {"inputs": ["1\n"], "outputs": ["0.5\n"]})
    assert grade(halves, "print('  0.500  ')\nprint()\n", host).score == 1.0
    assert grade(halves, "print('1/2')\n", host).score == 0.0


def test_wrong_answer_and_line_count_are_failures_with_reasons(host):
    wrong = grade(SUMS, "n = int(input())\nfor _ in range(n):\n    print(0)\n", host)
    assert [c.status for c in wrong.cases] == [CaseStatus.FAILED, CaseStatus.PASSED]
    assert wrong.cases[0].reason == "line 1: expected '3', got '0'"
    assert wrong.score == 0.5 and wrong.compare == "livecodebench" and wrong.reason.startswith("test 0: line 1")
    short = grade(SUMS, "print(3)\n", host)
    assert short.cases[0].reason == "expected 2 lines, got 1"


def test_a_crash_is_an_error_with_the_exception(host):
    result = grade(SUMS, "raise ValueError('bad input')\n", host)
    assert result.cases[0].status is CaseStatus.ERROR
    assert result.cases[0].reason == "exit code 1: ValueError: bad input"
    assert "Traceback" in result.cases[0].stderr_tail


def test_a_hanging_solution_times_out(host):
    result = grade(SUMS, "while True:\n    pass\n", host, GradeOptions(stdio_timeout=1))
    assert {c.status for c in result.cases} == {CaseStatus.TIMEOUT}, [c.reason for c in result.cases]
    assert result.cases[0].reason.startswith("timed out after 1.")


def test_a_flood_of_output_fails(host):
    result = grade(SUMS, "import sys\nfor _ in range(5000):\n    sys.stdout.write('7\\n' * 500)\n", host)
    assert {c.reason for c in result.cases} == {"output went over the limit"}


def test_a_fork_bomb_is_contained(host):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = grade(SUMS, bomb, host, GradeOptions(stdio_timeout=2))
    assert {c.status for c in result.cases} == {CaseStatus.TIMEOUT}, [c.reason for c in result.cases]


def test_a_memory_hog_runs_out_of_memory(host):
    result = grade(SUMS, "x = bytearray(4 << 30)\n", host)
    assert result.cases[0].reason == "out of memory"


# --- call-based -------------------------------------------------------------------------------------------

def test_call_based_livecodebench_layout(host):
    # Each input is one JSON value a line, one line an argument; each output a JSON string.
    task = parse_ground_truth("two_sum", {"fn_name": "twoSum", "inputs": ["[2, 7, 11, 15]\n9", "[3, 3]\n6"],
                                          "outputs": ["[0, 1]", "[0, 1]"]})
    solution = ("class Solution:\n"
                "    def twoSum(self, nums, target):\n"
                "        seen = {}\n"
                "        for i, n in enumerate(nums):\n"
                "            if target - n in seen:\n"
                "                return (seen[target - n], i)\n"
                "            seen[n] = i\n")
    assert grade(task, solution, host).score == 1.0  # a tuple is a list after JSON, as LiveCodeBench converts


def test_call_based_apps_layout_accepts_the_wrapped_value(host):
    task = parse_ground_truth("add", {"fn_name": "add", "inputs": [[1, 2], [5, 5]], "outputs": [[3], 10]})
    assert grade(task, "def add(a, b):\n    return a + b\n", host).score == 1.0
    wrong = grade(task, "def add(a, b):\n    return a - b\n", host)
    assert wrong.cases[0].reason == "expected [3], got -1"


def test_call_based_always_equal_object_cannot_pass(host):
    task = parse_ground_truth("add", {"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]})
    cheat = ("class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n"
             "def add(a, b):\n    return AlwaysEqual()\n")
    result = grade(task, cheat, host)
    assert result.score == 0.0 and result.cases[0].reason == "raised TypeError"


def test_call_based_missing_function_and_early_exit(host):
    task = parse_ground_truth("add", {"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]})
    assert grade(task, "def plus(a, b):\n    return a + b\n", host).cases[0].reason == "raised NameError"
    exits = grade(task, "import os\ndef add(a, b):\n    os._exit(0)\n", host)
    assert exits.cases[0].status is CaseStatus.ERROR and "without a report" in exits.cases[0].reason


def test_output_that_breaks_the_comparison_fails_its_case_and_nothing_else(host):
    """A signalling NaN raised out of LiveCodeBench's comparison, and a return value's report nested past the
    JSON parser's depth raised out of the call-based one: each ended the whole grading run (and a verl batch)."""
    snan = parse_ground_truth("s", {"inputs": ["1\n"], "outputs": ["5\n"]})
    result = grade(snan, "print('sNaN')\n", host, GradeOptions(compare="livecodebench"))
    assert result.status is TaskStatus.FAILED and "got 'sNaN'" in result.cases[0].reason, result.reason
    deep = parse_ground_truth("add", {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]})
    result = grade(deep, "import json\njson.dumps = lambda v, **k: '[' * 100000 + ']' * 100000\n"
                         "def add(a, b):\n    return a + b\n", host)
    assert result.status is TaskStatus.FAILED and "nested too deep" in result.cases[0].reason, result.reason


def test_call_based_input_that_is_not_json_is_a_bad_task(host):
    task = parse_ground_truth("add", {"fn_name": "add", "inputs": ["[1, 2"], "outputs": ["3"]})
    assert grade(task, "def add(a, b):\n    return a + b\n", host).status is TaskStatus.BAD_TASK


# --- the comparison itself --------------------------------------------------------------------------------

@pytest.mark.parametrize("output,expected,verdict", [
    ("1 2\n3\n", "1 2\n3", None),
    ("\n\n  1 2  \n3\n\n", "1 2\n3", None),  # the whole output and each line are stripped
    ("1.0 2.50\n", "1 2.5\n", None),  # token-wise decimals
    ("1e2\n", "100\n", None),
    ("1  2\n", "1 2\n", None),  # equal as decimals although not as text
    ("1 2\n\n3\n", "1 2\n3\n", "expected 2 lines, got 3"),  # inner blank lines count
    ("YES\n", "yes\n", "line 1: expected 'yes', got 'YES'"),
    ("1 2 3\n", "1 2\n", "line 1: expected '1 2', got '1 2 3'"),
    ("nan\n", "nan\n", None),  # equal as text first
    ("0.1\n", "0.10000001\n", "line 1: expected '0.10000001', got '0.1'"),  # no tolerance: exact decimals
])
def test_livecodebench_comparison(output, expected, verdict):
    assert compare_stdout(output, expected) == verdict


# --- comparison modes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,output,expected,verdict", [
    ("exact", "1 2\n3\n", "1 2\n3", None),
    ("exact", "1 2   \n3\t\n\n\n", "1 2\n3\n", None),  # trailing whitespace and blank lines
    ("exact", " 1 2\n3\n", "1 2\n3\n", "line 1: expected '1 2', got ' 1 2'"),  # leading whitespace counts
    ("exact", "1  2\n", "1 2\n", "line 1: expected '1 2', got '1  2'"),
    ("exact", "1.0\n", "1\n", "line 1: expected '1', got '1.0'"),
    ("exact", "1\n\n2\n", "1\n2\n", "line 2: expected '2', got ''"),
    ("exact", "1\n", "1\n2\n", "expected 2 lines, got 1"),
    ("tokens", "1 2\n3 4\n", "1 2 3\n4", None),  # wrapped differently
    ("tokens", "  1\t2  ", "1 2\n", None),
    ("tokens", "1 2\n", "1 2 3\n", "expected 3 tokens, got 2"),
    ("tokens", "1.0\n", "1\n", "token 1: expected '1', got '1.0'"),
    ("tokens", "YES\n", "yes\n", "token 1: expected 'yes', got 'YES'"),
    ("float", "3.3333333334\n", "3.3333333333\n", None),
    ("float", "0.15000000000000002 0.3 0.55\n", "0.15 0.3 0.55\n", None),
    ("float", "0.1000005\n", "0.1\n", None),  # absolute 1e-6
    ("float", "0.1000011\n", "0.1\n", "token 1: expected '0.1', got '0.1000011'"),
    ("float", "1000000.5\n", "1000000.0\n", None),  # relative 1e-6
    ("float", "1000002.5\n", "1000000.0\n", "token 1: expected '1000000.0', got '1000002.5'"),
    # An integer answer is exact however the candidate writes its token: a wrong answer written as a float
    # passed within 1e-6 of a large one (999999998 as 1000000497.0, found by red-teaming).
    ("float", "1000000.5\n", "1000000\n", "token 1: expected '1000000', got '1000000.5'"),
    ("float", "1.000000497e9\n", "999999998\n", "token 1: expected '999999998', got '1.000000497e9'"),
    ("float", "5.0 5e0\n", "5 5\n", None),
    ("float", "1e2 +7\n", "100.0 7\n", None),
    ("float", "12345678901234567891\n", "12345678901234567890\n",  # integers are exact, however big
     "token 1: expected '12345678901234567890', got '12345678901234567891'"),
    ("float", "1 2\n3\n", "1\n2 3\n", None),  # tokens
    ("float", "nan\n", "0\n", "token 1: expected '0', got 'nan'"),
    ("float", "inf\n", "inf\n", None),  # equal as text
    ("float", "0x10\n", "16\n", "token 1: expected '16', got '0x10'"),
    ("float", "1_000\n", "1000\n", "token 1: expected '1000', got '1_000'"),
    ("livecodebench", "1.0 2.50\n", "1 2.5\n", None),
    ("livecodebench", "0.1\n", "0.10000001\n", "line 1: expected '0.10000001', got '0.1'"),
    ("livecodebench", "sNaN\n", "5\n", "line 1: expected '5', got 'sNaN'"),  # raised when compared
    # SandboxFusion's check_stdio_test_case (its /submit for CommonOJDataset)
    ("sandboxfusion", "YES  \n\n", "  yes\n", None),  # stripped, lower-cased
    ("sandboxfusion", "0.3333333\n", "0.33333334\n", None),  # relative 1e-5
    ("sandboxfusion", "0.3334\n", "0.3333\n", "line 1: expected '0.3333', got '0.3334' (relative 1e-5)"),
    ("sandboxfusion", "1e2\n", "100\n", None),
    ("sandboxfusion", "1 2\n", "1  2\n", "line 1: expected '1  2', got '1 2'"),  # inner spaces count
    ("sandboxfusion", "1\n2\n", "1\n", "expected 1 lines, got 2"),
    ("sandboxfusion", "nan\n", "NaN\n", None),  # equal as lower-cased text
    ("sandboxfusion", "inf\n", "1e400\n", "line 1: expected '1e400', got 'inf' (relative 1e-5)"),
])
def test_comparison_modes(mode, output, expected, verdict):
    assert compare_output(mode, output, expected) == verdict


def test_float_tolerance_can_be_set_by_the_task(host):
    assert compare_output("float", "0.101\n", "0.1\n", 1e-2) is None
    task = task_from_record({"task_id": "t", "inputs": ["\n"], "outputs": ["0.1\n"], "compare": "float",
                             "tolerance": 0.01}, "line 1")
    assert task.tolerance == 0.01 and grade(task, "print(0.101)\n", host).passed
    strict = replace(task, tolerance=None)
    assert not grade(strict, "print(0.101)\n", host).passed


def test_defaults_by_data_source_and_results_name_the_comparison(host):
    assert [default_compare(s) for s in ("livecodebench", "LiveCodeBench/code_generation_lite", "codecontests",
                                         "deepmind/code_contests", "codeforces", "", "apps", "taco")] == \
        ["livecodebench", "livecodebench", "float", "float", "float", "livecodebench", "livecodebench",
         "livecodebench"]
    task = parse_ground_truth("third", {"inputs": ["\n"], "outputs": ["0.3333333333\n"]}, data_source="codecontests")
    third = "print(1 / 3)\n"  # 0.3333333333333333
    assert (grade(task, third, host).compare, grade(task, third, host).reason) == ("float", "")
    verl = replace(task, data_source="")  # verl inputs/outputs: LiveCodeBench's, exact decimals
    graded = grade(verl, third, host)
    assert graded.compare == "livecodebench" and graded.reason.startswith("test 0: line 1: expected")
    # The run's option picks for tasks that do not say; a record's own compare wins over it.
    assert grade(verl, third, host, GradeOptions(compare="float")).passed
    own = replace(task, compare="exact")
    graded = grade(own, third, host, GradeOptions(compare="float"))
    assert graded.compare == "exact" and graded.reason.startswith("test 0")


def test_records_ask_for_a_comparison_and_bad_ones_are_bad_tasks():
    base = {"task_id": "t", "inputs": ["1\n"], "outputs": ["1\n"]}
    assert task_from_record({**base, "compare": "tokens"}, "line 1").compare == "tokens"
    checked = task_from_record({**base, "checker": "import sys\n"}, "line 1")
    assert (checked.compare, checked.checker) == ("checker", "import sys\n")
    truth = parse_ground_truth("v", json.dumps({"inputs": ["1\n"], "outputs": ["1\n"], "compare": "exact"}))
    assert truth.compare == "exact"  # verl ground truth may say it too
    for bad, why in [({"compare": "fuzzy"},
                      "compare must be one of exact, tokens, float, livecodebench, sandboxfusion, checker"),
                     ({"compare": "checker"}, "compare is checker but the record has no checker"),
                     ({"checker": ""}, "checker must be the source of a checker program"),
                     ({"tolerance": "1e-3"}, "tolerance must be a number in [0, 1)"),
                     ({"fn_name": "f", "compare": "float"}, "call-based tests compare return values")]:
        task = task_from_record({**base, **bad}, "line 1")
        assert isinstance(task, BadTask) and task.reason.startswith(why), task
    with pytest.raises(ValueError, match="compare must be one of"):
        GradeOptions(compare="fuzzy")


def test_the_run_asking_for_a_checker_the_task_lacks_is_a_bad_task(host):
    result = grade(SUMS, SUMS_BY_INPUT, host, GradeOptions(compare="checker"))
    assert (result.status, result.reason, result.compare) == (TaskStatus.BAD_TASK, "the task has no checker",
                                                              "checker")


def test_codecontests_records_are_stdio_tasks_compared_as_floats():
    tasks = load_tasks(DATA / "codecontests_30.jsonl")
    assert len(tasks) == 30 and all(isinstance(t, StdioTask) and len(t.inputs) == 10 for t in tasks)
    assert {(t.data_source, t.compare) for t in tasks} == {("codecontests", None)}
    first = json.loads((DATA / "codecontests_30.jsonl").read_text().split("\n")[0])
    assert tasks[0].inputs[0] == first["tests"][0]["input"] and tasks[0].outputs[0] == first["tests"][0]["output"]
    for bad in ([], [{"input": "1"}], ["1"], [{"input": 1, "output": "1"}]):
        task = task_from_record({"task_id": "cc", "tests": bad}, "line 1")
        assert task.reason == "tests must be a non-empty list of {input, output} strings"
    own = task_from_record({"task_id": "cc", "tests": [{"input": "", "output": "1"}], "compare": "tokens",
                            "data_source": "mine"}, "line 1")
    assert (own.compare, own.data_source) == ("tokens", "mine")


# --- the datasets' own rows ---------------------------------------------------------------------------

def _lcb_compressed(cases: list[dict]) -> str:
    """LiveCodeBench's private_test_cases: base64 of zlib of a pickled JSON string."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


LCB_SUMS = {"question_id": "abc300_a", "question_title": "Sums", "platform": "atcoder", "question_content": "...",
            "starter_code": "", "metadata": "{}",
            "public_test_cases": json.dumps([{"input": "2\n1 2\n3 4\n", "output": "3\n7\n", "testtype": "stdin"}]),
            "private_test_cases": _lcb_compressed([{"input": "1\n-5 5\n", "output": "0\n", "testtype": "stdin"}])}
LCB_TWO_SUM = {"question_id": "1", "platform": "leetcode", "question_content": "...", "metadata": '{"func_name": "twoSum"}',
               "public_test_cases": json.dumps([{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]",
                                                 "testtype": "functional"}]),
               "private_test_cases": _lcb_compressed([{"input": "[3, 3]\n6", "output": "[0, 1]",
                                                       "testtype": "functional"}])}
TWO_SUM = ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
           "        for i, n in enumerate(nums):\n            if target - n in seen:\n"
           "                return [seen[target - n], i]\n            seen[n] = i\n")


def test_the_datasets_own_rows_load_as_published(tmp_path):
    # DeepMind's CodeContests, as its parquet holds it (nested structs): every test counts.
    import pyarrow as pa
    import pyarrow.parquet as pq
    row = {"name": "1548_E. Gregor and the Two Painters", "description": "...",
           "public_tests": {"input": ["2\n1 2\n3 4\n"], "output": ["3\n7\n"]},
           "private_tests": {"input": ["1\n-5 5\n"], "output": ["0\n"]},
           "generated_tests": {"input": ["1\n0 0\n"], "output": ["0\n"]},
           "time_limit": {"seconds": 2, "nanos": 0}, "memory_limit_bytes": 256000000}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "cc.parquet")
    (task,) = load_tasks(tmp_path / "cc.parquet")
    assert (task.task_id, task.data_source, task.inputs, task.outputs) == (
        "1548_E. Gregor and the Two Painters", "codecontests", ("2\n1 2\n3 4\n", "1\n-5 5\n", "1\n0 0\n"),
        ("3\n7\n", "0\n", "0\n"))
    bad = task_from_record({**row, "private_tests": {"input": ["1"], "output": []}}, "row 1")
    assert bad.reason == "private_tests must be {input: [...], output: [...]}, lists of the same length"
    # LiveCodeBench's code_generation rows: public and private tests, call-based where metadata names a function.
    sums, two_sum = task_from_record(LCB_SUMS, "line 1"), task_from_record(LCB_TWO_SUM, "line 2")
    assert (sums.task_id, sums.inputs, sums.fn_name, sums.data_source) == (
        "abc300_a", ("2\n1 2\n3 4\n", "1\n-5 5\n"), None, "livecodebench")
    assert (two_sum.fn_name, two_sum.inputs) == ("twoSum", ("[2, 7, 11, 15]\n9", "[3, 3]\n6"))
    # APPS / TACO: input_output, a JSON string; stdin tests given as lists of lines are joined.
    apps = task_from_record({"problem_id": 7, "input_output": json.dumps({"inputs": ["1\n"], "outputs": [["2", "3"]]})},
                            "row 0")
    assert (apps.task_id, apps.outputs, apps.data_source) == ("7", ("2\n3",), "apps")
    assert task_from_record({"problem_id": 8, "input_output": ""}, "row 1").reason == \
        "input_output has no tests (inputs and outputs)"


def test_a_livecodebench_pickle_never_runs_what_it_names(tmp_path):
    """Unpickling runs what a pickle names: a hostile row's private_test_cases must not reach the host."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    hostile = base64.b64encode(zlib.compress(pickle.dumps(Payload()))).decode()
    task = task_from_record({**LCB_SUMS, "private_test_cases": hostile}, "line 1")
    assert task.reason == "private_test_cases: refused the pickle: it names posix.system; test cases are a string"
    assert not marker.exists()
    not_a_string = base64.b64encode(zlib.compress(pickle.dumps([1, 2]))).decode()
    assert task_from_record({**LCB_SUMS, "private_test_cases": not_a_string}, "line 2").reason == \
        "private_test_cases: the pickle holds a list, not the JSON string of the tests"
    bomb = base64.b64encode(zlib.compress(pickle.dumps("x" * (2 << 20)))).decode()  # 2 MiB from a few kB
    os.environ["IMAGE_BUILDER_MAX_LINE"] = "64K"
    try:
        reason = task_from_record({**LCB_SUMS, "private_test_cases": bomb}, "line 3").reason
    finally:
        del os.environ["IMAGE_BUILDER_MAX_LINE"]
    assert reason == "private_test_cases: over 0 MiB decompressed (8 x $IMAGE_BUILDER_MAX_LINE)"


def test_livecodebench_rows_grade_as_its_evaluator_runs_them(host):
    sums, two_sum = task_from_record(LCB_SUMS, "line 1"), task_from_record(LCB_TWO_SUM, "line 2")
    assert grade(sums, SUMS_BY_INPUT, host).score == 1.0
    wrong = grade(sums, "input()\nprint(3)\nprint(7)\n", host)  # right on the public test only
    assert wrong.score == 0.5 and [c.status for c in wrong.cases] == [CaseStatus.PASSED, CaseStatus.FAILED]
    assert grade(two_sum, TWO_SUM, host).score == 1.0
    assert grade(two_sum, "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n",
                 host).score == 1.0  # both tests' answer is [0, 1]
    assert grade(two_sum, "class Solution:\n    def twoSum(self, nums, target):\n        return [1, 0]\n",
                 host).score == 0.0


# --- checker ----------------------------------------------------------------------------------------------

# Any two numbers summing to the input: several valid answers.
SPLIT_CHECKER = """import sys
given, expected, actual = (open(path).read() for path in sys.argv[1:4])
try:
    a, b = map(int, actual.split())
except ValueError:
    print("not two integers")
    sys.exit(1)
if a + b != int(given) or a < 0 or b < 0:
    print("%d + %d is not %s" % (a, b, given.strip()))
    sys.exit(1)
assert expected.split()  # the checker gets the jury's answer too
"""
SPLIT = task_from_record({"task_id": "split", "inputs": ["10\n", "3\n"], "outputs": ["5 5\n", "1 2\n"],
                          "checker": SPLIT_CHECKER}, "line 1")


def test_a_checker_accepts_any_valid_answer(host):
    result = grade(SPLIT, "n = int(input())\nprint(0, n)\n", host)
    assert (result.status, result.reason, result.compare) == (TaskStatus.PASSED, "", "checker")
    assert grade(SPLIT, "n = int(input())\nprint(n - 1, 1)\n", host).passed


def test_a_checker_rejection_carries_its_message(host):
    result = grade(SPLIT, "n = int(input())\nprint(n, 1)\n", host)
    assert [c.status for c in result.cases] == [CaseStatus.FAILED] * 2
    assert result.cases[0].reason == "checker rejected (exit code 1): 10 + 1 is not 10"
    assert grade(SPLIT, "print('five')\n", host).cases[0].reason == "checker rejected (exit code 1): not two integers"


def test_a_broken_or_hanging_checker_is_an_error_and_a_failing_candidate_is_not_checked(host):
    hanging = replace(SPLIT, checker="while True:\n    pass\n")
    result = grade(hanging, "print(0, 10)\n", host, GradeOptions(stdio_timeout=1))
    assert result.cases[0].status is CaseStatus.ERROR and result.cases[0].reason.startswith("checker: timed out")
    crashed = grade(SPLIT, "raise SystemExit(3)\n", host)
    assert crashed.cases[0].reason == "exit code 3: "


class RecordingExecutor:
    """Passes runs to another executor, keeping each request."""

    def __init__(self, inner):
        self.inner, self.requests = inner, []

    def run(self, request: RunRequest):
        self.requests.append(request)
        return self.inner.run(request)


# Reads every file it can find in the places a grader could leave one, and prints what it found.
SNOOP = """import os
found = False
for top in ("/tmp", ".", os.path.expanduser("~")):
    for root, dirs, files in os.walk(top):
        for name in files:
            try:
                with open(os.path.join(root, name), "rb") as f:
                    found = found or b"SECRET-" + b"ANSWER" in f.read(1 << 20)  # not in this file
            except OSError:
                pass
print("SECRET-" + "ANSWER" if found else "nothing")
"""


@pytest.mark.parametrize("mode", ["exact", "tokens", "float", "livecodebench", "checker"])
def test_the_candidates_run_never_sees_the_expected_output(host, mode):
    checker = "import sys\nsys.exit(open(sys.argv[2]).read() != open(sys.argv[3]).read())\n"
    task = StdioTask("secret", ("1\n",), ("SECRET-ANSWER\n",), "secret", compare=mode,
                     checker=checker if mode == "checker" else None)
    recorder = RecordingExecutor(host)
    result = grade(task, SNOOP, recorder)
    assert result.cases[0].status is CaseStatus.FAILED, result
    candidate = [r for r in recorder.requests if "_ib_solution.py" in " ".join(r.argv)]
    assert len(candidate) == 1
    seen = [candidate[0].stdin or b"", *candidate[0].files.values(), *map(str.encode, candidate[0].argv),
            *map(str.encode, candidate[0].env.values())]
    assert not any(b"SECRET-ANSWER" in blob for blob in seen)
    assert len(recorder.requests) == (2 if mode == "checker" else 1)  # the checker runs on its own
    # The same program passes when it is handed the answer, so it would have found it.
    handed = StdioTask("secret", ("1\n",), ("SECRET-ANSWER\n",), "secret", compare="exact")
    leaky = SNOOP.replace('for top in ("/tmp"', 'open("hint", "w").write("SECRET-" + "ANSWER")\nfor top in ("/tmp"')
    assert grade(handed, leaky, host).passed


# --- fidelity: 30 CodeContests problems against a host check --------------------------------------------

# The host check (index/data/codecontests_30_host_check.json) ran each solution_py on the host with
# 10 s a test. The solutions' TLE tests take 7-10 s here, the rest at most 0.2 s, so 3 s a test tells
# them apart in a fifth of the time; a timeout counts as a fail, as TLE does.
FIDELITY_TIMEOUT = 3.0
HOST_PASSES = {"OK", "OK_float", "OK_tok"}
# Where the float mode deliberately disagrees with the host check: the expected answer's second
# line is a 20-digit 0/1 schedule; the host's tolerance read both as floats near 1e19 and called
# a different schedule equal. Integers compare exactly here; whether that schedule is also valid
# (the problem accepts any optimal one) is a checker's call: see the checker test below.
KNOWN_DEVIATIONS = {("1407_e_egor_in_the_republic_of_dagestan_1382", "5"): "failed"}


def _codecontests():
    records = [json.loads(line) for line in (DATA / "codecontests_30.jsonl").read_text().splitlines()]
    host_check = json.loads((DATA / "codecontests_30_host_check.json").read_text())
    return load_tasks(DATA / "codecontests_30.jsonl"), {r["task_id"]: r["solution_py"] for r in records}, host_check


def _disagreements(results, host_check):
    """(task, test, host status, our status) wherever the verdicts differ."""
    return [(r.task_id, c.name, want, c.status.value) for r in results
            for c, want in zip(r.cases, host_check[r.task_id]["statuses"])
            if (c.status is CaseStatus.PASSED) != (want in HOST_PASSES)]


def test_float_mode_matches_the_host_check_of_codecontests(host):
    tasks, solutions, host_check = _codecontests()
    options = GradeOptions(compare="float", stdio_timeout=FIDELITY_TIMEOUT)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda t: grade(t, solutions[t.task_id], host, options), tasks))
    assert sum(len(r.cases) for r in results) == 300
    assert all(r.compare == "float" for r in results)
    differ = _disagreements(results, host_check)
    assert {(task, test): ours for task, test, _, ours in differ} == KNOWN_DEVIATIONS, differ
    timeouts = [(r.task_id, c.name) for r in results for c in r.cases if c.status is CaseStatus.TIMEOUT]
    assert timeouts == [("1238_e_keyboard_purchase_2831", n) for n in "34579"]  # the host's TLEs


def test_codecontests_in_the_sandbox_match_the_host_check(mbpp_store):
    # The MBPP store's environment has python3; any of its instances runs these.
    from image_builder.graders.grading import StoreExecutors
    from image_builder.store.store import Store
    tasks, solutions, host_check = _codecontests()
    chosen = [t for t in tasks if t.task_id in ("208_c_police_station_7323", "1057_c_tanya_and_colored_candies_12296")]
    with StoreExecutors(Store.open(mbpp_store)) as executors:
        executor = executors.for_instance("512")
        results = [grade(t, solutions[t.task_id], executor, GradeOptions(stdio_timeout=FIDELITY_TIMEOUT))
                   for t in chosen]
    assert [(r.compare, r.reason) for r in results] == [("float", "")] * 2  # the codecontests default
    assert _disagreements(results, host_check) == []


# 1407E accepts any optimal schedule: the length must be the jury's, and the schedule must give it.
DAGESTAN_CHECKER = """import sys
from collections import deque
given, expected, actual = (open(path).read().split() for path in sys.argv[1:4])
n, m = int(given[0]), int(given[1])
if len(actual) != 2 or actual[0] != expected[0]:
    print("length %s, expected %s" % (actual[0] if actual else "none", expected[0]))
    sys.exit(1)
schedule = actual[1]
if len(schedule) != n or set(schedule) - set("01"):
    print("the schedule is not %d digits 0/1" % n)
    sys.exit(1)
out = [[] for _ in range(n + 1)]
for i in range(m):
    u, v, t = (int(x) for x in given[2 + 3 * i:5 + 3 * i])
    if int(schedule[u - 1]) == t:
        out[u].append(v)
dist = [-1] * (n + 1)
dist[1] = 0
queue = deque([1])
while queue:
    u = queue.popleft()
    for v in out[u]:
        if dist[v] < 0:
            dist[v] = dist[u] + 1
            queue.append(v)
if dist[n] != int(actual[0]):
    print("the schedule's shortest path is %d, not %s" % (dist[n], actual[0]))
    sys.exit(1)
"""


def test_a_checker_accepts_the_valid_schedules_that_exact_comparison_rejects(host):
    tasks, solutions, host_check = _codecontests()
    task = next(t for t in tasks if t.task_id.startswith("1407_e"))
    checked = grade(replace(task, compare="checker", checker=DAGESTAN_CHECKER), solutions[task.task_id], host)
    assert (checked.status, checked.compare) == (TaskStatus.PASSED, "checker"), checked
    assert host_check[task.task_id]["statuses"].count("WA") == 6  # all of them valid answers
    # The checker does reject: the claimed length is wrong, or the schedule does not give it.
    bad = grade(replace(task, compare="checker", checker=DAGESTAN_CHECKER),
                "import sys\nn = int(sys.stdin.readline().split()[0])\nprint(-1)\nprint('0' * n)\n", host)
    assert not bad.passed and bad.cases[0].reason.startswith("checker rejected (exit code 1)")
