# `make demo` and `make test` work on a fresh machine: each creates .venv and installs first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Flower's CLI would otherwise reinstall the app's dependencies with uv and phone home.
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1

.PHONY: help install demo docs test test-compose test-arm64 lint clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z0-9-]+:.*## / {printf "  make %-13s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# Two stamps: the demo needs EdgeFleet alone; tests and docs add their tools on top.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[test,docs]'
	touch $@

install: $(VENV)/.installed-test ## create .venv with EdgeFleet and the test and docs tools

demo: $(VENV)/.installed ## install EdgeFleet alone and run the default scenario with its story and plots
	$(BIN)/edgefleet run scenarios/default.toml --report

docs: $(VENV)/.installed-test ## regenerate the generated pages and build the site into site/
	$(BIN)/python docs/gen.py
	$(BIN)/mkdocs build --strict

lint: install ## ruff and mypy
	$(BIN)/ruff format --check edgefleet fleetharness tests benchmarks
	$(BIN)/ruff check edgefleet fleetharness tests benchmarks
	$(BIN)/mypy edgefleet fleetharness

# --durations: the slowest tests in the log, for keeping CI's run within its budget.
# The site in strict mode (a broken link, a missing page or symbol fails; about 10 s; not
# --quiet, which hides the warnings that --strict counts), then pytest
# (tests/test_docs.py keeps the generated pages equal to a fresh generation).
test: lint ## lint, build the docs strictly, run the test suite
	$(BIN)/mkdocs build --strict
	$(BIN)/pytest -q --durations=25

# The docker compose fleet against a real engine (root, dockerd running; builds the images
# it lacks: 10-20 minutes the first time).
test-compose: install ## the docker compose fleet against a real engine (root)
	EDGEFLEET_COMPOSE_TEST=1 $(BIN)/pytest -q -s tests/test_compose.py

# Two emulated Raspberry Pis (a Pi 4's and a Pi 5's CPU under qemu-user) set up by
# deploy/EDGE.md's steps join a live SuperLink (root; the first build of the boards' root file
# system and venv took 105 minutes on a loaded 2-core machine, cached in
# $$EDGEFLEET_ARM64_CACHE after); with both cached it passes in about 3 minutes, the boards
# completing the two-round run (deploy/EDGE.md, "Status").
test-arm64: install ## two emulated Raspberry Pis join a live SuperLink (root)
	EDGEFLEET_ARM64_TEST=1 $(BIN)/pytest -q -s tests/test_arm64.py

clean: ## remove .venv, runs, reports, the site and caches
	rm -rf $(VENV) runs report site .pytest_cache .mypy_cache .ruff_cache
