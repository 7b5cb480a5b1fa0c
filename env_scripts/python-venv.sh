#!/bin/sh
# Create a Python virtualenv and install packages into it.
#   PYTHON            interpreter to build the venv from (default: python3)
#   VENV              where the venv goes (default: /opt/venv; put $VENV/bin first on PATH); one that
#                     exists (an environment built on another) is installed into
#   PIP_VERSION       pip requirement to install first, e.g. pip==24.0 (optional; a base's own pip may be
#                     too old for editable installs of newer projects, the latest too new for old ones)
#   PYTHON_PACKAGES   space-separated pip requirements, from PyPI (optional)
#   /build/wheels/    wheels from the build context, installed first (optional)
#   /build/requirements.txt  (optional)
set -eu
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-/opt/venv}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --no-input --disable-pip-version-check --no-cache-dir "$@"; }
if [ -n "${PIP_VERSION:-}" ]; then
    pip install "$PIP_VERSION"
fi
if [ -d /build/wheels ]; then
    pip install --no-index --find-links /build/wheels /build/wheels/*.whl
fi
if [ -f /build/requirements.txt ]; then
    pip install -r /build/requirements.txt
fi
if [ -n "${PYTHON_PACKAGES:-}" ]; then
    # shellcheck disable=SC2086  # one argument per requirement
    pip install $PYTHON_PACKAGES
fi
# Byte-compile now: the packed image is read-only, so Python could never cache them later.
"$VENV/bin/python" -m compileall -q -j 0 "$VENV" >/dev/null || true
