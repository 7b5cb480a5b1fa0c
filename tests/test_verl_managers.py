"""verl's reward managers calling the reward function, each the way verl calls it, on real MBPP rows graded
in the store's sandbox: naive/dapo (keywords, a row at a time), batch (the batch keywords, a list back),
prime (a fork-started process pool per batch, `float(result[0])`), the reward loop (a thread per row from
the event loop, or the `async def` variant), and eight threads at once.

The small functions below mirror verl's own calling code (volcengine/verl, the file named in each); the
reward function is loaded as verl loads it: by its file path, outside any package."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import inspect
import json
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest

import image_builder.rewards
from image_builder.graders import rewards
from image_builder.graders.errors import GraderError
from image_builder.graders.grading import StoreExecutors
from image_builder.store.store import Store
from tests.conftest import ROOT

DATA = ROOT / "index/data"
WRONG = "```python\ndef f():\n    pass\n```"


def _rows() -> list[dict]:
    solutions = {str(json.loads(line)["task_id"]): json.loads(line)["solution"]
                 for line in (DATA / "mbpp_train_40_solutions.jsonl").read_text().splitlines()}
    rows = pq.read_table(DATA / "mbpp_train_40.parquet").to_pylist()
    return [{**row, "solution": solutions[str(row["extra_info"]["task_id"])]} for row in rows]


ROWS = _rows()


def batch_of(start: int, n: int) -> list[tuple[dict, str, float]]:
    """(row, response, expected score): each row twice, its reference solution (1) and a wrong answer (0)."""
    out = []
    for row in ROWS[start:start + n]:
        out.append((row, f"Here is my solution:\n```python\n{row['solution']}\n```", 1.0))
        out.append((row, WRONG, 0.0))
    return out


# --- verl's side ---------------------------------------------------------------------------------------------

def _call_with_kwargs(raw_fn, extra_kwargs, *args, **kwargs):
    # verl/trainer/ppo/reward.py: _call_with_kwargs (reward_kwargs win over the call's)
    return raw_fn(*args, **{**kwargs, **extra_kwargs})


async def _call_with_kwargs_async(raw_fn, extra_kwargs, *args, **kwargs):
    # verl/trainer/ppo/reward.py: _call_with_kwargs_async
    return await raw_fn(*args, **{**kwargs, **extra_kwargs})


def custom_reward_fn(name: str, reward_kwargs: dict | None = None):
    """verl/trainer/ppo/reward.py get_custom_reward_fn + verl/utils/import_utils.py load_module: the file at
    custom_reward_function.path executed as a module of its own name, not put in sys.modules; the
    function wrapped in a partial (async functions in the async wrapper)."""
    path = image_builder.rewards.__file__
    spec = importlib.util.spec_from_file_location(f"custom_module_{hash(os.path.abspath(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert spec.name not in sys.modules
    raw_fn = getattr(module, name)
    wrap = _call_with_kwargs_async if inspect.iscoroutinefunction(raw_fn) else _call_with_kwargs
    return partial(wrap, raw_fn, dict(reward_kwargs or {}))


def naive_manager(compute_score, batch) -> tuple[list[float], dict[str, list]]:
    """verl/workers/reward_manager/naive.py NaiveRewardManager.__call__ (dapo.py calls it the same way):
    keywords, one row at a time; a dict's "score" is the reward, its other keys the extra info."""
    rewards_, extra = [], defaultdict(list)
    for row, response, _ in batch:
        extra_info = dict(row["extra_info"])
        extra_info["num_turns"] = None
        extra_info["rollout_reward_scores"] = {}
        score = compute_score(data_source=row["data_source"], solution_str=response,
                              ground_truth=row["reward_model"]["ground_truth"], extra_info=extra_info)
        rewards_.append(_reward(score, extra))
    return rewards_, extra


def _reward(score, extra: dict[str, list]):
    """How both managers read a row's score: a dict's "score" is the reward, its keys go to the extra info."""
    if not isinstance(score, dict):
        return score
    for key, value in score.items():
        extra[key].append(value)
    return score["score"]


def batch_manager(compute_score, batch, **reward_kwargs) -> tuple[list[float], dict[str, list]]:
    """verl/workers/reward_manager/batch.py BatchRewardManager.verify + __call__: one call for the batch with
    the plural keywords (data_sources and extra_infos are numpy object arrays, DataProto's non-tensor batch);
    a list back, one score (a number or a dict) per row."""
    data_sources = np.array([row["data_source"] for row, _, _ in batch], dtype=object)
    extras = np.empty(len(batch), dtype=object)
    for i, (row, _, _) in enumerate(batch):
        extras[i] = dict(row["extra_info"])
        extras[i]["rollout_reward_scores"] = {}
    scores = compute_score(data_sources=data_sources, solution_strs=[response for _, response, _ in batch],
                           ground_truths=[row["reward_model"].get("ground_truth", None) for row, _, _ in batch],
                           extra_infos=extras, **reward_kwargs)
    extra = defaultdict(list)
    return [_reward(scores[i], extra) for i in range(len(batch))], extra


PRIME_TIMEOUT = 60.0  # verl waits 300 s a row


async def _prime_single(evaluation_func, completion, reference, task, task_extra_info, executor, timeout):
    # verl/workers/reward_manager/prime.py single_compute_score: positional arguments, in the process pool
    loop = asyncio.get_event_loop()
    try:
        future = loop.run_in_executor(executor, partial(evaluation_func, task, completion, reference, task_extra_info))
        return await asyncio.wait_for(future, timeout=timeout)
    except asyncio.TimeoutError:
        return "timeout"
    except Exception as e:
        return e


def prime_manager(compute_score, batch, num_processes: int = 4) -> tuple[list[float], list]:
    """verl/workers/reward_manager/prime.py run_reward_scoring + parallel_compute_score_async: a new event
    loop and a new ProcessPoolExecutor (fork: Linux's default start method, as verl leaves it) per batch,
    its workers terminated after; None/an exception scores 0, a number is the score, else float(result[0]).
    Also returns what failed (verl prints it and scores 0)."""
    async def scoring():
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=num_processes, mp_context=context) as executor:
            try:
                return await asyncio.gather(*[
                    _prime_single(compute_score, response, row["reward_model"]["ground_truth"], row["data_source"],
                                  row["extra_info"], executor, PRIME_TIMEOUT) for row, response, _ in batch])
            finally:
                for pid in list(executor._processes):
                    try:
                        p = psutil.Process(pid)
                        p.terminate()
                        try:
                            p.wait(timeout=5)
                        except psutil.TimeoutExpired:
                            p.kill()
                    except psutil.Error:
                        pass

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        results = loop.run_until_complete(scoring())
    finally:
        loop.close()
        asyncio.set_event_loop(None)
    scores, failed = [], []
    for result in results:
        if result is None or isinstance(result, Exception) or result == "timeout":
            scores.append(0.0)
            failed.append(result)
        elif isinstance(result, int | float | bool):
            scores.append(float(result))
        else:
            try:
                scores.append(float(result[0]))
            except Exception as e:  # verl: the whole batch scores 0 ("Unexpected error during scoring")
                return [0.0] * len(batch), [repr(e)]
    return scores, failed


def reward_loop_manager(compute_score, batch) -> list[dict]:
    """verl/experimental/reward_loop/reward_loop.py RewardLoopWorker.compute_score_batch (a task per row,
    gathered) + reward_manager/naive.py run_single: an async function is awaited, a plain one runs on the
    loop's default thread pool."""
    is_async = inspect.iscoroutinefunction(compute_score)

    async def run_single(row, response):
        loop = asyncio.get_running_loop()
        extra_info = dict(row["extra_info"])
        extra_info["num_turns"] = None
        extra_info["rollout_reward_scores"] = {}
        kwargs = dict(data_source=row["data_source"], solution_str=response,
                      ground_truth=row["reward_model"]["ground_truth"], extra_info=extra_info)
        if is_async:
            result = await compute_score(**kwargs)
        else:
            result = await loop.run_in_executor(None, lambda: compute_score(**kwargs))
        if isinstance(result, dict):
            return {"reward_score": result["score"], "reward_extra_info": dict(result)}
        return {"reward_score": result, "reward_extra_info": {"acc": result}}

    async def compute_score_batch():
        return await asyncio.gather(*[asyncio.create_task(run_single(row, response)) for row, response, _ in batch])

    return asyncio.run(compute_score_batch())


# --- the tests -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def store_env(mbpp_store):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(rewards.STORE_ENV, str(mbpp_store))
        mp.delenv(rewards.INSTANCE_ENV, raising=False)
        mp.delenv(rewards.OPTIONS_ENV, raising=False)
        rewards.set_executor(None)
        yield mbpp_store
        _drop_pool()


def _drop_pool() -> None:
    if rewards._store_executors is not None:
        rewards._store_executors.close()
    rewards._store_executors = None
    gc.collect()


def expected(batch) -> list[float]:
    return [e for _, _, e in batch]


def test_naive_and_dapo_keyword_calls(store_env):
    batch = batch_of(0, 4)
    scores, extra = naive_manager(custom_reward_fn("compute_score"), batch)
    assert scores == expected(batch)
    assert extra["graded"] == [1.0] * len(batch) and extra["all_passed"] == expected(batch)


def test_batch_manager_gets_a_list_one_score_a_row(store_env):
    batch = batch_of(4, 4)
    for name in ("compute_score_batch", "compute_score"):  # either name takes the batch keywords
        scores, extra = batch_manager(custom_reward_fn(name), batch)
        assert scores == expected(batch), name
        assert extra["graded"] == [1.0] * len(batch), name
    # custom_reward_function.reward_kwargs reach the batch call: a bad one is refused, not ignored
    with pytest.raises(TypeError):
        batch_manager(custom_reward_fn("compute_score_batch", {"wrokers": 2}), batch)
    scores, _ = batch_manager(custom_reward_fn("compute_score_batch", {"workers": 2}), batch)
    assert scores == expected(batch)


def test_batch_keeps_the_process_sessions_across_batches(store_env):
    fn = custom_reward_fn("compute_score_batch")
    batch_manager(fn, batch_of(8, 2))
    pool = rewards._store_executors
    sessions = dict(pool._sessions)
    assert sessions  # the first batch opened the instance's session
    scores, _ = batch_manager(fn, batch_of(10, 2))
    assert scores == expected(batch_of(10, 2))
    assert rewards._store_executors is pool and dict(pool._sessions) == sessions  # the same sessions, warm


def test_eight_threads_at_once_share_one_pool(store_env):
    """verl's reward loop runs a plain compute_score on the loop's thread pool: many rows at once, in one
    process. One StoreExecutors is made for them all (its creation is locked), and every score is right.
    Unlocked, about one burst in five made two or more (each opening its own sessions) until the
    constructor was made to take 50 ms (_pools_made_during): now every burst does."""
    fn = custom_reward_fn("compute_score")
    batch = batch_of(26, 4)  # 8 rows, one a thread
    for burst in range(3):
        _drop_pool()
        results, pools = _pools_made_during(lambda: _all_at_once(fn, batch))
        assert [score for score, _ in results] == expected(batch), f"burst {burst}"
        assert [extra["graded"] for _, extra in results] == [1.0] * len(batch), f"burst {burst}"
        assert len(pools) == 1, f"burst {burst}: {len(pools)} StoreExecutors made by threads at once"
        assert pools[0] is rewards._store_executors


def _all_at_once(fn, batch) -> list[tuple[float, dict]]:
    """Each row on its own thread of eight, all let go at once."""
    barrier = threading.Barrier(len(batch))

    def one(item):
        barrier.wait()
        scores, extra = naive_manager(fn, [item])
        return scores[0], {k: v[0] for k, v in extra.items()}

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, batch))


def _pools_made_during(call) -> tuple[object, list[StoreExecutors]]:
    """call()'s result and every StoreExecutors made while it ran (its constructor recorded and made
    slow), with threads switching as often as they can: a creation that can race does. (A watcher thread
    polling gc.get_objects() did this before: the list it took held a reference to a tuple another
    thread was still building, and CPython's tuple() then failed with SystemError.)"""
    made: list[StoreExecutors] = []
    original = StoreExecutors.__init__

    def recording(self, *args, **kwargs):
        made.append(self)
        time.sleep(0.05)  # the other threads reach the check meanwhile
        original(self, *args, **kwargs)

    interval = sys.getswitchinterval()
    StoreExecutors.__init__ = recording
    sys.setswitchinterval(1e-6)
    try:
        result = call()
    finally:
        sys.setswitchinterval(interval)
        StoreExecutors.__init__ = original
    return result, made


def test_reward_loop_runs_the_plain_function_on_threads(store_env):
    batch = batch_of(30, 4)
    out = reward_loop_manager(custom_reward_fn("compute_score"), batch)
    assert [o["reward_score"] for o in out] == expected(batch)
    assert [o["reward_extra_info"]["graded"] for o in out] == [1.0] * len(batch)


SLOW_WRONG = "```python\nimport time\ntime.sleep(1.5)\ndef f():\n    pass\n```"


def test_async_variant_under_gather_leaves_the_loop_free(store_env):
    batch = batch_of(34, 3)
    fn = custom_reward_fn("compute_score_async")
    assert inspect.iscoroutinefunction(fn)  # what verl's reward loop checks to await it
    out = reward_loop_manager(fn, batch)
    assert [o["reward_score"] for o in out] == expected(batch)

    row = ROWS[37]

    async def main():
        gaps, last, done = [], time.monotonic(), False

        async def ticker():
            nonlocal last
            while not done:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        results = await asyncio.gather(*[
            rewards.compute_score_async(row["data_source"], response, row["reward_model"]["ground_truth"],
                                        row["extra_info"]) for response in (SLOW_WRONG, SLOW_WRONG, WRONG)])
        done = True
        await tick
        return results, gaps

    t0 = time.monotonic()
    results, gaps = asyncio.run(main())
    assert [r["score"] for r in results] == [0.0, 0.0, 0.0] and all(r["graded"] == 1.0 for r in results)
    assert time.monotonic() - t0 >= 1.5  # the slow answers did run
    assert max(gaps) < 0.5, f"the event loop stalled {max(gaps):.2f} s"  # graded on threads, not on the loop


def test_a_forked_child_opens_its_own_sessions(store_env):
    """A process forked after scoring (by os.fork, as multiprocessing's fork does) starts with no sessions
    and opens its own, even when another thread held the pool's lock at the fork (the child's copy of
    that lock is never released)."""
    fn = custom_reward_fn("compute_score")
    row, response, _ = batch_of(28, 1)[0]
    assert naive_manager(fn, batch_of(28, 1))[0] == [1.0, 0.0]
    parent_pool = rewards._store_executors
    read, write = os.pipe()
    lock = rewards._lock
    lock.acquire()  # held at the fork, as by another of the parent's threads opening the pool
    pid = os.fork()
    if pid == 0:  # the child (its copy of the lock held for good): report, never return into pytest
        try:
            inherited = rewards._store_executors
            result = rewards.compute_score(row["data_source"], response, row["reward_model"]["ground_truth"],
                                           row["extra_info"])
            own = rewards._store_executors
            os.write(write, json.dumps([inherited is None, own is not None and own is not parent_pool,
                                        dict(result)]).encode())
        finally:
            os._exit(0)
    lock.release()
    report = child_report(pid, read, write)
    assert report == [True, True, {"score": 1.0, "all_passed": 1.0, "graded": 1.0}]


def child_report(pid: int, read: int, write: int):
    """What the forked child `pid` wrote (JSON) on the pipe, or "the child hung" after 30 s (then killed)."""
    os.close(write)
    with os.fdopen(read) as f:
        ready, _, _ = select.select([f], [], [], 30)
        report = json.loads(f.read() or "null") if ready else "the child hung"
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return report


def test_a_forked_child_leaves_set_executor_to_its_parent(store_env):
    """An executor given to set_executor (a trainer's own instance: its sessions) is the parent's: a forked
    child does not use it; it grades in sessions of its own, or says what to do."""
    row, response, _ = batch_of(32, 1)[0]
    with StoreExecutors(Store.open(store_env)) as own:
        rewards.set_executor(own.for_instance(str(row["extra_info"]["task_id"])))
        try:
            args = (row["data_source"], response, row["reward_model"]["ground_truth"], row["extra_info"])
            assert rewards.compute_score(*args) == {"score": 1.0, "all_passed": 1.0, "graded": 1.0}
            assert own._sessions  # the parent's session, open
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    report = [rewards._executor is None]
                    store = os.environ.pop(rewards.STORE_ENV)
                    try:
                        rewards.compute_score(*args)
                        report.append("no error")
                    except GraderError as e:
                        report.append(str(e))
                    os.environ[rewards.STORE_ENV] = store
                    report.append(dict(rewards.compute_score(*args)))
                    os.write(write, json.dumps(report).encode())
                finally:
                    os._exit(0)
            report = child_report(pid, read, write)
        finally:
            rewards.set_executor(None)
    assert report == [True, f"no executor for reward scoring: set {rewards.STORE_ENV} to the image store (the "
                      f"executor given to set_executor is process {os.getpid()}'s, which forked this one; call "
                      "set_executor in this process)", {"score": 1.0, "all_passed": 1.0, "graded": 1.0}]


def score_only(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """What a trainer wrote for prime before compute_score's result could be read by it: the score alone."""
    return float(rewards.compute_score(data_source, solution_str, ground_truth, extra_info)["score"])


@pytest.mark.timeout(300)  # a hang is a failure, not a stuck run
def test_prime_process_pool_after_the_parent_scored(store_env):
    """Fork safety: each batch's pool is forked from a parent holding its sessions. Before, the children
    used the parent's connections to the holder: their rows were not graded, or hung until the timeout."""
    parent = batch_of(12, 2)
    assert naive_manager(custom_reward_fn("compute_score"), parent)[0] == expected(parent)
    pool = rewards._store_executors
    assert pool is not None and pool._sessions  # the parent holds open sessions now
    t0 = time.monotonic()
    for batch in (batch_of(14, 6), batch_of(20, 4)):  # a new pool of new children each batch
        scores, failed = prime_manager(score_only, batch)
        assert failed == [] and scores == expected(batch)
        # the children neither used nor closed the parent's sessions: it goes on with the same ones
        assert naive_manager(score_only, parent)[0] == expected(parent)
    assert time.monotonic() - t0 < PRIME_TIMEOUT
    assert rewards._store_executors is pool


def test_prime_reads_the_score_of_the_result(store_env):
    """verl's prime reads float(result[0]) of a result that is not a number: that is the score (a plain dict
    gave KeyError: 0, which verl swallows, scoring the whole batch 0)."""
    batch = batch_of(24, 4)
    scores, failed = prime_manager(custom_reward_fn("compute_score"), batch)
    assert failed == [] and scores == expected(batch)
