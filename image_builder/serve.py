"""`image-builder serve`: SandboxFusion's HTTP API (`POST /run_code`, `POST /submit`, `GET /health`) over a store's
environment.

Trainers and tools written for SandboxFusion's client run code here unchanged. Every run is what
`image-builder run` gives: a fresh throwaway root over the environment's read-only layers, no network,
the process tree killed at the timeout, through one warm runtime session shared by the server's threads.

/run_code's verdict is the exit status, as SandboxFusion's is (code that calls `sys.exit(0)` "passes"); /submit's
are the graders' (submit.py), which the candidate cannot forge, as are `image_builder.rewards.compute_score`'s.

Guarding a shared node: a bearer token (another user on the node can reach a loopback port too), at most
`max_concurrency` runs at once with a short queue (past it, 503 with Retry-After, so clients back off
rather than pile up), and a body size limit (413).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import os
import secrets
import shlex
import socket
import struct
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from image_builder.errors import ImageBuilderError
from image_builder.ownership import unsafe_ancestor
from image_builder.runtime.execution import RunRequest, RunResult
from image_builder.runtime.session import InstanceLayers
from image_builder.runtime.statedir import config_dir
from image_builder.runtime.warm import WarmExecutor, WarmPools, run_warm
from image_builder.submit import MAX_SECONDS, BadSubmit, Submission, evaluate, parse_submit

DEFAULT_BODY_LIMIT = 16 << 20
# Bytes kept of stdout and of stderr each (fetched files ride on stderr: see _fetch_script).
DEFAULT_MAX_OUTPUT = 8 << 20
WORKDIR = "/sandbox"  # where the code and the request's files go, as SandboxFusion's temp dir
RETRY_AFTER = "1"  # seconds; runs are short, so a full queue drains soon
MAX_MEMORY_MB = 1 << 20  # the largest memory_limit_MB (1 TiB); past it a request is refused, not crashed on
BODY_TIMEOUT = 60.0  # seconds a request's body has to arrive once its head has


class ServeError(ImageBuilderError):
    pass


@dataclass(frozen=True)
class Language:
    """How a language's code runs: written to `file` in the workdir, compiled with `compile` (when given) into
    `binary`, run with `argv`; offered only when `probe` (a shell test) succeeds in the environment."""

    name: str
    file: str
    argv: tuple[str, ...]
    probe: str
    compile: tuple[str, ...] = ()
    binary: str = ""


# SandboxFusion's commands (sandbox/runners/major.py); index/sandbox.yaml builds an environment with them all.
# A compiled program comes back from its compiler's run as a fetched file (every run has a fresh root) and
# is the next run's file: written without modes, hence the chmod.
LANGUAGES = (
    Language("python", "main.py", ("python3", "main.py"), "command -v python3 >/dev/null"),
    Language("bash", "main.sh", ("/bin/bash", "main.sh"), "test -x /bin/bash"),
    Language("cpp", "main.cpp", ("/bin/sh", "-c", "chmod u+x test && exec ./test"), "command -v g++ >/dev/null",
             ("g++", "-std=c++17", "main.cpp", "-o", "test"), "test"),
    Language("nodejs", "main.js", ("node", "main.js"), "command -v node >/dev/null"),
)


# --- SandboxFusion's models (sandbox_fusion.models), as plain dataclasses --------------------------

@dataclass
class CommandRunResult:
    status: str  # Finished, TimeLimitExceeded, Error
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


@dataclass
class RunCodeResponse:
    status: str  # Success, Failed, SandboxError
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    files: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunCodeRequest:
    code: str
    language: str
    stdin: str | None = None
    compile_timeout: float = 10.0
    run_timeout: float = 10.0
    memory_limit_mb: int | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    fetch_files: tuple[str, ...] = ()


class BadRequest(ValueError):
    """The request cannot be read as /run_code's (400)."""


def _number(doc: dict, key: str, default: float) -> float:
    value = doc.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
        raise BadRequest(f"{key} must be seconds in (0, {MAX_SECONDS:.0f}], not {value!r}")
    return float(value)


def _path(name: object, what: str) -> str:
    if not isinstance(name, str) or not name or "\0" in name:
        raise BadRequest(f"{what}: a file path must be a non-empty string without NUL, not {name!r}")
    return name


def parse_request(doc: object) -> RunCodeRequest:
    """The request of a /run_code body (parsed JSON); BadRequest says what is wrong. The language is
    not checked here: an unknown one is SandboxFusion's SandboxError answer, not a malformed request."""
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object")
    code, language, stdin = doc.get("code"), doc.get("language"), doc.get("stdin")
    if not isinstance(code, str):
        raise BadRequest("code must be a string")
    if not isinstance(language, str):
        raise BadRequest("language must be a string")
    if stdin is not None and not isinstance(stdin, str):
        raise BadRequest("stdin must be a string or null")
    memory = doc.get("memory_limit_MB", -1)
    if memory is None:
        memory = -1
    if isinstance(memory, bool) or not isinstance(memory, int) or memory > MAX_MEMORY_MB:
        raise BadRequest(f"memory_limit_MB must be an integer up to {MAX_MEMORY_MB} (-1: no limit), not {memory!r}")
    files = doc.get("files") or {}
    if not isinstance(files, dict):
        raise BadRequest("files must be an object of path -> base64 content")
    decoded = {}
    for name, content in files.items():
        if content is None:  # the client's model allows null: SandboxFusion skips those
            continue
        if not isinstance(content, str):
            raise BadRequest(f"files[{name!r}] must be a base64 string")
        path = _path(name, "files")
        try:
            decoded[path] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"files[{name!r}] is not valid base64") from None
    fetch = doc.get("fetch_files") or []
    if not isinstance(fetch, list):
        raise BadRequest("fetch_files must be a list of paths")
    return RunCodeRequest(code, language, stdin, _number(doc, "compile_timeout", 10.0),
                          _number(doc, "run_timeout", 10.0), memory if memory > 0 else None, decoded,
                          tuple(_path(f, "fetch_files") for f in fetch))


# --- running a request ----------------------------------------------------------------------------

# Seconds the whole run gets past run_timeout when files are fetched: the wrapper's own timer stops the code
# at run_timeout, then reads the files (SandboxFusion fetches them after a timeout too).
FETCH_GRACE = 30.0


def _fetch_script(argv: tuple[str, ...], fetch: tuple[str, ...], nonce: str, timeout: float | None,
                  limit: int) -> str:
    """A shell wrapper that runs the code, then writes each fetched file after a marker line on
    stderr (the run's only other channel out: its root is gone when the run ends). The marker's nonce is
    read from a file the wrapper removes first, so the code's own stderr cannot end the section early by
    accident. With `timeout` (the environment has setsid), the code runs in a session of its own that a
    timer kills at the timeout, so the files are fetched after a timeout too. Files over `limit` bytes are
    named, not sent (stderr's own limit would cut them: a cut file was answered as if whole)."""
    # The script's own file goes too (sh keeps it open): the code sees only its files in the workdir.
    lines = ['G=$(mktemp -d) && mv .ib-serve/nonce "$G"/ && rm -r .ib-serve && read -r N < "$G/nonce" || exit 125']
    code = " ".join(map(shlex.quote, argv))
    if timeout is None:
        lines += [code, "rc=$?"]
    else:
        # A background list's stdin is /dev/null unless given: fd 3 hands the run's stdin on. setsid in a
        # process that leads no group execs in place, so $! is the code's process group (and the timer's).
        # The timer marks the timeout before it kills: the wrapper's `wait` returns at the kill, and a mark
        # written after it was missed under load (a killed run read as Finished, exit 137).
        lines += ["exec 3<&0", f"setsid {code} <&3 3<&- &", "p=$!",
                  f"setsid sh -c 'sleep \"$1\" && : > \"$3/tle\" && kill -KILL -\"$2\"' timer {timeout:.3f} "
                  '"$p" "$G" </dev/null >/dev/null 2>&1 &', "t=$!",
                  "wait $p", "rc=$?", "kill -KILL -$t 2>/dev/null"]
    lines += ["printf '\\n@@ %s files\\n' \"$N\" >&2", 'if [ -e "$G/tle" ]; then echo tle >&2; fi']
    # Each file as `INDEX SIZE BASE64`, or `INDEX SIZE` alone when over `limit` or unreadable (SIZE then says
    # which): the size lets _split_fetched tell a whole file from one the output limit cut or a read broke.
    for i, name in enumerate(fetch):
        q = shlex.quote(name)
        lines.append(f"if [ -f {q} ]; then s=$(wc -c < {q} 2>/dev/null) || s=unreadable; "
                     f"if [ \"$s\" -le {limit} ] 2>/dev/null; then printf '{i} %s ' $s >&2; "
                     f"base64 < {q} 2>/dev/null | tr -d '\\n' >&2; printf '\\n' >&2; "
                     f"else printf '{i} %s\\n' \"$s\" >&2; fi; fi")
    lines += ["echo end >&2", 'rm -rf "$G"; exit $rc']
    return "\n".join(lines) + "\n"


@dataclass
class Fetched:
    """What the wrapper wrote after the code's stderr."""

    files: dict[str, str]  # path as asked -> base64, each checked whole
    timed_out: bool  # its timer stopped the code
    not_sent: dict[str, str] = field(default_factory=dict)  # path -> why it is not in `files`


def _split_fetched(stderr: bytes, nonce: str, fetch: tuple[str, ...], limit: int) -> tuple[bytes, Fetched | None]:
    """The code's stderr and what the wrapper wrote after it; None when the marker never came (the run
    was stopped first, or the code's own stderr filled the output limit)."""
    marker = f"\n@@ {nonce} files\n".encode()
    cut = stderr.rfind(marker)
    if cut < 0:
        return stderr, None
    fetched = Fetched({}, False)
    for line in stderr[cut + len(marker):].decode("ascii", "replace").split("\n"):
        if line == "end":
            return stderr[:cut], fetched
        if line == "tle":
            fetched.timed_out = True
            continue
        index, size, content = (line.split(" ", 2) + ["", ""])[:3]
        if not index.isdigit() or int(index) >= len(fetch):
            continue
        name = fetch[int(index)]
        if not size.isdigit():
            fetched.not_sent[name] = "cannot be read"
        elif int(size) > limit:
            fetched.not_sent[name] = f"{size} bytes, over the {limit} a fetched file may have"
        elif _whole(content, int(size)):
            fetched.files[name] = content
        else:
            fetched.not_sent[name] = "cut by the output limit (or a failed read)"
    for name in fetch:  # no end line: the output limit cut the section, and every file it did not reach
        if name not in fetched.files:
            fetched.not_sent.setdefault(name, "cut by the output limit")
    return stderr[:cut], fetched


def _whole(content: str, size: int) -> bool:
    try:
        return len(base64.b64decode(content, validate=True)) == size
    except (binascii.Error, ValueError):
        return False


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def command_result(result: RunResult, fetched: Fetched | None, stderr: bytes) -> CommandRunResult:
    if result.timed_out or (fetched is not None and fetched.timed_out):
        status, code = "TimeLimitExceeded", None
    elif result.start_errno is not None:
        status, code = "Error", result.exit_code
    else:  # a signal's death as Python's subprocess reports it (SandboxFusion's runner): -N
        status, code = "Finished", result.exit_code if result.exit_code is not None else -(result.signal or 0)
    return CommandRunResult(status, round(result.wall_time, 6), code, _text(result.stdout), _text(stderr))


def answer(request: RunCodeRequest, language: Language, result: RunResult, fetched: Fetched | None,
           stderr: bytes, compiled: CommandRunResult | None = None) -> RunCodeResponse:
    """SandboxFusion's verdict on a run: Success iff it finished with exit status 0."""
    run = command_result(result, fetched, stderr)
    status, code = run.status, run.return_code
    notes = []
    if result.truncated:
        notes.append(f"output went over {DEFAULT_MAX_OUTPUT} bytes and was cut")
    if result.out_of_memory:
        notes.append(f"out of memory ({request.memory_limit_mb} MB)")
    if request.fetch_files and fetched is None:
        notes.append("files were not fetched: " + ("the code's stderr filled the output limit" if result.truncated
                                                   else "the run was stopped before they were read"))
    elif request.fetch_files:
        notes.extend(f"{name}: {fetched.not_sent.get(name, 'no such file')}" for name in request.fetch_files
                     if name not in fetched.files)
    if status == "Error":  # SandboxFusion's verdict on a command that could not run: the sandbox's fault
        return RunCodeResponse("SandboxError", f"cannot start {language.argv[0]} in the environment: "
                                               f"{os.strerror(result.start_errno)}", compiled, run)
    ok = status == "Finished" and code == 0
    return RunCodeResponse("Success" if ok else "Failed", "; ".join(notes), compiled, run,
                           fetched.files if fetched else {})


class Runner:
    """Runs /run_code requests in one environment's warm session (thread-safe: the graders share theirs);
    with `warm`, Python runs are clones of warm interpreters (runtime/warm.py: the same fresh root, without
    the interpreter's start), and so are /submit's graders' runs (`executor`)."""

    def __init__(self, session, languages: dict[str, Language], has_setsid: bool,
                 max_output: int = DEFAULT_MAX_OUTPUT, warm: WarmPools | None = None):
        self.session, self.languages, self.has_setsid, self.max_output = session, languages, has_setsid, max_output
        self.warm = warm
        self.executor = WarmExecutor(session, warm) if warm else session
        # A fetched file's bytes as base64 (4/3) in the stderr limit, with room for the code's own stderr.
        self.fetch_limit = max_output * 3 // 4 - (64 << 10)

    @classmethod
    def probe(cls, session, warm: WarmPools | None = None) -> Runner:
        """The languages the environment has, by one run of each's probe, and whether it has setsid
        (_fetch_script's timer)."""
        def has(test: str) -> bool:
            return session.run(RunRequest(("/bin/sh", "-c", test), timeout=30)).exit_code == 0

        return cls(session, {lang.name: lang for lang in LANGUAGES if has(lang.probe)},
                   has("command -v setsid >/dev/null"), warm=warm)

    def run(self, request: RunCodeRequest) -> RunCodeResponse:
        language = self.languages.get(request.language)
        if language is None:
            offered = ", ".join(sorted(self.languages)) or "none"
            return RunCodeResponse("SandboxError", f"language {request.language!r} is not served here "
                                                   f"(this environment offers: {offered})")
        files = {**request.files, language.file: request.code.encode()}
        compiled = None
        try:
            if language.compile:
                # SandboxFusion's order: compile (its own timeout), run only what compiled.
                result, stderr, fetched = self._execute(language.compile, files, b"", request.compile_timeout,
                                                        request.memory_limit_mb, (language.binary,))
                compiled = command_result(result, fetched, stderr)
                if compiled.status == "Error":
                    return RunCodeResponse("SandboxError", f"cannot start {language.compile[0]} in the environment: "
                                                           f"{os.strerror(result.start_errno)}", compiled)
                binary = fetched.files.get(language.binary) if fetched else None
                if compiled.status != "Finished" or compiled.return_code != 0:
                    return RunCodeResponse("Failed", "", compiled)
                if binary is None:
                    why = fetched.not_sent.get(language.binary, "no such file") if fetched else "not fetched"
                    return RunCodeResponse("Failed", f"the compiler's {language.binary}: {why}", compiled)
                files = {**request.files, language.binary: base64.b64decode(binary)}
            result, stderr, fetched = self._execute(language.argv, files, (request.stdin or "").encode(),
                                                    request.run_timeout, request.memory_limit_mb, request.fetch_files)
        except ImageBuilderError as exc:
            return RunCodeResponse("SandboxError", " ".join(str(exc).splitlines()), compiled)
        return answer(request, language, result, fetched, stderr, compiled)

    def _execute(self, argv: tuple[str, ...], files: dict[str, bytes], stdin: bytes, timeout: float,
                 memory_mb: int | None, fetch: tuple[str, ...]) -> tuple[RunResult, bytes, Fetched | None]:
        """One run in a fresh root; its stderr and the files fetched after it (None: not asked, or the run
        was stopped before they were read)."""
        nonce = None
        if fetch:
            nonce = secrets.token_hex(16)
            files = {**files, ".ib-serve/nonce": f"{nonce}\n".encode()}  # `read` fails on a last line without one
            timer = timeout if self.has_setsid else None
            files[".ib-serve/run.sh"] = _fetch_script(argv, fetch, nonce, timer, self.fetch_limit).encode()
            argv = ("/bin/sh", ".ib-serve/run.sh")
            timeout += FETCH_GRACE if timer else 0
        request = RunRequest(argv, stdin=stdin, files=files, timeout=timeout, memory_mb=memory_mb,
                             max_output=self.max_output, network=False)
        pool = self.warm.pool(argv[:1], None, {}, memory_mb, 2) if self.warm and argv[0] == "python3" else None
        result = run_warm(pool, self.session, request)
        if nonce is None:
            return result, result.stderr, None
        stderr, fetched = _split_fetched(result.stderr, nonce, fetch, self.fetch_limit)
        return result, stderr, fetched


# --- the token ------------------------------------------------------------------------------------

def default_token_file() -> Path:
    return Path(config_dir()) / "serve.token"


def load_or_create_token(path: Path) -> tuple[str, bool]:
    """The token in `path`, or a new one written there (0600); and whether it was made. A file that others
    can read is refused: the token is the only thing between another user of the node and the sandbox."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        token = secrets.token_urlsafe(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:  # another server made it meanwhile: use theirs
            return load_or_create_token(path)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token, True
    except OSError as exc:
        raise ServeError(f"{path}: cannot read the token file ({exc.strerror})") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_mode & 0o077:
            raise ServeError(f"{path}: other users can read this token file; chmod 600 it (or give another "
                             "--token-file)")
        # Another user's file (a root server reads it all the same), or one in a directory another user could
        # swap it in: its token may be theirs to know.
        found = (str(path), f"owned by uid {st.st_uid}") if st.st_uid != os.geteuid() else unsafe_ancestor(path)
        if found:
            raise ServeError(f"{path}: {found[0]} is {found[1]}: another user may know this token; give a "
                             "--token-file of yours in a directory of yours")
        token = f.read().strip()
    if not token or any(c.isspace() for c in token):
        raise ServeError(f"{path}: expected one token (no spaces) in the file")
    return token, False


def given_token(header: str) -> bytes:
    """The token an Authorization header carries: `Bearer TOKEN`, or Basic auth whose password is the token
    (SandboxFusion's client sends no header of its own, but `requests` sends an endpoint URL's
    `http://x:TOKEN@host:port` as Basic auth). b"" when there is none."""
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "bearer":
        return value.strip().encode("latin-1", "replace")
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return b""
    return b""


# --- the HTTP app ---------------------------------------------------------------------------------

@dataclass
class Limits:
    max_concurrency: int = 4
    queue: int = 16
    body_limit: int = DEFAULT_BODY_LIMIT


class _TooLarge(Exception):
    pass


def make_app(runner: Runner, token: str | None, limits: Limits = Limits(),
             log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)):
    """The Starlette app. `token` None: no authentication (loopback tests only: the CLI asks for --no-token)."""
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    pool = ThreadPoolExecutor(max_workers=limits.max_concurrency, thread_name_prefix="image-builder-serve")
    state = {"admitted": 0}  # running or waiting for a worker; only the event loop's thread touches it
    secret = token.encode() if token is not None else None

    def refused(code: int, detail: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"detail": detail}, status_code=code, headers=headers)

    def authorized(request) -> bool:
        return secret is None or hmac.compare_digest(given_token(request.headers.get("authorization", "")), secret)

    async def read_body(request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.body_limit:
            raise _TooLarge
        chunks, size = [], 0
        async for chunk in request.stream():  # a chunked body has no length to check first
            size += len(chunk)
            if size > limits.body_limit:
                raise _TooLarge
            chunks.append(chunk)
        return b"".join(chunks)

    async def served(request, parse: Callable, work: Callable, what: str):
        """Authorized, size-checked, parsed, admitted (or 503), then `work(parsed)` on a worker thread. The slot
        is held until the answer is sent: an answer carries up to twice the output limit, so a client that
        asks and never reads holds at most max_concurrency + queue of them in memory, not one per request."""
        if not authorized(request):
            return refused(401, "missing or wrong token (Authorization: Bearer TOKEN)", {"WWW-Authenticate": "Bearer"})
        try:
            body = await asyncio.wait_for(read_body(request), BODY_TIMEOUT)
        except _TooLarge:
            return refused(413, f"request body over {limits.body_limit} bytes")
        except asyncio.TimeoutError:
            return refused(408, f"the request body did not arrive within {BODY_TIMEOUT:.0f} s")
        except ClientDisconnect:
            return refused(400, "the client went away before its body arrived")
        try:
            parsed = parse(json.loads(body))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, BadRequest and BadSubmit are ValueErrors
            return refused(400, f"not a {what} request: {exc}")
        if state["admitted"] >= limits.max_concurrency + limits.queue:
            return refused(503, f"busy: {limits.max_concurrency} runs and {limits.queue} queued; retry",
                           {"Retry-After": RETRY_AFTER})
        state["admitted"] += 1
        try:
            answer = await asyncio.get_running_loop().run_in_executor(pool, work, parsed)
            response = answer if isinstance(answer, JSONResponse) else JSONResponse(answer)
        except BaseException:
            state["admitted"] -= 1
            raise
        return _SentThenReleased(response, lambda: state.__setitem__("admitted", state["admitted"] - 1))

    def run(parsed: RunCodeRequest) -> dict:
        try:
            return runner.run(parsed).to_json()
        except Exception as exc:  # a fault of ours (the runtime's expected ones are answered in Runner.run)
            log(f"run failed: {type(exc).__name__}: {' '.join(str(exc).splitlines())}")
            return RunCodeResponse("SandboxError", f"the sandbox failed: {type(exc).__name__}: {exc}").to_json()

    def run_for_submit(language: str, code: str, stdin: str, compile_timeout: float, run_timeout: float) -> dict:
        return runner.run(RunCodeRequest(code, language, stdin, compile_timeout, run_timeout)).to_json()

    def evaluated(parsed: Submission) -> dict | JSONResponse:
        try:
            return evaluate(parsed, runner.executor, run_for_submit).to_json()
        except BadSubmit as exc:  # the row is not its class's: SandboxFusion answers 400 too
            return refused(400, f"not a /submit request: {exc}")
        except Exception as exc:  # a fault of ours: graders answer every candidate with a record
            log(f"submit failed: {type(exc).__name__}: {' '.join(str(exc).splitlines())}")
            return refused(500, f"grading failed: {type(exc).__name__}: {exc}")

    async def run_code(request):
        return await served(request, parse_request, run, "/run_code")

    async def submit(request):
        return await served(request, parse_submit, evaluated, "/submit")

    async def health(request):
        return JSONResponse({"status": "ok", "languages": sorted(runner.languages),
                             "running_or_queued": state["admitted"],
                             "max_concurrency": limits.max_concurrency, "queue": limits.queue})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        pool.shutdown(wait=False, cancel_futures=True)  # queued runs are dropped at shutdown, not started

    app = Starlette(routes=[Route("/run_code", run_code, methods=["POST"]), Route("/submit", submit, methods=["POST"]),
                            Route("/health", health, methods=["GET"])], lifespan=lifespan)
    return _AccessLog(app, log)


class _SentThenReleased:
    """A response (ASGI app) that calls `release` once it is sent, or its client is gone."""

    def __init__(self, response, release: Callable[[], None]):
        self.response, self.release = response, release

    async def __call__(self, scope, receive, send):
        try:
            await self.response(scope, receive, send)
        finally:
            self.release()


class _AccessLog:
    """One line per request: client, method, path, status, bytes sent, seconds (ASGI middleware, so
    every answer is logged, the 401s and 413s too)."""

    def __init__(self, app, log: Callable[[str], None]):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, seen = time.monotonic(), {"status": 0, "bytes": 0}

        async def sending(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body":
                seen["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-", 0)
            self.log(f"{client[0]}:{client[1]} {scope['method']} {scope['path']} {seen['status']} "
                     f"{seen['bytes']}B {time.monotonic() - start:.3f}s")


# An accepted connection whose other end is a socket of this host: whose it is (netlink's sock_diag, one exact
# lookup by the connection's four addresses, about 20 us). uvicorn holds a connection that never sends a
# request forever, so another user of the node could take every descriptor with idle connections (red team:
# nobody held 4,300 and the server accepted no one, token or not); such a peer is let go at once instead.
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLMSG_ERROR = 4, 20, 1, 2
_NO_COOKIE = 0xFFFFFFFF
HEAD_TIMEOUT = 10.0  # seconds a connection has to send its first request's head (a slow client elsewhere)


def local_peer_uid(peer: tuple, local: tuple) -> int | None:
    """The uid owning the socket at the other end of an accepted TCP connection from `peer` to `local`
    (socket addresses as getpeername/getsockname give them), when that socket is on this host; else None."""
    if peer[0].startswith("::ffff:") and local[0].startswith("::ffff:"):
        # An IPv4 client of a dual-stack listener: its own socket is in IPv4's table, by IPv4 addresses.
        peer, local = (peer[0][7:], peer[1]), (local[0][7:], local[1])
    family = socket.AF_INET6 if ":" in peer[0] else socket.AF_INET
    packed = [socket.inet_pton(family, a[0]).ljust(16, b"\0") for a in (peer, local)]
    # inet_diag_req_v2 for the peer's own socket: its source is our peer, its destination us.
    sockid = struct.pack("!HH", peer[1], local[1]) + packed[0] + packed[1] + struct.pack("=III", 0, _NO_COOKIE,
                                                                                          _NO_COOKIE)
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.sendto(header + request, (0, 0))
            answer = nl.recv(8192)
    except OSError:
        return None
    if len(answer) < 16 + 72 or struct.unpack_from("=H", answer, 4)[0] == _NLMSG_ERROR:
        return None  # not a socket of this host (or no sock_diag here)
    return struct.unpack_from("=I", answer, 16 + 64)[0]  # inet_diag_msg's idiag_uid


def guarded_protocol():
    """uvicorn's HTTP/1.1 protocol, letting go at once of a connection from another user's socket on this host
    (root's and ours are served), and of one that sends no request head within HEAD_TIMEOUT."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    mine = {0, os.geteuid()}

    class Guarded(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
            if isinstance(peer, tuple) and isinstance(local, tuple) and local_peer_uid(peer, local) not in (
                    None, *mine):
                transport.abort()
                return
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT, self._no_head)

        def _no_head(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.abort()

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    return Guarded


WILDCARDS = ("0.0.0.0", "::", "")


def listen(host: str, port: int) -> socket.socket:
    """A listening socket for uvicorn (port 0: a free one), so that the URL is known before serving.

    Every address a client may try for the URL is ours: a client sends its token to whatever answers there,
    and any user of the node can listen on a port of an address family we left free (red team: with
    --host 0.0.0.0 another user took [::]:PORT, and clients of the node's name reached over IPv6 gave it
    their token). So all addresses listen dual-stack on [::] where the host has IPv6, and a name listens
    on the one address it resolves to first, which url_of then writes by number."""
    if host in WILDCARDS and _has_ipv6():
        # No falling back to 0.0.0.0 when [::]:PORT is taken: that is the half of the URL someone else holds.
        return _listen(socket.AF_INET6, ("::", port), dual_stack=True)
    family, address = socket.AF_INET, ("0.0.0.0", port)
    if host not in WILDCARDS:
        try:
            family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except socket.gaierror as exc:
            raise ServeError(f"cannot listen on {host}: {exc.strerror}; give an address (--host)") from None
    return _listen(family, address[:2], dual_stack=False)


def _has_ipv6() -> bool:
    """Whether this kernel makes IPv6 sockets (not with ipv6.disable=1: nobody can listen there either)."""
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return True


def _listen(family: int, address: tuple, dual_stack: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual_stack else 1)
    # Accepted connections inherit it: without it a keep-alive client waited out a delayed ACK on every
    # response (its headers and body are two writes): 52 ms a print(1) where the run took 8 (bench/serve.py).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {address[0]}:{address[1]} ({exc.strerror}); give another --port "
                         "(0: a free one)") from None
    sock.listen(128)
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    """How clients reach the socket: the host's name when it listens on every address (a cluster's nodes),
    else the address it listens on, by number (a name may resolve to another address first)."""
    address, port = sock.getsockname()[:2]
    name = socket.gethostname() if host in WILDCARDS else address
    return f"http://{f'[{name}]' if ':' in name else name}:{port}"


def environment_layers(store, name: str | None, workdir: str = WORKDIR) -> tuple[InstanceLayers, str]:
    """The layers of the store's environment `name` (default: its only one, else the first by name), with
    `workdir` as theirs (made in each run's fresh root), and the name (`shell --env` uses this too)."""
    environments = store.index.environments
    if not environments:
        raise ServeError(f"{store.root} has no environments; build one first")
    if name is None:
        name = sorted(environments)[0]
    env = environments.get(name)
    if env is None:
        raise ServeError(f"no environment {name!r} in {store.root} (it has: {', '.join(sorted(environments))})")
    files = tuple(store.root / f for f in env.files)
    return InstanceLayers(files[0], files[1:], env.env, workdir, env.digests), name
