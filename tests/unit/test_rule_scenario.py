"""The aggregation rules on the embedded cxr scenario's own label summaries.

The scenario has unequal site sizes (n_k) and partial annotation inside a
site (n_k^c < n_k, in site-specific proportions), so rules that differ only
in their weights give different models on it: FedAvg by n_k vs unweighted,
Surgical's unweighted class-wise head vs TDMA's n_k^c-weighted one. Each
server's output is checked against the formula written out here in NumPy,
with hand-made weights of a tiny model ("features.weight", "head.weight",
"head.bias"); what a site sends for a class it does not annotate is a
sentinel that must never reach the global head.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedlabels.data.synthetic import generate
from fedlabels.methods import Update
from fedlabels.methods.fedavg import FedAvgServer
from fedlabels.methods.fedpsl import TDMAServer
from fedlabels.methods.surgical import SurgicalServer
from fedlabels.profile import load_scenario

C, HIDDEN = 6, 3
FOREIGN = 1000.0  # a site's head row for a class it does not annotate


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    root = generate("cxr", tmp_path_factory.mktemp("rules") / "cxr", seed=0, size=16, cases=24, test_cases=2)
    sc = load_scenario(root)
    return {name: sc.site(name).summary() for name in sc.sites}


def site_weights(k: int, mask) -> dict:
    """Hand-made weights of site k (0-based): every entry differs between sites."""
    s = float(k + 1)
    features = s * np.arange(1, 7, dtype=np.float32).reshape(3, 2) + s**2
    rows = np.array([[s**2 + 0.1 * c + 0.01 * j for j in range(HIDDEN)] for c in range(C)], dtype=np.float32)
    bias = np.array([-s + 0.5 * c for c in range(C)], dtype=np.float32)
    rows[~mask], bias[~mask] = FOREIGN, FOREIGN
    return {"features.weight": features, "head.weight": rows, "head.bias": bias}


GLOBAL = {
    "features.weight": np.zeros((3, 2), dtype=np.float32),
    "head.weight": np.full((C, HIDDEN), -7.0, dtype=np.float32),
    "head.bias": np.full(C, -7.0, dtype=np.float32),
}


def make_updates(summaries, sites=None) -> list:
    sites = list(summaries) if sites is None else sites
    out = []
    for k, name in enumerate(summaries):
        if name not in sites:
            continue
        summ = summaries[name]
        meta = dict(summ, head_name="head")
        out.append(Update(name, site_weights(k, np.array(summ["labeled_mask"])), summ["cases"], meta,
                          {"train_loss": 0.0}))
    return out


# ------------------------------------------------------- the formulas, by hand


def mean(arrays, weights):
    w = np.asarray(weights, dtype=np.float64)
    return sum(wi * a.astype(np.float64) for wi, a in zip(w, arrays)) / w.sum()


def fedavg_by_hand(updates, weighted):
    w = [u.n for u in updates] if weighted else [1.0] * len(updates)
    return {key: mean([u.weights[key] for u in updates], w) for key in GLOBAL}


def classwise_head_by_hand(updates, weight_of):
    """Row c: sum_k w_kc row_kc / sum_k w_kc over sites with w_kc > 0; no such site: the global row."""
    out = {}
    for key in ("head.weight", "head.bias"):
        rows = GLOBAL[key].astype(np.float64).copy()
        for c in range(C):
            have = [(u.weights[key][c], weight_of(u, c)) for u in updates if weight_of(u, c) > 0]
            if have:
                rows[c] = mean([r for r, _ in have], [w for _, w in have])
        out[key] = rows
    return out


def surgical_by_hand(updates, weighted=False):
    out = {"features.weight": fedavg_by_hand(updates, weighted)["features.weight"]}
    out.update(classwise_head_by_hand(updates, lambda u, c: 1.0 if u.meta["labeled_mask"][c] else 0.0))
    return out


def tdma_by_hand(updates):
    out = {"features.weight": fedavg_by_hand(updates, True)["features.weight"]}
    out.update(classwise_head_by_hand(updates, lambda u, c: float(u.meta["annotated"][c]) if u.meta["labeled_mask"][c] else 0.0))
    return out


def head_by_n_k(updates):
    """A wrong rule to tell apart from TDMA: head row c weighted by n_k (not n_k^c)."""
    return classwise_head_by_hand(updates, lambda u, c: float(u.n) if u.meta["labeled_mask"][c] else 0.0)


def assert_matches(out, expected):
    assert set(out) == set(GLOBAL)
    for key, value in expected.items():
        assert out[key].dtype == GLOBAL[key].dtype, key
        np.testing.assert_allclose(out[key], value, rtol=1e-6, atol=1e-5, err_msg=key)


def differs(a, b, tol=1e-2) -> bool:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()) > tol


# ------------------------------------------------------------------- tests


def test_the_scenario_separates_n_k_from_n_k_c(summaries):
    """What makes the rules distinguishable: unequal n_k, and n_k^c / n_k not one constant."""
    cases = [s["cases"] for s in summaries.values()]
    assert len(set(cases)) == len(cases)
    shares = {name: np.array(s["annotated"], float) / s["cases"] for name, s in summaries.items()}
    labeled = {name: np.array(s["labeled_mask"]) for name, s in summaries.items()}
    assert all(s["labeled"] and any(s["labeled_mask"]) for s in summaries.values())
    assert any((shares[n][labeled[n]] < 1).any() for n in summaries)
    # a class labeled by several sites, with a different annotated share at each
    assert any(len({round(shares[n][c], 3) for n in summaries if labeled[n][c]}) > 1 for c in range(C))


def test_fedavg_weighted_and_unweighted_follow_their_formulas_and_differ(summaries):
    updates = make_updates(summaries)
    weighted = FedAvgServer(weighted=True).aggregate(updates, GLOBAL, 0)
    plain = FedAvgServer(weighted=False).aggregate(updates, GLOBAL, 0)
    assert_matches(weighted, fedavg_by_hand(updates, True))
    assert_matches(plain, fedavg_by_hand(updates, False))
    assert differs(weighted["features.weight"], plain["features.weight"])


def test_surgical_head_is_the_unweighted_mean_of_the_annotating_sites(summaries):
    updates = make_updates(summaries)
    out = SurgicalServer().aggregate(updates, GLOBAL, 0)
    assert_matches(out, surgical_by_hand(updates))
    assert (out["head.weight"] < FOREIGN / 2).all()  # no foreign row leaks in
    # weighted=True changes the features only: n_k-weighted, the head stays unweighted
    out_w = SurgicalServer(weighted=True).aggregate(updates, GLOBAL, 0)
    assert_matches(out_w, surgical_by_hand(updates, weighted=True))
    assert differs(out_w["features.weight"], out["features.weight"])
    np.testing.assert_array_equal(out_w["head.weight"], out["head.weight"])


def test_tdma_features_by_n_k_head_by_n_k_c(summaries):
    updates = make_updates(summaries)
    out = TDMAServer().aggregate(updates, GLOBAL, 0)
    assert_matches(out, tdma_by_hand(updates))
    assert (out["head.weight"] < FOREIGN / 2).all()
    # n_k^c is not n_k here: weighting the head by n_k would be another model
    assert differs(out["head.weight"], head_by_n_k(updates)["head.weight"])


def test_surgical_and_tdma_give_different_heads_on_this_scenario(summaries):
    updates = make_updates(summaries)
    surgical = SurgicalServer().aggregate(updates, GLOBAL, 0)
    tdma = TDMAServer().aggregate(updates, GLOBAL, 0)
    classes_of = [np.array(s["labeled_mask"]) for s in summaries.values()]
    n_sites = np.sum(classes_of, axis=0)
    for key in ("head.weight", "head.bias"):
        for c in range(C):
            if n_sites[c] == 1:  # a single-site class takes that site's row under both rules
                np.testing.assert_allclose(surgical[key][c], tdma[key][c], rtol=1e-6)
        shared = n_sites > 1
        assert differs(surgical[key][shared], tdma[key][shared]), key
    # and each differs from the other's formula, so swapping the rules fails
    assert differs(surgical["head.weight"], tdma_by_hand(updates)["head.weight"])
    assert differs(tdma["head.weight"], surgical_by_hand(updates)["head.weight"])
    assert differs(tdma["features.weight"], surgical["features.weight"])


def test_two_sites_keep_the_global_rows_of_classes_neither_annotates(summaries):
    updates = make_updates(summaries, ["site-1", "site-2"])
    for server, by_hand in ((SurgicalServer(), surgical_by_hand), (TDMAServer(), tdma_by_hand)):
        out = server.aggregate(updates, GLOBAL, 3)
        assert_matches(out, by_hand(updates))
        mask = np.array(summaries["site-1"]["labeled_mask"]) | np.array(summaries["site-2"]["labeled_mask"])
        np.testing.assert_array_equal(out["head.weight"][~mask], GLOBAL["head.weight"][~mask])
