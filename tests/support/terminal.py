"""Driving a program on a pseudo-terminal, as a user's shell runs."""

from __future__ import annotations

import os
import select
import time


def read_pty(master: int, timeout: float) -> bytes:
    """What the program on the terminal's other side writes until it closes it (or `timeout`)."""
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 1)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the terminal closed
                break
            if not chunk:
                break
            out += chunk
    return out
