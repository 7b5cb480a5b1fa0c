"""Root filesystem trees as the pipeline takes them: bounded, and walked without recursion.

Python 3.11's os.walk recurses, and a tree 2,000 directories deep ended an import
with RecursionError; a tree deeper than MAX_DEPTH, or with a directory path too long
for PATH_MAX, is refused in one line (oci.layers refuses such a layer before it is
applied; pack.overlay, build and imports walk with `walk`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from image_builder.errors import ImageBuilderError

# The trees the pipeline takes (layers.py refuses a layer past these): what every real image
# stays within, and room for the recursive tools after us (shutil.rmtree, mksquashfs, ...).
MAX_DEPTH = 256  # levels (path components) of an entry below the tree's top
MAX_PATH = 3072  # bytes of an entry's path below the top: room under PATH_MAX for where the tree lies
_PATH_MAX, _NAME_MAX = 4096, 255  # Linux's


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
