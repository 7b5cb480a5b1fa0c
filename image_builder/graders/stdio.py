"""Stdin/stdout grading (`{"inputs": [...], "outputs": [...]}`), and call-based when fn_name is set.

Standard input is a regular file, as judges give it (some real solutions read
`os.fstat(0).st_size` bytes). Output is compared as LiveCodeBench does; each
test is its own run with its own time limit (6 s by default, LiveCodeBench's).

Call-based tests come in two layouts: LiveCodeBench's (each input a string of
JSON lines, one per argument; each output a JSON string) and APPS/verl's (each
input a list of arguments; each output the value, often wrapped in a list).
The return value is compared on the grader's side after a JSON round trip, so
an object whose __eq__ always says True cannot pass (it is not JSON).
"""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation

from image_builder.runtime.execution import Executor, RunRequest

from image_builder.tasks import StdioTask
from .options import GradeOptions
from .pyharness import SCRATCH, harness_request, last_line, no_report_reason, process_failure, read_outcome, tail
from .results import CaseResult, CaseStatus, GradeResult, TaskStatus, from_cases

SOLUTION_FILE = f"{SCRATCH}/_ib_solution.py"
CALL_FILE = f"{SCRATCH}/_ib_call.json"


def grade_stdio(task: StdioTask, solution: str, executor: Executor, options: GradeOptions) -> GradeResult:
    if task.fn_name:
        try:
            calls = [_call_case(given, expected) for given, expected in zip(task.inputs, task.outputs)]
        except ValueError as exc:
            return GradeResult(task.task_id, "stdio", TaskStatus.BAD_TASK, reason=f"call-based test: {exc}")
        cases = [_run_call(str(i), solution, task.fn_name, args, accepted, executor, options)
                 for i, (args, accepted) in enumerate(calls)]
    else:
        cases = [_run_stdin(str(i), solution, given, expected, executor, options)
                 for i, (given, expected) in enumerate(zip(task.inputs, task.outputs))]
    return from_cases(task.task_id, "stdio", cases, "test")


def compare_stdout(output: str, expected: str) -> str | None:
    """LiveCodeBench's check; None when the output is accepted, else why not."""
    got, want = _stripped_lines(output), _stripped_lines(expected)
    if len(got) != len(want):
        return f"expected {len(want)} lines, got {len(got)}"
    for number, (line, wanted) in enumerate(zip(got, want), 1):
        if line == wanted:
            continue
        got_decimals, want_decimals = _decimals(line), _decimals(wanted)
        if got_decimals is None or want_decimals is None or got_decimals != want_decimals:
            return f"line {number}: expected {wanted[:80]!r}, got {line[:80]!r}"
    return None


def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(token) for token in line.split()]
    except InvalidOperation:
        return None


def _run_stdin(name: str, solution: str, given: str, expected: str, executor: Executor,
               options: GradeOptions) -> CaseResult:
    result = executor.run(RunRequest(argv=(options.python, SOLUTION_FILE), stdin=given.encode(),
                                     files={SOLUTION_FILE: solution.encode()}, env=dict(options.env),
                                     timeout=options.stdio_timeout, memory_mb=options.memory_mb,
                                     max_output=options.max_output))
    stderr = result.stderr.decode("utf-8", "replace")
    failure = process_failure(result)
    if failure:
        status, reason = failure
    elif result.exit_code != 0:
        status, reason = CaseStatus.ERROR, f"exit code {result.exit_code}: {last_line(stderr)}"
    elif result.truncated:
        status, reason = CaseStatus.FAILED, "output went over the limit"
    else:
        mismatch = compare_stdout(result.stdout.decode("utf-8", "replace"), expected)
        status, reason = (CaseStatus.PASSED, "") if mismatch is None else (CaseStatus.FAILED, mismatch)
    return CaseResult(name, status, reason, tail(stderr), result.wall_time)


def _call_case(given: object, expected: object) -> tuple[list, list]:
    """(arguments, accepted return values) for either layout."""
    if isinstance(given, str):  # LiveCodeBench
        try:
            return [json.loads(line) for line in given.split("\n")], [json.loads(expected)]
        except (ValueError, TypeError) as exc:
            raise ValueError(f"input or output is not JSON: {exc}") from None
    if not isinstance(given, list):
        raise ValueError("each input must be a JSON-lines string or a list of arguments")
    accepted = [expected]
    if isinstance(expected, list) and expected:  # APPS wraps the return value in a list
        accepted.append(expected[0])
    return given, accepted


def _run_call(name: str, solution: str, fn_name: str, args: list, accepted: list, executor: Executor,
              options: GradeOptions) -> CaseResult:
    files = {SOLUTION_FILE: solution, CALL_FILE: json.dumps({"fn_name": fn_name, "args": args})}
    request, nonce = harness_request(("call", SOLUTION_FILE, CALL_FILE), files, options.stdio_timeout, options)
    result = executor.run(request)
    outcome = read_outcome(result, nonce)
    if outcome.kind == "returned":
        status, reason = _judge_return(outcome.detail, accepted)
    elif outcome.kind == "raised":
        status, reason = CaseStatus.ERROR, f"raised {outcome.detail}"
    elif outcome.kind == "exited":
        status, reason = CaseStatus.ERROR, "exited (sys.exit) before returning"
    else:
        status, reason = process_failure(result) or (CaseStatus.ERROR, no_report_reason(result))
    return CaseResult(name, status, reason, outcome.stderr_tail, result.wall_time)


def _judge_return(returned_json: str, accepted: list) -> tuple[CaseStatus, str]:
    try:
        returned = json.loads(returned_json)
    except ValueError:
        return CaseStatus.ERROR, "the return value's report was cut off"
    if returned in accepted:
        return CaseStatus.PASSED, ""
    return CaseStatus.FAILED, f"expected {json.dumps(accepted[0])[:80]}, got {returned_json[:80]}"
