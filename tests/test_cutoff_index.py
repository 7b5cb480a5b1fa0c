"""The cut-off index (build/cutoff_index.py): a build step's pips resolve as of its PIP_UPLOADED_PRIOR_TO,
whatever their version, through a real build over a package index served here (PEP 691 JSON)."""

from __future__ import annotations

import hashlib
import http.server
from pathlib import Path

import yaml

from image_builder.build.catalog import load
from tests.support.simple_index import serve_index
from tests.test_checkpoints import wheel
from tests.test_envbuild import ROOT, build_env, options, sif_files, write_catalog

UPLOADED = {"1.0": "2020-01-01T00:00:00Z", "2.0": "2023-01-01T00:00:00Z"}


def serve_lib_and_tool(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """`lib` and `tool`, 1.0 and 2.0 each, with their upload times, as PyPI's JSON simple API has them."""
    pages = {}
    for name in ("lib", "tool"):
        for version in UPLOADED:
            wheel(folder, name, version)
        pages[name] = [{"filename": f"{name}-{v}-py3-none-any.whl", "url": f"../../files/{name}-{v}-py3-none-any.whl",
                        "hashes": {"sha256": hashlib.sha256((folder / f"{name}-{v}-py3-none-any.whl").read_bytes())
                                   .hexdigest()}, "upload-time": when} for v, when in UPLOADED.items()]
    return serve_index(pages, folder)


def test_a_cut_off_holds_for_a_pip_that_takes_none(tmp_path, debian_base, registries):
    """Debian 12's venv pip (23.0.1; every Python before 3.9 has a pip before 26) reads no
    PIP_UPLOADED_PRIOR_TO: it took lib 2.0, uploaded after the cut-off. Served the index as of the cut-off,
    it takes 1.0; with no cut-off, 2.0. What a script installs as of today on purpose (PIP_FOR_INSTALL, as
    the pip upgrade) still takes the real index: tool 2.0."""
    server, index = serve_lib_and_tool(tmp_path / "files")
    scripts = {"python-venv.sh": (ROOT / "env_scripts/python-venv.sh").read_text()}
    env = {"VENV": "/opt/venv", "PIP_INDEX_URL": index, "PYTHON_PACKAGES": "lib", "PIP_FOR_INSTALL": "tool==2.0",
           "PIP_UPLOADED_PRIOR_TO": "2021-06-01T00:00:00Z"}
    try:
        got = []
        for name, cutoff in (("cut", True), ("uncut", False)):
            work = tmp_path / name
            work.mkdir()
            cat = write_catalog(work, [{"name": "e", "base": debian_base, "scripts": ["python-venv.sh"],
                                        "env": env if cutoff else {k: v for k, v in env.items()
                                                                   if k != "PIP_UPLOADED_PRIOR_TO"}}], scripts)
            result = build_env(load(cat).environments["e"], options(work, registries.tls.cert))
            site = "opt/venv/lib/python3.11/site-packages"
            got.append(tuple(sif_files(result.sif, work, f"{site}/lib/__init__.py", f"{site}/tool/__init__.py").values()))
    finally:
        server.shutdown()
    assert got == [("VERSION = '1.0'\n", "VERSION = '2.0'\n"), ("VERSION = '2.0'\n", "VERSION = '2.0'\n")]
    log = next((tmp_path / "cut/store").rglob("*python-venv.sh.log")).read_text()
    lines = log.splitlines()
    assert lines[lines.index("Collecting lib") - 1] != f"Looking in indexes: {index}", "lib: the cut-off index"
    assert lines[lines.index("Collecting tool==2.0") - 1] == f"Looking in indexes: {index}", "tool: the real one"
    assert yaml.safe_load((tmp_path / "cut/catalog.yaml").read_text())["environments"][0]["env"]["PIP_INDEX_URL"] \
        == index, "the catalog names the real index"
