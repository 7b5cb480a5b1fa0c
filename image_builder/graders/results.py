"""What grading gives back: one record per graded task, JSONL output and a summary.

Every input yields a record, never an exception: a malformed task, an unknown
task id, a patch that does not apply, a hanging or flooding solution each get
a status and a one-line reason.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from image_builder.store.files import atomic_write


class CaseStatus(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"  # the check ran and said no: an assertion, a wrong answer
    ERROR = "error"  # the code did not get to the check: exception, crash, early exit, limit
    TIMEOUT = "timeout"


class TaskStatus(str, enum.Enum):
    PASSED = "passed"  # every case passed; for repo tasks: resolved
    FAILED = "failed"
    BAD_TASK = "bad_task"  # the task record cannot be graded (malformed ground truth)
    UNKNOWN_TASK = "unknown_task"  # a prediction names no known task
    NO_SOLUTION = "no_solution"  # nothing to run: no code block in the response
    PATCH_FAILED = "patch_failed"  # the candidate patch does not apply, or is refused
    ERROR = "error"  # the grading run itself failed (executor error, test patch does not apply)


@dataclass
class CaseResult:
    name: str  # the case's index for assert and stdio tasks
    status: CaseStatus
    reason: str = ""
    stderr_tail: str = ""
    wall_time: float = 0.0


@dataclass
class RepoReport:
    """A repo-test run (SWE-bench style): what was applied, reverted, run and parsed."""
    access: str
    patch_applied_with: str | None  # the command that applied the candidate patch; None if empty or failed
    reverted_files: list[str]  # candidate changes to test files undone before the tests ran
    test_command: str
    test_exit_code: int | None
    timed_out: bool
    fail_to_pass: dict[str, str]  # test id -> PASSED/FAILED/ERROR/SKIPPED/XFAIL/MISSING/MISMATCH
    pass_to_pass: dict[str, str]
    resolved: bool
    crosscheck: str  # "junit" (log and junit agree or the test fails), "runner" (log and the runner's own
    # output agree on a pass, runner_tee.py), "log-only", "junit-missing"
    mismatches: list[str] = field(default_factory=list)  # tests whose log and junit statuses differ
    # read-only/hidden: candidate changes to test infrastructure undone before the tests ran, as
    # "tests/conftest.py" (whole file) or "setup.cfg [tool:pytest]" (a pytest section)
    dropped_changes: list[str] = field(default_factory=list)
    # open: the same changes, left standing
    test_infrastructure_modified: list[str] = field(default_factory=list)
    # changes the candidate's code made to the test runner as the tests ran (runner_tee.py's guard), as
    # "_pytest.reports.TestReport.from_item_and_call set (src/pkg/__init__.py:12)": fails the run but in open mode
    runner_changes: list[str] = field(default_factory=list)
    # the environment's install run again after the candidate patch (its exit status; None: not run)
    reinstall_exit_code: int | None = None
    apply_log: str = ""
    log: str = ""  # the test command's output, between the run's markers
    network: bool = False  # the tests ran with the network (grade --net)


@dataclass
class GradeResult:
    task_id: str
    kind: str  # "assert", "stdio", "repo"; "" when the task is unknown or malformed
    status: TaskStatus
    score: float = 0.0  # fraction of cases passed; repo tasks: 1.0 if resolved
    reason: str = ""
    cases: list[CaseResult] = field(default_factory=list)
    repo: RepoReport | None = None
    compare: str = ""  # stdin/stdout tasks: how the output was compared (stdio.py's modes)
    mode: str = ""  # "splice": answer and tests in one process (splice.py); "": the evaluator's, the default
    # Cheat evidence the grader saw in a passing solution (evidence.py): on an impossible variant the pass's
    # explanation, elsewhere a warning.
    evidence: list[str] = field(default_factory=list)
    solution_sha256: str = ""  # of the graded solution or patch: a resumed run checks it is the same
    # Repo tasks: the run's files (eval.sh, model.patch, test_output.txt, junit.xml, run.json), kept beside
    # the results file (grading.write_artifacts) and read by `regrade`; not part of the record.
    artifacts: dict[str, str] | None = field(default=None, compare=False, repr=False)

    @property
    def passed(self) -> bool:
        return self.status is TaskStatus.PASSED

    def to_dict(self) -> dict:
        record = asdict(self)
        del record["artifacts"]
        return {**record, "passed": self.passed}

    @classmethod
    def from_dict(cls, d: dict) -> GradeResult:
        """A result read back from a results file (to resume or summarise a run)."""
        return cls(d["task_id"], d["kind"], TaskStatus(d["status"]), d.get("score", 0.0), d.get("reason", ""),
                   [CaseResult(**{**c, "status": CaseStatus(c["status"])}) for c in d.get("cases", [])],
                   RepoReport(**d["repo"]) if d.get("repo") else None, d.get("compare", ""),
                   d.get("mode", ""), list(d.get("evidence", [])), d.get("solution_sha256", ""))


def from_cases(task_id: str, kind: str, cases: list[CaseResult], label: str) -> GradeResult:
    """A task graded case by case: the fraction passed, and the first miss as the reason."""
    passed = sum(c.status is CaseStatus.PASSED for c in cases)
    miss = next((c for c in cases if c.status is not CaseStatus.PASSED), None)
    return GradeResult(task_id, kind, TaskStatus.PASSED if miss is None else TaskStatus.FAILED,
                       score=passed / len(cases), cases=cases,
                       reason="" if miss is None else f"{label} {miss.name}: {miss.reason}")


@dataclass
class Summary:
    total: int
    passed: int
    pass_rate: float
    mean_score: float
    by_status: dict[str, int]
    case_timeouts: int  # cases that hit their time limit, over all tasks
    tasks_with_timeouts: int  # tasks with at least one timed-out case or a timed-out test run
    # The first ids of each status that is neither a pass nor a fail (unknown_task, bad_task, error, ...),
    # so that a prediction keyed by the wrong id is never silent.
    first_ids: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(results: Iterable[GradeResult]) -> Summary:
    results = list(results)
    total = len(results)
    passed = sum(r.passed for r in results)
    timeouts = [sum(c.status is CaseStatus.TIMEOUT for c in r.cases) + bool(r.repo and r.repo.timed_out)
                for r in results]
    return Summary(total=total, passed=passed, pass_rate=passed / total if total else 0.0,
                   mean_score=sum(r.score for r in results) / total if total else 0.0,
                   by_status=dict(Counter(r.status.value for r in results)),
                   case_timeouts=sum(timeouts), tasks_with_timeouts=sum(t > 0 for t in timeouts),
                   first_ids=_first_ids(results))


def _first_ids(results: list[GradeResult], keep: int = 5) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for r in results:
        if r.status not in (TaskStatus.PASSED, TaskStatus.FAILED) and len(found.setdefault(r.status.value, [])) < keep:
            found[r.status.value].append(r.task_id)
    return found


def write_jsonl(records: Iterable, path: Path) -> Path:
    """Writes records that have a to_dict() (results, qc verdicts), one JSON object a line, published
    whole (a temporary file, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.writelines(json.dumps(r.to_dict()).encode() + b"\n" for r in records))
    return path
