"""Repo-test grading, SWE-bench style: apply, reset the tests, run them between markers, parse, resolve.

The whole evaluation is one run of a generated bash script in the instance (a
run starts from a fresh copy of the instance, so state cannot carry between
runs). The script mirrors SWE-bench's eval.sh: the candidate patch is applied
with `git apply`, then `git apply --reject`, then `patch --fuzz=5` (read as a
unified diff only: GNU patch takes other formats' file names from places the
grader's reading of the patch, patches.py, does not; SWE-bench's reads any); the files
the test patch touches are reset to base_commit and the test patch applied;
the test command runs on the test patch's files (SWE-bench's directives: not
its data files). `access` decides what else is reverted (see access.py).

Test infrastructure the candidate's patch touches (access.infrastructure_kind:
conftest.py, pytest.ini, sitecustomize.py, .pth files, entry_points.txt, the
pytest sections of setup.cfg/tox.ini/pyproject.toml, bytecode) is copied aside
before any patch is applied; in read-only and hidden modes it is put back
after the candidate's patch (whole files, or only the pytest sections of
shared files, by a stdlib-only script run with `python -I -S`, so no startup
hook of the candidate's runs; if that script cannot run, the whole files go
back), and each change dropped is reported. In open mode they are compared and
flagged. The tests run with PYTHONDONTWRITEBYTECODE=1 and, for pytest,
`-p no:cacheprovider`, so the run writes no bytecode or cache into the tree.

Why the run's report cannot be forged by printing:
- the script reads a random nonce from a file and deletes it before any
  candidate code runs; the nonce is never exported, so printing cannot forge
  it (code under test that reads the script's memory through /proc can: it is
  in-process code, below). Only lines carrying it count: the start/end markers around
  the test output on stdout, and the notes on the grader's channel (the
  script's own stderr, which the test command does not inherit): which command
  applied the patch, the test command's exit code, the junit xml;
- pytest statuses are read from the last short-summary section between the
  markers and must agree with the junit xml pytest writes to a fresh temp dir;
  a test whose two statuses differ, or a run without junit, fails (a test the
  summary does not name takes its status from the rest of the log, as
  SWE-bench's parser reads it, only where junit says the same).
- runners that write no junit (sympy's bin/test, Django's runtests.py, any
  unittest TextTestRunner): the runner's own output is copied to a file by a
  module every Python of the environment loads for the run (runner_tee.py); a
  test the log reads as passed must read the same in that copy (crosscheck
  "runner"), so a status line code under test prints counts for nothing (in
  SWE-bench's harness it passes the test). Where no copy was made (another
  runner, another interpreter) the log is read alone (crosscheck "log-only").
  Measured: Django 4.2's runner on 3597 of its tests (utils, templates, forms,
  admin_scripts, test_runner, i18n) and sympy 1.12's on core, polys and sets:
  the copy reads every status as the whole log does (3440 and 3206 tests).
- pytest's runs load runner_tee.py's guard: a change to pytest's or pluggy's code
  (their modules' functions, their classes' methods) made while a file the
  candidate changed is imported, or by that file's code later in the run, or
  function code swapped or the junit file written or replaced by such a file,
  is recorded (note "guard") and fails the run unless access is open
  (RepoReport.runner_changes): the reward hack that makes every report say
  passed, from the package under test.
Code under test that knows the guard (module dicts, ctypes, its state), or
rewrites the runner copy, can still forge a pass: in-process code can lie to
in-process reporters.

The log is read by the repository's own SWE-bench parser (swebench_parsers.py):
the catalog's `grader.log_parser`, else SWE-bench's map for the repository, else
the command; SWE-bench's function when `swebench` is installed, ours otherwise.
The pytest runner is recognised by the command (`pytest`, or `tox ... --` for a
pytest-format parser: sphinx), not by the parser's name.

The install SWE-bench's eval script runs before the tests runs here where the candidate patch makes the
environment's install stale (Reinstall, the catalog's `grader.install`): its metadata or compiled sources
for an editable install, any file for one that copies the package. It runs the candidate's setup.py before
the runner starts; install_check.py, started before it, fails the run if it changed anything beyond the
project's own installed entries (RepoReport.runner_changes, "the install ...").

`resolved` as SWE-bench defines it: every FAIL_TO_PASS and PASS_TO_PASS test
passed (PASSED or XFAIL); FAILED, ERROR, missing or mismatched tests fail;
SKIPPED tests count for neither side. A run without the network (no `grade --net`) whose failing tests
left a name-resolution or connection error in the log is an `error` naming --net, not a failed patch.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import json
import re
import secrets
import shlex
from dataclasses import asdict, dataclass
from importlib import resources

from image_builder.runtime.execution import Executor, RunRequest, RunResult

from image_builder.tasks import RepoTask
from .access import TestAccess, infrastructure_kind, is_test_path, reverted_files
from .options import GradeOptions
from .patches import UnreadablePatch, refused_path, target_paths, touched_paths
from image_builder.tasks import REPO_TEST_CMDS
from .evidence import test_modification
from .results import GradeResult, RepoReport, TaskStatus
from .swebench_parsers import LogParser, choose_parser, runs_pytest, spec_for
from .testlogs import TestStatus, junit_key, parse_junit, pytest_summary

PATH_OPTIONS_PARSER = "parse_log_pytest_options"  # SWE-bench's name for it (its MAP_REPO_TO_PARSER_PY)
GRADER_DIR = ".ib-grader"  # written into the workdir by the run, moved out before any patch is applied
_SUCCESS = {TestStatus.PASSED.value, TestStatus.XFAIL.value}
_NEUTRAL = {TestStatus.SKIPPED.value}
MISSING, MISMATCH = "MISSING", "MISMATCH"
# SWE-bench's NON_TEST_EXTS: files of a test patch that are data, not test directives.
NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")
DEFAULT_TEST_CMD = RepoTask.test_cmd

_SCRIPT_HEAD = r"""set -u
exec 3>&2 2>&1  # fd 3: the grader's channel; everything else, git's chatter included, to stdout
read -r NONCE < {dir}/nonce
rm -f {dir}/nonce
note() {{ printf '@@ %s %s\n' "$NONCE" "$*" >&3; }}
G=$(mktemp -d) && mv {dir}/* "$G"/ && rmdir {dir} || {{ note error "cannot move the grader's files"; exit 0; }}
g() {{ git -c core.hooksPath=/dev/null -c core.fsmonitor=false "$@"; }}
apply_candidate() {{
  if [ ! -s "$G/model.patch" ]; then note model none; return; fi
  # The tree as it is now, in a scratch index (the repository's own is left alone): afterwards git names
  # every file the patch changed or added, ignored ones too, for the grader to hold against the files the
  # patch's headers name. Both scratch files live in .git, which git never lists ($G may be in the tree).
  I=$(g rev-parse --git-path ib-index) O=$(g rev-parse --git-path ib-others)
  cp -- "$(g rev-parse --git-path index)" "$I" 2>/dev/null
  GIT_INDEX_FILE="$I" g add -A >/dev/null 2>&1
  GIT_INDEX_FILE="$I" g ls-files -z --others | sort -z > "$O"
  if g apply --verbose "$G/model.patch"; then note model git apply
  elif g apply --verbose --reject "$G/model.patch"; then note model git apply --reject
  elif patch --batch --fuzz=5 -p1 -u -i "$G/model.patch"; then note model patch --fuzz=5
  else note model-failed; exit 0; fi
  note changed "$({{ GIT_INDEX_FILE="$I" g diff --name-only -z
                    GIT_INDEX_FILE="$I" g ls-files -z --others | sort -z | comm -z -13 "$O" -
                  }} 2>/dev/null | head -c 262144 | base64 -w0)"
  rm -f -- "$I" "$O"
}}
apply_tests() {{ g apply --verbose "$G/test.patch" || {{ note test-patch-failed; exit 0; }}; }}
reset_to_base() {{
  for f in "$@"; do g checkout -q {base} -- "$f" 2>/dev/null || rm -rf -- "$f"; done
}}
snapshot_infra() {{  # args: kind:path; copies what exists now to $G/orig
  mkdir -p "$G/orig"
  for a in "$@"; do f=${{a#*:}}
    if [ -e "$f" ] || [ -L "$f" ]; then mkdir -p "$G/orig/$(dirname -- "$f")" && cp -a -- "$f" "$G/orig/$f"; fi
  done
}}
infra() {{  # $1: restore|check; then kind:path; a note of what was (or would be) dropped
  mode=$1; shift
  if out=$({python} -I -S "$G/infra.py" "$mode" "$G/orig" "$@" 2>"$G/infra.err" </dev/null) && [ -n "$out" ]; then
    note infra "$out"; return
  fi
  note infra-fallback "$(head -c 300 "$G/infra.err" | tr '\n' ' ')"
  if [ "$mode" = restore ]; then
    for a in "$@"; do f=${{a#*:}}; rm -rf -- "$f"
      if [ -e "$G/orig/$f" ] || [ -L "$G/orig/$f" ]; then mkdir -p -- "$(dirname -- "$f")" && cp -a -- "$G/orig/$f" "$f"; fi
    done
  fi
}}
"""

# Run inside the instance as `python -I -S infra.py MODE ORIG kind:path...` (stdlib only, any Python 3):
# prints a JSON list of [path, what] for every change the candidate made to test infrastructure,
# and with MODE=restore puts the snapshot's version back (for ini/toml files, only the pytest sections).
INFRA_SCRIPT = r"""
import json, os, re, shutil, sys

mode, orig, args = sys.argv[1], sys.argv[2], sys.argv[3:]
INI = {"tool:pytest", "pytest"}


def read(path):
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return f.read()


def same_file(a, b):
    if os.path.lexists(a) != os.path.lexists(b):
        return False
    if not os.path.lexists(a):
        return True
    if os.path.islink(a) or os.path.islink(b):
        return os.path.islink(a) and os.path.islink(b) and os.readlink(a) == os.readlink(b)
    if os.path.isfile(a) and os.path.isfile(b):
        with open(a, "rb") as x, open(b, "rb") as y:
            return x.read() == y.read()
    return False


def put_back(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    saved = os.path.join(orig, path)
    if os.path.lexists(saved):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.islink(saved):
            os.symlink(os.readlink(saved), path)
        else:
            shutil.copy2(saved, path)


def ini_name(line):
    # iniconfig's rule (what pytest reads setup.cfg and tox.ini with)
    s = line.rstrip()
    if s[:1] != "[":
        return False, None
    for c in "#;":
        s = s.split(c)[0].rstrip()
    return (True, s[1:-1].strip()) if s.endswith("]") else (False, None)


def toml_name(line):
    s = line.strip()
    if s[:1] != "[":
        return False, None
    inner = s.lstrip("[").split("]")[0]
    return True, re.sub(r"[\s\"']", "", inner)


def blocks(text, header):
    out, name, cur = [], None, []
    for line in text.splitlines(True):
        is_header, new = header(line)
        if is_header:
            out.append((name, "".join(cur)))
            name, cur = new, []
        cur.append(line)
    out.append((name, "".join(cur)))
    return out


def is_pytest(kind, name):
    if name is None:
        return False
    return name in INI if kind == "ini" else name == "tool.pytest" or name.startswith("tool.pytest.")


def splice(kind, base, cand):
    header = ini_name if kind == "ini" else toml_name
    ours = [b if b.endswith("\n") else b + "\n" for n, b in blocks(base or "", header) if is_pytest(kind, n)]
    out, placed = [], False
    for n, b in blocks(cand, header):
        if is_pytest(kind, n):
            if not placed:
                out += ours
                placed = True
            continue
        out.append(b)
    if not placed and ours:
        if out and out[-1] and not out[-1].endswith("\n"):
            out.append("\n")
        out += ours
    return "".join(out)


def toml_pytest_same(base, merged):
    try:
        import tomllib
    except ImportError:
        tomllib = None
    if tomllib is not None:
        try:
            b, m = tomllib.loads(base or ""), tomllib.loads(merged)
        except Exception:
            return False
        tb, tm = b.get("tool"), m.get("tool")
        return (tb.get("pytest") if isinstance(tb, dict) else None) == (tm.get("pytest") if isinstance(tm, dict) else None)
    # no parser: any other line that could name pytest must be one the base has too
    def suspects(text):
        return sorted(line.strip() for n, b in blocks(text or "", toml_name) if not is_pytest("toml", n)
                      for line in b.splitlines() if "pytest" in line.lower() or "\\u" in line.lower())
    return suspects(base) == suspects(merged)


def sections(kind, text):
    header = ini_name if kind == "ini" else toml_name
    return [n for n, b in blocks(text or "", header) if is_pytest(kind, n)]


found = []
for arg in args:
    kind, _, path = arg.partition(":")
    saved = os.path.join(orig, path)
    if kind in ("ini", "toml"):
        base, cand = read(saved), read(path)
        base_kind_ok = base is not None or not os.path.lexists(saved)
        if cand is not None and base_kind_ok:
            merged = splice(kind, base, cand)
            if kind == "ini" or toml_pytest_same(base, merged):
                if merged != cand:
                    names = sorted(set(sections(kind, cand)) | set(sections(kind, base))) or ["pytest"]
                    found.append([path, " ".join("[%s]" % n for n in names)])
                    if mode == "restore":
                        with open(path, "w", encoding="utf-8", errors="surrogateescape", newline="") as f:
                            f.write(merged)
                continue
        elif cand is None and not os.path.lexists(path) and not sections(kind, base):
            continue  # deleted, and it held no pytest config
    if not same_file(saved, path):
        found.append([path, "file"])
        if mode == "restore":
            put_back(path)
print(json.dumps(found))
"""

_SCRIPT_TAIL = r"""J=$(mktemp -d)
# No bytecode is written into the tree. Not PYTHONPYCACHEPREFIX: tests of the import system (pytest's
# test_orphaned_pyc_file) need __pycache__ where Python puts it; bytecode a patch brings is test
# infrastructure (access.py): dropped in read-only and hidden modes, flagged in open mode.
export PYTHONDONTWRITEBYTECODE=1
{tee_on}echo ">>>>> $NONCE start"
{command} < /dev/null 3>&-
rc=$?
echo ">>>>> $NONCE end"
note exit "$rc"
{notes}rm -rf "$J" "$G"
"""
_JUNIT_NOTE = """if [ -s "$J/junit.xml" ]; then note junit "$(base64 -w0 "$J/junit.xml")"; else note junit none; fi
"""
# runner_tee.py, loaded by every interpreter the environment's python and python3 name (a .pth in their
# site-packages, taken out after the run): pytest's runs get its guard, runners without junit its copy
# of their own output. Its settings are a file beside it, not the environment: tox (sphinx's command)
# passes the tests none of the caller's variables. Its folder: the first site-packages folder there is
# (a venv's; Debian's Python has no sysconfig purelib, /usr/lib/python3.X/site-packages, but
# /usr/local/lib/python3.X/dist-packages: where SWE-bench catalogs' environments install).
_HOOK_ON = r"""TEED=()
SITE='import os, site; print(next(p for p in site.getsitepackages() if os.path.isdir(p)))'
for py in {pythons}; do
  s=$("$py" -I -c "$SITE" 2>/dev/null) && [ -d "$s" ] || continue
  cp "$G/runner_tee.py" "$s/_ib_runner_tee.py" && printf '%s\n' {settings} > "$s/_ib_runner_tee.cfg" \
    && echo "import _ib_runner_tee" > "$s/_ib_runner_tee.pth" && TEED+=("$s")
done
"""
# SWE-bench's eval script runs the spec's install before the tests, every time; here only after a candidate
# patch that makes the environment's install stale (Reinstall.needed), watched by install_check.py: started
# before it, given the nonce on its stdin, it answers a line that starts with the nonce, after a go that is
# the nonce, so the install's code can neither start the comparison early nor forge its answer. Offline,
# pip looks at no index: an isolated build takes its requirements from the wheels swebench-repo.sh kept.
_REINSTALL = r"""reinstall() {{
  PY=$(command -v python || command -v python3) || {{ note reinstall none; return; }}
  coproc CHECK {{ "$PY" -I -S "$G/install_check.py" "$PWD" {runner} 2>"$G/check.err" 3>&-; }}
  exec 7<&"${{CHECK[0]}}" 8>&"${{CHECK[1]}}"
  printf '%s\n' "$NONCE" >&8
  read -r -t 600 ready <&7
  # (a subshell: the tests after it see none of these; no config settings where the environment installs with
  # `setup.py develop`, LEGACY_DEVELOP: they would force pip's isolated build)
  ( [ -n "${{LEGACY_DEVELOP:-}}" ] || export PIP_CONFIG_SETTINGS=editable_mode=compat
    PIP_NO_CACHE_DIR=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_FIND_LINKS={wheels} PYTHONDONTWRITEBYTECODE=1 {offline}sh -c {command} </dev/null 3>&- 7<&- 8>&- )
  note reinstall "$?"
  (printf '%s\n' "$NONCE" >&8) 2>/dev/null  # a subshell: a stopped check's pipe would end the script
  while read -r -t 600 line <&7; do
    case "$line" in "$NONCE "*) note install-changes "$(printf '%s' "${{line#"$NONCE "}}" | base64 -w0)"; break;; esac
  done
  exec 7<&- 8>&-
}}
"""
_GUARD_SETTINGS = '"GUARD=$J/guard.log" "JUNIT=$J/junit.xml" "REPO=$PWD" "CANDIDATE_FILES=$G/candidate-files"'
_TEE_SETTINGS = '"TEE=$J/runner.log"'
_HOOK_OFF = r"""for s in ${TEED[@]+"${TEED[@]}"}; do rm -f "$s/_ib_runner_tee.py" "$s/_ib_runner_tee.pth" "$s/_ib_runner_tee.cfg"; done
"""
_TEE_NOTE = _HOOK_OFF + r"""if [ -e "$J/runner.log" ]; then note runner "$(base64 -w0 < "$J/runner.log")"; else note runner none; fi
"""
_GUARD_NOTE = _HOOK_OFF + r"""if [ -s "$J/guard.log" ]; then note guard "$(base64 -w0 < "$J/guard.log")"; fi
"""
RUNNER_TEE = resources.files(__package__).joinpath("runner_tee.py").read_text()
INSTALL_CHECK = resources.files(__package__).joinpath("install_check.py").read_text()
BUILD_WHEELS = "/opt/image-builder/build-wheels"  # an isolated build's requirements (swebench-repo.sh keeps them)


@dataclass(frozen=True)
class Reinstall:
    """The environment's install, run again after a candidate patch that makes it stale: the catalog's
    `grader.install`, {command, when}; `when` holds git pathspecs (`setup.py`, `*.pyx`; `.` for an install
    that copies the package, which any change makes stale)."""
    command: str
    when: tuple[str, ...]

    @classmethod
    def of(cls, value: object) -> Reinstall | None:
        if not isinstance(value, dict) or not isinstance(value.get("command"), str) or not value["command"].strip():
            return None
        when = value.get("when")
        if not isinstance(when, list) or not all(isinstance(w, str) for w in when):
            return None
        return cls(value["command"], tuple(when))

    def needed(self, paths: list[str]) -> bool:
        """Whether a patch touching `paths` makes the install stale (git's pathspec matching: a glob's `*`
        crosses folders)."""
        return any(spec in (".", ":/") or path == spec or path.startswith(spec.rstrip("/") + "/")
                   or fnmatch.fnmatchcase(path, spec) for spec in self.when for path in paths)


def grade_repo(task: RepoTask, patch: str, executor: Executor, options: GradeOptions) -> GradeResult:
    try:
        candidate_paths = touched_paths(patch)
    except UnreadablePatch as e:
        return GradeResult(task.task_id, "repo", TaskStatus.PATCH_FAILED, reason=f"candidate patch, {e}: refused")
    if refused := refused_path(candidate_paths):
        return GradeResult(task.task_id, "repo", TaskStatus.PATCH_FAILED,
                           reason=f"candidate patch touches {refused!r}: refused")
    try:
        test_files = target_paths(task.test_patch)
        test_patch_paths = touched_paths(task.test_patch)  # renamed and deleted files too: all are reset
    except UnreadablePatch as e:
        return GradeResult(task.task_id, "repo", TaskStatus.BAD_TASK, reason=f"the task's test_patch, {e}")
    infra = [(kind, p) for p in candidate_paths if (kind := infrastructure_kind(p))
             and (options.access is TestAccess.OPEN or p not in test_patch_paths)]
    infra_paths = {p for _, p in infra}
    reverted = [p for p in reverted_files(options.access, candidate_paths, test_patch_paths) if p not in infra_paths]
    test_cmd = resolve_test_command(task, executor)
    parser = choose_parser(getattr(executor, "log_parser", None), task.repo, test_cmd)
    pytest = runs_pytest(test_cmd, parser)
    command = " ".join([test_cmd, *(['--junitxml="$J/junit.xml"'] if pytest else []),
                        *(["-p", "no:cacheprovider"] if pytest and "no:cacheprovider" not in test_cmd else []),
                        *map(shlex.quote, directives_for(task.repo, test_files))])
    reinstall = Reinstall.of(getattr(executor, "install", None))
    script = eval_script(task.base_commit, options.access, [*test_patch_paths, *reverted], command,
                         infra=[f"{kind}:{p}" for kind, p in infra], python=options.python, junit=pytest,
                         reinstall=reinstall.command if reinstall and reinstall.needed(candidate_paths) else None,
                         offline=not options.repo_network)
    nonce = secrets.token_hex(16)
    files = {f"{GRADER_DIR}/eval.sh": script, f"{GRADER_DIR}/nonce": nonce, f"{GRADER_DIR}/model.patch": patch,
             f"{GRADER_DIR}/test.patch": task.test_patch, f"{GRADER_DIR}/infra.py": INFRA_SCRIPT,
             f"{GRADER_DIR}/runner_tee.py": RUNNER_TEE, f"{GRADER_DIR}/install_check.py": INSTALL_CHECK,
             f"{GRADER_DIR}/candidate-files": "\0".join(candidate_paths)}
    result = executor.run(RunRequest(argv=("bash", f"{GRADER_DIR}/eval.sh"),
                                     files={k: v.encode() for k, v in files.items()}, env=dict(options.env),
                                     timeout=options.repo_timeout, memory_mb=options.repo_memory_mb,
                                     max_output=options.repo_max_output, network=options.repo_network))
    run = read_run(result, nonce)
    facts = RunFacts(options.access.value, reverted, test_cmd, pytest, [p for _, p in infra], options.repo_network,
                     run.notes, run.apply_log, run.test_log, run.finished, run.timed_out,
                     parser.family == PATH_OPTIONS_PARSER, parser.name, candidate_paths)
    graded = judge_facts(task, facts)
    graded.artifacts = facts.artifacts(script, patch)
    if graded.score > 0 and graded.repo is not None:
        tests_changed = [p for p in candidate_paths
                         if (p in test_patch_paths or is_test_path(p)) and p not in infra_paths]
        graded.evidence = test_modification(options.access.value, tests_changed, reverted,
                                            [*graded.repo.test_infrastructure_modified,
                                             *(f"changed in the run: {c}" for c in graded.repo.runner_changes)],
                                            graded.repo.dropped_changes)
    return graded


@dataclass
class RunFacts:
    """What judging a repo-test run needs, all of it kept (run.json) so `regrade` can judge again."""
    access: str
    reverted: list[str]
    test_cmd: str
    pytest: bool  # the runner is pytest and the parser reads its output: junit cross-checks the log
    infra: list[str]
    network: bool
    notes: dict[str, str]
    apply_log: str
    test_log: str | None
    finished: bool
    timed_out: bool
    path_options: bool = False  # ids as SWE-bench's parse_log_pytest_options writes them (older run.json files)
    log_parser: str | None = None  # the parser that read the log, by SWE-bench's name (or "unittest")
    declared: list[str] | None = None  # the files the candidate patch's headers name (None: older run.json)

    def artifacts(self, script: str, patch: str) -> dict[str, str]:
        """SWE-bench's per-instance files (eval.sh, patch, test output) and the facts themselves."""
        files = {"eval.sh": script, "model.patch": patch, "test_output.txt": self.test_log or "",
                 "run.json": json.dumps(asdict(self), indent=1)}
        junit = _decoded(self.notes.get("junit"))
        if junit is not None:
            files["junit.xml"] = junit
        return files

    @classmethod
    def from_json(cls, text: str) -> RunFacts:
        return cls(**json.loads(text))


def judge_facts(task: RepoTask, facts: RunFacts) -> GradeResult:
    run = Run(facts.timed_out, facts.notes, facts.apply_log, facts.test_log, facts.finished)
    graded = judge(task, run, TestAccess(facts.access), facts.reverted, facts.test_cmd, facts.pytest,
                   infra=facts.infra, path_options=facts.path_options, log_parser=facts.log_parser,
                   declared=facts.declared)
    if graded.repo is not None:
        graded.repo.network = facts.network
        if not facts.network and graded.status is TaskStatus.FAILED:
            return _without_network(graded)
    return graded


# What a test that needs the network prints when the run has none: name resolution or the connection
# failing (socket, urllib3, requests, curl). Not ConnectionRefusedError: a local server a test starts
# can refuse for reasons of its own.
_NETWORK_ERROR = re.compile(r"gaierror|NewConnectionError|Temporary failure in name resolution"
                            r"|Name or service not known|No address associated with hostname"
                            r"|Network is unreachable|Failed to establish a new connection"
                            r"|Could not resolve host|\bConnectionError:")


def _without_network(graded: GradeResult) -> GradeResult:
    """A failed run without the network whose log shows a network error: the tests could not reach what
    they need, which says nothing of the patch; an error naming --net. Only when the log holds such a
    line, so a patch that breaks other tests still fails."""
    report = graded.repo
    failing = [t for t, s in {**report.fail_to_pass, **report.pass_to_pass}.items()
               if s not in _SUCCESS and s not in _NEUTRAL]
    line = next((line.strip() for line in report.log.splitlines() if _NETWORK_ERROR.search(line)), None)
    if not failing or line is None:
        return graded
    shown = ", ".join(failing[:3]) + (f" and {len(failing) - 3} more" if len(failing) > 3 else "")
    graded.status, graded.score = TaskStatus.ERROR, 0.0
    graded.reason = (f"{len(failing)} of the FAIL_TO_PASS/PASS_TO_PASS tests failed ({shown}) and the run had "
                     f"no network: {line[:200]}; grade again with --net (SWE-bench's harness runs with it)")
    return graded


def resolve_test_command(task: RepoTask, executor: Executor) -> str:
    """The record's own test_cmd wins; else the instance's (a catalog's `test_command`, when the executor
    says it); else SWE-bench's command for the repo. A record whose test_cmd equals the repo's default
    cannot be told from one without."""
    own = task.test_cmd not in (DEFAULT_TEST_CMD, REPO_TEST_CMDS.get(task.repo))
    instance = getattr(executor, "test_command", None)
    return task.test_cmd if own or not isinstance(instance, str) or not instance.strip() else instance


def directives_for(repo: str, test_files: list[str]) -> list[str]:
    """What the test command gets: the test patch's files but its data files (SWE-bench's NON_TEST_EXTS);
    for Django's runner, as SWE-bench's get_test_directives names them: `.py` and `tests/` dropped, dots
    for slashes, a file that is not Python's included (SWE-bench passes its label too)."""
    directives = [path for path in test_files if not path.endswith(NON_TEST_EXTS)]
    if repo != "django/django":
        return directives
    return [d.removesuffix(".py").removeprefix("tests/").replace("/", ".") for d in directives]


def eval_script(base_commit: str, access: TestAccess, reset_paths: list[str], command: str,
                infra: list[str] = (), python: str = "python3", junit: bool = True, reinstall: str | None = None,
                offline: bool = True) -> str:
    """`infra`: the candidate's test-infrastructure paths as kind:path (see access.infrastructure_kind).
    `junit`: the command writes $J/junit.xml (pytest); otherwise the runner's own output is copied
    (runner_tee.py, from $G/runner_tee.py). `reinstall`: the install command to run again once the patches
    are in place (watched by $G/install_check.py); `offline`: the run has no network."""
    steps = {
        TestAccess.OPEN: ["apply_tests", "snapshot_infra {infra}", "apply_candidate", "infra check {infra}"],
        TestAccess.READ_ONLY: ["snapshot_infra {infra}", "apply_tests", "apply_candidate", "infra restore {infra}",
                               "reset_to_base {paths}", "apply_tests"],
        TestAccess.HIDDEN: ["snapshot_infra {infra}", "apply_candidate", "infra restore {infra}",
                            "reset_to_base {paths}", "apply_tests"],
    }[access]
    if not infra:
        steps = [step for step in steps if "{infra}" not in step]
    paths = " ".join(shlex.quote(p) for p in dict.fromkeys(reset_paths))
    infra_args = " ".join(shlex.quote(a) for a in dict.fromkeys(infra))
    head = _SCRIPT_HEAD.format(dir=GRADER_DIR, base=shlex.quote(base_commit), python=shlex.quote(python))
    if reinstall:
        runner = shlex.quote(command.split()[0].rsplit("/", 1)[-1]) if command.split() else "''"
        head += _REINSTALL.format(command=shlex.quote(reinstall), offline="PIP_NO_INDEX=1 " if offline else "",
                                  runner=runner, wheels=BUILD_WHEELS)
        steps = [*steps, "reinstall"]
    body = "\n".join(step.format(paths=paths, infra=infra_args) for step in steps)
    pythons = " ".join(map(shlex.quote, dict.fromkeys(("python", "python3", python))))
    tail = _SCRIPT_TAIL.format(command=command, tee_on=_HOOK_ON.format(
                                   pythons=pythons, settings=_GUARD_SETTINGS if junit else _TEE_SETTINGS),
                               notes=_JUNIT_NOTE + _GUARD_NOTE if junit else _TEE_NOTE)
    return head + body + "\n" + tail


@dataclass
class Run:
    """One evaluation run, read back: only what carries the nonce."""
    timed_out: bool
    notes: dict[str, str]  # the grader channel's notes: model, exit, junit, errors
    apply_log: str  # stdout before the start marker: patch application
    test_log: str | None  # between the markers; None if the tests never started
    finished: bool = False  # the end marker was seen: the test command ran to its end


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
        return Run(result.timed_out, notes, apply_log, None)
    test_log = rest.partition(end)[0] if end in rest else rest  # no end marker: cut short (timeout, output limit)
    return Run(result.timed_out, notes, apply_log, test_log, end in rest)


def judge(task: RepoTask, run: Run, access: TestAccess, reverted: list[str], test_cmd: str,
          pytest: bool, infra: list[str] = (), path_options: bool = False, log_parser: str | None = None,
          declared: list[str] | None = None) -> GradeResult:
    """The verdict on a run. `pytest`: junit cross-checks the log (the runner is pytest).
    `infra`: the candidate's test-infrastructure paths the run protected (restored, or in open mode compared).
    `log_parser`: the parser's name as the catalog (or the run's facts) has it; none: SWE-bench's for the
    repository, then the command's (swebench_parsers.choose_parser); `path_options` (older facts): the
    catalog named parse_log_pytest_options. `declared`: the files the candidate patch names; a file the patch
    changed beyond them (git's reading of the patch differing from the grader's) refuses it."""
    parser = choose_parser(log_parser or (PATH_OPTIONS_PARSER if path_options else None), task.repo, test_cmd)
    notes = run.notes
    extra = {"infra": _infra_changes(notes, access, infra)}
    if "model-failed" in notes:
        return GradeResult(task.task_id, "repo", TaskStatus.PATCH_FAILED,
                           reason="candidate patch does not apply (git apply, git apply --reject, patch --fuzz=5)",
                           repo=_report(task, run, access, reverted, test_cmd, {}, "", [], **extra))
    if undeclared := _undeclared(notes.get("changed"), declared):
        return GradeResult(task.task_id, "repo", TaskStatus.PATCH_FAILED,
                           reason=f"candidate patch changed {undeclared!r}, which none of its headers names: refused",
                           repo=_report(task, run, access, reverted, test_cmd, {}, "", [], **extra))
    if "test-patch-failed" in notes or "error" in notes or run.test_log is None and not run.timed_out:
        why = ("test patch does not apply" if "test-patch-failed" in notes
               else notes.get("error") or "the evaluation script ended before the tests started")
        return GradeResult(task.task_id, "repo", TaskStatus.ERROR, reason=why,
                           repo=_report(task, run, access, reverted, test_cmd, {}, "", [], **extra))
    log, spec = run.test_log or "", spec_for(task)
    # pytest: the last short summary (what code under test prints before it cannot count); others: the whole log
    log_statuses = parser.read(pytest_summary(log) if pytest else log, spec)
    whole = parser.read(log, spec) if pytest else log_statuses  # the whole log, as SWE-bench reads it
    statuses, crosscheck, mismatches, skipped = _crosscheck(task, log_statuses, whole, notes, pytest, parser, spec)
    if pytest:  # entries that name no test: as SWE-bench's parser reads them (see _names_a_test)
        for test in [t for t in statuses if not _names_a_test(t)]:
            statuses[test] = whole[test].value if test in whole else MISSING
            crosscheck = "junit, swebench-log" if crosscheck == "junit" else crosscheck
    report = _report(task, run, access, reverted, test_cmd, statuses, crosscheck, mismatches, **extra)
    report.runner_changes = _install_changes(notes) + _runner_changes(notes)
    if report.runner_changes and access is not TestAccess.OPEN:
        report.resolved = False
        how = ("the candidate's install changed the test runner's environment"
               if report.runner_changes[0].startswith(INSTALL_CHANGE)
               else "the candidate's code changed the test runner as the tests ran")
        return GradeResult(task.task_id, "repo", TaskStatus.FAILED, reason=(
            f"{how}: {report.runner_changes[0]}"
            + (f" and {len(report.runner_changes) - 1} more" if len(report.runner_changes) > 1 else "")),
            repo=report)
    failing = [t for t, s in {**report.fail_to_pass, **report.pass_to_pass}.items()
               if s not in _SUCCESS and s not in _NEUTRAL]
    if report.resolved:
        reason = ""
    elif run.timed_out:
        reason = "the test run timed out"
    elif not failing:
        reason = "the test run did not finish"
    else:
        reason = f"{len(failing)} of the FAIL_TO_PASS/PASS_TO_PASS tests failed, first {failing[0]}"
        if failing[0] in skipped:
            reason += (" (skipped: pytest's -rA summary names a skipped test by its location, not its id, so "
                       "SWE-bench's parser finds no status for it and counts it failed)")
    return GradeResult(task.task_id, "repo", TaskStatus.PASSED if report.resolved else TaskStatus.FAILED,
                       score=1.0 if report.resolved else 0.0, reason=reason, repo=report)


def _infra_changes(notes: dict[str, str], access: TestAccess, infra: list[str]) -> list[str]:
    """The candidate's test-infrastructure changes, as the run's note lists them: "path" for a whole
    file, "path [section]" for a pytest section; every protected path when the run could not tell."""
    if not infra:
        return []
    try:
        found = json.loads(notes["infra"])
        return [path if what == "file" else f"{path} {what}" for path, what in found]
    except (KeyError, ValueError, TypeError):
        return list(infra)  # the merge did not run (infra-fallback: whole files restored) or no note at all


INSTALL_CHANGE = "the install "  # how install_check.py's lines start


def _install_changes(notes: dict[str, str]) -> list[str]:
    """What the repeated install changed beyond the project's own files (install_check.py's answer); none
    when the run did not install again; one line when the check gave no answer."""
    if notes.get("reinstall", "none") == "none":
        return []
    try:
        found = json.loads(_decoded(notes.get("install-changes")) or "")
    except ValueError:
        found = None
    if not isinstance(found, list):
        return [f"{INSTALL_CHANGE}check gave no answer (its process was stopped, or could not take stock)"]
    return [str(line)[:300] for line in found[:20]]


def _runner_changes(notes: dict[str, str]) -> list[str]:
    """What runner_tee.py's guard recorded (its note; none without one), at most 20 lines of 300 bytes."""
    if "guard" not in notes:
        return []
    text = _decoded(notes["guard"])
    if text is None:
        return ["the guard's record is unreadable"]
    lines = [line[:300] for line in text.splitlines() if line.strip()]
    return lines[:20] + ([f"... and {len(lines) - 20} more"] if len(lines) > 20 else [])


def _undeclared(note: str | None, declared: list[str] | None) -> str | None:
    """The first file the run's `changed` note names that the patch's headers do not (its .rej and .orig
    files aside: `git apply --reject` and GNU patch write them); None when all are named, or no note."""
    if note is None or declared is None:
        return None
    try:
        changed = base64.b64decode(note, validate=True).decode("utf-8", "surrogateescape").split("\0")
    except (ValueError, binascii.Error):
        return None
    named = set(declared)
    for path in filter(None, changed):
        stem, dot, suffix = path.rpartition(".")
        if path not in named and not (dot and suffix in ("rej", "orig") and stem in named):
            return path
    return None


def _names_a_test(test: str) -> bool:
    """A pytest node id (`file.py::name`) or file. SWE-bench's datasets hold a few entries that are neither:
    its parser took `[100%]` for a test id from a captured `PASSED [100%]` line (pytest-5227), and counts it
    passed when such a line is printed. No junit entry can back those; a candidate that prints one gains a
    verdict on no test at all."""
    return "::" in test or test.endswith(".py")


def _crosscheck(task: RepoTask, log_statuses: dict[str, TestStatus], whole: dict[str, TestStatus],
                notes: dict[str, str], pytest: bool, parser: LogParser, spec: object = None,
                ) -> tuple[dict[str, str], str, list[str], set[str]]:
    """Statuses, how they were checked, the log/junit mismatches, and the tests junit says were skipped
    that the log (as SWE-bench reads it) does not name: those are MISSING, as SWE-bench has them.
    `log_statuses`: the summary's; `whole`: the whole log's, which count for a test the summary does not
    name only where junit agrees (pytest -v's `id SKIPPED` lines, as parse_log_pytest_v2 reads them)."""
    tests = [*task.fail_to_pass, *task.pass_to_pass]
    if not pytest:
        return _runner_crosscheck(tests, log_statuses, notes.get("runner"), parser, spec)
    junit = _junit(notes.get("junit"))
    if junit is None:
        return {t: MISSING for t in tests}, "junit-missing", [], set()
    junit = {(cls, parser.junit_name(name)): status for (cls, name), status in junit.items()}
    statuses, mismatches, skipped = {}, [], set()
    for test in tests:
        from_log, from_junit = log_statuses.get(test), junit.get(junit_key(test))
        if from_log is None and from_junit is not None and whole.get(test) is from_junit:
            from_log = from_junit
        if from_log == from_junit:
            statuses[test] = from_log.value if from_log else MISSING
        elif from_log is None and from_junit is TestStatus.SKIPPED:
            statuses[test] = MISSING  # -rA lists a skip as "SKIPPED [1] file:line: why", without the test's id
            skipped.add(test)
        elif from_log is None and from_junit not in parser.records:
            statuses[test] = MISSING  # a status this parser never reports (seaborn's: XFAIL, ERROR), as SWE-bench
        else:
            statuses[test] = MISMATCH
            mismatches.append(f"{test}: log {from_log.value if from_log else MISSING}, "
                              f"junit {from_junit.value if from_junit else MISSING}")
    return statuses, "junit", mismatches, skipped


def _runner_crosscheck(tests: list[str], log_statuses: dict[str, TestStatus], note: str | None, parser: LogParser,
                       spec: object) -> tuple[dict[str, str], str, list[str], set[str]]:
    """A runner without junit: each test as the log reads it, but a pass only where the runner's own output
    (runner_tee.py's copy, read by the same parser) says the same; "log-only" where the run made no copy.
    A failure stays the log's, so a run no one tampered with reads as SWE-bench reads it."""
    log_only = {t: log_statuses[t].value if t in log_statuses else MISSING for t in tests}
    copy = _decoded(note)
    if copy is None:
        return log_only, "log-only", [], set()
    own = parser.read(copy, spec)
    statuses, mismatches = {}, []
    for test in tests:
        said, from_runner = log_statuses.get(test), own.get(test)
        if said is not None and said.value in _SUCCESS and from_runner is not said:
            statuses[test] = MISMATCH
            mismatches.append(f"{test}: log {said.value}, runner {from_runner.value if from_runner else MISSING}")
        else:
            statuses[test] = log_only[test]
    return statuses, "runner", mismatches, set()


def _decoded(note: str | None) -> str | None:
    """A note's base64 text; None for none, or a note that is not base64."""
    if note is None or note == "none":
        return None
    try:
        return base64.b64decode(note, validate=True).decode("utf-8", "replace")
    except (ValueError, binascii.Error):
        return None


def _junit(note: str | None) -> dict | None:
    text = _decoded(note)
    if not text:
        return None
    try:
        return parse_junit(text)
    except ValueError:
        return None


def _report(task: RepoTask, run: Run, access: TestAccess, reverted: list[str], test_cmd: str,
            statuses: dict[str, str], crosscheck: str, mismatches: list[str], infra: list[str] = ()) -> RepoReport:
    fail_to_pass = {t: statuses.get(t, MISSING) for t in task.fail_to_pass}
    pass_to_pass = {t: statuses.get(t, MISSING) for t in task.pass_to_pass}
    outcomes = [*fail_to_pass.values(), *pass_to_pass.values()]
    # SWE-bench with empty FAIL_TO_PASS and PASS_TO_PASS: resolved once the test output is complete
    ran = bool(statuses) if outcomes else run.finished and not run.timed_out
    resolved = ran and all(s in _SUCCESS or s in _NEUTRAL for s in outcomes)
    exit_note, reinstall_note = run.notes.get("exit", ""), run.notes.get("reinstall", "")
    applied = run.notes.get("model")
    return RepoReport(access=access.value, patch_applied_with=None if applied in (None, "none") else applied,
                      reverted_files=reverted, test_command=test_cmd,
                      test_exit_code=int(exit_note) if exit_note.isdigit() else None,
                      reinstall_exit_code=int(reinstall_note) if reinstall_note.isdigit() else None,
                      timed_out=run.timed_out, fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass,
                      resolved=resolved, crosscheck=crosscheck, mismatches=mismatches,
                      dropped_changes=list(infra) if access is not TestAccess.OPEN else [],
                      test_infrastructure_modified=list(infra) if access is TestAccess.OPEN else [],
                      apply_log=run.apply_log, log=run.test_log or "")
