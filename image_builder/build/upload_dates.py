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


class UploadDateError(ImageBuilderError):
    pass


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
        for f in files if isinstance(files, list) else []:
            m = stem.match(str(f.get("filename", "")))
            if not m:
                continue
            when = f.get("upload-time")
            version = m.group(1)
            if when and (first.get(version) is None or parse_time(when) < parse_time(first[version])):
                first[version] = when
            else:
                first.setdefault(version, None)
        for version, when in first.items():
            self.known[f"{name}=={version}"] = when
        self._dirty = True

    def newest(self, requirements: Iterable[tuple[str, str]]) -> datetime | None:
        dates = [d for d in (self.of(n, v) for n, v in requirements) if d]
        return max(dates) if dates else None

    def save(self) -> None:
        if self._dirty:
            text = json.dumps(dict(sorted(self.known.items())), indent=0)
            atomic_write(self.cache_path, lambda f: f.write(text.encode()))
            self._dirty = False
