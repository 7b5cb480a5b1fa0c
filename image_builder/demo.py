"""`make demo`: the main job end to end on the built-in sample.

Makes a base image available over HTTPS (a Debian python base made with
debootstrap once, served by a local docker-registry on 127.0.0.1 over TLS),
pulls it through the real client and shows what it got. Everything is kept in
the cache, so a second run reuses it and takes seconds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .bases import debian_rootfs
from .cache import BlobCache, default_cache_dir
from .localregistry import push_image, rootfs_layer, self_signed_cert, start_registry
from .progress import LogProgress
from .pull import pull
from .registry import RegistryOptions


def say(text: str) -> None:
    print(text, flush=True)


def main() -> int:
    t0 = time.monotonic()
    home = default_cache_dir() / "demo"
    say("1/2 base image: a Debian bookworm python base made with debootstrap (once, about a minute), "
        "served by a local docker-registry over TLS on 127.0.0.1")
    rootfs = debian_rootfs("bookworm", home / "bases")
    layer = rootfs_layer(rootfs, home / "bases" / f"{rootfs.name}.tar.gz")
    tls = self_signed_cert(home / "tls", "registry")
    with start_registry(home / "registry", "demo", home / "registry" / "storage", tls) as reg:
        push_image(reg.url, "demo/python", "bookworm", [layer], ca=tls.cert)
        ref = f"{reg.host}/demo/python:bookworm"
        say(f"2/2 pull {ref}")
        image = pull(ref, cache=BlobCache(), options=RegistryOptions(ca_cert=tls.cert), progress=LogProgress(sys.stdout))
    say(f"\n{image.reference}  {image.digest}  ({image.platform})")
    for layer_ in image.layers:
        say(f"  {layer_.digest}  {layer_.size / 1e6:8.1f} MB  {layer_.media_type}")
    say(f"\ndone in {time.monotonic() - t0:.1f} s. Next: .venv/bin/image-builder pull --help")
    return 0


if __name__ == "__main__":
    sys.exit(main())
