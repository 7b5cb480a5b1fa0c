"""Grading against a store: every task runs in its own instance, through the runtime.

A task maps to the instance built for it (ImpossibleBench variants to their
original task's instance); each instance is mounted once and its session
reused for every run, so thousands of short runs pay for the mounts once.
Results stream to a JSONL file as they finish, and a rerun skips what the file
already holds, so an interrupted grading run resumes where it stopped.

Across nodes, `shard_predictions` splits a run by instance (so each instance
is mounted on one node) and `merge_results` joins the shards' files into one,
in the predictions' order, with its summary.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from image_builder.errors import ImageBuilderError
from image_builder.runtime.backends import open_session
from image_builder.runtime.execution import Executor, RunRequest, RunResult
from image_builder.runtime.mounts import RunnerError
from image_builder.runtime.session import Backend, InstanceLayers, Session
from image_builder.runtime.warm import LAYERS_AT, WarmPool, WarmPools, worker_pool
from image_builder.store.files import atomic_write
from image_builder.store.store import Store, UnknownInstance
from image_builder.store.ids import file_name
from image_builder.tasks import RepoTask, Task, max_line_bytes, read_lines
from .grade import TaskIndex, grade_prediction
from .options import GradeOptions
from .predictions import Prediction
from .results import GradeResult, Summary, summarize, write_jsonl


def instance_of(task: Task) -> str:
    """The instance a task runs in: ImpossibleBench variants use their original task's."""
    return getattr(task, "original_id", task.task_id)


# Sessions kept open at once: each holds its instance's mounts (and spare inits) in the
# holder. Unbounded, grading 5,000 one-instance tasks ended with 10,017 mounts and 12
# tasks/s against 78 at the start.
DEFAULT_MAX_SESSIONS = 32


class StoreExecutors:
    """`executor_for(task)` backed by a store: a warm session per set of layers (instances
    that add nothing to their environment share one), shared by threads, at most
    `max_sessions` open; the least recently used idle one is closed to make room."""

    def __init__(self, store: Store, *, backend: Backend | None = None, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 fallback: str | None = None):
        """`fallback`: the instance for tasks the store has none for (grade --instance)."""
        self.store, self.backend, self.max_sessions = store, backend, max(1, max_sessions)
        self.fallback = fallback
        self._sessions: OrderedDict[tuple, Session] = OrderedDict()  # by layers, least recently used first
        self._busy: Counter[tuple] = Counter()
        # Warm interpreters (runtime/warm.py) by instance, least recently used first.
        self._warm: OrderedDict[tuple, WarmPools] = OrderedDict()
        self._lock = threading.Lock()
        self._stopped = False
        self.peak_sessions = 0

    def __call__(self, task: Task) -> Executor:
        return self.executor_for(task, self.fallback)

    def executor_for(self, task: Task, fallback: str | None = None) -> Executor:
        """The task's own instance, else `fallback`'s; UnknownInstance when neither is in the store."""
        try:
            return self.for_instance(instance_of(task))
        except UnknownInstance:
            if fallback is None:
                raise
            return self.for_instance(fallback)

    def for_instance(self, instance_id: str) -> Executor:
        """An executor for the instance (UnknownInstance now if the store has none); its
        session opens at the first run."""
        resolved = self.store.resolve(instance_id)
        return _InstanceExecutor(self, InstanceLayers.of(resolved), resolved.test_command,
                                 resolved.grader.get("log_parser"), resolved.grader.get("install"))

    def _acquire(self, key: tuple, layers: InstanceLayers) -> Session:
        with self._lock:
            if self._stopped:
                raise RunnerError("grading was stopped")
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = open_session(layers, backend=self.backend)
            self._sessions.move_to_end(key)
            self._busy[key] += 1
            surplus = len(self._sessions) - self.max_sessions
            for idle in [i for i in self._sessions if not self._busy[i]][:max(0, surplus)]:
                self._sessions.pop(idle).close()  # the holder unmounts what no session uses
                del self._busy[idle]
            self.peak_sessions = max(self.peak_sessions, len(self._sessions))
            return session

    def _release(self, key: tuple) -> None:
        with self._lock:
            self._busy[key] -= 1

    def _warm_pools(self, key: tuple, layers: InstanceLayers) -> WarmPools:
        with self._lock:
            pools = self._warm.get(key)
            if pools is None:
                pools = self._warm[key] = WarmPools(layers, partial(open_session, layers, backend=self.backend,
                                                                    layers_at=LAYERS_AT))
            self._warm.move_to_end(key)
            surplus = max(0, len(self._warm) - self.max_sessions)
            idle = [k for k, p in list(self._warm.items())[:-1] if not p.busy][:surplus]  # least recently used first
            evicted = [self._warm.pop(k) for k in idle]
        for gone in evicted:
            gone.close()
        return pools

    def stop(self) -> None:
        """Stop the runs in flight (their graders see RunnerError) and refuse new ones: for a caller that
        is ending (Ctrl-C, SIGTERM) and drops the results graded from now on."""
        with self._lock:
            self._stopped = True
        self.close()

    def close(self) -> None:
        with self._lock:
            for pools in self._warm.values():
                pools.close()
            for session in self._sessions.values():
                session.close()
            self._warm.clear()
            self._sessions.clear()

    def __enter__(self) -> StoreExecutors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _InstanceExecutor:
    """What a grader is given: each run borrows its instance's session from the pool."""

    def __init__(self, pool: StoreExecutors, layers: InstanceLayers, test_command: str | None,
                 log_parser: object = None, install: object = None):
        self._pool, self._layers = pool, layers
        # Sessions are shared by layers: instances that add nothing to one environment share its session.
        self._key = layers.env_sif, layers.overlays, layers.workdir, tuple(sorted(layers.env.items()))
        self.test_command = test_command  # the catalog's, for repo graders (swebench.resolve_test_command)
        self.log_parser = log_parser  # SWE-bench's parser for the repository, as the catalog names it
        self.install = install  # the catalog's {command, when}: the install a stale patch repeats (swebench.py)

    def run(self, request: RunRequest) -> RunResult:
        with self._session() as session:
            return session.run(request)

    def stream(self, request: RunRequest, stdin: int | None = None, stdout: int = 1, stderr: int = 2) -> RunResult:
        with self._session() as session:
            return session.stream(request, stdin, stdout, stderr)

    def warm(self, interpreter: tuple[str, ...], program: tuple[str, bytes] | None, env: dict[str, str],
             memory_mb: int | None, runs: int) -> WarmPool | None:
        """Warm interpreters for this instance's runs of `*interpreter program` (None: of any script;
        runtime/warm.py), or None where the backend has none or where `runs` (the caller's, now) would
        not pay for one."""
        return self._pool._warm_pools(self._key, self._layers).pool(interpreter, program, env, memory_mb, runs)

    @contextmanager
    def _session(self) -> Iterator[Session]:
        session = self._pool._acquire(self._key, self._layers)
        try:
            yield session
        finally:
            self._pool._release(self._key)


# A result line holds its run's whole test log (repo_max_output, 64 MiB), up to 6 bytes a byte
# as JSON escapes it: results are read a line at a time up to this, never a whole file at once.
RESULT_MAX_LINE = 512 << 20


def read_results(output: Path) -> list[GradeResult]:
    """The results a file holds (a line cut short by a crash is skipped; one over RESULT_MAX_LINE
    or $IMAGE_BUILDER_MAX_LINE, whichever is more, is refused in one line naming it)."""
    out = []
    for _, line in read_lines(output, max(RESULT_MAX_LINE, max_line_bytes())) if output.exists() else ():
        try:
            out.append(GradeResult.from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def resumable(output: Path, predictions: list[Prediction]) -> set[str]:
    """The tasks of `predictions` that `output` already holds; ImageBuilderError if it holds one graded from
    another solution (a rerun must not mix two runs' verdicts in one file)."""
    done = {r.task_id: r.solution_sha256 for r in read_results(output)}
    for prediction in predictions:
        if prediction.task_id in done and done[prediction.task_id] != prediction.sha256:
            raise ImageBuilderError(f"{output} holds a result for {prediction.task_id!r} graded from another "
                                    "solution (other predictions, or an older image-builder); give another -o, or "
                                    "--overwrite to grade afresh")
    return set(done) & {p.task_id for p in predictions}


def discard_results(output: Path) -> None:
    """A results file and what belongs to it (summary, artifacts, SWE-bench reports), for grading afresh into
    the same name."""
    from image_builder.store.store import remove_tree
    from .swebench_report import report_dir, run_report_path
    for path in (output, summary_path(output), artifacts_root(output), report_dir(output), run_report_path(output)):
        remove_tree(path)


def grade_to_file(tasks: Iterable[Task], predictions: list[Prediction], executor_for: Callable[[Task], Executor],
                  output: Path, *, options: GradeOptions = GradeOptions(), workers: int = 2,
                  on_result: Callable[[GradeResult], None] = lambda r: None,
                  stop: Callable[[], None] = lambda: None) -> int:
    """Grade what `output` does not hold yet, appending each result as it finishes; returns how many ran.
    Stopped (Ctrl-C, SIGTERM: an exception here), it calls `stop` to cut the runs in flight short
    (StoreExecutors.stop) and writes none of their results: a rerun grades those tasks again."""
    index = TaskIndex(tasks)
    done = resumable(output, predictions)
    todo = [p for p in predictions if p.task_id not in done]
    output.parent.mkdir(parents=True, exist_ok=True)
    _drop_partial_line(output)
    lock = threading.Lock()
    stopping = threading.Event()
    with open(output, "a") as out, worker_pool(max(1, workers)) as pool:
        def one(prediction: Prediction) -> None:
            result = grade_prediction(prediction, index, executor_for, options)
            with lock:
                if stopping.is_set():  # its runs may have been cut short
                    return
                if result.artifacts:
                    write_artifacts(output, result)  # before the result line: a listed result has its files
                out.write(json.dumps(result.to_dict()) + "\n")
                out.flush()
                on_result(result)
        try:
            list(pool.map(one, todo))  # an exception here cancels the tasks not started
        except BaseException:
            with lock:
                stopping.set()
            stop()  # before the pool's exit waits for the tasks in flight
            raise
    return len(todo)


def artifacts_root(output: Path) -> Path:
    return output.with_name(f"{output.stem}.artifacts")


def artifacts_dir(output: Path, task_id: str) -> Path:
    """Where a result's run files go, as SWE-bench's harness keeps them per instance:
    results.jsonl -> results.artifacts/<task id>/."""
    return artifacts_root(output) / file_name(task_id)


def write_artifacts(output: Path, result: GradeResult) -> None:
    """The result's files, published whole: written into a temporary directory, then renamed into place."""
    import shutil
    import tempfile

    final = artifacts_dir(output, result.task_id)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name[:40]}.", dir=final.parent))
    for name, text in (result.artifacts or {}).items():
        (tmp / name).write_text(text, errors="surrogateescape")
    (tmp / "report.json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    old = final.with_name(f".{final.name[:40]}.old-{tmp.name.rsplit('.', 1)[-1]}")
    if final.exists():
        final.rename(old)  # a regraded or resumed task: its earlier files go only once the new ones are whole
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def regrade(results: Path, tasks: Iterable[Task], output: Path) -> tuple[Summary, list[str]]:
    """Judge every repo result of `results` again from its kept files (no run): the log and junit parsed
    with today's parsers against the tasks' test lists. Writes `output` (whole, then renamed) and its
    summary; returns them with the ids whose status or score changed. Other results are copied as they are."""
    from .swebench import RunFacts, judge_facts

    by_id = {t.task_id: t for t in tasks}
    old = read_results(results)
    new, changed = [], []
    for result in old:
        facts_file = artifacts_dir(results, result.task_id) / "run.json"
        task = by_id.get(result.task_id)
        if result.kind != "repo" or not facts_file.exists() or not isinstance(task, RepoTask):
            new.append(result)
            continue
        try:
            facts = RunFacts.from_json(facts_file.read_text())
        except (ValueError, TypeError) as exc:
            raise ImageBuilderError(f"{facts_file}: not a run record ({exc}); grade the task again") from None
        again = judge_facts(task, facts)
        again.solution_sha256 = result.solution_sha256
        if (again.status, again.score) != (result.status, result.score):
            changed.append(result.task_id)
        new.append(again)
    write_jsonl(new, output)
    return write_summary(new, output), changed


def _drop_partial_line(output: Path) -> None:
    """A run killed mid-write leaves half a line: cut it so appends start clean (read from the end
    back to the last newline: the file may be larger than memory)."""
    if not output.exists():
        return
    with open(output, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            step = min(pos, 1 << 20)
            f.seek(pos - step)
            chunk = f.read(step)
            if pos == end and chunk.endswith(b"\n"):
                return
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                f.truncate(pos - step + cut + 1)
                return
            pos -= step
        f.truncate(0)


def shard_predictions(predictions: list[Prediction], tasks: Iterable[Task], shard: tuple[int, int]
                      ) -> list[Prediction]:
    """Shard K of N: the predictions of instances K, K+N, K+2N, ... in instance id order, so every
    prediction of one instance lands in one shard and the instance is mounted once."""
    k, n = shard
    by_id = {t.task_id: instance_of(t) for t in tasks}
    keys = sorted({by_id.get(p.task_id, p.task_id) for p in predictions})
    mine = {key for pos, key in enumerate(keys) if pos % n == k}
    return [p for p in predictions if by_id.get(p.task_id, p.task_id) in mine]


def summary_path(output: Path) -> Path:
    """Where a results file's summary goes: results.jsonl -> results.summary.json."""
    return output.with_name(f"{output.stem}.summary.json")


def write_summary(results: Iterable[GradeResult], output: Path) -> Summary:
    summary = summarize(results)
    atomic_write(summary_path(output), lambda f: f.write(json.dumps(summary.to_dict(), indent=2).encode() + b"\n"))
    return summary


def merge_results(parts: Iterable[Path], predictions: list[Prediction], output: Path) -> Summary:
    """One results file from the shards' files, in the predictions' order, and its summary; refuses to publish
    while a prediction has no result (a shard failed or was not run)."""
    found: dict[str, GradeResult] = {}
    for part in parts:
        found.update((r.task_id, r) for r in read_results(part))
    wanted = list(dict.fromkeys(p.task_id for p in predictions))
    missing = [task_id for task_id in wanted if task_id not in found]
    if missing:
        raise ImageBuilderError(f"{len(missing)} predictions have no result in the shards' files (first: "
                                f"{missing[0]!r}); run or resubmit the shards that failed, then merge again")
    results = [found[task_id] for task_id in wanted]
    write_jsonl(results, output)
    return write_summary(results, output)
