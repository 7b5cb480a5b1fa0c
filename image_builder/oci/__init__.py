"""Pull base images: references, registry client and auth, manifests, the
content-addressed blob cache, and flattening layers into a tree (layers.py).

May import: errors, progress.
"""
