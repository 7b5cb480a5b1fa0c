"""The content-addressed blob cache shared by every pull and build.

Layout under the cache root (default `$XDG_CACHE_HOME/image_builder`):

    blobs/sha256/<hex>     verified blobs and manifests, read-only, never rewritten
    partial/<hex>          a download in progress (resumed with Range after a fault)
    locks/<hex>.lock       flock held while a blob is being fetched

Several processes may pull at once: whoever holds a blob's lock downloads it,
the others wait and then find it present. A blob only appears under `blobs/`
by rename after its digest was checked, so a reader never sees a partial one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from image_builder.errors import ImageBuilderError
from image_builder.ownership import unsafe_ancestor


class DigestMismatch(ImageBuilderError, ValueError):
    def __init__(self, expected: str, actual: str, what: str = "blob"):
        super().__init__(f"{what} digest mismatch: expected {expected}, got {actual}")
        self.expected, self.actual = expected, actual


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "image_builder"


def split_digest(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"unsupported digest {digest!r}: expected sha256:<64 hex digits>")
    return hexpart


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class UnsafeCache(ImageBuilderError):
    pass


class BlobCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root else default_cache_dir()
        for sub in ("blobs/sha256", "partial", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # A blob found under its digest's name is trusted without being hashed again: a directory of the
        # cache that another user owns or anyone may write to, or one above it they could rename it out
        # of, would let them plant the layers of an image whose digests they know (a public one's).
        # Group-writable is a team's cache, shared on purpose.
        found = unsafe_ancestor(self.root.resolve() / "blobs" / "sha256", writable=0o002, itself=True)
        if found:
            where, why = found
            raise UnsafeCache(f"blob cache {self.root}: {where} is {why}: another user could put a blob there "
                              "under a digest it would be trusted for; use a cache directory of yours others "
                              "cannot write to (--cache-dir, IMAGE_BUILDER_CACHE)")

    def path(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / split_digest(digest)

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def partial(self, digest: str) -> Path:
        return self.root / "partial" / split_digest(digest)

    @contextmanager
    def lock(self, digest: str) -> Iterator[None]:
        fd = os.open(self.root / "locks" / f"{split_digest(digest)}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def commit(self, digest: str, src: Path) -> Path:
        """Publish a file already verified to hold `digest` (rename, so atomic)."""
        dest = self.path(digest)
        os.chmod(src, 0o444)
        with open(src, "rb") as f:
            os.fsync(f.fileno())
        os.replace(src, dest)
        return dest

    def put_bytes(self, digest: str, data: bytes) -> Path:
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise DigestMismatch(digest, actual, "manifest")
        if self.has(digest):
            return self.path(digest)
        fd, tmp = tempfile.mkstemp(dir=self.root / "partial", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return self.commit(digest, Path(tmp))

    def get_bytes(self, digest: str) -> bytes | None:
        try:
            return self.path(digest).read_bytes()
        except FileNotFoundError:
            return None
