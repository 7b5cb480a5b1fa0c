"""A private registry on 127.0.0.1 and pushing a root filesystem into it.

The tests and benchmarks pull through a real OCI registry (Debian's
`docker-registry`, over TLS) this way. Sites without a registry do not need
one: `image-builder base debian` writes an OCI layout that catalogs name as
`oci:DIR:TAG` (oci/local.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import requests
import yaml

from image_builder.errors import ImageBuilderError
from image_builder.oci.cache import sha256_file
from image_builder.oci.layout import OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, DEFAULT_ENV, image_config



class LocalRegistryError(ImageBuilderError):
    pass


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


def self_signed_cert(directory: Path, name: str, cn: str = "127.0.0.1") -> CertPair:
    """A certificate for 127.0.0.1 and localhost, made with openssl."""
    directory.mkdir(parents=True, exist_ok=True)
    pair = CertPair(directory / f"{name}.pem", directory / f"{name}.key")
    if not (pair.cert.exists() and pair.key.exists()):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30",
                        "-subj", f"/CN={cn}", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                        "-keyout", str(pair.key), "-out", str(pair.cert)], check=True, capture_output=True)
    return pair


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class LocalRegistry:
    name: str
    port: int
    process: subprocess.Popen
    log: Path
    tls: CertPair

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"https://{self.host}"

    def stop(self) -> None:
        stop_process(self.process, 10)

    def __enter__(self) -> LocalRegistry:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_registry(workdir: Path, name: str, storage: Path, tls: CertPair, auth: dict | None = None,
                   port: int | None = None) -> LocalRegistry:
    """Start `docker-registry serve` over TLS on 127.0.0.1 and wait until it answers."""
    if not shutil.which("docker-registry"):
        raise LocalRegistryError("docker-registry is not installed: apt-get install docker-registry")
    port = port or free_port()
    config = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}", "tls": {"certificate": str(tls.cert), "key": str(tls.key)},
                 "secret": "image-builder-local"},
    }
    if auth:
        config["auth"] = auth
    workdir.mkdir(parents=True, exist_ok=True)
    conf_path = workdir / f"{name}.yml"
    conf_path.write_text(yaml.safe_dump(config))
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["docker-registry", "serve", str(conf_path)], stdout=out, stderr=subprocess.STDOUT)
    reg = LocalRegistry(name, port, proc, log, tls)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LocalRegistryError(f"docker-registry {name} exited: {log.read_text()[-500:]}")
        try:
            if requests.get(f"{reg.url}/v2/", verify=str(tls.cert), timeout=2).status_code in (200, 401):
                return reg
        except requests.ConnectionError:
            time.sleep(0.1)
    reg.stop()
    raise LocalRegistryError(f"docker-registry {name} did not answer within 20 s; see {log}")


def push_image(registry_url: str, repository: str, tag: str, layers: list[Path], *, ca: Path | None,
               env: list[str] | None = None, arch: str = "amd64") -> str:
    """Push gzip layers and a minimal config as an OCI image; returns the manifest digest."""
    verify = str(ca) if ca else True
    session = requests.Session()

    def put_blob(data_path: Path | None, data: bytes | None) -> tuple[str, int]:
        digest = sha256_file(data_path) if data_path else "sha256:" + hashlib.sha256(data).hexdigest()
        size = data_path.stat().st_size if data_path else len(data)
        if session.head(f"{registry_url}/v2/{repository}/blobs/{digest}", verify=verify).status_code == 200:
            return digest, size
        r = session.post(f"{registry_url}/v2/{repository}/blobs/uploads/", verify=verify)
        r.raise_for_status()
        loc = r.headers["Location"]
        url = loc if loc.startswith("http") else registry_url + loc
        body = open(data_path, "rb") if data_path else data
        try:
            session.put(url, params={"digest": digest}, data=body, verify=verify,
                        headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)}
                        ).raise_for_status()
        finally:
            if data_path:
                body.close()
        return digest, size

    descriptors = [dict(zip(("digest", "size"), put_blob(p, None)), mediaType=OCI_LAYER_GZIP) for p in layers]
    config = image_config(layers, tuple(env) if env else DEFAULT_ENV, arch)
    config_digest, config_size = put_blob(None, config)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                           "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config_size},
                           "layers": descriptors}).encode()
    session.put(f"{registry_url}/v2/{repository}/manifests/{tag}", data=manifest, verify=verify,
                headers={"Content-Type": OCI_MANIFEST}).raise_for_status()
    return "sha256:" + hashlib.sha256(manifest).hexdigest()
