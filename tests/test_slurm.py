"""Slurm scale-out: sharded builds and grading as real job arrays on a one-node cluster (munged, slurmctld,
slurmd)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import requests
import yaml

from image_builder.errors import ImageBuilderError
from image_builder.graders import GradeResult, TaskStatus, load_predictions, load_tasks
from image_builder.graders.grading import merge_results, shard_predictions
from image_builder.slurm import (Run, SbatchOptions, SlurmError, build_plan, drop_other_fragments, format_indices,
                                 parse_indices, write_run)
from image_builder.store.index import read_index
from image_builder.store.store import remove_tree
from tests.conftest import run_cli
from tests.support.grader_data import MBPP_SOLUTIONS, MBPP_TASKS
from tests.support.slurm_cluster import start_cluster
from tests.test_store import ENV_SCRIPT, catalog

ROOT = Path(__file__).resolve().parents[1]
EPOCH = {"SOURCE_DATE_EPOCH": "1700000000"}


@pytest.fixture(scope="session")
def slurm_cluster():
    # munged wants every directory above its socket searchable by all: pytest's tmp is private to root.
    root = Path(tempfile.mkdtemp(prefix="ib-slurm-", dir="/var/tmp"))
    root.chmod(0o755)
    cluster = start_cluster(root)
    try:
        yield cluster
    finally:
        cluster.stop()
        remove_tree(root)


def eight_instances(tmp: Path, base: str, script: str | None = None, **kw) -> Path:
    """8 instances of one environment, and an environment no instance uses (a full build has it too)."""
    path = catalog(tmp, base, n=8, **kw)
    doc = yaml.safe_load(path.read_text())
    # Its own build key (a variable of its own): an environment equal to tiny would share tiny's image.
    doc["environments"].append({"name": "spare", "base": base, "scripts": ["env.sh"], "env": {"SPARE": "1"}})
    if script:  # task-5, in shard 1 of 4, runs this one
        doc["instances"][5]["script"] = script
    path.write_text(yaml.safe_dump(doc))
    return path


def slurm(cluster, *args: str) -> subprocess.CompletedProcess:
    return run_cli("slurm", *args, env={**cluster.env, **EPOCH})


def slurm_build(cluster, cat: Path, store: Path, registries, *extra: str) -> subprocess.CompletedProcess:
    return slurm(cluster, "build", str(cat), "--store", str(store), "--shards", "4", "--cache-dir",
                 str(store.parent / "cache"), "--ca-cert", str(registries.tls.cert), "--poll", "0.5", *extra)


def the_run(store: Path) -> Run:
    runs = sorted((store / "slurm").iterdir())
    assert len(runs) == 1, runs
    return Run.open(runs[0])


def comparable(store: Path) -> tuple[dict, dict]:
    """The index's records, without the one field that is a wall-clock time (when an image was built)."""
    index = read_index(store)
    return ({k: {**asdict(v), "built_at": None} for k, v in index.environments.items()},
            {k: asdict(v) for k, v in index.instances.items()})


def test_indices_round_trip():
    assert parse_indices("0-3") == (0, 1, 2, 3)
    assert parse_indices("1,5,7-8%2") == (1, 5, 7, 8)
    assert format_indices([5, 0, 1, 2, 8, 7]) == "0-2,5,7-8"
    assert parse_indices(format_indices(range(0, 100, 3))) == tuple(range(0, 100, 3))
    with pytest.raises(SlurmError, match="not a job array index list"):
        parse_indices("1-x")


def test_run_scripts_are_readable_bash(tmp_path, tiny_base, registries):
    cat = eight_instances(tmp_path, tiny_base)
    plan = build_plan(cat, tmp_path / "store", 4, bases={"py": "example.org/py:3"}, cache_dir=None,
                      ca_cert=registries.tls.cert, plain_http=(), insecure_tls=("example.org",), compression="gzip")
    run = write_run(plan, SbatchOptions("short", "0:30:00", 2, ("--account=proj",)), EPOCH)
    job = (run.directory / "job.sh").read_text()
    for script in ("job.sh", "submit.sh"):
        subprocess.run(["bash", "-n", str(run.directory / script)], check=True)
    for line in ("#SBATCH --partition=short", "#SBATCH --time=0:30:00", "#SBATCH --cpus-per-task=2",
                 "#SBATCH --account=proj", "export SOURCE_DATE_EPOCH=1700000000"):
        assert line in job.splitlines()
    assert '--shard "$SHARD/4" --attempt "$SLURM_ARRAY_JOB_ID"' in job and "--insecure-tls example.org" in job
    assert f"--ca-cert {registries.tls.cert}" in job and "--base py=example.org/py:3" in job
    assert "ib index merge --store" in job and "&& ib verify --store" in job
    with pytest.raises(SlurmError, match="expected one sbatch option"):
        write_run(plan, SbatchOptions(extra=("account=proj",)), {})
    with pytest.raises(SlurmError, match="--shards 9: .* has only 8 instances"):
        build_plan(cat, tmp_path / "store", 9, bases={}, cache_dir=None, ca_cert=None, plain_http=(),
                   insecure_tls=(), compression="zstd")


def test_fragments_of_another_shard_count_are_dropped(tmp_path):
    fragments = tmp_path / "index.d"
    fragments.mkdir()
    for name in ("shard-0-of-2.json", "shard-1-of-2.json", "shard-1-of-4.json", "shard-3-of-40.json"):
        (fragments / name).write_text("{}")
    dropped = drop_other_fragments(tmp_path, 4)
    assert sorted(p.name for p in dropped) == ["shard-0-of-2.json", "shard-1-of-2.json", "shard-3-of-40.json"]
    assert [p.name for p in fragments.iterdir()] == ["shard-1-of-4.json"]


def test_environments_only_builds_no_instance(tmp_path, tiny_base, registries):
    cat = eight_instances(tmp_path, tiny_base)
    r = run_cli("build", str(cat), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "cache"),
                "--ca-cert", str(registries.tls.cert), "--environments-only")
    assert r.returncode == 0, r.stderr
    index = read_index(tmp_path / "store")
    assert sorted(index.environments) == ["spare", "tiny"] and not index.instances
    assert not list((tmp_path / "store").glob("instances/*.sqfs"))


def test_an_environment_that_failed_in_one_shard_is_not_retried_by_the_others(tmp_path, tiny_base, registries):
    cat = eight_instances(tmp_path, tiny_base)
    (tmp_path / "scripts/env.sh").write_text("#!/bin/sh\nexit 4\n")  # a broken environment

    def shard(k: int, attempt: str) -> subprocess.CompletedProcess:
        return run_cli("build", str(cat), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "cache"),
                       "--ca-cert", str(registries.tls.cert), "--shard", f"{k}/4", "--attempt", attempt)
    first, second = shard(0, "41"), shard(1, "41")
    assert first.returncode == 1 and "environment tiny: failed" in first.stderr and "exited 4" in first.stderr
    assert second.returncode == 1 and "environment tiny: its build failed in another shard of this submission; " \
        f"log: {tmp_path / 'store/logs/envs/tiny'}" in second.stderr, second.stderr
    assert "exited 4" not in second.stderr, "not built again"
    (tmp_path / "scripts/env.sh").write_text(ENV_SCRIPT)  # fixed
    assert shard(1, "42").returncode == 0, "a new submission tries again"
    assert not (tmp_path / "store/locks/env-tiny.failed").exists()


def test_sharded_slurm_build_equals_one_process_build(tmp_path, tiny_base, registries, slurm_cluster):
    cat = eight_instances(tmp_path, tiny_base)
    one = run_cli("build", str(cat), "--store", str(tmp_path / "one/store"), "--cache-dir",
                  str(tmp_path / "one/cache"), "--ca-cert", str(registries.tls.cert), "-j", "2", env=EPOCH)
    assert one.returncode == 0, one.stderr

    store = tmp_path / "arr/store"
    r = slurm_build(slurm_cluster, cat, store, registries, "--wait")
    assert r.returncode == 0, r.stdout + r.stderr + slurm_cluster.logs()
    assert "submitted shard " in r.stdout and "(shards 0-3)" in r.stdout
    assert "shards 4/4 done" in r.stderr and "done: every job of" in r.stdout
    assert comparable(store) == comparable(tmp_path / "one/store"), "same items, same digests"

    run = the_run(store)
    sub = run.submissions()[-1]
    assert sub.shards == (0, 1, 2, 3) and set(sub.jobs) == {"shard", "merge"}
    logs = [run.log("shard", f"{sub.jobs['shard']}_{k}").read_text() for k in range(4)]
    assert sum("environment tiny: built" in log for log in logs) == 1, "built once, by the first shard to need it"
    assert all("environment tiny: built" in log or "environment tiny: up to date" in log for log in logs)
    assert "environment spare: built" in logs[0], "shard 0 builds the environments no instance uses"
    for log in logs:
        assert log.count("instance task-") == 2 and ": built" in log
    merge_log = run.log("merge", sub.jobs["merge"]).read_text()
    assert "merged 4 fragments" in merge_log and "0 missing, 0 corrupt" in merge_log
    status = slurm(slurm_cluster, "status", str(run.directory))
    assert status.returncode == 0 and "shards 4/4 done; merge done" in status.stdout


def test_failed_shard_is_reported_and_resubmitted_after_the_fix(tmp_path, tiny_base, registries, slurm_cluster):
    cat = eight_instances(tmp_path, tiny_base, "bad.sh", extra={"bad.sh": "#!/bin/sh\necho cannot-build\nexit 3\n"})
    store = tmp_path / "store"
    r = slurm_build(slurm_cluster, cat, store, registries, "--wait")
    assert r.returncode == 1, r.stdout + r.stderr
    run = the_run(store)
    jobs = run.submissions()[-1].jobs
    task = f"{jobs['shard']}_1"
    assert f"failed: shard 1 (job {task}): FAILED, exit 1; log: {run.log('shard', task)}\n" in r.stderr
    assert "  | failed: instance task-5: script bad.sh exited 3" in r.stderr, "what the shard's log says failed"
    assert f"failed: merge (job {jobs['merge']}): CANCELLED, not run: a job it depends on failed\n" in r.stderr
    assert f"resubmit what failed: image-builder slurm resubmit {run.directory}" in r.stderr
    assert not (store / "index.json").exists() or len(read_index(store).instances) < 8

    (tmp_path / "scripts/bad.sh").write_text("#!/bin/sh\necho fixed > /etc/task\n")
    again = slurm(slurm_cluster, "resubmit", str(run.directory), "--wait", "--poll", "0.5")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "(shards 1)" in again.stdout, "only the failed shard runs again"
    assert sorted(read_index(store).instances) == [f"task-{i}" for i in range(8)]
    rerun = run.log("shard", f"{run.submissions()[-1].jobs['shard']}_1").read_text()
    assert "instance task-1: up to date" in rerun and "instance task-5: built" in rerun
    nothing = slurm(slurm_cluster, "resubmit", str(run.directory))
    assert nothing.returncode == 1 and "nothing to resubmit, every job succeeded" in nothing.stderr


def test_shard_killed_by_the_scheduler_resumes_on_resubmission(tmp_path, tiny_base, registries, slurm_cluster):
    slow = "#!/bin/sh\nset -e\necho \"$TASK\" > /etc/task\n[ \"$TASK\" != 'task 4' ] || sleep 8\n"
    cat = eight_instances(tmp_path, tiny_base, instance_script=slow)
    store = tmp_path / "store"
    r = slurm_build(slurm_cluster, cat, store, registries)
    assert r.returncode == 0, r.stderr
    run = the_run(store)
    array = run.submissions()[-1].jobs["shard"]
    deadline = time.monotonic() + 120
    while not (store / "instances/task-0.json").exists():  # shard 0 builds task-0, then the slow task-4
        assert time.monotonic() < deadline, slurm_cluster.logs()
        time.sleep(0.2)
    slurm_cluster.run("scancel", f"{array}_0")

    watched = slurm(slurm_cluster, "status", str(run.directory), "--wait", "--poll", "0.5")
    assert watched.returncode == 1
    assert f"failed: shard 0 (job {array}_0): CANCELLED" in watched.stderr, watched.stderr
    assert f"JOB {array}_0" not in watched.stderr and "CANCELLED AT" in watched.stderr, "slurmstepd's note"
    again = slurm(slurm_cluster, "resubmit", str(run.directory), "--wait", "--poll", "0.5")
    assert again.returncode == 0, again.stdout + again.stderr
    rerun = run.log("shard", f"{run.submissions()[-1].jobs['shard']}_0").read_text()
    assert "instance task-0: up to date" in rerun and "instance task-4: built" in rerun, rerun
    assert len(read_index(store).instances) == 8
    assert not list((store / "work").iterdir()), "the killed build's work tree is cleaned"


def test_errors_are_one_line(tmp_path, tiny_base, registries, slurm_cluster):
    r = run_cli("slurm", "status", str(tmp_path))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "not a Slurm run of image-builder" in r.stderr
    cat = eight_instances(tmp_path, tiny_base)
    r = slurm_build(slurm_cluster, cat, tmp_path / "store", registries, "--partition", "nope")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "submit.sh failed: sbatch: error: Batch job submission failed: Invalid partition name" in r.stderr
    status = slurm(slurm_cluster, "status", str(the_run(tmp_path / "store").directory))
    assert status.returncode == 1 and "nothing submitted yet; run submit.sh there" in status.stderr
    assert not slurm_cluster.run("squeue", "-h").stdout, "nothing left queued"


def mixed_predictions(path: Path) -> Path:
    """The MBPP references, every third one replaced by a wrong solution, so results differ task by task."""
    refs = [json.loads(line) for line in MBPP_SOLUTIONS.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "solution": "def nothing():\n    pass\n"} if i % 3 == 0 else r) + "\n"
                            for i, r in enumerate(refs)))
    return path


def verdicts(path: Path) -> list[tuple]:
    """Each result without its timings: task, status, score, and every case's status."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["task_id"], r["status"], r["score"], [c["status"] for c in r["cases"]]) for r in rows]


def test_grade_shards_split_by_instance_and_merge_refuses_gaps(tmp_path):
    tasks, preds = load_tasks(MBPP_TASKS), load_predictions(mixed_predictions(tmp_path / "preds.jsonl"))
    shards = [shard_predictions(preds, tasks, (k, 3)) for k in range(3)]
    assert sorted(p.task_id for s in shards for p in s) == sorted(p.task_id for p in preds), "each exactly once"
    assert all(13 <= len(s) <= 14 for s in shards)
    part = tmp_path / "shard-0-of-3.jsonl"
    part.write_text(json.dumps(GradeResult(shards[0][0].task_id, "assert", TaskStatus.PASSED, 1.0).to_dict()) + "\n")
    with pytest.raises(ImageBuilderError, match=r"39 predictions have no result .* resubmit the shards"):
        merge_results([part], preds, tmp_path / "results.jsonl")
    assert not (tmp_path / "results.jsonl").exists(), "nothing half-merged is published"


def test_slurm_grade_equals_local_grade(tmp_path, mbpp_store, slurm_cluster):
    preds = mixed_predictions(tmp_path / "preds.jsonl")
    common = ["--store", str(mbpp_store), "--tasks", str(MBPP_TASKS), "--predictions", str(preds),
              "--compare", "float", "--instance", "512"]
    local = run_cli("grade", *common, "-o", str(tmp_path / "local/results.jsonl"), "-j", "2")
    assert local.returncode == 0, local.stderr

    out = tmp_path / "arr/results.jsonl"
    r = slurm(slurm_cluster, "grade", *common, "-o", str(out), "--shards", "4", "--wait", "--poll", "0.5")
    assert r.returncode == 0, r.stdout + r.stderr + slurm_cluster.logs()
    assert "shards 4/4 done" in r.stderr and f"succeeded; made {out}" in r.stdout
    assert f"40 tasks: 26 passed (65.0%), mean score 0.650; summary: {tmp_path / 'arr/results.summary.json'}" \
        in r.stdout
    assert sorted(verdicts(out)) == sorted(verdicts(tmp_path / "local/results.jsonl")), "same results"
    assert [v[0] for v in verdicts(out)] == [p.task_id for p in load_predictions(preds)], "in the predictions' order"
    summary = json.loads((tmp_path / "arr/results.summary.json").read_text())
    assert summary == json.loads((tmp_path / "local/results.summary.json").read_text())
    assert summary["total"] == 40 and summary["passed"] == 26

    run = Run.open(next((tmp_path / "arr/slurm").iterdir()))
    sub = run.submissions()[-1]
    assert run.kind == "grade" and set(sub.jobs) == {"shard", "merge"}
    assert "--compare float --instance 512" in (run.directory / "job.sh").read_text(), "passed on to every shard"
    shard_ids = [{json.loads(line)["task_id"] for line in (run.directory / f"results/shard-{k}-of-4.jsonl")
                  .read_text().splitlines()} for k in range(4)]
    assert sum(map(len, shard_ids)) == 40 and all(shard_ids), "every shard graded a part"
    assert "40 tasks: 26 passed (65.0%)" in run.log("merge", sub.jobs["merge"]).read_text()


def test_sharded_slurm_import_equals_one_process_import(tmp_path, registries, slurm_cluster):
    from tests.test_import import push_images

    refs = push_images(registries, tmp_path)
    id_from = f"{registries.open.host}/swe/sweb.eval.x86_64." "{instance_id}:latest"
    one = run_cli("import", *refs, "--store", str(tmp_path / "one/store"), "--cache-dir", str(tmp_path / "one/cache"),
                  "--ca-cert", str(registries.tls.cert), "--id-from", id_from, env=EPOCH)
    assert one.returncode == 0, one.stderr
    store = tmp_path / "arr/store"
    r = slurm(slurm_cluster, "import", *refs, "--store", str(store), "--shards", "3", "--cache-dir",
              str(tmp_path / "arr/cache"), "--ca-cert", str(registries.tls.cert), "--id-from", id_from,
              "--poll", "0.5", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr + slurm_cluster.logs()
    assert "shards 3/3 done" in r.stderr and "done: every job of" in r.stdout
    assert comparable(store) == comparable(tmp_path / "one/store"), "same split, same digests"
    run = the_run(store)
    assert run.kind == "import"
    merge_log = run.log("merge", run.submissions()[-1].jobs["merge"]).read_text()
    assert "merged 3 fragments" in merge_log and "0 missing, 0 corrupt" in merge_log


def test_slurm_serve_starts_a_server_per_node_and_lists_their_urls(tmp_path, mbpp_store, slurm_cluster):
    """A real job on the test cluster's node: the server listens on all addresses with the token made on the
    login side, its URL (the node's name, a free port) is listed, and it answers; scancel stops it and its URL
    file goes."""
    token_file = tmp_path / "token"
    proc = subprocess.Popen([str(ROOT / ".venv/bin/image-builder"), "slurm", "serve", "--store", str(mbpp_store),
                             "--nodes", "1", "--token-file", str(token_file), "--wait-timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **slurm_cluster.env})
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err + slurm_cluster.logs()
    urls = out.split()
    assert len(urls) == 1 and urls[0].startswith(f"http://{socket.gethostname()}:"), out
    job = re.search(r"scancel (\d+)", err).group(1)
    run_dir = next((mbpp_store / "slurm").glob("serve-*"))
    assert (run_dir / "urls.txt").read_text() == f"{urls[0]}\n"
    token = token_file.read_text().strip()
    try:
        r = requests.post(f"{urls[0]}/run_code", json={"code": "print(6 * 7)", "language": "python"},
                          headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text
        assert requests.post(f"{urls[0]}/run_code", json={"code": "1", "language": "python"},
                             timeout=60).status_code == 401, "the token is asked on every node"
    finally:
        slurm_cluster.run("scancel", job)
    deadline = time.monotonic() + 60
    while list((run_dir / "urls").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not list((run_dir / "urls").iterdir()), "a stopped server's URL is removed"
