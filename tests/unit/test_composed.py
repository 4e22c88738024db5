"""The composed method (fedlabels.methods.composed): each part against hand-computed rounds, each part
switched on by the sites' profiles, and what every registered method declares it does with each kind of site."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from fedlabels import methods
from fedlabels.engine import RoundEngine
from fedlabels.losses import partial_bce
from fedlabels.methods.base import Update
from fedlabels.methods.composed import ComposedServer
from fedlabels.profile import SiteProfile, label_summary
from helpers import site_context

CLASSES = ("a", "b", "c")
MASKS = {"F": [True, True, True], "P": [True, False, False], "U": [False, False, False]}
N = {"F": 2, "P": 6, "U": 4}
DELTA = {"F": 1.0, "P": 3.0, "U": 10.0}


def summary(site, mask=None):
    mask = MASKS[site] if mask is None else mask
    return {"site": site, "task": "multilabel", "supervision": "image" if any(mask) else "none",
            "labeled": any(mask), "cases": N[site], "annotated": [N[site] * m for m in mask],
            "positives": [0, 0, 0], "labeled_mask": list(mask)}


def start():
    return {"f": np.zeros(2), "head.weight": np.zeros((3, 1)), "head.bias": np.zeros(3)}


def run_round(server, sites=("F", "P", "U")):
    """One round on the real engine; each site sends what it received plus its own delta on every entry."""
    seen = {}

    def send(step, targets, weights, rnd, extras):
        out = []
        for s in targets:
            seen[s] = float(weights["f"][0])
            new = {k: np.asarray(v) + DELTA[s] for k, v in weights.items()}
            out.append(Update(s, new, N[s], meta={**summary(s), "head_name": "head"}))
        return out

    server.setup({s: summary(s) for s in sites})
    new, record, _ = RoundEngine(server, send, key_metric="val_auroc").run_round(0, start(), list(sites))
    return new, record, seen


def test_isolated_step_then_classwise_head_by_hand():
    new, record, seen = run_round(ComposedServer())
    assert [(s["name"], s["sites"]) for s in record["steps"]] == [("unlabeled", ["U"]), ("labeled", ["F", "P"])]
    # U trains from the global model (0) -> W_u = 10 on every key (a step of unlabeled sites: every key by n)
    assert seen == {"U": 0.0, "F": 10.0, "P": 10.0}
    # F sends 11, P sends 13: features by n (2*11 + 6*13) / 8 = 12.5
    np.testing.assert_allclose(new["f"], [12.5, 12.5])
    # head row a: unweighted mean of F and P (both annotate a) = 12; rows b, c: F alone = 11
    np.testing.assert_allclose(new["head.weight"][:, 0], [12.0, 11.0, 11.0])
    np.testing.assert_allclose(new["head.bias"], [12.0, 11.0, 11.0])


def test_without_isolation_one_step_and_the_unlabeled_site_counts_for_features_only():
    new, record, seen = run_round(ComposedServer(isolate=False))
    assert len(record["steps"]) == 1 and seen == {"F": 0.0, "P": 0.0, "U": 0.0}
    np.testing.assert_allclose(new["f"], [(2 * 1 + 6 * 3 + 4 * 10) / 12] * 2)  # = 5
    np.testing.assert_allclose(new["head.bias"], [2.0, 1.0, 1.0])  # a: (1 + 3) / 2; b, c: F's 1; U's 10 never


def test_without_the_classwise_head_every_key_is_averaged_by_n():
    new, _, _ = run_round(ComposedServer(classwise_head=False))
    np.testing.assert_allclose(new["head.bias"], [12.5, 12.5, 12.5])
    new, _, _ = run_round(ComposedServer(isolate=False, classwise_head=False))
    np.testing.assert_allclose(new["head.bias"], [5.0, 5.0, 5.0])


def test_a_class_no_site_of_the_step_annotates_keeps_the_steps_start_row():
    new, _, _ = run_round(ComposedServer(), sites=("P", "U"))
    # W_u = 10; P alone annotates a: row a = 13, rows b, c keep W_u's 10; features = P's 13
    np.testing.assert_allclose(new["head.bias"], [13.0, 10.0, 10.0])
    np.testing.assert_allclose(new["f"], [13.0, 13.0])


def test_the_parts_follow_the_profiles():
    server = ComposedServer()
    lines = server.setup({s: summary(s) for s in ("F", "P")})
    assert [s.name for s in server.plan(0, ["F", "P"])] == ["train"]  # no unlabeled site: no isolated step
    assert "no unlabeled site" in " ".join(lines)
    with pytest.raises(ValueError, match="no site annotates any class"):
        ComposedServer().setup({"U": summary("U")})


class Tiny(nn.Module):
    head_name = "head"

    def __init__(self):
        super().__init__()
        self.features = nn.Linear(4, 3)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.features(x)))


def site(labels, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = {"image": torch.randn(len(labels), 4, generator=g), "image_strong": torch.randn(len(labels), 4, generator=g),
             "label": torch.tensor(labels, dtype=torch.float32)}
    annotated = tuple(c for j, c in enumerate(CLASSES) if any(row[j] >= 0 for row in labels))
    profile = SiteProfile("s", "multilabel", CLASSES, annotated, "image" if annotated else "none")
    return site_context(profile, [batch], labels=labels), batch


def test_a_site_that_annotates_nothing_trains_the_consistency_term_alone_or_abstains_without_it():
    ctx, batch = site([[-1, -1, -1], [-1, -1, -1]])
    torch.manual_seed(0)
    net = Tiny()
    ref = copy.deepcopy(net)
    client = methods.get("composed").make_client(net, ctx, lr=0.1, optimizer="sgd", ema_alpha=0.5)
    client.receive({k: v.numpy() for k, v in ref.state_dict().items()})
    client.begin_round(0, {})
    client.optimizer = client.make_optimizer(client.net.parameters())
    got = client.train_step(batch)
    with torch.no_grad():
        target = torch.sigmoid(ref(batch["image"]))
    expected = ((torch.sigmoid(ref(batch["image_strong"])) - target) ** 2).mean()  # every entry is missing
    assert got == pytest.approx(float(expected), rel=1e-5)
    expected.backward()
    with torch.no_grad():
        for p_ref, p_got in zip(ref.parameters(), client.net.parameters()):
            torch.testing.assert_close(p_got, p_ref - 0.1 * p_ref.grad, rtol=1e-5, atol=1e-6)
    off = methods.get("composed").make_client(Tiny(), ctx, consistency_weight=0.0)
    update = off.train(start_of(off.net), 0)
    assert update.abstain and not update.weights


def start_of(net):
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def test_a_fully_labeled_site_trains_the_partial_bce_alone():
    ctx, batch = site([[1, 0, 0], [0, 1, 1]])
    torch.manual_seed(0)
    net = Tiny()
    ref = copy.deepcopy(net)
    client = methods.get("composed").make_client(net, ctx, lr=0.1, optimizer="sgd")
    client.begin_round(0, {})
    client.optimizer = client.make_optimizer(client.net.parameters())
    got = client.train_step(batch)
    pw = torch.as_tensor(client.pos_weight)
    assert got == pytest.approx(float(partial_bce(ref(batch["image"]), batch["label"], pos_weight=pw)), rel=1e-6)
    update = client.make_update(2, {})
    assert update.meta["head_name"] == "head" and update.meta["labeled_mask"] == [True, True, True]


# ---------------------------------------------------------------- what each method does with each kind of site


def test_every_method_declares_what_it_does_with_each_kind_of_site():
    sites = {s: summary(s) for s in ("F", "P", "U")}
    for name in methods.names():
        m = methods.get(name)
        why = m.refusal(sites)
        if "multilabel" not in m.tasks:
            assert why == f"{name} handles {'/'.join(m.tasks)} tasks, not multilabel"
            continue
        roles = m.site_roles(sites)
        assert roles["F"] == methods.LABELED
        assert why is None and None not in roles.values(), name
    roles = methods.get("composed").site_roles(sites)
    assert (roles["P"], roles["U"]) == (methods.FROM_MODEL, methods.WITHOUT_LABELS)
    assert methods.get("surgical").site_roles(sites)["U"] == methods.ABSTAINS
    assert methods.get("fedavg").site_roles(sites)["P"] == methods.AS_NEGATIVES


def test_a_method_refuses_a_site_it_cannot_serve_naming_the_site_and_what_it_lacks():
    mc = {s: {**summary(s), "task": "multiclass"} for s in ("F", "P", "U")}
    assert methods.get("isofed").refusal(mc) == "isofed cannot use P: it annotates 1 of the 3 classes"
    no_full = {s: {**mc[s]} for s in ("U",)}
    assert methods.get("isofed").refusal(no_full) == "isofed needs a site that annotates every class; none of ['U'] does"
    seg = {"B": {"task": "segmentation", "supervision": "bbox", "labeled": True, "labeled_mask": [True]}}
    assert methods.get("fedavg").refusal(seg) is None and methods.get("fedavg").site_roles(seg)["B"] == methods.ABSTAINS
    assert methods.get("fedmix").site_roles(seg)["B"] == methods.WEAK_LABELS


def test_a_label_summary_of_a_real_profile_gives_the_same_roles():
    full = SiteProfile("F", "multilabel", CLASSES, CLASSES)
    none = SiteProfile("U", "multilabel", CLASSES, (), "none")
    sums = {"F": label_summary(full, [{"label": [1, 0, 0]}]), "U": label_summary(none, [{"label": [-1, -1, -1]}])}
    assert methods.get("composed").site_roles(sums) == {"F": methods.LABELED, "U": methods.WITHOUT_LABELS}
    assert methods.get("fedavg_pl").site_roles(sums)["U"] == methods.ABSTAINS
