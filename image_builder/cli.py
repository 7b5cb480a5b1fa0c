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
from image_builder.cli_run import CAPPED  # run's status past --max-output (124 is the timeout's)
from image_builder.cli_common import (Size, backend_option, base_option, catalog_argument, grade_run_options,
                                        grading_options, one_line_errors, parse_bases, predictions_option,
                                        registry_options, runtime_backend_option, store_option, tasks_option,
                                        with_options)
from image_builder.cli_impossible import impossible_group
from image_builder.cli_sandbox import sandbox_group
from image_builder.cli_slurm import slurm_group
from image_builder.cli_swebench import swebench_group


def _progress(quiet: bool):
    from image_builder.progress import LogProgress, NullProgress, RichProgress
    if quiet:
        return NullProgress()
    return RichProgress() if sys.stderr.isatty() else LogProgress()


def _make_options(ca_cert, plain_http, insecure_tls, jobs=4):
    from image_builder.oci.registry import RegistryOptions
    return RegistryOptions(ca_cert=ca_cert, plain_http=frozenset(plain_http),
                           insecure_tls=frozenset(insecure_tls), jobs=jobs)


@click.group()
@click.version_option(__version__, prog_name="image-builder")
def main() -> None:
    """Rootless sandbox images for code-benchmark graders."""
    _end_through_finally()


def _end_through_finally() -> None:
    """SIGTERM (kill, `timeout`, a scheduler's time limit) and SIGHUP end the command as Ctrl-C
    does, through its cleanups, with the signal's status (128+N): a build's scripts are stopped
    and its index written, its temporary files go. A signal the caller ignores (nohup) stays so."""
    import signal

    def leave(signum, _frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, leave)


@main.command()
@click.argument("ref")
@click.option("--platform", "platform_", metavar="OS/ARCH[/VARIANT]", help="Default: this host's.")
@click.option("--rootfs", type=click.Path(file_okay=False, path_type=Path),
              help="Also flatten the layers into this directory.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON record on stdout.")
@click.option("-j", "--jobs", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Parallel layer downloads.")
@registry_options
@one_line_errors
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


@main.command()
@catalog_argument
@base_option
@one_line_errors
def check(catalog, bases):
    """Validate CATALOG without building anything."""
    from image_builder.build.catalog import load
    cat = load(catalog, bases=parse_bases(bases))
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
@one_line_errors
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

    cat = load(catalog, bases=parse_bases(bases))
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
@click.argument("name")
@store_option
@backend_option
@one_line_errors
def debug(name, store, backend):
    """Open a shell in the failed build of NAME (an environment or an instance), to rerun its scripts by hand."""
    from image_builder.build.envbuild import debug_shell, failed_build
    from image_builder.build.sandbox import BuildBackend
    failed = failed_build(store, name)
    click.echo(f"debug shell in {failed.where} ({(BuildBackend(backend) if backend else failed.backend).value}); "
               "the scripts are in the catalog's env_scripts/ (an instance's staged in /tmp/.image-builder); "
               "exit to leave", err=True)
    sys.exit(debug_shell(failed, BuildBackend(backend) if backend else None))


@main.command()
@click.argument("target")
@click.option("--store", type=click.Path(file_okay=False, path_type=Path), envvar="IMAGE_BUILDER_STORE",
              default=Path("store"), show_default=True)
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
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
@one_line_errors
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
@one_line_errors
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
@one_line_errors
def gc(store, keep_failed):
    """Remove files the index no longer references, temporary files and failed builds."""
    from image_builder.store.store import Store, gc as do_gc
    removed = do_gc(Store.open(store), keep_failed=keep_failed)
    for rel in removed:
        click.echo(f"removed {rel}")
    click.echo(f"{len(removed)} removed")


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
@click.option("--max-output", type=Size(), default="1G", show_default=True, metavar="SIZE",
              help=f"Most bytes of stdout, and of stderr, passed on (K, M, G; 0: no limit). Past it the "
                   f"command is stopped, a line on stderr says so and the exit status is {CAPPED}.")
@click.option("--json", "as_json", is_flag=True, help="Print a result record; output goes to files.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="With --json: where stdout and stderr are written (default: a new temp dir).")
@one_line_errors
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
@one_line_errors
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
@click.option("--body-limit", type=Size(), default="16M", show_default=True, metavar="SIZE",
              help="Largest request body (K, M, G); past it, 413.")
@runtime_backend_option
@one_line_errors
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
@one_line_errors
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
@with_options(grading_options)
@with_options(grade_run_options)
@one_line_errors
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
        grade_to_file(task_list, preds, executors, output, options=options, workers=jobs, on_result=progress,
                      stop=executors.stop)
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
@one_line_errors
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
@one_line_errors
def results_merge(parts, predictions, output):
    """Join the results files of a sharded grading run (grade --shard K/N) into one, with its summary."""
    from image_builder.graders import load_predictions
    from image_builder.graders.grading import merge_results
    _print_grades(merge_results(parts, load_predictions(predictions), output), output)


@results_group.command(name="swebench")
@click.argument("results", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--tasks", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The run's tasks: its total and incomplete instances (default: the instances RESULTS holds).")
@one_line_errors
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
@with_options(grading_options)
@one_line_errors
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
@one_line_errors
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
@one_line_errors
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
@one_line_errors
def base_debian(suite, output, tag, include, mirror, cache_dir):
    """Debootstrap a Debian SUITE (minbase, as root; about a minute, once) into an OCI layout; prints the
    reference a catalog's `base:` or `--base ALIAS=` takes."""
    from image_builder.oci.cache import default_cache_dir
    from image_builder.oci.debian import debian_base
    packages = tuple(p for p in include.split(",") if p)
    ref = debian_base(suite, output, cache_dir or default_cache_dir() / "bases", packages, tag, mirror)
    click.echo(ref)


@base_group.command(name="python")
@click.argument("prefix", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="OCI layout directory to add the image to (made if missing).")
@click.option("--tag", help="Its tag in the layout (default: python-X.Y).")
@click.option("--suite", help="Debian release under it (default: the oldest of bullseye, bookworm, trixie whose C "
              "library runs the prefix's programs).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the debootstrap trees and made layers are kept (default: the blob cache's directory).")
@one_line_errors
def base_python(prefix, output, tag, suite, cache_dir):
    """A base image of the Python installed at PREFIX (its sys.prefix: pyenv's versions/X.Y.Z, a module
    tree's), laid at /usr/local of a Debian minbase, for a Python no registry here serves (as root; prints the
    reference `swebench catalog --python X.Y=` or a catalog's `base:` takes)."""
    from image_builder.oci.cache import default_cache_dir
    from image_builder.oci.hostpython import python_base
    click.echo(python_base(prefix, output, cache_dir or default_cache_dir() / "bases", suite, tag))


for _group in (impossible_group, sandbox_group, slurm_group, swebench_group):
    main.add_command(_group)

if __name__ == "__main__":
    main()
