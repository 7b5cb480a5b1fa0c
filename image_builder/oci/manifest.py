"""Image manifests: the four formats registries serve, and platform selection."""

from __future__ import annotations

import json
import platform as host_platform
from dataclasses import dataclass

from image_builder.errors import ImageBuilderError

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
ACCEPT = ", ".join(INDEX_TYPES + MANIFEST_TYPES)

_MACHINE_TO_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64",
                    "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64",
                    "i686": "386", "i386": "386"}


class ManifestError(ImageBuilderError, ValueError):
    pass


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    @classmethod
    def parse(cls, text: str) -> Platform:
        parts = text.split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise ManifestError(f"invalid platform {text!r}: expected os/arch[/variant], e.g. linux/amd64")
        return cls(parts[0], parts[1], parts[2] if len(parts) == 3 else None)

    @classmethod
    def host(cls) -> Platform:
        machine = host_platform.machine()
        arch = _MACHINE_TO_ARCH.get(machine, machine)
        return cls("linux", arch, "v8" if arch == "arm64" else None)

    def matches(self, entry: dict) -> bool:
        p = entry.get("platform") or {}
        if p.get("os") != self.os or p.get("architecture") != self.architecture:
            return False
        # arm64 images often omit the variant; a wanted variant only rules out a different one.
        return self.variant is None or p.get("variant") in (None, self.variant)

    def __str__(self) -> str:
        return "/".join(x for x in (self.os, self.architecture, self.variant) if x)


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int


@dataclass(frozen=True)
class ImageManifest:
    config: Descriptor
    layers: tuple[Descriptor, ...]


def media_type_of(body: bytes, header_type: str | None) -> str:
    """The manifest's media type: its own mediaType field, else the HTTP header."""
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise ManifestError(f"manifest is not JSON: {e}") from e
    mt = doc.get("mediaType") or (header_type or "").split(";")[0].strip()
    if not mt:  # OCI allows omitting mediaType; tell index from manifest by shape
        mt = OCI_INDEX if "manifests" in doc else OCI_MANIFEST
    return mt


def _descriptor(d: dict, where: str) -> Descriptor:
    try:
        return Descriptor(d.get("mediaType", ""), d["digest"], int(d["size"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where}: descriptor lacks digest/size") from e


def is_attestation(entry: dict) -> bool:
    annotations = entry.get("annotations") or {}
    return "vnd.docker.reference.type" in annotations or (entry.get("platform") or {}).get("os") == "unknown"


def select_platform(index_body: bytes, want: Platform) -> Descriptor:
    """Pick the manifest for `want` from an OCI index or Docker manifest list."""
    entries = [e for e in json.loads(index_body).get("manifests", []) if not is_attestation(e)]
    for e in entries:
        if want.matches(e):
            return _descriptor(e, "index entry")
    offered = ", ".join(
        "/".join(x for x in ((e.get("platform") or {}).get(k) for k in ("os", "architecture", "variant")) if x)
        for e in entries
    )
    raise ManifestError(f"no image for platform {want} (offered: {offered or 'none'}); choose one with --platform")


def parse_manifest(body: bytes) -> ImageManifest:
    doc = json.loads(body)
    if doc.get("schemaVersion") != 2:
        raise ManifestError("unsupported manifest schemaVersion (only schema 2 / OCI manifests are supported)")
    config = _descriptor(doc.get("config") or {}, "manifest config")
    layers = tuple(_descriptor(layer, f"manifest layer {i}") for i, layer in enumerate(doc.get("layers", [])))
    return ImageManifest(config, layers)
