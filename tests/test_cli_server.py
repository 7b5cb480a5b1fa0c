"""`run` and `sandbox exec` through this user's CLI server (image_builder/cli_server.py): the
same output, status and files as the fast path, a thin client that imports no runtime,
Ctrl-C and a killed client stopping the run, and a server no other user can use or fake.
Kernel as root, userns as uid 65534, through the installed console script on the MBPP store."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_runtime_client import CASES, EXE, NOBODY, as_user, cli, cli_env, user_dir, stop_holders_of

# One worker for all: a test that changes a module's time on disk makes every server leave.
pytestmark = pytest.mark.xdist_group("cli_server")

THIN = "image_builder.runtime.backends"  # what the client imports only when it runs the command itself


def traced(*args: str, user: int | None, xdg: Path, **kw) -> subprocess.CompletedProcess:
    """The CLI under `python -X importtime`: stderr also lists every module the client imported."""
    argv = as_user(user, [sys.executable, "-X", "importtime", str(EXE), *args])
    return subprocess.run(argv, capture_output=True, text=True, env=cli_env(xdg), cwd="/", timeout=300, **kw)


def served(r: subprocess.CompletedProcess) -> bool:
    return "image_builder.cli_server" in r.stderr and THIN not in r.stderr


def without_imports(stderr: str) -> str:
    return "".join(line + "\n" for line in stderr.splitlines() if not line.startswith("import time:"))


def wait_for_server(xdg: Path, timeout: float = 60.0) -> None:
    """Until the server of `xdg`'s state dir listens on its name (it binds it after its imports)."""
    from image_builder.runtime.statedir import read_token
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        token = read_token(xdg / "image_builder")  # its name: image-builder-cli-UID-TOKEN-CODE
        if token and re.search(rf" @image-builder-cli-\d+-{token}-[0-9a-f]+$", Path("/proc/net/unix").read_text(),
                               re.MULTILINE):
            return
        time.sleep(0.1)
    raise AssertionError("no CLI server was started")


@pytest.fixture
def server(mbpp_store):
    """A root state dir of its own (XDG_RUNTIME_DIR) whose CLI server is up; stopped after."""
    xdg = user_dir(None)
    try:
        cli("run", "--store", str(mbpp_store), "512", "--", "true", user=None, xdg=xdg)
        wait_for_server(xdg)
        yield xdg
    finally:
        stop_holders_of(xdg)
        subprocess.run(["rm", "-rf", str(xdg)])


@pytest.mark.parametrize("backend, user", CASES)
def test_a_served_run_is_the_fast_paths_run(mbpp_store, backend, user, tmp_path):
    xdg = user_dir(user)
    out = user_dir(user)
    store = str(mbpp_store)
    try:
        first = traced("run", "--store", store, "--backend", backend, "512", "--", "true", user=user, xdg=xdg)
        assert first.returncode == 0 and not served(first), first.stderr
        wait_for_server(xdg)
        r = traced("run", "--store", store, "--backend", backend, "-e", "X=1", "512", "--", "sh", "-c",
                   'echo "out $X $(cat)"; echo err >&2; exit 3', user=user, xdg=xdg, input="in")
        assert served(r), "the thin client imported the runtime: " + r.stderr[-2000:]
        assert (r.returncode, r.stdout, without_imports(r.stderr)) == (3, "out 1 in\n", "err\n")
        timed = traced("run", "--store", store, "--backend", backend, "--timeout", "0.5", "512", "--", "sleep", "30",
                       user=user, xdg=xdg)
        assert served(timed) and timed.returncode == 124, timed.stderr[-2000:]
        assert "image-builder: timed out after 0.5 s" in timed.stderr
        # --json's files land in the client's directory, made with its umask
        argv = as_user(user, ["sh", "-c", f"cd {out} && umask 077 && exec {sys.executable} -X importtime {EXE} run "
                                          f"--store {store} --backend {backend} --json --output-dir o 512 -- echo hi"])
        j = subprocess.run(argv, capture_output=True, text=True, env=cli_env(xdg), timeout=300)
        assert served(j) and j.returncode == 0, j.stderr[-2000:]
        assert (out / "o" / "stdout").read_text() == "hi\n"
        assert (out / "o" / "stdout").stat().st_mode & 0o777 == 0o600
        # a relative --store is the client's directory's
        argv = as_user(user, ["sh", "-c", f"cd {mbpp_store.parent} && exec {sys.executable} -X importtime {EXE} run "
                                          f"--store {mbpp_store.name} --backend {backend} 512 -- echo relative"])
        rel = subprocess.run(argv, capture_output=True, text=True, env=cli_env(xdg), timeout=300)
        assert served(rel) and (rel.returncode, rel.stdout) == (0, "relative\n"), rel.stderr[-2000:]
        # argv the fast path leaves to click is click's, as without a server
        bad = traced("run", "--store", store, "--max-output", "lots", "512", "--", "true", user=user, xdg=xdg)
        assert bad.returncode == 2 and "expected a byte count" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        stop_holders_of(xdg)
        subprocess.run(["rm", "-rf", str(xdg), str(out)])


def test_ctrl_c_and_a_killed_client_stop_the_served_run(mbpp_store, server):
    store = str(mbpp_store)
    for how in (signal.SIGINT, signal.SIGKILL):
        mark = f"{how.value}.{time.monotonic_ns() % 100000}"  # a sleep of its own, to find on the host
        proc = subprocess.Popen([str(EXE), "run", "--store", store, "512", "--", "sleep", mark],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(server), cwd="/")
        deadline = time.monotonic() + 30
        while not sleeping(mark):
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.05)
        proc.send_signal(how)
        proc.wait(30)
        if how == signal.SIGINT:
            assert proc.returncode == 1 and proc.stderr.read().endswith(b"Aborted!\n")
        deadline = time.monotonic() + 15
        while sleeping(mark):
            assert time.monotonic() < deadline, f"the run outlived its client ({how.name})"
            time.sleep(0.1)


def sleeping(mark: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == f"sleep\0{mark}\0".encode():
                return True
        except OSError:
            pass
    return False


# Another user: uses the victim's server (its name is public in /proc/net/unix), or holds the
# name first so that the victim's client hands it its descriptors.
INTRUDER = """
import marshal, socket, sys
name, target = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(b"\\0" + name.encode())
req = marshal.dumps({"argv": ["run", "--store", "/", "x", "--", "touch", target], "cwd": "/", "env": {}, "umask": 0})
fds = [0, 1, 2]
try:
    s.sendmsg([req], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(memoryview(__import__("array").array("i", fds))))])
    print(repr(s.recv(64)))
except OSError:  # closed before the request got there
    print(repr(b""))
"""

SQUATTER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(b"\\0" + sys.argv[1].encode())
s.listen()
print("bound", flush=True)
conn, _ = s.accept()
conn.settimeout(20)
try:
    msg, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(12))
    print(f"got {len(msg)} bytes, {len(anc)} descriptors" if msg or anc else "nothing: closed", flush=True)
except (OSError, socket.timeout) as e:
    print("nothing", type(e).__name__, flush=True)
"""


def test_another_user_can_neither_use_nor_fake_the_server(mbpp_store, server):
    from image_builder.cli_server import _name
    from image_builder.runtime.statedir import read_token
    public = user_dir(NOBODY)
    try:
        name = _name(read_token(server / "image_builder"))
        target = public / "touched"
        r = subprocess.run(as_user(NOBODY, [sys.executable, "-c", INTRUDER, name, str(target)]), capture_output=True,
                           text=True, timeout=60)
        assert r.stdout.strip() == "b''", (r.stdout, r.stderr)  # closed unanswered
        assert not target.exists()
        stop_holders_of(server)  # the server gone, the intruder takes its name
        squat = subprocess.Popen(as_user(NOBODY, [sys.executable, "-c", SQUATTER, name]), stdout=subprocess.PIPE,
                                 text=True)
        try:
            assert squat.stdout.readline() == "bound\n"
            t = traced("run", "--store", str(mbpp_store), "512", "--", "echo", "mine", user=None, xdg=server)
            assert (t.returncode, t.stdout) == (0, "mine\n") and not served(t), t.stderr[-2000:]
            squat.wait(30)
            assert squat.stdout.read().startswith("nothing"), "the client sent its request to another user"
        finally:
            squat.kill()
            squat.wait()
    finally:
        subprocess.run(["rm", "-rf", str(public)])


def test_a_client_in_another_mount_namespace_runs_its_command_itself(mbpp_store, server):
    r = subprocess.run(["unshare", "--mount", sys.executable, "-X", "importtime", str(EXE), "run", "--store",
                        str(mbpp_store), "512", "--", "echo", "ok"], capture_output=True, text=True,
                       env=cli_env(server), cwd="/", timeout=300)
    assert (r.returncode, r.stdout) == (0, "ok\n") and THIN in r.stderr, r.stderr[-2000:]


def test_a_server_whose_code_changed_on_disk_never_serves_it(mbpp_store, server):
    """An upgrade or an edit of the checkout while a server is up: the next command runs the new code."""
    import image_builder.cli_run as module
    run = ("run", "--store", str(mbpp_store), "512", "--", "echo", "ok")
    assert served(traced(*run, user=None, xdg=server))
    path = Path(module.__file__)
    before = path.stat()
    try:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
        r = traced(*run, user=None, xdg=server)
        assert (r.returncode, r.stdout) == (0, "ok\n") and not served(r), r.stderr[-2000:]
        wait_for_server(server)  # the one the stale server started as it left: of the code as it is now
        assert served(traced(*run, user=None, xdg=server))
    finally:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # a change again: that server leaves too
    assert not served(traced(*run, user=None, xdg=server))
