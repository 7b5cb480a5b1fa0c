"""The Python harness that runs call-based candidate code inside the instance, and how its runs are read.

A call-based test (LiveCodeBench's functional problems) calls the solution's
function and compares the returned value on the grader's side, after a JSON
round trip. Why a harness rather than `python3 script.py`: a solution can end
the process early with status 0 (`sys.exit(0)` or `os._exit(0)` at import, an
`atexit` hook), and a bare exit code calls that a pass. The harness loads the
solution as module `solution`, calls the function, then writes
`<nonce> returned <JSON>` to stderr and leaves with os._exit. The nonce comes
from a file that the harness deletes before any candidate code runs; a run
without the report failed. Code that digs the nonce out of the harness's frames
can forge a report, but only one carrying its own return value: the expected
value never enters the run. (Assert cases, whose expected values are in the
test code, run in assert_sides.py's evaluator instead.)

The harness keeps to Python 3.6 syntax: instance images carry old interpreters.
"""

from __future__ import annotations

import secrets
import signal
from dataclasses import dataclass

from image_builder.runtime.execution import RunRequest, RunResult

from .options import GradeOptions
from .results import CaseStatus

# The run's files go to /tmp, which the runtime empties after each run: a case that writes
# nothing else leaves its root to the next case, with no fresh root to build (bench/graders:
# 174-196 cases a second, 115 with the files in the working directory). The working directory
# stays the instance's.
SCRATCH = "/tmp/.ib-grader"
HARNESS_FILE = f"{SCRATCH}/_ib_harness.py"
NONCE_FILE = f"{SCRATCH}/_ib_nonce"
STDERR_TAIL = 1000

# Only os, sys and types load up front: json and traceback load where needed.
HARNESS = r'''
import os, sys, types

def run_call(path, call_path):
    import json
    with open(call_path) as f:
        call = json.load(f)
    with open(path) as f:
        source = f.read()
    module = types.ModuleType("solution")  # not __main__: LiveCodeBench imports call-based code
    module.__file__ = path
    module.__builtins__ = __builtins__
    exec(compile(source, path, "exec"), module.__dict__)
    holder = module.__dict__.get("Solution")
    if isinstance(holder, type) and hasattr(holder, call["fn_name"]):
        function = getattr(holder(), call["fn_name"])
    elif call["fn_name"] in module.__dict__:
        function = module.__dict__[call["fn_name"]]
    else:
        raise NameError("no function or Solution method named " + call["fn_name"])
    return json.dumps(function(*call["args"]))


def show_exception():
    try:
        import traceback
        traceback.print_exc()
    except BaseException:
        pass


def main():
    sys.path[0] = os.getcwd()  # imports as if the script were in the working directory, not in /tmp
    path = sys.argv[2]
    with open("''' + NONCE_FILE + r'''") as f:
        nonce = f.read().strip()
    os.unlink("''' + NONCE_FILE + r'''")
    try:
        outcome = "returned " + run_call(path, sys.argv[3])
    except SystemExit:
        outcome = "exited"
    except BaseException as exc:
        show_exception()
        outcome = "raised " + ("".join(type(exc).__name__.split()) or "?")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os.write(2, ("\n" + nonce + " " + outcome + "\n").encode("utf-8", "replace"))
    os._exit(0)  # candidate atexit hooks must not run after the report


main()
'''


@dataclass(frozen=True)
class Outcome:
    kind: str  # returned, exited, raised; "" when the harness never reported
    detail: str  # the exception's name, or the returned JSON
    stderr_tail: str  # stderr without the report


def harness_request(mode_args: tuple[str, ...], files: dict[str, str], timeout: float,
                    options: GradeOptions) -> tuple[RunRequest, str]:
    nonce = secrets.token_hex(16)
    payload = {name: text.encode() for name, text in files.items()}
    payload[HARNESS_FILE] = HARNESS.encode()
    payload[NONCE_FILE] = nonce.encode()
    request = RunRequest(argv=(options.python, HARNESS_FILE, *mode_args), files=payload, env=dict(options.env),
                         timeout=timeout, memory_mb=options.memory_mb, max_output=options.max_output)
    return request, nonce


def read_outcome(result: RunResult, nonce: str) -> Outcome:
    text = result.stderr.decode("utf-8", "replace")
    marker = "\n" + nonce + " "
    at = text.rfind(marker)
    if at < 0:
        return Outcome("", "", tail(text))
    kind, _, detail = text[at + len(marker):].rstrip("\n").partition(" ")
    return Outcome(kind, detail, tail(text[:at]))


def process_failure(result: RunResult) -> tuple[CaseStatus, str] | None:
    """Why a run ended without the program finishing by itself, if it did."""
    if result.timed_out:
        return CaseStatus.TIMEOUT, f"timed out after {result.wall_time:.1f}s"
    if result.out_of_memory:
        return CaseStatus.ERROR, "out of memory"
    if result.signal is not None:
        return CaseStatus.ERROR, f"killed by {signal_name(result.signal)}"
    return None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def tail(text: str) -> str:
    return text[-STDERR_TAIL:]


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else ""


def no_report_reason(result: RunResult) -> str:
    if result.truncated:
        return "ended without a report; output went over the limit"
    return f"ended without a report (exit code {result.exit_code}): the process left before the case finished"
