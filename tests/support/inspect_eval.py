"""One real Inspect eval on a store's instance through the "image_builder" sandbox
provider, with Inspect's mock model playing a scripted agent; run in its own process
so a test can run it as another user.

    python inspect_eval.py CONFIG.yaml INSTANCE_ID PATCH_FILE TEST_PATCH_FILE TESTS_JSON LOG_DIR

The agent looks around, applies PATCH_FILE with git, starts a server in the background
and queries it in a later call, makes two bash calls at once (Inspect runs them side by
side: one waits for a file the other makes), edits a file with text_editor, changes directory and
environment in a bash_session and finds them in the next call, then stops. The scorer writes TEST_PATCH_FILE into the
sandbox, applies it and runs the tests (a JSON list of pytest ids) there, as SWE-bench
scores. Prints a JSON summary: the score, each tool output, and
what the sandbox said was left running.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import (ChatCompletionChoice, ChatMessageAssistant, ChatMessageTool, ModelOutput, ModelUsage,
                              get_model)
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import ToolCall, bash, bash_session, text_editor
from inspect_ai.util import sandbox

SERVER = "python3 -m http.server 8431 --bind 127.0.0.1 >/tmp/server.log 2>&1 & echo started"
QUERY = ("for i in $(seq 50); do python3 -c \"import urllib.request as u; "
         "print(u.urlopen('http://127.0.0.1:8431/').status)\" 2>/dev/null && exit 0; sleep 0.1; done; exit 1")


def _usage(out: ModelOutput) -> ModelOutput:
    out.usage = ModelUsage(input_tokens=10, output_tokens=10, total_tokens=20)  # else mockllm counts with tiktoken
    return out


def main() -> int:
    config, instance, patch_file, test_patch_file, tests_json, log_dir = sys.argv[1:7]
    patch, test_patch = Path(patch_file).read_text(), Path(test_patch_file).read_text()
    tests = json.loads(tests_json)
    steps = ["pwd; git status --short | wc -l",
             f"cat > /tmp/fix.patch <<'IB_EOF'\n{patch}IB_EOF\ngit apply /tmp/fix.patch && echo applied",
             SERVER, QUERY]
    outputs = [_usage(ModelOutput.for_tool_call("mockllm/model", "bash", {"command": s})) for s in steps]
    # Parallel tool calls (one message, two calls): the first waits in the foreground for the second.
    pair = [ToolCall(id=f"pair-{i}", function="bash", arguments={"command": c})
            for i, c in enumerate(["until [ -e /tmp/go ]; do sleep 0.05; done; echo waited", "touch /tmp/go; echo made"])]
    outputs.append(_usage(ModelOutput(model="mockllm/model", choices=[ChatCompletionChoice(
        message=ChatMessageAssistant(content="", tool_calls=pair, model="mockllm/model"), stop_reason="tool_calls")])))
    # text_editor(): Inspect injects its own tool-support program (bundled with inspect_ai) through
    # the provider's write_file and exec, and starts its server in the background of the sandbox.
    edits = [{"command": "create", "path": "/testbed/NOTES.md", "file_text": "first line\nsecond line\n"},
             {"command": "str_replace", "path": "/testbed/NOTES.md", "old_str": "second", "new_str": "2nd"},
             {"command": "view", "path": "/testbed/NOTES.md"}]
    outputs += [_usage(ModelOutput.for_tool_call("mockllm/model", "text_editor", e)) for e in edits]
    # bash_session(): one shell on a terminal (the same tool-support server), kept from call to call.
    typed = [{"action": "type_submit", "input": "cd /testbed/src && export IB_MARK=kept"},
             {"action": "type_submit", "input": "echo mark=$IB_MARK in $(pwd) on $(tty)"}]
    outputs += [_usage(ModelOutput.for_tool_call("mockllm/model", "bash_session", t)) for t in typed]
    outputs.append(_usage(ModelOutput.from_content("mockllm/model", "done")))

    @scorer(metrics=[accuracy()])
    def repo_tests():
        async def score(state: TaskState, target: Target) -> Score:
            await sandbox().write_file("/tmp/test.patch", test_patch)
            applied = await sandbox().exec(["git", "apply", "/tmp/test.patch"])
            if not applied.success:
                return Score(value=INCORRECT, explanation=f"test patch: {applied.stderr}")
            r = await sandbox().exec(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], timeout=600)
            return Score(value=CORRECT if r.returncode == 0 else INCORRECT, explanation=r.stdout[-2000:])
        return score

    task = Task(dataset=[Sample(input="Fix the issue.", metadata={"instance_id": instance})],
                solver=[use_tools(bash(timeout=120), text_editor(), bash_session()), generate()], scorer=repo_tests(),
                sandbox=("image_builder", config))
    [log] = eval(task, model=get_model("mockllm/model", custom_outputs=outputs), log_dir=log_dir,
                 display="none", sandbox_cleanup=True)
    if log.status != "success":
        print(json.dumps({"status": log.status, "error": str(log.error)}))
        return 1
    [sample] = log.samples
    tools = [m.text for m in sample.messages if isinstance(m, ChatMessageTool)]
    errors = [m.error.message for m in sample.messages if isinstance(m, ChatMessageTool) and m.error]
    print(json.dumps({"status": log.status, "score": sample.scores["repo_tests"].value,
                      "explanation": sample.scores["repo_tests"].explanation, "tools": tools,
                      "tool_errors": errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
