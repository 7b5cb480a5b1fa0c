#!/bin/sh
# A SWE-bench instance: its repository at its base commit, installed, as SWE-bench's setup_repo.sh does.
# Runs in the instance's workdir (e.g. /testbed). Two ways:
# - the environment holds the repository (swebench-repo.sh): its history up to a merge-base of its
#   instances, checked out there. This adds /build/commits.bundle (the commits from there to BASE_COMMIT,
#   if any), checks BASE_COMMIT out, and installs again only when REINSTALL_WHEN files differ: the overlay
#   holds the files that changed, git's index and the new objects;
# - else the whole repository is cloned here from REPO_SOURCE.
#   BASE_COMMIT     the commit to check out (required)
#   REPO_SOURCE     what `git clone` takes: a bundle under /build, a URL, a path (without a repository layer)
#   INSTALL         install command run in the checkout (unset: pip install -e .; empty: none)
#   REINSTALL_WHEN  git pathspecs whose change makes the environment's install stale
#                   (default: setup.py setup.cfg pyproject.toml)
#   PRE_INSTALL     the environment's pre_install commands, run again if this commit changes files they edit
# After it, the build leaves the repository BASE_COMMIT and its ancestors only, as SWE-bench's images have it:
# no later commit, other branch, remote or reflog (image_builder/build/repo_history.py).
set -eu
# Editable installs put the checkout on sys.path (a .pth path entry), as the older setuptools of SWE-bench's
# conda environments do: pylint's tests find its modules by path, and an editable finder hook broke 8 of
# pylint-6506's tests. Not where the environment installs with `setup.py develop` (LEGACY_DEVELOP: swebench
# catalog's PIP_FOR_LEGACY_DEVELOP), as SWE-bench's pips did: config settings force pip's isolated build.
[ -n "${LEGACY_DEVELOP:-}" ] || export PIP_CONFIG_SETTINGS="editable_mode=compat"
export PIP_NO_CACHE_DIR=1  # a cache would be packed into the overlay
: "${BASE_COMMIT:?set BASE_COMMIT to the commit to check out}"
INSTALL="${INSTALL-python -m pip install --no-input --no-cache-dir -e .}"  # set but empty: no install
if [ -n "${REPO_SOURCE:-}" ]; then
    git clone -q --no-checkout "$REPO_SOURCE" .
    git -c advice.detachedHead=false checkout -q "$BASE_COMMIT"
    if [ -n "$INSTALL" ]; then sh -c "$INSTALL"; fi
    # Graders commit and reset in this checkout; git wants an identity for that.
    git config user.email image-builder@localhost
    git config user.name image-builder
    exit 0
fi
if [ ! -d .git ]; then
    echo "no repository in $(pwd): set REPO_SOURCE, or build on an environment that holds one" >&2
    exit 1
fi
if [ -f /build/commits.bundle ]; then
    git fetch -q --no-write-fetch-head /build/commits.bundle \
        "+refs/heads/image-builder:refs/heads/image-builder" "+refs/tags/*:refs/tags/*"
fi
set -f  # the pathspecs are git's globs, not the shell's
stale=0
git diff --quiet HEAD "$BASE_COMMIT" -- ${REINSTALL_WHEN:-setup.py setup.cfg pyproject.toml} || stale=1
set +f
[ -f .git/image-builder-installed ] || stale=1  # the environment did not install (see swebench-repo.sh)
# PRE_INSTALL's edits to tracked files carry over to this commit where it leaves those files as they were;
# where it changes them, check out clean and run PRE_INSTALL again, as SWE-bench runs it after its checkout.
if ! git -c advice.detachedHead=false checkout -q --detach "$BASE_COMMIT" 2>/dev/null; then
    git -c advice.detachedHead=false checkout -q -f --detach "$BASE_COMMIT"
    # pre_install's wget finds the files the environment carries (swebench-repo.sh)
    if [ -n "${PRE_INSTALL:-}" ]; then PATH="/opt/image-builder/bin:$PATH" sh -ec "$PRE_INSTALL"; fi
    stale=1
fi
git update-ref -d refs/heads/image-builder 2>/dev/null || true
rm -f .git/image-builder-installed
if [ "$stale" = 1 ] && [ -n "$INSTALL" ]; then sh -c "$INSTALL"; fi
