"""The `image-builder` program: `run` on a fast path that imports no click, the rest through click.

A fresh `image-builder run` process should start about as fast as `ch-run`; importing click
and building the whole command tree cost it more than the run itself. So argv that click
would read as `run` with valid options goes straight to the run (cli_run.parse says which);
anything else, --help and every error included, is click's (image_builder.cli).
"""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["run"]:
        from image_builder import cli_run
        params = cli_run.parse(argv[1:])
        if params is not None:
            _fast_run(cli_run, params)
    from image_builder.cli import main as click_main
    click_main()


def _fast_run(cli_run, p: dict) -> None:
    """As click runs the command: an ImageBuilderError is one `Error: ...` line and status 1,
    Ctrl-C `Aborted!` and 1; a usage error (no default command) goes back to click for its message."""
    import errno

    from image_builder.errors import ImageBuilderError
    try:
        cli_run.run(p["instance"], p["command"], p["store"], p["timeout"], p["memory"], p["net"], p["binds"],
                    p["env_vars"], p["workdir"], p["backend"], p["max_output"], p["as_json"], p["output_dir"])
    except cli_run.NoCommand:
        return  # click says it, with the usage line
    except ImageBuilderError as e:
        print("Error: " + " ".join(str(e).splitlines()), file=sys.stderr, flush=True)
        sys.exit(1)
    except (KeyboardInterrupt, EOFError):
        print(file=sys.stderr)
        print("Aborted!", file=sys.stderr, flush=True)
        sys.exit(1)
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
        sys.exit(1)
