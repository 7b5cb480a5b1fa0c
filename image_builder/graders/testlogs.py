"""Test statuses from a test command's output (pytest -rA, unittest/Django) and from pytest's junit xml.

SWE-bench reads each repository's log with its own parser (MAP_REPO_TO_PARSER_PY).
The `swebench_*` readers below are ours, one for each of its families (pytest,
pytest with path options, pytest v2, django, sympy, matplotlib, seaborn), written
to the formats those parsers read so that grading needs no swebench install:
each returns what SWE-bench's function returns on the same log, a test id to a
status word (swebench_parsers.py picks the parser, and SWE-bench's own function
where swebench is installed). Where SWE-bench's function raises on a malformed
line (a lone `FAILED`), ours skips the line.

pytest: only the lines after the last "short test summary info" header count
(pytest_summary; the grader hands the parser that part of a pytest run),
so "PASSED x" lines printed by code under test earlier in the run are ignored
(the real summary comes later and wins). It is still text that code under
test can print after the summary; that is why runs also cross-check junit.

Test ids are keyed as SWE-bench's parser keys them: the first whitespace-free
token after the status word. Ids with spaces in their parameters are therefore
cut at the first space, and the datasets' FAIL_TO_PASS/PASS_TO_PASS lists hold
them cut that way (marshmallow's `test_make_error[required-Missing`). When cut
ids collide, the last summary line wins; -rA lists passes before failures.
"""

from __future__ import annotations

import enum
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable


class TestStatus(str, enum.Enum):
    __test__ = False  # a name pytest would otherwise try to collect
    PASSED = "PASSED"
    FAILED = "FAILED"
    SKIPPED = "SKIPPED"
    ERROR = "ERROR"
    XFAIL = "XFAIL"
    XPASS = "XPASS"


# The order in which `-rA` lists statuses in the short summary ("PpsxXEf").
_SUMMARY_ORDER = [TestStatus.PASSED, TestStatus.SKIPPED, TestStatus.XFAIL, TestStatus.XPASS, TestStatus.ERROR,
                  TestStatus.FAILED]
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+$")
_UNITTEST_RESULT = re.compile(
    r"^(?P<head>.*?) \.\.\. (?P<result>ok|FAIL|ERROR|skipped\b.*|expected failure|unexpected success)\s*$")
_UNITTEST_ID = re.compile(r"^(\w+ \([\w.]+\))")
_UNITTEST_REPORT = re.compile(r"^(FAIL|ERROR): (\w+ \([\w.]+\))")
_UNITTEST_STATUS = {"ok": TestStatus.PASSED, "FAIL": TestStatus.FAILED, "ERROR": TestStatus.ERROR,
                    "skipped": TestStatus.SKIPPED, "expected failure": TestStatus.XFAIL,
                    "unexpected success": TestStatus.FAILED}


def parse_pytest_log(log: str, *, summary_only: bool = True) -> dict[str, TestStatus]:
    """`STATUS id` lines of the last short test summary; `summary_only=False`: of the whole log, as
    SWE-bench's parse_log_pytest reads it (captured output of the tests included)."""
    statuses: dict[str, TestStatus] = {}
    for line in _ANSI.sub("", pytest_summary(log) if summary_only else log).splitlines():
        word, _, rest = line.partition(" ")
        if word in TestStatus.__members__ and rest.split():
            statuses[rest.split()[0]] = TestStatus[word]  # "FAILED id - message" too
    return statuses


def pytest_summary(log: str) -> str:
    """The lines after the last "short test summary info" header (its colour codes aside), as they are;
    the whole log when it has none."""
    lines = log.split("\n")
    headers = [i for i, line in enumerate(lines) if _SUMMARY_HEADER.match(_ANSI.sub("", line).strip())]
    return "\n".join(lines[headers[-1] + 1:]) if headers else log


def parse_unittest_log(log: str) -> dict[str, TestStatus]:
    """`test_x (mod.Class) ... ok` lines (Django's runner too), including a docstring
    on its own line between the id and the result, and the `FAIL: test_x (mod.Class)` reports."""
    statuses: dict[str, TestStatus] = {}
    previous = ""
    for line in _ANSI.sub("", log).splitlines():
        if result := _UNITTEST_RESULT.match(line):
            test = _UNITTEST_ID.match(result.group("head")) or _UNITTEST_ID.fullmatch(previous.strip())
            if test:
                word = "skipped" if result.group("result").startswith("skipped") else result.group("result")
                statuses[test.group(1)] = _UNITTEST_STATUS[word]
        elif report := _UNITTEST_REPORT.match(line):
            statuses[report.group(2)] = TestStatus.FAILED if report.group(1) == "FAIL" else TestStatus.ERROR
        previous = line
    return statuses


def parse_junit(xml_text: str) -> dict[tuple[str, str], TestStatus]:
    """(classname, name cut at the first space) -> status; ValueError for text that is not junit xml.
    Entries that share a key keep the status the -rA summary would list last (see _SUMMARY_ORDER)."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as exc:
        raise ValueError(f"junit xml does not parse: {exc}") from None
    statuses: dict[tuple[str, str], TestStatus] = {}
    for case in root.iter("testcase"):
        name = case.get("name", "")
        key = (case.get("classname", ""), name.split()[0] if name.split() else name)
        status = _junit_status(case)
        if key not in statuses or _SUMMARY_ORDER.index(status) > _SUMMARY_ORDER.index(statuses[key]):
            statuses[key] = status
    return statuses


_OPTION = re.compile(r"(.*?)\[(.*)\]")


def shorten_path_option(test: str) -> str:
    """A parametrized id as SWE-bench's parse_log_pytest_options writes it (pylint, requests, pydicom): an
    option that is an absolute path keeps only its last part, `test_stdin[/testbed/tests/mymodule.py-...-
    /testbed/tests/mymodule.py]` -> `test_stdin[/mymodule.py]` (so ids do not depend on where the repo is)."""
    found = _OPTION.search(test)
    if not found:
        return test
    main, option = found.groups()
    if option.startswith("/") and not option.startswith("//") and "*" not in option:
        option = "/" + option.split("/")[-1]
    return f"{main}[{option}]"


def junit_key(nodeid: str) -> tuple[str, str]:
    """The (classname, name) pytest writes to junit for a node id (pytest's mangle_test_address)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def _junit_status(case: ET.Element) -> TestStatus:
    tags = {child.tag: child for child in case}
    if "failure" in tags:
        return TestStatus.FAILED
    if "error" in tags:
        return TestStatus.ERROR
    if "skipped" in tags:
        return TestStatus.XFAIL if tags["skipped"].get("type") == "pytest.xfail" else TestStatus.SKIPPED
    return TestStatus.PASSED


# --- SWE-bench's parser families, our reading of the same formats ------------------------------------------
# Each returns {test id: status word} as SWE-bench's function of that name does (its words: PASSED, FAILED,
# SKIPPED, ERROR, XFAIL; a word glued to more text is kept as it stands, as SWE-bench keeps it).

SWEBENCH_STATUSES = ("FAILED", "PASSED", "SKIPPED", "ERROR", "XFAIL")  # SWE-bench 4.x's TestStatus: no XPASS
_ESCAPE_CODE = re.compile(r"\[\d+m")  # what pytest v2's reader takes out ("[32m"); the ESC itself goes below
_CONTROL = dict.fromkeys(range(1, 32))


def _status_words(line: str) -> list[str] | None:
    """`STATUS id ...` as a list of words (a FAILED line's " - message" dash dropped); None for other lines."""
    if not line.startswith(SWEBENCH_STATUSES):
        return None
    return (line.replace(" - ", " ") if line.startswith("FAILED") else line).split()


def swebench_pytest(log: str, key: Callable[[str], str] = str) -> dict[str, str]:
    """parse_log_pytest: every line of the log that starts with a status word, the id after it (through
    `key`); the last line naming an id wins."""
    out: dict[str, str] = {}
    for line in log.split("\n"):
        words = _status_words(line)
        if words and len(words) > 1:
            out[key(words[1])] = words[0]
    return out


def swebench_pytest_options(log: str) -> dict[str, str]:
    """parse_log_pytest_options: as parse_log_pytest, ids through shorten_path_option."""
    return swebench_pytest(log, shorten_path_option)


def swebench_matplotlib(log: str) -> dict[str, str]:
    """parse_log_matplotlib: as parse_log_pytest, with MouseButton.LEFT/RIGHT written as 1/3 (matplotlib's
    ids changed with its enum; the datasets have the numbers)."""
    return swebench_pytest(mouse_buttons(log))


def mouse_buttons(text: str) -> str:
    return text.replace("MouseButton.LEFT", "1").replace("MouseButton.RIGHT", "3")


def swebench_pytest_v2(log: str) -> dict[str, str]:
    """parse_log_pytest_v2 (astropy, scikit-learn, sphinx): colour codes and control characters out, then
    `STATUS id` lines, and also `id STATUS` lines (pytest -v without percentages), whose word after the
    first is taken as the status."""
    out: dict[str, str] = {}
    for line in log.split("\n"):
        line = _ESCAPE_CODE.sub("", line).translate(_CONTROL)
        words = _status_words(line)
        if words is not None:
            if len(words) > 1:
                out[words[1]] = words[0]
        elif line.endswith(SWEBENCH_STATUSES):
            words = line.split()
            if len(words) > 1:
                out[words[0]] = words[1]
    return out


def swebench_seaborn(log: str) -> dict[str, str]:
    """parse_log_seaborn: only passes and failures, from `FAILED id`, `id PASSED ...` and `PASSED id` lines
    (in that order of precedence: a line is read by the first form it has)."""
    out: dict[str, str] = {}
    for line in log.split("\n"):
        words = line.split()
        if line.startswith("FAILED"):
            if len(words) > 1:
                out[words[1]] = "FAILED"
        elif " PASSED " in line:
            if len(words) > 1 and words[1] == "PASSED":
                out[words[0]] = "PASSED"
        elif line.startswith("PASSED") and len(words) > 1:
            out[words[1]] = "PASSED"
    return out


def swebench_sympy(log: str) -> dict[str, str]:
    """parse_log_sympy: sympy's bin/test --verbose prints `test_name ok|F|E` per test, and a header
    `____ path.py:test_name ____` per failure or error. Headers read FAILED under `path.py:name`; the
    per-test lines then set `test_name` (the datasets' ids). `f` (expected failure), `s`, `X` are not
    read; nor is a file's last test, whose line ends in the file's [OK]/[FAIL]."""
    out: dict[str, str] = {}
    for line in log.split("\n"):
        # A header as SWE-bench's pattern finds one, anywhere in a line: from the line's first space
        # to its last, the last ".py:" between them splits path and name.
        first, last = line.find(" "), line.rfind(" ")
        cut = line.rfind(".py:", first + 1, last) if first >= 0 else -1
        if cut >= 0:
            out[f"{line[first + 1:cut]}.py:{line[cut + 4:last]}"] = "FAILED"
    for line in log.split("\n"):
        line = line.strip()
        if not line.startswith("test_"):
            continue
        for suffix, status in ((" E", "ERROR"), (" F", "FAILED"), (" ok", "PASSED")):
            if line.endswith(suffix):
                out[line.split()[0]] = status
    return out


def swebench_django(log: str) -> dict[str, str]:
    """parse_log_django: Django's runner at --verbosity 2, `label ... ok|skipped|FAIL|ERROR` lines keyed by
    the whole label before " ... ": `test_x (module.Class)` or, for a test with a docstring, the docstring's
    first line (the datasets list those). Also `FAIL:`/`ERROR:` report headers (keyed by their next word),
    an `ok` alone on a line after a test's own output (for the last label seen), and three outputs known to
    split a test's line (see _DJANGO_SPLIT)."""
    out: dict[str, str] = {}
    previous = None
    for line in log.split("\n"):
        line = line.strip()
        if "--version is equivalent to version" in line:  # a test whose docstring runs over lines
            out["--version is equivalent to version"] = "PASSED"
        if " ... " in line:
            previous = line.split(" ... ")[0]
        for suffix in (" ... ok", " ... OK", " ...  OK"):
            if line.endswith(suffix):
                if line.startswith("Applying sites.0002_alter_domain_unique...test_no_migrations"):
                    line = line.split("...", 1)[-1].strip()  # a migration's progress ran into django-7188's test
                out[line.rsplit(suffix, 1)[0]] = "PASSED"
                break
        if " ... skipped" in line:
            out[line.split(" ... skipped")[0]] = "SKIPPED"
        if line.endswith(" ... FAIL"):
            out[line.split(" ... FAIL")[0]] = "FAILED"
        if line.startswith("FAIL:") and len(line.split()) > 1:
            out[line.split()[1]] = "FAILED"
        if line.endswith(" ... ERROR"):
            out[line.split(" ... ERROR")[0]] = "ERROR"
        if line.startswith("ERROR:") and len(line.split()) > 1:
            out[line.split()[1]] = "ERROR"
        if line.startswith("ok") and previous is not None:
            out[previous] = "PASSED"
    for middle in _DJANGO_SPLIT:
        for found in re.finditer(rf"^(.*?)\s\.\.\.\s{middle}\nok$", log, re.MULTILINE):
            out[found.group(1)] = "PASSED"
    return out


# What Django's runner is known to print between a test's " ... " and its "ok" (SWE-bench's list).
_DJANGO_SPLIT = (r"Testing against Django installed in (?s:.*?) silenced\)\.",
                 r"Internal Server Error: /.*/",
                 r"System check identified no issues \(0 silenced\)")
