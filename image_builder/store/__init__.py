"""A store on disk: where its files live (store.py), the rule for ids that become
file names (ids.py), index.json and its sqlite lookup copy (index.py), and
publishing a file whole (files.py).

May import: errors, oci (blob hashing). `image_builder.store.Store` is kept for scripts.
"""


def __getattr__(name: str):
    # Lazy, so that importing store.files or store.index does not load store.py.
    if name in ("Store", "UnknownInstance"):
        from . import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
