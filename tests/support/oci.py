"""Assemble OCI images from tar layers and push them over the registry's HTTP API."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass

import requests
import zstandard

OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One tar member: a file (data), a dir, a symlink/hardlink (link) or a char device."""
    name: str
    data: bytes = b""
    kind: str = "file"  # file | dir | symlink | hardlink | chr
    link: str = ""
    mode: int = 0o644
    mtime: int = 1_700_000_000


def tar_bytes(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.mode, info.mtime = e.mode, e.mtime
            kinds = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                     "hardlink": tarfile.LNKTYPE, "chr": tarfile.CHRTYPE}
            info.type = kinds[e.kind]
            info.linkname = e.link
            if e.kind == "file":
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def compress(raw: bytes, how: str) -> tuple[bytes, str]:
    """(blob, media type suffix); zstd is written as several frames, like zstd:chunked."""
    if how == "gzip":
        return gzip.compress(raw, mtime=0), "+gzip"
    if how == "zstd":
        cctx = zstandard.ZstdCompressor()
        half = len(raw) // 2
        return cctx.compress(raw[:half]) + cctx.compress(raw[half:]), "+zstd"
    if how == "none":
        return raw, ""
    raise ValueError(how)


@dataclass(frozen=True)
class Blob:
    data: bytes
    media_type: str

    @property
    def digest(self) -> str:
        return sha256(self.data)

    def descriptor(self, **extra) -> dict:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data), **extra}


def layer(entries: list[Entry], how: str = "gzip", docker: bool = False) -> Blob:
    data, suffix = compress(tar_bytes(entries), how)
    return Blob(data, DOCKER_LAYER if docker else OCI_LAYER + suffix)


def config_blob(arch: str = "amd64", env: list[str] | None = None, docker: bool = False, layers: int = 1) -> Blob:
    doc = {"architecture": arch, "os": "linux",
           "config": {"Env": env or ["PATH=/usr/local/bin:/usr/bin:/bin"]},
           "rootfs": {"type": "layers", "diff_ids": []},
           "history": [{"created": "2023-11-14T22:13:20Z", "created_by": f"layer {i}"} for i in range(layers)]}
    return Blob(json.dumps(doc, sort_keys=True).encode(), DOCKER_CONFIG if docker else OCI_CONFIG)


def manifest(config: Blob, layers: list[Blob], docker: bool = False) -> Blob:
    doc = {"schemaVersion": 2, "mediaType": DOCKER_MANIFEST if docker else OCI_MANIFEST,
           "config": config.descriptor(), "layers": [b.descriptor() for b in layers]}
    return Blob(json.dumps(doc).encode(), doc["mediaType"])


def index(entries: list[tuple[Blob, dict | None, dict | None]], docker: bool = False) -> Blob:
    """entries: (manifest, platform, annotations)."""
    manifests = []
    for m, plat, ann in entries:
        d = m.descriptor()
        if plat:
            d["platform"] = plat
        if ann:
            d["annotations"] = ann
        manifests.append(d)
    mt = DOCKER_LIST if docker else OCI_INDEX
    return Blob(json.dumps({"schemaVersion": 2, "mediaType": mt, "manifests": manifests}).encode(), mt)


class Pusher:
    def __init__(self, base_url: str, ca: str):
        self.base, self.verify = base_url, ca

    def blob(self, repo: str, blob: Blob) -> None:
        head = requests.head(f"{self.base}/v2/{repo}/blobs/{blob.digest}", verify=self.verify)
        if head.status_code == 200:
            return
        r = requests.post(f"{self.base}/v2/{repo}/blobs/uploads/", verify=self.verify)
        r.raise_for_status()
        loc = r.headers["Location"]
        url = loc if loc.startswith("http") else self.base + loc
        r = requests.put(url, params={"digest": blob.digest}, data=blob.data, verify=self.verify,
                         headers={"Content-Type": "application/octet-stream"})
        r.raise_for_status()

    def manifest(self, repo: str, ref: str, m: Blob) -> str:
        r = requests.put(f"{self.base}/v2/{repo}/manifests/{ref}", data=m.data, verify=self.verify,
                         headers={"Content-Type": m.media_type})
        r.raise_for_status()
        return m.digest

    def image(self, repo: str, tag: str, config: Blob, layers: list[Blob], docker: bool = False) -> Blob:
        for b in [*layers, config]:
            self.blob(repo, b)
        m = manifest(config, layers, docker)
        self.manifest(repo, tag, m)
        return m
