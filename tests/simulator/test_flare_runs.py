"""FLARE glue against the real nvflare simulator on tiny synthetic data.

The simulator runs are shared (``sim_run``, tests/shared_runs.py): each job's smoke run
(2 sites x 2 rounds) happens once per session and carries every check that can read it.
What each run serves:

* ``fedavg_cxr``: its smoke test, FLARE = in-process, the half-precision run's float32
  upload sizes, and tests/simulator/test_dicom_runs.py's structured reports;
* ``fedbn_cxr``: its smoke test, FLARE = in-process, FedBN's batch norm and personal
  models, the run a resume continues, and the process-per-site side of the sites-taking-turns
  test (which is the same-seed rerun too);
* ``surgical_cxr``: its smoke test and FLARE = in-process;
* ``fedprox_cxr`` (lr 5e-05, ``hidden`` 16): its smoke test and the one-configuration check;
* ``fedpsl_cxr`` (privacy option on): its smoke test and tests/simulator/test_privacy_runs.py's noised
  summaries in every message;
* ``fedmlp_cxr`` (warm-up 1 round): its smoke test and the prototypes and tags;
* ``fedavg_cxr`` with half-precision transfer (torch threads left to the controller): the
  half-precision checks and the cores' share;
* the other cxr jobs, the medmnist and lesion jobs: their own tests.

Jobs whose client and server code other jobs' runs execute (``COVERED_BY``) have no run of
their own; their committed folders are checked like every job's (drift, configuration; tests/unit/test_flare.py).
"""

import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedlabels.data.synthetic import generate
from fedlabels.flare.commands import evaluate_global
from fedlabels import references
from fedlabels.flare.job import JOBS
from shared_runs import CXR, PRODUCTION, SEMI_SUPERVISED, TINY, job, simulate_job, smoke

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(cxr_data):
    return cxr_data


def weights(run_dir, name="FL_global_model.pt"):
    state = torch.load(run_dir / "app_server" / name, weights_only=False)["model"]
    return {k: np.asarray(v) for k, v in state.items()}


def in_process(spec, data, rounds=TINY["rounds"], **setup_options):
    """The in-process engine's run of ``spec`` on one torch thread (as each simulated site), with the options
    its run configuration carries (a preset's included)."""
    cfg = spec.run
    setups = references.setups(REPO / "bundles" / cfg.bundle, data, batch_size=TINY["batch_size"], seed=cfg.seed,
                               config=cfg.bundle_config() or None, **setup_options)  # the job's preset
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return references.federate(spec.method, setups, rounds, seed=cfg.seed, client_options=cfg.client,
                                   server_options=cfg.server or None, log=None)
    finally:
        torch.set_num_threads(threads)


def rounds(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def other_task(name, changes):
    """fedavg_medmnist on the session's medmnist scenario; fedavg_lesion on its 32 px pixel + box scenario."""
    return (("medmnist_data", None) if JOBS[name].run.data.family == "medmnist" else ("lesion_data", "bbox")), \
        job(name, **{**PRODUCTION, **changes})


def semi_supervised(name):
    return job(name, server={**JOBS[name].run.server, **SEMI_SUPERVISED[name][0]}, **PRODUCTION)


# RSCFed's run has one simulator worker process for its two sites: they take turns, a new process per
# task, so a site's second draw in a round must continue its first from the state it saved.
SEMI_SUPERVISED_THREADS = {"rscfed_medmnist": {"threads": 1}}


HALF = (job("fedavg_cxr", transfer="float16"), {"env": {"OMP_NUM_THREADS": None}})


@pytest.fixture(scope="module")
def job_runs(sim_run, data):
    """``job_runs(name)`` -> (server run folder, log): the job's smoke run, once per session."""
    def get(name):
        return sim_run(smoke(name), data)
    return get


@pytest.mark.simulator
@pytest.mark.parametrize("name", CXR)
def test_every_cxr_job_runs_in_the_simulator(name, job_runs, data):
    run_dir, log = job_runs(name)
    recs = rounds(run_dir)
    assert [r["round"] for r in recs] == [0, 1]
    assert sorted(recs[-1]["sites"]) == ["site-1", "site-2"] and not recs[-1]["dropped"] and recs[-1]["aggregated"]
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
    # best = the model with the best mean site-validation score: one the sites received
    # at the start of a round (round r scores the model of round r-1), or the final one
    final = float(np.mean([cross[s]["auroc"] for s in cross if cross[s]["auroc"] is not None]))
    received = [r["mean_val_auroc"] for r in recs if r["mean_val_auroc"] is not None]
    last_w, best_w = weights(run_dir), weights(run_dir, "best_FL_global_model.pt")
    same = all(np.array_equal(last_w[k], best_w[k]) for k in last_w)
    assert same == (not received or final > max(received)), (received, final)
    # the global model reloads into the bundle's network and scores on the test split
    metrics = evaluate_global(run_dir, REPO / "bundles" / JOBS[name].run.bundle, data, "last")
    assert 0.0 <= metrics["auroc"] <= 1.0


@pytest.mark.simulator
@pytest.mark.parametrize("name, changes, metric", [
    ("fedavg_medmnist", {}, "accuracy"),
    ("fedavg_lesion", {"image_size": 32}, "dice"),  # the 32 px pixel + box scenario of the FedMix runs
])
def test_multiclass_and_segmentation_jobs_run_in_the_simulator(name, changes, metric, sim_run, medmnist_data,
                                                               lesion_data):
    spec = JOBS[name]
    (fixture, part), changed = other_task(name, changes)
    family_data = {"medmnist_data": medmnist_data, "lesion_data": lesion_data}[fixture]
    family_data = family_data if part is None else family_data[part]
    run_dir, log = sim_run(changed, family_data)
    recs = rounds(run_dir)
    assert [r["round"] for r in recs] == [0, 1] and all(r["aggregated"] and not r["dropped"] for r in recs)
    # sites with nothing a supervised method can learn from abstain (weight 0), they do not fail
    assert recs[0]["abstained"] == ["site-2"] and recs[0]["sites"]["site-2"]["n"] == 0
    assert recs[0]["sites"]["site-1"]["n"] > 0
    cross = json.loads((run_dir / "cross_site_eval.json").read_text())
    assert 0.0 <= cross["site-1"][metric] <= 1.0
    assert f"val_{metric}" in recs[1]["sites"]["site-1"]  # the task's key metric picks the best model
    assert evaluate_global(run_dir, REPO / "bundles" / spec.run.bundle, family_data, "best")[metric] is not None


@pytest.fixture(scope="module")
def half_run(sim_run, data):
    """fedavg_cxr with half-precision transfer, the sites' torch threads left to the controller
    (no OMP_NUM_THREADS in the simulator's environment)."""
    return sim_run(HALF[0], data, **HALF[1])


@pytest.mark.simulator
def test_simulated_sites_share_the_cores_without_fedlabels_simulate(half_run):
    """The controller gives each simulated site its share of the cores (the plain
    `nvflare simulator` command gets it too: simulate() sets no thread variable)."""
    _, log = half_run
    expected = str(max(1, (os.cpu_count() or 1) // TINY["sites"]))
    text = log.read_text()
    assert f"[site-1] torch threads: {expected}" in text and f"[site-2] torch threads: {expected}" in text


@pytest.mark.simulator
@pytest.mark.parametrize("name", ["fedavg_cxr", "surgical_cxr", "fedbn_cxr"])
def test_flare_and_in_process_engine_give_the_same_weights(name, job_runs, data):
    """The controller and the in-process loop run the same engine: same global weights (1e-6),
    one torch thread on both sides. FedBN: nvflare's ExcludeVars filter and the in-process
    site_round withhold the same keys."""
    run_dir, _ = job_runs(name)
    out = in_process(smoke(name), data, sites=["site-1", "site-2"])
    flare_w = weights(run_dir)
    assert set(flare_w) == set(out["last"])
    for k, v in out["last"].items():
        np.testing.assert_allclose(flare_w[k], v, rtol=0, atol=1e-6, err_msg=k)


FAULTS = ["site-2:keys:0", "site-3:no_n:0", "site-4:n_text:0", "site-2:nan:1", "site-3:shape:1", "site-3:metric:1",
          "site-4:n_huge:1", "site-2:dtype:2", "site-3:extras:2", "site-4:stall:2", "site-4:crash:3",
          "site-2:norm:3", "site-3:metric_huge:3"]


# site-4 stalls in round 2 for site_timeout + 3 s: the server leaves it out after site_timeout (every
# second of it adds to the run). A round's task here takes 4 s on an idle 2-core machine, 10 s beside
# other tests, and 2-3 times that on a slower 2-core machine: 60 s leaves a healthy site in. The handshake,
# which also waits for the sites' start-up (11-20 s here), has at least an hour.
FAULT_TIMEOUT = 60


FAULT_RUN = job("fedavg_pl_cxr", sites=4, rounds=4, faults=FAULTS, site_timeout=FAULT_TIMEOUT)


NEVER_AGGREGATES = [f"site-{s}:nan:{r}" for s in (1, 2) for r in (0, 1)]


@pytest.mark.simulator
def test_bad_updates_and_crashes_are_dropped_and_rounds_complete(sim_run, data):
    """The fault drill: broken and hostile replies (tracker issue 22, item 3), a crash, and a site that
    does not answer within site_timeout (item 4) are each dropped with their reason, logged; every
    round goes on, and the job finishes with a finite model."""
    run_dir, log = sim_run(FAULT_RUN, data)
    recs = rounds(run_dir)
    assert [r["round"] for r in recs] == [0, 1, 2, 3] and all(r["aggregated"] for r in recs)
    dropped = [sorted(r["dropped"]) for r in recs]
    assert dropped == [["site-2", "site-3", "site-4"]] * 3 + [["site-2", "site-4"]], dropped
    assert "no case count" in recs[0]["dropped"]["site-3"]  # never weighted 1
    assert "case count 'many' is not a positive integer" in recs[0]["dropped"]["site-4"]
    assert "exceeds the" in recs[1]["dropped"]["site-4"]
    assert "dtype of" in recs[2]["dropped"]["site-2"] and "float64" in recs[2]["dropped"]["site-2"]
    assert "extras are a list" in recs[2]["dropped"]["site-3"]
    assert "no result" in recs[2]["dropped"]["site-4"]  # stalled past the timeout
    norm = re.search(r"weight norm ([\d.]+) x the received model's", recs[3]["dropped"]["site-2"])
    assert norm and 90 < float(norm.group(1)) < 110, recs[3]["dropped"]  # its trained weights scaled 100 times
    # on this data only site-3's validation cases give an AUROC: its infinite score in round 1 and its
    # AUROC of 1e9 in round 3 are not scored (either would pin the best model for good), so neither round
    # is a best-model candidate
    assert [r["scored_by"] for r in recs] == [["site-3"], [], ["site-3"], []], recs
    assert recs[1]["mean_val_auroc"] is None and recs[3]["mean_val_auroc"] is None
    # a dropped site still reports its metrics (its score of the received model counts for the
    # best model, so the score averages the same sites every round; tests/unit/test_engine.py)
    assert sorted(recs[0]["sites"]) == ["site-1", "site-2", "site-3", "site-4"]
    assert set(recs[0]["sites"]["site-2"]) == set(recs[0]["sites"]["site-1"])
    text = log.read_text()
    for line in ("round 0 site-2: update dropped: unknown keys", "round 0 site-3: update dropped: no case count",
                 "round 1 site-2: update dropped: non-finite values", "round 1 site-3: update dropped: shape of",
                 "round 1 site-3: val_auroc=inf is not finite: not scored",
                 "round 3 site-3: val_auroc=1000000000.0 is not in [0, 1]: not scored",
                 f"task train: ['site-4'] did not answer within {FAULT_TIMEOUT}s (site_timeout)",
                 "fault drill: site-4 crashes in round 3"):
        assert line in text, line
    progress = json.loads((run_dir / "progress.json").read_text())
    assert progress["next_round"] == 4 and progress["best"] is not None and math.isfinite(progress["best"])
    last = torch.load(run_dir / "app_server/FL_global_model.pt", weights_only=False)["model"]
    assert all(np.isfinite(np.asarray(v, dtype=np.float64)).all() for v in last.values())
    assert all(np.asarray(v).dtype != np.float64 for v in last.values())


@pytest.mark.simulator
def test_sites_whose_declarations_fail_the_screen_are_left_out_and_the_job_finishes(sim_run, data):
    """Before round 0, site-2 declares a privacy report whose noise would widen its case bound by 2.4e13
    cases and site-3 declares 10^8 cases: both are left out of the run with their reason, and site-1 trains
    and is validated alone (min_sites 1)."""
    run_dir, log = sim_run(job("fedavg_cxr", sites=3, rounds=1,
                               faults=["site-2:summary_noise:0", "site-3:summary_cases:0"]), data)
    text = log.read_text()
    assert ("site-2 is left out of this run: its label summary: field 'privacy.noise_multiplier': "
            "1000000000000.0 is not in (0, 20.0]") in text
    assert "site-3 is left out of this run: its label summary: field 'cases': 100000000 is more than" in text
    (rec,) = rounds(run_dir)
    assert sorted(rec["sites"]) == ["site-1"] and rec["aggregated"]
    assert sorted(json.loads((run_dir / "cross_site_eval.json").read_text())) == ["site-1"]
    assert json.loads((run_dir / "progress.json").read_text())["next_round"] == 1


@pytest.mark.simulator
def test_bad_site_profiles_stop_the_job_before_training(tmp_path, data):
    """Two sites with a bad profile each (one annotates no class, the other lists the classes out of
    order): each names its own file and field, and no round is trained."""
    broken = tmp_path / "broken"
    shutil.copytree(data, broken)
    docs = {f: yaml.safe_load((broken / f).read_text()) for f in ("site-1/profile.yaml", "site-2/profile.yaml")}
    docs["site-2/profile.yaml"].update(annotated=[])
    docs["site-1/profile.yaml"]["classes"].reverse()
    for f, d in docs.items():
        (broken / f).write_text(yaml.safe_dump(d))
    with pytest.raises(RuntimeError, match="did not finish"):
        simulate_job(job("surgical_cxr"), broken, tmp_path)
    text = (tmp_path / "surgical_cxr.log").read_text()
    for message in ("site-2/profile.yaml: field 'annotated': the site annotates no class",
                    "site-1/profile.yaml: field 'classes': class list"):
        assert message in text  # the site's own log
    # what the server was told names the field, never the hospital's path or file name
    # (the server stops at the first site's report)
    told = re.findall(r"FATAL_SYSTEM_ERROR received: (site-\d: [^\n]*)", text)
    assert told and all(re.match(r"site-\d: <local file>: field '(annotated|classes)'", t) for t in told), told
    assert not any("profile.yaml" in t or "/tmp" in t for t in told), told
    assert "round 0 site-" not in text  # no round was trained


@pytest.mark.simulator
def test_sites_taking_turns_in_fewer_processes_continue_their_state(sim_run, data, job_runs):
    """nvflare's simulator with fewer threads than sites starts a new process for every
    site task; each site continues its saved state (FedBN: its own batch norm and Adam
    moments), so the run equals the one with a long-lived process per site: the same
    metrics round by round and the same weights, which is also the same-seed rerun. (One
    torch thread in both runs: another thread count changes the sums' order, not the state.)"""
    straight, _ = job_runs("fedbn_cxr")  # a process per site, one torch thread
    turns, log = sim_run(job("fedbn_cxr"), data, threads=1)  # one worker process: the sites take turns
    text = log.read_text()
    for site in ("site-1", "site-2"):  # round 1 runs in a new process
        assert f"[{site}] continued its state of this run" in text
    strip = lambda recs: [{k: v for k, v in r.items() if k != "seconds"} for r in recs]  # noqa: E731
    assert strip(rounds(turns)) == strip(rounds(straight))
    a, b = weights(turns), weights(straight)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # the final cross-site validation (a task in a new process too) scores with each site's own batch norm
    cross = [json.loads((r / "cross_site_eval.json").read_text()) for r in (turns, straight)]
    assert cross[0] == cross[1]


@pytest.mark.simulator
def test_half_precision_transfer_runs_in_the_simulator(half_run, job_runs):
    """transfer=float16: nvflare's ModelQuantizer/ModelDequantizer filters on both sides;
    the site's upload, as nvflare's download service counted it, is about half the
    float32 run's, and the server's model comes back in float32."""
    full, _ = job_runs("fedavg_cxr")
    half, log = half_run
    assert [r["round"] for r in rounds(half)] == [0, 1]
    assert "Running quantization on" in (half.parents[1] / "server" / "log.txt").read_text()
    w = weights(half)
    assert all(v.dtype != np.float16 for v in w.values())
    assert all(np.isfinite(v).all() for v in w.values() if v.dtype.kind == "f")
    up_full, up_half = uploads(full), uploads(half)
    assert len(up_full) == len(up_half) == 4  # 2 sites x 2 rounds
    assert max(up_half) <= 0.51 * min(up_full), (up_half, up_full)


# A site's log line when the server fetched that site's update through nvflare's
# download service (messages with arrays over 2 MiB travel through it).
UPLOAD = re.compile(r"\[server\] download tx \S+ done: status=\w+ .*\(([\d,]+) bytes\)")


def uploads(run_dir) -> list:
    ws = run_dir.parents[1]
    return [int(n.replace(",", "")) for log in sorted(ws.glob("site-*/log.txt")) for n in UPLOAD.findall(log.read_text())]


@pytest.mark.simulator
def test_a_run_that_never_aggregates_fails_with_the_reason(sim_run, data):
    with pytest.raises(RuntimeError, match="no round aggregated"):
        sim_run(job("fedavg_cxr", faults=NEVER_AGGREGATES), data)


@pytest.mark.simulator
def test_one_configuration_reaches_server_and_sites(job_runs):
    """JSON keeps 5e-05 a float at every site; a network override reaches the server's
    persistor and every site (or the sites' updates would not match the global keys).
    The fedprox_cxr smoke run carries both (shared_runs.SMOKE_CHANGES)."""
    assert smoke("fedprox_cxr").run.client["lr"] == 5e-05 and smoke("fedprox_cxr").run.network == {"hidden": 16}
    run_dir, log = job_runs("fedprox_cxr")
    text = log.read_text()
    assert text.count("'lr': 5e-05") >= 2 and "'lr': '5e-05'" not in text
    w = weights(run_dir)
    hidden = [k for k in w if k.startswith("class_layers.") and w[k].shape[:1] == (16,)]
    assert hidden, sorted(w)[-6:]
    assert all(not r["dropped"] and r["aggregated"] for r in rounds(run_dir))


@pytest.mark.simulator
def test_fedbn_batch_norm_never_leaves_a_site_and_its_personal_model_carries_it(job_runs, data, tmp_path, capsys):
    """In the real simulator: no task a FedBN site sent carries a batch-norm key (its audit record,
    written after nvflare's filters); the server's global model keeps its initial batch norm while
    every other weight trains; a site's personal model is the global weights with the batch norm it
    trained for both rounds, and predicts otherwise than the global model; the exported global model
    scores what `fedlabels report` reports."""
    from fedlabels.bundle import network
    from fedlabels.bundle.workflows import export_bundle
    from fedlabels.methods.base import personal_model
    from fedlabels.nets import batchnorm_keys, rebuild
    from fedlabels.site import evaluate, latest_state, setup_site, test_loader

    spec = JOBS["fedbn_cxr"]
    bundle = REPO / "bundles" / spec.run.bundle
    run_dir, _ = job_runs("fedbn_cxr")
    w = weights(run_dir)
    net = network(bundle, spec.run.network)
    bn = set(batchnorm_keys(net))
    torch.manual_seed(spec.run.seed)  # the controller's seeded initial model
    initial = {k: v.numpy() for k, v in rebuild(net).state_dict().items()}
    for site in ("site-1", "site-2"):
        record = run_dir.parents[1] / site / "fedlabels_sent" / f"{site}.jsonl"
        sent = [json.loads(line) for line in record.read_text().splitlines()]
        assert [e["task"] for e in sent] == ["summary", "train", "train", "validate"], site
        assert [e["round"] for e in sent] == [None, 0, 1, 2] and len({e["run"] for e in sent} - {None}) == 1
        assert all(not bn & set(e["weights"]) for e in sent)
        for e in sent[1:3]:
            assert set(e["weights"]) == set(w) - bn and e["meta"]["filter_history"] == ["ExcludeVars"]
    for k in bn:
        np.testing.assert_array_equal(w[k], initial[k], err_msg=k)
    trained = [k for k in set(w) - bn if w[k].dtype.kind == "f"]
    assert trained and all(not np.array_equal(w[k], initial[k]) for k in trained)

    # Each site's personal model: the global weights with the batch norm it trained on for both
    # rounds (its own statistics continued, never reset to the global ones).
    images = next(iter(test_loader(bundle, data)))["image"]
    states = run_dir.parents[2] / "ws.state" / json.loads((run_dir / "progress.json").read_text())["run"]
    with torch.no_grad():
        net.load_state_dict({k: torch.as_tensor(v) for k, v in w.items()})
        global_out = net.eval()(images)
        for site in ("site-1", "site-2"):
            st = setup_site(bundle, data, site, batch_size=TINY["batch_size"], seed=spec.run.seed)
            own = personal_model(w, latest_state(states / site))
            assert set(own) == set(w)
            assert all(np.array_equal(own[k].numpy(), w[k]) for k in set(w) - bn)
            counts = {int(own[k]) for k in bn if k.endswith("num_batches_tracked")}
            assert counts == {TINY["rounds"] * len(st.context().train)}, site
            net.load_state_dict(own)
            assert not torch.allclose(net.eval()(images), global_out, atol=1e-4), site

    reported = evaluate_global(run_dir, bundle, data, "last")
    out = export_bundle(bundle, run_dir / "app_server" / "FL_global_model.pt", tmp_path / "exported")
    scripted = torch.jit.load(str(out / "models" / "model.ts"), map_location="cpu")
    scored = evaluate(scripted, test_loader(bundle, data), "multilabel", tuple(reported["per_class"]))
    for cls, m in reported["per_class"].items():
        assert scored["per_class"][cls]["auroc"] == pytest.approx(m["auroc"], abs=1e-6), cls

    # A hospital's deployable bundle: `fedlabels export --run --site-state` takes the run's last model (the
    # round the state file's batch norm is from) with the site's own batch norm, judged on its own validation
    # cases; without --site-state a FedBN run is refused in one line, nothing written. (The command in this
    # process, cli.main; tests/unit/test_cli.py runs the console script in subprocesses.)
    from fedlabels import cli

    state_file = states / "site-1"  # the site's state folder: its last saved round
    mine = tmp_path / "site-1"
    assert cli.main(["export", "--bundle", spec.run.bundle, "--run", str(run_dir), "--data", str(data),
                     "--site-state", str(state_file), "--out", str(mine)]) == 0
    exported = torch.load(mine / "models" / "model.pt", weights_only=True)
    own = personal_model(w, latest_state(state_file))
    assert all(torch.equal(exported[k], own[k]) for k in own)
    assert any(not np.array_equal(exported[k].numpy(), w[k]) for k in bn)
    meta = json.loads((mine / "configs" / "metadata.json").read_text())
    assert meta["provenance"]["site_state"] == str(state_file)
    assert meta["provenance"]["checkpoint"].endswith("/FL_global_model.pt")
    assert meta["training"]["validation_sites"] == ["site-1"]
    capsys.readouterr()
    code = cli.main(["export", "--bundle", spec.run.bundle, "--run", str(run_dir), "--out", str(tmp_path / "global")])
    stderr = capsys.readouterr().err
    assert code == 2 and "--site-state" in stderr and len(stderr.splitlines()) == 1
    assert not (tmp_path / "global").exists()


@pytest.mark.simulator
@pytest.mark.parametrize("name", sorted(SEMI_SUPERVISED))
def test_semi_supervised_jobs_run_in_the_simulator(name, sim_run, medmnist_data, capsys):
    """Site-1 labeled, site-2 unlabeled. mt_wfedavg_medmnist has no run of its own (COVERED_BY):
    its steps are wfedavg's and its unlabeled site's rule is rscfed's."""
    server, steps = SEMI_SUPERVISED[name]
    spec = semi_supervised(name)
    run_dir, log = sim_run(spec, medmnist_data, **SEMI_SUPERVISED_THREADS.get(name, {}))
    recs = rounds(run_dir)
    assert [r["round"] for r in recs] == [0, 1]
    for r in recs:
        assert [(s["name"], s["sites"]) for s in r["steps"]] == steps and all(s["aggregated"] for s in r["steps"])
        assert not r["dropped"] and not r["abstained"]
        # the unlabeled site trains too (wfedavg: on its oracle labels, the upper bound)
        assert r["sites"]["site-1"]["n"] > 0 and r["sites"]["site-2"]["n"] > 0
    text = log.read_text()
    if name == "wfedavg_medmnist":
        assert "every site is labeled" in text  # the labeled-only special case, said once
    else:
        assert "labeled sites ['site-1'], unlabeled sites ['site-2']" in text
    if name == "rscfed_medmnist":  # taking turns: the second draw continued the first, as in process
        for site in ("site-1", "site-2"):
            assert f"[{site}] continued its state of this run" in text
        out = in_process(spec, medmnist_data, method=spec.method)
        flare_w = weights(run_dir)
        for k, v in out["last"].items():
            np.testing.assert_allclose(flare_w[k], v, rtol=0, atol=1e-6, err_msg=k)
    if name == "isofed_medmnist":
        assert np.isfinite(recs[0]["sites"]["site-2"]["pretrain_loss"])
        assert "pretrain_loss" not in recs[0]["sites"]["site-1"]
        # the isolated order through FLARE is the in-process engine's: same global weights (one torch thread)
        out = in_process(spec, medmnist_data, method=spec.method)
        flare_w = weights(run_dir)
        for k, v in out["last"].items():
            np.testing.assert_allclose(flare_w[k], v, rtol=0, atol=1e-6, err_msg=k)
        # fedlabels report: the multi-class metrics per class
        from fedlabels import cli

        capsys.readouterr()
        assert cli.main(["report", f"isofed={run_dir}", "--bundle", "medmnist_cnn", "--data", str(medmnist_data)]) in (0, None)
        text = capsys.readouterr().out
        assert all(f"### {m}" in text for m in ("auroc", "precision", "recall")) and "accuracy: isofed " in text


@pytest.mark.simulator
def test_semi_supervised_job_without_a_labeled_site_stops_before_round_0(tmp_path):
    data = generate("medmnist", tmp_path / "nolab", seed=0, sites=2, cases=32, test_cases=8, labeled=[])
    with pytest.raises(RuntimeError, match="did not finish"):
        simulate_job(job("isofed_medmnist"), data, tmp_path)
    text = (tmp_path / "isofed_medmnist.log").read_text()
    # the method's declared need (Method.refusal), before its server rule is set up
    assert "method isofed: isofed needs a site that annotates every class; none of ['site-1', 'site-2'] does" in text
    assert "round 0 site-" not in text  # no round was trained


@pytest.mark.simulator
def test_fedmlp_sends_prototypes_from_the_last_warmup_round_and_tags_in_stage_2(job_runs):
    """The real simulator with warmup_rounds=1: round 0 is the warm-up, whose updates already carry the
    prototypes of the site's annotated classes and the degree (the sent record shows exactly these extras);
    in round 1 the sites tag missing labels from the global prototypes. Does not assert anything about
    accuracy (2 rounds on 16 cases)."""
    run_dir, log = job_runs("fedmlp_cxr")
    recs = rounds(run_dir)
    for site, own in (("site-1", {"0", "1", "2"}), ("site-2", {"1", "2", "3"})):
        assert "tags_total" not in recs[0]["sites"][site] and recs[1]["sites"][site]["tags_total"] > 0, site
        sent = [json.loads(line) for line in (run_dir.parents[1] / site / "fedlabels_sent" / f"{site}.jsonl")
                .read_text().splitlines()]
        trains = [e for e in sent if e["task"] == "train"]
        assert len(trains) == 2
        for e in trains:
            extras = e["meta"]["extras"]
            assert set(extras) == {"prototypes", "degree"}, extras
            assert set(extras["prototypes"]) <= own and extras["prototypes"], (site, extras["prototypes"])
    assert "prototype for class" not in log.read_text()  # the server dropped none


def _cxr(*names):
    return [("cxr_data", None, smoke(name), {}) for name in names]


# The shared runs each test asks for, started in the background as the session starts (tests/conftest.py).
SHARED_RUNS = {
    "test_every_cxr_job_runs_in_the_simulator": lambda p: _cxr(p["name"]),
    "test_multiclass_and_segmentation_jobs_run_in_the_simulator":
        lambda p: [(*other_task(p["name"], p["changes"])[0], other_task(p["name"], p["changes"])[1], {})],
    "test_simulated_sites_share_the_cores_without_fedlabels_simulate": lambda p: [("cxr_data", None, *HALF)],
    "test_flare_and_in_process_engine_give_the_same_weights": lambda p: _cxr(p["name"]),
    "test_sites_taking_turns_in_fewer_processes_continue_their_state":
        lambda p: _cxr("fedbn_cxr") + [("cxr_data", None, job("fedbn_cxr"), {"threads": 1})],
    "test_bad_updates_and_crashes_are_dropped_and_rounds_complete":
        lambda p: [("cxr_data", None, FAULT_RUN, {})],
    "test_a_run_that_never_aggregates_fails_with_the_reason":
        lambda p: [("cxr_data", None, job("fedavg_cxr", faults=NEVER_AGGREGATES), {})],
    "test_half_precision_transfer_runs_in_the_simulator": lambda p: [("cxr_data", None, *HALF)] + _cxr("fedavg_cxr"),
    "test_one_configuration_reaches_server_and_sites": lambda p: _cxr("fedprox_cxr"),
    "test_fedbn_batch_norm_never_leaves_a_site_and_its_personal_model_carries_it": lambda p: _cxr("fedbn_cxr"),
    "test_semi_supervised_jobs_run_in_the_simulator":
        lambda p: [("medmnist_data", None, semi_supervised(p["name"]), SEMI_SUPERVISED_THREADS.get(p["name"], {}))],
    "test_fedmlp_sends_prototypes_from_the_last_warmup_round_and_tags_in_stage_2": lambda p: _cxr("fedmlp_cxr"),
}
