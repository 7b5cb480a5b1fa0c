"""Files a build downloads from its project's own site (build/downloads.py): fetched once by the catalog from
the first source with the right bytes, carried into the environment, found there by pre_install's wget and
by the build (unpacked where it looks first), so neither the build nor the grader's reinstall reaches out.
matplotlib's qhull and FreeType are the real case; a local server stands for their sites here."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import subprocess
import tarfile
import threading

import pytest

from image_builder.build import downloads
from image_builder.build.catalog import load
from image_builder.build.envbuild import BuildOptions
from image_builder.build.swebench_catalog import load_swebench, spec_of
from image_builder.oci.cache import BlobCache
from image_builder.oci.registry import RegistryOptions
from tests.conftest import run_cli
from tests.test_checkpoints import GIT, commit
from tests.test_grading import build_and_grade_gold_and_empty
from tests.test_runner_tee import file_diff


def tarball(files: dict[str, bytes], mode: str = "w:gz") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


class Files(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.server.asked.append(self.path)
        data = self.server.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def log_message(self, *args):
        pass


@pytest.fixture
def site():
    """A web server of `files` (path -> bytes) on 127.0.0.1, recording what is asked of it."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    server.files, server.asked = {}, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()


def test_a_version_asks_for_what_its_pre_install_or_its_build_fetches():
    """matplotlib 3.5-3.9's spec wgets qhull; its setupext.py fetches FreeType 2.6.1 (3.3-3.4 name it
    directly, 3.5+ through TESTING_VERSION_OF_FREETYPE); scikit-learn's build asks for neither."""
    constants = load_swebench()
    mpl = spec_of(constants, "matplotlib/matplotlib", "3.6")
    setupext = {"setupext.py": "TESTING_VERSION_OF_FREETYPE = '2.6.1'\nLOCAL_QHULL_VERSION = '2020.2'\n"}
    assert downloads.asked(mpl.pre_install, setupext.get) == [downloads.QHULL, downloads.FREETYPE]
    assert downloads.asked(mpl.pre_install, {}.get) == [downloads.QHULL]
    assert downloads.asked((), {"setupext.py": "LOCAL_FREETYPE_VERSION = '2.6.1'"}.get) == [downloads.FREETYPE]
    assert downloads.asked((), {"setupext.py": "LOCAL_FREETYPE_VERSION = '2.11.1'"}.get) == []
    sklearn = spec_of(constants, "scikit-learn/scikit-learn", "1.3")
    assert downloads.asked(sklearn.pre_install, {}.get) == []


def test_a_download_comes_from_the_first_source_with_its_bytes_and_is_kept(site, tmp_path):
    """Upstream gone (404), a mirror with other bytes (refused), an orig tarball holding upstream's: the
    member is taken and checked; asked again, nothing is fetched. No source: one line naming each URL and
    where to put the file by hand."""
    wanted = b"int qh_version = 2020;\n"
    site.files = {"/other/lib-1.0.tar.bz2": b"not it",
                  "/orig/lib_1.0.orig.tar.gz": tarball({"lib-1.0/lib-1.0.tar.bz2": wanted,
                                                        "lib-1.0/lib-doc-1.0.tar.bz2": b"docs"})}
    download = downloads.Download(
        "lib-1.0.tar.bz2", hashlib.sha256(wanted).hexdigest(), "lib-1.0", "build", (),
        (downloads.Source(f"{site.url}/upstream/lib-1.0.tar.bz2"),
         downloads.Source(f"{site.url}/other/lib-1.0.tar.bz2"),
         downloads.Source(f"{site.url}/orig/lib_1.0.orig.tar.gz", "lib-1.0/lib-1.0.tar.bz2")))
    path = downloads.fetch(download, tmp_path / "cache")
    assert path.read_bytes() == wanted
    assert site.asked == ["/upstream/lib-1.0.tar.bz2", "/other/lib-1.0.tar.bz2", "/orig/lib_1.0.orig.tar.gz"]
    assert downloads.fetch(download, tmp_path / "cache") == path and len(site.asked) == 3

    lost = downloads.Download("gone.tgz", "0" * 64, "", "", (), (downloads.Source(f"{site.url}/a/gone.tgz"),
                                                                 downloads.Source(f"{site.url}/other/lib-1.0.tar.bz2")))
    with pytest.raises(downloads.DownloadError) as e:
        downloads.fetch(lost, tmp_path / "cache")
    message = str(e.value)
    assert "\n" not in message and f"{site.url}/a/gone.tgz (HTTPError" in message
    assert f"{site.url}/other/lib-1.0.tar.bz2 (sha256 " in message and str(tmp_path / "cache" / "gone.tgz") in message
    assert not (tmp_path / "cache" / "gone.tgz").exists()


@pytest.mark.parametrize("entry, says", [
    ({"name": "x.tgz", "sha256": "0" * 64}, "urls must be a list"),
    ({"name": "x.tgz", "sha256": "abc", "urls": ["http://h/x.tgz"]}, "sha256 must be 64"),
    ({"name": "../x.tgz", "sha256": "0" * 64, "urls": ["http://h/x.tgz"]}, "name must be a file name"),
    ({"name": "x.tgz", "sha256": "0" * 64, "urls": ["file:///etc/passwd"]}, "is not an http(s) URL"),
    ({"name": "x.tgz", "sha256": "0" * 64, "urls": ["http://h/x.tgz"], "tree": "x"}, "go together"),
    ({"name": "x.tgz", "sha256": "0" * 64, "urls": ["http://h/x.tgz"], "tree": "x", "unpack_into": "../.."},
     "go together"),
    ({"name": "x.tgz", "sha256": "0" * 64, "urls": ["http://h/x.tgz"], "size": 3}, "unknown key 'size'"),
])
def test_a_specs_file_download_is_checked(entry, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        downloads.from_specs(entry)


SETUP = """import os
# As matplotlib's setupext.py: the tree under build/ first, else a download (which cannot be had here).
assert os.path.exists("build/lib-1.0/lib.h"), "lib-1.0 is not under build/, and its site is out of reach"
from setuptools import setup
setup(name="fetching", version="1.0", py_modules=["fetching"], setup_requires=["six"])
"""
FIXED_SETUP = SETUP.replace('version="1.0"', 'version="1.1"')
SOURCE = "def lib_version():\n    return 2019\n"
FIXED_SOURCE = "def lib_version():\n    return 2020\n"
TESTS = """import os


def test_version():
    from fetching import lib_version
    assert lib_version() == 2020


def test_lib_unpacked():
    assert open(os.path.join(os.path.dirname(__file__), "..", "build", "lib-1.0", "lib.h")).read() == "2020\\n"
"""


@pytest.mark.timeout(900)
def test_a_build_that_downloads_finds_its_files_carried_in(tmp_path, site, registries, debian_bullseye_base):
    """A repository as matplotlib is: pre_install wgets a tarball (SWE-bench's lines, its URL in a
    variable), its setup.py needs a tree under build/ (or else downloads it) and names setup_requires (which
    pip's isolated build installs: the environment keeps them as wheels too). The files come from the
    specs file's `downloads` at catalog time; the site is then shut, and the build (whose image has no wget)
    and the grader's offline reinstall after a patch to setup.py still succeed: gold resolves, empty not."""
    lib = tarball({"lib-1.0/lib.h": b"2020\n"})
    site.files = {"/dl/lib-1.0.tgz": lib}
    repo = tmp_path / "repos/fetching"
    repo.mkdir(parents=True)
    subprocess.run([*GIT, "init", "-q", str(repo)], check=True)
    base = commit(repo, {".gitignore": "build\n", "setup.py": SETUP, "fetching.py": SOURCE}, "base")
    fix = file_diff("fetching.py", SOURCE, FIXED_SOURCE) + file_diff("setup.py", SETUP, FIXED_SETUP)
    row = {"repo": "acme/fetching", "instance_id": "acme__fetching-1", "version": "1.0", "base_commit": base,
           "environment_setup_commit": base, "created_at": "2024-06-01T00:00:00Z", "patch": fix,
           "test_patch": file_diff("tests/test_fetching.py", "", TESTS), "problem_statement": "old lib",
           "FAIL_TO_PASS": json.dumps(["tests/test_fetching.py::test_version"]),
           "PASS_TO_PASS": json.dumps(["tests/test_fetching.py::test_lib_unpacked"])}
    dataset = tmp_path / "fetching.jsonl"
    dataset.write_text(json.dumps(row) + "\n")
    pre_install = [f'LIB_URL="{site.url}/dl/lib-1.0.tgz"', 'wget -O /tmp/lib.tgz "$LIB_URL"',
                   "tar -xzf /tmp/lib.tgz -C /tmp", "test -f /tmp/lib-1.0/lib.h"]
    specs = {"acme/fetching": {
        "log_parser": "parse_log_pytest",
        "downloads": [{"name": "lib-1.0.tgz", "sha256": hashlib.sha256(lib).hexdigest(), "tree": "lib-1.0",
                       "unpack_into": "build", "urls": [f"{site.url}/gone/lib-1.0.tgz", f"{site.url}/dl/lib-1.0.tgz"]}],
        "versions": {"1.0": {"python": "3.9", "pre_install": pre_install, "install": "python -m pip install -e .",
                             "pip_packages": ["pytest"], "test_cmd": "pytest -rA"}}}}
    (tmp_path / "specs.yaml").write_text(json.dumps(specs))
    r = run_cli("swebench", "catalog", str(dataset), "--repos", str(tmp_path / "repos"), "-o",
                str(tmp_path / "swe.yaml"), "--specs", str(tmp_path / "specs.yaml"),
                "--python", f"3.9={debian_bullseye_base}")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "swe.d/envs/acme__fetching-1.0/downloads/lib-1.0.tgz").read_bytes() == lib
    site.files = {}  # the site is gone for the build and the grading
    asked = len(site.asked)
    build = BuildOptions(store=tmp_path / "store", cache=BlobCache(tmp_path / "cache"),
                         registry=RegistryOptions(ca_cert=registries.tls.cert))
    verdicts = build_and_grade_gold_and_empty(load(tmp_path / "swe.yaml"), build, dataset, row["instance_id"], fix,
                                              tmp_path)
    assert len(site.asked) == asked  # nothing fetched after the catalog
    gold = verdicts["gold"]["repo"]
    assert gold["resolved"] and gold["reinstall_exit_code"] == 0, verdicts["gold"]
    assert not verdicts["empty"]["repo"]["resolved"]
