"""`POST /submit`: SandboxFusion's dataset evaluation (SubmitRequest -> EvalResult), judged by the graders.

SandboxFusion finds a submission's tests in its dataset tables by `dataset` and `id`, or takes the row from
`config.provided_data`. This server holds no tables: the row comes with the request, as RL code sends it.
Two of SandboxFusion's dataset classes are served, by their registered dataset name or `config.dataset_type`:

- CommonOJDataset (`code_contests`): `provided_data.test` = [{"input": {"stdin": ...}, "output": {"stdout":
  ...}}] (a list or its JSON text), in `config.language`. Compared as SandboxFusion compares (grade's
  `sandboxfusion` mode: stripped lines, case-insensitive, numbers within relative 1e-5), each case its own
  run with `run_timeout` (default 20 s; compiled languages 10 s, after a `compile_timeout` of 10 s,
  SandboxFusion's); python through the stdio grader, the other languages /run_code serves through its runs;
  the answer lists cases up to the first failure (all of them with `config.extra.run_all_cases`).
- MBPPDataset (`mbpp`): `provided_data.test_list` (asserts, a list or its JSON text) and
  `provided_data.labels.test_setup_code`; the completion cut as SandboxFusion cuts it (its first code block,
  up to `[DONE]`, a following `assert` or `\"\"\"`, `if __name__ ==`), the setup code before it.

The code is taken from the completion as SandboxFusion's extraction does (fenced blocks, then an unclosed
fence, then `def`/`class` blocks; a block of the request's language first). `custom_extract_logic` is
refused: SandboxFusion runs it with `exec` in the server's own process.

Where verdicts differ from SandboxFusion's, these are the graders': SandboxFusion runs an MBPP answer and
its asserts as one program and takes the exit status, so an answer calling `os._exit(0)` or replacing
`AssertionError` passes there and fails here (the asserts run in the evaluator, out of the answer's reach:
graders/assert_cases.py). On honest answers the two agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from image_builder.graders.grade import grade
from image_builder.graders.options import GradeOptions
from image_builder.graders.results import CaseResult, CaseStatus, GradeResult
from image_builder.graders.one_answer import Question, one_answer_each
from image_builder.graders.stdio import DEFAULT_TOLERANCE, compare_sandboxfusion, outputs_exclude
from image_builder.runtime.execution import Executor
from image_builder.tasks import AssertTask, StdioTask

# SandboxFusion's registered dataset names of the two classes (its configs' registry).
DATASET_CLASSES = {"code_contests": "CommonOJDataset", "mbpp": "MBPPDataset"}
STDIO_TIMEOUT = 20.0  # SandboxFusion's run_timeout default for stdio tests (check_stdio_test_case)
COMPILE_TIMEOUT = COMPILED_RUN_TIMEOUT = 10.0  # and its defaults for compiled languages
COMPILED = ("cpp",)
MBPP_TIMEOUT = 20.0  # and for MBPP's one run
MAX_SECONDS = 3600.0  # the longest timeout a request may ask (/run_code's too)
# Code block languages by SandboxFusion's aliases (sandbox/utils/extraction.py), the ones served here.
ALIASES = {"python": ("python", "Python", "py", "Python3", "python3", "PY"),
           "bash": ("bash", "Bash", "BASH", "sh", "shell")}
FENCED = re.compile(r"```([^\n]*)\n(.*?)\n\s*```", re.DOTALL | re.MULTILINE)
UNCLOSED = re.compile(r"```([^\n]*)\n(.*)", re.DOTALL | re.MULTILINE)
PY_BLOCK = re.compile(r"(?:^(?:import|from|#)[^\n]+\n)*^(?:def|class) [^\n]+\n(?:\s+[^\n]+\n)+", re.M)


# (language, code, stdin, compile_timeout, run_timeout) -> a /run_code answer's JSON (serve.Runner's)
RunCode = Callable[[str, str, str, float, float], dict]


class BadSubmit(ValueError):
    """A request /submit cannot evaluate (400, with SandboxFusion's wording where it has one)."""


@dataclass(frozen=True)
class Submission:
    dataset: str
    id: int | str
    completion: str
    dataset_class: str  # CommonOJDataset or MBPPDataset
    row: dict  # config.provided_data
    language: str | None = None
    run_timeout: float | None = None
    compile_timeout: float | None = None
    is_fewshot: bool = False
    run_all_cases: bool = False


@dataclass
class EvalTestCase:
    passed: bool
    exec_info: dict  # a RunCodeResponse's fields
    test_info: dict | None = None


@dataclass
class EvalResult:
    id: int | str
    accepted: bool
    extracted_code: str
    full_code: str | None = None
    test_code: str | None = None
    tests: list[EvalTestCase] = field(default_factory=list)
    extracted_type: str | None = None
    extra: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


def parse_submit(doc: object) -> Submission:
    if not isinstance(doc, dict):
        raise BadSubmit("the body must be a JSON object")
    dataset, ident, completion, config = (doc.get(k) for k in ("dataset", "id", "completion", "config"))
    if not isinstance(dataset, str):
        raise BadSubmit("dataset must be a string")
    if isinstance(ident, bool) or not isinstance(ident, (int, str)):
        raise BadSubmit("id must be an integer or a string")
    if not isinstance(completion, str):
        raise BadSubmit("completion must be a string")
    if not isinstance(config, dict):
        raise BadSubmit("config must be an object (SandboxFusion's TestConfig)")
    dataset_class = DATASET_CLASSES.get(dataset)
    if dataset_class is None:
        wanted = config.get("dataset_type")
        if wanted is None:
            raise BadSubmit(f"no eval class found for dataset {dataset}")
        if wanted not in DATASET_CLASSES.values():
            raise BadSubmit(f"eval class {wanted} not served here (this server evaluates "
                            f"{', '.join(sorted(set(DATASET_CLASSES.values())))})")
        dataset_class = wanted
    if config.get("custom_extract_logic") is not None:
        raise BadSubmit("custom_extract_logic is not run here (SandboxFusion would exec it in the server)")
    row = config.get("provided_data")
    if not isinstance(row, dict):
        raise BadSubmit("this server holds no dataset tables: give the problem as config.provided_data (an object)"
                        if row is None else "request.config.provided_data should be a dict with str -> str | int")
    language = config.get("language")
    if language is not None and not isinstance(language, str):
        raise BadSubmit("config.language must be a string")
    timeouts = [config.get(key) for key in ("run_timeout", "compile_timeout")]
    for key, timeout in zip(("run_timeout", "compile_timeout"), timeouts):
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout <= MAX_SECONDS):
            raise BadSubmit(f"config.{key} must be seconds in (0, {MAX_SECONDS:.0f}], not {timeout!r}")
    extra = config.get("extra") or {}
    if not isinstance(extra, dict):
        raise BadSubmit("config.extra must be an object")
    run_timeout, compile_timeout = (None if t is None else float(t) for t in timeouts)
    return Submission(dataset, ident, completion, dataset_class, row, language, run_timeout, compile_timeout,
                      bool(config.get("is_fewshot")), bool(extra.get("run_all_cases")))


def evaluate(submission: Submission, executor: Executor, run_code: RunCode | None = None) -> EvalResult:
    """The EvalResult of one submission, graded in `executor`; languages other than python through `run_code`
    (/run_code's). BadSubmit: the row is not the class's, or the language is not served."""
    if submission.dataset_class == "CommonOJDataset":
        return _common_oj(submission, executor, run_code)
    return _mbpp(submission, executor)


def _common_oj(s: Submission, executor: Executor, run_code: RunCode | None) -> EvalResult:
    if not s.language:
        raise BadSubmit("config.language field must exist for CommonOJDataset, got None")
    cases = _json_field(s.row, "test")
    if not isinstance(cases, list) or not cases or not all(_stdio_case(c) for c in cases):
        raise BadSubmit("provided_data.test must be a non-empty list of {input: {stdin}, output: {stdout}}")
    code, kind = extract(s.completion, s.language)
    if s.language != "python":
        if run_code is None:
            raise BadSubmit(f"config.language {s.language!r}: only python is graded without /run_code's languages")
        return _stdio_runs(s, code, kind, cases, run_code)
    task = StdioTask(str(s.id), tuple(c["input"]["stdin"] for c in cases), tuple(c["output"]["stdout"] for c in cases),
                     str(s.id), compare="sandboxfusion")
    result = grade(task, code, executor, GradeOptions(stdio_timeout=s.run_timeout or STDIO_TIMEOUT))
    tests = _to_first_failure(s, [EvalTestCase(case.status == CaseStatus.PASSED, _exec_info(case), cases[i])
                                  for i, case in enumerate(result.cases)])
    return EvalResult(s.id, _accepted(result, tests), code, tests=tests, extracted_type=kind)


def _to_first_failure(s: Submission, tests: list[EvalTestCase]) -> list[EvalTestCase]:
    """SandboxFusion stops at the first failure unless the submission asks for every case."""
    failed = next((i for i, t in enumerate(tests) if not t.passed), None)
    return tests if s.run_all_cases or failed is None else tests[:failed + 1]


def _stdio_runs(s: Submission, code: str, kind: str, cases: list[dict], run_code: RunCode) -> EvalResult:
    """A compiled or other language's cases, each a /run_code run (SandboxFusion compiles per case too), its
    stdout judged here by SandboxFusion's rule; the run's answer is the case's exec_info."""
    compiled = s.language in COMPILED
    tests = []
    for case in cases:
        answer = run_code(s.language, code, case["input"]["stdin"], s.compile_timeout or COMPILE_TIMEOUT,
                          s.run_timeout or (COMPILED_RUN_TIMEOUT if compiled else STDIO_TIMEOUT))
        if answer["status"] == "SandboxError" and answer["message"].startswith("language "):
            raise BadSubmit(answer["message"])
        stdout = (answer.get("run_result") or {}).get("stdout")
        passed = (answer["status"] == "Success" and stdout is not None
                  and compare_sandboxfusion(stdout, case["output"]["stdout"]) is None)
        tests.append(EvalTestCase(passed, answer, case))
        if not passed and not s.run_all_cases:
            break
    # One input, one answer, as the stdio grader judges python's (graders/one_answer.py).
    judged = one_answer_each(
        [Question(t.test_info["input"]["stdin"], t.test_info["output"]["stdout"]) for t in tests],
        [CaseResult(str(i), CaseStatus.PASSED if t.passed else CaseStatus.FAILED) for i, t in enumerate(tests)],
        partial(outputs_exclude, "sandboxfusion", DEFAULT_TOLERANCE), "test")
    for test, case in zip(tests, judged):
        test.passed = case.status is CaseStatus.PASSED
    tests = _to_first_failure(s, tests)
    return EvalResult(s.id, all(t.passed for t in tests), code, tests=tests, extracted_type=kind)


def _mbpp(s: Submission, executor: Executor) -> EvalResult:
    asserts = _json_field(s.row, "test_list")
    if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) for a in asserts):
        raise BadSubmit("provided_data.test_list must be a non-empty list of assert statements")
    labels = _json_field(s.row, "labels") or {}
    setup = labels.get("test_setup_code", "") if isinstance(labels, dict) else ""
    if not isinstance(setup, str):
        raise BadSubmit("provided_data.labels.test_setup_code must be a string")
    completion = s.completion[:s.completion.index("[DONE]")] if "[DONE]" in s.completion else s.completion
    code, kind = extract(completion, "python", first_block_only=True)
    for stop in ("\nassert", '\n"""'):
        code = code[:code.index(stop)] if stop in code else code
    code = "\n".join([setup, code])
    code = code[:code.index("if __name__ ==")] if "if __name__ ==" in code else code
    cases = tuple(asserts[-1:] if s.is_fewshot else asserts)  # few-shot prompts show all but the last
    task = AssertTask(str(s.id), cases, str(s.id), data_source="mbpp")
    result = grade(task, code, executor, GradeOptions(case_timeout=s.run_timeout or MBPP_TIMEOUT))
    tests = [EvalTestCase(case.status == CaseStatus.PASSED, _exec_info(case), {"assert": cases[i]})
             for i, case in enumerate(result.cases)]
    return EvalResult(s.id, _accepted(result, tests), code, full_code=code, test_code="\n".join(cases), tests=tests,
                      extracted_type=kind)


def _accepted(result: GradeResult, tests: list[EvalTestCase]) -> bool:
    return bool(tests) and all(t.passed for t in tests) and result.passed


def _json_field(row: dict, key: str) -> Any:
    value = row.get(key)
    if isinstance(value, str):  # SandboxFusion's ensure_json: a column may hold JSON text
        try:
            return json.loads(value)
        except ValueError:
            raise BadSubmit(f"provided_data.{key} is a string but not JSON") from None
    return value


def _stdio_case(case: object) -> bool:
    return (isinstance(case, dict) and isinstance(case.get("input"), dict) and isinstance(case.get("output"), dict)
            and isinstance(case["input"].get("stdin"), str) and isinstance(case["output"].get("stdout"), str))


def _exec_info(case: CaseResult) -> dict:
    """A RunCodeResponse of a case's run, as far as the grader's record says (no output: it is not kept)."""
    if case.status == CaseStatus.TIMEOUT:
        status, run = "Failed", "TimeLimitExceeded"
    else:
        status, run = ("Success" if case.status == CaseStatus.PASSED else "Failed"), "Finished"
    return {"status": status, "message": case.reason, "compile_result": None,
            "run_result": {"status": run, "execution_time": round(case.wall_time, 6), "return_code": None,
                           "stdout": None, "stderr": case.stderr_tail or None},
            "files": {}}


def extract(completion: str, language: str, first_block_only: bool = False) -> tuple[str, str]:
    """(code, extracted_type) as SandboxFusion takes code from a completion: its complete fenced blocks, else
    an unclosed fence, else (python) `def`/`class` blocks; the first block tagged with `language`, else the
    first of any. `first_block_only` (its MBPP path): the first block, whatever its tag."""
    aliases = {alias: name for name, names in ALIASES.items() for alias in names}
    for pattern, kind in ((FENCED, "fenced"), (UNCLOSED, "incomplete_fenced")):
        blocks = [(aliases.get(tag.strip(), ""), code) for tag, code in pattern.findall(completion)]
        if blocks:
            break
    else:
        dense = "\n".join(line for line in completion.split("\n") if line.strip()) + "\n"
        blocks, kind = [("python", m) for m in PY_BLOCK.findall(dense)] if language == "python" else [], "heuristic"
    if not blocks:
        return "", "empty"
    if first_block_only:
        code = blocks[0][1]
    else:
        code = next((c for tag, c in blocks if tag == language), blocks[0][1])
    return code.replace("\r", ""), kind
