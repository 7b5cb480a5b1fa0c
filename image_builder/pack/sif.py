"""Our own SIF (Singularity Image Format) writer and reader.

Layout (as apptainer/sif's Go package defines it; checked against `siftool`):
a 128-byte global header, 48 descriptors of 585 bytes at offset 4096, then the data
objects. write_sif() writes, as `apptainer build` does, the definition file, a labels
JSON object, any generic JSON objects sorted by name, then the squashfs root
filesystem as the primary system partition, aligned to 4096 bytes.

The partition is not copied: mksquashfs writes it straight into the temporary SIF
with `-offset`, then the header, descriptors and small objects are written in front
of it. The result is re-read and checked before it is renamed into place. With the
same inputs and the same `created` (or SOURCE_DATE_EPOCH) the file is byte-identical:
the UUID is all zeros and every time is fixed.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import IntEnum
from pathlib import Path

from image_builder.errors import ImageBuilderError
from .squashfs import SQUASHFS_MAGIC, SquashfsError, SquashOptions, pack, read_superblock, source_date_epoch

__all__ = [
    "ARCH_CODES",
    "DataType",
    "Descriptor",
    "FsType",
    "PartType",
    "SifError",
    "SifImage",
    "arch_code",
    "partition_offset",
    "read_sif",
    "write_sif",
    "write_singularity_env",
]

HEADER = struct.Struct("<32s10s3s3s16s8q")  # 128 bytes
DESCRIPTOR = struct.Struct("<i?III7q128s384s")  # 585 bytes
PARTITION_EXTRA = struct.Struct("<ii3s")

LAUNCH_SCRIPT = b"#!/usr/bin/env run-singularity\n"
MAGIC = b"SIF_MAGIC\0"
VERSION = b"01\0"
DESCRIPTORS_OFFSET = 4096
DESCRIPTORS_TOTAL = 48
DATA_OFFSET = DESCRIPTORS_OFFSET + DESCRIPTORS_TOTAL * DESCRIPTOR.size  # 32176
PARTITION_ALIGN = 4096
GROUP_MASK = 0xF0000000
DEFAULT_GROUP = 1
LABELS_NAME = "labels.json"
ENV_SCRIPT = ".singularity.d/env/10-docker2singularity.sh"
RUNSCRIPT = ".singularity.d/runscript"
_MAX_DESCRIPTORS = 1 << 16  # sanity bound when reading foreign files

assert HEADER.size == 128 and DESCRIPTOR.size == 585 and PARTITION_EXTRA.size == 11


class DataType(IntEnum):
    DEFFILE = 0x4001
    ENV_VARS = 0x4002
    LABELS = 0x4003
    PARTITION = 0x4004
    SIGNATURE = 0x4005
    GENERIC_JSON = 0x4006
    GENERIC = 0x4007
    CRYPTO_MESSAGE = 0x4008
    SBOM = 0x4009
    OCI_ROOT_INDEX = 0x400A
    OCI_BLOB = 0x400B


class FsType(IntEnum):
    SQUASHFS = 1
    EXT3 = 2
    IMMUTABLE_OBJECT = 3
    RAW = 4
    ENCRYPTED_SQUASHFS = 5


class PartType(IntEnum):
    SYSTEM = 1
    PRIMARY_SYSTEM = 2
    DATA = 3
    OVERLAY = 4


# Go architecture name -> SIF code
ARCH_CODES: dict[str, str] = {
    "386": "01", "amd64": "02", "arm": "03", "arm64": "04", "ppc64": "05", "ppc64le": "06",
    "mips": "07", "mipsle": "08", "mips64": "09", "mips64le": "10", "s390x": "11", "riscv64": "12",
}
ARCH_NAMES: dict[str, str] = {code: name for name, code in ARCH_CODES.items()} | {"00": "unknown"}
# platform.machine() -> Go architecture name
_MACHINES: dict[str, str] = {
    "x86_64": "amd64", "amd64": "amd64", "i386": "386", "i486": "386", "i586": "386", "i686": "386",
    "aarch64": "arm64", "arm64": "arm64", "armv6l": "arm", "armv7l": "arm", "armv8l": "arm", "arm": "arm",
    "ppc64": "ppc64", "ppc64le": "ppc64le", "mips": "mips", "mipsel": "mipsle", "mips64": "mips64",
    "mips64el": "mips64le", "s390x": "s390x", "riscv64": "riscv64",
}


class SifError(ImageBuilderError):
    """A SIF file cannot be read or written; the message names the file."""


def arch_code(arch: str | None = None) -> str:
    """The two-digit SIF code for `arch`: a SIF code ("02"), a Go name ("amd64") or a
    machine name ("x86_64"); None means this host (platform.machine())."""
    if arch is None:
        import platform  # only here: reading a SIF (every run's client does) needs no host name

        arch = platform.machine()
    name = arch
    key = name.strip().lower()
    if key in ARCH_NAMES:
        return key
    if key in ARCH_CODES:
        return ARCH_CODES[key]
    if key in _MACHINES:
        return ARCH_CODES[_MACHINES[key]]
    what = "this host's architecture" if arch is None else "architecture"
    raise SifError(f"{what} {name!r} has no SIF code; pass arch= one of {', '.join(ARCH_CODES)}")


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


@dataclass(frozen=True)
class Descriptor:
    """One used descriptor. Ids are as stored: group_id includes the 0xF0000000 mask."""

    datatype: int
    id: int
    group_id: int
    linked_id: int
    offset: int
    size: int
    size_with_padding: int
    created: int
    modified: int
    name: str
    extra: bytes = field(repr=False)

    def _partition(self) -> tuple[int, int, str] | None:
        if self.datatype != DataType.PARTITION:
            return None
        fstype, parttype, arch = PARTITION_EXTRA.unpack_from(self.extra)
        return fstype, parttype, _cstr(arch)

    @property
    def fstype(self) -> int | None:
        """Filesystem type of a partition (FsType), None for other objects."""
        p = self._partition()
        return p[0] if p else None

    @property
    def parttype(self) -> int | None:
        """Partition type (PartType), None for other objects."""
        p = self._partition()
        return p[1] if p else None

    @property
    def arch(self) -> str | None:
        """Two-digit SIF architecture code of a partition, None for other objects."""
        p = self._partition()
        return p[2] if p else None

    def pack(self) -> bytes:
        return DESCRIPTOR.pack(
            self.datatype, True, self.id, self.group_id, self.linked_id, self.offset, self.size,
            self.size_with_padding, self.created, self.modified, 0, 0, self.name.encode(), self.extra,
        )


@dataclass(frozen=True)
class SifImage:
    path: Path
    arch: str  # two-digit SIF code from the header, e.g. "02" (amd64)
    id: bytes  # 16 UUID bytes
    created: int
    modified: int
    descriptors: tuple[Descriptor, ...]
    data_offset: int = DATA_OFFSET
    data_size: int = 0

    def primary_partition(self) -> Descriptor:
        prim = [d for d in self.descriptors
                if d.datatype == DataType.PARTITION and d.parttype == PartType.PRIMARY_SYSTEM]
        if len(prim) != 1:
            raise SifError(f"{self.path}: {len(prim)} primary system partitions, want exactly one")
        return prim[0]

    def find(self, datatype: int, name: str | None = None) -> list[Descriptor]:
        return [d for d in self.descriptors if d.datatype == datatype and (name is None or d.name == name)]

    def read_object(self, d: Descriptor) -> bytes:
        """The bytes of a data object (whole: mind the size of a partition)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(d.offset)
                data = f.read(d.size)
        except OSError as e:
            raise SifError(f"{self.path}: cannot read object {d.id}: {e.strerror}") from None
        if len(data) != d.size:
            raise SifError(f"{self.path}: truncated, object {d.id} needs {d.size} bytes at {d.offset}")
        return data

    def labels(self) -> dict[str, str]:
        """The labels JSON object, {} if there is none."""
        found = self.find(DataType.LABELS)
        if not found:
            return {}
        try:
            return json.loads(self.read_object(found[0]))
        except ValueError as e:
            raise SifError(f"{self.path}: labels object is not JSON: {e}") from None


def read_sif(path: Path | str) -> SifImage:
    """Read and check a SIF file's header and descriptors. The file must have exactly
    one primary system partition, a squashfs starting with `hsqs` within the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER.size)
            if len(head) < HEADER.size:
                raise SifError(f"{path}: truncated, {size} bytes is too short for a SIF header")
            (_launch, magic, version, arch, uuid, created, modified, _free, total, descr_off, descr_size,
             data_off, data_size) = HEADER.unpack(head)
            if magic != MAGIC:
                raise SifError(f"{path}: not a SIF file (magic {magic!r}, want {MAGIC!r})")
            if version != VERSION:
                raise SifError(f"{path}: unsupported SIF version {_cstr(version)!r}, want '01'")
            if not 0 < total <= _MAX_DESCRIPTORS or descr_off < HEADER.size or descr_size != total * DESCRIPTOR.size:
                raise SifError(f"{path}: corrupt SIF header ({total} descriptors of {descr_size} bytes at {descr_off})")
            if descr_off + descr_size > size:
                raise SifError(f"{path}: truncated, the descriptor table ends at {descr_off + descr_size}, "
                               f"the file at {size}")
            f.seek(descr_off)
            table = f.read(descr_size)
            descriptors = []
            for i in range(total):
                (datatype, used, did, group, link, off, osize, padded, dcreated, dmodified, _uid, _gid, name,
                 extra) = DESCRIPTOR.unpack_from(table, i * DESCRIPTOR.size)
                if not used:
                    continue
                d = Descriptor(datatype, did, group, link, off, osize, padded, dcreated, dmodified, _cstr(name),
                               extra)
                if off < 0 or osize < 0:
                    raise SifError(f"{path}: corrupt descriptor {did} (offset {off}, size {osize})")
                if off + osize > size:
                    raise SifError(f"{path}: truncated, object {did} ends at {off + osize}, the file at {size}")
                descriptors.append(d)
            image = SifImage(path, _cstr(arch), uuid, created, modified, tuple(descriptors), data_off, data_size)
            prim = image.primary_partition()
            if prim.fstype != FsType.SQUASHFS:
                raise SifError(f"{path}: the primary partition is filesystem type {prim.fstype}, not squashfs")
            f.seek(prim.offset)
            if f.read(4) != SQUASHFS_MAGIC:
                raise SifError(f"{path}: the primary partition at {prim.offset} is not a squashfs (no hsqs magic)")
    except OSError as e:
        raise SifError(f"cannot read {path}: {e.strerror}") from None
    try:
        sb = read_superblock(path, prim.offset)
    except SquashfsError as e:
        raise SifError(f"{path}: primary partition: {e}") from None
    if sb.bytes_used > prim.size:
        raise SifError(f"{path}: the squashfs needs {sb.bytes_used} bytes, its partition has {prim.size}")
    return image


def partition_offset(path: Path | str) -> tuple[int, int]:
    """(offset, size) of the primary squashfs partition, for `squashfuse_ll -o offset=N`."""
    prim = read_sif(path).primary_partition()
    return prim.offset, prim.size


def _default_created() -> int:
    try:
        epoch = source_date_epoch()
    except SquashfsError as e:
        raise SifError(str(e)) from None
    return int(time.time()) if epoch is None else epoch


def _json_bytes(obj: object, indent: str | None = None) -> bytes:
    separators = None if indent else (",", ":")
    return json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False, separators=separators).encode()


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def write_sif(
    dest: Path | str,
    rootfs: Path | str,
    *,
    deffile: str,
    labels: Mapping[str, str],
    squash: SquashOptions,
    arch: str | None = None,
    created: int | None = None,
    extra_json: Mapping[str, Mapping] | None = None,
) -> SifImage:
    """Pack `rootfs` into a SIF at `dest` and return what read_sif() reads back.

    `arch`: as for arch_code() (default this host). `created`: unix time for the header
    and descriptors (default SOURCE_DATE_EPOCH, else now). `extra_json`: generic JSON
    objects by name, written sorted by name."""
    dest = Path(dest)
    rootfs = Path(rootfs)
    code = arch_code(arch)
    when = _default_created() if created is None else int(created)
    if when < 0:
        raise SifError(f"created must be a unix time >= 0, not {when}")

    objects: list[tuple[int, str, bytes]] = [
        (DataType.DEFFILE, "", deffile.encode()),
        (DataType.LABELS, LABELS_NAME, _json_bytes(dict(labels), indent="\t")),
    ]
    for name in sorted(extra_json or {}):
        objects.append((DataType.GENERIC_JSON, name, _json_bytes((extra_json or {})[name])))
    if len(objects) + 1 > DESCRIPTORS_TOTAL:
        raise SifError(f"{dest}: {len(objects) + 1} objects do not fit in {DESCRIPTORS_TOTAL} descriptors")
    for _, name, _ in objects:
        if len(name.encode()) > 128:
            raise SifError(f"{dest}: object name {name!r} is longer than 128 bytes")

    group = DEFAULT_GROUP | GROUP_MASK
    descriptors: list[Descriptor] = []
    pos = DATA_OFFSET
    for i, (dtype, name, data) in enumerate(objects):
        descriptors.append(Descriptor(int(dtype), i + 1, group, 0, pos, len(data), len(data), when, when, name,
                                      b"\0" * 384))
        pos += len(data)
    part_off = _align(pos, PARTITION_ALIGN)

    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    try:
        # 0777 minus umask, like apptainer: the launch script makes a SIF executable.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o777))
    except OSError as e:
        raise SifError(f"cannot create {tmp}: {e.strerror}") from None
    ok = False
    try:
        try:
            pack(rootfs, tmp, squash, offset=part_off)
        except SquashfsError as e:
            raise SifError(f"{dest}: {e}") from None
        part_size = os.stat(tmp).st_size - part_off
        extra = PARTITION_EXTRA.pack(FsType.SQUASHFS, PartType.PRIMARY_SYSTEM, code.encode()).ljust(384, b"\0")
        descriptors.append(Descriptor(int(DataType.PARTITION), len(descriptors) + 1, group, 0, part_off, part_size,
                                      part_off - pos + part_size, when, when, "", extra))
        header = HEADER.pack(
            LAUNCH_SCRIPT, MAGIC, VERSION, code.encode() + b"\0", bytes(16), when, when,
            DESCRIPTORS_TOTAL - len(descriptors), DESCRIPTORS_TOTAL, DESCRIPTORS_OFFSET,
            DESCRIPTORS_TOTAL * DESCRIPTOR.size, DATA_OFFSET, part_off + part_size - DATA_OFFSET,
        )
        table = b"".join(d.pack() for d in descriptors).ljust(DESCRIPTORS_TOTAL * DESCRIPTOR.size, b"\0")
        # mksquashfs truncated the file: everything before the partition is a hole (zeros).
        with open(tmp, "r+b") as f:
            f.seek(0)
            f.write(header)
            f.seek(DESCRIPTORS_OFFSET)
            f.write(table)
            f.seek(DATA_OFFSET)
            f.write(b"".join(data for _, _, data in objects))
            f.flush()
            os.fsync(f.fileno())
        image = read_sif(tmp)
        if image.descriptors != tuple(descriptors) or image.arch != code:
            raise SifError(f"{tmp}: re-read descriptors differ from the ones written")
        for d, (_, _, data) in zip(image.descriptors, objects):
            if image.read_object(d) != data:
                raise SifError(f"{tmp}: object {d.id} reads back different bytes")
        os.replace(tmp, dest)
        fd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        ok = True
    except OSError as e:
        raise SifError(f"cannot write {dest}: {e}") from None
    finally:
        if not ok:
            tmp.unlink(missing_ok=True)
    return replace(image, path=dest)


# --- /.singularity.d inside the root filesystem --------------------------------------

def _shell_double_quoted(value: str) -> str:
    """`value` for use inside double quotes, also nested ones ("${K:-"..."}")."""
    return "".join("\\" + c if c in '\\"$`' else c for c in value)


def _is_shell_name(name: str) -> bool:
    return bool(name) and (name[0].isascii() and (name[0].isalpha() or name[0] == "_")) and all(
        c.isascii() and (c.isalnum() or c == "_") for c in name
    )


def env_script(env: Mapping[str, str]) -> str:
    """The text of 10-docker2singularity.sh, as Apptainer writes it for OCI images:
    `export K="${K:-"v"}"` (a value already set in the environment wins), except PATH,
    which the image sets (Apptainer then appends its default PATH entries)."""
    lines = ["#!/bin/sh"]
    for key, value in env.items():
        if not _is_shell_name(key):
            raise ValueError(f"environment variable name {key!r} cannot be exported by sh")
        if "\0" in value:
            raise ValueError(f"environment variable {key} contains a NUL byte")
        quoted = _shell_double_quoted(value)
        if key == "PATH":
            lines.append(f'export PATH="{quoted}"')
        else:
            lines.append(f'export {key}="${{{key}:-"{quoted}"}}"')
    return "\n".join(lines) + "\n"


_RUNSCRIPT_TEXT = '#!/bin/sh\n# written by image_builder: run the command given, if any\nexec "$@"\n'


def _open_dir(parent_fd: int, name: str, shown: str) -> int:
    """Open (creating if needed) the directory `name` under parent_fd, never through a symlink."""
    try:
        os.mkdir(name, 0o755, dir_fd=parent_fd)
    except FileExistsError:
        pass
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as e:
        raise SifError(f"{shown} is not a directory (a symlink?): {e.strerror}") from None


def _write_at(dir_fd: int, name: str, data: bytes, mode: int) -> None:
    """Replace `name` in dir_fd atomically; an existing symlink is replaced, not followed."""
    tmp = f".{name}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def write_singularity_env(
    rootfs: Path | str,
    env: Mapping[str, str],
    *,
    labels: Mapping[str, str] | None = None,
    runscript: bool = True,
) -> None:
    """Write `/.singularity.d/env/10-docker2singularity.sh` (see env_script) and, unless
    runscript=False, a `/.singularity.d/runscript` that runs its arguments, so Apptainer
    users get the image's environment. With `labels`, also `/.singularity.d/labels.json`
    (what `apptainer inspect` shows). Nothing is written through a symlink: the root
    filesystem comes from untrusted layers."""
    rootfs = Path(rootfs)
    text = env_script(env)
    try:
        root_fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise SifError(f"cannot open root filesystem {rootfs}: {e.strerror}") from None
    fds = [root_fd]
    try:
        sd = _open_dir(root_fd, ".singularity.d", f"{rootfs}/.singularity.d")
        fds.append(sd)
        envd = _open_dir(sd, "env", f"{rootfs}/.singularity.d/env")
        fds.append(envd)
        _write_at(envd, "10-docker2singularity.sh", text.encode(), 0o755)
        if runscript:
            _write_at(sd, "runscript", _RUNSCRIPT_TEXT.encode(), 0o755)
        if labels is not None:
            _write_at(sd, "labels.json", _json_bytes(dict(labels), indent="\t"), 0o644)
    except OSError as e:
        raise SifError(f"cannot write /.singularity.d in {rootfs}: {e}") from None
    finally:
        for fd in reversed(fds):
            os.close(fd)

