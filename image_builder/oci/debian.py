"""Debian base images made locally with debootstrap, for sites that cannot reach a public registry:

    image-builder base debian bookworm --include python3,python3-venv,git -o bases
    # -> oci:bases:bookworm, for a catalog's `base:` or `--base ALIAS=...`

`debian_rootfs` runs debootstrap once per (suite, packages) and keeps the tree
in a cache; `debian_base` writes it as an OCI image layout (layout.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import shutil
import subprocess
from pathlib import Path

from image_builder.errors import ImageBuilderError
from .layout import rootfs_layer, write_layout

PYTHON_PACKAGES = ("python3", "python3-venv", "git", "ca-certificates")


class BaseError(ImageBuilderError):
    pass


def debian_base(suite: str, layout: Path, cache_dir: Path, include: tuple[str, ...] = PYTHON_PACKAGES,
                tag: str | None = None, mirror: str | None = None) -> str:
    """Debootstrap (cached) `suite` with `include` into the OCI layout `layout`; returns its oci: reference."""
    rootfs = debian_rootfs(suite, cache_dir, include, mirror)
    write_layout(layout, tag or suite, [rootfs_layer(rootfs, cache_dir / f"{rootfs.name}.tar.gz")])
    return f"oci:{layout.resolve()}:{tag or suite}"


def debian_rootfs(suite: str, cache_dir: Path, include: tuple[str, ...] = PYTHON_PACKAGES,
                  mirror: str | None = None) -> Path:
    """A Debian minbase tree with `include`, made with debootstrap (about a minute) and cached."""
    # Keyed by the recipe too (how _debootstrap makes the tree): a tree made another way is made again,
    # so a kept cache (CI keeps its bases) never hides a change to how bases are made.
    recipe = [*sorted(include), *([mirror] if mirror else []), inspect.getsource(_debootstrap)]
    tag = hashlib.sha256(" ".join(recipe).encode()).hexdigest()[:8]
    dest = cache_dir / f"debian-{suite}-{tag}"
    if (dest / "bin").exists():
        return dest
    if not shutil.which("debootstrap"):
        raise BaseError("debootstrap is not installed: apt-get install debootstrap")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one debootstrap per tree, however many processes ask
        if not (dest / "bin").exists():
            _debootstrap(suite, include, dest, mirror)
    return dest


def unmount_under(tree: Path) -> None:
    """Detach what is mounted in `tree`: a debootstrap killed midway leaves the target's /proc mounted,
    and every later attempt (and `rm -rf` of the cache) failed on it, file by file."""
    inside = f"{tree}/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    for point in sorted((p for p in points if p.startswith(inside)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def _debootstrap(suite: str, include: tuple[str, ...], dest: Path, mirror: str | None) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    unmount_under(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    r = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(include)}", suite, str(tmp),
                        *([mirror] if mirror else [])], capture_output=True, text=True)
    if r.returncode:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise BaseError(f"debootstrap {suite} failed ({r.returncode}): {tail[0]}")
    shutil.rmtree(tmp / "var/cache/apt/archives", ignore_errors=True)
    (tmp / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    tmp.rename(dest)
