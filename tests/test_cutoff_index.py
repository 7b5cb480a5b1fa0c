"""The cut-off index (build/cutoff_index.py): a build step's pips resolve as of its PIP_UPLOADED_PRIOR_TO,
whatever their version, through a real build over a package index served here (PEP 691 JSON)."""

from __future__ import annotations

import hashlib
import http.server
import subprocess
import sys
from pathlib import Path

import yaml

from image_builder.build.catalog import load
from tests.conftest import TEST_CACHE
from tests.support.simple_index import serve_index
from tests.test_checkpoints import wheel
from tests.test_envbuild import ROOT, build_env, options, sif_files, write_catalog

UPLOADED = {"1.0": "2020-01-01T00:00:00Z", "2.0": "2023-01-01T00:00:00Z"}
PIP = "pip-26.0.1-py3-none-any.whl"  # a pip that takes the cut-off itself (from PyPI once, kept in TEST_CACHE)


def serve_lib_tool_and_pip(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """`lib` and `tool`, 1.0 and 2.0 each, and pip 26, with their upload times, as PyPI's JSON simple API
    has them."""
    pages = {}
    for name in ("lib", "tool"):
        for version in UPLOADED:
            wheel(folder, name, version)
        pages[name] = [{"filename": f"{name}-{v}-py3-none-any.whl", "url": f"../../files/{name}-{v}-py3-none-any.whl",
                        "upload-time": when} for v, when in UPLOADED.items()]
    if not (TEST_CACHE / "wheels" / PIP).exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", str(TEST_CACHE / "wheels"), "pip==26.0.1"], check=True)
    (folder / PIP).write_bytes((TEST_CACHE / "wheels" / PIP).read_bytes())
    pages["pip"] = [{"filename": PIP, "url": f"../../files/{PIP}", "upload-time": "2026-01-30T00:00:00Z"}]
    for entries in pages.values():
        for f in entries:
            f["hashes"] = {"sha256": hashlib.sha256((folder / f["filename"]).read_bytes()).hexdigest()}
    return serve_index(pages, folder)


def test_a_cut_off_holds_for_every_pip(tmp_path, debian_base, registries):
    """Debian 12's venv pip (23.0.1; every Python before 3.9 has a pip before 26) reads no
    PIP_UPLOADED_PRIOR_TO: it took lib 2.0, uploaded after the cut-off. Served the index as of the cut-off,
    it takes 1.0, and so does pip 26, which takes the cut-off itself and refuses an index without upload
    times (the HTML pages of this index's first version); with no cut-off, 2.0. What a script installs as of
    today on purpose (PIP_FOR_INSTALL, the pip upgrade) takes the real index: tool 2.0, pip 26."""
    server, index = serve_lib_tool_and_pip(tmp_path / "files")
    scripts = {"python-venv.sh": (ROOT / "env_scripts/python-venv.sh").read_text()}
    env = {"VENV": "/opt/venv", "PIP_INDEX_URL": index, "PYTHON_PACKAGES": "lib", "PIP_FOR_INSTALL": "tool==2.0",
           "PIP_UPLOADED_PRIOR_TO": "2021-06-01T00:00:00Z"}
    cases = {"pip23": env, "pip26": {**env, "PIP_VERSION": "pip==26.0.1"},
             "uncut": {k: v for k, v in env.items() if k != "PIP_UPLOADED_PRIOR_TO"}}
    got = {}
    try:
        for name, case_env in cases.items():
            work = tmp_path / name
            work.mkdir()
            cat = write_catalog(work, [{"name": "e", "base": debian_base, "scripts": ["python-venv.sh"],
                                        "env": case_env}], scripts)
            result = build_env(load(cat).environments["e"], options(work, registries.tls.cert))
            site = "opt/venv/lib/python3.11/site-packages"
            got[name] = tuple(v.split("'")[1] for v in sif_files(
                result.sif, work, f"{site}/lib/__init__.py", f"{site}/tool/__init__.py").values())
    finally:
        server.shutdown()
    assert got == {"pip23": ("1.0", "2.0"), "pip26": ("1.0", "2.0"), "uncut": ("2.0", "2.0")}
    for name in ("pip23", "pip26"):
        lines = next((tmp_path / name / "store").rglob("*python-venv.sh.log")).read_text().splitlines()
        assert lines[lines.index("Collecting lib") - 1] != f"Looking in indexes: {index}", "lib: the cut-off index"
        assert lines[lines.index("Collecting tool==2.0") - 1] == f"Looking in indexes: {index}", "tool: the real one"
    assert "Successfully installed pip-26.0.1" in next((tmp_path / "pip26/store").rglob("*.log")).read_text()
    assert yaml.safe_load((tmp_path / "pip23/catalog.yaml").read_text())["environments"][0]["env"]["PIP_INDEX_URL"] \
        == index, "the catalog names the real index"
