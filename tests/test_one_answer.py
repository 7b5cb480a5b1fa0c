"""One question, one answer (graders/one_answer.py): cases that ask the same for answers that exclude each
other do not pass together, whatever carried the state between them. Here the state is a file on the host
(the host executor's runs share the host), the plainest channel; tests/test_runtime_holes.py carries it
through the real runtime's page cache."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from image_builder.graders import AssertTask, GradeOptions, grade
from image_builder.graders.one_answer import Question, assert_answers_exclude, assert_question, one_answer_each
from image_builder.graders.results import CaseResult, CaseStatus
from image_builder.submit import evaluate, parse_submit
from image_builder.tasks import StdioTask
from tests.support.host_executor import HostExecutor

OPTIONS = GradeOptions(case_timeout=5)


@pytest.fixture(scope="module")
def host():
    return HostExecutor()


def counter(path) -> str:
    """A solution's preamble: `_count()` is how many runs asked before this one."""
    return f"""
import os
def _count():
    n = len(os.listdir({str(path)!r}))
    open(os.path.join({str(path)!r}, str(os.getpid()) + str(n)), "w").close()
    return n
"""


@pytest.fixture
def shared():
    """A directory every run reaches: the host executor's runs each get a /tmp of their own."""
    path = Path(tempfile.mkdtemp(dir="/var/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


def test_a_conflicting_assert_pair_passed_by_a_counter_fails(host, shared):
    task = AssertTask("t", ("assert f(1) == 2", "assert f(2) == 4", "assert f(1) == 3"), "t")
    cheat = counter(shared) + "def f(x):\n    return 2 * x + (x == 1 and _count() > 0)\n"
    result = grade(task, cheat, host, OPTIONS)
    assert [c.status.value for c in result.cases] == ["failed", "passed", "failed"], result.cases
    assert "case 2 asks the same" in result.cases[0].reason and "case 0 asks" in result.cases[2].reason
    assert any(line.startswith("state recording") for line in result.evidence), result.evidence
    honest = grade(task, "def f(x):\n    return 2 * x\n", host, OPTIONS)
    assert [c.status.value for c in honest.cases] == ["passed", "passed", "failed"], honest.cases


def test_a_conflicting_stdin_pair_passed_by_a_counter_fails(host, shared):
    task = StdioTask("t", ("1\n", "2\n", "1\n"), ("A", "C", "B"), "t", compare="tokens")
    cheat = counter(shared) + "x = input()\nprint('C' if x == '2' else 'AB'[_count() > 0])\n"
    result = grade(task, cheat, host, OPTIONS)
    assert [c.status.value for c in result.cases] == ["failed", "passed", "failed"], result.cases
    assert "state carried between runs" in result.cases[0].reason


def test_a_conflicting_call_pair_passed_by_a_counter_fails(host, shared):
    task = StdioTask("t", ([1], [2], [1]), ([2], [4], [3]), "t", fn_name="f")
    cheat = counter(shared) + "def f(x):\n    return 2 * x + (x == 1 and _count() > 0)\n"
    result = grade(task, cheat, host, OPTIONS)
    assert [c.status.value for c in result.cases] == ["failed", "passed", "failed"], result.cases


def test_a_checker_may_take_two_answers_to_one_input(host, shared):
    """With a checker, one input has several right outputs: a solution that answers it two ways passes."""
    checker = "import sys\nsys.exit(0 if open(sys.argv[3]).read().split() in (['A'], ['B']) else 1)\n"
    task = StdioTask("t", ("1\n", "1\n"), ("A", "B"), "t", compare="checker", checker=checker)
    result = grade(task, counter(shared) + "input()\nprint('AB'[_count() > 0])\n", host, OPTIONS)
    assert result.score == 1.0, result.cases


@pytest.mark.parametrize("a, b, exclude", [
    ("assert f(1) == 2", "assert f(1) == 3", True),
    ("assert f(1) == 2", "assert 3 == f(1)", True),
    ("assert f(1) == 1", "assert f(1) == True", False),  # 1 == True: one answer passes both
    ("assert f(1) == 1", "assert f(1) == 1.0", False),
    ("assert f(1)", "assert not f(1)", True),
    ("assert f(1) == 0", "assert f(1)", True),
    ("assert f(1) == []", "assert not f(1)", False),
    ("assert f(1) != 2", "assert f(1) == 2", True),
    ("assert f(1) != 2", "assert f(1) != 3", False),
    ("assert f(1) is None", "assert f(1) is not None", True),
    ("assert f(1) == [1, 2]", "assert f(1) == (1, 2)", True),
    ("assert f(1) == {1, 2}", "assert f(1) == {2, 1}", False),
    ("assert f(1) == 2, 'message'", "assert f(1) == 3", True),
])
def test_which_asserts_ask_one_question_for_answers_that_exclude_each_other(a, b, exclude):
    qa, qb = assert_question(a), assert_question(b)
    assert qa.key == qb.key
    assert assert_answers_exclude(qa.wants, qb.wants) is exclude
    assert assert_answers_exclude(qb.wants, qa.wants) is exclude


@pytest.mark.parametrize("a, b", [
    ("assert sorted(f(x)) == [1, 2]", "assert f(x) == [2, 1]"),  # one answer, [2, 1], passes both
    ("assert f(1) == 2", "assert g(1) == 3"),
    ("x = 1\nassert f(x) == 2", "x = 2\nassert f(x) == 3"),
    ("candidate = f\nassert candidate(1) == 2", "assert candidate(1) == 3"),
])
def test_different_questions(a, b):
    assert assert_question(a).key != assert_question(b).key


@pytest.mark.parametrize("case", ["x = f(1)\nprint(x)", "assert f(1) < 3", "assert 1 == 1", "assert f(1) == g(2)",
                                  "not python ("])
def test_cases_of_other_shapes_ask_nothing_checked(case):
    assert assert_question(case) is None


@pytest.mark.parametrize("run_all_cases", [True, False])
def test_submit_s_other_languages_pass_one_input_for_one_answer(run_all_cases):
    """/submit's runs of languages other than python (bash, cpp, nodejs) are judged in submit.py: the same
    rule. A stand-in for /run_code answers the same input A, then B, as a solution that reads the page cache
    would (tests/test_runtime_holes.py does that through the real runtime)."""
    answers = iter(["A", "C", "B"])
    tests = [{"input": {"stdin": s}, "output": {"stdout": o}} for s, o in (("1", "A"), ("2", "C"), ("1", "B"))]
    submission = parse_submit({"dataset": "code_contests", "id": 1, "completion": "```bash\ncat\n```",
                               "config": {"language": "bash", "provided_data": {"test": tests},
                                          "extra": {"run_all_cases": run_all_cases}}})
    result = evaluate(submission, None, lambda *request: {"status": "Success", "message": "",
                                                          "run_result": {"stdout": next(answers)}})
    assert not result.accepted
    assert [t.passed for t in result.tests] == ([False, True, False] if run_all_cases else [False])


def test_one_question_asked_many_times_for_one_answer_costs_one_look_each():
    """A hostile dataset asking one question 50,000 times: pairs of its cases would be 10^9 comparisons."""
    compared = []
    cases = [CaseResult(str(i), CaseStatus.PASSED) for i in range(50_000)]
    judged = one_answer_each([Question("f(1)", ("==", 2))] * len(cases), cases,
                             lambda a, b: compared.append((a, b)) or a != b)
    assert judged == cases and len(compared) == 0
    judged = one_answer_each([Question("f(1)", ("==", 2))] * 49_999 + [Question("f(1)", ("==", 3))], cases,
                             lambda a, b: compared.append((a, b)) or a != b)
    assert len(compared) == 1 and all(c.status is CaseStatus.FAILED for c in judged)
