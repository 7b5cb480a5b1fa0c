#!/bin/sh
# Check out a SWE-bench instance's repository at its base commit and install it,
# as SWE-bench's setup_repo.sh does. Runs in the instance's workdir (e.g. /testbed).
#   REPO_SOURCE   what `git clone` takes: a bundle under /build, a URL, a path (required)
#   BASE_COMMIT   the commit to check out (required)
#   INSTALL       install command run in the checkout (default: pip install -e .)
set -eu
: "${REPO_SOURCE:?set REPO_SOURCE to the repository (bundle, URL or path)}"
: "${BASE_COMMIT:?set BASE_COMMIT to the commit to check out}"
git clone -q --no-checkout "$REPO_SOURCE" .
git -c advice.detachedHead=false checkout -q "$BASE_COMMIT"
git remote remove origin
sh -c "${INSTALL:-python -m pip install --no-input --no-cache-dir -e .}"
# Graders commit and reset in this checkout; git wants an identity for that.
git config user.email image-builder@localhost
git config user.name image-builder
