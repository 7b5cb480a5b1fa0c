"""image_builder: rootless sandbox images for code-benchmark graders.

The pipeline, one module per step:
    registry (pull) -> layers (flatten) -> sandbox (run scripts) -> squashfs/sif (pack)
    -> store (index) -> runtime (mount, run) -> graders (grade)
"""

__version__ = "0.1.0"
