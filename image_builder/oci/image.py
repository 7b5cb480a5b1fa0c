"""What a pull gives: an image's manifest digest, config and verified layer blobs (registry or disk)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layer:
    digest: str
    size: int
    media_type: str
    path: Path  # the verified blob in the cache


@dataclass(frozen=True)
class PulledImage:
    reference: str  # normalised, e.g. docker.io/library/python:3.12
    digest: str  # the platform manifest's digest: what a build key pins
    index_digest: str | None  # the multi-platform index it was chosen from, if any
    platform: str
    config: dict  # the image config (env, working dir, ...); empty for a rootfs tarball
    layers: tuple[Layer, ...]

    @property
    def env(self) -> dict[str, str]:
        pairs = (self.config.get("config") or {}).get("Env") or []
        return dict(p.split("=", 1) for p in pairs if "=" in p)

    def to_json(self) -> dict:
        d = asdict(self)
        d["layers"] = [{**asdict(layer), "path": str(layer.path)} for layer in self.layers]
        del d["config"]
        return d
