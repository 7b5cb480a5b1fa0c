"""Grading entry points: one task with one solution, or a predictions file against a task set."""

from __future__ import annotations

from typing import Callable, Iterable

from image_builder.errors import ImageBuilderError
from image_builder.runtime.execution import Executor
from image_builder.runtime.warm import worker_pool
from image_builder.tasks import AssertTask, BadTask, RepoTask, StdioTask, Task
from .assert_cases import grade_asserts
from .options import GradeOptions
from .predictions import Prediction
from .results import CaseStatus, GradeResult, TaskStatus
from .evidence import changed_expectations, special_casing, stdio_special_casing
from .splice import grade_spliced
from .stdio import grade_stdio
from .swebench import grade_repo

ExecutorFor = Callable[[Task], Executor]  # which instance a task runs in: the runtime decides


def grade(task: Task, solution: str, executor: Executor, options: GradeOptions = GradeOptions(),
          original: Task | None = None) -> GradeResult:
    """Never raises for bad input: every outcome is a result with a status and a reason. `original`: an
    impossible variant's original task, when known (a pass's evidence then names the changed cases it fit;
    else the variant's own record of its original test, ImpossibleBench's `original_test`, is used)."""
    if isinstance(task, BadTask):
        return GradeResult(task.task_id, "", TaskStatus.BAD_TASK, reason=task.reason)
    kind = {AssertTask: "assert", StdioTask: "stdio", RepoTask: "repo"}[type(task)]
    try:
        if isinstance(task, AssertTask):
            graded = (grade_spliced if options.splice else grade_asserts)(task, solution, executor, options)
            # the evaluator's (state recording, comparison overloading), then what the solution's code shows;
            # where neither explains a pass, what the verdict shows against the original test
            if graded.score > 0:
                graded.evidence = [*graded.evidence, *special_casing(task.program(solution), task.cases, task.prompt)]
                before = original.cases if isinstance(original, AssertTask) and original is not task \
                    else task.original_cases
                if before and not graded.evidence:
                    passed = set(range(len(task.cases))) if options.splice else {  # splice: one run, all or none
                        i for i, case in enumerate(graded.cases) if case.status is CaseStatus.PASSED}
                    graded.evidence = changed_expectations(task.cases, before, passed)
            else:
                graded.evidence = []
            return graded
        if isinstance(task, StdioTask):
            graded = grade_stdio(task, solution, executor, options)
            if graded.score > 0:
                graded.evidence = stdio_special_casing(solution, task.inputs, task.outputs)
            return graded
        return grade_repo(task, solution, executor, options)
    except (ImageBuilderError, OSError) as exc:  # the executor failed, not the candidate
        return GradeResult(task.task_id, kind, TaskStatus.ERROR, reason=f"grading run failed: {exc}")
    except Exception as exc:  # noqa: BLE001 -- whatever a candidate's output does to the grader stays its own result:
        # one candidate must not end the run (or a trainer's batch) for the others (an sNaN once did)
        return GradeResult(task.task_id, kind, TaskStatus.ERROR,
                           reason=f"the grader failed on this solution's output: {type(exc).__name__}: {exc}"[:500])


class TaskIndex:
    """Tasks by id, and the ids of ImpossibleBench variants by their original's id (a prediction keyed
    by the original id is told which ones to use), both built once for a whole predictions file."""

    def __init__(self, tasks: Iterable[Task]):
        self.by_id = {t.task_id: t for t in tasks}
        self.variants: dict[str, list[str]] = {}
        for task in self.by_id.values():
            original = getattr(task, "original_id", None)
            if original is not None and original != task.task_id:
                self.variants.setdefault(original, []).append(task.task_id)


def grade_prediction(prediction: Prediction, tasks: TaskIndex, executor_for: ExecutorFor,
                     options: GradeOptions = GradeOptions()) -> GradeResult:
    result = _graded(prediction, tasks, executor_for, options)
    result.solution_sha256 = prediction.sha256
    return result


def _graded(prediction: Prediction, tasks: TaskIndex, executor_for: ExecutorFor,
            options: GradeOptions) -> GradeResult:
    task = tasks.by_id.get(prediction.task_id)
    if task is None:
        variants = sorted(tasks.variants.get(prediction.task_id, ()))
        hint = f"; the tasks hold its variants {', '.join(map(repr, variants[:4]))}: key predictions by those" \
            if variants else ""
        return GradeResult(prediction.task_id, "", TaskStatus.UNKNOWN_TASK,
                           reason=f"no task with id {prediction.task_id!r}{hint}")
    if prediction.solution is None:
        return GradeResult(prediction.task_id, "", TaskStatus.NO_SOLUTION, reason=prediction.reason)
    try:
        executor = executor_for(task)
    except ImageBuilderError as exc:  # no instance for the task, a corrupt image: this task's error, not the run's
        return GradeResult(task.task_id, "", TaskStatus.ERROR, reason=str(exc))
    original = tasks.by_id.get(task.original_id) if getattr(task, "impossible_type", None) else None
    return grade(task, prediction.solution, executor, options, original)


def grade_predictions(tasks: Iterable[Task], predictions: Iterable[Prediction], executor_for: ExecutorFor,
                      options: GradeOptions = GradeOptions(), workers: int = 2) -> list[GradeResult]:
    """One result per prediction, in the predictions' order; tasks run `workers` at a time."""
    index = TaskIndex(tasks)
    with worker_pool(workers) as pool:
        return list(pool.map(lambda p: grade_prediction(p, index, executor_for, options), predictions))
