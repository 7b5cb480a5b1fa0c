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
        self.pages: dict[str, tuple[int, bytes]] = {}
        self.lock = threading.Lock()
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, body = index.page(self.path)
                self.send_response(status)
                self.send_header("Content-Type", "text/html; charset=utf-8")
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

    def page(self, path: str) -> tuple[int, bytes]:
        m = re.fullmatch(r"/simple/([A-Za-z0-9._-]+)/?", path.split("?", 1)[0])
        if not m:
            return 404, b"not a project page\n"
        name = normalized(m[1])
        with self.lock:
            known = self.pages.get(name)
        if known is None:
            known = self._fetch(name)
            if known[0] != 502:  # an upstream failure is asked again, not kept
                with self.lock:
                    self.pages[name] = known
        return known

    def _fetch(self, name: str) -> tuple[int, bytes]:
        import requests

        try:
            r = self.session.get(f"{self.upstream}/{name}/", headers={"Accept": ACCEPT}, timeout=60)
            if r.status_code == 404:
                return 404, b"no such project\n"
            r.raise_for_status()
            files = r.json().get("files", [])
        except (requests.RequestException, ValueError) as e:
            return 502, f"the index {self.upstream} failed: {type(e).__name__}\n".encode()
        links = [self._link(f, r.url) for f in files if isinstance(f, dict) and self._kept(f)]
        body = "<!DOCTYPE html>\n<html><body>\n" + "".join(link for link in links if link) + "</body></html>\n"
        return 200, body.encode()

    def _kept(self, f: dict) -> bool:
        """Uploaded before the cut-off; a file with no upload time is kept (a mirror that records none)."""
        when = f.get("upload-time")
        if not isinstance(when, str):
            return True
        try:
            return parse_time(when) < self.cutoff
        except ValueError:
            return True

    @staticmethod
    def _link(f: dict, base: str) -> str:
        from urllib.parse import urljoin

        filename, url = f.get("filename"), f.get("url")
        if not isinstance(filename, str) or not isinstance(url, str):
            return ""
        url = urljoin(base, url)  # absolute: pip downloads from the index's own file host
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
        return f"<a {' '.join(attrs)}>{html.escape(filename)}</a><br>\n"
