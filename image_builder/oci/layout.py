"""Writing images as OCI image layouts (the format skopeo's `oci:` and umoci read), and the layer of a root
filesystem directory: how a base made here (`image-builder base debian`) reaches catalogs without a registry.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import shutil
import tarfile
from pathlib import Path

from .cache import sha256_file

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DEFAULT_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)


def rootfs_layer(rootfs: Path, dest: Path) -> Path:
    """A gzip tar layer of a directory, numeric owners, written once: under a lock, because a second writer
    replacing the file while a first pushes it makes the pushed bytes disagree with their digest (HTTP 400
    from the registry, two test workers on a fresh machine); with a zero gzip time, so the same tree always
    gives the same digest."""
    if dest.exists():
        return dest
    with open(dest.with_name(f"{dest.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not dest.exists():
            tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as raw, gzip.GzipFile("", "wb", 6, raw, mtime=0) as gz, \
                    tarfile.open(fileobj=gz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for entry in sorted(rootfs.iterdir()):
                    tar.add(entry, arcname=entry.name)
            os.replace(tmp, dest)
    return dest


def diff_id(layer: Path) -> str:
    """The sha256 of a gzip layer's uncompressed tar: what an image config's rootfs.diff_ids lists (umoci, and
    every runtime that checks layers after unpacking, need them)."""
    h = hashlib.sha256()
    with gzip.open(layer, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def image_config(layers: list[Path], env: tuple[str, ...] = DEFAULT_ENV, arch: str = "amd64") -> bytes:
    return json.dumps({"architecture": arch, "os": "linux", "config": {"Env": list(env)},
                       "rootfs": {"type": "layers", "diff_ids": [diff_id(p) for p in layers]},
                       "history": [{"created_by": f"image-builder layer {i}"} for i in range(len(layers))]},
                      sort_keys=True).encode()


def _write_blob(root: Path, data: bytes | None = None, src: Path | None = None) -> tuple[str, int]:
    digest = sha256_file(src) if src else "sha256:" + hashlib.sha256(data).hexdigest()
    dest = root / "blobs" / "sha256" / digest[7:]
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp")
        if src:
            shutil.copyfile(src, tmp)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, dest)
    return digest, dest.stat().st_size


def write_layout(dest: Path, tag: str, layers: list[Path], env: tuple[str, ...] = DEFAULT_ENV,
                 arch: str = "amd64") -> str:
    """Add an image of gzip `layers` to the OCI layout at `dest` under `tag` (replacing that tag); returns
    the manifest digest. Blobs first, index.json last (temp name, rename): a reader never sees a tag whose
    blobs are missing."""
    dest.mkdir(parents=True, exist_ok=True)
    descriptors = [dict(zip(("digest", "size"), _write_blob(dest, src=p)), mediaType=OCI_LAYER_GZIP) for p in layers]
    config_digest, config_size = _write_blob(dest, image_config(layers, env, arch))
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                           "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config_size},
                           "layers": descriptors}).encode()
    digest, size = _write_blob(dest, manifest)
    (dest / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    index_path = dest / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {"schemaVersion": 2, "manifests": []}
    index["mediaType"] = OCI_INDEX
    index["manifests"] = [m for m in index.get("manifests", [])
                          if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") != tag]
    index["manifests"].append({"mediaType": OCI_MANIFEST, "digest": digest, "size": size,
                               "annotations": {"org.opencontainers.image.ref.name": tag},
                               "platform": {"architecture": arch, "os": "linux"}})
    tmp = index_path.with_name(".index.json.tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, index_path)
    return digest
