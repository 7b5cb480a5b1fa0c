"""Which log parser reads a repo-test run, SWE-bench's way: the repository's own.

SWE-bench reads each repository's test output with the parser its
MAP_REPO_TO_PARSER_PY names (parse_log_sympy for sympy's `bin/test`, parse_log_django
for Django's runner, parse_log_pytest_v2 for astropy, scikit-learn and sphinx, ...).
The parser is chosen, first match wins:

1. the catalog's `grader.log_parser` (what `swebench catalog` records: the name of
   SWE-bench's function, e.g. `parse_log_sympy`), when it names a parser known here;
2. the repository's name, through SWE-bench's map (the installed package's, else
   ours: REPO_PARSERS, the names of 4.x's);
3. the test command: `pytest` -> parse_log_pytest, `bin/test` -> parse_log_sympy,
   `runtests.py` -> parse_log_django, anything else -> unittest's `... ok` lines
   (testlogs.parse_unittest_log: not a SWE-bench parser).

With `swebench` installed, the statuses come from its own function (loaded from
its log_parsers/python.py alone, as the catalog loads its specs:
build.swebench_catalog.log_parser_module); without it, or if its function raises,
from ours (testlogs.swebench_*), which read the same formats.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

from . import testlogs
from .testlogs import TestStatus

UNITTEST = "unittest"  # our own reader, for commands no SWE-bench parser is known for
# The families: SWE-bench's function names a parser's reading is one of (4.x's aliases share these).
BUILTIN: dict[str, Callable[[str], dict[str, str]]] = {
    "parse_log_pytest": testlogs.swebench_pytest,
    "parse_log_pytest_options": testlogs.swebench_pytest_options,
    "parse_log_pytest_v2": testlogs.swebench_pytest_v2,
    "parse_log_django": testlogs.swebench_django,
    "parse_log_sympy": testlogs.swebench_sympy,
    "parse_log_matplotlib": testlogs.swebench_matplotlib,
    "parse_log_seaborn": testlogs.swebench_seaborn,
}
# SWE-bench 4.x's per-repository names for the families above.
ALIASES = {
    **dict.fromkeys(("parse_log_astroid", "parse_log_flask", "parse_log_marshmallow", "parse_log_pvlib",
                     "parse_log_pyvista", "parse_log_sqlfluff", "parse_log_xarray"), "parse_log_pytest"),
    **dict.fromkeys(("parse_log_pydicom", "parse_log_requests", "parse_log_pylint"), "parse_log_pytest_options"),
    **dict.fromkeys(("parse_log_astropy", "parse_log_scikit", "parse_log_sphinx"), "parse_log_pytest_v2"),
}
# SWE-bench 4.x's MAP_REPO_TO_PARSER_PY, by family: for when swebench is not installed.
REPO_PARSERS = {
    "astropy/astropy": "parse_log_pytest_v2",
    "django/django": "parse_log_django",
    "marshmallow-code/marshmallow": "parse_log_pytest",
    "matplotlib/matplotlib": "parse_log_matplotlib",
    "mwaskom/seaborn": "parse_log_seaborn",
    "pallets/flask": "parse_log_pytest",
    "psf/requests": "parse_log_pytest_options",
    "pvlib/pvlib-python": "parse_log_pytest",
    "pydata/xarray": "parse_log_pytest",
    "pydicom/pydicom": "parse_log_pytest_options",
    "pylint-dev/astroid": "parse_log_pytest",
    "pylint-dev/pylint": "parse_log_pytest_options",
    "pytest-dev/pytest": "parse_log_pytest",
    "pyvista/pyvista": "parse_log_pytest",
    "scikit-learn/scikit-learn": "parse_log_pytest_v2",
    "sqlfluff/sqlfluff": "parse_log_pytest",
    "sphinx-doc/sphinx": "parse_log_pytest_v2",
    "sympy/sympy": "parse_log_sympy",
}
# Families that read a test runner other than pytest: their runs are never cross-checked with junit.
NOT_PYTEST = {"parse_log_django", "parse_log_sympy", UNITTEST}
# The statuses each family can report at all (seaborn's reads passes and failures only): a test junit
# gives another status that the log does not name is MISSING, as SWE-bench has it, not a mismatch.
_ALL = frozenset(TestStatus) - {TestStatus.XPASS}
RECORDS = {"parse_log_seaborn": frozenset({TestStatus.PASSED, TestStatus.FAILED})}


@dataclass(frozen=True)
class LogParser:
    """A parser as chosen for a run: `name` as SWE-bench names it (recorded with the run), `family` the
    reading it is (one of BUILTIN, UNITTEST, or a function of a later swebench's this module does not know),
    `source` "swebench" (the installed package's function) or "builtin" (ours), `chosen_by` catalog,
    repository or command."""
    name: str
    family: str
    source: str
    chosen_by: str
    function: Callable | None = None  # SWE-bench's, when source is "swebench"

    @property
    def pytest_format(self) -> bool:
        """Reads pytest's output: junit can check its statuses where the runner is pytest."""
        return self.family not in NOT_PYTEST

    @property
    def records(self) -> frozenset[TestStatus]:
        return RECORDS.get(self.family, _ALL)

    def read(self, log: str, spec: object = None) -> dict[str, TestStatus]:
        """{test id: status} from `log`; words that are no status (SWE-bench keeps what a line holds) are left
        out, so such a test reads MISSING."""
        return {test: TestStatus(word) for test, word in self.raw(log, spec).items() if word in TestStatus.__members__}

    def raw(self, log: str, spec: object = None) -> dict[str, str]:
        """What SWE-bench's function (or ours) returns: {test id: status word}."""
        if self.family == UNITTEST:
            return {test: status.value for test, status in testlogs.parse_unittest_log(log).items()}
        if self.function is not None:
            try:
                found = _call(self.function, log, spec)
                if isinstance(found, dict):
                    return {str(k): str(v) for k, v in found.items()}
            except Exception:  # noqa: BLE001 - a line SWE-bench's function chokes on (a lone "FAILED"): ours
                pass
        builtin = BUILTIN.get(self.family)
        return builtin(log) if builtin else {}

    def junit_name(self, name: str) -> str:
        """A junit testcase name as this parser writes the same test's id (pylint's path options shortened,
        matplotlib's MouseButton as numbers)."""
        if self.family == "parse_log_pytest_options":
            return testlogs.shorten_path_option(name)
        if self.family == "parse_log_matplotlib":
            return testlogs.mouse_buttons(name)
        return name


def choose_parser(log_parser: object, repo: str, test_cmd: str, *, use_swebench: bool = True) -> LogParser:
    """The parser for a run (see the module's docstring); `use_swebench=False`: ours only."""
    module = swebench_module() if use_swebench else None
    if isinstance(log_parser, str) and log_parser.strip():
        if found := _named(log_parser.strip(), module, "catalog"):
            return found
    by_repo = getattr(module, "MAP_REPO_TO_PARSER_PY", {}).get(repo) if module else None
    if callable(by_repo):
        return LogParser(by_repo.__name__, _family(by_repo.__name__), "swebench", "repository", by_repo)
    if repo in REPO_PARSERS:
        return _named(REPO_PARSERS[repo], module, "repository")
    return _named(command_parser(test_cmd), module, "command")


def command_parser(test_cmd: str) -> str:
    """The parser a command's output calls for, where neither catalog nor repository names one."""
    words = test_cmd.split()
    if "pytest" in words or "py.test" in words:
        return "parse_log_pytest"
    if any(w == "bin/test" or w.endswith("/bin/test") for w in words):
        return "parse_log_sympy"
    if any(w == "runtests.py" or w.endswith("/runtests.py") for w in words):
        return "parse_log_django"
    return UNITTEST


def runs_pytest(test_cmd: str, parser: LogParser) -> bool:
    """The run's statuses are pytest's and junit can check them: the parser reads pytest's output and the
    command runs pytest, itself or through tox (`tox ... --`: what follows `--` reaches pytest, as
    sphinx's tox.ini passes {posargs})."""
    if not parser.pytest_format:
        return False
    words = test_cmd.split()
    if "pytest" in words or "py.test" in words:
        return True
    return bool(words) and words[-1] == "--" and any(w == "tox" or w.endswith("/tox") for w in words)


def swebench_module() -> types.ModuleType | None:
    """SWE-bench's log_parsers/python.py, or None without swebench (loaded once)."""
    from image_builder.build.swebench_catalog import log_parser_module
    return log_parser_module()


def spec_for(task: object) -> types.SimpleNamespace:
    """What SWE-bench's parsers take as `test_spec` (4.x's Python parsers read none of it)."""
    return types.SimpleNamespace(instance_id=getattr(task, "task_id", ""), repo=getattr(task, "repo", ""),
                                 version=getattr(task, "version", ""), language="py")


def _named(name: str, module: types.ModuleType | None, chosen_by: str) -> LogParser | None:
    if name == UNITTEST:
        return LogParser(UNITTEST, UNITTEST, "builtin", chosen_by)
    function = getattr(module, name, None) if module is not None and name.startswith("parse_log_") else None
    if callable(function):
        return LogParser(name, _family(function.__name__), "swebench", chosen_by, function)
    family = ALIASES.get(name, name)
    if family in BUILTIN:
        return LogParser(name, family, "builtin", chosen_by)
    return None


def _family(function_name: str) -> str:
    return ALIASES.get(function_name, function_name)


def _call(function: Callable, log: str, spec: object) -> object:
    """SWE-bench 4.x's parsers take (log, test_spec); older ones (log)."""
    try:
        takes = len(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        takes = 2
    return function(log, spec) if takes >= 2 else function(log)
