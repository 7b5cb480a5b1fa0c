"""Agent sandbox benchmark (runtime/sandbox.py), side by side, as root on the Debian python image:

- exec latency of `python3 -c pass` in a live sandbox against `chroot DIR` and
  `bwrap --bind DIR /` of the same tree (interleaved rounds: the machine's load falls on
  all alike; goal within 1.2x of chroot);
- start of a sandbox (open + first exec; with no holder running, and with one up)
  against `ch-run DIR -- true` (goal: faster; ch-run on the directory, not on a .sqfs:
  Debian's ch-run mounts no squashfs, so the peer pays no mount);
- 16 sandboxes open at once, each having installed a package into its own root (a
  wheel-sized tree copied in with pip's layout): memory each holds (the growth of the
  node's used memory, divided), and exec latency at that load.

    python -m bench.sandbox [ROUNDS]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import CACHE, Report, Row, need, python_rootfs
from image_builder.pack.sif import write_sif
from image_builder.pack.squashfs import SquashOptions
from image_builder.runtime.sandbox import Sandbox
from image_builder.runtime.session import Backend, InstanceLayers

PASS = ["python3", "-c", "pass"]
MANY = 16


def _env_sif(rootfs: Path) -> Path:
    sif = CACHE / f"sandbox-env-{rootfs.name}-{int(rootfs.stat().st_mtime)}.sif"
    if not sif.exists():
        write_sif(sif.with_suffix(".tmp"), rootfs, deffile="", labels={}, squash=SquashOptions(), created=0)
        sif.with_suffix(".tmp").rename(sif)
    return sif


def _run(argv: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


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
    env = {**os.environ, "USER": "root"}
    try:
        with Sandbox(layers, backend=Backend.KERNEL, state_dir=state / "warm") as box:
            times: dict[str, list[float]] = {"ours": [], "chroot": [], "bwrap": []}
            for _ in range(rounds):
                t0 = time.perf_counter()
                assert box.exec(PASS).exit_code == 0
                times["ours"].append(time.perf_counter() - t0)
                times["chroot"].append(_run(["chroot", str(rootfs), *PASS]))
                times["bwrap"].append(_run([bwrap, "--bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev",
                                            *PASS]))
            med = {k: statistics.median(v) for k, v in times.items()}
            report.rows.append(Row("exec `python3 -c pass` in a live sandbox (median)", med["ours"], "chroot DIR",
                                   med["chroot"], "<= 1.2x"))
            report.rows.append(Row("exec `python3 -c pass` in a live sandbox (median)", med["ours"], "bwrap --bind DIR /",
                                   med["bwrap"]))
        starts, peers = [], []
        for i in range(max(5, rounds // 8)):
            t0 = time.perf_counter()
            with Sandbox(layers, backend=Backend.KERNEL, state_dir=state / f"cold{i}") as box:
                box.exec(["true"])
                starts.append(time.perf_counter() - t0)
            peers.append(_run([ch_run, str(rootfs), "--", "true"], env=env))
        report.rows.append(Row("sandbox start: open (new holder) + first exec (median)", statistics.median(starts),
                               "ch-run DIR -- true", statistics.median(peers), "< 1x"))
        warm = []
        with Sandbox(layers, backend=Backend.KERNEL, state_dir=state / "held") as holding:  # the holder stays up
            for _ in range(max(5, rounds // 4)):
                t0 = time.perf_counter()
                with Sandbox(layers, backend=Backend.KERNEL, state_dir=state / "held") as box:
                    box.exec(["true"])
                    warm.append(time.perf_counter() - t0)
            holding.exec(["true"])
        report.rows.append(Row("sandbox start, the node's holder already up (median)", statistics.median(warm),
                               "ch-run DIR -- true", statistics.median(peers), "< 1x"))
        site = "/usr/local/lib/python3.11/dist-packages/ib_bench_pkg"
        install = ["sh", "-c", f"mkdir -p {site} && for i in $(seq 200); do head -c 4096 /dev/urandom > {site}/m$i.py;"
                               " done"]
        before = _shmem_kb()
        boxes = []
        try:
            for i in range(MANY):
                box = Sandbox(layers, backend=Backend.KERNEL, state_dir=state / "many")
                boxes.append(box)
                assert box.exec(install).exit_code == 0
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
        report.notes.append(f"memory held per open sandbox, each with an 800 KB package installed in its writable "
                            f"layer: {held_layer / 1024:.2f} MB of tmpfs (the node's Shmem growth / {MANY}) and "
                            f"{held_init:.0f} KB of init (PSS); the mounts are shared: one per image per node")
        report.notes.append("rootless (userns, uid 65534) sandboxes are not in this table yet")
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return report


if __name__ == "__main__":
    r = main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
    r.print()
    r.save()
