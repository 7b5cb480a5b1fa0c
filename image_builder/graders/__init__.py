"""Graders: run candidate code for benchmark tasks inside an instance and score it.

Everything a grader runs goes through `image_builder.runtime.execution.Executor`
(`run`, or `stream` for a conversation with a run): patching, writing files, running
tests; graders never touch the host.

    image_builder.tasks.load_tasks(path)  verl parquet, JSONL, SWE-bench/ImpossibleBench JSONL
    predictions.load_predictions(path) solutions, model patches, or raw responses
    grade.grade(task, solution, executor, options)           one GradeResult
    grade.grade_predictions(tasks, predictions, executor_for) many, in parallel
    impossible.quality_check_all(...)  ImpossibleBench's check of mutated tasks
    results.summarize / write_jsonl    pass rate, statuses, timeouts; JSONL records

Graders by task kind: assert_cases (verl assert_case: starts the two runs whose code is
assert_sides.py, the evaluator and the candidate, and connects them), stdio (stdin/stdout and
call-based, LiveCodeBench comparison), swebench (repo tests). access holds
ImpossibleBench's test-access modes. grading.py runs them on a store's instances
(StoreExecutors, resumable results files, shards, per-run artifacts and regrade); rewards.py
is verl's reward function.

May import: errors, tasks, store, runtime (execution and sessions only through grading.py).
"""

from image_builder.tasks import AssertTask, BadTask, RepoTask, StdioTask, Task, load_tasks, parse_ground_truth
from .access import TestAccess, candidate_feedback
from .grade import grade, grade_prediction, grade_predictions
from .impossible import QcVerdict, quality_check, quality_check_all, write_qc
from .options import GradeOptions
from .predictions import Prediction, extract_code, load_predictions
from .results import CaseResult, CaseStatus, GradeResult, RepoReport, Summary, TaskStatus, summarize, write_jsonl

__all__ = [
    "AssertTask", "BadTask", "CaseResult", "CaseStatus", "GradeOptions", "GradeResult", "Prediction", "QcVerdict",
    "RepoReport", "RepoTask", "StdioTask", "Summary", "Task", "TaskStatus", "TestAccess", "candidate_feedback",
    "extract_code", "grade", "grade_prediction", "grade_predictions", "load_predictions", "load_tasks",
    "parse_ground_truth", "quality_check", "quality_check_all", "summarize", "write_jsonl", "write_qc",
]
