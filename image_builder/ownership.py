"""Whether another user of the node could swap a directory of ours: checked with `os` alone, for the
runtime's state and unpack dirs (runtime/statedir.py), the blob cache (oci/cache.py), whose contents
are trusted by name, and serve's token file."""

from __future__ import annotations

import os
import stat


def unsafe_ancestor(path: str | os.PathLike, writable: int = 0o022, itself: bool = False) -> tuple[str, str] | None:
    """The outermost directory above `path` (and `path` itself if `itself`) another user could rename it
    out of, with why, or None: each one up to / must be root's or ours, and writable by others (the
    `writable` bits: group and others, or others alone where a group shares on purpose) only if sticky,
    as /tmp is; `path` itself not even then. As OpenSSH checks the paths of its keys: a directory
    checked private is otherwise swapped after the check."""
    path = os.path.abspath(path)
    chain, d = [], path
    while d != "/":
        d = os.path.dirname(d)
        chain.append(d)
    for d in reversed([path, *chain] if itself else chain):  # the outermost first: the one to fix
        st = os.lstat(d)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (0, os.geteuid()):
            return d, f"owned by uid {st.st_uid}"
        if mode & writable and (d == path or not mode & stat.S_ISVTX):
            return d, f"mode {mode:o}, writable by others" + ("" if d == path else " and not sticky")
    return None
