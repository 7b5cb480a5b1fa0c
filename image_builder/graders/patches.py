"""Which files a unified diff touches, and which paths a candidate patch may not touch.

Headers are read only outside hunks (hunk lengths are counted), because a
removed line starting with "-- " looks exactly like a `--- ` header. A line
that cannot be hunk content ends a hunk whose counts were wrong.
Paths are taken as `git apply` and `patch -p1` take them: first component dropped.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


@dataclass
class FileChange:
    old: str | None  # None for a new file
    new: str | None  # None for a deleted file


def file_changes(diff: str) -> list[FileChange]:
    changes: list[FileChange] = []
    current: FileChange | None = None
    awaiting_headers = False  # after `diff --git`, the ---/+++ lines belong to the same file
    old_left = new_left = 0
    for line in diff.splitlines():
        if (old_left > 0 or new_left > 0) and line[:1] in ("", " ", "-", "+", "\\"):
            if line.startswith("-"):
                old_left -= 1
            elif line.startswith("+"):
                new_left -= 1
            elif not line.startswith("\\"):  # "\ No newline at end of file" counts for neither side
                old_left, new_left = old_left - 1, new_left - 1
            continue
        if hunk := _HUNK.match(line):
            old_left, new_left = int(hunk.group(1) or 1), int(hunk.group(2) or 1)
            awaiting_headers = False
        elif line.startswith("diff --git "):
            path = _git_header_path(line[len("diff --git "):])
            current = FileChange(path, path)
            changes.append(current)
            awaiting_headers = True
        elif line.startswith("--- "):
            if not awaiting_headers or current is None:
                current = FileChange(None, None)
                changes.append(current)
            awaiting_headers = False
            current.old = _header_path(line[4:])
        elif current is None:
            continue
        elif line.startswith("+++ "):
            current.new = _header_path(line[4:])
        elif line.startswith(("rename from ", "copy from ")):
            current.old = line.split(" ", 2)[2]
        elif line.startswith(("rename to ", "copy to ")):
            current.new = line.split(" ", 2)[2]
        elif line.startswith("new file mode"):
            current.old = None
        elif line.startswith("deleted file mode"):
            current.new = None
    return changes


def touched_paths(diff: str) -> list[str]:
    """Every path the diff reads or writes, in order, once each."""
    paths = [p for change in file_changes(diff) for p in (change.old, change.new) if p is not None]
    return list(dict.fromkeys(paths))


def target_paths(diff: str) -> list[str]:
    """The files that exist after the diff is applied (SWE-bench's test directives)."""
    return list(dict.fromkeys(c.new for c in file_changes(diff) if c.new is not None))


def refused_path(paths: list[str]) -> str | None:
    """A path a candidate patch may not touch: outside the repo, or git's own metadata
    (a hook or a filter in .git would run the candidate's code during grading's git commands)."""
    for path in paths:
        parts = PurePosixPath(path).parts
        if path.startswith("/") or ".." in parts or ".git" in parts:
            return path
    return None


def _header_path(text: str) -> str | None:
    path = text.split("\t")[0].rstrip("\r")
    if path.startswith('"'):  # git C-quotes unusual names
        path = codecs.escape_decode(path.strip('"').encode())[0].decode("utf-8", "replace")
    if path == "/dev/null":
        return None
    return path.split("/", 1)[1] if "/" in path else path


def _git_header_path(rest: str) -> str | None:
    """`a/P b/P` -> P; None when the two sides differ (renames) or the split is ambiguous."""
    length = (len(rest) - 5) // 2
    path = rest[2:2 + length]
    return path if length > 0 and rest == f"a/{path} b/{path}" else None
