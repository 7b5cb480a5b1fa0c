"""Pull: resolve a reference to one platform's manifest and fetch its blobs.

Manifests are cached by digest and a tag is resolved with a HEAD, so pulling
an image already in the cache sends no GET at all: no blob requests, and no
manifest GETs (which Docker Hub counts against anonymous pulls).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from image_builder.progress import NullProgress, Progress
from .cache import BlobCache
from .image import Layer, PulledImage
from .local import is_local, pull_local
from .manifest import (INDEX_TYPES, MANIFEST_TYPES, ManifestError, Platform, media_type_of, parse_manifest,
                       select_platform)
from .reference import parse as parse_reference
from .registry import RegistryClient, RegistryError, RegistryOptions, Transport


def is_tarball_url(ref: str) -> bool:
    return ref.startswith(("https://", "http://"))


def _pull_tarball(url: str, cache: BlobCache, transport: Transport, progress: Progress) -> PulledImage:
    """A plain rootfs tarball given as `https://host/rootfs.tar.zst#sha256=HEX`."""
    base, _, fragment = url.partition("#")
    if not fragment.startswith("sha256=") or len(fragment) != 71:
        raise RegistryError(f"{url}: a tarball base needs its digest, as {base}#sha256=<64 hex digits>")
    digest = "sha256:" + fragment[7:].lower()
    host = urlsplit(base).netloc
    if base.startswith("http://") and host not in transport.options.plain_http:
        raise RegistryError(f"{url}: plain HTTP is used only when asked (--plain-http {host})")
    path = transport.fetch_blob(base, digest, None, cache, progress=progress, label=Path(urlsplit(base).path).name)
    layer = Layer(digest, path.stat().st_size, "application/vnd.oci.image.layer.v1.tar", path)
    return PulledImage(base, digest, None, "", {}, (layer,))


def _manifest(client: RegistryClient, cache: BlobCache, version: str) -> tuple[bytes, str]:
    """(body, digest) from the cache when the digest is known and cached, else from the registry."""
    digest = version if version.startswith("sha256:") else client.manifest_digest(version)
    if digest and (body := cache.get_bytes(digest)) is not None:
        return body, digest
    body, _, digest = client.get_manifest(digest or version)
    cache.put_bytes(digest, body)
    return body, digest


def pull(ref: str, *, cache: BlobCache | None = None, options: RegistryOptions = RegistryOptions(),
         platform: Platform | None = None, progress: Progress = NullProgress(), layers: bool = True) -> PulledImage:
    """Fetch an image's manifest, config and layers into the cache, all verified. `layers=False`: the
    manifest and config only (the layers' paths are where the cache would keep them); disk sources are read
    whole either way."""
    cache = cache or BlobCache()
    transport = Transport(replace(options, bundle_dir=options.bundle_dir or cache.root))
    if is_tarball_url(ref):
        return _pull_tarball(ref, cache, transport, progress)
    if is_local(ref):
        return pull_local(ref, cache, platform)
    reference = parse_reference(ref)
    client = RegistryClient(reference, transport)
    platform = platform or Platform.host()

    body, digest = _manifest(client, cache, reference.version)
    index_digest = None
    media_type = media_type_of(body, None)
    if media_type in INDEX_TYPES:
        index_digest = digest
        chosen = select_platform(body, platform)
        body, digest = _manifest(client, cache, chosen.digest)
    elif media_type not in MANIFEST_TYPES:
        raise ManifestError(f"{reference}: unsupported manifest type {media_type!r}")
    manifest = parse_manifest(body)

    config_path = client.fetch_blob(manifest.config.digest, manifest.config.size, cache)
    config = json.loads(config_path.read_bytes())
    image_platform = "/".join(x for x in (config.get("os"), config.get("architecture"), config.get("variant")) if x)

    def fetch(d) -> Layer:
        path = client.fetch_blob(d.digest, d.size, cache, progress=progress, label=d.digest[7:19]) if layers \
            else cache.path(d.digest)
        return Layer(d.digest, d.size, d.media_type, path)

    with ThreadPoolExecutor(max_workers=max(1, options.jobs)) as pool:
        fetched = tuple(pool.map(fetch, manifest.layers))
    return PulledImage(str(reference), digest, index_digest, image_platform or str(platform), config, fetched)
