"""Candidate solutions: predictions JSONL, or raw model responses holding a fenced code block.

Records: {"task_id" | "instance_id", "solution" | "model_patch" | "response"}.
`model_patch` is a diff, used as is (SWE-bench). `response` is a raw model
answer: the MBPP prompt asks for "a single ```python code block", so the code
is the last ```python block (the answer after any drafts); a response without
fences is the code when it compiles as Python as a whole (LiveCodeBench-style
prompts ask for the bare program), else it has no solution. A `solution`
holding fences is treated as a response.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from image_builder.tasks import Unreadable, read_records

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = {"python", "py", "python3"}
NO_CODE = "no ```python block in the response, and it is not a Python program as a whole"


@dataclass(frozen=True)
class Prediction:
    task_id: str
    solution: str | None  # code or patch; None when there is nothing to run
    reason: str = ""  # why solution is None

    @property
    def sha256(self) -> str:
        """What a results file records of the solution, to tell a resumed run from another one."""
        import hashlib
        return "" if self.solution is None else hashlib.sha256(self.solution.encode("utf-8", "surrogatepass")).hexdigest()


def extract_code(response: str) -> str | None:
    """The last ```python block; failing that the last untagged block; a response without any
    fence, when it compiles as Python as a whole (a bare program; prose does not compile); else None."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(response)]
    python = [code for tag, code in blocks if tag in _PYTHON_TAGS]
    untagged = [code for tag, code in blocks if not tag]
    chosen = python or untagged
    if chosen:
        return chosen[-1]
    if "```" in response or not response.strip():
        return None
    try:
        compile(response, "<response>", "exec", dont_inherit=True)  # compiled only: nothing runs here
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    return response


def prediction_from_record(record: object, fallback_id: str) -> Prediction:
    if isinstance(record, Unreadable):
        return Prediction(fallback_id, None, record.reason)
    if not isinstance(record, dict):
        return Prediction(fallback_id, None, "prediction is not a JSON object")
    task_id = str(record.get("instance_id", record.get("task_id", fallback_id)))
    if "model_patch" in record:
        return Prediction(task_id, record["model_patch"] or "")  # an empty patch is a real (losing) answer
    text = record.get("solution", record.get("response"))
    if not isinstance(text, str):
        return Prediction(task_id, None, "no solution, model_patch or response string")
    if "response" in record and "solution" not in record or "```" in text:
        code = extract_code(text)
        return Prediction(task_id, code, "" if code is not None else NO_CODE)
    return Prediction(task_id, text)


def load_predictions(path: Path) -> list[Prediction]:
    return [prediction_from_record(record, fallback) for fallback, record in read_records(path)]
