"""`image-builder sandbox`: sandboxes that outlive the command that started them, held by
the user's mount holder, as root (kernel) and as uid 65534 (userns), on the marshmallow
instance of the store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.conftest import DATA
from tests.test_agent_harnesses import INSTANCE
from tests.test_runtime import NOBODY, eventually, processes_with


@pytest.fixture(params=[None, NOBODY], ids=["root", "uid65534"])
def user_env(request, public_dir):
    """(uid, environment) with a private runtime dir of that user's."""
    user = request.param
    home = Path(tempfile.mkdtemp(prefix=f"sandbox-cli-{user or 0}-", dir=public_dir))  # mode 700
    (home / "run").mkdir(mode=0o700)
    if user is not None:
        for path in (home, home / "run"):
            os.chown(path, user, user)
    yield user, {"HOME": str(home), "XDG_RUNTIME_DIR": str(home / "run")}
    run_cli("sandbox", "stop", *[r["id"] for r in _ls(user, {"HOME": str(home), "XDG_RUNTIME_DIR": str(home / "run")})],
            user=user, env={"HOME": str(home), "XDG_RUNTIME_DIR": str(home / "run")})


def _command(user, *args: str) -> list[str]:
    """The console script's command line, as `user` (run_cli's, for Popen)."""
    exe = Path(os.environ.get("VIRTUAL_ENV", Path(__file__).resolve().parents[1] / ".venv")) / "bin" / "image-builder"
    prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
    return [*prefix, str(exe), *args]


def _ls(user, env) -> list[dict]:
    r = run_cli("sandbox", "ls", "--json", user=user, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_sandbox_outlives_its_commands_until_stopped(public_store, user_env):
    user, env = user_env
    cli = lambda *a, **kw: run_cli(*a, user=user, env=env, **kw)  # noqa: E731
    started = cli("sandbox", "start", INSTANCE, "--store", str(public_store), "--memory", "2048")
    assert started.returncode == 0, started.stderr
    sid = started.stdout.strip()
    assert [r["instance"] for r in _ls(user, env)] == [INSTANCE]

    assert cli("sandbox", "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 3").returncode == 3
    r = cli("sandbox", "exec", sid, "--", "sh", "-c", "echo out; echo err >&2")
    assert (r.stdout, r.stderr) == ("out\n", "err\n")
    r = cli("sandbox", "exec", sid, "--", "sh", "-c",
            "python3 -m http.server 8519 --bind 127.0.0.1 >/tmp/srv.log 2>&1 & echo changed >> README.rst")
    assert r.returncode == 0, r.stderr
    query = ("for i in $(seq 50); do python3 -c \"import urllib.request as u; "
             "print(u.urlopen('http://127.0.0.1:8519/').status)\" 2>/dev/null && exit 0; sleep 0.1; done; exit 1")
    r = cli("sandbox", "exec", sid, "--", "sh", "-c", query)
    assert r.stdout.strip() == "200", "a server started by an earlier `sandbox exec` still answers"
    assert cli("sandbox", "exec", sid, "--", "cat", "-", input="piped in\n").stdout == "piped in\n"

    # cp both ways, diff
    host = Path(env["HOME"]) / "dl"
    assert cli("sandbox", "cp", f"{sid}:src/marshmallow/__init__.py", str(host)).returncode == 0
    assert "__version__" in host.read_text()
    up = Path(env["HOME"]) / "up.txt"
    up.write_text("from the host\r\n")
    if user is not None:
        os.chown(up, user, user)
    assert cli("sandbox", "cp", str(up), f"{sid}:notes/up.txt").returncode == 0
    diff = cli("sandbox", "diff", sid)
    assert diff.returncode == 0 and "+changed" in diff.stdout and "b/notes/up.txt" in diff.stdout, diff

    # two clients at once: one waits for the other, each gets its own output
    procs = [subprocess.Popen(_command(user, "sandbox", "exec", sid, "--", "sh", "-c", f"sleep 0.3; echo {i}"),
                              stdout=subprocess.PIPE, text=True, env={**os.environ, **env}) for i in range(3)]
    assert [p.communicate(timeout=60)[0] for p in procs] == ["0\n", "1\n", "2\n"]

    assert cli("sandbox", "stop", sid).returncode == 0
    gone = cli("sandbox", "exec", sid, "--", "true")
    assert gone.returncode != 0 and len(gone.stderr.strip().splitlines()) == 1 and sid in gone.stderr, gone.stderr
    assert _ls(user, env) == []
    assert eventually(lambda: not processes_with("http.server 8519"), 20), "stop left the server running"


def test_an_interrupted_exec_leaves_the_next_one_its_own_answer(public_store, user_env):
    user, env = user_env
    cli = lambda *a, **kw: run_cli(*a, user=user, env=env, **kw)  # noqa: E731
    sid = cli("sandbox", "start", INSTANCE, "--store", str(public_store)).stdout.strip()
    for sig, mark in ((signal.SIGINT, "4001.5"), (signal.SIGKILL, "4002.5")):
        proc = subprocess.Popen(_command(user, "sandbox", "exec", sid, "--", "sh", "-c", f"sleep {mark}; echo late"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        other = subprocess.Popen(_command(user, "sandbox", "exec", sid, "--", "sh", "-c", "sleep 4003.5 & wait"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        assert eventually(lambda: processes_with(f"sleep {mark}") and processes_with("sleep 4003.5"), 20)
        time.sleep(0.2)
        proc.send_signal(sig)
        proc.communicate(timeout=30)
        # Ctrl-C, or the client killed: the command goes too, as a local one would with its terminal
        assert eventually(lambda: not processes_with(f"sleep {mark}"), 10), sig
        assert processes_with("sleep 4003.5"), "another client's command runs on"
        r = cli("sandbox", "exec", sid, "--", "echo", "next")
        assert (r.returncode, r.stdout) == (0, "next\n"), (sig, r)
        other.kill()
        other.communicate(timeout=30)
        assert eventually(lambda: not processes_with("sleep 4003.5"), 10), "a killed client's command goes with it"
    assert cli("sandbox", "stop", sid).returncode == 0


def test_clients_of_one_sandbox_run_side_by_side(public_store, user_env):
    """Two shells on one sandbox: a command waiting in the foreground does not hold up
    another client's, which makes what it waits for."""
    user, env = user_env
    cli = lambda *a, **kw: run_cli(*a, user=user, env=env, **kw)  # noqa: E731
    sid = cli("sandbox", "start", INSTANCE, "--store", str(public_store)).stdout.strip()
    waiting = subprocess.Popen(_command(user, "sandbox", "exec", sid, "--", "sh", "-c",
                                        "until [ -e /tmp/go ]; do sleep 0.05; done; echo waited"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    assert eventually(lambda: _ls(user, env)[0]["busy"], 20)
    made = subprocess.run(_command(user, "sandbox", "exec", sid, "--", "touch", "/tmp/go"), capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=30)  # taking turns, it would wait for ever
    assert made.returncode == 0, made.stderr
    out, err = waiting.communicate(timeout=30)
    assert (waiting.returncode, out) == (0, "waited\n"), err
    assert cli("sandbox", "stop", sid).returncode == 0


def test_score_and_access_from_the_command_line(public_store, user_env):
    user, env = user_env
    from tests.test_agent_access import HACK

    cli = lambda *a, **kw: run_cli(*a, user=user, env=env, **kw)  # noqa: E731
    tasks = Path(env["HOME"]) / "tasks.jsonl"
    tasks.write_text((DATA / "swebench_marshmallow.jsonl").read_text())
    if user is not None:
        os.chown(tasks, user, user)
    sid = cli("sandbox", "start", f"{INSTANCE}__conflicting", "--store", str(public_store), "--tasks", str(tasks),
              "--access", "read-only").stdout.strip()
    row = next(json.loads(line) for line in tasks.read_text().splitlines()
               if json.loads(line)["instance_id"] == INSTANCE)
    assert cli("sandbox", "exec", sid, "--", "git", "apply", "-", input=row["patch"]).returncode == 0
    assert cli("sandbox", "exec", sid, "--", "python3", "-c", HACK).returncode == 0
    for how in ((), ("--in-place",)):  # in a fresh instance, and in the sandbox itself: the same verdict
        scored = cli("sandbox", "score", sid, *how)
        assert scored.returncode == 1, (how, scored)
        assert "reverted changes to test files: tests/test_fields.py" in scored.stdout, how
    assert cli("sandbox", "stop", sid).returncode == 0
