"""verl custom reward function: `custom_reward_function.path=<this file>`, `name=compute_score`.

The code is the last ```python block of the response (the MBPP prompt asks for
one), or the whole response when it has no fenced block and compiles as Python
(LiveCodeBench-style prompts ask for the bare program; prose does not compile).
The ground truth is verl's JSON string, dispatched on its keys (`assert_case`,
or `inputs`/`outputs`).

Every call returns the same keys, as verl's reward manager needs for a batch:
`score` (fraction of tests passed), `all_passed` (1.0 or 0.0) and `graded`: 0.0
when the reward says nothing about the response (a malformed ground truth, a
task without an instance, bad grade options, the sandbox failing), each logged
in one line on the `image_builder.rewards` logger, so a trainer can mask those
rows. A response without code is graded: it scores 0. Only a missing store is a
configuration error, and raises.

Each task runs in the store's instance named by `extra_info.task_id` (or in
$IMAGE_BUILDER_INSTANCE when the store has none for it), inside the sandbox.
Grade options (graders.options.GradeOptions.SETTABLE: strict, case_timeout,
stdio_timeout, memory_mb, compare) come from $IMAGE_BUILDER_GRADE_OPTIONS, a JSON
object, and per row from `extra_info["grade_options"]`, which wins:

    export IMAGE_BUILDER_STORE=/shared/stores/mbpp
    export IMAGE_BUILDER_GRADE_OPTIONS='{"strict": true}'
    python -m verl.trainer.main_ppo ... \
        custom_reward_function.path=$(python -c 'import image_builder.rewards as r; print(r.__file__)') \
        custom_reward_function.name=compute_score
"""

from __future__ import annotations

import json
import logging
import os

from image_builder.runtime.execution import Executor
from image_builder.tasks import BadTask, Task, parse_ground_truth
from .errors import GraderError
from .grade import grade
from .options import GradeOptions
from .predictions import extract_code
from .results import TaskStatus

STORE_ENV = "IMAGE_BUILDER_STORE"
INSTANCE_ENV = "IMAGE_BUILDER_INSTANCE"  # the instance for tasks that have none of their own
OPTIONS_ENV = "IMAGE_BUILDER_GRADE_OPTIONS"
LOG = logging.getLogger("image_builder.rewards")
_executor: Executor | None = None
_store_executors = None  # grading.StoreExecutors, opened on first use and kept for the trainer's life


class NotGraded(Exception):
    """Why a row's reward says nothing about its response."""


def set_executor(executor: Executor | None) -> None:
    """Use this executor for every task (tests; a trainer that manages its own instance)."""
    global _executor
    _executor = executor


def _executor_for(task: Task) -> Executor:
    """The task's instance in the store at $IMAGE_BUILDER_STORE, mounted once and kept warm."""
    global _store_executors
    if _executor is not None:
        return _executor
    store = os.environ.get(STORE_ENV)
    if not store:
        raise GraderError(f"no executor for reward scoring: set {STORE_ENV} to the image store")
    if _store_executors is None:
        from image_builder.store.store import Store
        from .grading import StoreExecutors
        _store_executors = StoreExecutors(Store.open(store))
    from image_builder.store.store import UnknownInstance
    default = os.environ.get(INSTANCE_ENV) or None
    try:
        return _store_executors.executor_for(task, default)
    except UnknownInstance:
        raise NotGraded(f"no instance in {store}; set {INSTANCE_ENV} to the instance that grades tasks without "
                        "their own" if default is None else f"no instance {default!r} ({INSTANCE_ENV}) in {store}"
                        ) from None


def _options(extra_info: dict) -> GradeOptions:
    options = GradeOptions()
    text = os.environ.get(OPTIONS_ENV)
    if text:
        try:
            options = options.updated(json.loads(text))
        except ValueError as exc:
            raise NotGraded(f"{OPTIONS_ENV}: {exc}") from None
    if "grade_options" in extra_info:
        try:
            options = options.updated(extra_info["grade_options"])
        except ValueError as exc:
            raise NotGraded(f"extra_info.grade_options: {exc}") from None
    return options


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """{"score", "all_passed", "graded"}: see the module docstring."""
    extra = extra_info if isinstance(extra_info, dict) else {}
    task_id = str(extra.get("task_id", extra.get("index", "")))
    try:
        options = _options(extra)
        task = parse_ground_truth(task_id, ground_truth, data_source=data_source)
        if isinstance(task, BadTask):
            raise NotGraded(task.reason)
        code = extract_code(solution_str or "")
        if code is None:
            return {"score": 0.0, "all_passed": 0.0, "graded": 1.0}
        result = grade(task, code, _executor_for(task), options)
        if result.status in (TaskStatus.ERROR, TaskStatus.BAD_TASK):
            raise NotGraded(result.reason)
    except NotGraded as exc:
        LOG.warning("task %s not graded: %s", task_id or "?", exc)
        return {"score": 0.0, "all_passed": 0.0, "graded": 0.0}
    return {"score": result.score, "all_passed": float(result.passed), "graded": 1.0}
