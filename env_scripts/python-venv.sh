#!/bin/sh
# Create a Python virtualenv and install packages into it, or install into the interpreter itself.
#   PYTHON            interpreter to build the venv from (default: python3)
#   PYTHON_VERSION    X.Y the interpreter must be (optional): a base of another Python fails here, in one
#                     line, rather than later at a pin no release for it has (pip==26.3 on 3.9)
#   VENV              where the venv goes (default: /opt/venv; put $VENV/bin first on PATH); one that
#                     exists (an environment built on another) is installed into. Set but empty: no venv,
#                     the interpreter's own site-packages are the environment's, as a conda env is
#                     SWE-bench's: a tool that links to the interpreter (tox-current-env's .tox/*/bin/python)
#                     sees its packages, which a link to a venv's python does not (no pyvenv.cfg beside it)
#   PIP_VERSION       pip requirement to install first, e.g. pip==26.3 (optional; a base's own pip may be
#                     too old for editable installs of newer projects, the latest too new for old ones)
#   PIP_UPLOADED_PRIOR_TO  pip (26+) takes only what was uploaded before this date (optional): installs
#                     resolve as on that day, not today (the pip upgrade above is exempt); the builder
#                     holds older pips to it too (PIP_INDEX_URL: its cut-off index; PIP_INDEX_URL_TODAY)
#   PYTHON_PACKAGES   space-separated pip requirements, from PyPI (optional)
#   PIP_FOR_INSTALL   pip requirement installed after the packages, for install commands of later layers
#                     that need options a newer pip dropped (--no-use-pep517, gone in pip 25.3) (optional)
#   /build/wheels/    wheels from the build context, installed first (optional)
#   /build/requirements.txt  (optional)
#   /build/optional.txt  requirements each installed where the index has wheels for it (with the pins of
#                     PYTHON_PACKAGES), else left out with a line: a conda environment.yml's packages by
#                     their PyPI names, where conda-only ones (hdf5) and source-only builds (cartopy) are
#                     expected (optional)
set -eu
PYTHON="${PYTHON:-python3}"
if [ -n "${PYTHON_VERSION:-}" ]; then
    found=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || found="none"
    if [ "$found" != "$PYTHON_VERSION" ]; then
        echo "error: this base's $PYTHON is Python $found, not the $PYTHON_VERSION this environment needs;" \
             "give a base with Python $PYTHON_VERSION (swebench catalog --python $PYTHON_VERSION=REF)" >&2
        exit 1
    fi
fi
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
# What is installed newer than the cut-off on purpose (pip itself) is resolved as of today: without the
# cut-off, and from the real index, not the builder's cut-off one (build/cutoff_index.py).
today() { (unset PIP_UPLOADED_PRIOR_TO; [ -z "${PIP_INDEX_URL_TODAY:-}" ] || export PIP_INDEX_URL="$PIP_INDEX_URL_TODAY"
           "$@"); }
if [ -n "${PIP_VERSION:-}" ]; then
    today pip install "$PIP_VERSION"
fi
if [ -d /build/wheels ]; then
    pip install --no-index --find-links /build/wheels /build/wheels/*.whl
fi
if [ -f /build/requirements.txt ]; then
    pip install -r /build/requirements.txt
fi
if [ -f /build/optional.txt ]; then
    # Before the packages, held to their pins: SWE-bench's order (the conda environment, then pip_packages).
    for p in ${PYTHON_PACKAGES:-}; do case "$p" in *\[*) ;; *==*) echo "$p" ;; esac; done > /tmp/pins.txt
    # All at once resolves them together; else one by one, so that one missing wheel leaves out only itself.
    if ! pip install --only-binary :all: -c /tmp/pins.txt -r /build/optional.txt; then
        grep -v '^#' /build/optional.txt | while read -r requirement; do
            [ -n "$requirement" ] || continue
            pip install -q --only-binary :all: -c /tmp/pins.txt "$requirement" ||
                echo "image-builder: left out $requirement (no wheel of it that fits the pins and Python)" >&2
        done
    fi
    rm -f /tmp/pins.txt
    # A package whose import fails other than by ImportError is worse than none: tests skip an absent optional
    # dependency (pytest.importorskip) but stop at cfgrib raising RuntimeError for want of conda's ecCodes.
    "$PY" - <<'PYTHON' | while read -r broken; do pip uninstall -q -y "$broken"; done
import re, subprocess, sys
try:
    import importlib.metadata as md
except ImportError:  # Python < 3.8: not checked
    sys.exit(0)
for line in open("/build/optional.txt"):
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
    if line.lstrip().startswith("#") or not name:
        continue
    try:
        dist = md.distribution(name.group(1))
    except md.PackageNotFoundError:
        continue
    tops = (dist.read_text("top_level.txt") or "").split()
    if not tops:  # wheels without top_level.txt: the first part of each module's path
        tops = sorted({str(f).split("/")[0] for f in dist.files or () if str(f).endswith(".py")})
    for top in (t[:-3] if t.endswith(".py") else t for t in tops):
        if not top.isidentifier():
            continue
        r = subprocess.run([sys.executable, "-c", f"try:\n import {top}\nexcept ImportError: pass"],
                           capture_output=True, text=True, timeout=300)
        if r.returncode:
            why = (r.stderr.strip().splitlines() or ["no output"])[-1][:160]
            name = dist.metadata["Name"]  # Distribution.name is 3.10+
            print(f"image-builder: left out {name} (import {top} fails: {why})", file=sys.stderr)
            print(name)
            break
PYTHON
fi
if [ -n "${PYTHON_PACKAGES:-}" ]; then
    # shellcheck disable=SC2086  # one argument per requirement
    pip install $PYTHON_PACKAGES
fi
if [ -n "${PIP_FOR_INSTALL:-}" ]; then
    today pip install "$PIP_FOR_INSTALL"
fi
# Byte-compile now: the packed image is read-only, so Python could never cache them later.
if [ -n "$VENV" ]; then
    "$PY" -m compileall -q -j 0 "$VENV" >/dev/null || true
else
    # shellcheck disable=SC2046  # one argument per directory
    "$PY" -m compileall -q -j 0 $("$PY" -c 'import site; print(" ".join(site.getsitepackages()))') >/dev/null || true
fi
