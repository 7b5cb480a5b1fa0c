"""Bases from disk, for sites without a registry (or that mirrored one with skopeo):

    oci:DIR[:TAG]             an OCI image layout: what `skopeo copy ... oci:DIR:TAG`, umoci and
                              `image-builder base debian` write
    oci-archive:FILE[:TAG]    the same layout as a tar
    docker-archive:FILE[:N]   `docker save` output (its manifest.json, image N; or the OCI layout
                              Docker 25 and later put in the same tar)
    tar:FILE                  a root filesystem tarball (.tar, .tar.gz, .tar.zst): one layer
    dir:DIR                   a root filesystem directory: one layer, packed as a tar first

The names are skopeo's transports. Every blob is copied into the blob cache and
checked against its digest on the way, as pulled blobs are: a layout on a shared
filesystem can change under a build, and the build key pins what was read. A
tarball or directory has no digest of its own: its bytes' sha256 is its digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .cache import BlobCache, DigestMismatch
from .manifest import INDEX_TYPES, MANIFEST_TYPES, ManifestError, Platform, media_type_of, parse_manifest, \
    select_platform
from .image import Layer, PulledImage
from .registry import RegistryError
from .trees import walk

SCHEMES = ("oci:", "oci-archive:", "docker-archive:", "tar:", "dir:")
REF_NAME = "org.opencontainers.image.ref.name"
PLAIN_LAYER = "application/vnd.oci.image.layer.v1.tar"
CHUNK = 1 << 20


class LocalImageError(RegistryError):
    pass


def is_local(ref: str) -> bool:
    return ref.startswith(SCHEMES)


def split(ref: str) -> tuple[str, Path, str | None]:
    """(scheme, path, tag or None) of a local reference; a tag only where the scheme takes one."""
    scheme, _, rest = ref.partition(":")
    tag = None
    if scheme in ("oci", "oci-archive", "docker-archive") and ":" in rest:
        path, _, maybe = rest.rpartition(":")
        if maybe and "/" not in maybe:
            rest, tag = path, maybe
    if not rest:
        raise LocalImageError(f"{ref}: give a path after {scheme}:")
    return scheme, Path(rest), tag


def resolve_path(ref: str, relative_to: Path) -> str:
    """The reference with its path made absolute (catalogs name paths relative to themselves)."""
    scheme, path, tag = split(ref)
    full = path if path.is_absolute() else (relative_to / path).resolve()
    return f"{scheme}:{full}" + (f":{tag}" if tag else "")


class _Source:
    """Files of a layout, in a directory or a tar."""

    def __init__(self, root: Path):
        self.root = root
        self._tar = None if root.is_dir() else tarfile.open(root)

    def _member(self, name: str) -> tarfile.TarInfo | None:
        for candidate in (name, f"./{name}"):  # tar writers differ on the leading ./
            try:
                return self._tar.getmember(candidate)
            except KeyError:
                continue
        return None

    def open(self, name: str) -> IO[bytes]:
        try:
            if self._tar is None:
                return open(self.root / name, "rb")
            member = self._member(name)
            found = self._tar.extractfile(member) if member is not None else None
            if found is None:
                raise KeyError(name)
            return found
        except (OSError, KeyError):
            raise LocalImageError(f"{self.root}: no {name} in it (not an image layout or archive?)") from None

    def has(self, name: str) -> bool:
        return (self.root / name).is_file() if self._tar is None else self._member(name) is not None

    def read(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()


def _import(cache: BlobCache, src: Callable[[], IO[bytes]], digest: str | None, label: str) -> tuple[str, Path]:
    """Copy a blob into the cache, hashing on the way: (digest, path). With `digest`, a mismatch is an
    error; without one (tarballs), the bytes' hash is the digest."""
    if digest and cache.has(digest):
        return digest, cache.path(digest)
    (cache.root / "partial").mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache.root / "partial", suffix=".local")
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, src() as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                out.write(chunk)
        actual = "sha256:" + h.hexdigest()
        if digest and actual != digest:
            raise DigestMismatch(digest, actual, label)
        cache.path(actual).parent.mkdir(parents=True, exist_ok=True)
        return actual, cache.path(actual) if cache.has(actual) else cache.commit(actual, Path(tmp))
    finally:
        Path(tmp).unlink(missing_ok=True)


def _blob_name(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise ManifestError(f"unsupported digest {digest!r}")
    return f"blobs/sha256/{hexdigest}"


def _from_layout(ref: str, source: _Source, tag: str | None, cache: BlobCache, platform: Platform) -> PulledImage:
    index = json.loads(source.read("index.json"))
    entries = index.get("manifests") or []
    if tag is not None:
        entries = [e for e in entries if (e.get("annotations") or {}).get(REF_NAME) == tag]
    if len(entries) != 1:
        tags = sorted({(e.get("annotations") or {}).get(REF_NAME, "?") for e in index.get("manifests") or []})
        raise LocalImageError(f"{ref}: {'no image tagged ' + repr(tag) if tag is not None else 'several images'} in "
                              f"{source.root}; name one of: {', '.join(tags) or 'none'} (as {ref.split(':')[0]}:"
                              f"{source.root}:TAG)")

    def blob(digest: str, label: str) -> Path:
        return _import(cache, lambda: source.open(_blob_name(digest)), digest, label)[1]

    digest = entries[0]["digest"]
    body = blob(digest, "manifest").read_bytes()
    index_digest = None
    if media_type_of(body, entries[0].get("mediaType")) in INDEX_TYPES:
        index_digest = digest
        digest = select_platform(body, platform).digest
        body = blob(digest, "manifest").read_bytes()
    elif media_type_of(body, entries[0].get("mediaType")) not in MANIFEST_TYPES:
        raise ManifestError(f"{ref}: unsupported manifest type")
    manifest = parse_manifest(body)
    config = json.loads(blob(manifest.config.digest, "config").read_bytes())
    layers = tuple(Layer(d.digest, d.size, d.media_type, blob(d.digest, f"layer {d.digest[7:19]}"))
                   for d in manifest.layers)
    image_platform = "/".join(x for x in (config.get("os"), config.get("architecture"), config.get("variant")) if x)
    return PulledImage(ref, digest, index_digest, image_platform, config, layers)


def _from_docker_archive(ref: str, source: _Source, pick: str | None, cache: BlobCache) -> PulledImage:
    """`docker save`'s manifest.json: [{Config, RepoTags, Layers}], layers as tar files in the archive. The
    image's digest is its config's (Docker's image id)."""
    images = json.loads(source.read("manifest.json"))
    try:
        entry = images[int(pick or 0)] if pick is None or pick.isdigit() else \
            next(i for i in images if pick in (i.get("RepoTags") or []))
    except (IndexError, StopIteration, TypeError):
        raise LocalImageError(f"{ref}: no image {pick!r} in {source.root}") from None
    config_digest, config_path = _import(cache, lambda: source.open(entry["Config"]), None, "config")
    layers = []
    for name in entry["Layers"]:
        digest, path = _import(cache, lambda name=name: source.open(name), None, f"layer {name}")
        layers.append(Layer(digest, path.stat().st_size, PLAIN_LAYER, path))
    config = json.loads(config_path.read_bytes())
    image_platform = "/".join(x for x in (config.get("os"), config.get("architecture")) if x)
    return PulledImage(ref, config_digest, None, image_platform, config, tuple(layers))


def _tar_of_directory(root: Path, dest: IO[bytes]) -> None:
    """A tar of a root filesystem directory in a stable order (numeric owners, modes and times kept)."""
    with tarfile.open(fileobj=dest, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in walk(root):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                path = Path(dirpath) / name
                tar.add(path, arcname=str(path.relative_to(root)), recursive=False)


def pull_local(ref: str, cache: BlobCache, platform: Platform | None = None) -> PulledImage:
    scheme, path, tag = split(ref)
    if not path.exists():
        raise LocalImageError(f"{ref}: no such {'directory' if scheme in ('oci', 'dir') else 'file'} {path}")
    platform = platform or Platform.host()
    if scheme == "dir":
        if not path.is_dir():
            raise LocalImageError(f"{ref}: {path} is not a directory")
        with tempfile.TemporaryFile(dir=cache.root) as packed:
            _tar_of_directory(path, packed)
            packed.seek(0)
            digest, blob = _import(cache, lambda: os.fdopen(os.dup(packed.fileno()), "rb"), None, "rootfs")
        return PulledImage(ref, digest, None, "", {}, (Layer(digest, blob.stat().st_size, PLAIN_LAYER, blob),))
    if scheme == "tar":
        digest, blob = _import(cache, lambda: open(path, "rb"), None, "rootfs")
        return PulledImage(ref, digest, None, "", {}, (Layer(digest, blob.stat().st_size, PLAIN_LAYER, blob),))
    if (scheme == "oci") != path.is_dir():
        raise LocalImageError(f"{ref}: {path} is {'not ' if scheme == 'oci' else ''}a directory "
                              f"({'oci:' if not path.is_dir() else 'oci-archive:'} takes "
                              f"{'a directory' if scheme != 'oci' else 'a tar'})")
    try:
        source = _Source(path)
    except tarfile.TarError as e:
        raise LocalImageError(f"{ref}: {path} is not a tar archive ({e})") from None
    try:
        if scheme == "docker-archive" and not source.has("index.json"):
            return _from_docker_archive(ref, source, tag, cache)
        return _from_layout(ref, source, None if scheme == "docker-archive" else tag, cache, platform)
    except (ValueError, KeyError, TypeError, tarfile.TarError) as e:
        raise LocalImageError(f"{ref}: not a valid image ({type(e).__name__}: {e})") from None
    finally:
        source.close()
