"""``fedlabels bench`` on the embedded mixed scenario (a site annotating every class, two annotating a half
each, one annotating none): every registered method either runs, its sites doing what the method declares
(``Method.site_roles``), or is refused before any cell with one line naming what it lacks."""

from __future__ import annotations

import json

import pytest
from fedlabels import methods
from helpers import run_cli

BENCH = ["bench", "--data", "embedded:mixed", "--synth", "cases=64", "--synth", "test_cases=16", "--bundle",
         "cxr_resnet18", "--seeds", "0", "--rounds", "1", "--batch-size", "8", "--network", "widen_factor=0.25",
         "--image-size", "28"]
SITES = ["site-1", "site-2", "site-3", "site-4"]
# refused for a reason outside the sites' labels: FedBN's global model is not scored; FedBN+ needs pretrained
# batch norm (init_ckpt)
NOT_SCORED = {"fedbn": "its sites keep their batch norm", "fedbn_plus": "init_ckpt"}


def served() -> list:
    return [n for n in methods.names() if "multilabel" in methods.get(n).tasks and n not in NOT_SCORED]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed") / "out"
    code, stdout, stderr = run_cli(BENCH + ["--methods", ",".join(served()), "--out", out])
    assert code == 0, stderr
    return out


def test_every_method_that_serves_the_sites_runs_and_its_sites_do_what_it_declares(run):
    roles = {"site-1": methods.LABELED, "site-4": None}
    for name in served():
        cell = json.loads((run / "cells" / f"{name}-seed0.json").read_text())
        record = cell["records"][0]
        declared = methods.get(name).site_roles({s: _summary(run, s) for s in SITES})
        assert declared["site-1"] == roles["site-1"] and None not in declared.values(), name
        # a site abstains exactly where its method declares it does (site-4 annotates nothing)
        abstained = {s for s in SITES if s in record["abstained"]}
        assert abstained == {s for s, r in declared.items() if r == methods.ABSTAINS}, (name, record["abstained"])
        assert record["sites"]["site-1"]["n"] > 0
    composed = json.loads((run / "cells" / "composed-seed0.json").read_text())["records"][0]
    assert [s["name"] for s in composed["steps"]] == ["unlabeled", "labeled"]
    assert composed["sites"]["site-4"]["n"] > 0  # it trains on its images without labels


def _summary(run, site):
    from fedlabels.profile import load_scenario

    return load_scenario(run / "data" / "mixed-seed0", sites=[site], with_test=False).site(site).summary()


@pytest.mark.parametrize("name", [n for n in methods.names() if "multilabel" not in methods.get(n).tasks]
                         + sorted(NOT_SCORED))
def test_a_method_that_cannot_serve_the_federation_is_refused_before_any_cell(name, tmp_path):
    out = tmp_path / "out"
    code, _, stderr = run_cli(BENCH + ["--methods", name, "--out", out])
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    m = methods.get(name)
    reason = NOT_SCORED.get(name) or f"{name} handles {'/'.join(m.tasks)} tasks, not multilabel"
    assert reason in stderr
    assert not (out / "cells").exists()


def test_a_training_epoch_never_ends_with_a_batch_of_one_case(run):
    """Batch norm cannot normalise one case (torch raises), so a training loader whose last batch would
    hold one case drops it; validation keeps every case. site-3 of this scenario has 17 training cases."""
    from fedlabels.bundle import bundle_path
    from fedlabels.site import setup_site

    st = setup_site(bundle_path("cxr_resnet18"), run / "data" / "mixed-seed0", "site-3", batch_size=8,
                    config={"image_size": 28})
    cases = len(st.site.training)
    assert cases % 8 == 1
    sizes = [len(b["image"]) for b in st.train_loader]
    assert sizes == [8] * (cases // 8)
    assert sum(len(b["image"]) for b in st.val_loader) == len(st.site.validation)


def test_fedlabels_methods_with_data_says_which_methods_serve_the_sites_and_how(run):
    code, out, err = run_cli(["methods", "--data", run / "data" / "mixed-seed0"])
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert set(lines) == set(methods.names())
    assert lines["isofed"].endswith("refused: isofed handles multiclass tasks, not multilabel")
    assert "site-4 trains on its images without labels" in lines["composed"]
    assert "site-2 trains on the classes it annotates only" in lines["surgical"]
    assert f"site-4 {methods.ABSTAINS}" in lines["surgical"]
