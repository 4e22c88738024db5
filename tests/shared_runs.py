"""Simulator runs shared by every test module of a session (the ``sim_run`` fixture, tests/conftest.py).

A run of the real ``nvflare simulator`` costs 20-40 s, almost all of it process
start-up, so each distinct run happens once per session and carries every check
that can read it. A run is identified by its whole job (the ``JobSpec`` after the
changes), its scenario folder, its worker processes and its environment: two
tests asking for the same four get the same folders back, anything else is a new
run.

Runs a test expects to fail, or that change the shared folders, are not cached
(``simulate_job``, into the test's own ``tmp_path``).

A simulator run waits on process start-up far more than it computes (one run keeps
about one of two cores busy), so the runs the session's selected tests will ask for
start in the background as the session starts, two at a time (``SharedRuns.prefetch``;
each simulator module declares its tests' runs in ``SHARED_RUNS``); a test asking for
a run that has not started yet runs it at once itself. The simulator's environment is
the one the session started with plus the run's changes, never a test's monkeypatched
``os.environ``.

Every run pins one torch thread per site (``OMP_NUM_THREADS=1``) unless the test
asks otherwise: exact comparisons with the in-process engine pin one thread on
their side too, and a site's sums must not change order with the machine's cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from fedlabels.flare.simulator import simulate
from fedlabels.flare.job import JOBS, export

# 2 sites x 2 rounds, batches of 8: what every simulator test trains unless it says otherwise
TINY = {"rounds": 2, "sites": 2, "batch_size": 8}
# A deployment's default (job.py --poc/--prod): every site is needed. The smoke runs of every shipped job
# train with it, so a step that reaches fewer sites than the federation has (IsoFed's, RSCFed's) or a site
# that abstains must still aggregate (fedlabels.engine counts min_sites against the sites a step can reach).
PRODUCTION = {"min_sites": TINY["sites"]}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# the privacy option of the fedpsl_cxr smoke run (tests/simulator/test_privacy_runs.py)
PRIVACY = {"noise_multiplier": 1.0, "clip": 4.0, "delta": 1e-5}

# Jobs without a simulator run of their own, and the jobs whose runs execute their code:
# fedpsl_tdma = FedPSL's TDMA server (fedpsl_cxr) with FedPSL's client without TADL (the plain
# training step every job runs, with FedPSL's loss); fedpsl_tadl = FedPSL's client (fedpsl_cxr)
# with the n_k-weighted FedAvg server (fedavg_cxr); mt_wfedavg = the mean-teacher client without
# pretraining (rscfed_medmnist) with the weighted FedAvg server (wfedavg_medmnist); fedavg_full_lesion
# = FedAvg on the lesion bundle (fedavg_lesion) on every site's masks (fedadaptagg_lesion, oracle).
COVERED_BY = {"fedpsl_tdma_cxr": ("fedpsl_cxr",), "fedpsl_tadl_cxr": ("fedpsl_cxr", "fedavg_cxr"),
              "mt_wfedavg_medmnist": ("rscfed_medmnist", "wfedavg_medmnist"),
              "fedavg_full_lesion": ("fedavg_lesion", "fedadaptagg_lesion")}
# the jobs with a smoke run of their own in tests/simulator/test_flare_runs.py (cxr) and their semi-supervised
# runs, by name: (client options, [(stage, sites)])
CXR = sorted(name for name, spec in JOBS.items() if spec.run.data.family == "cxr" and name not in COVERED_BY)
SEMI_SUPERVISED = {"isofed_medmnist": ({}, [("unlabeled", ["site-2"]), ("labeled", ["site-1"])]),
                   "rscfed_medmnist": ({"subset_size": 2, "subsets": 2}, [("subsets", ["site-1", "site-2"])]),
                   "wfedavg_medmnist": ({}, [("train", ["site-1", "site-2"])])}
# the jobs tests/simulator/test_fedmix_flare.py runs
FEDMIX_RUNS = ("fedmix_lesion", "fedst_lesion", "fedadaptagg_lesion")

# What the 2-round smoke runs of tests/simulator/test_flare_runs.py change beyond TINY. FedMLP warms up for one round so
# that stage 2 (prototypes, tagging) runs too, with fixed selection ratios large enough to tag some of the
# 16 cases. FedProx carries the one-configuration check (a float that JSON could turn into a string, a
# network override); FedPSL the privacy option (tests/simulator/test_privacy_runs.py reads the same run).
SMOKE_CHANGES = {
    "fedmlp_cxr": {"server": {"warmup_rounds": 1, "tau0": 0.3, "tau1": 0.3, "adaptive_threshold": False}},
    "fedprox_cxr": {"client": {**JOBS["fedprox_cxr"].run.client, "lr": 5e-05}, "network": {"hidden": 16}},
    "fedpsl_cxr": {"privacy": dict(PRIVACY)},
}


def job(spec, **changes):
    """The job ``spec`` (a ``JobSpec`` or a job's name) with ``TINY`` and ``changes`` applied."""
    spec = JOBS[spec] if isinstance(spec, str) else spec
    return spec.replace(**{**TINY, **changes})


def smoke(name):
    """A job's smoke run on the session's cxr scenario, as tests/simulator/test_flare_runs.py (and tests/simulator/test_privacy_runs.py,
    tests/simulator/test_dicom_runs.py through test_flare_runs's ``job_runs``) asks for it."""
    return job(name, **{**PRODUCTION, **SMOKE_CHANGES.get(name, {})})


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


def environ(env=None, base=None) -> dict:
    """``base`` (default: ``os.environ`` now) with ``env`` applied (default ``ONE_THREAD``; None removes)."""
    out = dict(os.environ if base is None else base)
    for k, v in (ONE_THREAD if env is None else env).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = str(v)
    return out


def prepare_job(spec, where: Path, tag: str = "") -> tuple:
    """Export ``spec`` under ``where``: (job folder, log path). (In the main thread: the job API is not
    known to be thread-safe.)"""
    where = Path(where)
    return export(spec, where / f"jobs{tag}"), where / f"{spec.name}{tag}.log"


# A bound that only catches a hung run: a 2-site run takes 1-2 minutes beside the other tests on a slow 2-core
# machine (one with its sites taking turns in one worker process ran past 300 s there), so leave it room.
RUN_TIMEOUT = 1200


def run_job(spec, data, job_dir, log, tag="", threads=None, env=None, base=None, timeout=RUN_TIMEOUT) -> tuple:
    run_dir = simulate(job_dir, Path(log).parent / f"ws{tag}", spec.sites, data=data, threads=threads or spec.sites,
                       log=log, timeout=timeout, environ=environ(env, base))
    return run_dir, log


def simulate_job(spec, data, where: Path, tag: str = "", threads=None, env=None, timeout=RUN_TIMEOUT) -> tuple:
    """One simulator run of ``spec`` (already changed, see ``job``) on ``data`` under ``where``;
    (server run folder, log). ``threads``: worker processes, default one per site. ``env``: changes to
    the environment (default ``ONE_THREAD``)."""
    job_dir, log = prepare_job(spec, where, tag)
    return run_job(spec, data, job_dir, log, tag, threads=threads, env=env, timeout=timeout)


def key(spec, data, threads, env) -> str:
    """What makes a run: the whole job, the scenario folder, the worker processes, the environment changes."""
    return json.dumps([dataclasses.asdict(spec), str(Path(data).resolve()), threads or spec.sites,
                       sorted((ONE_THREAD if env is None else env).items())], sort_keys=True, default=str)


class SharedRuns:
    """``sim_run(spec, data, threads=None, env=None)`` -> (server run folder, log): each distinct
    run once per session, in its own temporary folder. ``spec``: a changed job (see ``job``).
    ``prefetch`` starts a run in the background (``workers`` at a time). Called from the main
    thread only; the background threads only wait for simulator processes."""

    def __init__(self, tmp_path_factory, workers=2):
        self.factory, self.base = tmp_path_factory, dict(os.environ)  # the environment the session started with
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="shared-run")
        self.futures, self.asked = {}, set()

    def _start(self, spec, data, threads, env, background) -> Future:
        job_dir, log = prepare_job(spec, self.factory.mktemp(f"sim-{spec.name}"))
        args = (spec, data, job_dir, log)
        options = dict(threads=threads, env=env, base=self.base)
        if background:
            return self.pool.submit(run_job, *args, **options)
        future = Future()
        try:
            future.set_result(run_job(*args, **options))
        except Exception as e:  # the next test asking for this run fails at once, without running it again
            future.set_exception(e)
        return future

    def prefetch(self, spec, data, threads=None, env=None) -> None:
        k = key(spec, data, threads, env)
        if k not in self.futures:
            self.futures[k] = self._start(spec, data, threads, env, background=True)

    def __call__(self, spec, data, threads=None, env=None) -> tuple:
        k = key(spec, data, threads, env)
        self.asked.add(k)
        future = self.futures.get(k)
        if future is None or future.cancel():  # not started yet: run it here, now
            self.futures[k] = future = self._start(spec, data, threads, env, background=False)
        try:
            return future.result()
        except Exception as e:
            raise RuntimeError(f"this session's shared run of {spec.name} failed: {e}") from e

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        unused = [json.loads(k)[0]["name"] for k, f in self.futures.items() if k not in self.asked and f.done()
                  and not f.cancelled()]
        if unused:  # a SHARED_RUNS entry that no test asked for in the same form: a wasted run
            warnings.warn(f"shared simulator runs started and never asked for: {unused}")

    @property
    def runs(self) -> int:
        return len(self.futures)
