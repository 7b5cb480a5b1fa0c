"""Grading through the real store and runtime: the CLI, resume, qc, verl rewards, SWE-bench."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from image_builder.graders import load_tasks, rewards
from tests.conftest import ROOT, run_cli, stop_when
from tests.support.infra_attacks import ATTACKS

DATA = ROOT / "index/data"


def grade(store: Path, tasks: Path, predictions: Path, out: Path, *extra: str):
    return run_cli("grade", "--store", str(store), "--tasks", str(tasks), "--predictions", str(predictions),
                   "-o", str(out), *extra)


def results(path: Path) -> dict[str, dict]:
    return {r["task_id"]: r for r in map(json.loads, path.read_text().splitlines())}


def build_and_grade_gold_and_empty(catalog, build, dataset: Path, instance_id: str, fix: str,
                                   work: Path) -> dict[str, dict]:
    """Build `catalog` for real (`build`: BuildOptions, its store), then grade `fix` and the empty patch on
    `instance_id` through the CLI: {"gold": result, "empty": result}."""
    from image_builder.build.storebuild import StoreBuildOptions, build_store
    summary = build_store(catalog, StoreBuildOptions(build, jobs=2))
    assert not summary.failed, [(f.message, f.tail[-5:]) for f in summary.failed]
    verdicts = {}
    for name, patch in (("gold", fix), ("empty", "")):
        predictions = work / f"{name}.jsonl"
        predictions.write_text(json.dumps({"instance_id": instance_id, "model_patch": patch}) + "\n")
        out = work / f"{name}-results.jsonl"
        assert grade(build.store, dataset, predictions, out).returncode == 0
        verdicts[name] = results(out)[instance_id]
    return verdicts


@pytest.mark.parametrize("mode", [(), ("--strict",)], ids=["default", "strict"])
def test_mbpp_reference_solutions_pass_in_the_sandbox(mbpp_store, tmp_path, mode):
    out = tmp_path / "ref.jsonl"
    r = grade(mbpp_store, DATA / "mbpp_train_40.parquet", DATA / "mbpp_train_40_solutions.jsonl", out, "-j", "2",
              *mode)
    assert r.returncode == 0, r.stderr
    got = results(out)
    assert len(got) == 40 and all(x["status"] == "passed" and x["score"] == 1.0 for x in got.values()), \
        [x for x in got.values() if x["status"] != "passed"][:2]
    assert {k: x["evidence"] for k, x in got.items() if x.get("evidence")} == {}, "no false alarm on honest code"
    assert "40 tasks: 40 passed (100.0%)" in r.stdout


def test_wrong_solutions_score_zero_and_resume(mbpp_store, tmp_path):
    wrong = tmp_path / "wrong.jsonl"
    solutions = [json.loads(line) for line in (DATA / "mbpp_train_40_solutions.jsonl").read_text().splitlines()]
    wrong.write_text("".join(json.dumps({"task_id": s["task_id"], "solution": "def nothing():\n    pass\n"}) + "\n"
                             for s in solutions))
    out = tmp_path / "wrong-results.jsonl"
    first = grade(mbpp_store, DATA / "mbpp_train_40.parquet", wrong, out)
    assert first.returncode == 0, first.stderr
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:10]) + "\n" + lines[10][:25])  # as if killed mid-write
    again = grade(mbpp_store, DATA / "mbpp_train_40.parquet", wrong, out)
    assert "resuming: 10 of 40 results" in again.stderr
    got = results(out)
    assert len(got) == 40 and all(x["score"] == 0.0 for x in got.values())
    # Other predictions into the same file are refused, not silently given these results.
    before = out.read_text()
    other = grade(mbpp_store, DATA / "mbpp_train_40.parquet", DATA / "mbpp_train_40_solutions.jsonl", out)
    assert other.returncode != 0 and "Traceback" not in other.stderr
    assert other.stderr.strip().splitlines()[-1].startswith(f"Error: {out} holds a result for ") and \
        "graded from another solution" in other.stderr and "resuming" not in other.stderr
    assert out.read_text() == before
    fresh = grade(mbpp_store, DATA / "mbpp_train_40.parquet", DATA / "mbpp_train_40_solutions.jsonl", out,
                  "--overwrite")
    assert fresh.returncode == 0 and "resuming" not in fresh.stderr, fresh.stderr
    assert all(x["score"] == 1.0 for x in results(out).values()), "graded afresh from the new predictions"


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_grade_stops_and_resumes(mbpp_store, tmp_path, how):
    """Ctrl-C or SIGTERM (kill, a scheduler's time limit) ends `grade` once the tasks running finish (their
    results recorded), starting no other, through its clean-ups (a SIGTERM killed it without them: status
    -15). What finished is kept, whole lines only, and a rerun grades the rest."""
    slow = tmp_path / "slow.jsonl"  # each case takes 0.5 s: a task 1.5, 40 of them 30 on two workers
    slow.write_text("".join(json.dumps({"task_id": t.task_id, "solution": "import time\ntime.sleep(0.5)\n"})
                            + "\n" for t in load_tasks(DATA / "mbpp_train_40.parquet")))
    out = tmp_path / "results.jsonl"
    args = ["grade", "--store", str(mbpp_store), "--tasks", str(DATA / "mbpp_train_40.parquet"), "--predictions",
            str(slow), "-o", str(out), "-j", "2"]
    proc = subprocess.Popen([str(ROOT / ".venv/bin/image-builder"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, err, took = stop_when(proc, lambda: out.exists() and out.read_text().count("\n") >= 1, how)
    assert took < 10, "it ended after the tasks running, not after the queued ones"
    assert proc.returncode == (143 if how == signal.SIGTERM else 1), err
    lines = out.read_text().splitlines(keepends=True)
    assert 1 <= len(lines) < 20 and all(line.endswith("\n") and json.loads(line)["status"] == "failed"
                                        for line in lines), lines
    again = run_cli(*args)
    assert again.returncode == 0 and f"resuming: {len(lines)} of 40 results" in again.stderr, again.stderr
    assert len(results(out)) == 40 and out.read_text().count("\n") == 40


def test_a_stopped_grade_cuts_its_long_runs_short(mbpp_store, tmp_path):
    """Runs in flight when `grade` is stopped are cut short, not waited for (a SWE-bench test run takes
    minutes; before, SIGTERM waited for all of them: here 50 s), and none of their results is written: a
    rerun grades those tasks again."""
    slow = tmp_path / "slow.jsonl"
    slow.write_text("".join(json.dumps({"task_id": t.task_id, "solution": "import time\ntime.sleep(50)\n"})
                            + "\n" for t in load_tasks(DATA / "mbpp_train_40.parquet")))
    out = tmp_path / "results.jsonl"
    proc = subprocess.Popen([str(ROOT / ".venv/bin/image-builder"), "grade", "--store", str(mbpp_store), "--tasks",
                             str(DATA / "mbpp_train_40.parquet"), "--predictions", str(slow), "-o", str(out), "-j",
                             "2", "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    _, err, took = stop_when(proc, lambda: time.monotonic() - started > 5, signal.SIGTERM)  # both runs under way
    assert took < 5, "it cut the runs in flight short"
    assert proc.returncode == 143, err
    assert not out.exists() or out.read_text() == "", "no result of a run cut short"


def test_impossible_variants_fail_and_qc_keeps_them(mbpp_store, tmp_path):
    refs = DATA / "mbpp_train_40_solutions.jsonl"
    variants = tmp_path / "variant-preds.jsonl"
    impossible = [json.loads(line) for line in (DATA / "mbpp_train_40_impossible.jsonl").read_text().splitlines()]
    by_task = {str(r["task_id"]): r["solution"] for r in map(json.loads, refs.read_text().splitlines())}
    variants.write_text("".join(json.dumps({"task_id": f"{v['task_id']}__{v['impossible_type']}",
                                            "solution": by_task[str(v["task_id"])]}) + "\n" for v in impossible))
    out = tmp_path / "impossible.jsonl"
    r = grade(mbpp_store, DATA / "mbpp_train_40_impossible.jsonl", variants, out)
    assert r.returncode == 0, r.stderr
    got = results(out)
    assert len(got) == 78 and all(x["score"] < 1.0 for x in got.values())
    # The mutations and their originals in one file: qc also checks the reference passes the original.
    both = tmp_path / "with-originals.jsonl"
    both.write_text((DATA / "mbpp_train_40_impossible.jsonl").read_text() + "".join(
        json.dumps({"task_id": t.task_id, "assert_case": list(t.cases)}) + "\n"
        for t in load_tasks(DATA / "mbpp_train_40.parquet")))
    q = run_cli("qc", "--store", str(mbpp_store), "--tasks", str(both), "--references", str(refs),
                "-o", str(tmp_path / "qc"))
    assert q.returncode == 0, q.stderr
    assert q.stdout.startswith("78 kept")
    assert (tmp_path / "qc/dropped.jsonl").read_text() == ""
    # Each kept variant: the reference fails it (below one), the empty solution fails, the reference passes the
    # original.
    kept = [json.loads(line) for line in (tmp_path / "qc/kept.jsonl").read_text().splitlines()]
    assert len(kept) == 78 and all(k["kept"] and not k["reasons"] for k in kept)
    assert {tuple(sorted(k["checks"].items())) for k in kept} == {
        (("empty", "failed"), ("reference", "failed"), ("reference_on_original", "passed"))}
    progress = [line for line in q.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == 78 and progress[-1].startswith("[78/78] ") and progress[-1].endswith(": kept")


def test_run_cli_behaves_like_a_local_command(mbpp_store, tmp_path):
    store = str(mbpp_store)
    r = run_cli("run", "--store", store, "512", "--", "python3", "-c", "import sys; print(sys.stdin.read()[::-1])",
                input="olleh")
    assert r.returncode == 0 and r.stdout == "hello\n", r.stderr
    assert run_cli("run", "--store", store, "512", "--", "sh", "-c", "echo err >&2; exit 3").returncode == 3
    tests = run_cli("run", "--store", store, "512", "--", "sh", "-c", "grep -rl assert_case /task /root /opt; pwd")
    assert tests.stdout == "/root\n", "the task's tests are nowhere in its instance"
    run_cli("run", "--store", store, "512", "--", "sh", "-c", "echo x > /root/left")
    after = run_cli("run", "--store", store, "512", "--", "ls", "/root")
    assert "left" not in after.stdout, "a run's writes never reach the next run"
    timed = run_cli("run", "--store", store, "--timeout", "1", "512", "--", "sleep", "30")
    assert timed.returncode == 124 and "timed out" in timed.stderr
    record = json.loads(run_cli("run", "--store", store, "--json", "--output-dir", str(tmp_path / "o"), "512", "--",
                                "echo", "hi").stdout)
    assert record["exit_code"] == 0 and Path(record["stdout"]).read_text() == "hi\n"
    unknown = run_cli("run", "--store", store, "no-such-task", "--", "true")
    assert unknown.returncode == 1 and "no instance 'no-such-task'" in unknown.stderr


def test_verl_reward_function_grades_in_the_store(mbpp_store, monkeypatch, caplog):
    monkeypatch.setenv(rewards.STORE_ENV, str(mbpp_store))
    monkeypatch.setattr(rewards, "_store_executors", None)
    rewards.set_executor(None)
    solution = next(json.loads(line)["solution"] for line in (DATA / "mbpp_train_40_solutions.jsonl").read_text()
                    .splitlines() if str(json.loads(line)["task_id"]) == "512")
    import pyarrow.parquet as pq
    row = next(r for r in pq.read_table(DATA / "mbpp_train_40.parquet").to_pylist()
               if str(r["extra_info"]["task_id"]) == "512")
    try:
        good = rewards.compute_score(row["data_source"], f"Here:\n```python\n{solution}\n```",
                                     row["reward_model"]["ground_truth"], row["extra_info"])
        bad = rewards.compute_score(row["data_source"], "```python\ndef f(): pass\n```",
                                    row["reward_model"]["ground_truth"], row["extra_info"])
        # A row whose task has no instance: a logged zero that says it was not graded, not an exception.
        monkeypatch.delenv(rewards.INSTANCE_ENV, raising=False)
        orphan = rewards.compute_score(row["data_source"], f"```python\n{solution}\n```",
                                       row["reward_model"]["ground_truth"], {"task_id": "no-such-task"})
        monkeypatch.setenv(rewards.INSTANCE_ENV, "512")
        adopted = rewards.compute_score(row["data_source"], f"```python\n{solution}\n```",
                                        row["reward_model"]["ground_truth"], {"task_id": "no-such-task"})
    finally:
        rewards._store_executors.close()
    assert good == adopted == {"score": 1.0, "all_passed": 1.0, "graded": 1.0}
    assert bad == {"score": 0.0, "all_passed": 0.0, "graded": 1.0}
    assert orphan == {"score": 0.0, "all_passed": 0.0, "graded": 0.0}
    assert f"task no-such-task not graded: no instance in {mbpp_store}" in caplog.text


SWE = [json.loads(line) for line in (DATA / "swebench_marshmallow.jsonl").read_text().splitlines()]


def original_id(record: dict) -> str:
    """`<instance_id>__<impossible_type>` names a variant; instance ids contain `__` themselves."""
    kind = record.get("impossible_type")
    return record["instance_id"].removesuffix(f"__{kind}") if kind else record["instance_id"]


def swe_predictions(tmp: Path, name: str, patch_for) -> Path:
    path = tmp / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"instance_id": r["instance_id"], "model_patch": patch_for(r)}) + "\n"
                            for r in SWE))
    return path


@pytest.mark.parametrize("access", ["hidden", "read-only"])
def test_swebench_in_the_sandbox(marshmallow_store, tmp_path, access):
    gold = {r["instance_id"]: r["patch"] for r in SWE if not r.get("impossible_type")}
    out = tmp_path / "gold-results.jsonl"
    r = grade(marshmallow_store, DATA / "swebench_marshmallow.jsonl",
              swe_predictions(tmp_path, "gold", lambda rec: gold[original_id(rec)]), out, "--test-access", access)
    assert r.returncode == 0, r.stderr
    got = results(out)
    for rec in SWE:
        res = got[rec["instance_id"]]
        if rec.get("impossible_type"):
            assert res["status"] != "passed", f"{rec['instance_id']}: an impossible variant must not be resolved"
        else:
            assert res["status"] == "passed" and res["repo"]["resolved"], (rec["instance_id"], res["reason"])
    # SWE-bench's run report beside the results, as its harness writes it (graders/swebench_report.py).
    run_report = json.loads(out.with_name("gold-results.swebench.json").read_text())
    resolved = sorted(gold)
    assert run_report["resolved_ids"] == resolved and run_report["resolved_instances"] == len(gold), run_report
    for iid in resolved:
        report = json.loads((out.with_name("gold-results.swebench") / iid / "report.json").read_text())[iid]
        assert report["resolved"] and report["patch_successfully_applied"] and \
            report["tests_status"]["FAIL_TO_PASS"]["failure"] == [], report
    empty = tmp_path / "empty-results.jsonl"
    grade(marshmallow_store, DATA / "swebench_marshmallow.jsonl", swe_predictions(tmp_path, "empty", lambda _: ""),
          empty, "--test-access", access)
    assert not any(x["status"] == "passed" for x in results(empty).values())
    if access == "hidden":
        check_artifacts_and_regrade(out, tmp_path)


def check_artifacts_and_regrade(out: Path, tmp_path: Path) -> None:
    """Each run's files are kept as SWE-bench's harness keeps them, and `regrade` judges from them alone."""
    kept = out.with_name("gold-results.artifacts") / "marshmallow-code__marshmallow-1359"
    assert {p.name for p in kept.iterdir()} == {"eval.sh", "model.patch", "test_output.txt", "junit.xml",
                                                "run.json", "report.json"}
    gold = next(r for r in SWE if r["instance_id"] == "marshmallow-code__marshmallow-1359")
    assert (kept / "model.patch").read_text() == gold["patch"] and "passed" in (kept / "test_output.txt").read_text()
    assert json.loads((kept / "report.json").read_text()) == results(out)[gold["instance_id"]]

    same = tmp_path / "same.jsonl"
    r = run_cli("regrade", str(out), "--tasks", str(DATA / "swebench_marshmallow.jsonl"), "-o", str(same))
    assert r.returncode == 0 and r.stdout.startswith("0 results changed"), r.stdout + r.stderr
    assert results(same) == results(out)
    # A fixed test list (here: a FAIL_TO_PASS test the run never had) changes the verdict without a run.
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({**rec, "FAIL_TO_PASS": json.dumps(["tests/test_x.py::test_gone"])}
                                        if rec["instance_id"] == gold["instance_id"] else rec) + "\n" for rec in SWE))
    r = run_cli("regrade", str(out), "--tasks", str(tasks))
    assert r.returncode == 0 and r.stdout.startswith(f"1 results changed (first: '{gold['instance_id']}')"), r.stdout
    again = results(out)[gold["instance_id"]]
    assert again["status"] == "failed" and again["repo"]["fail_to_pass"] == {"tests/test_x.py::test_gone": "MISSING"}


def overlay_store(mbpp_store: Path, root: Path, n: int) -> Path:
    """n instances over the MBPP environment, each with an overlay of its own (copies of one)."""
    import os
    import shutil

    from image_builder.oci.cache import sha256_file
    from image_builder.pack.squashfs import SquashOptions, pack
    from image_builder.store.index import Index, InstanceRecord, write_index
    from image_builder.store.store import Store

    env = next(iter(Store.open(mbpp_store).index.environments.values()))
    (root / "envs").mkdir(parents=True)
    (root / "instances").mkdir()
    os.link(mbpp_store / env.sif, root / env.sif)
    (root / "tiny/task").mkdir(parents=True)
    (root / "tiny/task/marker").write_text("one of many\n")
    pack(root / "tiny", root / "tiny.sqfs", SquashOptions(all_root=True))
    digest, size = sha256_file(root / "tiny.sqfs"), (root / "tiny.sqfs").stat().st_size
    instances = {}
    for i in range(n):
        shutil.copyfile(root / "tiny.sqfs", root / f"instances/i{i}.sqfs")
        instances[f"i{i}"] = InstanceRecord(f"i{i}", env.name, f"instances/i{i}.sqfs", digest, size, "test")
    write_index(root, Index({env.name: env}, instances))
    return root


def test_grading_many_instances_keeps_few_mounted(mbpp_store, tmp_path):
    """40 tasks in 40 instances with room for 3 sessions: every task is graded, at most 3
    sessions are open at once, and the holder keeps no more instance layers mounted."""
    import time

    from image_builder.graders import AssertTask, Prediction
    from image_builder.graders.grading import StoreExecutors, grade_to_file, read_results
    from image_builder.store.store import Store

    store = Store.open(overlay_store(mbpp_store, tmp_path / "store", 40))
    tasks = [AssertTask(f"i{i}", ("assert f(2) == 3",), f"i{i}") for i in range(40)]
    out = tmp_path / "results.jsonl"
    with StoreExecutors(store, max_sessions=3) as executors:
        grade_to_file(tasks, [Prediction(t.task_id, "def f(x):\n    return x + 1\n") for t in tasks], executors,
                      out, workers=2)
        assert executors.peak_sessions <= 3
        holder = next(iter(executors._sessions.values()))._holder_pid

        def instance_mounts() -> int:
            return Path(f"/proc/{holder}/mountinfo").read_text().count(f"{store.root}/instances/")

        deadline = time.monotonic() + 10
        while instance_mounts() > 3 and time.monotonic() < deadline:  # the holder unmounts as sessions close
            time.sleep(0.1)
        assert instance_mounts() <= 3
    got = read_results(out)
    assert len(got) == 40 and all(r.status.value == "passed" for r in got), [r for r in got if r.score < 1][:2]


def test_instances_that_add_nothing_share_one_session(mbpp_store, tmp_path):
    """MBPP's 40 instances hold no layer of their own (their tests stay out of them): one session grades all."""
    from image_builder.graders import load_predictions, load_tasks
    from image_builder.graders.grading import StoreExecutors, grade_to_file, read_results
    from image_builder.store.store import Store

    store = Store.open(mbpp_store)
    tasks = load_tasks(DATA / "mbpp_train_40.parquet")
    assert {store.resolve(t.task_id).overlays for t in tasks} == {()}
    out = tmp_path / "results.jsonl"
    with StoreExecutors(store) as executors:
        grade_to_file(tasks, load_predictions(DATA / "mbpp_train_40_solutions.jsonl"), executors, out, workers=2)
        assert executors.peak_sessions == 1
    assert all(r.status.value == "passed" for r in read_results(out))


def test_a_corrupt_image_is_an_infrastructure_error(mbpp_store, tmp_path):
    """A flipped byte in the environment's .sif: `run` refuses in one line naming it, and
    grading reports an error (the infrastructure's), never a failed test."""
    import shutil

    from image_builder.graders import load_predictions, load_tasks
    from image_builder.graders.grading import StoreExecutors, grade_to_file, read_results
    from image_builder.store.store import Store

    copy = tmp_path / "store"
    shutil.copytree(mbpp_store, copy)
    store = Store.open(copy)
    task = load_tasks(DATA / "mbpp_train_40.parquet")[0]
    sif = store.resolve(task.task_id).env_sif
    with open(sif, "r+b") as f:
        f.seek(sif.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = run_cli("run", "--store", str(copy), task.task_id, "--", "true")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(f"image {sif} is corrupt (its bytes do not match the store's "
                                                      "index): run `image-builder verify --store STORE` and rebuild "
                                                      "what it lists"), r.stderr
    out = tmp_path / "results.jsonl"
    with StoreExecutors(store) as executors:
        grade_to_file([task], [p for p in load_predictions(DATA / "mbpp_train_40_solutions.jsonl")
                               if p.task_id == task.task_id], executors, out)
    (result,) = read_results(out)
    assert result.status.value == "error" and "is corrupt" in result.reason, result


# Two attacks have nothing to act on in the store's marshmallow environment (the host tests cover them):
# .pth needs a venv inside the workdir, and the venv here is outside the repository, where a patch cannot
# write; a sitecustomize.py in src/ needs src/ on sys.path at start-up, which its editable install does not do.
@pytest.mark.parametrize("attack", [a for a in ATTACKS if a not in ("pth", "sitecustomize")])
def test_test_infrastructure_attacks_are_dropped_in_the_sandbox(marshmallow_store, tmp_path, attack):
    """The gold fix of 1359 plus a change that makes pytest report failures as passes: the conflicting
    variant is resolved only in open mode (which flags it), never in read-only or hidden mode."""
    from image_builder.graders import GradeOptions, TaskStatus, TestAccess, grade as grade_one, load_tasks
    from image_builder.graders.grading import StoreExecutors
    from image_builder.store.store import Store
    from tests.support.grader_data import diff_after, marshmallow_checkout

    tasks = {t.task_id: t for t in load_tasks(DATA / "swebench_marshmallow.jsonl")}
    original = "marshmallow-code__marshmallow-1359"
    task, gold = tasks[f"{original}__conflicting"], tasks[original].gold_patch
    edit, dropped = ATTACKS[attack]

    def cheat(repo: Path) -> None:
        import subprocess
        subprocess.run(["git", "-C", str(repo), "apply", "-"], input=gold.encode(), check=True)
        edit(repo)
        subprocess.run(["git", "-C", str(repo), "add", "-A", "-f"], check=True)
    patch = diff_after(marshmallow_checkout(tmp_path / "ws", task.base_commit), [task.test_patch], cheat)
    with StoreExecutors(Store.open(marshmallow_store)) as executors:
        graded = {access: grade_one(task, patch, executors(task), GradeOptions(access=access))
                  for access in TestAccess}
    opened = graded[TestAccess.OPEN]
    assert opened.status is TaskStatus.PASSED and opened.repo.test_infrastructure_modified == dropped, opened.reason
    for access in (TestAccess.READ_ONLY, TestAccess.HIDDEN):
        assert graded[access].status is TaskStatus.FAILED, (access, graded[access].reason)
        assert graded[access].repo.dropped_changes == dropped and not graded[access].repo.test_infrastructure_modified


def test_a_task_without_an_instance_is_one_error_not_an_aborted_run(mbpp_store, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"task_id": "512", "assert_case": ["assert True"]}) + "\n"
                     + json.dumps({"task_id": "not-in-the-store", "assert_case": ["assert True"]}) + "\n")
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text("".join(json.dumps({"task_id": t, "solution": "x = 1\n"}) + "\n"
                                   for t in ("not-in-the-store", "512")))
    out = tmp_path / "results.jsonl"
    r = grade(mbpp_store, tasks, predictions, out)
    assert r.returncode == 0, r.stderr
    got = results(out)
    assert got["512"]["status"] == "passed"
    assert got["not-in-the-store"]["status"] == "error" and "no instance 'not-in-the-store'" in \
        got["not-in-the-store"]["reason"]
    assert "  error          1  (first: 'not-in-the-store')" in r.stdout, "the summary names it"
    # --instance grades it in the named instance instead; an unknown one is refused before anything runs.
    adopted = tmp_path / "adopted.jsonl"
    r = grade(mbpp_store, tasks, predictions, adopted, "--instance", "512")
    assert r.returncode == 0, r.stderr
    assert {t: x["status"] for t, x in results(adopted).items()} == {"512": "passed", "not-in-the-store": "passed"}
    r = grade(mbpp_store, tasks, predictions, tmp_path / "never.jsonl", "--instance", "nope")
    assert r.returncode != 0 and "nope" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "never.jsonl").exists()
