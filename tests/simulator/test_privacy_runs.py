"""The privacy option in nvflare's simulator: the noised label summary in every message (the accountant, clipping and noise are tests/unit/test_privacy.py)."""

from __future__ import annotations

import json

import pytest

from fedlabels import privacy
from fedlabels.profile import load_scenario
from shared_runs import smoke
from shared_runs import PRIVACY as OPTS



SHARED_RUNS = {"test_the_server_receives_the_noised_summary_in_every_message":  # started as the session starts
               lambda p: [("cxr_data", None, smoke("fedpsl_cxr"), {})]}


@pytest.mark.simulator
def test_the_server_receives_the_noised_summary_in_every_message(sim_run, cxr_data):
    """2 sites x 2 rounds of FedPSL in nvflare's simulator with the option in fedlabels.json
    (the fedpsl_cxr smoke run of tests/simulator/test_flare_runs.py, the same run): each site's audit record
    shows the same noised counts and report in the handshake and in both training updates;
    the server logs each site's (epsilon, delta) once."""
    spec = smoke("fedpsl_cxr")
    assert spec.run.privacy == OPTS and spec.sites == 2 and spec.rounds == 2
    run_dir, log = sim_run(spec, cxr_data)
    assert json.loads((run_dir / "app_server" / "custom" / "fedlabels.json").read_text())["privacy"] == OPTS
    sc = load_scenario(cxr_data)
    for site in ("site-1", "site-2"):
        sent_record = run_dir.parents[1] / site / "fedlabels_sent" / f"{site}.jsonl"  # the audit record's default
        records = [json.loads(line) for line in sent_record.read_text().splitlines()]
        handshake = [r["meta"]["label_summary"] for r in records if r["task"] == "summary"]
        trains = [r["meta"] for r in records if r["task"] == "train"]
        assert len(handshake) == 1 and len(trains) == 2
        sent = handshake[0]
        assert sent[privacy.REPORT]["epsilon"] == pytest.approx(privacy.epsilon(1.0, 1e-5))
        for meta in trains:
            assert {k: meta[k] for k in sent} == sent
        exact = sc.site(site).summary()
        assert (sent["cases"], sent["annotated"], sent["positives"]) != (exact["cases"], exact["annotated"], exact["positives"])
    server_log = run_dir / "log.txt"
    text = server_log.read_text() if server_log.is_file() else log.read_text()
    for site in ("site-1", "site-2"):
        assert text.count(f"privacy: {site}: label summary noised") == 1, text[-3000:]
        assert f"privacy: {site}: label summary noised (Gaussian, noise_multiplier=1, clip=4): (epsilon=4.729" in text
