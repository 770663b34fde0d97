# Two commands matter: `make run` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TEST_WORKERS ?= 3

.PHONY: run test check format bench docs docs-serve install clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)  ## start the gateway on the default config (simulated models, no keys)
	$(BIN)/tailguard serve $(ARGS)

test: $(STAMP)  ## the whole suite, in parallel workers (most tests wait on sockets, not the CPU)
	$(BIN)/pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

check: $(STAMP)  ## format, lint, types, and the docs (generated pages current, strict build)
	$(BIN)/ruff format --check gateway tests bench
	$(BIN)/ruff check gateway tests bench
	$(BIN)/mypy
	$(BIN)/python -m gateway.cli.reference --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

format: $(STAMP)
	$(BIN)/ruff format gateway tests bench
	$(BIN)/ruff check --fix gateway tests bench

bench: $(STAMP)  ## gateway overhead against direct-to-upstream
	$(BIN)/python bench/overhead.py $(ARGS)

docs: $(STAMP)  ## regenerate docs/reference/, then build the site into site/
	$(BIN)/python -m gateway.cli.reference
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)  ## the docs on http://127.0.0.1:8000, rebuilt on every change
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) build site *.egg-info .mypy_cache .ruff_cache .pytest_cache
