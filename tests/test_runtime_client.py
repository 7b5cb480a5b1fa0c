"""The runtime's client side against a hostile local user: the holder's socket name and
state dir taken first by someone else, and the `run` and `shell` commands (output and
input streamed in flat memory, the shell's PATH the image's). Kernel as root, userns as
uid 65534 (setpriv), through the installed console script on the MBPP store."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.support.terminal import read_pty

EXE = Path(sys.executable).parent / "image-builder"
NOBODY = 65534
OTHER = 65533  # a second unprivileged user: the squatter of a rootless victim, the victim of planted dirs
CASES = [("kernel", None), ("userns", NOBODY)]  # backend, the uid it runs as (None: root)


def as_user(user: int | None, argv: list[str]) -> list[str]:
    return argv if user is None else ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]


def user_dir(owner: int | None) -> Path:
    d = Path(tempfile.mkdtemp(prefix="ib-client-"))  # mode 700
    if owner is not None:
        os.chown(d, owner, owner)
    return d


def cli_env(xdg: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    return {**env, "XDG_RUNTIME_DIR": str(xdg)} if xdg else env


def cli(*args: str, user: int | None, xdg: Path | None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(as_user(user, [str(EXE), *args]), capture_output=True, env=cli_env(xdg), cwd="/",
                          timeout=300, **kw)


def stop_holders_of(path: Path) -> None:
    """Kill the holders (and their daemons) this test started for the state dir `path`,
    by pid: a lingering holder would outlive the test by a minute."""
    needle = str(path).encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def image_path(store: Path) -> str:
    from image_builder.store.store import Store
    return Store.open(store).resolve("512").env["PATH"]


# --- 1. the holder's socket name, taken first by another user --------------------------------------

SQUATTER = """
import socket, sys
name, kind = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(b"\\0" + name.encode())
if kind != "bound":
    s.listen()
print("bound", flush=True)
sys.stdin.read()
"""

NAME_OF = ("import sys; from pathlib import Path; from image_builder.runtime.holder_session import holder_name; "
           "print(holder_name(Path(sys.argv[1]), sys.argv[2] == 'kernel'))")


@pytest.mark.parametrize("backend, victim, squatter, kind", [
    ("kernel", None, NOBODY, "listening"),  # answers: the peer's uid gives it away
    ("kernel", None, NOBODY, "bound"),  # bound, never listening: the new holder finds the name taken
    ("userns", NOBODY, OTHER, "listening"),
])
def test_a_squatted_holder_name_is_given_up_for_a_new_one(mbpp_store, backend, victim, squatter, kind):
    xdg = user_dir(victim)
    state = xdg / "image_builder"
    state.mkdir(mode=0o700)
    if victim is not None:
        os.chown(state, victim, victim)
    name = subprocess.run(as_user(victim, [sys.executable, "-c", NAME_OF, str(state), backend]), cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()
    squat = subprocess.Popen(as_user(squatter, [sys.executable, "-c", SQUATTER, name, kind]),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert squat.stdout.readline() == b"bound\n"
        r = cli("run", "--store", str(mbpp_store), "--backend", backend, "512", "--", "echo", "ok", user=victim,
                xdg=xdg)
        assert (r.returncode, r.stdout) == (0, b"ok\n"), r.stderr.decode()
        assert squat.poll() is None, "the squatter keeps its name: the holder went elsewhere"
        assert f"@{name}" in (state / "holder.log").read_text(), "the move is noted in holder.log"
        again = cli("run", "--store", str(mbpp_store), "--backend", backend, "512", "--", "echo", "again",
                    user=victim, xdg=xdg)
        assert again.stdout == b"again\n", again.stderr.decode()
    finally:
        squat.kill()
        squat.wait()
        stop_holders_of(state)
        shutil.rmtree(xdg, ignore_errors=True)


# --- 2. the default state dir, made first by another user --------------------------------------------

def home_env(home: Path) -> dict[str, str]:
    """The environment of a user whose home is `home`, without XDG_RUNTIME_DIR or XDG_CONFIG_HOME."""
    return {**{k: v for k, v in cli_env(None).items() if k != "XDG_CONFIG_HOME"}, "HOME": str(home)}


@contextlib.contextmanager
def planted_state_dir(plant: str):
    """/tmp/image_builder-OTHER made first: by another user (a directory of theirs, mode 777, or a symlink to
    one) or left open by the victim, with holder.log pointing at a file of the victim's. Yields (the planted
    directory, the victim's file)."""
    default = Path(f"/tmp/image_builder-{OTHER}")
    if default.is_symlink() or default.is_file():
        default.unlink()
    elif default.exists():
        shutil.rmtree(default)
    victims = user_dir(OTHER)
    precious = victims / "precious"
    precious.write_text("precious\n")
    os.chown(precious, OTHER, OTHER)
    evil = user_dir(NOBODY)
    try:
        planted = default
        if plant == "symlink":
            default.symlink_to(evil)
            os.lchown(default, NOBODY, NOBODY)
            planted = evil
        else:
            default.mkdir()
            os.chown(default, *((NOBODY, NOBODY) if plant == "foreign" else (OTHER, OTHER)))
        planted.chmod(0o777)
        (planted / "holder.log").symlink_to(precious)
        os.lchown(planted / "holder.log", NOBODY, NOBODY)
        yield planted, precious
        assert precious.read_text() == "precious\n"
        assert sorted(p.name for p in planted.iterdir()) == ["holder.log"], "nothing was made in it"
    finally:
        for made in [default, *Path("/tmp").glob(f"image_builder-{OTHER}-*")]:
            stop_holders_of(made)
            if made.is_symlink():
                made.unlink()
            else:
                shutil.rmtree(made, ignore_errors=True)
        shutil.rmtree(victims, ignore_errors=True)
        shutil.rmtree(evil, ignore_errors=True)


@pytest.mark.xdist_group("other-user-state-dir")  # one at a time: they share /tmp/image_builder-OTHER (conftest)
@pytest.mark.parametrize("plant", ["foreign", "symlink"])
def test_a_state_dir_name_taken_by_another_user_does_not_block_runs(mbpp_store, plant):
    """Without XDG_RUNTIME_DIR the state dir is /tmp/image_builder-UID, a name any user of the node can take
    first: every run of the victim was refused (a denial of service). The victim's runs now go to
    /tmp/image_builder-UID-KEY, KEY a secret in their ~/.config, made once (mode 600); nothing is made in, or
    written through, what was planted."""
    with planted_state_dir(plant):
        home = user_dir(OTHER)
        try:
            runs = [subprocess.run(as_user(OTHER, [str(EXE), "run", "--store", str(mbpp_store), "512", "--", "echo",
                                                   "ran"]), capture_output=True, text=True, cwd="/", timeout=300,
                                   env=home_env(home)) for _ in range(2)]
            for r in runs:
                assert r.returncode == 0 and r.stdout == "ran\n", r.stderr
            key = home / ".config" / "image_builder" / "state-dir.key"
            assert key.stat().st_uid == OTHER and key.stat().st_mode & 0o777 == 0o600
            fallback = Path(f"/tmp/image_builder-{OTHER}-{key.read_text().strip()}")
            st = fallback.lstat()
            assert stat.S_ISDIR(st.st_mode) and st.st_uid == OTHER and st.st_mode & 0o777 == 0o700
            assert (fallback / "holder.token").exists(), "both runs used the one fallback (and its holder)"
            assert [p.name for p in Path("/tmp").glob(f"image_builder-{OTHER}-*")] == [fallback.name]
        finally:
            shutil.rmtree(home, ignore_errors=True)


@pytest.mark.xdist_group("other-user-state-dir")
@pytest.mark.parametrize("plant", ["foreign", "open", "symlink"])
def test_a_planted_state_dir_is_refused_in_one_line(mbpp_store, plant):
    """A state dir of the victim's own left open to others is refused (others may have put files in it); one
    another user took is refused where the victim has no private place for a key of their own (HOME not
    theirs). One line naming the directory and XDG_RUNTIME_DIR, nothing written through the planted log."""
    with planted_state_dir(plant):
        r = subprocess.run(as_user(OTHER, [str(EXE), "run", "--store", str(mbpp_store), "512", "--", "true"]),
                           capture_output=True, text=True, cwd="/", timeout=300, env=home_env(Path("/nonexistent")))
        lines = r.stderr.splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert f"/tmp/image_builder-{OTHER}" in lines[0] and "XDG_RUNTIME_DIR" in lines[0], lines


# --- 3. the shell's PATH is the image's -----------------------------------------------------------

@pytest.mark.parametrize("backend, user", CASES)
def test_the_shell_keeps_the_image_path_over_etc_profile(mbpp_store, backend, user):
    """Debian's /etc/profile sets PATH afresh, without the image's /opt/venv/bin: on a
    terminal and with commands piped in, the shell has the image's PATH."""
    want = image_path(mbpp_store)
    assert want.startswith("/opt/venv/bin:")
    xdg = user_dir(user)
    cmd = as_user(user, [str(EXE), "shell", "--store", str(mbpp_store), "--backend", backend, "512"])
    try:
        pid, master = pty.fork()
        if pid == 0:  # a session leader with the pty as its terminal, as a user's shell is
            os.chdir("/")
            os.execvpe(cmd[0], cmd, cli_env(xdg))
        os.write(master, b'echo "P=[$PATH]"; command -v python; exit 3\n')
        out = read_pty(master, 120)
        _, status = os.waitpid(pid, 0)
        os.close(master)
        assert f"P=[{want}]".encode() in out, out
        assert b"/opt/venv/bin/python\r\n" in out, out
        assert f"/bin/bash (login files, then the image's environment); PATH={want}".encode() in out, \
            "the banner says which shell and PATH"
        assert os.waitstatus_to_exitcode(status) == 3, out
        piped = cli("shell", "--store", str(mbpp_store), "--backend", backend, "512", user=user, xdg=xdg,
                    input=b'echo "P=[$PATH]"; command -v python\n')
        assert piped.stdout == f"P=[{want}]\n/opt/venv/bin/python\n".encode(), piped.stderr
    finally:
        stop_holders_of(xdg)
        shutil.rmtree(xdg, ignore_errors=True)


# --- 4. run streams its output and input ---------------------------------------------------------

# The peak RSS of a command (and of the children it waited for), into the file argv[1]. Measured
# from a process of its own: an exec'd child's ru_maxrss starts at its parent's high-water mark
# (pytest's, over 100 MB) when that parent is pytest itself.
MAXRSS = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("backend, user", CASES)
def test_run_streams_2_gb_of_output_in_flat_memory_and_stops_at_the_cap(mbpp_store, backend, user):
    """256 MiB on stdin (a pipe) and 2 GiB out: the client stays under 100 MB, passes on
    exactly the default cap (1 GiB) of stdout, then stops the command, says so and exits 125."""
    xdg = user_dir(user)
    rss = xdg / "maxrss"
    cmd = [sys.executable, "-c", MAXRSS, str(rss), *as_user(user, [
        str(EXE), "run", "--store", str(mbpp_store), "--backend", backend, "512", "--",
        "sh", "-c", "wc -c; head -c 2147483648 /dev/zero"])]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cli_env(xdg), cwd="/")
    err = bytearray()

    def feed():
        block = b"y" * (1 << 20)
        try:
            for _ in range(256):
                proc.stdin.write(block)
            proc.stdin.close()
        except BrokenPipeError:
            pass

    threads = [threading.Thread(target=feed), threading.Thread(target=lambda: err.extend(proc.stderr.read()))]
    try:
        for t in threads:
            t.start()
        first = proc.stdout.readline()
        total = len(first)
        t0 = time.monotonic()
        while chunk := proc.stdout.read1(1 << 20):
            total += len(chunk)
        elapsed = time.monotonic() - t0
        proc.wait(60)
        for t in threads:
            t.join(30)
        peak_kb = int(rss.read_text())
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
        stop_holders_of(xdg)
        shutil.rmtree(xdg, ignore_errors=True)
    assert peak_kb < 100 << 10, f"client peak RSS {peak_kb} KB"
    assert first == b"268435456\n", (first, bytes(err))
    assert total == 1 << 30, total
    assert proc.returncode == 125, bytes(err)
    assert b"image-builder: stdout went over --max-output (1073741824 bytes): the command was stopped" in err
    assert b"Traceback" not in err
    print(f"{backend}: 1 GiB passed on in {elapsed:.1f} s, client peak RSS {peak_kb >> 10} MB")


def test_run_stops_when_its_reader_leaves_and_honours_max_output(mbpp_store, tmp_path):
    store = str(mbpp_store)
    proc = subprocess.Popen([str(EXE), "run", "--store", store, "512", "--", "yes"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd="/")
    try:
        assert select.select([proc.stdout], [], [], 60)[0], "no output within a minute: not streamed"
        assert proc.stdout.readline() == b"y\n"
        proc.stdout.close()  # as `run ... | head -1` does
        assert proc.wait(timeout=60) == 141
        assert b"Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    small = subprocess.run([str(EXE), "run", "--store", store, "--max-output", "10K", "512", "--", "sh", "-c",
                            "echo out; head -c 20000 /dev/zero >&2"], capture_output=True, cwd="/", timeout=120)
    assert small.returncode == 125 and small.stdout == b"out\n"
    assert small.stderr.startswith(b"\0" * 10240 + b"image-builder: stderr went over --max-output (10240 bytes)")
    record = subprocess.run([str(EXE), "run", "--store", store, "--json", "--output-dir", str(tmp_path / "o"),
                             "--max-output", "1K", "512", "--", "head", "-c", "5000", "/dev/zero"],
                            capture_output=True, cwd="/", timeout=120)
    assert record.returncode == 125 and b'"truncated": true' in record.stdout
    assert (tmp_path / "o" / "stdout").read_bytes() == b"\0" * 1024
    bad = subprocess.run([str(EXE), "run", "--store", store, "--max-output", "lots", "512", "--", "true"],
                         capture_output=True, text=True, cwd="/")
    assert bad.returncode == 2 and "expected a byte count" in bad.stderr and "Traceback" not in bad.stderr


def test_a_file_on_stdin_is_a_regular_file_the_run_cannot_write_back(mbpp_store, tmp_path):
    """A file on stdin is copied first: the run sees a regular file (os.fstat works), and
    writing through /proc/self/fd/0 changes the copy, never the host's file."""
    given = tmp_path / "input.txt"
    given.write_text("12345")
    code = ("import os, stat, sys; st = os.fstat(0); print(stat.S_ISREG(st.st_mode), st.st_size, sys.stdin.read());"
            "open('/proc/self/fd/0', 'w').write('overwritten')")
    with open(given, "rb") as f:
        r = subprocess.run([str(EXE), "run", "--store", str(mbpp_store), "512", "--", "python3", "-c", code],
                           stdin=f, capture_output=True, cwd="/", timeout=120)
    assert (r.returncode, r.stdout) == (0, b"True 5 12345\n"), r.stderr
    assert given.read_text() == "12345"


@pytest.mark.parametrize("owner, mode", [(NOBODY, 0o1777), (0, 0o777)])  # sticky does not stop an owner
def test_a_state_dir_inside_a_directory_others_can_rename_it_in_is_refused(mbpp_store, owner, mode):
    """XDG_RUNTIME_DIR set to a directory another user owns, or one anyone may write
    that is not sticky: they could swap our private dir for theirs after it is checked."""
    parent = user_dir(owner)
    parent.chmod(mode)
    try:
        r = cli("run", "--store", str(mbpp_store), "512", "--", "true", user=OTHER, xdg=parent, text=True)
        lines = r.stderr.splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert str(parent) in lines[0] and "XDG_RUNTIME_DIR" in lines[0], lines
        assert not (parent / "image_builder").exists(), "nothing was made in it"
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_a_state_dir_of_ours_that_others_can_only_read_is_narrowed_to_700(tmp_path):
    from image_builder.runtime.statedir import private_dir
    from image_builder.runtime.mounts import RunnerError
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    readable.chmod(0o755)
    assert private_dir(readable) == str(readable) and (readable.stat().st_mode & 0o777) == 0o700
    made = Path(private_dir(tmp_path / "a" / "new"))
    assert (made.stat().st_mode & 0o777) == 0o700
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(RunnerError, match="is a symlink"):
        private_dir(tmp_path / "link")
