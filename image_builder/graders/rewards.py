"""verl custom reward functions, one for each way verl's reward managers call them (the README's verl
section gives each manager's config):

    compute_score(data_source, solution_str, ground_truth, extra_info)   one row: naive, dapo, prime, the
        reward loop (which runs it on its thread pool); given the batch keywords (data_sources=,
        solution_strs=, ground_truths=, extra_infos=) it is compute_score_batch
    compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos, workers=)   the batch
        manager: a list, one result a row, graded `workers` rows at a time on threads
    compute_score_async(...)   the reward loop's `async def`: the row graded on a thread, the loop free

The code is the last ```python block of the response (the MBPP prompt asks for
one), or the whole response when it has no fenced block and compiles as Python
(LiveCodeBench-style prompts ask for the bare program; prose does not compile).
The ground truth is verl's JSON string, dispatched on its keys (`assert_case`,
or `inputs`/`outputs`).

Every row's result has the same keys, as verl's reward manager needs for a batch:
`score` (fraction of tests passed), `all_passed` (1.0 or 0.0) and `graded`: 0.0
when the reward says nothing about the response (a malformed ground truth, a
task without an instance, bad grade options, the sandbox failing), each logged
in one line on the `image_builder.rewards` logger, so a trainer can mask those
rows. A response without code is graded: it scores 0. Only a missing store is a
configuration error, and raises. The result is a `Reward`, a dict whose `[0]`
is also the score: verl's prime manager reads `float(result[0])`.

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

A process opens the store's sessions (the instances' mounts, kept warm) at its first row and keeps them
for its life, shared by its threads. A process forked from one that has them (prime's process pool, made
anew for every batch) opens its own: the parent's are connections it goes on using (os.register_at_fork,
and a pid check).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading

from image_builder.runtime.execution import Executor
from image_builder.runtime.warm import worker_pool
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
# A batch's rows graded at once: ThreadPoolExecutor's default, as the reward loop's own thread pool.
DEFAULT_WORKERS = min(32, (os.cpu_count() or 1) + 4)

_executor: Executor | None = None
_executor_pid: int | None = None  # the process that called set_executor
_store_executors = None  # grading.StoreExecutors, opened on first use and kept for the process's life
_store_pid: int | None = None  # the process that opened it
_lock = threading.Lock()  # around opening it: the reward loop calls from many threads at once
_forked_from: int | None = None  # the parent whose set_executor executor this process dropped


class NotGraded(Exception):
    """Why a row's reward says nothing about its response."""


class Reward(dict):
    """One row's result: {"score", "all_passed", "graded"}, a plain dict to verl's naive, dapo, batch and
    reward-loop managers; `[0]` is the score too, which is what verl's prime manager reads of a result
    that is not a number (`float(result[0])`)."""

    __slots__ = ()

    def __getitem__(self, key):
        if key == 0 and isinstance(key, int) and not dict.__contains__(self, key):
            return dict.__getitem__(self, "score")
        return dict.__getitem__(self, key)


def set_executor(executor: Executor | None) -> None:
    """Use this executor for every task (tests; a trainer that manages its own instance). A process forked
    from this one does not use it (it is this process's, a session's connections to the holder)."""
    global _executor, _executor_pid
    _executor, _executor_pid = executor, os.getpid()


def _after_fork_in_child() -> None:
    """The parent's sessions are its connections to the mount holder, which it goes on using: a child
    writing to them too mixes the two's messages (runs that hang, or fail). Drop them (the child's copies
    of the descriptors close with their objects; nothing is sent) and the lock, which another of the
    parent's threads may have held at the fork: the child opens its own at its first row."""
    global _store_executors, _store_pid, _lock, _executor, _executor_pid, _forked_from
    _lock = threading.Lock()
    _store_executors = _store_pid = None
    if _executor is not None:
        _forked_from = _executor_pid
        _executor = _executor_pid = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _store_pool():
    """This process's StoreExecutors on $IMAGE_BUILDER_STORE, opened once (under the lock) and kept."""
    global _store_executors, _store_pid
    pool = _store_executors
    if pool is not None and _store_pid == os.getpid():
        return pool
    store = os.environ.get(STORE_ENV)
    if not store:
        why = "" if _forked_from is None else (
            f" (the executor given to set_executor is process {_forked_from}'s, which forked this one; call "
            "set_executor in this process)")
        raise GraderError(f"no executor for reward scoring: set {STORE_ENV} to the image store{why}")
    with _lock:
        if _store_executors is None or _store_pid != os.getpid():
            from image_builder.store.store import Store
            from .grading import StoreExecutors
            _store_executors, _store_pid = StoreExecutors(Store.open(store)), os.getpid()
        return _store_executors


def _executor_for(task: Task) -> Executor:
    """The task's instance in the store at $IMAGE_BUILDER_STORE, mounted once and kept warm."""
    executor = _executor
    if executor is not None and _executor_pid == os.getpid():
        return executor
    pool = _store_pool()
    from image_builder.store.store import UnknownInstance
    default = os.environ.get(INSTANCE_ENV) or None
    try:
        return pool.executor_for(task, default)
    except UnknownInstance:
        store = os.environ.get(STORE_ENV)
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


def _score_row(data_source, solution_str, ground_truth, extra_info) -> Reward:
    extra = extra_info if isinstance(extra_info, dict) else {}
    task_id = str(extra.get("task_id", extra.get("index", "")))
    try:
        options = _options(extra)
        task = parse_ground_truth(task_id, ground_truth, data_source=data_source)
        if isinstance(task, BadTask):
            raise NotGraded(task.reason)
        code = extract_code(solution_str or "")
        if code is None:
            return Reward(score=0.0, all_passed=0.0, graded=1.0)
        result = grade(task, code, _executor_for(task), options)
        if result.status in (TaskStatus.ERROR, TaskStatus.BAD_TASK):
            raise NotGraded(result.reason)
    except NotGraded as exc:
        LOG.warning("task %s not graded: %s", task_id or "?", exc)
        return Reward(score=0.0, all_passed=0.0, graded=0.0)
    return Reward(score=result.score, all_passed=float(result.passed), graded=1.0)


_ROW = object()  # compute_score's row arguments not given


def compute_score(data_source=_ROW, solution_str=_ROW, ground_truth=_ROW, extra_info: dict | None = None, *,
                  data_sources=None, solution_strs=None, ground_truths=None, extra_infos=None,
                  workers: int | None = None) -> Reward | list[Reward]:
    """One row's Reward ({"score", "all_passed", "graded"}, `[0]` the score): see the module docstring.
    Given verl's batch keywords instead (its batch manager), compute_score_batch's list."""
    batch = (data_sources, solution_strs, ground_truths, extra_infos)
    if any(b is not None for b in batch) or workers is not None:
        if any(a is not _ROW for a in (data_source, solution_str, ground_truth)) or extra_info is not None:
            raise TypeError("compute_score takes one row (data_source, solution_str, ground_truth, extra_info) "
                            "or a batch (data_sources=, solution_strs=, ground_truths=, extra_infos=), not both")
        return compute_score_batch(data_sources=data_sources, solution_strs=solution_strs,
                                   ground_truths=ground_truths, extra_infos=extra_infos, workers=workers)
    missing = [n for n, a in (("data_source", data_source), ("solution_str", solution_str),
                              ("ground_truth", ground_truth)) if a is _ROW]
    if missing:
        raise TypeError(f"compute_score() missing {', '.join(missing)}: give a row (data_source, solution_str, "
                        "ground_truth, extra_info) or a batch (data_sources=, solution_strs=, ground_truths=, "
                        "extra_infos=)")
    return _score_row(data_source, solution_str, ground_truth, extra_info)


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos=None, *,
                        workers: int | None = None) -> list[Reward]:
    """verl's batch manager's call: one Reward a row, in the rows' order, graded `workers` at a time
    (default DEFAULT_WORKERS) on threads of this process, in its sessions. Sequences of one length
    (numpy arrays too, as verl passes them)."""
    if data_sources is None or solution_strs is None or ground_truths is None:
        raise TypeError("compute_score_batch needs data_sources, solution_strs and ground_truths")
    n = len(solution_strs)
    if extra_infos is None:
        extra_infos = [None] * n
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError(f"a batch's columns differ in length: {len(data_sources)} data_sources, {n} solution_strs, "
                         f"{len(ground_truths)} ground_truths, {len(extra_infos)} extra_infos")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be a positive int, not {workers!r}")
    rows = list(zip(data_sources, solution_strs, ground_truths, extra_infos))
    workers = min(workers or DEFAULT_WORKERS, n)
    if workers <= 1:
        return [_score_row(*row) for row in rows]
    with worker_pool(workers, thread_name_prefix="image-builder-reward") as pool:
        return list(pool.map(lambda row: _score_row(*row), rows))


async def compute_score_async(data_source, solution_str, ground_truth, extra_info: dict | None = None) -> Reward:
    """compute_score as verl's reward loop awaits it: the row is graded on a thread (the loop's default
    executor), so the event loop goes on meanwhile."""
    return await asyncio.to_thread(_score_row, data_source, solution_str, ground_truth, extra_info)
