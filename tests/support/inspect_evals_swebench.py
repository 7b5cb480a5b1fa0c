"""inspect_evals' own SWE-bench task (its dataset loader, react agent and swe_bench_scorer)
on a store through the "image_builder" provider, offline, with Inspect's mock model;
run in its own process so a test can run it as another user.

    python inspect_evals_swebench.py STORE DATASET_DIR gold|none LOG_DIR

DATASET_DIR holds test.jsonl in SWE-bench's Hugging Face schema. The scripted agent
applies the row's gold patch with one python() call (or does nothing), then submits; the
scorer runs SWE-bench's eval script for the row in the sandbox and parses its log.
Prints a JSON summary: the score, its explanation, the tool outputs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # the dataset is on disk; nothing is fetched

from inspect_ai import eval  # noqa: E402
from inspect_ai.model import ChatMessageTool, ModelOutput, ModelUsage, get_model  # noqa: E402

from image_builder.agents.inspect_provider import sample_sandbox  # noqa: E402
from image_builder.build.swebench_catalog import load_swebench  # noqa: E402


def _usage(out: ModelOutput) -> ModelOutput:
    out.usage = ModelUsage(input_tokens=10, output_tokens=10, total_tokens=20)  # else mockllm counts with tiktoken
    return out


def main() -> int:
    store, dataset, mode, log_dir = sys.argv[1:5]
    # The scorer imports swebench's harness modules; swebench is installed here without its
    # harness's own dependencies (docker, modal, ghapi), which its package __init__ imports:
    # load_swebench() makes the package importable without running that __init__.
    load_swebench()
    from inspect_evals.swe_bench import swe_bench

    row = json.loads(Path(dataset, "test.jsonl").read_text().splitlines()[0])
    steps = []
    if mode == "gold":
        code = ("import subprocess\n"
                f"open('/tmp/fix.patch', 'w').write({row['patch']!r})\n"
                "r = subprocess.run(['git', 'apply', '/tmp/fix.patch'], cwd='/testbed', capture_output=True, "
                "text=True)\nprint('applied' if r.returncode == 0 else 'failed: ' + r.stderr)\n")
        steps.append(_usage(ModelOutput.for_tool_call("mockllm/model", "python", {"code": code})))
    steps.append(_usage(ModelOutput.for_tool_call("mockllm/model", "submit", {"answer": "done"})))
    task = swe_bench(dataset=dataset, split="test", sandbox_type="image_builder",
                     sandbox_config=sample_sandbox(store, network=False, memory_mb=2048))
    [log] = eval(task, model=get_model("mockllm/model", custom_outputs=steps), log_dir=log_dir, display="none",
                 sandbox_cleanup=True)
    if log.status != "success" or not log.samples or not log.samples[0].scores:
        print(json.dumps({"status": log.status, "error": str(log.samples[0].error if log.samples else log.error)}))
        return 1
    [sample] = log.samples
    score = sample.scores["swe_bench_scorer"]
    print(json.dumps({"status": log.status, "score": score.value, "explanation": score.explanation[-3000:],
                      "tools": [m.text for m in sample.messages if isinstance(m, ChatMessageTool)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
