"""Slurm benchmark: what the scheduler adds to a sharded build.

The 8-instance catalog of the store tests (tiny base, one environment) built
into a fresh store, blob cache warm, two ways on this machine:

- one process, `image-builder build -j 2`;
- `image-builder slurm build --shards 4 --wait --poll 0.5` on a one-node
  cluster (Debian's munged, slurmctld and slurmd with Slurm's default
  scheduler settings, started here) whose cores run the 4 array tasks 2 at a
  time, one CPU each: the same parallelism.

Both do the same building, so the difference is what Slurm adds: three
scheduling hops (the first wave of array tasks, the second, the merge job), a
Python start-up and environment check per job, the merge and verify, and
polling. (A separate environments job, as an earlier version had, added a hop
and a job: 11.3 s in all.) Slurm schedules at most once per batch_sched_delay (3 s by default),
so a hop after a job shorter than that waits out the rest: instances that
build in a blink show the worst case, instances that take 2 s each (a sleep
standing in for a clone and a pip install) a more usual one.
Goal: under 10 s of overhead in total.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bench.common import VENV_BIN, Report, Row, timed
from image_builder.devtools.localregistry import push_image, self_signed_cert, start_registry
from image_builder.oci.layout import rootfs_layer
from image_builder.store.store import remove_tree
from tests.support.bases import tiny_rootfs
from tests.support.slurm_cluster import SlurmCluster, start_cluster
from tests.test_store import INSTANCE_SCRIPT, catalog

INSTANCES = 8
SHARDS = 4
GOAL = 10.0  # seconds of overhead


def compare(work: Path, base: str, ca: Path, cluster: SlurmCluster, seconds_each: int) -> tuple[float, float]:
    """(one process, Slurm) median wall times for instances whose script takes `seconds_each` more."""
    work.mkdir()
    cat = catalog(work, base, n=INSTANCES, instance_script=INSTANCE_SCRIPT + f"sleep {seconds_each}\n")
    store = work / "store"
    common = [str(cat), "--store", str(store), "--cache-dir", str(work.parent / "cache"), "--ca-cert", str(ca)]
    ib = str(VENV_BIN / "image-builder")
    epoch = {"SOURCE_DATE_EPOCH": "1700000000"}

    def fresh():  # each run builds everything, from a warm blob cache
        remove_tree(store)
    one = timed([ib, "build", *common, "-j", "2"], env=epoch, setup=fresh)
    arr = timed([ib, "slurm", "build", *common, "--shards", str(SHARDS), "--wait", "--poll", "0.5"],
                env={**epoch, **cluster.env}, setup=fresh)
    return one, arr


def main() -> Report:
    report = Report("slurm")
    with tempfile.TemporaryDirectory(prefix="ib-bench-slurm-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        work.chmod(0o755)  # munged checks that every directory above its socket is searchable
        (work / "cluster").mkdir(mode=0o755)
        tls = self_signed_cert(work, "tls")
        layer = rootfs_layer(tiny_rootfs(work / "rootfs"), work / "tiny.tar.gz")
        with start_registry(work, "bench", work / "storage", tls) as reg:
            push_image(reg.url, "bench/tiny", "1", [layer], ca=tls.cert)
            base = f"{reg.host}/bench/tiny:1"
            cluster = start_cluster(work / "cluster")
            try:
                for seconds_each, label in ((0, "instances built in a blink"), (2, "instances of 2 s each")):
                    one, arr = compare(work / f"sleep-{seconds_each}", base, tls.cert, cluster, seconds_each)
                    report.rows.append(Row(f"{INSTANCES} {label}: {SHARDS} array tasks on {os.cpu_count()} cores",
                                           arr, "one process, -j 2", one, f"Slurm adds < {GOAL:.0f} s"))
                    report.notes.append(f"{label}: Slurm adds {arr - one:.1f} s "
                                        f"({'meets' if arr - one < GOAL else 'misses'} the goal of < {GOAL:.0f} s)")
            finally:
                cluster.stop()
    report.notes.append("medians of 3 runs; Slurm's default scheduler settings (batch_sched_delay 3 s, so a hop "
                        "after a job shorter than 3 s waits out the rest)")
    return report


if __name__ == "__main__":
    r = main()
    r.print()
    r.save()
