"""image_builder/runtime/native/squashfuse_cached (built by `make`) against Debian's squashfuse_ll:
the same file system, rootless, but the kernel serves repeated opens, listings and
symlinks from its caches."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from image_builder.pack.squashfs import SquashOptions, pack
from image_builder.runtime.mounts import SQUASHFUSE_ENV, fuse_mount, squashfuse

NOBODY = 65534
CACHED = Path(sys.executable).parent / "squashfuse_cached"
PROGRAMS = {"squashfuse_cached": str(CACHED), "squashfuse_ll": "squashfuse_ll"}

# Prints one JSON record per path of the tree at argv[1]: what a reader of the mount sees.
WALK = r"""
import hashlib, json, os, stat, sys
top = sys.argv[1]
out = {}
for d, dirs, files in os.walk(top):
    dirs.sort()
    for name in sorted(dirs + files):
        p = os.path.join(d, name)
        st = os.lstat(p)
        rec = {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid, "size": st.st_size, "nlink": st.st_nlink,
               "mtime": st.st_mtime_ns, "rdev": st.st_rdev, "ino": st.st_ino,
               "xattrs": {k: os.getxattr(p, k, follow_symlinks=False).hex()
                          for k in sorted(os.listxattr(p, follow_symlinks=False))}}
        if stat.S_ISLNK(st.st_mode):
            rec["target"] = os.readlink(p)
        elif stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                rec["sha256"] = hashlib.sha256(f.read()).hexdigest()
        out[os.path.relpath(p, top)] = rec
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def base() -> Path:
    """Where uid 65534 can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="ib-cached-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def image(base) -> Path:
    """A tree with what trips a FUSE server up: a directory needing many readdir replies,
    every file type, long and dangling symlinks, hard links, multi-block files, xattrs."""
    src = base / "src"
    (src / "many").mkdir(parents=True)
    for i in range(3000):
        (src / "many" / (f"{i:04d}-" + "n" * 120)).write_bytes(b"%d\n" % i)
    (src / "data").mkdir()
    big = os.urandom(3 << 20)
    (src / "data" / "big").write_bytes(big)
    os.link(src / "data" / "big", src / "data" / "hard")
    (src / "data" / "empty").write_bytes(b"")
    (src / "data" / "tail").write_bytes(os.urandom(1000))  # lives in a fragment
    (src / "data" / "setuid").write_bytes(b"#!/bin/sh\n")
    (src / "data" / "setuid").chmod(0o4751)
    (src / "data" / "secret").write_bytes(b"root only\n")
    (src / "data" / "secret").chmod(0o600)
    os.setxattr(src / "data" / "tail", "user.note", b"kept")
    (src / "links").mkdir()
    (src / "links" / "relative").symlink_to("../data/big")
    (src / "links" / "dangling").symlink_to("/nowhere/at/all")
    (src / "links" / "long").symlink_to("x/" * 500 + "end")
    (src / "links" / "loop").symlink_to("loop")
    (src / "special").mkdir()
    os.mknod(src / "special" / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mkfifo(src / "special" / "fifo")
    (src / "empty-dir").mkdir()
    os.chown(src / "data" / "empty", 1234, 5678)
    out = base / "image.sqfs"
    pack(src, out, SquashOptions())
    out.chmod(0o644)
    return out


@contextlib.contextmanager
def mounted(program: str, image: Path, point: Path, user: int | None = None, debug_log: Path | None = None):
    """`program` mounts `image` at `point` (as `user`); with `debug_log`, in the foreground
    with FUSE's request log there."""
    point.mkdir(exist_ok=True)
    prefix = []
    if user is not None:
        os.chown(point, user, user)
        prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
    cmd = [*prefix, program, "-o", "offset=0", str(image), str(point)]
    daemon = None
    if debug_log is None:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"{cmd}: {r.stderr}"
    else:
        daemon = subprocess.Popen([*cmd[:-2], "-f", "-d", *cmd[-2:]], stderr=debug_log.open("wb"))
        deadline = time.monotonic() + 10
        while not os.path.ismount(point):
            assert daemon.poll() is None and time.monotonic() < deadline, debug_log.read_text(errors="replace")
            time.sleep(0.02)
    try:
        yield point
    finally:
        subprocess.run([*prefix, "fusermount3", "-u", str(point)], check=True, capture_output=True, timeout=30)
        if daemon:
            daemon.wait(timeout=10)


def walk(top: Path, user: int | None = None) -> dict:
    prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
    out = subprocess.run([*prefix, sys.executable, "-I", "-c", WALK, str(top)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def requests(log: Path) -> list[str]:
    """The FUSE opcodes in a debug log, once the daemon has logged all it was sent (the
    kernel's readahead goes on after the reader is done)."""
    size = -1
    while size != log.stat().st_size:
        size = log.stat().st_size
        time.sleep(0.3)
    return [line.split("opcode: ", 1)[1].split(" ")[0].strip(",")
            for line in log.read_text(errors="replace").splitlines() if "opcode: " in line]


def test_make_built_it_and_the_runtime_prefers_it(monkeypatch):
    assert os.access(CACHED, os.X_OK), "make builds squashfuse_cached into the venv"
    assert squashfuse() == str(CACHED)
    monkeypatch.setenv(SQUASHFUSE_ENV, "squashfuse_ll")
    assert squashfuse() == "squashfuse_ll"


def test_same_view_as_squashfuse_ll_for_an_unprivileged_user(image, base):
    views = {}
    for name, program in PROGRAMS.items():
        with mounted(program, image, base / name, user=NOBODY) as point:
            views[name] = walk(point, user=NOBODY)
    cached, plain = views["squashfuse_cached"], views["squashfuse_ll"]
    assert len([p for p in cached if p.startswith("many/")]) == 3000
    assert cached == plain
    assert cached["data/hard"]["ino"] == cached["data/big"]["ino"] and cached["data/big"]["nlink"] == 2
    assert cached["links/long"]["target"] == "x/" * 500 + "end"
    assert cached["data/tail"]["xattrs"] == {"user.note": b"kept".hex()}
    assert stat.S_IMODE(cached["data/setuid"]["mode"]) == 0o4751 and cached["special/null"]["rdev"] == os.makedev(1, 3)
    assert (cached["data/empty"]["uid"], cached["data/empty"]["gid"]) == (1234, 5678)


def test_repeated_reads_are_served_by_the_kernel(image, tmp_path):
    """The second pass over the tree sends no open requests to squashfuse_cached, and
    hardly any listing, symlink or read request; squashfuse_ll gets them all again.
    (Hardly: this VM's DAMON reclaim takes a few fresh page-cache pages now and then.)"""
    second_pass = {}
    for name, program in PROGRAMS.items():
        log = tmp_path / f"{name}.log"
        with mounted(program, image, tmp_path / name, debug_log=log) as point:
            first = walk(point)
            seen = len(requests(log))
            assert walk(point) == first
            second_pass[name] = Counter(requests(log)[seen:])
    plain, cached = second_pass["squashfuse_ll"], second_pass["squashfuse_cached"]
    assert plain["OPEN"] >= 3000 and plain["READDIR"] and plain["READLINK"], plain
    assert cached["OPEN"] == cached["OPENDIR"] == 0, cached
    again = sum(cached[op] for op in ("READ", "READDIR", "READLINK", "LOOKUP"))
    # 20x, not more: under the whole suite's load reclaim took 70 pages of 3,000 once.
    assert again * 20 <= sum(plain[op] for op in ("OPEN", "OPENDIR", "READDIR", "READLINK")), cached


def test_an_image_without_xattrs_lets_the_kernel_answer_xattr_queries(base, tmp_path):
    """A flattened environment has no extended attributes: the kernel is told once and
    answers EOPNOTSUPP itself (a fresh overlay asks on every lower directory it walks)."""
    src = base / "plain-src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "os-release").write_text("ID=plain\n")
    plain = base / "plain.sqfs"
    pack(src, plain, SquashOptions())
    log = tmp_path / "plain.log"
    with mounted(str(CACHED), plain, tmp_path / "m", debug_log=log) as point:
        before = Counter(requests(log))
        for _ in range(20):
            for query in (lambda: os.getxattr(point / "etc", "user.overlay.opaque"), lambda: os.listxattr(point)):
                with pytest.raises(OSError) as e:
                    query()
                assert e.value.errno == errno.EOPNOTSUPP
        assert (point / "etc/os-release").read_text() == "ID=plain\n"
        asked = Counter(requests(log)) - before
    assert asked["GETXATTR"] == asked["LISTXATTR"] == 1, asked


def test_the_mount_is_read_only(image, tmp_path):
    with mounted(str(CACHED), image, tmp_path / "m") as point:
        for attempt in (lambda: open(point / "data/big", "r+b"), lambda: (point / "new").write_text("x"),
                        lambda: (point / "d").mkdir(), lambda: (point / "data/big").unlink(),
                        lambda: os.setxattr(point / "data/tail", "user.x", b"y")):
            with pytest.raises(OSError) as e:
                attempt()
            assert e.value.errno == errno.EROFS
        assert (point / "data/big").stat().st_size == 3 << 20


@pytest.mark.parametrize("args, needle", [
    (["/nonexistent.sqfs", "{point}"], "Can't open squashfs image"),
    (["/etc/passwd", "{point}"], "doesn't look like a squashfs image"),
    (["{image}", "/nonexistent-point"], "mountpoint"),
    (["{image}"], "usage:"),
])
def test_bad_input_says_what_is_wrong(image, tmp_path, args, needle):
    args = [a.format(point=tmp_path, image=image) for a in args]
    out = subprocess.run([str(CACHED), *args], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and needle in out.stderr
    assert not os.path.ismount(tmp_path)


# A squashfuse that floods its stderr past a pipe's buffer, then fails, or hangs: a fault a real one
# produces only by chance (a stuck FUSE connection), hence a stand-in.
_FAULTY = """#!/bin/sh
head -c 200000 /dev/zero | tr '\\0' x >&2
echo >&2
echo "$0: cannot mount $3 at $4" >&2
[ "$FAULT" = hang ] && exec sleep 60
exit 3
"""


@pytest.mark.parametrize("fault", ["fail", "hang"])
def test_a_squashfuse_that_fails_or_hangs_fails_the_mount_in_one_line(image, tmp_path, monkeypatch, fault):
    """fuse_mount (the holder's, rootless) reads the program's stderr as it comes (a flood does not block it),
    gives its last line, and gives up on one that never mounts, killed, after its timeout."""
    program = tmp_path / "squashfuse"
    program.write_text(_FAULTY)
    program.chmod(0o755)
    monkeypatch.setenv(SQUASHFUSE_ENV, str(program))
    monkeypatch.setenv("FAULT", fault)
    t0 = time.monotonic()
    with pytest.raises(OSError) as failed:
        fuse_mount(str(image), 0, str(tmp_path), timeout=2)
    assert time.monotonic() - t0 < 30
    why = str(failed.value)
    assert "\n" not in why and str(image) in why, why
    assert ("no mount after 2 s" if fault == "hang" else f"cannot mount {image} at {tmp_path}") in why, why
    assert not subprocess.run(["pgrep", "-f", str(program)], capture_output=True).stdout
    monkeypatch.setenv(SQUASHFUSE_ENV, str(tmp_path / "missing"))
    with pytest.raises(OSError, match="not found .install squashfuse") as missing:
        fuse_mount(str(image), 0, str(tmp_path))
    assert missing.value.errno == errno.ENOENT
