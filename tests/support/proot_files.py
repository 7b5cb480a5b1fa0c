"""What proot left in /tmp: its loader (prooted-PID-*) and glue folders (proot-PID-*)."""

from __future__ import annotations

import os


def dead_proots_files(uid: int) -> list[str]:
    """`uid`'s proot files in /tmp whose proot is gone (a live one, another test's, keeps its own)."""
    left = []
    for name in os.listdir("/tmp"):
        kind, _, rest = name.partition("-")
        pid = rest.partition("-")[0]
        if kind in ("proot", "prooted") and pid.isdigit() and os.lstat(f"/tmp/{name}").st_uid == uid \
                and not os.path.exists(f"/proc/{pid}"):
            left.append(name)
    return left
