#!/bin/sh
# The repository layers of a SWE-bench environment (swebench catalog): first the history a repository's
# versions share, then per version the commits up to a merge-base of its instances, checked out in the
# workdir and installed, as SWE-bench's setup_repo.sh does per instance; then the version's checkpoints
# (build/checkpoints.py), each over the version's checkout or an earlier checkpoint: the commits up to one
# instance's base commit, checked out as an instance checks out, installed again only where the install
# files changed; and install layers, checkpoints at the merge-base of instances that would each install
# alike. Each instance then checks out its own base commit over them (swebench-instance.sh).
#   REPO_BUNDLE   a bundle of refs/heads/image-builder and the tags on its history; without the file there
#                 is nothing to add (optional)
#   BASE_COMMIT   the commit to check out (optional: a history layer has no checkout)
#   REINSTALL_WHEN  a checkpoint's: git pathspecs whose change makes the install below it stale
#   WORKDIR       where the repository goes (default: /testbed)
#   PRE_INSTALL   shell commands run in the checkout before installing (optional)
#   EVAL_SETUP    shell commands SWE-bench runs before each test run that set up the system, not the
#                 checkout (django 3.x's locale-gen): run once here (optional)
#   INSTALL       install command run in the checkout (optional); .git/image-builder-installed records
#                 the commit it installed, for the instances; a pip install with build isolation also
#                 leaves its build requirements as wheels in /opt/image-builder/build-wheels (for the
#                 grader's offline install: keep_build_wheels)
#   INSTALL_AS_INSTANCES  1: every instance on this layer has this commit's install files, so an install that
#                 changes the environment's packages is done here rather than left to each instance
#                 (optional; a version's, or an install layer's: swebench_catalog._install_layers)
# /build/downloads (optional): files the build would download from hosts a cluster does not reach, and their
# UNPACK list (build/downloads.py): kept in /opt/image-builder/downloads, where pre_install's wget finds them,
# and unpacked in the checkout where the build looks first.
set -eu
# Editable installs put the checkout on sys.path (a .pth path entry), as the older setuptools of SWE-bench's
# conda environments do: pylint's tests find its modules by path, and an editable finder hook broke 8 of
# pylint-6506's tests. Not where the environment installs with `setup.py develop` (LEGACY_DEVELOP: swebench
# catalog's PIP_FOR_LEGACY_DEVELOP), as SWE-bench's pips did: config settings force pip's isolated build.
[ -n "${LEGACY_DEVELOP:-}" ] || export PIP_CONFIG_SETTINGS="editable_mode=compat"
export PIP_NO_CACHE_DIR=1  # a cache would be packed into the layer
W="${WORKDIR:-/testbed}"
mkdir -p "$W"
cd "$W"
if [ ! -d .git ]; then
    git -c init.defaultBranch=main init -q
    # Layers above check out and fetch over this one: no automatic gc or maintenance may repack (each
    # layer would hold a copy of every pack), and stat data differs between mounts (content decides).
    git config gc.auto 0
    git config maintenance.auto false
    git config core.checkStat minimal
    git config core.trustctime false
    # Graders commit and reset in this checkout; git wants an identity for that.
    git config user.email image-builder@localhost
    git config user.name image-builder
fi
if [ -n "${REPO_BUNDLE:-}" ] && [ -f "$REPO_BUNDLE" ]; then
    git fetch -q --no-write-fetch-head "$REPO_BUNDLE" "+refs/heads/image-builder:refs/heads/image-builder" \
        "+refs/tags/*:refs/tags/*"
    git update-ref -d refs/heads/image-builder
fi
# Install with the environment's packages held as they are: an install at this commit that would change them
# (an older commit asking for an older astroid than the spec's requirements pin) is left to each instance,
# at its own commit over the untouched environment, as SWE-bench installs. .git/image-builder-installed
# records what was installed, for the layers above.
# Held is only right where it is what the install would do anyway: pip under constraints that conflict with
# what the install asks for does not fail but backtracks to old releases of the new packages (pvlib's
# `.[all]` over numpy 1.25 took numba 0.53.1, which predates any numpy cap and fails at import, where
# SWE-bench's pip downgrades numpy under numba 0.57). So a plain `pip install` is first resolved without
# the constraints (--dry-run --report), and one that would change a held package is not held.
changes_held() {
    case "$INSTALL" in
        *"&"*|*";"*|*"|"*|*'$'*|*'`'*) return 1 ;;  # not one pip command: no dry run
        "pip install "*|"python -m pip install "*|"pip3 install "*|"python3 -m pip install "*) ;;
        *) return 1 ;;
    esac
    # Options on the command line (pip before 22.2 refuses them), not PIP_* variables: pip's own child that
    # installs the build requirements into an isolated build environment inherits variables, and a dry run
    # there leaves no setuptools ("Cannot import 'setuptools.build_meta'": every project with a build step).
    sh -ec "$INSTALL --dry-run --quiet --report /tmp/report.json" >/dev/null 2>&1 || return 1
    python - /tmp/held.txt /tmp/report.json <<'PY'
import json, re, sys
key = lambda name: re.sub(r"[-_.]+", "-", name).lower()
held = dict(line.strip().split("==", 1) for line in open(sys.argv[1]) if "==" in line)
held = {key(name): version for name, version in held.items()}
changed = [f"{m['name']} {held[key(m['name'])]} -> {m['version']}"
           for m in (item["metadata"] for item in json.load(open(sys.argv[2])).get("install", []))
           if key(m["name"]) in held and held[key(m["name"])] != m["version"]]
if changed:
    print("image-builder: the install would change " + ", ".join(changed), file=sys.stderr)
sys.exit(0 if changed else 1)
PY
}
install_held() {
    python -m pip freeze --exclude-editable > /tmp/held.txt
    if ! changes_held && PIP_CONSTRAINT=/tmp/held.txt sh -ec "$INSTALL"; then
        git rev-parse HEAD > .git/image-builder-installed
    elif [ "${INSTALL_AS_INSTANCES:-}" = 1 ]; then
        # Every instance has this commit's install files (the catalog checked): an install that changes the
        # packages is what each of them would do, done here once.
        echo "image-builder: installing at $BASE_COMMIT changes the environment's packages, as each instance" \
            "(all have these install files) would: installing here" >&2
        sh -ec "$INSTALL"
        git rev-parse HEAD > .git/image-builder-installed
    else
        echo "image-builder: installing at $BASE_COMMIT would change the environment's packages; each instance installs at its own commit" >&2
    fi
    rm -f /tmp/held.txt /tmp/report.json
    keep_build_wheels
}
# The grader runs the install again where a candidate patch makes it stale (graders/swebench.py), offline:
# pip's isolated build would download the build requirements there. They are kept here, as wheels with
# their dependencies, as of the environment's cut-off, where the grader's pip looks (PIP_FIND_LINKS).
# Not for `--no-build-isolation` (the environment has them); a download that fails leaves the grader's
# install to fail offline as before, and is said.
BUILD_WHEELS=/opt/image-builder/build-wheels
keep_build_wheels() {
    case "$INSTALL" in *--no-build-isolation*) return 0 ;; *pip*install*) ;; *) return 0 ;; esac
    python - > /tmp/build-requires.txt <<'PY' || return 0
import os
try:
    import tomllib
except ImportError:
    try:
        from pip._vendor import tomli as tomllib
    except ImportError:
        tomllib = None
requires = ["setuptools>=40.8.0", "wheel"]  # pip's for a project without [build-system]
system = {}
if os.path.exists("pyproject.toml") and tomllib is not None:
    with open("pyproject.toml", "rb") as f:
        system = tomllib.load(f).get("build-system", {})
        requires = system.get("requires", requires)
if system.get("build-backend", "setuptools.build_meta:__legacy__").startswith("setuptools.build_meta"):
    # What setup.py asks of the backend beyond that, as pip's isolated build asks it (its setup_requires:
    # matplotlib's certifi, numpy and setuptools_scm). Its prints go to stderr, not into the list.
    import contextlib, sys
    try:
        from setuptools import build_meta
        with contextlib.redirect_stdout(sys.stderr):
            requires = requires + [r for r in build_meta.get_requires_for_build_wheel() if r not in requires]
    except BaseException as e:
        print("image-builder: setup.py's own build requirements unknown (%s)" % e, file=sys.stderr)
print("\n".join(requires))
PY
    python -m pip download --quiet --dest "$BUILD_WHEELS" --only-binary=:all: -r /tmp/build-requires.txt >&2 \
        || python -m pip download --quiet --dest "$BUILD_WHEELS" -r /tmp/build-requires.txt >&2 \
        || echo "image-builder: the build requirements could not be kept as wheels: an offline grade cannot install again" >&2
    rm -f /tmp/build-requires.txt
}
DOWNLOADS=/opt/image-builder/downloads
carry_downloads() {
    [ -d /build/downloads ] || return 0
    mkdir -p "$DOWNLOADS" /opt/image-builder/bin
    cp /build/downloads/* "$DOWNLOADS/"
    # SWE-bench's base image has wget, and pre_install fetches with it: here it copies a file carried, and
    # anything else goes to a wget the image may have.
    cat > /opt/image-builder/bin/wget <<'SH'
#!/bin/sh
out= url= prev=
for a in "$@"; do
    case "$prev" in -O|--output-document) out="$a"; prev=; continue ;; esac
    case "$a" in
        -O|--output-document) prev="$a" ;;
        -O?*) out="${a#-O}" ;;
        --output-document=*) out="${a#*=}" ;;
        -*) ;;
        *) url="$a" ;;
    esac
done
file="/opt/image-builder/downloads/${url##*/}"
if [ -n "$url" ] && [ -f "$file" ]; then
    if [ "$out" = - ]; then exec cat "$file"; fi
    exec cp "$file" "${out:-${url##*/}}"
fi
PATH=$(printf %s "$PATH" | sed 's#/opt/image-builder/bin:##g')
if command -v wget >/dev/null 2>&1; then exec wget "$@"; fi
echo "image-builder: wget $url: not a file this environment carries ($(dirname "$file")), and the image has no wget" >&2
exit 1
SH
    chmod 755 /opt/image-builder/bin/wget
}
unpack_downloads() {
    [ -f "$DOWNLOADS/UNPACK" ] || return 0
    while read -r file into tree; do
        [ -e "$into/$tree" ] && continue
        mkdir -p "$into"
        # Python's tarfile, not tar: minbase images have no bzip2 for tar to call. Verified files (sha256).
        python -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$DOWNLOADS/$file" "$into"
    done < "$DOWNLOADS/UNPACK"
}
pre_install() {
    PATH="/opt/image-builder/bin:$PATH" sh -ec "$PRE_INSTALL"
}
if [ -n "${BASE_COMMIT:-}" ] && git rev-parse -q --verify HEAD >/dev/null; then
    # A checkpoint, over a checkout: PRE_INSTALL's edits carry over where this commit leaves their files as
    # they were (else a clean checkout and PRE_INSTALL again, as swebench-instance.sh does); the version's
    # layer ran EVAL_SETUP.
    set -f  # the pathspecs are git's globs, not the shell's
    stale=0
    git diff --quiet HEAD "$BASE_COMMIT" -- ${REINSTALL_WHEN:-setup.py setup.cfg pyproject.toml} || stale=1
    set +f
    [ -f .git/image-builder-installed ] || stale=1
    if ! git -c advice.detachedHead=false checkout -q --detach "$BASE_COMMIT" 2>/dev/null; then
        git -c advice.detachedHead=false checkout -q -f --detach "$BASE_COMMIT"
        if [ -n "${PRE_INSTALL:-}" ]; then pre_install; fi
        stale=1
    fi
    if [ "$stale" = 1 ] && [ -n "${INSTALL:-}" ]; then
        rm -f .git/image-builder-installed
        unpack_downloads
        install_held
    fi
    exit 0
fi
if [ -n "${BASE_COMMIT:-}" ]; then
    git -c advice.detachedHead=false checkout -q --detach "$BASE_COMMIT"
fi
carry_downloads
unpack_downloads
if [ -n "${PRE_INSTALL:-}" ]; then pre_install; fi
if [ -n "${EVAL_SETUP:-}" ]; then sh -ec "$EVAL_SETUP"; fi
if [ -n "${INSTALL:-}" ]; then install_held; fi
