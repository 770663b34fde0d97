# Two commands matter: `make run` and `make test`. Both set up .venv on first use.
#
# Each target installs only what it needs, once: `make run` the base dependencies (serving),
# `make tour` adds the OpenAI SDK, `make test` the test toolchain, `make check` the linters and
# the docs builder. A stamp in .venv marks each set as installed (again when pyproject.toml
# changes), so `make run` after `make test` installs nothing. NO_INSTALL=1 uses the environment
# in VENV as it is (`make stats VENV=~/venvs/tg NO_INSTALL=1`).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --quiet --disable-pip-version-check
TEST_WORKERS ?= 3
GATEWAY ?= http://127.0.0.1:8080

MODEL  ?= chat-large
PROBE_ARGS ?= --requests 5 --concurrency 5

ifdef NO_INSTALL
BASE :=
TOUR :=
TEST :=
DEV  :=
else
BASE := $(VENV)/.base
TOUR := $(VENV)/.tour
TEST := $(VENV)/.test
DEV  := $(VENV)/.dev
endif

.PHONY: run tour stats report probe test test-fast check format bench docs docs-serve install clean

$(VENV)/.base: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -e .
	@touch $@

$(VENV)/.tour: $(VENV)/.base
	$(PIP) install -e '.[tour]'
	@touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -e '.[test]'
	@touch $@

$(VENV)/.dev: $(VENV)/.test
	$(PIP) install -e '.[dev]'
	@touch $@

install: $(BASE)

run: $(BASE)  ## start the gateway on the default config (simulated models, no keys)
	$(BIN)/tailguard serve $(ARGS)

tour: $(TOUR)  ## the README's tour: one streamed request through a running gateway
	$(BIN)/python tour.py $(GATEWAY)/v1

stats: $(BASE)  ## a running gateway's SLO attainment and latency percentiles
	$(BIN)/tailguard stats --url $(GATEWAY) $(ARGS)

report: $(BASE)  ## a running gateway's latency report (Markdown)
	$(BIN)/tailguard report --url $(GATEWAY) $(ARGS)

probe: $(BASE)  ## TTFT and total time of a model through a running gateway
	$(BIN)/tailguard probe $(GATEWAY)/v1 --model $(MODEL) $(PROBE_ARGS) $(ARGS)

test: $(TEST)  ## the whole suite, in parallel workers (most tests wait on sockets, not the CPU)
	$(BIN)/pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-fast: $(TEST)  ## the suite without the tests marked slow, for the edit-test loop (CI runs `make test`)
	$(BIN)/pytest -n $(TEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

check: $(DEV)  ## format, lint, types, and the docs (generated pages current, strict build)
	$(BIN)/ruff format --check gateway tests bench tour.py
	$(BIN)/ruff check gateway tests bench tour.py
	$(BIN)/mypy
	$(BIN)/python -m gateway.cli.reference --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

format: $(DEV)
	$(BIN)/ruff format gateway tests bench tour.py
	$(BIN)/ruff check --fix gateway tests bench tour.py

bench: $(TEST)  ## gateway overhead against direct-to-upstream
	$(BIN)/python bench/overhead.py $(ARGS)

docs: $(DEV)  ## regenerate docs/reference/, then build the site into site/
	$(BIN)/python -m gateway.cli.reference
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(DEV)  ## the docs on http://127.0.0.1:8000, rebuilt on every change
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) build site *.egg-info .mypy_cache .ruff_cache .pytest_cache
