#!/bin/sh
# Create a Python virtualenv and install packages into it, or install into the interpreter itself.
#   PYTHON            interpreter to build the venv from (default: python3)
#   VENV              where the venv goes (default: /opt/venv; put $VENV/bin first on PATH); one that
#                     exists (an environment built on another) is installed into. Set but empty: no venv,
#                     the interpreter's own site-packages are the environment's, as a conda env is
#                     SWE-bench's: a tool that links to the interpreter (tox-current-env's .tox/*/bin/python)
#                     sees its packages, which a link to a venv's python does not (no pyvenv.cfg beside it)
#   PIP_VERSION       pip requirement to install first, e.g. pip==26.3 (optional; a base's own pip may be
#                     too old for editable installs of newer projects, the latest too new for old ones)
#   PIP_UPLOADED_PRIOR_TO  pip (26+) takes only what was uploaded before this date (optional): installs
#                     resolve as on that day, not today (the pip upgrade above is exempt)
#   PYTHON_PACKAGES   space-separated pip requirements, from PyPI (optional)
#   PIP_FOR_INSTALL   pip requirement installed after the packages, for install commands of later layers
#                     that need options a newer pip dropped (--no-use-pep517, gone in pip 25.3) (optional)
#   /build/wheels/    wheels from the build context, installed first (optional)
#   /build/requirements.txt  (optional)
set -eu
PYTHON="${PYTHON:-python3}"
VENV="${VENV-/opt/venv}"
if [ -n "$VENV" ]; then
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    PY="$VENV/bin/python"
else
    PY=$(command -v "$PYTHON")
    # pip: the interpreter's own, else ensurepip (python.org builds), else Debian's package (Debian
    # disables ensurepip for its python3).
    if ! "$PY" -m pip --version >/dev/null 2>&1 && ! "$PY" -m ensurepip >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends python3-pip
        apt-get clean
        rm -rf /var/lib/apt/lists/*
    fi
    # SWE-bench's specs and test commands say `python`; Debian's interpreter is only python3.
    command -v python >/dev/null || ln -s "$PY" /usr/local/bin/python
fi
pip() { "$PY" -m pip --no-input --disable-pip-version-check --no-cache-dir "$@"; }
if [ -n "${PIP_VERSION:-}" ]; then
    (unset PIP_UPLOADED_PRIOR_TO; pip install "$PIP_VERSION")
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
if [ -n "${PIP_FOR_INSTALL:-}" ]; then
    (unset PIP_UPLOADED_PRIOR_TO; pip install "$PIP_FOR_INSTALL")
fi
# Byte-compile now: the packed image is read-only, so Python could never cache them later.
if [ -n "$VENV" ]; then
    "$PY" -m compileall -q -j 0 "$VENV" >/dev/null || true
else
    # shellcheck disable=SC2046  # one argument per directory
    "$PY" -m compileall -q -j 0 $("$PY" -c 'import site; print(" ".join(site.getsitepackages()))') >/dev/null || true
fi
