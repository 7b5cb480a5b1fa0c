"""A package index as of a day, for the build's pips: PIP_UPLOADED_PRIOR_TO for every pip.

pip takes a cut-off (--uploaded-prior-to) from 26.0, which runs on Python 3.9 and later; the pips of
older Pythons (21.3.1 on 3.6, 25.0.1 on 3.8: SWE-bench's django 1.x-4.0, scikit-learn 0.2x, matplotlib
3.1-3.4, astropy 1.x) take none and resolved as of the build's day. So where a build step's environment
sets PIP_UPLOADED_PRIOR_TO, the builder serves on loopback a simple index (PEP 503 HTML, which every pip
reads) made of the real index's JSON pages (PEP 691) with only the files uploaded before that time
(upload-time, PEP 700), and points the step's PIP_INDEX_URL there: every pip in the step, those of
build isolation too, resolves as of that day, as pip 26 does by itself. The files' own addresses are the
real index's (with their hashes), so downloads do not pass through here; a PIP_EXTRA_INDEX_URL is not
cut (none of SWE-bench's specs names one). What the builds install newer than the cut-off on purpose
(pip itself, conda's solver) goes to the real index, PIP_INDEX_URL_TODAY (the scripts' `today`).

The port is the kernel's choice (bound before anyone is told of it); what it serves is the public
index's metadata, which any local user could read from the index anyway.
"""

from __future__ import annotations

import html
import http.server
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from .upload_dates import ACCEPT, DEFAULT_INDEX, normalized, parse_time


@contextmanager
def cutoff_index(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """The variables a build step's pips take the cut-off index from while it runs ({} with no cut-off)."""
    cutoff, upstream = env.get("PIP_UPLOADED_PRIOR_TO"), env.get("PIP_INDEX_URL") or DEFAULT_INDEX
    if not cutoff or not upstream.startswith(("http://", "https://")):  # a file:// index: pip 26's own cut-off
        yield {}
        return
    index = CutoffIndex(upstream, parse_time(cutoff))
    try:
        yield {"PIP_INDEX_URL": index.url, "PIP_INDEX_URL_TODAY": index.upstream}
    finally:
        index.close()


class CutoffIndex:
    """A simple index on 127.0.0.1 serving `upstream`'s projects as they were before `cutoff`."""

    def __init__(self, upstream: str, cutoff: datetime):
        import requests

        self.upstream, self.cutoff = upstream.rstrip("/"), cutoff
        self.session = requests.Session()
        self.pages: dict[str, tuple[int, list]] = {}
        self.lock = threading.Lock()
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, body, kind = index.page(self.path, ACCEPT in self.headers.get("Accept", ""))
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.session.close()

    def page(self, path: str, json_api: bool) -> tuple[int, bytes, str]:
        """A project's page: PEP 691 JSON where the pip asks for it (pip 26 reads the upload times there and
        refuses an index without them), else PEP 503 HTML (pip before 22.2 reads nothing else)."""
        m = re.fullmatch(r"/simple/([A-Za-z0-9._-]+)/?", path.split("?", 1)[0])
        if not m:
            return 404, b"not a project page\n", "text/plain"
        name = normalized(m[1])
        with self.lock:
            known = self.pages.get(name)
        if known is None:
            known = self._fetch(name)
            if known[0] != 502:  # an upstream failure is asked again, not kept
                with self.lock:
                    self.pages[name] = known
        status, files = known
        if status != 200:
            return status, files[0].encode() if files else b"", "text/plain"
        if json_api:
            return 200, json.dumps({"meta": {"api-version": "1.1"}, "name": name, "files": files}).encode(), ACCEPT
        links = "".join(_link(f) for f in files)
        return 200, f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n".encode(), "text/html; charset=utf-8"

    def _fetch(self, name: str) -> tuple[int, list]:
        """The project's files uploaded before the cut-off, their URLs absolute (pip downloads from the
        index's own file host); for a failure, the status and its line."""
        import requests
        from urllib.parse import urljoin

        try:
            r = self.session.get(f"{self.upstream}/{name}/", headers={"Accept": ACCEPT}, timeout=60)
            if r.status_code == 404:
                return 404, ["no such project\n"]
            r.raise_for_status()
            files = r.json()["files"]
            if not isinstance(files, list):
                raise ValueError("files is not a list")
        except (requests.RequestException, ValueError, KeyError, TypeError) as e:
            return 502, [f"the index {self.upstream} failed: {type(e).__name__}\n"]
        return 200, [{**f, "url": urljoin(r.url, f["url"])} for f in files if isinstance(f, dict)
                     and isinstance(f.get("filename"), str) and isinstance(f.get("url"), str) and self._kept(f)]

    def _kept(self, f: dict) -> bool:
        """Uploaded before the cut-off; a file with no upload time is kept (a mirror that records none)."""
        when = f.get("upload-time")
        if not isinstance(when, str):
            return True
        try:
            return parse_time(when) < self.cutoff
        except ValueError:
            return True


def _link(f: dict) -> str:
    """A file's PEP 503 anchor, with what PEP 691 says of it that HTML can carry."""
    url = f["url"]
    hashes = f.get("hashes") if isinstance(f.get("hashes"), dict) else {}
    if isinstance(hashes.get("sha256"), str):
        url = f"{url.split('#', 1)[0]}#sha256={hashes['sha256']}"
    attrs = [f'href="{html.escape(url)}"']
    if isinstance(f.get("requires-python"), str):
        attrs.append(f'data-requires-python="{html.escape(f["requires-python"])}"')
    yanked = f.get("yanked")
    if yanked:
        attrs.append(f'data-yanked="{html.escape(yanked if isinstance(yanked, str) else "")}"')
    metadata = f.get("core-metadata", f.get("dist-info-metadata"))
    if isinstance(metadata, dict) and isinstance(metadata.get("sha256"), str):
        value = html.escape(f"sha256={metadata['sha256']}")
        attrs += [f'data-core-metadata="{value}"', f'data-dist-info-metadata="{value}"']
    return f"<a {' '.join(attrs)}>{html.escape(f['filename'])}</a><br>\n"
