"""mini-swe-agent's DefaultAgent with its DeterministicModel on a store's instance
through image_builder's environment class (found by mini-swe-agent's own lookup of
`environment_class`), in a process of its own so a test can run it as another user.

    python miniswe_run.py STORE INSTANCE PATCH_FILE

The scripted agent looks around, applies PATCH_FILE, starts a server in the background
and queries it in a later step, then submits `git diff`. Prints a JSON summary.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

QUERY = ("for i in $(seq 50); do python3 -c \"import urllib.request as u; "
         "print(u.urlopen('http://127.0.0.1:8617/').status)\" 2>/dev/null && exit 0; sleep 0.1; done; exit 1")


def main() -> int:
    store, instance, patch_file = sys.argv[1:4]
    patch = Path(patch_file).read_text()
    steps = ["pwd; git status --short | wc -l; echo to-stderr >&2",
             f"cat > /tmp/fix.patch <<'IB_EOF'\n{patch}IB_EOF\ngit apply /tmp/fix.patch && echo applied",
             "python3 -m http.server 8617 --bind 127.0.0.1 >/tmp/server.log 2>&1 & echo started",
             QUERY,
             "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"]
    model = DeterministicModel(outputs=[make_output(f"step {i}", [{"command": c}]) for i, c in enumerate(steps)])
    env = get_environment({"environment_class": "image_builder.agents.miniswe.ImageBuilderEnvironment",
                           "store": store, "instance": instance, "cwd": "/testbed", "timeout": 60})
    agent = DefaultAgent(model, env, system_template="You are a test.", instance_template="{{task}}",
                         step_limit=10, cost_limit=100.0)
    try:
        result = agent.run("Fix the issue.")
    finally:
        env.cleanup()
    observations = [m["content"] for m in agent.messages if m.get("role") == "user"][1:]
    print(json.dumps({"result": result, "observations": observations}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
