"""The `image-builder` program: `run` and `sandbox exec` on a fast path that imports no click, the rest
through click.

A fresh `image-builder run` process should start about as fast as `ch-run`; importing click
and building the whole command tree cost it more than the run itself. So argv that click would
read as `run` or `sandbox exec` with valid options goes straight to it (cli_run.parse and
parse_exec say which); anything else, --help and every error included, is click's
(image_builder.cli).
"""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["run"] or argv[:2] == ["sandbox", "exec"]:
        from image_builder import cli_run
        if argv[0] == "run":
            params = cli_run.parse(argv[1:])
            if params is not None:
                _fast(lambda: cli_run.run(**params), cli_run)
        else:
            params = cli_run.parse_exec(argv[2:])
            if params is not None:
                _fast(lambda: cli_run.sandbox_exec(**params), cli_run)
    from image_builder.cli import main as click_main
    click_main()


def _fast(command, cli_run) -> None:
    """As click runs the command: an ImageBuilderError is one `Error: ...` line and status 1,
    Ctrl-C `Aborted!` and 1; a usage error (no default command) goes back to click for its message."""
    import errno

    from image_builder.errors import ImageBuilderError
    try:
        command()
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
