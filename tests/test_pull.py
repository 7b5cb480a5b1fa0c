"""Pulling from real registries over HTTPS: formats, auth, faults, cache, concurrency."""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing
import time
from dataclasses import replace

import pytest
import zstandard

from image_builder.oci.cache import BlobCache, sha256_file
from image_builder.oci.manifest import ManifestError, Platform
from image_builder.oci.pull import pull
from image_builder.oci.registry import RegistryError, RegistryOptions
from tests.conftest import run_cli
from tests.support.oci import Entry, tar_bytes
from tests.support.servers import Fault, FaultProxy, write_auth_file

AMD64 = Platform("linux", "amd64")


def blob_paths(cache: BlobCache) -> list:
    return sorted(p.name for p in (cache.root / "blobs" / "sha256").iterdir())


def test_multi_layer_pull_verifies_and_caches_every_blob(registries, images, cache, options):
    img = pull(f"{registries.open.host}/test/multi:1", cache=cache, options=options, platform=AMD64)
    assert img.digest == images.multi.digest
    assert [layer.digest for layer in img.layers] == [b.digest for b in images.multi_layers]
    for layer, blob in zip(img.layers, images.multi_layers):
        assert layer.path.read_bytes() == blob.data
        assert sha256_file(layer.path) == layer.digest
        assert layer.path.stat().st_mode & 0o222 == 0, "cached blobs are read-only"
    assert img.layers[1].media_type.endswith("+zstd") and img.layers[2].media_type.endswith(".tar")
    assert img.env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert not list((cache.root / "partial").iterdir())


def test_pulled_layers_flatten_with_whiteouts(registries, images, cache, options, tmp_path):
    from image_builder.oci.layers import flatten
    img = pull(f"{registries.open.host}/test/multi:1", cache=cache, options=options, platform=AMD64)
    root = tmp_path / "root"
    flatten([layer.path for layer in img.layers], root)
    assert (root / "etc/b").read_bytes() == b"b2"
    assert (root / "etc/c").read_bytes() == b"c2"
    assert not (root / "etc/a").exists()
    assert sorted(p.name for p in (root / "etc/dir").iterdir()) == ["y"]
    assert (root / "usr/bin/tool").stat().st_mode & 0o777 == 0o755
    assert not [p for p in root.rglob("*") if p.name.startswith(".wh.")]


@pytest.mark.parametrize("arch,variant", [("amd64", None), ("arm64", "v8"), ("arm64", None)])
def test_platform_selection_from_an_oci_index(registries, images, cache, options, arch, variant):
    img = pull(f"{registries.open.host}/test/multiarch:1", cache=cache, options=options,
               platform=Platform("linux", arch, variant))
    assert img.index_digest == images.multiarch_index.digest
    assert img.digest == images.multiarch[arch].digest
    assert img.platform.startswith(f"linux/{arch}")
    assert arch.encode() in gzip.decompress(img.layers[0].path.read_bytes())


def test_attestation_entries_are_never_chosen(registries, images, cache, options):
    with pytest.raises(ManifestError, match=r"no image for platform unknown/unknown \(offered: linux/amd64, "
                                            r"linux/arm64/v8\)"):
        pull(f"{registries.open.host}/test/multiarch:1", cache=cache, options=options,
             platform=Platform("unknown", "unknown"))


def test_docker_manifest_list_and_schema2(registries, images, cache, options):
    img = pull(f"{registries.open.host}/test/docker:1", cache=cache, options=options, platform=AMD64)
    assert img.index_digest == images.docker_list.digest
    assert img.layers[0].media_type == "application/vnd.docker.image.rootfs.diff.tar.gzip"


def test_pull_by_digest_pins_the_manifest(registries, images, cache, options):
    ref = f"{registries.open.host}/test/multi@{images.multi.digest}"
    assert pull(ref, cache=cache, options=options).digest == images.multi.digest
    bad = f"{registries.open.host}/test/multi@sha256:{'0' * 64}"
    with pytest.raises(RegistryError, match="no such image"):
        pull(bad, cache=cache, options=options)


def test_private_ca_is_required(registries, images, cache):
    with pytest.raises(RegistryError, match="--ca-cert"):
        pull(f"{registries.open.host}/test/multi:1", cache=cache, options=RegistryOptions(attempts=1))
    img = pull(f"{registries.open.host}/test/multi:1", cache=cache,
               options=RegistryOptions(insecure_tls=frozenset({registries.open.host})))
    assert img.digest == images.multi.digest


def test_basic_auth_from_registry_auth_file(registries, images, cache, options, tmp_path, monkeypatch):
    ref = f"{registries.basic.host}/test/multi:1"
    with pytest.raises(RegistryError, match="requires a login"):
        pull(ref, cache=cache, options=options)
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(write_auth_file(tmp_path / "auth.json", registries.basic.host,
                                                                  "alice", "wrong")))
    with pytest.raises(RegistryError, match="denied as 'alice'"):
        pull(ref, cache=cache, options=options)
    write_auth_file(tmp_path / "auth.json", registries.basic.host, "alice", "wonderland")
    assert pull(ref, cache=cache, options=options).digest == images.multi.digest


def test_docker_config_json_credentials(registries, images, cache, options, tmp_path, monkeypatch):
    (tmp_path / "dockercfg").mkdir()
    write_auth_file(tmp_path / "dockercfg" / "config.json", f"https://{registries.basic.host}", "alice",
                    "wonderland")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "dockercfg"))
    assert pull(f"{registries.basic.host}/test/multi:1", cache=cache, options=options).digest == images.multi.digest


def test_bearer_token_flow_with_scope(registries, images, cache, options):
    registries.issuer.requests.clear()
    img = pull(f"{registries.token.host}/test/multi:1", cache=cache, options=options)
    assert img.digest == images.multi.digest
    assert registries.issuer.requests, "the registry must have sent us to the token service"
    assert {r["scope"] for r in registries.issuer.requests} == {"repository:test/multi:pull"}
    assert {r["service"] for r in registries.issuer.requests} == {registries.issuer.service}


def test_token_expiring_mid_pull_is_renewed(registries, images, cache, tmp_path):
    """Tokens live 3 s; a proxy slows each blob by 1.5 s, so the first token dies mid-pull."""
    proxy = FaultProxy(registries.token.url, registries.tls).start()
    proxy.faults = [Fault(r"/blobs/", "delay", times=-1, delay=1.5)]
    issuer = registries.issuer
    issuer.requests.clear()
    old = issuer.lifetime
    issuer.lifetime = 3
    try:
        opts = RegistryOptions(ca_cert=registries.tls.cert, jobs=1)
        img = pull(f"{proxy.host}/test/big:1", cache=cache, options=opts)
    finally:
        issuer.lifetime = old
        proxy.stop()
    assert img.digest == images.big.digest
    assert len(issuer.requests) >= 2, "an expired token must be renewed, not fail the pull"
    assert [s for s in proxy.seen if s.path.startswith("/v2/test/big/blobs/")]


def test_503_storm_is_retried(proxy, images, cache, options):
    proxy.faults = [Fault(r"/manifests/", "status", times=3, status=503),
                    Fault(r"/blobs/", "status", times=4, status=502)]
    img = pull(f"{proxy.host}/test/multi:1", cache=cache, options=options)
    assert img.digest == images.multi.digest
    assert [f.times for f in proxy.faults] == [0, 0], "every injected fault was met and survived"


def test_503_forever_gives_up_with_a_clear_error(proxy, images, cache, options):
    proxy.faults = [Fault(r"/blobs/", "status", times=-1, status=503)]
    with pytest.raises(RegistryError, match=r"download failed after 6 attempts: .*HTTP 503"):
        pull(f"{proxy.host}/test/multi:1", cache=cache, options=options)


def test_429_honours_retry_after(proxy, images, cache, options):
    proxy.faults = [Fault(r"/blobs/", "status", times=1, status=429, headers={"Retry-After": "1"})]
    t0 = time.monotonic()
    pull(f"{proxy.host}/test/multi:1", cache=cache, options=replace(options, jobs=1))
    assert time.monotonic() - t0 >= 1.0, "the client must wait as long as Retry-After asks"
    assert proxy.faults[0].times == 0


def test_truncated_body_resumes_with_range(proxy, images, cache, options):
    layer = images.big_layers[1]
    proxy.faults = [Fault(layer.digest, "truncate", times=2)]
    img = pull(f"{proxy.host}/test/big:1", cache=cache, options=options)
    assert img.layers[1].path.read_bytes() == layer.data
    gets = proxy.requests_to(layer.digest, "GET")
    ranges = [s.headers.get("Range") for s in gets]
    assert ranges[0] is None and len(gets) == 3
    assert ranges[1] == f"bytes={len(layer.data) // 2}-", "the second try resumes where the first stopped"


def test_corrupted_blob_is_fetched_again_once(proxy, images, cache, options):
    layer = images.big_layers[0]
    proxy.faults = [Fault(layer.digest, "corrupt", times=1)]
    img = pull(f"{proxy.host}/test/big:1", cache=cache, options=options)
    assert sha256_file(img.layers[0].path) == layer.digest


def test_always_corrupt_blob_fails_and_caches_nothing(proxy, images, cache, options):
    layer = images.big_layers[0]
    proxy.faults = [Fault(layer.digest, "corrupt", times=-1)]
    with pytest.raises(RegistryError, match="digest mismatch"):
        pull(f"{proxy.host}/test/big:1", cache=cache, options=options)
    assert layer.digest[7:] not in blob_paths(cache)
    assert not list((cache.root / "partial").iterdir())


def test_authorization_never_follows_a_redirect_to_another_host(registries, images, cache, tmp_path, monkeypatch):
    proxy = FaultProxy(registries.basic.url, registries.tls, direct=registries.open.url).start()
    try:
        proxy.faults = [Fault(r"/blobs/", "redirect", times=-1)]
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(write_auth_file(tmp_path / "a.json", proxy.host, "alice",
                                                                      "wonderland")))
        opts = RegistryOptions(ca_cert=registries.tls.cert)
        img = pull(f"{proxy.host}/test/multi:1", cache=cache, options=opts)
    finally:
        proxy.stop()
    assert img.digest == images.multi.digest
    redirected = [s for s in proxy.seen if s.path.startswith("/direct/")]
    assert redirected, "blobs must have been fetched through the redirect"
    assert all("Authorization" not in s.headers for s in redirected)
    assert any("Authorization" in s.headers for s in proxy.seen if s.path.startswith("/v2/test/multi/manifests"))


def test_warm_cache_pull_sends_no_blob_or_manifest_get(proxy, images, cache, options):
    ref = f"{proxy.host}/test/multi:1"
    pull(ref, cache=cache, options=options)
    proxy.seen.clear()
    img = pull(ref, cache=cache, options=options)
    assert img.digest == images.multi.digest
    assert not proxy.requests_to("/blobs/"), "a warm pull must not request any blob"
    assert not proxy.requests_to("/manifests/", "GET")
    assert len(proxy.requests_to("/manifests/", "HEAD")) == 1


def _pull_in_process(args):
    ref, cache_dir, ca = args
    img = pull(ref, cache=BlobCache(cache_dir), options=RegistryOptions(ca_cert=ca, jobs=3))
    return [layer.digest for layer in img.layers]


def test_concurrent_pulls_share_one_verified_copy(registries, images, tmp_path):
    ref = f"{registries.open.host}/test/big:1"
    args = (ref, tmp_path / "shared", registries.tls.cert)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.map(_pull_in_process, [args, args])
    assert results[0] == results[1] == [b.digest for b in images.big_layers]
    cache = BlobCache(tmp_path / "shared")
    for b in images.big_layers:
        assert sha256_file(cache.path(b.digest)) == b.digest
    assert len(blob_paths(cache)) == 3 + 2  # layers, config, manifest
    assert not list((cache.root / "partial").iterdir())


def test_rootfs_tarball_base_is_verified(proxy, cache, options, tmp_path):
    from image_builder.oci.layers import flatten
    data = zstandard.ZstdCompressor().compress(tar_bytes([Entry("etc/os-release", b"ID=test\n")]))
    proxy.files["rootfs.tar.zst"] = data
    digest = hashlib.sha256(data).hexdigest()
    img = pull(f"https://{proxy.host}/files/rootfs.tar.zst#sha256={digest}", cache=cache, options=options)
    flatten([img.layers[0].path], tmp_path / "root")
    assert (tmp_path / "root/etc/os-release").read_text() == "ID=test\n"
    with pytest.raises(RegistryError, match="digest mismatch"):
        pull(f"https://{proxy.host}/files/rootfs.tar.zst#sha256={'1' * 64}", cache=cache, options=options)
    with pytest.raises(RegistryError, match="needs its digest"):
        pull(f"https://{proxy.host}/files/rootfs.tar.zst", cache=cache, options=options)


def test_cli_pull_json_and_rootfs(registries, images, tmp_path):
    r = run_cli("pull", f"{registries.open.host}/test/multi:1", "--ca-cert", str(registries.tls.cert),
                "--cache-dir", str(tmp_path / "c"), "--platform", "linux/amd64", "--json",
                "--rootfs", str(tmp_path / "root"))
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["digest"] == images.multi.digest
    assert [layer["digest"] for layer in record["layers"]] == [b.digest for b in images.multi_layers]
    assert (tmp_path / "root/etc/c").read_bytes() == b"c2"


def test_cli_plain_log_lines_off_a_terminal(registries, images, tmp_path):
    r = run_cli("pull", f"{registries.open.host}/test/big:1", "--ca-cert", str(registries.tls.cert),
                "--cache-dir", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("done,") == 3 and "MB/s" in r.stderr
    assert images.big.digest in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["Not/Valid:ref"], "invalid repository name"),
    (["127.0.0.1:1/none:1", "--platform", "linux"], "invalid platform 'linux'"),
])
def test_cli_errors_are_one_line(args, needle, tmp_path):
    r = run_cli("pull", *args, "--cache-dir", str(tmp_path / "c"))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
