"""Method rules without FLARE: every aggregation against hand-computed arrays,
every local update rule against a short reference loop written here."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedlabels.methods as methods
from fedlabels.losses import pos_weight_from_counts, pos_weights
from fedlabels.methods import Update
from fedlabels.methods.aggregate import average_keys, classwise_head_mean, weighted_mean
from fedlabels.methods.base import SiteContext, load_weights, local_keys, personal_model, site_seed, to_numpy
from fedlabels.methods.fedavg import FedAvgClient, FedAvgServer
from fedlabels.methods.fedpsl import FedPSLClient, TDMAServer
from fedlabels.methods.surgical import SurgicalClient, SurgicalServer
from fedlabels.nets import batchnorm_keys
from fedlabels.profile import SiteProfile, label_summary
from fedlabels.site import load_state, save_state

CLASSES = ("a", "b", "c")
MULTILABEL = ("fedavg", "fedavg_pl", "fedprox", "fedbn", "surgical", "fedpsl", "fedpsl_tdma", "fedpsl_tadl")
# FedMLP's own loss corrects the imbalance by logit adjustment instead (off in its released code's preset).
LOGIT_ADJUSTED = ("fedmlp", "fedmlp_code")


# ------------------------------------------------------------------ fixtures

class TinyNet(nn.Module):
    """The nets.py protocol in miniature: ``head_name``, ``head``, ``extract``."""

    head_name = "head"

    def __init__(self, d=4, h=3, c=3, bn=False):
        super().__init__()
        layers = [nn.Linear(d, h)] + ([nn.BatchNorm1d(h)] if bn else [])
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(h, c)

    def extract(self, x):
        return torch.tanh(self.features(x))

    def forward(self, x):
        return self.head(self.extract(x))


def make_net(seed=0, bn=False, dtype=torch.float32, pretrained=False):
    """``pretrained``: claim an init_ckpt, as FedBN+ requires of a net with batch norm."""
    torch.manual_seed(seed)
    net = TinyNet(bn=bn).to(dtype)
    if pretrained:
        net.init_ckpt = "pretrained.pt"
    return net


def make_data(seed=0, batches=(6, 6, 6), annotated=("a", "b"), dtype=torch.float32, d=4, p=0.4):
    """A loader (list of batches) and the matching profile and label summary."""
    g = torch.Generator().manual_seed(seed)
    profile = SiteProfile(f"site-{seed}", "multilabel", CLASSES, tuple(annotated))
    mask = torch.as_tensor(profile.labeled_mask)
    loader, items = [], []
    for b in batches:
        x = torch.randn(b, d, generator=g, dtype=dtype)
        y = (torch.rand(b, len(CLASSES), generator=g) < p).to(dtype)
        y[0, :] = 1  # every annotated class has a positive ...
        if b > 1:
            y[-1, :] = 0  # ... and a negative
        y[:, ~mask] = -1
        loader.append({"image": x, "label": y})
        items += [{"label": row.long().tolist()} for row in y]
    return loader, profile, label_summary(profile, items)


def context(loader, profile, summary, seed=0):
    return SiteContext(profile, loader, summary, seed=seed)


def client_of(name, net, data, **options):
    """``methods.get(name).make_client`` on the site ``data`` = (loader, profile, summary)."""
    return methods.get(name).make_client(net, context(*data), **options)


def state(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def bce_ref(z, y, w=1.0):
    p = 1 / (1 + math.exp(-z))
    return -(w * y * math.log(p) + (1 - y) * math.log(1 - p))


def summary_pos_weight(summary, dtype=torch.float32):
    return torch.as_tensor(pos_weight_from_counts(summary["annotated"], summary["positives"]), dtype=dtype)


# Three sites, three classes: "a" annotated by all, "b" by site A only, "c" by none.
# Rows a site does not annotate hold 100 -- they must never leak into the head.
GLOBAL = {
    "features.w": np.array([10.0, 20.0], dtype=np.float32),
    "bn.num_batches_tracked": np.array(0, dtype=np.int64),
    "head.weight": np.full((3, 2), 7.0, dtype=np.float32),
    "head.bias": np.full(3, 7.0, dtype=np.float32),
}


def site_updates():
    def upd(site, n, fw, nbt, rows, bias, mask, annotated):
        return Update(site, {
            "features.w": np.array(fw, dtype=np.float32),
            "bn.num_batches_tracked": np.array(nbt, dtype=np.int64),
            "head.weight": np.array(rows, dtype=np.float32),
            "head.bias": np.array(bias, dtype=np.float32),
        }, n, {"cases": n, "annotated": annotated, "labeled_mask": mask, "head_name": "head"})

    return [
        upd("A", 4, [1, 2], 2, [[1, 1], [2, 2], [100, 100]], [1, 2, 100], [True, True, False], [4, 2, 0]),
        upd("B", 2, [3, 4], 2, [[3, 3], [100, 100], [100, 100]], [3, 100, 100], [True, False, False], [1, 0, 0]),
        upd("C", 2, [5, 8], 6, [[5, 5], [100, 100], [100, 100]], [5, 100, 100], [True, False, False], [2, 0, 0]),
    ]


def assert_arrays(out, expected):
    assert set(out) == set(expected)
    for k, v in expected.items():
        np.testing.assert_allclose(out[k], v, rtol=1e-6, err_msg=k)
        assert out[k].dtype == GLOBAL[k].dtype, k


# ------------------------------------------------------------------ aggregation helpers

def test_weighted_mean_and_average_keys():
    assert weighted_mean([np.array([1.0, 2.0]), np.array([3.0, 6.0])], [1, 3]).tolist() == [2.5, 5.0]
    with pytest.raises(ValueError):
        weighted_mean([np.zeros(2)], [0])
    ups = [Update("A", {"x": np.array([1.0]), "only_a": np.array([5.0])}, 1),
           Update("B", {"x": np.array([3.0])}, 1)]
    out = average_keys(ups, {"x": np.array([0.0]), "only_a": np.array([0.0]), "nobody": np.array([9.0])}, [1, 1])
    assert out["x"].tolist() == [2.0]
    assert out["only_a"].tolist() == [5.0]  # the one site that sent it
    assert out["nobody"].tolist() == [9.0]  # no site sent it: global value kept


def test_integer_buffers_are_rounded_not_truncated():
    nbt = [np.array(3, dtype=np.int64), np.array(4, dtype=np.int64)]
    # (1*3 + 3*4) / 4 = 3.75, (2*3 + 3*4) / 5 = 3.6, (3 + 4) / 2 = 3.5: all 4 (truncation would give 3)
    for weights in ([1, 3], [2, 3], [1, 1]):
        out = weighted_mean(nbt, weights)
        assert out.dtype == np.int64 and int(out) == 4, weights
    assert int(weighted_mean(nbt, [3, 1])) == 3  # 3.25
    # np.rint: halves go to the even neighbour
    assert int(weighted_mean([np.array(2), np.array(3)], [1, 1])) == 2
    # The same through a server rule: num_batches_tracked 3 and 4 from sites of 1 and 3 cases.
    glob = {"bn.num_batches_tracked": np.array(0, dtype=np.int64), "w": np.zeros(1, dtype=np.float32)}
    ups = [Update("A", {"bn.num_batches_tracked": nbt[0], "w": np.array([1.0], dtype=np.float32)}, 1),
           Update("B", {"bn.num_batches_tracked": nbt[1], "w": np.array([2.0], dtype=np.float32)}, 3)]
    out = FedAvgServer().aggregate(ups, glob, 0)
    assert out["bn.num_batches_tracked"].dtype == np.int64 and int(out["bn.num_batches_tracked"]) == 4
    assert out["w"].tolist() == [1.75]


def test_load_weights_skips_keys():
    net = make_net()
    before = state(net)
    new = {k: np.full(v.shape, 0.5, dtype=np.float32) for k, v in before.items()}
    load_weights(net, new, skip={"head.bias"})
    assert torch.all(net.head.weight == 0.5)
    assert torch.equal(net.head.bias, before["head.bias"])


# ------------------------------------------------------------------ server rules

def test_fedavg_server_weighted_and_unweighted():
    ups = site_updates()
    w = FedAvgServer(weighted=True).aggregate(ups, GLOBAL, 0)  # n = 4, 2, 2
    assert_arrays(w, {
        "features.w": [(4 * 1 + 2 * 3 + 2 * 5) / 8, (4 * 2 + 2 * 4 + 2 * 8) / 8],  # [2.5, 4.0]
        "bn.num_batches_tracked": np.array(3),  # (8 + 4 + 12) / 8
        "head.weight": [[2.5, 2.5], [(8 + 200 + 200) / 8] * 2, [100, 100]],
        "head.bias": [2.5, 408 / 8, 100],
    })
    u = FedAvgServer(weighted=False).aggregate(ups, GLOBAL, 0)
    assert_arrays(u, {
        "features.w": [3.0, 14 / 3],
        "bn.num_batches_tracked": np.array(3),  # 10 / 3 rounded
        "head.weight": [[3, 3], [202 / 3] * 2, [100, 100]],
        "head.bias": [3, 202 / 3, 100],
    })


@pytest.mark.parametrize("weighted", [False, True])
def test_surgical_server(weighted):
    out = SurgicalServer(weighted=weighted).aggregate(site_updates(), GLOBAL, 0)
    features = [2.5, 4.0] if weighted else [3.0, 14 / 3]
    assert_arrays(out, {
        "features.w": features,
        "bn.num_batches_tracked": np.array(3),
        # a: unweighted mean over A, B, C (Eq. 2) whatever `weighted` says;
        # b: only A annotates it -> A's row (Eq. 3); c: nobody -> previous global row
        "head.weight": [[3, 3], [2, 2], [7, 7]],
        "head.bias": [3, 2, 7],
    })
    assert list(out) == list(GLOBAL)  # key order preserved


def test_tdma_server():
    out = TDMAServer().aggregate(site_updates(), GLOBAL, 0)
    row_a = (4 * 1 + 1 * 3 + 2 * 5) / 7  # n_k^a = 4, 1, 2
    assert_arrays(out, {
        "features.w": [2.5, 4.0],  # by n_k = 4, 2, 2
        "bn.num_batches_tracked": np.array(3),
        "head.weight": [[row_a, row_a], [2, 2], [7, 7]],
        "head.bias": [row_a, 2, 7],
    })


def test_tdma_ignores_counts_of_classes_outside_the_mask():
    ups = site_updates()
    ups[1].meta["annotated"] = [1, 50, 0]  # B claims cases for "b" but does not annotate it
    out = TDMAServer().aggregate(ups, GLOBAL, 0)
    assert out["head.bias"][1] == 2


def test_classwise_rules_reduce_to_fedavg_without_class_heterogeneity():
    ups = site_updates()
    for u in ups:
        u.meta["labeled_mask"] = [True] * 3
        u.meta["annotated"] = [u.n] * 3
    for a, b in [(SurgicalServer(), FedAvgServer(weighted=False)), (TDMAServer(), FedAvgServer(weighted=True))]:
        x, y = a.aggregate(ups, GLOBAL, 0), b.aggregate(ups, GLOBAL, 0)
        for k in GLOBAL:
            np.testing.assert_allclose(x[k], y[k], rtol=1e-6)


def test_classwise_head_mean_weights_and_shapes():
    ups = site_updates()
    out = classwise_head_mean(ups, GLOBAL, "head", [[1, 0, 0], [3, 0, 0], [0, 0, 0]])
    assert out["head.bias"].tolist() == [2.5, 7, 7]  # (1*1 + 3*3) / 4; others keep global
    with pytest.raises(ValueError):
        classwise_head_mean(ups, GLOBAL, "head", [[1, 0], [1, 0], [1, 0]])


def test_classwise_servers_fail_clearly_without_metadata():
    ups = site_updates()
    del ups[0].meta["labeled_mask"]
    with pytest.raises(ValueError, match="labeled_mask"):
        SurgicalServer().aggregate(ups, GLOBAL, 0)
    ups = site_updates()
    del ups[2].meta["annotated"]
    with pytest.raises(ValueError, match="annotated"):
        TDMAServer().aggregate(ups, GLOBAL, 0)
    ups = site_updates()
    for u in ups:
        del u.meta["head_name"]
    with pytest.raises(ValueError, match="head_name"):
        SurgicalServer().aggregate(ups, GLOBAL, 0)
    assert SurgicalServer(head_name="head").aggregate(ups, GLOBAL, 0)["head.bias"].tolist() == [3, 2, 7]
    assert TDMAServer(head_name="head").aggregate(ups, GLOBAL, 0)["head.bias"][1] == 2


# ------------------------------------------------------------------ losses of the clients

def test_partial_vs_naive_loss_and_pos_weight():
    logits = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.0, -0.3]])
    target = torch.tensor([[1.0, -1.0, 0.0], [-1.0, 0.0, 1.0]])
    # A site annotating every class, with annotated = [3, 2, 4] and positives = [1, 1, 1] cases:
    # pos_weight = N_neg / N_pos = [2, 1, 3].
    profile = SiteProfile("s", "multilabel", CLASSES, CLASSES)
    rows = [[1, 1, 1], [0, 0, 0], [0, -1, 0], [-1, -1, 0]]
    summary = label_summary(profile, [{"label": r} for r in rows])
    assert (summary["annotated"], summary["positives"]) == ([3, 2, 4], [1, 1, 1])
    data = ([], profile, summary)
    net = make_net()
    partial = client_of("fedavg_pl", net, data, pos_weighted=False)
    naive = client_of("fedavg", net, data, pos_weighted=False)
    expected_partial = (bce_ref(0.5, 1) + bce_ref(2.0, 0) + bce_ref(0.0, 0) + bce_ref(-0.3, 1)) / 4
    expected_naive = (bce_ref(0.5, 1) + bce_ref(-1.0, 0) + bce_ref(2.0, 0) + bce_ref(1.5, 0) + bce_ref(0.0, 0)
                      + bce_ref(-0.3, 1)) / 6
    assert partial.loss(logits, target).item() == pytest.approx(expected_partial, rel=1e-6)
    assert naive.loss(logits, target).item() == pytest.approx(expected_naive, rel=1e-6)
    weighted = client_of("fedavg_pl", net, data)  # pos_weighted: the multi-label default
    assert weighted.pos_weight.tolist() == [2.0, 1.0, 3.0]
    expected_w = (bce_ref(0.5, 1, 2.0) + bce_ref(2.0, 0) + bce_ref(0.0, 0) + bce_ref(-0.3, 1, 3.0)) / 4
    assert weighted.loss(logits, target).item() == pytest.approx(expected_w, rel=1e-6)
    naive_w = client_of("fedavg", net, data)
    expected_naive_w = (bce_ref(0.5, 1, 2.0) + bce_ref(-1.0, 0) + bce_ref(2.0, 0) + bce_ref(1.5, 0) + bce_ref(0.0, 0)
                        + bce_ref(-0.3, 1, 3.0)) / 6
    assert naive_w.loss(logits, target).item() == pytest.approx(expected_naive_w, rel=1e-6)
    # The Surgical client: the partial BCE, with the same positive weighting.
    surgical = client_of("surgical", net, data, pos_weighted=False)
    assert surgical.loss(logits, target).item() == pytest.approx(expected_partial, rel=1e-6)
    assert client_of("surgical", net, data).loss(logits, target).item() == pytest.approx(expected_w, rel=1e-6)
    # The explicit per-class array option is gone: one rule for every method.
    with pytest.raises(ValueError, match="pos_weight"):
        client_of("fedavg_pl", net, data, pos_weight=[2.0, 1.0, 3.0])


def test_multiclass_loss_of_an_unlabeled_batch_is_zero_not_nan():
    profile = SiteProfile("s", "multiclass", CLASSES, CLASSES)
    summary = label_summary(profile, [{"label": 0}, {"label": 2}, {"label": -1}])
    client = client_of("fedavg", make_net(), ([], profile, summary))
    assert client.pos_weighted is False and client.pos_weight is None  # the default off a multi-label task
    logits = torch.randn(3, 3, requires_grad=True)
    loss = client.loss(logits, torch.tensor([-1, -1, -1]))
    loss.backward()
    assert loss.item() == 0 and torch.all(logits.grad == 0)
    labeled = client.loss(logits, torch.tensor([2, -1, 0]))
    assert labeled.item() == pytest.approx(F.cross_entropy(logits[[0, 2]], torch.tensor([2, 0])).item(), rel=1e-6)
    with pytest.raises(ValueError, match="multi-label"):
        client_of("fedavg", make_net(), ([], profile, summary), pos_weighted=True)


def test_pos_weight_from_counts():
    labels = torch.tensor([[1, 0, -1], [0, 0, -1], [0, 1, -1], [0, 0, -1], [1, 0, -1]])
    # a: 3 neg / 2 pos, b: 4 neg / 1 pos, c: not annotated -> 1
    w = pos_weight_from_counts([5, 5, 0], [2, 1, 0])
    assert w.dtype == np.float32 and w.tolist() == [1.5, 4.0, 1.0]
    assert w.tolist() == pos_weights(labels).tolist()
    # No positive, no negative (w would be 0), fewer positives than min_pos: weight 1.
    assert pos_weight_from_counts([4, 3, 6], [0, 3, 2]).tolist() == [1.0, 1.0, 2.0]
    assert pos_weight_from_counts([4, 3, 6], [0, 3, 2], min_pos=3).tolist() == [1.0, 1.0, 1.0]
    assert pos_weights(torch.tensor([[1, 1], [0, 1], [0, 1]]), min_pos=2).tolist() == [1.0, 1.0]
    # A client weights by its label summary's counts.
    profile = SiteProfile("s", "multilabel", CLASSES, ("a", "b"))
    summary = label_summary(profile, [{"label": row.tolist()} for row in labels])
    assert (summary["annotated"], summary["positives"]) == ([5, 5, 0], [2, 1, 0])
    client = FedPSLClient(make_net(), context([], profile, summary))
    assert client.pos_weighted and client.pos_weight.tolist() == [1.5, 4.0, 1.0]
    assert FedPSLClient(make_net(), context([], profile, summary), pos_weighted=False).pos_weight is None


def test_pos_weighted_is_one_default_for_every_multilabel_method():
    registered = [n for n in methods.names() if "multilabel" in methods.get(n).tasks]
    assert set(MULTILABEL) <= set(registered)
    # Rare positives: a 1 in 12, b 2 in 12 -> pos_weight [11, 5, 1].
    profile = SiteProfile("s", "multilabel", CLASSES, ("a", "b"))
    g = torch.Generator().manual_seed(3)
    y = torch.zeros(12, 3)
    y[0, 0] = y[1, 1] = y[5, 1] = 1
    y[:, 2] = -1
    loader = [{"image": torch.randn(6, 4, generator=g), "label": y[:6]},
              {"image": torch.randn(6, 4, generator=g), "label": y[6:]}]
    summary = label_summary(profile, [{"label": r.long().tolist()} for r in y])
    data = (loader, profile, summary)
    pw = torch.tensor([11.0, 5.0, 1.0])
    logits = torch.randn(12, 3, generator=g)
    for name in registered:
        method = methods.get(name)
        assert "pos_weighted" in method.client_option_names(), name
        if name in LOGIT_ADJUSTED:  # the paper's WPC loss has no positive weighting (tests/unit/test_fedmlp.py)
            assert method.client_presets["pos_weighted"] is False, name
        else:
            assert "pos_weighted" not in method.client_presets, name  # nobody else overrides the shared default
    for name in MULTILABEL:  # the rules with a per-batch ``loss`` (the others: tests/unit/test_fedmlp.py)
        method = methods.get(name)
        on, off = client_of(name, make_net(), data), client_of(name, make_net(), data, pos_weighted=False)
        assert on.pos_weighted is True and off.pos_weighted is False, name
        assert on.pos_weight.tolist() == pw.tolist() and off.pos_weight is None, name
        for c in (on, off):
            if getattr(c, "mu", 0) > 0:
                c.begin_round(0, {})  # FedProx's anchor: the proximal term is 0 at the received model
        loss_on, loss_off = on.loss(logits, y).item(), off.loss(logits, y).item()
        if method.client_presets.get("partial_loss", True):
            assert loss_on == pytest.approx(ref_loss(logits, y, pw).item(), rel=1e-6), name
            assert loss_off == pytest.approx(ref_loss(logits, y, 1.0).item(), rel=1e-6), name
        assert loss_on > loss_off + 0.1, name  # the positives count 5-11 times
        # ... and so does what the site trains.
        kw = {"warmup_epochs": 0} if name == "surgical" else {}
        u_on = client_of(name, make_net(), data, lr=0.05, **kw).train(to_numpy(make_net().state_dict()), 0)
        u_off = client_of(name, make_net(), data, lr=0.05, pos_weighted=False, **kw).train(
            to_numpy(make_net().state_dict()), 0)
        assert not np.allclose(u_on.weights["head.bias"], u_off.weights["head.bias"]), name


# ------------------------------------------------------------------ FedProx

def test_fedprox_proximal_term_and_gradient():
    data = make_data()
    loader, _, summary = data
    net = make_net()
    mu, lr = 0.5, 0.1
    client = client_of("fedprox", net, data, mu=mu, lr=lr, optimizer="sgd")
    glob = to_numpy(net.state_dict())
    client.receive(glob)
    client.begin_round(0, {})
    assert client.proximal_term().item() == 0
    deltas = {}
    with torch.no_grad():
        for i, (name, p) in enumerate(net.named_parameters()):
            deltas[name] = 0.1 * (i + 1)
            p.add_(deltas[name])
    expected = mu / 2 * sum(d * d * dict(net.named_parameters())[n].numel() for n, d in deltas.items())
    assert client.proximal_term().item() == pytest.approx(expected, rel=1e-5)

    # One SGD step (the first step of momentum SGD is plain SGD):
    # w <- w - lr * (grad of the pos-weighted partial BCE + mu * (w - w_global)).
    batch = loader[0]
    before = state(net)
    net.zero_grad()
    ref_loss(net(batch["image"]), batch["label"], summary_pos_weight(summary)).backward()
    task_grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    client.optimizer = client.make_optimizer(net.parameters())
    client.train_step(batch)
    for n, p in net.named_parameters():
        anchor = torch.as_tensor(glob[n])
        expected_p = before[n] - lr * (task_grads[n] + mu * (before[n] - anchor))
        torch.testing.assert_close(p.detach(), expected_p, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ batch-norm policies

def _bn_client(name, seed=0, **kw):
    data = make_data(seed)
    net = make_net(bn=True, pretrained=True)
    return client_of(name, net, data, lr=0.05, **kw), net


def test_fedavg_sends_and_averages_bn_statistics():
    (c1, n1), (c2, _) = _bn_client("fedavg_pl", 1), _bn_client("fedavg_pl", 2)
    glob = to_numpy(n1.state_dict())
    u1, u2 = c1.train(glob, 0), c2.train(glob, 0)
    for key in batchnorm_keys(n1):
        assert key in u1.weights
    assert not np.allclose(u1.weights["features.1.running_mean"], glob["features.1.running_mean"])
    assert u1.weights["features.1.num_batches_tracked"] == 3
    out = FedAvgServer().aggregate([u1, u2], glob, 0)
    np.testing.assert_allclose(out["features.1.running_mean"],
                               (u1.n * u1.weights["features.1.running_mean"] + u2.n * u2.weights["features.1.running_mean"])
                               / (u1.n + u2.n), rtol=1e-6)


def test_fedbn_keeps_its_own_bn_across_rounds_and_declares_it_local():
    client, net = _bn_client("fedbn")
    bn = set(batchnorm_keys(net))
    assert client.local_keys == bn == set(local_keys(net, "fedbn"))
    glob = to_numpy(net.state_dict())
    glob["features.1.running_mean"] = np.full(3, 5.0, dtype=np.float32)
    client.receive(glob)  # first contact: the global BN initialises the site
    assert torch.all(net.features[1].running_mean == 5.0)
    update = client.train(glob, 0)
    # the rule returns its whole state; the transport withholds local_keys (FLARE: ExcludeVars)
    assert set(update.weights) == set(glob)
    local_bn = {k: v for k, v in state(net).items() if k in bn}
    assert not torch.all(local_bn["features.1.running_mean"] == 5.0)
    assert set(client.state_dict()["bn"]) == bn  # kept in the site's state file
    new_glob = {k: np.full_like(v, 9) for k, v in glob.items()}
    client.receive(new_glob)
    for k, v in state(net).items():
        if k in bn:
            assert torch.equal(v, local_bn[k]), k  # the site's own BN survives
        else:
            assert torch.all(v == 9), k
    # The next round trains on from the site's own statistics: 3 batches on top of its 3, not the global 9.
    client.train(new_glob, 1)
    assert int(net.features[1].num_batches_tracked) == 6
    # What reaches the server has no BN: the server keeps its own (initial) value of those keys.
    other, _ = _bn_client("fedbn", seed=1)
    sent = [Update(u.site, {k: v for k, v in u.weights.items() if k not in client.local_keys}, u.n)
            for u in (update, other.train(glob, 0))]
    out = FedAvgServer().aggregate(sent, glob, 0)
    for k in bn:
        np.testing.assert_array_equal(out[k], glob[k], err_msg=k)
    np.testing.assert_allclose(out["features.0.weight"], (sent[0].n * sent[0].weights["features.0.weight"]
                               + sent[1].n * sent[1].weights["features.0.weight"]) / (sent[0].n + sent[1].n), rtol=1e-6)


def test_fedbn_plus_freezes_bn_and_keeps_it_local():
    client, net = _bn_client("fedbn_plus")
    bn = set(batchnorm_keys(net))
    assert client.local_keys == bn == set(local_keys(net, "fedbn+"))
    assert local_keys(net, "fedavg") == []
    glob = to_numpy(net.state_dict())
    before = state(net)
    client.train(glob, 0)
    for k in bn:
        assert torch.equal(state(net)[k], before[k]), k  # statistics and affine frozen
    assert not net.features[1].training
    assert not torch.equal(net.features[0].weight, before["features.0.weight"])


def _bn_state_file(path, bn: dict):
    torch.save({"round": 1, "run": "r", "state": {"received": True, "optimizer": None, "bn": bn}}, path)
    return path


def test_personal_model_is_the_global_model_with_the_sites_own_bn(tmp_path):
    glob = {"conv.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "bn.weight": np.ones(2, np.float32),
            "bn.running_mean": np.zeros(2, np.float32), "bn.num_batches_tracked": np.array(0)}
    own = {"bn.weight": torch.tensor([2.0, 3.0]), "bn.running_mean": torch.tensor([0.5, -0.5]),
           "bn.num_batches_tracked": torch.tensor(7)}
    out = personal_model(glob, _bn_state_file(tmp_path / "site-1.pt", own))
    assert set(out) == set(glob)
    assert out["conv.weight"].tolist() == glob["conv.weight"].tolist()
    assert out["bn.weight"].tolist() == [2.0, 3.0] and out["bn.running_mean"].tolist() == [0.5, -0.5]
    assert int(out["bn.num_batches_tracked"]) == 7 and out["bn.weight"].dtype == torch.float32
    assert glob["bn.weight"].tolist() == [1.0, 1.0]  # the caller's global model is untouched
    # a global model loaded as tensors (FL_global_model.pt) works the same
    assert personal_model({k: torch.as_tensor(v) for k, v in glob.items()}, tmp_path / "site-1.pt")[
        "bn.running_mean"].tolist() == [0.5, -0.5]


def test_personal_model_says_which_state_file_cannot_give_batch_norm(tmp_path):
    glob = {"conv.weight": np.zeros((2, 3), np.float32), "bn.weight": np.ones(2, np.float32)}
    empty = _bn_state_file(tmp_path / "fedavg-site.pt", {})
    with pytest.raises(ValueError, match=r"fedavg-site\.pt: field 'state\.bn': no batch-norm keys"):
        personal_model(glob, empty)
    other = _bn_state_file(tmp_path / "other-net.pt", {"bn.weight": torch.ones(4)})
    with pytest.raises(ValueError, match=r"other-net\.pt: field 'state\.bn': bn\.weight has shape \(4,\)"):
        personal_model(glob, other)
    foreign = _bn_state_file(tmp_path / "foreign.pt", {"norm9.weight": torch.ones(2)})
    with pytest.raises(ValueError, match=r"foreign\.pt: .*not in the global model"):
        personal_model(glob, foreign)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"junk\.pt: not a site state file"):
        personal_model(glob, tmp_path / "junk.pt")
    with pytest.raises(ValueError, match=r"missing\.pt: not a site state file"):
        personal_model(glob, tmp_path / "missing.pt")


def test_fedbn_plus_refuses_batch_norm_without_a_pretrained_checkpoint():
    data = make_data()
    for name, kw in [("fedbn_plus", {}), ("surgical", {"bn_policy": "fedbn+"}), ("fedpsl", {"bn_policy": "fedbn+"})]:
        with pytest.raises(ValueError, match="init_ckpt"):
            client_of(name, make_net(bn=True), data, **kw)
        client_of(name, make_net(bn=True, pretrained=True), data, **kw)
        client_of(name, make_net(bn=False), data, **kw)  # nothing to freeze: accepted


# ------------------------------------------------------------------ TADL

def ref_forward(P, x):
    return torch.tanh(x @ P["features.0.weight"].T + P["features.0.bias"]) @ P["head.weight"].T + P["head.bias"]


def ref_loss(z, y, pw):
    """Pos-weighted BCE averaged over annotated entries, written out."""
    mask = (y >= 0).to(z.dtype)
    t = y.clamp(min=0)
    per = -(pw * t * F.logsigmoid(z) + (1 - t) * F.logsigmoid(-z))
    return (per * mask).sum() / mask.sum()


THETA, PHI = ("features.0.weight", "features.0.bias"), ("head.weight", "head.bias")


def ref_tadl(P, loader, pw, alpha, beta, inner, second_order, step):
    """Algorithm 1 on explicit tensors; ``step(name, grad, lr)`` applies the optimizer."""
    P = {k: v.detach().clone() for k, v in P.items()}
    for batch in loader:
        x, y = batch["image"], batch["label"]
        h = (len(x) + 1) // 2
        th = {k: P[k].clone().requires_grad_(True) for k in THETA}
        ph = {k: P[k].clone().requires_grad_(True) for k in PHI}
        lt = ref_loss(ref_forward({**th, **ph}, x[:h]), y[:h], pw)
        g = torch.autograd.grad(lt, [th[k] for k in THETA] + [ph[k] for k in PHI], create_graph=second_order)
        if second_order:
            th_prime = {k: th[k] - inner * gk for k, gk in zip(THETA, g)}
            wrt = [th[k] for k in THETA]
        else:  # first order: the meta gradient is taken at theta'
            th_prime = {k: (th[k] - inner * gk).detach().requires_grad_(True) for k, gk in zip(THETA, g)}
            wrt = [th_prime[k] for k in THETA]
        for k, gk in zip(PHI, g[len(THETA):]):
            P[k] = step(k, gk.detach(), alpha, P[k])
        lv = ref_loss(ref_forward({**th_prime, **{k: P[k] for k in PHI}}, x[h:]), y[h:], pw)
        gm = torch.autograd.grad(lv, wrt)
        for k, gk in zip(THETA, gm):
            P[k] = step(k, gk.detach(), beta, P[k])
    return P


def momentum_sgd():
    buf = {}

    def step(k, g, lr, p):
        buf[k] = g.clone() if k not in buf else 0.9 * buf[k] + g
        return p - lr * buf[k]

    return step


def adam(b1=0.9, b2=0.999, eps=1e-8):
    m, v, t = {}, {}, {}

    def step(k, g, lr, p):
        t[k] = t.get(k, 0) + 1
        m[k] = b1 * m.get(k, 0) + (1 - b1) * g
        v[k] = b2 * v.get(k, 0) + (1 - b2) * g * g
        mhat, vhat = m[k] / (1 - b1 ** t[k]), v[k] / (1 - b2 ** t[k])
        return p - lr * mhat / (vhat.sqrt() + eps)

    return step


@pytest.mark.parametrize("first_order", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_tadl_matches_reference_loop(first_order, optimizer):
    data = make_data(batches=(6, 5, 6), dtype=torch.float64)
    loader, _, summary = data
    net = make_net(dtype=torch.float64)
    P0 = state(net)
    alpha, beta, inner = 0.3, 0.2, 0.5
    client = FedPSLClient(net, context(*data), lr=alpha, meta_lr=beta, inner_lr=inner,
                          optimizer=optimizer, first_order=first_order)
    update = client.train(to_numpy(net.state_dict()), 0)
    assert update.n == 17 and np.isfinite(update.metrics["train_loss"])
    pw = summary_pos_weight(summary, torch.float64)
    step = momentum_sgd() if optimizer == "sgd" else adam()
    ref = ref_tadl(P0, loader, pw, alpha, beta, inner, not first_order, step)
    for k in THETA + PHI:
        torch.testing.assert_close(net.state_dict()[k], ref[k], atol=1e-6, rtol=0)
        np.testing.assert_allclose(update.weights[k], ref[k].numpy(), atol=1e-6)
        assert not torch.allclose(ref[k], P0[k])


def test_tadl_second_order_term_matters():
    data = make_data(dtype=torch.float64)
    nets = []
    for first_order in (False, True):
        net = make_net(dtype=torch.float64)
        FedPSLClient(net, context(*data), lr=0.3, inner_lr=0.5, optimizer="sgd",
                     first_order=first_order).train(to_numpy(net.state_dict()), 0)
        nets.append(state(net))
    assert (nets[0]["features.0.weight"] - nets[1]["features.0.weight"]).abs().max() > 1e-4


def test_tadl_skips_a_batch_of_one_and_updates_bn_once_per_half():
    data = make_data(batches=(6, 1))
    net = make_net(bn=True)
    client = FedPSLClient(net, context(*data), lr=0.05)
    update = client.train(to_numpy(net.state_dict()), 0)
    assert update.n == 6
    assert net.features[1].num_batches_tracked.item() == 2  # B_train forward + B_val forward
    frozen = FedPSLClient(make_net(bn=True, pretrained=True), context(*data), lr=0.05, bn_policy="fedbn+")
    before = state(frozen.net)
    frozen.train(to_numpy(frozen.net.state_dict()), 0)
    for k in batchnorm_keys(frozen.net):
        assert torch.equal(frozen.net.state_dict()[k], before[k]), k
    assert not torch.equal(frozen.net.features[0].weight, before["features.0.weight"])


def test_tadl_with_training_batch_norm_skips_a_batch_whose_half_would_hold_one_case():
    """A batch of 2 or 3 splits into a half of one case, which batch norm in training cannot normalise
    (torch raises): skipped, as a batch of one is; without batch norm only a batch of one is skipped;
    with batch norm frozen (FedBN+), every batch of 2 or more trains."""
    data = make_data(batches=(6, 3, 2))
    update = FedPSLClient(make_net(bn=True), context(*data), lr=0.05).train(to_numpy(make_net(bn=True).state_dict()), 0)
    assert update.n == 6
    update = FedPSLClient(make_net(), context(*data), lr=0.05).train(to_numpy(make_net().state_dict()), 0)
    assert update.n == 11
    frozen = FedPSLClient(make_net(bn=True, pretrained=True), context(*data), lr=0.05, bn_policy="fedbn+")
    assert frozen.train(to_numpy(frozen.net.state_dict()), 0).n == 11


def test_fedpsl_tdma_client_is_plain_pos_weighted_training():
    data = make_data(batches=(6,))
    loader, _, summary = data
    net = make_net()
    before = state(net)
    client = client_of("fedpsl_tdma", net, data, lr=0.1, optimizer="sgd")
    client.train(to_numpy(net.state_dict()), 0)
    ref = make_net()
    ref.load_state_dict(before)
    x, y = loader[0]["image"], loader[0]["label"]
    loss = ref_loss(ref(x), y, summary_pos_weight(summary))
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    for (k, p), g in zip(ref.named_parameters(), grads):
        torch.testing.assert_close(net.state_dict()[k], p.detach() - 0.1 * g, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ Surgical client

def test_surgical_warmup_trains_only_the_head_once():
    data = make_data()
    net = make_net(bn=True)
    client = SurgicalClient(net, context(*data), warmup_epochs=3, warmup_lr=0.1)
    client.receive(to_numpy(net.state_dict()))
    client.set_train_mode()
    before = state(net)
    client.begin_round(0, {})
    after = state(net)
    for k in before:
        if k.startswith("features."):
            assert torch.equal(after[k], before[k]), k  # weights and BN statistics untouched
    assert not torch.equal(after["head.weight"][:2], before["head.weight"][:2])
    # class "c" is not annotated here: its row gets no gradient
    assert torch.equal(after["head.weight"][2], before["head.weight"][2])
    assert torch.equal(after["head.bias"][2], before["head.bias"][2])
    assert net.training and net.features[1].training  # back in train mode
    assert client.warmed_up
    client.begin_round(1, {})  # only once
    assert all(torch.equal(state(net)[k], after[k]) for k in after)
    assert client.warmup_loss is not None and np.isfinite(client.warmup_loss)


def test_surgical_warmup_matches_reference_loop():
    """Adam on the head alone, features computed by the frozen backbone in inference mode."""
    data = make_data(batches=(6, 5, 6), dtype=torch.float64)
    loader, _, summary = data
    net = make_net(bn=True, dtype=torch.float64)
    with torch.no_grad():  # statistics that differ from a fresh BN, so inference mode matters
        net.features[1].running_mean.fill_(0.3)
        net.features[1].running_var.fill_(2.0)
    P0 = state(net)
    epochs, lr = 2, 0.1
    client = SurgicalClient(net, context(*data), warmup_epochs=epochs, warmup_lr=lr)
    client.receive(to_numpy(net.state_dict()))
    client.begin_round(0, {})

    pw = summary_pos_weight(summary, torch.float64)
    W, b = P0["head.weight"], P0["head.bias"]
    bn_eval = lambda z: (z - P0["features.1.running_mean"]) / torch.sqrt(P0["features.1.running_var"] + 1e-5) \
        * P0["features.1.weight"] + P0["features.1.bias"]  # noqa: E731
    step, losses = adam(), []
    for _ in range(epochs):
        for batch in loader:
            feats = torch.tanh(bn_eval(batch["image"] @ P0["features.0.weight"].T + P0["features.0.bias"]))
            w_, b_ = W.clone().requires_grad_(True), b.clone().requires_grad_(True)
            loss = ref_loss(feats @ w_.T + b_, batch["label"], pw)
            gw, gb = torch.autograd.grad(loss, [w_, b_])
            W, b = step("w", gw, lr, W), step("b", gb, lr, b)
            losses.append(loss.item())
    torch.testing.assert_close(net.head.weight.detach(), W, atol=1e-6, rtol=0)
    torch.testing.assert_close(net.head.bias.detach(), b, atol=1e-6, rtol=0)
    assert client.warmup_loss == pytest.approx(np.mean(losses), rel=1e-6)
    for k in P0:
        if k.startswith("features."):
            assert torch.equal(net.state_dict()[k], P0[k]), k


def test_surgical_client_round_flow_and_bn_policy():
    data = make_data()
    net = make_net(bn=True)
    client = client_of("surgical", net, data, warmup_epochs=1, lr=0.01)
    glob = to_numpy(net.state_dict())
    u0 = client.train(glob, 0)
    assert "warmup_loss" in u0.metrics and u0.meta["head_name"] == "head"
    assert u0.meta["labeled_mask"] == [True, True, False]
    assert "warmup_loss" not in client.train(glob, 1).metrics
    # The paper's feature rule f is the client's bn_policy.
    bn = set(batchnorm_keys(net))
    plain = client_of("surgical", make_net(bn=True), data)
    assert plain.bn_policy == "fedavg" and plain.local_keys == set()
    fedbn = client_of("surgical", make_net(bn=True), data, bn_policy="fedbn")
    assert fedbn.bn_policy == "fedbn" and fedbn.local_keys == bn
    plus = client_of("surgical", make_net(bn=True, pretrained=True), data, bn_policy="fedbn+")
    assert plus.bn_policy == "fedbn+" and plus.local_keys == bn
    u = plus.train(glob, 0)
    assert set(u.weights) == set(glob)  # the whole state: the transport withholds local_keys
    with pytest.raises(ValueError, match="bn_policy"):
        client_of("surgical", make_net(), data, bn_policy="fedprox")
    with pytest.raises(ValueError, match="feature_rule"):  # the removed option fails by name
        client_of("surgical", make_net(), data, feature_rule="fedbn")


# ------------------------------------------------------------------ client lifecycle

def test_abstaining_client_sends_nothing():
    class Picky(FedAvgClient):
        def abstains(self, round, extras):
            return bool(extras.get("skip"))

    data = make_data()
    net = make_net()
    client = Picky(net, context(*data), lr=0.1)
    glob = {k: np.full_like(v, 0.25) for k, v in to_numpy(net.state_dict()).items()}
    u = client.train(glob, 0, {"skip": True})
    assert u.abstain is True and u.n == 0 and u.weights == {} and u.site == "site-0"
    assert u.meta["labeled_mask"] == [True, True, False]  # still identifies itself
    assert all(torch.all(v == 0.25) for v in net.state_dict().values())  # received, not trained
    assert client.optimizer is None
    u = client.train(glob, 1, {})
    assert not u.abstain and u.n == 18 and set(u.weights) == set(glob)


def test_reseed_draws_the_same_per_site_and_round():
    profile = SiteProfile("s", "multilabel", CLASSES, CLASSES)
    loader = torch.utils.data.DataLoader(list(range(20)), batch_size=20, shuffle=True, generator=torch.Generator())
    ctx = SiteContext(profile, loader, {}, seed=7)
    orders, draws = [], []
    for rnd in (3, 3, 4):
        ctx.reseed(rnd)
        assert torch.initial_seed() == (7 * 1_000_003 + rnd) % 2**31
        draws.append(torch.rand(3))
        orders.append(next(iter(loader)).tolist())
    assert orders[0] == orders[1] and torch.equal(draws[0], draws[1])
    assert orders[0] != orders[2]
    assert site_seed(0, "site-1") == site_seed(0, "site-1") != site_seed(0, "site-2")
    assert site_seed(5, "site-1") == site_seed(0, "site-1") + 5




@pytest.mark.parametrize("name", [
    "fedavg", "fedavg_pl", "fedprox", "fedbn", "fedbn_plus",
    "surgical", "fedpsl", "fedpsl_tdma", "fedpsl_tadl"])
def test_client_state_round_trip_resumes_exactly(name, tmp_path):
    """A site rebuilt from its saved state (site.save_state / load_state) trains round 1
    exactly as the one that never stopped."""
    data = make_data(1, batches=(6, 6))
    opts = {"lr": 0.05, **({"warmup_epochs": 2} if name == "surgical" else {})}
    glob = to_numpy(make_net(seed=9, bn=True).state_dict())
    first = client_of(name, make_net(seed=1, bn=True, pretrained=True), data, **opts)
    first.train(glob, 0)
    saved = first.state_dict()
    if name == "surgical":
        assert saved["warmed_up"] is True
    assert saved["received"] is True and saved["optimizer"] is not None
    save_state(tmp_path / "site", first, 0)
    glob1 = {k: v + (0.01 if v.dtype.kind == "f" else 0) for k, v in glob.items()}  # a "new global model"
    resumed = client_of(name, make_net(seed=2, bn=True, pretrained=True), data, **opts)
    assert load_state(tmp_path / "site", resumed, before=0) is None  # nothing before round 0: nothing loaded
    assert load_state(tmp_path / "site", resumed, before=1) == 0
    a, b = first.train(glob1, 1), resumed.train(glob1, 1)
    assert set(a.weights) == set(b.weights) and a.n == b.n
    for k in a.weights:
        np.testing.assert_allclose(a.weights[k], b.weights[k], atol=1e-7, rtol=0, err_msg=k)
    assert a.metrics == b.metrics


# ------------------------------------------------------------------ registry and rounds

def test_registry_has_the_methods_and_checks_options():
    assert set(MULTILABEL) | {"fedbn_plus"} <= set(methods.names())
    assert methods.get("fedpsl").client_options()["tadl"] is True
    assert methods.get("fedpsl_tdma").client_options()["tadl"] is False
    assert methods.get("fedpsl_tadl").server is FedAvgServer
    assert isinstance(methods.get("fedpsl_tadl").make_server(), FedAvgServer)
    assert methods.get("fedpsl_tadl").make_server().weighted is True
    assert methods.get("surgical").make_server().weighted is False
    with pytest.raises(ValueError, match="warmup_epoch"):
        methods.get("surgical").client_options(warmup_epoch=3)
    # Option names are the rule's keyword arguments, followed up the MRO through **kw.
    surgical = methods.get("surgical")
    assert {"warmup_epochs", "warmup_lr", "lr", "epochs", "optimizer", "bn_policy", "pos_weighted",
            "reset_optimizer", "weight_decay"} <= surgical.client_option_names()
    assert not {"net", "ctx", "kw", "self"} & surgical.client_option_names()
    assert {"tadl", "first_order", "meta_lr", "inner_lr", "pos_weighted"} <= methods.get("fedpsl").client_option_names()
    assert surgical.server_option_names() == {"weighted", "head_name"}
    assert methods.get("fedpsl").server_option_names() == {"head_name"}
    assert methods.get("fedavg").server_option_names() == {"weighted"}


@pytest.mark.parametrize("name", ["fedpsl", "fedpsl_tdma"])
def test_tdma_servers_reject_weighted_by_name(name):
    with pytest.raises(ValueError, match="weighted"):  # an option error, not a TypeError
        methods.get(name).make_server(weighted=False)
    assert methods.get(name).make_server(head_name="head").head_name == "head"


@pytest.mark.parametrize("name", ["surgical", "fedpsl"])
def test_removed_feature_rule_option_fails_by_name(name):
    with pytest.raises(ValueError, match="feature_rule"):
        methods.get(name).make_server(feature_rule="fedbn")
    with pytest.raises(ValueError, match="feature_rule"):
        methods.get(name).client_options(feature_rule="fedbn")


@pytest.mark.parametrize("name", ["fedavg", "fedavg_pl", "fedprox", "fedbn", "fedbn_plus", "surgical", "fedpsl",
                                  "fedpsl_tdma", "fedpsl_tadl"])
def test_two_rounds_two_sites(name):
    method = methods.get(name)
    net0 = make_net(bn=True)
    glob = to_numpy(net0.state_dict())
    clients = []
    for seed, annotated in [(1, ("a", "b")), (2, ("a",))]:
        data = make_data(seed, batches=(6, 6), annotated=annotated)
        net = make_net(seed=seed, bn=True, pretrained=True)
        opts = {"lr": 0.01, **({"warmup_epochs": 1} if name == "surgical" else {})}
        clients.append(method.make_client(net, context(*data, seed=seed), **opts))
    server = method.make_server()
    server.setup({c.profile.site: c.ctx.summary for c in clients})
    for rnd in range(2):
        updates = [c.train(glob, rnd, server.extras(rnd, server.plan(rnd, ["site-1", "site-2"])[0])) for c in clients]
        assert all(np.isfinite(u.metrics["train_loss"]) for u in updates)
        glob = server.aggregate(updates, glob, rnd)
        assert set(glob) == set(net0.state_dict())
        assert all(np.isfinite(v).all() for v in glob.values())
    if name in ("surgical", "fedpsl", "fedpsl_tdma"):  # class "c": nobody annotates it
        np.testing.assert_array_equal(glob["head.weight"][2], net0.head.weight[2].detach().numpy())


def test_methods_do_not_import_nvflare():
    folder = Path(methods.__file__).parent
    for path in list(folder.glob("*.py")) + [folder.parent / "engine.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] == "nvflare" for n in names), (path, names)
