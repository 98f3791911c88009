# ckpteval — every target does its own set-up.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test lint demo bench chaos slurm-up clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch first: a local wheel here; a range later in pyproject keeps GPU clusters' own build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q -m "not chaos or chaos_quick" tests

lint: setup
	$(BIN)/ruff check coord jobs tests bench

clean:
	rm -rf $(VENV) runs
