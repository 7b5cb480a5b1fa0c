"""Image references: `python:3.12`, `host:port/name:tag`, `name@sha256:...`.

Normalised the way Docker does it, so `python:3.12` means
`docker.io/library/python:3.12`, served by the API host `registry-1.docker.io`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from image_builder.errors import ImageBuilderError

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"

_NAME_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class ReferenceError(ImageBuilderError, ValueError):
    """A reference that cannot name an image."""


@dataclass(frozen=True)
class Reference:
    registry: str  # as written by users: docker.io, ghcr.io, 127.0.0.1:5000
    repository: str  # library/python
    tag: str | None = None
    digest: str | None = None

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def version(self) -> str:
        """What to ask the manifests endpoint for: the digest wins over the tag."""
        return self.digest or self.tag or "latest"

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        s = f"{self.registry}/{self.repository}"
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s


def parse(text: str) -> Reference:
    """Parse and normalise an image reference; ReferenceError says what is wrong."""
    ref = text.strip()
    if not ref or any(c.isspace() for c in ref):
        raise ReferenceError(f"invalid image reference {text!r}: empty or contains spaces")
    digest = None
    if "@" in ref:
        ref, digest = ref.split("@", 1)
        if not _DIGEST.match(digest):
            raise ReferenceError(f"invalid digest in {text!r}: expected sha256: and 64 hex digits")
    tag = None
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:  # a colon in the first component alone is a registry port
        ref, tag = ref.rsplit(":", 1)
        if not _TAG.match(tag):
            raise ReferenceError(f"invalid tag {tag!r} in {text!r}")
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
    else:
        registry, path = DOCKER_HUB, ref
    if registry in ("index.docker.io", DOCKER_HUB_API):
        registry = DOCKER_HUB
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    for component in path.split("/"):
        if not _NAME_COMPONENT.match(component):
            raise ReferenceError(
                f"invalid repository name {path!r} in {text!r}: use lowercase letters, digits and . _ -"
            )
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, path, tag, digest)
