"""A small conda channel made in the test, served over HTTP as a site's mirror would be.

Packages are written as conda's .tar.bz2 format has them (info/index.json, info/paths.json, the files) and
indexed with rattler's own indexer (repodata.json per subdir). The `python` package is the base image's
interpreter seen as a prefix: a link to /usr/bin/python3.11 beside a pyvenv.cfg, so that noarch python
packages linked into the prefix's site-packages are what that interpreter imports.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import io
import json
import tarfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

TIMESTAMP_MS = 1_600_000_000_000  # 2020-09-13: before any cut-off the tests give


def package(channel: Path, subdir: str, name: str, version: str, files: dict[str, bytes],
            links: dict[str, str] | None = None, depends: tuple[str, ...] = (), noarch: str | None = None,
            build: str = "0", timestamp_ms: int = TIMESTAMP_MS) -> Path:
    index = {"name": name, "version": version, "build": build, "build_number": 0, "depends": list(depends),
             "subdir": subdir, "timestamp": timestamp_ms, "license": "MIT", **({"noarch": noarch} if noarch else {})}
    links = links or {}
    paths = [{"_path": p, "path_type": "hardlink", "sha256": hashlib.sha256(d).hexdigest(), "size_in_bytes": len(d)}
             for p, d in files.items()] + [{"_path": p, "path_type": "softlink", "size_in_bytes": 0} for p in links]
    (channel / subdir).mkdir(parents=True, exist_ok=True)
    out = channel / subdir / f"{name}-{version}-{build}.tar.bz2"
    with tarfile.open(out, "w:bz2") as tar:
        def add(path: str, data: bytes) -> None:
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o755 if path.startswith("bin/") else 0o644
            tar.addfile(info, io.BytesIO(data))
        add("info/index.json", json.dumps(index).encode())
        add("info/paths.json", json.dumps({"paths": paths, "paths_version": 1}).encode())
        for path, data in files.items():
            add(path, data)
        for path, target in links.items():
            info = tarfile.TarInfo(path)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return out


def python_package(channel: Path, version: str = "3.11.2") -> Path:
    x_y = ".".join(version.split(".")[:2])
    cfg = f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {version}\n".encode()
    return package(channel, "linux-64", "python", version, {"pyvenv.cfg": cfg},
                   links={"bin/python": f"/usr/bin/python{x_y}", "bin/python3": "python"})


def noarch_python_package(channel: Path, name: str, version: str, module_text: str, **kw) -> Path:
    return package(channel, "noarch", name, version, {f"site-packages/{name}/__init__.py": module_text.encode()},
                   depends=("python",), noarch="python", build="py_0", **kw)


def index(channel: Path) -> None:
    """repodata.json per subdir, by rattler's indexer; each package's upload time (`indexed_timestamp`, what a
    solver's exclude_newer reads) set to its build time, as on a mirror that took it then."""
    import rattler.index
    (channel / "noarch").mkdir(parents=True, exist_ok=True)
    done = rattler.index.index_fs(channel, write_zst=False, write_shards=False)
    if asyncio.iscoroutine(done):
        asyncio.run(done)
    for repodata in channel.glob("*/repodata.json"):
        doc = json.loads(repodata.read_text())
        for records in (doc.get("packages", {}), doc.get("packages.conda", {})):
            for record in records.values():
                record["indexed_timestamp"] = record.get("timestamp", TIMESTAMP_MS)
        repodata.write_text(json.dumps(doc))


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextmanager
def served(channel: Path) -> Iterator[str]:
    """The channel's URL on a loopback HTTP server (the build sandbox shares the host's network)."""
    handler = partial(_Quiet, directory=str(channel))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
