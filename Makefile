# Two entry points for a fresh machine: `make train` and `make test`.
# Each creates .venv and installs the package on first use.
#
# TORCH selects the PyTorch build to install. The default is the CPU build that
# this project's CI uses; GPU users pick theirs, e.g. `make train TORCH=torch`
# (latest CUDA build from PyPI) or `make train TORCH="torch==2.6.0"`.
TORCH ?= torch==2.13.0
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install train test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# `make train` re-runs the main job from scratch each time (replacing runs/default; the cold
# start is cached). Extra overrides: make train ARGS="objective.name=grpo seed=1".
train: $(STAMP)
	$(BIN)/gspo train configs/default.yaml run.overwrite=true $(ARGS)

# The layer contracts of pyproject.toml ([tool.importlinter]) first, then the tests.
test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/logprob_memory.py

clean:
	rm -rf $(VENV) runs .pytest_cache
