"""Assert-case grading (verl `{"assert_case": [...]}`): the cases run where the solution cannot reach.

Each task gets one evaluator run, which holds the cases, and each case one
fresh candidate run, which holds the solution: two runs of the instance, two
roots, two pid namespaces (assert_sides.py says what runs on each side and
what that defends). For each case this module makes the candidate's stdin and
stdout pipes, starts its run on them and hands their other ends to the
evaluator (over the Unix socket that is the evaluator's stdin), then takes the
verdict only from the evaluator's stdout. The two sides talk directly: relayed
through here, each message woke this process and was copied twice more (MBPP,
2 workers, A/B over 8 rounds: 8.9 -> 8.4 ms of the machine's CPU a case, the
VM drifting 10-30% between rounds). The candidate's stderr
(its prints go there too) is kept for the result. Score: the fraction of cases
passed, as verl's sandbox path scores them.
"""

from __future__ import annotations

import array
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from importlib import resources

from image_builder.runtime.execution import Executor, RunRequest, RunResult
from image_builder.runtime.warm import WarmPool, WarmUnavailable, keeping_cpu
from image_builder.tasks import AssertTask
from .assert_sides import MAX_EVIDENCE, MAX_FRAME, Codec, ProtocolError
from .one_answer import assert_answers_exclude, assert_question, one_answer_each
from .options import GradeOptions
from .pyharness import SCRATCH, no_report_reason, process_failure, tail
from .results import CaseResult, CaseStatus, GradeResult, from_cases

SIDES_FILE = f"{SCRATCH}/_ib_sides.py"
SIDES_PYC = f"{SCRATCH}/_ib_sides.pyc"
CASES_FILE = f"{SCRATCH}/_ib_cases.json"
SOLUTION_FILE = f"{SCRATCH}/_ib_solution.py"
SIDES = resources.files(__package__).joinpath("assert_sides.py").read_bytes()

GRACE = 5.0  # seconds past a case's timeout for the runs to report back
HEADER = struct.Struct(">I")


def grade_asserts(task: AssertTask, solution: str, executor: Executor, options: GradeOptions) -> GradeResult:
    solution = task.program(solution)
    mode = "strict" if options.strict else "plain"
    sides = _Sides(executor, options, len(task.cases))
    # Fresh candidate interpreters take this task's compiled copy of this file: the evaluator's first message.
    # The evaluator runs with -S (no instance's .pth code runs beside the cases), and its zygote knows it by that.
    evaluator = _Evaluator(partial(sides.stream, sides.evaluators, RunRequest(
        argv=(options.python, "-S", SIDES_FILE, "evaluator", CASES_FILE, mode) + (() if sides.candidates else ("pyc",)),
        files={SIDES_FILE: SIDES, CASES_FILE: Codec.plain.enc(tuple(task.cases))}, env=dict(options.env),
        timeout=(options.case_timeout + GRACE) * max(1, len(task.cases)) + GRACE, memory_mb=options.memory_mb,
        max_output=0)))
    try:
        program = (SIDES_FILE, SIDES) if sides.candidates else _compiled(evaluator, time.monotonic() +
                                                                         options.case_timeout + GRACE)
        if evaluator.error is not None:  # the executor failed, not the candidate
            raise evaluator.error
        graded = [_Case(str(i), solution, program, sides, options, evaluator).run() for i in range(len(task.cases))]
    finally:
        evaluator.stop()
    if evaluator.error is not None:
        raise evaluator.error
    cases = one_answer_each([assert_question(case) for case in task.cases], [case for case, _ in graded],
                            assert_answers_exclude)
    result = from_cases(task.task_id, "assert", cases, "case")
    result.evidence = [line for _, evidence in graded for line in evidence][:MAX_EVIDENCE]
    return result


def _compiled(evaluator: _Evaluator, deadline: float) -> tuple[str, bytes]:
    """The candidate side's program, (path, content): assert_sides.py as compiled by this task's evaluator
    (its first message, sent before it reads a case), so each candidate run saves the 5 ms of compiling
    it. Not kept across tasks: another instance's interpreter must never shape this one's runs."""
    while not evaluator.over and time.monotonic() < deadline:
        frame = evaluator.frames.pop()
        if frame is None:
            _pump((evaluator,), deadline)
            continue
        try:
            magic, pyc = Codec.plain.dec(frame[1:]) if frame[:1] == b"p" else (b"", b"")
        except (ProtocolError, TypeError, ValueError):
            break
        if type(magic) is bytes and type(pyc) is bytes and magic and pyc.startswith(magic):
            return SIDES_PYC, pyc
        break
    return SIDES_FILE, SIDES  # the first case then sees why the evaluator failed


def _pump(runs: tuple[_Run, ...], deadline: float) -> None:
    """Wait until one of the runs' pipes is ready (or the deadline), and read what is ready."""
    readers = {fd: f for r in runs for fd, f in ((r.stdout, r.read_out), (r.stderr, r.read_err)) if fd >= 0}
    ready, _, _ = select.select(list(readers), [], [], max(0.0, deadline - time.monotonic()))
    for fd in ready:
        readers[fd]()


class _Run:
    """A streamed run, `stream(stdin, stdout, stderr)`, given its ends of the descriptors: `stdin` (the
    run's, made by the caller), `stdout` (likewise, or None: a pipe whose other end is ours) and stderr
    (a pipe whose other end is ours). Our ends are non-blocking; the run's are closed when it is over."""

    def __init__(self, stream: Callable[[int, int, int], RunResult], stdin: int, stdout: int | None = None):
        self.stdout = -1
        if stdout is None:
            self.stdout, stdout = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(self.stdout, False)
        self.stderr, err_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self.stderr, False)
        self.frames = _Frames()
        self.err_tail = b""
        self.result: RunResult | None = None
        self.error: BaseException | None = None
        self.started = time.monotonic()

        def go() -> None:
            try:
                self.result = stream(stdin, stdout, err_w)
            except BaseException as exc:  # noqa: BLE001 - raised again in the grading thread
                self.error = exc
            finally:
                for fd in (stdin, stdout, err_w):
                    os.close(fd)

        self.thread = threading.Thread(target=keeping_cpu(go), name="image-builder-assert-run", daemon=True)
        self.thread.start()

    @property
    def over(self) -> bool:
        return self.stdout < 0

    def read_out(self) -> None:
        if chunk := self._read("stdout", 1 << 20):
            self.frames.feed(chunk)

    def read_err(self) -> None:
        if chunk := self._read("stderr", 1 << 16):
            self.err_tail = (self.err_tail + chunk)[-4 * 1024:]

    def _read(self, name: str, size: int) -> bytes:
        """What the pipe has now (b"" when nothing yet); at its end the pipe is closed."""
        try:
            chunk = os.read(getattr(self, name), size)
        except BlockingIOError:
            return b""
        if not chunk:
            self._close(name)
        return chunk

    def _close(self, name: str) -> None:
        fd = getattr(self, name)
        if fd >= 0:
            os.close(fd)
            setattr(self, name, -1)

    def stop(self, wait: float | None = None) -> None:
        """Wait `wait` seconds for the run to end, then close our ends (a run still writing gets EPIPE
        and stops) and wait for its result."""
        self.thread.join(wait)
        for name in ("stdout", "stderr"):
            self._close(name)
        self.thread.join()


class _Evaluator(_Run):
    """The evaluator's run: its stdin a Unix socket on which it gets each case's candidate channel."""

    def __init__(self, stream: Callable[[int, int, int], RunResult]):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        super().__init__(stream, theirs.detach())

    def connect(self, from_candidate: int, to_candidate: int) -> None:
        """Hand the evaluator the next case's pipes (and close ours: the two sides hold one end each)."""
        try:
            self.control.sendmsg([b"case"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                              array.array("i", [from_candidate, to_candidate]))])
        except OSError:
            pass  # it is over: the case says so
        finally:
            os.close(from_candidate)
            os.close(to_candidate)

    def stop(self, wait: float | None = None) -> None:
        """No more cases: it leaves."""
        self.control.close()
        super().stop(wait)


class _Frames:
    """Length-prefixed frames out of a byte stream; over MAX_FRAME is a broken channel."""

    def __init__(self):
        self.buf = bytearray()
        self.broken = ""

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk

    def pop(self) -> bytes | None:
        if self.broken or len(self.buf) < HEADER.size:
            return None
        size = HEADER.unpack_from(self.buf)[0]
        if not 1 <= size <= MAX_FRAME:
            self.broken = f"a message of {size} bytes (at most {MAX_FRAME})"
            return None
        if len(self.buf) < HEADER.size + size:
            return None
        frame = bytes(self.buf[HEADER.size:HEADER.size + size])
        del self.buf[:HEADER.size + size]
        return frame


class _Sides:
    """Where the two sides run: warm interpreters of the instance (runtime/warm.py: a clone, per run,
    of an interpreter that has loaded this file, in a root and pid namespace of its own) where the
    executor has them, else fresh ones. Evaluators and candidates have zygotes of their own: two runs
    of the instance, two pid namespaces, as their fresh runs are."""

    def __init__(self, executor: Executor, options: GradeOptions, cases: int):
        self.executor = executor
        warm = getattr(executor, "warm", None)
        env, memory = dict(options.env), options.memory_mb
        self.evaluators = warm((options.python, "-S"), (SIDES_FILE, SIDES), env, memory, 1) if warm else None
        self.candidates = warm((options.python,), (SIDES_FILE, SIDES), env, memory, cases) if warm else None

    def stream(self, pool: WarmPool | None, request: RunRequest, stdin: int, stdout: int, stderr: int) -> RunResult:
        if pool is not None:
            try:  # the zygote holds this file already
                return pool.stream(replace(request, files={k: v for k, v in request.files.items() if k != SIDES_FILE}),
                                   stdin, stdout, stderr)
            except WarmUnavailable:
                pass  # nothing of it ran
        return self.executor.stream(request, stdin, stdout, stderr)


class _Case:
    def __init__(self, name: str, solution: str, program: tuple[str, bytes], sides: _Sides, options: GradeOptions,
                 evaluator: _Evaluator):
        self.name, self.options, self.evaluator = name, options, evaluator
        self.evidence: list[str] = []
        # The candidate's channel: pipes, not a socket (nothing but bytes can pass on them), one end each
        # for the candidate and the evaluator. A pipe lives as long as its case: a frame the candidate
        # sends out of turn can only answer this case's own questions, as it could anyway.
        stdin, self.to_candidate = os.pipe2(os.O_CLOEXEC)
        self.from_candidate, stdout = os.pipe2(os.O_CLOEXEC)
        self.candidate = _Run(partial(sides.stream, sides.candidates, RunRequest(
            argv=(options.python, program[0], "candidate", SOLUTION_FILE),
            files={program[0]: program[1], SOLUTION_FILE: solution.encode()}, env=dict(options.env),
            timeout=options.case_timeout, memory_mb=options.memory_mb, max_output=0)), stdin, stdout)

    def run(self) -> tuple[CaseResult, list[str]]:
        """The case's result, and the evidence the evaluator saw in it."""
        try:
            self.evaluator.connect(self.from_candidate, self.to_candidate)
            verdict = self._verdict()
        finally:
            self.candidate.stop(GRACE)
        if self.candidate.error is not None:
            raise self.candidate.error
        return self._result(verdict), self.evidence

    def _verdict(self) -> list:
        """Read the evaluator until it gives this case's verdict (and the candidate's stderr meanwhile)."""
        ev, cand = self.evaluator, self.candidate
        deadline = cand.started + self.options.case_timeout + 2 * GRACE
        while True:
            for frame in iter(ev.frames.pop, None):
                tag, payload = frame[:1], frame[1:]
                if tag == b"w":  # evidence the evaluator saw (assert_sides.EvaluatorChannel.witness)
                    try:
                        line = Codec.plain.dec(payload)
                    except ProtocolError:
                        line = None
                    if type(line) is str and len(self.evidence) < MAX_EVIDENCE:
                        self.evidence.append(line[:300])
                    continue
                if tag == b"v":
                    try:
                        verdict = Codec.plain.dec(payload)
                    except ProtocolError:
                        verdict = None
                    if isinstance(verdict, tuple) and len(verdict) == 3 and all(type(v) is str for v in verdict):
                        return list(verdict)
                    return ["evaluator", "it sent a malformed verdict", ""]
                return ["evaluator", "it sent a message of no known kind", ""]
            if ev.over or ev.frames.broken:
                return ["evaluator", "it ended before giving a verdict: " + _last_line(ev.err_tail), ""]
            if time.monotonic() > deadline:
                return ["evaluator", "it gave no verdict in time", ""]
            _pump((ev, cand), deadline)

    def _result(self, verdict: list) -> CaseResult:
        kind, detail, shown = verdict
        result = self.candidate.result
        wall = result.wall_time if result is not None else 0.0
        stderr = self.candidate.err_tail.decode("utf-8", "replace")
        if shown:
            stderr = tail(stderr + ("\n" if stderr else "") + shown)
        status, reason = {
            "passed": (CaseStatus.PASSED, ""),
            "failed": (CaseStatus.FAILED, "assertion failed"),
            "refused": (CaseStatus.FAILED, detail),
            "raised": (CaseStatus.ERROR, f"raised {detail}"),
            "exited": (CaseStatus.ERROR, "exited (sys.exit) before the case finished"),
            "broken": (CaseStatus.ERROR, f"the solution's process broke the grader's channel: {detail}"),
            "bad_case": (CaseStatus.ERROR, detail),
            "evaluator": (CaseStatus.ERROR, f"the evaluator failed: {detail}"),
        }.get(kind) or (result is not None and process_failure(result)) or (
            CaseStatus.ERROR, no_report_reason(result) if result is not None else "the run did not start")
        return CaseResult(self.name, status, reason, tail(stderr), wall)


def _last_line(data: bytes) -> str:
    lines = [line for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else "no message"
