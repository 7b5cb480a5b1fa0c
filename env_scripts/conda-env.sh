#!/bin/sh
# A conda environment made with conda's own solver, for SWE-bench specs whose packages are a conda
# environment.yml (swebench catalog --conda-channel), as SWE-bench's `conda create python=X.Y` then
# `conda env update -f environment.yml` make it; then the spec's pip packages with the environment's pip.
# The solver is py-rattler (conda's libsolv-based solver as a Python library, from PyPI), installed under
# /tmp for the solve and gone after; packages' post-link scripts are not run.
#   CONDA_CHANNELS       space-separated channel URLs the site names (a conda-forge mirror), in priority order
#   CONDA_PYTHON         the environment's Python (X.Y)
#   CONDA_PREFIX_DIR     where it goes (default: /opt/conda/envs/testbed); put its bin/ first on PATH
#   CONDA_EXCLUDE_NEWER  an ISO time: packages built after it are not taken (optional; the catalog's cut-off)
#   RATTLER              the py-rattler requirement (default: py-rattler==0.28.0)
#   PIP_VERSION          pip requirement for the environment, installed before its pip packages (optional)
#   PYTHON_PACKAGES      space-separated pip requirements, installed last (the spec's pip_packages) (optional)
#   /build/conda-specs.txt        the environment.yml's match specs, one per line
#   /build/pip-requirements.txt   its pip section (optional)
set -eu
PREFIX="${CONDA_PREFIX_DIR:-/opt/conda/envs/testbed}"
SOLVER=/tmp/ib-rattler
# The solver itself is today's (the cut-off is for what it installs), in a venv of the base's python3, else
# beside it with the base's pip.
# today: without the cut-off, from the real index, not the builder's cut-off one (build/cutoff_index.py).
today() { (unset PIP_UPLOADED_PRIOR_TO; [ -z "${PIP_INDEX_URL_TODAY:-}" ] || export PIP_INDEX_URL="$PIP_INDEX_URL_TODAY"
           "$@"); }
solver_pip() {  # PYTHON [pip install options]
    py="$1"
    shift
    today "$py" -m pip install -q --no-input --disable-pip-version-check --no-cache-dir "$@" \
        "${RATTLER:-py-rattler==0.28.0}"
}
if python3 -m venv "$SOLVER" >/dev/null 2>&1; then
    solver_pip "$SOLVER/bin/python"
    SOLVER_PY="$SOLVER/bin/python"
else
    rm -rf "$SOLVER"
    solver_pip python3 --target "$SOLVER"
    SOLVER_PY=python3
fi
PYTHONPATH="$SOLVER" "$SOLVER_PY" - "$PREFIX" <<'PYTHON'
import asyncio, datetime, os, sys
import rattler

prefix = sys.argv[1]
channels = os.environ["CONDA_CHANNELS"].split()
with open("/build/conda-specs.txt") as f:
    specs = [line.strip() for line in f if line.strip() and not line.startswith("#")]
specs.append("python=" + os.environ["CONDA_PYTHON"])
cutoff = os.environ.get("CONDA_EXCLUDE_NEWER")
newer = {"exclude_newer": datetime.datetime.fromisoformat(cutoff.replace("Z", "+00:00"))} if cutoff else {}


async def main():
    records = await rattler.solve(channels, specs, platforms=["linux-64", "noarch"],
                                  virtual_packages=rattler.VirtualPackage.detect(), **newer)
    print(f"image-builder: solved {len(records)} conda packages: " + " ".join(sorted(str(r) for r in records)))
    await rattler.install(records, target_prefix=prefix, cache_dir="/tmp/ib-rattler-cache",
                          execute_link_scripts=False, show_progress=False)

try:
    asyncio.run(main())
    status = 0
except Exception as e:  # the solver's own message names what cannot be had
    print(f"image-builder: conda environment: {type(e).__name__}: {e}", file=sys.stderr)
    status = 1
sys.stdout.flush()
sys.stderr.flush()
# Not through the interpreter's finalization: py-rattler's runtime threads can abort it (PyGILState_Release,
# exit 134, seen with the other core busy).
os._exit(status)
PYTHON
rm -rf "$SOLVER" /tmp/ib-rattler-cache
PY="$PREFIX/bin/python"
pip() { "$PY" -m pip --no-input --disable-pip-version-check --no-cache-dir "$@"; }
# An environment.yml lists pip; where it does not, the interpreter's own.
"$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip >/dev/null
if [ -n "${PIP_VERSION:-}" ]; then
    today pip install -q "$PIP_VERSION"
fi
if [ -s /build/pip-requirements.txt ]; then
    pip install -r /build/pip-requirements.txt
fi
if [ -n "${PYTHON_PACKAGES:-}" ]; then
    # shellcheck disable=SC2086  # one argument per requirement
    pip install $PYTHON_PACKAGES
fi
"$PY" -m compileall -q -j 0 "$PREFIX/lib" >/dev/null 2>&1 || true
