"""`run` and `sandbox exec` served warm: a fresh `image-builder run` process hands its argv,
environment, working directory and stdin/stdout/stderr to this user's CLI server, a
process that has already imported the run path, and waits for the exit status.

Why: the run path's imports (our typed records, pathlib, sqlite3, the runtime) cost a
fresh process about 50 ms, more than the run itself (see bench/runtime.py's CLI row); the
thin client below imports `os`, `_socket` and `marshal` only.

- The server forks a worker per command. The worker takes the client's descriptors as its
  0, 1 and 2, its environment, directory and umask, and runs the command as the fast path
  does (cli_run), so the output goes straight from the run to the client's descriptors
  and the exit status is the same (124 on a timeout, 141 on a closed pipe...).
- Either end checks the other is this user (SO_PEERCRED), as with the holder; the server
  also serves only a client in its own mount namespace and root (the paths must mean the same).
  The socket name carries the state dir's token: a client finds only the server of its
  own state dir.
- Anything the server cannot take (no server yet, a name held by someone else, argv the
  fast path leaves to click) is done by the client itself, as before this existed; the
  first such run starts a server, which leaves after IDLE seconds without a command.
- Ctrl-C at the client is sent on: the worker stops as a local run does (`Aborted!`,
  status 1). A client that dies or is killed closes the connection, and the worker dies
  with it: its holder connection closes and the holder stops the run.
"""

from __future__ import annotations

import os
import sys

IDLE = 60.0  # seconds the server waits for a command before leaving: `run`'s own linger
_PROTOCOL = 1


def _name(token: str) -> str:
    """The server's abstract socket name: per user, state dir (its token), interpreter and code."""
    import zlib

    key = f"{sys.executable}:{sys.version}:{_PROTOCOL}:{os.path.dirname(os.path.abspath(__file__))}"
    return f"image-builder-cli-{os.getuid()}-{token}-{zlib.crc32(key.encode()):08x}"


# --- the thin client ----------------------------------------------------------------------------------


def served(argv: list[str]) -> int | None:
    """Run argv (`run ...` or `sandbox exec ...`) on this user's CLI server: its exit
    status, or None when the caller must run it itself (the server is started for next time)."""
    from image_builder.runtime.statedir import default_state_dir, peer, private_dir, read_token
    try:
        state = private_dir(default_state_dir())
        token = read_token(state)
    except Exception:  # noqa: BLE001 - the caller's own path says what is wrong, in one line
        return None
    if token is None:  # no holder has run yet: nor has a server
        _start_server(state)
        return None
    import _socket
    import marshal

    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    try:
        conn.connect(b"\0" + _name(token).encode())
        if peer(conn)[1] != os.getuid():
            raise PermissionError("another user's socket")
        for fd in (0, 1, 2):
            os.fstat(fd)  # all three open, else the caller's own path deals with it
        umask = os.umask(0o022)
        os.umask(umask)
        request = marshal.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask})
        fds = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in (0, 1, 2))
        conn.sendmsg([request], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
        taken = conn.recv(64)
    except OSError as e:
        conn.close()
        if isinstance(e, ConnectionRefusedError):  # nothing listens: none runs
            _start_server(state)
        return None
    except KeyboardInterrupt:  # Ctrl-C before the worker took the command: it sees us go and stops
        conn.close()
        print("\nAborted!", file=sys.stderr, flush=True)
        return 1
    if not taken or marshal.loads(taken).get("fallback"):
        conn.close()
        return None
    return _wait(conn)


def _wait(conn) -> int:
    """The worker's exit status; Ctrl-C (and SIGTERM, SIGHUP) sent on meanwhile."""
    import _signal
    import marshal

    def forward(signum, frame):
        try:
            conn.send(marshal.dumps({"signal": signum}))
        except OSError:
            pass
        if signum != _signal.SIGINT:  # as a local run would: end by that signal
            _signal.signal(signum, _signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for signum in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP):
        _signal.signal(signum, forward)
    reply = conn.recv(64)
    if not reply:
        print("image-builder: the CLI server's worker ended without a status; see holder.log in the state dir",
              file=sys.stderr, flush=True)
        return 1
    return marshal.loads(reply)["status"]


def _start_server(state: str) -> None:
    """A detached server for `state` (it leaves at once if one runs already); no wait."""
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:  # a grandchild, in a session of its own, with nothing of the terminal's
        os.setsid()
        if os.fork():
            os._exit(0)
        from image_builder.runtime.statedir import open_log
        null = os.open(os.devnull, os.O_RDWR)
        log = open_log(state)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(log, 2)
        os.chdir("/")  # it holds no directory of the first client's
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        boot = f"import sys; sys.path[:0] = [{root!r}]; from image_builder.cli_server import serve; serve(sys.argv[1])"
        os.execv(sys.executable, [sys.executable, "-c", boot, state])
    finally:
        os._exit(127)


# --- the server -------------------------------------------------------------------------------------


def serve(state: str) -> None:
    """Serve this user's `run` and `sandbox exec` commands until IDLE seconds pass without one."""
    import select
    import signal
    import socket
    import time

    # What the run path imports, once: every worker starts with it loaded (13 ms of a run's 29 ms
    # in a worker was the modules the run path imports on first use).
    import image_builder.pack.sif  # noqa: F401
    import image_builder.runtime.backends  # noqa: F401
    import image_builder.runtime.checked  # noqa: F401
    import image_builder.runtime.sandbox  # noqa: F401
    import image_builder.store.store  # noqa: F401
    from image_builder import cli_run  # noqa: F401
    from image_builder.runtime.holder_session import new_token
    from image_builder.runtime.statedir import peer, private_dir, read_token

    code = _code_files()
    state = private_dir(state)
    token = read_token(state) or new_token(state, None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(b"\0" + _name(token).encode())
    except OSError:
        return  # one runs already (or the name is someone else's: clients then run their commands themselves)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes poll when a worker ends
    own_ns = os.readlink("/proc/self/ns/mnt")
    workers: set[int] = set()
    last = time.monotonic()
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    while True:
        while workers:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                workers.clear()
                break
            if not pid:
                break
            workers.discard(pid)
        if workers:
            last = time.monotonic()
        elif time.monotonic() - last > IDLE:
            return
        if not poller.poll(1000):
            continue
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        last = time.monotonic()
        if _code_files(list(code)) != code:  # an upgrade, an edit of the checkout: never serve the old code
            listener.close()  # the name free for a server of the new code, started here for the next client
            conn.close()  # unanswered: this client runs its command itself
            _start_server(state)
            return
        with conn:
            pid, uid, _gid = peer(conn)
            try:  # its paths mean ours: the same mount namespace and root (not a chroot)
                same_ns = os.readlink(f"/proc/{pid}/ns/mnt") == own_ns and os.readlink(f"/proc/{pid}/root") == "/"
            except OSError:
                same_ns = False
            if uid != os.getuid() or not same_ns:
                continue  # closed unanswered: a client of ours runs the command itself
            child = os.fork()
            if child == 0:
                try:
                    listener.close()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    _work(conn)
                finally:
                    os._exit(1)
            workers.add(child)


def _code_files(paths: list[str] | None = None) -> dict[str, tuple[int, int]]:
    """`paths` (default: the files of our modules this process has imported), as they are on disk now
    (60 us a command)."""
    if paths is None:
        paths = [getattr(module, "__file__", None) for name, module in list(sys.modules.items())
                 if name.split(".")[0] == "image_builder"]
    found = {}
    for path in filter(None, paths):
        try:
            st = os.stat(path)
            found[path] = (st.st_mtime_ns, st.st_size)
        except OSError:
            found[path] = (0, -1)
    return found


def _work(conn) -> None:
    """A worker: the client's command, run here as the fast path runs it; its status sent back."""
    import marshal
    import socket
    import threading

    from image_builder import cli_run

    msg, ancillary, _flags, _addr = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * 4))
    fds = [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True)
           for level, kind, data in ancillary if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
           for i in range(0, len(data) - 3, 4)]
    if len(fds) != 3:
        os._exit(1)  # not a client of ours: it gets no answer
    request = marshal.loads(msg)
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    try:
        os.chdir(request["cwd"])  # first: parse reads relative paths (--store) as the client would
    except OSError:
        conn.send(marshal.dumps({"fallback": True}))
        os._exit(0)
    command = cli_run.fast_command(argv)
    if command is None:  # click's to answer (--help, a usage error): the client's own path
        conn.send(marshal.dumps({"fallback": True}))
        os._exit(0)
    os.umask(request["umask"])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    conn.send(marshal.dumps({"taken": True}))

    def watch() -> None:  # the client's Ctrl-C, or its end
        import signal

        while True:
            try:
                data = conn.recv(64)
            except OSError:
                data = b""
            if not data:
                os.kill(os.getpid(), signal.SIGKILL)  # the client is gone: so is its run (the holder sees us go)
            if marshal.loads(data).get("signal") == signal.SIGINT:  # to the main thread: it wakes from its poll
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()
    try:
        cli_run.as_click_would(command)
        sys.argv = ["image-builder", *argv]  # it returned: a usage error (no command), click's to say
        from image_builder.cli import main
        main()
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
        import traceback

        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(marshal.dumps({"status": status}))
    os._exit(0)
