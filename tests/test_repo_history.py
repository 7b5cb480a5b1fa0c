"""An instance's repository holds its base commit and that commit's ancestors, nothing later
(build/repo_history.py): not the fix, not the hidden tests, however the instance got its
repository; `image-builder verify` names an instance that holds more."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from image_builder.agents.sandbox import open_sandbox
from image_builder.build.catalog import InstanceSpec, Where
from image_builder.build.envbuild import EnvBuild
from image_builder.build.instances import build_instance
from image_builder.graders.patches import touched_paths
from image_builder.oci.cache import sha256_file
from image_builder.pack.squashfs import SquashOptions, pack
from image_builder.runtime.backends import open_session
from image_builder.runtime.execution import RunRequest
from image_builder.runtime.session import InstanceLayers
from image_builder.store.index import read_index, write_index
from image_builder.store.store import ResolvedInstance, Store
from image_builder.tasks import load_tasks
from tests.conftest import DATA, run_cli

BUNDLE = DATA / "repos" / "marshmallow.bundle"
RECORDS = {r["instance_id"]: r for r in map(json.loads, (DATA / "swebench_marshmallow.jsonl").read_text().splitlines())
           if not r.get("impossible_type")}
IID = "marshmallow-code__marshmallow-1359"
GIT = ["git", "-c", "core.hooksPath=/dev/null"]  # the host's git, on this test's own copies of trusted data


def run_in(resolved: ResolvedInstance, argv: list[str]) -> str:
    """argv in a fresh run of the instance, in its workdir; its stdout (asserting exit 0)."""
    with open_session(InstanceLayers(resolved.env_sif, resolved.overlays, resolved.env, resolved.workdir)) as s:
        r = s.run(RunRequest(tuple(argv), timeout=300, max_output=64 << 20))
    assert r.exit_code == 0, (argv, r.stderr.decode(errors="replace")[-2000:])
    return r.stdout.decode()


def host_clone(dest: Path, commit: str) -> Path:
    subprocess.run([*GIT, "clone", "-q", "--no-checkout", str(BUNDLE), str(dest)], check=True)
    subprocess.run([*GIT, "-C", str(dest), "-c", "advice.detachedHead=false", "checkout", "-q", commit], check=True)
    return dest


def added_line(patch: str) -> str:
    """A line the patch adds: `git log --all -S` finds the commit that added it."""
    return max((line[1:].strip() for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++")),
               key=len)


@pytest.mark.parametrize("iid", sorted(RECORDS))
def test_an_instance_holds_its_base_commit_and_its_ancestors_only(marshmallow_store, iid, tmp_path):
    """swebench-instance.sh clones the whole bundle (2,686 commits, 4 branches, 133 tags; the tags 3.0.1-3.0.3 on
    marshmallow-1359's fix): what the instance keeps is what SWE-bench's images keep."""
    base = RECORDS[iid]["base_commit"]
    needle = added_line(RECORDS[iid]["patch"])
    clone = host_clone(tmp_path / "clone", base)
    git = [*GIT, "-C", str(clone)]
    assert subprocess.run([*git, "log", "--all", "--format=%H", "-S", needle], capture_output=True, text=True,
                          check=True).stdout, "the bundle holds the fix: the attack works on a plain clone"
    ancestors = set(subprocess.run([*git, "rev-list", base], capture_output=True, text=True, check=True).stdout.split())
    resolved = Store.open(marshmallow_store).resolve(iid)
    assert run_in(resolved, ["git", "log", "--all", "--format=%H", "-S", needle]) == "", "the fix is not in .git"
    assert set(run_in(resolved, ["git", "log", "--all", "--format=%H"]).split()) == ancestors
    assert set(run_in(resolved, ["git", "rev-list", "--all", "--reflog"]).split()) == ancestors
    objects = run_in(resolved, ["git", "cat-file", "--batch-all-objects", "--batch-check=%(objectname) %(objecttype)"])
    commits = {line.split()[0] for line in objects.splitlines() if line.endswith(" commit")}
    assert commits == ancestors, "no commit object but the base commit's ancestors, reachable or not"
    # From the refs (the tags below) and the index: the tags' own objects too.
    reachable = run_in(resolved, ["git", "rev-list", "--objects", "--no-object-names", "--all", "--indexed-objects"])
    assert {line.split()[0] for line in objects.splitlines()} == set(reachable.split()), "no unreachable object"
    refs = run_in(resolved, ["git", "for-each-ref", "--format=%(refname)"]).split()
    assert refs and all(ref.startswith("refs/tags/") for ref in refs), refs
    assert run_in(resolved, ["git", "tag", "--no-merged", base]) == "", "no tag beyond the base commit"
    assert run_in(resolved, ["git", "remote"]) == ""
    assert run_in(resolved, ["sh", "-c", "ls .git; ls .git/objects/info"]).split() == \
        ["HEAD", "branches", "config", "description", "hooks", "index", "info", "objects", "packed-refs", "refs"], \
        "no reflog, ORIG_HEAD, FETCH_HEAD, alternates or commit-graph"
    assert run_in(resolved, ["git", "rev-parse", "HEAD"]).strip() == base


def test_hidden_mode_leaves_no_object_holding_the_hidden_tests(marshmallow_store, tmp_path):
    """ImpossibleBench's hidden mode removes the test patch's files from the agent's checkout: no git object may
    hold them as the test patch has them (a plain clone holds them: the fix commit added them)."""
    task = next(t for t in load_tasks(DATA / "swebench_marshmallow.jsonl") if t.task_id == IID)
    clone = host_clone(tmp_path / "clone", task.base_commit)
    subprocess.run([*GIT, "-C", str(clone), "apply", "-"], input=task.test_patch.encode(), check=True)
    paths = touched_paths(task.test_patch)
    hidden = subprocess.run([*GIT, "-C", str(clone), "hash-object", "--", *paths], capture_output=True, text=True,
                            check=True).stdout.split()
    held = subprocess.run([*GIT, "-C", str(clone), "cat-file", "--batch-check"], input="\n".join(hidden) + "\n",
                          capture_output=True, text=True, check=True).stdout
    assert "missing" not in held, "a plain clone of the bundle holds the hidden tests"
    with open_sandbox(marshmallow_store, task=task, access="hidden", state_dir=tmp_path / "state") as box:
        assert box.exec(["test", "-e", paths[0]]).exit_code != 0, "hidden: the test file is not in the checkout"
        r = box.exec(["git", "cat-file", "--batch-check"], input="\n".join(hidden) + "\n")
        assert r.stdout.decode().split().count("missing") == len(hidden), r.stdout
        r = box.exec(["git", "log", "--all", "--format=%H", "-S", added_line(task.test_patch)])
        assert r.exit_code == 0 and r.stdout == b"", "no commit adds the hidden test"


def _planted(store: Path, iid: str, tmp: Path) -> None:
    """The instance as it was built before repo_history: its clone given back a tag of a later release (the
    commits up to it, the fix among them). Its overlay is rewritten in place of the old one (the store is a
    hard-linked copy: a new file, never the linked one changed), and the index with it."""
    index = read_index(store)
    record = index.instances[iid]
    sqfs = store / record.sqfs
    tree = tmp / "tree"
    subprocess.run(["unsquashfs", "-q", "-d", str(tree), str(sqfs)], check=True)
    subprocess.run([*GIT, "-C", str(tree / "testbed"), "fetch", "-q", "--no-tags", "--no-write-fetch-head", str(BUNDLE),
                    "refs/tags/3.0.3:refs/tags/3.0.3"], check=True)
    sqfs.unlink()
    pack(tree, sqfs, SquashOptions(all_root=True))
    instances = {**index.instances, iid: replace(record, sha256=sha256_file(sqfs), size=sqfs.stat().st_size)}
    write_index(store, replace(index, instances=instances))


def test_verify_names_an_instance_holding_later_history(marshmallow_store, tmp_path):
    fixed = run_cli("verify", "--store", str(marshmallow_store))
    assert fixed.returncode == 0 and "0 instances with history beyond their base commit" in fixed.stdout, fixed.stdout
    store = tmp_path / "store"
    shutil.copytree(marshmallow_store, store, copy_function=os.link)
    _planted(store, IID, tmp_path)
    r = run_cli("verify", "--store", str(store))
    assert r.returncode == 1, r.stdout + r.stderr
    flagged = [line for line in r.stdout.splitlines() if line.startswith("history: ")]
    assert len(flagged) == 1 and flagged[0].startswith(f"history: {IID!r}: /testbed/.git: "), r.stdout
    assert "commits that are not HEAD or its ancestors" in flagged[0], flagged
    assert "1 refs besides HEAD's branch and its tags (refs/tags/3.0.3 ...)" in flagged[0], flagged
    assert "1 instances with history beyond their base commit" in r.stdout
    assert run_cli("verify", "--store", str(store), "--no-history").returncode == 0, "the files themselves are sound"


# An instance script that leaves every kind of history a repository can hold besides HEAD's: the objects
# only in an alternate (a mirror on the build's /tmp, gone after it), a branch, tags (annotated, and on a
# tree), a remote, a stash, notes, a replace ref, a linked worktree, reflogs, ORIG_HEAD, a kept pack.
TANGLED = r"""set -eux
BASE=$1
git clone -q --mirror /build/marshmallow.bundle /tmp/mirror.git
git clone -q --no-checkout --shared /tmp/mirror.git .
git -c advice.detachedHead=false checkout -q -b main "$BASE"
git config user.email t@t && git config user.name t
git tag -a -m later later-annotated refs/remotes/origin/env30
git tag tree-tag "$BASE^{tree}"
git branch side refs/tags/3.0.3
echo dirt >> README.rst && git stash -q
git notes add -m note HEAD
git replace HEAD~1 HEAD~2
git worktree add -q /tmp/wt refs/remotes/origin/i1343
git update-ref ORIG_HEAD refs/remotes/origin/env30
git repack -q -d && touch .git/objects/pack/$(ls .git/objects/pack | grep '\.pack$' | head -n 1 | sed 's/pack$/keep/')
"""


def test_every_kind_of_later_history_goes_and_the_repository_still_works(marshmallow_store, tmp_path):
    store = Store.open(marshmallow_store)
    env_record = store.index.environments["marshmallow-3.0"]
    env = EnvBuild(env_record.name, store.root / env_record.files[0],
                   tuple(store.root / f for f in env_record.files[1:]), env_record.build_key, env_record.base,
                   env_record.base_digest, env_record.env, False, 0.0)
    script = tmp_path / "tangled.sh"
    script.write_text(TANGLED.replace("$1", RECORDS[IID]["base_commit"]))
    spec = InstanceSpec("tangled", env.name, script, {}, {}, "/testbed", None, {}, 600, Where(script, 1),
                        context=DATA / "repos")
    build = build_instance(spec, env, tmp_path / "store")
    resolved = ResolvedInstance("tangled", env.name, env.sif, (*env.overlays, build.sqfs), env.env, "/testbed",
                                None, {})
    base = RECORDS[IID]["base_commit"]
    refs = run_in(resolved, ["git", "for-each-ref", "--format=%(refname)"]).split()
    assert "refs/heads/main" in refs and "refs/tags/2.0.0" in refs, "HEAD's branch and the tags on its history"
    assert [r for r in refs if r != "refs/heads/main" and not r.startswith("refs/tags/")] == [], refs
    assert "refs/tags/later-annotated" not in refs and "refs/tags/tree-tag" not in refs
    assert run_in(resolved, ["git", "symbolic-ref", "HEAD"]).strip() == "refs/heads/main"
    count = run_in(resolved, ["sh", "-c", "git cat-file --batch-all-objects --batch-check | wc -l; "
                                          "git rev-list --objects --all --indexed-objects | wc -l"]).split()
    assert count[0] == count[1], "every object reachable"
    assert run_in(resolved, ["git", "log", "--all", "--format=%H"]).split() == \
        run_in(resolved, ["git", "rev-list", base]).split()
    # The mirror it borrowed from is gone (the build's /tmp): what HEAD needs was copied in.
    run_in(resolved, ["git", "fsck", "--no-dangling", "--strict"])
    left = run_in(resolved, ["sh", "-c", "ls -a .git .git/objects/info .git/objects/pack"])
    for gone in ("logs", "ORIG_HEAD", "worktrees", "alternates", ".keep"):
        assert gone not in left, (gone, left)
    assert run_in(resolved, ["git", "stash", "list"]) == "" and run_in(resolved, ["git", "remote"]) == ""
