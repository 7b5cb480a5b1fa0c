"""A package index as PyPI's JSON simple API (PEP 691) serves it, on loopback, for tests that resolve."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path


def serve_index(pages: dict[str, list[dict]], files: Path | None = None,
                asked: list[str] | None = None) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve /simple/NAME/ (the `files` entries of `pages[NAME]`; 404 for another name, noted in `asked`)
    and /files/FILE from `files`; returns the server and the index's URL (.../simple)."""
    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            name = self.path.strip("/").rpartition("/")[2]
            if files is not None and self.path.startswith("/files/") and (files / name).is_file():
                body, kind, status = (files / name).read_bytes(), "application/octet-stream", 200
            else:
                if asked is not None:
                    asked.append(name)
                body = json.dumps({"meta": {"api-version": "1.1"}, "name": name,
                                   "files": pages.get(name, [])}).encode()
                kind, status = "application/vnd.pypi.simple.v1+json", 200 if name in pages else 404
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/simple"
