"""Import benchmark: 20 instance images over one shared base + environment, in SWE-bench's shape.

Each image: a Debian python base layer, an environment layer (a venv made once), and its own layer: a
clone of marshmallow at one of 20 consecutive commits in /testbed (as SWE-bench's instance images copy the
repository). Served by a local docker-registry over TLS.

- Store bytes after `image-builder import` against one `.sif` per image (`mksquashfs` of each flattened
  tree, the HPC status quo) and against the images' flattened sizes. Goal: at least 10x smaller than one
  `.sif` per image.
- Import time against `skopeo copy` of each image to an OCI layout, `umoci raw unpack` and one
  `mksquashfs` per image. Goal: at most 0.5x.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import CACHE, Report, Row, need, python_rootfs
from bench.store import BUNDLE, commits
from image_builder.build.envbuild import BuildOptions
from image_builder.build.imports import ImportItem, ImportOptions, import_images
from image_builder.devtools.localregistry import push_image, self_signed_cert, start_registry
from image_builder.oci.cache import BlobCache
from image_builder.oci.layout import rootfs_layer
from image_builder.oci.registry import RegistryOptions
from image_builder.pack.squashfs import SquashOptions, mksquashfs_command
from image_builder.store.store import Store

N = 20


def env_layer(work: Path) -> Path:
    """/opt/venv with pytest and its dependencies: the environment layer the images share."""
    dest = CACHE / "import-env-layer.tar.gz"
    if not dest.exists():
        tree = work / "envtree"
        subprocess.run(["python3", "-m", "venv", str(tree / "opt/venv")], check=True)
        subprocess.run([str(tree / "opt/venv/bin/pip"), "install", "-q", "pytest<8", "pytz", "simplejson"], check=True)
        rootfs_layer(tree, dest)
    return dest


def instance_layers(work: Path) -> list[Path]:
    """One layer per commit: the repository cloned at it into /testbed, .git and all."""
    layers = []
    for i, sha in enumerate(commits(N, work)):
        dest = CACHE / f"import-inst-{sha[:12]}.tar.gz"
        if not dest.exists():
            tree = work / f"inst-{i}"
            subprocess.run(["git", "clone", "-q", "--no-checkout", str(BUNDLE), str(tree / "testbed")], check=True)
            subprocess.run(["git", "-C", str(tree / "testbed"), "checkout", "-q", sha], check=True)
            rootfs_layer(tree, dest)
        layers.append(dest)
    return layers


def status_quo(refs: list[str], work: Path, tls: Path) -> tuple[float, int]:
    """skopeo copy + umoci raw unpack + mksquashfs, per image: (seconds, bytes of the .sif-equivalents)."""
    need("skopeo")
    need("umoci")
    total, t0 = 0, time.perf_counter()
    cert_dir = work / "certs"
    cert_dir.mkdir(exist_ok=True)
    shutil.copy(tls, cert_dir / "ca.crt")
    for i, ref in enumerate(refs):
        layout, tree, dest = work / f"layout-{i}", work / f"tree-{i}", work / f"img-{i}.sqfs"
        subprocess.run(["skopeo", "copy", "-q", "--src-cert-dir", str(cert_dir), f"docker://{ref}",
                        f"oci:{layout}:x"], check=True)
        subprocess.run(["umoci", "raw", "unpack", "--rootless", "--image", f"{layout}:x", str(tree)], check=True,
                       capture_output=True)
        subprocess.run(mksquashfs_command(tree, dest, SquashOptions()), check=True, stdout=subprocess.DEVNULL)
        total += dest.stat().st_size
        shutil.rmtree(tree)
        shutil.rmtree(layout)
    return time.perf_counter() - t0, total


def main() -> Report:
    report = Report("imports")
    base = rootfs_layer(python_rootfs(), CACHE / f"{python_rootfs().name}.tar.gz")
    with tempfile.TemporaryDirectory(prefix="ib-bench-import-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        env, insts = env_layer(work), instance_layers(work)
        tls = self_signed_cert(work, "tls")
        with start_registry(work, "bench", work / "storage", tls) as reg:
            refs = []
            for i, layer in enumerate(insts):
                push_image(reg.url, f"bench/sweb.eval.x86_64.mm_1776_{i:02d}", "latest", [base, env, layer],
                           ca=tls.cert)
                refs.append(f"{reg.host}/bench/sweb.eval.x86_64.mm_1776_{i:02d}:latest")
            peer_s, peer_bytes = status_quo(refs, work, tls.cert)
            build = BuildOptions(store=work / "store", cache=BlobCache(work / "cache"),
                                 registry=RegistryOptions(ca_cert=tls.cert))
            opts = ImportOptions(build, id_from=f"{reg.host}/bench/sweb.eval.x86_64.{{instance_id}}:latest")
            t0 = time.perf_counter()
            summary = import_images([ImportItem(r) for r in refs], opts)
            ours_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            import_images([ImportItem(r) for r in refs], opts)
            rerun = time.perf_counter() - t0
        store = Store.open(work / "store").index
        ours_bytes = sum(store.file_sizes().values())
        sizes = sorted(i.size for i in store.instances.values())
        report.rows.append(Row(f"store bytes, {N} imported instance images", ours_bytes / 1e6,
                               f"{N} .sif (mksquashfs per image)", peer_bytes / 1e6, "ratio <= 0.1", "MB"))
        report.rows.append(Row(f"import {N} images (pull, split, pack)", ours_s,
                               "skopeo copy + umoci unpack + mksquashfs per image", peer_s, "ratio <= 0.5"))
        report.notes.append(f"{len(summary.environments)} environment(s) for {N} images; overlays median "
                            f"{sizes[len(sizes) // 2] / 1e6:.1f} MB (each holds its full clone: the images re-add "
                            f"/testbed and the environment has none); image layers pulled "
                            f"{summary.image_bytes / 1e6:.0f} MB; a rerun took {rerun:.1f} s and fetched no blob")
    return report


if __name__ == "__main__":
    r = main()
    r.print()
    r.save()
