"""image_builder: rootless sandbox images for code-benchmark graders.

The sub-packages are the pipeline; each may import the ones before it, never one after:

    errors, progress, tasks   shared by every stage (errors, progress bars, task records)
    oci/      pull base images: references, registries, manifests, the blob cache, flattening
    pack/     squashfs images and SIFs: writing, reading, overlay layers
    store/    a store on disk: its paths, index.json, publishing files whole
    runtime/  mount an instance's layers and run commands in them (the session types,
              backends, the mount holder, the native init)
    build/    catalogs and datasets into environments and instances (the build sandbox)
    graders/  grade candidates in instances: asserts, stdio, SWE-bench; grading, rewards
    devtools/ the demo, a local registry, debootstrap bases (not on any run path)
    cli, slurm  on top: the command line and job arrays (entry: the console script, `run` on a
                fast path through cli_run that imports no click, served warm by cli_server)

tests/test_layout.py keeps this true.
"""

__version__ = "0.1.1"  # in every build key: a fix to what builds make rebuilds them
