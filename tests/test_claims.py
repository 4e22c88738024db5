"""What the partial-label rules change on the classes only one site annotates.

The embedded ``cxr`` scenario follows FedPSL's Table I: infiltration is
annotated only at site-1, pneumothorax only at site-4, yet both findings occur
at every site. Naive FedAvg trains the other three sites' cases as negatives,
so it learns P(finding) x P(the case is annotated for it), a fraction of the
true probability: it under-calls those findings. FedPSL trains each class
only where it is annotated and weights its head row by the annotated counts,
so it does not.

Checked on calibration (mean predicted probability over the fully labeled
test split / prevalence), where the effect is structural. What is *not*
asserted, because it did not hold at this scale (ResNet18 from scratch,
sites of 150/90/240/120 cases, 10 rounds; benchmarks/results/partial_label_claim.md,
three seeds, the same configuration as here):

* an AUROC win: naive FedAvg ranks the single-site findings as well as the
  class-wise rules (missing-as-negative shrinks probabilities without
  reordering cases);
* anything for Surgical Aggregation: a single-site class's global head row is
  that one site's locally trained row, applied to the averaged features, and
  it under-called pneumothorax as much as naive FedAvg in one of three seeds;
* anything for FedAvg-PL or Surgical Aggregation's calibration (see the
  benchmark's table).

Runs the methods' own client and server rules in one process
(``references.federate``), about 4 minutes on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

from fedlabels.data.synthetic import CXR_CLASSES, CXR_SITE_CLASSES, generate
from fedlabels.bundle import bundle_path
from fedlabels import site
from fedlabels.references import federate, score, setups

SINGLE = [c for c in CXR_CLASSES if sum(c in s for s in CXR_SITE_CLASSES) == 1]
METHODS = ("fedavg", "fedpsl")


def test_the_scenario_has_single_site_classes():
    assert SINGLE == ["infiltration", "pneumothorax"]


@pytest.fixture(scope="module", params=[0, 1], ids=lambda s: f"seed{s}")
def calibration(request, tmp_path_factory):
    """Expected/observed ratio (p̄ / prevalence) of each single-site class on the test split, per method."""
    seed = request.param
    data = generate("cxr", tmp_path_factory.mktemp(f"claim{seed}") / "cxr", seed=seed, cases=150, test_cases=600)
    bundle = bundle_path("cxr_resnet18")
    tests = site.test_loader(bundle, data)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    out = {}
    try:
        for method in METHODS:
            st = setups(bundle, data, seed=seed)
            weights = federate(method, st, rounds=10, seed=seed, log=None, client_options={"lr": 1e-3, "epochs": 1})["last"]
            per_class = score(st["site-1"].net, weights, bundle, data, tests)["per_class"]
            out[method] = {c: per_class[c]["eo_ratio"] for c in SINGLE}
    finally:
        torch.set_num_threads(threads)
    print(f"seed {seed} p̄/prevalence:", {m: {c: round(v, 2) for c, v in r.items()} for m, r in out.items()})
    return out


def test_naive_fedavg_under_calls_single_site_classes(calibration):
    # Missing labels taught as negatives shrink it towards the share of the class's positives
    # that some site annotates (0.25 for infiltration, 0.15 for pneumothorax here).
    for c in SINGLE:
        assert calibration["fedavg"][c] < 0.5, (c, calibration)


def test_fedpsl_does_not_under_call_single_site_classes(calibration):
    # Both rows use the same positive weighting (the shared pos_weighted default); FedPSL's partial
    # loss calls positives generously (p̄ above prevalence); what matters here is that it does not
    # shrink them: measured 8-32x naive FedAvg's ratio (seeds 0 and 1).
    for c in SINGLE:
        ratio, naive = calibration["fedpsl"][c], calibration["fedavg"][c]
        assert ratio > 0.8, (c, calibration)
        assert ratio > 3 * naive, (c, calibration)
