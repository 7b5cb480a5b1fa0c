"""Limits and switches for one grading run; the defaults are those of the graders we mirror."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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
    # Repo tests with the network (SWE-bench's harness has it; some repositories' tests need it). Off by
    # default; the result's repo report records it. Assert and stdio runs never get it.
    repo_network: bool = False
    # Beyond verl: in assert cases no truth value comes from the solution's own objects (their
    # __bool__ and __eq__ between two of them are not asked; assert_sides.py). Comparing one with a
    # plain value fails in every mode. Call-based tests compare after a JSON round trip anyway.
    strict: bool = False
    # How stdin/stdout output is compared (tasks.COMPARE_MODES) for tasks whose record does not say;
    # None: the data source's default (stdio.default_compare). A record's `compare` or `checker` wins.
    compare: str | None = None
    access: TestAccess = TestAccess.HIDDEN  # for repo tasks; assert and stdio tests always live in the grader
    # ImpossibleBench's allow_test_modifications=True for assert tasks: the answer and its tests in one process
    # (splice.py), so the answer can redefine them. Only to reproduce that setting; results say `mode: splice`.
    splice: bool = False
    env: Mapping[str, str] = field(default_factory=dict)  # on top of the instance's environment

    def __post_init__(self):
        if self.compare is not None and self.compare not in COMPARE_MODES:
            raise ValueError(f"compare must be one of {', '.join(COMPARE_MODES)}, not {self.compare!r}")

    # What a trainer may set per run ($IMAGE_BUILDER_GRADE_OPTIONS) or per row (extra_info["grade_options"]).
    SETTABLE = {"strict": bool, "case_timeout": float, "stdio_timeout": float, "memory_mb": int, "compare": str}

    def updated(self, given: Mapping[str, object]) -> GradeOptions:
        """These options with `given` applied; ValueError naming the key that cannot be."""
        if not isinstance(given, Mapping):
            raise ValueError("grade options must be an object of " + ", ".join(self.SETTABLE))
        changes = {}
        for key, value in given.items():
            kind = self.SETTABLE.get(key)
            if kind is None:
                raise ValueError(f"unknown grade option {key!r}; known: {', '.join(self.SETTABLE)}")
            if kind is float and type(value) is int:
                value = float(value)
            if type(value) is not kind or (kind is not bool and kind is not str and value <= 0):
                raise ValueError(f"grade option {key!r} must be a {'positive ' if kind in (int, float) else ''}"
                                 f"{kind.__name__}, not {value!r}")
            changes[key] = value
        return replace(self, **changes)
