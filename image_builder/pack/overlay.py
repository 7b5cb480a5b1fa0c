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
  have there: the same result for every reader, and no xattr needed. So does
  every directory made again inside one (unmarked: the kernel hides all below an
  opaque directory), else the layers' entries under it showed through (pip 26
  replaced by 25.0.1 kept 26's `_vendor/resolvelib/resolvers/`, and failed).

Other overlayfs bookkeeping xattrs are dropped. Unprivileged users may create
0:0 character devices (Linux 5.8+), so this works rootless too.

Trees are walked without recursion (oci.trees.walk).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from image_builder.oci.trees import walk

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
    _fixed_time(str(path))


def _fixed_time(path: str) -> None:
    """A whiteout's time: fixed, not when it was made (by us or by the kernel's overlay),
    so that the same layers make the same overlay to the byte, whenever."""
    os.utime(path, ns=(0, 0), follow_symlinks=False)


def _overlay_xattrs(path: str) -> list[str]:
    try:
        return [x for x in os.listxattr(path, follow_symlinks=False) if ".overlay." in x]
    except OSError:  # filesystem without xattrs, or a special file
        return []


def normalise_upper(upper: Path, lower_children: Callable[[str], list[str]]) -> DiffStats:
    """Rewrite `upper` in place into Apptainer overlay form.

    `lower_children(rel_dir)` lists the names the layers below hold in a
    directory; it is asked only for opaque directories and those under them.
    """
    entries = whiteouts = opaque = 0
    hiding: set[str] = set()  # directories that hide what the layers below have there (opaque, or in one)
    for dirpath, dirnames, filenames in walk(upper):
        rel_dir = os.path.relpath(dirpath, upper)
        rel_dir = "" if rel_dir == "." else rel_dir
        names = set(dirnames) | set(filenames)
        is_opaque = OPAQUE_MARKER in names
        for attr in _overlay_xattrs(dirpath):
            if attr in OPAQUE_XATTRS and os.getxattr(dirpath, attr, follow_symlinks=False) == b"y":
                is_opaque = True
            os.removexattr(dirpath, attr, follow_symlinks=False)
        opaque += is_opaque and bool(rel_dir)
        is_opaque = is_opaque or (bool(rel_dir) and os.path.dirname(rel_dir) in hiding)
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
                _fixed_time(path)
                whiteouts += 1
            else:
                for attr in _overlay_xattrs(path):
                    os.removexattr(path, attr, follow_symlinks=False)
            entries += 1
        if is_opaque and rel_dir:
            hiding.add(rel_dir)
            present = set(os.listdir(dirpath))
            for name in lower_children(rel_dir):
                if name not in present:
                    _whiteout(Path(dirpath) / name)
                    whiteouts += 1
        entries += len(dirnames)
    return DiffStats(entries, whiteouts, opaque)



def diff_trees(lower: Path, full: Path, upper: Path) -> DiffStats:
    """Write into `upper` what turns `lower` into `full`, in overlay form: entries of `full` that `lower` lacks
    or has otherwise (type, mode, size, content, symlink target), and a whiteout for each entry of `lower`
    that `full` lacks. A file byte-identical to the lower one is not stored again (an image's own layer that
    re-adds a checkout its environment holds costs only what changed)."""
    entries = whiteouts = 0
    upper.mkdir(parents=True, exist_ok=True)
    for dirpath, dirnames, filenames in walk(full):
        rel = Path(os.path.relpath(dirpath, full))
        low_dir = lower / rel
        low_is_dir = low_dir.is_dir() and not low_dir.is_symlink()
        descend = []
        for name in sorted(dirnames + filenames):
            src, low = Path(dirpath) / name, low_dir / name
            if name in dirnames and not src.is_symlink() and low.is_dir() and not low.is_symlink():
                descend.append(name)  # both directories: compared entry by entry below
                if os.lstat(src).st_mode != os.lstat(low).st_mode:
                    _parents(upper, full, rel / name)
                    entries += 1
            elif not _same_entry(src, low):
                _parents(upper, full, rel)
                _copy(src, upper / rel / name)
                entries += 1
        dirnames[:] = descend
        if low_is_dir:
            for name in sorted(set(os.listdir(low_dir)) - set(os.listdir(dirpath))):
                _parents(upper, full, rel)
                _whiteout(upper / rel / name)
                whiteouts += 1
    for dirpath, _, _ in sorted(walk(upper), key=lambda w: -len(w[0])):  # last, deepest first: exact modes
        twin = full / os.path.relpath(dirpath, upper)
        st = os.lstat(twin)
        os.chmod(dirpath, stat.S_IMODE(st.st_mode))
        os.utime(dirpath, ns=(st.st_atime_ns, st.st_mtime_ns))
    return DiffStats(entries, whiteouts, 0)


def prune_upper(upper: Path, lower: Path) -> DiffStats:
    """Drop from `upper` (overlay form, over `lower`) what `lower` already holds as it is:
    files and symlinks the same as their twin (_same_entry: type, mode, size, content or
    target), then directories left empty whose twin is a directory of the same mode; each
    directory keeps its times. An overlay mount's upper directory then holds what
    diff_trees(lower, merged) would have written: an image's own layer that re-adds a
    checkout its environment holds costs only what changed."""
    entries = whiteouts = 0
    for dirpath, dirnames, filenames in walk(upper, topdown=False):
        here = os.lstat(dirpath)
        low_dir = lower / os.path.relpath(dirpath, upper)
        for name in filenames + dirnames:
            path, low = Path(dirpath) / name, low_dir / name
            st = os.lstat(path)
            if is_whiteout(st):
                whiteouts += 1
            elif not stat.S_ISDIR(st.st_mode):  # os.walk lists a symlink to a directory among dirnames
                if _same_entry(path, low):
                    os.unlink(path)
                else:
                    entries += 1
            elif not os.listdir(path) and not low.is_symlink() and low.is_dir() and os.lstat(low).st_mode == st.st_mode:
                os.rmdir(path)
            else:
                entries += 1
        os.utime(dirpath, ns=(here.st_atime_ns, here.st_mtime_ns))
    return DiffStats(entries, whiteouts, 0)


def _same_entry(a: Path, b: Path) -> bool:
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except FileNotFoundError:
        return False
    if sa.st_mode != sb.st_mode:
        return False
    if stat.S_ISLNK(sa.st_mode):
        return os.readlink(a) == os.readlink(b)
    if stat.S_ISREG(sa.st_mode):
        if sa.st_size != sb.st_size:
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                x, y = fa.read(1 << 20), fb.read(1 << 20)
                if x != y:
                    return False
                if not x:
                    return True
    return False  # devices, fifos, sockets: stored as they are


def _parents(upper: Path, full: Path, rel: Path) -> None:
    """upper/rel and the directories above it, each with the mode and times of its twin in `full`."""
    made = []
    for part in [*reversed(rel.parents), rel] if str(rel) != "." else []:
        if str(part) == "." or (upper / part).exists():
            continue
        (upper / part).mkdir()
        made.append(part)
    for part in reversed(made):  # deepest first: setting a parent's times would not survive a child's mkdir
        st = os.lstat(full / part)
        os.chmod(upper / part, stat.S_IMODE(st.st_mode) | stat.S_IRWXU)  # writable while we fill it
        os.utime(upper / part, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy(src: Path, dest: Path) -> None:
    """src (a tree too) to dest as it is: symlinks, fifos and devices as themselves, never
    opened (shutil.copy2 refuses a fifo), without recursion (shutil.copytree recurses)."""
    import shutil
    if not src.is_dir() or src.is_symlink():
        _copy_entry(str(src), str(dest))
        return
    made = []
    for dirpath, dirnames, filenames in walk(src):
        there = os.path.normpath(os.path.join(dest, os.path.relpath(dirpath, src)))
        os.mkdir(there, 0o700)
        made.append((dirpath, there))
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            _copy_entry(os.path.join(dirpath, name), os.path.join(there, name))
    for dirpath, there in reversed(made):  # deepest first: a child's entries would change its parent's times
        shutil.copystat(dirpath, there, follow_symlinks=False)


def _copy_entry(src: str, dest: str) -> None:
    import shutil
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dest)
    elif stat.S_ISREG(st.st_mode):
        shutil.copyfile(src, dest, follow_symlinks=False)
    elif stat.S_ISFIFO(st.st_mode):
        os.mkfifo(dest, 0o600)
    else:  # a device (as root: a rootless flatten skips them)
        os.mknod(dest, stat.S_IFMT(st.st_mode) | 0o600, st.st_rdev)
    shutil.copystat(src, dest, follow_symlinks=False)  # as shutil.copy2: mode, times, xattrs
