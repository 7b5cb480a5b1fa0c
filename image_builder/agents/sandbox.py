"""A store's instance as a sandbox an agent works in for many turns.

    with open_sandbox("store/", "marshmallow-code__marshmallow-1359") as box:
        box.exec(["sh", "-c", "sed -i s/old/new/ src/marshmallow/fields.py"])
        patch = box.diff()   # what the agent changed, as SWE-bench takes a patch

diff() is SWE-bench's (`git add -A`, `git diff --cached --binary` against the commit
the instance started at, recorded at open), so a commit the agent made is in it too.
"""

from __future__ import annotations

from pathlib import Path

from image_builder.runtime.execution import Bind
from image_builder.runtime.mounts import RunnerError
from image_builder.runtime.sandbox import DEFAULT_IDLE, Sandbox
from image_builder.runtime.session import Backend, InstanceLayers
from image_builder.store.store import ResolvedInstance, Store

_DIFF_TIMEOUT = 300.0


class AgentSandbox(Sandbox):
    """A Sandbox on one of a store's instances (see the module docstring)."""

    def __init__(self, instance: ResolvedInstance, **options):
        super().__init__(InstanceLayers(instance.env_sif, instance.overlays, instance.env, instance.workdir,
                                        instance.digests), **options)
        self.instance = instance
        head = self.exec(["git", "rev-parse", "--verify", "-q", "HEAD"], timeout=_DIFF_TIMEOUT)
        self.base_commit = head.stdout.decode().strip() if head.exit_code == 0 else None

    def diff(self) -> str:
        """The candidate patch: every change in the workdir since the instance's commit,
        new and binary files included (as text: git's binary patches are ASCII)."""
        if self.base_commit is None:
            raise RunnerError(f"{self.instance.id}: the workdir {self.instance.workdir} is not a git checkout; "
                              "there is no diff to take")
        add = self.exec(["git", "add", "-A"], timeout=_DIFF_TIMEOUT)
        diff = self.exec(["git", "-c", "core.quotepath=off", "diff", "--cached", "--binary", "--no-color",
                          "--no-ext-diff", self.base_commit], timeout=_DIFF_TIMEOUT, max_output=256 << 20)
        for step in (add, diff):
            if step.exit_code != 0 or step.truncated:
                why = step.stderr.decode(errors="replace").strip() or "its output went over 256 MiB"
                raise RunnerError(f"{self.instance.id}: cannot take the diff: {why}")
        return diff.stdout.decode(errors="surrogateescape")


def open_sandbox(store: Store | Path | str, instance_id: str, *, backend: Backend | None = None,
                 state_dir: Path | None = None, binds: tuple[Bind, ...] = (), network: bool = False,
                 memory_mb: int | None = None, max_processes: int | None = None, disk_mb: int | None = None,
                 idle: float = DEFAULT_IDLE) -> AgentSandbox:
    """An AgentSandbox on `instance_id` of `store` (runtime.sandbox.Sandbox says what
    each limit bounds; they hold for the sandbox as a whole)."""
    store = store if isinstance(store, Store) else Store.open(store)
    options = {} if max_processes is None else {"max_processes": max_processes}
    return AgentSandbox(store.resolve(instance_id), backend=backend, state_dir=state_dir, binds=binds,
                        network=network, memory_mb=memory_mb, disk_mb=disk_mb, idle=idle, **options)
