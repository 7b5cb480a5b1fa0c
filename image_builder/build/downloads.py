"""Files a repository's build downloads from its project's own site, carried into the environment instead.

SWE-bench's matplotlib specs fetch qhull's source in pre_install (`wget ... www.qhull.org`), and matplotlib's
setupext.py fetches FreeType 2.6.1 (sourceforge, savannah) while it builds, the FreeType its image tests were
drawn with. Neither host answers a cluster that reaches PyPI and Debian's mirror (nor this builder's CI), and
SWE-bench's base image has the wget its pre_install calls: every matplotlib environment failed. The same
bytes are on mirrors such a cluster does reach: qhull's tarball is Debian's orig tarball (one sha256), and
FreeType's upstream .tar.bz2 lies inside Ubuntu 16.04's orig tarball. So the catalog fetches each file a
version asks for (ASKED) once, from its project's site or else a mirror, checks it against the sha256 below,
and puts it in the version environment's context (`downloads/`). swebench-repo.sh copies them into the image
(/opt/image-builder/downloads), where
- a `wget` in pre_install of a file carried copies it (a shim first on PATH for pre_install alone), and
- the tree of each is unpacked where the build looks before it downloads (matplotlib: build/freetype-2.6.1,
  build/qhull-2020.2, as its own error message asks), so neither the build nor the grader's offline
  reinstall reaches out.
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from image_builder.errors import ImageBuilderError
from image_builder.store.files import atomic_write, write_if_changed
from image_builder.store.store import remove_tree

MAX_BYTES = 64 << 20  # a source tarball; more is not one of these


class DownloadError(ImageBuilderError):
    pass


@dataclass(frozen=True)
class Source:
    url: str
    member: str = ""  # the file is this member of the tarball at url (an orig tarball holding upstream's)


@dataclass(frozen=True)
class Download:
    name: str  # the file carried (and what a wget of it asks for)
    sha256: str  # its bytes'
    tree: str  # the directory its archive holds
    unpack_into: str  # where in the checkout the build looks for the tree before downloading ("": nowhere)
    # Where a version asks for it: ("pre_install", pattern) in its spec's pre_install, or (path, pattern) in
    # that file of the checkout at its setup commit.
    asked_by: tuple[tuple[str, str], ...]
    sources: tuple[Source, ...]  # the project's own first, then mirrors


QHULL = Download(
    "qhull-2020-src-8.0.2.tgz", "b5c2d7eb833278881b952c8a52d20179eab87766b00b865000469a45c1838b7e",
    "qhull-2020.2", "build",
    (("pre_install", r"qhull-2020-src-8\.0\.2\.tgz"), ("setupext.py", r"LOCAL_QHULL_VERSION\s*=\s*['\"]2020\.2['\"]")),
    (Source("http://www.qhull.org/download/qhull-2020-src-8.0.2.tgz"),
     Source("http://deb.debian.org/debian/pool/main/q/qhull/qhull_2020.2.orig.tar.gz")))
FREETYPE = Download(
    "freetype-2.6.1.tar.bz2", "2f6e9a7de3ae8e85bdd2fe237e27d868d3ba7a27495e65906455c27722dd1a17",
    "freetype-2.6.1", "build",
    (("setupext.py", r"FREETYPE\w*\s*=\s*['\"]2\.6\.1['\"]"),),
    (Source("https://downloads.sourceforge.net/project/freetype/freetype2/2.6.1/freetype-2.6.1.tar.bz2"),
     Source("https://download.savannah.gnu.org/releases/freetype/freetype-old/freetype-2.6.1.tar.bz2"),
     Source("http://archive.ubuntu.com/ubuntu/pool/main/f/freetype/freetype_2.6.1.orig.tar.gz",
            "freetype-2.6.1/freetype-2.6.1.tar.bz2")))
KNOWN = (QHULL, FREETYPE)
UNPACK = "UNPACK"  # in the downloads directory: one "FILE INTO TREE" line per file to unpack in the checkout


SHA256 = re.compile(r"^[0-9a-f]{64}$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def from_specs(entry: object) -> Download:
    """A download a specs file names for a repository (asked by each of its versions), or ValueError saying
    what is wrong:

        {name: qhull-2020-src-8.0.2.tgz, sha256: b5c2..., urls: [URL, ...], tree: qhull-2020.2,
         unpack_into: build}

    `urls` in order of trying; an item may be {url: URL, member: PATH}: the file is that member of the tarball
    there. `tree` and `unpack_into` (optional, together): unpack it there in the checkout before installing."""
    if not isinstance(entry, dict):
        raise ValueError("a download is a mapping with name, sha256 and urls")
    unknown = sorted(set(entry) - {"name", "sha256", "urls", "tree", "unpack_into"})
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (name, sha256, urls, tree, unpack_into)")
    name, sha256, urls = entry.get("name"), entry.get("sha256"), entry.get("urls")
    tree, into = entry.get("tree", ""), entry.get("unpack_into", "")
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError("name must be a file name (letters, digits and . _ + -)")
    if not isinstance(sha256, str) or not SHA256.match(sha256):
        raise ValueError("sha256 must be 64 lowercase hex digits")
    if not isinstance(urls, list) or not urls:
        raise ValueError("urls must be a list of URLs (or {url, member} mappings)")
    sources = []
    for item in urls:
        url, member = (item, "") if isinstance(item, str) else \
            (item.get("url"), item.get("member", "")) if isinstance(item, dict) else (None, "")
        if not isinstance(url, str) or not re.match(r"^https?://\S+$", url) or not isinstance(member, str):
            raise ValueError(f"{item!r} is not an http(s) URL or {{url, member}}")
        sources.append(Source(url, member))
    if bool(tree) != bool(into) or not all(isinstance(x, str) and (not x or NAME.match(x)) for x in (tree, into)):
        raise ValueError("tree and unpack_into go together, each a directory name")
    return Download(name, sha256, tree, into, (), tuple(sources))


def asked(pre_install: tuple[str, ...], show: Callable[[str], str | None],
          known: tuple[Download, ...] = KNOWN) -> list[Download]:
    """The downloads a version's build asks for: `show(path)` reads a file of its checkout (None: absent)."""
    text = "\n".join(pre_install)
    found = []
    for download in known:
        for where, pattern in download.asked_by:
            within = text if where == "pre_install" else show(where)
            if within is not None and re.search(pattern, within):
                found.append(download)
                break
    return found


def fetch(download: Download, cache: Path, timeout: float = 60.0) -> Path:
    """`cache/<name>`, fetched from the first source that answers with the right bytes (kept: asked again,
    nothing is fetched)."""
    dest = cache / download.name
    if dest.is_file() and _sha256(dest.read_bytes()) == download.sha256:
        return dest
    import requests
    tried = []
    for source in download.sources:
        try:
            # A host behind a firewall that drops rather than refuses would hold every catalog run a minute.
            r = requests.get(source.url, timeout=(10, timeout), stream=True)
            r.raise_for_status()
            data = r.raw.read(MAX_BYTES + 1, decode_content=True)
            if len(data) > MAX_BYTES:
                raise DownloadError(f"more than {MAX_BYTES >> 20} MB")
            if source.member:
                data = _member(data, source.member)
        except (requests.RequestException, OSError, tarfile.TarError, DownloadError) as e:
            tried.append(f"{source.url} ({type(e).__name__}: {str(e)[:100]})")
            continue
        if _sha256(data) != download.sha256:
            tried.append(f"{source.url} (sha256 {_sha256(data)[:16]}..., not {download.sha256[:16]}...)")
            continue
        cache.mkdir(parents=True, exist_ok=True)
        atomic_write(dest, lambda f: f.write(data))
        return dest
    raise DownloadError(f"{download.name}, which the build downloads, could not be had from any of: "
                        f"{'; '.join(tried)}; put it (sha256 {download.sha256}) at {dest} and generate again")


def carry(downloads: list[Download], cache: Path, context: Path) -> None:
    """Put `downloads` (fetched into `cache`) and their UNPACK list into `context` (an environment's
    `downloads/`), only what changed rewritten (a rerun keeps the build key); none: no directory."""
    if not downloads:
        remove_tree(context)
        return
    context.mkdir(parents=True, exist_ok=True)
    for download in downloads:
        write_if_changed(context / download.name, fetch(download, cache).read_bytes())
    write_if_changed(context / UNPACK, "".join(f"{d.name} {d.unpack_into} {d.tree}\n" for d in downloads
                                               if d.unpack_into))
    kept = {d.name for d in downloads} | {UNPACK}
    for f in context.iterdir():
        if f.name not in kept:
            f.unlink()


def _member(data: bytes, member: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        f = tar.extractfile(member)
        if f is None:
            raise DownloadError(f"{member} is not a file in it")
        return f.read(MAX_BYTES)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
