"""Build a store: catalogs and datasets (catalog.py, datasets.py) into environments
(envbuild.py: pull, flatten, run env scripts in the build sandbox, pack a .sif) and
instances (instances.py: a script over the environment, packed as a .sqfs overlay);
storebuild.py builds a whole catalog in parallel and writes the index.

May import: errors, progress, tasks, oci, pack, store, runtime (binds, squashfuse).
"""
