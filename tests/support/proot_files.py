"""What proot left in /tmp: its loader (prooted-PID-*) and glue folders (proot-PID-*)."""

from __future__ import annotations

import os


def proots_files(uid: int) -> dict[str, bool]:
    """`uid`'s proot files in /tmp, each with whether the proot that made it (the PID in its name) still runs."""
    found = {}
    for name in os.listdir("/tmp"):
        kind, _, rest = name.partition("-")
        pid = rest.partition("-")[0]
        if kind in ("proot", "prooted") and pid.isdigit() and os.lstat(f"/tmp/{name}").st_uid == uid:
            found[name] = os.path.exists(f"/proc/{pid}")
    return found


def dead_proots_files(uid: int) -> list[str]:
    """`uid`'s proot files in /tmp whose proot is gone (a live one, another test's, keeps its own)."""
    return [name for name, alive in proots_files(uid).items() if not alive]
