"""Errors a grader user can fix: unreadable task or prediction files, a missing executor."""

from __future__ import annotations

from image_builder.errors import ImageBuilderError


class GraderError(ImageBuilderError):
    pass
