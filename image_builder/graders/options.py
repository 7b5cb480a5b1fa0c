"""Limits and switches for one grading run; the defaults are those of the graders we mirror."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .access import TestAccess


@dataclass(frozen=True)
class GradeOptions:
    python: str = "python3"  # the interpreter inside the instance
    case_timeout: float = 10.0  # per assert case: verl's sandbox run timeout
    stdio_timeout: float = 6.0  # per stdin/stdout test: LiveCodeBench's
    memory_mb: int = 1024  # per case or test: verl's sandbox default
    max_output: int = 1 << 20  # bytes kept of each of stdout and stderr per case
    repo_timeout: float = 1800.0  # a whole repo-test run: SWE-bench's default
    repo_memory_mb: int | None = None  # SWE-bench sets none
    repo_max_output: int = 64 << 20  # -rA logs of big suites are long
    # Beyond verl: assert cases compare `==` only between plain built-in values, so an object whose
    # __eq__ always says True fails (call-based tests compare after a JSON round trip anyway).
    strict: bool = False
    access: TestAccess = TestAccess.HIDDEN  # for repo tasks; assert and stdio tests always live in the grader
    env: Mapping[str, str] = field(default_factory=dict)  # on top of the instance's environment
