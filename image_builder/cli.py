"""The `image-builder` command: a thin click layer over the Python API.

Each command imports what it needs when it runs, so a command that starts
often (running a grader) does not pay for the registry client or rich. The
console script is image_builder.entry: `run` and `sandbox exec` with valid options
go to the CLI server (cli_server) or through cli_run without importing click at all;
everything else comes here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from image_builder import __version__
from image_builder.cli_run import CAPPED as _CAPPED  # run's status past --max-output (124 is the timeout's)
from image_builder.cli_common import one_line_errors as _one_line_errors
from image_builder.cli_impossible import impossible_group


def _progress(quiet: bool):
    from image_builder.progress import LogProgress, NullProgress, RichProgress
    if quiet:
        return NullProgress()
    return RichProgress() if sys.stderr.isatty() else LogProgress()


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


def _make_options(ca_cert, plain_http, insecure_tls, jobs=4):
    from image_builder.oci.registry import RegistryOptions
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
@click.option("-j", "--jobs", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Parallel layer downloads.")
@registry_options
@_one_line_errors
def pull(ref, platform_, rootfs, as_json, jobs, cache_dir, ca_cert, plain_http, insecure_tls):
    """Pull REF (an image reference, or https://.../rootfs.tar.zst#sha256=HEX) into the cache."""
    from image_builder.oci.cache import BlobCache
    from image_builder.oci.manifest import Platform
    from image_builder.oci.pull import pull as do_pull

    with _progress(as_json) as progress:
        image = do_pull(ref, cache=BlobCache(cache_dir), options=_make_options(ca_cert, plain_http, insecure_tls, jobs),
                        platform=Platform.parse(platform_) if platform_ else None, progress=progress)
    record = image.to_json()
    if rootfs:
        from image_builder.oci.layers import flatten
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


@main.command()
@catalog_argument
@base_option
@_one_line_errors
def check(catalog, bases):
    """Validate CATALOG without building anything."""
    from image_builder.build.catalog import load
    cat = load(catalog, bases=_parse_bases(bases))
    click.echo(f"{catalog}: {len(cat.environments)} environments, {len(cat.instances)} instances, ok")


def _parse_shard(value: str | None) -> tuple[int, int] | None:
    if not value:
        return None
    k, sep, n = value.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise click.BadParameter(f"{value!r}: expected K/N with 0 <= K < N, e.g. 0/4", param_hint="--shard")
    return int(k), int(n)


@main.command()
@catalog_argument
@store_option
@click.option("-j", "--jobs", type=click.IntRange(1, 256), default=2, show_default=True,
              help="Items built at once.")
@click.option("--only", multiple=True, metavar="ID", help="Build only these instances or environments (and what "
              "they are built on): names or shell globs, quoted ('sphinx-doc__sphinx-*'), repeatable or "
              "comma-separated.")
@click.option("--shard", metavar="K/N", help="Build the K-th of N slices of the instances (K from 0), "
              "writing an index fragment for `index merge`.")
@click.option("--environments-only", is_flag=True, help="Build only the environments (those of the --only or "
              "--shard instances), none of the instances.")
@click.option("--fail-fast", is_flag=True, help="Stop at the first failure.")
@click.option("--attempt", metavar="ID", help="Shared by the shards of one submission (slurm build passes the "
              "array job id): an environment that failed in one is not tried again by the others.")
@base_option
@backend_option
@click.option("--compression", type=click.Choice(["zstd", "gzip", "lz4", "xz"]), default="zstd", show_default=True,
              help="squashfs compression (gzip for the oldest Apptainers).")
@click.option("--processors", type=click.IntRange(1), help="mksquashfs threads per image (default: all cores).")
@click.option("--force", is_flag=True, help="Rebuild even when nothing changed.")
@click.option("-v", "--verbose", is_flag=True, help="Show script output live.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@registry_options
@_one_line_errors
def build(catalog, store, jobs, only, shard, fail_fast, attempt, environments_only, bases, backend, compression,
          processors, force, verbose, as_json, cache_dir, ca_cert, plain_http, insecure_tls):
    """Build CATALOG into STORE: one .sif per environment, one .sqfs per instance, and index.json."""
    from image_builder.build.catalog import load
    from image_builder.build.envbuild import BuildOptions
    from image_builder.build.sandbox import BuildBackend, detect_backend
    from image_builder.build.storebuild import StoreBuildOptions, build_store, expand_only, select, to_json
    from image_builder.oci.cache import BlobCache
    from image_builder.pack.squashfs import SquashOptions
    from image_builder.progress import BuildLog, BuildProgress

    cat = load(catalog, bases=_parse_bases(bases))
    chosen = BuildBackend(backend) if backend else detect_backend()
    if chosen is BuildBackend.PROOT:
        click.echo("warning: building under proot (ptrace): syscall-heavy steps like pip or compileall "
                   "run 2-45x slower than in a user namespace", err=True)
    build_opts = BuildOptions(store=store, cache=BlobCache(cache_dir),
                              registry=_make_options(ca_cert, plain_http, insecure_tls), backend=chosen,
                              squash=SquashOptions(compression=compression,
                                                   level=3 if compression == "zstd" else None, processors=processors),
                              verbose=verbose, force=force)
    opts = StoreBuildOptions(build_opts, jobs=jobs, only=expand_only(cat, only), shard=_parse_shard(shard),
                             fail_fast=fail_fast, environments_only=environments_only, attempt=attempt)
    envs, instances = select(cat, opts.only, opts.shard, opts.environments_only)
    reporter = BuildProgress(len(envs) + len(instances)) if sys.stderr.isatty() and not verbose else BuildLog()
    with reporter:
        summary = build_store(cat, opts, reporter)
    if as_json:
        click.echo(json.dumps(to_json(summary), indent=2))
    else:
        _print_summary(summary)
    for failure in summary.failed:
        for line in failure.tail:
            click.echo(f"  | {line}", err=True)
        click.echo(f"failed: {failure.message}", err=True)
    if summary.failed:
        sys.exit(1)


def _print_summary(summary) -> None:
    rows = []
    for kind in ("environment", "instance"):
        counts = {st: summary.count(kind, st) for st in ("built", "up to date", "failed", "skipped")}
        size = sum(r.size for r in summary.results if r.kind == kind)
        rows.append((kind + "s", *(str(c) for c in counts.values()), _human(size)))
    header = ("", "built", "up to date", "failed", "skipped", "size")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        click.echo("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    for first, others in summary.shared:
        click.echo(f"{', '.join(others)}: same environment as {first} (one image)")
    click.echo(f"{summary.seconds:.1f} s; index: {summary.index}")


def _human(n: float) -> str:
    from image_builder.progress import human_bytes
    return human_bytes(n)


@main.command()
@click.argument("environment")
@store_option
@backend_option
@_one_line_errors
def debug(environment, store, backend):
    """Open a shell in ENVIRONMENT's failed build, to rerun its scripts by hand."""
    from image_builder.build.envbuild import debug_shell, failed_build
    from image_builder.build.sandbox import BuildBackend
    failed = failed_build(store, environment)
    click.echo(f"debug shell in {failed.where} ({(BuildBackend(backend) if backend else failed.backend).value}); "
               "the scripts are in the catalog's env_scripts/; exit to leave", err=True)
    sys.exit(debug_shell(failed, BuildBackend(backend) if backend else None))


@main.command()
@click.argument("target")
@click.option("--store", type=click.Path(file_okay=False, path_type=Path), envvar="IMAGE_BUILDER_STORE",
              default=Path("store"), show_default=True)
@click.option("--json", "as_json", is_flag=True)
@_one_line_errors
def inspect(target, store, as_json):
    """Show TARGET: a .sif file's objects, or an instance of the store and its layers."""
    if target.endswith(".sif") and Path(target).is_file():
        return _inspect_sif(Path(target), as_json)
    from dataclasses import asdict
    from image_builder.store.store import Store
    st = Store.open(store)
    resolved = st.resolve(target)
    record = {**asdict(resolved), "layers": [str(p) for p in resolved.layers]}
    record["env_sif"] = str(resolved.env_sif)
    record["overlays"] = [str(p) for p in resolved.overlays]
    if as_json:
        click.echo(json.dumps(record, indent=2))
        return
    click.echo(f"instance {resolved.id} (environment {resolved.environment}), workdir {resolved.workdir}")
    for i, layer in enumerate(resolved.layers):
        click.echo(f"  layer {i}: {layer}  ({_human(layer.stat().st_size)})")
    if resolved.test_command:
        click.echo(f"  test command: {resolved.test_command}")
    click.echo("  apptainer: apptainer exec " + " ".join(f"--overlay {p}:ro" for p in resolved.overlays)
               + f" {resolved.env_sif} CMD")


def _inspect_sif(file: Path, as_json: bool) -> None:
    from image_builder.pack.sif import read_sif
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


@main.command(name="ls")
@store_option
@click.option("--json", "as_json", is_flag=True)
@_one_line_errors
def ls_(store, as_json):
    """List the store's environments: instance counts and sizes."""
    from image_builder.store.store import Store
    index = Store.open(store).index
    rows = []
    for name, env in sorted(index.environments.items()):
        insts = [i for i in index.instances.values() if i.environment == name]
        own = env.overlays[-1] if env.overlays else env
        rows.append({"environment": name, "instances": len(insts), "image": own.file if env.overlays else env.sif,
                     "image_bytes": own.size, "layers": len(env.files),
                     "instance_bytes": sum(i.size for i in insts), "base": env.base})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    # An environment's own image: its .sif, or for one built `from:` another its overlay (shared files once).
    click.echo(f"{'environment':<28} {'instances':>9} {'image':>10} {'layers':>6} {'instances':>10}  base")
    for r in rows:
        click.echo(f"{r['environment']:<28} {r['instances']:>9} {_human(r['image_bytes']):>10} {r['layers']:>6} "
                   f"{_human(r['instance_bytes']):>10}  {r['base']}")
    images = len({r["image"] for r in rows})
    click.echo(f"{len(rows)} environments ({images} images), {len(index.instances)} instances, "
               f"{_human(sum(index.file_sizes().values()))}")


@main.command()
@store_option
@click.option("--no-history", is_flag=True, help="Do not check the instances' repositories (one run each).")
@_one_line_errors
def verify(store, no_history):
    """Re-hash every file against the index; report missing, corrupt and orphaned files, and instances whose
    repository holds more than their base commit and its ancestors."""
    from image_builder.store.store import Store, verify as do_verify
    st = Store.open(store)
    report = do_verify(st)
    if not no_history:
        from image_builder.build.repo_history import check_histories
        check_histories(st, report)
    for kind in ("missing", "corrupt", "orphaned", "history"):
        for rel in getattr(report, kind):
            click.echo(f"{kind}: {rel}")
    click.echo(f"{report.checked} files checked: {len(report.missing)} missing, {len(report.corrupt)} corrupt, "
               f"{len(report.orphaned)} orphaned" + ("" if no_history else f"; {len(report.history)} instances "
                                                     "with history beyond their base commit"))
    if not report.ok:
        sys.exit(1)


@main.command()
@store_option
@click.option("--keep-failed", is_flag=True, help="Keep failed builds (for `debug`).")
@_one_line_errors
def gc(store, keep_failed):
    """Remove files the index no longer references, temporary files and failed builds."""
    from image_builder.store.store import Store, gc as do_gc
    removed = do_gc(Store.open(store), keep_failed=keep_failed)
    for rel in removed:
        click.echo(f"removed {rel}")
    click.echo(f"{len(removed)} removed")


runtime_backend_option = click.option("--backend", type=click.Choice(["kernel", "userns", "apptainer", "extract"]),
                                      help="How to mount and run (default: what `doctor` picks).")


def _layers(store: Path, instance: str | None, env_name: str | None):
    """The runtime's layers for an instance, or for an environment alone (--env)."""
    from image_builder.cli_run import layers
    return layers(store, instance, env_name)


def _binds(values: tuple[str, ...]):
    from image_builder.cli_run import BadBind, parse_binds
    try:
        return parse_binds(values)
    except BadBind as e:
        raise click.BadParameter(f"{e.args[0]!r}: expected SRC:/DEST[:ro|rw]", param_hint="--bind") from None


class _Size(click.ParamType):
    """A byte count: 1048576, 64K, 10M, 1G (binary)."""

    name = "size"

    def convert(self, value, param, ctx):
        from image_builder.cli_run import parse_size
        n = parse_size(value)
        if n is None:
            self.fail(f"{value!r}: expected a byte count such as 1048576, 64K, 10M or 1G", param, ctx)
        return n


@main.command(context_settings={"allow_interspersed_args": False})
@click.argument("instance")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@store_option
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="Seconds; kills the whole process tree.")
@click.option("--memory", type=click.IntRange(1), metavar="MB", help="Memory limit.")
@click.option("--net", is_flag=True, help="Allow network access (off by default).")
@click.option("--bind", "binds", multiple=True, metavar="SRC:DST[:ro]", help="Show a host path inside.")
@click.option("-e", "--env", "env_vars", multiple=True, metavar="K=V", help="An environment variable.")
@click.option("--workdir", help="Default: the instance's.")
@runtime_backend_option
@click.option("--max-output", type=_Size(), default="1G", show_default=True, metavar="SIZE",
              help=f"Most bytes of stdout, and of stderr, passed on (K, M, G; 0: no limit). Past it the "
                   f"command is stopped, a line on stderr says so and the exit status is {_CAPPED}.")
@click.option("--json", "as_json", is_flag=True, help="Print a result record; output goes to files.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="With --json: where stdout and stderr are written (default: a new temp dir).")
@_one_line_errors
def run(instance, command, store, timeout, memory, net, binds, env_vars, workdir, backend, max_output, as_json,
        output_dir):
    """Run COMMAND in INSTANCE: exit status, stdout and stderr as if it ran here.

    Layers are read-only and each run gets a fresh throwaway layer. Output is
    passed on as it comes and stdin read as the command reads it (a file given
    on stdin is copied first, so the command sees a regular file). Put `--`
    before COMMAND when it has options of its own. Without COMMAND, the instance's default command (an
    imported image's Entrypoint and Cmd).

    Exit status: the command's (128+N when signal N killed it); 124 when
    --timeout stopped it; 125 when its output went over --max-output. With
    --json the record tells: 0, or 125 over --max-output.
    """
    from image_builder import cli_run  # the body, shared with the fast path (image_builder.entry)
    try:
        cli_run.run(instance, command, store, timeout, memory, net, binds, env_vars, workdir, backend, max_output,
                    as_json, output_dir)
    except cli_run.BadBind as e:
        _binds((e.args[0],))
    except cli_run.NoCommand as e:
        raise click.UsageError(str(e)) from None


# A login shell's startup files, then the image's environment over them: /etc/profile sets PATH
# afresh (Debian's drops /opt/venv/bin, which `run` has). $1 is the rc text; bash reads it when
# interactive (on a terminal), and commands piped in run with the image's environment as it is.
_BASH_AS_LOGIN = 'exec /bin/bash --rcfile <(printf "%s\\n" "$1")'


def _shell_rc(env: dict[str, str]) -> str:
    import shlex
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k.isidentifier() and k.isascii())
    return ("if [ -r /etc/profile ]; then . /etc/profile; fi\n"
            "for __ib in ~/.bash_profile ~/.bash_login ~/.profile; do\n"
            '  if [ -r "$__ib" ]; then . "$__ib"; break; fi\n'
            "done\nunset __ib\n" + (f"export {exports}\n" if exports else ""))


@main.command()
@click.argument("instance", required=False)
@click.option("--env", "env_name", metavar="NAME", help="A shell in an environment, without an instance.")
@store_option
@click.option("--persist", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the writable layer in this directory (and reuse it next time).")
@click.option("--net", is_flag=True, help="Allow network access.")
@click.option("--bind", "binds", multiple=True, metavar="SRC:DST[:ro]")
@runtime_backend_option
@_one_line_errors
def shell(instance, env_name, store, persist, net, binds, backend):
    """An interactive shell in INSTANCE (or --env NAME), over a throwaway writable layer.

    bash reads its login files, then gets the image's environment (PATH above
    all) back over them, as `run` has it; without bash, /bin/sh.
    """
    from image_builder.runtime.backends import open_session
    from image_builder.runtime.execution import DEFAULT_PATH
    from image_builder.runtime.session import Backend
    if not instance and not env_name:
        raise click.UsageError("name an INSTANCE or --env NAME")
    layers, what = _layers(store, instance, env_name)
    # merged-/usr images have bin -> usr/bin: look where the file really is
    has_bash = _has(layers, "bin/bash") or _has(layers, "usr/bin/bash")
    image_env = {"PATH": DEFAULT_PATH, **layers.env}
    if has_bash:
        argv = ("/bin/bash", "-c", _BASH_AS_LOGIN, "bash", _shell_rc(image_env))
        how = "/bin/bash (login files, then the image's environment)"
    else:
        argv, how = ("/bin/sh",), "/bin/sh"
    layer_list = ", ".join(str(p) for p in (layers.env_sif, *layers.overlays))
    click.echo(f"image-builder shell: {what}; layers (read-only): {layer_list}; writes go to "
               + (f"{persist} (kept)" if persist else "a throwaway layer") + "; exit to leave", err=True)
    click.echo(f"image-builder shell: {how}; PATH={image_env['PATH']}", err=True)
    with open_session(layers, backend=Backend(backend) if backend else None, binds=_binds(binds)) as session:
        code = session.shell(argv, persist=persist, network=net)
    sys.exit(code)


def _has(layers, path: str) -> bool:
    """Whether the environment image has `path` (read from its squashfs listing, no mount)."""
    from image_builder.pack.sif import partition_offset
    from image_builder.pack.squashfs import list_paths
    return f"/{path}" in list_paths(layers.env_sif, path, partition_offset(layers.env_sif)[0])


@main.command()
@store_option
@click.option("--env", "env_name", metavar="NAME", help="The environment runs use (default: the store's only, "
                                                        "else first by name).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0: a free one.")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Bearer token clients send (made, mode 600, when absent; default: "
                   "$XDG_CONFIG_HOME/image_builder/serve.token).")
@click.option("--no-token", is_flag=True, help="No authentication (loopback only: any user of the node can call it).")
@click.option("--url-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the server's URL here once it listens (the host's name when listening on all addresses); "
                   "removed when it stops.")
@click.option("--max-concurrency", type=click.IntRange(1), default=4, show_default=True, help="Runs at once.")
@click.option("--queue", type=click.IntRange(0), default=16, show_default=True,
              help="Requests waiting for a run; past them, 503 with Retry-After.")
@click.option("--body-limit", type=_Size(), default="16M", show_default=True, metavar="SIZE",
              help="Largest request body (K, M, G); past it, 413.")
@runtime_backend_option
@_one_line_errors
def serve(store, env_name, host, port, token_file, no_token, url_file, max_concurrency, queue, body_limit,
          backend):
    """Serve SandboxFusion's API (POST /run_code, POST /submit, GET /health) over an environment of STORE.

    Each run gets a fresh root and no network, as `run`. /run_code's verdict is the
    exit status (SandboxFusion's); /submit's (CommonOJDataset, MBPPDataset with
    config.provided_data) are the graders', as `grade` gives them.
    """
    import ipaddress
    import signal

    try:
        import uvicorn
    except ImportError:
        raise click.ClickException("serve needs starlette and uvicorn: pip install 'image_builder[serve]'") from None

    import contextlib
    from functools import partial

    from image_builder.runtime.backends import open_session
    from image_builder.runtime.session import Backend
    from image_builder.runtime.warm import LAYERS_AT, WarmPools
    from image_builder.serve import Limits, Runner, default_token_file, environment_layers, guarded_protocol, \
        listen, load_or_create_token, make_app, url_of
    from image_builder.store.files import atomic_write
    from image_builder.store.store import Store
    if no_token:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            raise click.BadParameter("--no-token only with a loopback --host", param_hint="--no-token")
        token = None
    else:
        token_file = token_file or default_token_file()
        token, made = load_or_create_token(token_file)
        click.echo(f"image-builder serve: token {'written to' if made else 'read from'} {token_file} "
                   "(send it as 'Authorization: Bearer TOKEN')", err=True)
    layers, name = environment_layers(Store.open(store), env_name)
    sock = listen(host, port)
    url = url_of(sock, host)
    # uvicorn re-raises the SIGTERM it stopped on once it is done: end as asked, but through the `with`
    # below, so the session closes (its mounts let go) rather than the process dying inside uvicorn.run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    chosen = Backend(backend) if backend else None
    warm = WarmPools(layers, partial(open_session, layers, backend=chosen, layers_at=LAYERS_AT))
    with open_session(layers, backend=chosen) as session, contextlib.closing(warm):
        runner = Runner.probe(session, warm)
        click.echo(f"image-builder serve: environment {name} ({', '.join(sorted(runner.languages)) or 'no languages'})"
                   f" on {url}", err=True)
        server = uvicorn.Server(uvicorn.Config(make_app(runner, token, Limits(max_concurrency, queue, body_limit)),
                                               http=guarded_protocol(), access_log=False, log_level="warning"))
        if url_file:
            atomic_write(url_file, lambda f: f.write(f"{url}\n".encode()))
        try:
            server.run(sockets=[sock])
        finally:
            if url_file:
                url_file.unlink(missing_ok=True)  # a stopped server's URL is not left for clients to find


@main.command()
@_one_line_errors
def doctor():
    """What this host supports for running instances, and why."""
    from image_builder.runtime.backends import doctor as diagnose
    for line in diagnose():
        click.echo(f"{'ok ' if line.ok else 'no '} {line.check:<12} {line.detail}")


def _grade_options(timeout, memory, strict, access):
    from dataclasses import replace
    from image_builder.graders import GradeOptions, TestAccess
    opts = GradeOptions(strict=strict, access=TestAccess(access))
    if timeout:
        opts = replace(opts, case_timeout=timeout, stdio_timeout=timeout)
    if memory:
        opts = replace(opts, memory_mb=memory)
    return opts


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


def _with(options):
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


@main.command()
@store_option
@tasks_option
@predictions_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("results.jsonl"),
              show_default=True, help="Results, one JSON line per task; a rerun resumes it. Its summary goes "
              "beside it (results.summary.json), and for SWE-bench tasks SWE-bench's run report "
              "(results.swebench.json) and per-instance reports (results.swebench/<instance_id>/report.json); "
              "`image-builder results swebench` writes them from an existing results file.")
@click.option("--shard", metavar="K/N", help="Grade the K-th of N slices (K from 0), whole instances at a time; "
              "`image-builder results merge` joins the slices' files.")
@click.option("--overwrite", is_flag=True, help="Grade afresh: remove OUTPUT (its summary and artifacts) first, "
              "instead of resuming it.")
@_with(grading_options)
@_with(grade_run_options)
@_one_line_errors
def grade(store, tasks, predictions, output, shard, overwrite, jobs, timeout, memory, strict, access, backend,
          compare, instance, net, splice):
    """Grade PREDICTIONS against TASKS, each in its instance of STORE."""
    from dataclasses import replace
    from image_builder.graders import load_predictions, load_tasks
    from image_builder.graders.grading import (StoreExecutors, discard_results, grade_to_file, read_results,
                                               resumable, shard_predictions, write_summary)
    from image_builder.runtime.session import Backend
    from image_builder.store.store import Store
    task_list, preds = load_tasks(tasks), load_predictions(predictions)
    if shard:
        preds = shard_predictions(preds, task_list, _parse_shard(shard))
    if overwrite:
        discard_results(output)
    already = len(resumable(output, preds))  # refuses a file of other predictions before saying anything
    if already:
        click.echo(f"resuming: {already} of {len(preds)} results already in {output}", err=True)
    opened = Store.open(store)
    if instance is not None:
        opened.resolve(instance)  # UnknownInstance now, in one line, not once per task
    with StoreExecutors(opened, backend=Backend(backend) if backend else None, fallback=instance) as executors, \
            _Progress(len(preds) - already, "grading",
                      lambda r: f"{r.task_id}: {r.status.value} (score {r.score:.2f})") as progress:
        options = replace(_grade_options(timeout, memory, strict, access), compare=compare, repo_network=net,
                          splice=splice)
        grade_to_file(task_list, preds, executors, output, options=options, workers=jobs, on_result=progress)
    wanted = {p.task_id for p in preds}
    graded = [r for r in read_results(output) if r.task_id in wanted]
    _print_grades(write_summary(graded, output), output)
    _write_swebench(graded, output, _repo_ids(task_list))


def _repo_ids(tasks) -> list[str]:
    from image_builder.tasks import RepoTask
    return [t.task_id for t in tasks if isinstance(t, RepoTask)]


def _write_swebench(results, output: Path, dataset_ids=None) -> None:
    from image_builder.graders.swebench_report import report_dir, run_report_path, write_swebench_reports
    reports = write_swebench_reports(results, output, dataset_ids)
    if reports is not None:
        run = reports.run
        click.echo(f"SWE-bench reports: {run_report_path(output)} ({run.resolved_instances} resolved of "
                   f"{run.submitted_instances} submitted), {report_dir(output)}/<instance_id>/report.json")


def _print_grades(summary, output: Path) -> None:
    from image_builder.graders.grading import summary_path
    click.echo(f"{summary.total} tasks: {summary.passed} passed ({summary.pass_rate:.1%}), "
               f"mean score {summary.mean_score:.3f}, timeouts in {summary.tasks_with_timeouts} tasks")
    for status, count in sorted(summary.by_status.items()):
        first = summary.first_ids.get(status)
        more = "" if not first else f"  (first: {', '.join(map(repr, first))}{', ...' if count > len(first) else ''})"
        click.echo(f"  {status:<14} {count}{more}")
    click.echo(f"results: {output}  (summary: {summary_path(output)})")


@main.command()
@click.argument("results", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@tasks_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Where the regraded results go (default: RESULTS itself, replaced whole).")
@_one_line_errors
def regrade(results, tasks, output):
    """Judge the repo results of RESULTS again from the files each run kept (RESULTS.artifacts/<id>/:
    eval.sh, model.patch, test_output.txt, junit.xml, run.json), against TASKS; nothing runs."""
    from image_builder.graders import load_tasks
    from image_builder.graders.grading import regrade as regrade_results
    output = output or results
    summary, changed = regrade_results(results, load_tasks(tasks), output)
    click.echo(f"{len(changed)} results changed" + (f" (first: {', '.join(map(repr, changed[:5]))})"
                                                     if changed else ""))
    _print_grades(summary, output)


@main.group(name="results")
def results_group():
    """Work on grading results."""


@results_group.command(name="merge")
@click.argument("parts", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@predictions_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The merged results, in the predictions' order; its summary goes beside it.")
@_one_line_errors
def results_merge(parts, predictions, output):
    """Join the results files of a sharded grading run (grade --shard K/N) into one, with its summary."""
    from image_builder.graders import load_predictions
    from image_builder.graders.grading import merge_results
    _print_grades(merge_results(parts, load_predictions(predictions), output), output)


@results_group.command(name="swebench")
@click.argument("results", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--tasks", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The run's tasks: its total and incomplete instances (default: the instances RESULTS holds).")
@_one_line_errors
def results_swebench(results, tasks):
    """Write SWE-bench's reports from RESULTS, as its harness writes them, to diff with the official run's:
    RESULTS.swebench/<instance_id>/report.json (get_eval_report's) and RESULTS.swebench.json
    (make_run_report's). `grade` writes them too."""
    from image_builder.graders import load_tasks
    from image_builder.graders.grading import read_results
    dataset = _repo_ids(load_tasks(tasks)) if tasks else None
    _write_swebench(read_results(results), results, dataset)


class _Progress:
    """A bar on a terminal, a line per item elsewhere (`describe(item)`); called with each item done."""

    def __init__(self, total: int, label: str, describe):
        self.total, self.label, self.describe, self.done, self._bar = total, label, describe, 0, None

    def __enter__(self):
        if sys.stderr.isatty() and self.total:
            from rich.progress import Progress
            self._bar = Progress()
            self._task = self._bar.add_task(self.label, total=self.total)
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._bar:
            self._bar.stop()

    def __call__(self, item) -> None:
        self.done += 1
        if self._bar:
            self._bar.advance(self._task)
        else:
            click.echo(f"[{self.done}/{self.total}] {self.describe(item)}", err=True)


@main.command()
@store_option
@click.option("--tasks", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="The mutated tasks (and, optionally, their originals).")
@click.option("--references", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="Reference solutions or gold patches, as predictions JSONL keyed by original task id.")
@click.option("-o", "--output-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("qc"),
              show_default=True, help="Where kept.jsonl and dropped.jsonl go.")
@_with(grading_options)
@_one_line_errors
def qc(store, tasks, references, output_dir, jobs, timeout, memory, strict, access, backend):
    """ImpossibleBench's quality check: keep a mutation only if the reference and the empty solution both fail."""
    from image_builder.graders import load_predictions, load_tasks, quality_check_all, write_qc
    from image_builder.graders.grading import StoreExecutors
    from image_builder.runtime.session import Backend
    from image_builder.store.store import Store
    from image_builder.graders.impossible import is_mutation
    refs = {p.task_id: p.solution for p in load_predictions(references) if p.solution is not None}
    task_list = load_tasks(tasks)
    with StoreExecutors(Store.open(store), backend=Backend(backend) if backend else None) as executors, \
            _Progress(sum(map(is_mutation, task_list)), "checking",
                      lambda v: f"{v.task_id}: {'kept' if v.kept else 'dropped'}") as progress:
        verdicts = quality_check_all(task_list, refs, executors, _grade_options(timeout, memory, strict, access),
                                     workers=jobs, on_verdict=progress)
    kept, dropped = write_qc(verdicts, output_dir)
    click.echo(f"{sum(v.kept for v in verdicts)} kept ({kept}), {sum(not v.kept for v in verdicts)} dropped "
               f"({dropped})")


@main.group(name="index")
def index_group():
    """Work on a store's index."""


@index_group.command(name="merge")
@store_option
@_one_line_errors
def index_merge(store):
    """Combine the index fragments of a sharded build (--shard K/N) into index.json."""
    from image_builder.build.storebuild import merge_fragments
    path, count = merge_fragments(store)
    click.echo(f"merged {count} fragments into {path}")


@main.command(name="import")
@click.argument("refs", nargs=-1)
@store_option
@click.option("--from-file", "list_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Images to import, one `REF [INSTANCE_ID [WORKDIR]]` a line.")
@click.option("--env-layers", "env_layers", multiple=True, metavar="[GLOB=]N",
              help="The first N layers of every image (or of those whose reference matches GLOB; the first rule "
              "that matches wins) are its environment. Default: the longest prefix it shares with another image.")
@click.option("--id-from", metavar="TEMPLATE", help="Instance ids from the references, e.g. "
              "'docker.io/swebench/sweb.eval.x86_64.{instance_id}:latest' (SWE-bench's _1776_ read as __).")
@click.option("-j", "--jobs", type=click.IntRange(1), default=2, show_default=True, help="Images pulled at once.")
@click.option("--shard", metavar="K/N", help="Import the K-th of N slices (instances in id order) into an index "
              "fragment; `image-builder index merge` joins the slices'.")
@registry_options
@_one_line_errors
def import_command(refs, store, list_file, env_layers, id_from, jobs, shard, cache_dir, ca_cert, plain_http,
                   insecure_tls):
    """Import prebuilt images into STORE: shared bottom layers as one environment, what each image adds as
    its instance's overlay."""
    from image_builder.build.envbuild import BuildOptions
    from image_builder.build.imports import ImportItem, ImportOptions, import_images, read_list
    from image_builder.oci.cache import BlobCache
    items = [ImportItem(r) for r in refs] + (read_list(list_file) if list_file else [])
    rules = []
    for rule in env_layers:
        pattern, _, n = rule.rpartition("=")
        if not n.isdigit():
            raise click.BadParameter(f"{rule!r}: expected N or GLOB=N", param_hint="--env-layers")
        rules.append((pattern or None, int(n)))
    if not items:
        raise click.UsageError("give image references, or --from-file LIST")
    build = BuildOptions(store=store, cache=BlobCache(cache_dir), registry=_make_options(ca_cert, plain_http,
                                                                                          insecure_tls))
    summary = import_images(items, ImportOptions(build, tuple(rules), id_from, jobs, _parse_shard(shard)))
    for name, ids in summary.environments.items():
        click.echo(f"{name}: {len(ids)} instances ({', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''})")
    click.echo(f"{len(items)} images, {len(summary.environments)} environments; store {_human(summary.store_bytes)} "
               f"against {_human(summary.image_bytes)} of image layers ({_human(summary.fetched_bytes)} fetched, "
               f"the rest from the cache); {summary.seconds:.1f} s; index: {summary.index}")
    if summary.users:
        shown = ", ".join(f"{iid} ({user})" for iid, user in list(summary.users.items())[:3])
        click.echo(f"{len(summary.users)} images set a User ({shown}{', ...' if len(summary.users) > 3 else ''}): "
                   "recorded in the index, not applied (commands run as root of the sandbox)")


@main.group(name="sandbox")
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
@_one_line_errors
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
@click.option("--max-output", type=_Size(), default="1G", show_default=True, metavar="SIZE",
              help=f"As `run`'s: past it the command is stopped, exit status {_CAPPED}.")
@sandbox_backend_option
@_one_line_errors
def sandbox_exec(sandbox_id, command, timeout, env_vars, cwd, max_output, backend):
    """Run COMMAND in the sandbox: exit status and output as if it ran here (as `run`)."""
    from image_builder import cli_run
    cli_run.sandbox_exec(sandbox_id, command, timeout, env_vars, cwd, max_output, backend)


@sandbox_group.command(name="cp")
@click.argument("source")
@click.argument("dest")
@sandbox_backend_option
@_one_line_errors
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
@_one_line_errors
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
@_one_line_errors
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
@_one_line_errors
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
@_one_line_errors
def sandbox_stop(sandbox_ids, backend):
    """End sandboxes: every process in them is killed, their writable layers freed."""
    from image_builder.runtime.sandbox import stop_sandbox
    from image_builder.runtime.session import Backend
    for sid in sandbox_ids:
        stop_sandbox(sid, backend=Backend(backend) if backend else None)


@main.group(name="base")
def base_group():
    """Make base images locally, for sites without a registry."""


@base_group.command(name="debian")
@click.argument("suite")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="OCI layout directory to add the image to (made if missing).")
@click.option("--tag", help="Its tag in the layout (default: SUITE).")
@click.option("--include", default="python3,python3-venv,git,ca-certificates", show_default=True,
              help="Comma-separated Debian packages.")
@click.option("--mirror", help="Debian mirror URL (default: debootstrap's).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the debootstrap trees are kept (default: the blob cache's directory).")
@_one_line_errors
def base_debian(suite, output, tag, include, mirror, cache_dir):
    """Debootstrap a Debian SUITE (minbase, as root; about a minute, once) into an OCI layout; prints the
    reference a catalog's `base:` or `--base ALIAS=` takes."""
    from image_builder.oci.cache import default_cache_dir
    from image_builder.oci.debian import debian_base
    packages = tuple(p for p in include.split(",") if p)
    ref = debian_base(suite, output, cache_dir or default_cache_dir() / "bases", packages, tag, mirror)
    click.echo(ref)


@main.group(name="swebench")
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
@_one_line_errors
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


@main.group(name="slurm")
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
@_with(sbatch_options)
@base_option
@click.option("--compression", type=click.Choice(["zstd", "gzip", "lz4", "xz"]), default="zstd", show_default=True,
              help="squashfs compression (gzip for the oldest Apptainers).")
@registry_options
@wait_option
@poll_option
@_one_line_errors
def slurm_build(catalog, store, shards, partition, time_limit, cpus_per_task, sbatch_args, bases, compression,
                cache_dir, ca_cert, plain_http, insecure_tls, wait, poll):
    """Build CATALOG into STORE as Slurm jobs: the instances as a job array (each shard building the environments
    it needs, each environment once), then the index."""
    from image_builder import slurm
    plan = slurm.build_plan(catalog, store, shards, bases=_parse_bases(bases), cache_dir=cache_dir, ca_cert=ca_cert,
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
@_with(sbatch_options)
@registry_options
@wait_option
@poll_option
@_one_line_errors
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
@_with(sbatch_options)
@_with(grade_limit_options)
@_with(grade_run_options)
@wait_option
@poll_option
@_one_line_errors
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
@_with(sbatch_options)
@_one_line_errors
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
@_one_line_errors
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
@_one_line_errors
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


if __name__ == "__main__":
    main()


main.add_command(impossible_group)
