"""Stdin/stdout and call-based grading on small made-up problems, and LiveCodeBench's comparison."""

from __future__ import annotations

import json

import pytest

from image_builder.graders import CaseStatus, GradeOptions, TaskStatus, grade, parse_ground_truth
from image_builder.graders.stdio import compare_stdout
from tests.support.host_executor import HostExecutor


@pytest.fixture(scope="module")
def host():
    return HostExecutor()


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
    assert wrong.score == 0.5 and wrong.reason.startswith("test 0: line 1")
    short = grade(SUMS, "print(3)\n", host)
    assert short.cases[0].reason == "expected 2 lines, got 1"


def test_a_crash_is_an_error_with_the_exception(host):
    result = grade(SUMS, "raise ValueError('bad input')\n", host)
    assert result.cases[0].status is CaseStatus.ERROR
    assert result.cases[0].reason == "exit code 1: ValueError: bad input"
    assert "Traceback" in result.cases[0].stderr_tail


def test_a_hanging_solution_times_out(host):
    result = grade(SUMS, "while True:\n    pass\n", host, GradeOptions(stdio_timeout=1))
    assert {c.status for c in result.cases} == {CaseStatus.TIMEOUT}
    assert result.cases[0].reason.startswith("timed out after 1.")


def test_a_flood_of_output_fails(host):
    result = grade(SUMS, "import sys\nfor _ in range(5000):\n    sys.stdout.write('7\\n' * 500)\n", host)
    assert {c.reason for c in result.cases} == {"output went over the limit"}


def test_a_fork_bomb_is_contained(host):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = grade(SUMS, bomb, host, GradeOptions(stdio_timeout=2))
    assert {c.status for c in result.cases} == {CaseStatus.TIMEOUT}


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
