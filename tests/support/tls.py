"""Self-signed certificates for the test servers (openssl, as an admin would)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


def self_signed(directory: Path, name: str, cn: str = "127.0.0.1") -> CertPair:
    directory.mkdir(parents=True, exist_ok=True)
    pair = CertPair(directory / f"{name}.pem", directory / f"{name}.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3",
         "-subj", f"/CN={cn}", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(pair.key), "-out", str(pair.cert)],
        check=True, capture_output=True,
    )
    return pair
