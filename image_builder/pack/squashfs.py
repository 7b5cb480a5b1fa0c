"""Squashfs images: written by a thin, typed wrapper over `mksquashfs` (squashfs-tools
4.5+), read here without mounting (read_superblock, list_paths, list_layer).

`pack(src, dest, opts)` packs a directory tree into a squashfs image:

* always `-noappend -no-progress -quiet -exit-on-error` (we draw progress, and a file
  mksquashfs cannot read must fail the build, not become an empty file);
* a standalone `dest` is written to a temporary name in the same directory, checked
  (superblock magic, size, compressor), fsync'ed and renamed: `dest` is never half written;
* with `offset=N` the image is written at byte N of `dest` in place (mksquashfs
  `-offset`), which is how sif.py puts the partition inside a SIF without a copy.
  mksquashfs truncates `dest` first: the caller writes everything before N afterwards;
* `pseudo` definitions (e.g. `"etc/msg c 0 0 0 0 0"`, an overlayfs whiteout) are checked
  before mksquashfs runs, because mksquashfs silently drops a definition whose parent
  directory is missing and ignores one that names an existing file;
* timestamps: `SquashOptions.mtime`, else `$SOURCE_DATE_EPOCH`, becomes `-mkfs-time`
  (and `-all-time` when `all_time=True`); mksquashfs itself refuses
  SOURCE_DATE_EPOCH together with those flags, so the variable is not passed down.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from image_builder.errors import ImageBuilderError

__all__ = [
    "SQUASHFS_MAGIC",
    "LayerListing",
    "SquashOptions",
    "SquashfsError",
    "Superblock",
    "list_layer",
    "list_paths",
    "mksquashfs_command",
    "pack",
    "read_superblock",
    "source_date_epoch",
]

SQUASHFS_MAGIC = b"hsqs"

# name -> (superblock compression id, allowed -Xcompression-level range or None)
_COMPRESSORS: dict[str, tuple[int, tuple[int, int] | None]] = {
    "gzip": (1, (1, 9)),
    "xz": (4, None),
    "lz4": (5, None),
    "zstd": (6, (1, 22)),
}

# struct squashfs_super_block (little endian, 96 bytes): magic, inodes, mkfs_time, block_size,
# fragments, compression, block_log, flags, ids, major, minor, root inode, bytes_used, then
# the id, xattr, inode, directory, fragment and export table offsets.
_SUPERBLOCK = struct.Struct("<4sIIIIHHHHHHQQQQQQQQ")

# Pseudo definition types of mksquashfs 4.5 (`mksquashfs -help`); m/M modify an
# existing entry, every other type creates one.
_PSEUDO_TYPES = set("dmbcfsilLDMBCFSIR")
_PSEUDO_MODIFY = set("mM")
_PSEUDO_DIRS = set("dD")


class SquashfsError(ImageBuilderError):
    """mksquashfs failed or wrote something that is not a valid image.

    `str(e)` is one line; `e.stderr` keeps the tool's whole error output.
    """

    def __init__(self, message: str, *, stderr: str = "") -> None:
        super().__init__(" ".join(message.split("\n")))
        self.stderr = stderr


@dataclass(frozen=True)
class SquashOptions:
    """How to pack. The defaults favour speed: zstd level 3 measured 17x faster than
    zstd's default level here for about 8% more bytes."""

    compression: str = "zstd"  # zstd | gzip | lz4 | xz
    # -Xcompression-level for zstd (1-22) and gzip (1-9); ignored by lz4 and xz,
    # which have no level.
    level: int | None = 3
    processors: int | None = None  # -processors N (default: all)
    all_root: bool = False  # -all-root (rootless builds)
    # -mkfs-time, for byte-identical output; None: $SOURCE_DATE_EPOCH if set.
    mtime: int | None = None
    # Also stamp every file with mtime (-all-time). Off by default: it makes every
    # timestamp-checked .pyc stale, and a read-only image cannot refresh them, which
    # doubled Python import times here. Reproducible builds clamp mtimes instead.
    all_time: bool = False

    def __post_init__(self) -> None:
        if self.compression not in _COMPRESSORS:
            raise ValueError(
                f"unknown squashfs compression {self.compression!r}; "
                f"choose one of {', '.join(sorted(_COMPRESSORS))}"
            )
        levels = _COMPRESSORS[self.compression][1]
        if self.level is not None and levels is not None:
            lo, hi = levels
            if not lo <= self.level <= hi:
                raise ValueError(f"{self.compression} compression level must be {lo}-{hi}, not {self.level}")
        if self.processors is not None and self.processors < 1:
            raise ValueError(f"processors must be at least 1, not {self.processors}")
        if self.mtime is not None:
            _check_time(self.mtime, "mtime")


@dataclass(frozen=True)
class Superblock:
    """The squashfs superblock fields we use."""

    inodes: int
    mkfs_time: int
    block_size: int
    compression: str
    bytes_used: int  # the image's size without mksquashfs's 4K padding
    version: tuple[int, int]


def _check_time(value: int, what: str) -> None:
    if not 0 <= value <= 0xFFFFFFFF:  # squashfs stores unsigned 32-bit times
        raise ValueError(f"{what} must be between 0 and 4294967295, not {value}")


def source_date_epoch() -> int | None:
    """$SOURCE_DATE_EPOCH as an int, None when unset or empty."""
    raw = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
        _check_time(value, "SOURCE_DATE_EPOCH")
    except ValueError:
        raise SquashfsError(f"SOURCE_DATE_EPOCH={raw!r} is not a unix time (whole seconds)") from None
    return value


def read_superblock(path: Path | str, offset: int = 0) -> Superblock:
    """Read and check the superblock of the squashfs at `offset` in `path`."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(offset)
            raw = f.read(_SUPERBLOCK.size)
    except OSError as e:
        raise SquashfsError(f"cannot read squashfs {path}: {e.strerror}") from None
    where = f"{path}" + (f" at offset {offset}" if offset else "")
    if len(raw) < _SUPERBLOCK.size:
        raise SquashfsError(f"{where}: truncated, no squashfs superblock ({size} bytes)")
    (magic, inodes, mkfs_time, block_size, _frags, comp_id, _block_log, _flags, _ids,
     major, minor, _root, bytes_used, *_tables) = _SUPERBLOCK.unpack(raw)
    if magic != SQUASHFS_MAGIC:
        raise SquashfsError(f"{where}: not a squashfs image (magic {magic!r}, want b'hsqs')")
    if (major, minor) != (4, 0):
        raise SquashfsError(f"{where}: squashfs version {major}.{minor}, want 4.0")
    if bytes_used > size - offset:
        raise SquashfsError(f"{where}: truncated, superblock says {bytes_used} bytes, file has {size - offset}")
    names = {cid: name for name, (cid, _) in _COMPRESSORS.items()}
    return Superblock(
        inodes=inodes,
        mkfs_time=mkfs_time,
        block_size=block_size,
        compression=names.get(comp_id, f"id {comp_id}"),
        bytes_used=bytes_used,
        version=(major, minor),
    )


def mksquashfs_command(
    src: Path, dest: Path, opts: SquashOptions, *, pseudo_file: Path | None = None, offset: int = 0,
    mtime: int | None = None,
) -> list[str]:
    """The mksquashfs argv pack() runs (without the program path resolved)."""
    cmd = ["mksquashfs", str(src), str(dest), "-noappend", "-no-progress", "-quiet", "-exit-on-error",
           "-comp", opts.compression]
    if opts.level is not None and _COMPRESSORS[opts.compression][1] is not None:
        cmd += ["-Xcompression-level", str(opts.level)]
    if opts.processors is not None:
        cmd += ["-processors", str(opts.processors)]
    if opts.all_root:
        cmd.append("-all-root")
    if mtime is not None:
        cmd += ["-mkfs-time", str(mtime)]
        if opts.all_time:
            cmd += ["-all-time", str(mtime)]
    if pseudo_file is not None:
        cmd += ["-pf", str(pseudo_file)]
    if offset:
        cmd += ["-offset", str(offset)]
    return cmd


def _split_pseudo(definition: str) -> tuple[str, str]:
    """(filename, type) of a pseudo definition; the filename may be quoted or use
    backslash escapes, as mksquashfs reads it."""
    s = definition.lstrip()
    name: list[str] = []
    i = 0
    quoted = False
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            name.append(s[i + 1])
            i += 2
            continue
        if c == '"':
            quoted = not quoted
        elif c.isspace() and not quoted:
            break
        else:
            name.append(c)
        i += 1
    if quoted:
        raise ValueError("unterminated quote in filename")
    rest = s[i:].split()
    if not name or not rest:
        raise ValueError("want 'filename type ...'")
    return "".join(name), rest[0]


def _check_pseudo(src: Path, pseudo: Sequence[str]) -> None:
    """Refuse pseudo definitions mksquashfs would drop or ignore without failing."""
    created_dirs: set[str] = set()
    seen: set[str] = set()
    for definition in pseudo:
        if any(c in definition for c in "\n\r\0"):
            raise SquashfsError(f"pseudo definition {definition!r}: contains a newline or NUL")
        try:
            name, kind = _split_pseudo(definition)
        except ValueError as e:
            raise SquashfsError(f"pseudo definition {definition!r}: {e}") from None
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if not parts or ".." in parts:
            raise SquashfsError(f"pseudo definition {definition!r}: bad path {name!r}")
        if kind not in _PSEUDO_TYPES:
            raise SquashfsError(f"pseudo definition {definition!r}: unknown type {kind!r}")
        rel = "/".join(parts)
        if rel in seen:
            raise SquashfsError(f"pseudo definition {definition!r}: {rel} is defined twice")
        seen.add(rel)
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in created_dirs:
                continue
            try:
                st = os.lstat(src / parent)
            except FileNotFoundError:
                st = None
            if st is None or not stat.S_ISDIR(st.st_mode):
                raise SquashfsError(
                    f"pseudo definition {definition!r}: parent {parent} is not a directory in {src} "
                    f"(mksquashfs would drop it); create it or define it first ('{parent} d 755 0 0')"
                )
        exists = os.path.lexists(src / rel)
        if kind in _PSEUDO_MODIFY:
            if not exists:
                raise SquashfsError(f"pseudo definition {definition!r}: {rel} does not exist in {src}")
        elif exists:
            raise SquashfsError(
                f"pseudo definition {definition!r}: {rel} already exists in {src} (mksquashfs would ignore it)"
            )
        if kind in _PSEUDO_DIRS:
            created_dirs.add(rel)


def _error_line(stderr: str, returncode: int) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    fatal = [line for line in lines if line.startswith("FATAL ERROR")]
    if fatal:
        return fatal[-1]
    # Usage listings after an error are indented; the message is the last line before them.
    plain = [line for line in stderr.splitlines() if line.strip() and not line[0].isspace()]
    if plain:
        return plain[-1].strip() if len(plain) == len(lines) else plain[0].strip()
    return f"exit status {returncode}"


def _new_temp(dest: Path) -> Path:
    """Create an empty, unique file next to dest (mode 0666 minus umask)."""
    for _ in range(100):
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise SquashfsError(f"cannot create a temporary file next to {dest}")


def _mksquashfs(cmd: list[str], env: dict[str, str], target: Path) -> tuple[int, str]:
    """Run mksquashfs (exit status, its output), starting the writeback of what it has
    written so far every 0.2 s: the fsync before the image is published then waits for
    the last part only, not for all of it (45 ms for a 128 MB image on these VMs, 5% of
    packing it)."""
    import ctypes
    import subprocess

    sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    start_write = 2  # SYNC_FILE_RANGE_WRITE: start writing dirty pages, wait for none
    fd = os.open(target, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)  # the file mksquashfs writes to
    try:
        with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env) as proc:
            while True:
                try:
                    out, err = proc.communicate(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    sync_file_range(fd, 0, 0, start_write)
        return proc.returncode, err.decode("utf-8", "replace") + out.decode("utf-8", "replace")
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pack(
    src: Path | str,
    dest: Path | str,
    opts: SquashOptions = SquashOptions(),
    *,
    pseudo: Sequence[str] = (),
    offset: int = 0,
) -> None:
    """Pack the directory `src` into a squashfs image at `dest` (or at byte `offset` of
    `dest`). Raises SquashfsError with a one-line message on failure; a standalone
    `dest` is then left as it was."""
    src = Path(src)
    dest = Path(dest)
    if offset < 0:
        raise ValueError(f"offset must be >= 0, not {offset}")
    if isinstance(pseudo, str):
        raise TypeError("pseudo is a sequence of definitions, not one string")
    if not src.is_dir():
        raise SquashfsError(f"cannot pack {src}: not a directory")
    if not dest.parent.is_dir():
        raise SquashfsError(f"cannot write {dest}: {dest.parent} is not a directory")
    # Here, not at the top: `image-builder run` reads superblocks, and each of these costs
    # milliseconds to import on its path.
    import shutil
    import tempfile

    _check_pseudo(src, pseudo)
    tool = shutil.which("mksquashfs")
    if tool is None:
        raise SquashfsError("mksquashfs not found on PATH (install squashfs-tools)")
    mtime = opts.mtime if opts.mtime is not None else source_date_epoch()

    target = dest if offset else _new_temp(dest)
    pseudo_file: Path | None = None
    ok = False
    try:
        if pseudo:
            fd, name = tempfile.mkstemp(prefix="mksquashfs-", suffix=".pseudo")
            pseudo_file = Path(name)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write("".join(d + "\n" for d in pseudo))
        cmd = mksquashfs_command(src, target, opts, pseudo_file=pseudo_file, offset=offset, mtime=mtime)
        cmd[0] = tool
        env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
        returncode, stderr = _mksquashfs(cmd, env, target)
        if returncode != 0:
            free = shutil.disk_usage(target.parent).free
            hint = (f"; only {free // 1_000_000} MB left on {target.parent} (No space left): free some and rerun"
                    if "Failed to write" in stderr else "")
            raise SquashfsError(
                f"mksquashfs failed packing {src}: {_error_line(stderr, returncode)}{hint}", stderr=stderr
            )
        try:
            sb = read_superblock(target, offset)
        except SquashfsError as e:
            raise SquashfsError(f"mksquashfs wrote a bad image from {src}: {e}", stderr=stderr) from None
        if sb.compression != opts.compression:
            raise SquashfsError(f"mksquashfs wrote {sb.compression}, not {opts.compression}, from {src}")
        if not offset:
            with open(target, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(target, dest)
            _fsync_dir(dest.parent)
        ok = True
    finally:
        if pseudo_file is not None:
            pseudo_file.unlink(missing_ok=True)
        if not ok and not offset:
            target.unlink(missing_ok=True)


def list_paths(image: Path, rel: str, offset: int = 0) -> list[str]:
    """The paths at and under `rel` in a squashfs image (at `offset`, e.g. in a SIF), as
    "/rel/...", read with `unsquashfs -l` without mounting; [] when `rel` is absent."""
    import subprocess

    out = subprocess.run(["unsquashfs", "-o", str(offset), "-d", "", "-l", str(image), rel],
                         capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.startswith("/")]


# --- reading an image's directory tree, without mounting it ------------------------------------

# Unprivileged unsquashfs can create neither the whiteouts (character devices 0:0) nor
# the trusted.overlay.opaque xattrs of an overlay layer: they are read from the image
# itself, its directory tree only (file data is unsquashfs's job).

_DIR_ENTRY_KINDS = {1: "d", 2: "f", 3: "l", 4: "b", 5: "c", 6: "p", 7: "s"}
_XATTR_PREFIXES = {0: "user.", 1: "trusted.", 2: "security."}


@dataclass
class LayerListing:
    """What an overlay layer holds besides file data."""

    kinds: dict[str, str] = field(default_factory=dict)  # path -> d f l b c p s
    whiteouts: list[str] = field(default_factory=list)  # paths the layer deletes
    opaque: list[str] = field(default_factory=list)  # directories whose lower contents it hides


def _decompressor(comp: int):
    import lzma
    import zlib

    if comp == 1:
        return zlib.decompress
    if comp in (2, 4):
        return lzma.decompress
    if comp == 6:
        import zstandard

        return lambda raw: zstandard.ZstdDecompressor().decompressobj().decompress(raw)
    raise SquashfsError(f"squashfs compression id {comp} (lzo or lz4) cannot be read here; pack with zstd, "
                      "gzip or xz")


def list_layer(image: Path, offset: int = 0) -> LayerListing:
    """The directory tree of the squashfs at `offset` in `image`."""
    with open(image, "rb") as f:
        f.seek(offset)
        sb = _SUPERBLOCK.unpack(f.read(_SUPERBLOCK.size))
        root_ref, xattr_table, inode_table, dir_table = sb[11], sb[14], sb[15], sb[16]
        decompress = _decompressor(sb[5])
        blocks: dict[int, tuple[bytes, int]] = {}

        def read(pos: int, off: int, n: int) -> tuple[bytes, int, int]:
            """n bytes of a metadata stream from block `pos` (absolute), offset `off`."""
            out = bytearray()
            while len(out) < n:
                if pos not in blocks:
                    f.seek(pos)
                    (head,) = struct.unpack("<H", f.read(2))
                    raw = f.read(head & 0x7FFF)
                    blocks[pos] = (raw if head & 0x8000 else decompress(raw), pos + 2 + (head & 0x7FFF))
                data, nxt = blocks[pos]
                chunk = data[off: off + n - len(out)]
                out += chunk
                off += len(chunk)
                if off >= len(data):
                    pos, off = nxt, 0
            return bytes(out), pos, off

        def inode(ref: int) -> tuple[int, bytes]:
            head, pos, off = read(offset + inode_table + (ref >> 16), ref & 0xFFFF, 16)
            kind = struct.unpack_from("<H", head)[0]
            size = {1: 16, 8: 24, 4: 8, 5: 8, 11: 12, 12: 12}.get(kind, 0)
            return kind, read(pos, off, size)[0]

        def opaque(xattr_index: int) -> bool:
            if xattr_index == 0xFFFFFFFF or xattr_table == 0xFFFFFFFFFFFFFFFF:
                return False
            f.seek(offset + xattr_table)
            kv_start = struct.unpack("<Q", f.read(8))[0]
            f.seek(offset + xattr_table + 16 + (xattr_index * 16 // 8192) * 8)
            id_block = struct.unpack("<Q", f.read(8))[0]
            ref, count, _size = struct.unpack("<QII", read(offset + id_block, xattr_index * 16 % 8192, 16)[0])
            pos, off = offset + kv_start + (ref >> 16), ref & 0xFFFF
            for _ in range(count):
                head, pos, off = read(pos, off, 4)
                kind, name_size = struct.unpack("<HH", head)
                name, pos, off = read(pos, off, name_size)
                head, pos, off = read(pos, off, 4)
                value, pos, off = read(pos, off, struct.unpack("<I", head)[0])
                if kind & 0x100:  # stored out of line: value is a reference to it
                    ref2 = struct.unpack("<Q", value)[0]
                    head, p2, o2 = read(offset + kv_start + (ref2 >> 16), ref2 & 0xFFFF, 4)
                    value = read(p2, o2, struct.unpack("<I", head)[0])[0]
                full = _XATTR_PREFIXES.get(kind & 0xFF, "?") + name.decode(errors="replace")
                if full in ("trusted.overlay.opaque", "user.overlay.opaque") and value == b"y":
                    return True
            return False

        listing = LayerListing()
        todo = [(root_ref, "")]
        while todo:
            ref, prefix = todo.pop()
            kind, body = inode(ref)
            if kind == 1:
                block, _nlink, size, block_off, _parent = struct.unpack("<IIHHI", body)
                xattr = 0xFFFFFFFF
            else:
                _nlink, size, block, _parent, _index, block_off, xattr = struct.unpack("<IIIIHHI", body)
            if prefix and opaque(xattr):
                listing.opaque.append(prefix)
            left, pos, off = size - 3, offset + dir_table + block, block_off
            while left > 0:
                head, pos, off = read(pos, off, 12)
                count, start, _base = struct.unpack("<III", head)
                left -= 12
                for _ in range(count + 1):
                    head, pos, off = read(pos, off, 8)
                    entry_off, _delta, etype, name_size = struct.unpack("<HhHH", head)
                    name, pos, off = read(pos, off, name_size + 1)
                    left -= 8 + name_size + 1
                    path = f"{prefix}/{os.fsdecode(name)}" if prefix else os.fsdecode(name)
                    child = (start << 16) | entry_off
                    kind = _DIR_ENTRY_KINDS.get(etype, "?")
                    listing.kinds[path] = kind
                    if kind == "d":
                        todo.append((child, path))
                    elif kind == "c" and struct.unpack("<II", inode(child)[1][:8])[1] == 0:
                        listing.whiteouts.append(path)
        return listing
