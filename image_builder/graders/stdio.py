"""Stdin/stdout grading (`{"inputs": [...], "outputs": [...]}`), and call-based when fn_name is set.

Standard input is a regular file, as judges give it (some real solutions read
`os.fstat(0).st_size` bytes). Each test is its own run with its own time limit
(6 s by default, LiveCodeBench's). The output is compared in one of these modes:

- `exact`: line by line, trailing whitespace of each line and trailing blank lines ignored;
- `tokens`: the whitespace-separated tokens are equal;
- `float`: tokens, where two numbers are equal within absolute or relative 1e-6 (the task's
  `tolerance` if it has one); an expected integer (no point, no exponent) must be matched exactly
  (`5.0` for `5`, as a number): a wrong integer answer written as a float once passed within 1e-6 of
  a large answer;
- `livecodebench`: LiveCodeBench's (`compare_stdout`): stripped lines, equal as text or
  token-wise as exact decimals;
- `sandboxfusion`: SandboxFusion's (`check_stdio_test_case`, its /submit for CommonOJDataset): stripped
  lines, equal lower-cased, or both numbers within relative 1e-5;
- `checker`: the task's checker program (Python source) decides, for problems with several
  valid answers. It is a run of its own through the same executor, after the candidate's,
  as `python3 checker.py INPUT EXPECTED ACTUAL` (three file paths); exit 0 accepts, any other
  status rejects with its last line of output as the reason. The expected output goes only to
  the checker's run: the candidate's run gets its code and its stdin, nothing else.

The mode is the task's (`compare`, or `checker` when it has a checker), else the run's
(`GradeOptions.compare`, `grade --compare`), else the data source's default
(`default_compare`). The result's `compare` says which.

Call-based tests come in two layouts: LiveCodeBench's (each input a string of
JSON lines, one per argument; each output a JSON string) and APPS/verl's (each
input a list of arguments; each output the value, often wrapped in a list).
The return value is compared on the grader's side after a JSON round trip, so
an object whose __eq__ always says True cannot pass (it is not JSON).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from decimal import Decimal, InvalidOperation
from functools import partial

from image_builder.runtime.execution import Executor, RunRequest
from image_builder.runtime.warm import WarmPool, run_warm

from image_builder.tasks import StdioTask
from .one_answer import Question, one_answer_each
from .options import GradeOptions
from .pyharness import SCRATCH, harness_request, last_line, no_report_reason, process_failure, read_outcome, tail
from .results import CaseResult, CaseStatus, GradeResult, TaskStatus, from_cases

SOLUTION_FILE = f"{SCRATCH}/_ib_solution.py"
CALL_FILE = f"{SCRATCH}/_ib_call.json"
CHECK_DIR = f"{SCRATCH}/_ib_check"  # the checker's run only
CHECKER_FILE, INPUT_FILE, EXPECTED_FILE, ACTUAL_FILE = (f"{CHECK_DIR}/{name}"
                                                         for name in ("checker.py", "input", "expected", "actual"))
DEFAULT_TOLERANCE = 1e-6

# Data sources (verl's `data_source`, lower-cased) by the comparison their own graders make; the rest,
# verl's `inputs/outputs` tasks among them, get LiveCodeBench's, the default before modes existed.
SOURCE_DEFAULTS = (("livecodebench", "livecodebench"), ("codecontests", "float"), ("code_contests", "float"),
                   ("codeforces", "float"))


def default_compare(data_source: str) -> str:
    source = data_source.lower()
    return next((mode for name, mode in SOURCE_DEFAULTS if name in source), "livecodebench")


def compare_mode(task: StdioTask, options: GradeOptions) -> str:
    return task.compare or options.compare or default_compare(task.data_source)


def grade_stdio(task: StdioTask, solution: str, executor: Executor, options: GradeOptions) -> GradeResult:
    # Each test's run (and a checker's) a clone of a warm interpreter where the executor has them:
    # the same fresh root and pid namespace, without the interpreter's start (runtime/warm.py).
    warm = getattr(executor, "warm", None)
    pool = warm((options.python,), None, dict(options.env), options.memory_mb, len(task.inputs)) if warm else None
    if task.fn_name:
        try:
            calls = [_call_case(given, expected) for given, expected in zip(task.inputs, task.outputs)]
        except ValueError as exc:
            return GradeResult(task.task_id, "stdio", TaskStatus.BAD_TASK, reason=f"call-based test: {exc}")
        cases = [_run_call(str(i), solution, task.fn_name, args, accepted, executor, options, pool)
                 for i, (args, accepted) in enumerate(calls)]
        cases = one_answer_each([Question(json.dumps(args, sort_keys=True), accepted) for args, accepted in calls],
                                cases, lambda a, b: not any(x in b for x in a), "test")
        return from_cases(task.task_id, "stdio", cases, "test")
    mode = compare_mode(task, options)
    if mode == "checker" and not task.checker:
        return GradeResult(task.task_id, "stdio", TaskStatus.BAD_TASK, reason="the task has no checker",
                           compare=mode)
    judge = _Judge(mode, task.tolerance if task.tolerance is not None else DEFAULT_TOLERANCE, task.checker)
    cases = [_run_stdin(str(i), solution, given, expected, executor, options, judge, pool)
             for i, (given, expected) in enumerate(zip(task.inputs, task.outputs))]
    if mode != "checker":  # a checker may take several answers to one input
        cases = one_answer_each([Question(given, expected) for given, expected in zip(task.inputs, task.outputs)],
                                cases, partial(outputs_exclude, mode, judge.tolerance), "test")
    result = from_cases(task.task_id, "stdio", cases, "test")
    return replace(result, compare=mode)


def outputs_exclude(mode: str, tolerance: float, a: str, b: str) -> bool:
    """Two expected outputs of one input that no one output matches: neither is accepted as the other, even
    within twice the tolerance (an output halfway between two numbers that far apart matches both)."""
    return all(compare_output(mode, x, y, 2 * tolerance) is not None for x, y in ((a, b), (b, a)))


def compare_output(mode: str, output: str, expected: str, tolerance: float = DEFAULT_TOLERANCE) -> str | None:
    """The output against the expected one in a mode other than checker; None when accepted, else why not."""
    if mode == "livecodebench":
        return compare_stdout(output, expected)
    if mode == "exact":
        return compare_exact(output, expected)
    if mode == "tokens":
        return compare_tokens(output, expected)
    if mode == "float":
        return compare_tokens(output, expected, tolerance)
    if mode == "sandboxfusion":
        return compare_sandboxfusion(output, expected)
    raise ValueError(f"no comparison named {mode!r}")


def compare_exact(output: str, expected: str) -> str | None:
    got, want = _trimmed_lines(output), _trimmed_lines(expected)
    for number, (line, wanted) in enumerate(zip(got, want), 1):
        if line != wanted:
            return f"line {number}: expected {wanted[:80]!r}, got {line[:80]!r}"
    if len(got) != len(want):
        return f"expected {len(want)} lines, got {len(got)}"
    return None


def _trimmed_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


_INTEGER = re.compile(r"[+-]?[0-9]+\Z")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")


def compare_tokens(output: str, expected: str, tolerance: float | None = None) -> str | None:
    """Whitespace tokens equal; with a tolerance, numbers within it (absolute, or relative to the expected)."""
    got, want = output.split(), expected.split()
    for number, (token, wanted) in enumerate(zip(got, want), 1):
        if token != wanted and (tolerance is None or not _close(token, wanted, tolerance)):
            return f"token {number}: expected {wanted[:80]!r}, got {token[:80]!r}"
    if len(got) != len(want):
        return f"expected {len(want)} tokens, got {len(got)}"
    return None


def _close(token: str, wanted: str, tolerance: float) -> bool:
    if not (_NUMBER.match(token) and _NUMBER.match(wanted)):
        return False
    if _INTEGER.match(wanted):  # "+7" is 7; an integer answer gets no tolerance, however the token is written
        return Decimal(token) == Decimal(wanted)
    got, want = float(token), float(wanted)
    return abs(got - want) <= tolerance * max(1.0, abs(want))


def compare_stdout(output: str, expected: str) -> str | None:
    """LiveCodeBench's check; None when the output is accepted, else why not."""
    got, want = _stripped_lines(output), _stripped_lines(expected)
    if len(got) != len(want):
        return f"expected {len(want)} lines, got {len(got)}"
    for number, (line, wanted) in enumerate(zip(got, want), 1):
        if line == wanted:
            continue
        got_decimals, want_decimals = _decimals(line), _decimals(wanted)
        if got_decimals is None or want_decimals is None or not _same_decimals(got_decimals, want_decimals):
            return f"line {number}: expected {wanted[:80]!r}, got {line[:80]!r}"
    return None


def compare_sandboxfusion(output: str, expected: str) -> str | None:
    """SandboxFusion's check_stdio_test_case: the stripped texts' lines (one trailing empty line dropped on
    either side), each pair equal stripped and lower-cased, or both floats within relative 1e-5."""
    got, want = output.strip().split("\n"), expected.strip().split("\n")
    if len(got) - len(want) == 1 and got[-1] == "":
        got = got[:-1]
    if len(want) - len(got) == 1 and want[-1] == "":
        want = want[:-1]
    if len(got) != len(want):
        return f"expected {len(want)} lines, got {len(got)}"
    for number, (line, wanted) in enumerate(zip(got, want), 1):
        if line.lower().strip() == wanted.lower().strip():
            continue
        try:
            a, b = float(line.lower()), float(wanted.lower())
        except ValueError:
            return f"line {number}: expected {wanted[:80]!r}, got {line[:80]!r}"
        if not abs(a - b) / max(abs(b), 1e-10) < 1e-5:
            return f"line {number}: expected {wanted[:80]!r}, got {line[:80]!r} (relative 1e-5)"
    return None


def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(token) for token in line.split()]
    except InvalidOperation:
        return None


def _same_decimals(a: list[Decimal], b: list[Decimal]) -> bool:
    try:
        return a == b
    except InvalidOperation:  # a signalling NaN ("sNaN") raises when compared: it equals nothing
        return False


class _Judge:
    def __init__(self, mode: str, tolerance: float, checker: str | None):
        self.mode, self.tolerance, self.checker = mode, tolerance, checker

    def __call__(self, given: str, expected: str, actual: bytes, executor: Executor,
                 options: GradeOptions, pool: WarmPool | None) -> tuple[CaseStatus, str]:
        if self.mode != "checker":
            mismatch = compare_output(self.mode, actual.decode("utf-8", "replace"), expected, self.tolerance)
            return (CaseStatus.PASSED, "") if mismatch is None else (CaseStatus.FAILED, mismatch)
        files = {CHECKER_FILE: self.checker.encode(), INPUT_FILE: given.encode(), EXPECTED_FILE: expected.encode(),
                 ACTUAL_FILE: actual}
        result = run_warm(pool, executor, RunRequest(
            argv=(options.python, CHECKER_FILE, INPUT_FILE, EXPECTED_FILE, ACTUAL_FILE), files=files,
            env=dict(options.env), timeout=options.stdio_timeout, memory_mb=options.memory_mb,
            max_output=options.max_output))
        failure = process_failure(result)
        if failure:
            return CaseStatus.ERROR, f"checker: {failure[1]}"
        if result.exit_code == 0:
            return CaseStatus.PASSED, ""
        said = last_line(result.stdout.decode("utf-8", "replace")) or last_line(result.stderr.decode("utf-8", "replace"))
        return CaseStatus.FAILED, f"checker rejected (exit code {result.exit_code}){': ' + said if said else ''}"


def _run_stdin(name: str, solution: str, given: str, expected: str, executor: Executor,
               options: GradeOptions, judge: _Judge, pool: WarmPool | None) -> CaseResult:
    result = run_warm(pool, executor, RunRequest(argv=(options.python, SOLUTION_FILE), stdin=given.encode(),
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
    else:  # the expected output is not in the candidate's request: only the judge (a checker's run) sees it
        status, reason = judge(given, expected, result.stdout, executor, options, pool)
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
              options: GradeOptions, pool: WarmPool | None) -> CaseResult:
    files = {SOLUTION_FILE: solution, CALL_FILE: json.dumps({"fn_name": fn_name, "args": args})}
    request, nonce = harness_request(("call", SOLUTION_FILE, CALL_FILE), files, options.stdio_timeout, options)
    result = run_warm(pool, executor, request)
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
    except RecursionError:  # the solution's own json.dumps may write anything: nested past the parser's depth
        return CaseStatus.FAILED, "the return value is nested too deep to compare"
    if returned in accepted:
        return CaseStatus.PASSED, ""
    return CaseStatus.FAILED, f"expected {json.dumps(accepted[0])[:80]}, got {returned_json[:80]}"
