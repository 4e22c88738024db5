# Entry points: `make demo` (the main job on the embedded data), `make test` (the
# test suite, what .ci/run calls) and `make test-fast` (tests/unit: units, reference loops and the
# static job checks; no simulator, deployment or claim runs); `make dist` builds the release's sdist and
# wheel (docs/release.md). All create .venv on first use.
# The test lanes are folders of tests/ (each folder's tests carry its marker, tests/conftest.py):
#   tests/unit       make test-fast, make test
#   tests/simulator  the real nvflare simulator (-m simulator): make test
#   tests/deploy     the loopback federation, POC mode, the release build (-m deploy): make test, but for
#                    its fault drills (-m drills: make test-drills) and every shipped job in POC mode
#                    (-m poc_jobs: make test-poc-jobs)
#   tests/claims     claims checked by training for minutes (-m claims): make test-claims
# make test-drills, make test-poc-jobs and make test-claims are outside CI: run them before a release.
# `make docs` builds the documentation site (mkdocs.yml) with --strict, so a broken link,
# a missing page or an API reference that no longer imports fails; .ci/run calls it too.
# The test targets print the slowest tests and write JUnit XML reports of every test's
# time into $(REPORTS).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Exact tested pins; torch==2.13.0 resolves to the local CPU build here.
# GPU users: see README "Choosing a torch build".
CONSTRAINTS ?= constraints.txt
REPORTS ?= test-reports

.PHONY: venv demo test test-fast test-claims test-drills test-poc-jobs docs jobs dist clean

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

# Two pytest processes share the cores. The deployment lane (tests/deploy: a provisioned federation on loopback,
# POC mode, the release build) waits on nvflare's heartbeats and job polling far more than it computes (about a
# third of one core), so it runs in a second process beside tests/unit and tests/simulator, and takes with it
# the simulator files of SECOND_PROCESS: tests that start their own simulator or CLI processes and share no
# session run with the rest (no SHARED_RUNS, tests/shared_runs.py), chosen by their measured times so that both
# processes end at about the same time. That is load balancing only: those tests keep their folder and marker
# (the simulator lane), and the first process ignores exactly the files the second one runs, so every test
# runs once. The second process's output follows the first's, and either failing fails the target. Both
# write their temporary folders (simulator workspaces, kits, checkpoints: several GB) into one new folder,
# removed when both pass and kept, with its path printed, when one fails. TMPDIR points into it too, so what
# a killed process leaves in its own temporary folder goes with the rest.
SECOND_PROCESS := tests/simulator/test_readme_flare.py
test: venv
	@mkdir -p $(REPORTS)
	@tmp=$$(mktemp -d -t fedlabels-tests.XXXXXX); mkdir $$tmp/tmp; export TMPDIR=$$tmp/tmp; \
	$(BIN)/python -m pytest -q -m "not drills and not poc_jobs" --basetemp=$$tmp/deploy --durations=15 \
	    --junitxml=$(REPORTS)/junit-deploy.xml tests/deploy $(SECOND_PROCESS) > $(REPORTS)/deploy.log 2>&1 & \
	deploy=$$!; \
	$(BIN)/python -m pytest -q --basetemp=$$tmp/suite --durations=15 \
	    --junitxml=$(REPORTS)/junit.xml tests/unit tests/simulator $(SECOND_PROCESS:%=--ignore=%); rest=$$?; \
	wait $$deploy; lane=$$?; echo "---- second process (tests/deploy $(SECOND_PROCESS)) ----"; \
	cat $(REPORTS)/deploy.log; \
	echo "tests wrote $$(du -sh $$tmp | cut -f1) of temporary files in $$tmp"; \
	if [ $$rest -eq 0 -a $$lane -eq 0 ]; then rm -rf $$tmp; else echo "kept $$tmp for inspection"; exit 1; fi

test-fast: venv
	$(BIN)/python -m pytest -q --durations=15 --junitxml=$(REPORTS)/junit-fast.xml tests/unit

# The claims (tests/claims): each trains for minutes beside its calibration processes. Not in CI; run
# before a release.
test-claims: venv
	$(BIN)/python -m pytest -q --durations=15 --junitxml=$(REPORTS)/junit-claims.xml tests/claims

# The fault drills on the loopback federation (tests/deploy/test_drills.py): malformed data, hostile replies
# and a stalled hospital, a killed hospital, the server killed and resumed. Not in CI; run before a release.
test-drills: venv
	$(BIN)/python -m pytest -q -m drills --durations=15 --junitxml=$(REPORTS)/junit-drills.xml tests/deploy

# Every shipped job in nvflare's POC mode with the production defaults (tests/deploy/test_poc_jobs.py): about
# 10 minutes on 2 cores. Not in CI; run before a release.
test-poc-jobs: venv
	$(BIN)/python -m pytest -q -m poc_jobs --durations=5 tests/deploy

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
