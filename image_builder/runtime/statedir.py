"""This user's state dir (the holder's log, its socket name's token, checked layers), found
and checked with `os` alone, and who is at the other end of a socket to this user's holder
or CLI server: the CLI's thin client (cli_server.py) needs them before importing anything
else. Paths are strings here for that reason (pathlib costs 5 ms)."""

from __future__ import annotations

import os
import stat
import sys

from image_builder.ownership import unsafe_ancestor

TOKEN = "holder.token"  # in the state dir (mode 700): the secret part of the holder's socket name
LOG = "holder.log"  # in the state dir: what the holder and the CLI server say


def _refuse(message: str):
    from .mounts import RunnerError  # the error path only: mounts imports ctypes

    raise RunnerError(message)


KEY = "state-dir.key"  # in $XDG_CONFIG_HOME/image_builder: the secret part of a fallback state dir's name
STATE_DIR_FIX = "set XDG_RUNTIME_DIR to a directory of yours (mode 700)"


def default_state_dir() -> str:
    """Per user, on local disk: $XDG_RUNTIME_DIR/image_builder, else /tmp/image_builder-UID; where another
    user took that name first (a directory of theirs, a symlink: anyone can make it, and so block every run
    of ours), /tmp/image_builder-UID-KEY, KEY a secret of ours (state_key): a name nobody else can know."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir and os.path.isdir(runtime_dir):
        return os.path.join(runtime_dir, "image_builder")
    path = f"/tmp/image_builder-{os.getuid()}"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        return path  # ours: private_dir checks the rest
    taken = "a symlink" if stat.S_ISLNK(st.st_mode) else f"owned by uid {st.st_uid}"
    return f"{path}-{state_key(f'{path} is {taken}')}"


def config_dir() -> str:
    """This user's configuration of image_builder: $XDG_CONFIG_HOME/image_builder, else ~/.config/image_builder
    (serve's token, the state dir key)."""
    return os.path.join(os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config"),
                        "image_builder")


def _hex32(text: str) -> bool:
    """Whether `text` is a secret as state_key and new_token make them: 32 lower-case hex digits."""
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def state_key(why: str) -> str:
    """This user's secret for a state dir name (32 hex digits), made once, readable by us alone; published
    whole (written under a temporary name, then linked into place), so concurrent first runs agree on it."""
    folder = config_dir()
    path = os.path.join(folder, KEY)
    try:
        os.makedirs(folder, 0o700, exist_ok=True)
        if not os.path.lexists(path):
            temp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}"
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, (os.urandom(16).hex() + "\n").encode())
                os.close(fd)
                os.link(temp, path)
            except FileExistsError:
                pass  # another first run's key is the one
            finally:
                os.unlink(temp)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            key = os.read(fd, 64).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
    except OSError as e:
        _refuse(f"{why}, and no private name can be kept in {path} ({e.strerror}): {STATE_DIR_FIX}")
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077 or not _hex32(key):
        _refuse(f"{why}, and {path} is not a private key of ours (32 hex digits, mode 600): remove it, or "
                f"{STATE_DIR_FIX}")
    return key


def private_dir(path: str | os.PathLike, what: str = "state dir", fix: str = STATE_DIR_FIX) -> str:
    """`path`, made mode 700 if missing; refused (RunnerError, naming it as `what`, saying `fix`) if it is a
    symlink, is another user's or writable by others: /tmp/image_builder-UID is a name anyone can
    take first, and a planted holder.log symlink would make us append wherever it points; an unpack dir
    someone else can write to could hold a tree of theirs under the name we would unpack to, used as
    the environment. Our own directory that only lets others read is narrowed to 700: no one else can
    have put anything in it. Refused too inside a directory another user could rename it
    out of (check_ancestors)."""
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    path = os.path.join(os.path.realpath(parent), name)  # the directories checked are the ones used
    check_ancestors(path, fix, what)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        why = "a symlink" if os.path.islink(path) else f"not usable ({e.strerror})"
        _refuse(f"{what} {path} is {why}: another user may control it; remove it, or {fix}")
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != os.geteuid():
            why, fix = f"owned by uid {st.st_uid}, not by us", f"{fix}, or have its owner remove it"
        elif mode & 0o022:
            why, fix = f"mode {mode:o}, writable by others", f"remove it (others may have put files in it), or {fix}"
        else:
            if mode != 0o700:
                os.fchmod(fd, 0o700)
            return path
    finally:
        os.close(fd)
    _refuse(f"{what} {path} is {why}: another user may control it; {fix}")


def check_ancestors(path: str | os.PathLike, fix: str, what: str = "state dir", itself: bool = False) -> None:
    """Refuse a state dir whose parents another user could rename it out of (ownership.unsafe_ancestor):
    XDG_RUNTIME_DIR is the user's to set, on HPC often a shared dir. `itself`: `path` too, writable by no
    one else even if sticky (a sandbox's layer dir)."""
    path = os.path.abspath(path)
    found = unsafe_ancestor(path, itself=itself)
    if found:
        d, why = found
        where, swapped = ("", "files in it") if d == path else (f"inside {d}, ", "it")
        _refuse(f"{what} {path} is {where}{why}: another user may swap {swapped}; {fix}")


def read_token(state_dir: str | os.PathLike) -> str | None:
    """The holder's token from `state_dir` (already checked private), or None if there is none yet."""
    path = os.path.join(state_dir, TOKEN)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        _refuse(f"cannot read {path}: {e.strerror}; remove it")
    with os.fdopen(fd) as f:
        token = f.read().strip()
    return token if _hex32(token) else None


def open_log(state_dir: str | os.PathLike) -> int:
    """holder.log, opened to append; never through a symlink planted in its place."""
    path = os.path.join(state_dir, LOG)
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        _refuse(f"cannot open {path}: {e.strerror}; remove it")


def peer(conn) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of the Unix socket `conn` (SO_PEERCRED)."""
    import _socket  # not socket: its enums cost the thin client 4 ms

    creds = conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
    return tuple(int.from_bytes(creds[i:i + 4], sys.byteorder, signed=True) for i in (0, 4, 8))
