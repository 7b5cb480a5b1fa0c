"""Build benchmark: one environment script in the build sandbox, and packing.

- The same script (create a venv, install a few wheels, byte-compile) on a
  fresh copy of a Debian python tree, as root: through the build sandbox (a user
  namespace whose root is BUILD_UID, the tree handed to it, pivot_root, a /dev and
  /proc of its own) against plain `chroot` in a private mount namespace, the
  unguarded way the builder used to run root builds (goal: within 1.1x).
- Packing that tree: our `.sif` (write_sif) against bare `mksquashfs` with the
  same flags (goal: within 1.05x), and the `.sif` size against the squashfs alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import CACHE, ROOT, Report, Row, python_rootfs
from image_builder.build.sandbox import BuildBackend, Bind, SandboxSpec, run as sandbox_run
from image_builder.pack.sif import write_sif
from image_builder.pack.squashfs import SquashOptions, mksquashfs_command

WHEELS = ("six", "attrs", "iniconfig", "packaging", "pluggy", "pytest")


def wheels() -> Path:
    dest = CACHE / "wheels"
    if not dest.is_dir() or not list(dest.glob("*.whl")):
        tmp = CACHE / "wheels.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version",
                        "3.11", "-d", str(tmp), *WHEELS], check=True)
        tmp.rename(dest)
    return dest


SCRIPT = ROOT / "env_scripts" / "python-venv.sh"


def fresh_tree(base: Path, work: Path, name: str) -> Path:
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run(["cp", "-a", str(base), str(root)], check=True)
    return root


def sandboxed(base: Path, context: Path, work: Path) -> tuple[float, Path]:
    root = fresh_tree(base, work, "root-sandbox")
    spec = SandboxSpec(root, env={"VENV": "/opt/venv"}, binds=(Bind(context, "/build"),))
    t0 = time.perf_counter()
    result = sandbox_run(spec, ["/bin/sh", "/tmp/.image-builder/python-venv.sh"], backend=BuildBackend.USERNS,
                         timeout=1800, files={"python-venv.sh": SCRIPT})
    elapsed = time.perf_counter() - t0
    if result.returncode:
        raise RuntimeError(f"build sandbox: script failed: {result.tail}")
    return elapsed, root


def chrooted(base: Path, context: Path, work: Path) -> float:
    root = fresh_tree(base, work, "root-chroot")
    (root / "build").mkdir(exist_ok=True)
    shutil.copy(SCRIPT, root / "python-venv.sh")
    setup = ('mount --bind "$1" "$0/build" && mount -t proc proc "$0/proc" && mount -t tmpfs tmpfs "$0/tmp" && '
             'exec chroot "$0" env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root VENV=/opt/venv '
             '/bin/sh /python-venv.sh')
    t0 = time.perf_counter()
    subprocess.run(["unshare", "--mount", "--pid", "--fork", "--propagation", "private", "sh", "-c", setup,
                    str(root), str(context)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> Report:
    base = python_rootfs()
    report = Report("build")
    with tempfile.TemporaryDirectory(prefix="ib-bench-build-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        context = work / "context"
        shutil.copytree(wheels(), context / "wheels")
        peer = chrooted(base, context, work)
        ours, tree = sandboxed(base, context, work)
        report.rows.append(Row(f"venv + {len(WHEELS)} wheels + compileall, as root", ours, "chroot", peer,
                               "<= 1.1x"))

        opts = SquashOptions()
        bare = work / "bare.sqfs"
        cmd = mksquashfs_command(tree, bare, opts)
        t_bare, t_sif = [], []
        for _ in range(5):
            bare.unlink(missing_ok=True)
            os.sync()  # as in common.timed: nothing earlier left to write back
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            t_bare.append(time.perf_counter() - t0)
            (work / "env.sif").unlink(missing_ok=True)  # as for the peer: removing the last one is not timed
            os.sync()
            t0 = time.perf_counter()
            write_sif(work / "env.sif", tree, deffile="bench\n", labels={}, squash=opts)
            t_sif.append(time.perf_counter() - t0)
        report.rows.append(Row("pack a python env (zstd -3)", sorted(t_sif)[2], "bare mksquashfs",
                               sorted(t_bare)[2], "<= 1.05x"))
        sif_size, sqfs_size = (work / "env.sif").stat().st_size, bare.stat().st_size
        report.notes.append(f".sif {sif_size / 1e6:.1f} MB against bare squashfs {sqfs_size / 1e6:.1f} MB "
                            f"(+{sif_size - sqfs_size} bytes of SIF header, descriptors and alignment)")
    return report


if __name__ == "__main__":
    r = main()
    r.print()
    r.save()
