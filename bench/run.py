"""`make bench`: every benchmark under bench/, side by side with its peer, into bench/RESULTS.md."""

from __future__ import annotations

import importlib
import os
import platform
import sys
import time
import traceback

from bench.common import ROOT
from image_builder.devtools.hpcfuse import open_fuse_to_users, restore_fuse

AREAS = ["pull", "build", "store", "imports", "runtime", "sandbox", "graders", "rewards", "slurm", "serve"]


def kept_sections(measured: set[str]) -> dict[str, list[str]]:
    """The sections of the RESULTS.md there now, by area, but those measured now: `make bench AREAS=...`
    replaces only its own, and an area that failed keeps its last figures."""
    path = ROOT / "bench" / "RESULTS.md"
    sections: dict[str, list[str]] = {}
    current = None
    for line in path.read_text().splitlines() if path.exists() else ():
        if line.startswith("## "):
            current = line[3:].strip()
            sections[current] = []
        if current and current not in measured:
            sections[current].append(line)
    return {k: v for k, v in sections.items() if k not in measured}


def main() -> int:
    # The rootless rows run as uid 65534 over squashfuse: /dev/fuse as HPC hosts have it, put back after.
    fuse = open_fuse_to_users()
    try:
        return run(sys.argv[1:] or AREAS)
    finally:
        restore_fuse(fuse)


def run(wanted: list[str]) -> int:
    sections, failed = [], []
    for area in wanted:
        try:
            module = importlib.import_module(f"bench.{area}")
        except ModuleNotFoundError:
            continue
        print(f"== {area}", flush=True)
        try:
            report = module.main()
        except Exception:  # one broken benchmark must not hide the others' figures
            traceback.print_exc()
            failed.append(area)
            continue
        report.print()
        report.save()
        sections.append(report)
    lines = ["# Benchmark results", "",
             f"{os.cpu_count()} cores, {platform.machine()}, {platform.platform()}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}. Produced by `make bench`; each row is this project "
             "against its peer measured in the same run, the ratio being ours / peer. Areas not run this "
             "time (`make bench AREAS=...`) keep their earlier figures; bench/out/AREA.json dates each.", ""]
    ran = {r.area: r for r in sections}
    kept = kept_sections(set(ran))
    for area in [a for a in AREAS if a in ran or a in kept] + [a for a in kept if a not in AREAS]:
        if area not in ran:
            lines += kept[area]  # measured by an earlier run (its own date is in bench/out/AREA.json)
            continue
        r = ran[area]
        lines += [f"## {r.area}", "", "| what | image_builder | peer | peer value | ratio | goal |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {row.what} | {row.ours:.3f} {row.unit} | {row.peer_name} | {row.peer:.3f} {row.unit} | "
                  f"{row.ratio:.2f}x | {row.goal} |" for row in r.rows]
        lines += [f"- {n}" for n in r.notes] + [""]
    if failed:
        lines.append(f"Failed to run: {', '.join(failed)} (see the output of make bench).")
    (ROOT / "bench" / "RESULTS.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {ROOT / 'bench' / 'RESULTS.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
