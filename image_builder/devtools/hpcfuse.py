"""/dev/fuse as HPC hosts leave it (mode 666), for the tests' and benchmarks' rootless runs, and back after.

HPC hosts leave /dev/fuse mode 666 so users can mount squashfuse; the rootless tests and benchmarks (uid
65534) need the same. A fresh Debian host has 600, and the next run on this machine (`make demo`, CI) must
meet that again: the mode found first is kept in MODE_FILE and put back by the last holder to leave.
Several holders may run at once (a test session, `make bench`): each holds LOCK shared while it runs; the
one that can take it exclusively when it leaves is the last. MODE_FILE outlives a killed holder: the next
one's leave restores the mode it recorded.
"""

from __future__ import annotations

import fcntl
import os
import stat
from typing import IO

FUSE = "/dev/fuse"
LOCK = "/run/image-builder-tests.lock"
MODE_FILE = "/run/image-builder-tests.fuse-mode"


def open_fuse_to_users() -> IO | None:
    """Make /dev/fuse mode 666 (as root, where it exists); the token to hand to `restore_fuse`, or None
    where nothing was changed."""
    if os.geteuid() != 0 or not os.path.exists(FUSE):
        return None
    lock = open(LOCK, "a")  # noqa: SIM115 - held until restore_fuse
    fcntl.flock(lock, fcntl.LOCK_SH)  # waits only while a leaving holder puts the mode back
    mode = oct(stat.S_IMODE(os.stat(FUSE).st_mode)).encode()
    try:  # the first holder keeps the mode; O_EXCL: one of two starting at once
        fd = os.open(MODE_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        os.write(fd, mode)
        os.close(fd)
    os.chmod(FUSE, 0o666)
    return lock


def restore_fuse(lock: IO | None) -> None:
    """Put /dev/fuse's first mode back if this is the last holder; else leave that to the last."""
    if lock is None:
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return  # another holder still runs: the last one out restores
    with open(MODE_FILE) as f:
        os.chmod(FUSE, int(f.read(), 8))
    os.unlink(MODE_FILE)
    lock.close()
