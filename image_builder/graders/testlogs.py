"""Test statuses from a test command's output (pytest -rA, unittest/Django) and from pytest's junit xml.

pytest: only the lines after the last "short test summary info" header count,
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
    lines = _ANSI.sub("", log).splitlines()
    headers = [i for i, line in enumerate(lines) if _SUMMARY_HEADER.match(line.strip())]
    statuses: dict[str, TestStatus] = {}
    for line in lines[headers[-1] + 1 if headers and summary_only else 0:]:
        word, _, rest = line.partition(" ")
        if word in TestStatus.__members__ and rest.split():
            statuses[rest.split()[0]] = TestStatus[word]  # "FAILED id - message" too
    return statuses


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
