"""Bases without a registry: OCI layouts (skopeo's, ours), archives, rootfs tarballs and directories."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from image_builder.oci.cache import BlobCache
from image_builder.oci.local import LocalImageError, pull_local
from image_builder.runtime.backends import open_session
from image_builder.runtime.execution import RunRequest
from image_builder.store.store import Store
from tests.conftest import TEST_CACHE, run_cli
from tests.test_envbuild import write_catalog

SCRIPT = {"hello.sh": "#!/bin/sh\nset -e\necho built-here > /etc/hello\n"}


def skopeo(src: str, dest: str) -> None:
    subprocess.run(["skopeo", "copy", "-q", "--src-tls-verify=false", src, dest], check=True,
                   capture_output=True)


def build_and_run(tmp: Path, base: str, command: str = "cat /etc/hello") -> str:
    """Build one environment on `base` through the CLI, then run `command` in it through the runtime."""
    cat = write_catalog(tmp, [{"name": "e", "base": base, "scripts": ["hello.sh"]}], SCRIPT,
                        [{"id": "i", "environment": "e"}])
    r = run_cli("build", str(cat), "--store", str(tmp / "store"), "--cache-dir", str(tmp / "cache"), cwd=tmp)
    assert r.returncode == 0, r.stderr
    resolved = Store.open(tmp / "store").resolve("i")
    from image_builder.runtime.session import InstanceLayers
    layers = InstanceLayers.of(resolved)
    with open_session(layers, state_dir=tmp / "state") as session:
        out = session.run(RunRequest(("sh", "-c", command), timeout=30))
    assert out.exit_code == 0, out
    return out.stdout.decode()


@pytest.mark.parametrize("kind", ["oci", "oci-archive", "docker-archive"])
def test_images_skopeo_wrote_build_and_run(tmp_path, tiny_base, kind):
    where = {"oci": "layout", "oci-archive": "image.tar", "docker-archive": "docker.tar"}[kind]
    skopeo(f"docker://{tiny_base}", f"{kind}:{tmp_path / where}:" + ("test/tiny:1" if kind == "docker-archive"
                                                                     else "tiny"))
    base = f"{kind}:{where}" + ("" if kind == "docker-archive" else ":tiny")  # relative to the catalog
    assert build_and_run(tmp_path, base) == "built-here\n"
    index = Store.open(tmp_path / "store").index
    assert index.environments["e"].base == f"{kind}:{tmp_path / where}" + ("" if kind == "docker-archive" else ":tiny")


def test_rootfs_tarball_and_directory_build_and_run(tmp_path, tiny_base):
    skopeo(f"docker://{tiny_base}", f"oci:{tmp_path / 'layout'}:tiny")
    image = pull_local(f"oci:{tmp_path / 'layout'}:tiny", BlobCache(tmp_path / "c"))
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    subprocess.run(["tar", "-xzf", str(image.layers[0].path), "-C", str(rootfs)], check=True)
    shutil.copy(image.layers[0].path, tmp_path / "rootfs.tar.gz")
    for name, base in (("tarball", "tar:../rootfs.tar.gz"), ("directory", f"dir:{rootfs}")):
        work = tmp_path / name
        work.mkdir()
        assert build_and_run(work, base) == "built-here\n", name
    # A directory's digest is its tar's: the same tree twice, the same digest (the build key holds).
    again = pull_local(f"dir:{rootfs}", BlobCache(tmp_path / "c"))
    assert again.digest == pull_local(f"dir:{rootfs}", BlobCache(tmp_path / "c2")).digest


def test_base_debian_writes_a_layout_catalogs_use(tmp_path):
    layout = tmp_path / "bases"
    # The fixtures' debootstrap tree (same suite and packages): made once, kept in TEST_CACHE.
    r = run_cli("base", "debian", "bookworm", "-o", str(layout), "--cache-dir", str(TEST_CACHE))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"oci:{layout}:bookworm"
    index = json.loads((layout / "index.json").read_text())
    assert [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]] == ["bookworm"]
    inspect = subprocess.run(["skopeo", "inspect", f"oci:{layout}:bookworm"], capture_output=True, text=True)
    assert inspect.returncode == 0 and json.loads(inspect.stdout)["Os"] == "linux", inspect.stderr
    work = tmp_path / "env"
    work.mkdir()
    out = build_and_run(work, r.stdout.strip(), "python3 -c 'import sys; print(sys.version_info[:2])'; cat /etc/hello")
    assert out == "(3, 11)\nbuilt-here\n"


def test_our_layouts_are_what_umoci_and_skopeo_read(tmp_path):
    """A layout written here (image-builder base debian's) unpacks with umoci: its config lists the layers'
    diff_ids, as the image spec asks (umoci indexes them)."""
    from image_builder.oci.layout import rootfs_layer, write_layout
    from tests.support.bases import tiny_rootfs
    layer = rootfs_layer(tiny_rootfs(tmp_path / "root"), tmp_path / "root.tar.gz")
    write_layout(tmp_path / "layout", "tiny", [layer])
    r = subprocess.run(["umoci", "raw", "unpack", "--rootless", "--image", f"{tmp_path / 'layout'}:tiny",
                        str(tmp_path / "unpacked")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    assert (tmp_path / "unpacked/usr/bin/dash").is_file()
    inspect = subprocess.run(["skopeo", "inspect", "--config", f"oci:{tmp_path / 'layout'}:tiny"],
                             capture_output=True, text=True, check=True)
    assert len(json.loads(inspect.stdout)["rootfs"]["diff_ids"]) == 1


def test_bad_local_bases_are_one_line_errors(tmp_path, tiny_base):
    cat = write_catalog(tmp_path, [{"name": "e", "base": "oci:missing:tag", "scripts": ["hello.sh"]}], SCRIPT)
    r = run_cli("check", str(cat))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"Error: {cat}:") and "no such file or directory" in r.stderr
    layout = tmp_path / "layout"
    skopeo(f"docker://{tiny_base}", f"oci:{layout}:one")
    skopeo(f"docker://{tiny_base}", f"oci:{layout}:two")
    with pytest.raises(LocalImageError, match="several images .* name one of: one, two"):
        pull_local(f"oci:{layout}", BlobCache(tmp_path / "c"))
    with pytest.raises(LocalImageError, match="no image tagged 'three'"):
        pull_local(f"oci:{layout}:three", BlobCache(tmp_path / "c"))
    # A layer whose bytes no longer match its digest is refused, not built from.
    manifest = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    layer = json.loads((layout / "blobs/sha256" / manifest[7:]).read_text())["layers"][0]["digest"]
    blob = layout / "blobs/sha256" / layer[7:]
    blob.chmod(0o644)
    blob.write_bytes(gzip.compress(b"not the layer"))
    cat = write_catalog(tmp_path, [{"name": "e", "base": f"oci:{layout}:one", "scripts": ["hello.sh"]}], SCRIPT)
    r = run_cli("build", str(cat), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "fresh"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "digest mismatch" in r.stderr, r.stderr


def test_a_debootstrap_killed_midway_leaves_nothing_the_next_cannot_remove(tmp_path):
    """A killed debootstrap leaves its target's /proc mounted; the next attempt's rmtree (and `rm -rf` of the
    cache) then failed on every file of it. unmount_under detaches it first (root: the only debootstrapper)."""
    from image_builder.oci.debian import unmount_under
    tmp = tmp_path / "debian-bookworm-x.tmp"
    (tmp / "proc").mkdir(parents=True)
    subprocess.run(["mount", "-t", "proc", "proc", str(tmp / "proc")], check=True)
    try:
        unmount_under(tmp)
        shutil.rmtree(tmp)
    finally:
        subprocess.run(["umount", "-l", str(tmp / "proc")], capture_output=True)
    assert not tmp.exists()


def test_base_python_lays_a_host_python_over_debian(tmp_path):
    """A Python built on this host (pyenv's: SWE-bench's 3.10 has no Debian release) made a base: a catalog
    builds on it, and in the store its interpreter (at /usr/local, finding its libpython there), its
    compiled modules and its pip (a script whose #! named the prefix) run."""
    prefix = _host_python()
    version = prefix.name.rsplit(".", 1)[0]
    layout = tmp_path / "bases"
    r = run_cli("base", "python", str(prefix), "-o", str(layout), "--cache-dir", str(TEST_CACHE))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"oci:{layout}:python-{version}"
    check = "import sys, ssl, sqlite3, ctypes; print('%d.%d' % sys.version_info[:2], sys.prefix)"
    out = build_and_run(tmp_path, r.stdout.strip(), f'python -c "{check}" && pip --version | cut -d" " -f1 && '
                                                    f'ls /usr/local/lib/python{version}/test 2>&1 | grep -c "No such"')
    assert out.split() == [version, "/usr/local", "pip", "1"], out


def _host_python() -> Path:
    """A Python this machine's kind carries beside its own (pyenv's), 3.10 where there is one."""
    versions = sorted((Path.home() / ".pyenv/versions").glob("3.*"))
    assert versions, "this test needs a Python built on the host: ~/.pyenv/versions/3.X.Y"
    return next((v for v in versions if v.name.startswith("3.10.")), versions[0])
