"""The `image-builder` program: `run` and `sandbox exec` on a fast path that imports no click, the rest
through click.

A fresh `image-builder run` process should start about as fast as `ch-run`; importing click
and building the whole command tree cost it more than the run itself. So `run` and `sandbox
exec` go first to this user's CLI server (cli_server.py: a warm process that runs them with
our descriptors), else straight to cli_run when click would read argv the same way (cli_run.parse
and parse_exec say which); anything else, --help and every error included, is click's
(image_builder.cli).
"""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["run"] or argv[:2] == ["sandbox", "exec"]:
        from image_builder.cli_server import served
        status = served(argv)
        if status is not None:
            sys.exit(status)
        from image_builder import cli_run
        command = cli_run.fast_command(argv)
        if command is not None:
            cli_run.as_click_would(command)
    from image_builder.cli import main as click_main
    click_main()
