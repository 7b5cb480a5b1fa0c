"""Build benchmark: one environment script under each sandbox backend, and packing.

- The same script (create a venv, install a few wheels, byte-compile) on a
  fresh copy of a Debian python tree under chroot, userns and proot; ratios to
  chroot (goal: userns within 1.1x).
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


def script_run(base: Path, backend: BuildBackend, context: Path, work: Path) -> tuple[float, Path]:
    root = work / f"root-{backend.value}"
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run(["cp", "-a", str(base), str(root)], check=True)
    script = ROOT / "env_scripts" / "python-venv.sh"
    spec = SandboxSpec(root, env={"VENV": "/opt/venv"}, binds=(Bind(context, "/build"),))
    t0 = time.perf_counter()
    result = sandbox_run(spec, ["/bin/sh", "/tmp/.image-builder/python-venv.sh"], backend=backend, timeout=1800,
                         files={"python-venv.sh": script})
    elapsed = time.perf_counter() - t0
    if result.returncode:
        raise RuntimeError(f"{backend.value}: script failed: {result.tail}")
    return elapsed, root


def main() -> Report:
    base = python_rootfs()
    report = Report("build")
    with tempfile.TemporaryDirectory(prefix="ib-bench-build-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        context = work / "context"
        shutil.copytree(wheels(), context / "wheels")
        times = {}
        for backend in (BuildBackend.CHROOT, BuildBackend.USERNS, BuildBackend.PROOT):
            times[backend], tree = script_run(base, backend, context, work)
        for backend in (BuildBackend.USERNS, BuildBackend.PROOT):
            goal = "<= 1.1x" if backend is BuildBackend.USERNS else "(ptrace: expected slower)"
            report.rows.append(Row(f"venv + {len(WHEELS)} wheels + compileall, {backend.value}", times[backend],
                                   "chroot", times[BuildBackend.CHROOT], goal))

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
