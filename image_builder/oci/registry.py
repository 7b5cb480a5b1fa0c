"""An OCI distribution client on requests: manifests and blobs, auth, retries.

Every blob is verified against its digest while it streams in and lands in the
content-addressed cache (`cache.BlobCache`) only once verified. Faults that a
retry can cure (connection drops, 5xx, 429) are retried with exponential
backoff, honouring `Retry-After`; a broken download resumes with `Range` from
where it stopped.
"""

from __future__ import annotations

import email.utils
import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode, urljoin, urlsplit

import requests
import tenacity
import urllib3

from image_builder.errors import ImageBuilderError
from image_builder.progress import NullProgress, Progress
from . import auth
from .cache import BlobCache, DigestMismatch
from .manifest import ACCEPT, media_type_of
from .reference import Reference

CHUNK = 1 << 20
MAX_REDIRECTS = 5


class RegistryError(ImageBuilderError):
    """A registry answered in a way no retry will fix (404, refused auth, ...)."""


class TransientError(ImageBuilderError):
    """A fault worth retrying; `retry_after` is the server's requested wait, if any."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class RegistryOptions:
    ca_cert: Path | None = None  # private CA, trusted in addition to the system bundle
    plain_http: frozenset[str] = frozenset()  # hosts reached over http://, only when asked
    insecure_tls: frozenset[str] = frozenset()  # hosts whose certificate is not verified
    attempts: int = 6
    backoff: float = 0.5  # first wait; doubles per attempt up to max_backoff
    max_backoff: float = 30.0
    max_retry_after: float = 60.0
    timeout: float = 60.0
    jobs: int = 4
    bundle_dir: Path | None = field(default=None, compare=False)  # where the merged CA bundle is written


def _retry_after(resp: requests.Response) -> float | None:
    value = resp.headers.get("Retry-After")
    if not value:
        return None
    if value.strip().isdigit():
        return float(value)
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _merged_bundle(ca_cert: Path, where: Path) -> str:
    """System CAs plus the private one, so redirects to public CDNs still verify."""
    system = os.environ.get("REQUESTS_CA_BUNDLE") or requests.certs.where()
    try:
        data = Path(system).read_bytes() + b"\n" + Path(ca_cert).read_bytes()
    except OSError as e:
        raise RegistryError(f"cannot read CA certificate {ca_cert}: {e.strerror}") from e
    where.mkdir(parents=True, exist_ok=True)
    dest = where / f"ca-{hashlib.sha256(data).hexdigest()[:16]}.pem"
    if not dest.exists():
        # Per thread too: environments built at once (-j) each open a transport with the same CA.
        tmp = dest.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
    return str(dest)


class Transport:
    """HTTP with explicit redirects, TLS settings per host and retry policy."""

    def __init__(self, options: RegistryOptions = RegistryOptions()):
        self.options = options
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=max(8, 2 * options.jobs))
        self.session.mount("https://", adapter)
        self.session.mount("http://", adapter)
        if options.insecure_tls:  # asked for explicitly: no warning on every request
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        self._bundle = (
            _merged_bundle(options.ca_cert, options.bundle_dir or Path.home() / ".cache" / "image_builder")
            if options.ca_cert else None
        )

    def base_url(self, host: str) -> str:
        return f"{'http' if host in self.options.plain_http else 'https'}://{host}"

    def _verify(self, url: str) -> bool | str:
        host = urlsplit(url).netloc
        if host in self.options.insecure_tls:
            return False
        # Passed on every request: requests would otherwise let REQUESTS_CA_BUNDLE override it.
        return self._bundle or os.environ.get("REQUESTS_CA_BUNDLE") or True

    def send(self, method: str, url: str, *, headers: dict | None = None, stream: bool = False,
             authorization: str | None = None) -> requests.Response:
        """One request, following redirects by hand so credentials never leave the first host."""
        origin = urlsplit(url).netloc
        for _ in range(MAX_REDIRECTS + 1):
            h = dict(headers or {})
            if authorization and urlsplit(url).netloc == origin:
                h["Authorization"] = authorization
            try:
                resp = self.session.request(method, url, headers=h, stream=stream, allow_redirects=False,
                                            verify=self._verify(url), timeout=self.options.timeout)
            except requests.exceptions.SSLError as e:
                raise RegistryError(f"TLS error for {urlsplit(url).netloc}: {e}; "
                                    "pass --ca-cert for a private CA") from e
            except (requests.ConnectionError, requests.Timeout) as e:
                raise TransientError(f"{method} {url}: {e.__class__.__name__}: {e}") from e
            if resp.status_code in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                url = urljoin(url, resp.headers["Location"])
                resp.close()
                continue
            if resp.status_code == 429 or resp.status_code >= 500:
                resp.close()
                raise TransientError(f"{method} {url}: HTTP {resp.status_code}", _retry_after(resp))
            return resp
        raise RegistryError(f"{method} {url}: more than {MAX_REDIRECTS} redirects")

    def _wait(self, state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        backoff = min(self.options.max_backoff, self.options.backoff * 2 ** (state.attempt_number - 1))
        server = getattr(exc, "retry_after", None)
        return min(self.options.max_retry_after, server) if server is not None else backoff

    def retrying(self) -> tenacity.Retrying:
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientError),
            wait=self._wait,
            stop=tenacity.stop_after_attempt(self.options.attempts),
            reraise=True,
        )

    def fetch_blob(self, url: str, digest: str, size: int | None, cache: BlobCache, *,
                   send: Callable[..., requests.Response] | None = None,
                   progress: Progress = NullProgress(), label: str = "") -> Path:
        """Download `url` into the cache as `digest`, verified, resuming after faults.

        Holds the blob's lock, so concurrent pulls of the same blob download it once.
        A digest mismatch is retried once from scratch, then reported.
        """
        send = send or self.send
        if cache.has(digest):
            progress.finish(digest, "cached", size or 0)
            return cache.path(digest)
        with cache.lock(digest):
            if cache.has(digest):  # another process fetched it while we waited
                progress.finish(digest, "cached", size or 0)
                return cache.path(digest)
            partial = cache.partial(digest)
            progress.start(digest, size, label or digest[7:19])
            for round_ in (1, 2):
                try:
                    actual = self._fetch_resumable(url, partial, size, send, progress, digest)
                except TransientError as e:
                    raise RegistryError(f"{label or digest}: download failed after "
                                        f"{self.options.attempts} attempts: {e}") from e
                if actual == digest:
                    progress.finish(digest, "done", size or partial.stat().st_size)
                    return cache.commit(digest, partial)
                partial.unlink(missing_ok=True)
                progress.restart(digest)
                if round_ == 2:
                    raise RegistryError(f"{label or digest}: {DigestMismatch(digest, actual)} "
                                        "(twice); the registry serves corrupt data")
        raise AssertionError("unreachable")

    def _fetch_resumable(self, url: str, partial: Path, size: int | None,
                         send: Callable[..., requests.Response], progress: Progress, key: str) -> str:
        hasher = hashlib.sha256()
        have = 0
        if partial.exists():  # a previous run was cut off: rehash what it kept, then resume
            if size is not None and partial.stat().st_size > size:
                partial.unlink()
            else:
                with open(partial, "rb") as f:
                    while chunk := f.read(CHUNK):
                        hasher.update(chunk)
                        have += len(chunk)
                progress.advance(key, have)
        for attempt in self.retrying():
            with attempt:
                headers = {"Range": f"bytes={have}-"} if have else {}
                resp = send("GET", url, headers=headers, stream=True)
                with resp:
                    if resp.status_code == 200 and have:  # Range ignored: start over
                        hasher, have = hashlib.sha256(), 0
                        progress.restart(key)
                    elif resp.status_code == 416 and size is not None and have == size:
                        break  # the partial file already holds everything
                    elif resp.status_code not in (200, 206):
                        raise RegistryError(f"GET {url}: HTTP {resp.status_code} {resp.reason}")
                    with open(partial, "ab" if have else "wb") as f:
                        try:
                            while chunk := resp.raw.read(CHUNK, decode_content=False):
                                f.write(chunk)
                                hasher.update(chunk)
                                have += len(chunk)
                                progress.advance(key, len(chunk))
                        except (urllib3.exceptions.HTTPError, requests.RequestException, OSError) as e:
                            raise TransientError(f"download cut off at byte {have}: {e}") from e
                if size is not None and have < size:
                    raise TransientError(f"download cut off at byte {have} of {size}")
        return "sha256:" + hasher.hexdigest()


class RegistryClient:
    """One repository on one registry, with its authentication state."""

    def __init__(self, ref: Reference, transport: Transport):
        self.ref = ref
        self.transport = transport
        self.base = f"{transport.base_url(ref.api_host)}/v2/{ref.repository}"
        self.credentials = auth.load_credentials(ref.registry)
        self._authorization: str | None = None
        self._auth_lock = threading.Lock()
        self.tokens_fetched = 0

    def send(self, method: str, url: str, *, headers: dict | None = None, stream: bool = False) -> requests.Response:
        """A request with authentication: answers a 401 challenge, also when a token expires mid-pull."""
        used = self._authorization
        resp = self.transport.send(method, url, headers=headers, stream=stream, authorization=used)
        if resp.status_code != 401:
            return resp
        challenge = auth.parse_challenge(resp.headers.get("WWW-Authenticate", ""))
        resp.close()
        with self._auth_lock:
            if self._authorization == used:  # not yet renewed by another thread
                self._authorization = self._authenticate(challenge)
        resp = self.transport.send(method, url, headers=headers, stream=stream, authorization=self._authorization)
        if resp.status_code == 401:
            resp.close()
            who = f"as {self.credentials.username!r}" if self.credentials else "anonymously"
            raise RegistryError(f"{self.ref.registry}: access to {self.ref.repository} denied {who}; "
                                "check the credentials in ~/.docker/config.json or $REGISTRY_AUTH_FILE")
        return resp

    def _authenticate(self, challenge: auth.Challenge) -> str:
        if challenge.scheme == "basic":
            if not self.credentials:
                raise RegistryError(f"{self.ref.registry} requires a login; add it to ~/.docker/config.json "
                                    "or $REGISTRY_AUTH_FILE")
            return auth.basic_header(self.credentials)
        if challenge.scheme != "bearer" or not challenge.realm:
            raise RegistryError(f"{self.ref.registry}: unsupported authentication challenge {challenge.scheme!r}")
        scope = challenge.scope or f"repository:{self.ref.repository}:pull"
        params = {"scope": scope, **({"service": challenge.service} if challenge.service else {})}
        headers = {"Authorization": auth.basic_header(self.credentials)} if self.credentials else {}
        url = challenge.realm + ("&" if "?" in challenge.realm else "?") + urlencode(params)
        for attempt in self.transport.retrying():
            with attempt:
                resp = self.transport.send("GET", url, headers=headers)
        if resp.status_code != 200:
            raise RegistryError(f"token service {urlsplit(challenge.realm).netloc} refused {scope}: HTTP {resp.status_code}")
        try:
            body = resp.json()
            token = body.get("token") or body["access_token"]
        except (ValueError, KeyError) as e:
            raise RegistryError(f"token service {challenge.realm} returned no token") from e
        self.tokens_fetched += 1
        return f"Bearer {token}"

    def _with_retries(self, method: str, url: str, **kw) -> requests.Response:
        for attempt in self.transport.retrying():
            with attempt:
                return self.send(method, url, **kw)
        raise AssertionError("unreachable")

    def manifest_digest(self, version: str) -> str | None:
        """HEAD the manifest: its digest without counting as a pull on Docker Hub."""
        resp = self._with_retries("HEAD", f"{self.base}/manifests/{version}", headers={"Accept": ACCEPT})
        resp.close()
        if resp.status_code == 404:
            raise RegistryError(f"{self.ref}: no such image on {self.ref.registry} (HTTP 404); check the name and tag")
        return resp.headers.get("Docker-Content-Digest") if resp.status_code == 200 else None

    def get_manifest(self, version: str) -> tuple[bytes, str, str]:
        """(body, media type, digest); the digest is computed, never taken on trust."""
        resp = self._with_retries("GET", f"{self.base}/manifests/{version}", headers={"Accept": ACCEPT})
        if resp.status_code == 404:
            raise RegistryError(f"{self.ref}: no such image on {self.ref.registry} (HTTP 404); check the name and tag")
        if resp.status_code != 200:
            raise RegistryError(f"{self.ref}: manifest request failed: HTTP {resp.status_code}")
        body = resp.content
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if version.startswith("sha256:") and digest != version:
            raise RegistryError(f"{self.ref}: {DigestMismatch(version, digest, 'manifest')}")
        return body, media_type_of(body, resp.headers.get("Content-Type")), digest

    def fetch_blob(self, digest: str, size: int | None, cache: BlobCache, *,
                   progress: Progress = NullProgress(), label: str = "") -> Path:
        return self.transport.fetch_blob(f"{self.base}/blobs/{digest}", digest, size, cache,
                                         send=self.send, progress=progress, label=label)
