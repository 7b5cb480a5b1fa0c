"""Small HTTPS servers around the real registry.

- TokenIssuer: the token service a registry with `auth: token` sends clients
  to; it signs RS256 JWTs the registry verifies against our certificate.
- FaultProxy: sits in front of a real registry and injects the faults a real
  server will not produce on demand (503 storms, 429 with Retry-After, bodies
  cut off mid-layer, corrupted bytes, redirects to another host). It also
  serves plain files, for rootfs-tarball bases.
- LOCALHOST_SERVER: a script that serves and fetches on `localhost` in a sandbox.
"""

from __future__ import annotations

import base64
import json
import re
import ssl
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding

from image_builder.devtools.localregistry import CertPair

FORWARDED_REQUEST_HEADERS = ("Authorization", "Range", "Accept")
FORWARDED_RESPONSE_HEADERS = ("Content-Type", "Content-Length", "Content-Range", "Docker-Content-Digest",
                              "WWW-Authenticate", "Accept-Ranges", "Retry-After")


# A server on `localhost` and a client of it, as test suites start them (sphinx's intersphinx tests, Django's live
# servers), run inside a sandbox: prints 200 where the name resolves (runtime/native/init.c default_hosts).
LOCALHOST_SERVER = """
import http.server, threading, urllib.request
class Quiet(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("localhost", 0), Quiet)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(urllib.request.urlopen("http://localhost:%d/" % server.server_address[1]).status)
"""


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def serve_tls(handler: type[BaseHTTPRequestHandler], cert: CertPair, owner) -> _Server:
    server = _Server(("127.0.0.1", 0), handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert.cert, cert.key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.owner = owner
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class _Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenIssuer:
    """Docker token auth: GET /token?service=S&scope=repository:NAME:pull."""
    signing: CertPair  # the key tokens are signed with; the registry trusts its certificate
    tls: CertPair  # the HTTPS certificate of the token service
    service: str = "image-builder-test"
    issuer: str = "image-builder-test-issuer"
    users: dict[str, str] = field(default_factory=dict)  # empty: anonymous pulls allowed
    lifetime: float = 300.0  # seconds a token is accepted by the registry
    requests: list[dict] = field(default_factory=list)

    def start(self) -> TokenIssuer:
        self._key = serialization.load_pem_private_key(self.signing.key.read_bytes(), None)
        cert = x509.load_pem_x509_certificate(self.signing.cert.read_bytes())
        self._x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self.server = serve_tls(_TokenHandler, self.tls, self)
        return self

    @property
    def realm(self) -> str:
        return f"https://127.0.0.1:{self.server.server_address[1]}/token"

    def sign(self, subject: str, scope: str) -> str:
        actions = []
        m = re.fullmatch(r"repository:([^:]+):([\w,]+)", scope)
        if m:
            actions = [{"type": "repository", "name": m.group(1), "actions": m.group(2).split(",")}]
        now = int(time.time())
        # distribution accepts tokens up to 60 s past exp; shift exp so `lifetime` is the real validity.
        claims = {"iss": self.issuer, "sub": subject, "aud": self.service, "iat": now, "nbf": now - 1,
                  "exp": now + int(self.lifetime) - 60, "jti": uuid.uuid4().hex, "access": actions}
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self._x5c]}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = self._key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64url(sig)}"

    def stop(self):
        self.server.shutdown()


class _TokenHandler(_Quiet):
    def do_GET(self):
        issuer: TokenIssuer = self.server.owner
        q = parse_qs(urlsplit(self.path).query)
        scope = q.get("scope", [""])[0]
        user = ""
        header = self.headers.get("Authorization", "")
        if header.startswith("Basic "):
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
            if issuer.users.get(user) != password:
                return self._send(401, {"errors": [{"message": "bad credentials"}]})
        elif issuer.users:
            return self._send(401, {"errors": [{"message": "login required"}]})
        issuer.requests.append({"scope": scope, "service": q.get("service", [""])[0], "user": user})
        self._send(200, {"token": issuer.sign(user, scope), "expires_in": int(issuer.lifetime)})

    def _send(self, status: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@dataclass
class Fault:
    """What to do to the next `times` requests whose path matches `match`."""
    match: str
    kind: str  # status | truncate | corrupt | redirect | delay
    times: int = 1  # -1: every matching request
    status: int = 503
    headers: dict = field(default_factory=dict)
    delay: float = 0.0


@dataclass
class Seen:
    method: str
    path: str
    headers: dict
    fault: str = ""


@dataclass
class FaultProxy:
    upstream: str  # https://127.0.0.1:PORT of a real registry
    cert: CertPair
    direct: str = ""  # where redirected requests are served from (an open registry)
    faults: list[Fault] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)  # served at /files/NAME

    def start(self) -> FaultProxy:
        self.server = serve_tls(_ProxyHandler, self.cert, self)
        self._lock = threading.Lock()
        return self

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def take_fault(self, path: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.times != 0 and re.search(f.match, path):
                    if f.times > 0:
                        f.times -= 1
                    return f
        return None

    def requests_to(self, pattern: str, method: str | None = None) -> list[Seen]:
        return [s for s in self.seen if re.search(pattern, s.path) and (method is None or s.method == method)]

    def stop(self):
        self.server.shutdown()


class _ProxyHandler(_Quiet):
    def do_HEAD(self):
        self._handle("HEAD")

    def do_GET(self):
        self._handle("GET")

    def _handle(self, method: str):
        proxy: FaultProxy = self.server.owner
        fault = None if self.path.startswith(("/direct/", "/files/")) else proxy.take_fault(self.path)
        proxy.seen.append(Seen(method, self.path, dict(self.headers), fault.kind if fault else ""))
        if self.path.startswith("/files/"):
            return self._send_file(proxy.files.get(self.path[7:]), method)
        if fault and fault.kind == "status":
            self.send_response(fault.status)
            for k, v in fault.headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if fault and fault.kind == "redirect":
            self.send_response(307)
            self.send_header("Location", f"https://localhost:{proxy.port}/direct{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if fault and fault.kind == "delay":
            time.sleep(fault.delay)
        upstream, path = proxy.upstream, self.path
        if path.startswith("/direct/"):
            upstream, path = proxy.direct, path[len("/direct"):]
        headers = {k: self.headers[k] for k in FORWARDED_REQUEST_HEADERS if k in self.headers}
        resp = requests.request(method, upstream + path, headers=headers, stream=True,
                                verify=str(proxy.cert.cert), allow_redirects=False)
        with resp:
            body = b"" if method == "HEAD" else resp.raw.read(decode_content=False)
            self.send_response(resp.status_code)
            for k in FORWARDED_RESPONSE_HEADERS:
                if k in resp.headers and k != "Content-Length":
                    self.send_header(k, resp.headers[k])
            length = resp.headers.get("Content-Length", str(len(body))) if method == "HEAD" else str(len(body))
            self.send_header("Content-Length", length)
            self.end_headers()
        if method == "HEAD":
            return
        if fault and fault.kind == "corrupt" and body:
            mid = len(body) // 2
            body = body[:mid] + bytes([body[mid] ^ 0xFF]) + body[mid + 1:]
        if fault and fault.kind == "truncate":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def _send_file(self, data: bytes | None, method: str):
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start = 0
        rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if rng and int(rng.group(1)) < len(data):
            start = int(rng.group(1))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if method == "GET":
            self.wfile.write(data[start:])


def write_auth_file(path: Path, host: str, user: str, password: str) -> Path:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": token}}}))
    return path
