"""Hostile inputs to reading and importing (issue 30): a predictions or task line of 1 GiB
is refused in one line naming file:line, with memory bounded by the line bound, not the
line; an image layer 2,000 levels deep, a path spliced deep through a symlink or a name
longer than the kernel takes is refused in one line, never a RecursionError, and trees
are walked without recursion."""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from image_builder.oci.layers import LayerError, flatten
from image_builder.oci.trees import MAX_DEPTH, TreeError, remove, walk
from image_builder.pack.overlay import normalise_upper
from image_builder.tasks import DatasetError, load_tasks, read_lines
from tests.conftest import DATA, ROOT, run_cli
from tests.support.oci import Blob, Entry, Pusher, config_blob, index, layer, manifest, tar_bytes

TASKS = DATA / "mbpp_train_40_impossible.jsonl"
EXE = ROOT / ".venv" / "bin" / "image-builder"
GIB = 1 << 30


def _with_a_long_line(path: Path, length: int, before: bytes = b"") -> Path:
    """`before`, then a JSON record `length` bytes long (a hole of NULs inside its string: on
    disk it takes nothing, to a reader it is a line of `length` bytes)."""
    with open(path, "wb") as f:
        f.write(before + b'{"task_id": "517", "solution": "')
        f.seek(length, os.SEEK_CUR)
        f.write(b'"}\n')
    return path


def _grade(tmp_path: Path, tasks: Path, predictions: Path, env: dict | None = None,
           memory: int | None = None) -> subprocess.CompletedProcess:
    """`image-builder grade` as a real process, its address space capped at `memory` bytes."""
    limit = (lambda: resource.setrlimit(resource.RLIMIT_AS, (memory, memory))) if memory else None
    return subprocess.run([str(EXE), "grade", "--store", str(tmp_path / "store"), "--tasks", str(tasks),
                           "--predictions", str(predictions), "-o", str(tmp_path / "out.jsonl")],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, preexec_fn=limit,
                          timeout=300)


def _one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr[-3000:]
    return r.stderr.strip()


def test_a_1_gib_predictions_line_is_refused_naming_its_line_in_bounded_memory(tmp_path):
    """Before: read_bytes() and a decode of the whole file, 3.2 GB and a MemoryError traceback.
    Under a 512 MiB address-space cap the line is read only as far as the 64 MiB bound."""
    good = b'{"task_id": "516", "solution": "def f(): pass"}\n'
    predictions = _with_a_long_line(tmp_path / "predictions.jsonl", GIB, before=good)
    assert predictions.stat().st_size > GIB and predictions.stat().st_blocks * 512 < (1 << 20), "sparse"
    message = _one_line(_grade(tmp_path, TASKS, predictions, memory=512 << 20))
    assert f"{predictions}:2: a line longer than {64 << 20} bytes" in message, message
    assert "IMAGE_BUILDER_MAX_LINE" in message


def test_the_line_bound_is_settable_and_holds_for_task_files_too(tmp_path, monkeypatch):
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text('{"task_id": "516", "solution": "def f(): pass"}\n')
    tasks = tmp_path / "tasks.jsonl"
    rows = TASKS.read_text().splitlines()[:2]
    tasks.write_text("\n".join(rows) + "\n")
    _with_a_long_line(tasks, 5000, before=tasks.read_bytes())
    message = _one_line(_grade(tmp_path, tasks, predictions, env={"IMAGE_BUILDER_MAX_LINE": "4K"}))
    assert f"{tasks}:3: a line longer than 4096 bytes" in message, message
    bad = _one_line(_grade(tmp_path, tasks, predictions, env={"IMAGE_BUILDER_MAX_LINE": "lots"}))
    assert "IMAGE_BUILDER_MAX_LINE='lots': not a byte count" in bad, bad
    # Raised past the line, the same file reads: the bound is the only thing in the way.
    monkeypatch.setenv("IMAGE_BUILDER_MAX_LINE", "8K")
    assert len(load_tasks(tasks)) == 3


def test_read_lines_takes_a_line_exactly_at_the_bound(tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_bytes(b"0123456789\n\n" + b"x" * 10)  # the last line at the bound, with no newline
    assert list(read_lines(path, 10)) == [(1, b"0123456789"), (2, b""), (3, b"x" * 10)]
    path.write_bytes(b"0123456789\n" + b"x" * 11 + b"\n")
    with pytest.raises(DatasetError, match=rf"^{path}:2: a line longer than 10 bytes"):
        list(read_lines(path, 10))


def test_a_partial_last_result_line_is_cut_without_reading_the_file_whole(tmp_path):
    from image_builder.graders.grading import _drop_partial_line

    results = tmp_path / "results.jsonl"
    whole = json.dumps({"task_id": "516"}) + "\n"
    results.write_text(whole + "x" * (3 << 20))  # a half line longer than the chunks read from the end
    _drop_partial_line(results)
    assert results.read_text() == whole
    _drop_partial_line(results)
    assert results.read_text() == whole, "a file ending in a newline is left alone"
    results.write_text("y" * (2 << 20))
    _drop_partial_line(results)
    assert results.read_bytes() == b""


def _deep_tree(top: Path, depth: int) -> Path:
    """top/d/d/.../d, `depth` directories, made through directory handles (the path is longer than
    the kernel takes in one call); a fuse-overlayfs whiteout at the bottom."""
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(os.open(".wh.gone", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
    return top


def _remove_deep(top: Path) -> None:
    """A tree _deep_tree made, removed from the bottom up through handles (pytest's own cleanup
    recurses, and the path is too long for one call)."""
    fd, depth = os.open(top, os.O_RDONLY | os.O_DIRECTORY), 0
    while "d" in os.listdir(fd):
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd, depth = child, depth + 1
    for _ in range(depth):
        for name in os.listdir(fd):
            os.unlink(name, dir_fd=fd)
        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        os.rmdir("d", dir_fd=parent)
        fd = parent
    os.close(fd)


def test_normalise_upper_refuses_a_2000_deep_tree_in_one_line(tmp_path):
    """Before: os.walk recursed, RecursionError."""
    upper = _deep_tree(tmp_path / "upper", 2000)
    try:
        with pytest.raises(TreeError) as e:
            normalise_upper(upper, lambda rel: [])
    finally:
        _remove_deep(upper)
    message = str(e.value)
    assert "\n" not in message and f"at most {MAX_DEPTH} levels deep" in message and str(upper) in message


def test_normalise_upper_walks_a_tree_within_the_bound_to_its_bottom(tmp_path):
    depth = MAX_DEPTH - 1
    upper = _deep_tree(tmp_path / "upper", depth)
    stats = normalise_upper(upper, lambda rel: [])
    bottom = os.path.join(upper, *["d"] * depth)
    assert stats.whiteouts == 1 and os.path.lexists(os.path.join(bottom, "gone"))
    assert not os.path.lexists(os.path.join(bottom, ".wh.gone")), "the fuse-overlayfs whiteout became a 0:0 device"
    assert [d for d, _, _ in walk(upper, topdown=False)][0] == bottom, "bottom-up: the deepest first"


def _hostile_tree(top: Path, outside: Path) -> None:
    """A 3000-deep tree (past the recursion limit and PATH_MAX) whose levels hold a file, a fifo and a
    symlink to `outside`; a level at mode 000 and the bottom read-only, as a build or a sandbox leaves them."""
    _deep_tree(top, 3000)
    fd, level, middle = os.open(top, os.O_RDONLY | os.O_DIRECTORY), 0, -1
    while True:
        if level % 500 == 0:
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o400, dir_fd=fd))
            os.mkfifo("p", dir_fd=fd)
            os.symlink(str(outside), "out", dir_fd=fd)
        if "d" not in os.listdir(fd):
            break
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        if level == 1500:
            middle = os.dup(child)
        os.close(fd)
        fd, level = child, level + 1
    os.fchmod(fd, 0o500)
    os.close(fd)
    os.fchmod(middle, 0)
    os.close(middle)


@pytest.mark.parametrize("user", ["root", "nobody"])
def test_remove_takes_a_3000_deep_tree_of_any_mode_and_follows_no_symlink(public_dir, user):
    """What a build script, an agent or a candidate leaves must go, at any depth (before: shutil.rmtree,
    RecursionError; remove_tree in every build after a failed one, the holder's rootless layers, the
    extract backend's /tmp), and nothing a symlink in it points to."""
    tmp_path = public_dir / f"remove-{user}"
    tmp_path.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("kept\n")
    top = tmp_path / "tree"
    if user == "root":
        _hostile_tree(top, outside)
        remove(top)
    else:
        os.chown(tmp_path, 65534, 65534)  # the tree's parent is the user's: it makes the tree and removes it
        code = ("import sys; from pathlib import Path; sys.path[:0] = [sys.argv[1]]; "
                "from tests.test_hostile_inputs import _hostile_tree; from image_builder.oci.trees import remove; "
                "top = Path(sys.argv[2]); _hostile_tree(top, Path(sys.argv[3])); remove(top)")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code,
                            str(ROOT), str(top), str(outside)], capture_output=True, text=True, cwd="/")
        assert r.returncode == 0, r.stderr[-2000:]
    assert not os.path.lexists(top)
    assert (outside / "keep").read_text() == "kept\n"
    remove(top)  # gone already: no error
    os.mkfifo(tmp_path / "fifo")
    remove(tmp_path / "fifo")
    assert not os.path.lexists(tmp_path / "fifo")


def test_diff_trees_copies_a_new_tree_with_a_fifo_as_it_is(tmp_path):
    """Where no overlay can be mounted the image is flattened whole and compared: a new
    directory holding a fifo (a layer may carry one) is copied as it is. Before: copytree's
    copy2 refused the fifo, and the import ended in a shutil.Error traceback."""
    from image_builder.pack.overlay import diff_trees

    lower, full = tmp_path / "lower", tmp_path / "full"
    lower.mkdir()
    (full / "new" / "sub").mkdir(parents=True)
    os.mkfifo(full / "new" / "pipe")
    (full / "new" / "sub" / "f").write_text("f\n")
    os.symlink("sub/f", full / "new" / "link")
    os.chmod(full / "new" / "sub", 0o750)
    os.utime(full / "new", ns=(10**18, 10**18))
    stats = diff_trees(lower, full, tmp_path / "upper")
    new = tmp_path / "upper" / "new"
    assert stats.entries == 1 and stat.S_ISFIFO(os.lstat(new / "pipe").st_mode)
    assert os.readlink(new / "link") == "sub/f" and (new / "sub" / "f").read_text() == "f\n"
    assert stat.S_IMODE(os.lstat(new / "sub").st_mode) == 0o750 and os.lstat(new).st_mtime_ns == 10**18


@pytest.mark.parametrize("entries, problem", [
    ([Entry("/".join(["d"] * 2000) + "/f", b"x")], "a path 2001 levels deep"),
    # A path spliced deep through a symlink: the archive path is short, where it lands is not.
    ([Entry("/".join(["d"] * 200), kind="dir", mode=0o755), Entry("s", kind="symlink", link="/".join(["d"] * 200)),
      Entry("s/" + "/".join(["e"] * 100) + "/f", b"x")], f"it reaches {MAX_DEPTH + 1} levels deep"),
    ([Entry("n" * 300, b"x")], "a name of 300 bytes (at most 255)"),
    ([Entry("l", kind="symlink", link="t" * 5000)], "a link target of 5000 bytes"),
], ids=["deep", "spliced", "long-name", "long-link"])
def test_pathological_layers_are_refused_in_one_line(tmp_path, entries, problem):
    blob = tmp_path / "layer.tar"
    blob.write_bytes(tar_bytes(entries))
    with pytest.raises(LayerError) as e:
        flatten([blob], tmp_path / "root", rootless=True)
    message = str(e.value)
    assert "\n" not in message and len(message) < 600, message
    assert problem in message and f"at most {MAX_DEPTH} levels deep" in message, message


def test_importing_an_image_with_a_2000_deep_path_fails_in_one_line(registries, tmp_path):
    """Two images sharing their bottom layers: the deep one's own layer is applied over the
    environment through an overlay (before: it was, then normalise_upper died with RecursionError)."""
    from image_builder.oci.layout import rootfs_layer
    from tests.support.bases import tiny_rootfs

    pusher = Pusher(registries.open.url, str(registries.tls.cert))
    base = Blob(rootfs_layer(tiny_rootfs(tmp_path / "rootfs"), tmp_path / "base.tar.gz").read_bytes(),
                "application/vnd.oci.image.layer.v1.tar+gzip")
    env = layer([Entry("opt", kind="dir", mode=0o755), Entry("opt/a", b"a\n")])
    deep = "testbed/" + "/".join(["d"] * 2000) + "/f.py"
    refs = []
    for name, own in (("fine", [Entry("testbed/x.py", b"print(1)\n")]), ("deep", [Entry(deep, b"print(2)\n")])):
        pusher.image(f"hostile/{name}", "latest", config_blob(layers=3), [base, env, layer(own)])
        refs.append(f"{registries.open.host}/hostile/{name}:latest")
    r = run_cli("import", *refs, "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "cache"),
                "--ca-cert", str(registries.tls.cert))
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr[-3000:]
    assert "a path 2002 levels deep" in r.stderr and f"at most {MAX_DEPTH} levels deep" in r.stderr, r.stderr


def _oci_layout(root: Path, own: Blob) -> None:
    """An OCI image layout with one image, tagged `t`, whose one layer is `own`."""
    config = config_blob()
    image = manifest(config, [own])
    for blob in (own, config, image):
        path = root / "blobs/sha256" / blob.digest.split(":")[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob.data)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    doc = json.loads(index([(image, None, {"org.opencontainers.image.ref.name": "t"})]).data)
    (root / "index.json").write_text(json.dumps(doc))


def test_a_blob_cache_others_can_write_to_is_refused(tmp_path):
    """A blob in the cache is trusted by its digest's file name. In a cache every user may write to, another
    user put a layer of theirs under the digest of an image's layer (digests of public images are public),
    and `pull --rootfs` flattened theirs: now refused in one line, as is a cache inside a directory another
    user could rename it out of; a cache of ours still pulls."""
    from image_builder.oci.cache import BlobCache, UnsafeCache

    theirs = layer([Entry("etc/planted", b"theirs\n")])
    own = layer([Entry("etc/mine", b"mine\n")])
    _oci_layout(tmp_path / "layout", own)
    shared = tmp_path / "shared"
    planted = shared / "blobs/sha256" / own.digest.split(":")[1]
    planted.parent.mkdir(parents=True)
    planted.write_bytes(theirs.data)
    for path in (shared, shared / "blobs", shared / "blobs/sha256"):
        path.chmod(0o777)
    os.chown(planted, 65534, 65534)
    r = run_cli("pull", f"oci:{tmp_path / 'layout'}:t", "--cache-dir", str(shared), "--rootfs",
                str(tmp_path / "root"))
    assert not (tmp_path / "root/etc/planted").exists(), "the planted layer was flattened"
    message = _one_line(r)
    assert f"blob cache {shared}" in message and "mode 777, writable by others" in message, message
    os.chown(shared, 65534, 65534)
    shared.chmod(0o755)
    with pytest.raises(UnsafeCache, match="owned by uid 65534"):
        BlobCache(shared)
    # A cache of ours inside a directory of another user's: they could rename it away and put theirs there.
    theirs_dir = tmp_path / "theirs"
    (theirs_dir / "cache").mkdir(parents=True)
    os.chown(theirs_dir, 65534, 65534)
    with pytest.raises(UnsafeCache, match=f"{theirs_dir} is owned by uid 65534"):
        BlobCache(theirs_dir / "cache")
    r = run_cli("pull", f"oci:{tmp_path / 'layout'}:t", "--cache-dir", str(tmp_path / "mine"), "--rootfs",
                str(tmp_path / "root"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "root/etc/mine").read_text() == "mine\n" and not (tmp_path / "root/etc/planted").exists()
