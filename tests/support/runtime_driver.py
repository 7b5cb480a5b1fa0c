"""Runs one runtime scenario in its own process, so that tests can run it as another
user (setpriv), kill it mid-run, or give it a terminal.

    python runtime_driver.py run    < scenario.json   # prints {"results": [...]} or {"error": ...}
    python runtime_driver.py shell  < scenario.json   # an interactive shell on this terminal

scenario: {"layers": {"env_sif", "overlays", "env", "workdir"}, "backend", "state_dir",
"session": open_session keywords (binds as [src, dest, readonly]), "requests": [RunRequest
fields, bytes as base64], "threads": N (run the requests from N threads), "shell": {argv,
persist, network}}. A result is RunResult's fields with stdout/stderr as base64.
"""

from __future__ import annotations

import base64
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from image_builder.runtime.backends import open_session  # noqa: E402
from image_builder.runtime.execution import Bind, RunRequest  # noqa: E402
from image_builder.runtime.mounts import RunnerError  # noqa: E402
from image_builder.runtime.session import Backend, InstanceLayers  # noqa: E402


def _request(r: dict) -> RunRequest:
    r = dict(r)
    r["argv"] = tuple(r["argv"])
    if r.get("stdin") is not None:
        r["stdin"] = base64.b64decode(r["stdin"])
    r["files"] = {k: base64.b64decode(v) for k, v in r.get("files", {}).items()}
    return RunRequest(**r)


def _result(res) -> dict:
    out = asdict(res)
    out["stdout"] = base64.b64encode(res.stdout).decode()
    out["stderr"] = base64.b64encode(res.stderr).decode()
    return out


def main() -> int:
    mode = sys.argv[1]
    sc = json.load(sys.stdin) if mode == "run" else json.loads(Path(sys.argv[2]).read_text())
    lay = sc["layers"]
    layers = InstanceLayers(Path(lay["env_sif"]), tuple(Path(p) for p in lay["overlays"]), lay["env"],
                            lay.get("workdir", "/"))
    opts = dict(sc.get("session", {}))
    opts["binds"] = tuple(Bind(Path(s), d, ro) for s, d, ro in opts.get("binds", ()))
    try:
        with open_session(layers, backend=Backend(sc["backend"]), state_dir=Path(sc["state_dir"]), **opts) as s:
            if mode == "shell":
                sh = sc["shell"]
                return s.shell(tuple(sh["argv"]), Path(sh["persist"]) if sh.get("persist") else None,
                               network=sh.get("network", False))
            print("session open", file=sys.stderr, flush=True)
            requests = [_request(r) for r in sc["requests"]]
            if sc.get("threads", 1) == 1:  # in this thread: Ctrl-C interrupts the run, as in a CLI
                results = [s.run(r) for r in requests]
            else:
                with ThreadPoolExecutor(sc["threads"]) as pool:
                    results = list(pool.map(s.run, requests))
    except RunnerError as e:
        print(json.dumps({"error": str(e)}))
        return 0
    print(json.dumps({"results": [_result(r) for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
