"""Root filesystem trees as the pipeline takes them: bounded, and walked without recursion.

Python 3.11's os.walk recurses, and a tree 2,000 directories deep ended an import
with RecursionError; a tree deeper than MAX_DEPTH, or with a directory path too long
for PATH_MAX, is refused in one line (oci.layers refuses such a layer before it is
applied; pack.overlay, build and imports walk with `walk`). Removing is another matter:
what a build script, an agent or a candidate's code left can be of any depth and must
go all the same (`remove`; shutil.rmtree recurses too).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from image_builder.errors import ImageBuilderError

# The trees the pipeline takes (layers.py refuses a layer past these): what every real image
# stays within, and room for the recursive tools after us (shutil.rmtree, mksquashfs, ...).
MAX_DEPTH = 256  # levels (path components) of an entry below the tree's top
MAX_PATH = 3072  # bytes of an entry's path below the top: room under PATH_MAX for where the tree lies
_PATH_MAX, _NAME_MAX = 4096, 255  # Linux's
_RESTARTS = 100  # times `remove` starts again where another process pulled a directory from under it


class TreeError(ImageBuilderError):
    """A tree too deep, or with paths too long, to be walked."""


def shown_path(path: str, keep: int = 160) -> str:
    """A path for a one-line message: its ends, when it is long."""
    return path if len(path) <= keep else f"{path[:keep // 2]}...{path[-keep // 2:]}"


def walk(top: Path | str, topdown: bool = True) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk(top, topdown) without recursion: the same (dirpath, dirnames, filenames) in the
    same order, symlinks not followed, a directory that cannot be listed skipped (as os.walk
    does); topdown, a caller may prune dirnames. TreeError for an entry deeper than MAX_DEPTH
    below top, or a directory whose path leaves its entries no room under PATH_MAX."""
    top = os.fspath(top)
    stack: list = [(top, 0)]
    while stack:
        item = stack.pop()
        if len(item) == 3:  # bottom-up: a directory whose subdirectories were all walked
            yield item
            continue
        dirpath, depth = item
        if len(os.fsencode(dirpath)) > _PATH_MAX - _NAME_MAX - 2:
            _too_deep(top, dirpath, f"a directory at a path of {len(os.fsencode(dirpath))} bytes")
        dirs, files, into = [], [], []
        try:
            with os.scandir(dirpath) as entries:
                for entry in entries:
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        is_dir = False
                    (dirs if is_dir else files).append(entry.name)
                    if is_dir and not topdown and not entry.is_symlink():
                        into.append(entry.name)
        except OSError:
            continue
        if depth >= MAX_DEPTH and (dirs or files):
            _too_deep(top, dirpath, f"entries {depth + 1} levels deep")
        if topdown:
            yield dirpath, dirs, files
            into = [d for d in dirs if not os.path.islink(os.path.join(dirpath, d))]
        else:
            stack.append((dirpath, dirs, files))
        stack.extend((os.path.join(dirpath, d), depth + 1) for d in reversed(into))


def _too_deep(top: str, dirpath: str, what: str) -> None:
    raise TreeError(f"{shown_path(top)}: {shown_path(os.path.relpath(dirpath, top))}: {what}; image-builder takes "
                    f"trees at most {MAX_DEPTH} levels deep, with paths under {_PATH_MAX} bytes")


def remove(top: Path | str) -> None:
    """rm -rf `top`, of any depth, without recursion: a tree deeper than PATH_MAX allows a path for is
    taken through directory handles, one level open at a time. A directory its owner may not list or
    write (overlayfs leaves its work directory's `work/` at mode 000; extracted trees keep read-only
    modes) is given u+rwx first. Symlinks are removed, never followed. Back up at each level, the
    parent must be the directory the walk came down from, else OSError and nothing above it is
    touched (the tree was moved meanwhile). Entries another process removes meanwhile are no error
    (a killed build's sandbox still cleaning its staging while the next build removes it): where that
    pulls a directory from under the walk, it starts again from the top."""
    top = os.fspath(top)
    for _ in range(_RESTARTS):
        try:
            if not stat.S_ISDIR(os.lstat(top).st_mode):
                _unlink(top, None)
                return
        except FileNotFoundError:
            return
        try:
            _remove_dir(top)
            return
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTEMPTY):
                raise
    raise OSError(errno.EBUSY, f"{shown_path(top)}: still filled by another process as it was removed")


def _remove_dir(top: str) -> None:
    fd = _open_dir(top, None)
    if fd is None:
        return
    above: list[tuple[str, tuple[int, int], list[str]]] = []  # per level: its name, its parent's id and to-do
    here, todo = _identity(fd), _clear(fd)
    try:
        while True:
            if todo:
                name = todo.pop()
                child = _open_dir(name, fd)
                if child is not None:
                    above.append((name, here, todo))
                    os.close(fd)
                    fd, here, todo = child, _identity(child), _clear(child)
                continue
            todo = _clear(fd)  # what was made meanwhile
            if todo:
                continue
            if not above:
                os.rmdir(top)
                return
            name, parent_id, parent_todo = above.pop()
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = parent
            if _identity(parent) != parent_id:
                raise OSError(errno.EBUSY, f"{shown_path(top)}: the tree was moved while it was removed; "
                                           "left as it is")
            try:
                os.rmdir(name, dir_fd=parent)
            except FileNotFoundError:
                pass
            here, todo = parent_id, parent_todo
    finally:
        os.close(fd)


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _open_dir(name: str, dir_fd: int | None) -> int | None:
    """The directory `name` (in `dir_fd`), opened without following a symlink and made its owner's to list
    and empty; None when it is gone, or no longer a directory (then it is unlinked)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    for attempt in range(2):
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
            break
        except FileNotFoundError:
            return None
        except PermissionError:
            if attempt:
                raise
            os.chmod(name, stat.S_IMODE(os.lstat(name, dir_fd=dir_fd).st_mode) | stat.S_IRWXU, dir_fd=dir_fd)
        except OSError as e:
            if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            _unlink(name, dir_fd)  # no longer a directory: replaced meanwhile, by a symlink too
            return None
    mode = os.fstat(fd).st_mode
    if mode & stat.S_IRWXU != stat.S_IRWXU:
        try:
            os.fchmod(fd, stat.S_IMODE(mode) | stat.S_IRWXU)
        except PermissionError:
            pass  # not ours: root empties it all the same, another user does not
    return fd


def _clear(fd: int) -> list[str]:
    """Unlink every entry of the directory `fd` but its subdirectories: their names."""
    dirs = []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if is_dir:
                dirs.append(entry.name)
            else:
                _unlink(entry.name, fd)
    return dirs


def _unlink(name: str, dir_fd: int | None) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
