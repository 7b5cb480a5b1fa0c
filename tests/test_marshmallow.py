"""The SWE-bench sample end to end: index/swebench-marshmallow.yaml built for real."""

from __future__ import annotations

import json
import subprocess

from image_builder.store.store import Store
from tests.conftest import ROOT
from tests.test_store import Stack

DATA = [json.loads(line) for line in open(ROOT / "index/data/swebench_marshmallow.jsonl")]
ORIGINALS = {r["instance_id"]: r for r in DATA if not r.get("impossible_type")}


def test_two_environments_two_instances(marshmallow_store):
    store = Store.open(marshmallow_store)
    assert set(store.index.environments) == {"marshmallow-3.0", "marshmallow-2.20"}
    assert set(store.index.instances) == set(ORIGINALS)
    for iid, record in ORIGINALS.items():
        inst = store.index.instances[iid]
        env = store.index.environments[inst.environment]
        assert inst.environment == f"marshmallow-{record['version']}"
        assert inst.size * 10 < env.size, "an instance is much smaller than its environment"
        assert inst.grader["base_commit"] == record["base_commit"]


def test_instance_holds_the_repo_at_base_commit(marshmallow_store, tmp_path):
    store = Store.open(marshmallow_store)
    for iid, record in ORIGINALS.items():
        resolved = store.resolve(iid)
        work = tmp_path / iid
        work.mkdir()
        stack = Stack(work, resolved.env_sif, resolved.overlays)
        try:
            def run(*cmd):
                # Images carry no device nodes (every runtime brings its own /dev): bind the host's.
                inner = f"cd {resolved.workdir} && PATH=/opt/venv/bin:$PATH " + " ".join(cmd)
                return subprocess.run(["unshare", "--mount", "sh", "-c", 'mount --rbind /dev "$0/dev" && '
                                       'exec chroot "$0" /bin/sh -c "$1"', str(stack.merged), inner],
                                      capture_output=True, text=True)
            head = run("git", "rev-parse", "HEAD")
            assert head.stdout.strip() == record["base_commit"], head.stderr
            assert run("git", "status", "--porcelain", "--untracked-files=no").stdout == "", \
                "tracked files are as at base_commit"
            imported = run("python", "-c", "'import marshmallow, sys; print(marshmallow.__file__, sys.version_info[:2])'")
            assert imported.stdout.startswith("/testbed/"), imported.stderr
            want = (3, 9) if record["version"] == "2.20" else (3, 11)
            assert imported.stdout.strip().endswith(str(want)), imported.stdout
        finally:
            stack.close()
