"""image_builder.pack.sif against siftool, squashfuse_ll and the kernel's squashfs."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from image_builder.pack.sif import (DATA_OFFSET, DESCRIPTOR, DESCRIPTORS_OFFSET, DataType, FsType, PartType, SifError,
                                    arch_code, env_script, partition_offset, read_sif, write_sif, write_singularity_env)
from image_builder.pack.squashfs import SquashOptions

EPOCH = 1_700_000_000
DEFFILE = "Bootstrap: docker\nFrom: python:3.12\n"
LABELS = {"org.opencontainers.image.title": "demo", "build": "42"}
EXTRA = {"z-last.json": {"b": 1}, "oci-config.json": {"Env": ["PATH=/usr/bin", "A=1"]}}
GO_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
SQUASH = SquashOptions(mtime=EPOCH)


def siftool(*args: str) -> str:
    return subprocess.run(["siftool", *args], check=True, capture_output=True, text=True, timeout=60).stdout


@contextlib.contextmanager
def mounted(cmd: list[str], mnt: Path, unmount: list[str]):
    mnt.mkdir(exist_ok=True)
    subprocess.run(cmd + [str(mnt)], check=True, capture_output=True, timeout=30)
    try:
        yield mnt
    finally:
        subprocess.run(unmount + [str(mnt)], check=True, capture_output=True, timeout=30)


def make_rootfs(root: Path) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "os-release").write_text("ID=demo\n")
    (root / "data.bin").write_bytes(os.urandom(300_000))
    write_singularity_env(root, {"PATH": "/usr/local/bin:/usr/bin:/bin", "GREETING": "hi there"})
    return root


def build(tmp: Path, name: str = "img.sif", **kw) -> tuple[Path, Path]:
    rootfs = tmp / "rootfs"
    if not rootfs.exists():
        make_rootfs(rootfs)
    dest = tmp / name
    args = dict(deffile=DEFFILE, labels=LABELS, squash=SQUASH, created=EPOCH, extra_json=EXTRA)
    args.update(kw)
    write_sif(dest, rootfs, **args)
    return dest, rootfs


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    return build(tmp_path_factory.mktemp("sif"))


# --- writer, checked by siftool and by mounting -------------------------------------

def test_siftool_list_shows_our_objects(built):
    sif, _ = built
    rows = [line for line in siftool("list", str(sif)).splitlines() if line[:1].isdigit()]
    assert len(rows) == 5, rows
    types = [row.split("|")[-1].strip() for row in rows]
    assert types[:4] == ["Def.FILE", "JSON.Labels", "JSON.Generic", "JSON.Generic"]
    assert types[4] == f"FS (Squashfs/*System/{GO_ARCH})"
    start = int(rows[4].split("|")[3].split("-")[0])
    assert start % 4096 == 0 and start == partition_offset(sif)[0]


def test_siftool_info_and_header(built):
    sif, _ = built
    offset, size = partition_offset(sif)
    info = siftool("info", "5", str(sif))
    assert "Filesystem Type:  Squashfs" in info
    assert "Partition Type:   *System" in info  # *System = primary system partition
    assert f"Architecture:     {GO_ARCH}" in info
    assert f"Offset:           {offset}" in info and f"Size:             {size}" in info
    assert "oci-config.json" in siftool("info", "3", str(sif))
    header = siftool("header", str(sif))
    assert f"Primary Architecture: {GO_ARCH}" in header
    assert "Descriptors Free:     43" in header and "Descriptors Total:    48" in header
    assert f"Data Offset:          {DATA_OFFSET}" in header
    assert "2023-11-14 22:13:20" in header  # EPOCH
    assert siftool("dump", "1", str(sif)) == DEFFILE


def test_read_sif_agrees(built):
    sif, _ = built
    img = read_sif(sif)
    assert img.arch == arch_code() and img.id == bytes(16)
    assert img.created == img.modified == EPOCH
    kinds = [(d.datatype, d.name) for d in img.descriptors]
    assert kinds == [(DataType.DEFFILE, ""), (DataType.LABELS, "labels.json"),
                     (DataType.GENERIC_JSON, "oci-config.json"), (DataType.GENERIC_JSON, "z-last.json"),
                     (DataType.PARTITION, "")]
    assert [d.id for d in img.descriptors] == [1, 2, 3, 4, 5]
    assert all(d.group_id == 0xF0000001 and d.linked_id == 0 for d in img.descriptors)
    assert img.read_object(img.descriptors[0]).decode() == DEFFILE
    assert img.labels() == LABELS
    assert json.loads(img.read_object(img.descriptors[2])) == EXTRA["oci-config.json"]
    prim = img.primary_partition()
    assert (prim.fstype, prim.parttype, prim.arch) == (FsType.SQUASHFS, PartType.PRIMARY_SYSTEM, arch_code())
    assert img.descriptors[0].fstype is None
    assert prim.offset % 4096 == 0 and prim.offset + prim.size == sif.stat().st_size
    # objects are contiguous; size with padding counts the alignment gap
    end = DATA_OFFSET
    for d in img.descriptors:
        assert d.offset + d.size - d.size_with_padding == end
        end = d.offset + d.size
    assert img.data_size == sum(d.size_with_padding for d in img.descriptors) == end - DATA_OFFSET
    assert sif.read_bytes()[128:DESCRIPTORS_OFFSET] == bytes(DESCRIPTORS_OFFSET - 128)
    assert os.access(sif, os.X_OK)  # like apptainer: the launch script makes it executable


def test_partition_mounts_with_squashfuse_offset(built, tmp_path):
    sif, rootfs = built
    offset, _ = partition_offset(sif)
    with mounted(["squashfuse_ll", "-o", f"offset={offset}", str(sif)], tmp_path / "mnt",
                 ["fusermount3", "-u"]) as mnt:
        assert (mnt / "etc" / "os-release").read_text() == "ID=demo\n"
        assert (mnt / "data.bin").read_bytes() == (rootfs / "data.bin").read_bytes()
        assert (mnt / ".singularity.d" / "env" / "10-docker2singularity.sh").is_file()


def test_partition_mounts_with_kernel_loop_offset(built, tmp_path):
    sif, rootfs = built
    offset, _ = partition_offset(sif)
    with mounted(["mount", "-t", "squashfs", "-o", f"loop,ro,offset={offset}", str(sif)], tmp_path / "mnt",
                 ["umount"]) as mnt:
        assert (mnt / "data.bin").read_bytes() == (rootfs / "data.bin").read_bytes()
        assert os.access(mnt / ".singularity.d" / "runscript", os.X_OK)


def test_rebuild_is_byte_identical(tmp_path):
    a, _ = build(tmp_path, "a.sif")
    b, _ = build(tmp_path, "b.sif")
    c, _ = build(tmp_path, "c.sif", created=EPOCH + 1)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_source_date_epoch_gives_the_times(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(EPOCH))
    a, _ = build(tmp_path, "a.sif", created=None, squash=SquashOptions())
    b, _ = build(tmp_path, "b.sif")
    img = read_sif(a)
    assert img.created == EPOCH and all(d.created == EPOCH for d in img.descriptors)
    assert a.read_bytes() == b.read_bytes()


def test_explicit_arch(tmp_path):
    sif, _ = build(tmp_path, "arm.sif", arch="aarch64")
    assert read_sif(sif).arch == "04" and read_sif(sif).primary_partition().arch == "04"
    assert "FS (Squashfs/*System/arm64)" in siftool("list", str(sif))


def test_arch_codes():
    assert arch_code("x86_64") == arch_code("amd64") == arch_code("02") == "02"
    assert arch_code("aarch64") == arch_code("arm64") == "04"
    assert arch_code("riscv64") == "12"
    with pytest.raises(SifError, match="no SIF code"):
        arch_code("vax")


# --- reader errors ----------------------------------------------------------------

def test_truncated_file(built, tmp_path):
    sif, _ = built
    data = sif.read_bytes()
    for cut, needle in ((100, "too short"), (DESCRIPTORS_OFFSET + 1000, "descriptor table"),
                        (len(data) - 4096, "truncated")):
        bad = tmp_path / f"cut{cut}.sif"
        bad.write_bytes(data[:cut])
        with pytest.raises(SifError, match=needle) as e:
            read_sif(bad)
        assert str(bad) in str(e.value)


def test_bad_magic(built, tmp_path):
    data = bytearray(built[0].read_bytes())
    data[32:41] = b"NOT_MAGIC"
    bad = tmp_path / "magic.sif"
    bad.write_bytes(bytes(data))
    with pytest.raises(SifError, match="not a SIF file") as e:
        read_sif(bad)
    assert str(bad) in str(e.value)


def test_no_primary_partition(built, tmp_path):
    data = bytearray(built[0].read_bytes())
    # descriptor 5 is the partition: make it a plain system partition (parttype 1)
    extra_at = DESCRIPTORS_OFFSET + 4 * DESCRIPTOR.size + 201
    assert struct.unpack_from("<ii", data, extra_at) == (FsType.SQUASHFS, PartType.PRIMARY_SYSTEM)
    struct.pack_into("<i", data, extra_at + 4, PartType.SYSTEM)
    bad = tmp_path / "noprim.sif"
    bad.write_bytes(bytes(data))
    with pytest.raises(SifError, match="0 primary system partitions") as e:
        read_sif(bad)
    assert str(bad) in str(e.value)


def test_siftool_file_without_partition(tmp_path):
    sif = tmp_path / "empty.sif"
    siftool("new", str(sif))
    (tmp_path / "def").write_text(DEFFILE)
    siftool("add", "--datatype", "1", str(sif), str(tmp_path / "def"))
    with pytest.raises(SifError, match="0 primary system partitions") as e:
        read_sif(sif)
    assert str(sif) in str(e.value)


def test_primary_partition_not_squashfs(built, tmp_path):
    data = bytearray(built[0].read_bytes())
    offset = read_sif(built[0]).primary_partition().offset
    data[offset:offset + 4] = b"XXXX"
    bad = tmp_path / "nosq.sif"
    bad.write_bytes(bytes(data))
    with pytest.raises(SifError, match="not a squashfs"):
        read_sif(bad)


def test_reads_a_siftool_built_sif(tmp_path):
    """Our reader on a SIF written by the Go implementation."""
    src = make_rootfs(tmp_path / "r")
    sqfs = tmp_path / "r.sqfs"
    subprocess.run(["mksquashfs", str(src), str(sqfs), "-noappend", "-quiet"], check=True)
    sif = tmp_path / "go.sif"
    siftool("new", str(sif))
    siftool("add", "--datatype", "4", "--parttype", "2", "--partfs", "1", "--partarch", "4", str(sif), str(sqfs))
    img = read_sif(sif)
    prim = img.primary_partition()
    assert prim.arch == "04" and img.arch == "04" and prim.offset % 4096 == 0
    assert prim.size == sqfs.stat().st_size
    assert partition_offset(sif) == (prim.offset, prim.size)


# --- failed writes leave nothing behind ---------------------------------------------

def test_failed_write_leaves_no_temp_and_keeps_old_dest(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dest = out / "img.sif"
    dest.write_bytes(b"old image")
    with pytest.raises(SifError) as e:
        write_sif(dest, tmp_path / "missing-rootfs", deffile="", labels={}, squash=SQUASH, created=EPOCH)
    assert "missing-rootfs" in str(e.value) and "\n" not in str(e.value)
    assert dest.read_bytes() == b"old image"
    assert [p.name for p in out.iterdir()] == ["img.sif"]


def test_write_replaces_existing_dest(tmp_path):
    dest = tmp_path / "img.sif"
    dest.write_bytes(b"old image")
    build(tmp_path, "img.sif")
    assert read_sif(dest).primary_partition().size > 0
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# --- /.singularity.d/env ----------------------------------------------------------

VALUES = ["plain", "two  spaces", 'double "quotes"', "single 'quotes'", "$HOME ${X} $(echo no) `echo no`",
          "back\\slash\\", "brace } {", 'x}"}y', "line\nbreak", "tab\tend", "ünïcode", "", "*", "~/x", "!bang"]


@pytest.mark.parametrize("shell", ["sh", "bash", "dash"])
def test_env_script_values_roundtrip(tmp_path, shell):
    assert shutil.which(shell), f"{shell} is not installed"
    env = {f"V{i}": v for i, v in enumerate(VALUES)}
    write_singularity_env(tmp_path, env)
    script = tmp_path / ".singularity.d" / "env" / "10-docker2singularity.sh"
    clean = {"PATH": os.environ["PATH"], "HOME": "/nonexistent"}
    for key, value in env.items():
        out = subprocess.run([shell, "-c", f'. "$1"; printf %s "${key}"', "sh", str(script)],
                             capture_output=True, text=True, env=clean, check=True)
        assert out.stdout == value, (key, value)


def test_env_script_preset_value_wins_but_path_is_the_images(tmp_path):
    write_singularity_env(tmp_path, {"K": "image value", "PATH": "/opt/img/bin:/usr/bin"})
    script = tmp_path / ".singularity.d" / "env" / "10-docker2singularity.sh"
    base = {"PATH": "/usr/bin:/bin"}

    def run(env):
        return subprocess.run(["/bin/sh", "-c", '. "$1"; echo "$K|$PATH"', "sh", str(script)],
                              capture_output=True, text=True, env=env, check=True).stdout.strip()

    assert run(base) == "image value|/opt/img/bin:/usr/bin"
    assert run(base | {"K": "from host"}) == "from host|/opt/img/bin:/usr/bin"
    text = script.read_text()
    assert text.startswith("#!/bin/sh\n")
    assert 'export K="${K:-"image value"}"' in text
    assert os.access(script, os.X_OK)
    runscript = tmp_path / ".singularity.d" / "runscript"
    assert os.access(runscript, os.X_OK)
    out = subprocess.run([str(runscript), "echo", "ran"], capture_output=True, text=True, check=True).stdout
    assert out == "ran\n"


def test_env_script_bad_names():
    with pytest.raises(ValueError, match="cannot be exported"):
        env_script({"A-B": "x"})
    with pytest.raises(ValueError):
        env_script({"1X": "x"})


def test_env_writes_labels_and_overwrites(tmp_path):
    write_singularity_env(tmp_path, {"A": "1"}, labels={"k": "v"})
    write_singularity_env(tmp_path, {"A": "2"})
    sd = tmp_path / ".singularity.d"
    assert 'export A="${A:-"2"}"' in (sd / "env" / "10-docker2singularity.sh").read_text()
    assert json.loads((sd / "labels.json").read_text()) == {"k": "v"}
    assert not [p for p in sd.rglob("*") if ".tmp-" in p.name]


def test_env_never_writes_through_symlinks(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    # an image whose /.singularity.d points outside the root filesystem
    (root / ".singularity.d").symlink_to(outside)
    with pytest.raises(SifError, match="not a directory"):
        write_singularity_env(root, {"A": "1"})
    assert list(outside.iterdir()) == []
    # an image whose env script is a symlink to a host file: replaced, not followed
    (root / ".singularity.d").unlink()
    (root / ".singularity.d" / "env").mkdir(parents=True)
    victim = outside / "victim"
    victim.write_text("keep me")
    (root / ".singularity.d" / "env" / "10-docker2singularity.sh").symlink_to(victim)
    (root / ".singularity.d" / "runscript").symlink_to(victim)
    write_singularity_env(root, {"A": "1"})
    assert victim.read_text() == "keep me"
    script = root / ".singularity.d" / "env" / "10-docker2singularity.sh"
    assert not script.is_symlink() and "export A=" in script.read_text()
