"""When pinned releases were uploaded, from a package index's JSON simple API (PEP 691, upload-time of PEP 700).

A SWE-bench spec pins some packages (`tox==4.16.0`) and leaves the rest to the resolver. Resolved today,
the rest is today's (docutils 0.22 dropped the `roman` module sphinx 3.x imports); SWE-bench's images were
resolved on the day they were built, after the newest release their specs pin. So the cut-off of an
environment is the day after the newest upload among its pins: the earliest day the spec could have been
written and checked. pip 26 takes it as PIP_UPLOADED_PRIOR_TO.

Answers are kept in a JSON file beside the catalog (`name==version` -> ISO time, or null when the index has
no upload time for it), so a rerun asks the index nothing it has asked before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from pathlib import Path

from image_builder.errors import ImageBuilderError
from image_builder.store.files import atomic_write

DEFAULT_INDEX = "https://pypi.org/simple"
PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*==\s*([A-Za-z0-9][A-Za-z0-9._+!-]*)\s*(?:;.*)?$")
ACCEPT = "application/vnd.pypi.simple.v1+json"


WHEEL = re.compile(r"-([^-]+-[^-]+-[^-]+)\.whl$")  # a wheel file name's PY-ABI-PLATFORM tags
RELEASE = re.compile(r"^\d+(\.\d+)*$")  # a final release; pre-releases and local versions are never chosen


class UploadDateError(ImageBuilderError):
    pass


def wheel_fits(tags: str, python: tuple[int, int], machine: str) -> bool:
    """Whether a wheel of tags `PY-ABI-PLATFORM` (its file name's end) installs on CPython `python` under Linux
    on `machine` (manylinux's glibc floor is not checked: Debian's is newer than most)."""
    py, _, rest = tags.partition("-")
    abi, _, platform = rest.partition("-")
    cp = f"cp{python[0]}{python[1]}"
    pys, abis = py.split("."), abi.split(".")
    abi3 = "abi3" in abis and any(t.startswith("cp3") and t[3:].isdigit() and int(t[3:]) <= python[1] for t in pys)
    return (abi3 or ((cp in pys or "py3" in pys or f"py{python[0]}{python[1]}" in pys)
                     and any(a in ("none", cp, cp + "m") for a in abis))) and \
        any(p == "any" or (p.startswith(("manylinux", "linux")) and p.endswith("_" + machine))
            for p in platform.split("."))


def release_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def pins(requirements: Iterable[str]) -> list[tuple[str, str]]:
    """(name, version) of each `name==version` requirement; other forms pin nothing."""
    found = []
    for requirement in requirements:
        m = PIN.match(requirement)
        if m:
            found.append((normalized(m.group(1)), m.group(2)))
    return found


def day_after(when: datetime) -> datetime:
    """Midnight UTC after `when`: a cut-off that admits everything uploaded that day."""
    return (when.astimezone(timezone.utc) + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)


def parse_time(text: str) -> datetime:
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class UploadDates:
    def __init__(self, cache: Path, index_url: str = DEFAULT_INDEX, timeout: float = 60.0):
        self.cache_path = cache
        self.index_url = index_url.rstrip("/")
        self.timeout = timeout
        try:
            self.known: dict[str, str | None] = json.loads(cache.read_text()) if cache.is_file() else {}
        except (OSError, ValueError) as e:
            raise UploadDateError(f"{cache}: unreadable ({e}); delete it to ask the index again") from None
        self._dirty = False

    def of(self, name: str, version: str) -> datetime | None:
        """The first upload of `name` `version` (its earliest file), or None where the index has no time."""
        key = f"{name}=={version}"
        if key not in self.known:
            self._ask(name)
            self.known.setdefault(key, None)  # not on the index: not asked again
        text = self.known.get(key)
        return parse_time(text) if text else None

    def _ask(self, name: str) -> None:
        import requests
        url = f"{self.index_url}/{name}/"
        try:
            r = requests.get(url, headers={"Accept": ACCEPT}, timeout=self.timeout)
            r.raise_for_status()
            files = r.json().get("files", [])
        except (requests.RequestException, ValueError) as e:
            raise UploadDateError(f"cannot read upload dates from {url} ({type(e).__name__}: {str(e)[:120]}): "
                                  "give --cutoff DATE, or --cutoff none to resolve as of today") from None
        # A file's version is what follows the project's name in it: name-VERSION-... or name-VERSION.tar.gz.
        stem = re.compile(rf"^{'[-_.]'.join(map(re.escape, name.split('-')))}-([^-]+?)(?:-|\.tar|\.zip|\.egg)", re.I)
        first: dict[str, str | None] = {}
        wheels: dict[str, set[str]] = {}
        for f in files if isinstance(files, list) else []:
            m = stem.match(str(f.get("filename", "")))
            if not m:
                continue
            when = f.get("upload-time")
            version = m.group(1)
            tags = WHEEL.search(str(f.get("filename", "")))
            wheels.setdefault(version, set()).update([tags.group(1)] if tags else [])
            if when and (first.get(version) is None or parse_time(when) < parse_time(first[version])):
                first[version] = when
            else:
                first.setdefault(version, None)
        for version, when in first.items():
            self.known[f"{name}=={version}"] = when
            self.known[f"{name}=={version} wheels"] = " ".join(sorted(wheels.get(version, ())))
        self._dirty = True

    def release_with_wheel(self, name: str, version: str, python: tuple[int, int], machine: str,
                           before: datetime | None) -> str:
        """`version`, unless the index has it only as source for CPython `python` on `machine`: then the
        nearest later release of its series (the same first two numbers: numpy 1.19.2 -> 1.19.3) uploaded
        before `before` that has a wheel, as conda's channels have binaries of releases PyPI has only as
        source; `version` where there is none."""
        name = normalized(name)
        if f"{name}=={version} wheels" not in self.known:
            self._ask(name)

        def has_wheel(release: str) -> bool:
            tags = self.known.get(f"{name}=={release} wheels") or ""
            return any(wheel_fits(t, python, machine) for t in tags.split())

        if f"{name}=={version} wheels" not in self.known or has_wheel(version) or not RELEASE.match(version):
            return version
        series = release_key(version)[:2]
        later = []
        for key, when in self.known.items():
            other = key[len(name) + 2:]
            if not key.startswith(f"{name}==") or " " in other or not RELEASE.match(other) or not when:
                continue
            if has_wheel(other) and release_key(other)[:2] == series and release_key(other) > release_key(version) \
                    and (before is None or parse_time(when) < before):
                later.append(other)
        return min(later, key=release_key) if later else version

    def newest(self, requirements: Iterable[tuple[str, str]]) -> datetime | None:
        dates = [d for d in (self.of(n, v) for n, v in requirements) if d]
        return max(dates) if dates else None

    def save(self) -> None:
        if self._dirty:
            text = json.dumps(dict(sorted(self.known.items())), indent=0)
            atomic_write(self.cache_path, lambda f: f.write(text.encode()))
            self._dirty = False
