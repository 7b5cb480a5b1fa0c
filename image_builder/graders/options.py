"""Limits and switches for one grading run; the defaults are those of the graders we mirror."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from image_builder.tasks import COMPARE_MODES
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
    # Beyond verl: in assert cases no truth value comes from the solution's own objects (their
    # __bool__ and __eq__ between two of them are not asked; assert_sides.py). Comparing one with a
    # plain value fails in every mode. Call-based tests compare after a JSON round trip anyway.
    strict: bool = False
    # How stdin/stdout output is compared (tasks.COMPARE_MODES) for tasks whose record does not say;
    # None: the data source's default (stdio.default_compare). A record's `compare` or `checker` wins.
    compare: str | None = None
    access: TestAccess = TestAccess.HIDDEN  # for repo tasks; assert and stdio tests always live in the grader
    env: Mapping[str, str] = field(default_factory=dict)  # on top of the instance's environment

    def __post_init__(self):
        if self.compare is not None and self.compare not in COMPARE_MODES:
            raise ValueError(f"compare must be one of {', '.join(COMPARE_MODES)}, not {self.compare!r}")
