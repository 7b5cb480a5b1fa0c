"""Checkpoint layers (build/checkpoints.py) built for real: swebench-repo.sh over a version's checkout, and
swebench-instance.sh over a checkpoint, keep SWE-bench's per-instance semantics: each instance's repository is
at its base commit with PRE_INSTALL's edits, installed at a commit with its install files, and nothing later."""

from __future__ import annotations

import subprocess
from pathlib import Path

from image_builder.build.catalog import load
from image_builder.build.envbuild import BuildOptions
from image_builder.build.storebuild import StoreBuildOptions, build_store
from image_builder.oci.cache import BlobCache
from image_builder.oci.registry import RegistryOptions
from image_builder.store.store import Store
from tests.test_repo_history import run_in

GIT = ["git", "-c", "core.hooksPath=/dev/null", "-c", "user.email=t@t", "-c", "user.name=t"]


def commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).write_text(text)
    subprocess.run([*GIT, "-C", str(repo), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(repo), "commit", "-q", "-m", message], check=True)
    return subprocess.run([*GIT, "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def bundle(repo: Path, dest: Path, head: str, since: str | None = None) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([*GIT, "-C", str(repo), "update-ref", "refs/heads/image-builder", head], check=True)
    subprocess.run([*GIT, "-C", str(repo), "bundle", "create", "-q", str(dest), "refs/heads/image-builder",
                    *([f"^{since}"] if since else [])], check=True)


PY = """
environments:
  - name: py
    base: BASE
    scripts: [python-venv.sh]
    env: {VENV: /opt/venv, PATH: "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
"""

CATALOG = PY + """  - name: v
    from: py
    scripts: [swebench-repo.sh]
    context: v
    env: &version
      REPO_BUNDLE: /build/repo.bundle
      BASE_COMMIT: C0
      PRE_INSTALL: "sed -i 's/^edited = no/edited = yes/' tox.ini"
      # An install that only records where it ran: pip's `freeze` around it still runs (held packages).
      INSTALL: "git rev-parse --short=7 HEAD >> /opt/installs"
  - name: v-at-c1
    from: v
    scripts: [swebench-repo.sh]
    context: c1
    env: {REPO_BUNDLE: /build/repo.bundle, BASE_COMMIT: C1, REINSTALL_WHEN: "setup.cfg"}
  - name: v-at-c2
    from: v-at-c1
    scripts: [swebench-repo.sh]
    context: c2
    env: {REPO_BUNDLE: /build/repo.bundle, BASE_COMMIT: C2, REINSTALL_WHEN: "setup.cfg"}
instances:
  - id: on-c2
    environment: v-at-c2
    script: swebench-instance.sh
    context: i3
    env: {BASE_COMMIT: C3, REINSTALL_WHEN: setup.cfg, INSTALL: "git rev-parse --short=7 HEAD >> /opt/installs",
          PRE_INSTALL: "sed -i 's/^edited = no/edited = yes/' tox.ini"}
    workdir: /testbed
  - id: tox-changed
    environment: v-at-c2
    script: swebench-instance.sh
    context: i4
    env: {BASE_COMMIT: C4, REINSTALL_WHEN: setup.cfg, INSTALL: "git rev-parse --short=7 HEAD >> /opt/installs",
          PRE_INSTALL: "sed -i 's/^edited = no/edited = yes/' tox.ini"}
    workdir: /testbed
"""


def build(tmp_path: Path, registries, catalog: str, values: dict[str, str]) -> Store:
    """`catalog` with its placeholders (": NAME") replaced, built into tmp_path/store."""
    for name, value in values.items():
        catalog = catalog.replace(f": {name}", f": {value}")
    (tmp_path / "catalog.yaml").write_text(catalog)
    options = BuildOptions(store=tmp_path / "store", cache=BlobCache(tmp_path / "cache"),
                           registry=RegistryOptions(ca_cert=registries.tls.cert))
    summary = build_store(load(tmp_path / "catalog.yaml"), StoreBuildOptions(options, jobs=2))
    assert not summary.failed, [(f.message, f.tail[-10:]) for f in summary.failed]
    return Store.open(tmp_path / "store")


def test_checkpoints_carry_pre_install_and_reinstall_only_where_install_files_change(tmp_path, registries,
                                                                                     debian_base):
    repo = tmp_path / "repo"
    subprocess.run([*GIT, "init", "-q", str(repo)], check=True)
    c0 = commit(repo, {"setup.cfg": "[v]\n0\n", "tox.ini": "[t]\nedited = no\n", "mod.py": "X = 0\n"}, "c0")
    c1 = commit(repo, {"mod.py": "X = 1\n"}, "c1: no install file changed")
    c2 = commit(repo, {"setup.cfg": "[v]\n2\n"}, "c2: setup.cfg changed")
    c3 = commit(repo, {"mod.py": "X = 3\n"}, "c3")
    subprocess.run([*GIT, "-C", str(repo), "checkout", "-q", c2], check=True)
    c4 = commit(repo, {"tox.ini": "[t]\nedited = no\nmore = 1\n"}, "c4: a file PRE_INSTALL edits changed")
    later = commit(repo, {"mod.py": "FIX = 1\n"}, "a later commit: the fix")
    bundle(repo, tmp_path / "v/repo.bundle", c0)
    bundle(repo, tmp_path / "c1/repo.bundle", c1, c0)
    bundle(repo, tmp_path / "c2/repo.bundle", c2, c1)
    bundle(repo, tmp_path / "i3/commits.bundle", c3, c2)
    bundle(repo, tmp_path / "i4/commits.bundle", c4, c2)
    store = build(tmp_path, registries, CATALOG, {"BASE": debian_base, "C0": c0, "C1": c1, "C2": c2, "C3": c3,
                                                  "C4": c4})
    show = ["sh", "-c", "git rev-parse --short=7 HEAD; cat /opt/installs | tr '\\n' ' '; echo;"
                        "grep edited tox.ini; git status --porcelain --untracked-files=no | tr '\\n' ' '; echo;"
                        "git cat-file -e " + later + " 2>/dev/null && echo later || echo none"]
    head, installs, edited, status, fix = run_in(store.resolve("on-c2"), show).splitlines()
    # c1 left the install as it was (no setup.cfg change); c2 installed again, once; c3 nothing more.
    assert (head, installs.split()) == (c3[:7], [c0[:7], c2[:7]])
    assert edited == "edited = yes" and status.strip() == "M tox.ini", "PRE_INSTALL's edit carried through the checkpoints"
    assert fix == "none"
    head, installs, edited, status, fix = run_in(store.resolve("tox-changed"), show).splitlines()
    # Checking out c4 over the edited tox.ini: clean, PRE_INSTALL again, installed again (as an instance does).
    assert (head, installs.split()) == (c4[:7], [c0[:7], c2[:7], c4[:7]])
    assert edited == "edited = yes" and status.strip() == "M tox.ini" and fix == "none"


# The version's layer at C0 over py, its env's first lines (each catalog adds what it installs).
VERSION = PY + """  - name: v
    from: py
    scripts: [swebench-repo.sh]
    context: v
    env:
      REPO_BUNDLE: /build/repo.bundle
      BASE_COMMIT: C0
"""

INSTALL_LAYER = VERSION + """      # An install that would change the environment's packages: it fails with them held (PIP_CONSTRAINT).
      INSTALL: 'test -z "${PIP_CONSTRAINT:-}" && git rev-parse --short=7 HEAD >> /opt/installs'
  - name: v-installed-at-c0
    from: v
    scripts: [swebench-repo.sh]
    env: {BASE_COMMIT: C0, REINSTALL_WHEN: setup.cfg, INSTALL_AS_INSTANCES: "1"}
instances:
  - id: alike
    environment: v-installed-at-c0
    script: swebench-instance.sh
    context: i1
    env: {BASE_COMMIT: C1, REINSTALL_WHEN: setup.cfg, INSTALL: 'git rev-parse --short=7 HEAD >> /opt/installs'}
    workdir: /testbed
  - id: other
    environment: v
    script: swebench-instance.sh
    context: i2
    env: {BASE_COMMIT: C2, REINSTALL_WHEN: setup.cfg, INSTALL: 'git rev-parse --short=7 HEAD >> /opt/installs'}
    workdir: /testbed
"""


def test_an_install_layer_installs_once_for_its_instances_over_the_untouched_version(tmp_path, registries,
                                                                                      debian_base):
    """The version layer leaves an install that would change its packages to each instance; an install layer
    (swebench_catalog._install_layers) does it once for the instances that share its install files, which
    then install nothing themselves, while an instance with other install files still installs over the
    untouched version layer."""
    repo = tmp_path / "repo"
    subprocess.run([*GIT, "init", "-q", str(repo)], check=True)
    c0 = commit(repo, {"setup.cfg": "[v]\n0\n", "mod.py": "X = 0\n"}, "c0")
    c1 = commit(repo, {"mod.py": "X = 1\n"}, "c1: no install file changed")
    subprocess.run([*GIT, "-C", str(repo), "checkout", "-q", c0], check=True)
    c2 = commit(repo, {"setup.cfg": "[v]\n2\n"}, "c2: setup.cfg changed")
    bundle(repo, tmp_path / "v/repo.bundle", c0)
    bundle(repo, tmp_path / "i1/commits.bundle", c1, c0)
    bundle(repo, tmp_path / "i2/commits.bundle", c2, c0)
    store = build(tmp_path, registries, INSTALL_LAYER, {"BASE": debian_base, "C0": c0, "C1": c1, "C2": c2})
    show = ["sh", "-c", "git rev-parse --short=7 HEAD; cat /opt/installs 2>/dev/null | tr '\\n' ' '; echo"]
    head, installs = run_in(store.resolve("alike"), show).splitlines()
    assert (head, installs.split()) == (c1[:7], [c0[:7]]), "installed once, by the install layer"
    head, installs = run_in(store.resolve("other"), show).splitlines()
    assert (head, installs.split()) == (c2[:7], [c2[:7]]), "its own install, over the untouched version"


HELD = VERSION + """      PRE_INSTALL: "python -m pip install -q --no-index --find-links /build/wheels lib==2.0"
      INSTALL: "python -m pip install --no-index --find-links /build/wheels ."
      INSTALL_AS_INSTANCES: "1"
instances:
  - id: i
    environment: v
    script: swebench-instance.sh
    context: i
    env: {BASE_COMMIT: C0, REINSTALL_WHEN: setup.cfg, INSTALL: ""}
    workdir: /testbed
"""


def wheel(folder: Path, name: str, version: str, *requires: str) -> None:
    """A pure-Python wheel of nothing but its metadata."""
    import zipfile
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


# The checkout: a project built by its own backend, which needs `lib` in its build environment (as a
# setuptools project needs setuptools there), and which needs `tool` installed.
PROJECT = {
    "pyproject.toml": '[build-system]\nrequires = ["lib"]\nbuild-backend = "backend"\nbackend-path = ["."]\n',
    "backend.py": """import os, zipfile
import lib  # the build environment's


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = "proj-1.0-py3-none-any.whl"
    files = {"proj/__init__.py": "", "proj-1.0.dist-info/METADATA":
             "Metadata-Version: 2.1\\nName: proj\\nVersion: 1.0\\nRequires-Dist: tool\\n",
             "proj-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}
    files["proj-1.0.dist-info/RECORD"] = "".join(p + ",,\\n" for p in [*files, "proj-1.0.dist-info/RECORD"])
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return name
""",
}


def test_an_install_that_would_move_a_held_package_is_not_held(tmp_path, registries, debian_base):
    """The install as SWE-bench runs it moves the environment's packages where what it adds needs that: tool
    2.0 needs lib<2, and pip takes lib 1.0 under it. Held (pip constraints), pip does not fail but backtracks
    to tool 1.0, which caps nothing (pvlib's `.[all]` over numpy 1.25 took numba 0.53.1, broken at import):
    the install is asked of pip first without the constraints (a dry run, whose options reach no build
    environment: given as variables, the build environment's own install was dry too and the project could
    not be built), and an install that would move a held package is not held."""
    repo = tmp_path / "repo"
    subprocess.run([*GIT, "init", "-q", str(repo)], check=True)
    c0 = commit(repo, {"setup.cfg": "[v]\n0\n", **PROJECT}, "c0")
    bundle(repo, tmp_path / "v/repo.bundle", c0)
    bundle(repo, tmp_path / "i/commits.bundle", c0)
    for version in ("1.0", "2.0"):
        wheel(tmp_path / "v/wheels", "lib", version)
    wheel(tmp_path / "v/wheels", "tool", "1.0", "lib")
    wheel(tmp_path / "v/wheels", "tool", "2.0", "lib<2")
    store = build(tmp_path, registries, HELD, {"BASE": debian_base, "C0": c0})
    installed = run_in(store.resolve("i"), ["sh", "-c", "python -m pip list | grep -E '^(lib|proj|tool) '"])
    assert [line.split() for line in installed.splitlines()] == [["lib", "1.0"], ["proj", "1.0"], ["tool", "2.0"]], \
        installed
