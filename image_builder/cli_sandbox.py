"""`image-builder sandbox ...`: sandboxes that outlive a command, for agents (runtime/sandbox.py, agents/sandbox.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from image_builder.cli_common import Size, one_line_errors, store_option
from image_builder.cli_run import CAPPED


@click.group(name="sandbox")
def sandbox_group():
    """Sandboxes that last: an instance root kept from command to command for an agent,
    held by this user's mount holder until `sandbox stop` or an idle timeout."""


def _attach(sandbox_id: str, backend: str | None, *, agent: bool = True):
    """The kept sandbox; `agent=False` for commands that only run or copy (exec, cp): the runtime's Sandbox,
    without the graders the agent's (diff, score) imports, 100 ms of a fresh process's start."""
    from image_builder.runtime.session import Backend
    if agent:
        from image_builder.agents.sandbox import AgentSandbox as kind
    else:
        from image_builder.runtime.sandbox import Sandbox as kind
    return kind.attach(sandbox_id, backend=Backend(backend) if backend else None)


sandbox_backend_option = click.option("--backend", type=click.Choice(["kernel", "userns"]),
                                      help="Default: kernel as root, userns otherwise.")


@sandbox_group.command(name="start")
@click.argument("instance")
@store_option
@click.option("--tasks", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Tasks (SWE-bench/ImpossibleBench JSONL, verl parquet, ...): INSTANCE is one of their ids, "
                   "started as --access has it.")
@click.option("--access", type=click.Choice(["open", "read-only", "hidden"]), default="open", show_default=True,
              help="Test access (with --tasks): open and read-only start with the tests in view (a repo task's "
                   "test patch applied); hidden without them.")
@click.option("--memory", type=click.IntRange(1), metavar="MB", help="For the sandbox as a whole.")
@click.option("--disk", type=click.IntRange(1), metavar="MB",
              help="Its writable layer's size (a tmpfs; with --layer-dir, a file system there).")
@click.option("--layer-dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              envvar="IMAGE_BUILDER_LAYER_DIR",
              help="Keep the writable layer on this node-local disk instead of in memory: an ext4 of --disk MB "
                   "(default 10240) as root, an uncapped directory rootless.  [env: IMAGE_BUILDER_LAYER_DIR]")
@click.option("--net", is_flag=True, help="Allow network access (off by default).")
@click.option("--idle", type=click.FloatRange(min=1), default=3600.0, show_default=True, metavar="SECONDS",
              help="It ends after this long without a command.")
@sandbox_backend_option
@one_line_errors
def sandbox_start(instance, store, tasks, access, memory, disk, layer_dir, net, idle, backend):
    """Start a sandbox on INSTANCE; prints its id."""
    from image_builder.agents.sandbox import open_sandbox
    from image_builder.runtime.session import Backend
    task = None
    if tasks is not None:
        from image_builder.graders import BadTask, load_tasks
        task = next((t for t in load_tasks(tasks) if t.task_id == instance), None)
        if task is None or isinstance(task, BadTask):
            raise click.UsageError(f"{tasks}: no task {instance!r}" + (f": {task.reason}" if task else ""))
    box = open_sandbox(store, None if task else instance, task=task, access=access, memory_mb=memory, disk_mb=disk,
                       network=net, idle=idle, backend=Backend(backend) if backend else None, layer_dir=layer_dir)
    try:
        click.echo(box.park())
    finally:
        box.close()


@sandbox_group.command(name="exec", context_settings={"allow_interspersed_args": False})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="Seconds; kills this command's "
              "process group (what earlier commands left running stays).")
@click.option("-e", "--env", "env_vars", multiple=True, metavar="K=V", help="An environment variable.")
@click.option("--cwd", help="Relative to the instance's workdir.")
@click.option("--max-output", type=Size(), default="1G", show_default=True, metavar="SIZE",
              help=f"As `run`'s: past it the command is stopped, exit status {CAPPED}.")
@sandbox_backend_option
@one_line_errors
def sandbox_exec(sandbox_id, command, timeout, env_vars, cwd, max_output, backend):
    """Run COMMAND in the sandbox: exit status and output as if it ran here (as `run`)."""
    from image_builder import cli_run
    cli_run.sandbox_exec(sandbox_id, command, timeout, env_vars, cwd, max_output, backend)


@sandbox_group.command(name="cp")
@click.argument("source")
@click.argument("dest")
@sandbox_backend_option
@one_line_errors
def sandbox_cp(source, dest, backend):
    """Copy between the host and a sandbox: `ID:PATH HOST_PATH` or `HOST_PATH ID:PATH` (trees too)."""
    inside = [":" in x and not x.startswith(("/", ".")) for x in (source, dest)]
    if inside.count(True) != 1:
        raise click.UsageError("name the sandbox side as ID:PATH on exactly one side")
    sandbox_id, path = (source if inside[0] else dest).split(":", 1)
    with _attach(sandbox_id, backend, agent=False) as box:
        try:
            box.download(path, dest) if inside[0] else box.upload(source, path)
        except OSError as e:  # FileNotFoundError and the like, for either side
            raise click.ClickException(f"{e.filename or path}: {e.strerror or e}") from None


@sandbox_group.command(name="diff")
@click.argument("sandbox_id")
@sandbox_backend_option
@one_line_errors
def sandbox_diff(sandbox_id, backend):
    """The candidate patch: what changed in the workdir since the sandbox started (SWE-bench's diff)."""
    with _attach(sandbox_id, backend) as box:
        sys.stdout.write(box.diff())


@sandbox_group.command(name="score")
@click.argument("sandbox_id")
@click.option("--in-place", is_flag=True,
              help="Grade in the sandbox itself, as ImpossibleBench's scorer does: what the agent installed or "
                   "left running takes part (and can touch the verdict). Not with --access hidden.")
@sandbox_backend_option
@one_line_errors
def sandbox_score(sandbox_id, in_place, backend):
    """Grade the sandbox's diff in a fresh instance (started with --tasks); prints the feedback its access
    mode allows. Exit status 0 when resolved, 1 when not."""
    with _attach(sandbox_id, backend) as box:
        got = box.score(in_place=in_place)
    click.echo(got.feedback)
    sys.exit(0 if got.result.passed else 1)


@sandbox_group.command(name="ls")
@click.option("--json", "as_json", is_flag=True)
@sandbox_backend_option
@one_line_errors
def sandbox_ls(as_json, backend):
    """This user's sandboxes."""
    import time

    from image_builder.runtime.sandbox import kept_sandboxes
    from image_builder.runtime.session import Backend
    rows = [{"id": k["id"], "instance": (k["info"].get("agent") or {}).get("instance"),
             "access": (k["info"].get("agent") or {}).get("access"), "started": k["made"], "busy": k["busy"]}
            for k in kept_sandboxes(backend=Backend(backend) if backend else None)]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        click.echo(f"{r['id']}  {r['instance']}  {r['access']}  up {time.time() - r['started']:.0f} s"
                   f"{'  busy' if r['busy'] else ''}")


@sandbox_group.command(name="stop")
@click.argument("sandbox_ids", nargs=-1, required=True)
@sandbox_backend_option
@one_line_errors
def sandbox_stop(sandbox_ids, backend):
    """End sandboxes: every process in them is killed, their writable layers freed."""
    from image_builder.runtime.sandbox import stop_sandbox
    from image_builder.runtime.session import Backend
    for sid in sandbox_ids:
        stop_sandbox(sid, backend=Backend(backend) if backend else None)
