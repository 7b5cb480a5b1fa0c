"""Debian's docker-registry (distribution 2.8), started for the tests over TLS.

Three registries share one storage directory: an open one the tests push to,
one behind htpasswd basic auth and one behind `auth: token` with a token
issuer run by the tests. What is pushed to the first is served by all three.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RegistryProcess:
    name: str
    port: int
    process: subprocess.Popen
    log: Path
    ca: Path
    extra: dict = field(default_factory=dict)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"https://{self.host}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_registry(workdir: Path, name: str, storage: Path, cert: Path, key: Path,
                   auth: dict | None = None) -> RegistryProcess:
    port = free_port()
    config = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}", "tls": {"certificate": str(cert), "key": str(key)},
                 "secret": "image-builder-tests"},
    }
    if auth:
        config["auth"] = auth
    conf_path = workdir / f"{name}.yml"
    conf_path.write_text(yaml.safe_dump(config))
    log = workdir / f"{name}.log"
    proc = subprocess.Popen(["docker-registry", "serve", str(conf_path)], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
    reg = RegistryProcess(name, port, proc, log, cert)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry {name} exited: {log.read_text()[-2000:]}")
        try:
            r = requests.get(f"{reg.url}/v2/", verify=str(cert), timeout=2)
            if r.status_code in (200, 401):
                return reg
        except requests.ConnectionError:
            time.sleep(0.1)
    reg.stop()
    raise RuntimeError(f"docker-registry {name} did not answer within 20 s: {log.read_text()[-2000:]}")
