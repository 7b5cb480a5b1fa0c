"""Environment builds: catalogs, scripts in the sandbox, .sif packing, failures."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import signal
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from image_builder.build.catalog import CatalogError, load
from image_builder.build.envbuild import BuildFailed, BuildOptions, LABEL_PREFIX, build_environment, plan_environment
from image_builder.oci.cache import BlobCache
from image_builder.oci.registry import RegistryOptions
from image_builder.pack.sif import read_sif
from image_builder.store.store import Store
from tests.conftest import run_cli, stop_when
from tests.support.proot_files import dead_proots_files, proots_files
from tests.support.terminal import read_pty

ROOT = Path(__file__).resolve().parents[1]


def build_env(spec, opts):
    return build_environment(plan_environment(spec, opts), opts)


def built_image(store: Path, environment: str) -> Path:
    """Where a store build put an environment's image (named by its build key)."""
    return store / Store.open(store).index.environments[environment].sif


def write_catalog(tmp: Path, environments: list[dict], scripts: dict[str, str], instances=()) -> Path:
    (tmp / "scripts").mkdir(exist_ok=True)
    for name, text in scripts.items():
        (tmp / "scripts" / name).write_text(text)
    path = tmp / "catalog.yaml"
    path.write_text(yaml.safe_dump({"scripts_dir": "scripts", "environments": environments,
                                    "instances": list(instances)}, sort_keys=False))
    return path


def options(tmp: Path, ca: Path, **kw) -> BuildOptions:
    return BuildOptions(store=tmp / "store", cache=BlobCache(tmp / "cache"),
                        registry=RegistryOptions(ca_cert=ca), **kw)


def sif_files(sif: Path, tmp: Path, *paths: str) -> dict[str, str | None]:
    """Read files from the SIF's partition, mounted with squashfuse_ll at its offset."""
    image = read_sif(sif)
    part = image.primary_partition()
    mnt = tmp / f"mnt-{time.monotonic_ns()}"
    mnt.mkdir()
    subprocess.run(["squashfuse_ll", "-o", f"offset={part.offset}", str(sif), str(mnt)], check=True)
    try:
        return {p: (mnt / p).read_text() if (mnt / p).is_file() else None for p in paths}
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)


SCRIPT = """#!/bin/sh
set -eu
echo "greeting=$GREETING" > /etc/built-by
id -u > /etc/built-uid
echo "ca=$SSL_CERT_FILE pip_find_links=${PIP_FIND_LINKS:-unset}" > /etc/built-env
test -s "$SSL_CERT_FILE"
echo building done
"""


@pytest.fixture
def tiny_catalog(tmp_path, tiny_base):
    return write_catalog(tmp_path, [{"name": "tiny", "base": tiny_base, "scripts": ["make.sh"],
                                     "env": {"GREETING": "hello world"}}], {"make.sh": SCRIPT})


def test_build_packs_a_sif_siftool_reads(tmp_path, tiny_catalog, registries, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/host/only")  # the host's environment must not leak in
    spec = load(tiny_catalog).environments["tiny"]
    result = build_env(spec, options(tmp_path, registries.tls.cert))
    assert result.built and result.sif == tmp_path / f"store/envs/{result.build_key[7:39]}.sif"
    listing = subprocess.run(["siftool", "list", str(result.sif)], capture_output=True, text=True, check=True).stdout
    assert "Squashfs/*System/amd64" in listing and "Def.FILE" in listing
    labels = read_sif(result.sif).labels()
    assert labels[LABEL_PREFIX + "build-key"] == result.build_key
    assert labels[LABEL_PREFIX + "base-digest"] == result.base_digest
    files = sif_files(result.sif, tmp_path, "etc/built-by", "etc/built-uid", "etc/built-env",
                      ".singularity.d/env/10-docker2singularity.sh", "tmp/.image-builder/ca.pem")
    assert files["etc/built-by"] == "greeting=hello world\n"
    assert files["etc/built-uid"] == "0\n"
    assert files["etc/built-env"] == "ca=/tmp/.image-builder/ca.pem pip_find_links=unset\n"
    assert 'export GREETING="${GREETING:-"hello world"}"' in files[".singularity.d/env/10-docker2singularity.sh"]
    assert files["tmp/.image-builder/ca.pem"] is None, "build-time files must not end up in the image"
    log = (tmp_path / "store/logs/envs/tiny/01-make.sh.log").read_text()
    assert "building done" in log
    assert not (tmp_path / "store/work").exists() or not list((tmp_path / "store/work").iterdir())


def test_unchanged_environment_is_not_rebuilt(tmp_path, tiny_catalog, registries):
    spec = load(tiny_catalog).environments["tiny"]
    opts = options(tmp_path, registries.tls.cert)
    first = build_env(spec, opts)
    stamp = first.sif.stat().st_mtime_ns
    again = build_env(spec, opts)
    assert not again.built and again.build_key == first.build_key
    assert first.sif.stat().st_mtime_ns == stamp
    changed = load(tiny_catalog).environments["tiny"]
    changed = type(changed)(**{**changed.__dict__, "env": {"GREETING": "bonjour"}})
    third = build_env(changed, opts)
    assert third.built and third.build_key != first.build_key
    assert sif_files(third.sif, tmp_path, "etc/built-by")["etc/built-by"] == "greeting=bonjour\n"


def test_reproducible_with_source_date_epoch(tmp_path, tiny_catalog, registries, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    spec = load(tiny_catalog).environments["tiny"]
    script = tmp_path / "scripts/make.sh"
    script.write_text("#!/bin/sh\necho fixed > /etc/built-by\n")
    spec = load(tiny_catalog).environments["tiny"]
    a = build_env(spec, options(tmp_path / "a", registries.tls.cert)).sif.read_bytes()
    time.sleep(1.1)  # a build that stamped the clock would now differ
    b = build_env(spec, options(tmp_path / "b", registries.tls.cert)).sif.read_bytes()
    assert a == b


def test_failed_script_reports_and_keeps_the_old_image(tmp_path, tiny_catalog, registries):
    opts = options(tmp_path, registries.tls.cert)
    good = build_env(load(tiny_catalog).environments["tiny"], opts)
    before = good.sif.read_bytes()
    (tmp_path / "scripts/make.sh").write_text("#!/bin/sh\necho line-before-failure\nexit 3\n")
    with pytest.raises(BuildFailed) as err:
        build_env(load(tiny_catalog).environments["tiny"], opts)
    msg = str(err.value)
    assert "script make.sh exited 3" in msg and "image-builder debug tiny" in msg and "\n" not in msg
    assert "line-before-failure" in err.value.tail
    assert good.sif.read_bytes() == before, "a failed build must not touch the published image"
    assert (tmp_path / "store/failed/envs/tiny/rootfs/etc/passwd").exists()


def test_cli_failure_shows_the_last_20_log_lines(tmp_path, tiny_catalog, registries):
    (tmp_path / "scripts/make.sh").write_text("#!/bin/sh\ni=0\nwhile [ $i -lt 30 ]; do echo filler-$i; i=$((i+1)); done\n"
                                              "echo tail-line; exit 7\n")
    r = run_cli("build", str(tiny_catalog), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "c"),
                "--ca-cert", str(registries.tls.cert))
    assert r.returncode == 1
    shown = [line[4:] for line in r.stderr.splitlines() if line.startswith("  | ")]
    assert shown == [f"filler-{i}" for i in range(11, 30)] + ["tail-line"]
    assert r.stderr.strip().splitlines()[-1].startswith("failed: environment tiny: script make.sh exited 7")


def test_cli_failure_shows_the_compiler_error_not_pip_s_notices(tmp_path, tiny_catalog, registries):
    """A failed pip build ends in pip's noise; the gcc error that made it fail comes long before."""
    (tmp_path / "scripts/make.sh").write_text(
        "#!/bin/sh\ni=0\nwhile [ $i -lt 30 ]; do echo filler-$i; i=$((i+1)); done\n"
        "echo 'gcc -Wno-error=format -c src/fast.c -o build/fast.o'\n"
        "echo 'src/fast.c:3:10: fatal error: Python.h: No such file or directory'\n"
        "echo '    3 | #include <Python.h>'\n"
        "i=0\nwhile [ $i -lt 30 ]; do echo after-$i; i=$((i+1)); done\n"
        "echo '[notice] A new release of pip is available: 23.0 -> 24.0'\n"
        "echo '[notice] To update, run: pip install --upgrade pip'\nexit 1\n")
    r = run_cli("build", str(tiny_catalog), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "c"),
                "--ca-cert", str(registries.tls.cert))
    assert r.returncode == 1
    shown = [line[4:] for line in r.stderr.splitlines() if line.startswith("  | ")]
    assert shown == [*(f"filler-{i}" for i in range(26, 30)), "gcc -Wno-error=format -c src/fast.c -o build/fast.o",
                     "src/fast.c:3:10: fatal error: Python.h: No such file or directory", "    3 | #include <Python.h>",
                     *(f"after-{i}" for i in range(9))]
    assert "[notice]" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("failed: environment tiny: script make.sh exited 1")


def test_script_timeout_kills_everything(tmp_path, tiny_base, registries):
    cat = write_catalog(tmp_path, [{"name": "slow", "base": tiny_base, "scripts": ["slow.sh"], "timeout": 1}],
                        {"slow.sh": "#!/bin/sh\n(sleep 97 &)\nsleep 98\n"})
    with pytest.raises(BuildFailed, match="script slow.sh timed out after 1 s"):
        build_env(load(cat).environments["slow"], options(tmp_path, registries.tls.cert))
    time.sleep(0.2)
    left = subprocess.run(["pgrep", "-f", "sleep 9[78]"], capture_output=True, text=True).stdout
    assert left == "", "the timeout must kill double-forked children too"


STOPS = [(None, "userns", signal.SIGTERM), (None, "userns", signal.SIGKILL), (65534, "userns", signal.SIGINT),
         (65534, "proot", signal.SIGTERM), (65534, "proot", signal.SIGKILL)]


@pytest.mark.parametrize("user,backend,how", STOPS, ids=[f"{u or 'root'}-{b}-{h.name}" for u, b, h in STOPS])
def test_a_stopped_build_stops_its_scripts(public_dir, tiny_base, public_ca, user, backend, how):
    """Ctrl-C, `kill`, a scheduler's time limit (SIGTERM) or SIGKILL while two scripts run: the builder
    ends at once and no process of either script runs on (before: SIGTERM and SIGKILL left both running
    and writing into the work tree, Ctrl-C waited for them to finish); short of SIGKILL, its temporary
    files go, and what was built before stays."""
    work = public_dir / f"stop-{user}-{backend}-{how.name}"
    work.mkdir()
    mark = f"{31 + STOPS.index((user, backend, how))}.5"  # each case's scripts sleep for a time of their own
    scripts = {"ok.sh": "true\n", "slow.sh": f"#!/bin/sh\nsleep 10{mark} & sleep 20{mark}\necho late > /late\n"}
    cat = write_catalog(work, [{"name": "ok", "base": tiny_base, "scripts": ["ok.sh"]},
                               *({"name": f"slow{i}", "base": tiny_base, "scripts": ["slow.sh"],
                                  "env": {"N": str(i)}} for i in (1, 2))], scripts)
    for p in [work, *work.rglob("*")]:
        p.chmod(0o1777 if p.is_dir() else 0o666)
    (work / "tmp").mkdir(mode=0o777)
    (work / "tmp").chmod(0o777)
    store = work / "store"
    args = ["--store", str(store), "--cache-dir", str(work / "cache"), "--ca-cert", str(public_ca),
            "--backend", backend, "-j", "2"]
    env = {**os.environ, "HOME": str(work), "XDG_CACHE_HOME": str(work / "xdg"), "TMPDIR": str(work / "tmp"),
           "DOCKER_CONFIG": str(work / "no-docker-config")}
    setpriv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user else []
    exe = [*setpriv, str(ROOT / ".venv/bin/image-builder"), "build", str(cat)]
    first = subprocess.run([*exe, *args, "--only", "ok"], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    built = built_image(store, "ok").read_bytes()

    def sleeping():
        ps = subprocess.run(["pgrep", "-f", f"^sleep [12]0{mark}$"], capture_output=True, text=True).stdout
        return ps.split()

    builder = subprocess.Popen([*exe, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err, took = stop_when(builder, lambda: len(sleeping()) == 4, how)  # both scripts, each with its two sleeps
    assert took < 5, "the builder ended at once, not when its scripts would have"
    assert builder.returncode == {signal.SIGTERM: 143, signal.SIGINT: 1, signal.SIGKILL: -9}[how], out + err
    time.sleep(0.5)
    assert sleeping() == [], "no process of a script outlives the build"
    assert built_image(store, "ok").read_bytes() == built, "what was built before stays"
    assert not list((store / "envs").glob("*slow*")), "nothing of the stopped builds is published"
    assert list((work / "tmp").iterdir()) == [], "its temporary files go, or are in its work trees (SIGKILL)"
    if how == signal.SIGKILL:  # the next build sweeps what a killed one left
        if backend == "proot":  # its proots, killed by their guards once the builder is gone, may still be
            # exiting (seen under CI's load): the sweep takes only a dead proot's files
            left = [name for name, alive in proots_files(user).items() if alive]
            deadline = time.monotonic() + 10
            while any(proots_files(user).get(name) for name in left) and time.monotonic() < deadline:
                time.sleep(0.05)
        again = subprocess.run([*exe, *args, "--only", "ok"], env=env, capture_output=True, text=True)
        assert again.returncode == 0, again.stderr
    assert not [p for p in (store / "work").iterdir()], "its work trees go"
    if backend == "proot":  # proot's own files in /tmp: the stopped build's, or the next build sweeps them
        assert dead_proots_files(user) == []


def test_debug_opens_a_shell_in_the_failed_tree(tmp_path, tiny_base, registries):
    cat = write_catalog(tmp_path, [{"name": "broken", "base": tiny_base, "scripts": ["b.sh"],
                                    "env": {"MARK": "from-the-build"}}],
                        {"b.sh": "#!/bin/sh\necho partial > /etc/partial\nexit 1\n"})
    with pytest.raises(BuildFailed):
        build_env(load(cat).environments["broken"], options(tmp_path, registries.tls.cert))
    out = drive_pty([str(ROOT / ".venv/bin/image-builder"), "debug", "broken", "--store", str(tmp_path / "store")],
                    b"cat /etc/partial; echo mark=$MARK; exit\n")
    assert "partial" in out and "mark=from-the-build" in out


def drive_pty(argv: list[str], keys: bytes, timeout: float = 20) -> str:
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(argv[0], argv)
    os.write(fd, keys)
    out = read_pty(fd, timeout)
    os.waitpid(pid, 0)
    return out.decode(errors="replace")


def test_missing_base_is_one_clear_line(tmp_path, registries):
    cat = write_catalog(tmp_path, [{"name": "x", "base": f"{registries.open.host}/no/such:1", "scripts": ["s.sh"]}],
                        {"s.sh": "true\n"})
    r = run_cli("build", str(cat), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "c"),
                "--ca-cert", str(registries.tls.cert))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("failed: environment x: ") and "no/such:1: no such image" in last


def test_full_disk_while_packing_keeps_earlier_images(tmp_path, tiny_base, registries):
    store = tmp_path / "store"
    store.mkdir()
    # Room for the small image and the work tree of the big one, not for packing the big one.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=14m", "tmpfs", str(store)], check=True)
    try:
        cat = write_catalog(tmp_path, [
            {"name": "small", "base": tiny_base, "scripts": ["small.sh"]},
            {"name": "huge", "base": tiny_base, "scripts": ["huge.sh"]}],
            {"small.sh": "true\n", "huge.sh": "head -c 5000000 /dev/urandom > /big\n"})
        opts = BuildOptions(store=store, cache=BlobCache(tmp_path / "cache"),
                            registry=RegistryOptions(ca_cert=registries.tls.cert))
        small = build_env(load(cat).environments["small"], opts)
        before = small.sif.read_bytes()
        with pytest.raises(BuildFailed, match="environment huge: .*No space left"):
            build_env(load(cat).environments["huge"], opts)
        assert small.sif.read_bytes() == before
        assert sorted(p.name for p in (store / "envs").iterdir()) == [small.sif.name], "no half-written image left"
    finally:
        subprocess.run(["umount", "-l", str(store)], check=True)


CATALOG_ERRORS = [
    ("environments:\n- name: a\n  base: x:1\n  scripts: [s.sh]\n  colour: red\n", 5,
     "environments[0]: unknown key 'colour'"),
    ("environments:\n- name: a\n  base: x:1\n  scripts: [missing.sh]\n", 4, "no script 'missing.sh'"),
    ("environments:\n- name: a\n  base: x:1\n  scripts: [s.sh]\n- name: a\n  base: x:1\n  scripts: [s.sh]\n",
     5, "duplicate environment name 'a' (first at line 3)"),
    ("environments:\n- name: a\n  base: x:1\n  scripts: [s.sh]\ninstances:\n- id: i1\n  environment: b\n", 7,
     "unknown environment 'b'"),
    ("environments:\n- name: a\n  base: Bad Ref\n  scripts: [s.sh]\n", 3, "environments[0].base"),
    ("environments:\n- name: a\n  base: x:1\n  scripts: [s.sh\n", 5, "not valid YAML"),
]


@pytest.mark.parametrize("text,line,needle", CATALOG_ERRORS)
def test_check_names_file_and_line(tmp_path, text, line, needle):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts/s.sh").write_text("true\n")
    path = tmp_path / "c.yaml"
    path.write_text("scripts_dir: scripts\n" + text)
    with pytest.raises(CatalogError) as err:
        load(path)
    assert str(err.value).startswith(f"{path}:{line + 1}: ") and needle in str(err.value), str(err.value)
    r = run_cli("check", str(path))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


def test_shipped_catalogs_validate():
    for name in ("mbpp.yaml", "swebench-marshmallow.yaml", "sandbox.yaml"):
        r = run_cli("check", str(ROOT / "index" / name))
        assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    cat = load(ROOT / "index/swebench-marshmallow.yaml")
    assert set(cat.environments) == {"marshmallow-3.0", "marshmallow-2.20"}
    assert "bullseye" in cat.environments["marshmallow-2.20"].base


def wheel(dest: Path, name: str = "hello", value: str = "42") -> Path:
    """A minimal pure-Python wheel, written by hand (no build backend needed)."""
    path = dest / f"{name}-1.0-py3-none-any.whl"
    files = {f"{name}/__init__.py": f"VALUE = {value}\n",
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + f"{name}-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
        z.writestr(f"{name}-1.0.dist-info/RECORD", record)
    return path


def venv_catalog(tmp: Path, base: str, backend_name: str) -> Path:
    context = tmp / "context"
    (context / "wheels").mkdir(parents=True)
    wheel(context / "wheels")
    scripts = {"python-venv.sh": (ROOT / "env_scripts/python-venv.sh").read_text()}
    return write_catalog(tmp, [{"name": f"venv-{backend_name}", "base": base, "scripts": ["python-venv.sh"],
                                "context": "context", "env": {"VENV": "/opt/venv"}}], scripts)


def test_venv_with_a_wheel_from_the_build_context(tmp_path, debian_base, registries):
    cat = venv_catalog(tmp_path, debian_base, "root")
    result = build_env(load(cat).environments["venv-root"], options(tmp_path, registries.tls.cert))
    with mounted_sif(result.sif, tmp_path / "mnt") as mnt:
        out = subprocess.run(["chroot", str(mnt), "/opt/venv/bin/python", "-c", "import hello; print(hello.VALUE)"],
                             capture_output=True, text=True)
        assert out.stdout == "42\n", out.stderr
        assert not (mnt / "build").exists(), "the /build mount point must not stay in the image"


@contextlib.contextmanager
def mounted_sif(sif: Path, mnt: Path):
    """The image's root partition mounted (read-only) at MNT for the block."""
    mnt.mkdir()
    subprocess.run(["mount", "-t", "squashfs", "-o", f"loop,ro,offset={read_sif(sif).primary_partition().offset}",
                    str(sif), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_optional_requirements_install_each_one_that_has_a_wheel(tmp_path, debian_base, registries):
    """A conda environment.yml's packages by PyPI name (swebench catalog): one the index lacks is left out with a
    line, the rest installed, and the spec's pins hold them (a wheel the pins exclude is left out too)."""
    context = tmp_path / "context"
    (context / "links").mkdir(parents=True)
    wheel(context / "links")
    wheel(context / "links", name="pinned", value="1")
    wheel(context / "links", name="cfgrib", value="1 / 0")  # its C library missing: not an ImportError
    wheel(context / "links", name="optional_dep", value="__import__('absent')")  # an ImportError: kept
    (context / "optional.txt").write_text("# from environment.yml (conda), as PyPI names\nhello\nhdf5\npinned>=1.0\n"
                                          "cfgrib\noptional_dep\n")
    scripts = {"python-venv.sh": (ROOT / "env_scripts/python-venv.sh").read_text()}
    cat = write_catalog(tmp_path, [{"name": "optional", "base": debian_base, "scripts": ["python-venv.sh"],
                                    "context": "context",
                                    "env": {"VENV": "/opt/venv", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/build/links",
                                            "PYTHON_PACKAGES": "pinned==0.9"}}], scripts)
    with pytest.raises(BuildFailed):  # pinned 0.9 is not there: the spec's own packages must install
        build_env(load(cat).environments["optional"], options(tmp_path, registries.tls.cert))
    log = next((tmp_path / "store").rglob("*python-venv.sh.log")).read_text()
    assert "image-builder: left out hdf5 (no wheel of it" in log
    assert "image-builder: left out pinned>=1.0 (no wheel of it" in log, "held to the spec's pin"
    assert "left out hello" not in log

    doc = yaml.safe_load(cat.read_text())
    doc["environments"][0]["env"]["PYTHON_PACKAGES"] = "pinned==1.0"
    cat.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = build_env(load(cat).environments["optional"], options(tmp_path, registries.tls.cert))
    site = "opt/venv/lib/python3.11/site-packages"
    files = sif_files(result.sif, tmp_path, *(f"{site}/{name}/__init__.py" for name in
                                              ("hello", "pinned", "hdf5", "cfgrib", "optional_dep")))
    assert list(files.values()) == ["VALUE = 42\n", "VALUE = 1\n", None, None, "VALUE = __import__('absent')\n"]
    log = next((tmp_path / "store").rglob("*python-venv.sh.log")).read_text()
    assert "image-builder: left out cfgrib (import cfgrib fails: ZeroDivisionError: division by zero)" in log


def test_a_conda_environment_from_the_site_s_channel(tmp_path, debian_base, registries):
    """conda-env.sh (swebench catalog --conda-channel): conda's solver (py-rattler) against a local channel over
    HTTP, as of the cut-off; the environment's interpreter imports what was solved, then its pip packages."""
    from tests.support import conda_channel
    channel = tmp_path / "channel"
    conda_channel.python_package(channel)
    conda_channel.noarch_python_package(channel, "hello", "1.0", "VALUE = 1\n")
    conda_channel.noarch_python_package(channel, "hello", "2.0", "VALUE = 2\n", timestamp_ms=1_800_000_000_000)
    conda_channel.index(channel)
    context = tmp_path / "context"
    context.mkdir()
    (context / "conda-specs.txt").write_text("hello\n")
    scripts = {"conda-env.sh": (ROOT / "env_scripts/conda-env.sh").read_text()}
    prefix = "/opt/conda/envs/testbed"
    with conda_channel.served(channel) as url:
        env = {"CONDA_CHANNELS": url, "CONDA_PYTHON": "3.11", "CONDA_EXCLUDE_NEWER": "2024-07-04T00:00:00Z",
               "PATH": f"{prefix}/bin:/usr/local/bin:/usr/bin:/bin", "PIP_BREAK_SYSTEM_PACKAGES": "1"}
        cat = write_catalog(tmp_path, [{"name": "conda", "base": debian_base, "scripts": ["conda-env.sh"],
                                        "context": "context", "env": env}], scripts)
        result = build_env(load(cat).environments["conda"], options(tmp_path, registries.tls.cert))
    log = next((tmp_path / "store").rglob("*conda-env.sh.log")).read_text()
    assert "image-builder: solved 2 conda packages: hello=1.0=py_0 python=3.11.2=0" in log, "2.0 is past the cut-off"
    with mounted_sif(result.sif, tmp_path / "mnt") as mnt:
        out = subprocess.run(["chroot", str(mnt), f"{prefix}/bin/python", "-c",
                              "import hello, sys; print(hello.VALUE, sys.prefix)"], capture_output=True, text=True)
        assert out.stdout == f"1 {prefix}\n", out.stderr
        assert (mnt / prefix.lstrip("/") / "conda-meta/hello-1.0-py_0.json").is_file(), "conda's own record"
        assert not (mnt / "tmp/ib-rattler").exists(), "the solver is not left in the image"

    (context / "conda-specs.txt").write_text("hello\nnot-in-the-channel\n")
    with conda_channel.served(channel) as url:
        env["CONDA_CHANNELS"] = url
        cat = write_catalog(tmp_path, [{"name": "conda", "base": debian_base, "scripts": ["conda-env.sh"],
                                        "context": "context", "env": env}], scripts)
        with pytest.raises(BuildFailed) as failed:
            build_env(load(cat).environments["conda"], options(tmp_path, registries.tls.cert))
    assert any("image-builder: conda environment:" in line and "not-in-the-channel" in line
               for line in failed.value.tail), failed.value.tail


def unprivileged_build(tmp_root: Path, catalog: Path, ca: Path, backend: str) -> subprocess.CompletedProcess:
    tmp_root.chmod(0o1777)  # sticky, as /tmp: a cache in a directory others may rename it out of is refused
    return run_cli("build", str(catalog), "--store", str(tmp_root / "store"), "--cache-dir", str(tmp_root / "cache"),
                   "--ca-cert", str(ca), "--backend", backend, user=65534,
                   env={"HOME": str(tmp_root), "XDG_CACHE_HOME": str(tmp_root / "xdg"),
                        "DOCKER_CONFIG": str(tmp_root / "no-docker-config")})


def test_rootless_userns_build_with_apt_and_venv(public_dir, debian_base, public_ca):
    """As an unprivileged user: apt-get (which needs APT_CONFIG in a one-uid namespace) and a venv."""
    work = public_dir / "userns"
    work.mkdir()
    cat = venv_catalog(work, debian_base, "userns")
    doc = yaml.safe_load(cat.read_text())
    (work / "scripts/apt-packages.sh").write_text((ROOT / "env_scripts/apt-packages.sh").read_text())
    doc["environments"][0]["scripts"] = ["apt-packages.sh", "python-venv.sh"]
    doc["environments"][0]["env"]["APT_PACKAGES"] = "hello"
    cat.write_text(yaml.safe_dump(doc, sort_keys=False))
    for p in work.rglob("*"):
        p.chmod(0o777 if p.is_dir() else 0o666)
    r = unprivileged_build(work, cat, public_ca, "userns")
    assert r.returncode == 0, r.stdout + r.stderr
    sif = built_image(work / "store", "venv-userns")
    assert sif.stat().st_uid == 65534
    files = sif_files(sif, work, "opt/venv/lib/python3.11/site-packages/hello/__init__.py")
    assert files["opt/venv/lib/python3.11/site-packages/hello/__init__.py"] == "VALUE = 42\n"
    listing = subprocess.run(["unsquashfs", "-o", str(read_sif(sif).primary_partition().offset), "-lln", str(sif),
                              "usr/bin/hello"], capture_output=True, text=True).stdout
    assert "usr/bin/hello" in listing, "apt-get must have installed hello"
    assert " 0/0 " in listing, "a rootless image's files must belong to root inside"


CHOWNING_PACKAGE = r"""#!/bin/sh
set -eu
# A package as Debian's fontconfig-config is: its postinst hands a directory to the `staff` group.
mkdir -p /tmp/pkg/DEBIAN /tmp/pkg/usr/share/ib-chown
printf 'Package: ib-chown\nVersion: 1\nArchitecture: all\nMaintainer: t <t@example.org>\nDescription: t\n' \
  > /tmp/pkg/DEBIAN/control
printf '#!/bin/sh\nset -e\nmkdir -p /usr/local/share/ib-fonts\nchown root:staff /usr/local/share/ib-fonts\n' \
  > /tmp/pkg/DEBIAN/postinst
chmod 755 /tmp/pkg/DEBIAN/postinst
dpkg-deb --root-owner-group --build /tmp/pkg /tmp/ib-chown.deb
dpkg -i /tmp/ib-chown.deb
chown 1000:1000 /usr/share/ib-chown
stat -c '%u:%g' /usr/local/share/ib-fonts /usr/share/ib-chown > /etc/owners
"""


def _seccomp_verdict(program: bytes, arch: int, nr: int) -> int:
    """What a classic-BPF seccomp program returns for a system call (the three kinds of instruction
    fake_chown_filter writes: load a word of seccomp_data, jump if equal, return)."""
    import struct
    insns = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    data, acc, pc = {0: nr, 4: arch}, 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc, pc = data[k], pc + 1
        elif code == 0x15:
            pc += 1 + (jt if acc == k else jf)
        else:
            assert code == 0x06, code
            return k


@pytest.mark.parametrize("machine, arch, faked, kept", [
    ("x86_64", 0xC000003E, (92, 93, 94, 260), (0, 2, 59, 90, 91, 105, 257)),  # chown..fchownat; read, open, execve...
    ("x86_64", 0x40000003, (16, 95, 182, 198, 207, 212, 298), (3, 5, 11, 15, 94)),  # i386's: chmod and fchmod kept
    ("aarch64", 0xC00000B7, (54, 55), (52, 53, 56, 63, 221)),  # fchmod, fchmodat, openat, read, execve kept
])
def test_the_build_filter_fakes_ownership_changes_and_nothing_else(machine, arch, faked, kept):
    """Every chown of the architecture answers 0 and does nothing (SECCOMP_RET_ERRNO with errno 0); every
    other call, and every call of an architecture the filter does not know, goes through."""
    from image_builder.build.enter import fake_chown_filter
    program = fake_chown_filter(machine)
    assert all(_seccomp_verdict(program, arch, nr) == 0x00050000 for nr in faked)
    assert all(_seccomp_verdict(program, arch, nr) == 0x7FFF0000 for nr in kept)
    assert all(_seccomp_verdict(program, 0x1234, nr) == 0x7FFF0000 for nr in faked)
    assert fake_chown_filter("sparc64") == b""


@pytest.mark.parametrize("user", ["root", "rootless"])
def test_a_package_that_hands_files_to_a_system_group_installs(user, public_dir, debian_base, public_ca, registries):
    """A user namespace maps one id: a chown to any other (dpkg's maintainer scripts: fontconfig-config's
    `chown root:staff`, which graphviz pulls in) failed with EINVAL and failed the build (met on sphinx
    8.1's pre_install). Now it succeeds and changes nothing: the files stay root's."""
    work = public_dir / f"chown-{user}"
    work.mkdir()
    cat = write_catalog(work, [{"name": "chown", "base": debian_base, "scripts": ["pkg.sh"]}],
                        {"pkg.sh": CHOWNING_PACKAGE})
    if user == "root":
        build_env(load(cat).environments["chown"], options(work, registries.tls.cert))
        sif = next((work / "store").rglob("*.sif"))
    else:
        for p in work.rglob("*"):
            p.chmod(0o777 if p.is_dir() else 0o666)
        r = unprivileged_build(work, cat, public_ca, "userns")
        assert r.returncode == 0, r.stdout + r.stderr
        sif = built_image(work / "store", "chown")
    assert sif_files(sif, work, "etc/owners")["etc/owners"] == "0:0\n0:0\n"


def test_rootless_layered_build_shares_and_stacks(public_dir, tiny_base, public_ca):
    """As uid 65534 in a user namespace: two names with one key share an image, a `from:` environment and
    an instance over it are overlays, and the runtime (rootless, squashfuse per layer) stacks all three."""
    from tests.test_store import LAYERED_SCRIPTS, layered_catalog
    work = public_dir / "layered"
    work.mkdir()
    cat = layered_catalog(work, tiny_base)
    for p in work.rglob("*"):
        p.chmod(0o777 if p.is_dir() else 0o666)
    r = unprivileged_build(work, cat, public_ca, "userns")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "py-copy: same environment as py (one image)" in r.stdout
    index = Store.open(work / "store").index
    assert len(index.environments["tool-a"].overlays) == 1 and sorted(LAYERED_SCRIPTS) == sorted(
        p.name for p in (work / "scripts").iterdir())
    run = run_cli("run", "--store", str(work / "store"), "a-1", "--", "sh", "-c", "cat /etc/tool /etc/task",
                  user=65534, env={"HOME": str(work), "XDG_RUNTIME_DIR": str(work / "run")})
    assert run.returncode == 0 and run.stdout == "a\na 1\n", run.stdout + run.stderr


def test_rootless_proot_build(public_dir, tiny_base, public_ca):
    work = public_dir / "proot"
    work.mkdir()
    cat = write_catalog(work, [{"name": "p", "base": tiny_base, "scripts": ["p.sh"]}],
                        {"p.sh": "#!/bin/sh\nset -e\nid -u > /etc/uid-inside\n"})
    for p in work.rglob("*"):
        p.chmod(0o777 if p.is_dir() else 0o666)
    r = unprivileged_build(work, cat, public_ca, "proot")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sif_files(built_image(work / "store", "p"), work, "etc/uid-inside")["etc/uid-inside"] == "0\n"


ATTACK = r"""#!/bin/sh
cat > /tmp/escape.py <<'PY'
import os, sys
os.makedirs("/jail", exist_ok=True)
top = os.open("/", os.O_RDONLY)
os.chroot("/jail")
os.fchdir(top)
for _ in range(64):
    os.chdir("..")
os.chroot(".")
try:
    print("ESCAPED: read", open(sys.argv[1]).read().strip())
    os.unlink(sys.argv[1])
except OSError as e:
    print("contained:", e.strerror)
PY
python3 /tmp/escape.py "$CANARY"
for f in /dev/*; do [ -b "$f" ] && echo "BLOCK DEVICE $f"; done
for f in /dev/kvm /dev/kmsg /dev/loop-control /dev/mem; do [ -e "$f" ] && echo "DEVICE $f"; done
(echo x > /proc/sys/kernel/core_pattern) 2>/dev/null && echo "WROTE core_pattern"
(echo x > /proc/sysrq-trigger) 2>/dev/null && echo "WROTE sysrq-trigger"
[ -n "$(head -c 8 /proc/kpageflags 2>/dev/null)" ] && echo "READ kpageflags"
[ -n "$(ls /sys)" ] && echo "HOST SYS"
echo "uid inside: $(id -u)"
rm -rf --no-preserve-root / 2>/dev/null
echo attack done
"""


def test_a_root_build_cannot_reach_the_host(tmp_path, debian_base, registries):
    """As root: the double-chroot breakout, devices, /proc and `rm -rf /` from an
    environment script touch nothing of the host (the tree itself it may destroy).
    Do not run it against a sandbox you do not trust: on the chroot sandbox before
    the fix, the breakout read the canary and `rm -rf /` emptied the host's /dev."""
    assert os.geteuid() == 0
    canary = tmp_path / "canary"
    canary.write_text("host secret\n")
    dev_canary = Path(f"/dev/ib-canary-{os.getpid()}")
    dev_canary.write_text("in the host's /dev\n")
    try:
        cat = write_catalog(tmp_path, [{"name": "attack", "base": debian_base, "scripts": ["attack.sh"],
                                        "env": {"CANARY": str(canary)}}], {"attack.sh": ATTACK})
        try:
            build_env(load(cat).environments["attack"], options(tmp_path, registries.tls.cert))
        except BuildFailed:
            pass  # the tree is gone: packing it may fail; what matters is the host
        log = (tmp_path / "store/logs/envs/attack/01-attack.sh.log").read_text()
        assert "attack done" in log, log
        assert "contained:" in log and "ESCAPED" not in log, log
        for bad in ("BLOCK DEVICE", "DEVICE /", "WROTE", "READ kpageflags", "HOST SYS"):
            assert bad not in log, log
        assert canary.read_text() == "host secret\n"
        assert dev_canary.read_text() == "in the host's /dev\n"
        assert Path("/dev/null").exists() and Path("/etc/passwd").exists()
    finally:
        dev_canary.unlink(missing_ok=True)


def test_builds_and_runs_mask_the_same_proc_files():
    from image_builder.runtime.mounts import PROC_MASKED, PROC_READONLY

    init = (ROOT / "image_builder/runtime/native/init.c").read_text()
    for name, python in (("PROC_MASKED", PROC_MASKED), ("PROC_READONLY", PROC_READONLY)):
        body = re.search(rf"{name}\[\] = {{(.*?)}};", init, re.S).group(1)
        assert tuple(re.findall(r'"([^"]+)"', body)) == python, name


def test_a_catalog_anywhere_finds_the_shipped_scripts(tmp_path):
    """Without `scripts_dir:` and without an env_scripts/ beside its folder, a catalog uses this checkout's."""
    path = tmp_path / "elsewhere" / "cat.yaml"
    path.parent.mkdir()
    path.write_text("environments:\n  - {name: e, base: 'docker.io/library/python:3.11-slim', "
                    "scripts: [apt-packages.sh, python-venv.sh]}\n")
    assert load(path).environments["e"].scripts == (ROOT / "env_scripts/apt-packages.sh",
                                                    ROOT / "env_scripts/python-venv.sh")
    (tmp_path / "env_scripts").mkdir()  # one beside its folder wins, as for index/
    (tmp_path / "env_scripts/python-venv.sh").write_text("true\n")
    with pytest.raises(CatalogError, match=r"no script 'apt-packages.sh' in .*/env_scripts \(available: "
                                           r"python-venv.sh\)"):
        load(path)


def test_an_instance_set_takes_only_the_rows_asked_for(tmp_path):
    """One SWE-bench JSONL of two repositories, one instance set per repository (`only:`)."""
    rows = [{"instance_id": f"{repo.replace('/', '__')}-{i}", "repo": repo, "base_commit": "a" * 40,
             "version": "1.0", "patch": "diff", "test_patch": "diff", "FAIL_TO_PASS": "[]", "PASS_TO_PASS": "[]"}
            for repo in ("pytest-dev/pytest", "pylint-dev/pylint") for i in range(2)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts/s.sh").write_text("true\n")
    head = ("scripts_dir: scripts\nenvironments:\n  - {name: e, base: 'docker.io/library/python:3.11-slim', "
            "scripts: [s.sh]}\ninstance_sets:\n  - from: data.jsonl\n    environment: e\n")
    path = tmp_path / "c.yaml"
    path.write_text(head + "    only: {repo: pylint-dev/pylint}\n")
    assert sorted(load(path).instances) == ["pylint-dev__pylint-0", "pylint-dev__pylint-1"]
    path.write_text(head + "    only: {repo: [pylint-dev/pylint, pytest-dev/pytest], version: '1.0'}\n")
    assert len(load(path).instances) == 4
    for only, needle in (("{repository: x}", "no field 'repository' in the dataset's tasks (they have: "),
                         ("{repo: django/django}", "no task of the dataset matches"),
                         ("[repo]", "only must map template fields")):
        path.write_text(head + f"    only: {only}\n")
        with pytest.raises(CatalogError, match=re.escape(needle)):
            load(path)


DEEP_SCRIPT = """#!/bin/sh
set -eu
mkdir -p /opt/deep
cd /opt/deep
i=0
while [ $i -lt 2000 ]; do mkdir d; cd d; i=$((i+1)); done
echo bottom > f
"""


def test_a_script_that_makes_a_2000_deep_tree_fails_in_one_line_and_the_next_build_recovers(tmp_path, tiny_catalog,
                                                                                           registries):
    """A build script (a third party's code) makes a tree deeper than image-builder walks. Before: the
    build died in RecursionError (clamping the tree's times, or removing the tree it left), a traceback,
    and so did every later build of the store, which removes that tree first."""
    (tmp_path / "scripts/make.sh").write_text(DEEP_SCRIPT)
    args = ("build", str(tiny_catalog), "--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "c"),
            "--ca-cert", str(registries.tls.cert))
    r = run_cli(*args)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("failed: environment tiny:") and "levels deep" in last, r.stderr[-3000:]
    (tmp_path / "scripts/make.sh").write_text(SCRIPT)
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sif_files(built_image(tmp_path / "store", "tiny"), tmp_path, "etc/built-by")["etc/built-by"] == \
        "greeting=hello world\n"
    assert not (tmp_path / "store/failed/envs/tiny").exists(), "the failed build's deep tree is still there"


UMASK_SCRIPT = """#!/bin/sh
set -eu
umask > /etc/built-umask
mkdir /etc/made
echo made > /etc/made/file
"""


def test_build_scripts_run_with_dockers_umask_whatever_the_builders(tmp_path, tiny_base, registries):
    """A build script's files get the modes they get in `docker build` (umask 0022), not the builder's: an
    admin's 077 (common on HPC sites) made every file the scripts wrote (a repository's checkout, its
    packages) 0600, unreadable to a sandbox's other users and not the modes the reference harnesses test."""
    catalog = write_catalog(tmp_path, [{"name": "tiny", "base": tiny_base, "scripts": ["make.sh"]}],
                            {"make.sh": UMASK_SCRIPT})
    before = os.umask(0o077)
    try:
        result = build_env(load(catalog).environments["tiny"], options(tmp_path, registries.tls.cert))
    finally:
        os.umask(before)
    assert sif_files(result.sif, tmp_path, "etc/built-umask")["etc/built-umask"] == "0022\n"
    part = read_sif(result.sif).primary_partition()
    listing = subprocess.run(["unsquashfs", "-o", str(part.offset), "-lln", str(result.sif), "etc/made"],
                             capture_output=True, text=True, check=True).stdout
    modes = {line.split()[-1]: line.split()[0] for line in listing.splitlines() if "etc/made" in line}
    assert modes == {"squashfs-root/etc/made": "drwxr-xr-x", "squashfs-root/etc/made/file": "-rw-r--r--"}, listing
