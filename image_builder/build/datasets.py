"""Instances from datasets: one instance per task of a verl parquet or SWE-bench JSONL.

A catalog's `instance_sets` entry names a dataset file and how its tasks map
to instances; string values may use `{field}` templates over the task
(`{instance_id}`, `{repo}`, `{repo_name}`, `{repo_slug}` (owner__name),
`{base_commit}`, `{version}`, `{task_id}`, `{instance_file}`: the id as the
store names files). ImpossibleBench variants share the instance of the task they
were made from (same repository state; their tests differ only at grading).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

from image_builder.store.ids import file_name, id_problem, shown_id
from image_builder.tasks import AssertTask, BadTask, RepoTask, StdioTask, load_tasks_with_rows


@dataclass(frozen=True)
class InstanceDraft:
    """What a dataset task contributes to an instance; the catalog adds the rest."""
    id: str
    fields: dict[str, str]  # template fields
    files: dict[str, bytes]
    grader: dict


def _repo_draft(task: RepoTask) -> InstanceDraft:
    fields = {"instance_id": task.original_id, "repo": task.repo, "repo_name": task.repo.rsplit("/", 1)[-1],
              "repo_slug": task.repo.replace("/", "__"), "base_commit": task.base_commit, "version": task.version,
              "task_id": task.original_id, "instance_file": file_name(task.original_id)}
    grader = {"kind": "swebench", "repo": task.repo, "base_commit": task.base_commit, "version": task.version,
              "test_cmd": task.test_cmd, "FAIL_TO_PASS": list(task.fail_to_pass),
              "PASS_TO_PASS": list(task.pass_to_pass)}
    return InstanceDraft(task.original_id, fields, {}, grader)


def _case_draft(task: AssertTask | StdioTask) -> InstanceDraft:
    kind, cases = ("assert_case", task.cases) if isinstance(task, AssertTask) else ("stdio", task.inputs)
    # The tests stay out of the instance: candidate code runs there and must not read the expected
    # values (a solution that read /task/tests.json passed every case). Graders take them from the task
    # file on the host, so such an instance adds nothing to its environment: no overlay, no mount.
    return InstanceDraft(task.original_id, {"task_id": task.original_id}, {},
                         {"kind": kind, "cases": len(cases)})


def drafts(path: Path) -> tuple[list[InstanceDraft], list[str]]:
    """(one draft per original task, reasons for the tasks that cannot become instances, each naming its row)."""
    out: dict[str, InstanceDraft] = {}
    bad = []
    for row, task in load_tasks_with_rows(path):
        if isinstance(task, BadTask):
            bad.append(f"{row}: {task.reason}" if task.task_id == row else f"{row} ({shown_id(task.task_id)}): "
                                                                            f"{task.reason}")
        elif problem := id_problem(task.original_id):  # the id names the instance's files in the store
            bad.append(f"{row}: instance id {shown_id(task.original_id)} {problem}; fix the id in the dataset")
        elif task.original_id not in out:  # variants map to their original's instance
            out[task.original_id] = _repo_draft(task) if isinstance(task, RepoTask) else _case_draft(task)
    return list(out.values()), bad


def fill(template: str, fields: dict[str, str]) -> str:
    """`{field}` substitution that reports a missing field by name (KeyError) or a template that is not one of
    plain `{name}` fields (ValueError: no indexing, attributes or format specs, which str.format would run)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"template {template!r}: {e} (write {{{{ and }}}} for literal braces)") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(f"template {template!r}: {{{name}}} is not a plain {{field}}")
        if name not in fields:
            raise KeyError(f"template {template!r} uses {{{name}}}, which this dataset's tasks do not have "
                           f"(they have: {', '.join(sorted(fields))})")
    return template.format_map(fields)
