"""Tasks to grade, read from verl parquet, JSONL, or SWE-bench/ImpossibleBench JSONL.

A record that cannot be graded (malformed ground truth, missing fields) becomes
a `BadTask` carrying the reason, so one bad row gives one `bad_task` result
instead of stopping a whole run. Only an unreadable file raises.

Variants of one task (ImpossibleBench `oneoff`/`conflicting`) get distinct ids,
`<id>__<impossible_type>`, as Impossible-SWEbench names its instances;
`original_id` names the task they were made from.

Stdin/stdout tasks come as verl ground truth (`inputs`/`outputs`), as bare
records with those keys, or in CodeContests's layout (`tests`: a list of
`{"input", "output"}`). Any of them may say how output is compared: `compare`
(a mode of `graders.stdio.COMPARE_MODES`), `checker` (Python source of a
checker, which implies `compare: checker`) and `tolerance` (float mode's).

The datasets' own published rows load as they are (`raw_layout_task`):
DeepMind's CodeContests (`public_tests`, `private_tests`, `generated_tests`,
each `{input: [...], output: [...]}`: every test counts, as the dataset calls
a solution correct), LiveCodeBench's code_generation (`public_test_cases`,
`private_test_cases` as JSON or as its base64 of zlib of a pickled JSON string,
`metadata.func_name` for call-based problems: public and private tests count,
as its evaluator runs them) and APPS/TACO (`input_output`, a JSON string of
`inputs`, `outputs` and maybe `fn_name`). LiveCodeBench's pickles are a hostile
dataset's easiest way onto the host (unpickling runs what the pickle names):
they are read by an unpickler that refuses every global, so only plain values
come out, and decompressed to a bound.

HumanEval-style records (HumanEval, ImpossibleBench's LiveCodeBench: `prompt`,
`entry_point`, `test` holding `def check(candidate): ...`) become assert tasks:
`check_cases` turns check's body into cases the evaluator runs with `candidate`
bound to the solution's entry point, so the test never runs in the solution's
process.

JSONL is read a line at a time, each line bounded ($IMAGE_BUILDER_MAX_LINE, 64 MiB
by default): a longer line stops the read in one line naming the file and line,
and memory stays bounded by the bound, however long the line.
"""

from __future__ import annotations

import ast
import base64
import binascii
import io
import json
import keyword
import os
import pickle
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

from image_builder.errors import ImageBuilderError


class DatasetError(ImageBuilderError):
    """A task or prediction file that cannot be read."""


MAX_LINE_ENV = "IMAGE_BUILDER_MAX_LINE"
DEFAULT_MAX_LINE = 64 << 20  # bytes of one JSONL line: far past any real record, and what one line may cost


def max_line_bytes() -> int:
    """The longest JSONL line read: $IMAGE_BUILDER_MAX_LINE (bytes; K, M, G: binary), else DEFAULT_MAX_LINE."""
    text = os.environ.get(MAX_LINE_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_LINE
    digits, scale = text.upper().removesuffix("B"), 1
    if digits[-1:] in ("K", "M", "G"):
        digits, scale = digits[:-1], 1 << (10 * ("KMG".index(digits[-1]) + 1))
    if not (digits.isascii() and digits.isdigit()) or int(digits) == 0:
        raise DatasetError(f"{MAX_LINE_ENV}={text!r}: not a byte count such as 67108864, 64M or 1G")
    return int(digits) * scale


def read_lines(path: Path, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number, line without its newline) of a file, each read with a bounded readline:
    a line over `limit` bytes (default max_line_bytes()) raises DatasetError naming path:line, so
    memory stays bounded by the limit whatever the file holds."""
    limit = max_line_bytes() if limit is None else limit
    try:
        with open(path, "rb") as f:
            number = 0
            while line := f.readline(limit + 1):
                number += 1
                if line.endswith(b"\n"):
                    line = line[:-1]
                elif len(line) > limit:
                    raise DatasetError(f"{path}:{number}: a line longer than {limit} bytes; a record that long is "
                                       f"refused (raise {MAX_LINE_ENV} to read it)")
                yield number, line
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc.strerror}") from None


@dataclass(frozen=True)
class AssertTask:
    """verl ground truth {"assert_case": [...]}: each case runs as `solution + "\\n" + case`."""
    task_id: str
    cases: tuple[str, ...]
    original_id: str
    impossible_type: str | None = None
    data_source: str = ""
    prompt: str = ""  # HumanEval-style tasks: put before an answer that does not define entry_point
    entry_point: str = ""
    test: str = ""  # HumanEval-style tasks: the `def check(candidate)` source (splice mode runs it as written)
    original_cases: tuple[str, ...] = ()  # an impossible variant's original test, where its record has it

    def program(self, solution: str) -> str:
        """The solution as the candidate's process runs it: HumanEval completions are often only the body
        of the prompt's function, so an answer that does not define entry_point gets the prompt first."""
        if not self.prompt or _defines(solution, self.entry_point):
            return solution
        return self.prompt + ("" if self.prompt.endswith("\n") else "\n") + solution


def _defines(source: str, name: str) -> bool:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a body-only completion is indented: it does not parse alone
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == name:
            return True
        if isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name:
            return True
    return False


@dataclass(frozen=True)
class StdioTask:
    """{"inputs": [...], "outputs": [...]}: stdin/stdout tests, or call-based when fn_name is set.

    `compare` None leaves the choice to the grading run (its option, else the data source's default);
    `checker` is the source of a checker program; `tolerance` float mode's, None for the default."""
    task_id: str
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    original_id: str
    fn_name: str | None = None
    impossible_type: str | None = None
    data_source: str = ""
    compare: str | None = None
    checker: str | None = None
    tolerance: float | None = None


@dataclass(frozen=True)
class RepoTask:
    """A SWE-bench instance; ImpossibleBench variants carry a mutated test_patch."""
    task_id: str  # instance_id
    repo: str
    base_commit: str
    gold_patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    original_id: str
    version: str = ""
    impossible_type: str | None = None
    original_test_patch: str | None = None
    test_cmd: str = "pytest -rA"  # SWE-bench's command for most pytest repos; the test files are appended


@dataclass(frozen=True)
class BadTask:
    task_id: str
    reason: str


Task = Union[AssertTask, StdioTask, RepoTask, BadTask]

# The comparisons of stdin/stdout output (graders/stdio.py implements them).
COMPARE_MODES = ("exact", "tokens", "float", "livecodebench", "sandboxfusion", "checker")
COMPARE_KEYS = ("compare", "checker", "tolerance")  # what a record or ground truth may say about comparing

# SWE-bench's test commands where they differ from `pytest -rA`; a record's own `test_cmd` wins.
REPO_TEST_CMDS = {"django/django": "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"}


def parse_ground_truth(task_id: str, ground_truth: Any, *, data_source: str = "",
                       impossible_type: str | None = None, original_id: str | None = None) -> Task:
    """verl's `reward_model.ground_truth`: a JSON string (or dict), dispatched on its keys."""
    original_id = original_id or task_id
    if isinstance(ground_truth, (str, bytes)):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError as exc:
            return BadTask(task_id, f"ground truth is not JSON: {exc}")
    if not isinstance(ground_truth, dict):
        return BadTask(task_id, f"ground truth is a {type(ground_truth).__name__}, not an object")
    if "assert_case" in ground_truth:
        cases = ground_truth["assert_case"]
        if not isinstance(cases, list) or not cases or not all(isinstance(c, str) for c in cases):
            return BadTask(task_id, "assert_case must be a non-empty list of strings")
        return AssertTask(task_id, tuple(cases), original_id, impossible_type, data_source)
    if "inputs" in ground_truth and "outputs" in ground_truth:
        inputs, outputs, fn_name = ground_truth["inputs"], ground_truth["outputs"], ground_truth.get("fn_name")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
            return BadTask(task_id, "inputs and outputs must be non-empty lists of the same length")
        if fn_name is not None and not isinstance(fn_name, str):
            return BadTask(task_id, "fn_name must be a string")
        if fn_name is None and not all(isinstance(x, str) for x in inputs + outputs):
            return BadTask(task_id, "stdin/stdout inputs and outputs must be strings")
        compare, checker, tolerance = (ground_truth.get(k) for k in COMPARE_KEYS)
        if checker is not None and (not isinstance(checker, str) or not checker.strip()):
            return BadTask(task_id, "checker must be the source of a checker program")
        compare = compare if compare is not None else ("checker" if checker is not None else None)
        if compare is not None and compare not in COMPARE_MODES:
            return BadTask(task_id, f"compare must be one of {', '.join(COMPARE_MODES)}, not {compare!r}")
        if compare == "checker" and checker is None:
            return BadTask(task_id, "compare is checker but the record has no checker")
        if fn_name is not None and compare is not None:
            return BadTask(task_id, "call-based tests compare return values; compare applies to stdin/stdout tests")
        if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                      or not 0 <= tolerance < 1):
            return BadTask(task_id, "tolerance must be a number in [0, 1)")
        return StdioTask(task_id, tuple(inputs), tuple(outputs), original_id, fn_name or None, impossible_type,
                         data_source, compare, checker, None if tolerance is None else float(tolerance))
    keys = sorted(map(str, ground_truth))
    return BadTask(task_id, f"ground truth has none of assert_case, inputs/outputs (keys: {keys})")


@dataclass(frozen=True)
class Unreadable:
    """A line of a JSONL file that is not JSON."""
    reason: str


def task_from_record(record: Any, fallback_id: str) -> Task:
    """One JSONL record or parquet row: verl row, SWE-bench instance, or a bare ground-truth record."""
    if isinstance(record, Unreadable):
        return BadTask(fallback_id, record.reason)
    if not isinstance(record, dict):
        return BadTask(fallback_id, f"record is a {type(record).__name__}, not an object")
    if "instance_id" in record or "test_patch" in record:
        return _repo_task(record, fallback_id)
    if "reward_model" in record:
        extra = record.get("extra_info") if isinstance(record.get("extra_info"), dict) else {}
        task_id = str(extra.get("task_id", extra.get("index", fallback_id)))
        reward_model = record["reward_model"] if isinstance(record["reward_model"], dict) else {}
        if "ground_truth" not in reward_model:
            return BadTask(task_id, "reward_model has no ground_truth")
        return parse_ground_truth(task_id, reward_model["ground_truth"], data_source=record.get("data_source") or "")
    raw = raw_layout_task(record, fallback_id)
    if raw is not None:
        return raw
    original_id = str(record.get("task_id", fallback_id))
    impossible_type = record.get("impossible_type")
    task_id = f"{original_id}__{impossible_type}" if impossible_type else original_id
    if ("test" in record or "entry_point" in record) and not any(
            k in record for k in ("assert_case", "inputs", "outputs", "tests")):
        return _check_task(record, task_id, original_id, impossible_type)
    if "tests" in record and not any(k in record for k in ("assert_case", "inputs", "outputs")):
        return _codecontests_task(record, task_id, original_id, impossible_type)
    truth = {k: record[k] for k in ("assert_case", "inputs", "outputs", "fn_name", *COMPARE_KEYS) if k in record}
    task = parse_ground_truth(task_id, truth, data_source=record.get("data_source") or "",
                              impossible_type=impossible_type, original_id=original_id)
    before = record.get("original_assert_case")  # `impossible mutate`'s: for evidence only
    if isinstance(task, AssertTask) and impossible_type and isinstance(before, list) and before \
            and all(isinstance(c, str) for c in before):
        task = replace(task, original_cases=tuple(before))
    return task


def _codecontests_task(record: dict, task_id: str, original_id: str, impossible_type: str | None) -> Task:
    """CodeContests's layout, `tests`: [{"input", "output"}, ...]; its data source defaults to codecontests
    (so float comparison unless the record or the run says otherwise)."""
    tests = record["tests"]
    if not isinstance(tests, list) or not tests or not all(
            isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str)
            for t in tests):
        return BadTask(task_id, "tests must be a non-empty list of {input, output} strings")
    truth = {"inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests],
             **{k: record[k] for k in COMPARE_KEYS if k in record}}
    return parse_ground_truth(task_id, truth, data_source=record.get("data_source") or "codecontests",
                              impossible_type=impossible_type, original_id=original_id)


def raw_layout_task(record: dict, fallback_id: str) -> Task | None:
    """A row as CodeContests, LiveCodeBench or APPS/TACO publish it (the module docstring), else None."""
    for key, source, id_keys, read_tests in RAW_LAYOUTS:
        if key not in record:
            continue
        original_id = next((str(record[k]) for k in ("task_id", *id_keys) if record.get(k) not in (None, "")),
                           fallback_id)
        impossible_type = record.get("impossible_type")
        task_id = f"{original_id}__{impossible_type}" if impossible_type else original_id
        try:
            truth = read_tests(record)
        except ValueError as exc:
            return BadTask(task_id, str(exc))
        truth.update({k: record[k] for k in COMPARE_KEYS if k in record})
        return parse_ground_truth(task_id, truth, data_source=record.get("data_source") or source,
                                  impossible_type=impossible_type, original_id=original_id)
    return None


def _codecontests_tests(record: dict) -> dict:
    inputs, outputs = [], []
    for key in ("public_tests", "private_tests", "generated_tests"):
        block = record.get(key)
        if block is None:
            continue
        given, wanted = (block.get(k) if isinstance(block, dict) else None for k in ("input", "output"))
        if not isinstance(given, list) or not isinstance(wanted, list) or len(given) != len(wanted):
            raise ValueError(f"{key} must be {{input: [...], output: [...]}}, lists of the same length")
        inputs += given
        outputs += wanted
    return {"inputs": inputs, "outputs": outputs}


def _livecodebench_tests(record: dict) -> dict:
    cases = _lcb_cases(record, "public_test_cases") + _lcb_cases(record, "private_test_cases")
    metadata = record.get("metadata") or {}
    try:
        metadata = json.loads(metadata) if isinstance(metadata, str) else metadata
    except ValueError:
        raise ValueError("metadata is not JSON") from None
    fn_name = metadata.get("func_name") if isinstance(metadata, dict) else None
    truth = {"inputs": [c["input"] for c in cases], "outputs": [c["output"] for c in cases]}
    return {**truth, "fn_name": fn_name} if fn_name else truth  # LiveCodeBench: call-based where it names one


def _lcb_cases(record: dict, key: str) -> list[dict]:
    value = record.get(key)
    if value in (None, ""):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            try:
                value = json.loads(_unpickled_string(value, key))
            except json.JSONDecodeError:
                raise ValueError(f"{key}: the unpickled string is not JSON") from None
    if not isinstance(value, list) or not all(
            isinstance(c, dict) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str)
            for c in value):
        raise ValueError(f"{key} must be a list of {{input, output}} strings")
    return value


class _PlainValues(pickle.Unpickler):
    """Unpickles plain values only: a pickle that names any class or function (what would run code) is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}; test cases are a string")


def _unpickled_string(text: str, key: str) -> str:
    """LiveCodeBench's compressed form: base64 of zlib of a pickled JSON string, decompressed to a bound."""
    limit = 8 * max_line_bytes()
    try:
        inflate = zlib.decompressobj()
        data = inflate.decompress(base64.b64decode(text.encode("ascii"), validate=True), limit)
    except (UnicodeEncodeError, binascii.Error, zlib.error) as exc:
        raise ValueError(f"{key}: neither JSON nor LiveCodeBench's compressed form ({exc})") from None
    if inflate.unconsumed_tail:
        raise ValueError(f"{key}: over {limit >> 20} MiB decompressed (8 x ${MAX_LINE_ENV})")
    try:
        value = _PlainValues(io.BytesIO(data)).load()
    except Exception as exc:  # whatever a malformed pickle raises, it is this field's fault
        raise ValueError(f"{key}: refused the pickle: {' '.join(str(exc).split())}") from None
    if not isinstance(value, str):
        raise ValueError(f"{key}: the pickle holds a {type(value).__name__}, not the JSON string of the tests")
    return value


def _apps_tests(record: dict) -> dict:
    value = record.get("input_output")
    if value in (None, ""):
        raise ValueError("input_output has no tests (inputs and outputs)")
    try:
        truth = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        raise ValueError("input_output is not JSON") from None
    if not isinstance(truth, dict) or not truth.get("inputs"):
        raise ValueError("input_output has no tests (inputs and outputs)")
    truth = {k: truth[k] for k in ("inputs", "outputs", "fn_name") if k in truth}
    if not truth.get("fn_name"):  # APPS gives some stdin tests as lists of lines; its harness joins them
        truth.pop("fn_name", None)
        truth = {k: [_lines(x) for x in truth.get(k) or []] for k in ("inputs", "outputs")}
    return truth


def _lines(value: Any) -> Any:
    return "\n".join(value) if isinstance(value, list) and all(isinstance(x, str) for x in value) else value


# A dataset's own layout: the key that tells it, its data source, the keys its task id is read from (`task_id`
# first) and its tests' reader.
RAW_LAYOUTS = (("public_tests", "codecontests", ("name",), _codecontests_tests),
               ("public_test_cases", "livecodebench", ("question_id",), _livecodebench_tests),
               ("input_output", "apps", ("problem_id", "name"), _apps_tests))


def _check_task(record: dict, task_id: str, original_id: str, impossible_type: str | None) -> Task:
    """A HumanEval-style record: `test` defines check(candidate), `entry_point` names the function under test."""
    test, entry_point, prompt = record.get("test"), record.get("entry_point"), record.get("prompt") or ""
    if not isinstance(test, str) or not test.strip():
        return BadTask(task_id, "test: missing or empty; it must be the source of `def check(candidate): ...`")
    if not isinstance(entry_point, str) or not entry_point.isidentifier() or keyword.iskeyword(entry_point):
        return BadTask(task_id, f"entry_point: {entry_point!r} does not name a function")
    if not isinstance(prompt, str):
        return BadTask(task_id, "prompt: not a string")
    try:
        cases = check_cases(test, entry_point)
    except ValueError as exc:
        return BadTask(task_id, str(exc))
    original_cases: tuple[str, ...] = ()
    if impossible_type and isinstance(record.get("original_test"), str):  # ImpossibleBench's: for evidence only
        try:
            original_cases = check_cases(record["original_test"], entry_point)
        except ValueError:
            pass
    return AssertTask(task_id, cases, original_id, impossible_type, record.get("data_source") or "", prompt,
                      entry_point, test, original_cases)


# Statements of check's body that only set up what its asserts use: with nothing else there, each assert can
# be a case of its own (the setup before it repeated) and run as it would in check. Anything else (a loop,
# a call whose effect a later assert may rely on) keeps the body one case.
_SETUP = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Pass)


def check_cases(test: str, entry_point: str) -> tuple[str, ...]:
    """Assert cases from HumanEval's `def check(candidate): ...`: each assert of check's body one case, or
    the whole body one case, after the test's other top-level statements (imports, METADATA, helpers);
    `candidate` is the entry point, which the evaluator binds to a stub of the solution's function.
    Raises ValueError, in one line naming the field (and the test's line), when the test has no check."""
    try:
        module = ast.parse(test)
    except (SyntaxError, ValueError) as exc:
        where = f" line {exc.lineno}" if getattr(exc, "lineno", None) else ""
        raise ValueError(f"test{where}: not Python: {getattr(exc, 'msg', exc)}") from None
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        raise ValueError("test: no `def check(candidate)` at its top level")
    check = checks[-1]
    params = check.args
    if len(params.args) != 1 or params.vararg or params.kwarg or params.kwonlyargs or check.decorator_list:
        raise ValueError(f"test line {check.lineno}: check must take one argument, the candidate, and no decorator")
    # A top-level call of check (a script's `check(f)`) would run the test twice, once on a name of the test.
    prelude = [n for n in module.body if n is not check and not any(
        isinstance(m, ast.Name) and m.id == "check" for m in ast.walk(n))]
    body = check.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # its docstring
    bind = ast.parse(f"{params.args[0].arg} = {entry_point}").body
    # HumanEval's `assert True, "This prints if this assert fails"` tests nothing: a case of it would give
    # any answer a share of the score.
    asserts = [s for s in body if isinstance(s, ast.Assert)
               and not (isinstance(s.test, ast.Constant) and s.test.value)]
    if asserts and all(isinstance(s, (ast.Assert, *_SETUP)) or _pure_assign(s) for s in body):
        cases = []
        for a in asserts:
            setup = [s for s in body[:body.index(a)] if not isinstance(s, ast.Assert)]
            cases.append(ast.unparse(ast.Module([*prelude, *bind, *setup, a], [])))
        return tuple(cases)
    call = ast.parse(f"check({entry_point})").body
    return (ast.unparse(ast.Module([*prelude, check, *call], [])),)


def _pure_assign(stmt: ast.stmt) -> bool:
    """An assignment to plain names of a value that calls nothing (`xs = [1, 2]`): setup, not a test step."""
    if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
        return False
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    return all(isinstance(t, ast.Name) for t in targets) and not any(
        isinstance(n, (ast.Call, ast.NamedExpr, ast.Lambda, ast.Await, ast.Yield)) for n in ast.walk(stmt.value))


def _repo_task(record: dict, fallback_id: str) -> Task:
    task_id = str(record.get("instance_id", fallback_id))
    # An empty FAIL_TO_PASS ([] or "[]") is a list SWE-bench grades: resolved once the tests run through.
    missing = [k for k in ("repo", "base_commit", "test_patch") if not record.get(k)]
    missing += ["FAIL_TO_PASS"] if record.get("FAIL_TO_PASS") in (None, "") else []
    if missing:
        return BadTask(task_id, f"SWE-bench record lacks {', '.join(missing)}")
    try:
        fail_to_pass, pass_to_pass = (_test_list(record.get(k) or "[]") for k in ("FAIL_TO_PASS", "PASS_TO_PASS"))
    except ValueError as exc:
        return BadTask(task_id, str(exc))
    impossible_type = record.get("impossible_type")
    original_id = task_id.removesuffix(f"__{impossible_type}") if impossible_type else task_id
    test_cmd = record.get("test_cmd") or REPO_TEST_CMDS.get(record["repo"])
    extra = {"test_cmd": test_cmd} if test_cmd else {}
    return RepoTask(task_id, record["repo"], record["base_commit"], record.get("patch") or "", record["test_patch"],
                    fail_to_pass, pass_to_pass, original_id, str(record.get("version", "")), impossible_type,
                    record.get("original_test_patch"), **extra)


def _test_list(value: Any) -> tuple[str, ...]:
    # SWE-bench stores the lists as JSON strings; some exports have real lists.
    try:
        tests = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        tests = None
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise ValueError("FAIL_TO_PASS and PASS_TO_PASS must be lists of test ids")
    return tuple(tests)


def read_records(path: Path | str, max_line: int | None = None) -> list[tuple[str, Any]]:
    """(fallback id, record) for each row of a .parquet or each line of a JSONL file (each line
    at most `max_line` bytes, default $IMAGE_BUILDER_MAX_LINE: read_lines)."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        import pyarrow as pa
        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError, TypeError, NotImplementedError, pa.ArrowException) as exc:
            raise DatasetError(f"{path}: not a readable parquet file: {' '.join(str(exc).split())}") from None
        return [(f"row {i}", row) for i, row in enumerate(rows)]
    records, offset = [], 0
    for number, data in read_lines(path, max_line):
        try:
            # "\n" only splits lines: JSON strings may hold U+2028 and other characters str.splitlines() breaks on.
            line = data.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not UTF-8 text (byte {offset + exc.start} of the file); JSONL "
                               "must be UTF-8, and a parquet file needs the .parquet suffix") from None
        offset += len(data) + 1
        if line.strip():
            try:
                records.append((f"line {number}", json.loads(line)))
            except (ValueError, RecursionError) as exc:
                why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
                records.append((f"line {number}", Unreadable(f"line {number} is not JSON: {why}")))
    if records and all(isinstance(r, Unreadable) for _, r in records):
        # One bad line is one bad task; a file without a JSON line is the wrong file.
        raise DatasetError(f"{path}: not JSONL, no line is JSON ({records[0][1].reason}); expected one JSON "
                           "object a line, or a .parquet file")
    return records


def load_tasks_with_rows(path: Path | str, max_line: int | None = None) -> list[tuple[str, Task]]:
    """(where in the file: "line N" or "row N", task) for each record; an id that appears twice raises."""
    tasks = [(fallback, task_from_record(record, fallback)) for fallback, record in read_records(path, max_line)]
    seen: set[str] = set()
    for where, task in tasks:
        if task.task_id in seen:
            shown = task.task_id if task.task_id.isprintable() else repr(task.task_id)  # keep it one line
            raise DatasetError(f"{path}: task id {shown} appears twice (again at {where})")
        seen.add(task.task_id)
    return tasks


def load_tasks(path: Path | str, max_line: int | None = None) -> list[Task]:
    return [task for _, task in load_tasks_with_rows(path, max_line)]
