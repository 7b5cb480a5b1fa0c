"""`image-builder slurm ...`: builds, imports, grading and servers as Slurm jobs (slurm.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from image_builder.cli_common import (base_option, catalog_argument, grade_limit_options, grade_run_options,
                                        one_line_errors, parse_bases, predictions_option, registry_options,
                                        store_option, tasks_option, with_options)


@click.group(name="slurm")
def slurm_group():
    """Build a store or grade predictions as Slurm job arrays: files on a shared filesystem, no root on the nodes."""


run_argument = click.argument("run_dir", metavar="RUN", type=click.Path(exists=True, file_okay=False, path_type=Path))
wait_option = click.option("--wait", is_flag=True, help="Follow the jobs until they end; exit non-zero if one failed.")
poll_option = click.option("--poll", type=click.FloatRange(0.1), default=5.0, show_default=True, metavar="SECONDS",
                           help="Seconds between two looks at squeue with --wait.")


sbatch_options = [
    click.option("--partition", help="sbatch --partition."),
    click.option("--time", "time_limit", metavar="TIME", help="sbatch --time, per job (e.g. 2:00:00)."),
    click.option("--cpus-per-task", type=click.IntRange(1), help="sbatch --cpus-per-task: items at once per job."),
    click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="OPTION",
                 help="Another sbatch option for every job, e.g. --account=proj (repeatable)."),
]


@slurm_group.command(name="build")
@catalog_argument
@store_option
@click.option("--shards", type=click.IntRange(1), required=True, help="Array tasks the instances are split over.")
@with_options(sbatch_options)
@base_option
@click.option("--compression", type=click.Choice(["zstd", "gzip", "lz4", "xz"]), default="zstd", show_default=True,
              help="squashfs compression (gzip for the oldest Apptainers).")
@registry_options
@wait_option
@poll_option
@one_line_errors
def slurm_build(catalog, store, shards, partition, time_limit, cpus_per_task, sbatch_args, bases, compression,
                cache_dir, ca_cert, plain_http, insecure_tls, wait, poll):
    """Build CATALOG into STORE as Slurm jobs: the instances as a job array (each shard building the environments
    it needs, each environment once), then the index."""
    from image_builder import slurm
    plan = slurm.build_plan(catalog, store, shards, bases=parse_bases(bases), cache_dir=cache_dir, ca_cert=ca_cert,
                            plain_http=plain_http, insecure_tls=insecure_tls, compression=compression)
    for stale in slurm.drop_other_fragments(plan.home, shards):
        click.echo(f"removed {stale}: a fragment of an earlier build in another number of shards", err=True)
    _launch(plan, slurm.SbatchOptions(partition, time_limit, cpus_per_task, sbatch_args), wait, poll)


@slurm_group.command(name="import")
@click.argument("refs", nargs=-1)
@store_option
@click.option("--from-file", "list_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Images to import, one `REF [INSTANCE_ID [WORKDIR]]` a line.")
@click.option("--env-layers", "env_layers", multiple=True, metavar="[GLOB=]N", help="As `import`'s.")
@click.option("--id-from", metavar="TEMPLATE", help="As `import`'s.")
@click.option("--shards", type=click.IntRange(1), required=True, help="Array tasks the images are split over.")
@with_options(sbatch_options)
@registry_options
@wait_option
@poll_option
@one_line_errors
def slurm_import(refs, store, list_file, env_layers, id_from, shards, partition, time_limit, cpus_per_task,
                 sbatch_args, cache_dir, ca_cert, plain_http, insecure_tls, wait, poll):
    """Import prebuilt images into STORE as Slurm jobs (as `import`, split over a job array), then the index."""
    from image_builder import slurm
    if not refs and list_file is None:
        raise click.UsageError("give image references, or --from-file LIST")
    plan = slurm.import_plan(tuple(refs), list_file, store, shards, env_layers=tuple(env_layers), id_from=id_from,
                             cache_dir=cache_dir, ca_cert=ca_cert, plain_http=plain_http, insecure_tls=insecure_tls)
    for stale in slurm.drop_other_fragments(plan.home, shards):
        click.echo(f"removed {stale}: a fragment of a build in another number of shards", err=True)
    _launch(plan, slurm.SbatchOptions(partition, time_limit, cpus_per_task, sbatch_args), wait, poll)


@slurm_group.command(name="grade")
@store_option
@tasks_option
@predictions_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("results.jsonl"),
              show_default=True, help="The merged results; the run's scripts and logs go to slurm/ beside it.")
@click.option("--shards", type=click.IntRange(1), required=True, help="Array tasks the predictions are split over.")
@with_options(sbatch_options)
@with_options(grade_limit_options)
@with_options(grade_run_options)
@wait_option
@poll_option
@one_line_errors
def slurm_grade(store, tasks, predictions, output, shards, partition, time_limit, cpus_per_task, sbatch_args,
                timeout, memory, strict, access, backend, compare, instance, net, splice, wait, poll):
    """Grade PREDICTIONS as a Slurm job array (each task grading --cpus-per-task at once), then merge the results."""
    from image_builder import slurm
    from image_builder.store.store import Store
    if instance is not None:
        Store.open(store).resolve(instance)  # refused here, not in every array task
    grade_args = [*(("--timeout", str(timeout)) if timeout else ()), *(("--memory", str(memory)) if memory else ()),
                  *(("--strict",) if strict else ()), "--test-access", access,
                  *(("--backend", backend) if backend else ()), *(("--compare", compare) if compare else ()),
                  *(("--instance", instance) if instance else ()), *(("--net",) if net else ()),
                  *(("--splice",) if splice else ())]
    plan = slurm.grade_plan(store, tasks, predictions, output, shards, tuple(grade_args))
    _launch(plan, slurm.SbatchOptions(partition, time_limit, cpus_per_task, sbatch_args), wait, poll)


@slurm_group.command(name="serve")
@store_option
@click.option("--nodes", type=click.IntRange(1), default=1, show_default=True, help="Servers: one per node.")
@click.option("--env", "env_name", metavar="NAME", help="The environment runs use (serve's --env).")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Each server's port (0: a free one on its node).")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              help="The token every server takes, on the shared filesystem (made, mode 600, when absent; default: "
                   "$XDG_CONFIG_HOME/image_builder/serve.token).")
@click.option("--max-concurrency", type=click.IntRange(1), default=4, show_default=True,
              help="Runs at once, per server.")
@click.option("--queue", type=click.IntRange(0), default=16, show_default=True, help="Waiting requests, per server.")
@click.option("--wait-timeout", type=click.FloatRange(1), default=600.0, show_default=True, metavar="SECONDS",
              help="How long to wait for every server to listen (the job may queue first).")
@with_options(sbatch_options)
@one_line_errors
def slurm_serve(store, nodes, env_name, port, token_file, max_concurrency, queue, wait_timeout, partition, time_limit,
                cpus_per_task, sbatch_args):
    """Start `serve` on each node of a Slurm job, wait until all listen, and print their URLs (also written to
    STORE/slurm/serve-<time>/urls.txt, one per line): give trainer worker i the URL on line i mod N."""
    from image_builder import slurm
    from image_builder.serve import default_token_file, environment_layers, load_or_create_token
    from image_builder.store.store import Store
    environment_layers(Store.open(store), env_name)  # an unknown environment fails here, not on every node
    token_file = (token_file or default_token_file()).absolute()
    _, made = load_or_create_token(token_file)  # made once here, so that every node reads the same token
    args = ("--port", str(port), "--token-file", str(token_file), "--max-concurrency", str(max_concurrency),
            "--queue", str(queue), *(("--env", env_name) if env_name else ()))
    job = slurm.start_servers(store, nodes, args, slurm.SbatchOptions(partition, time_limit, cpus_per_task,
                                                                      sbatch_args))
    click.echo(f"job {job.job}: {nodes} server{'s' if nodes > 1 else ''} starting ({job.directory}); token "
               f"{'written to' if made else 'read from'} {token_file}", err=True)
    for url in slurm.wait_for_servers(job, wait_timeout):
        click.echo(url)
    click.echo(f"URLs in {job.directory / 'urls.txt'}; stop the servers with: scancel {job.job}", err=True)


def _launch(plan, sbatch, wait: bool, poll: float) -> None:
    """Write the run's scripts, submit them, and with --wait follow the jobs to the end."""
    import os
    from image_builder import slurm
    run = slurm.write_run(plan, sbatch, dict(os.environ))
    _submitted(run, slurm.submit(run), wait, poll)


@slurm_group.command(name="status")
@run_argument
@wait_option
@poll_option
@one_line_errors
def slurm_status(run_dir, wait, poll):
    """Show where the jobs of RUN (STORE/slurm/<kind>-<time>/) are; exit non-zero if one failed."""
    from image_builder import slurm
    run = slurm.Run.open(run_dir)
    if wait:
        return _slurm_follow(run, poll)
    snap = slurm.snapshot(run)
    click.echo(snap.summary())
    _slurm_report(run, snap)


@slurm_group.command(name="resubmit")
@run_argument
@wait_option
@poll_option
@one_line_errors
def slurm_resubmit(run_dir, wait, poll):
    """Submit again the failed shards of RUN, and the jobs after them; finished items are not rebuilt."""
    from image_builder import slurm
    run = slurm.Run.open(run_dir)
    _submitted(run, slurm.resubmit(run), wait, poll)


def _submitted(run, submission, wait: bool, poll: float) -> None:
    """Say what was submitted and how to follow it; with --wait, follow it to the end."""
    from image_builder.slurm import format_indices
    jobs = ", ".join(f"{stage} {job}" + (f" (shards {format_indices(submission.shards)})" if stage == run.array else "")
                     for stage, job in submission.jobs.items())
    click.echo(f"submitted {jobs}")
    click.echo(f"run: {run.directory}  (job.sh, submit.sh, logs/)")
    click.echo(f"follow: image-builder slurm status {run.directory} --wait")
    if wait:
        _slurm_follow(run, poll)


def _slurm_follow(run, poll: float) -> None:
    from image_builder.slurm import follow
    _slurm_report(run, follow(run, lambda snap: click.echo(snap.summary(), err=True), poll=poll))


def _slurm_report(run, snap) -> None:
    """Failed jobs with their logs and how to resubmit them; exit 1 if there are any."""
    from image_builder.slurm import log_excerpt
    for task in snap.failed:
        what = f"{task.stage} {task.shard}" if task.shard is not None else task.stage
        log = f"; log: {task.log}" if task.log.exists() else ""  # none when it never ran
        click.echo(f"failed: {what} (job {task.job}): {task.detail}{log}", err=True)
        for line in log_excerpt(task.log):
            click.echo(f"  | {line}", err=True)
    if snap.failed:
        click.echo(f"resubmit what failed: image-builder slurm resubmit {run.directory}", err=True)
        sys.exit(1)
    if snap.finished:
        click.echo(f"done: every job of {run.directory} succeeded; made {run.product}")
        if run.kind == "grade":
            from image_builder.graders.grading import summary_path
            path = summary_path(run.product)
            if path.exists():
                summary = json.loads(path.read_text())
                click.echo(f"{summary['total']} tasks: {summary['passed']} passed ({summary['pass_rate']:.1%}), "
                           f"mean score {summary['mean_score']:.3f}; summary: {path}")
