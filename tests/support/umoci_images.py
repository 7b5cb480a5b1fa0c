"""Benchmark-shaped OCI images made with the real tools, as a site would make or mirror them.

umoci builds every layer: `umoci insert` of a directory (the base; an opaque
directory), `umoci repack` of a change to an unpacked bundle (it diffs the tree: its
own `.wh.` entries for what was deleted, its own owners, modes and times); skopeo
pushes them. The shape is SWE-bench's: a Debian base
layer, an environment layer (a venv), and per instance a layer that clones a repository
at a commit into /testbed. Each layout is cached by what made it: an edit to this file
remakes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

@dataclass(frozen=True)
class InstanceImage:
    """One instance image: `repo` (a git bundle) cloned at `commit` into /testbed."""
    tag: str
    repo: Path
    commit: str
    delete: tuple[str, ...] = ()  # environment paths the instance removes: umoci writes whiteouts
    opaque: str | None = None  # an environment directory the layer replaces whole (.wh..wh..opq)
    user: str | None = None  # the config's User
    extra: tuple[tuple[str, str], ...] = ()  # (path, umoci config flag value) pairs: owners and links, below


def _umoci(*args: str) -> None:
    subprocess.run(["umoci", *args], check=True, capture_output=True)


def _clone(repo: Path, commit: str, dest: Path) -> None:
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(repo), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", commit], check=True)


def make_layout(layout: Path, base_rootfs: Path, instances: list[InstanceImage]) -> Path:
    """An OCI layout with one tag per instance (and `base`, `env`), made once per inputs."""
    key = hashlib.sha256(json.dumps([str(base_rootfs), [i.__dict__ for i in instances],
                                     Path(__file__).read_text()], default=str).encode()).hexdigest()[:16]
    done = layout / f".made-{key}"
    if done.exists():
        return layout
    shutil.rmtree(layout, ignore_errors=True)
    work = layout.with_name(layout.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _umoci("init", "--layout", str(layout))
    _umoci("new", "--image", f"{layout}:base")
    _umoci("insert", "--image", f"{layout}:base", str(base_rootfs), "/")  # the tree debootstrap made
    # The environment: a venv with the wheels Debian's python3-venv bundles (pip, setuptools).
    env = work / "env"
    _umoci("unpack", "--image", f"{layout}:base", str(env))
    subprocess.run([shutil.which("chroot"), str(env / "rootfs"), "python3", "-m", "venv", "/opt/venv"], check=True,
                   env={"PATH": "/usr/bin:/bin", "HOME": "/root"})
    _umoci("repack", "--image", f"{layout}:env", str(env))
    _umoci("config", "--image", f"{layout}:env", "--config.env", "PATH=/opt/venv/bin:/usr/bin:/bin",
           "--config.workingdir", "/testbed")
    shutil.rmtree(env)
    for inst in instances:
        if inst.opaque:
            _opaque_layer(layout, work, inst)
        else:
            bundle = work / inst.tag
            _umoci("unpack", "--image", f"{layout}:env", str(bundle))
            rootfs = bundle / "rootfs"
            _clone(inst.repo, inst.commit, rootfs / "testbed")
            for path in inst.delete:
                target = rootfs / path
                shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
            for path, how in inst.extra:
                _extra(rootfs, path, how)
            _umoci("repack", "--image", f"{layout}:{inst.tag}", str(bundle))
            shutil.rmtree(bundle)
        flags = ["--config.env", f"INSTANCE={inst.tag}", "--config.cmd", "sh", "--config.cmd", "-c",
                 "--config.cmd", "echo hi"]
        if inst.user:
            flags += ["--config.user", inst.user]
        _umoci("config", "--image", f"{layout}:{inst.tag}", *flags)
    _umoci("gc", "--layout", str(layout))
    shutil.rmtree(work)
    done.touch()
    return layout


def _extra(rootfs: Path, path: str, how: str) -> None:
    """owner=UID:GID, mode=OCTAL, symlink=TARGET, hardlink=EXISTING: what checkouts alone never have."""
    kind, _, value = how.partition("=")
    target = rootfs / path
    if kind == "owner":
        uid, gid = value.split(":")
        os.lchown(target, int(uid), int(gid))
    elif kind == "mode":
        target.chmod(int(value, 8))
    elif kind == "symlink":
        target.symlink_to(value)
    elif kind == "hardlink":
        os.link(rootfs / value, target)
    else:
        raise ValueError(how)


def _opaque_layer(layout: Path, work: Path, inst: InstanceImage) -> None:
    """Two layers: `<opaque>` replaced whole by a directory holding one file (umoci
    insert --opaque: an opaque marker), then the clone."""
    stage = work / inst.tag
    (stage / "dir").mkdir(parents=True)
    (stage / "dir" / "only-this").write_text("the directory holds this alone\n")
    _clone(inst.repo, inst.commit, stage / "testbed")
    _umoci("insert", "--image", f"{layout}:env", "--tag", inst.tag, "--opaque", str(stage / "dir"), inst.opaque)
    _umoci("insert", "--image", f"{layout}:{inst.tag}", str(stage / "testbed"), "/testbed")
    shutil.rmtree(stage)


def push(layout: Path, tag: str, dest: str, cert_dir: Path) -> None:
    """skopeo copy oci:LAYOUT:TAG docker://DEST, trusting the test registry's CA."""
    subprocess.run(["skopeo", "copy", "-q", "--dest-cert-dir", str(cert_dir), f"oci:{layout}:{tag}",
                    f"docker://{dest}"], check=True, capture_output=True)
