"""Errors a grader user can fix: a missing executor or instance (unreadable task and
prediction files are tasks.DatasetError)."""

from __future__ import annotations

from image_builder.errors import ImageBuilderError


class GraderError(ImageBuilderError):
    pass
