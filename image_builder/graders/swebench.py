"""Repo-test grading, SWE-bench style: apply, reset the tests, run them between markers, parse, resolve.

The whole evaluation is one run of a generated bash script in the instance (a
run starts from a fresh copy of the instance, so state cannot carry between
runs). The script mirrors SWE-bench's eval.sh: the candidate patch is applied
with `git apply`, then `git apply --reject`, then `patch --fuzz=5`; the files
the test patch touches are reset to base_commit and the test patch applied;
the test command runs on the test patch's files. `access` decides what else is
reverted (see access.py).

Why the run's report cannot be forged by printing:
- the script reads a random nonce from a file and deletes it before any
  candidate code runs; the nonce is never exported, so the code under test
  cannot know it. Only lines carrying it count: the start/end markers around
  the test output on stdout, and the notes on the grader's channel (the
  script's own stderr, which the test command does not inherit): which command
  applied the patch, the test command's exit code, the junit xml;
- pytest statuses are read from the last short-summary section between the
  markers and must agree with the junit xml pytest writes to a fresh temp dir;
  a test whose two statuses differ, or a run without junit, fails.
Code under test that patches pytest in-process, or rewrites the junit file at
exit, can still forge a pass: in-process code can lie to in-process reporters.

`resolved` as SWE-bench defines it: every FAIL_TO_PASS and PASS_TO_PASS test
passed (PASSED or XFAIL); FAILED, ERROR, missing or mismatched tests fail;
SKIPPED tests count for neither side.
"""

from __future__ import annotations

import base64
import binascii
import secrets
import shlex
from dataclasses import dataclass

from image_builder.runtime.execution import Executor, RunRequest, RunResult

from image_builder.tasks import RepoTask
from .access import TestAccess, reverted_files
from .options import GradeOptions
from .patches import refused_path, target_paths, touched_paths
from .results import GradeResult, RepoReport, TaskStatus
from .testlogs import TestStatus, junit_key, parse_junit, parse_pytest_log, parse_unittest_log

GRADER_DIR = ".ib-grader"  # written into the workdir by the run, moved out before any patch is applied
_SUCCESS = {TestStatus.PASSED.value, TestStatus.XFAIL.value}
_NEUTRAL = {TestStatus.SKIPPED.value}
MISSING, MISMATCH = "MISSING", "MISMATCH"

_SCRIPT_HEAD = r"""set -u
exec 3>&2 2>&1  # fd 3: the grader's channel; everything else, git's chatter included, to stdout
read -r NONCE < {dir}/nonce
rm -f {dir}/nonce
note() {{ printf '@@ %s %s\n' "$NONCE" "$*" >&3; }}
G=$(mktemp -d) && mv {dir}/* "$G"/ && rmdir {dir} || {{ note error "cannot move the grader's files"; exit 0; }}
g() {{ git -c core.hooksPath=/dev/null -c core.fsmonitor=false "$@"; }}
apply_candidate() {{
  if [ ! -s "$G/model.patch" ]; then note model none; return; fi
  if g apply --verbose "$G/model.patch"; then note model git apply; return; fi
  if g apply --verbose --reject "$G/model.patch"; then note model git apply --reject; return; fi
  if patch --batch --fuzz=5 -p1 -i "$G/model.patch"; then note model patch --fuzz=5; return; fi
  note model-failed; exit 0
}}
apply_tests() {{ g apply --verbose "$G/test.patch" || {{ note test-patch-failed; exit 0; }}; }}
reset_to_base() {{
  for f in "$@"; do g checkout -q {base} -- "$f" 2>/dev/null || rm -rf -- "$f"; done
}}
"""

_SCRIPT_TAIL = r"""J=$(mktemp -d)
echo ">>>>> $NONCE start"
{command} < /dev/null 3>&-
rc=$?
echo ">>>>> $NONCE end"
note exit "$rc"
if [ -s "$J/junit.xml" ]; then note junit "$(base64 -w0 "$J/junit.xml")"; else note junit none; fi
rm -rf "$J" "$G"
"""


def grade_repo(task: RepoTask, patch: str, executor: Executor, options: GradeOptions) -> GradeResult:
    candidate_paths = touched_paths(patch)
    if refused := refused_path(candidate_paths):
        return GradeResult(task.task_id, "repo", TaskStatus.PATCH_FAILED,
                           reason=f"candidate patch touches {refused!r}: refused")
    test_files = target_paths(task.test_patch)
    reverted = reverted_files(options.access, candidate_paths, test_files)
    pytest = "pytest" in task.test_cmd.split()
    command = " ".join([task.test_cmd, *(['--junitxml="$J/junit.xml"'] if pytest else []),
                        *map(shlex.quote, directives_for(task.repo, test_files))])
    script = eval_script(task.base_commit, options.access, [*test_files, *reverted], command)
    nonce = secrets.token_hex(16)
    files = {f"{GRADER_DIR}/eval.sh": script, f"{GRADER_DIR}/nonce": nonce, f"{GRADER_DIR}/model.patch": patch,
             f"{GRADER_DIR}/test.patch": task.test_patch}
    result = executor.run(RunRequest(argv=("bash", f"{GRADER_DIR}/eval.sh"),
                                     files={k: v.encode() for k, v in files.items()}, env=dict(options.env),
                                     timeout=options.repo_timeout, memory_mb=options.repo_memory_mb,
                                     max_output=options.repo_max_output))
    return judge(task, read_run(result, nonce), options.access, reverted, task.test_cmd, pytest)


def directives_for(repo: str, test_files: list[str]) -> list[str]:
    """What the test command gets: the test patch's files; for Django's runner, their module names."""
    if repo != "django/django":
        return test_files
    modules = [path.removesuffix(".py") for path in test_files if path.endswith(".py")]
    return [m.removeprefix("tests/").replace("/", ".") for m in modules]


def eval_script(base_commit: str, access: TestAccess, reset_paths: list[str], command: str) -> str:
    steps = {
        TestAccess.OPEN: ["apply_tests", "apply_candidate"],
        TestAccess.READ_ONLY: ["apply_tests", "apply_candidate", "reset_to_base {paths}", "apply_tests"],
        TestAccess.HIDDEN: ["apply_candidate", "reset_to_base {paths}", "apply_tests"],
    }[access]
    paths = " ".join(shlex.quote(p) for p in dict.fromkeys(reset_paths))
    head = _SCRIPT_HEAD.format(dir=GRADER_DIR, base=shlex.quote(base_commit))
    return head + "\n".join(step.format(paths=paths) for step in steps) + "\n" + _SCRIPT_TAIL.format(command=command)


@dataclass
class Run:
    """One evaluation run, read back: only what carries the nonce."""
    result: RunResult
    notes: dict[str, str]  # the grader channel's notes: model, exit, junit, errors
    apply_log: str  # stdout before the start marker: patch application
    test_log: str | None  # between the markers; None if the tests never started


def read_run(result: RunResult, nonce: str) -> Run:
    notes: dict[str, str] = {}
    prefix = f"@@ {nonce} "
    for line in result.stderr.decode("utf-8", "replace").splitlines():
        if line.startswith(prefix):
            key, _, value = line[len(prefix):].partition(" ")
            notes[key] = value
    stdout = result.stdout.decode("utf-8", "replace")
    start, end = f">>>>> {nonce} start\n", f">>>>> {nonce} end\n"
    apply_log, started, rest = stdout.partition(start)
    if not started:
        return Run(result, notes, apply_log, None)
    test_log = rest.partition(end)[0] if end in rest else rest  # no end marker: cut short (timeout, output limit)
    return Run(result, notes, apply_log, test_log)


def judge(task: RepoTask, run: Run, access: TestAccess, reverted: list[str], test_cmd: str,
          pytest: bool) -> GradeResult:
    notes = run.notes
    if "model-failed" in notes:
        return GradeResult(task.task_id, "repo", TaskStatus.PATCH_FAILED,
                           reason="candidate patch does not apply (git apply, git apply --reject, patch --fuzz=5)",
                           repo=_report(task, run, access, reverted, test_cmd, {}, "", []))
    if "test-patch-failed" in notes or "error" in notes or run.test_log is None and not run.result.timed_out:
        why = ("test patch does not apply" if "test-patch-failed" in notes
               else notes.get("error") or "the evaluation script ended before the tests started")
        return GradeResult(task.task_id, "repo", TaskStatus.ERROR, reason=why,
                           repo=_report(task, run, access, reverted, test_cmd, {}, "", []))
    log_statuses = (parse_pytest_log if pytest else parse_unittest_log)(run.test_log or "")
    statuses, crosscheck, mismatches = _crosscheck(task, log_statuses, notes.get("junit"), pytest)
    report = _report(task, run, access, reverted, test_cmd, statuses, crosscheck, mismatches)
    failing = [t for t, s in {**report.fail_to_pass, **report.pass_to_pass}.items()
               if s not in _SUCCESS and s not in _NEUTRAL]
    if report.resolved:
        reason = ""
    elif run.result.timed_out:
        reason = "the test run timed out"
    else:
        reason = f"{len(failing)} of the FAIL_TO_PASS/PASS_TO_PASS tests failed, first {failing[0]}"
    return GradeResult(task.task_id, "repo", TaskStatus.PASSED if report.resolved else TaskStatus.FAILED,
                       score=1.0 if report.resolved else 0.0, reason=reason, repo=report)


def _crosscheck(task: RepoTask, log_statuses: dict[str, TestStatus], junit_note: str | None,
                pytest: bool) -> tuple[dict[str, str], str, list[str]]:
    tests = [*task.fail_to_pass, *task.pass_to_pass]
    if not pytest:
        return {t: log_statuses[t].value if t in log_statuses else MISSING for t in tests}, "log-only", []
    junit = _junit(junit_note)
    if junit is None:
        return {t: MISSING for t in tests}, "junit-missing", []
    statuses, mismatches = {}, []
    for test in tests:
        from_log, from_junit = log_statuses.get(test), junit.get(junit_key(test))
        if from_log == from_junit:
            statuses[test] = from_log.value if from_log else MISSING
        else:
            statuses[test] = MISMATCH
            mismatches.append(f"{test}: log {from_log.value if from_log else MISSING}, "
                              f"junit {from_junit.value if from_junit else MISSING}")
    return statuses, "junit", mismatches


def _junit(note: str | None) -> dict | None:
    if not note or note == "none":
        return None
    try:
        return parse_junit(base64.b64decode(note, validate=True).decode("utf-8", "replace"))
    except (ValueError, binascii.Error):
        return None


def _report(task: RepoTask, run: Run, access: TestAccess, reverted: list[str], test_cmd: str,
            statuses: dict[str, str], crosscheck: str, mismatches: list[str]) -> RepoReport:
    fail_to_pass = {t: statuses.get(t, MISSING) for t in task.fail_to_pass}
    pass_to_pass = {t: statuses.get(t, MISSING) for t in task.pass_to_pass}
    outcomes = [*fail_to_pass.values(), *pass_to_pass.values()]
    resolved = bool(statuses) and all(s in _SUCCESS or s in _NEUTRAL for s in outcomes)
    exit_note = run.notes.get("exit", "")
    applied = run.notes.get("model")
    return RepoReport(access=access.value, patch_applied_with=None if applied in (None, "none") else applied,
                      reverted_files=reverted, test_command=test_cmd,
                      test_exit_code=int(exit_note) if exit_note.isdigit() else None,
                      timed_out=run.result.timed_out, fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass,
                      resolved=resolved, crosscheck=crosscheck, mismatches=mismatches,
                      apply_log=run.apply_log, log=run.test_log or "")
