"""From an overlayfs upper directory to an Apptainer-compatible overlay tree.

`apptainer exec --overlay inst.sqfs:ro env.sif` stacks the squashfs as a plain
lower directory, so deletions must be overlayfs whiteouts (character devices
0:0). What an instance build leaves in its upper directory is normalised to
that form, whatever wrote it:

- kernel overlayfs already writes 0:0 whiteouts;
- fuse-overlayfs (rootless, no user namespace) may write `.wh.NAME` files;
- opaque directories (a directory removed and made again) are marked with a
  `trusted.`/`user.overlay.opaque` xattr or a `.wh..wh..opq` file. Which xattr
  a reader honours depends on how it mounts (privileged or not), so instead an
  opaque directory gets an explicit whiteout for every entry the layers below
  have there: the same result for every reader, and no xattr needed.

Other overlayfs bookkeeping xattrs are dropped. Unprivileged users may create
0:0 character devices (Linux 5.8+), so this works rootless too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")


@dataclass(frozen=True)
class DiffStats:
    entries: int
    whiteouts: int
    opaque_dirs: int


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _whiteout(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def _overlay_xattrs(path: str) -> list[str]:
    try:
        return [x for x in os.listxattr(path, follow_symlinks=False) if ".overlay." in x]
    except OSError:  # filesystem without xattrs, or a special file
        return []


def normalise_upper(upper: Path, lower_children: Callable[[str], list[str]]) -> DiffStats:
    """Rewrite `upper` in place into Apptainer overlay form.

    `lower_children(rel_dir)` lists the names the layers below hold in a
    directory; it is asked only for opaque directories.
    """
    entries = whiteouts = opaque = 0
    for dirpath, dirnames, filenames in os.walk(upper):
        rel_dir = os.path.relpath(dirpath, upper)
        rel_dir = "" if rel_dir == "." else rel_dir
        names = set(dirnames) | set(filenames)
        is_opaque = OPAQUE_MARKER in names
        for attr in _overlay_xattrs(dirpath):
            if attr in OPAQUE_XATTRS and os.getxattr(dirpath, attr, follow_symlinks=False) == b"y":
                is_opaque = True
            os.removexattr(dirpath, attr, follow_symlinks=False)
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name == OPAQUE_MARKER:
                os.unlink(path)
                continue
            if name.startswith(WHITEOUT_PREFIX):  # fuse-overlayfs' fallback whiteout
                os.unlink(path)
                target = Path(dirpath) / name[len(WHITEOUT_PREFIX):]
                if not os.path.lexists(target):
                    _whiteout(target)
                    whiteouts += 1
                continue
            if is_whiteout(os.lstat(path)):
                whiteouts += 1
            else:
                for attr in _overlay_xattrs(path):
                    os.removexattr(path, attr, follow_symlinks=False)
            entries += 1
        if is_opaque and rel_dir:
            opaque += 1
            present = set(os.listdir(dirpath))
            for name in lower_children(rel_dir):
                if name not in present:
                    _whiteout(Path(dirpath) / name)
                    whiteouts += 1
        entries += len(dirnames)
    return DiffStats(entries, whiteouts, opaque)
