# One entry point for people and CI. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CI and development pin the CPU build of torch; set CONSTRAINTS= to skip the pins (CUDA users).
CONSTRAINTS ?= -c constraints.txt

.PHONY: setup demo test lint typecheck pytest proto clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install $(CONSTRAINTS) -e ".[dev]"
	touch $@

demo: setup
	$(BIN)/kvrelay demo

lint: setup
	$(BIN)/ruff check .

typecheck: setup
	$(BIN)/mypy services/kvpolicy

pytest: setup
	$(BIN)/pytest

test: lint typecheck pytest

proto: setup
	$(BIN)/kvrelay codegen

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
