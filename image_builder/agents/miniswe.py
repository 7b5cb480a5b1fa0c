"""A mini-swe-agent environment on a store's instance: its agent runs commands in an
image_builder sandbox (agents/sandbox.py) instead of a Docker container or a writable
Apptainer sandbox directory built per run.

    environment:
      environment_class: image_builder.agents.miniswe.ImageBuilderEnvironment
      store: /scratch/stores/swebench-lite
      instance: marshmallow-code__marshmallow-1359
      cwd: /testbed
      timeout: 60

or in Python: `DefaultAgent(model, ImageBuilderEnvironment(store=..., instance=...))`.
As mini-swe-agent's own environments do, each command runs in a fresh `bash -c` (what
it changes on disk and starts in the background stays; its shell variables do not),
stderr merged into the output, and a first output line
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT ends the run with the rest as the submission.
Needs mini-swe-agent (2.x) installed; `mini-extra swebench` only fills in an image for
its own Docker and Singularity classes, so name the instance in the config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .sandbox import open_sandbox

_SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class ImageBuilderEnvironmentConfig(BaseModel):
    store: str
    instance: str
    cwd: str = ""
    env: dict[str, str] = {}
    timeout: int = 60
    interpreter: list[str] = ["bash", "-c"]
    network: bool = False
    memory_mb: int | None = None
    disk_mb: int | None = None
    layer_dir: str | None = None


class ImageBuilderEnvironment:
    def __init__(self, *, config_class: type = ImageBuilderEnvironmentConfig, **kwargs):
        self.config = config_class(**kwargs)
        self.box = open_sandbox(self.config.store, self.config.instance, network=self.config.network,
                                memory_mb=self.config.memory_mb, disk_mb=self.config.disk_mb,
                                layer_dir=Path(self.config.layer_dir) if self.config.layer_dir else None)

    def execute(self, action: dict | str, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "") if isinstance(action, dict) else action
        seconds = timeout or self.config.timeout
        # stderr into stdout as the command writes them, as mini-swe-agent's environments give it
        argv = ["sh", "-c", 'exec "$@" 2>&1', "sh", *self.config.interpreter, command]
        r = self.box.exec(argv, cwd=cwd or self.config.cwd or None, env=self.config.env, timeout=seconds)
        text = r.stdout.decode(errors="replace")
        if r.timed_out:
            output = {"output": text, "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: timed out after {seconds} s",
                      "extra": {"exception_type": "TimeoutExpired", "exception": f"timed out after {seconds} s"}}
        else:
            output = {"output": text, "returncode": r.exit_status, "exception_info": ""}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == _SUBMIT and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs) -> dict[str, Any]:
        return {**self.config.model_dump(), **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config.model_dump(mode="json"),
                                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}"}}}

    def cleanup(self) -> None:
        self.box.close()

    def __del__(self):
        box = getattr(self, "box", None)
        if box is not None:
            box.close()
