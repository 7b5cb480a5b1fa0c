"""Serving benchmark: `image-builder serve` against SandboxFusion's own server, side by side, over HTTP.

Both speak SandboxFusion's `POST /run_code`; the same load goes to each in the same run: `print(1)` and an
MBPP program (the reference solution of task 512 and its 3 asserts, from index/data), language python,
from 1 client (100 requests) and from 8 concurrent clients (threads with keep-alive sessions, 200 requests),
after warm-up requests, in ROUNDS rounds whose order alternates so a shared machine's load falls on both.
Reported per row: requests per second (the median over the rounds), p50 and p99 latency (over all rounds'
requests), and errors: every answer is checked (status Success, exit 0, stdout "1\\n" for print(1)); a
row with errors says so.

Ours: `image-builder serve` over a store of index/sandbox.yaml (built once, on a debootstrapped Debian base
made with `image-builder base debian`, kept in the bench cache), with its defaults (4 runs at once, 16
queued) and a bearer token. Each run gets a fresh root over read-only layers, no network, and its process
tree killed at the timeout. SandboxFusion: its FastAPI app under uvicorn as its Makefile's `run` starts it,
config `local` (`sandbox.isolation: none`: the code runs as a plain subprocess of the server, with the
server's user, filesystem and network), in a venv of its locked dependencies in the bench cache. Two
isolation probes show the difference: a file written to /tmp by one request and looked for by the next,
and a TCP connection from the code to the server's own port.

Goal: at least 3x SandboxFusion's requests per second at 8 clients, with that isolation.

    python -m bench.serve [ROUNDS]
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import requests

from bench.common import CACHE, ROOT, VENV_BIN, Report, Row, need
from image_builder.devtools.localregistry import free_port, stop_process

ROUNDS = 3
CLIENTS_REQUESTS = ((1, 100), (8, 200))  # (concurrent clients, requests per round)
WARMUP = 8
SF_REPO = "https://github.com/bytedance/SandboxFusion"
SF_COMMIT = "469de0845cb7d665bc68044d541aa3aa28c5b30a"  # its main branch when this benchmark was written
# Where this project's sessions keep fetched repositories; a clone from GitHub otherwise.
SF_MIRROR = Path(os.environ.get("SANDBOXFUSION_GIT", "/work/.mirror/bytedance+SandboxFusion/repo"))
SF_DIR = CACHE / "sandboxfusion"
STORE = CACHE / "serve-store"
MBPP_TASK = 512


# --- the programs ---------------------------------------------------------------------------------


def mbpp_program() -> str:
    """The reference solution of MBPP task MBPP_TASK and its 3 asserts, as one program."""
    import pyarrow.parquet as pq

    solution = next(json.loads(line)["solution"]
                    for line in (ROOT / "index/data/mbpp_train_40_solutions.jsonl").read_text().splitlines()
                    if json.loads(line)["task_id"] == MBPP_TASK)
    row = next(r for r in pq.read_table(ROOT / "index/data/mbpp_train_40.parquet").to_pylist()
               if r["extra_info"]["task_id"] == MBPP_TASK)
    asserts = json.loads(row["reward_model"]["ground_truth"])["assert_case"]
    assert len(asserts) == 3, asserts
    return solution + "\n\n" + "\n".join(asserts) + "\n"


def check_print(answer: dict) -> bool:
    run = answer.get("run_result") or {}
    return answer.get("status") == "Success" and run.get("return_code") == 0 and run.get("stdout") == "1\n"


def check_asserts(answer: dict) -> bool:
    run = answer.get("run_result") or {}
    return answer.get("status") == "Success" and run.get("return_code") == 0


# --- our server -----------------------------------------------------------------------------------


def our_store() -> Path:
    """index/sandbox.yaml built once into the bench cache, on a local Debian base (no Docker Hub here)."""
    if (STORE / "index.json").exists():
        return STORE
    need("debootstrap")
    cli = str(VENV_BIN / "image-builder")
    ref = subprocess.run([cli, "base", "debian", "bookworm", "-o", str(CACHE / "serve-bases"),
                          "--cache-dir", str(CACHE)], check=True, capture_output=True, text=True).stdout.split()[-1]
    subprocess.run([cli, "build", str(ROOT / "index/sandbox.yaml"), "--store", str(STORE), "--base",
                    f"debian={ref}", "--cache-dir", str(CACHE / "blobs")], check=True)
    return STORE


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    headers: dict = field(default_factory=dict)

    def stop(self) -> None:
        stop_process(self.proc, 30)


def wait_until(ready, proc: subprocess.Popen, log: Path, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if ready():
                return
        except (OSError, requests.RequestException):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer in {timeout:.0f} s: {log.read_text()[-2000:]}")


def start_ours(store: Path, work: Path) -> Server:
    url_file, token_file, log = work / "ours.url", work / "ours.token", work / "ours.log"
    proc = subprocess.Popen([str(VENV_BIN / "image-builder"), "serve", "--store", str(store), "--port", "0",
                             "--url-file", str(url_file), "--token-file", str(token_file)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_until(lambda: url_file.exists() and url_file.read_text().strip(), proc, log, "image-builder serve")
    url = url_file.read_text().strip()
    wait_until(lambda: requests.get(f"{url}/health", timeout=5).ok, proc, log, "image-builder serve")
    return Server("image-builder serve", url, proc,
                  {"Authorization": f"Bearer {token_file.read_text().strip()}"})


# --- SandboxFusion --------------------------------------------------------------------------------


def sf_source() -> Path:
    """Its source at SF_COMMIT, from the local mirror or a clone, unpacked once into the bench cache."""
    src = SF_DIR / "src"
    if (src / ".commit").exists() and (src / ".commit").read_text().strip() == SF_COMMIT:
        return src
    git_dir = SF_MIRROR
    if not (git_dir / "HEAD").exists():
        git_dir = SF_DIR / "git"
        if not (git_dir / "HEAD").exists():
            subprocess.run(["git", "clone", "--bare", SF_REPO, str(git_dir)], check=True)
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", SF_COMMIT], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(src)], input=archive, check=True)
    # server.py mounts docs/build, the doc site its Docker image builds with npm: without the directory the
    # app does not start. An empty one serves no pages; the API is unaffected.
    (src / "docs/build").mkdir(parents=True, exist_ok=True)
    (src / ".commit").write_text(SF_COMMIT + "\n")
    return src


def sf_requirements(src: Path) -> tuple[list[str], str]:
    """Its pyproject's main dependencies at the versions of its poetry.lock, and the whole lock as pip
    constraints (so the dependencies' own dependencies are the locked ones too)."""
    lock = tomllib.loads((src / "poetry.lock").read_text())["package"]
    versions = {p["name"].lower(): p["version"] for p in lock}
    deps = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["poetry"]["dependencies"]
    reqs = []
    for name, spec in deps.items():
        if name == "python":
            continue
        extras = spec.get("extras") if isinstance(spec, dict) else None
        reqs.append(f"{name}{'[' + ','.join(extras) + ']' if extras else ''}=={versions[name.lower()]}")
    return reqs, "".join(f"{p['name']}=={p['version']}\n" for p in lock)


def base_python() -> str:
    """A python >= 3.11 (its pyproject's `python = "^3.11"`) to make its venvs with."""
    base = getattr(sys, "_base_executable", sys.executable)
    if sys.version_info >= (3, 11):
        return base
    for name in ("python3.12", "python3.11"):
        if shutil.which(name):
            return shutil.which(name)
    raise RuntimeError("SandboxFusion needs python >= 3.11")


def sf_conda(src: Path) -> Path:
    """A conda-shaped root for its local mode, made once in the bench cache:

    - it finds the conda root by walking up from the server's own interpreter to a directory with
      `condabin` (sandbox/utils/common.py find_conda_root), so the server's venv is `envs/sandbox` in it;
    - python code runs with the PATH that `source ROOT/bin/activate sandbox-runtime && which python` gives
      (sandbox/runners/major.py), so `bin/activate ENV` puts `envs/ENV/bin` first, as conda's does;
    - `envs/sandbox-runtime` is a plain venv of the same python: its runtime/python/requirements.txt (numpy,
      torch and the like for its datasets) is not needed by these programs, and ours has no packages either.
    """
    root = SF_DIR / "conda"
    reqs, constraints = sf_requirements(src)
    stamp = hashlib.sha256(json.dumps([reqs, constraints, base_python()]).encode()).hexdigest()[:16]
    server_env, runtime_env = root / "envs/sandbox", root / "envs/sandbox-runtime"
    if (server_env / ".bench-installed").exists() and (server_env / ".bench-installed").read_text() == stamp:
        return root
    shutil.rmtree(root, ignore_errors=True)
    (root / "condabin").mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin/activate").write_text(f'export PATH="{root}/envs/$1/bin:$PATH"\n')
    subprocess.run([base_python(), "-m", "venv", "--without-pip", str(runtime_env)], check=True)
    subprocess.run([base_python(), "-m", "venv", str(server_env)], check=True)
    (SF_DIR / "constraints.txt").write_text(constraints)
    pip = subprocess.run([str(server_env / "bin/pip"), "install", "-q", "--disable-pip-version-check",
                          "-c", str(SF_DIR / "constraints.txt"), *reqs], capture_output=True, text=True)
    if pip.returncode:
        raise RuntimeError(f"installing SandboxFusion's dependencies failed: {(pip.stderr or pip.stdout)[-3000:]}")
    (server_env / ".bench-installed").write_text(stamp)
    return root


def start_sandboxfusion(work: Path) -> Server:
    src = sf_source()
    conda = sf_conda(src)
    port, log = free_port(), work / "sandboxfusion.log"
    home = work / "sf-home"
    home.mkdir()
    env = {**os.environ,
           "SANDBOX_CONFIG": "local",  # sandbox/configs/local.yaml: isolation none, as without Docker
           # An empty HOME: the code runs with the server's environment, so it must not pick up this machine's
           # user configuration (pip's, pyenv's, ~/.local site-packages) that a container would not have.
           "HOME": str(home)}
    proc = subprocess.Popen([str(conda / "envs/sandbox/bin/python"), "-m", "uvicorn", "sandbox.server.server:app",
                             "--host", "127.0.0.1", "--port", str(port)],
                            cwd=src, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(f"{url}/v1/ping", timeout=5).ok, proc, log, "SandboxFusion")
    return Server("SandboxFusion (isolation: none)", url, proc)


# --- the load -------------------------------------------------------------------------------------


@dataclass
class Result:
    rps: list[float] = field(default_factory=list)  # one per round
    latencies: list[float] = field(default_factory=list)  # seconds, every request of every round
    errors: int = 0
    requests: int = 0
    first_error: str = ""

    def quantile(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


def post(session: requests.Session, server: Server, code: str) -> dict:
    r = session.post(f"{server.url}/run_code", json={"code": code, "language": "python"}, headers=server.headers,
                     timeout=120)
    r.raise_for_status()
    return r.json()


def load(server: Server, code: str, check, clients: int, n: int, result: Result) -> None:
    """n requests from `clients` threads (after WARMUP of them, untimed, unchecked but for errors)."""
    local = threading.local()
    lock = threading.Lock()
    todo = iter(range(n))

    def session() -> requests.Session:
        if not hasattr(local, "s"):
            local.s = requests.Session()
        return local.s

    def warm() -> None:
        for _ in range(WARMUP // clients or 1):
            post(session(), server, code)

    def client() -> None:
        while True:
            with lock:
                if next(todo, None) is None:
                    return
            t0 = time.perf_counter()
            try:
                answer = post(session(), server, code)
                ok, why = check(answer), json.dumps(answer)[:300]
            except (requests.RequestException, ValueError) as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            elapsed = time.perf_counter() - t0
            with lock:
                result.latencies.append(elapsed)
                result.requests += 1
                if not ok:
                    result.errors += 1
                    result.first_error = result.first_error or why

    def in_threads(fn) -> float:
        threads = [threading.Thread(target=fn) for _ in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    in_threads(warm)
    result.rps.append(n / in_threads(client))


# --- isolation probes -----------------------------------------------------------------------------


def isolation(server: Server, port: int) -> str:
    """Whether a file one request writes to /tmp is there for the next, and whether the code reaches `port`."""
    s = requests.Session()
    name = f"/tmp/image_builder-bench-{secrets.token_hex(6)}"
    try:
        post(s, server, f"open({name!r}, 'w').write('x')")
        seen = post(s, server, f"import os; print(os.path.exists({name!r}))")
        reach = post(s, server, "import socket\ntry:\n    socket.create_connection(('127.0.0.1', "
                                f"{port}), timeout=5).close(); print('connected')\n"
                                "except OSError as e:\n    print('refused:', e)\n")
    finally:
        on_host = os.path.exists(name)
        if on_host:
            os.unlink(name)
    out = lambda a: ((a.get("run_result") or {}).get("stdout") or "").strip()  # noqa: E731
    return (f"{server.name}: a file written to /tmp by one run is {'' if out(seen) == 'True' else 'not '}seen by "
            f"the next, is {'' if on_host else 'not '}left on the host; a TCP connection from the code to the "
            f"server's own port: {out(reach)}")


# --- the report -----------------------------------------------------------------------------------


def main(rounds: int = ROUNDS) -> Report:
    programs = (("print(1)", "print(1)\n", check_print),
                (f"MBPP {MBPP_TASK} (function + 3 asserts)", mbpp_program(), check_asserts))
    store = our_store()
    report = Report("serve")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        work = Path(tmp)
        servers = []
        try:
            servers.append(start_ours(store, work))
            servers.append(start_sandboxfusion(work))
            ours, theirs = servers
            results = {}
            for r in range(rounds):
                for label, code, check in programs:
                    for clients, n in CLIENTS_REQUESTS:
                        for server in (servers if r % 2 == 0 else servers[::-1]):
                            res = results.setdefault((label, clients, server.name), Result())
                            load(server, code, check, clients, n, res)
            probes = [isolation(s, int(s.url.rsplit(":", 1)[1])) for s in servers]
        finally:
            for s in servers:
                s.stop()
        errors_seen = []
        for label, _, _ in programs:
            for clients, n in CLIENTS_REQUESTS:
                a, b = results[(label, clients, ours.name)], results[(label, clients, theirs.name)]
                what = f"{label}, {clients} client{'s' if clients > 1 else ''}"
                errs = ""
                if a.errors or b.errors:
                    errs = f" (ERRORS: ours {a.errors}/{a.requests}, SandboxFusion {b.errors}/{b.requests})"
                    errors_seen += [f"{what}, {s.name}: {x.errors} errors, first: {x.first_error}"
                                    for s, x in ((ours, a), (theirs, b)) if x.errors]
                goal = "at least 3x, isolated" if clients == 8 else "report"
                report.rows.append(Row(f"{what}: requests/s{errs}", statistics.median(a.rps), theirs.name,
                                       statistics.median(b.rps), goal, "req/s"))
                for q, name in ((0.5, "p50"), (0.99, "p99")):
                    report.rows.append(Row(f"{what}: {name} latency{errs}", 1000 * a.quantile(q), theirs.name,
                                           1000 * b.quantile(q), "report (lower is better)", "ms"))
    report.notes += [
        f"{rounds} rounds, order alternating; per row and round "
        f"{', '.join(f'{n} requests from {c} client(s)' for c, n in CLIENTS_REQUESTS)} "
        f"after {WARMUP} warm-up requests; "
        "requests/s is the median of the rounds, latencies over all requests; "
        "ratio is ours / SandboxFusion's (above 1 is better for requests/s, below 1 for latency).",
        f"ours: image-builder serve over {STORE.name} (index/sandbox.yaml), defaults: 4 runs at once, 16 queued, "
        "bearer token; every run a fresh root, no network.",
        f"SandboxFusion {SF_COMMIT[:10]}: uvicorn sandbox.server.server:app, config local (isolation: none), "
        "python runs in a plain venv (envs/sandbox-runtime).",
        f"load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after: the machine is shared, "
        "both servers saw the same load (interleaved rounds).",
        *probes,
        *errors_seen,
        "errors: none" if not errors_seen else f"errors in {len(errors_seen)} measurement(s), above",
    ]
    return report


if __name__ == "__main__":
    done = main(int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS)
    done.print()
    print(f"\nwritten: {done.save()}")
