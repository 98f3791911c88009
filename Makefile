# ckpteval — every target does its own set-up (a fresh clone needs nothing but python3.11, make, root for apt).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1
ARGS ?=

.PHONY: setup test lint demo bench chaos slurm-up slurm-down clean

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

# The whole suite, set-up included. The SLURM tests start a throw-away cluster (tests/slurm/cluster.sh).
test: setup
	$(BIN)/python -m pytest -q --durations=25 tests

lint: setup
	$(BIN)/ruff check coord jobs tests bench

# The embedded default: reference trainer + an eval fleet of 2 workers on CPU. make demo ARGS="--help"
demo: setup
	$(BIN)/ckpteval demo $(ARGS)

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
	rm -rf $(VENV) runs
