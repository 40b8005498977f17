# `make demo` and `make test` work on a fresh machine: each creates .venv and installs first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Flower's CLI would otherwise reinstall the app's dependencies with uv and phone home.
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1

.PHONY: install demo test test-compose test-arm64 lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/edgefleet run scenarios/default.toml --report

lint: install
	$(BIN)/ruff format --check edgefleet tests benchmarks
	$(BIN)/ruff check edgefleet tests benchmarks
	$(BIN)/mypy edgefleet

# --durations: the slowest tests in the log, for keeping CI's run within its budget.
test: lint
	$(BIN)/pytest -q --durations=25

# The docker compose fleet against a real engine (root, dockerd running; builds the images
# it lacks: 10-20 minutes the first time).
test-compose: install
	EDGEFLEET_COMPOSE_TEST=1 $(BIN)/pytest -q -s tests/test_compose.py

# Two emulated Raspberry Pis (a Pi 4's and a Pi 5's CPU under qemu-user) set up by
# deploy/EDGE.md's steps join a live SuperLink (root; the first build of the boards' root file
# system and venv took 105 minutes on a loaded 2-core machine, cached in
# $$EDGEFLEET_ARM64_CACHE after); with both cached it passes in about 3 minutes, the boards
# completing the two-round run (deploy/EDGE.md, "Status").
test-arm64: install
	EDGEFLEET_ARM64_TEST=1 $(BIN)/pytest -q -s tests/test_arm64.py

clean:
	rm -rf $(VENV) runs report .pytest_cache .mypy_cache .ruff_cache
