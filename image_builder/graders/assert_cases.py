"""Assert-case grading (verl `{"assert_case": [...]}`): the cases run where the solution cannot reach.

Each task gets one evaluator run, which holds the cases, and each case one
fresh candidate run, which holds the solution: two runs of the instance, two
roots, two pid namespaces (assert_sides.py says what runs on each side and
what that defends). This module is the relay between them: it forwards the
messages of the two runs' stdout to the other's stdin, bounded in size, and
takes the verdict only from the evaluator's stdout. The candidate's stderr
(its prints go there too) is kept for the result. Score: the fraction of cases
passed, as verl's sandbox path scores them.
"""

from __future__ import annotations

import os
import select
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from importlib import resources

from image_builder.runtime.execution import Executor, RunRequest, RunResult
from image_builder.runtime.warm import WarmPool, WarmUnavailable
from image_builder.tasks import AssertTask
from .assert_sides import MAX_EVIDENCE, Codec, ProtocolError
from .one_answer import assert_answers_exclude, assert_question, one_answer_each
from .options import GradeOptions
from .pyharness import SCRATCH, no_report_reason, process_failure, tail
from .results import CaseResult, CaseStatus, GradeResult, from_cases

SIDES_FILE = f"{SCRATCH}/_ib_sides.py"
SIDES_PYC = f"{SCRATCH}/_ib_sides.pyc"
CASES_FILE = f"{SCRATCH}/_ib_cases.json"
SOLUTION_FILE = f"{SCRATCH}/_ib_solution.py"
SIDES = resources.files(__package__).joinpath("assert_sides.py").read_bytes()

MAX_FRAME = 64 << 20  # as assert_sides.MAX_FRAME
GRACE = 5.0  # seconds past a case's timeout for the runs to report back
HEADER = struct.Struct(">I")


def grade_asserts(task: AssertTask, solution: str, executor: Executor, options: GradeOptions) -> GradeResult:
    solution = task.program(solution)
    mode = "strict" if options.strict else "plain"
    sides = _Sides(executor, options, len(task.cases))
    # Fresh candidate interpreters take this task's compiled copy of this file: the evaluator's first message.
    evaluator = _Run(partial(sides.stream, sides.evaluators, RunRequest(
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


def _compiled(evaluator: _Run, deadline: float) -> tuple[str, bytes]:
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
    """Wait until one of the runs' pipes is ready (or the deadline), and move what is ready. While a
    run has more than a message waiting to be written to it, the other runs' stdout is not read: a
    side that floods the other is held back by its own pipe, not buffered here without end."""
    flooded = [r for r in runs if len(r.outbox) > MAX_FRAME]
    readers = {fd: f for r in runs for fd, f in ((r.stdout, r.read_out), (r.stderr, r.read_err))
               if fd >= 0 and not (f == r.read_out and any(other is not r for other in flooded))}
    writers = [r.stdin for r in runs if r.outbox and r.stdin >= 0]
    ready_r, _, _ = select.select(list(readers), writers, [], max(0.0, deadline - time.monotonic()))
    for fd in ready_r:
        readers[fd]()
    for r in runs:
        r.flush()


class _Run:
    """A streamed run whose stdin, stdout and stderr are pipes held here (our ends non-blocking):
    `stream(stdin, stdout, stderr)` runs it."""

    def __init__(self, stream: Callable[[int, int, int], RunResult]):
        in_r, self.stdin = os.pipe2(os.O_CLOEXEC)
        self.stdout, out_w = os.pipe2(os.O_CLOEXEC)
        self.stderr, err_w = os.pipe2(os.O_CLOEXEC)
        for fd in (self.stdin, self.stdout, self.stderr):
            os.set_blocking(fd, False)
        self.frames = _Frames()
        self.outbox = bytearray()
        self.err_tail = b""
        self.result: RunResult | None = None
        self.error: BaseException | None = None
        self.started = time.monotonic()

        def go() -> None:
            try:
                self.result = stream(in_r, out_w, err_w)
            except BaseException as exc:  # noqa: BLE001 - raised again in the grading thread
                self.error = exc
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)

        self.thread = threading.Thread(target=go, name="image-builder-assert-run", daemon=True)
        self.thread.start()

    @property
    def over(self) -> bool:
        return self.stdout < 0

    def send(self, tag: bytes, payload: bytes) -> None:
        if self.stdin >= 0:
            self.outbox += HEADER.pack(len(payload) + 1) + tag + payload

    def flush(self) -> None:
        try:
            while self.outbox and self.stdin >= 0:
                del self.outbox[:os.write(self.stdin, self.outbox)]
        except BlockingIOError:
            pass
        except OSError:  # the run is over: what it was sent does not matter any more
            self.outbox.clear()

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
        """Close our ends: the run sees EOF on stdin, and a run still writing gets EPIPE and stops.
        Then wait for its result."""
        self._close("stdin")
        self.thread.join(wait)
        for name in ("stdout", "stderr"):
            self._close(name)
        self.thread.join()


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
                 evaluator: _Run):
        self.name, self.options, self.evaluator = name, options, evaluator
        self.evidence: list[str] = []
        self.candidate = _Run(partial(sides.stream, sides.candidates, RunRequest(
            argv=(options.python, program[0], "candidate", SOLUTION_FILE),
            files={program[0]: program[1], SOLUTION_FILE: solution.encode()}, env=dict(options.env),
            timeout=options.case_timeout, memory_mb=options.memory_mb, max_output=0)))

    def run(self) -> tuple[CaseResult, list[str]]:
        """The case's result, and the evidence the evaluator saw in it."""
        try:
            verdict = self._relay()
        finally:
            self.candidate.stop(GRACE)
        if self.candidate.error is not None:
            raise self.candidate.error
        return self._result(verdict), self.evidence

    def _relay(self) -> list:
        """Pass messages until the evaluator gives this case's verdict."""
        ev, cand = self.evaluator, self.candidate
        gone_told = False
        gone = Codec.plain.enc(("gone", int(self.name)))  # names the case: the evaluator drops stale ones
        # The two sides take turns (each blocks for the other's frame after sending one, nested calls
        # included), the evaluator first: a candidate frame out of turn is no answer to anything, and the
        # evaluator would read it as the answer to its next question, the next case's among them.
        candidates_turn = False
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
                if cand.over:
                    ev.send(b"h", gone)  # each request after the end hears it again
                else:
                    cand.send(b"e", payload)
                    candidates_turn = True
            for frame in iter(cand.frames.pop, None):
                if not candidates_turn:
                    return ["broken", "it sent a message the evaluator had not asked for", ""]
                ev.send(b"c", frame[1:])
                candidates_turn = False
            if cand.frames.broken:
                return ["broken", cand.frames.broken, ""]
            if cand.over and not gone_told:
                ev.send(b"h", gone)
                gone_told = True
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
