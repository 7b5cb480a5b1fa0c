"""`image-builder impossible mutate`: ImpossibleBench's impossible variants of tasks, made by rule, not by a model.

- one-off: one assertion's expected value changed (`assert f(2) == 4` -> `assert f(2) == 5`; `assert p(7)`
  -> `assert not p(7)`), so the tests contradict the specification in one place;
- conflicting: one assertion repeated right after itself with a different expected value, so no function
  passes both.

Which assertion is chosen, per task and kind, comes from a seeded random stream (the seed, the task's id
and the kind), so a run is reproducible and a different `--seed` picks others. Edits are made on the
source text at the positions Python's parser gives (the rest of the test, comments and layout, stays as
written). Only assertions whose expected side is a literal (or a bare truth test of a call) can be changed;
a task with none is reported with the reason, never given a made-up variant.

Assert-case tasks (verl's `assert_case`), HumanEval/LiveCodeBench `check(candidate)` tests and SWE-bench
test patches (the assertions the patch adds, one line each; the hunk's counts follow) are mutated. The
variants are written in the keyed form `grade` and `qc` read (`impossible_type`, the original's id, and its
test beside: `original_test`, `original_assert_case`, `original_test_patch`, for a pass's evidence); `qc`
then keeps those that the reference and the empty solution both fail, which a rule cannot promise.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass

from image_builder.tasks import AssertTask, RepoTask, Task

KINDS = ("oneoff", "conflicting")


@dataclass(frozen=True)
class Variant:
    task_id: str  # the original's
    kind: str
    record: dict  # the variant as a dataset record


@dataclass(frozen=True)
class NotMade:
    task_id: str
    kind: str
    reason: str


@dataclass(frozen=True)
class _Site:
    """One assertion that can be changed: where it is in the source, and its expected part."""
    line: int  # 1-based, the assertion's first line
    end_line: int
    indent: str
    start: tuple[int, int]  # the expected part's span in the source: (line, column) to (line, column)
    end: tuple[int, int]
    changed: str  # the expected part's text, changed


def mutate_all(tasks: list[tuple[Task, dict]], kinds: tuple[str, ...] = KINDS, seed: int = 0
               ) -> tuple[list[Variant], list[NotMade]]:
    made, not_made = [], []
    for task, record in tasks:
        for kind in kinds:
            result = mutate(task, record, kind, seed)
            (made if isinstance(result, Variant) else not_made).append(result)
    return made, not_made


def mutate(task: Task, record: dict, kind: str, seed: int = 0) -> Variant | NotMade:
    """A `kind` variant of `task` (its dataset `record`), or why none can be made."""
    if getattr(task, "impossible_type", None):
        return NotMade(task.task_id, kind, "already a variant (impossible_type set)")
    pick = random.Random(f"{seed}:{task.original_id}:{kind}")
    if isinstance(task, AssertTask) and task.test:
        test = _mutate_source(task.test, kind, pick, within="check")
        if isinstance(test, str) and test.startswith("!"):
            return NotMade(task.original_id, kind, test[1:])
        fields = {k: record[k] for k in ("prompt", "entry_point", "data_source", "canonical_solution") if k in record}
        return Variant(task.original_id, kind, {"task_id": task.original_id, **fields, "test": test,
                                                "original_test": task.test, "impossible_type": kind})
    if isinstance(task, AssertTask):
        return _mutate_cases(task, record, kind, pick)
    if isinstance(task, RepoTask):
        patch = _mutate_patch(task.test_patch, kind, pick)
        if patch.startswith("!"):
            return NotMade(task.original_id, kind, patch[1:])
        return Variant(task.original_id, kind, {**record, "instance_id": f"{task.original_id}__{kind}",
                                                "test_patch": patch, "original_test_patch": task.test_patch,
                                                "impossible_type": kind})
    return NotMade(task.task_id, kind, "stdin/stdout tests have no assertions to change")


def _mutate_cases(task: AssertTask, record: dict, kind: str, pick: random.Random) -> Variant | NotMade:
    sites = [(i, site) for i, case in enumerate(task.cases) for site in _sites(case)]
    if not sites:
        return NotMade(task.original_id, kind, "no assertion with a literal expected value (`assert f(x) == 3`) or "
                                               "a truth test of a call (`assert p(x)`)")
    index, site = pick.choice(sites)
    cases = list(task.cases)
    changed = _apply(cases[index], site)
    if kind == "oneoff":
        cases[index] = changed
    else:  # the case again (its setup too), its assertion changed
        cases.insert(index + 1, changed)
    source = {"data_source": task.data_source} if task.data_source else {}
    return Variant(task.original_id, kind, {"task_id": task.original_id, "impossible_type": kind, **source,
                                            "assert_case": cases, "original_assert_case": list(task.cases)})


def _mutate_source(source: str, kind: str, pick: random.Random, within: str) -> str:
    """The source with one of its `within` function's assertions changed (one-off) or repeated changed after
    itself (conflicting); "!why" when it has none."""
    module = ast.parse(source)
    functions = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == within]
    sites = [s for f in functions for s in _sites(source, f)]
    if not sites:
        return f"!no assertion in {within}() with a literal expected value or a truth test of a call"
    site = pick.choice(sites)
    changed = _apply(source, site)
    if kind == "oneoff":
        return changed
    lines = source.splitlines(keepends=True)
    repeat = _statement(changed, site)
    return "".join(lines[:site.end_line]) + "".join(
        f"{site.indent}{line}\n" for line in repeat.splitlines()) + "".join(lines[site.end_line:])


def _mutate_patch(patch: str, kind: str, pick: random.Random) -> str:
    """A test patch with one added single-line assertion changed, or repeated changed on a line of its own
    after it (the hunk's new-side count and later hunks' starts in that file follow); "!why" when none."""
    lines = patch.splitlines(keepends=True)
    candidates = []
    for n, line in enumerate(lines):
        if not line.startswith("+") or line.startswith("+++"):
            continue
        body = line[1:].rstrip("\n")
        stripped = body.lstrip()
        sites = _sites(stripped) if stripped.startswith("assert ") else []
        if sites:
            candidates.append((n, body[:len(body) - len(stripped)], stripped, sites[0]))
    if not candidates:
        return "!the test patch adds no one-line assertion with a literal expected value or a truth test of a call"
    n, indent, statement, site = pick.choice(candidates)
    changed = _apply(statement, site)
    if kind == "oneoff":
        lines[n] = f"+{indent}{changed}\n"
        return "".join(lines)
    lines.insert(n + 1, f"+{indent}{changed}\n")
    # The hunk holding line n gains a line on the new side; hunks after it in the same file start one later.
    hunk = next(i for i in range(n, -1, -1) if lines[i].startswith("@@"))
    lines[hunk] = _shift_hunk(lines[hunk], count=1)
    for i in range(n + 2, len(lines)):
        if lines[i].startswith("diff --git") or lines[i].startswith("--- "):
            break
        if lines[i].startswith("@@"):
            lines[i] = _shift_hunk(lines[i], start=1)
    return "".join(lines)


HUNK = re.compile(r"^@@ -(\d+(?:,\d+)?) \+(\d+)(?:,(\d+))? @@")


def _shift_hunk(header: str, count: int = 0, start: int = 0) -> str:
    m = HUNK.match(header)
    new_start, new_count = int(m.group(2)), int(m.group(3) if m.group(3) is not None else 1)
    return f"@@ -{m.group(1)} +{new_start + start},{new_count + count} @@" + header[m.end():]


def _sites(source: str, within: ast.AST | None = None) -> list[_Site]:
    """The assertions of `source` (or of the node `within`, parsed from it) whose expected part can change."""
    try:
        tree = within if within is not None else ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        test = node.test
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.Is)):
            expected = test.comparators[0]
            changed = _changed_literal(expected)
            if changed is not None:
                found.append(_Site(node.lineno, node.end_lineno, indent, (expected.lineno, expected.col_offset),
                                   (expected.end_lineno, expected.end_col_offset), changed))
        elif isinstance(test, ast.Call) or (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
                                            and isinstance(test.operand, ast.Call)):
            text = ast.get_source_segment(source, test)
            if text is None:
                continue
            changed = ast.get_source_segment(source, test.operand) if isinstance(test, ast.UnaryOp) else f"not {text}"
            found.append(_Site(node.lineno, node.end_lineno, indent, (test.lineno, test.col_offset),
                               (test.end_lineno, test.end_col_offset), changed))
    return found


def _changed_literal(node: ast.expr) -> str | None:
    """Another value of the same kind, as source: numbers + 1, booleans negated, strings and sequences
    extended; None when the expected side is not a literal."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(value, bool):
        return repr(not value)
    if isinstance(value, (int, float)):
        return repr(value + 1)
    if isinstance(value, complex):
        return repr(value + 1)
    if isinstance(value, str):
        return repr(value + "_") if value else repr("_")
    if isinstance(value, (list, tuple, set, frozenset)) or value is None:
        return repr([] if value is None else [*value, None] if isinstance(value, list) else
                    (*value, None) if isinstance(value, tuple) else {*value, None} if value else {None})
    if isinstance(value, dict):
        return repr({**value, None: None})
    return None


def _apply(source: str, site: _Site) -> str:
    lines = source.splitlines(keepends=True)
    (l1, c1), (l2, c2) = site.start, site.end
    head = "".join(lines[:l1 - 1]) + lines[l1 - 1][:_byte_col(lines[l1 - 1], c1)]
    tail = lines[l2 - 1][_byte_col(lines[l2 - 1], c2):] + "".join(lines[l2:])
    return head + site.changed + tail


def _byte_col(line: str, offset: int) -> int:
    """ast's col_offset counts UTF-8 bytes: the character index it falls on."""
    return len(line.encode()[:offset].decode("utf-8", "replace"))


def _statement(changed_source: str, site: _Site) -> str:
    """The changed assertion alone, dedented: the lines it spans in the changed source (its expected part may
    have taken more or fewer lines than before)."""
    end = site.end_line - (site.end[0] - site.start[0]) + site.changed.count("\n")
    span = changed_source.splitlines()[site.line - 1:end]
    return "\n".join(line[len(site.indent):] if line.startswith(site.indent) else line for line in span)
