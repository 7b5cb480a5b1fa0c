"""Flatten OCI image layers (tar changesets) into a root filesystem directory.

Layers are untrusted input. Every entry is resolved chroot-style inside the
root: parent directories are walked one component at a time with O_NOFOLLOW
directory handles, symlinks met on the way are spliced in relative to the root,
and the final component is never followed. All changes go through those
handles (the *at system calls), so nothing outside the root can be touched.
An entry deeper than oci.trees' MAX_DEPTH, with a path longer than its
MAX_PATH (where it lands: symlinks on the way count), or a name or link target
longer than the kernel takes, refuses the layer in one line.
"""

from __future__ import annotations

import errno
import gzip
import lzma
import os
import shutil
import stat
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Sequence, TypeVar

import zstandard

from image_builder.errors import ImageBuilderError
from .trees import MAX_DEPTH, MAX_PATH, shown_path

_T = TypeVar("_T")

_COPY_BUF = 1 << 20
_MAX_SYMLINKS = 40  # the kernel's own limit for one lookup
# Directory handles are cached; stay well under the usual 1024 open-file limit.
_MAX_CACHED_FDS = 512
_WH = ".wh."
_WH_META = ".wh..wh."  # AUFS bookkeeping (.wh..wh.plnk, ...), never content
_OPAQUE = ".wh..wh..opq"
# O_PATH needs no read permission on the directory and is enough for *at calls;
# O_NOFOLLOW|O_DIRECTORY makes the open fail on a symlink or a non-directory.
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_A_DIR = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)

_UNTRUSTED = "refusing the layer: the image is malformed or malicious, do not use it"
_TOO_DEEP = (f"refusing the layer: image-builder takes paths at most {MAX_DEPTH} levels deep and "
             f"{MAX_PATH} bytes long")
_NAME_MAX, _PATH_MAX = 255, 4096  # Linux's: longer fails in the kernel, as ENAMETOOLONG
_CORRUPT = "the blob is corrupt or truncated: delete it from the cache and pull again"
_STREAM_ERRORS = (
    tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError, gzip.BadGzipFile,
)


class LayerError(ImageBuilderError):
    """A layer that cannot be applied safely or at all.

    The message is one line naming the layer file and the tar entry, and what to do.
    The root is left partly written: discard it.
    """


@dataclass
class FlattenReport:
    """What flattening did; skipped lists what a rootless build could not create."""

    skipped: list[str] = field(default_factory=list)  # "dev/null: character device (rootless)"
    layers: int = 0
    entries: int = 0  # tar members read, whiteout markers included
    bytes_written: int = 0  # regular-file data
    whiteouts: int = 0  # .wh.NAME markers that removed something from a lower layer
    opaque_dirs: int = 0  # .wh..wh..opq markers applied


def open_layer(path: Path) -> BinaryIO:
    """Open a layer blob as an uncompressed tar stream.

    The compression is sniffed from magic bytes: media types lie (Docker's
    "rootfs.diff.tar.gzip" may be plain tar) and a blob cache keeps only digests.
    """
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.open(path, "rb")
    # A zstd frame, or a skippable frame (zstd:chunked keeps metadata in those).
    if magic.startswith(b"\x28\xb5\x2f\xfd") or (magic[1:4] == b"\x2a\x4d\x18" and magic[0] >> 4 == 5):
        # zstd:chunked is many frames; without read_across_frames the tar would end after the first.
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True, closefd=True)
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.open(path, "rb")
    return open(path, "rb", buffering=_COPY_BUF)


def apply_tar_layer(
    path: Path, root: Path, *, rootless: bool | None = None, report: FlattenReport | None = None
) -> FlattenReport:
    """Apply one layer on top of the tree at root (created if missing)."""
    report = FlattenReport() if report is None else report
    with _Tree(Path(root), rootless, report) as tree:
        tree.apply(Path(path))
    return report


def flatten(layers: Sequence[Path], root: Path, *, rootless: bool | None = None) -> FlattenReport:
    """Apply layers, lowest first, into root (created if missing).

    rootless defaults to "not running as root": device nodes are skipped and
    reported, ownership is not kept, and modes are widened for the owner so the
    tree can be packed and deleted without privileges.
    """
    report = FlattenReport()
    with _Tree(Path(root), rootless, report) as tree:
        for layer in layers:
            tree.apply(Path(layer))
    return report


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _components(name: str) -> list[str]:
    return [p for p in name.split("/") if p and p != "."]


def _next_member(tar: tarfile.TarFile, last: tarfile.TarInfo | None) -> tarfile.TarInfo | None:
    """The next member, or None at the end; as Go's archive/tar (Docker, containerd, podman,
    umoci, skopeo read layers with it), a stream that ends right after the last member's data,
    without its padding or the end-of-archive blocks, ends there: umoci 0.4.7's `insert`
    writes layers so. A stream cut inside the data or the padding is still an error."""
    try:
        return tar.next()
    except tarfile.ReadError:
        if last is not None and tar.fileobj.pos == last.offset_data + last.size:
            return None
        raise


class _Tree:
    """The root being built, addressed by canonical paths.

    A canonical path is relative to the root, "/"-separated, and names only real
    directories in its parent components ("" is the root itself).
    """

    def __init__(self, root: Path, rootless: bool | None, report: FlattenReport):
        root.mkdir(parents=True, exist_ok=True)
        # The caller's root path is trusted, so it may itself be reached through a symlink.
        self.root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.root = root
        self.rootless = os.geteuid() != 0 if rootless is None else rootless
        self.report = report
        self._fds: dict[str, int] = {}  # canonical directory -> O_PATH handle
        # Archive directory path -> canonical path. Only a removed directory or
        # symlink can change a resolution, and removing one clears this cache.
        self._resolved: dict[str, str] = {}
        self._layer = Path()
        # Per layer: what it created (so its own whiteouts spare it), the
        # directories above those, directory metadata to set once the children are
        # written, and device nodes skipped (hardlinks to them are skipped too).
        self._added: set[str] = set()
        self._above: set[str] = set()
        self._dir_meta: dict[str, tarfile.TarInfo] = {}
        self._skipped: set[str] = set()

    def __enter__(self) -> _Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_fds()
        os.close(self.root_fd)

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _error(self, entry: str, problem: str, hint: str = _UNTRUSTED) -> LayerError:
        return LayerError(f"{self._layer}: entry {shown_path(repr(entry))}: {problem}; {hint}")

    # -- one layer ---------------------------------------------------------

    def apply(self, layer: Path) -> None:
        self._layer = layer
        self._added, self._above, self._dir_meta, self._skipped = set(), set(), {}, set()
        entry = "(first entry)"
        stream = open_layer(layer)
        try:
            with stream, tarfile.open(fileobj=stream, mode="r|") as tar:
                member = None
                while (member := _next_member(tar, member)) is not None:
                    entry = member.name
                    # tarfile keeps every member for random access, which a stream never needs.
                    tar.members.clear()
                    self.report.entries += 1
                    # Safe point to drop handles: none is in use between entries.
                    if len(self._fds) > _MAX_CACHED_FDS:
                        self._close_fds()
                    self._entry(tar, member)
            self._finish_dirs()
        except LayerError:
            raise
        except _STREAM_ERRORS as e:
            raise LayerError(f"{layer}: at entry {entry!r}: unreadable tar stream ({e}); {_CORRUPT}") from e
        except OSError as e:
            raise self._error(entry, str(e), f"check free space and permissions under {self.root}") from e
        self.report.layers += 1

    def _entry(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        if "\0" in m.name or "\0" in m.linkname:
            raise self._error(m.name, "NUL byte in a path")
        parts = _components(m.name)
        if ".." in parts:
            raise self._error(m.name, "path contains '..'")
        if len(parts) > MAX_DEPTH:
            raise self._error(m.name, f"a path {len(parts)} levels deep", _TOO_DEEP)
        if len(os.fsencode(m.linkname)) >= _PATH_MAX:
            raise self._error(m.name, f"a link target of {len(os.fsencode(m.linkname))} bytes", _TOO_DEEP)
        if not parts:  # "./" or "/": the root itself
            if not m.isdir():
                raise self._error(m.name, "a non-directory would replace the root")
            self._dir_meta[""] = m
            return
        base = parts[-1]
        if base.startswith(_WH):
            self._whiteout(m.name, parts[:-1], base)
            return
        parent, pfd = self._resolve(m.name, parts[:-1], create=True)
        canon = _join(parent, base)
        self._check_path(m.name, canon, base)
        if m.isreg():
            self._write_file(tar, m, pfd, base, canon)
        elif m.isdir():
            self._make_dir(m, pfd, base, canon)
        elif m.issym():
            self._replace(pfd, base, canon, lambda: os.symlink(m.linkname, base, dir_fd=pfd))
            self._set_meta(pfd, base, m, chmod=False)  # a symlink's mode means nothing on Linux
        elif m.islnk():
            if not self._hardlink(m, pfd, base, canon):
                return
        elif m.ischr() or m.isblk():
            kind = "character device" if m.ischr() else "block device"
            if self.rootless:  # mknod needs CAP_MKNOD
                self.report.skipped.append(f"{canon}: {kind} (rootless)")
                self._skipped.add(canon)
                return
            dev_type = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            dev = os.makedev(m.devmajor, m.devminor)
            self._replace(pfd, base, canon, lambda: os.mknod(base, dev_type | 0o600, dev, dir_fd=pfd))
            self._set_meta(pfd, base, m)
        elif m.isfifo():
            self._replace(pfd, base, canon, lambda: os.mkfifo(base, 0o600, dir_fd=pfd))
            self._set_meta(pfd, base, m)
        else:
            self.report.skipped.append(f"{canon}: unsupported tar type {m.type!r}")
            return
        self._mark_added(canon)

    def _finish_dirs(self) -> None:
        # Directory modes and mtimes are set last: writing children would change
        # the mtimes, and a read-only mode would stop us writing them.
        for canon, m in self._dir_meta.items():
            if len(self._fds) > _MAX_CACHED_FDS:
                self._close_fds()
            if canon:
                parent, _, name = canon.rpartition("/")
                pfd = self._open_dir(parent)
                # Skip directories replaced later in this layer (by a file or a symlink).
                if pfd is None or self._open_dir(canon) is None:
                    continue
            else:
                pfd, name = self.root_fd, "."
            self._set_meta(pfd, name, m, mode_bits=0o700)

    # -- path resolution -----------------------------------------------------

    def _open_dir(self, canon: str) -> int | None:
        """Handle of the real directory at a canonical path, or None if it is gone or not a directory."""
        if not canon:
            return self.root_fd
        fd = self._fds.get(canon)
        if fd is not None:
            return fd
        fd, cur = self.root_fd, ""
        for name in canon.split("/"):
            cur = _join(cur, name)
            child = self._fds.get(cur)
            if child is None:
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in _NOT_A_DIR:
                        return None
                    raise
                self._fds[cur] = child
            fd = child
        return fd

    def _resolve(self, entry: str, parts: list[str], *, create: bool) -> tuple[str, int] | None:
        """Resolve directory components chroot-style to (canonical path, handle).

        Symlinks are spliced in (absolute targets restart at the root, ".." stops
        at the root). Missing directories are created when create is set; otherwise
        a missing or non-directory component gives None.
        """
        key = "/".join(parts)
        canon = self._resolved.get(key)
        if canon is not None:
            fd = self._open_dir(canon)
            if fd is not None:
                return canon, fd
        stack = [("", self.root_fd)]  # the real directories walked so far, for ".."
        todo = parts[::-1]
        links = 0
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) > 1:
                    stack.pop()
                continue
            cur, fd = stack[-1]
            child = _join(cur, name)
            self._check_path(entry, child, name)
            cfd = self._fds.get(child)
            if cfd is None:
                try:
                    cfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        return None
                    os.mkdir(name, 0o755, dir_fd=fd)
                    os.chmod(name, 0o755, dir_fd=fd)  # not the umask's choice: implied parents are 0755
                    cfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise
                    if not stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        if not create:
                            return None
                        raise self._error(entry, f"{child!r} is not a directory") from e
                    links += 1
                    if links > _MAX_SYMLINKS:
                        raise self._error(entry, "too many levels of symbolic links") from e
                    target = os.readlink(name, dir_fd=fd)
                    if target.startswith("/"):
                        del stack[1:]
                    todo.extend(reversed(target.split("/")))
                    continue
                self._fds[child] = cfd
            stack.append((child, cfd))
        canon, fd = stack[-1]
        self._resolved[key] = canon
        return canon, fd

    def _check_path(self, entry: str, canon: str, name: str) -> None:
        """Where an entry lands (symlinks on the way spliced in) within the bounds the rest of
        the pipeline takes (trees.MAX_DEPTH, MAX_PATH), its name within the kernel's."""
        if len(os.fsencode(name)) > _NAME_MAX:
            raise self._error(entry, f"a name of {len(os.fsencode(name))} bytes (at most {_NAME_MAX})", _TOO_DEEP)
        if canon.count("/") >= MAX_DEPTH or len(os.fsencode(canon)) > MAX_PATH:
            raise self._error(entry, f"it reaches {canon.count('/') + 1} levels deep, at a path of "
                                     f"{len(os.fsencode(canon))} bytes", _TOO_DEEP)

    def _forget(self, canon: str) -> None:
        """Drop cached lookups after the directory or symlink at canon was removed."""
        self._resolved.clear()
        prefix = canon + "/"
        for key in [k for k in self._fds if k == canon or k.startswith(prefix)]:
            os.close(self._fds.pop(key))

    # -- changes ---------------------------------------------------------------

    def _mark_added(self, canon: str) -> None:
        self._added.add(canon)
        parent = canon.rpartition("/")[0]
        while parent not in self._above:
            self._above.add(parent)
            if not parent:
                break
            parent = parent.rpartition("/")[0]

    def _remove(self, pfd: int, name: str, canon: str, mode: int) -> None:
        if stat.S_ISDIR(mode):
            try:
                shutil.rmtree(name, dir_fd=pfd)  # fd-based, never follows symlinks
            finally:
                self._forget(canon)
        else:
            os.unlink(name, dir_fd=pfd)
            if stat.S_ISLNK(mode):
                self._forget(canon)

    def _replace(self, pfd: int, name: str, canon: str, create: Callable[[], _T]) -> _T:
        """Run create(); if the name is taken, remove what is there (never following it) and retry."""
        try:
            return create()
        except FileExistsError:
            self._remove(pfd, name, canon, os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode)
            return create()

    def _write_file(self, tar: tarfile.TarFile, m: tarfile.TarInfo, pfd: int, name: str, canon: str) -> None:
        fd = self._replace(pfd, name, canon, lambda: os.open(name, _NEW_FILE, 0o600, dir_fd=pfd))
        with open(fd, "wb") as out:
            if m.size:
                shutil.copyfileobj(tar.extractfile(m), out, _COPY_BUF)
                out.flush()  # before the mtime is set
                self.report.bytes_written += m.size
            if not self.rootless:
                os.fchown(fd, m.uid, m.gid)  # before chmod: chown clears setuid
            os.fchmod(fd, m.mode | 0o400 if self.rootless else m.mode)
            ns = int(m.mtime * 1e9)
            os.utime(fd, ns=(ns, ns))

    def _make_dir(self, m: tarfile.TarInfo, pfd: int, name: str, canon: str) -> None:
        try:
            os.mkdir(name, 0o755, dir_fd=pfd)
        except FileExistsError:
            # A directory over a directory only updates its metadata.
            mode = os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode
            if not stat.S_ISDIR(mode):
                self._remove(pfd, name, canon, mode)
                os.mkdir(name, 0o755, dir_fd=pfd)
        self._dir_meta[canon] = m

    def _hardlink(self, m: tarfile.TarInfo, pfd: int, name: str, canon: str) -> bool:
        """Link canon to the archive path m.linkname; False if skipped."""
        parts = _components(m.linkname)
        if ".." in parts:
            raise self._error(m.name, f"hardlink target {m.linkname!r} is outside the root")
        found = self._resolve(m.name, parts[:-1], create=False) if parts else None
        mode = 0
        if found:
            tdir, tfd = found
            target = _join(tdir, parts[-1])
            try:
                mode = os.stat(parts[-1], dir_fd=tfd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                if target in self._skipped:
                    self.report.skipped.append(f"{canon}: hardlink to skipped {target}")
                    return False
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise self._error(m.name, f"hardlink target {m.linkname!r} is not a file in the root")
        if target == canon:
            return True
        if target.startswith(canon + "/"):
            # Replacing canon would delete the target (and close its handle).
            raise self._error(m.name, f"hardlink target {m.linkname!r} is inside the entry itself")
        self._replace(
            pfd, name, canon,
            lambda: os.link(parts[-1], name, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False),
        )
        return True

    def _set_meta(self, pfd: int, name: str, m: tarfile.TarInfo, *, chmod: bool = True, mode_bits: int = 0) -> None:
        """Set ownership (as root), mode and mtime of a name the caller just made or checked.

        chmod follows symlinks, so symlinks pass chmod=False. mode_bits are the
        owner bits a rootless tree keeps so it stays traversable and deletable.
        """
        if not self.rootless:
            os.chown(name, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
        if chmod:
            os.chmod(name, m.mode | mode_bits if self.rootless else m.mode, dir_fd=pfd)
        ns = int(m.mtime * 1e9)
        os.utime(name, ns=(ns, ns), dir_fd=pfd, follow_symlinks=False)

    # -- whiteouts -------------------------------------------------------------

    def _whiteout(self, entry: str, dir_parts: list[str], base: str) -> None:
        if base.startswith(_WH_META) and base != _OPAQUE:
            return
        name = base[len(_WH):]
        if name in ("", ".", ".."):
            raise self._error(entry, "whiteout of the directory itself or its parent")
        found = self._resolve(entry, dir_parts, create=False)
        if base == _OPAQUE:
            if found:
                self._prune(found[0])
            self.report.opaque_dirs += 1
            return
        if found and self._hide_lower(found[1], name, _join(found[0], name)):
            self.report.whiteouts += 1

    def _hide_lower(self, pfd: int, name: str, canon: str) -> bool:
        """Remove what lower layers put at canon, keeping what this layer added; True if anything went."""
        try:
            mode = os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(mode) and (canon in self._added or canon in self._above):
            # This layer's directory, or one holding its entries: hide only the lower children.
            return self._prune(canon)
        if canon in self._added:
            return False
        self._remove(pfd, name, canon, mode)
        return True

    def _prune(self, canon: str) -> bool:
        """Opaque directory: hide the children lower layers put under canon."""
        fd = self._open_dir(canon)
        if fd is None:
            return False
        list_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        try:
            names = os.listdir(list_fd)
        finally:
            os.close(list_fd)
        removed = False
        for name in names:
            removed |= self._hide_lower(fd, name, _join(canon, name))
        return removed
