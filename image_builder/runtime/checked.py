"""Layers checked against the digests the store recorded, once per node, before their
first mount. A flipped byte in an image otherwise reaches the command as an I/O error
deep in a test run, which a grader counts against the candidate; here it is an
infrastructure error naming the image, before anything runs.

The check is remembered per user on this node (STATE/checked/, the private state dir)
by device, inode, size and mtime with the digest, so a rebuilt or replaced image is
hashed again and an unchanged one costs a stat: hashing a 330 MB environment image
takes about 0.4 s here, once.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .mounts import RunnerError
from .session import InstanceLayers


class CorruptImage(RunnerError):
    pass


def _marker(state_dir: Path, path: Path, st: os.stat_result, digest: str) -> Path:
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{digest}:{os.path.realpath(path)}"
    return state_dir / "checked" / hashlib.sha256(key.encode()).hexdigest()


def check_layers(layers: InstanceLayers, state_dir: Path) -> None:
    """CorruptImage unless every layer's bytes are what the store recorded (layers
    without recorded digests are not checked)."""
    for path, digest in zip((layers.env_sif, *layers.overlays), layers.digests):
        try:
            st = os.stat(path)
        except OSError as e:
            raise RunnerError(f"image {path}: {e.strerror}; run `image-builder verify` on its store") from None
        marker = _marker(state_dir, path, st, digest)
        if marker.exists():
            continue
        from image_builder.oci.cache import sha256_file  # only here: its module's imports cost the run path 3 ms

        if sha256_file(path) != digest:
            raise CorruptImage(f"image {path} is corrupt (its bytes do not match the store's index): "
                               "run `image-builder verify --store STORE` and rebuild what it lists")
        marker.parent.mkdir(mode=0o700, exist_ok=True)
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
