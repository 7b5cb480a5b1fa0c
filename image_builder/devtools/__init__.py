"""Developer tooling, on no run path: `make demo` (demo.py), a local TLS registry
(localregistry.py) and debootstrap bases (bases.py) for the demo, tests and benchmarks.

May import anything below it.
"""
