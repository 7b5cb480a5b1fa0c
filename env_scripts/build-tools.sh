#!/bin/sh
# A C/C++ compiler and the interpreter's headers, for environments that build extensions (swebench catalog
# adds this layer where a repository has C, C++, Cython or Fortran sources outside its tests and docs).
#   PYTHON   the interpreter whose headers the builds need (default: python3); python.org images ship
#            them, Debian's interpreter needs its -dev package
set -eu
PYTHON="${PYTHON:-python3}"
packages="build-essential"
if ! "$PYTHON" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    packages="$packages python$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-dev"
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086  # one argument per package
apt-get install -y -qq --no-install-recommends $packages
apt-get clean
rm -rf /var/lib/apt/lists/*
