"""Registry credentials and the bearer-token flow of the distribution spec.

Credentials come from `$REGISTRY_AUTH_FILE` or the Docker client's config
(`$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`): `auths` entries
holding base64 `user:password`. A 401 carries a `WWW-Authenticate` challenge:
`Basic` is answered with those credentials, `Bearer` by asking the challenge's
realm for a token for its service and scope.
"""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from image_builder.errors import ImageBuilderError
from .reference import DOCKER_HUB

_PARAM = re.compile(r'(\w+)="([^"]*)"')


class AuthError(ImageBuilderError):
    """Credentials were refused or a token could not be obtained."""


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str


@dataclass(frozen=True)
class Challenge:
    scheme: str  # "basic" or "bearer"
    realm: str = ""
    service: str = ""
    scope: str = ""


def parse_challenge(header: str) -> Challenge:
    scheme, _, params = header.strip().partition(" ")
    values = dict(_PARAM.findall(params))
    return Challenge(scheme.lower(), values.get("realm", ""), values.get("service", ""), values.get("scope", ""))


def _auth_files() -> list[Path]:
    files = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(Path(os.environ["REGISTRY_AUTH_FILE"]))
    docker_dir = os.environ.get("DOCKER_CONFIG")
    files.append(Path(docker_dir) / "config.json" if docker_dir else Path.home() / ".docker" / "config.json")
    return files


def _auth_keys(registry: str) -> list[str]:
    keys = [registry, f"https://{registry}", f"http://{registry}"]
    if registry == DOCKER_HUB:  # the Docker CLI stores Hub logins under the v1 index URL
        keys += ["https://index.docker.io/v1/", "index.docker.io", "registry-1.docker.io"]
    return keys


def load_credentials(registry: str) -> Credentials | None:
    """The first matching `auths` entry of the auth files, or None (anonymous)."""
    for path in _auth_files():
        try:
            auths = json.loads(path.read_text()).get("auths", {})
        except FileNotFoundError:
            continue
        except (OSError, ValueError, AttributeError) as e:
            raise AuthError(f"{path}: cannot read registry credentials ({e}); fix or remove the file") from e
        for key in _auth_keys(registry):
            entry = auths.get(key) or auths.get(key.rstrip("/"))
            if not entry:
                continue
            if entry.get("auth"):
                try:
                    user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
                except (ValueError, UnicodeDecodeError) as e:
                    raise AuthError(f"{path}: auths[{key!r}].auth is not base64 'user:password'") from e
                return Credentials(user, password)
            if entry.get("username"):
                return Credentials(entry["username"], entry.get("password", ""))
    return None


def basic_header(creds: Credentials) -> str:
    return "Basic " + base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()
