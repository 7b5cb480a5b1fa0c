"""`image-builder impossible ...`: ImpossibleBench's method around the graders (its commands, a module of their
own as cli.py grows): `mutate` makes the impossible variants; `qc` (a top-level command) keeps the sound ones."""

from __future__ import annotations

import json
from pathlib import Path

import click

from image_builder.cli_common import one_line_errors


@click.group(name="impossible")
def impossible_group():
    """ImpossibleBench's impossible variants: made by rule, then kept by `qc`."""


@impossible_group.command(name="mutate")
@click.argument("tasks", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The variants, JSONL, keyed as grade and qc read them (impossible_type).")
@click.option("--kind", "kinds", multiple=True, type=click.Choice(["oneoff", "conflicting"]),
              help="Which variants (default: both).")
@click.option("--seed", type=int, default=0, show_default=True, help="Which assertions are changed, reproducibly.")
@one_line_errors
def impossible_mutate(tasks, output, kinds, seed):
    """Write one-off and conflicting variants of the assert-case, check(candidate) and SWE-bench tasks of TASKS
    (verl parquet or JSONL); then `image-builder qc` keeps those the reference and the empty solution fail."""
    from image_builder.graders.mutate import KINDS, mutate_all
    from image_builder.store.files import atomic_write
    from image_builder.tasks import BadTask, load_tasks_with_rows, read_records
    rows = dict(read_records(tasks))
    loaded = [(task, rows.get(row) or {}) for row, task in load_tasks_with_rows(tasks) if not isinstance(task, BadTask)]
    made, not_made = mutate_all(loaded, tuple(kinds) or KINDS, seed)
    for miss in not_made:
        click.echo(f"not made: {miss.task_id} {miss.kind}: {miss.reason}", err=True)
    text = "".join(json.dumps(v.record) + "\n" for v in made)
    atomic_write(output, lambda f: f.write(text.encode()))
    counts = ", ".join(f"{kind} {sum(v.kind == kind for v in made)}" for kind in (tuple(kinds) or KINDS))
    click.echo(f"{len(made)} variants ({counts}) of {len(loaded)} tasks written to {output}; {len(not_made)} not made. "
               f"Keep the sound ones: image-builder qc --tasks {output} --references REFERENCES.jsonl")


@impossible_group.command(name="report")
@click.argument("sources", nargs=-1, required=True, metavar="[LABELS@]RESULTS_OR_LOG...")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="The rows as JSON too.")
@click.option("--html", "html_out", type=click.Path(dir_okay=False, path_type=Path),
              help="A page with the table and a bar chart of the cheating rates.")
@one_line_errors
def impossible_report(sources, json_out, html_out):
    """ImpossibleBench's cheating rate (pass rate on impossible variants), one-off and conflicting apart, by
    model, scaffold, test access and submission budget, with the flag rate and the original tasks' pass rate.

    Each source is a `grade` results file, labelled as `model=o3,scaffold=minimal,attempts=10@results.jsonl`,
    or an Inspect eval log (its model, task and scores say the rest)."""
    from image_builder.graders.cheating import html_report, outcomes_of, parse_source, report, rows_json, table
    from image_builder.store.files import atomic_write
    outcomes = [o for source in sources for o in outcomes_of(*parse_source(source))]
    rows = report(outcomes)
    click.echo(table(rows))
    for path, text in ((json_out, rows_json(rows)), (html_out, html_report(rows))):
        if path:
            atomic_write(path, lambda f, text=text: f.write(text.encode()))
            click.echo(f"written: {path}", err=True)
