"""Assert-case grading (verl `{"assert_case": [...]}`): each case a fresh standalone run.

Each case runs as the script `solution + "\\n" + case`, in its own run with its
own throwaway state, so nothing a solution writes (to the case file, the
harness, the working directory) reaches another case. The case text comes from
the grader with every run; candidate code never holds the tests between cases.
Score: the fraction of cases passed, as verl's sandbox path scores them.
"""

from __future__ import annotations

from image_builder.runtime.execution import Executor

from image_builder.tasks import AssertTask
from .options import GradeOptions
from .pyharness import SCRATCH, harness_request, no_report_reason, process_failure, read_outcome
from .results import CaseResult, CaseStatus, GradeResult, from_cases

CASE_FILE = f"{SCRATCH}/_ib_case.py"


def grade_asserts(task: AssertTask, solution: str, executor: Executor, options: GradeOptions) -> GradeResult:
    cases = [run_case(str(i), solution, case, executor, options) for i, case in enumerate(task.cases)]
    return from_cases(task.task_id, "assert", cases, "case")


def run_case(name: str, solution: str, case: str, executor: Executor, options: GradeOptions) -> CaseResult:
    case_line = solution.count("\n") + 2  # where the case starts in the script, for strict mode
    mode = ("script", CASE_FILE, "strict" if options.strict else "plain", str(case_line))
    request, nonce = harness_request(mode, {CASE_FILE: solution + "\n" + case}, options.case_timeout, options)
    result = executor.run(request)
    outcome = read_outcome(result, nonce)
    status, reason = {
        "passed": (CaseStatus.PASSED, ""),
        "failed": (CaseStatus.FAILED, "assertion failed"),
        "exited": (CaseStatus.ERROR, "exited (sys.exit) before the case finished"),
        "raised": (CaseStatus.ERROR, f"raised {outcome.detail}"),
    }.get(outcome.kind) or process_failure(result) or (CaseStatus.ERROR, no_report_reason(result))
    return CaseResult(name, status, reason, outcome.stderr_tail, result.wall_time)
