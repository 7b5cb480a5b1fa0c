"""The base of every error a user can fix: the CLI prints it as one line."""


class ImageBuilderError(Exception):
    """Bad input or a failed step, with a message naming what and what to do."""
