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


def _parse_bases(values: tuple[str, ...]) -> dict[str, str]:
    bases = {}
    for v in values:
        alias, sep, ref = v.partition("=")
        if not sep or not alias or not ref:
            raise click.BadParameter(f"{v!r}: expected ALIAS=REFERENCE", param_hint="--base")
        bases[alias] = ref
    return bases


catalog_argument = click.argument("catalog", type=click.Path(exists=True, dir_okay=False, path_type=Path))
base_option = click.option("--base", "bases", multiple=True, metavar="ALIAS=REF",
                           help="Use REF for the catalog's base alias ALIAS.")
store_option = click.option("--store", type=click.Path(file_okay=False, path_type=Path), envvar="IMAGE_BUILDER_STORE",
                            default=Path("store"), show_default=True, help="The store directory.")
backend_option = click.option("--backend", type=click.Choice(["chroot", "userns", "proot"]),
                              help="Sandbox for scripts (default: chroot as root, else userns, else proot).")


@main.command()
@catalog_argument
@base_option
@_one_line_errors
def check(catalog, bases):
    """Validate CATALOG without building anything."""
    from .catalog import load
    cat = load(catalog, bases=_parse_bases(bases))
    click.echo(f"{catalog}: {len(cat.environments)} environments, {len(cat.instances)} instances, ok")


@main.command()
@catalog_argument
@store_option
@click.option("--only", multiple=True, metavar="NAME", help="Build only these environments.")
@base_option
@backend_option
@click.option("--compression", type=click.Choice(["zstd", "gzip", "lz4", "xz"]), default="zstd", show_default=True,
              help="squashfs compression (gzip for the oldest Apptainers).")
@click.option("--processors", type=click.IntRange(1), help="mksquashfs threads (default: all cores).")
@click.option("--force", is_flag=True, help="Rebuild even when nothing changed.")
@click.option("-v", "--verbose", is_flag=True, help="Show script output live.")
@registry_options
@_one_line_errors
def build(catalog, store, only, bases, backend, compression, processors, force, verbose,
          cache_dir, jobs, ca_cert, plain_http, insecure_tls):
    """Build the environments of CATALOG into STORE (one .sif each)."""
    from .cache import BlobCache
    from .catalog import load
    from .envbuild import BuildFailed, BuildOptions, build_environment
    from .sandbox import Backend, detect_backend
    from .squashfs import SquashOptions

    cat = load(catalog, bases=_parse_bases(bases))
    chosen = Backend(backend) if backend else detect_backend()
    if chosen is Backend.PROOT:
        click.echo("warning: building under proot (ptrace): syscall-heavy steps like pip or compileall "
                   "run 2-45x slower than in a user namespace", err=True)
    unknown = sorted(set(only) - set(cat.environments))
    if unknown:
        raise click.BadParameter(f"no environment {unknown[0]!r} in {catalog}", param_hint="--only")
    opts = BuildOptions(store=store, cache=BlobCache(cache_dir),
                        registry=_make_options(jobs, ca_cert, plain_http, insecure_tls),
                        backend=chosen,
                        squash=SquashOptions(compression=compression, level=3 if compression == "zstd" else None,
                                             processors=processors),
                        verbose=verbose, force=force)
    for name, spec in cat.environments.items():
        if only and name not in only:
            continue
        try:
            with _progress(False) as progress:
                result = build_environment(spec, opts, progress)
        except BuildFailed as e:
            for line in e.tail:
                click.echo(f"  | {line}", err=True)
            raise
        state = f"built in {result.seconds:.1f} s" if result.built else "up to date"
        click.echo(f"{name}: {state}  {result.sif}")


@main.command()
@click.argument("environment")
@store_option
@backend_option
@_one_line_errors
def debug(environment, store, backend):
    """Open a shell in ENVIRONMENT's failed build, to rerun its scripts by hand."""
    from .envbuild import debug_shell, failed_build
    from .sandbox import Backend
    failed = failed_build(store, environment)
    click.echo(f"debug shell in {failed.rootfs} ({(Backend(backend) if backend else failed.backend).value}); "
               "the scripts are in the catalog's env_scripts/; exit to leave", err=True)
    sys.exit(debug_shell(failed, Backend(backend) if backend else None))


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
@_one_line_errors
def inspect(file, as_json):
    """List the objects of a .sif file."""
    from .sif import read_sif
    image = read_sif(file)
    if as_json:
        click.echo(json.dumps({"path": str(file), "arch": image.arch, "labels": image.labels(), "objects": [
            {"id": d.id, "type": f"0x{d.datatype:04x}", "name": d.name, "offset": d.offset, "size": d.size,
             "fstype": d.fstype, "parttype": d.parttype, "arch": d.arch} for d in image.descriptors]}, indent=2))
        return
    click.echo(f"{file}: SIF, arch {image.arch}, {len(image.descriptors)} objects")
    for d in image.descriptors:
        part = f"  fs={d.fstype} part={d.parttype} arch={d.arch}" if d.fstype is not None else ""
        click.echo(f"  {d.id:>3}  0x{d.datatype:04x}  {d.name or '-':<28} offset={d.offset:<10} size={d.size}{part}")
    for k, v in sorted(image.labels().items()):
        click.echo(f"  label {k} = {v}")


if __name__ == "__main__":
    main()
