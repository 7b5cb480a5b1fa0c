"""What every command module of the CLI shares (cli.py and the command groups in modules of their own)."""

from __future__ import annotations

import functools

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
