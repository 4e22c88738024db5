"""The composed method's job (``composed_mixed``) in the real nvflare simulator on the embedded mixed
scenario (4 sites: every class / a half / the other half / none; 2 rounds), the same weights as the
in-process engine, and its model exported as a clinical bundle that MONAI's bundle runner runs.

The composition itself is checked against hand-computed rounds in tests/unit/test_composed.py."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from monai.bundle import run as bundle_run

from fedlabels import references
from fedlabels.bundle.workflows import export_bundle
from shared_runs import job

pytestmark = pytest.mark.simulator

REPO = Path(__file__).resolve().parents[2]
SITES = ["site-1", "site-2", "site-3", "site-4"]
SPEC = job("composed_mixed", sites=4, min_sites=4, image_size=28)

# started in the background as the session starts (tests/conftest.py)
SHARED_RUNS = {name: (lambda p: [("mixed_data", None, SPEC, {})]) for name in (
    "test_the_composed_job_isolates_the_unlabeled_site_and_matches_the_in_process_engine",
    "test_the_composed_model_exports_as_a_clinical_bundle_that_monai_runs")}


@pytest.fixture(scope="module")
def run(sim_run, mixed_data):
    return sim_run(SPEC, mixed_data)


def test_the_composed_job_isolates_the_unlabeled_site_and_matches_the_in_process_engine(run, mixed_data):
    run_dir, log = run
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in recs] == [0, 1]
    for r in recs:
        assert [(s["name"], s["sites"]) for s in r["steps"]] == [("unlabeled", ["site-4"]),
                                                                ("labeled", ["site-1", "site-2", "site-3"])]
        assert all(s["aggregated"] for s in r["steps"]) and not r["dropped"] and not r["abstained"]
        assert all(r["sites"][s]["n"] > 0 for s in SITES)  # site-4 trains on its images without labels
    text = log.read_text()
    assert "isolated step: ['site-4'] train first from the global model" in text
    assert "head: class-wise over the annotating sites" in text
    # the controller and the in-process loop run the same engine: the same global weights (1e-6)
    cfg = SPEC.run
    setups = references.setups(REPO / "bundles" / cfg.bundle, mixed_data, batch_size=cfg.data.batch_size,
                               seed=cfg.seed, config=cfg.bundle_config() or None, method=SPEC.method,
                               network_overrides=cfg.network or None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = references.federate(SPEC.method, setups, SPEC.rounds, seed=cfg.seed, client_options=cfg.client,
                                  server_options=cfg.server or None, log=None)
    finally:
        torch.set_num_threads(threads)
    flare = torch.load(run_dir / "app_server" / "FL_global_model.pt", weights_only=False)["model"]
    assert set(flare) == set(out["last"])
    for k, v in out["last"].items():
        np.testing.assert_allclose(np.asarray(flare[k]), v, rtol=0, atol=1e-6, err_msg=k)


def test_the_composed_model_exports_as_a_clinical_bundle_that_monai_runs(run, mixed_data, tmp_path):
    run_dir, _ = run
    exp = export_bundle("cxr_resnet18", run_dir / "app_server" / "best_FL_global_model.pt", tmp_path / "exp",
                        run=run_dir, data=mixed_data)
    meta = json.loads((exp / "configs" / "metadata.json").read_text())
    classes = ["disc", "ring", "square", "cross", "pair", "bar", "triangle", "ellipse"]
    assert meta["class_names"] == classes and meta["provenance"]["method"] == "composed"
    shipped = torch.load(exp / "models" / "model.pt", weights_only=True)
    state = torch.load(run_dir / "app_server" / "best_FL_global_model.pt", weights_only=False)["model"]
    assert set(shipped) == set(state) and all(torch.equal(shipped[k], torch.as_tensor(state[k])) for k in shipped)
    inputs = tmp_path / "in"
    inputs.mkdir()
    for f in sorted((mixed_data / "test" / "images").glob("*.png"))[:2]:
        (inputs / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "out"
    bundle_run(config_file=str(exp / "configs" / "inference.json"), meta_file=str(exp / "configs" / "metadata.json"),
               logging_file=False, bundle_root=str(exp), dataset_dir=str(inputs), output_dir=str(out), device="cpu")
    with open(out / "predictions.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2
    probs = [[float(r[c]) for c in classes] for r in rows]
    assert all(0.0 <= p <= 1.0 for row in probs for p in row)
