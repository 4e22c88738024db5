# Two entry points: `make demo` (the main job on the embedded data) and
# `make test` (the test suite). Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Exact tested pins; torch==2.13.0 resolves to the local CPU build here.
# GPU users: see README "Choosing a torch build".
CONSTRAINTS ?= constraints.txt

.PHONY: venv demo test jobs clean

$(BIN)/fedlabels: setup.cfg $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) torch
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $@

venv: $(BIN)/fedlabels

demo: venv
	$(BIN)/fedlabels demo --out demo

test: venv
	$(BIN)/python -m pytest -q --durations=15 tests

jobs: venv
	$(BIN)/fedlabels jobs --out nvflare_jobs

clean:
	rm -rf demo .pytest_cache
