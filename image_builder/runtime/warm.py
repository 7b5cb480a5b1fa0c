"""Warm interpreters: runs of `python PROGRAM ARGS...` that do not pay for the interpreter's start.

A pool is for one PROGRAM, compiled once in the zygote (a grader's own file), or for any: each job's
program is the script its argv names, compiled in the job (a candidate's solution, a served request).

A zygote (zygote.py: what it shares with its jobs, and why a job cannot carry state to the next)
is an ordinary run of the instance, with the instance's layers bound read-only inside; each job
is a fork of it in a root, pid, mount, ipc and user namespace of its own, built on those layers.
Measured here (2-core VM, MBPP's environment): a job running `pass` costs 7.4 ms of the machine's
CPU as a clone (kernel backend; 4.8 rootless), where a fresh `python3 -c pass` alone is 13.3 ms; an
MBPP assert case one at a time 5.5 ms against 10.3 ms for bare python3 on the host (bench/graders.py).
A zygote costs a fresh interpreter's start and serves one job at a time; WarmPool keeps one per job
in flight.

Only where it holds: kernel and userns backends, Python 3.8+ on x86_64 or aarch64, a root whose
layers have /proc, /dev and /tmp. A zygote that cannot start, or a job it cannot set up, says so
before anything of the job ran (WarmUnavailable): the caller runs that job the ordinary way.
"""

from __future__ import annotations

import array
import functools
import itertools
import json
import marshal
import os
import select
import signal
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

from .execution import Executor, RunRequest, RunResult
from .holder import memfd_with
from .mounts import INIT_MISSING, ZYGOTE_LIBRARY_MISSING, RunnerError, init_program, zygote_library
from .session import Captured, InstanceLayers, Session, build_result, collect, stdin_for_run

LAYERS_AT = "/.image-builder-layers"
ZYGOTE_FILE = "/tmp/.ib-zygote/zygote.py"
ZYGOTE = resources.files(__package__).joinpath("zygote.py").read_bytes()
REAPER_FILE = "/tmp/.ib-zygote/init"  # zygote.py REAPER: pid 1 of each job's pid namespace
ROOT_LIB_FILE = "/tmp/.ib-zygote/root.so"  # zygote.py ROOT_LIB: each job enters its root with it
START_TIMEOUT = 30.0  # seconds for a zygote to answer its first job (a cold holder mounts the layers)
GRACE = 5.0  # seconds past a job's timeout for the zygote's answer
ZYGOTE_HEADROOM_MB = 64  # the zygote's run holds the job and the zygote: its memory limit is the job's and this
DEFAULT_SCRATCH_MB = 4096  # as native/init.c: the three tmpfs together, for a job without a memory limit
SCRATCH_PART = (2, 4, 4)
MAX_POOLS = 8  # an instance's pools kept (by program, environment, memory limit: a server's clients choose them)


_kept = threading.local()  # .cpu: the CPU worker_pool gave this thread


def thread_cpu() -> int:
    """The CPU worker_pool gave the calling thread (or the thread that started it, through keeping_cpu), else
    -1: a warm job sent from it runs there (zygote_root.c keep_to)."""
    return getattr(_kept, "cpu", -1)


def keeping_cpu(target: Callable[[], None]) -> Callable[[], None]:
    """`target`, to run on a thread of its own whose warm jobs keep to the calling thread's CPU (a case's
    candidate and evaluator runs, sent from threads its worker starts)."""
    cpu = thread_cpu()

    def run() -> None:
        _kept.cpu = cpu
        target()
    return run


def worker_pool(workers: int, **kw) -> ThreadPoolExecutor:
    """A thread pool whose threads are each given one of the process's CPUs, in turn, where they are at least as
    many as the CPUs (so none of the process's CPUs is left out; a Slurm job's are its own): the warm jobs a
    thread sends run on its CPU, so a case's candidate and its evaluator hand over to each other there, without
    waking another CPU between them. Fewer threads than CPUs give none: on a node shared with others, which
    of its CPUs are free is not this process's to know. Only warm jobs keep to the CPU (a case is one
    interpreter's work): the threads themselves, and every other run and process they start, run anywhere the
    process may, as in SWE-bench's containers (a repository's test suite counts the CPUs it has: pylint skips
    its multiprocessing tests on one). Measured (MBPP, 40 tasks x3, this 2-CPU VM): a grader alone on one CPU
    143 cases/s, one of 2 workers 183-199 (bare python3 gets 2.1x from the second CPU; we got 1.4x), two of 1
    worker each kept to a CPU 201-253 together; A/B of this pool, 3 rounds alternated: 232-239 -> 253-298
    cases/s; with its threads kept to their CPUs as well, 12 rounds: 230 against 227 (medians), no faster."""
    cpus = sorted(os.sched_getaffinity(0))
    if workers < len(cpus):
        return ThreadPoolExecutor(max_workers=workers, **kw)
    turn = itertools.cycle(cpus)
    lock = threading.Lock()

    def give_one() -> None:
        with lock:
            _kept.cpu = next(turn)

    return ThreadPoolExecutor(max_workers=workers, initializer=give_one, **kw)


class WarmUnavailable(Exception):
    """The job was not run: no zygote could take it (why, in the message)."""


def scratch_kb(memory_mb: int | None) -> list[int]:
    """Each of a job's writable layer, /tmp and /dev/shm: its share of the memory limit (native/init.c's
    scratch_sizes), in KiB."""
    budget = min(memory_mb, 1 << 30) if memory_mb else DEFAULT_SCRATCH_MB
    return [(budget << 10) // part for part in SCRATCH_PART]


@functools.cache
def reaper() -> bytes:
    """image-builder-init (static), which each zygote runs as its jobs' pid 1 (zygote.py REAPER)."""
    path = init_program()
    if path is None:
        raise RunnerError(INIT_MISSING)
    with open(path, "rb") as f:
        return f.read()


@functools.cache
def root_library() -> bytes:
    """image-builder-zygote.so, with which each zygote's jobs enter their roots (zygote.py ROOT_LIB)."""
    path = zygote_library()
    if path is None:
        raise WarmUnavailable(ZYGOTE_LIBRARY_MISSING)  # not cached: looked for again at the next zygote
    with open(path, "rb") as f:
        return f.read()


class Zygote:
    """One zygote in `session`, serving runs of `*interpreter program` (None: of any script) with `env`,
    one at a time."""

    def __init__(self, session: Session, interpreter: tuple[str, ...], program: tuple[str, bytes] | None,
                 env: dict[str, str], memory_mb: int | None):
        self.session, self.program = session, program
        self.dead = ""
        self._ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._err_r, err_w = os.pipe2(os.O_CLOEXEC)
        # Written to stop the zygote's run: one that no longer answers (no job can signal it, zygote.py;
        # a fault or a starved machine might) would hold the job's output pipes; its run's init kills it.
        self._cancel_r, self._cancel_w = os.pipe2(os.O_CLOEXEC)
        self._err = b""
        self.interpreter = interpreter
        request = RunRequest(argv=(*interpreter, ZYGOTE_FILE, LAYERS_AT, *(program[:1] if program else ())),
                             files={ZYGOTE_FILE: ZYGOTE, REAPER_FILE: reaper(), ROOT_LIB_FILE: root_library(),
                                    **dict([program] if program else [])},
                             env=env,
                             memory_mb=memory_mb + ZYGOTE_HEADROOM_MB if memory_mb else None, max_output=0,
                             zygote=True)

        def run() -> None:
            try:
                session.stream(request, stdin=theirs.fileno(), stdout=err_w, stderr=err_w, cancel=self._cancel_r)
            except BaseException as exc:  # noqa: BLE001 - told as the zygote's death
                self.dead = f"{type(exc).__name__}: {exc}"
            finally:
                theirs.close()
                os.close(err_w)
                os.close(self._cancel_r)
                self.dead = self.dead or "it exited"
                try:
                    self._ctl.shutdown(socket.SHUT_RDWR)  # wakes a job waiting for an answer
                except OSError:
                    pass

        self._thread = threading.Thread(target=run, name="image-builder-zygote", daemon=True)
        self._thread.start()
        self.started = False  # it said it takes jobs
        self.served = False  # it ran a job

    def stream(self, request: RunRequest, stdin: int | None, stdout: int, stderr: int, workdir: str) -> RunResult:
        """The run, served by this zygote. WarmUnavailable when it did not run."""
        if not self.started:
            ready = self._answer(START_TIMEOUT)
            if not (ready and ready.get("ready") is True):
                self.dead = self.dead or "it did not start"
                self.close()
                raise WarmUnavailable(self._why())
            self.started = True
        if self.dead:
            raise WarmUnavailable(self._why())
        files = b"".join(struct.pack("<I", len(p.encode())) + p.encode() + struct.pack("<Q", len(d)) + d
                         for p, d in request.placed_files(workdir).items())
        job = {"argv": list(request.argv[len(self.interpreter) + 1:]), "program": request.argv[len(self.interpreter)],
               "workdir": request.workdir or workdir,
               "memory_mb": request.memory_mb,
               "max_processes": self.session.max_processes, "scratch_kb": scratch_kb(request.memory_mb)}
        # marshal's version 4, which every Python the zygote runs on reads (3.4 on): the zygote imports no
        # json. Only here is it ever unmarshalled from: the zygote's answers, written in the instance, are JSON.
        given = []
        # What a run may have of the caller's stdin, as Session.stream gives it (never a host file or terminal).
        shown, release = stdin_for_run(stdin if request.stdin is None else None)
        try:
            try:
                given.append(memfd_with(request.stdin) if request.stdin is not None else
                             os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) if shown is None else os.dup(shown))
                given.append(memfd_with(files))
                t0 = time.monotonic()
                timeout = -1 if request.timeout is None else int(request.timeout * 1e6)  # zygote.py HEADER
                self._ctl.sendmsg([struct.pack("<qq", timeout, thread_cpu()) + marshal.dumps(job, 4)],
                                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array(
                    "i", [given[0], stdout, stderr, given[1]]))])
            except OSError as e:
                raise WarmUnavailable(f"the zygote took no job: {e}") from None
            finally:
                for fd in given:
                    os.close(fd)
            answer = self._answer((request.timeout or 24 * 3600) + GRACE)
        finally:
            release()
        wall = time.monotonic() - t0
        if answer is None:  # the zygote went away, or is still taking the job down (a fork bomb's)
            self.dead = self.dead or "it gave no answer"
            self.close(stop=True)
            timed_out = request.timeout is not None and wall >= request.timeout
            return RunResult(None, signal.SIGKILL, timed_out, False, wall, None, b"", b"")
        if "error" in answer:
            self.dead = str(answer["error"])
            self.close()
            raise WarmUnavailable(self._why())
        self.served = True
        if "retire" in answer:  # it leaves after this job: none is given to it again
            self.dead = str(answer["retire"])
            self.close()
        return RunResult(answer["exit_code"], answer["signal"], bool(answer["timed_out"]), False, wall,
                         answer["peak_memory_kb"], b"", b"")

    def _answer(self, wait: float) -> dict | None:
        deadline = time.monotonic() + wait
        while True:
            watched = [self._ctl] + ([self._err_r] if self._err_r >= 0 else [])
            ready, _, _ = select.select(watched, [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            if self._err_r in ready:  # what the zygote says about itself: the reason it gives up
                chunk = os.read(self._err_r, 1 << 16)
                self._err = (self._err + chunk)[-2048:]
                if not chunk:
                    os.close(self._err_r)
                    self._err_r = -1
            if self._ctl in ready:
                try:
                    msg, anc, _, _ = self._ctl.recvmsg(1 << 16, socket.CMSG_SPACE(16))
                except OSError:
                    return None
                for level, kind, data in anc:  # a zygote may send descriptors: never kept
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        for fd in array.array("i", data[:len(data) - len(data) % 4]):
                            os.close(fd)
                if not msg:
                    return None
                try:
                    answer = json.loads(msg)
                except ValueError:
                    return None
                return answer if isinstance(answer, dict) else None

    def _why(self) -> str:
        said = self._err.decode("utf-8", "replace").strip().splitlines()
        return f"{self.dead}" + (f" ({said[-1].strip()[:200]})" if said else "")

    def close(self, stop: bool = False) -> None:
        """EOF on its control socket: the zygote leaves; one that does not (`stop`, or not within
        GRACE) is killed with its run."""
        try:
            self._ctl.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not stop:
            self._thread.join(GRACE)
        if self._thread.is_alive() and self._cancel_w >= 0:
            os.write(self._cancel_w, b"x")
        self._thread.join()
        for fd in (self._err_r, self._cancel_w):
            if fd >= 0:
                os.close(fd)
        self._err_r = self._cancel_w = -1


class WarmPool:
    """Zygotes for one instance's runs of one program, or of any script (program None), kept idle
    between jobs, one per job in flight."""

    def __init__(self, session: Session, layers: InstanceLayers, interpreter: tuple[str, ...],
                 program: tuple[str, bytes] | None, env: dict[str, str], memory_mb: int | None):
        self.session, self.layers = session, layers
        self._args = interpreter, program, env, memory_mb
        self._idle: list[Zygote] = []
        self._lock = threading.Lock()
        self.busy = 0  # jobs in flight
        self.failed = ""  # why zygotes cannot run here: then every job goes the ordinary way

    def stream(self, request: RunRequest, stdin: int | None = None, stdout: int = 1, stderr: int = 2) -> RunResult:
        if self.failed or not self.takes(request):
            raise WarmUnavailable(self.failed or "not a run of the warm program")
        with self._lock:
            zygote = self._idle.pop() if self._idle else None
            self.busy += 1
        try:
            if zygote is None:
                zygote = Zygote(self.session, *self._args)
            result = zygote.stream(request, stdin, stdout, stderr, self.layers.workdir)
        except WarmUnavailable as e:
            if zygote is None or not zygote.served:
                self.failed = str(e)  # it cannot start or set up a job here: none will
            raise
        finally:
            with self._lock:
                self.busy -= 1
                if zygote is not None and not zygote.dead:
                    self._idle.append(zygote)
        return result

    def takes(self, request: RunRequest) -> bool:
        interpreter, program = self._args[:2]
        script = request.argv[len(interpreter):len(interpreter) + 1]
        if request.network or request.argv[:len(interpreter)] != interpreter or not script:
            return False
        return script[0] == program[0] if program else not script[0].startswith("-")

    def run(self, request: RunRequest) -> RunResult:
        """As Session.run: the output kept (max_output of each stream), the input a regular file."""
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        got, failed = Captured(), []

        def drain() -> None:
            try:
                got.__dict__.update(collect(out_r, err_r, request.max_output, None).__dict__)
            except BaseException as exc:  # noqa: BLE001 - raised again below
                failed.append(exc)

        reader = threading.Thread(target=drain, name="image-builder-warm-output", daemon=True)
        reader.start()
        try:
            result = self.stream(request, None, out_w, err_w)
        finally:
            os.close(out_w)
            os.close(err_w)
            reader.join()  # the job's processes are gone with its pid 1: the pipes are at their end
            os.close(out_r)
            os.close(err_r)
        if failed:
            raise failed[0]
        return build_result(got, request, result.wall_time, result.exit_code, result.signal, result.timed_out,
                            result.peak_memory_kb, None)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for zygote in idle:
            zygote.close()


class WarmPools:
    """One instance's warm pools, by interpreter, program, environment and memory limit, on a session
    that shows the layers inside (`open_warm_session`, called when the first pool is made)."""

    def __init__(self, layers: InstanceLayers, open_warm_session: Callable[[], Session]):
        self.layers, self._open = layers, open_warm_session
        self._session: Session | None = None
        self.pools: OrderedDict[tuple, WarmPool] = OrderedDict()  # least recently used first
        self._asked: Counter[tuple] = Counter()
        self._unavailable = False  # the backend has no warm interpreters, or these pools were closed
        self._lock = threading.Lock()

    def pool(self, interpreter: tuple[str, ...], program: tuple[str, bytes] | None, env: dict[str, str],
             memory_mb: int | None, runs: int) -> WarmPool | None:
        """The pool for these runs, or None where the backend has none or where `runs` (the caller's,
        now) would not pay for one: a zygote costs a fresh interpreter's start, so it pays from its
        second run."""
        key = interpreter, program, tuple(sorted(env.items())), memory_mb
        with self._lock:
            pool = self.pools.get(key)
            self._asked[key] += 1
            if pool is None and (self._unavailable or (runs < 2 and self._asked[key] < 2)):
                return None
            if pool is None:
                if self._session is None:
                    try:
                        self._session = self._open()
                    except RunnerError:  # apptainer, extract: runs go the ordinary way
                        self._unavailable = True
                        return None
                pool = self.pools[key] = WarmPool(self._session, self.layers, interpreter, program, env, memory_mb)
            self.pools.move_to_end(key)
            surplus = max(0, len(self.pools) - MAX_POOLS)
            idle = [k for k, p in list(self.pools.items())[:-1] if not p.busy][:surplus]  # least recently used first
            evicted = [self.pools.pop(k) for k in idle]
        for gone in evicted:
            gone.close()
        return pool

    @property
    def busy(self) -> bool:
        return any(pool.busy for pool in self.pools.values())

    def close(self) -> None:
        with self._lock:
            pools, self.pools = list(self.pools.values()), OrderedDict()
            session, self._session = self._session, None
            self._unavailable = True
        for pool in pools:
            pool.close()
        if session is not None:
            session.close()


class WarmExecutor:
    """An Executor whose runs go through warm pools where they can (`warm`, as graders ask for them)."""

    def __init__(self, executor: Executor, pools: WarmPools):
        self.executor, self.pools = executor, pools

    def run(self, request: RunRequest) -> RunResult:
        return self.executor.run(request)

    def stream(self, request: RunRequest, stdin: int | None = None, stdout: int = 1, stderr: int = 2) -> RunResult:
        return self.executor.stream(request, stdin, stdout, stderr)

    def warm(self, interpreter: tuple[str, ...], program: tuple[str, bytes] | None, env: dict[str, str],
             memory_mb: int | None, runs: int) -> WarmPool | None:
        return self.pools.pool(interpreter, program, env, memory_mb, runs)


def run_warm(pool: WarmPool | None, executor: Executor, request: RunRequest) -> RunResult:
    """`request` through `pool` where it takes it, else (no pool, or none of it could run) by `executor`."""
    if pool is not None and pool.takes(request):
        try:
            return pool.run(request)
        except WarmUnavailable:
            pass  # nothing of it ran
    return executor.run(request)
