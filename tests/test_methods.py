"""Method rules without FLARE: every aggregation against hand-computed arrays,
every local update rule against a short reference loop written here."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedlabels.methods as methods
from fedlabels.methods import Update
from fedlabels.methods.base import average_keys, load_weights, to_numpy, weighted_mean
from fedlabels.methods.fedavg import FedAvgServer
from fedlabels.methods.fedpsl import FedPSLClient, TDMAServer, pos_weight_from_summary
from fedlabels.methods.surgical import SurgicalClient, SurgicalServer, classwise_head_mean
from fedlabels.losses import pos_weights
from fedlabels.nets import batchnorm_keys
from fedlabels.profile import SiteProfile, label_summary

CLASSES = ("a", "b", "c")


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


def make_net(seed=0, bn=False, dtype=torch.float32):
    torch.manual_seed(seed)
    return TinyNet(bn=bn).to(dtype)


def make_data(seed=0, batches=(6, 6, 6), annotated=("a", "b"), dtype=torch.float32, d=4):
    """A loader (list of batches) and the matching profile and label summary."""
    g = torch.Generator().manual_seed(seed)
    profile = SiteProfile(f"site-{seed}", "multilabel", CLASSES, tuple(annotated))
    mask = torch.as_tensor(profile.labeled_mask)
    loader, items = [], []
    for b in batches:
        x = torch.randn(b, d, generator=g, dtype=dtype)
        y = (torch.rand(b, len(CLASSES), generator=g) < 0.4).to(dtype)
        y[0, :] = 1  # every annotated class has a positive ...
        if b > 1:
            y[-1, :] = 0  # ... and a negative
        y[:, ~mask] = -1
        loader.append({"image": x, "label": y})
        items += [{"label": row.long().tolist()} for row in y]
    return loader, profile, label_summary(profile, items)


def state(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def bce_ref(z, y, w=1.0):
    p = 1 / (1 + math.exp(-z))
    return -(w * y * math.log(p) + (1 - y) * math.log(1 - p))


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


# ------------------------------------------------------------------ helpers in base

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


# ------------------------------------------------------------------ losses of the clients

def test_partial_vs_naive_loss_and_pos_weight():
    logits = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.0, -0.3]])
    target = torch.tensor([[1.0, -1.0, 0.0], [-1.0, 0.0, 1.0]])
    _, profile, _ = make_data()
    net = make_net()
    partial = methods.get("fedavg_pl").make_client(net, profile, [])
    naive = methods.get("fedavg").make_client(net, profile, [])
    expected_partial = (bce_ref(0.5, 1) + bce_ref(2.0, 0) + bce_ref(0.0, 0) + bce_ref(-0.3, 1)) / 4
    expected_naive = (bce_ref(0.5, 1) + bce_ref(-1.0, 0) + bce_ref(2.0, 0) + bce_ref(1.5, 0) + bce_ref(0.0, 0)
                      + bce_ref(-0.3, 1)) / 6
    assert partial.loss(logits, target).item() == pytest.approx(expected_partial, rel=1e-6)
    assert naive.loss(logits, target).item() == pytest.approx(expected_naive, rel=1e-6)
    weighted = methods.get("fedavg_pl").make_client(net, profile, [], pos_weight=[2.0, 1.0, 3.0])
    expected_w = (bce_ref(0.5, 1, 2.0) + bce_ref(2.0, 0) + bce_ref(0.0, 0) + bce_ref(-0.3, 1, 3.0)) / 4
    assert weighted.loss(logits, target).item() == pytest.approx(expected_w, rel=1e-6)
    # The Surgical client uses the plain partial BCE.
    surgical = methods.get("surgical").make_client(net, profile, [])
    assert surgical.loss(logits, target).item() == pytest.approx(expected_partial, rel=1e-6)


def test_multiclass_loss_of_an_unlabeled_batch_is_zero_not_nan():
    profile = SiteProfile("s", "multiclass", CLASSES, CLASSES)
    client = methods.get("fedavg").make_client(make_net(), profile, [])
    logits = torch.randn(3, 3, requires_grad=True)
    loss = client.loss(logits, torch.tensor([-1, -1, -1]))
    loss.backward()
    assert loss.item() == 0 and torch.all(logits.grad == 0)
    labeled = client.loss(logits, torch.tensor([2, -1, 0]))
    assert labeled.item() == pytest.approx(F.cross_entropy(logits[[0, 2]], torch.tensor([2, 0])).item(), rel=1e-6)


def test_pos_weight_from_summary():
    labels = torch.tensor([[1, 0, -1], [0, 0, -1], [0, 1, -1], [0, 0, -1], [1, 0, -1]])
    profile = SiteProfile("s", "multilabel", CLASSES, ("a", "b"))
    summary = label_summary(profile, [{"label": row.tolist()} for row in labels])
    w = pos_weight_from_summary(summary)
    assert w.tolist() == [1.5, 4.0, 1.0]  # 3 neg / 2 pos, 4 neg / 1 pos, not annotated -> 1
    assert w.tolist() == pos_weights(labels).tolist()
    loader, profile, summary = make_data()
    client = FedPSLClient(make_net(), profile, loader, summary=summary)
    assert client.pos_weight.tolist() == pos_weight_from_summary(summary).tolist()
    assert FedPSLClient(make_net(), profile, loader, summary=summary, pos_weighted=False).pos_weight is None
    explicit = FedPSLClient(make_net(), profile, loader, summary=summary, pos_weight=[2.0, 2.0, 2.0])
    assert explicit.pos_weight.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="annotated"):
        FedPSLClient(make_net(), profile, loader)  # no summary, nothing to weight by


# ------------------------------------------------------------------ FedProx

def test_fedprox_proximal_term_and_gradient():
    loader, profile, summary = make_data()
    net = make_net()
    mu, lr = 0.5, 0.1
    client = methods.get("fedprox").make_client(net, profile, loader, mu=mu, lr=lr, optimizer="sgd")
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
    # w <- w - lr * (grad of the partial BCE + mu * (w - w_global)).
    batch = loader[0]
    before = state(net)
    net.zero_grad()
    task_loss = F.binary_cross_entropy_with_logits(net(batch["image"]), batch["label"].clamp(min=0), reduction="none")
    mask = batch["label"] >= 0
    ((task_loss * mask).sum() / mask.sum()).backward()
    task_grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    client.optimizer = client.make_optimizer(net.parameters())
    client.train_step(batch)
    for n, p in net.named_parameters():
        anchor = torch.as_tensor(glob[n])
        expected_p = before[n] - lr * (task_grads[n] + mu * (before[n] - anchor))
        torch.testing.assert_close(p.detach(), expected_p, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ batch-norm policies

def _bn_client(name, seed=0, **kw):
    loader, profile, summary = make_data(seed)
    net = make_net(bn=True)
    return methods.get(name).make_client(net, profile, loader, summary=summary, lr=0.05, **kw), net


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


def test_fedbn_keeps_bn_local_across_rounds():
    client, net = _bn_client("fedbn")
    glob = to_numpy(net.state_dict())
    glob["features.1.running_mean"] = np.full(3, 5.0, dtype=np.float32)
    client.receive(glob)  # first contact: the global BN initialises the site
    assert torch.all(net.features[1].running_mean == 5.0)
    update = client.train(glob, 0)
    assert not set(batchnorm_keys(net)) & set(update.weights)
    assert "features.0.weight" in update.weights and "head.weight" in update.weights
    local_bn = {k: v for k, v in state(net).items() if k in batchnorm_keys(net)}
    new_glob = {k: np.full_like(v, 9) for k, v in glob.items()}
    client.receive(new_glob)
    for k, v in state(net).items():
        if k in local_bn:
            assert torch.equal(v, local_bn[k]), k  # the site's own BN survives
        else:
            assert torch.all(v == 9), k
    out = FedAvgServer().aggregate([update], glob, 0)
    assert out["features.1.running_mean"].tolist() == [5.0] * 3  # the server never sees it


def test_fedbn_plus_freezes_bn_and_keeps_it_local():
    client, net = _bn_client("fedbn_plus")
    glob = to_numpy(net.state_dict())
    before = state(net)
    update = client.train(glob, 0)
    for k in batchnorm_keys(net):
        assert torch.equal(state(net)[k], before[k]), k  # statistics and affine frozen
        assert k not in update.weights
    assert not net.features[1].training
    assert not torch.equal(net.features[0].weight, before["features.0.weight"])


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
    loader, profile, summary = make_data(batches=(6, 5, 6), dtype=torch.float64)
    net = make_net(dtype=torch.float64)
    P0 = state(net)
    alpha, beta, inner = 0.3, 0.2, 0.5
    client = FedPSLClient(net, profile, loader, summary=summary, lr=alpha, meta_lr=beta, inner_lr=inner,
                          optimizer=optimizer, first_order=first_order)
    update = client.train(to_numpy(net.state_dict()), 0)
    assert update.n == 17 and np.isfinite(update.metrics["train_loss"])
    pw = torch.as_tensor(pos_weight_from_summary(summary), dtype=torch.float64)
    step = momentum_sgd() if optimizer == "sgd" else adam()
    ref = ref_tadl(P0, loader, pw, alpha, beta, inner, not first_order, step)
    for k in THETA + PHI:
        torch.testing.assert_close(net.state_dict()[k], ref[k], atol=1e-6, rtol=0)
        np.testing.assert_allclose(update.weights[k], ref[k].numpy(), atol=1e-6)
        assert not torch.allclose(ref[k], P0[k])


def test_tadl_second_order_term_matters():
    loader, profile, summary = make_data(dtype=torch.float64)
    nets = []
    for first_order in (False, True):
        net = make_net(dtype=torch.float64)
        FedPSLClient(net, profile, loader, summary=summary, lr=0.3, inner_lr=0.5, optimizer="sgd",
                     first_order=first_order).train(to_numpy(net.state_dict()), 0)
        nets.append(state(net))
    assert (nets[0]["features.0.weight"] - nets[1]["features.0.weight"]).abs().max() > 1e-4


def test_tadl_skips_a_batch_of_one_and_updates_bn_once_per_half():
    loader, profile, summary = make_data(batches=(6, 1))
    net = make_net(bn=True)
    client = FedPSLClient(net, profile, loader, summary=summary, lr=0.05)
    update = client.train(to_numpy(net.state_dict()), 0)
    assert update.n == 6
    assert net.features[1].num_batches_tracked.item() == 2  # B_train forward + B_val forward
    frozen = FedPSLClient(make_net(bn=True), profile, loader, summary=summary, lr=0.05, bn_policy="fedbn+")
    before = state(frozen.net)
    frozen.train(to_numpy(frozen.net.state_dict()), 0)
    for k in batchnorm_keys(frozen.net):
        assert torch.equal(frozen.net.state_dict()[k], before[k]), k
    assert not torch.equal(frozen.net.features[0].weight, before["features.0.weight"])


def test_fedpsl_tdma_client_is_plain_pos_weighted_training():
    loader, profile, summary = make_data(batches=(6,))
    net = make_net()
    before = state(net)
    client = methods.get("fedpsl_tdma").make_client(net, profile, loader, summary=summary, lr=0.1, optimizer="sgd")
    client.train(to_numpy(net.state_dict()), 0)
    ref = make_net()
    ref.load_state_dict(before)
    x, y = loader[0]["image"], loader[0]["label"]
    loss = ref_loss(ref(x), y, torch.as_tensor(pos_weight_from_summary(summary)))
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    for (k, p), g in zip(ref.named_parameters(), grads):
        torch.testing.assert_close(net.state_dict()[k], p.detach() - 0.1 * g, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ Surgical client

def test_surgical_warmup_trains_only_the_head_once():
    loader, profile, summary = make_data()
    net = make_net(bn=True)
    client = SurgicalClient(net, profile, loader, summary=summary, warmup_epochs=3, warmup_lr=0.1)
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
    client.begin_round(1, {})  # only once
    assert all(torch.equal(state(net)[k], after[k]) for k in after)
    assert client.warmup_loss is not None and np.isfinite(client.warmup_loss)


def test_surgical_client_round_flow_and_feature_rule():
    loader, profile, summary = make_data()
    net = make_net(bn=True)
    client = methods.get("surgical").make_client(net, profile, loader, summary=summary, warmup_epochs=1, lr=0.01)
    glob = to_numpy(net.state_dict())
    u0 = client.train(glob, 0)
    assert "warmup_loss" in u0.metrics and u0.meta["head_name"] == "head"
    assert u0.meta["labeled_mask"] == [True, True, False]
    assert "warmup_loss" not in client.train(glob, 1).metrics
    fedbn = methods.get("surgical").make_client(make_net(bn=True), profile, loader, feature_rule="fedbn")
    assert fedbn.bn_policy == "fedbn" and fedbn.local_keys == set(batchnorm_keys(fedbn.net))
    plus = methods.get("surgical").make_client(make_net(bn=True), profile, loader, feature_rule="fedbn+")
    assert plus.bn_policy == "fedbn+"
    with pytest.raises(ValueError):
        methods.get("surgical").make_client(make_net(), profile, loader, feature_rule="fedbn", bn_policy="fedavg")
    with pytest.raises(ValueError):
        methods.get("surgical").make_client(make_net(), profile, loader, feature_rule="fedprox")


# ------------------------------------------------------------------ registry and rounds

def test_registry_has_the_methods_and_checks_options():
    assert {"fedavg", "fedavg_pl", "fedprox", "fedbn", "fedbn_plus", "surgical", "fedpsl", "fedpsl_tdma",
            "fedpsl_tadl"} <= set(methods.names())
    assert methods.get("fedpsl").options()["tadl"] is True
    assert methods.get("fedpsl_tdma").options()["tadl"] is False
    assert methods.get("fedpsl_tadl").server is FedAvgServer
    assert isinstance(methods.get("fedpsl_tadl").make_server(), FedAvgServer)
    assert methods.get("fedpsl_tadl").make_server().weighted is True
    assert methods.get("surgical").make_server().weighted is False
    with pytest.raises(ValueError, match="warmup_epoch"):
        methods.get("surgical").options(warmup_epoch=3)


@pytest.mark.parametrize("name", ["fedavg", "fedavg_pl", "fedprox", "fedbn", "fedbn_plus", "surgical", "fedpsl",
                                  "fedpsl_tdma", "fedpsl_tadl"])
def test_two_rounds_two_sites(name):
    method = methods.get(name)
    net0 = make_net(bn=True)
    glob = to_numpy(net0.state_dict())
    clients = []
    for seed, annotated in [(1, ("a", "b")), (2, ("a",))]:
        loader, profile, summary = make_data(seed, batches=(6, 6), annotated=annotated)
        net = make_net(seed=seed, bn=True)
        clients.append(method.make_client(net, profile, loader, summary=summary, lr=0.01, warmup_epochs=1)
                       if name == "surgical" else method.make_client(net, profile, loader, summary=summary, lr=0.01))
    server = method.make_server()
    for rnd in range(2):
        updates = [c.train(glob, rnd) for c in clients]
        assert all(np.isfinite(u.metrics["train_loss"]) for u in updates)
        glob = server.aggregate(updates, glob, rnd)
        assert set(glob) == set(net0.state_dict())
    if name in ("surgical", "fedpsl", "fedpsl_tdma"):  # class "c": nobody annotates it
        np.testing.assert_array_equal(glob["head.weight"][2], net0.head.weight[2].detach().numpy())


def test_methods_do_not_import_nvflare():
    folder = Path(methods.__file__).parent
    for path in folder.glob("*.py"):
        assert "nvflare" not in path.read_text(), path
