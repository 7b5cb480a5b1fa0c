"""devtools/hpcfuse.py: /dev/fuse mode 666 while test sessions and benchmark runs go, the first mode back after
the last of them, on a stand-in device file."""

from __future__ import annotations

import os
import stat

import pytest

from image_builder.devtools import hpcfuse


@pytest.fixture
def device(tmp_path, monkeypatch):
    fuse = tmp_path / "fuse"
    fuse.write_text("")
    os.chmod(fuse, 0o600)
    monkeypatch.setattr(hpcfuse, "FUSE", str(fuse))
    monkeypatch.setattr(hpcfuse, "LOCK", str(tmp_path / "lock"))
    monkeypatch.setattr(hpcfuse, "MODE_FILE", str(tmp_path / "mode"))
    return fuse


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_last_holder_out_puts_the_first_mode_back(device):
    tests = hpcfuse.open_fuse_to_users()
    bench = hpcfuse.open_fuse_to_users()  # a benchmark run while a test session goes: it must not record 666
    assert mode(device) == 0o666
    hpcfuse.restore_fuse(tests)
    assert mode(device) == 0o666, "the benchmark still runs rootless rows"
    hpcfuse.restore_fuse(bench)
    assert mode(device) == 0o600 and not os.path.exists(hpcfuse.MODE_FILE)


def test_a_killed_holder_s_mode_is_put_back_by_the_next(device):
    hpcfuse.open_fuse_to_users().close()  # killed: its lock gone, the mode file left
    assert mode(device) == 0o666
    hpcfuse.restore_fuse(hpcfuse.open_fuse_to_users())
    assert mode(device) == 0o600
