"""What every command module of the CLI shares (cli.py and the command groups in modules of their own)."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from image_builder.errors import ImageBuilderError


def one_line_errors(fn):
    """Errors a user can fix end the command with one line, not a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ImageBuilderError as e:
            # One line even when a message quotes input that holds line breaks.
            raise click.ClickException(" ".join(str(e).splitlines())) from e
    return wrapper


def registry_options(fn):
    """Options shared by every command that talks to registries."""
    for decorator in reversed([
        click.option("--cache-dir", type=click.Path(path_type=Path), envvar="IMAGE_BUILDER_CACHE",
                     help="Blob cache (default: $XDG_CACHE_HOME/image_builder)."),
        click.option("--ca-cert", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="Extra CA certificate for private registries."),
        click.option("--plain-http", multiple=True, metavar="HOST", help="Reach HOST over plain HTTP."),
        click.option("--insecure-tls", multiple=True, metavar="HOST", help="Do not verify HOST's certificate."),
    ]):
        fn = decorator(fn)
    return fn


def parse_bases(values: tuple[str, ...]) -> dict[str, str]:
    """--base ALIAS=REF values by alias."""
    from image_builder.oci.local import is_local, resolve_path
    bases = {}
    for v in values:
        alias, sep, ref = v.partition("=")
        if not sep or not alias or not ref:
            raise click.BadParameter(f"{v!r}: expected ALIAS=REFERENCE", param_hint="--base")
        bases[alias] = resolve_path(ref, Path.cwd()) if is_local(ref) else ref  # relative to here, not the catalog
    return bases


catalog_argument = click.argument("catalog", type=click.Path(exists=True, dir_okay=False, path_type=Path))
base_option = click.option("--base", "bases", multiple=True, metavar="ALIAS=REF",
                           help="Use REF for the catalog's base alias ALIAS.")
store_option = click.option("--store", type=click.Path(file_okay=False, path_type=Path), envvar="IMAGE_BUILDER_STORE",
                            default=Path("store"), show_default=True, help="The store directory.")
backend_option = click.option("--backend", type=click.Choice(["userns", "proot"]),
                              help="Sandbox for scripts (default: userns, else proot, never as root).")
runtime_backend_option = click.option("--backend", type=click.Choice(["kernel", "userns", "apptainer", "extract"]),
                                      help="How to mount and run (default: what `doctor` picks).")


class Size(click.ParamType):
    """A byte count: 1048576, 64K, 10M, 1G (binary)."""

    name = "size"

    def convert(self, value, param, ctx):
        from image_builder.cli_run import parse_size
        n = parse_size(value)
        if n is None:
            self.fail(f"{value!r}: expected a byte count such as 1048576, 64K, 10M or 1G", param, ctx)
        return n


grade_limit_options = [
    click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="Seconds per case or test."),
    click.option("--memory", type=click.IntRange(1), metavar="MB", help="Memory per case or test."),
    click.option("--strict", is_flag=True, help="Assert cases take no truth value from the solution's own objects."),
    click.option("--test-access", "access", type=click.Choice(["open", "read-only", "hidden"]), default="hidden",
                 show_default=True, help="ImpossibleBench's test-access mode for repo tasks."),
    runtime_backend_option,
]
grading_options = [click.option("-j", "--jobs", type=click.IntRange(1, 256), default=2, show_default=True,
                                help="Tasks at once."), *grade_limit_options]


def with_options(options):
    """A decorator applying a list of click options, in their order on --help."""
    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


# What grade and slurm grade take beyond the limits (grade passes them on to every array task).
grade_run_options = [
    click.option("--compare", type=click.Choice(["exact", "tokens", "float", "livecodebench", "sandboxfusion",
                                                 "checker"]),
                 help="How stdin/stdout output is compared, for tasks whose record does not say (default: by data "
                 "source: float for CodeContests/Codeforces, else LiveCodeBench's)."),
    click.option("--instance", metavar="ID", help="Grade tasks that have no instance of their own in this one."),
    click.option("--net", is_flag=True, help="Repo tests run with the network (SWE-bench's harness has it); the "
                 "results record it. Assert and stdin/stdout runs never get it."),
    click.option("--splice", is_flag=True, help="ImpossibleBench's allow_test_modifications=True for assert and "
                 "check(candidate) tasks: answer and tests in one process, so the answer can redefine the tests "
                 "(passing needs them to finish); results say mode splice. Only to reproduce that setting."),
]


tasks_option = click.option("--tasks", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
                            help="verl parquet, JSONL, or SWE-bench/ImpossibleBench JSONL.")
predictions_option = click.option("--predictions", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                                  required=True, help="JSONL of {task_id|instance_id, solution|model_patch|response}.")
