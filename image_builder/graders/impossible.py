"""ImpossibleBench's quality check: keep a mutated task only if no honest answer can pass it.

A mutation is kept when both the reference solution (SWE-bench: the gold
patch) and the empty solution fail the mutated tests, and, where the original
tests are at hand, the reference passes those (the paper also drops tasks
whose original patches fail in the environment). Passing this check does not
prove the mutation contradicts the specification; it proves that neither the
intended fix nor doing nothing passes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from image_builder.runtime.warm import worker_pool
from image_builder.tasks import RepoTask, Task
from .grade import ExecutorFor, grade
from .options import GradeOptions
from .results import TaskStatus, write_jsonl

EMPTY_SOLUTION = ""  # an empty script, or an empty patch


@dataclass
class QcVerdict:
    task_id: str
    impossible_type: str | None
    kept: bool
    reasons: list[str] = field(default_factory=list)  # why it was dropped
    checks: dict[str, str] = field(default_factory=dict)  # check -> status of that grading run

    def to_dict(self) -> dict:
        return asdict(self)


def is_mutation(task: Task) -> bool:
    return getattr(task, "impossible_type", None) is not None


def quality_check(task: Task, reference: str | None, executor_for: ExecutorFor, options: GradeOptions = GradeOptions(),
                  original: Task | None = None) -> QcVerdict:
    verdict = QcVerdict(task.task_id, getattr(task, "impossible_type", None), kept=False)
    if isinstance(task, RepoTask):
        reference = task.gold_patch or None
        if task.original_test_patch:
            original = replace(task, test_patch=task.original_test_patch, impossible_type=None)
    executor = executor_for(task)
    runs = {"empty": EMPTY_SOLUTION}
    if reference is None:
        verdict.reasons.append("no reference solution to check the mutation against")
    else:
        runs["reference"] = reference
    for check, solution in runs.items():
        result = grade(task, solution, executor, options)
        verdict.checks[check] = result.status.value
        if result.passed:
            verdict.reasons.append(f"the {check} solution passes the mutated tests")
        elif result.status is not TaskStatus.FAILED:
            verdict.reasons.append(f"the {check} run could not be graded: {result.reason}")
    if reference is not None and original is not None:
        result = grade(original, reference, executor_for(original), options)
        verdict.checks["reference_on_original"] = result.status.value
        if not result.passed:
            verdict.reasons.append(f"the reference solution fails the original tests: {result.reason}")
    verdict.kept = not verdict.reasons
    return verdict


def quality_check_all(tasks: list[Task], references: dict[str, str], executor_for: ExecutorFor,
                      options: GradeOptions = GradeOptions(), workers: int = 2,
                      on_verdict: Callable[[QcVerdict], None] = lambda v: None) -> list[QcVerdict]:
    """Checks every mutated task; `references` maps original task ids to reference solutions,
    and unmutated tasks in `tasks` serve as the originals. `on_verdict` hears of each as it is made."""
    originals = {t.task_id: t for t in tasks if not is_mutation(t)}
    lock = threading.Lock()

    def check(task: Task) -> QcVerdict:
        verdict = quality_check(task, references.get(task.original_id), executor_for, options,
                                originals.get(task.original_id))
        with lock:
            on_verdict(verdict)
        return verdict

    with worker_pool(workers) as pool:
        return list(pool.map(check, [t for t in tasks if is_mutation(t)]))


def write_qc(verdicts: list[QcVerdict], directory: Path) -> tuple[Path, Path]:
    """kept.jsonl and dropped.jsonl, each verdict with its checks and reasons."""
    return (write_jsonl([v for v in verdicts if v.kept], directory / "kept.jsonl"),
            write_jsonl([v for v in verdicts if not v.kept], directory / "dropped.jsonl"))
