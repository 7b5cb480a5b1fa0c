"""`image-builder swebench ...`: catalogs made from SWE-bench-format datasets (build/swebench_catalog.py)."""

from __future__ import annotations

from pathlib import Path

import click

from image_builder.cli_common import one_line_errors


@click.group(name="swebench")
def swebench_group():
    """SWE-bench-format datasets (Lite, Verified, SWE-Gym, ImpossibleBench's SWE variants)."""


@swebench_group.command(name="catalog")
@click.argument("dataset", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--repos", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Directory of the repositories: NAME.bundle, OWNER__NAME.bundle or a clone NAME/.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The catalog to write; its bundles go beside it in OUTPUT's stem + .d/.")
@click.option("--python", "pythons", multiple=True, metavar="X.Y=REF",
              help="Base image for the specs' Python X.Y (repeatable).")
@click.option("--python-default", default="", metavar="TEMPLATE",
              help="Base image for a Python without --python, '{python}' replaced (e.g. "
              "'docker.io/library/python:{python}-slim'); default: those instances are left out.")
@click.option("--apt", default="git", show_default=True, help="Debian packages every Python layer gets.")
@click.option("--pip", "pip_version", default="",
              help="pip requirement of every Python layer (default: by Python: pip 26 from 3.9, which takes "
              "the cut-off; the newest an older Python runs).")
@click.option("--cutoff", default="auto", show_default=True, metavar="auto|none|DATE",
              help="Resolve unpinned packages as on this day (ISO 8601, e.g. 2024-07-04): 'auto' takes, per "
              "repository version, the day after the newest release its spec pins; 'none' resolves as of the build.")
@click.option("--index-url", default="https://pypi.org/simple", show_default=True,
              help="Package index whose upload dates --cutoff auto reads (PEP 691 JSON simple API).")
@click.option("--exclude-tags", multiple=True, metavar="GLOB",
              help="Tags of the repositories not to copy (a mirror's own, like ib/*): setuptools_scm takes the "
              "nearest tag for the version and fails on one that is not a version.")
@click.option("--prefix", default="", metavar="NAME",
              help="Start every environment's name with NAME-: several generated catalogs then build into one "
              "store, and their equal layers (a Python, a shared repository version) are one image, built once.")
@click.option("--conda-channel", "conda_channels", multiple=True, metavar="URL",
              help="A conda channel (a conda-forge mirror, http(s)://) to solve environment.yml specs against with "
              "conda's solver (py-rattler, fetched from PyPI at build); repeat in priority order. Without one their "
              "packages come from PyPI by name.")
@click.option("--specs", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None, metavar="FILE",
              help="Specs (YAML or JSON, swebench's keys) for repositories or versions the swebench package has "
              "none for (SWE-Gym's, one's own), laid over its own: OWNER/NAME: {versions: {\"X.Y\": {python, "
              "install, test_cmd, ...}}, log_parser, requirements_paths}.")
@one_line_errors
def swebench_catalog(dataset, repos, output, pythons, python_default, apt, pip_version, cutoff, index_url,
                     exclude_tags, prefix, conda_channels, specs):
    """Write a catalog building DATASET from the swebench package's specs: one environment per repository and
    version, layered over one per Python, and one thin instance per task."""
    from image_builder.build.swebench_catalog import CatalogOptions, generate
    mapping = {}
    for v in pythons:
        version, sep, ref = v.partition("=")
        if not sep or not version or not ref:
            raise click.BadParameter(f"{v!r}: expected X.Y=REFERENCE", param_hint="--python")
        mapping[version] = ref
    if cutoff not in ("auto", "none"):
        from image_builder.build.upload_dates import iso, parse_time
        try:
            cutoff = iso(parse_time(cutoff))
        except ValueError:
            raise click.BadParameter(f"{cutoff!r}: expected auto, none or an ISO 8601 date (2024-07-04)",
                                     param_hint="--cutoff") from None
    for channel in conda_channels:
        if not channel.startswith(("http://", "https://")) or any(c.isspace() for c in channel):
            raise click.BadParameter(f"{channel!r}: expected a channel's http(s):// URL (serve a local one over "
                                     "HTTP: the build sandbox sees no host path)", param_hint="--conda-channel")
    result = generate(CatalogOptions(dataset, repos, output, mapping, python_default, apt, pip_version, cutoff,
                                     index_url, tuple(exclude_tags), prefix, tuple(conda_channels), specs),
                      progress=lambda line: click.echo(line, err=True))
    for line in result.skipped:
        click.echo(f"left out: {line}", err=True)
    for line in result.notes:
        click.echo(f"note: {line}", err=True)
    click.echo(f"{result.catalog}: {result.environments} repository environments, {result.instances} instances "
               f"({len(result.skipped)} left out); build it with image-builder build {result.catalog} --store STORE")
