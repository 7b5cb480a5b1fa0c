"""Images on disk: squashfs (written with mksquashfs, read without mounting),
Singularity SIFs around them, and overlay layers in Apptainer's form.

May import: errors.
"""
