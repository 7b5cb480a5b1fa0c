"""The host executor the grader tests run on: a real process tree per run, with the runtime's limits."""

from __future__ import annotations

import os
import signal
import time

import pytest

from image_builder.runtime.execution import RunRequest
from tests.support.host_executor import SANDBOX_UID, HostExecutor, HostExecutorError


@pytest.fixture(scope="module")
def host():
    return HostExecutor()


def py(code: str, **kw) -> RunRequest:
    return RunRequest(argv=("python3", "-c", code), **kw)


def test_stdin_is_a_regular_file(host):
    code = "import os, stat, sys; st = os.fstat(0); print(stat.S_ISREG(st.st_mode), st.st_size, os.read(0, st.st_size))"
    result = host.run(py(code, stdin=b"3 4\n"))
    assert result.exit_code == 0
    assert result.stdout == b"True 4 b'3 4\\n'\n"


def test_files_land_in_a_fresh_workdir_each_run(host):
    first = host.run(py("import os; print(open('data/in.txt').read()); open('left-behind', 'w').write('x')",
                        files={"data/in.txt": b"hello"}))
    second = host.run(py("import os; print(os.path.exists('left-behind'))"))
    assert first.stdout == b"hello\n" and second.stdout == b"False\n"


def test_each_run_has_a_tmp_of_its_own(host):
    first = host.run(py("import os; print(open('/tmp/g/in.txt').read(), os.listdir('/tmp'))",
                        files={"/tmp/g/in.txt": b"hello"}))
    second = host.run(py("import os; print(os.listdir('/tmp'))"))
    assert first.stdout == b"hello ['g']\n" and second.stdout == b"[]\n"
    assert not os.path.exists("/tmp/g/in.txt")


def test_refuses_paths_outside_the_workdir(host):
    with pytest.raises(HostExecutorError, match="relative"):
        host.run(py("pass", files={"/etc/x": b""}))
    with pytest.raises(HostExecutorError, match="relative"):
        host.run(py("pass", files={"../x": b""}))


def test_runs_as_an_unprivileged_user(host):
    ids = host.run(py("import os; print(os.getuid(), os.getgid())")).stdout
    assert ids == f"{SANDBOX_UID} {SANDBOX_UID}\n".encode()


def test_exit_code_and_signal(host):
    assert host.run(py("raise SystemExit(3)")).exit_code == 3
    killed = host.run(py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    assert (killed.exit_code, killed.signal) == (None, signal.SIGKILL)


def test_timeout_kills_the_whole_tree_even_after_setsid(host):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(60)"
    start = time.monotonic()
    result = host.run(py(code, timeout=1))
    assert result.timed_out and result.signal == signal.SIGKILL
    assert time.monotonic() - start < 5


def test_leftover_background_processes_end_with_the_run(host):
    # A daemon holding stdout open must not keep the run (or its output pipes) alive.
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('done')"
    start = time.monotonic()
    result = host.run(py(code, timeout=30))
    assert result.stdout == b"done\n" and not result.timed_out
    assert time.monotonic() - start < 5


def test_memory_limit(host):
    result = host.run(py("x = bytearray(800 << 20)", memory_mb=256))
    assert result.out_of_memory and result.exit_code == 1
    assert host.run(py("x = bytearray(100 << 20)", memory_mb=256)).exit_code == 0


def test_output_is_capped_and_drained(host):
    result = host.run(py("import sys\nfor _ in range(5000): sys.stdout.write('x' * 1000)", max_output=4096))
    assert result.exit_code == 0 and result.truncated and len(result.stdout) == 4096


def test_fork_bomb_is_capped_and_cleaned_up():
    host = HostExecutor(max_processes=64)
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    result = host.run(py(code, timeout=3))
    assert result.timed_out and time.monotonic() - start < 15


def test_no_network_unless_asked(host):
    code = "import socket; socket.create_connection(('127.0.0.1', 9), timeout=2)"
    result = host.run(py(code))
    assert result.exit_code == 1 and b"Network is unreachable" in result.stderr
