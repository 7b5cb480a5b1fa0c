"""Agent sandbox benchmark (runtime/sandbox.py), side by side, as root on the Debian python image:

- exec latency of `python3 -c pass` in a live sandbox against `chroot DIR` and
  `bwrap --bind DIR /` of the same tree (interleaved rounds: the machine's load falls on
  all alike; goal within 1.2x of chroot);
- start of a sandbox (open + first exec; with no holder running, and with one up)
  against `ch-run FILE.sqfs -- true` of the same tree (goal: faster; Debian's ch-run
  mounts it with its built-in squashfuse), and against `ch-run DIR` (no mount at all);
- rootless (userns, as uid 65534): the same exec against `bwrap --unshare-user` into
  the same tree (a hard-linked copy uid 65534 can read);
- 64 sandboxes open at once, each having run `pip install` of one wheel into a venv
  of its own: memory each holds (tmpfs and init), and exec latency at that load.

    python -m bench.sandbox [ROUNDS]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import CACHE, Report, Row, need, python_rootfs, timed
from image_builder.pack.sif import write_sif
from image_builder.pack.squashfs import SquashOptions, pack
from image_builder.runtime.sandbox import Sandbox
from image_builder.runtime.session import Backend, InstanceLayers

PASS = ["python3", "-c", "pass"]
MANY = 64
NOBODY = 65534
# Timed as uid 65534 in one process (setpriv's own start-up is not counted): a sandbox's execs, then
# bwrap's, interleaved; prints the two medians.
_ROOTLESS = """
import json, statistics, subprocess, sys, time
from pathlib import Path
from image_builder.runtime.sandbox import Sandbox
from image_builder.runtime.session import Backend, InstanceLayers
sif, tree, bwrap, rounds, state = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
argv = ["python3", "-c", "pass"]
ours, peer = [], []
with Sandbox(InstanceLayers(Path(sif), (), {}, "/root"), backend=Backend.USERNS, state_dir=Path(state)) as box:
    for _ in range(rounds):
        t0 = time.perf_counter(); box.exec(argv); ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run([bwrap, "--unshare-user", "--uid", "0", "--bind", tree, "/", "--proc", "/proc", "--dev", "/dev",
                        *argv], check=True)
        peer.append(time.perf_counter() - t0)
print(json.dumps([statistics.median(ours), statistics.median(peer)]))
"""


def _env_sif(rootfs: Path) -> Path:
    sif = CACHE / f"sandbox-env-{rootfs.name}-{int(rootfs.stat().st_mtime)}.sif"
    if not sif.exists():
        write_sif(sif.with_suffix(".tmp"), rootfs, deffile="", labels={}, squash=SquashOptions(), created=0)
        sif.with_suffix(".tmp").rename(sif)
    return sif


def _root_sqfs(rootfs: Path) -> Path:
    """A plain .sqfs of the tree, for ch-run."""
    sqfs = CACHE / f"sandbox-root-{rootfs.name}-{int(rootfs.stat().st_mtime)}.sqfs"
    if not sqfs.exists():
        pack(rootfs, sqfs.with_suffix(".tmp"), SquashOptions())
        sqfs.with_suffix(".tmp").rename(sqfs)
    return sqfs


def _wheel() -> bytes:
    """A small pure-Python wheel (one module), made here: nothing is downloaded."""
    import base64
    import hashlib
    import io
    import zipfile

    files = {"ib_bench_pkg/__init__.py": b"VALUE = 42\n",
             "ib_bench_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: ib-bench-pkg\nVersion: 1.0\n",
             "ib_bench_pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\n"
                                                 b"Tag: py3-none-any\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items()) + "ib_bench_pkg-1.0.dist-info/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in {**files, "ib_bench_pkg-1.0.dist-info/RECORD": record.encode()}.items():
            z.writestr(name, data)
    return buf.getvalue()


def _shmem_kb() -> int:
    """tmpfs pages on the node: where a sandbox's writable layer lives."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(info["Shmem"].split()[0])


def _sandbox_pss_kb() -> int:
    """The proportional memory of every sandbox init (image-builder-init in "sandbox" mode) on the node."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:2] != [b"sandbox"]:
                continue
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except (OSError, IndexError):
            continue
        total += int(rollup.split("Pss:", 1)[1].split()[0])
    return total


def main(rounds: int = 40) -> Report:
    rootfs = python_rootfs()
    layers = InstanceLayers(_env_sif(rootfs), (), {}, "/root")
    bwrap, ch_run = need("bwrap"), need("ch-run")
    report = Report("sandbox")
    state = Path(tempfile.mkdtemp(prefix="ib-bench-sandbox-"))
    env = {"USER": "root"}  # ch-run wants one; timed() adds the rest of ours
    try:
        with Sandbox(layers, backend=Backend.KERNEL, state_dir=state / "warm") as box:
            times: dict[str, list[float]] = {"ours": [], "chroot": [], "bwrap": []}
            for _ in range(rounds):
                t0 = time.perf_counter()
                assert box.exec(PASS).exit_code == 0
                times["ours"].append(time.perf_counter() - t0)
                times["chroot"].append(timed(["chroot", str(rootfs), *PASS], repeat=1))
                times["bwrap"].append(timed([bwrap, "--bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev",
                                              *PASS], repeat=1))
            med = {k: statistics.median(v) for k, v in times.items()}
            report.rows.append(Row("exec `python3 -c pass` in a live sandbox (median)", med["ours"], "chroot DIR",
                                   med["chroot"], "<= 1.2x"))
            report.rows.append(Row("exec `python3 -c pass` in a live sandbox (median)", med["ours"], "bwrap --bind DIR /",
                                   med["bwrap"]))
        sqfs = _root_sqfs(rootfs)
        starts, peers, peers_dir = [], [], []
        for i in range(max(5, rounds // 8)):
            t0 = time.perf_counter()
            with Sandbox(layers, backend=Backend.KERNEL, state_dir=state / f"cold{i}") as box:
                box.exec(["true"])
                starts.append(time.perf_counter() - t0)
            peers.append(timed([ch_run, str(sqfs), "--", "true"], env=env, repeat=1))
            peers_dir.append(timed([ch_run, str(rootfs), "--", "true"], env=env, repeat=1))
        report.rows.append(Row("sandbox start: open (new holder) + first exec (median)", statistics.median(starts),
                               "ch-run FILE.sqfs -- true", statistics.median(peers), "< 1x"))
        report.rows.append(Row("sandbox start: open (new holder) + first exec (median)", statistics.median(starts),
                               "ch-run DIR -- true", statistics.median(peers_dir)))
        warm, on_disk = [], []
        (state / "layers").mkdir()
        with Sandbox(layers, backend=Backend.KERNEL, state_dir=state / "held") as holding:  # the holder stays up
            for _ in range(max(5, rounds // 4)):
                for times, extra in ((warm, {}), (on_disk, {"layer_dir": state / "layers"})):
                    t0 = time.perf_counter()
                    with Sandbox(layers, backend=Backend.KERNEL, state_dir=state / "held", **extra) as box:
                        box.exec(["true"])
                        times.append(time.perf_counter() - t0)
            holding.exec(["true"])
        report.rows.append(Row("sandbox start, the node's holder already up (median)", statistics.median(warm),
                               "ch-run FILE.sqfs -- true", statistics.median(peers), "< 1x"))
        report.rows.append(Row("sandbox start, its layer on disk (an ext4 of 10 GB: mkfs, loop), holder up (median)",
                               statistics.median(on_disk), "its layer a tmpfs", statistics.median(warm)))
        public = Path(tempfile.mkdtemp(prefix="ib-bench-sandbox-public-", dir="/var/tmp"))
        try:
            public.chmod(0o755)
            os.link(layers.env_sif, public / "env.sif")
            subprocess.run(["cp", "-al", str(rootfs), str(public / "tree")], check=True)
            (public / "state").mkdir()
            os.chown(public / "state", NOBODY, NOBODY)
            out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                  sys.executable, "-c", _ROOTLESS, str(public / "env.sif"), str(public / "tree"), bwrap,
                                  str(rounds), str(public / "state")], check=True, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}, cwd="/")
            ours_rootless, bwrap_rootless = json.loads(out.stdout.splitlines()[-1])
        finally:
            shutil.rmtree(public, ignore_errors=True)
        report.rows.append(Row("rootless exec `python3 -c pass` (uid 65534, median)", ours_rootless,
                               "bwrap --unshare-user into DIR", bwrap_rootless, "<= 1.2x"))
        wheel = _wheel()
        install = ["sh", "-c", "python3 -m venv /opt/v && /opt/v/bin/pip install -q --no-index /tmp/ib_bench_pkg-1.0-"
                               "py3-none-any.whl && /opt/v/bin/python -c 'import ib_bench_pkg'"]
        before = _shmem_kb()
        boxes = []
        try:
            for i in range(MANY):
                box = Sandbox(layers, backend=Backend.KERNEL, state_dir=state / "many")
                boxes.append(box)
                box.write_file("/tmp/ib_bench_pkg-1.0-py3-none-any.whl", wheel)
                r = box.exec(install, timeout=300)
                assert r.exit_code == 0, r.stderr[-2000:]
            held_layer = (_shmem_kb() - before) / MANY
            held_init = _sandbox_pss_kb() / MANY
            loaded = []
            for _ in range(rounds):
                for box in boxes[:4]:
                    t0 = time.perf_counter()
                    box.exec(PASS)
                    loaded.append(time.perf_counter() - t0)
        finally:
            for box in boxes:
                box.close()
        report.rows.append(Row(f"exec latency with {MANY} sandboxes open (median)", statistics.median(loaded),
                               "one sandbox open", med["ours"]))
        report.notes.append(f"memory held per open sandbox, each with a venv and one wheel pip-installed in its "
                            f"writable layer: {held_layer / 1024:.2f} MB of tmpfs (the node's Shmem growth / {MANY}) "
                            f"and {held_init:.0f} KB of init (PSS); the mounts are shared: one per image per node")
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return report


if __name__ == "__main__":
    r = main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
    r.print()
    r.save()
