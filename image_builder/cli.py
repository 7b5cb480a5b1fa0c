"""The `image-builder` command: a thin click layer over the Python API.

Each command imports what it needs when it runs, so a command that starts
often (running a grader) does not pay for the registry client or rich.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from . import __version__
from .errors import ImageBuilderError


def _one_line_errors(fn):
    """Errors a user can fix end the command with one line, not a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ImageBuilderError as e:
            raise click.ClickException(str(e)) from e
    return wrapper


def _progress(quiet: bool):
    from .progress import LogProgress, NullProgress, RichProgress
    if quiet:
        return NullProgress()
    return RichProgress() if sys.stderr.isatty() else LogProgress()


def registry_options(fn):
    """Options shared by every command that talks to registries."""
    for decorator in reversed([
        click.option("--cache-dir", type=click.Path(path_type=Path), envvar="IMAGE_BUILDER_CACHE",
                     help="Blob cache (default: $XDG_CACHE_HOME/image_builder)."),
        click.option("-j", "--jobs", type=click.IntRange(1, 64), default=4, show_default=True,
                     help="Parallel layer downloads."),
        click.option("--ca-cert", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="Extra CA certificate for private registries."),
        click.option("--plain-http", multiple=True, metavar="HOST", help="Reach HOST over plain HTTP."),
        click.option("--insecure-tls", multiple=True, metavar="HOST", help="Do not verify HOST's certificate."),
    ]):
        fn = decorator(fn)
    return fn


def _make_options(jobs, ca_cert, plain_http, insecure_tls):
    from .registry import RegistryOptions
    return RegistryOptions(ca_cert=ca_cert, plain_http=frozenset(plain_http),
                           insecure_tls=frozenset(insecure_tls), jobs=jobs)


@click.group()
@click.version_option(__version__, prog_name="image-builder")
def main() -> None:
    """Rootless sandbox images for code-benchmark graders."""


@main.command()
@click.argument("ref")
@click.option("--platform", "platform_", metavar="OS/ARCH[/VARIANT]", help="Default: this host's.")
@click.option("--rootfs", type=click.Path(file_okay=False, path_type=Path),
              help="Also flatten the layers into this directory.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON record on stdout.")
@registry_options
@_one_line_errors
def pull(ref, platform_, rootfs, as_json, cache_dir, jobs, ca_cert, plain_http, insecure_tls):
    """Pull REF (an image reference, or https://.../rootfs.tar.zst#sha256=HEX) into the cache."""
    from .cache import BlobCache
    from .manifest import Platform
    from .pull import pull as do_pull

    with _progress(as_json) as progress:
        image = do_pull(ref, cache=BlobCache(cache_dir), options=_make_options(jobs, ca_cert, plain_http, insecure_tls),
                        platform=Platform.parse(platform_) if platform_ else None, progress=progress)
    record = image.to_json()
    if rootfs:
        from .layers import flatten
        report = flatten([layer.path for layer in image.layers], rootfs)
        record["rootfs"] = {"path": str(rootfs), "skipped": report.skipped}
    if as_json:
        click.echo(json.dumps(record, indent=2))
        return
    click.echo(f"{image.reference} {image.digest} ({image.platform})")
    for layer in image.layers:
        click.echo(f"  {layer.digest}  {layer.size:>12,d}  {layer.media_type}")
    if rootfs:
        click.echo(f"flattened into {rootfs}" + (f" ({len(report.skipped)} entries skipped)" if report.skipped else ""))


if __name__ == "__main__":
    main()
