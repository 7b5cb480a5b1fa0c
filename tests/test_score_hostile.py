"""Scoring what a hostile agent leaves (issue 30): a solution.py that is huge, a FIFO, a
symlink to a secret, a directory or not UTF-8, and a 300 MB file in a repo sandbox, each
give a failed score whose result says why, quickly and in bounded memory, never an
exception: through the API (AgentSandbox.score), the command line (`sandbox score`) and
Inspect's scorer (`submission_scorer`) in a real eval."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from image_builder.agents.sandbox import MAX_SUBMISSION, open_sandbox
from image_builder.graders.results import TaskStatus
from image_builder.runtime.mounts import RunnerError
from image_builder.tasks import load_tasks
from tests.conftest import DATA, run_cli

MBPP = DATA / "mbpp_train_40.parquet"
SECRET = "root:$6$not-for-the-grader$:19000:0:99999:7:::"
# What the agent leaves as solution.py (run in the workdir), and what the reason must say.
HOSTILE = {
    "huge": (f"truncate -s {120 << 20} solution.py", f"solution.py is over {MAX_SUBMISSION} bytes"),
    "fifo": ("mkfifo solution.py", "solution.py is a FIFO"),
    "symlink": (f"printf '%s\\n' '{SECRET}' > /etc/ib-shadow && ln -s /etc/ib-shadow solution.py",
                "solution.py is a symbolic link"),
    "directory": ("mkdir solution.py", "solution.py is a directory"),
    "binary": ("printf 'def f():\\n    return 1\\n\\377\\376' > solution.py", "solution.py is not UTF-8 text"),
}


def _task(path: Path, task_id: str):
    return next(t for t in load_tasks(path) if t.task_id == task_id)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_solution_file_scores_failed_with_its_reason(mbpp_store, tmp_path, kind):
    """Before: huge raised OutputCapped, the FIFO blocked scoring for 600 s, the symlink's target
    was graded as the solution, a directory or bytes that are not UTF-8 graded as an empty one."""
    make, reason = HOSTILE[kind]
    with open_sandbox(mbpp_store, task=_task(MBPP, "516"), access="open", state_dir=tmp_path) as box:
        assert box.exec(["sh", "-c", make]).exit_code == 0
        score = box.score()
    assert score.result.status is TaskStatus.NO_SOLUTION and not score.result.passed, score.result
    assert reason in score.result.reason and score.feedback == f"failed: {score.result.reason}", score.feedback
    assert score.submission == "" and SECRET not in score.feedback


@pytest.mark.timeout(300)
def test_hidden_mode_tells_the_agent_only_failed_but_the_result_says_why(mbpp_store, tmp_path):
    with open_sandbox(mbpp_store, task=_task(MBPP, "516"), access="hidden", state_dir=tmp_path) as box:
        assert box.exec(["mkfifo", "solution.py"]).exit_code == 0
        score = box.score()
    assert score.feedback == "failed" and "solution.py is a FIFO" in score.result.reason


@pytest.mark.timeout(600)
def test_a_300_mb_file_in_a_repo_sandbox_scores_failed_with_its_reason(marshmallow_store, tmp_path):
    """Before: RunnerError "cannot take the diff" out of score(). The patch is neither made nor
    read: the sizes of what it adds are known first. Taken out again, the diff scores as usual."""
    task = _task(DATA / "swebench_marshmallow.jsonl", "marshmallow-code__marshmallow-1359")
    with open_sandbox(marshmallow_store, task=task, access="read-only", state_dir=tmp_path) as box:
        assert box.exec(["sh", "-c", "head -c 300000000 /dev/urandom > big.bin"]).exit_code == 0
        score = box.score()
        assert score.result.status is TaskStatus.PATCH_FAILED and score.submission == "", score.result
        assert "the diff adds 300000000 bytes (the largest file: big.bin" in score.result.reason, score.result.reason
        assert score.feedback.startswith("failed: the diff adds") and "\n" not in score.feedback
        with pytest.raises(RunnerError, match="cannot take the diff: the diff adds 300000000 bytes"):
            box.diff()
        assert box.exec(["rm", "big.bin"]).exit_code == 0
        again = box.score()
    assert again.result.status is TaskStatus.FAILED and again.result.repo is not None, again.result


@pytest.mark.timeout(300)
def test_sandbox_score_says_why_in_one_line(mbpp_store, public_dir):
    """Before: a 36-line OutputCapped traceback."""
    home = Path(tempfile.mkdtemp(prefix="score-hostile-", dir=public_dir))
    (home / "run").mkdir(mode=0o700)
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": str(home / "run")}
    started = run_cli("sandbox", "start", "516", "--store", str(mbpp_store), "--tasks", str(MBPP),
                      "--access", "open", env=env)
    assert started.returncode == 0, started.stderr
    sid = started.stdout.strip()
    try:
        made = run_cli("sandbox", "exec", sid, "--", "truncate", "-s", str(120 << 20), "solution.py", env=env)
        assert made.returncode == 0, made.stderr
        scored = run_cli("sandbox", "score", sid, env=env)
    finally:
        assert run_cli("sandbox", "stop", sid, env=env).returncode == 0
    assert scored.returncode == 1 and "Traceback" not in scored.stderr, scored
    assert scored.stdout == f"failed: solution.py is over {MAX_SUBMISSION} bytes: nothing was graded\n", scored.stdout


@pytest.mark.timeout(600)
def test_inspect_scores_a_hostile_submission_incorrect(mbpp_store, public_dir):
    """A real Inspect eval: the agent's bash leaves a 120 MB solution.py, submits it through
    test_feedback and is scored by submission_scorer. Before: OutputCapped out of the tool
    and the scorer, the sample an error."""
    from tests.test_agent_harnesses import IMPOSSIBLE, _home, _run

    hack = f"open('/root/solution.py', 'w').truncate({120 << 20})\n"  # /root: the MBPP instances' workdir
    home = _home(public_dir, None, {
        "sandbox.yaml": f"store: {mbpp_store}\ndataset: {MBPP}\naccess: open\nmax_scores: 3\n",
        "none.patch": "", "hack.py": hack})
    got = _run(None, home, IMPOSSIBLE, str(home / "sandbox.yaml"), "516", str(home / "none.patch"),
               str(home / "hack.py"), str(home / "logs"))
    feedback = got["tools"][-1]
    assert got["score"] == "I", got
    assert got["metadata"]["status"] == "no_solution", got["metadata"]
    assert f"solution.py is over {MAX_SUBMISSION} bytes" in got["metadata"]["reason"]
    assert feedback.startswith(f"failed: solution.py is over {MAX_SUBMISSION} bytes"), json.dumps(got)[:2000]
