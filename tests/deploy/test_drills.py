"""Fault drills on a real provisioned federation on loopback (``make test-drills``, before a release; not in CI).

The same federation as tests/deploy/test_federation.py (the ``fed`` fixture, tests/deploy/conftest.py;
the helpers are tests/deploy/loopback.py), started for this module. The tests run in file order on it:
malformed data at one hospital stops the job before round 0; hostile replies and a stalled hospital are
dropped; a hospital killed mid-round is left out; the server killed at several points of a job, each time
resumed to the uninterrupted model, then one hospital without its saved state.

The killed hospital is killed while it holds its trained round-1 update (the
``hang`` fault drill: it never sends it), so the test does not depend on how fast
the machine is: the hospital cannot have finished round 1 before the kill.

Two deployment settings are shortened so that the fault tests take seconds,
not the 10 minutes of nvflare's defaults: the server's heartbeat timeout
(``local/resources.json``) and the grace before a silent site is declared
dead (``NVFLARE_DEAD_CLIENT_GRACE_PERIOD``, ``..._CHECK_LEAD_TIME``; tests/deploy/conftest.py).
docs/deployment.md says where an IT team sets them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch


from fedlabels.flare.local_federation import Participant, wait_for_sites
from loopback import (HANG, JOB, REPO, SERVER_ENV, SITES, SITE_TIMEOUT, _result, nvflare, site_log, submit,
                      wait_for_line, wait_for_round)

pytestmark = [pytest.mark.deploy, pytest.mark.drills]


def test_a_hospital_with_malformed_data_stops_the_job_before_round_0(fed):
    """The production job folder, its audit filter deleted from its configuration by hand, through
    nvflare's own admin CLI: site-2's malformed datalist stops the job before round 0, and each hospital's
    own record (its kit's local/privacy.json) still holds what it sent, the job's record nothing."""
    t0 = time.time()
    datalist = fed["data"]["site-2"] / "site-2" / "datalist.json"
    good = datalist.read_text()
    datalist.write_text(good.replace('"label"', '"labels"', 1))
    kit = ["--startup-kit", str(fed["admin"])]
    folder = subprocess.run([sys.executable, str(JOB), "--out", str(fed["tmp"] / "jobs"), "--config-only"],
                            capture_output=True, text=True, check=True).stdout.strip()
    client_config = Path(folder) / "app" / "config" / "config_fed_client.json"
    config = json.loads(client_config.read_text())
    assert [f["path"] for c in config["task_result_filters"] for f in c["filters"]] == ["fedlabels.flare.sent.SentRecord"]
    config["task_result_filters"] = []
    client_config.write_text(json.dumps(config))
    try:
        # the production job folder through nvflare's own admin CLI (docs/deployment.md, "Submit")
        out = nvflare("job", "submit", "-j", folder, *kit)
        job_id = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", out).group(0)
        assert job_id in nvflare("job", "list", *kit)
        nvflare("job", "wait", job_id, "--timeout", "180", *kit, check=False)
        status = nvflare("job", "meta", job_id, *kit)
        nvflare("job", "download", job_id, "-o", str(fed["tmp"] / "bad"), *kit)
    finally:
        datalist.write_text(good)
    assert "FINISHED:COMPLETED" not in status and "FINISHED" in status, status
    result = fed["tmp"] / "bad"
    log = next(result.rglob("workspace/log.txt")).read_text()
    # the hospital's message reaches the admin's download naming the field, not the hospital's path or
    # file name; the hospital's own log has the full message
    told = re.findall(r"site-2: <local file>[^\n]*", log)
    assert told and "label" in told[0] and str(datalist) not in log and "datalist.json" not in log, told
    own = "".join(p.read_text() for p in fed["kits"]["site-2"].rglob(f"{job_id}/log.txt"))
    assert str(datalist) in own and "label" in own
    assert not list(result.rglob("metrics.jsonl"))  # no round ran
    for site, task in (("site-1", "summary"), ("site-2", "fatal")):  # site-1's label summary, site-2's error
        records = fed["kits"][site] / "fedlabels_sent"
        own = [e for e in map(json.loads, (records / f"{site}.site.jsonl").read_text().splitlines()) if e["time"] > t0]
        assert [e["task"] for e in own] == [task], own
        job_record = records / f"{site}.jsonl"
        assert not job_record.exists() or all(json.loads(line)["time"] < t0
                                              for line in job_record.read_text().splitlines())


def test_hostile_replies_and_a_stalled_hospital_are_dropped_and_the_job_finishes(fed):
    """Surgical Aggregation (its rule reads each site's per-class labeled mask) for 8 rounds. site-2 sends
    what a broken or hostile site could (a case count that is no number, one far above what it declared at
    the handshake, weights of another dtype, extras that are no mapping, an infinite validation score, a
    weight of the right shape holding text, a labeled mask of text) and, in round 1, answers only after the
    server's site_timeout; with the first and the third it sends a key metric that is text, then NaN. (site-1's
    validation split is too small for an AUROC: site-2 alone scores.) Each update is dropped with its reason
    in metrics.jsonl, no score that is not a finite number is scored, and every round goes on (tests/simulator/test_flare_runs.py drills the other kinds in the simulator)."""
    job_id, status, result = submit(fed, "--rounds", "8", "--min-sites", "1", "--site-timeout", str(SITE_TIMEOUT),
                                    name="surgical_cxr",
                                    faults=["site-2:n_text:0", "site-2:metric_text:0", "site-2:stall:1",
                                            "site-2:dtype:2", "site-2:metric_nan:2", "site-2:n_huge:3",
                                            "site-2:extras:4", "site-2:metric:5", "site-2:strings:6",
                                            "site-2:mask:7"])
    assert status == "FINISHED:COMPLETED"
    recs = [json.loads(line) for line in (result / "workspace" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in recs] == list(range(8)) and all(r["aggregated"] for r in recs)
    assert [sorted(r["dropped"]) for r in recs] == [["site-2"]] * 5 + [[], ["site-2"], ["site-2"]]
    reasons = [r["dropped"]["site-2"] for r in recs[:5]]
    assert "case count 'many' is not a positive integer" in reasons[0]
    assert "no result" in reasons[1]  # stalled past the timeout
    assert "dtype of" in reasons[2] and "float64" in reasons[2]
    assert "exceeds the" in reasons[3]
    assert "extras are a list" in reasons[4]
    assert "dtype of" in recs[6]["dropped"]["site-2"] and "<U" in recs[6]["dropped"]["site-2"], recs[6]["dropped"]
    assert "could not convert string to float: 'yes'" in recs[7]["dropped"]["site-2"], recs[7]["dropped"]
    # a score is the site's validation of the model it received: it counts when its update is dropped
    assert [r["scored_by"] for r in recs] == [[], [], [], ["site-2"], ["site-2"], [], ["site-2"], ["site-2"]], recs
    assert sorted(recs[5]["sites"]) == list(SITES)  # site-2's update counts; its score does not
    log = (result / "workspace" / "log.txt").read_text()
    assert f"did not answer within {SITE_TIMEOUT}s (site_timeout)" in log
    assert re.search(r"round 0 site-2: metric 'val_\w+'='high' is not a number: left out of the record", log), \
        log[-3000:]
    for rnd, value in [(2, "nan"), (5, "inf")]:
        assert re.search(rf"round {rnd} site-2: val_\w+={value} is not finite: not scored", log), log[-3000:]


def test_a_killed_hospital_is_left_out_and_the_job_finishes(fed):
    t0 = time.time()
    proc = submit(fed, "--rounds", "2", "--min-sites", "1", wait=False, faults=["site-2:hang:1"])
    try:
        # round 0 aggregated from both; site-2 has trained round 1 and holds its update (the hang drill)
        wait_for_round(fed["kits"]["localhost"], 1, t0, proc)
        wait_for_line(fed["kits"]["site-2"], "fault drill: site-2 hangs in round 1", t0, proc)
        fed["sites"]["site-2"].stop()  # SIGKILL to the whole hospital: no goodbye to the server
        out, _ = proc.communicate(timeout=HANG)
    finally:
        proc.kill()
        fed["sites"]["site-2"].start()
    job_id, status, result = _result(out)
    assert status == "FINISHED:COMPLETED"
    rounds = [json.loads(line) for line in (result / "workspace" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1]
    assert sorted(rounds[0]["sites"]) == list(SITES)
    assert list(rounds[-1]["sites"]) == ["site-1"]  # the round went on with the hospital that stayed
    wait_for_sites(fed["admin"], SITES)


def test_a_server_killed_at_any_point_resumes_to_the_uninterrupted_model(fed):
    """fedbn_cxr for 4 rounds (each hospital keeps its own batch norm and its Adam moments from round to
    round), the server stopped five times and the job resumed each time from the folder the stopped
    server left: the whole server killed (SIGKILL) wherever it is once round 0 is aggregated, then
    restarted; then the fault drill once the hospitals have answered round 2 (they hold their round-2
    state, the server wrote nothing of the round); once round 3 is aggregated but before anything of it is written;
    after round 3's checkpoint, progress.json and metrics but before its model file; and, from the same
    folder again, after everything of round 3 but before the final evaluation (the job resumed from there
    has no round left: it validates the checkpoint's model with the sites' saved state). Each leg finds its
    drill's line in the server's log and the files it should have left behind. That global model equals 4 uninterrupted rounds
    of the in-process engine, the engine the FLARE controller runs
    (FLARE = in-process: tests/simulator/test_flare_runs.py). Then site-2 loses its saved state and the last round is
    resumed again: it joins from the global model, restarted with its own rules (its privacy.json): its
    batch norm never leaves it, which its record of what it sent shows, and its label summary leaves
    noised, which the server's log shows."""
    from fedlabels.bundle import network
    from fedlabels.checkpoint import read_checkpoint
    from fedlabels.flare.job import JOBS
    from fedlabels.flare.provision import SITE_NOISE, site_policy
    from fedlabels.nets import batchnorm_keys
    from fedlabels.references import federate, setups

    server_kit = fed["kits"]["localhost"]
    t0 = time.time()
    proc = submit(fed, "--rounds", "4", wait=False, name="fedbn_cxr")
    try:
        progress = wait_for_round(server_kit, 1, t0, proc)
        fed["server"].stop()
    finally:
        proc.kill()
        proc.communicate()
    first = progress.parent
    next_round, run = (json.loads(progress.read_text())[k] for k in ("next_round", "run"))
    assert next_round in (1, 2), next_round  # stopped in round 1 (or 2 on a fast machine), before the drills' round
    fed["server"] = Participant(server_kit, env=SERVER_ENV).start()
    wait_for_sites(fed["admin"], SITES)

    def leg(resume_from, *faults):
        job_id, status, result = submit(fed, "--rounds", "4", "--resume-from", str(resume_from), faults=faults,
                                        name="fedbn_cxr")
        assert status == "FINISHED:COMPLETED", status
        log = (result / "workspace" / "log.txt").read_text()
        assert f"resuming from {resume_from}: round " in log
        metrics = result / "workspace" / "metrics.jsonl"
        recs = [json.loads(line)["round"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
        # nvflare archives a finished job's run folder into its job store: resumed from the admin's download
        return result / "workspace", job_id, log, recs

    def states(site):
        (folder,) = fed["kits"][site].rglob(f"fedlabels_state/{run}/{site}")
        return sorted(p.name for p in folder.iterdir())

    b, job_id, log, recs = leg(first, "server:mid_round:2")
    assert "fault drill: the server dies at mid_round of round 2" in log
    assert recs == list(range(next_round, 2)), recs  # round 2 answered by the sites, never logged
    assert read_checkpoint(b, "fedbn", 4)["next_round"] == 2
    assert states("site-1") == ["round-00001.pt", "round-00002.pt"]  # its last two rounds
    def model_file(folder):
        return torch.load(folder / "app_server" / "FL_global_model.pt", weights_only=False)["model"]

    def same(a, b):
        return set(a) == set(b) and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)

    c, job_id, log, recs = leg(b, "server:before_checkpoint:3")
    assert "fault drill: the server dies at before_checkpoint of round 3" in log
    for site in SITES:  # they had trained round 2 for the stopped server: they resume the state before it
        assert f"[{site}] resumed its state of round 1" in site_log(fed, site, job_id)
    assert recs == [2]  # round 3 aggregated, nothing of it written: no line ahead of the checkpoint
    saved = read_checkpoint(c, "fedbn", 4)
    assert saved["next_round"] == 3 and json.loads((c / "progress.json").read_text())["next_round"] == 3
    assert same(model_file(c), saved["weights"])  # the model file is the checkpoint's (round 2's), never round 3's
    d, job_id, log, recs = leg(c, "server:before_model:3")
    assert "fault drill: the server dies at before_model of round 3" in log
    for site in SITES:
        assert f"[{site}] resumed its state of round 2" in site_log(fed, site, job_id)
    assert recs == [3] and read_checkpoint(d, "fedbn", 4)["next_round"] == 4  # checkpointed, its model file not:
    assert same(model_file(d), saved["weights"]) and not same(model_file(d), read_checkpoint(d, "fedbn", 4)["weights"])
    # the same round again from c, the server stopped after everything of round 3, before the final evaluation
    d2, job_id, log, recs = leg(c, "server:between_rounds:3")
    assert "fault drill: the server dies at between_rounds of round 3" in log
    final = read_checkpoint(d2, "fedbn", 4)
    assert recs == [3] and final["next_round"] == 4 and same(model_file(d2), final["weights"])
    assert same(final["weights"], read_checkpoint(d, "fedbn", 4)["weights"])  # round 3 twice from c: one model
    assert not (d2 / "cross_site_eval.json").exists()  # the final evaluation never ran
    e, job_id, log, recs = leg(d2)
    assert recs == [] and f"(run {run})" in log  # nothing left to train: the checkpoint's model, validated
    assert (e / "cross_site_eval.json").exists()
    for site in SITES:  # with the state each site saved (its own batch norm), not the initial one
        assert f"[{site}] resumed its state of round 3" in site_log(fed, site, job_id)
    resumed = model_file(e)

    spec = JOBS["fedbn_cxr"].replace(sites=2, rounds=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each hospital (OMP_NUM_THREADS=1): the same order of sums
    try:
        straight = federate("fedbn", setups(REPO / "bundles" / spec.run.bundle, fed["full"], seed=spec.run.seed,
                                            config=spec.run.bundle_config() or None),
                            4, seed=spec.run.seed, client_options=spec.run.client, log=None)["last"]
    finally:
        torch.set_num_threads(threads)
    assert set(resumed) == set(straight)
    for k in resumed:
        np.testing.assert_allclose(np.asarray(resumed[k]), straight[k], rtol=0, atol=1e-5, err_msg=k)

    # site-2 lost its saved state (a replaced machine, or a site new to the run): it joins from the global
    # model. It comes back with its own rule that batch norm never leaves it (provision --withhold-batchnorm):
    # its record of what it sent, taken after that rule and before the job's filters, holds no batch norm.
    lost = list(fed["kits"]["site-2"].rglob(f"fedlabels_state/{run}/site-2"))
    assert lost, "site-2 saved no state under its kit"
    for folder in lost:
        shutil.rmtree(folder)
    site = fed["sites"]["site-2"]
    site.stop()
    site_policy(fed["kits"]["site-2"], withhold_batchnorm=True, noise_summary=SITE_NOISE)
    # the hospital's privacy ledger, in the test's folder rather than the account's home
    site.env["FEDLABELS_PRIVACY_LEDGER"] = str(fed["tmp"] / "site-2-ledger.json")
    site.start()
    wait_for_sites(fed["admin"], SITES)
    try:
        t1 = time.time()
        f, job_id, _, recs = leg(c)
        assert recs == [3]
        assert ("[site-2] no saved state of this run before round 3" in site_log(fed, "site-2", job_id)
                and "joins from the global model" in site_log(fed, "site-2", job_id))
        last = json.loads((f / "metrics.jsonl").read_text().splitlines()[-1])
        assert sorted(last["sites"]) == list(SITES)  # both trained the last round
        bn = set(batchnorm_keys(network(REPO / "bundles" / spec.run.bundle)))
        for site, has_bn in (("site-1", True), ("site-2", False)):
            lines = (fed["kits"][site] / "fedlabels_sent" / f"{site}.site.jsonl").read_text().splitlines()
            trained = [e for e in map(json.loads, lines) if e["time"] > t1 and e["task"] == "train"]
            assert len(trained) == 1 and bool(bn & set(trained[0]["weights"])) == has_bn, \
                (site, sorted(trained[0]["weights"])[:5])
        assert re.search(r"withheld \d+ batch-norm entries", site_log(fed, "site-2", job_id))
        # and its own label-summary noise, under a job without the privacy option; the server takes it
        assert "the hospital's own label-summary noise" in site_log(fed, "site-2", job_id)
        server_log = (f / "log.txt").read_text()
        assert "privacy: site-2: label summary noised (Gaussian, noise_multiplier=1, clip=4)" in server_log
        assert "privacy: site-1" not in server_log
    finally:
        # the last test on this federation: site-2's policy file goes back to the default, and the running
        # site keeps its rules until the fixture stops it (a restart here cost CI half a minute)
        site_policy(fed["kits"]["site-2"])
        fed["sites"]["site-2"].env.pop("FEDLABELS_PRIVACY_LEDGER", None)
