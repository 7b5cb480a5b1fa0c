"""Session fixtures: real registries over TLS on 127.0.0.1, seeded with test images."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest

from image_builder.devtools.hpcfuse import open_fuse_to_users, restore_fuse
from image_builder.devtools.localregistry import (CertPair, LocalRegistry, push_image,
                                                  self_signed_cert as self_signed, start_registry)
from image_builder.oci.cache import BlobCache
from image_builder.oci.debian import debian_rootfs
from image_builder.oci.layout import rootfs_layer
from image_builder.oci.registry import RegistryOptions
from image_builder.store.store import remove_tree
from tests.support import oci
from tests.support.bases import tiny_rootfs
from tests.support.oci import Entry
from tests.support.servers import FaultProxy, TokenIssuer

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_TOOLS = ["docker-registry", "mksquashfs", "unsquashfs", "squashfuse_ll", "siftool", "skopeo", "openssl",
                  "setpriv", "unshare", "fusermount3"]


def pytest_sessionstart(session):
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:  # never skip: the suite is only meaningful with the real tools
        raise pytest.UsageError(f"missing tools {missing}: run `make test`, which installs them")
    if os.geteuid() != 0:  # the rootless paths are tested by dropping to uid 65534 from root
        raise pytest.UsageError("run the tests as root (`make test`): they drop to an unprivileged user themselves")


# /dev/fuse mode 666 for the rootless tests, as on HPC hosts, and the mode found put back by the last
# session to end (devtools/hpcfuse.py). Once in the controller, before xdist's workers start and after they end.
_SESSION_LOCK = pytest.StashKey()


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        config.stash[_SESSION_LOCK] = open_fuse_to_users()


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller, once its workers have ended
        for path in Path("/var/tmp").glob("ib-tests-run-*"):
            if path == _run_dir_path() or not _alive(*path.name.split("-")[3:5]):  # this run's, or a killed run's
                remove_tree(path)
    restore_fuse(config.stash.get(_SESSION_LOCK, None))


# `make test` runs the tests on two xdist workers (--dist loadgroup), each making the session
# fixtures its own tests use. Tests that must not run at the same time carry one
# `xdist_group` mark; xdist gives the group one worker by a suffix on their node ids, which
# pytest 9.2 no longer takes (a group then raced over both workers: CI failed once on it).
# pytest_collection_finish checks that the suffix is there.


@pytest.hookimpl(trylast=True)  # after -m has deselected: `make test` leaves the shared_data tests out
def pytest_collection_modifyitems(config, items):
    needing = [item for item in items if item.get_closest_marker("shared_data")]
    if needing and not SHARED_DATA.is_dir():
        raise pytest.UsageError(f"{len(needing)} selected tests read the shared sample data, expected in {SHARED_DATA} "
                                "(set IMAGE_BUILDER_SHARED_DATA to its data/ folder, or run `make test`, which leaves "
                                "them out)")


def pytest_collection_finish(session):
    if getattr(session.config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if lost:
            raise pytest.UsageError(f"xdist did not group {lost[0]} (and {len(lost) - 1} more): this pytest and "
                                    "pytest-xdist do not work together; see the pytest pin in pyproject.toml")


@pytest.fixture(autouse=True)
def no_host_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)


@dataclass
class Registries:
    tls: CertPair
    open: LocalRegistry
    basic: LocalRegistry
    token: LocalRegistry
    issuer: TokenIssuer
    users: dict[str, str]
    pusher: oci.Pusher


@pytest.fixture(scope="session")
def registries(tmp_path_factory):
    work = tmp_path_factory.mktemp("registries")
    tls = self_signed(work, "server")
    storage = work / "storage"
    storage.mkdir()
    users = {"alice": "wonderland"}
    htpasswd = work / "htpasswd"
    htpasswd.write_text("".join(f"{u}:{bcrypt.hashpw(p.encode(), bcrypt.gensalt(rounds=4)).decode()}\n"
                                for u, p in users.items()))
    issuer = TokenIssuer(self_signed(work, "token-signer", cn="image-builder-test-issuer"), tls).start()
    started = []
    try:
        started.append(start_registry(work, "open", storage, tls))
        started.append(start_registry(work, "basic", storage, tls,
                                      {"htpasswd": {"realm": "image-builder-test", "path": str(htpasswd)}}))
        started.append(start_registry(work, "token", storage, tls, {"token": {
            "realm": issuer.realm, "service": issuer.service, "issuer": issuer.issuer,
            "rootcertbundle": str(issuer.signing.cert)}}))
        yield Registries(tls, *started, issuer, users, oci.Pusher(started[0].url, str(tls.cert)))
    finally:
        for reg in started:
            reg.stop()
        issuer.stop()


@dataclass
class TestImages:
    multi: oci.Blob  # manifest of test/multi:1
    multi_layers: list[oci.Blob]
    multiarch_index: oci.Blob
    multiarch: dict[str, oci.Blob]  # arch -> manifest
    docker_list: oci.Blob
    big: oci.Blob
    big_layers: list[oci.Blob]


def _arch_image(pusher, repo: str, arch: str, docker: bool = False) -> oci.Blob:
    layer = oci.layer([Entry("arch", arch.encode())], "gzip", docker=docker)
    return pusher.image(repo, arch, oci.config_blob(arch, docker=docker), [layer], docker=docker)


@pytest.fixture(scope="session")
def images(registries) -> TestImages:
    p = registries.pusher
    multi_layers = [
        oci.layer([Entry("etc", kind="dir", mode=0o755), Entry("etc/a", b"a1"), Entry("etc/b", b"b1"),
                   Entry("etc/dir", kind="dir", mode=0o755), Entry("etc/dir/x", b"x1"),
                   Entry("usr/bin/tool", b"#!/bin/sh\n", mode=0o755)], "gzip"),
        oci.layer([Entry("etc/.wh.a"), Entry("etc/c", b"c2"), Entry("etc/b", b"b2")], "zstd"),
        oci.layer([Entry("etc/dir/.wh..wh..opq"), Entry("etc/dir/y", b"y3")], "none"),
    ]
    multi = p.image("test/multi", "1", oci.config_blob(), multi_layers)

    # Each manifest an index names must already be in the index's repository.
    per_arch = {a: _arch_image(p, "test/multiarch", a) for a in ("amd64", "arm64")}
    attestation = p.image("test/multiarch", "att", oci.config_blob("unknown"),
                          [oci.layer([Entry("att", b"sbom")])])
    idx = oci.index([(attestation, {"os": "unknown", "architecture": "unknown"},
                      {"vnd.docker.reference.type": "attestation-manifest",
                       "vnd.docker.reference.digest": per_arch["amd64"].digest}),
                     (per_arch["amd64"], {"os": "linux", "architecture": "amd64"}, None),
                     (per_arch["arm64"], {"os": "linux", "architecture": "arm64", "variant": "v8"}, None)])
    p.manifest("test/multiarch", "1", idx)

    docker_amd64 = _arch_image(p, "test/docker", "amd64", docker=True)
    dlist = oci.index([(docker_amd64, {"os": "linux", "architecture": "amd64"}, None)], docker=True)
    p.manifest("test/docker", "1", dlist)

    big_layers = [oci.layer([Entry(f"data/{i}.bin", os.urandom(3 << 20))], "gzip") for i in range(3)]
    big = p.image("test/big", "1", oci.config_blob(), big_layers)
    return TestImages(multi, multi_layers, idx, per_arch, dlist, big, big_layers)


TEST_CACHE = Path.home() / ".cache" / "image_builder-tests"  # outside the checkout: reruns reuse it
DATA = ROOT / "index" / "data"  # the samples the shipped catalogs and the demo use: in every clone
# The project's larger shared sample data (the pytest and pylint bundles, 69 MB), beside the
# checkout where CI has it; only the tests marked `shared_data` read it (`make test-shared`).
SHARED_DATA = Path(os.environ.get("IMAGE_BUILDER_SHARED_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def public_dir():
    """A directory every user can read: pytest's own tmp is private to root."""
    path = Path(tempfile.mkdtemp(prefix="ib-tests-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    remove_tree(path)


@pytest.fixture(scope="session")
def public_ca(registries, public_dir) -> Path:
    dest = public_dir / "ca.pem"
    shutil.copy(registries.tls.cert, dest)
    dest.chmod(0o644)
    return dest


@pytest.fixture(scope="session")
def tiny_base(registries, tmp_path_factory) -> str:
    """A couple-of-MB image with dash and coreutils, as test/tiny:1."""
    work = tmp_path_factory.mktemp("tiny")
    root = tiny_rootfs(work / "rootfs")
    push_image(registries.open.url, "test/tiny", "1", [rootfs_layer(root, work / "tiny.tar.gz")],
               ca=registries.tls.cert)
    return f"{registries.open.host}/test/tiny:1"


def _debian_image(registries, suite: str) -> str:
    """A Debian minbase with python3, venv and git (debootstrap once, cached), as test/debian:SUITE."""
    root = debian_rootfs(suite, TEST_CACHE)
    layer = rootfs_layer(root, TEST_CACHE / f"{root.name}.tar.gz")
    push_image(registries.open.url, "test/debian", suite, [layer], ca=registries.tls.cert)
    return f"{registries.open.host}/test/debian:{suite}"


@pytest.fixture(scope="session")
def debian_base(registries) -> str:
    return _debian_image(registries, "bookworm")  # Python 3.11


@pytest.fixture(scope="session")
def debian_bullseye_base(registries) -> str:
    return _debian_image(registries, "bullseye")  # Python 3.9


def _start_time(pid: int | str) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _alive(pid: str, start: str) -> bool:
    try:
        return _start_time(pid) == start
    except (OSError, IndexError):
        return False


def run_dir() -> Path:
    """A directory every user can read, shared by this run's xdist workers, removed when the run ends (by
    pytest_unconfigure, or by the next run if this one is killed). Named by the controller's pid (an xdist
    worker's parent) and start time: a later process with that pid names another."""
    path = _run_dir_path()
    path.mkdir(mode=0o755, exist_ok=True)
    return path


def _run_dir_path() -> Path:
    pid = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    return Path("/var/tmp") / f"ib-tests-run-{pid}-{_start_time(pid)}"


def built_once(name: str, catalog: Path, bases: dict[str, str], registries: Registries) -> Path:
    """`catalog` built for real into a store the run's xdist workers share (run_dir: every user may read
    it): the first worker to ask builds it, the other waits on the lock and finds it built (each worker
    built its own: 60 s more of a worker's time for the marshmallow store, 46 s for the sandbox languages',
    45 for MBPP's). Tests only read it (a test that changes a store copies it first)."""
    from image_builder.build.catalog import load
    from image_builder.build.envbuild import BuildOptions
    from image_builder.build.storebuild import StoreBuildOptions, build_store
    work = run_dir() / f"built-{name}"
    work.mkdir(mode=0o755, exist_ok=True)
    with open(work / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (work / "built").exists():
            build = BuildOptions(store=work / "store", cache=BlobCache(work / "cache"),
                                 registry=RegistryOptions(ca_cert=registries.tls.cert))
            summary = build_store(load(catalog, bases=bases), StoreBuildOptions(build, jobs=2))
            assert not summary.failed, [(f.message, f.tail) for f in summary.failed]
            (work / "built").touch()
    return work / "store"


@pytest.fixture(scope="session")
def marshmallow_store(registries, debian_base, debian_bullseye_base) -> Path:
    """index/swebench-marshmallow.yaml built for real: two environments, two instances."""
    return built_once("marshmallow", ROOT / "index/swebench-marshmallow.yaml",
                      {"bookworm-python": debian_base, "bullseye-python": debian_bullseye_base}, registries)


@pytest.fixture(scope="session")
def public_store(marshmallow_store, public_dir) -> Path:
    """The marshmallow store where uid 65534 can read it (hard links, no copy)."""
    dest = public_dir / "marshmallow-store"
    shutil.copytree(marshmallow_store, dest, copy_function=os.link)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


@pytest.fixture(scope="session")
def mbpp_store(registries, debian_base) -> Path:
    """index/mbpp.yaml built for real: one Python environment, the 40 sample tasks as instances."""
    return built_once("mbpp", ROOT / "index/mbpp.yaml", {"python": debian_base}, registries)


@pytest.fixture
def cache(tmp_path) -> BlobCache:
    return BlobCache(tmp_path / "cache")


@pytest.fixture
def options(registries) -> RegistryOptions:
    return RegistryOptions(ca_cert=registries.tls.cert, backoff=0.01, max_backoff=0.05)


@pytest.fixture
def proxy(registries):
    """A fault proxy in front of the open registry; redirects go to the open registry too."""
    p = FaultProxy(registries.open.url, registries.tls, direct=registries.open.url).start()
    yield p
    p.stop()


def stop_when(proc: subprocess.Popen, ready, how: int, wait: float = 120) -> tuple[str, str, float]:
    """Once `ready()` (within `wait` seconds, proc still running), send proc the signal `how`: its stdout,
    stderr, and the seconds it took to end after the signal."""
    deadline = time.monotonic() + wait
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    t0 = time.monotonic()
    proc.send_signal(how)
    out, err = proc.communicate(timeout=60)
    return out, err, time.monotonic() - t0


def run_cli(*args: str, env: dict | None = None, user: int | None = None, check: bool = False,
            input: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The installed console script, as a real process (optionally as another uid)."""
    exe = Path(os.environ.get("VIRTUAL_ENV", Path(__file__).resolve().parents[1] / ".venv")) / "bin" / "image-builder"
    cmd = [str(exe), *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                          check=check, input=input, cwd=cwd)
