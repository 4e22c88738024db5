"""Simulator runs shared by every test module of a session (the ``sim_run`` fixture, tests/conftest.py).

A run of the real ``nvflare simulator`` costs 20-40 s, almost all of it process
start-up, so each distinct run happens once per session and carries every check
that can read it. A run is identified by its whole job (the ``JobSpec`` after the
changes), its scenario folder, its worker processes and its environment: two
tests asking for the same four get the same folders back, anything else is a new
run.

Runs a test expects to fail, or that change the shared folders, are not cached
(``simulate_job``, into the test's own ``tmp_path``).

Every run pins one torch thread per site (``OMP_NUM_THREADS=1``) unless the test
asks otherwise: exact comparisons with the in-process engine pin one thread on
their side too, and a site's sums must not change order with the machine's cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import contextmanager
from pathlib import Path

from fedlabels.flare.commands import simulate
from fedlabels.flare.job import JOBS, export

# 2 sites x 2 rounds, batches of 8: what every simulator test trains unless it says otherwise
TINY = {"rounds": 2, "sites": 2, "batch_size": 8}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# the privacy option of the fedpsl_cxr smoke run (tests/test_privacy.py)
PRIVACY = {"noise_multiplier": 1.0, "clip": 4.0, "delta": 1e-5}
# What the 2-round smoke runs of tests/test_flare.py change beyond TINY. FedMLP warms up for one round so
# that stage 2 (prototypes, tagging) runs too, with fixed selection ratios large enough to tag some of the
# 16 cases. FedProx carries the one-configuration check (a float that JSON could turn into a string, a
# network override); FedPSL the privacy option (tests/test_privacy.py reads the same run).
SMOKE_CHANGES = {
    "fedmlp_cxr": {"server": {"warmup_rounds": 1, "tau0": 0.3, "tau1": 0.3, "adaptive_threshold": False}},
    "fedprox_cxr": {"client": {**JOBS["fedprox_cxr"].client, "lr": 5e-05}, "network": {"hidden": 16}},
    "fedpsl_cxr": {"privacy": dict(PRIVACY)},
}


def job(spec, **changes):
    """The job ``spec`` (a ``JobSpec`` or a job's name) with ``TINY`` and ``changes`` applied."""
    spec = JOBS[spec] if isinstance(spec, str) else spec
    return dataclasses.replace(spec, **{**TINY, **changes})


def smoke(name):
    """A job's smoke run on the session's cxr scenario, as tests/test_flare.py (and tests/test_privacy.py,
    tests/test_dicom_outputs.py through test_flare's ``job_runs``) asks for it."""
    return job(name, **SMOKE_CHANGES.get(name, {}))


@contextmanager
def environment(env: dict):
    """``os.environ`` with ``env`` applied (a value of None removes the variable), then restored."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def simulate_job(spec, data, where: Path, tag: str = "", threads=None, env=None, timeout=300) -> tuple:
    """One simulator run of ``spec`` (already changed, see ``job``) on ``data`` under ``where``;
    (server run folder, log). ``threads``: worker processes, default one per site. ``env``: changes to
    the environment (default ``ONE_THREAD``)."""
    where = Path(where)
    job_dir = export(spec, where / f"jobs{tag}")
    log = where / f"{spec.name}{tag}.log"
    with environment(ONE_THREAD if env is None else env):
        run_dir = simulate(job_dir, where / f"ws{tag}", spec.sites, data=data, threads=threads or spec.sites,
                           log=log, timeout=timeout)
    return run_dir, log


def key(spec, data, threads, env) -> str:
    """What makes a run: the whole job, the scenario folder, the worker processes, the environment changes."""
    return json.dumps([dataclasses.asdict(spec), str(Path(data).resolve()), threads or spec.sites,
                       sorted((ONE_THREAD if env is None else env).items())], sort_keys=True, default=str)


class SharedRuns:
    """``sim_run(spec, data, threads=None, env=None)`` -> (server run folder, log): each distinct
    run once per session, in its own temporary folder. ``spec``: a changed job (see ``job``)."""

    def __init__(self, tmp_path_factory):
        self.factory, self.cache = tmp_path_factory, {}

    def __call__(self, spec, data, threads=None, env=None) -> tuple:
        k = key(spec, data, threads, env)
        if k not in self.cache:
            where = self.factory.mktemp(f"sim-{spec.name}")
            try:
                self.cache[k] = simulate_job(spec, data, where, threads=threads, env=env)
            except Exception as e:  # the next test asking for this run fails at once, without running it again
                self.cache[k] = e
                raise
        if isinstance(self.cache[k], Exception):
            raise RuntimeError(f"this session's shared run of {spec.name} failed: {self.cache[k]}")
        return self.cache[k]

    @property
    def runs(self) -> int:
        return len(self.cache)
