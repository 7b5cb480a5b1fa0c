"""Which files a unified diff touches, and which paths a candidate patch may not touch.

Headers are read only outside hunks (hunk lengths are counted), because a
removed line starting with "-- " looks exactly like a `--- ` header. A line
that cannot be hunk content ends a hunk whose counts were wrong.
Paths are taken as `git apply` and `patch -p1` take them: first component dropped.

What cannot be read is refused (UnreadablePatch), never taken as touching
nothing: a hunk with no file header (GNU patch takes its file from an
`Index:` line), a binary patch whose `diff --git` names cannot be split. Both
once added a conftest.py that grading neither saw nor reverted.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


class UnreadablePatch(ValueError):
    """A patch whose files cannot all be named: refused."""


@dataclass
class FileChange:
    old: str | None  # None for a new file
    new: str | None  # None for a deleted file
    header: str | None = None  # the path a `diff --git` line names (None: none, or not splittable)


def file_changes(diff: str) -> list[FileChange]:
    """The files the diff changes; UnreadablePatch when a change's file cannot be told."""
    changes: list[FileChange] = []
    current: FileChange | None = None
    awaiting_headers = False  # after `diff --git`, the ---/+++ lines belong to the same file
    old_left = new_left = 0
    for number, line in enumerate(diff.splitlines(), 1):
        if (old_left > 0 or new_left > 0) and line[:1] in ("", " ", "-", "+", "\\"):
            if line.startswith("-"):
                old_left -= 1
            elif line.startswith("+"):
                new_left -= 1
            elif not line.startswith("\\"):  # "\ No newline at end of file" counts for neither side
                old_left, new_left = old_left - 1, new_left - 1
            continue
        if hunk := _HUNK.match(line):
            if current is None or not (current.old or current.new):
                raise UnreadablePatch(f"line {number}: a hunk with no ---/+++ header naming its file")
            old_left, new_left = int(hunk.group(1) or 1), int(hunk.group(2) or 1)
            awaiting_headers = False
        elif line.startswith("diff --git "):
            path = _git_header_path(line[len("diff --git "):])
            current = FileChange(path, path, path)
            changes.append(current)
            awaiting_headers = True
        elif line.startswith(("GIT binary patch", "Binary files ")) and (current is None or current.header is None):
            raise UnreadablePatch(f"line {number}: a binary change whose `diff --git` line names no one file")
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
    """Every path the diff reads or writes, in order, once each; UnreadablePatch as file_changes."""
    paths = [p for change in file_changes(diff) for p in (change.header, change.old, change.new) if p is not None]
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
    path = _unquote(text.split("\t")[0].rstrip("\r"))  # git C-quotes unusual names
    if path == "/dev/null":
        return None
    return path.split("/", 1)[1] if "/" in path else path


def _git_header_path(rest: str) -> str | None:
    """`a/P b/P` -> P, either side C-quoted as git quotes unusual names (`"a/P" "b/P"`); None when the two
    sides differ (renames) or the split is ambiguous."""
    if '"' in rest:
        sides = re.fullmatch(r'("(?:[^"\\]|\\.)*"|\S+) ("(?:[^"\\]|\\.)*"|\S+)', rest.rstrip("\r"))
        if not sides:
            return None
        old, new = (_unquote(side) for side in sides.groups())
        return old[2:] if old.startswith("a/") and new == "b/" + old[2:] and len(old) > 2 else None
    length = (len(rest) - 5) // 2
    path = rest[2:2 + length]
    return path if length > 0 and rest == f"a/{path} b/{path}" else None


def _unquote(text: str) -> str:
    if text.startswith('"'):
        return codecs.escape_decode(text[1:-1].encode())[0].decode("utf-8", "replace")
    return text
