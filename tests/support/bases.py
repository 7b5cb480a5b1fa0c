"""Base root filesystems for build tests.

`tiny_rootfs`: dash as /bin/sh and a few coreutils with their libraries (a
couple of MB): enough to run scripts, so most build tests pack in a blink.
The Debian python base (debootstrap) is used where a real distribution matters.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

TOOLS = ("dash", "cat", "cp", "ls", "mkdir", "rm", "touch", "chmod", "id", "sleep", "env", "head", "dd", "sh")


def _libraries(binary: str) -> set[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    return {m for m in re.findall(r"(/\S+\.so[.\d]*)", out)}


def tiny_rootfs(dest: Path) -> Path:
    if (dest / "usr/bin/sh").exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for d in ("usr/bin", "usr/lib", "usr/lib64", "etc", "root", "tmp"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
        os.symlink(target, tmp / link)
    libs: set[str] = set()
    for tool in TOOLS:
        src = shutil.which(tool)
        real = os.path.realpath(src)
        libs |= _libraries(real)
        if tool == "sh":
            os.symlink("dash", tmp / "usr/bin/sh")
        else:
            shutil.copy2(real, tmp / "usr/bin" / tool)
    for lib in libs:
        real = os.path.realpath(lib)
        rel = lib.lstrip("/")
        rel = rel if rel.startswith("usr/") else "usr/" + rel
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(real, tmp / rel)
    (tmp / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    tmp.rename(dest)
    return dest
