"""Test lanes and the session's shared simulator runs.

The lanes are the folders of tests/, and each folder gives its tests its marker (registered in
setup.cfg; ``--strict-markers`` refuses any other), so a test cannot sit in a lane without it:

* tests/unit: no marker; units, reference loops and the static job checks (drift, filters,
  configuration): ``make test-fast``;
* tests/simulator, ``simulator``: runs the real NVIDIA FLARE simulator (or ``fedlabels bench --engine flare``);
* tests/deploy, ``deploy``: a provisioned federation on 127.0.0.1, nvflare's POC mode, the release build.
  Its own markers: ``drills`` (the fault drills, tests/deploy/test_drills.py, ``make test-drills``),
  ``poc_jobs`` (every shipped job in POC mode, tests/deploy/test_poc_jobs.py, ``make test-poc-jobs``) and
  ``release`` (the sdist and wheel built, the wheel installed and run outside the checkout,
  tests/deploy/test_release.py);
* tests/claims, ``claims``: a claim checked by training for minutes (``make test-claims``).

``make test`` (what .ci/run calls) runs tests/unit, tests/simulator and tests/deploy but for the drills
and ``poc_jobs``; the drills, the POC jobs and the claims run before a release. Support modules shared
by several lanes (shared_runs.py, helpers.py, clinical_inputs.py, ...) sit here, beside this file, and
are imported by name (pytest's default ``prepend`` import mode puts tests/ on ``sys.path``).

Simulator runs are shared across modules (``sim_run``, tests/shared_runs.py): the scenario
folders they read are session fixtures here, so a run asked for by two modules happens once.
A test that asks for ``sim_run`` must carry the ``simulator`` marker (checked at collection).
The runs the selected tests declare (a module's ``SHARED_RUNS``: test name -> its runs) start
in the background when the session starts, and so does a module's ``BACKGROUND`` computation
(the claims' calibration processes) when its tests are selected; the claims tests run last, when
it has had the whole session to finish.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedlabels.data.synthetic import generate
from shared_runs import SharedRuns


# The lane folders and the marker each gives its tests (``-m simulator`` and the like select them).
LANES = ("simulator", "deploy", "claims")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        lane = item.path.relative_to(here).parts[0] if item.path.is_relative_to(here) else None
        if lane in LANES:
            item.add_marker(lane)
    unmarked = [item.nodeid for item in items  # fixturenames: every fixture the test needs, directly or not
                if "sim_run" in getattr(item, "fixturenames", ()) and item.get_closest_marker("simulator") is None]
    if unmarked:
        raise pytest.UsageError("tests using a shared simulator run without the simulator marker: "
                                + ", ".join(unmarked))
    # The claims last: their calibration processes start with the session (``BACKGROUND``) and have
    # until then to finish beside the other tests.
    items[:] = [i for i in items if i.get_closest_marker("claims") is None] + \
               [i for i in items if i.get_closest_marker("claims") is not None]


@pytest.fixture(scope="session")
def sim_run(tmp_path_factory):
    """``sim_run(spec, data, threads=None, env=None)`` -> (server run folder, log), once per session."""
    runs = SharedRuns(tmp_path_factory)
    yield runs
    runs.close()


def pytest_configure(config):
    """The session's own training (bench cells, reference loops, exports) on one torch thread: the
    shared simulator runs, the claims' calibration processes and the deployment lane share the cores
    with it, and torch threads spinning against other processes ran these tests 10-20x slower. (A test
    that needs another count sets it and restores it; subprocesses are not affected.)"""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _prefetch_shared_runs(request):
    """Start, in test order, the shared runs the selected tests declare in their module's ``SHARED_RUNS``
    (test function name -> ``f(params)`` -> [(data fixture, key in it or None, job, sim_run options)])."""
    planned = []
    for item in request.session.items:
        plans = getattr(getattr(item, "module", None), "SHARED_RUNS", None) or {}
        plan = plans.get(getattr(item, "originalname", None))
        if plan is not None:
            planned += plan(item.callspec.params if hasattr(item, "callspec") else {})
    # a module's long computation that can run beside the others (``BACKGROUND = (start, stop)``;
    # tests/claims/test_claims.py): started now, read by its tests, stopped at the end if still running
    background = {id(m): m.BACKGROUND for m in (getattr(i, "module", None) for i in request.session.items)
                  if hasattr(m, "BACKGROUND")}
    tmp_path_factory = request.getfixturevalue("tmp_path_factory")
    for start, _ in background.values():
        start(tmp_path_factory)
    if planned:
        runs = request.getfixturevalue("sim_run")
        for data_fixture, part, spec, options in planned:
            data = request.getfixturevalue(data_fixture)
            runs.prefetch(spec, data if part is None else data[part], **options)
    yield
    for _, stop in background.values():
        stop()


@pytest.fixture(scope="session")
def cxr_data(tmp_path_factory):
    """The embedded cxr scenario, small: 4 sites of 16/10/... cases (FedPSL's Table I label sets), 12 test cases."""
    return generate("cxr", tmp_path_factory.mktemp("cxr") / "cxr", seed=0, cases=16, test_cases=12)


@pytest.fixture(scope="session")
def medmnist_data(tmp_path_factory):
    """Two sites: site-1 labeled, site-2 unlabeled (the embedded medmnist default), 48 + 16 test cases."""
    return generate("medmnist", tmp_path_factory.mktemp("mm") / "mm", seed=0, sites=2, cases=48, test_cases=16)


@pytest.fixture(scope="session")
def mixed_data(tmp_path_factory):
    """The embedded mixed scenario, small: site-1 annotates every class, site-2 and site-3 a half each,
    site-4 none; 48 cases in all (Dirichlet 0.8 over the 4 sites), 12 test cases, 28 px."""
    return generate("mixed", tmp_path_factory.mktemp("mixed") / "mixed", seed=0, cases=48, test_cases=12)


@pytest.fixture(scope="session")
def lesion_data(tmp_path_factory):
    """Two 32 px lesion scenarios of 2 sites: a pixel site beside a box site, or beside an image-level site."""
    root = tmp_path_factory.mktemp("lesion")
    common = dict(seed=0, sites=2, size=32, cases=12, test_cases=8)
    return {"bbox": generate("lesion", root / "pb", supervision=["pixel", "bbox"], **common),
            "image": generate("lesion", root / "pi", supervision=["pixel", "image"], **common)}
