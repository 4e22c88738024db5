"""What the partial-label rules change on the classes only one site annotates.

The embedded ``cxr`` scenario follows FedPSL's Table I: infiltration is
annotated only at site-1, pneumothorax only at site-4, yet both findings occur
at every site. Naive FedAvg trains the other three sites' cases as negatives,
so it learns P(finding) x P(the case is annotated for it), a fraction of the
true probability: it under-calls those findings. FedPSL trains each class
only where it is annotated and weights its head row by the annotated counts,
so it does not.

Checked at the budget CI affords (ResNet18 from scratch, sites of 150/90/240/120
cases, 10 rounds of one epoch: about 80 local steps per site), on what held in
each of three seeds there:

* calibration (mean predicted probability over the fully labeled test split /
  prevalence): naive FedAvg under-calls both findings (below 0.5), FedPSL calls
  them at more than 3x naive FedAvg's ratio;
* the head: naive FedAvg's head rows for the single-site classes have a
  negative mean, below FedPSL's (benchmarks/partial_label_study.py measures
  it growing with the budget, and the naive logit falling as the features'
  total activation rises).

What is *not* asserted: any AUROC ordering. At this budget none holds across
seeds; the study finds the partial-loss and class-wise head rules ahead of
naive FedAvg on the single-site classes in every seed only from about 570
local steps per site (docs/results/partial-labels.md, "Partial labels at a realistic budget"), and
FedPSL with its TADL step not ahead even then.

Runs the methods' own client and server rules (``references.federate``), each seed
in its own single-thread process, the two seeds at once (the thresholds below were
measured single-threaded): about 4 minutes on 2 cores alone; under ``make test`` they
start with the session and run beside the other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedlabels.data.synthetic import CXR_CLASSES, CXR_SITE_CLASSES

pytestmark = pytest.mark.claims

SINGLE = [c for c in CXR_CLASSES if sum(c in s for s in CXR_SITE_CLASSES) == 1]
METHODS = ("fedavg", "fedpsl")
SEEDS = (0, 1)


def measure(seed: int, out_dir: Path) -> dict:
    """Expected/observed ratio (p̄ / prevalence) of each single-site class on the test split, and the
    mean of its head row, per method; one torch thread."""
    import torch

    from fedlabels.bundle import bundle_path
    from fedlabels.data.synthetic import generate
    from fedlabels.references import federate, setups
    from fedlabels.scoring import Scorer

    torch.set_num_threads(1)
    data = generate("cxr", out_dir / "cxr", seed=seed, cases=150, test_cases=600)
    bundle = bundle_path("cxr_resnet18")
    scorer = Scorer(bundle, data, groups=False)
    out = {}
    for method in METHODS:
        st = setups(bundle, data, seed=seed)
        weights = federate(method, st, rounds=10, seed=seed, log=None, client_options={"lr": 1e-3, "epochs": 1})["last"]
        per_class = scorer.evaluate(weights)["per_class"]
        out[method] = {c: per_class[c]["eo_ratio"] for c in SINGLE}
        head = scorer.net.head.weight.detach()  # evaluate() loaded the weights
        out[f"{method}/head"] = {c: float(head[CXR_CLASSES.index(c)].mean()) for c in SINGLE}
    out["threads"] = torch.get_num_threads()
    return out


def test_the_scenario_has_single_site_classes():
    assert SINGLE == ["infiltration", "pneumothorax"]


_STARTED = {}  # seed -> (process, its folder): started once per session


def start(tmp_path_factory) -> dict:
    """Both seeds' processes, each with one thread (OMP_NUM_THREADS=1 and torch's own setting), started once.
    tests/conftest.py starts them as the session starts (``BACKGROUND``): they mostly use the core the
    simulator runs leave idle, at a lower priority, and are read when this module's tests run."""
    if not _STARTED:
        root = tmp_path_factory.mktemp("claims")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        for seed in SEEDS:
            (root / f"seed{seed}").mkdir()
            proc = subprocess.Popen([sys.executable, __file__, str(seed), str(root / f"seed{seed}")], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    preexec_fn=lambda: os.nice(5))
            _STARTED[seed] = (proc, root / f"seed{seed}")
    return _STARTED


def stop() -> None:
    for proc, _ in _STARTED.values():
        if proc.poll() is None:
            proc.kill()


BACKGROUND = (start, stop)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = {}
    for seed, (proc, folder) in start(tmp_path_factory).items():
        text, _ = proc.communicate(timeout=1800)
        assert proc.returncode == 0, text[-3000:]
        out[seed] = json.loads((folder / "calibration.json").read_text())
        print(f"seed {seed} p̄/prevalence and head row means:",
              {m: {c: round(v, 3) for c, v in r.items()} for m, r in out[seed].items() if m != "threads"})
    return out


@pytest.fixture(params=SEEDS, ids=lambda s: f"seed{s}")
def calibration(request, measured):
    out = dict(measured[request.param])
    assert out.pop("threads") == 1
    return out


def test_naive_fedavg_under_calls_single_site_classes(calibration):
    # Missing labels taught as negatives shrink it towards the share of the class's positives
    # that some site annotates (0.25 for infiltration, 0.15 for pneumothorax here).
    for c in SINGLE:
        assert calibration["fedavg"][c] < 0.5, (c, calibration)


def test_fedpsl_calls_single_site_classes_above_naive_fedavgs_bound_and_at_over_3x_its_ratio(calibration):
    # Both rows use the same positive weighting (the shared pos_weighted default). FedPSL's ratio was
    # 0.78-6.0 over three seeds (one thread), 5.7-38x naive FedAvg's. Asserted: above the 0.5 that naive
    # FedAvg stays below (the under-calling of the test above), and more than 3x naive FedAvg's ratio.
    # Not asserted: calibration (a ratio near 1); a floor of 0.8 failed seed 2's infiltration, 0.78.
    for c in SINGLE:
        ratio, naive = calibration["fedpsl"][c], calibration["fedavg"][c]
        assert ratio > 0.5, (c, calibration)
        assert ratio > 3 * naive, (c, calibration)


def test_naive_fedavg_turns_single_site_head_rows_negative(calibration):
    # Three of four sites train a single-site class as all-negative: the mean of its head row goes
    # below zero (benchmarks/results/partial_label_study: at every budget point and seed), so the
    # logit falls as the features' total activation rises. FedPSL trains the row only where the
    # class is annotated.
    for c in SINGLE:
        assert calibration["fedavg/head"][c] < 0, (c, calibration)
        assert calibration["fedavg/head"][c] < calibration["fedpsl/head"][c], (c, calibration)


if __name__ == "__main__":  # one seed's measurement, in its own process (the ``measured`` fixture)
    seed, out_dir = int(sys.argv[1]), Path(sys.argv[2])
    (out_dir / "calibration.json").write_text(json.dumps(measure(seed, out_dir)))
