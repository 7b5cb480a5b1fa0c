"""Tests for image_builder.oci.layers: OCI layer changesets flattened into a directory.

Layers are built here with tarfile; the malicious ones check that nothing outside
the root changed by comparing a snapshot of everything next to it.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import lzma
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
import zstandard

from image_builder.oci.layers import FlattenReport, LayerError, apply_tar_layer, flatten, open_layer

MTIME = 1_600_000_000
NOBODY = 65534


# -- building layers -----------------------------------------------------------


def _info(name: str, type_: bytes, mode: int, mtime: float = MTIME, uid: int = 0, gid: int = 0) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.mtime, ti.uid, ti.gid = type_, mode, mtime, uid, gid
    return ti


def reg(name: str, data: bytes = b"", mode: int = 0o644, **kw):
    ti = _info(name, tarfile.REGTYPE, mode, **kw)
    ti.size = len(data)
    return ti, data


def d(name: str, mode: int = 0o755, **kw):
    return _info(name, tarfile.DIRTYPE, mode, **kw), b""


def sym(name: str, target: str, **kw):
    ti = _info(name, tarfile.SYMTYPE, 0o777, **kw)
    ti.linkname = target
    return ti, b""


def hard(name: str, target: str):
    ti = _info(name, tarfile.LNKTYPE, 0o644)
    ti.linkname = target
    return ti, b""


def dev(name: str, major: int = 1, minor: int = 3, type_: bytes = tarfile.CHRTYPE):
    ti = _info(name, type_, 0o666)
    ti.devmajor, ti.devminor = major, minor
    return ti, b""


def tar_bytes(*members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if data else None)
    return buf.getvalue()


def zstd_two_frames(raw: bytes) -> bytes:
    # Like zstd:chunked: independently compressed frames, one after the other.
    half = len(raw) // 2
    return zstandard.ZstdCompressor().compress(raw[:half]) + zstandard.ZstdCompressor().compress(raw[half:])


COMPRESS = {
    "gzip": gzip.compress,
    "zstd": zstd_two_frames,
    "xz": lzma.compress,
    "plain": lambda raw: raw,
}


class Box:
    """A tmp dir holding root/, outside/ (a sentinel next to the root) and the layer files."""

    def __init__(self, base: Path):
        self.base = base
        self.root = base / "root"
        self.root.mkdir()
        self.outside = base / "outside"
        (self.outside / "sub").mkdir(parents=True)
        (self.outside / "sentinel").write_text("outside data")
        (self.outside / "sub" / "inner").write_text("inner data")
        os.utime(self.outside / "sub", ns=(MTIME * 10**9,) * 2)
        self.layer_dir = base / "layers"
        self.layer_dir.mkdir()
        self._n = 0

    def layer(self, *members, compression: str = "gzip") -> Path:
        self._n += 1
        path = self.layer_dir / f"layer{self._n}"  # no extension: the format is sniffed
        path.write_bytes(COMPRESS[compression](tar_bytes(*members)))
        return path

    def in_root(self, host_path: Path | str) -> Path:
        """Where an absolute path lands when taken relative to the root."""
        return self.root / str(host_path).lstrip("/")

    def snapshot(self) -> dict:
        """Everything under base except root: names, types, modes, contents, mtimes, link counts."""
        snap = {}
        for dirpath, dirnames, filenames in os.walk(self.base):
            if Path(dirpath) == self.base:
                dirnames.remove("root")
            for name in [".", *dirnames, *filenames]:
                path = Path(dirpath, name)
                st = path.lstat()
                content = path.read_bytes() if stat.S_ISREG(st.st_mode) else None
                if stat.S_ISLNK(st.st_mode):
                    content = os.readlink(path)
                snap[str(path)] = (st.st_mode, st.st_uid, st.st_nlink, st.st_mtime_ns, st.st_ctime_ns, content)
        return snap

    @contextlib.contextmanager
    def untouched(self):
        before = self.snapshot()
        yield
        assert self.snapshot() == before, "something outside the root changed"


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def assert_no_markers(root: Path) -> None:
    assert not [p for p in tree(root) if Path(p).name.startswith(".wh.")]


# -- formats -------------------------------------------------------------------


@pytest.mark.parametrize("compression", sorted(COMPRESS))
def test_formats_are_sniffed(box: Box, compression: str):
    # Enough data that the zstd split falls inside file contents, not just headers.
    big = os.urandom(300_000)
    layer = box.layer(d("etc"), reg("etc/a", b"alpha"), reg("big", big), reg("etc/z", b"last"), compression=compression)
    report = flatten([layer], box.root)
    assert (box.root / "etc/a").read_bytes() == b"alpha"
    assert (box.root / "big").read_bytes() == big
    assert (box.root / "etc/z").read_bytes() == b"last"
    assert report.entries == 4 and report.layers == 1 and report.bytes_written == len(big) + 9


def test_zstd_layer_really_has_two_frames(box: Box):
    layer = box.layer(reg("a", b"x" * 100_000), reg("b", b"y"), compression="zstd")
    full = open_layer(layer).read()
    with zstandard.ZstdDecompressor().stream_reader(layer.open("rb"), read_across_frames=False) as first:
        assert len(first.read(len(full))) < len(full)  # one read stops at the end of a frame
    assert full == tar_bytes(reg("a", b"x" * 100_000), reg("b", b"y"))


def test_empty_layer(box: Box):
    # The usual "empty layer" blob: a gzipped tar holding only the end-of-archive blocks.
    layer = box.layer_dir / "empty"
    layer.write_bytes(gzip.compress(b"\0" * 1024))
    assert flatten([layer], box.root).entries == 0
    assert tree(box.root) == set()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_layer_is_a_layer_error(box: Box, damage: str):
    good = box.layer(reg("a", os.urandom(100_000)))
    bad = box.layer_dir / "bad"
    bad.write_bytes(good.read_bytes()[:5000] if damage == "truncated" else b"not a tar at all" * 100)
    with pytest.raises(LayerError, match=f"{bad}.*pull again"):
        flatten([bad], box.root)


@pytest.mark.parametrize("cut, accepted", [(0, True), (10, False), (-5, False)])
def test_a_layer_ending_right_after_its_last_file_s_data_is_read_as_go_reads_it(box: Box, cut: int, accepted: bool):
    """umoci 0.4.7's `insert` writes no padding after the last file and no end blocks; Go's
    archive/tar (Docker, containerd, umoci itself) reads such a layer whole. Cut anywhere
    else (in the padding, in the data) it is still a corrupt layer."""
    raw = tar_bytes(reg("d/first", b"1" * 600), reg("d/last", b"the last file, 31 bytes long..\n"))
    end = 512 + 1024 + 512 + 31  # header, data padded, header, data: what umoci writes
    bad = box.layer_dir / "unpadded"
    bad.write_bytes(gzip.compress(raw[:end + cut]))
    if accepted:
        assert flatten([bad], box.root).entries == 2
        assert (box.root / "d/last").read_bytes() == b"the last file, 31 bytes long..\n"
    else:
        with pytest.raises(LayerError, match="unreadable tar stream"):
            flatten([bad], box.root)


def test_root_is_created(tmp_path: Path):
    box = Box(tmp_path)
    layer = box.layer(reg("f", b"1"))
    root = tmp_path / "new" / "rootfs"
    apply_tar_layer(layer, root)
    assert (root / "f").read_bytes() == b"1"


# -- changeset semantics ---------------------------------------------------------


def test_later_layer_overwrites(box: Box):
    l1 = box.layer(d("etc"), reg("etc/conf", b"one"), reg("etc/keep", b"keep"))
    l2 = box.layer(reg("etc/conf", b"two, longer"))
    flatten([l1, l2], box.root)
    assert (box.root / "etc/conf").read_bytes() == b"two, longer"
    assert (box.root / "etc/keep").read_bytes() == b"keep"


def test_file_whiteout(box: Box):
    l1 = box.layer(d("etc"), reg("etc/a", b"a"), reg("etc/b", b"b"), d("gone"), reg("gone/x", b"x"))
    l2 = box.layer(reg("etc/.wh.a"), reg(".wh.gone"), reg(".wh.never-existed"))
    report = flatten([l1, l2], box.root)
    assert tree(box.root) == {"etc", "etc/b"}
    assert report.whiteouts == 2


@pytest.mark.parametrize("marker_first", [True, False], ids=["marker-first", "marker-last"])
def test_opaque_whiteout(box: Box, marker_first: bool):
    l1 = box.layer(
        d("d"), reg("d/old", b"old"), d("d/sub"), reg("d/sub/old2", b"old2"), reg("d/sub/both", b"lower"),
        d("d/emptied"), reg("d/emptied/old3"), d("other"), reg("other/keep", b"keep"),
    )
    marker = [reg("d/.wh..wh..opq")]
    own = [d("d/sub"), d("d/emptied"), reg("d/new", b"new"), reg("d/sub/new2", b"new2"), reg("d/sub/both", b"upper")]
    l2 = box.layer(d("d"), *(marker + own if marker_first else own + marker))
    report = flatten([l1, l2], box.root)
    assert tree(box.root) == {"d", "d/new", "d/sub", "d/sub/new2", "d/sub/both", "d/emptied", "other", "other/keep"}
    assert (box.root / "d/sub/both").read_bytes() == b"upper"
    assert report.opaque_dirs == 1


@pytest.mark.parametrize("marker_first", [True, False], ids=["marker-first", "marker-last"])
def test_whiteout_spares_the_same_layers_file(box: Box, marker_first: bool):
    l1 = box.layer(reg("f", b"lower"), d("dir"), reg("dir/lower", b"l"))
    marker = [reg(".wh.f"), reg(".wh.dir")]
    own = [reg("f", b"upper"), reg("dir/upper", b"u")]
    l2 = box.layer(*(marker + own if marker_first else own + marker))
    flatten([l1, l2], box.root)
    assert (box.root / "f").read_bytes() == b"upper"
    # The lower directory's contents are hidden, this layer's file in it stays.
    assert tree(box.root) == {"f", "dir", "dir/upper"}


def test_aufs_metadata_is_not_content(box: Box):
    layer = box.layer(d(".wh..wh.plnk"), reg(".wh..wh.aufs"), reg("a", b"a"))
    flatten([layer], box.root)
    assert tree(box.root) == {"a"}


def test_type_replacements(box: Box):
    l1 = box.layer(
        d("was_dir"), d("was_dir/deep"), reg("was_dir/deep/f", b"f"),
        reg("was_file", b"f"),
        d("dir_to_link"), reg("dir_to_link/f", b"f"),
        d("stays", mode=0o755), reg("stays/child", b"c"),
    )
    l2 = box.layer(
        reg("was_dir", b"now a file"),
        d("was_file"), reg("was_file/child", b"c"),
        sym("dir_to_link", "stays"),
        d("stays", mode=0o700),
    )
    flatten([l1, l2], box.root)
    assert (box.root / "was_dir").read_bytes() == b"now a file"
    assert (box.root / "was_file/child").read_bytes() == b"c"
    assert os.readlink(box.root / "dir_to_link") == "stays"
    # A directory over a directory keeps the children and takes the new metadata.
    assert (box.root / "stays/child").read_bytes() == b"c"
    assert stat.S_IMODE((box.root / "stays").stat().st_mode) == 0o700


def test_symlinked_parents_resolve_inside_root(box: Box):
    # Usrmerge-style links: absolute targets restart at the root, relative ones at the link's directory.
    layer = box.layer(
        d("usr/bin"), sym("bin", "usr/bin"), reg("bin/sh", b"sh"),
        sym("etc/alternatives/dir", "/usr/lib/x"), reg("etc/alternatives/dir/f", b"abs"),
    )
    flatten([layer], box.root)
    assert (box.root / "usr/bin/sh").read_bytes() == b"sh"
    assert (box.root / "usr/lib/x/f").read_bytes() == b"abs"
    assert tree(box.root / "etc") == {"alternatives", "alternatives/dir"}


@pytest.mark.parametrize("later_layer", [False, True], ids=["same-layer", "later-layer"])
def test_replaced_symlink_is_not_resolved_from_cache(box: Box, later_layer: bool):
    first = [d("one"), d("two"), sym("link", "one"), reg("link/a", b"a"), d("dir"), reg("dir/b", b"b")]
    second = [sym("link", "two"), reg("link/c", b"c"), sym("dir", "two"), reg("dir/d", b"d")]
    layers = [box.layer(*first), box.layer(*second)] if later_layer else [box.layer(*first, *second)]
    flatten(layers, box.root)
    assert tree(box.root / "one") == {"a"}
    assert tree(box.root / "two") == {"c", "d"}


def test_hardlinks(box: Box):
    l1 = box.layer(d("bin"), reg("bin/python3.11", b"ELF..."), sym("bin/python3", "python3.11"))
    l2 = box.layer(hard("bin/python", "bin/python3.11"), hard("/bin/py3", "./bin/python3"), reg("x", b"x"), hard("y", "x"))
    flatten([l1, l2], box.root)
    b = box.root / "bin"
    assert (b / "python").stat().st_ino == (b / "python3.11").stat().st_ino
    assert (b / "python3.11").stat().st_nlink == 2
    # A hardlink to a symlink links the symlink itself.
    assert os.readlink(b / "py3") == "python3.11"
    assert (b / "py3").lstat().st_ino == (b / "python3").lstat().st_ino
    assert (box.root / "y").stat().st_ino == (box.root / "x").stat().st_ino


def test_symlinks_are_kept_verbatim(box: Box):
    layer = box.layer(
        sym("abs", "/usr/lib/x"), sym("rel", "../../up/../there"), sym("dangling", "nowhere"), sym("dot", "."),
    )
    flatten([layer], box.root)
    assert {name: os.readlink(box.root / name) for name in ("abs", "rel", "dangling", "dot")} == {
        "abs": "/usr/lib/x", "rel": "../../up/../there", "dangling": "nowhere", "dot": ".",
    }


def test_modes_mtimes_and_ownership_as_root(box: Box):
    layer = box.layer(
        d("app", mode=0o711, mtime=MTIME + 1, uid=1000, gid=1000),
        # Written after the directory entry, which must not disturb its mtime.
        reg("app/suid", b"#!", mode=0o4755, mtime=MTIME + 2, uid=0, gid=0),
        reg("app/secret", b"s", mode=0o600, mtime=MTIME + 3, uid=1234, gid=5678),
        d("app/ro", mode=0o555, mtime=MTIME + 4),
        reg("app/ro/f", b"f", mode=0o444, mtime=MTIME + 5),
        sym("app/link", "secret", mtime=MTIME + 6, uid=42, gid=43),
    )
    flatten([layer], box.root)
    app = box.root / "app"

    def meta(p: Path):
        st = p.lstat()
        return stat.S_IMODE(st.st_mode), st.st_mtime_ns // 10**9, st.st_uid, st.st_gid

    assert meta(app) == (0o711, MTIME + 1, 1000, 1000)
    assert meta(app / "suid") == (0o4755, MTIME + 2, 0, 0)
    assert meta(app / "secret") == (0o600, MTIME + 3, 1234, 5678)
    assert meta(app / "ro") == (0o555, MTIME + 4, 0, 0)
    assert meta(app / "ro/f") == (0o444, MTIME + 5, 0, 0)
    assert meta(app / "link")[1:] == (MTIME + 6, 42, 43)


def test_dir_mtime_survives_later_whiteouts(box: Box):
    l1 = box.layer(d("d"), reg("d/a"), reg("d/b"))
    l2 = box.layer(d("d", mtime=MTIME + 7), reg("d/.wh.a"), reg("d/c"))
    flatten([l1, l2], box.root)
    assert tree(box.root) == {"d", "d/b", "d/c"}
    assert (box.root / "d").stat().st_mtime == MTIME + 7


def test_device_nodes_as_root(box: Box):
    fifo = _info("dev/fifo", tarfile.FIFOTYPE, 0o620), b""
    layer = box.layer(d("dev"), dev("dev/null", 1, 3), dev("dev/loop0", 7, 0, tarfile.BLKTYPE), fifo)
    report = flatten([layer], box.root)
    null, loop = (box.root / "dev/null").lstat(), (box.root / "dev/loop0").lstat()
    assert stat.S_ISCHR(null.st_mode) and os.major(null.st_rdev) == 1 and os.minor(null.st_rdev) == 3
    assert stat.S_ISBLK(loop.st_mode) and os.major(loop.st_rdev) == 7
    assert stat.S_IMODE(null.st_mode) == 0o666
    fifo_st = (box.root / "dev/fifo").lstat()
    assert stat.S_ISFIFO(fifo_st.st_mode) and stat.S_IMODE(fifo_st.st_mode) == 0o620
    assert report.skipped == []


def test_rootless_flag_skips_devices(box: Box):
    layer = box.layer(d("dev"), dev("dev/null"), hard("dev/null2", "dev/null"), reg("dev/ok", b"ok"))
    report = flatten([layer], box.root, rootless=True)
    assert tree(box.root) == {"dev", "dev/ok"}
    assert report.skipped == ["dev/null: character device (rootless)", "dev/null2: hardlink to skipped dev/null"]


@pytest.fixture
def nobody_dir():
    # tmp_path sits under a root-only directory; the unprivileged user needs its own.
    path = Path(tempfile.mkdtemp(prefix="layers-rootless-"))
    os.chown(path, NOBODY, NOBODY)
    yield path
    shutil.rmtree(path)


def run_as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
        capture_output=True, text=True, timeout=120,
    )


def test_rootless_as_unprivileged_user(nobody_dir: Path):
    usable = run_as_nobody(sys.executable, "-c", "import image_builder")
    assert usable.returncode == 0, f"uid {NOBODY} cannot import image_builder: {usable.stderr}"
    l1 = nobody_dir / "l1.tar.gz"
    l1.write_bytes(gzip.compress(tar_bytes(
        d("dev"), dev("dev/null", 1, 3), dev("dev/sda", 8, 0, tarfile.BLKTYPE),
        d("ro", mode=0o555), reg("ro/f", b"f", mode=0o000), d("locked", mode=0o000), reg("locked/f", b"l"),
        reg("usr/bin/tool", b"t", mode=0o4711, uid=0),
    )))
    # A later layer must still be able to change the read-only directories.
    l2 = nobody_dir / "l2.tar.gz"
    l2.write_bytes(gzip.compress(tar_bytes(reg("ro/.wh.f"), reg("ro/g", b"g", mode=0o200), reg(".wh.locked"))))
    root = nobody_dir / "root"
    code = (
        "import dataclasses, json, sys; from pathlib import Path; from image_builder.oci.layers import flatten; "
        "print(json.dumps(dataclasses.asdict(flatten([Path(p) for p in sys.argv[2:]], Path(sys.argv[1])))))"
    )
    done = run_as_nobody(sys.executable, "-c", code, str(root), str(l1), str(l2))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["skipped"] == ["dev/null: character device (rootless)", "dev/sda: block device (rootless)"]
    assert tree(root) == {"dev", "ro", "ro/g", "usr", "usr/bin", "usr/bin/tool"}
    assert stat.S_IMODE((root / "ro").stat().st_mode) == 0o755  # 0555 + u+rwx
    assert stat.S_IMODE((root / "ro/g").stat().st_mode) == 0o600  # 0200 + u+r
    assert stat.S_IMODE((root / "usr/bin/tool").stat().st_mode) == 0o4711
    assert {p.stat().st_uid for p in [root, *root.rglob("*")]} == {NOBODY}
    # The tree can be deleted without root.
    removed = run_as_nobody("rm", "-rf", str(root))
    assert removed.returncode == 0, removed.stderr
    assert not root.exists()


# -- malicious layers ------------------------------------------------------------


@pytest.mark.parametrize("name", ["../escape", "a/../../escape", "./../escape/", "a/.wh..."])
def test_dotdot_entries_are_refused(box: Box, name: str):
    layer = box.layer(reg("before", b"b"), reg(name, b"pwned"))
    with box.untouched(), pytest.raises(LayerError, match=rf"{layer}.*{re.escape(name)}.*refusing"):
        flatten([layer], box.root)


def test_absolute_entries_land_in_root(box: Box):
    existed = os.path.lexists("/etc/x")
    target = box.outside / "sentinel"
    layer = box.layer(reg("/etc/x", b"abs"), reg(str(target), b"pwned"))
    with box.untouched():
        flatten([layer], box.root)
    assert (box.root / "etc/x").read_bytes() == b"abs"
    assert box.in_root(target).read_bytes() == b"pwned"
    assert os.path.lexists("/etc/x") == existed


@pytest.mark.parametrize("later_layer", [False, True], ids=["same-layer", "later-layer"])
def test_write_through_absolute_symlink_stays_in_root(box: Box, later_layer: bool):
    plant = [sym("evil", str(box.outside)), sym("evil2", str(box.outside / "sub"))]
    attack = [reg("evil/sentinel", b"pwned"), reg("evil/new", b"pwned"), d("evil2", mode=0o700), reg("evil2/inner", b"x")]
    layers = [box.layer(*plant), box.layer(*attack)] if later_layer else [box.layer(*plant, *attack)]
    with box.untouched():
        flatten(layers, box.root)
    assert box.in_root(box.outside / "sentinel").read_bytes() == b"pwned"
    assert box.in_root(box.outside / "new").read_bytes() == b"pwned"
    # The directory entry replaced the symlink rather than chmod'ing its target.
    assert stat.S_ISDIR((box.root / "evil2").lstat().st_mode)
    assert (box.root / "evil2/inner").read_bytes() == b"x"


def test_write_through_relative_symlink_is_clamped(box: Box):
    layer = box.layer(
        sym("a/b/evil", "../../../../.."), reg("a/b/evil/x", b"clamped"),
        sym("up", "../outside"), reg("up/sentinel", b"pwned"),
    )
    with box.untouched():
        flatten([layer], box.root)
    assert (box.root / "x").read_bytes() == b"clamped"
    assert (box.root / "outside/sentinel").read_bytes() == b"pwned"


@pytest.mark.parametrize("later_layer", [False, True], ids=["same-layer", "later-layer"])
def test_file_over_symlink_replaces_the_link(box: Box, later_layer: bool):
    plant = [sym("link", str(box.outside / "sentinel")), sym("rel", "../outside/sentinel")]
    attack = [reg("link", b"pwned", mode=0o777), reg("rel", b"pwned too")]
    layers = [box.layer(*plant), box.layer(*attack)] if later_layer else [box.layer(*plant, *attack)]
    with box.untouched():
        flatten(layers, box.root)
    assert not (box.root / "link").is_symlink()
    assert (box.root / "link").read_bytes() == b"pwned"
    assert (box.root / "rel").read_bytes() == b"pwned too"


@pytest.mark.parametrize("target", ["../outside/sentinel", "a/../../outside/sentinel"])
def test_hardlink_with_dotdot_is_refused(box: Box, target: str):
    layer = box.layer(hard("stolen", target))
    with box.untouched(), pytest.raises(LayerError, match=r"'stolen'.*outside the root"):
        flatten([layer], box.root)
    assert not (box.root / "stolen").exists()


@pytest.mark.parametrize("via_symlink", [False, True], ids=["absolute-path", "planted-symlink"])
def test_hardlink_to_outside_file_is_refused(box: Box, via_symlink: bool):
    if via_symlink:
        layers = [box.layer(sym("evil", str(box.outside))), box.layer(hard("stolen", "evil/sentinel"))]
    else:
        layers = [box.layer(hard("stolen", str(box.outside / "sentinel")))]
    with box.untouched(), pytest.raises(LayerError, match=r"'stolen'.*not a file in the root"):
        flatten(layers, box.root)


def test_hardlink_through_symlink_resolves_inside_root(box: Box):
    layer = box.layer(reg("inroot", b"mine"), sym("a/up", "../../../.."), hard("linked", "a/up/inroot"))
    with box.untouched():
        flatten([layer], box.root)
    assert (box.root / "linked").stat().st_ino == (box.root / "inroot").stat().st_ino


def test_hardlink_to_directory_is_refused(box: Box):
    layer = box.layer(d("dir"), hard("linked", "dir"))
    with pytest.raises(LayerError, match=r"'linked'.*not a file in the root"):
        flatten([layer], box.root)


@pytest.mark.parametrize("target", ["abs", "../../.."])
def test_whiteout_through_symlink_stays_in_root(box: Box, target: str):
    link = str(box.outside) if target == "abs" else target
    inside = box.in_root(box.outside) if target == "abs" else box.root
    l1 = box.layer(sym("evil", link), reg(str(inside.relative_to(box.root) / "sentinel"), b"inside copy"))
    l2 = box.layer(reg("evil/.wh.sentinel"), reg("evil/sub/.wh.inner"))
    with box.untouched():
        flatten([l1, l2], box.root)
    # The whiteout resolved inside the root and removed the copy there.
    assert not (inside / "sentinel").exists()
    assert (box.root / "evil").is_symlink()


@pytest.mark.parametrize("target", ["abs", ".."])
def test_opaque_marker_in_symlinked_dir_stays_in_root(box: Box, target: str):
    link = str(box.outside) if target == "abs" else target
    l1 = box.layer(sym("evil", link), reg("lower", b"lower"))
    l2 = box.layer(reg("evil/.wh..wh..opq"), reg("upper", b"upper"))
    with box.untouched():
        flatten([l1, l2], box.root)
    if target == "..":  # "evil -> .." is the root itself: its lower contents are hidden
        assert tree(box.root) == {"upper"}
    else:
        assert tree(box.root) == {"evil", "lower", "upper"}


def test_deferred_dir_metadata_never_follows_a_later_symlink(box: Box):
    # The directory's mode and mtime are set at the end of the layer; by then it is a symlink.
    layer = box.layer(d("victim", mode=0o777, mtime=1), sym("victim", str(box.outside)))
    with box.untouched():
        flatten([layer], box.root)
    assert os.readlink(box.root / "victim") == str(box.outside)


@pytest.mark.parametrize("links", [[("a", "b"), ("b", "a")], [("self", "self/x")], [("abs", "/abs")]])
def test_symlink_loop_is_refused(box: Box, links):
    layer = box.layer(*[sym(name, target) for name, target in links], reg(f"{links[0][0]}/file", b"x"))
    with box.untouched(), pytest.raises(LayerError, match=rf"'{links[0][0]}/file'.*symbolic links"):
        flatten([layer], box.root)


def test_long_symlink_chain_within_limit_is_followed(box: Box):
    chain = [sym(f"l{i}", f"l{i + 1}") for i in range(39)] + [d("l39")]
    layer = box.layer(*chain, reg("l0/file", b"end"))
    flatten([layer], box.root)
    assert (box.root / "l39/file").read_bytes() == b"end"


def test_report_is_shared_across_apply_tar_layer_calls(box: Box):
    report = FlattenReport()
    apply_tar_layer(box.layer(reg("a"), reg("b")), box.root, report=report)
    apply_tar_layer(box.layer(reg(".wh.a")), box.root, report=report)
    assert (report.layers, report.entries, report.whiteouts) == (2, 3, 1)
    assert_no_markers(box.root)
    assert tree(box.root) == {"b"}


def test_many_directories_outlive_the_handle_cache(box: Box):
    # More directories than the cache keeps open, revisited by a later layer.
    l1 = box.layer(*[reg(f"d{i}/sub/a", b"a") for i in range(700)])
    l2 = box.layer(*[reg(f"d{i}/sub/b", str(i).encode()) for i in range(700) if i != 5], reg("d5/.wh.sub"))
    flatten([l1, l2], box.root)
    assert (box.root / "d699/sub/b").read_bytes() == b"699"
    assert len(tree(box.root)) == 700 * 4 - 3
    assert tree(box.root / "d5") == set()
