"""A store's instance as a sandbox an agent works in for many turns.

    with open_sandbox("store/", "marshmallow-code__marshmallow-1359") as box:
        box.exec(["sh", "-c", "sed -i s/old/new/ src/marshmallow/fields.py"])
        patch = box.diff()   # what the agent changed, as SWE-bench takes a patch

diff() is SWE-bench's (`git add -A`, `git diff --cached --binary` against the commit
the agent started from, recorded at open), so a commit the agent made is in it too.

With a SWE-bench task, the sandbox starts as ImpossibleBench's test-access mode says
(graders/access.py grades each mode's patch):
- open: the task's test patch applied and committed, the tests the agent's to edit;
- read-only: the same start; scoring reverts what the agent changed in test files
  and test infrastructure, and says so in the feedback;
- hidden: the files the test patch touches removed from the working tree (committed;
  the test patch itself never enters the sandbox, the old files stay in git's history
  as SWE-bench leaves them); scoring applies the test patch where the agent cannot
  reach it, and tells only passed or failed.
The start is committed as "image-builder: ..." so that diff() is only the agent's.

With a function or program task (MBPP/verl assert cases, stdin/stdout and call-based
problems), the agent writes its solution to `solution.py` in the workdir; in open
and read-only mode it also finds the task's tests there (`test_solution.py`, or
`tests/N.in` + `tests/N.out`, `tests/cases.json` for call-based), in hidden mode
none. Their scoring never reads those files: the grader brings its own copy of the
tests to the out-of-process evaluator, so a test the agent edited, or read, changes
no verdict (graders/access.py); the mode decides what the agent sees and hears.

score() grades the current diff in a fresh instance (graders.grade on a new
session of the same layers): nothing the agent left running in its sandbox, nor any
file it left there, takes part. Up to `max_scores` times (score(final=True), the
harness's own grading once the agent stopped, is not counted), each with the feedback
text the grader gives that mode. A candidate scoring cannot take (solution.py not a
regular file, a symlink, over MAX_SUBMISSION bytes or not UTF-8; a diff git cannot take,
or one adding more than MAX_SUBMISSION bytes) is a failed score whose result says why
(no_solution, patch_failed), never an exception; reading it takes bounded time and
memory (a FIFO is never opened, sizes are known before anything is read).
score(in_place=True) grades in the sandbox itself,
as ImpossibleBench's own scorer does: the same grader and verdicts, on the workdir
put back to the instance's commit for the run (then to the agent's state again), so
what the agent installed elsewhere takes part, and what it left running can read
the grader's files and touch the verdict: for fidelity with that scorer, not against
a hostile agent. Not in hidden mode (the tests would enter the agent's sandbox).
"""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from image_builder.graders.access import TestAccess, candidate_feedback
from image_builder.graders.grade import grade
from image_builder.graders.grading import StoreExecutors, instance_of
from image_builder.graders.options import GradeOptions
from image_builder.graders.patches import UnreadablePatch, touched_paths
from image_builder.graders.results import GradeResult, TaskStatus
from image_builder.runtime.execution import Bind, RunRequest, RunResult
from image_builder.runtime.mounts import RunnerError
from image_builder.runtime.sandbox import DEFAULT_IDLE, Sandbox
from image_builder.runtime.session import Backend, InstanceLayers
from image_builder.store.store import ResolvedInstance, Store
from image_builder.tasks import AssertTask, RepoTask, StdioTask, Task

SOLUTION_FILE = "solution.py"  # where a function or program task's agent leaves its solution
_TASK_KINDS = {kind.__name__: kind for kind in (AssertTask, StdioTask, RepoTask)}

_DIFF_TIMEOUT = 300.0
_READ_TIMEOUT = 60.0  # reading solution.py: head of a regular file, unless the agent swapped in a FIFO meanwhile
# The most of a candidate scored: solution.py, or what the diff adds (as `grade` reads a predictions line).
MAX_SUBMISSION = 64 << 20
# The patch itself: a binary file's is ~1.3x its size, and removed lines (a deleted binary's old bytes) count too.
_MAX_PATCH = 2 * MAX_SUBMISSION
# solution.py read as a candidate: a regular file only (a FIFO is never opened, where reading would block;
# a device never read; a symlink never followed, wherever it points), one byte past the bound at most.
_READ_SOLUTION = ('[ -L "$1" ] && exit 6; [ -e "$1" ] || exit 3; [ -d "$1" ] && exit 4; [ -p "$1" ] && exit 8; '
                  '[ -f "$1" ] || exit 7; exec head -c "$2" -- "$1"')
_NOT_READ = {6: "is a symbolic link", 4: "is a directory", 8: "is a FIFO", 7: "is a device or a socket"}
# The start of a sandbox is committed by this identity, at a fixed date: nothing of the host in it.
_GIT_START = ["git", "-c", "user.name=image-builder", "-c", "user.email=image-builder@localhost",
              "-c", "commit.gpgsign=false"]
_START_ENV = {"GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}


@dataclass(frozen=True)
class AgentScore:
    result: GradeResult
    feedback: str  # what the agent may be told (candidate_feedback of the sandbox's access mode)
    submission: str  # what was graded: the diff (repo tasks), the solution's source (the others)


class AgentSandbox(Sandbox):
    """A Sandbox on one of a store's instances (see the module docstring)."""

    def __init__(self, store: Store, instance: ResolvedInstance, task: Task | None = None,
                 access: TestAccess = TestAccess.OPEN, max_scores: int | None = None, **options):
        super().__init__(InstanceLayers.of(instance), **options)
        self.store, self.instance, self.task, self.access = store, instance, task, TestAccess(access)
        self.max_scores, self.scores = max_scores, 0
        try:
            self.instance_commit = self._head()  # the instance's own, as a fresh instance has it
            if task is not None:
                self._start(task)
            # Where the agent starts, its diff taken against it: a repo task's start is committed;
            # a function task's only writes files, so its head is the instance's.
            self.base_commit = self._head() if isinstance(task, RepoTask) else self.instance_commit
        except BaseException:
            self.close()
            raise

    def _head(self) -> str | None:
        head = self._git(["git", "rev-parse", "--verify", "-q", "HEAD"], check=False)
        return head.stdout.decode().strip() if head.exit_code == 0 else None

    def park(self, info: dict | None = None) -> str:
        """Keep the sandbox past this process (runtime Sandbox.park), with what attach()
        needs to diff and score it again."""
        agent = {"store": str(self.store.root.resolve()), "instance": self.instance.id, "access": self.access.value,
                 "base_commit": self.base_commit, "instance_commit": self.instance_commit,
                 "max_scores": self.max_scores,
                 "task": None if self.task is None else {"kind": type(self.task).__name__, **asdict(self.task)}}
        return super().park({**(info or {}), "agent": agent})

    @classmethod
    def attach(cls, sandbox_id: str, *, backend: Backend | None = None, state_dir: Path | None = None):
        box = super().attach(sandbox_id, backend=backend, state_dir=state_dir)
        agent = box.info.get("agent")
        try:
            if not agent:
                raise RunnerError(f"sandbox {sandbox_id} was not opened on a store's instance")
            box.store = Store.open(agent["store"])
            box.instance = box.store.resolve(agent["instance"])
        except BaseException:
            box.close()
            raise
        fields = dict(agent["task"] or {})
        box.task = _TASK_KINDS[fields.pop("kind")](**fields) if fields else None
        box.access, box.base_commit = TestAccess(agent["access"]), agent["base_commit"]
        box.instance_commit = agent["instance_commit"]
        box.max_scores, box.scores = agent["max_scores"], 0  # counted per attach: the agent's harness counts all
        return box

    def _git(self, argv: list[str], check: bool = True, **kw):
        r = self.exec(argv, timeout=_DIFF_TIMEOUT, env=_START_ENV, **kw)
        if check and r.exit_code != 0:
            why = r.stderr.decode(errors="replace").strip().splitlines()
            raise RunnerError(f"{self.instance.id}: {' '.join(argv[-3:])} failed in the sandbox: "
                              f"{why[-1] if why else r.exit_code}")
        return r

    def _start(self, task: Task) -> None:
        """The workdir as the access mode has the agent start (see the module docstring)."""
        if not isinstance(task, RepoTask):
            if self.access is not TestAccess.HIDDEN:
                for path, text in _visible_tests(task).items():
                    self.write_file(path, text)
            return
        if self.access is TestAccess.HIDDEN:
            try:
                paths = touched_paths(task.test_patch)
            except UnreadablePatch as e:
                raise RunnerError(f"{task.task_id}: the task's test_patch, {e}") from None
            self._git(["git", "rm", "-r", "-q", "-f", "--ignore-unmatch", "--", *paths])
            what = "image-builder: the task's test files hidden"
        else:
            self._git(["git", "apply", "--whitespace=nowarn", "-"], input=task.test_patch)
            self._git(["git", "add", "-A"])
            what = "image-builder: the task's test patch"
        self._git([*_GIT_START, "commit", "-q", "--no-verify", "--allow-empty", "-m", what])

    def diff(self) -> str:
        """The candidate patch: every change in the workdir since the instance's commit,
        new and binary files included (as text: git's binary patches are ASCII); RunnerError
        when git cannot take it, or it adds more than MAX_SUBMISSION bytes."""
        patch, why = self._take_diff()
        if patch is None:
            raise RunnerError(f"{self.instance.id}: cannot take the diff: {why}")
        return patch

    def _take_diff(self) -> tuple[str | None, str]:
        """The diff, or None and why the workdir gives none (what the agent left in it: a file
        too large, one git cannot add, a broken .git)."""
        if self.base_commit is None:
            raise RunnerError(f"{self.instance.id}: the workdir {self.instance.workdir} is not a git checkout; "
                              "there is no diff to take")
        add = self.exec(["git", "add", "-A"], timeout=_DIFF_TIMEOUT)
        if not add.ok:
            return None, _failed(add, "git add -A")
        # What the diff adds, by size, before the patch is made: over the bound, it is neither made nor read.
        raw = self.exec(["git", "diff", "--cached", "--raw", "-z", "--no-abbrev", "--no-renames", self.base_commit],
                        timeout=_DIFF_TIMEOUT, max_output=MAX_SUBMISSION)
        if not raw.ok or raw.truncated:
            return None, "too many changed files to list" if raw.truncated else _failed(raw, "git diff --raw")
        fields = raw.stdout.split(b"\0")
        added = [(meta.split()[3].decode(), path.decode(errors="replace"))
                 for meta, path in zip(fields[0::2], fields[1::2]) if meta.count(b" ") == 4]
        added = [(sha, path) for sha, path in added if sha.strip("0")]  # an all-zero id: a deletion
        sizes = self.exec(["git", "cat-file", "--batch-check=%(objectsize)"], timeout=_DIFF_TIMEOUT,
                          input="".join(f"{sha}\n" for sha, _ in added), max_output=64 << 20)
        if not sizes.ok:
            return None, _failed(sizes, "git cat-file")
        counted = [(int(n), path) for n, (_, path) in zip(sizes.stdout.split(b"\n"), added) if n.isdigit()]
        total = sum(n for n, _ in counted)
        if total > MAX_SUBMISSION:
            size, path = max(counted)
            return None, (f"the diff adds {total} bytes (the largest file: {path}, {size} bytes); at most "
                          f"{MAX_SUBMISSION} are scored")
        diff = self.exec(["git", "-c", "core.quotepath=off", "diff", "--cached", "--binary", "--no-color",
                          "--no-ext-diff", self.base_commit], timeout=_DIFF_TIMEOUT, max_output=_MAX_PATCH)
        if not diff.ok or diff.truncated:
            return None, f"the patch is over {_MAX_PATCH} bytes" if diff.truncated else _failed(diff, "git diff")
        return diff.stdout.decode(errors="surrogateescape"), ""

    def _read_solution(self) -> tuple[str | None, str]:
        """solution.py's text ("" when there is none: graded as an empty solution, every case
        failing), or None and why it is refused (_READ_SOLUTION says what is read)."""
        r = self.exec(["sh", "-c", _READ_SOLUTION, "read_solution", self._path(SOLUTION_FILE),
                       str(MAX_SUBMISSION + 1)], timeout=_READ_TIMEOUT, max_output=MAX_SUBMISSION + 1)
        if r.exit_code == 3:
            return "", ""
        if r.exit_code in _NOT_READ:
            return None, f"{SOLUTION_FILE} {_NOT_READ[r.exit_code]}, not a regular file: nothing was graded"
        if not r.ok:
            return None, _failed(r, f"reading {SOLUTION_FILE}")
        if r.truncated or len(r.stdout) > MAX_SUBMISSION:
            return None, f"{SOLUTION_FILE} is over {MAX_SUBMISSION} bytes: nothing was graded"
        try:
            return r.stdout.decode(), ""
        except UnicodeDecodeError as e:
            return None, f"{SOLUTION_FILE} is not UTF-8 text (byte {e.start}): nothing was graded"

    def score(self, options: GradeOptions | None = None, *, in_place: bool = False,
              final: bool = False) -> AgentScore:
        """Grade the current diff (function and program tasks: solution.py) in a fresh
        instance, in the sandbox's access mode; `in_place`: in this sandbox (the module
        docstring says what that lets in). A candidate that cannot be taken is a failed
        score, its result's reason saying why. `final`: the harness's own grading once the
        agent has stopped (Inspect's scorer); it is no submission of the agent's, so it
        neither counts against max_scores nor is refused when the agent spent them."""
        if self.task is None:
            raise RunnerError(f"{self.instance.id}: this sandbox was opened without a task; there is nothing to "
                              "score against")
        if in_place and self.access is TestAccess.HIDDEN:
            raise RunnerError(f"{self.instance.id}: hidden tests are scored out of the agent's reach; scoring in "
                              "place would bring them into its sandbox (score without in_place)")
        if not final:
            if self.max_scores is not None and self.scores >= self.max_scores:
                raise RunnerError(f"{self.instance.id}: already scored {self.scores} times, the most this sandbox "
                                  "allows")
            self.scores += 1
        repo = isinstance(self.task, RepoTask)
        submission, refused = self._take_diff() if repo else self._read_solution()
        if submission is None:
            kind, status = ("repo", TaskStatus.PATCH_FAILED) if repo else \
                ("assert" if isinstance(self.task, AssertTask) else "stdio", TaskStatus.NO_SOLUTION)
            result = GradeResult(self.task.task_id, kind, status, reason=refused)
            return AgentScore(result, candidate_feedback(result, self.access), "")
        options = replace(options or GradeOptions(), access=self.access)
        if in_place:
            with self._as_instance(submission) if repo else nullcontext():
                result = grade(self.task, submission, _InPlace(self), options)
        else:
            with StoreExecutors(self.store, backend=self.backend) as pool:
                result = grade(self.task, submission, pool.for_instance(self.instance.id), options)
        return AgentScore(result, candidate_feedback(result, self.access), submission)

    @contextmanager
    def _as_instance(self, submission: str):
        """The workdir at the instance's commit, as the grader takes a fresh instance; then
        back at the agent's start with `submission` (its diff) applied, uncommitted (so
        commits the agent made come back as changes)."""
        if self.instance_commit is None:
            raise RunnerError(f"{self.instance.id}: the workdir is not a git checkout; it cannot be scored in place")
        self._git(["git", "reset", "-q", "--hard", self.instance_commit])
        self._git(["git", "clean", "-q", "-f", "-d"])  # untracked files are in the diff; ignored ones stay
        try:
            yield
        finally:
            self._git(["git", "reset", "-q", "--hard", self.base_commit])
            self._git(["git", "clean", "-q", "-f", "-d"])
            if submission:
                self._git(["git", "apply", "--binary", "--whitespace=nowarn", "-"], input=submission)


class _InPlace:
    """The grader's runs in a live sandbox (score(in_place=True)): a run's files are
    written into it first, where a fresh instance would get them in its throwaway layer."""

    def __init__(self, box: AgentSandbox):
        self.box = box

    def _placed(self, request: RunRequest) -> RunRequest:
        for path, data in request.placed_files(self.box.layers.workdir).items():
            self.box.write_file(path, data)
        return replace(request, files={})

    def run(self, request: RunRequest) -> RunResult:
        return self.box.run(self._placed(request))

    def stream(self, request: RunRequest, stdin: int | None = None, stdout: int = 1, stderr: int = 2) -> RunResult:
        return self.box.stream(self._placed(request), stdin, stdout, stderr)


def _failed(step: RunResult, what: str) -> str:
    """Why a step on the agent's workdir failed, in one line."""
    if step.timed_out:
        return f"{what} timed out"
    why = step.stderr.decode(errors="replace").strip().splitlines()
    return f"{what} failed: {why[-1] if why else f'exit status {step.exit_status}'}"


def _visible_tests(task: AssertTask | StdioTask) -> dict[str, str]:
    """The tests an agent may see of a function or program task, by path under the workdir."""
    if isinstance(task, AssertTask):
        return {"test_solution.py": "# The task's test cases; each runs after solution.py, as the grader runs it.\n"
                                    "from solution import *  # noqa: F401,F403\n\n" + "\n".join(task.cases) + "\n"}
    if task.fn_name:
        cases = [{"input": i, "output": o} for i, o in zip(task.inputs, task.outputs)]
        return {"tests/cases.json": json.dumps({"fn_name": task.fn_name, "cases": cases}, indent=1) + "\n"}
    files = {}
    for n, (given, wanted) in enumerate(zip(task.inputs, task.outputs), 1):
        files[f"tests/{n}.in"] = given if isinstance(given, str) else json.dumps(given)
        files[f"tests/{n}.out"] = wanted if isinstance(wanted, str) else json.dumps(wanted)
    return files


def open_sandbox(store: Store | Path | str, instance_id: str | None = None, *, task: Task | None = None,
                 access: TestAccess | str = TestAccess.OPEN, max_scores: int | None = None,
                 backend: Backend | None = None, state_dir: Path | None = None, binds: tuple[Bind, ...] = (),
                 network: bool = False, memory_mb: int | None = None, max_processes: int | None = None,
                 disk_mb: int | None = None, idle: float = DEFAULT_IDLE, layer_dir: Path | None = None) -> AgentSandbox:
    """An AgentSandbox on `instance_id` of `store` (default: the task's instance), started
    as `access` has it for `task` (module docstring). runtime.sandbox.Sandbox says what
    each limit bounds; they hold for the sandbox as a whole."""
    store = store if isinstance(store, Store) else Store.open(store)
    if instance_id is None:
        if task is None:
            raise RunnerError("open_sandbox needs an instance id or a task")
        instance_id = instance_of(task)
    options = {} if max_processes is None else {"max_processes": max_processes}
    return AgentSandbox(store, store.resolve(instance_id), task, TestAccess(access), max_scores, backend=backend,
                        state_dir=state_dir, binds=binds, network=network, memory_mb=memory_mb, disk_mb=disk_mb,
                        idle=idle, layer_dir=layer_dir, **options)
