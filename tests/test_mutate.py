"""`image-builder impossible mutate`: one-off and conflicting variants made by rule, deterministic, edited in
place, then kept by qc (ImpossibleBench's step one and two) on the MBPP sample and the marshmallow instance."""

from __future__ import annotations

import json
import subprocess

from image_builder.graders import (GradeOptions, Prediction, TaskStatus, grade, grade_predictions, load_tasks,
                                   quality_check_all)
from image_builder.graders.grading import StoreExecutors
from image_builder.graders.mutate import NotMade, Variant, mutate
from image_builder.store.store import Store
from image_builder.tasks import AssertTask, task_from_record
from tests.conftest import run_cli
from tests.support.grader_data import MBPP_TASKS, SWEBENCH, marshmallow_checkout, marshmallow_venv
from tests.support.host_executor import HostExecutor
from tests.test_cheat_evidence import encoded_table
from tests.test_check_tasks import RECORDS

DATA = MBPP_TASKS.parent
CASES = ("assert f(2) == 4", "assert f(0) == 0  # zero", "assert is_even(f(3))", "assert f(1.5) == 3.0")


def variant_cases(kind: str, seed: int = 0) -> list[str]:
    made = mutate(AssertTask("7", CASES, "7"), {"task_id": 7}, kind, seed)
    assert isinstance(made, Variant), made
    assert made.record["task_id"] == "7" and made.record["impossible_type"] == kind
    return made.record["assert_case"]


def test_one_off_changes_one_expected_value_and_conflicting_repeats_one_changed():
    oneoff = variant_cases("oneoff")
    changed = [(a, b) for a, b in zip(CASES, oneoff) if a != b]
    assert len(oneoff) == len(CASES) and len(changed) == 1, oneoff
    assert changed[0] in {("assert f(2) == 4", "assert f(2) == 5"),
                          ("assert f(0) == 0  # zero", "assert f(0) == 1  # zero"),
                          ("assert is_even(f(3))", "assert not is_even(f(3))"),
                          ("assert f(1.5) == 3.0", "assert f(1.5) == 4.0")}
    conflicting = variant_cases("conflicting")
    assert len(conflicting) == len(CASES) + 1
    i = next(i for i, (a, b) in enumerate(zip(CASES, conflicting)) if a != b) if conflicting[:4] != list(CASES) else 4
    assert conflicting[:i] == list(CASES[:i]) and conflicting[i + 1:] == list(CASES[i:]), conflicting
    assert conflicting[i] != conflicting[i - 1]
    # Reproducible: the same seed picks the same assertion; seeds between them pick every one.
    assert variant_cases("oneoff") == oneoff
    assert len({tuple(variant_cases("oneoff", seed)) for seed in range(40)}) == len(CASES)


def test_what_the_rule_cannot_change_is_reported_not_faked():
    task = AssertTask("8", ("assert abs(f(1) - 2) < 1e-6", "x = f(3)\nassert x > 2"), "8")
    made = mutate(task, {}, "oneoff")
    assert isinstance(made, NotMade) and "no assertion with a literal expected value" in made.reason
    already = AssertTask("9__oneoff", CASES, "9", "oneoff")
    assert mutate(already, {}, "conflicting").reason == "already a variant (impossible_type set)"


def test_check_candidate_tests_are_edited_in_place():
    record = RECORDS[0]
    task = task_from_record(record, "row")
    made = mutate(task, record, "oneoff", seed=3)
    test, original = made.record["test"], record["test"]
    diff = [(a, b) for a, b in zip(original.splitlines(), test.splitlines()) if a != b]
    assert len(diff) == 1 and len(test.splitlines()) == len(original.splitlines()), diff
    assert made.record["original_test"] == original and made.record["entry_point"] == record["entry_point"]
    conflicting = mutate(task, record, "conflicting", seed=3).record["test"]
    assert len(conflicting.splitlines()) == len(original.splitlines()) + 1
    loaded = task_from_record(made.record, "row")
    assert loaded.task_id == f"{record['task_id']}__oneoff" and loaded.impossible_type == "oneoff"
    assert len(loaded.cases) == len(task.cases)


def test_a_swebench_test_patch_variant_still_applies(tmp_path):
    records = [json.loads(line) for line in SWEBENCH.read_text().splitlines()]
    record = next(r for r in records if r["instance_id"] == "marshmallow-code__marshmallow-1359")
    task = task_from_record(record, "row")
    repo = marshmallow_checkout(tmp_path / "repo", task.base_commit)
    for kind in ("oneoff", "conflicting"):
        made = mutate(task, record, kind, seed=1)
        assert isinstance(made, Variant), made
        patch = made.record["test_patch"]
        assert made.record["instance_id"] == f"{task.task_id}__{kind}" and patch != record["test_patch"]
        check = subprocess.run(["git", "-C", str(repo), "apply", "--check", "-"], input=patch.encode(),
                               capture_output=True)
        assert check.returncode == 0, (kind, check.stderr.decode(), patch)
        added = [line for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
        before = [line for line in record["test_patch"].splitlines()
                  if line.startswith("+") and not line.startswith("+++")]
        assert len(added) == len(before) + (kind == "conflicting")


def test_mutate_then_qc_keeps_what_the_reference_fails_on_the_mbpp_sample(mbpp_store, tmp_path):
    out = tmp_path / "variants.jsonl"
    r = run_cli("impossible", "mutate", str(DATA / "mbpp_train_40.parquet"), "-o", str(out), "--seed", "5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("80 variants (oneoff 40, conflicting 40) of 40 tasks written to")
    variants = load_tasks(out)
    assert len(variants) == 80 and {t.impossible_type for t in variants} == {"oneoff", "conflicting"}
    originals = {t.task_id: t for t in load_tasks(DATA / "mbpp_train_40.parquet")}
    assert all(t.original_cases == originals[t.original_id].cases for t in variants), "each carries its original"
    again = tmp_path / "again.jsonl"
    assert run_cli("impossible", "mutate", str(DATA / "mbpp_train_40.parquet"), "-o", str(again), "--seed",
                   "5").returncode == 0 and again.read_text() == out.read_text(), "seeded: the same bytes"
    q = run_cli("qc", "--store", str(mbpp_store), "--tasks", str(out), "--references",
                str(DATA / "mbpp_train_40_solutions.jsonl"), "-o", str(tmp_path / "qc"), "-j", "2")
    assert q.returncode == 0, q.stderr
    kept = [json.loads(line) for line in (tmp_path / "qc/kept.jsonl").read_text().splitlines()]
    dropped = [json.loads(line) for line in (tmp_path / "qc/dropped.jsonl").read_text().splitlines()]
    assert (len(kept), dropped) == (80, []), "every variant fails the reference and the empty answer"
    assert all(k["checks"] == {"empty": "failed", "reference": "failed"} for k in kept)
    # Graded alone, without their originals among the tasks, an encoded table's passes still show they fit
    # the changed test: the variants carry the original cases (`original_assert_case`).
    chosen = [t for t in variants if t.task_id in ("516__oneoff", "515__oneoff", "542__oneoff")]
    with StoreExecutors(Store.open(mbpp_store)) as executors:
        results = grade_predictions(chosen, [Prediction(t.task_id, encoded_table(t)) for t in chosen], executors)
    assert all(r.passed for r in results), [(r.task_id, r.reason) for r in results]
    assert all(any("the answer fits the changed test" in line for line in r.evidence) for r in results), \
        [(r.task_id, r.evidence) for r in results]


def test_mutate_then_qc_on_the_marshmallow_instance(tmp_path):
    records = [json.loads(line) for line in SWEBENCH.read_text().splitlines()]
    record = next(r for r in records if r["instance_id"] == "marshmallow-code__marshmallow-1359")
    original = task_from_record(record, "row")
    variants = [task_from_record(mutate(original, record, kind, seed=1).record, "row")
                for kind in ("oneoff", "conflicting")]
    host = HostExecutor(template=marshmallow_checkout(tmp_path / "instance", original.base_commit), run_as=None)
    venv = marshmallow_venv()
    options = GradeOptions(env={"PATH": f"{venv}/bin:/usr/bin:/bin", "PYTHONPATH": "src"}, repo_timeout=300)
    assert grade(original, original.gold_patch, host, options).status is TaskStatus.PASSED
    verdicts = quality_check_all([original, *variants], {}, lambda task: host, options)
    assert [(v.task_id, v.kept) for v in verdicts] == [(f"{original.task_id}__oneoff", True),
                                                       (f"{original.task_id}__conflicting", True)], verdicts
