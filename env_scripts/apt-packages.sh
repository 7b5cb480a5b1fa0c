#!/bin/sh
# Install Debian packages into the environment.
#   APT_PACKAGES  space-separated package names (required)
# Under a user namespace or proot the builder sets APT_CONFIG so apt does not
# try to drop privileges to its _apt user (only one uid is mapped there).
set -eu
: "${APT_PACKAGES:?set APT_PACKAGES to the packages to install}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086  # word splitting of the package list is intended
apt-get install -y -qq --no-install-recommends $APT_PACKAGES
apt-get clean
rm -rf /var/lib/apt/lists/*
