"""Where a store keeps its files.

    STORE/
      index.json                 what the store holds (see index/schema.json)
      envs/<name>.sif            one image per environment
      instances/<id>.sqfs        one overlay per instance
      logs/envs/<name>/          build logs, one file per script
      logs/instances/<id>.log
      failed/envs/<name>/        a failed build's root filesystem, kept for `debug`
      work/                      builds in progress (removed when they end)

Every path the index records is relative to STORE, so a store can be copied
or rsynced to a shared filesystem and still resolve.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path


def remove_tree(path: Path) -> None:
    """rmtree that also removes read-only directories a rootless build left behind."""
    def make_writable_and_retry(func, p, _exc):
        parent = os.path.dirname(p)
        os.chmod(parent, os.stat(parent).st_mode | stat.S_IRWXU)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, os.stat(p).st_mode | stat.S_IRWXU)
        func(p)

    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, onerror=make_writable_and_retry)


@dataclass(frozen=True)
class StorePaths:
    root: Path

    def env_sif(self, name: str) -> Path:
        return self.root / "envs" / f"{name}.sif"

    def instance_sqfs(self, instance_id: str) -> Path:
        return self.root / "instances" / f"{instance_id}.sqfs"

    def env_logs(self, name: str) -> Path:
        return self.root / "logs" / "envs" / name

    def instance_log(self, instance_id: str) -> Path:
        return self.root / "logs" / "instances" / f"{instance_id}.log"

    def failed_env(self, name: str) -> Path:
        return self.root / "failed" / "envs" / name

    def work(self, name: str) -> Path:
        return self.root / "work" / f"{name}.{os.getpid()}"

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.root))
