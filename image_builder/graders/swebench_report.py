"""SWE-bench's own report files, made from our results, so a user can diff our verdicts with the official
harness's instance by instance (SWE-bench 4.1: harness/grading.py get_eval_report, reporting.py
make_run_report).

results.jsonl -> results.swebench/<instance_id>/report.json (SWE-bench: logs/run_evaluation/<run_id>/<model>/
<instance_id>/report.json) and results.swebench.json (SWE-bench: <model>.<run_id>.json).

Which instance lands where, as SWE-bench's harness has it:
- an empty or missing patch: empty_patch (SWE-bench never runs it; no report.json);
- resolved / unresolved: completed, with a report.json;
- a patch that does not apply, a test run that timed out, a run that failed (our patch_failed, error,
  bad_task, or a timed-out run): error, no report.json (SWE-bench's run_instance raises before writing one);
- an unknown task id: submitted only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from image_builder.store.files import atomic_write
from image_builder.store.ids import file_name
from .results import GradeResult, TaskStatus
from .swebench import _SUCCESS, MISSING

EMPTY_PATCH_SHA256 = hashlib.sha256(b"").hexdigest()  # what grade records for model_patch ""
# SWE-bench's test_failed: FAILED, ERROR, or no status at all; ours adds MISMATCH (log and junit disagree),
# which fails our verdict too. SKIPPED is in neither list, as in SWE-bench's check_pass_and_fail.
_FAILURE = {"FAILED", "ERROR", MISSING, "MISMATCH"}
SCHEMA_VERSION = 2  # make_run_report's


@dataclass
class RunReport:
    """make_run_report's JSON (schema_version 2), without its docker fields (unstopped/unremoved)."""
    total_instances: int
    submitted_instances: int
    completed_instances: int
    resolved_instances: int
    unresolved_instances: int
    empty_patch_instances: int
    error_instances: int
    completed_ids: list[str]
    incomplete_ids: list[str]
    empty_patch_ids: list[str]
    submitted_ids: list[str]
    resolved_ids: list[str]
    unresolved_ids: list[str]
    error_ids: list[str]
    schema_version: int = SCHEMA_VERSION


@dataclass
class SwebenchReports:
    run: RunReport
    instances: dict[str, dict] = field(default_factory=dict)  # instance id -> get_eval_report's mapping


def report_dir(output: Path) -> Path:
    return output.with_name(f"{output.stem}.swebench")


def run_report_path(output: Path) -> Path:
    return output.with_name(f"{output.stem}.swebench.json")


def is_empty_patch(result: GradeResult) -> bool:
    """SWE-bench's empty patch: model_patch "" or None (our no_solution: nothing to apply)."""
    return result.status is TaskStatus.NO_SOLUTION or result.solution_sha256 == EMPTY_PATCH_SHA256


def completed(result: GradeResult) -> bool:
    """A run SWE-bench writes a report.json for: the tests ran to a verdict (a timeout raises in its harness)."""
    return (result.status in (TaskStatus.PASSED, TaskStatus.FAILED) and result.repo is not None
            and not result.repo.timed_out)


def instance_report(result: GradeResult) -> dict:
    """get_eval_report(..., include_tests_status=True) for a completed run: FAIL_TO_FAIL and PASS_TO_FAIL
    stay empty, as its calculate_to_fail defaults to False."""
    def split(statuses: dict[str, str]) -> dict[str, list[str]]:
        return {"success": [t for t, s in statuses.items() if s in _SUCCESS],
                "failure": [t for t, s in statuses.items() if s in _FAILURE]}

    repo = result.repo
    return {result.task_id: {
        "patch_is_None": False, "patch_exists": True, "patch_successfully_applied": True,
        "resolved": repo.resolved,
        "tests_status": {"FAIL_TO_PASS": split(repo.fail_to_pass), "PASS_TO_PASS": split(repo.pass_to_pass),
                         "FAIL_TO_FAIL": {"success": [], "failure": []},
                         "PASS_TO_FAIL": {"success": [], "failure": []}}}}


def swebench_reports(results: Iterable[GradeResult], dataset_ids: Iterable[str] | None = None,
                     ) -> SwebenchReports | None:
    """The reports of a run's SWE-bench results; None when it holds no repo task. Results of no kind
    (no solution, unknown task, no instance) count with them. `dataset_ids`: the tasks of the run (its
    total and incomplete ids); without them, the ids graded."""
    results = [r for r in results if r.kind in ("repo", "")]
    if not any(r.kind == "repo" for r in results):
        return None
    by_id = {r.task_id: r for r in results}  # a later line for an id wins, as a resumed file reads
    known = [i for i, r in by_id.items() if r.status is not TaskStatus.UNKNOWN_TASK]
    dataset = list(dict.fromkeys(dataset_ids)) if dataset_ids is not None else known
    ids = {"completed": [], "resolved": [], "unresolved": [], "empty_patch": [], "error": [], "incomplete": []}
    instances = {}
    for instance_id in dataset:
        result = by_id.get(instance_id)
        if result is None:
            ids["incomplete"].append(instance_id)
        elif is_empty_patch(result):
            ids["empty_patch"].append(instance_id)
        elif completed(result):
            ids["completed"].append(instance_id)
            ids["resolved" if result.repo.resolved else "unresolved"].append(instance_id)
            instances[instance_id] = instance_report(result)
        else:
            ids["error"].append(instance_id)
    ids = {k: sorted(v) for k, v in ids.items()}
    run = RunReport(total_instances=len(dataset), submitted_instances=len(by_id),
                    completed_instances=len(ids["completed"]), resolved_instances=len(ids["resolved"]),
                    unresolved_instances=len(ids["unresolved"]), empty_patch_instances=len(ids["empty_patch"]),
                    error_instances=len(ids["error"]), completed_ids=ids["completed"],
                    incomplete_ids=ids["incomplete"], empty_patch_ids=ids["empty_patch"],
                    submitted_ids=sorted(by_id), resolved_ids=ids["resolved"], unresolved_ids=ids["unresolved"],
                    error_ids=ids["error"])
    return SwebenchReports(run, instances)


def write_swebench_reports(results: Iterable[GradeResult], output: Path,
                           dataset_ids: Iterable[str] | None = None) -> SwebenchReports | None:
    """Writes the reports beside `output`: the instances' directory built under a temporary name, then
    renamed over the old one (no report.json of an earlier run is left), and the run report by atomic_write.
    None (and nothing written) when the results hold no repo task."""
    reports = swebench_reports(results, dataset_ids)
    if reports is None:
        return None
    final = report_dir(output)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        for instance_id, report in reports.instances.items():
            (tmp / file_name(instance_id)).mkdir()
            # indent=4: as run_instance writes it
            (tmp / file_name(instance_id) / "report.json").write_text(json.dumps(report, indent=4))
        old = final.with_name(f"{tmp.name}.old")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    atomic_write(run_report_path(output),
                 lambda f: f.write(json.dumps(asdict(reports.run), indent=4).encode() + b"\n"))
    return reports
