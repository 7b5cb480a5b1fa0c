"""Pull benchmark: a Debian python image (about 120 MB gzip) from a local HTTPS registry.

Cold cache, side by side in one run: `image-builder pull` against `skopeo copy`
to an OCI layout (both download and verify), and `image-builder pull --rootfs`
against `ch-image pull` (both download and unpack). Then a warm-cache pull
through a counting proxy, which must send no blob request.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from image_builder.devtools.localregistry import push_image, self_signed_cert, start_registry
from image_builder.oci.layout import rootfs_layer
from bench.common import CACHE, VENV_BIN, Report, Row, need, python_rootfs, timed
from tests.support.servers import FaultProxy


def main() -> Report:
    skopeo, ch_image = need("skopeo"), need("ch-image")
    rootfs = python_rootfs()
    layer_path = rootfs_layer(rootfs, CACHE / f"{rootfs.name}.tar.gz")
    report = Report("pull")
    with tempfile.TemporaryDirectory(prefix="ib-bench-pull-") as tmp:
        work = Path(tmp)
        tls = self_signed_cert(work, "server")
        reg = start_registry(work, "bench", work / "storage", tls)
        try:
            push_image(reg.url, "bench/python", "1", [layer_path], ca=tls.cert)
            ref = f"{reg.host}/bench/python:1"
            certs = work / "certs"
            certs.mkdir()
            shutil.copy(tls.cert, certs / "ca.crt")
            cache, oci_dir, root, ch = work / "cache", work / "oci", work / "root", work / "ch"

            def clean(*paths):
                return lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths]

            ours = [str(VENV_BIN / "image-builder"), "pull", ref, "--ca-cert", str(tls.cert), "--cache-dir", str(cache)]
            t_ours = timed(ours, setup=clean(cache))
            t_skopeo = timed([skopeo, "copy", "-q", "--src-cert-dir", str(certs), f"docker://{ref}",
                              f"oci:{oci_dir}:latest"], setup=clean(oci_dir))
            report.rows.append(Row("pull + verify, cold cache", t_ours, "skopeo copy", t_skopeo, "<= 1.3x"))

            t_flat = timed([*ours, "--rootfs", str(root)], setup=clean(cache, root))
            t_ch = timed(["/usr/bin/python3", ch_image, "--storage", str(ch), "pull", ref],
                         setup=clean(ch), env={"USER": "root", "REQUESTS_CA_BUNDLE": str(tls.cert)})
            report.rows.append(Row("pull + flatten, cold cache", t_flat, "ch-image pull", t_ch, "<= 0.5x"))

            proxy = FaultProxy(reg.url, tls).start()
            warm = [str(VENV_BIN / "image-builder"), "pull", f"{proxy.host}/bench/python:1", "--ca-cert",
                    str(tls.cert), "--cache-dir", str(cache)]
            t_warm = timed(warm)
            blob_requests = len(proxy.requests_to("/blobs/"))
            proxy.stop()
            report.rows.append(Row("pull, warm cache", t_warm, "skopeo copy (cold)", t_skopeo, "no blob request"))
            size = layer_path.stat().st_size
            report.notes.append(f"layer: {size / 1e6:.0f} MB gzip; warm pulls sent {blob_requests} blob requests")
            assert blob_requests == 0, "a warm-cache pull must not request any blob"
        finally:
            reg.stop()
    return report


if __name__ == "__main__":
    r = main()
    r.print()
    r.save()
