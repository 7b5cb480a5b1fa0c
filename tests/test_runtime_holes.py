"""Holes in the runtime (issue 30), each attacked for real: root's sandbox layer dir that
another user can write to, a sandbox whose own `tar` forges what `sandbox cp` unpacks on
the host, and a catalog workdir the instance lacks. As root (kernel backend) and as uid
65534 (userns) where the hole is not root's alone."""

from __future__ import annotations

import json
import marshal
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from image_builder.oci.cache import sha256_file
from image_builder.runtime.mounts import RunnerError
from image_builder.runtime.sandbox import Sandbox
from image_builder.runtime.session import Backend, InstanceLayers
from image_builder.store.index import EnvRecord, Index, InstanceRecord, write_index
from tests.conftest import ROOT, run_cli
from tests.test_runtime import NOBODY, _env_sif, _images
from tests.test_runtime_client import stop_holders_of

OTHER = 65533  # the planter of a tree

BARE, PLAIN, RO = "bare", "plain", "ro-task"  # workdir /task (not in the image), /, /data/task (a read-only bind)


@pytest.fixture(scope="module")
def store():
    """A store written by hand over test_runtime's Debian environment (python3 in it): three
    instances that add nothing, one per workdir above; every user can read it."""
    imgs = _images(_env_sif(slim=False))
    root = imgs.dir / "store"
    (root / "envs").mkdir(parents=True)
    os.link(imgs.env_sif, root / "envs/env.sif")
    sif = root / "envs/env.sif"
    env = EnvRecord("env", "envs/env.sif", sha256_file(sif), sif.stat().st_size, "debian", "sha256:0", "key", 0, {})
    write_index(root, Index({"env": env}, {
        name: InstanceRecord(name, "env", None, None, 0, "key", workdir=workdir)
        for name, workdir in ((BARE, "/task"), (PLAIN, "/"), (RO, "/data/task"))}))
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield root
    shutil.rmtree(imgs.dir, ignore_errors=True)


@pytest.fixture(params=[None, NOBODY], ids=["root", "uid65534"])
def user(request, tmp_path):
    """(uid or None for root, its environment, a home of its own in a directory everyone can enter)."""
    home = Path(tempfile.mkdtemp(prefix="ib-holes-", dir="/var/tmp"))
    (home / "run").mkdir(mode=0o700)
    if request.param is not None:
        for path in (home, home / "run"):
            os.chown(path, request.param, request.param)
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": str(home / "run")}
    yield request.param, env, home
    r = run_cli("sandbox", "ls", "--json", user=request.param, env=env)
    ids = [s["id"] for s in json.loads(r.stdout or "[]")]
    if ids:
        run_cli("sandbox", "stop", *ids, user=request.param, env=env)
    shutil.rmtree(home, ignore_errors=True)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr.strip()


# --- 1. the layer dir ----------------------------------------------------------------------


def test_a_layer_dir_another_user_can_write_is_refused_in_one_line(store, tmp_path):
    """Root's sandbox with its writable layer in a directory uid 65534 owns (mode 777), in a
    sticky one everyone writes to, or in a directory of root's inside the attacker's: each
    refused before anything is made there; and the same for uid 65534 in a directory of root's
    everyone can write to."""
    theirs = Path(tempfile.mkdtemp(prefix="ib-theirs-", dir="/var/tmp"))
    shared = Path(tempfile.mkdtemp(prefix="ib-shared-", dir="/var/tmp"))
    try:
        os.chown(theirs, NOBODY, NOBODY)
        theirs.chmod(0o777)
        shared.chmod(0o1777)
        (theirs / "mine").mkdir(mode=0o700)  # root's own, but the attacker can rename it away
        layers = InstanceLayers(store / "envs/env.sif", (), {}, "/")
        for layer_dir, why in ((theirs, f"layer dir {theirs} is owned by uid {NOBODY}"),
                               (shared, f"layer dir {shared} is mode 1777, writable by others"),
                               (theirs / "mine", f"layer dir {theirs}/mine is inside {theirs}, owned by uid {NOBODY}")):
            with pytest.raises(RunnerError) as e:
                Sandbox(layers, backend=Backend.KERNEL, state_dir=tmp_path / "state", layer_dir=layer_dir)
            assert str(e.value).startswith(why) and "\n" not in str(e.value), str(e.value)
            assert "another user may swap" in str(e.value) and "mkdir -m 700" in str(e.value)
        assert sorted(p.name for p in theirs.iterdir()) == ["mine"] and not any(shared.iterdir())

        home = Path(tempfile.mkdtemp(prefix="ib-holes-", dir="/var/tmp"))
        os.chown(home, NOBODY, NOBODY)
        shared.chmod(0o777)
        r = run_cli("sandbox", "start", PLAIN, "--store", str(store), "--layer-dir", str(shared), user=NOBODY,
                    env={"HOME": str(home), "XDG_RUNTIME_DIR": str(home)})
        assert one_line_error(r).startswith(f"Error: layer dir {shared} is mode 777, writable by others"), r.stderr
        shutil.rmtree(home)
    finally:
        shutil.rmtree(theirs, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)


# uid 65534, in the layer dir: swaps every entry the holder makes there for a link to the
# victim (a file: for the link; a directory: moved away, then a link to the victim's
# directory or a directory of its own holding a link named as the holder's file).
SWAPPER = r"""
import os, sys
d, victim, stop = sys.argv[1:]
loops = swapped = 0
while not os.path.exists(stop):
    loops += 1
    for name in os.listdir(d):
        p = os.path.join(d, name)
        if not name.startswith("image-builder-layer-") or name.endswith(".moved") or os.path.islink(p):
            continue
        try:
            if os.path.isdir(p):
                os.rename(p, p + ".moved")
                if swapped % 2:
                    os.symlink(os.path.dirname(victim), p)
                else:
                    os.mkdir(p)
                    os.symlink(victim, os.path.join(p, "layer"))
            else:
                os.unlink(p)
                os.symlink(victim, p)
            swapped += 1
        except OSError:
            pass
print(loops, swapped)
"""

# Root, in a mount namespace of its own (as the holder is): the holder's layers on disk, one
# after another, each unmounted at once; prints how many were made, and how many were refused
# (the attacker won: the holder's own errors, nothing else).
MAKER = r"""
import os, shutil, sys, tempfile
from image_builder.runtime.holder import Holder
from image_builder.runtime.mounts import RunnerError, umount
d, n = sys.argv[1], int(sys.argv[2])
base = tempfile.mkdtemp()
os.chdir(base)
os.mkdir("d")
holder = Holder(True, base, None, "/bin/true")
made = refused = 0
for _ in range(n):
    try:
        target = holder._ext4_layer(d, 4)
    except (RunnerError, OSError):
        refused += 1
        continue
    made += 1
    umount(target)
    os.rmdir(target)
os.chdir("/")
shutil.rmtree(base)
print(made, refused)
"""


def test_the_holder_s_layer_file_cannot_be_swapped_for_a_link():
    """Past the check (a layer dir uid 65534 can write to, given to the holder itself): while
    the attacker keeps swapping whatever the holder makes there, root's holder makes 60 ext4
    layers; the root-owned victim file is never formatted nor mounted."""
    victim_dir = Path(tempfile.mkdtemp(prefix="ib-victim-", dir="/var/tmp"))
    victim = victim_dir / "precious.img"
    content = os.urandom(4 << 20)
    victim.write_bytes(content)
    layer_dir = Path(tempfile.mkdtemp(prefix="ib-layers-", dir="/var/tmp"))
    layer_dir.chmod(0o777)
    stop = layer_dir / "stop"  # where the attacker sees it
    attacker = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                 sys.executable, "-c", SWAPPER, str(layer_dir), str(victim), str(stop)],
                                stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        made = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", MAKER,
                               str(layer_dir), "60"], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert made.returncode == 0, made.stderr[-2000:]
    finally:
        stop.touch()
        loops, swapped = map(int, attacker.communicate(timeout=60)[0].split())
        shutil.rmtree(layer_dir, ignore_errors=True)
    count, refused = map(int, made.stdout.split())
    assert victim.read_bytes() == content, "the victim was formatted through a swapped layer file"
    assert loops > 100, "the attacker was running all along"
    assert count + refused == 60 and count > refused, (made.stdout, swapped)
    shutil.rmtree(victim_dir, ignore_errors=True)


def plant_unpacked_tree(unpack: Path, env_sif: Path) -> None:
    """Under `unpack`, the tree the runtime would unpack `env_sif` to (its name is computed from the image's
    path and stat, which anyone who can read the image knows): a root of the planter's with /bin/cat and
    /marker."""
    from image_builder.pack.sif import partition_offset
    from image_builder.pack.squashfs import LayerListing
    from image_builder.runtime.extract import _layer_key

    entry = unpack / _layer_key(env_sif, partition_offset(env_sif)[0])
    tree = entry / "tree"
    for d in ("bin", "lib/x86_64-linux-gnu", "lib64", "proc", "dev", "tmp", "etc", "root", "sys"):
        (tree / d).mkdir(parents=True)
    for lib in ("/bin/cat", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"):
        shutil.copy2(lib, tree / lib.lstrip("/"))
    (tree / "marker").write_text("planted\n")
    (entry / "listing.marshal").write_bytes(marshal.dumps(LayerListing({"marker": "f"}).__dict__))
    (entry / "source").write_text(f"{env_sif}\n{partition_offset(env_sif)[0]}\n")
    for path in [unpack, *unpack.rglob("*")]:
        os.lchown(path, OTHER, OTHER)


def test_an_unpack_dir_another_user_can_write_is_refused_in_one_line(store):
    """Rootless runs unpack the environment under IMAGE_BUILDER_UNPACK_DIR once and reuse the tree they find
    there by name. In a directory another user owns or can write to (a shared scratch dir), that user had
    put a tree of theirs under that name, and uid 65534's run used it as its environment (`cat /marker`
    printed theirs): now refused in one line before anything there is read."""
    base = Path(tempfile.mkdtemp(prefix="ib-unpack-", dir="/var/tmp"))
    base.chmod(0o755)
    home = Path(tempfile.mkdtemp(prefix="ib-holes-", dir="/var/tmp"))
    os.chown(home, NOBODY, NOBODY)
    try:
        theirs = base / "theirs"
        theirs.mkdir()
        plant_unpacked_tree(theirs, store / "envs/env.sif")
        theirs.chmod(0o777)
        shared = base / "shared"  # the victim's, left open: the planter wrote in it
        shared.mkdir()
        plant_unpacked_tree(shared, store / "envs/env.sif")
        os.chown(shared, NOBODY, NOBODY)
        shared.chmod(0o777)
        for unpack, why in ((theirs, f"unpack dir {theirs} is owned by uid {OTHER}"),
                            (shared, f"unpack dir {shared} is mode 777, writable by others")):
            r = run_cli("run", "--store", str(store), "--backend", "userns", PLAIN, "--", "cat", "/marker",
                        user=NOBODY, env={"HOME": str(home), "XDG_RUNTIME_DIR": str(home),
                                          "IMAGE_BUILDER_UNPACK_DIR": str(unpack)})
            assert "planted" not in r.stdout
            assert one_line_error(r).startswith(f"Error: {why}"), r.stderr
            assert "IMAGE_BUILDER_UNPACK_DIR" in r.stderr
        mine = home / "unpacked"
        r = run_cli("run", "--store", str(store), "--backend", "userns", PLAIN, "--", "cat", "/etc/debian_version",
                    user=NOBODY, env={"HOME": str(home), "XDG_RUNTIME_DIR": str(home),
                                      "IMAGE_BUILDER_UNPACK_DIR": str(mine)})
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        assert mine.stat().st_uid == NOBODY and mine.stat().st_mode & 0o777 == 0o700 and any(mine.glob("*/tree"))
    finally:
        stop_holders_of(home)
        shutil.rmtree(base, ignore_errors=True)
        subprocess.run(["chmod", "-R", "u+w", str(home)], check=False)
        shutil.rmtree(home, ignore_errors=True)


# --- 2. what a sandbox's tar sends to `sandbox cp` ------------------------------------------

# The sandbox's own tar, as an agent could leave it: its archive of whatever was asked is one
# of these, by /tmp/mode.
EVIL_TAR = r"""
import io, sys, tarfile
host = sys.argv[1]
entries = {
    # a symlink to a host directory, then an entry through it
    "through": [("top", "dir", ""), ("top/x", "sym", host), ("top/x/planted", "sym", "/etc/passwd")],
    "through-file": [("top", "dir", ""), ("top/x", "sym", host), ("top/x/planted.txt", "file", "pwned\n")],
    # each link inside on its own, together leading out: c is b/../.., b is ../.. (dest itself)
    "chain": [("top", "dir", ""), ("top/p", "dir", ""), ("top/p/q", "dir", ""), ("top/p/q/c", "sym", "b/../.."),
              ("top/p/q/b", "sym", "../.."), ("top/ok.txt", "file", "fine\n")],
    "absolute": [("top", "dir", ""), ("top/etc", "sym", "/etc")],
}[open("/tmp/mode").read().strip()]
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w") as tar:
    for name, kind, value in entries:
        info = tarfile.TarInfo(name)
        if kind == "dir":
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        elif kind == "sym":
            info.type, info.linkname = tarfile.SYMTYPE, value
            tar.addfile(info)
        else:
            info.size = len(value)
            tar.addfile(info, io.BytesIO(value.encode()))
sys.stdout.buffer.write(buf.getvalue())
"""


def test_sandbox_cp_writes_nothing_outside_its_destination(store, user):
    """The agent puts a `tar` of its own first on PATH; `sandbox cp ID:top DEST` (Sandbox.download)
    unpacks what it sends: nothing is made in the host directory its symlinks point at, no
    symlink leading outside DEST is left, each refusal is one line naming the entry. A link
    that stays inside DEST is kept."""
    uid, env, home = user
    cli = lambda *a, **kw: run_cli(*a, user=uid, env=env, **kw)  # noqa: E731
    host = home / "host-dir"
    host.mkdir()
    (host / "mine.txt").write_text("mine\n")
    if uid is not None:
        os.chown(host, uid, uid)  # the user's own: the attack would have its rights
    before = sorted(os.listdir(host))
    started = cli("sandbox", "start", PLAIN, "--store", str(store))
    assert started.returncode == 0, started.stderr
    sid = started.stdout.strip()

    r = cli("sandbox", "exec", sid, "--", "sh", "-c", "mkdir -p /keep/d && echo hi > /keep/d/f && ln -s d/f /keep/l")
    assert r.returncode == 0, r.stderr
    assert cli("sandbox", "cp", f"{sid}:/keep", str(home / "keep")).returncode == 0
    assert os.readlink(home / "keep/l") == "d/f" and (home / "keep/l").read_text() == "hi\n", "a link inside is kept"
    assert cli("sandbox", "cp", f"{sid}:/keep/d/f", str(home / "one.txt")).returncode == 0
    assert (home / "one.txt").read_text() == "hi\n"

    r = cli("sandbox", "exec", sid, "--", "sh", "-c", "cat > /usr/local/lib/evil_tar.py && mkdir -p /top && "
            f"printf '#!/bin/sh\\nexec python3 /usr/local/lib/evil_tar.py {host}\\n' > /usr/local/bin/tar && "
            "chmod 755 /usr/local/bin/tar", input=EVIL_TAR)
    assert r.returncode == 0, r.stderr
    refusals = {"through": "refusing the entry 'top/x/planted': it would go through 'top/x'",
                "through-file": "refusing the entry 'top/x/planted.txt': it would go through 'top/x'",
                "chain": "refusing the entry 'top/p/q/c': a symlink to 'b/../..', which leads outside",
                "absolute": "refusing the entry 'top/etc': a symlink to '/etc', which leads outside"}
    for mode, refusal in refusals.items():
        assert cli("sandbox", "exec", sid, "--", "sh", "-c", f"echo {mode} > /tmp/mode").returncode == 0
        dest = home / f"dl-{mode}"
        r = cli("sandbox", "cp", f"{sid}:/top", str(dest))
        assert sorted(os.listdir(host)) == before, f"{mode}: the sandbox wrote into the host directory"
        error = one_line_error(r)
        assert error.startswith("Error: download: " + refusal), error
        inside = os.path.realpath(dest)
        for path in dest.rglob("*"):
            assert os.path.commonpath([inside, os.path.realpath(path)]) == inside, f"{mode}: {path} leads outside"
    assert (home / "dl-chain/ok.txt").read_text() == "fine\n", "what came before and beside stays"


# --- 3. a workdir the instance lacks ---------------------------------------------------------------


def test_a_workdir_the_instance_lacks_is_made_for_runs_and_sandboxes(store, user):
    """A catalog's /task for an instance that adds no files: a run starts there (an empty
    directory of its writable layer, gone with it; rootless on the extract backend too), a
    sandbox's commands too (another cwd must still exist, as for `docker exec -w`); where it
    would be on a read-only bind, one line says so."""
    uid, env, home = user
    cli = lambda *a, **kw: run_cli(*a, user=uid, env=env, **kw)  # noqa: E731
    for _ in range(2):  # the second run finds no trace of the first's file
        r = cli("run", "--store", str(store), BARE, "--", "sh", "-c", "pwd; ls -A; touch left")
        assert (r.returncode, r.stdout) == (0, "/task\n"), r.stderr
    if uid is not None:  # proot would start in / and say so on stderr
        r = cli("run", "--store", str(store), "--backend", "extract", "--net", BARE, "--", "pwd")
        assert (r.returncode, r.stdout, r.stderr) == (0, "/task\n", ""), r.stderr

    started = cli("sandbox", "start", BARE, "--store", str(store))
    assert started.returncode == 0, started.stderr
    sid = started.stdout.strip()
    r = cli("sandbox", "exec", sid, "--", "sh", "-c", "pwd; echo kept > here")
    assert (r.returncode, r.stdout) == (0, "/task\n"), r.stderr
    assert cli("sandbox", "exec", sid, "--", "cat", "/task/here").stdout == "kept\n"
    r = cli("sandbox", "exec", "--cwd", "no/such/dir", sid, "--", "pwd")
    assert r.returncode != 0 and "no/such/dir" in r.stderr, (r.stdout, r.stderr)

    data = home / "data"
    data.mkdir()
    r = cli("run", "--store", str(store), "--bind", f"{data}:/data", RO, "--", "pwd")
    assert one_line_error(r) == ("Error: workdir /data/task is not in the instance and cannot be made: it would "
                                 "be on a read-only file system (no writable layer there); give a workdir that "
                                 "exists"), r.stderr


def test_a_grade_in_an_instance_that_lacks_its_workdir_is_not_an_error(store, user):
    """An assert task of an instance whose catalog workdir (/task) it lacks grades as passed,
    not as an error: the graders put their files in /tmp, so nothing else makes it."""
    [result] = grade_as(user, store, [{"task_id": BARE, "assert_case": ["assert f(2) == 3"]}],
                        [{"task_id": BARE, "solution": "def f(x):\n    return x + 1\n"}]).values()
    assert (result["status"], result["score"]) == ("passed", 1.0), result


def grade_as(user, store: Path, tasks: list[dict], predictions: list[dict]) -> dict[str, dict]:
    """`image-builder grade` of `predictions` for `tasks` over `store`, as the `user` fixture's user:
    the results by task id."""
    uid, env, home = user
    files = home / "tasks.jsonl", home / "predictions.jsonl"
    for path, rows in zip(files, (tasks, predictions)):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        if uid is not None:
            os.chown(path, uid, uid)
    out = home / "results.jsonl"
    r = run_cli("grade", "--store", str(store), "--tasks", str(files[0]), "--predictions", str(files[1]),
                "-o", str(out), user=uid, env=env)
    assert r.returncode == 0, r.stderr
    return {row["task_id"]: row for row in map(json.loads, out.read_text().splitlines())}


# --- the init's descriptors ------------------------------------------------------------------


def test_file_names_and_workdirs_cannot_reach_the_init_s_descriptors(store, tmp_path):
    """The init writes a run's files and enters its workdir while it holds host descriptors: the
    run's cgroup directory on the host's cgroupfs and the holder's log. A file named
    /proc/self/fd/N/../../X made a cgroup at the root of the host's hierarchy (and `cgroup.procs`
    there took the run out of its pids limit), /proc/self/fd/2 rewrote the holder's log (red team,
    serve's /run_code `files`). /proc's magic links are no longer followed there, and no /proc
    file is written."""
    from image_builder.runtime.backends import open_session
    from image_builder.runtime.execution import RunRequest
    from image_builder.store.store import Store

    resolved = Store.open(store).resolve(PLAIN)
    layers = InstanceLayers.of(resolved)
    proof = "ib-holes-proof"
    state = tmp_path / "state"
    with open_session(layers, state_dir=state) as session:
        assert session.run(RunRequest(("true",))).exit_code == 0
        log = (state / "holder.log").read_bytes()
        attempts = [{"/proc/self/fd/2": b"forged\n"}, {"/proc/self/oom_score_adj": b"500\n"}]
        attempts += [{f"/proc/self/fd/{n}/../../{proof}/x": b""} for n in range(3, 16)]
        attempts += [{f"/proc/1/fd/{n}/../{proof}/x": b""} for n in range(3, 16)]
        for files in attempts:
            with pytest.raises(RunnerError):
                session.run(RunRequest(("true",), files=files))
        for n in range(3, 16):
            with pytest.raises(RunnerError):
                session.run(RunRequest(("sh", "-c", f"mkdir {proof}"), workdir=f"/proc/self/fd/{n}/../.."))
        assert (state / "holder.log").read_bytes().startswith(log), "the holder's log was rewritten"
        r = session.run(RunRequest(("cat", "/tmp/d/x"), files={"/tmp/d/x": b"plain files still go in\n"}))
        assert r.stdout == b"plain files still go in\n", r
    # os.walk passes over a directory gone while it walks (other tests' runs end meanwhile); rglob raised.
    made = [Path(d) / proof for d, dirs, _ in os.walk("/sys/fs/cgroup") if proof in dirs]
    for p in made:
        p.rmdir()
    assert made == [], made


# --- what a case leaves for the next ---------------------------------------------------------

COUNTER = '''
import os
MAGIC = 1000000
PATHS = ("/dev/null", "/proc", "/dev/pts", "/dev/shm", "/tmp")
def _count():
    seen = 0
    for p in PATHS:
        try:
            m = int(os.stat(p).st_mtime)
            if MAGIC <= m < MAGIC + 1000:
                seen = max(seen, m - MAGIC + 1)
        except OSError:
            pass
    for p in PATHS:
        try:
            os.utime(p, (MAGIC + seen, MAGIC + seen))
        except OSError:
            pass
    return seen
'''


def test_a_case_leaves_no_count_for_the_next_in_the_times_of_what_it_cannot_empty(store, user):
    """Conflicting cases (the same input, A then B) passed whole: a candidate kept a count in the times of
    what every case's run shares and nothing empties (red team): the host's /dev/null (root's runs), the
    tops of /proc and /dev/pts (a warm interpreter's jobs; a reused init's root), /tmp and /dev/shm (a
    reused init's, emptied but their times kept). Now each case sees them as the first did: half passes.
    And a run cannot chmod the host's device nodes (root's runs are the host's root)."""
    uid, env, _ = user
    tasks = [{"task_id": PLAIN, "inputs": ["1\n"] * 4, "outputs": ["A", "B"] * 2},
             {"task_id": PLAIN, "impossible_type": "conflicting",
              "assert_case": ["assert f(1) == 2", "assert f(1) == 3"] * 2}]
    predictions = [{"task_id": PLAIN, "solution": COUNTER + "input()\nprint('AB'[_count() % 2])\n"},
                   {"task_id": f"{PLAIN}__conflicting",
                    "solution": COUNTER + "def f(x):\n    return 2 + _count() % 2\n"}]
    null = os.stat("/dev/null")
    try:
        results = grade_as(user, store, tasks, predictions)
        assert {k: (v["status"], v["score"]) for k, v in results.items()} == {
            PLAIN: ("failed", 0.5), f"{PLAIN}__conflicting": ("failed", 0.5)}, results
        r = run_cli("run", "--store", str(store), PLAIN, "--", "sh", "-c",
                    "chmod 600 /dev/full; chown 12:12 /dev/zero; touch -d @5 /dev/null; echo done",
                    user=uid, env=env)
        assert r.stdout == "done\n", r.stderr
        assert os.stat("/dev/full").st_mode & 0o777 == 0o666 and os.stat("/dev/zero").st_uid == 0
    finally:
        os.utime("/dev/null", ns=(null.st_atime_ns, null.st_mtime_ns))
        os.chmod("/dev/full", 0o666)
        os.chown("/dev/zero", 0, 0)
    assert os.stat("/dev/null").st_mtime_ns == null.st_mtime_ns



COUNTERS = {  # which case this is, from what the cases before it left in the pid namespace they share
    # each case adds 1000 to its pid counter (threads are cheap pids)
    "pids": """
import os, threading
def _count():
    seen = int(os.readlink("/proc/self")) // 1000
    for t in [threading.Thread(target=int) for _ in range(1000)]:
        t.start(); t.join()
    return seen
""",
}


@pytest.mark.parametrize("counter", COUNTERS)
def test_a_case_reads_no_count_of_the_cases_before_it_in_its_pid_namespace(store, user, counter):
    """A warm interpreter's jobs (every Python case) share its pid namespace's /proc on the kernel backend
    (root): a job read its own pid there, which advanced with every fork of the jobs before it, and the
    zygote's counters (tests/test_warm.py), so conflicting cases passed whole. Now the pids are the same
    every job: half passes."""
    solution = COUNTERS[counter] + "input()\nprint('AB'[_count() % 2])\n"
    [result] = grade_as(user, store, [{"task_id": PLAIN, "inputs": ["1\n"] * 4, "outputs": ["A", "B"] * 2}],
                        [{"task_id": PLAIN, "solution": solution}]).values()
    assert (result["status"], result["score"]) == ("failed", 0.5), result


# What the machine shares across runs and a run reads without timing: whether a page of an image file is in
# the page cache. A case maps a page few programs read and counts its own major faults: the first case of a
# task to ask faults it in, the later ones find it cached.
PAGE_CACHE = '''
import glob, mmap, os, resource, zlib
def _first_time(salt):
    path = max(glob.glob("/usr/lib/python3*/*.py"), key=os.path.getsize)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    m.madvise(mmap.MADV_RANDOM)  # that page alone, nothing read around it
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    m[zlib.crc32(salt.encode()) % len(m) // 4096 * 4096]
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt > faults
'''


def test_cases_asking_one_question_pass_for_one_answer_only(store, user):
    """Conflicting cases (one question, two expected answers) are passed only by a solution that tells a
    first asking from a later one. A fresh root per case leaves it nothing of its own, but the page cache
    of the image's files is the machine's: through it an assert task's and a stdin task's conflicting
    pairs passed whole. Cases that ask the same for answers that exclude each other no longer pass
    together, whatever carried the state (one_answer.py)."""
    salt = os.urandom(8).hex()
    tasks = [{"task_id": PLAIN, "inputs": ["1\n"] * 2, "outputs": ["A", "B"]},
             {"task_id": PLAIN, "impossible_type": "conflicting",
              "assert_case": ["assert f(1) == 2", "assert f(2) == 4", "assert f(1) == 3"]}]
    predictions = [
        {"task_id": PLAIN, "solution": PAGE_CACHE + f"input()\nprint('A' if _first_time('{salt}') else 'B')\n"},
        {"task_id": f"{PLAIN}__conflicting",
         "solution": PAGE_CACHE + f"def f(x):\n    return 2 * x + (x == 1 and not _first_time('{salt}!'))\n"}]
    results = grade_as(user, store, tasks, predictions)
    for task_id, pair in ((PLAIN, (0, 1)), (f"{PLAIN}__conflicting", (0, 2))):
        result = results[task_id]
        assert result["status"] == "failed", result
        # Before: both passed whenever the page was uncached at the first asking (the 1.0 it took). Now,
        # that way both fail for it; where another run had cached the page, the solution only got one right.
        assert [result["cases"][i]["status"] for i in pair] != ["passed", "passed"], result


@pytest.mark.parametrize("user", [None, NOBODY])
def test_files_of_different_layers_never_share_a_device_and_inode(public_store, public_dir, user):
    """Every squashfs layer numbers its inodes from 1, and the run's overlay sees the layers through one
    stacked overlay: without xino on that stack, files of two layers showed the same (st_dev, st_ino) (61
    pairs in the demo SWE-bench store), and glibc's dlopen, which knows a loaded library by that pair, gave
    pvlib's run h5py's h5.so for charset_normalizer's md.so (ImportError: no PyInit_md). tar and cp take
    such files for hard links. A file with one link must be the only one with its pair."""
    home = public_dir / f"inodes-{user}"
    home.mkdir(exist_ok=True)
    if user is not None:
        os.chown(home, user, user)
    r = run_cli("run", "--store", str(public_store), "marshmallow-code__marshmallow-1359", "--", "sh", "-c",
                "find / -xdev -type f -links 1 -printf '%D %i %p\\n' 2>/dev/null | sort -k1,2 > /tmp/all;"
                " wc -l < /tmp/all; cut -d' ' -f1,2 /tmp/all | uniq -d | head -3",
                user=user, env={"HOME": str(home), "XDG_RUNTIME_DIR": str(home / "run")})
    assert r.returncode == 0, r.stderr[-2000:]
    counted, *shared = r.stdout.splitlines()
    assert int(counted) > 1000, r.stdout
    assert not shared, f"files of two layers share a (device, inode): {shared}"
