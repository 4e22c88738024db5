"""The clinical evidence an exported bundle carries (``fedlabels.bundle.card``), against
hand-computed values and small reference loops, on data where the rules differ from 0.5."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from fedlabels.bundle import card
from fedlabels.bundle.data import SaveMaskd
from fedlabels.bundle.handlers import PredictionCSVWriter


def test_youden_threshold_by_hand():
    y = np.array([0, 0, 1, 1, 0, 1])
    p = np.array([0.1, 0.3, 0.35, 0.8, 0.2, 0.9])
    # cut 0.35 calls the three positives and no negative (J = 1); 0.5 would miss the one at 0.35
    assert card.youden_threshold(y, p) == pytest.approx(0.35)
    assert card.youden_threshold(np.ones(4), np.linspace(0, 1, 4)) is None
    assert card.youden_threshold(np.zeros(4), np.linspace(0, 1, 4)) is None
    # a score that ranks every negative above every positive: no cut beats chance, none is chosen
    assert card.youden_threshold(np.array([1, 1, 0, 0]), np.array([0.1, 0.2, 0.8, 0.9])) is None


def test_dice_threshold_by_hand():
    probs = np.array([[0.9, 0.6, 0.3, 0.1], [0.2, 0.25, 0.7, 0.05]])
    masks = np.array([[1, 1, 1, 0], [0, 1, 1, 0]])
    # 0.25 gives both cases their exact masks (mean Dice 1); 0.5 scores (0.8 + 0.667) / 2
    assert card.dice_threshold(probs, masks) == 0.25
    assert card.dice_threshold(np.zeros((0, 4)), np.zeros((0, 4))) is None


def test_thresholds_use_only_the_cases_that_annotate_the_class():
    probs = np.array([[0.35, 0.9], [0.3, 0.1], [0.9, 0.2], [0.1, 0.8]])
    labels = np.array([[1, -1], [0, -1], [-1, 0], [0, 1]])
    t = card.choose_thresholds("multilabel", probs, labels, ["a", "b"])
    # a: cases 0, 1, 3 (p 0.35+, 0.3-, 0.1-) -> 0.35; b: cases 2, 3 (0.2-, 0.8+) -> 0.8
    assert t == pytest.approx({"a": 0.35, "b": 0.8})
    assert card.choose_thresholds("multiclass", probs, labels, ["a", "b"]) == {}
    assert card.choose_thresholds("multilabel", None, None, ["a", "b"]) == {"a": None, "b": None}  # no validation


def test_auroc_interval_matches_a_stratified_reference_bootstrap():
    rng = np.random.default_rng(0)
    y = np.r_[np.ones(30), np.zeros(50)].astype(int)
    p = np.r_[rng.normal(1, 1, 30), rng.normal(0, 1, 50)]
    lo, hi = card.auroc_ci(y, p, n_resamples=4000)
    ref_rng = np.random.default_rng(1)
    pos, neg = p[y == 1], p[y == 0]
    ref = []
    for i in range(4000):  # resample positives and negatives apart; score by the AUROC's definition
        a, b = ref_rng.choice(pos, len(pos)), ref_rng.choice(neg, len(neg))
        # P(positive > negative) + P(tie) / 2 over every pair (sklearn took 4000 x 25 ms on a loaded 2-core machine)
        ref.append(((a[:, None] > b[None, :]).mean() + 0.5 * (a[:, None] == b[None, :]).mean()))
        if i < 50:  # the definition is sklearn's AUROC
            assert ref[-1] == pytest.approx(roc_auc_score(np.r_[np.ones(len(a)), np.zeros(len(b))], np.r_[a, b]))
    assert lo == pytest.approx(np.percentile(ref, 2.5), abs=0.02)
    assert hi == pytest.approx(np.percentile(ref, 97.5), abs=0.02)
    assert lo < roc_auc_score(y, p) < hi and hi - lo > 0.1
    assert card.auroc_ci([1, 0, 0, 0], [0.9, 0.1, 0.2, 0.3]) is None  # one positive: no interval


def test_wilson_interval_by_hand():
    k, n, z = 8, 10, 1.959963984540054
    centre = (k + z * z / 2) / (n + z * z)
    half = z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    out = card.proportion(k, n)
    assert out["value"] == 0.8 and out["n"] == 10
    assert out["ci"] == pytest.approx([centre - half, centre + half], abs=1e-9)
    assert card.proportion(0, 0) == {"value": None, "ci": None, "n": 0}


def test_test_report_scores_at_the_chosen_thresholds():
    probs = np.array([[0.35], [0.8], [0.3], [0.2], [0.9], [0.4]])
    labels = np.array([[1], [1], [0], [0], [1], [-1]])  # the last case does not annotate the class
    rep = card.test_report("multilabel", probs, labels, ["a"], {"a": 0.35})
    m = rep["per_class"]["a"]
    assert (m["n_pos"], m["n_neg"]) == (3, 2)
    assert m["sensitivity"]["value"] == 1.0 and m["specificity"]["value"] == 1.0
    rep = card.test_report("multilabel", probs, labels, ["a"], {"a": 0.5})
    assert rep["per_class"]["a"]["sensitivity"]["value"] == pytest.approx(2 / 3)
    assert "sensitivity" not in card.test_report("multilabel", probs, labels, ["a"], {"a": None})["per_class"]["a"]


def test_limitations_name_single_site_and_unlabeled_classes():
    # which site labels a class comes from its declared label set, not from (possibly noised) counts
    table = {"h1": {"labels": {"a": True, "b": True, "c": False}, "annotated": {"a": 5, "b": 0, "c": 0}},
             "h2": {"labels": {"a": True, "b": False, "c": False}, "annotated": {"a": 3, "b": 2, "c": 0}}}
    meta = {"class_names": ["a", "b", "c"], "training": {"label_table": table},
            "decision_thresholds": {"a": 0.4, "b": 0.3, "c": None},
            "test_metrics": {"per_class": {"a": {"n_pos": 40}, "b": {"n_pos": 4}, "c": {"n_pos": 30}}}}
    lines = card.limitations(meta)
    assert not any(line.startswith("`a`") for line in lines)
    assert any("`b`: only h1 annotated it" in line for line in lines)
    assert any("`b`: 4 test positives" in line for line in lines)
    assert any("`c`: no training site annotated it" in line for line in lines)
    assert any("`c`: no threshold could be chosen" in line for line in lines)
    meta["test_metrics"] = None
    assert any("Not evaluated on a held-out test set" in line for line in card.limitations(meta))


def test_prediction_rows_carry_decisions_at_each_class_threshold():
    w = PredictionCSVWriter("x.csv", ["a", "b", "c"], thresholds={"a": 0.3, "b": 0.6, "c": None})
    assert w.header() == ["image", "a", "b", "c", "a_positive", "b_positive", "c_positive"]
    assert w.row("im.png", [0.3, 0.5, 0.9]) == ["im.png", "0.300000", "0.500000", "0.900000", "1", "0", ""]
    w = PredictionCSVWriter("x.csv", ["a", "b", "c"], decision="argmax")
    assert w.row("im.png", [0.2, 0.5, 0.3])[-1] == "b" and w.header()[-1] == "predicted"
    assert PredictionCSVWriter("x.csv", ["a"]).header() == ["image", "a"]
    with pytest.raises(ValueError, match="unknown classes"):
        PredictionCSVWriter("x.csv", ["a"], thresholds={"z": 0.5})


def test_masks_follow_the_kind_of_input(tmp_path):
    s = SaveMaskd("pred", tmp_path)
    assert [s.ext_for(f) for f in ("a.png", "b.JPG", "c.nii", "d.nii.gz", "e.dcm")] == \
        [".png", ".png", ".nii.gz", ".nii.gz", ".nii.gz"]
    assert SaveMaskd("pred", tmp_path, output_ext=".nii.gz").ext_for("a.png") == ".nii.gz"


def test_the_card_names_the_round_and_the_sites_the_best_model_comes_from(tmp_path):
    """The round the best model comes from is what the controller recorded (progress.json), not guessed
    by matching scores: here round 0's mean equals the best score, yet round 2 was the best (scored
    over site-1 alone once site-2 was lost)."""
    import json

    from fedlabels.run import Run
    from fedlabels.config import FILE, RunConfig

    run = tmp_path / "run"
    RunConfig(method="fedavg").save(run / "app_server" / "custom" / FILE)
    (run / "progress.json").write_text(json.dumps({"next_round": 3, "best": 0.7, "method": "fedavg",
                                                   "best_round": 2, "best_scored_by": ["site-1"]}))
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"round": 0, "sites": {"site-1": {}, "site-2": {}}, "mean_val_auroc": 0.7},
        {"round": 1, "sites": {"site-1": {}, "site-2": {}}, "mean_val_auroc": 0.6},
        {"round": 2, "sites": {"site-1": {}}, "mean_val_auroc": 0.7, "scored_by": ["site-1"]}]) + "\n")
    prov = Run(run).provenance(run / "app_server" / "best_FL_global_model.pt")
    assert prov["model_after_rounds"] == 2 and prov["best_scored_by"] == ["site-1"]
    text = card.model_card({"name": "x", "class_names": ["a"], "provenance": prov})
    assert "The model after round(s): 2" in text
    assert "Chosen as the best on the validation data of: site-1" in text
