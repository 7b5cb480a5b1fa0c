"""`image-builder serve` for real: the CLI's server over the MBPP store on a free loopback port, called by
SandboxFusion's own client (sandbox_fusion.run_code) and by plain requests.

The official client sends no Authorization header of its own (it posts with bare `requests.post`): most tests
run it against a server started with --no-token; test_the_token gives it the token in its endpoint URL
(`http://x:TOKEN@host:port`, which requests sends as Basic auth) and sends Bearer headers with requests."""

from __future__ import annotations

import base64
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from sandbox_fusion import RunCodeRequest, RunStatus, run_code
from sandbox_fusion.models import CommandRunStatus

from image_builder.devtools.localregistry import free_port, stop_process
from tests.conftest import ROOT, built_once

EXE = Path(os.environ.get("VIRTUAL_ENV", Path(__file__).resolve().parents[1] / ".venv")) / "bin" / "image-builder"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def stop(self) -> str:
        stop_process(self.proc, 20)
        return self.log.read_text()


def start(store: Path, tmp: Path, *args: str) -> Server:
    port = free_port()
    log = tmp / f"serve-{port}.log"
    proc = subprocess.Popen([str(EXE), "serve", "--store", str(store), "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}: {log.read_text()}")
        try:
            if requests.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except requests.ConnectionError:
            time.sleep(0.2)
    server.stop()
    raise AssertionError(f"serve did not answer in 120 s: {log.read_text()}")


@pytest.fixture(scope="module")
def open_server(mbpp_store, tmp_path_factory):
    server = start(mbpp_store, tmp_path_factory.mktemp("serve"), "--no-token")
    yield server
    server.stop()


def call(server: Server, **fields):
    return run_code(RunCodeRequest(**fields), endpoint=server.url, max_attempts=1, client_timeout=60)


def test_the_official_client_runs_python(open_server):
    health = requests.get(f"{open_server.url}/health", timeout=10).json()
    assert health["languages"] == ["bash", "python"] and health["running_or_queued"] == 0, health
    r = call(open_server, code="print(1)", language="python")
    assert r.status == RunStatus.Success and r.message == ""
    assert r.compile_result is None
    assert r.run_result.status == CommandRunStatus.Finished and r.run_result.return_code == 0
    assert r.run_result.stdout == "1\n" and r.run_result.stderr == ""
    assert 0 < r.run_result.execution_time < 30


def test_python_runs_are_warm_clones_in_fresh_roots(open_server):
    """Each served Python run is a clone of a warm interpreter (runtime/warm.py; the kernel backend shows
    it the zygote's processes in /proc) and still finds nothing of the run before."""
    code = ("import os\nleft = os.path.exists('/tmp/left')\nopen('/tmp/left', 'w').close()\n"
            "seen = [open('/proc/%s/cmdline' % p, 'rb').read() for p in os.listdir('/proc') if p.isdigit()]\n"
            "print(left, any(b'zygote.py' in c for c in seen))")
    answers = [call(open_server, code=code, language="python").run_result.stdout for _ in range(3)]
    assert answers == ["False True\n"] * 3


def test_stdin_and_stderr(open_server):
    code = "import sys\nd = sys.stdin.read()\nprint(d.upper(), end='')\nprint('e', file=sys.stderr)"
    r = call(open_server, code=code, language="python", stdin="abc\ndef\n")
    assert r.status == RunStatus.Success
    assert r.run_result.stdout == "ABC\nDEF\n" and r.run_result.stderr == "e\n"


def test_a_non_zero_exit_fails_and_exit_zero_passes(open_server):
    r = call(open_server, code="import sys; print('x'); sys.exit(3)", language="python")
    assert r.status == RunStatus.Failed
    assert r.run_result.status == CommandRunStatus.Finished and r.run_result.return_code == 3
    assert r.run_result.stdout == "x\n"
    r = call(open_server, code="raise ValueError('boom')", language="python")
    assert r.status == RunStatus.Failed and r.run_result.return_code == 1 and "ValueError: boom" in r.run_result.stderr
    # The verdict is the exit status, as SandboxFusion's: this "passes" (the README says to grade otherwise).
    r = call(open_server, code="import sys; sys.exit(0)\nassert False", language="python")
    assert r.status == RunStatus.Success


def test_a_timeout_is_time_limit_exceeded(open_server):
    start_ = time.monotonic()
    r = call(open_server, code="import time\nprint('started', flush=True)\ntime.sleep(60)", language="python",
             run_timeout=1.5)
    assert time.monotonic() - start_ < 30
    assert r.status == RunStatus.Failed
    assert r.run_result.status == CommandRunStatus.TimeLimitExceeded and r.run_result.return_code is None
    assert r.run_result.stdout == "started\n"
    # Files are fetched after a timeout too, as SandboxFusion's are; a child the code started holds nothing open.
    code = ("import subprocess, time\nopen('partial.txt', 'w').write('so far')\n"
            "subprocess.Popen(['sleep', '600'])\ntime.sleep(60)")
    start_ = time.monotonic()
    r = call(open_server, code=code, language="python", run_timeout=1.5, fetch_files=["partial.txt"])
    assert time.monotonic() - start_ < 30
    assert r.status == RunStatus.Failed and r.run_result.status == CommandRunStatus.TimeLimitExceeded, r
    assert r.run_result.return_code is None
    assert base64.b64decode(r.files["partial.txt"]) == b"so far"


def test_files_in_and_fetched_out(open_server):
    code = ("data = open('in/data.txt').read()\nopen('out.txt', 'w').write(data * 2)\n"
            "import sys; print('to stderr', file=sys.stderr)\nopen('/tmp/abs.bin', 'wb').write(bytes(range(256)))")
    code += "\nimport sys, os; print(sys.stdin.read().upper(), sorted(os.listdir('.')), end='')"
    r = call(open_server, code=code, language="python", files={"in/data.txt": base64.b64encode(b"hi\n").decode()},
             fetch_files=["out.txt", "/tmp/abs.bin", "missing.txt"], stdin="given\n")
    assert r.status == RunStatus.Success, r
    # stdin reaches the code through the fetching wrapper, which leaves nothing of its own in the workdir.
    assert r.run_result.stdout == "GIVEN\n ['in', 'main.py', 'out.txt']"
    assert base64.b64decode(r.files["out.txt"]) == b"hi\nhi\n"
    assert base64.b64decode(r.files["/tmp/abs.bin"]) == bytes(range(256))
    assert "missing.txt" not in r.files and "missing.txt: no such file" in r.message
    assert r.run_result.stderr == "to stderr\n"  # the fetched files' channel is cut from the code's stderr
    # Every run has a fresh root: the last run's files are gone.
    r = call(open_server, code="import os; print(os.path.exists('out.txt'), os.path.exists('in'))", language="python",
             fetch_files=["out.txt"])
    assert r.run_result.stdout == "False False\n" and r.files == {}


def test_a_fetched_file_is_whole_or_named_as_not_sent(open_server):
    """A fetched file rides on stderr, which is cut at the output limit (8 MiB): a 20 MiB file came back as
    its first 8 MiB of base64, answered as if whole (red team). Now a file is sent only whole (its size is
    checked against its base64), else named in the message with why."""
    code = ("open('big', 'wb').write(b'x' * (7 << 20)); open('small', 'wb').write(b'ok')\n"
            "open('half', 'wb').write(b'y' * (5 << 20)); import sys; sys.stderr.write('e' * (4 << 20))")
    r = call(open_server, code=code, language="python", fetch_files=["small", "big", "half"])
    assert r.status == RunStatus.Success, r
    assert base64.b64decode(r.files["small"]) == b"ok"
    assert "big" not in r.files and "big: 7340032 bytes, over the" in r.message, r.message
    # 5 MiB of base64 (6.7 MiB) behind 4 MiB of the code's own stderr: past the limit, so not sent.
    assert "half" not in r.files and "half: cut by the output limit" in r.message, r.message
    assert r.run_result.stderr == "e" * (4 << 20)


def test_a_client_gone_before_its_body_leaves_no_traceback(open_server):
    import socket
    port = int(open_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"code\":")
        time.sleep(0.3)
    assert requests.get(f"{open_server.url}/health", timeout=10).status_code == 200
    time.sleep(0.3)
    assert "Traceback" not in open_server.log.read_text()


def test_bash_runs_with_bash(open_server):
    r = call(open_server, code='read x; echo "${x^^}" ${BASH_VERSION:+bash}', language="bash", stdin="yo\n")
    assert r.status == RunStatus.Success and r.run_result.stdout == "YO bash\n"


def test_the_memory_limit(open_server):
    # SandboxFusion's server takes memory_limit_MB; its client's model has no such field: sent with requests.
    def run(mb):
        r = requests.post(f"{open_server.url}/run_code", timeout=60, json={
            "code": "b = b'x' * (400 << 20)\nprint('allocated')", "language": "python", "memory_limit_MB": mb})
        assert r.status_code == 200
        return r.json()

    r = run(128)
    assert r["status"] == "Failed" and "MemoryError" in r["run_result"]["stderr"], r
    assert "out of memory (128 MB)" in r["message"]
    r = run(1024)
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "allocated\n", r


def test_no_network(open_server):
    r = call(open_server, code="import socket\ns = socket.socket()\ns.settimeout(3)\ns.connect(('1.1.1.1', 53))",
             language="python")
    assert r.status == RunStatus.Failed, r
    assert "Network is unreachable" in r.run_result.stderr, r.run_result.stderr


def test_unknown_language_is_a_sandbox_error(open_server):
    with pytest.raises(Exception, match="language 'cpp' is not served here"):  # the client raises on SandboxError
        call(open_server, code="int main(){}", language="cpp")
    r = requests.post(f"{open_server.url}/run_code", json={"code": "x", "language": "cobol"}, timeout=10)
    assert r.status_code == 200
    assert r.json()["status"] == "SandboxError" and "cobol" in r.json()["message"]
    assert r.json()["run_result"] is None


@pytest.mark.parametrize("body, says", [
    (b"not json", "not a /run_code request"),
    (b'["code"]', "JSON object"),
    (b'{"language": "python"}', "code must be a string"),
    (b'{"code": "1", "language": "python", "run_timeout": -1}', "run_timeout"),
    (b'{"code": "1", "language": "python", "files": {"a": "!!"}}', "not valid base64"),
    (b'{"code": "1", "language": "python", "fetch_files": [""]}', "non-empty string"),
    # Past what a run can take: answered 400 naming the field (they crashed the run: "argument out of range").
    (b'{"code": "1", "language": "python", "run_timeout": 1e400}', "run_timeout must be seconds in (0, 3600]"),
    (b'{"code": "1", "language": "python", "compile_timeout": 1e300}', "compile_timeout must be seconds"),
    (b'{"code": "1", "language": "python", "memory_limit_MB": 1000000000000000000000}', "memory_limit_MB must be"),
])
def test_a_malformed_request_is_400_with_the_reason(open_server, body, says):
    r = requests.post(f"{open_server.url}/run_code", data=body, timeout=10)
    assert r.status_code == 400 and says in r.json()["detail"]


def test_a_body_over_the_limit_is_413(open_server):
    big = b'{"code": "' + b"#" * (20 << 20) + b'", "language": "python"}'
    r = requests.post(f"{open_server.url}/run_code", data=big, timeout=60)
    assert r.status_code == 413
    # Chunked, without a length to check first: counted as it comes.
    chunks = iter([big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)])
    r = requests.post(f"{open_server.url}/run_code", data=chunks, timeout=60)
    assert r.status_code == 413
    assert requests.get(f"{open_server.url}/health", timeout=10).status_code == 200


def test_the_token(mbpp_store, tmp_path):
    token_file = tmp_path / "cfg" / "token"
    server = start(mbpp_store, tmp_path, "--token-file", str(token_file))
    try:
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        body = {"code": "print(2)", "language": "python"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            r = requests.post(f"{server.url}/run_code", json=body, headers=headers, timeout=10)
            assert r.status_code == 401, headers
        basic = base64.b64encode(b"anyone:wrong").decode()
        r = requests.post(f"{server.url}/run_code", json=body, headers={"Authorization": f"Basic {basic}"}, timeout=10)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        r = requests.post(f"{server.url}/run_code", json=body, headers={"Authorization": f"Bearer {token}"},
                          timeout=60)
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "2\n"
        # SandboxFusion's client sends no header, but requests turns the endpoint's user:password into Basic auth.
        host = server.url.removeprefix("http://")
        r = run_code(RunCodeRequest(code="print(3)", language="python"), endpoint=f"http://client:{token}@{host}",
                     max_attempts=1, client_timeout=60)
        assert r.status == RunStatus.Success and r.run_result.stdout == "3\n"
        with pytest.raises(Exception, match="responded with code 401"):
            run_code(RunCodeRequest(code="print(3)", language="python"), endpoint=f"http://client:nope@{host}",
                     max_attempts=1, client_timeout=60)
        with pytest.raises(Exception, match="responded with code 401"):
            run_code(RunCodeRequest(code="print(3)", language="python"), endpoint=server.url, max_attempts=1,
                     client_timeout=60)
    finally:
        log = server.stop()
    assert server.proc.returncode == 0, log  # SIGTERM: a clean shutdown, the session closed
    assert f"token written to {token_file}" in log
    assert token not in log  # the access log shows paths, never credentials
    # One access line per request: the 401s too.
    assert log.count("POST /run_code 401") == 6 and log.count("POST /run_code 200") == 2, log
    # A token file others can read is refused, in one line.
    token_file.chmod(0o644)
    r = subprocess.run([str(EXE), "serve", "--store", str(mbpp_store), "--token-file", str(token_file)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "other users can read this token file" in r.stderr and "Traceback" not in r.stderr
    # A private token file another user made (or one they could swap: in their directory) holds a token they know:
    # a root server took it (red team).
    token_file.chmod(0o600)
    for owner in (token_file, token_file.parent):
        os.chown(owner, 65534, 65534)
        r = subprocess.run([str(EXE), "serve", "--store", str(mbpp_store), "--token-file", str(token_file)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "is owned by uid 65534: another user may know this token" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        os.chown(owner, 0, 0)


HOLD = """
import socket, sys, time
port = int(sys.argv[1])
held = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
time.sleep(1)
closed = 0
for s in held:
    s.settimeout(0.5)
    try:
        closed += s.recv(1) == b""
    except ConnectionResetError:
        closed += 1
    except socket.timeout:
        pass
print(closed)
"""


def test_another_user_of_the_node_cannot_hold_the_servers_connections(open_server):
    """uvicorn keeps a connection that never sends a request: another user of the node (no token needed) held
    4,300 idle ones and the server, out of descriptors, accepted no one (red team). A connection from another
    user's socket on this host is let go at once; the server's own user (and root) are served."""
    port = open_server.url.rsplit(":", 1)[1]
    mine = __import__("socket").create_connection(("127.0.0.1", int(port)))
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", HOLD, port],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "200\n", (r.stdout, r.stderr)
    mine.settimeout(0.5)
    with pytest.raises(TimeoutError):  # ours stays open, waiting for its request
        mine.recv(1)
    mine.close()
    assert requests.get(f"{open_server.url}/health", timeout=10).status_code == 200


TAKE_PORT = """
import socket, sys
taken = []
for host in ("::", "::1", "127.0.0.1", "0.0.0.0"):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        s.bind((host, int(sys.argv[1])))
        taken.append(host)
    except OSError:
        pass
print(taken)
"""


def test_no_address_of_the_url_is_left_for_another_user(mbpp_store, tmp_path):
    """Clients send the token to whatever answers at the URL. Listening on 0.0.0.0 left [::]:PORT free: another
    user of the node took it, and a client reaching the node's name over IPv6 gave it the token; --host
    localhost wrote `localhost` into the URL, which may resolve to ::1 first (red team). Now every address
    family of a wildcard is ours, and a name is written as the number it was bound to."""
    url_file = tmp_path / "url"
    server = start(mbpp_store, tmp_path, "--host", "0.0.0.0", "--token-file", str(tmp_path / "token"),
                   "--url-file", str(url_file))
    try:
        port = server.url.rsplit(":", 1)[1]
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
                            TAKE_PORT, port], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == "[]\n", (r.stdout, r.stderr)
        assert url_file.read_text() == f"http://{__import__('socket').gethostname()}:{port}\n"
        # IPv4 clients of the dual-stack socket are still told apart by user (idle connections let go).
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
                            HOLD, port], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == "200\n", (r.stdout, r.stderr)
    finally:
        server.stop()
    url_file = tmp_path / "url2"
    server = start(mbpp_store, tmp_path, "--host", "localhost", "--no-token", "--url-file", str(url_file))
    try:
        assert url_file.read_text() == f"http://127.0.0.1:{server.url.rsplit(':', 1)[1]}\n"
    finally:
        server.stop()


SQUAT = """
import socket, sys, time
s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
s.bind(("::", 0)); s.listen(8)
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


def test_a_port_another_user_holds_on_ipv6_is_not_served_on_ipv4_alone(mbpp_store, tmp_path):
    """If [::]:PORT is taken, listening on 0.0.0.0:PORT alone gives another user the IPv6 half of the node's
    URL again: the server refuses to start, in one line, rather than fall back to IPv4."""
    squatter = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                                 "-c", SQUAT], stdout=subprocess.PIPE, text=True)
    try:
        port = squatter.stdout.readline().strip()
        r = subprocess.run([str(EXE), "serve", "--store", str(mbpp_store), "--host", "0.0.0.0", "--port", port,
                            "--token-file", str(tmp_path / "token")], capture_output=True, text=True, timeout=60)
    finally:
        squatter.kill()
        squatter.wait()
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot listen on :::{port} (Address already in use)" in r.stderr


def test_no_token_only_on_loopback(mbpp_store):
    r = subprocess.run([str(EXE), "serve", "--store", str(mbpp_store), "--no-token", "--host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--no-token only with a loopback --host" in r.stderr


def test_back_pressure(mbpp_store, tmp_path):
    server = start(mbpp_store, tmp_path, "--no-token", "--max-concurrency", "2", "--queue", "4")
    try:
        body = {"code": "import time; time.sleep(1); print('done')", "language": "python", "run_timeout": 30}

        def one(_):
            r = requests.post(f"{server.url}/run_code", json=body, timeout=120)
            return r.status_code, r.headers.get("Retry-After"), r.json()

        began = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(one, range(32)))
        took = time.monotonic() - began
    finally:
        server.stop()
    assert len(answers) == 32
    assert {code for code, _, _ in answers} <= {200, 503}
    done = [a for a in answers if a[0] == 200]
    busy = [a for a in answers if a[0] == 503]
    assert all(r["status"] == "Success" and r["run_result"]["stdout"] == "done\n" for _, _, r in done)
    assert all(retry == "1" and "busy" in r["detail"] for _, retry, r in busy)
    # 2 running and 4 waiting are admitted; the rest, arriving meanwhile, are turned away.
    assert len(done) >= 6 and busy, (len(done), len(busy))
    # At most 2 at once: the admitted one-second runs took at least half their number in seconds.
    assert took >= len(done) / 2 * 1.0


@pytest.mark.parametrize("command", [["serve", "--no-token"], ["shell"]])
def test_an_unknown_environment_is_one_line_naming_the_ones_there(mbpp_store, command):
    r = subprocess.run([str(EXE), *command, "--store", str(mbpp_store), "--env", "nope"], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"Error: no environment 'nope' in {mbpp_store} (it has: mbpp-py311)"


@pytest.mark.parametrize("name, status, says", [
    ("/proc/self/x", "SandboxError", "cannot write /proc/self/x"),
    # Through /proc's magic links, the init's descriptors: the run's cgroup directory on the host (a cgroup made
    # at the root of the host's hierarchy; the run moved out of its pids limit), the holder's log (red team).
    ("/proc/self/fd/10/../../cgroup.procs", "SandboxError", "mkdir /proc/self/fd/10/../..: "),
    ("/proc/self/fd/2", "SandboxError", "cannot write /proc/self/fd/2: Symbolic link loop"),
    ("/proc/self/oom_score_adj", "SandboxError", "cannot write /proc/self/oom_score_adj: not a regular file"),
    ("d/", "SandboxError", "cannot write /sandbox/d/: Is a directory"),
    (".", "SandboxError", "cannot write /sandbox/.: Is a directory"),
    ("/", "SandboxError", "cannot write /: Is a directory"),
    ("a" * 300, "SandboxError", "cannot write /sandbox/aaaa"),
    ("../../../../../x", "Success", ""),  # the run's own root: /x in its throwaway layer
    ("main.py", "Success", ""),  # the code wins over a file of its name
    ("x\nnewline", "Success", ""),
])
def test_odd_file_names_answer_without_breaking_the_server(open_server, name, status, says):
    r = requests.post(f"{open_server.url}/run_code", timeout=60, json={
        "code": "print('ran')", "language": "python", "files": {name: base64.b64encode(b"data").decode()},
        "fetch_files": [name]})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["status"] == status and says in answer["message"], answer
    if status == "Success":
        assert answer["run_result"]["stdout"] == "ran\n"
        if name != "main.py":
            assert base64.b64decode(answer["files"][name]) == b"data"
    assert requests.get(f"{open_server.url}/health", timeout=10).status_code == 200


# --- POST /submit: SandboxFusion's dataset API, the graders' verdicts -----------------------------

from sandbox_fusion import SubmitRequest, TestConfig, submit  # noqa: E402

OJ_TESTS = [{"input": {"stdin": "3\n1 2 3\n"}, "output": {"stdout": "6\n"}},
            {"input": {"stdin": "2\n5 5\n"}, "output": {"stdout": "10\n"}},
            {"input": {"stdin": "1\n7\n"}, "output": {"stdout": "7\n"}}]
SUM = "n = int(input())\nprint(sum(map(int, input().split())))\n"


def oj(server: Server, completion: str, tests=OJ_TESTS, **config):
    config = {"language": "python", "provided_data": {"test": tests}, **config}
    return submit(SubmitRequest(dataset="code_contests", id=7, completion=completion, config=TestConfig(**config)),
                  endpoint=server.url, max_attempts=1, client_timeout=120)


def test_submit_a_stdio_problem_with_the_official_client(open_server):
    result = oj(open_server, f"Here it is:\n```python\n{SUM}```\nDone.")
    assert result.accepted and result.extracted_code == SUM.rstrip("\n") and len(result.tests) == 3
    assert all(t.passed and t.exec_info.status == RunStatus.Success for t in result.tests)
    assert result.tests[0].test_info == OJ_TESTS[0]
    # SandboxFusion's comparison: lines stripped, case-insensitive, numbers within relative 1e-5
    loose = [{"input": {"stdin": ""}, "output": {"stdout": "YES\n0.3333333\n"}}]
    assert oj(open_server, "```python\nprint('yes  ')\nprint(1/3)\n```", loose).accepted
    assert not oj(open_server, "```python\nprint('yes')\nprint(0.3334)\n```", loose).accepted


def test_submit_stops_at_the_first_failed_case_unless_asked_for_all(open_server):
    wrong = "```python\nn = int(input())\nprint(n * 3)\n```"  # wrong in every case
    result = oj(open_server, wrong)
    assert not result.accepted and [t.passed for t in result.tests] == [False]
    result = oj(open_server, wrong, extra={"run_all_cases": True})
    assert [t.passed for t in result.tests] == [False, False, False]
    assert result.tests[0].exec_info.status == RunStatus.Failed
    slow = oj(open_server, "```python\nimport time\ntime.sleep(30)\n```", OJ_TESTS[:1], run_timeout=1)
    assert not slow.accepted and slow.tests[0].exec_info.run_result.status == CommandRunStatus.TimeLimitExceeded


MBPP_ROW = {"id": 2, "content": "Write a function to find the shared elements from the given two lists.",
            "labels": {"test_setup_code": "import math"},
            "test_list": ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
                          "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
                          "assert math.pi > 3"]}


def mbpp(server: Server, completion: str):
    return submit(SubmitRequest(dataset="mbpp", id=2, completion=completion,
                                config=TestConfig(provided_data=MBPP_ROW)),
                  endpoint=server.url, max_attempts=1, client_timeout=120)


def test_submit_an_mbpp_answer_cut_as_sandboxfusion_cuts_it(open_server):
    answer = ("[BEGIN]\n```python\ndef similar_elements(a, b):\n    return tuple(set(a) & set(b))\n```\n"
              "assert similar_elements((1,), (2,)) == ()\n[DONE]\nAnd more prose.")
    result = mbpp(open_server, answer)
    assert result.accepted, result
    assert result.full_code.startswith("import math\ndef similar_elements") and "assert" not in result.full_code
    assert [t.passed for t in result.tests] == [True, True, True]
    assert not mbpp(open_server, "```python\ndef similar_elements(a, b):\n    return ()\n```").accepted


def test_submit_verdicts_cannot_be_forged_where_sandboxfusion_s_exit_status_can(open_server):
    """SandboxFusion runs answer + asserts as one program and takes its exit status: exiting 0 first passes
    there. Here the asserts run in the evaluator."""
    for cheat in ("import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n",
                  # after the failed assert's traceback, the exit status becomes 0
                  "import atexit, os\natexit.register(os._exit, 0)\ndef similar_elements(a, b):\n    return 0\n"):
        result = mbpp(open_server, f"```python\n{cheat}```")
        assert not result.accepted and [t.passed for t in result.tests][:2] == [False, False], cheat


@pytest.mark.parametrize("body, says", [
    ({"dataset": "humaneval_python", "id": 1, "completion": "", "config": {}}, "no eval class found for dataset"),
    ({"dataset": "x", "id": 1, "completion": "", "config": {"dataset_type": "AiderBenchmarkDataset"}},
     "eval class AiderBenchmarkDataset not served here"),
    ({"dataset": "mbpp", "id": 1, "completion": "", "config": {}}, "holds no dataset tables"),
    ({"dataset": "mbpp", "id": 1, "completion": "", "config": {"provided_data": MBPP_ROW,
                                                                "custom_extract_logic": "import os"}},
     "custom_extract_logic is not run here"),
    ({"dataset": "code_contests", "id": 1, "completion": "", "config": {"provided_data": {"test": OJ_TESTS}}},
     "config.language field must exist"),
    ({"dataset": "code_contests", "id": 1, "completion": "", "config": {"language": "python",
                                                                         "provided_data": {"test": "[1]"}}},
     "provided_data.test must be a non-empty list"),
    ({"dataset": "mbpp", "id": True, "completion": "", "config": {}}, "id must be"),
])
def test_a_submit_the_server_cannot_evaluate_is_400_with_the_reason(open_server, body, says):
    r = requests.post(f"{open_server.url}/submit", json=body, timeout=30)
    assert r.status_code == 400 and says in r.json()["detail"], r.text


# --- compiled and other languages: index/sandbox.yaml's environment --------------------------------------

@pytest.fixture(scope="module")
def languages_server(registries, debian_base, tmp_path_factory):
    """index/sandbox.yaml built for real (g++, nodejs, bash from Debian's packages) and served."""
    store = built_once("languages", ROOT / "index/sandbox.yaml", {"debian": debian_base}, registries)
    server = start(store, tmp_path_factory.mktemp("languages"), "--no-token")
    yield server
    server.stop()


SUM_CPP = "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }\n"


def test_cpp_compiles_then_runs_as_sandboxfusion_reports_it(languages_server):
    health = requests.get(f"{languages_server.url}/health", timeout=10).json()
    assert health["languages"] == ["bash", "cpp", "nodejs", "python"]
    r = call(languages_server, code=SUM_CPP, language="cpp", stdin="1 2\n")
    assert r.status == RunStatus.Success, r
    assert r.compile_result.status == CommandRunStatus.Finished and r.compile_result.return_code == 0
    assert r.run_result.stdout == "3\n" and r.run_result.return_code == 0


def test_cpp_compile_errors_and_timeouts(languages_server):
    r = requests.post(f"{languages_server.url}/run_code", timeout=60,
                      json={"code": "int main() { return missing; }", "language": "cpp"}).json()
    assert r["status"] == "Failed" and r["run_result"] is None, r
    assert r["compile_result"]["return_code"] != 0 and "missing" in r["compile_result"]["stderr"]
    r = call(languages_server, code="int main() { for (;;) {} }", language="cpp", run_timeout=1)
    assert r.status == RunStatus.Failed and r.compile_result.return_code == 0
    assert r.run_result.status == CommandRunStatus.TimeLimitExceeded
    r = call(languages_server, code="int main() { return 3; }", language="cpp")
    assert r.status == RunStatus.Failed and r.run_result.return_code == 3


def test_nodejs_and_bash(languages_server):
    js = ("const s = require('fs').readFileSync(0, 'utf8');\n"
          "console.log(s.split(' ').map(Number).reduce((a, b) => a + b));\n")
    r = call(languages_server, code=js, language="nodejs", stdin="1 2")
    assert r.status == RunStatus.Success and r.run_result.stdout == "3\n", r
    r = call(languages_server, code="read a b; echo $((a + b))", language="bash", stdin="1 2\n")
    assert r.status == RunStatus.Success and r.run_result.stdout == "3\n", r


def test_submit_a_cpp_stdio_problem(languages_server):
    """CommonOJDataset in C++: each case compiled and run through /run_code's runs, judged by SandboxFusion's
    rule; a wrong answer stops at its first failed case."""
    tests = [{"input": {"stdin": "1 2\n"}, "output": {"stdout": "3\n"}},
             {"input": {"stdin": "40 2\n"}, "output": {"stdout": "42\n"}}]
    result = oj(languages_server, f"```cpp\n{SUM_CPP}```", tests, language="cpp")
    assert result.accepted and [t.passed for t in result.tests] == [True, True], result
    assert result.tests[0].exec_info.compile_result.return_code == 0
    wrong = SUM_CPP.replace("a + b", "a - b")
    result = oj(languages_server, f"```c++\n{wrong}```", tests, language="cpp")
    assert not result.accepted and [t.passed for t in result.tests] == [False]
    r = requests.post(f"{languages_server.url}/submit", timeout=60, json={
        "dataset": "code_contests", "id": 1, "completion": "x",
        "config": {"language": "cobol", "provided_data": {"test": tests}}})
    assert r.status_code == 400 and "language 'cobol' is not served here" in r.json()["detail"], r.text


def test_connections_are_accepted_without_nagle():
    """Keep-alive clients (verl's requests sessions) otherwise wait out a delayed ACK on every answer,
    whose headers and body are two writes: 52 ms a print(1) instead of 9 in bench/serve.py."""
    import socket

    from image_builder.serve import listen
    server = listen("127.0.0.1", 0)
    with server, socket.create_connection(server.getsockname()):
        accepted, _ = server.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
