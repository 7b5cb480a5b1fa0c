"""image_builder.pack.squashfs against the real mksquashfs, unsquashfs and squashfuse_ll."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from image_builder.pack.squashfs import SquashfsError, SquashOptions, mksquashfs_command, pack, read_superblock

EPOCH = 1_700_000_000


@contextlib.contextmanager
def squashfuse(image: Path, mnt: Path, offset: int = 0):
    mnt.mkdir(exist_ok=True)
    cmd = ["squashfuse_ll"] + (["-o", f"offset={offset}"] if offset else []) + [str(image), str(mnt)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)
    try:
        yield mnt
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True, capture_output=True, timeout=30)


def lls(image: Path) -> list[str]:
    """The lines of `unsquashfs -lls` (mode owner/group size-or-dev date time squashfs-root/path)."""
    out = subprocess.run(["unsquashfs", "-lls", str(image)], check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if " squashfs-root" in line]


def entry(image: Path, path: str) -> str:
    """The `unsquashfs -lls` line of one path inside the image."""
    for line in lls(image):
        name = line.split(" squashfs-root/", 1)[-1].split(" -> ")[0]
        if name == path:
            return line
    raise AssertionError(f"{path} not in {image}: {lls(image)}")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "usr" / "bin").mkdir(parents=True)
    (src / "etc" / "hello.txt").write_text("hello squashfs\n")
    (src / "usr" / "bin" / "tool").write_bytes(b"#!/bin/sh\necho tool\n" + os.urandom(50_000))
    (src / "usr" / "bin" / "tool").chmod(0o755)
    (src / "link").symlink_to("etc/hello.txt")
    for p in src.rglob("*"):
        os.utime(p, (EPOCH - 1000, EPOCH - 1000), follow_symlinks=False)
    return src


def test_pack_reads_back_through_squashfuse_and_unsquashfs(tree: Path, tmp_path: Path):
    dest = tmp_path / "out.sqfs"
    pack(tree, dest, SquashOptions())
    assert dest.read_bytes()[:4] == b"hsqs"
    sb = read_superblock(dest)
    assert sb.compression == "zstd" and sb.bytes_used <= dest.stat().st_size
    listing = subprocess.run(["unsquashfs", "-l", str(dest)], check=True, capture_output=True, text=True).stdout
    assert "squashfs-root/etc/hello.txt" in listing and "squashfs-root/usr/bin/tool" in listing
    with squashfuse(dest, tmp_path / "mnt") as mnt:
        assert (mnt / "etc" / "hello.txt").read_text() == "hello squashfs\n"
        assert (mnt / "usr" / "bin" / "tool").read_bytes() == (tree / "usr" / "bin" / "tool").read_bytes()
        assert os.readlink(mnt / "link") == "etc/hello.txt"
        assert (mnt / "usr" / "bin" / "tool").stat().st_mode & 0o777 == 0o755
    # only dest is left in the directory: no temporary file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt", "out.sqfs", "src"]


def test_pseudo_whiteout_is_a_char_device_0_0(tree: Path, tmp_path: Path):
    dest = tmp_path / "wh.sqfs"
    pack(tree, dest, SquashOptions(), pseudo=["etc/msg c 0 0 0 0 0", '"etc/with space" c 0 0 0 0 0'])
    line = entry(dest, "etc/msg")
    assert line.startswith("c"), line
    assert " 0,  0 " in line or " 0, 0 " in line, line
    assert entry(dest, "etc/with space").startswith("c")
    assert entry(dest, "etc/hello.txt").startswith("-")


def test_pseudo_whiteout_under_new_directories(tree: Path, tmp_path: Path):
    dest = tmp_path / "wh.sqfs"
    pack(tree, dest, SquashOptions(), pseudo=["var d 755 0 0", "var/lib d 755 0 0", "var/lib/gone c 0 0 0 0 0"])
    assert entry(dest, "var/lib/gone").startswith("c")
    assert entry(dest, "var/lib").startswith("d")


@pytest.mark.parametrize(
    ("definition", "needle"),
    [
        ("nodir/x c 0 0 0 0 0", "parent nodir is not a directory"),  # mksquashfs would drop it silently
        ("link/x c 0 0 0 0 0", "parent link is not a directory"),  # a symlink is not a directory in the image
        ("etc/hello.txt c 0 0 0 0 0", "already exists"),  # mksquashfs would ignore it
        ("etc/x q 0 0 0", "unknown type"),
        ("../x c 0 0 0 0 0", "bad path"),
        ("etc/a\nb c 0 0 0 0 0", "newline"),
    ],
)
def test_bad_pseudo_definitions_are_refused(tree: Path, tmp_path: Path, definition: str, needle: str):
    dest = tmp_path / "bad.sqfs"
    with pytest.raises(SquashfsError, match=needle):
        pack(tree, dest, SquashOptions(), pseudo=[definition])
    assert not dest.exists()


def test_all_root_makes_owners_root(tree: Path, tmp_path: Path):
    os.chown(tree / "etc" / "hello.txt", 1234, 5678)
    plain, rooted = tmp_path / "plain.sqfs", tmp_path / "root.sqfs"
    pack(tree, plain, SquashOptions())
    pack(tree, rooted, SquashOptions(all_root=True))
    assert "1234/5678" in entry(plain, "etc/hello.txt")
    assert "root/root" in entry(rooted, "etc/hello.txt")
    assert all("root/root" in line for line in lls(rooted))


def test_same_tree_same_mtime_is_byte_identical(tree: Path, tmp_path: Path):
    a, b, c = tmp_path / "a.sqfs", tmp_path / "b.sqfs", tmp_path / "c.sqfs"
    pack(tree, a, SquashOptions(mtime=EPOCH, all_time=True))
    os.utime(tree / "etc" / "hello.txt", None)  # file times are overridden by -all-time
    pack(tree, b, SquashOptions(mtime=EPOCH, all_time=True))
    pack(tree, c, SquashOptions(mtime=EPOCH + 1, all_time=True))
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert read_superblock(a).mkfs_time == EPOCH


def test_source_date_epoch_is_the_default_mtime(tree: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(EPOCH))
    a, b = tmp_path / "a.sqfs", tmp_path / "b.sqfs"
    pack(tree, a, SquashOptions())  # would fail if SOURCE_DATE_EPOCH reached mksquashfs with -mkfs-time
    pack(tree, b, SquashOptions(mtime=EPOCH))
    assert read_superblock(a).mkfs_time == EPOCH
    assert a.read_bytes() == b.read_bytes()


def test_file_mtimes_kept_unless_all_time(tree: Path, tmp_path: Path):
    dest = tmp_path / "keep.sqfs"
    pack(tree, dest, SquashOptions(mtime=EPOCH))
    assert read_superblock(dest).mkfs_time == EPOCH
    with squashfuse(dest, tmp_path / "mnt") as mnt:
        assert int((mnt / "etc" / "hello.txt").stat().st_mtime) == EPOCH - 1000
    dest2 = tmp_path / "all.sqfs"
    pack(tree, dest2, SquashOptions(mtime=EPOCH, all_time=True))
    with squashfuse(dest2, tmp_path / "mnt") as mnt:
        assert int((mnt / "etc" / "hello.txt").stat().st_mtime) == EPOCH


@pytest.mark.parametrize("compression", ["gzip", "lz4", "xz", "zstd"])
def test_compressors(tree: Path, tmp_path: Path, compression: str):
    dest = tmp_path / f"{compression}.sqfs"
    pack(tree, dest, SquashOptions(compression=compression, processors=1))
    assert read_superblock(dest).compression == compression
    cmd = mksquashfs_command(tree, dest, SquashOptions(compression=compression))
    assert ("-Xcompression-level" in cmd) == (compression in ("zstd", "gzip"))


def test_options_are_validated():
    with pytest.raises(ValueError, match="lzo"):
        SquashOptions(compression="lzo")
    with pytest.raises(ValueError, match="1-22"):
        SquashOptions(level=30)
    with pytest.raises(ValueError, match="1-9"):
        SquashOptions(compression="gzip", level=15)
    with pytest.raises(ValueError):
        SquashOptions(processors=0)
    with pytest.raises(ValueError):
        SquashOptions(mtime=-1)
    cmd = mksquashfs_command(Path("s"), Path("d"), SquashOptions(all_root=True, processors=2, all_time=True), mtime=5, offset=4096)
    for flag in ("-noappend", "-no-progress", "-quiet", "-all-root"):
        assert flag in cmd
    assert cmd[cmd.index("-processors") + 1] == "2"
    assert cmd[cmd.index("-mkfs-time") + 1] == "5" and cmd[cmd.index("-all-time") + 1] == "5"
    assert cmd[cmd.index("-offset") + 1] == "4096"
    assert cmd[cmd.index("-Xcompression-level") + 1] == "3"


def test_missing_source_fails_and_leaves_nothing(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SquashfsError) as e:
        pack(tmp_path / "nope", out / "x.sqfs", SquashOptions())
    assert str(tmp_path / "nope") in str(e.value)
    assert list(out.iterdir()) == []


def test_mksquashfs_failure_keeps_old_dest_and_no_temp(tree: Path, tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    dest = out / "x.sqfs"
    dest.write_bytes(b"previous good image")
    # a pseudo file whose generating command fails: mksquashfs itself fails
    with pytest.raises(SquashfsError) as e:
        pack(tree, dest, SquashOptions(), pseudo=["etc/gen f 644 0 0 exit 3"])
    message = str(e.value)
    assert "\n" not in message
    assert str(tree) in message and "etc/gen" in message
    assert e.value.stderr  # the whole tool output is kept for a log
    assert dest.read_bytes() == b"previous good image"
    assert [p.name for p in out.iterdir()] == ["x.sqfs"]


def test_pack_at_offset_in_place(tree: Path, tmp_path: Path):
    dest = tmp_path / "big.img"
    offset = 8192
    pack(tree, dest, SquashOptions(), offset=offset)
    data = dest.read_bytes()
    assert data[offset:offset + 4] == b"hsqs"
    assert read_superblock(dest, offset).bytes_used <= len(data) - offset
    with squashfuse(dest, tmp_path / "mnt", offset=offset) as mnt:
        assert (mnt / "etc" / "hello.txt").read_text() == "hello squashfs\n"


def test_read_superblock_rejects_non_squashfs(tmp_path: Path):
    f = tmp_path / "junk"
    f.write_bytes(b"x" * 200)
    with pytest.raises(SquashfsError, match="not a squashfs"):
        read_superblock(f)
    f.write_bytes(b"hsqs")
    with pytest.raises(SquashfsError, match="truncated"):
        read_superblock(f)
