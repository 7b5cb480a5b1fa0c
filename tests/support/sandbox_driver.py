"""Runs steps on one runtime Sandbox in its own process, so that tests can run it as
another user (setpriv) and kill its holder in the middle.

    python sandbox_driver.py < scenario.json   # prints one JSON line per step

scenario: {"layers": {"env_sif", "overlays", "env", "workdir"}, "backend", "state_dir",
"sandbox": Sandbox keywords, "steps": [[op, {keywords}]...]}; ops: exec (exec's keywords,
input as base64), read_file / write_file (data as base64) / download, sleep {seconds},
together {steps: [[op, {keywords}, delay]...]} (each step in a thread of its own, started
`delay` seconds in; a list of their lines),
kill_holder (SIGKILL to the mount holder), host_files {path} (what is below a host path:
relative name -> size), host_uids {text} (the host's real uid of each process whose command
line holds `text`), close. A step's line: {"ok": result} or
{"error": exception type, "message"}; exec's result is RunResult's fields, bytes as base64.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from image_builder.runtime.sandbox import Sandbox  # noqa: E402
from image_builder.runtime.session import Backend, InstanceLayers  # noqa: E402


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _step(box: Sandbox, op: str, kw: dict):
    if op == "exec":
        if kw.get("input") is not None:
            kw["input"] = base64.b64decode(kw["input"])
        out = asdict(box.exec(**kw))
        out["stdout"], out["stderr"] = _b64(out["stdout"]), _b64(out["stderr"])
        return out
    if op == "read_file":
        data = box.read_file(kw["path"], text=False)
        return _b64(data)
    if op == "write_file":
        return box.write_file(kw["path"], base64.b64decode(kw["data"]))
    if op == "download":
        box.download(kw["path"], kw["host_path"])
        return sorted(str(p.relative_to(kw["host_path"])) for p in Path(kw["host_path"]).rglob("*"))
    if op == "sleep":
        return time.sleep(kw["seconds"])
    if op == "kill_holder":
        os.kill(box._session._holder_pid, signal.SIGKILL)
        return time.sleep(0.5)
    if op == "host_files":
        return {str(p.relative_to(kw["path"])): p.stat().st_size for p in Path(kw["path"]).rglob("*") if p.is_file()}
    if op == "host_uids":
        needle = kw["text"].encode().replace(b" ", b"\0")
        uids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                    status = Path(f"/proc/{pid}/status").read_text()
                    uids.append(int(status.split("\nUid:", 1)[1].split()[0]))
            except OSError:
                pass
        return uids
    if op == "close":
        return box.close()
    if op == "together":
        lines: list[dict | None] = [None] * len(kw["steps"])

        def one(i: int, op: str, kw: dict, delay: float) -> None:
            time.sleep(delay)
            lines[i] = _line(box, op, kw)

        threads = [threading.Thread(target=one, args=(i, *step)) for i, step in enumerate(kw["steps"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return lines
    raise ValueError(op)


def _line(box: Sandbox, op: str, kw: dict) -> dict:
    try:
        return {"ok": _step(box, op, dict(kw))}
    except Exception as e:  # the test reads which one
        return {"error": type(e).__name__, "message": str(e)}


def main() -> int:
    sc = json.load(sys.stdin)
    lay = sc["layers"]
    layers = InstanceLayers(Path(lay["env_sif"]), tuple(Path(p) for p in lay["overlays"]), lay["env"],
                            lay.get("workdir", "/"))
    box = Sandbox(layers, backend=Backend(sc["backend"]), state_dir=Path(sc["state_dir"]), **sc.get("sandbox", {}))
    print(json.dumps({"ok": box._session._holder_pid}), flush=True)
    try:
        for op, kw in sc["steps"]:
            print(json.dumps(_line(box, op, kw)), flush=True)
    finally:
        box.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
