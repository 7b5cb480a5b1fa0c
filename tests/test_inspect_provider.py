"""Inspect AI on the store without Docker: a real `inspect_ai.eval()` whose sandbox is
this package's provider (found through its entry point), on the marshmallow instance,
as root (kernel backend) and as uid 65534 (userns). The scripted agent's tool calls,
the background server between calls, the scorer in the sandbox, and nothing left after."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_runtime import NOBODY, eventually, processes_with

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("IMAGE_BUILDER_SHARED_DATA", ROOT.parent / "shared" / "data"))
EVAL = Path(__file__).parent / "support" / "inspect_eval.py"
INSTANCE = "marshmallow-code__marshmallow-1359"


@pytest.fixture(scope="module")
def public_store(marshmallow_store, public_dir) -> Path:
    """The marshmallow store where uid 65534 can read it (hard links, no copy)."""
    dest = public_dir / "inspect-store"
    if not dest.exists():
        shutil.copytree(marshmallow_store, dest, copy_function=os.link)
        for path in [dest, *dest.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


def _row() -> dict:
    rows = [json.loads(line) for line in (DATA / "swebench_marshmallow.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["instance_id"] == INSTANCE)


@pytest.mark.parametrize("user,patch", [(None, "gold"), (NOBODY, "gold"), (None, "none")])
def test_an_inspect_eval_runs_its_agent_and_scorer_in_the_store(public_store, public_dir, tmp_path, user, patch):
    row = _row()
    home = Path(public_dir) / f"inspect-home-{user or 0}-{patch}"
    home.mkdir(mode=0o700)
    run = home / "run"
    run.mkdir(mode=0o700)
    config = home / "sandbox.yaml"
    config.write_text(f"store: {public_store}\nnetwork: false\nmemory_mb: 2048\n")
    patch_file = home / "fix.patch"
    patch_file.write_text(row["patch"] if patch == "gold" else "")
    test_patch = home / "test.patch"
    test_patch.write_text(row["test_patch"])
    if user is not None:
        for path in (home, run, config, patch_file, test_patch):
            os.chown(path, user, user)
    cmd = [sys.executable, str(EVAL), str(config), INSTANCE, str(patch_file), str(test_patch),
           row["FAIL_TO_PASS"],  # SWE-bench's rows hold the list as JSON text
           str(home / "logs")]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    proc = subprocess.run(cmd, capture_output=True, timeout=600, cwd="/",
                          env={**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": str(run)})
    assert proc.returncode == 0, (proc.stdout.decode()[-2000:], proc.stderr.decode()[-4000:])
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["tool_errors"] == [], got
    pwd, applied, started, queried = got["tools"]
    assert pwd.splitlines()[0] == "/testbed" and pwd.splitlines()[1].strip() == "0", pwd
    assert started.strip() == "started"
    assert queried.strip() == "200", "the server started by an earlier tool call still answers"
    if patch == "gold":
        assert applied.strip() == "applied" and got["score"] == "C", got["explanation"]
    else:
        assert "applied" not in applied and got["score"] == "I", got
    # sample_cleanup closed the sandbox: its init, the server and the holder are gone
    assert eventually(lambda: not processes_with(str(run)) and not processes_with("http.server 8431"), 20)
