"""Sandboxes that last (runtime/sandbox.py) on the real runtime: kernel as root, userns
as uid 65534. Each scenario runs in tests/support/sandbox_driver.py, a process of its
own, so it runs as that user and its holder can be killed under it."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.test_runtime import NOBODY, _env_sif, _images, eventually, loops_backed_by, processes_with

DRIVER = Path(__file__).parent / "support" / "sandbox_driver.py"


@pytest.fixture(scope="module")
def images():
    """test_runtime's images: the Debian environment and an instance layer adding /testbed."""
    imgs = _images(_env_sif(slim=False))
    yield imgs
    shutil.rmtree(imgs.dir, ignore_errors=True)


@pytest.fixture(params=["kernel", "userns"])
def backend(request) -> str:
    return request.param


@pytest.fixture
def state_dir(backend):
    d = Path(tempfile.mkdtemp(prefix=f"ib-sandbox-{backend}-"))
    if backend == "userns":
        os.chown(d, NOBODY, NOBODY)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def scenario(images, backend: str, state_dir: Path, steps: list, **sandbox) -> list[dict]:
    """Run `steps` on one sandbox as the backend's user; one answer per step (the first
    line, the holder's pid, is dropped)."""
    cmd = [sys.executable, str(DRIVER)]
    if backend == "userns":
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
    sc = {"layers": images.layers(), "backend": backend, "state_dir": str(state_dir), "sandbox": sandbox,
          "steps": steps}
    proc = subprocess.run(cmd, input=json.dumps(sc).encode(), capture_output=True, timeout=300, cwd="/",
                          env={**os.environ, "HOME": str(state_dir)})
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(lines) == len(steps) + 1, (lines, proc.stderr.decode()[-2000:])
    return lines[1:]


def sh(script: str, **kw) -> list:
    return ["exec", {"argv": ["sh", "-c", script], **kw}]


def out(answer: dict) -> bytes:
    assert "ok" in answer, answer
    return base64.b64decode(answer["ok"]["stdout"])


def test_files_and_background_processes_last_from_one_exec_to_the_next(images, backend, state_dir):
    server = ("import http.server, os; os.chdir('/testbed'); "
              "http.server.HTTPServer(('127.0.0.1', 8123), http.server.SimpleHTTPRequestHandler).serve_forever()")
    fetch = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8123/hello.txt').read().decode())"
    wait = "for i in $(seq 50); do python3 -c \"$0\" 2>/dev/null && exit 0; sleep 0.1; done; exit 1"
    got = scenario(images, backend, state_dir, [
        sh("echo changed > /testbed/hello.txt; p=/usr/local/lib/installed; mkdir -p $p; touch $p/pkg"),
        ["exec", {"argv": ["python3", "-c", server + "  # started in the background"], "timeout": 0.5}],
        sh(f"python3 -c \"{server}\" >/tmp/server.log 2>&1 & echo started"),
        ["exec", {"argv": ["sh", "-c", wait, fetch]}],
        ["exec", {"argv": ["python3", "-c", fetch]}],
        sh("cat /testbed/hello.txt; ls /usr/local/lib/installed; echo $FOO"),
    ])
    assert got[1]["ok"]["timed_out"], "a foreground server is stopped by its exec's timeout"
    assert out(got[2]) == b"started\n" and got[2]["ok"]["wall_time"] < 5, "an exec does not wait for its background"
    assert got[3]["ok"]["exit_code"] == 0, got[3]
    assert out(got[4]) == b"changed\n\n", "the server started two execs before still answers"
    assert out(got[5]) == b"changed\npkg\nbar\n"


def test_a_timeout_kills_that_exec_only(images, backend, state_dir):
    mark = {"kernel": "2001.5", "userns": "2002.5"}[backend]
    got = scenario(images, backend, state_dir, [
        sh(f"sleep {mark}0 >/dev/null 2>&1 & echo bg"),
        sh(f"sleep {mark} & sleep {mark}", timeout=1.0),
        ["sleep", {"seconds": 0.5}],
        sh("ps -eo args 2>/dev/null || for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"),
    ])
    assert got[1]["ok"]["timed_out"] and got[1]["ok"]["wall_time"] < 10
    left = out(got[3]).decode()
    assert f"sleep {mark}0" in left, "what an earlier exec left in the background survives"
    assert f"sleep {mark} " not in left + " ", "the timed-out exec's process group is gone"


def test_execs_run_side_by_side(images, backend, state_dir):
    """An agent's parallel tool calls (Inspect runs them at once): one waits in the
    foreground for what a later one makes; one's timeout leaves the others running."""
    got = scenario(images, backend, state_dir, [
        ["together", {"steps": [
            [*sh("until [ -e /tmp/go ]; do sleep 0.05; done; echo waited", timeout=60), 0.0],
            [*sh("touch /tmp/go; echo made"), 0.5],
            [*sh("sleep 600", timeout=1.0), 0.5],
            [*sh("sleep 3; echo slow"), 0.5],
        ]}],
        sh("ls /tmp"),
    ])
    waited, made, timed, slow = got[0]["ok"]
    assert out(waited) == b"waited\n" and not waited["ok"]["timed_out"], "it ran while another exec waited"
    assert waited["ok"]["wall_time"] < 30, waited
    assert out(made) == b"made\n"
    assert timed["ok"]["timed_out"] and timed["ok"]["wall_time"] < 10, timed
    assert out(slow) == b"slow\n" and not slow["ok"]["timed_out"], "another exec's timeout did not kill it"
    assert out(got[1]) == b"go\n"


def test_commands_run_as_the_instance_s_users_as_root_only(images, backend, state_dir):
    """exec's `user`, a name of the instance's /etc/passwd: as root its uid and gid (on
    the host, a range no account uses) and its HOME, and no power over root's files;
    rootless the sandbox maps root only and says so."""
    mark = {"kernel": "3101.5", "userns": "3102.5"}[backend]
    got = scenario(images, backend, state_dir, [
        sh("id -u; id -g; echo $HOME; touch /tmp/mine; stat -c %u:%g /tmp/mine; "
           "touch /testbed/x 2>/dev/null || echo denied", user="nobody"),
        sh(f"sleep {mark} >/dev/null 2>&1 &", user="nobody"),
        ["sleep", {"seconds": 0.5}],
        ["host_uids", {"text": f"sleep {mark}"}],
        sh("id -u; ls /testbed/x 2>/dev/null || echo none", user="root"),
        sh("true", user="no-such-user"),
    ])
    if backend == "userns":
        assert [g.get("error") for g in got[:2]] == ["UserUnsupported"] * 2, got
        assert "root only" in got[0]["message"] and got[3]["ok"] == []
    else:
        assert out(got[0]) == b"65534\n65534\n/nonexistent\n65534:65534\ndenied\n"
        assert got[3]["ok"] == [0x6FFF0000 + 65534 - 1], "on the host, nobody of the sandbox is no account"
    assert out(got[4]) == b"0\nnone\n"
    assert got[5]["error"] == ("UserUnsupported" if backend == "userns" else "UnknownUser"), got[5]


def test_file_helpers_are_byte_exact_and_raise_local_errors(images, backend, state_dir):
    data = b"line one\r\nline two\x00\xff\n"
    host = state_dir / "dl"
    got = scenario(images, backend, state_dir, [
        ["write_file", {"path": "new/dir/file.bin", "data": base64.b64encode(data).decode()}],
        ["read_file", {"path": "/testbed/new/dir/file.bin"}],
        ["read_file", {"path": "missing.txt"}],
        ["read_file", {"path": "new"}],
        ["write_file", {"path": "new", "data": ""}],
        sh("ln -s dir/file.bin /testbed/new/link; mkfifo /testbed/new/fifo 2>/dev/null; true"),
        ["download", {"path": "new", "host_path": str(host)}],
        ["exec", {"argv": ["pwd"], "cwd": "new/dir"}],
        ["exec", {"argv": ["pwd"], "cwd": "no/such/dir"}],
        ["exec", {"argv": ["echo", "still here"]}],
    ])
    assert base64.b64decode(got[1]["ok"]) == data
    assert got[2]["error"] == "FileNotFoundError" and got[3]["error"] == "IsADirectoryError"
    assert got[4]["error"] == "IsADirectoryError"
    assert got[6].get("error") in (None, "RunnerError"), got[6]
    if "ok" in got[6]:  # mkfifo made a fifo: the download refuses it in one line; else the tree came
        assert {"dir", "dir/file.bin", "link"} <= set(got[6]["ok"])
        assert (host / "dir" / "file.bin").read_bytes() == data and os.readlink(host / "link") == "dir/file.bin"
    else:
        assert "fifo" in got[6]["message"]
    assert out(got[7]) == b"/testbed/new/dir\n"
    assert got[8]["error"] == "RunnerError" and "no/such/dir" in got[8]["message"]
    assert out(got[9]) == b"still here\n", "a failed exec leaves the sandbox usable"


def test_a_killed_holder_makes_the_next_call_fail_fast(images, backend, state_dir):
    got = scenario(images, backend, state_dir, [
        sh("echo alive"),
        ["kill_holder", {}],
        sh("echo after", timeout=30),
        sh("echo again"),
    ])
    assert out(got[0]) == b"alive\n"
    assert got[2]["error"] == "SandboxUnavailable" and got[3]["error"] == "SandboxUnavailable", got


def test_nothing_is_left_after_close(images, backend, state_dir):
    scenario(images, backend, state_dir, [sh("sleep 3003.5 >/dev/null 2>&1 & echo bg"), ["close", {}]])
    assert eventually(lambda: not processes_with("sleep 3003.5"), 20), "a background process outlived close()"


def test_the_sandbox_is_bounded_as_a_whole(images, backend, state_dir):
    """The writable layer is a sized tmpfs (disk_mb), and the process limit counts every
    process of the sandbox, those left running by earlier execs included."""
    got = scenario(images, backend, state_dir, [
        sh("head -c 80M /dev/zero > /testbed/big; echo $?"),
        sh("for i in $(seq 12); do sleep 60 >/dev/null 2>&1 & done; echo spawned"),
        sh("for i in $(seq 30); do sleep 60 >/dev/null 2>&1 & done; echo done"),
    ], disk_mb=32, max_processes=20)
    assert out(got[0]) != b"0\n", "80 MB fit in a 32 MB writable layer"
    assert out(got[1]) == b"spawned\n"
    assert base64.b64decode(got[2]["ok"]["stderr"]), "30 more processes started beside the first 12"


def test_a_layer_on_disk_is_capped_as_root_and_goes_with_the_sandbox(images, backend, state_dir):
    """layer_dir: the writable layer on a node-local disk instead of in memory. Root: an ext4
    of disk_mb on a loop device (a write past it gets ENOSPC), its file unlinked at once;
    rootless: a directory there, uncapped. Nothing of it is left after close."""
    layer_dir = Path(tempfile.mkdtemp(prefix="ib-layers-", dir="/var/tmp"))
    if backend == "userns":
        os.chown(layer_dir, NOBODY, NOBODY)
    try:
        got = scenario(images, backend, state_dir, [
            sh("head -c 48M /dev/zero > /tmp/big; echo $?; stat -f -c %b,%S /"),
            ["host_files", {"path": str(layer_dir)}],
            sh("cat /tmp/big | wc -c"),
        ], **({"disk_mb": 32} if backend == "kernel" else {}), layer_dir=str(layer_dir))
        status, fs = out(got[0]).decode().split()
        on_disk = got[1]["ok"]
        if backend == "kernel":
            blocks, size = map(int, fs.split(","))
            assert status != "0" and blocks * size <= 32 << 20, "the layer is a 32 MB file system"
            assert on_disk == {}, "its file is unlinked once mounted"
            assert int(out(got[2])) < 32 << 20
        else:
            assert status == "0" and int(out(got[2])) == 48 << 20
            [(name, size)] = [(n, s) for n, s in on_disk.items() if n.endswith("/upper/tmp/big")]
            assert size == 48 << 20, "the layer is on the disk, not in memory"
        assert eventually(lambda: not list(layer_dir.iterdir()) and not loops_backed_by(layer_dir), 10), \
            "nothing of the layer is left once the sandbox's init ends"
    finally:
        shutil.rmtree(layer_dir, ignore_errors=True)


def test_a_capped_layer_on_disk_rootless_is_refused_in_one_line(images, tmp_path):
    from image_builder.runtime.mounts import RunnerError
    from image_builder.runtime.sandbox import Sandbox
    from image_builder.runtime.session import Backend, InstanceLayers
    layers = InstanceLayers(images.env_sif, (images.inst_sqfs,), {}, "/testbed")
    with pytest.raises(RunnerError, match="needs the kernel backend .root: a loop device"):
        Sandbox(layers, backend=Backend.USERNS, disk_mb=32, layer_dir=tmp_path)


def test_a_rootless_layer_a_killed_holder_left_is_removed_by_the_next_sandbox(images):
    """A Slurm job's end kills the holder outright: its rootless layer directory stays on the
    node's disk until a sandbox is next made in that layer dir (its holder's lock is free)."""
    layer_dir = Path(tempfile.mkdtemp(prefix="ib-layers-", dir="/var/tmp"))
    state_dir = Path(tempfile.mkdtemp(prefix="ib-sandbox-userns-"))
    for d in (layer_dir, state_dir):
        os.chown(d, NOBODY, NOBODY)
    try:
        scenario(images, "userns", state_dir, [sh("echo left > /tmp/left"), ["kill_holder", {}]],
                 layer_dir=str(layer_dir))
        [left] = list(layer_dir.iterdir())
        assert (left / "upper/tmp/left").read_text() == "left\n"
        got = scenario(images, "userns", state_dir, [["host_files", {"path": str(layer_dir)}]],
                       layer_dir=str(layer_dir))
        assert not left.exists(), "the killed holder's layer is removed"
        assert got[0]["ok"] and not any(name.startswith(left.name) for name in got[0]["ok"])
        assert eventually(lambda: not list(layer_dir.iterdir()), 10)
    finally:
        shutil.rmtree(layer_dir, ignore_errors=True)
        shutil.rmtree(state_dir, ignore_errors=True)


def test_the_sweep_passes_over_a_layer_whose_holder_lives(tmp_path):
    import fcntl

    from image_builder.runtime.holder import _LAYER_LOCK, _LAYER_PREFIX, Holder
    live, dead, other = (tmp_path / f"{_LAYER_PREFIX}{n}" for n in ("live", "dead", "other"))
    for d in (live, dead):
        (d / "upper").mkdir(parents=True)
        (d / _LAYER_LOCK).touch()
    other.mkdir()  # no lock in it: not a layer of ours
    held = os.open(live / _LAYER_LOCK, os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        Holder._sweep_layers(str(tmp_path))
        assert live.exists() and other.exists() and not dead.exists()
    finally:
        os.close(held)
    Holder._sweep_layers(str(tmp_path))
    assert not live.exists() and other.exists()
