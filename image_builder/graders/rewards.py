"""verl custom reward function: `custom_reward_function.path=<this file>`, `name=compute_score`.

The code is the last ```python block of the response (the MBPP prompt asks for
one); the ground truth is verl's JSON string, dispatched on its keys
(`assert_case`, or `inputs`/`outputs`). A malformed ground truth or a response
without code scores 0; a missing executor is a configuration error and raises.

Each task runs in the store's instance named by `extra_info.task_id` (or in
$IMAGE_BUILDER_INSTANCE when the store has none for it), inside the sandbox:

    export IMAGE_BUILDER_STORE=/shared/stores/mbpp
    python -m verl.trainer.main_ppo ... \
        custom_reward_function.path=$(python -c 'import image_builder.rewards as r; print(r.__file__)') \
        custom_reward_function.name=compute_score
"""

from __future__ import annotations

import os

from image_builder.runtime.execution import Executor
from image_builder.tasks import BadTask, Task, parse_ground_truth
from .errors import GraderError
from .grade import grade
from .options import GradeOptions
from .predictions import extract_code

STORE_ENV = "IMAGE_BUILDER_STORE"
INSTANCE_ENV = "IMAGE_BUILDER_INSTANCE"  # the instance for tasks that have none of their own
OPTIONS = GradeOptions()
_executor: Executor | None = None
_store_executors = None  # grading.StoreExecutors, opened on first use and kept for the trainer's life


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
    try:
        return _store_executors(task)
    except UnknownInstance:
        default = os.environ.get(INSTANCE_ENV)
        if not default:
            raise GraderError(f"task {task.task_id!r} has no instance in {store}; set {INSTANCE_ENV} to the "
                              "instance that grades tasks without their own") from None
        return _store_executors.for_instance(default)


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """{"score": fraction of tests passed, "all_passed": 1.0 or 0.0}; verl logs the extra key."""
    task_id = str((extra_info or {}).get("task_id", (extra_info or {}).get("index", "")))
    task = parse_ground_truth(task_id, ground_truth, data_source=data_source)
    code = extract_code(solution_str or "")
    if code is None or isinstance(task, BadTask):
        return {"score": 0.0, "all_passed": 0.0}
    result = grade(task, code, _executor_for(task), OPTIONS)
    return {"score": result.score, "all_passed": float(result.passed)}
