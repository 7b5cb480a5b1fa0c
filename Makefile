# The two commands a newcomer runs: `make demo` and `make test`. Both set up
# everything they need on a fresh Debian machine (as root): apt packages, a venv.

# Debian's interpreter, so the venv also works for the unprivileged users the tests run as.
PYTHON ?= /usr/bin/python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# Runtime tools, then the ones only the tests and benchmarks use.
APT_RUNTIME = python3-venv squashfs-tools squashfuse fuse-overlayfs fuse3 proot util-linux git ca-certificates e2fsprogs
# To build image_builder/runtime/native: squashfuse_cached, and image-builder-init (static with musl:
# glibc's start-up probes the CPU with cpuid, a VM exit each; 0.1 ms per init against 0.5).
APT_BUILD   = gcc libc6-dev pkg-config libfuse3-dev libsquashfuse-dev musl-tools
APT_TEST    = docker-registry siftool skopeo umoci debootstrap openssl munge slurmctld slurmd slurm-client
# One binary per package, to tell whether the packages are already there.
APT_PROBES  = mksquashfs mkfs.ext4 musl-gcc squashfuse_ll fuse-overlayfs proot unshare git docker-registry siftool skopeo debootstrap openssl \
              umoci munged slurmctld slurmd sbatch

.PHONY: all setup host venv native test test-shared demo bench clean

all: test

host:
	@missing=""; for t in $(APT_PROBES); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	$(PYTHON) -c 'import ensurepip' 2>/dev/null || missing="$$missing python3-venv"; \
	pkg-config --exists squashfuse_ll fuse3 2>/dev/null || missing="$$missing libsquashfuse-dev"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages (missing:$$missing)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(APT_RUNTIME) $(APT_BUILD) $(APT_TEST) >/dev/null; \
	fi

# What the venv holds: the project with its test extra and the agent harnesses the tests run; then, without
# their dependencies, the swebench extra without its harness's (docker, datasets, modal: only its specs are
# read) and inspect_evals' SWE-bench task for the tests (0.26.0 is the newest installable: 0.28.0 needs
# inspect-evals-utils, not on PyPI; its swe_bench module needs only these beyond what is here).
# The checkout is installed editable as a plain path (.pth), not through setuptools' import finder, whose
# imports (pathlib, urllib.parse) cost every Python process here about 20 ms at start: the CLI's, the tests'.
VENV_PACKAGES = -e '.[test]' 'inspect-ai==0.3.285' 'mini-swe-agent==2.4.6'
VENV_NO_DEPS  = 'swebench==4.1.0' 'inspect-evals==0.26.0' 'backoff==2.2.1' 'unidiff==0.7.5'
venv_install  = $(1) $(2)editable_mode=compat $(VENV_PACKAGES) && $(1) --no-deps $(VENV_NO_DEPS)

# Installed by uv: 32 s here where pip takes 109 (both compiling bytecode; a third of a CI run's demo);
# by pip where uv fails (a site whose package mirror is set in pip.conf, which uv does not read).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	{ $(PY) -m pip install -q 'uv==0.13.9' \
	  && $(call venv_install,$(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode,--config-setting=); } \
	  || { $(call venv_install,$(PY) -m pip install -q,--config-settings=); }
	touch $@

venv: $(VENV)/.installed

# squashfuse_ll with the kernel's FUSE caches on; the runtime finds it beside the venv's python.
$(VENV)/bin/squashfuse_cached: image_builder/runtime/native/squashfuse_cached.c $(VENV)/.installed
	cc -O2 -Wall -Werror -o $@.tmp $< $$(pkg-config --cflags --libs squashfuse_ll fuse3)
	mv $@.tmp $@

# Every run's pid 1 (kernel and userns backends); the runtime finds it the same way.
$(VENV)/bin/image-builder-init: image_builder/runtime/native/init.c image_builder/runtime/native/hosts.h $(VENV)/.installed
	musl-gcc -static -O2 -Wall -Wextra -Werror -o $@.tmp $<
	mv $@.tmp $@

# What a warm interpreter's jobs enter their roots with (runtime/zygote.py): freestanding, no libc, so it
# loads into any image's interpreter.
$(VENV)/bin/image-builder-zygote.so: image_builder/runtime/native/zygote_root.c image_builder/runtime/native/hosts.h \
                                     $(VENV)/.installed
	gcc -O2 -shared -fPIC -nostdlib -ffreestanding -fno-stack-protector -fno-builtin -Wall -Wextra -Werror \
	    -Wl,-z,defs -o $@.tmp $<
	mv $@.tmp $@

native: $(VENV)/bin/squashfuse_cached $(VENV)/bin/image-builder-init $(VENV)/bin/image-builder-zygote.so

setup: host venv native

# Everything a clone holds on its own; the tests that read the larger shared sample data
# (../shared/data, or $$IMAGE_BUILDER_SHARED_DATA) are `make test-shared`, which .ci/run also runs.
# Two workers: both cores (JOBS=0 runs in one process).
JOBS ?= 2
test: setup
	$(PY) -m pytest tests -m "not shared_data" -n $(JOBS) --dist loadgroup $(PYTEST_ARGS)

SHARED_DATA = $(or $(IMAGE_BUILDER_SHARED_DATA),../shared/data)
test-shared: setup
	@[ -d "$(SHARED_DATA)" ] || { echo "make test-shared: the shared sample data is expected in $(SHARED_DATA) (set IMAGE_BUILDER_SHARED_DATA to its data/ folder)"; exit 2; }
	IMAGE_BUILDER_SHARED_DATA=$(abspath $(SHARED_DATA)) $(PY) -m pytest tests -m shared_data -n $(JOBS) --dist loadgroup $(PYTEST_ARGS)

demo: setup
	$(PY) -m image_builder.devtools.demo

# `make bench` runs every area; `make bench AREAS="store imports"` some, keeping the others' figures.
bench: setup
	$(PY) -m bench.run $(AREAS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
