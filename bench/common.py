"""Shared pieces of the benchmarks: the base rootfs, peers, timing and reporting.

Each benchmark measures this project and its peer tool in the same run, on the
same input, and reports the ratio. Peers that are missing are installed.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from image_builder.oci.debian import debian_rootfs

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("IMAGE_BUILDER_BENCH_CACHE", Path.home() / ".cache" / "image_builder-bench"))
OUT = ROOT / "bench" / "out"
VENV_BIN = Path(sys.executable).parent
PEER_PACKAGES = {"skopeo": "skopeo", "ch-image": "charliecloud-builders python3-lark python3-requests",
                 "ch-run": "charliecloud-runtime", "bwrap": "bubblewrap", "debootstrap": "debootstrap"}


def need(tool: str) -> str:
    """The path of a peer tool, installing its Debian package if missing."""
    if not shutil.which(tool):
        subprocess.run(f"apt-get install -y -qq --no-install-recommends {PEER_PACKAGES[tool]}", shell=True,
                       check=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    return shutil.which(tool)


def python_rootfs(suite: str = "bookworm") -> Path:
    """Debian minbase + python3, venv and git (about 280 MB), made once with debootstrap, kept in the bench cache."""
    need("debootstrap")
    return debian_rootfs(suite, CACHE)


def timed(cmd: list[str] | str, *, env: dict | None = None, setup=None, repeat: int = 3, **kw) -> float:
    """Median wall time of a command over `repeat` runs; `setup` runs before each, untimed,
    then sync: a command that fsyncs (ours do, before publishing) must not wait for what
    earlier ones left to write back (ext4 commits it with the journal)."""
    times = []
    for _ in range(repeat):
        if setup:
            setup()
        os.sync()
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, shell=isinstance(cmd, str), **kw)
        times.append(time.perf_counter() - t0)
        if r.returncode:
            raise RuntimeError(f"{cmd} failed ({r.returncode}): {r.stderr.decode()[-1500:]}")
    return statistics.median(times)


@dataclass
class Row:
    what: str
    ours: float
    peer_name: str
    peer: float
    goal: str = ""
    unit: str = "s"

    @property
    def ratio(self) -> float:
        return self.ours / self.peer if self.peer else float("nan")


@dataclass
class Report:
    area: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def print(self) -> None:
        print(f"\n## {self.area} ({os.cpu_count()} cores, {platform.machine()}, {time.strftime('%Y-%m-%d')})")
        print("| what | image_builder | peer | peer time | ratio | goal |")
        print("|---|---|---|---|---|---|")
        for r in self.rows:
            print(f"| {r.what} | {r.ours:.3f} {r.unit} | {r.peer_name} | {r.peer:.3f} {r.unit} | "
                  f"{r.ratio:.2f}x | {r.goal} |")
        for n in self.notes:
            print(f"- {n}")

    def save(self) -> Path:
        OUT.mkdir(parents=True, exist_ok=True)
        path = OUT / f"{self.area}.json"
        path.write_text(json.dumps({"area": self.area, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                                    "rows": [asdict(r) | {"ratio": r.ratio} for r in self.rows],
                                    "notes": self.notes}, indent=2))
        return path
