# Entry points: `make demo` (the main job on the embedded data), `make test` (the
# test suite, what .ci/run calls) and `make test-fast` (units, reference loops and the
# static job checks: no simulator, deployment or claim runs); `make test-poc-jobs` runs every shipped
# job in nvflare's POC mode (about 10 minutes, before a release); `make dist` builds the release's sdist and
# wheel (docs/release.md). All create .venv on first use.
# `make docs` builds the documentation site (mkdocs.yml) with --strict, so a broken link,
# a missing page or an API reference that no longer imports fails; .ci/run calls it too.
# The test targets print the 15 slowest tests and write JUnit XML reports of every test's
# time into $(REPORTS).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Exact tested pins; torch==2.13.0 resolves to the local CPU build here.
# GPU users: see README "Choosing a torch build".
CONSTRAINTS ?= constraints.txt
REPORTS ?= test-reports
FAST    := not simulator and not deploy and not claims and not poc_jobs and not release

.PHONY: venv demo test test-fast test-poc-jobs docs jobs dist clean

$(BIN)/fedlabels: setup.cfg $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) torch
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $@

venv: $(BIN)/fedlabels

# The docs extra (mkdocs, mkdocs-material, mkdocstrings) on top of the package, same pins.
$(BIN)/mkdocs: $(BIN)/fedlabels
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e ".[test,docs]"
	touch $@

demo: venv
	$(BIN)/fedlabels demo --out demo

# The deployment lane (a provisioned federation on loopback, POC mode) waits on nvflare's heartbeats and
# job polling far more than it computes (about a third of one core), so it runs in a second pytest
# process beside the rest of the suite; its output follows the suite's, and either failing fails the target.
# Both lanes write their temporary folders (simulator workspaces, kits, checkpoints: several GB) into one
# new folder, removed when both pass and kept, with its path printed, when one fails. TMPDIR points into it
# too, so what a killed process (a fault drill) leaves in its own temporary folder goes with the rest.
test: venv
	@mkdir -p $(REPORTS)
	@tmp=$$(mktemp -d -t fedlabels-tests.XXXXXX); mkdir $$tmp/tmp; export TMPDIR=$$tmp/tmp; \
	$(BIN)/python -m pytest -q -m "deploy and not poc_jobs" --basetemp=$$tmp/deploy --durations=15 \
	    --junitxml=$(REPORTS)/junit-deploy.xml tests > $(REPORTS)/deploy.log 2>&1 & deploy=$$!; \
	$(BIN)/python -m pytest -q -m "not deploy and not poc_jobs" --basetemp=$$tmp/suite --durations=15 \
	    --junitxml=$(REPORTS)/junit.xml tests; rest=$$?; \
	wait $$deploy; lane=$$?; echo "---- deployment lane (-m deploy) ----"; cat $(REPORTS)/deploy.log; \
	echo "tests wrote $$(du -sh $$tmp | cut -f1) of temporary files in $$tmp"; \
	if [ $$rest -eq 0 -a $$lane -eq 0 ]; then rm -rf $$tmp; else echo "kept $$tmp for inspection"; exit 1; fi

test-fast: venv
	$(BIN)/python -m pytest -q -m "$(FAST)" --durations=15 --junitxml=$(REPORTS)/junit-fast.xml tests

# Every shipped job in nvflare's POC mode with the production defaults (tests/test_poc_jobs.py): about
# 10 minutes on 2 cores, beside `make test` rather than in it; run before a release.
test-poc-jobs: venv
	$(BIN)/python -m pytest -q -m poc_jobs --durations=5 tests

docs: $(BIN)/mkdocs
	$(BIN)/python benchmarks/render_pages.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

jobs: venv
	$(BIN)/fedlabels jobs --out nvflare_jobs

# The release archives (docs/release.md): the sdist and the wheel, which carries bundles/ as package data
# (setup.py), built with the pinned setuptools of the environment, offline.
dist: venv
	rm -rf dist
	$(BIN)/python -m build --no-isolation --outdir dist .

clean:
	rm -rf demo site dist .pytest_cache $(REPORTS)
