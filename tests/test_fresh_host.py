"""What a fresh Debian host gives root: /dev/fuse mode 600, which only root can open.

The suite makes /dev/fuse mode 666 for its rootless tests (conftest), so these tests give
one command a mode-600 /dev/fuse of its own: a private mount namespace with a root-owned
node of the same device bound over it. The host's device is never touched.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from pathlib import Path

from image_builder.store.index import read_index
from tests.conftest import ROOT
from tests.test_store import catalog

EXE = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "image-builder"


def as_on_a_fresh_host(tmp: Path, *argv: str) -> subprocess.CompletedProcess:
    """argv as root where /dev/fuse is root's, mode 600."""
    scratch = Path(tempfile.mkdtemp(prefix="fresh-dev-", dir=tmp))
    rdev = os.stat("/dev/fuse").st_rdev
    script = (f"set -e; mount -t tmpfs -o mode=755 fresh {shlex.quote(str(scratch))}; "
              f"mknod -m 600 {shlex.quote(str(scratch))}/fuse c {os.major(rdev)} {os.minor(rdev)}; "
              f"mount --bind {shlex.quote(str(scratch))}/fuse /dev/fuse; "
              'test "$(stat -c %a /dev/fuse)" = 600; exec "$@"')
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "fresh", *argv],
                          capture_output=True, text=True, timeout=600)


def test_a_root_build_and_run_need_no_fuse_for_others(tmp_path, tiny_base, registries):
    """The instance build runs its scripts as BUILD_UID over the environment's image, mounted
    with squashfuse in the build's user namespace; before the fix: `fuse: failed to open
    /dev/fuse: Permission denied` and every instance failed on a fresh host."""
    cat = catalog(tmp_path, tiny_base, n=2)
    r = as_on_a_fresh_host(tmp_path, str(EXE), "build", str(cat), "--store", str(tmp_path / "store"),
                           "--ca-cert", str(registries.tls.cert), "-j", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(read_index(tmp_path / "store").instances) == ["task-0", "task-1"]
    run = as_on_a_fresh_host(tmp_path, str(EXE), "run", "--store", str(tmp_path / "store"), "task-1",
                             "--", "cat", "/etc/task")
    assert run.returncode == 0 and run.stdout == "task 1\n", run.stdout + run.stderr
