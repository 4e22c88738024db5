"""FLARE glue against the real nvflare simulator on tiny synthetic data."""

import dataclasses
import filecmp
import json
import shutil
import sys
import time

import numpy as np
import pytest
import torch
import yaml

from fedlabels.data.synthetic import generate
from fedlabels.flare.commands import LOST_SITE, SiteLostAtStartup, evaluate_global, run_watched, simulate, write_jobs
from fedlabels.flare.controller import screen_update
from fedlabels.flare.job import JOBS, REPO, export

TINY = {"rounds": 2, "sites": 2, "batch_size": 8}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate("cxr", tmp_path_factory.mktemp("cxr") / "cxr", seed=0, cases=16, test_cases=12)


_RUNS = {}


def run(spec, tmp_path, data, tag="", **changes):
    spec = dataclasses.replace(spec, **{**TINY, **changes})
    job = export(spec, tmp_path / f"jobs{tag}")
    log = tmp_path / f"{spec.name}{tag}.log"
    return simulate(job, tmp_path / f"ws{tag}", spec.sites, data=data, log=log, timeout=300), log


def test_run_watched_stops_a_run_that_lost_a_site(tmp_path):
    # The simulator never exits when a site is lost at start-up: the watchdog must stop it at once.
    script = f"import time; print('starting'); print({LOST_SITE!r}, flush=True); time.sleep(120)"
    t0 = time.time()
    with pytest.raises(SiteLostAtStartup, match="lost at start-up"):
        run_watched([sys.executable, "-c", script], None, tmp_path / "lost.log", poll=0.2)
    assert time.time() - t0 < 30
    assert "starting" in (tmp_path / "lost.log").read_text()


def test_run_watched_timeout_and_exit_code(tmp_path):
    with pytest.raises(RuntimeError, match="within 1 s"):
        run_watched([sys.executable, "-c", "import time; time.sleep(120)"], None, tmp_path / "slow.log", timeout=1, poll=0.2)
    assert run_watched([sys.executable, "-c", "raise SystemExit(3)"], None, tmp_path / "exit.log", poll=0.2) == 3


def rounds(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_committed_jobs_match_their_code(tmp_path):
    write_jobs(tmp_path)
    committed = REPO / "nvflare_jobs"
    assert sorted(p.name for p in committed.iterdir()) == sorted(JOBS)
    for name in JOBS:
        cmp = filecmp.dircmp(tmp_path / name, committed / name)
        stack, diffs = [cmp], []
        while stack:
            c = stack.pop()
            diffs += c.diff_files + c.left_only + c.right_only
            stack += c.subdirs.values()
        assert not diffs, f"nvflare_jobs/{name} drifted from fedlabels.flare.job ({diffs}); run `fedlabels jobs`"


@pytest.fixture(scope="module")
def job_runs(tmp_path_factory, data):
    """Each job run once (2 sites x 2 rounds), shared by the tests below."""
    def get(name):
        if name not in _RUNS:
            _RUNS[name] = run(JOBS[name], tmp_path_factory.mktemp(name), data)
        return _RUNS[name]
    return get


@pytest.mark.parametrize("name", sorted(JOBS))
def test_every_job_runs_in_the_simulator(name, job_runs, data):
    run_dir, log = job_runs(name)
    recs = rounds(run_dir)
    assert [r["round"] for r in recs] == [0, 1]
    assert sorted(recs[-1]["sites"]) == ["site-1", "site-2"] and not recs[-1]["dropped"]
    assert all(np.isfinite(r["sites"][s]["train_loss"]) for r in recs for s in r["sites"])
    for f in ("FL_global_model.pt", "best_FL_global_model.pt"):
        assert (run_dir / "app_server" / f).is_file()
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    cross = json.loads((run_dir / "cross_site_eval.json").read_text())
    # a site is scored only on the classes it annotates
    assert set(cross["site-1"]["undefined"]) >= {"nodule", "consolidation", "pneumothorax"}
    assert set(cross["site-2"]["undefined"]) >= {"infiltration", "consolidation", "pneumothorax"}
    for site in ("site-1", "site-2"):
        assert all(cross[site]["per_class"][c]["auroc"] is None for c in cross[site]["undefined"])
    # best = the model with the best mean site-validation score (last round's or the final one)
    final = float(np.mean([cross[s]["auroc"] for s in cross if cross[s]["auroc"] is not None]))
    round0 = recs[1]["mean_val_auroc"]  # round 1's sites scored the model of round 0
    last_w = torch.load(run_dir / "app_server/FL_global_model.pt", weights_only=False)["model"]
    best_w = torch.load(run_dir / "app_server/best_FL_global_model.pt", weights_only=False)["model"]
    same = all(np.array_equal(np.asarray(last_w[k]), np.asarray(best_w[k])) for k in last_w)
    assert same == (round0 is None or final > round0), (round0, final)
    # the global model reloads into the bundle's network and scores on the test split
    metrics = evaluate_global(run_dir, REPO / "bundles" / JOBS[name].bundle, data, "last")
    assert 0.0 <= metrics["auroc"] <= 1.0


def test_same_seed_same_metrics(tmp_path, data, job_runs):
    a, _ = job_runs("fedavg_cxr")
    b, _ = run(JOBS["fedavg_cxr"], tmp_path, data, "b")
    strip = lambda recs: [{k: v for k, v in r.items() if k != "seconds"} for r in recs]  # noqa: E731
    assert strip(rounds(a)) == strip(rounds(b))
    wa = torch.load(a / "app_server/FL_global_model.pt", weights_only=False)["model"]
    wb = torch.load(b / "app_server/FL_global_model.pt", weights_only=False)["model"]
    assert all(np.array_equal(np.asarray(wa[k]), np.asarray(wb[k])) for k in wa)


def test_bad_updates_and_crashes_are_dropped_and_rounds_complete(tmp_path, data):
    faults = ["site-2:keys:0", "site-2:nan:1", "site-3:shape:1", "site-4:crash:1"]
    run_dir, log = run(JOBS["fedavg_pl_cxr"], tmp_path, data, sites=4, faults=faults)
    recs = rounds(run_dir)
    assert recs[0]["dropped"] == ["site-2"] and sorted(recs[0]["sites"]) == ["site-1", "site-3", "site-4"]
    assert sorted(recs[1]["sites"]) == ["site-1"]  # the round completes with the one good update
    text = log.read_text()
    for line in ("round 0 site-2: update dropped: unknown keys", "round 1 site-2: update dropped: non-finite values",
                 "round 1 site-3: update dropped: shape of", "fault drill: site-4 crashes in round 1"):
        assert line in text
    last = torch.load(run_dir / "app_server/FL_global_model.pt", weights_only=False)["model"]
    assert all(np.isfinite(np.asarray(v, dtype=np.float64)).all() for v in last.values())


@pytest.mark.parametrize("breakage, message", [
    (lambda d: d["site-2/profile.yaml"].update(annotated=[]), "site-2/profile.yaml: field 'annotated': the site annotates no class"),
    (lambda d: d["site-1/profile.yaml"]["classes"].reverse(), "site-1/profile.yaml: field 'classes': class list"),
])
def test_bad_site_profile_stops_the_job_before_training(breakage, message, tmp_path, data):
    broken = tmp_path / "broken"
    shutil.copytree(data, broken)
    docs = {f: yaml.safe_load((broken / f).read_text()) for f in ("site-1/profile.yaml", "site-2/profile.yaml")}
    breakage(docs)
    for f, d in docs.items():
        (broken / f).write_text(yaml.safe_dump(d))
    with pytest.raises(RuntimeError, match="did not finish"):
        run(JOBS["surgical_cxr"], tmp_path, broken)
    text = (tmp_path / "surgical_cxr.log").read_text()
    assert message in text
    assert "round 0 site-" not in text  # no round was trained


def test_resume_continues_from_last_global_model(tmp_path, data, job_runs):
    first, _ = job_runs("fedavg_pl_cxr")
    saved = tmp_path / "saved"
    shutil.copytree(first, saved)
    second, log = run(JOBS["fedavg_pl_cxr"], tmp_path, data, "2", rounds=3, resume_from=str(saved))
    assert [r["round"] for r in rounds(second)] == [2]
    assert "resuming from" in log.read_text()
    assert json.loads((second / "progress.json").read_text())["next_round"] == 3


def test_screen_update():
    ref = {"a": np.zeros((2, 2), np.float32), "n": np.array(3)}
    assert screen_update({"a": np.ones((2, 2), np.float32)}, ref) is None
    assert "non-finite" in screen_update({"a": np.full((2, 2), np.inf, np.float32)}, ref)
    assert "shape" in screen_update({"a": np.ones(4, np.float32)}, ref)
    assert "unknown keys" in screen_update({"b": np.ones(1)}, ref)
    assert screen_update({}, ref) == "empty update"
