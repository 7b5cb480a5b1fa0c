"""Instance overlays, index.json and whole-store builds."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from image_builder.build.catalog import load
from image_builder.build.envbuild import BuildOptions
from image_builder.build.sandbox import BUILD_UID, STAGING, remove_dead_staging
from image_builder.build.storebuild import StoreBuildOptions, build_store
from image_builder.oci.cache import BlobCache
from image_builder.oci.registry import RegistryOptions
from image_builder.pack.sif import partition_offset
from image_builder.store.index import read_index
from image_builder.store.store import Store, UnknownInstance
from tests.conftest import run_cli
from tests.test_envbuild import drive_pty, write_catalog

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "index/schema.json").read_text())

# /etc/opaque is removed and made again above: what the layers below had in it, its subdirectories' too, is gone
ENV_SCRIPT = "#!/bin/sh\nset -e\nmkdir -p /etc/keep /etc/opaque/sub\necho e > /etc/keep/file\n" \
             "echo one > /etc/opaque/one\necho two > /etc/opaque/two\necho old > /etc/opaque/sub/old\n" \
             "echo env > /etc/from-env\n"
INSTANCE_SCRIPT = "#!/bin/sh\nset -e\necho \"$TASK\" > /etc/task\nrm /etc/from-env\n" \
                  "rm -rf /etc/opaque && mkdir -p /etc/opaque/sub && echo new > /etc/opaque/new\n"


def catalog(tmp: Path, base: str, n: int = 3, instance_script: str = INSTANCE_SCRIPT, extra: dict | None = None):
    scripts = {"env.sh": ENV_SCRIPT, "inst.sh": instance_script, **(extra or {})}
    insts = [{"id": f"task-{i}", "environment": "tiny", "script": "inst.sh", "env": {"TASK": f"task {i}"},
              "workdir": "/work", "test_command": "true", "grader": {"n": i}} for i in range(n)]
    return write_catalog(tmp, [{"name": "tiny", "base": base, "scripts": ["env.sh"]}], scripts, insts)


def opts(tmp: Path, ca: Path, **kw) -> StoreBuildOptions:
    build = BuildOptions(store=tmp / "store", cache=BlobCache(tmp / "cache"), registry=RegistryOptions(ca_cert=ca))
    return StoreBuildOptions(build, **kw)


def lls(image: Path) -> str:
    return subprocess.run(["unsquashfs", "-lls", str(image)], capture_output=True, text=True, check=True).stdout


class Stack:
    """Kernel overlayfs over the env partition and instance overlays: what Apptainer's --overlay does."""

    def __init__(self, tmp: Path, env_sif: Path, overlays: tuple[Path, ...]):
        self.tmp, self.points = tmp, []
        lowers = []
        # offset and sizelimit as the holder's loop devices have them: mount(8) then shares one the holder
        # holds on the same file ("overlapping loop device exists" otherwise, with a store in use)
        for i, (path, (offset, size)) in enumerate([(env_sif, partition_offset(env_sif))] +
                                                   [(p, (0, 0)) for p in overlays]):
            point = tmp / f"layer{i}"
            point.mkdir()
            limit = f",sizelimit={size}" if size else ""
            subprocess.run(["mount", "-t", "squashfs", "-o", f"loop,ro,offset={offset}{limit}", str(path), str(point)],
                           check=True)
            self.points.append(point)
            lowers.insert(0, str(point))
        self.merged = tmp / "merged"
        self.merged.mkdir()
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={':'.join(lowers)}",
                        str(self.merged)], check=True)
        self.points.append(self.merged)

    def close(self):
        for p in reversed(self.points):
            subprocess.run(["umount", str(p)], check=True)


def test_store_build_instances_index_and_stacking(tmp_path, tiny_base, registries):
    cat = load(catalog(tmp_path, tiny_base))
    summary = build_store(cat, opts(tmp_path, registries.tls.cert))
    assert not summary.failed, summary.failed
    assert summary.count("instance", "built") == 3 and summary.count("environment", "built") == 1
    doc = json.loads((tmp_path / "store/index.json").read_text())
    jsonschema.validate(doc, SCHEMA)
    index = read_index(tmp_path / "store")
    assert set(index.instances) == {"task-0", "task-1", "task-2"}
    inst = index.instances["task-1"]
    assert inst.sqfs == "instances/task-1.sqfs" and inst.workdir == "/work" and inst.grader == {"n": 1}
    env = index.environments["tiny"]
    assert inst.size < env.size / 5, "an instance costs only what it adds"

    listing = lls(tmp_path / "store/instances/task-1.sqfs")
    assert "etc/task" in listing and "etc/opaque/new" in listing
    whiteouts = [line for line in listing.splitlines() if line.startswith("c") and re.search(r"\s0,\s*0\s", line)]
    assert any(line.endswith("etc/from-env") for line in whiteouts), listing
    assert any(line.endswith("etc/opaque/one") for line in whiteouts) and any(line.endswith("etc/opaque/two")
                                                                                for line in whiteouts)
    assert "etc/keep" not in listing, "nothing the instance did not change"

    resolved = Store.open(tmp_path / "store").resolve("task-1")
    assert resolved.layers == (tmp_path / "store" / env.sif, tmp_path / "store/instances/task-1.sqfs")
    assert env.sif == f"envs/{env.build_key[7:39]}.sif", "environments are stored by build key"
    stack = Stack(tmp_path, resolved.env_sif, resolved.overlays)
    try:
        m = stack.merged
        assert (m / "etc/task").read_text() == "task 1\n"
        assert not (m / "etc/from-env").exists(), "a deletion in the instance hides the env's file"
        assert sorted(os.listdir(m / "etc/opaque")) == ["new", "sub"]
        assert os.listdir(m / "etc/opaque/sub") == [], "a directory made again in an opaque one hides the old one's"
        assert (m / "etc/keep/file").read_text() == "e\n"
    finally:
        stack.close()


LAYERED_SCRIPTS = {
    "env.sh": ENV_SCRIPT,
    "tool-a.sh": "#!/bin/sh\nset -e\necho a > /etc/tool\nrm /etc/from-env\n"
                 "rm -rf /etc/opaque && mkdir -p /etc/opaque/sub && echo a > /etc/opaque/a\n",
    "tool-b.sh": "#!/bin/sh\nset -e\necho b > /etc/tool\n",
    "inst.sh": "#!/bin/sh\nset -e\necho \"$TASK\" > /etc/task\n",
}


def layered_catalog(tmp: Path, base: str) -> Path:
    envs = [{"name": "py", "base": base, "scripts": ["env.sh"]},
            {"name": "py-copy", "base": base, "scripts": ["env.sh"]},  # the same build key as py
            {"name": "tool-a", "from": "py", "scripts": ["tool-a.sh"], "env": {"TOOL": "a"}},
            {"name": "tool-b", "from": "py-copy", "scripts": ["tool-b.sh"]}]
    insts = [{"id": f"a-{i}", "environment": "tool-a", "script": "inst.sh", "env": {"TASK": f"a {i}"}}
             for i in range(2)] + [{"id": "b-0", "environment": "tool-b", "script": "inst.sh", "env": {"TASK": "b"}}]
    return write_catalog(tmp, envs, LAYERED_SCRIPTS, insts)


def test_environments_share_images_by_key_and_layer_from_others(tmp_path, tiny_base, registries):
    from image_builder.runtime.backends import open_session
    from image_builder.runtime.execution import RunRequest
    from image_builder.runtime.session import InstanceLayers

    path = layered_catalog(tmp_path, tiny_base)
    r = run_cli("build", str(path), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "cache"),
                "--ca-cert", str(registries.tls.cert))
    assert r.returncode == 0, r.stderr
    assert "py-copy: same environment as py (one image)" in r.stdout
    doc = json.loads((tmp_path / "store/index.json").read_text())
    jsonschema.validate(doc, SCHEMA)
    index = read_index(tmp_path / "store")
    envs = index.environments
    assert envs["py"].sif == envs["py-copy"].sif and envs["py"].build_key == envs["py-copy"].build_key
    assert envs["tool-a"].sif == envs["py"].sif and len(envs["tool-a"].overlays) == 1
    assert envs["tool-a"].overlays[0].file.endswith(".sqfs") and envs["tool-a"].env["TOOL"] == "a"
    files = sorted(p.name for p in (tmp_path / "store/envs").iterdir() if p.suffix in (".sif", ".sqfs"))
    assert len(files) == 3 and sum(f.endswith(".sif") for f in files) == 1, "one base image, two overlays"
    layer = tmp_path / "store" / envs["tool-a"].overlays[0].file
    assert layer.stat().st_size < envs["py"].size / 5, "an environment over another stores only what it adds"
    assert "etc/keep" not in lls(layer)

    resolved = Store.open(tmp_path / "store").resolve("a-1")
    assert resolved.layers == (tmp_path / "store" / envs["py"].sif, layer, tmp_path / "store/instances/a-1.sqfs")
    assert len(resolved.digests) == 3
    stack = Stack(tmp_path, resolved.env_sif, resolved.overlays)  # what `apptainer --overlay` per layer stacks
    try:
        m = stack.merged
        assert (m / "etc/tool").read_text() == "a\n" and (m / "etc/task").read_text() == "a 1\n"
        assert not (m / "etc/from-env").exists() and sorted(os.listdir(m / "etc/opaque")) == ["a", "sub"]
        assert os.listdir(m / "etc/opaque/sub") == [], "the environment's /etc/opaque/sub/old is gone"
        assert (m / "etc/keep/file").read_text() == "e\n"
    finally:
        stack.close()
    layers = InstanceLayers.of(resolved)
    with open_session(layers, state_dir=tmp_path / "state") as session:  # the real runtime, layers checked
        out = session.run(RunRequest(("sh", "-c", "cat /etc/tool /etc/task; echo $TOOL; ls /etc/opaque "
                                      "/etc/opaque/sub"), timeout=30))
    assert out.exit_code == 0 and out.stdout == b"a\na 1\na\n/etc/opaque:\na\nsub\n\n/etc/opaque/sub:\n", out

    again = build_store(load(path), opts(tmp_path, registries.tls.cert))
    assert {r.status for r in again.results} == {"up to date"}
    assert Store.open(tmp_path / "store").resolve("b-0").layers[0] == resolved.env_sif
    # A changed parent changes its children's keys: they are rebuilt over the new parent.
    (tmp_path / "scripts/env.sh").write_text(ENV_SCRIPT + "echo v2 > /etc/version\n")
    changed = build_store(load(path), opts(tmp_path, registries.tls.cert))
    status = {(r.name): r.status for r in changed.results}
    assert sorted([status["py"], status["py-copy"]]) == ["built", "up to date"], "one build for the shared key"
    assert status["tool-a"] == status["tool-b"] == status["a-0"] == "built", status
    run_cli("gc", "--store", str(tmp_path / "store"))
    assert len([p for p in (tmp_path / "store/envs").iterdir() if p.suffix in (".sif", ".sqfs")]) == 3


def test_noop_rebuild_packs_nothing(tmp_path, tiny_base, registries):
    cat = load(catalog(tmp_path, tiny_base))
    build_store(cat, opts(tmp_path, registries.tls.cert))
    images = sorted((tmp_path / "store").glob("*/*.s*"))
    stamps = [p.stat().st_mtime_ns for p in images]
    again = build_store(cat, opts(tmp_path, registries.tls.cert))
    assert {r.status for r in again.results} == {"up to date"}
    assert [p.stat().st_mtime_ns for p in images] == stamps


def test_resolve_errors_and_stale_lookup(tmp_path, tiny_base, registries):
    build_store(load(catalog(tmp_path, tiny_base, n=1)), opts(tmp_path, registries.tls.cert))
    store = Store.open(tmp_path / "store")
    with pytest.raises(UnknownInstance, match="no instance 'nope'"):
        store.resolve("nope")
    first = store.resolve("task-0")
    assert store.resolve("task-0") is first  # kept while index.json is unchanged
    index_json = tmp_path / "store/index.json"
    doc = json.loads(index_json.read_text())
    doc["instances"]["task-0"]["workdir"] = "/changed-by-hand"
    index_json.write_text(json.dumps(doc))  # the lookup copy is now stale: the JSON must win
    assert Store.open(tmp_path / "store").resolve("task-0").workdir == "/changed-by-hand"
    assert store.resolve("task-0").workdir == "/changed-by-hand"  # what it kept is dropped
    with pytest.raises(Exception, match="not a store"):
        Store.open(tmp_path / "nowhere")


def test_failing_instance_does_not_stop_the_rest(tmp_path, tiny_base, registries):
    path = catalog(tmp_path, tiny_base, n=2, extra={"bad.sh": "#!/bin/sh\necho about-to-fail\nexit 4\n"})
    doc = yaml.safe_load(path.read_text())
    doc["instances"].append({"id": "broken", "environment": "tiny", "script": "bad.sh"})
    path.write_text(yaml.safe_dump(doc))
    r = run_cli("build", str(path), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "c"),
                "--ca-cert", str(registries.tls.cert), "-j", "2")
    assert r.returncode == 1
    assert "failed: instance broken: script bad.sh exited 4" in r.stderr
    log = tmp_path / "store/logs/instances/broken.log"
    assert "about-to-fail" in log.read_text()
    index = read_index(tmp_path / "store")
    assert set(index.instances) == {"task-0", "task-1"}, "the index lists only finished items"


def test_a_failed_instance_build_opens_in_debug(tmp_path, tiny_base, registries):
    """A failed instance's tree is kept as a failed environment's is (its upper over the environment's layers),
    and `image-builder debug ID` opens a shell in it with the build's variables; before, only environments'
    were kept (`no failed build of 'broken' in STORE/failed/envs`). gc removes it."""
    bad = "#!/bin/sh\necho half-done > /work/partial\necho about-to-fail\nexit 4\n"
    path = catalog(tmp_path, tiny_base, n=1, extra={"bad.sh": bad})
    doc = yaml.safe_load(path.read_text())
    doc["instances"].append({"id": "broken", "environment": "tiny", "script": "bad.sh", "workdir": "/work",
                             "env": {"MARK": "from-the-build"}})
    path.write_text(yaml.safe_dump(doc))
    store = tmp_path / "store"
    r = run_cli("build", str(path), "--store", str(store), "--cache-dir", str(tmp_path / "c"),
                "--ca-cert", str(registries.tls.cert))
    assert r.returncode == 1 and f"debug with: image-builder debug broken --store {store}" in r.stderr, r.stderr
    out = drive_pty([str(ROOT / ".venv/bin/image-builder"), "debug", "broken", "--store", str(store)],
                    b"cat /work/partial; echo mark=$MARK; cat /etc/from-env; exit\n")
    assert "half-done" in out and "mark=from-the-build" in out, out
    assert "\nenv" in out.replace("\r", ""), "the environment's layers are under it"
    assert run_cli("gc", "--store", str(store)).returncode == 0
    assert not (store / "failed/instances/broken").exists()


def test_a_dead_builders_staging_is_swept_whether_or_not_it_was_handed_over():
    """A root builder killed between making its staging folder in the temporary folder and handing it to
    BUILD_UID left it root's: the next build kept it for good (met in CI, test_kill_9_mid_build_then_resume).
    Root's and BUILD_UID's folders of a dead builder go; another user's, a live builder's and a symlink stay."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    prefix = f"{STAGING}{socket.gethostname()}@"
    tmp = Path(tempfile.gettempdir())
    made = {name: tmp / f"{prefix}{pid}-sweep-{name}" for name, pid in
            (("root", dead.pid), ("handed", dead.pid), ("other-user", dead.pid), ("live", os.getpid()))}
    link = tmp / f"{prefix}{dead.pid}-sweep-link"
    try:
        for name, path in made.items():
            (path / "files").mkdir(parents=True)
            (path / "files" / "ca.pem").write_text("x")
        for path, uid in ((made["handed"], BUILD_UID), (made["other-user"], 65534)):
            for p in (path, path / "files", path / "files" / "ca.pem"):
                os.lchown(p, uid, uid)
        link.symlink_to(made["live"])
        remove_dead_staging()  # (a build in another test may sweep them first: what is left is what counts)
        assert not made["root"].exists() and not made["handed"].exists(), sorted(tmp.glob(f"{prefix}*"))
        assert made["other-user"].exists() and made["live"].exists() and link.is_symlink()
    finally:
        link.unlink(missing_ok=True)
        for path in made.values():
            shutil.rmtree(path, ignore_errors=True)


def test_kill_9_mid_build_then_resume(tmp_path, tiny_base, registries):
    slow = INSTANCE_SCRIPT + "sleep 2\n"
    path = catalog(tmp_path, tiny_base, n=4, instance_script=slow)
    args = ["build", str(path), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "c"),
            "--ca-cert", str(registries.tls.cert), "-j", "2"]
    exe = str(ROOT / ".venv/bin/image-builder")
    staged_before = set(Path(tempfile.gettempdir()).glob("ib-sandbox-*"))
    proc = subprocess.Popen([exe, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    # An image counts as built once its record (written after it) is there.
    while time.monotonic() < deadline and not list((tmp_path / "store").glob("instances/*.json")):
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "store/work").exists() and list((tmp_path / "store/work").iterdir()), \
        "the build was killed with work in progress"
    r = run_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    statuses = [x["status"] for x in json.loads(r.stdout)["results"] if x["kind"] == "instance"]
    assert "up to date" in statuses and "built" in statuses, "finished items are kept, the rest built"
    assert not list((tmp_path / "store/work").iterdir()), "dead builds' work trees are cleaned"
    # a root build's sandboxes stage in /tmp (their user must reach them): the killed builder's went too
    # (what another test's live builder stages there now is named by its pid)
    live = re.compile(rf"ib-sandbox-{re.escape(socket.gethostname())}@(\d+)-")
    leaked = [p.name for p in set(Path(tempfile.gettempdir()).glob("ib-sandbox-*")) - staged_before
              if not ((m := live.match(p.name)) and Path(f"/proc/{m.group(1)}").exists())]
    assert not leaked, leaked
    v = run_cli("verify", "--store", str(tmp_path / "store"))
    assert v.returncode == 0 and "0 missing, 0 corrupt, 0 orphaned" in v.stdout, v.stdout


def test_two_concurrent_builds_of_one_store(tmp_path, tiny_base, registries):
    path = catalog(tmp_path, tiny_base, n=4)
    args = ["build", str(path), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "c"),
            "--ca-cert", str(registries.tls.cert), "--json"]
    exe = str(ROOT / ".venv/bin/image-builder")
    procs = [subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    built = sum(1 for out, _ in outs for x in json.loads(out)["results"] if x["status"] == "built")
    assert built == 5, "each environment and instance is built once, by one of the two"
    assert len(read_index(tmp_path / "store").instances) == 4
    assert run_cli("verify", "--store", str(tmp_path / "store")).returncode == 0


def test_verify_finds_corruption_and_build_repairs_it(tmp_path, tiny_base, registries):
    path = catalog(tmp_path, tiny_base, n=1)
    build_store(load(path), opts(tmp_path, registries.tls.cert))
    rel = read_index(tmp_path / "store").environments["tiny"].sif
    sif = tmp_path / "store" / rel
    with open(sif, "r+b") as f:
        f.seek(sif.stat().st_size - 100)
        f.write(b"corrupted!")
    (tmp_path / "store/instances/stray.sqfs").write_bytes(b"x")
    r = run_cli("verify", "--store", str(tmp_path / "store"))
    assert r.returncode == 1
    assert f"corrupt: {rel}" in r.stdout and "orphaned: instances/stray.sqfs" in r.stdout
    summary = build_store(load(path), opts(tmp_path, registries.tls.cert))
    assert [r.status for r in summary.results if r.kind == "environment"] == ["built"]
    g = run_cli("gc", "--store", str(tmp_path / "store"))
    assert "removed instances/stray.sqfs" in g.stdout
    assert run_cli("verify", "--store", str(tmp_path / "store")).returncode == 0


def test_shards_merge_into_the_same_index(tmp_path, tiny_base, registries):
    path = catalog(tmp_path, tiny_base, n=5)
    for k in range(2):
        r = run_cli("build", str(path), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "c"),
                    "--ca-cert", str(registries.tls.cert), "--shard", f"{k}/2")
        assert r.returncode == 0, r.stderr
    assert not (tmp_path / "store/index.json").exists()
    m = run_cli("index", "merge", "--store", str(tmp_path / "store"))
    assert m.returncode == 0 and "merged 2 fragments" in m.stdout
    assert sorted(read_index(tmp_path / "store").instances) == [f"task-{i}" for i in range(5)]
    ls = run_cli("ls", "--store", str(tmp_path / "store"))
    assert ls.returncode == 0 and "tiny" in ls.stdout and " 5 " in ls.stdout
    insp = run_cli("inspect", "task-3", "--store", str(tmp_path / "store"))
    assert "apptainer exec --overlay" in insp.stdout and "task-3.sqfs:ro" in insp.stdout


def test_two_catalogs_share_a_store_built_from_a_relative_path(tmp_path, tiny_base, registries):
    """A second catalog adds to the store instead of dropping the first's items; a rebuild of either keeps
    the other's; one that declares a name the other owns is refused in one line. `--store store`, relative
    to the working directory, builds (it used to fail every environment at chroot)."""
    def named(directory: str, name: str, env: str, prefix: str) -> Path:
        (tmp_path / directory).mkdir()
        insts = [{"id": f"{prefix}-{i}", "environment": env, "script": "inst.sh", "env": {"TASK": str(i)}}
                 for i in range(2)]
        path = write_catalog(tmp_path / directory, [{"name": env, "base": tiny_base, "scripts": ["env.sh"]}],
                             {"env.sh": ENV_SCRIPT, "inst.sh": INSTANCE_SCRIPT}, insts)
        return path.rename(path.with_name(name))

    def build(cat: Path):
        return run_cli("build", str(cat), "--store", "store", "--cache-dir", "cache", "--ca-cert",
                       str(registries.tls.cert), cwd=tmp_path)

    first, second = named("a", "first.yaml", "tiny", "a"), named("b", "second.yaml", "tiny2", "b")
    for cat in (first, second, first):
        r = build(cat)
        assert r.returncode == 0, r.stderr
    index = read_index(tmp_path / "store")
    assert sorted(index.environments) == ["tiny", "tiny2"] and sorted(index.instances) == ["a-0", "a-1", "b-0", "b-1"]
    assert {i: r.catalog for i, r in index.instances.items()} == {
        "a-0": str(first), "a-1": str(first), "b-0": str(second), "b-1": str(second)}
    jsonschema.validate(json.loads((tmp_path / "store/index.json").read_text()), SCHEMA)
    clash = named("c", "third.yaml", "tiny", "c")
    r = build(clash)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"Error: {tmp_path / 'c/third.yaml'}: environment 'tiny' is already in {tmp_path / 'store'} from catalog "
        f"{first}; rename it in one of them (generated ones: swebench catalog --prefix NAME) or build into "
        "another store"), r.stderr
    copy = shutil.copytree(first.parent, tmp_path / "copy")  # a copy (another clone of the same commit) is it
    r = build(copy / first.name)
    assert r.returncode == 0, r.stderr
    assert read_index(tmp_path / "store").instances["a-0"].catalog == str(copy / first.name)
    r = build(first)
    assert r.returncode == 0, r.stderr
    index = read_index(tmp_path / "store")
    assert index.instances["a-0"].catalog == str(first) and sorted(index.instances) == ["a-0", "a-1", "b-0", "b-1"]
    namesake = named("d", "first.yaml", "tiny", "d")  # another folder's first.yaml is another catalog
    r = build(namesake)
    assert r.returncode != 0 and f"is already in {tmp_path / 'store'} from catalog {first};" in r.stderr, r.stderr
    assert read_index(tmp_path / "store") == index, "nothing already built is lost"
    moved = first.rename(tmp_path / "c" / first.name)  # a catalog moved is still its items' owner
    r = build(moved)
    assert r.returncode == 0, r.stderr
    assert {r.catalog for i, r in read_index(tmp_path / "store").instances.items() if i.startswith("a-")} == {
        str(moved)}
    for k in range(2):  # one catalog rebuilt in shards: the merge keeps the other's items
        r = run_cli("build", str(second), "--store", "store", "--cache-dir", "cache", "--ca-cert",
                    str(registries.tls.cert), "--shard", f"{k}/2", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    assert run_cli("index", "merge", "--store", "store", cwd=tmp_path).returncode == 0
    assert sorted(read_index(tmp_path / "store").instances) == ["a-0", "a-1", "b-0", "b-1"]


def test_a_store_another_user_cannot_read_is_one_line_not_a_traceback(tmp_path):
    store = tmp_path / "private" / "store"
    store.mkdir(parents=True)
    (store / "index.json").write_text("{}")
    (tmp_path / "private").chmod(0o700)
    for args in (("run", "--store", str(store), "task-0", "--", "true"), ("ls", "--store", str(store))):
        result = run_cli(*args, user=65534)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"Error: {store}: cannot read its index.json (Permission denied); its owner can share it with "
            f"`chmod -R a+rX {store}`"]


def test_failed_instance_builds_kept_are_the_newest(tmp_path):
    """A dataset whose spec is broken fails every instance: only the newest FAILED_KEPT trees stay."""
    from image_builder.build.instances import make_room_for_failed
    for i in range(20):
        (tmp_path / f"i{i}").mkdir()
        os.utime(tmp_path / f"i{i}", ns=(i * 10**9, i * 10**9))
    make_room_for_failed(tmp_path, kept=16)
    assert sorted(int(p.name[1:]) for p in tmp_path.iterdir()) == list(range(5, 20)), "15: room for one more"
    make_room_for_failed(tmp_path / "none")  # no directory yet: nothing to do


def test_a_tree_another_process_removes_meanwhile_is_removed_without_error(tmp_path, monkeypatch):
    """A killed build's sandbox may still be removing its staging folder when the next build removes it as
    dead: a folder gone under rmtree is done, not an error (`build` failed with a traceback on resume)."""
    import os
    from image_builder.store.store import remove_tree
    tree = tmp_path / "staging"
    (tree / "files/usr/lib").mkdir(parents=True)
    (tree / "files/usr/lib/x").write_text("x")
    real_rmdir = os.rmdir

    def raced(path, *args, **kwargs):  # the other process got there first
        real_rmdir(path, *args, **kwargs)
        if os.path.basename(path) == "files":
            raise FileNotFoundError(2, "No such file or directory", path)
    monkeypatch.setattr(os, "rmdir", raced)
    remove_tree(tree)
    assert not tree.exists()
