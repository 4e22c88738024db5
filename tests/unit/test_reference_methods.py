"""The independent method references (benchmarks/reference/semisup.py, surgical.py, fedmix.py, fedst.py, fedmlp.py,
fedpsl.py, partial_fedavg.py) against
hand-computed numbers, and the project's server rules and sites against the references on the same inputs (same
weights, same counts, one batch: the rules are deterministic there)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from reference import semisup as ref  # noqa: E402
from reference import surgical as ref_surgical  # noqa: E402
from helpers import site_context


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def assert_same_rounds(project: list, reference: list) -> None:
    """The project's weights after each round (numpy arrays) equal the reference's (tensors) to 1e-5."""
    assert len(project) == len(reference)
    for rnd, (want, got) in enumerate(zip(project, reference)):
        for k, v in got.items():
            np.testing.assert_allclose(want[k], v.numpy(), rtol=0, atol=1e-5, err_msg=f"round {rnd} {k}")


def assert_differs(project: dict, other: dict) -> None:
    """Some weight of the project's model is more than 1e-3 from ``other``'s: the switch under test matters at
    the tolerance of ``assert_same_rounds``."""
    assert max(float(np.abs(project[k] - other[k].numpy()).max()) for k in other) > 1e-3


# ---------------------------------------------------------------- Eq. 2-3 by hand

# Two sites, two tensors; n = (3, 1).
# W_avg = (3 S1 + S2) / 4 = {a: [1.5, 2], b: [0.5]}
# paper distance (whole model): d1 = sqrt(1.5^2 + 2^2 + 0.5^2) = sqrt(6.5), d2 = sqrt(4.5^2 + 6^2 + 1.5^2) = 3 sqrt(6.5)
# RSCFed's model_dist (sum of per-tensor norms): d1 = 2.5 + 0.5 = 3, d2 = 7.5 + 1.5 = 9
S1 = {"a": t([0.0, 0.0]), "b": t([0.0])}
S2 = {"a": t([6.0, 8.0]), "b": t([2.0])}


def test_distances_by_hand():
    avg = ref.mean_state([S1, S2], [3, 1])
    assert avg["a"].tolist() == [1.5, 2.0] and avg["b"].tolist() == [0.5]
    assert ref.flat_distance(S1, avg) == pytest.approx(math.sqrt(6.5))
    assert ref.flat_distance(S2, avg) == pytest.approx(3 * math.sqrt(6.5))
    assert ref.sum_of_norms(S1, avg) == pytest.approx(3.0)
    assert ref.sum_of_norms(S2, avg) == pytest.approx(9.0)


@pytest.mark.parametrize("distance,d1,d2", [("paper", math.sqrt(6.5), 3 * math.sqrt(6.5)), ("rscfed", 3.0, 9.0)])
def test_dynamic_weights_by_hand(distance, d1, d2):
    # scale 1: c_k = n_k exp(-d_k / n_k)
    c = np.array([3 * math.exp(-d1 / 3), 1 * math.exp(-d2 / 1)])
    got = ref.dynamic_weights([S1, S2], [3, 1], 1.0, distance)
    np.testing.assert_allclose(got, c / c.sum(), rtol=1e-12)
    # scale 0 is FedAvg by n: 3/4, 1/4, and the aggregate is W_avg
    np.testing.assert_allclose(ref.dynamic_weights([S1, S2], [3, 1], 0.0, distance), [0.75, 0.25])
    agg = ref.wfedavg([S1, S2], [3, 1], 0.0, distance)
    assert agg["a"].tolist() == [1.5, 2.0]
    # RSCFed's 1e4: every exp underflows alone; the ratio survives and the closer-per-case site takes it all
    np.testing.assert_allclose(ref.dynamic_weights([S1, S2], [3, 1], 1e4, distance), [1.0, 0.0], atol=1e-12)


def test_mean_state_rounds_integer_tensors_and_keeps_dtypes():
    a = {"w": torch.tensor([1.0], dtype=torch.float32), "k": torch.tensor(1)}
    b = {"w": torch.tensor([2.0], dtype=torch.float32), "k": torch.tensor(2)}
    out = ref.mean_state([a, b], [1, 3])  # (1 + 3*2) / 4 = 1.75
    assert out["w"].dtype == torch.float32 and out["w"].item() == pytest.approx(1.75)
    assert out["k"].dtype == torch.int64 and out["k"].item() == 2  # 1.75 rounded, not truncated


# ---------------------------------------------------------------- local rules by hand


def test_sharpen_im_consistency_ema_by_hand():
    # Sharpen([0.6, 0.4], T = 0.5) = [0.36, 0.16] / 0.52
    np.testing.assert_allclose(ref.sharpen(t([[0.6, 0.4]]), 0.5).numpy(), [[0.36 / 0.52, 0.16 / 0.52]])
    # IM: p1 = [0.8, 0.2], p2 = [0.2, 0.8]: mean entropy -(0.8 ln 0.8 + 0.2 ln 0.2) = 0.500402,
    # mean prediction [0.5, 0.5] with entropy ln 2: 0.500402 - 0.693147 = -0.192745
    logits = torch.log(t([[0.8, 0.2], [0.2, 0.8]]))
    assert float(ref.im_loss(logits)) == pytest.approx(-(0.8 * math.log(0.8) + 0.2 * math.log(0.2)) - math.log(2))
    assert float(ref.im_loss(torch.log(t([[0.5, 0.5], [0.5, 0.5]])))) == pytest.approx(0.0, abs=1e-12)
    # consistency: case 1 (0.4^2 + 0.4^2) = 0.32, case 2 0: mean 0.16
    assert float(ref.consistency(t([[1, 0], [0, 1]]), t([[0.6, 0.4], [0, 1]]))) == pytest.approx(0.16)
    # Eq. 1 with alpha 0.25: 0.25 * 3 + 0.75 * 1 = 1.5
    teacher, student = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        teacher.weight.fill_(1.0)
        student.weight.fill_(3.0)
    ref.ema(teacher, student, 0.25)
    assert teacher.weight.item() == pytest.approx(1.5)


# ---------------------------------------------------------------- round order with stub sites


class Stub:
    """A site whose training returns the received weights plus its own delta; records what it received."""

    def __init__(self, name, labeled, n, delta):
        self.name, self.labeled, self.n, self.delta, self.seen = name, labeled, n, delta, []

    def train(self, weights, method, gen):
        self.seen.append(float(weights["w"][0]))
        return {"w": weights["w"] + self.delta}


def stubs():
    return [Stub("L1", True, 10, 10.0), Stub("U1", False, 10, 1.0), Stub("U2", False, 30, 3.0)]


SCALE0 = {**ref.CHECK, "sup_scale": 0.0, "dist_scale": 0.0}


def test_isofed_round_by_hand():
    sites = stubs()
    new = ref.one_round("isofed", sites, {"w": t([0.0])}, SCALE0, None)
    # unlabeled group from W_glob = 0: W_u = (10 * 1 + 30 * 3) / 40 = 2.5; the labeled site from W_u: 12.5
    assert [s.seen for s in sites] == [[2.5], [0.0], [0.0]]
    assert new["w"].item() == pytest.approx(12.5)


def test_mt_wfedavg_round_by_hand():
    sites = stubs()
    new = ref.one_round("mt_wfedavg", sites, {"w": t([0.0])}, SCALE0, None)
    assert [s.seen for s in sites] == [[0.0], [0.0], [0.0]]
    assert new["w"].item() == pytest.approx((10 * 10 + 10 * 1 + 30 * 3) / 50)  # 4.0


def test_rscfed_round_by_hand():
    sites = stubs()
    # subsets {L1, U1} and {U1, U2}, every member from W_glob = 0 (U1 twice): (10*10 + 10*1) / 20 = 5.5 and
    # (10*1 + 30*3) / 40 = 2.5; W_glob = their plain mean, 4.0 (a count-weighted mean of the two would be 3.5)
    new = ref.one_round("rscfed", sites, {"w": t([0.0])}, SCALE0, None, draws=[[0, 1], [1, 2]])
    assert [s.seen for s in sites] == [[0.0], [0.0, 0.0], [0.0]]
    assert new["w"].item() == pytest.approx(4.0)
    # a subset whose every model diverged is left out of the mean
    sites = stubs()
    sites[0].delta = float("nan")
    dropped = []
    new = ref.one_round("rscfed", sites, {"w": t([0.0])}, SCALE0, None, dropped=dropped, draws=[[0], [1, 2]])
    assert dropped == ["L1"] and new["w"].item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="subsets"):
        ref.one_round("rscfed", stubs(), {"w": t([0.0])}, SCALE0, None)


def test_rscfed_subset_scale_follows_its_members():
    # the subset holding the labeled site uses sup_scale (0: FedAvg), the unlabeled-only one dist_scale (large:
    # the model closest per case wins)
    sites = [Stub("L1", True, 10, 10.0), Stub("U1", False, 10, 1.0), Stub("U2", False, 10, 9.0),
             Stub("U3", False, 10, 2.0)]
    new = ref.one_round("rscfed", sites, {"w": t([0.0])}, {**SCALE0, "dist_scale": 1e4}, None,
                        draws=[[0, 1], [1, 2, 3]])
    assert new["w"].item() == pytest.approx((5.5 + 2.0) / 2)


def test_rscfed_draws_distinct_sites_per_subset():
    import random

    draws = [ref.draw_subsets(random.Random(s), 4, {"subsets": 3, "subset_size": 3}) for s in range(20)]
    assert all(len(d) == 3 and all(len(set(g)) == 3 and set(g) <= {0, 1, 2, 3} for g in d) for d in draws)
    assert len({tuple(map(tuple, d)) for d in draws}) > 1  # the seed changes the draw
    with pytest.raises(ValueError, match="subset_size"):
        ref.draw_subsets(random.Random(0), 2, {"subsets": 3, "subset_size": 3})


def test_the_groups_scales():
    # unlabeled-only group: dist_scale; a group holding a labeled site: sup_scale. Infinite scale on the unlabeled
    # group only: W_u is the closest-per-case site's model, the labeled step stays FedAvg
    sites = [Stub("L1", True, 10, 10.0), Stub("U1", False, 10, 1.0), Stub("U2", False, 10, 9.0),
             Stub("U3", False, 10, 2.0)]
    new = ref.one_round("isofed", sites, {"w": t([0.0])}, {**SCALE0, "dist_scale": 1e4}, None)
    assert sites[0].seen == [2.0]  # W_avg = 4; U3 (distance 2) is the closest
    assert new["w"].item() == pytest.approx(12.0)


# ---------------------------------------------------------------- the project's rules give the reference's aggregate


fedlabels = pytest.importorskip("fedlabels")


def _random_states(k, seed, int_key=False):
    g = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        s = {"conv.weight": g.normal(size=(3, 2, 2)).astype(np.float32),
             "fc.weight": g.normal(size=(4, 5)).astype(np.float32), "fc.bias": g.normal(size=4).astype(np.float32)}
        if int_key:
            s["bn.num_batches_tracked"] = np.array(g.integers(0, 10), dtype=np.int64)
        out.append(s)
    return out


def _torch(state):
    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}


@pytest.mark.parametrize("scale", [0.0, 0.5, 1.0, 1e4])
def test_project_distance_weights_equal_the_reference(scale):
    from fedlabels.methods.aggregate import average_keys, distance_weights
    from fedlabels.methods.base import Update

    states, n = _random_states(3, 1), [120, 40, 75]
    updates = [Update(f"s{i}", s, ni) for i, (s, ni) in enumerate(zip(states, n))]
    got = distance_weights(updates, states[0], scale)
    want = ref.dynamic_weights([_torch(s) for s in states], n, scale, "paper")
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)
    agg = average_keys(updates, states[0], got)
    ragg = ref.mean_state([_torch(s) for s in states], want)
    for k in agg:
        np.testing.assert_allclose(agg[k], ragg[k].numpy(), rtol=1e-6, atol=1e-7)


def _engine_round(server, deltas, n, start):
    """One round of a project server rule through the project's round engine, sites adding their delta."""
    from fedlabels.engine import RoundEngine
    from fedlabels.methods.base import Update

    seen = {}

    def send(step, targets, weights, rnd, extras):
        out = []
        for s in targets:
            seen.setdefault(s, []).append({k: np.array(v) for k, v in weights.items()})
            out.append(Update(s, {k: np.asarray(weights[k]) + deltas[s][k] for k in weights}, n[s]))
        return out

    server.setup({s: {"labeled": s.startswith("L")} for s in deltas})
    new, _, _ = RoundEngine(server, send, key_metric=None).run_round(0, start, sorted(deltas))
    return new, seen


class TensorStub(Stub):
    def __init__(self, name, labeled, n, delta):
        super().__init__(name, labeled, n, delta)

    def train(self, weights, method, gen):
        self.seen.append({k: v.clone() for k, v in weights.items()})
        return {k: weights[k] + _torch(self.delta)[k].to(weights[k].dtype) for k in weights}


@pytest.mark.parametrize("method", ["isofed", "mt_wfedavg", "wfedavg", "rscfed"])
@pytest.mark.parametrize("scales", [(1.0, 1e4, 1.0), (0.3, 2.0, 1.0), (0.3, 2.0, 6.0)])
def test_project_semisup_servers_equal_the_reference_round(method, scales):
    """Third case: RSCFed's labeled multiplier (README --w_mul_times=6, on the coefficient only)."""
    from fedlabels.methods.semisup import IsoFedServer, RSCFedServer, WeightedFedAvgServer

    sup, dist, mul = scales
    names = ["L1", "L2", "U1", "U2"] if method != "wfedavg" else ["L1", "L2", "L3"]
    deltas = dict(zip(names, _random_states(len(names), 7)))
    n = dict(zip(names, [50, 20, 35, 90][:len(names)]))
    start = _random_states(1, 3)[0]
    if method == "rscfed":  # subsets of 2: at seed 5 one holds only unlabeled sites, so both scales are used
        server = RSCFedServer(subsets=3, subset_size=2, seed=5, lambda_c=sup, lambda_unlabeled=dist,
                              labeled_multiplier=mul)
        draws = [[names.index(x) for x in g] for g in server.draw(0, names)]
        assert any(all(names[i].startswith("U") for i in d) for d in draws)
        assert any(any(names[i].startswith("L") for i in d) for d in draws)
    else:
        server = (IsoFedServer if method == "isofed" else WeightedFedAvgServer)(lambda_c=sup, lambda_unlabeled=dist,
                                                                                 labeled_multiplier=mul)
        draws = None
    got, seen = _engine_round(server, deltas, n, start)
    sites = [TensorStub(s, s.startswith("L"), n[s], deltas[s]) for s in names]
    want = ref.one_round(method, sites, _torch(start),
                         {**ref.CHECK, "sup_scale": sup, "dist_scale": dist, "w_mul_times": mul}, None, draws=draws)
    for k in start:
        np.testing.assert_allclose(got[k], want[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    for site in sites:  # each site received the same models, as often, on both sides
        assert len(seen.get(site.name, [])) == len(site.seen)
        for a, b in zip(seen.get(site.name, []), site.seen):
            for k in a:
                np.testing.assert_allclose(a[k], b[k].numpy(), rtol=1e-5, atol=1e-6)


def test_project_losses_equal_the_reference():
    from fedlabels.losses import consistency_mse, information_maximization, sharpen

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 5, generator=g, dtype=torch.float64)
    other = torch.softmax(torch.randn(16, 5, generator=g, dtype=torch.float64), 1)
    p = torch.softmax(logits, 1)
    for temp in (0.5, 0.25, 1.0):
        torch.testing.assert_close(sharpen(p, temp), ref.sharpen(p, temp))
    torch.testing.assert_close(information_maximization(logits), ref.im_loss(logits))
    torch.testing.assert_close(consistency_mse(other, p), ref.consistency(other, p))


@pytest.mark.parametrize("weighted", [False, True])
def test_project_surgical_server_equals_the_reference(weighted):
    from fedlabels.methods.base import Update
    from fedlabels.methods.surgical import SurgicalServer

    states = _random_states(3, 11, int_key=True)
    glob = _random_states(1, 12, int_key=True)[0]
    # fc has 4 classes: 0 at every site, 1 at sites 0 and 2, 2 at site 1 only (Eq. 3), 3 at none
    masks = [[True, True, False, False], [True, False, True, False], [True, True, False, False]]
    n = [30, 10, 60]
    updates = [Update(f"s{k}", s, n[k], {"labeled_mask": masks[k], "head_name": "fc"}) for k, s in enumerate(states)]
    got = SurgicalServer(weighted=weighted).aggregate(updates, glob, 0)
    want = ref_surgical.aggregate(states, masks, glob, "fc", weights=n if weighted else None)
    assert list(got) == list(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)
        assert got[k].dtype == want[k].dtype


def test_surgical_reference_by_hand():
    states = [{"f": np.array([1.0]), "h.weight": np.array([[1.0, 1.0], [2.0, 2.0], [9.0, 9.0]]),
               "h.bias": np.array([1.0, 2.0, 9.0])},
              {"f": np.array([4.0]), "h.weight": np.array([[3.0, 3.0], [9.0, 9.0], [9.0, 9.0]]),
               "h.bias": np.array([3.0, 9.0, 9.0])}]
    glob = {"f": np.array([0.0]), "h.weight": np.full((3, 2), 7.0), "h.bias": np.full(3, 7.0)}
    masks = [[True, True, False], [True, False, False]]
    out = ref_surgical.aggregate(states, masks, glob, "h")
    assert out["f"].tolist() == [2.5]                                        # Eq. 1: (1 + 4) / 2
    assert out["h.weight"].tolist() == [[2.0, 2.0], [2.0, 2.0], [7.0, 7.0]]  # Eq. 2, Eq. 3, nobody: kept
    assert out["h.bias"].tolist() == [2.0, 2.0, 7.0]
    assert ref_surgical.aggregate(states, masks, glob, "h", weights=[3, 1])["f"].tolist() == [1.75]


class _TinyResNet(torch.nn.Module):
    """The reference ResNet-18's attribute layout (stem, layers, fc) at toy size, with the project's head
    interface (head_name, head, extract), so both clients can train the same network."""

    head_name = "fc"

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4),
                                        torch.nn.ReLU())  # no bias before batch norm: its gradient is float noise
        self.layers = torch.nn.Identity()
        self.fc = torch.nn.Linear(4, 3)

    @property
    def head(self):
        return self.fc

    def extract(self, x):
        return ref_surgical.features(self, x)

    def forward(self, x):
        return self.fc(self.extract(x))


@pytest.mark.parametrize("pos_weight", ["none", "neg_over_pos"])
def test_project_surgical_client_equals_the_reference_over_two_rounds(pos_weight):
    """Surgical's site, two rounds with Adam carried: the head warm-up on frozen features in round 0 only, then
    the partial BCE (the paper's unweighted, or positives weighted by N_neg / N_pos) on every entry the site
    annotates. One batch holding every case and no augmentation, so the reference's shuffling cannot change the
    batch's means."""
    from fedlabels.methods.base import to_numpy
    from fedlabels.methods.surgical import SurgicalClient
    from fedlabels.profile import SiteProfile
    from reference import partial_fedavg as rf

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1, 5, 5, generator=g)
    # class a: 4 positives of 6, class b: 2 (a positive weighting would weigh them 0.5 and 2), class c: not annotated
    y = torch.tensor([[1, 0, -1], [0, 1, -1], [1, 1, -1], [0, 0, -1], [1, 0, -1], [1, 0, -1]], dtype=torch.float32)
    s = {**ref_surgical.CHECK, "lr": 0.01, "warmup_epochs": 2, "warmup_lr": 0.05, "pos_weight": pos_weight}
    profile = SiteProfile("site-1", "multilabel", ("a", "b", "c"), ("a", "b"), "image")
    ctx = site_context(profile, [{"image": x, "label": y}], labels=y.long().tolist())
    torch.manual_seed(0)
    net = _TinyResNet()
    start = to_numpy(net.state_dict())
    client = SurgicalClient(net, ctx, warmup_epochs=s["warmup_epochs"], warmup_lr=s["warmup_lr"], lr=s["lr"],
                            optimizer=s["optimizer"], reset_optimizer=not s["carry_optimizer"],
                            pos_weighted=s["pos_weight"] == "neg_over_pos")
    weight = rf.class_weights(y, s["pos_weight"])
    assert weight is None or weight.tolist() == [0.5, 2.0, 1.0]
    rnet = _TinyResNet()
    ropt = torch.optim.Adam(rnet.parameters(), lr=s["lr"])
    gen = torch.Generator().manual_seed(0)

    def one_batch(n):
        return [torch.randperm(n, generator=gen)]

    weights = start
    for rnd in (0, 1):
        sent = client.train(weights, rnd).weights
        rnet.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
        if rnd == 0:
            ref_surgical.warm_up(rnet, x, y, one_batch, s["warmup_epochs"], s["warmup_lr"], lambda v: v, weight)
        ref_surgical.train_local(rnet, ropt, x, y, one_batch, s["epochs"], lambda v: v, weight)
        for k, v in rnet.state_dict().items():
            np.testing.assert_allclose(sent[k], v.detach().numpy(), rtol=0, atol=1e-5, err_msg=f"round {rnd} {k}")
        weights = {k: np.asarray(v) + 0.01 * (np.asarray(v).dtype.kind == "f") for k, v in sent.items()}
    # the unannotated class's row gets no gradient: only the warm-up and local steps of classes a and b moved
    np.testing.assert_array_equal(sent["fc.weight"][2], start["fc.weight"][2] + 0.01)
    assert not np.allclose(sent["fc.weight"][:2], start["fc.weight"][:2])


def _scenario(root, sites, size=4):
    """A tiny prepared scenario: ``sites`` = {name: [label, ...]} (-1 = unlabeled), 2 classes, size x size images."""
    import json

    import yaml
    from PIL import Image

    (root / "test").mkdir(parents=True)
    Image.fromarray(np.zeros((size, size), np.uint8)).save(root / "test" / "a.png")
    (root / "test" / "datalist.json").write_text(json.dumps({"testing": [{"image": "a.png", "label": 0}]}))
    for name, labels in sites.items():
        (root / name).mkdir()
        items = []
        for i, y in enumerate(labels):
            Image.fromarray(np.full((size, size), 40 * i, np.uint8)).save(root / name / f"{i}.png")
            items.append({"image": f"{i}.png", "label": y})
        (root / name / "datalist.json").write_text(json.dumps({"training": items}))
        (root / name / "oracle.json").write_text(json.dumps({"training": [{**it, "label": 1} for it in items]}))
    (root / "scenario.yaml").write_text(yaml.safe_dump({"classes": ["a", "b"], "sites": list(sites)}))


def test_read_sites_tells_labeled_from_unlabeled_sites_and_refuses_a_mixed_one(tmp_path):
    _scenario(tmp_path / "ok", {"site-1": [0, 1], "site-2": [-1, -1, -1]})
    sites, test, classes = ref.read_sites(tmp_path / "ok", 1, "fixed", oracle=False)
    assert [(len(y), lab) for _, y, lab in sites] == [(2, True), (3, False)] and classes == 2
    assert np.allclose(sites[1][0][1].numpy(), 40 / 127.5 - 1)  # image 1 of site-2: 40 -> x / 127.5 - 1
    oracle, _, _ = ref.read_sites(tmp_path / "ok", 1, "fixed", oracle=True)
    assert [lab for _, _, lab in oracle] == [True, True]  # full labels everywhere: the upper bound
    _scenario(tmp_path / "mixed", {"site-1": [0, -1]})
    with pytest.raises(ValueError, match="1 of 2 cases labeled"):
        ref.read_sites(tmp_path / "mixed", 1, "fixed", oracle=False)


def test_project_unlabeled_client_equals_the_reference_over_two_rounds():
    """IsoFed's unlabeled site, two rounds, SGD state carried: IM pretraining, then the mean teacher. One batch
    holding every case and no augmentation, so the reference's shuffling cannot change its per-case means."""
    from fedlabels.methods.base import to_numpy
    from fedlabels.methods.semisup import SemiSupClient
    from fedlabels.profile import SiteProfile

    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 3, generator=g)
    # the unlabeled site's own lr and a clip small enough to act on this batch's gradients
    s = {**ref.CHECK, "augment": "none", "strong": "none", "batch_size": 100, "lr": 0.1, "lr_unlabeled": 0.07,
         "max_grad_norm": 0.05, "lambda_u": 2.0, "ema_alpha": 0.3, "pretrain_epochs": 2}
    profile = SiteProfile("site-u", "multiclass", ("a", "b"), (), "none")
    ctx = site_context(profile, [{"image": x, "image_strong": x, "label": torch.full((8,), -1)}], labels=[-1] * 8)
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    start = to_numpy(net.state_dict())
    client = SemiSupClient(net, ctx, temperature=s["temperature"], ema_alpha=s["ema_alpha"], lr=s["lr"],
                           optimizer="sgd", weight_decay=s["weight_decay"], consistency_weight=s["lambda_u"],
                           pretrain=True, pretrain_epochs=s["pretrain_epochs"], reset_optimizer=False,
                           lr_unlabeled=s["lr_unlabeled"], momentum=s["momentum"], clip_grad_norm=s["max_grad_norm"])
    rnet = torch.nn.Linear(3, 2)
    ropt = ref.optimizer(rnet.parameters(), s, ref.site_lr(s, labeled=False))
    gen = torch.Generator().manual_seed(0)
    weights = start
    for rnd in (0, 1):
        sent = client.train(weights, rnd).weights
        rnet.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
        ref.pretrain(rnet, x, s, gen)
        ref.train_unlabeled(rnet, ropt, x, s, gen)
        for k, v in rnet.state_dict().items():
            np.testing.assert_allclose(sent[k], v.detach().numpy(), rtol=0, atol=1e-6, err_msg=f"round {rnd} {k}")
        # the next round starts from a moved model, so a carried momentum buffer matters
        weights = {k: np.asarray(v) + 0.05 for k, v in sent.items()}
    assert not np.allclose(sent["weight"], start["weight"])


def test_a_diverged_site_is_left_out_of_its_group():
    sites = stubs()
    sites[2].delta = float("nan")  # U2 diverges: W_u is U1's model alone (1.0), the labeled site trains from it
    dropped = []
    new = ref.one_round("isofed", sites, {"w": t([0.0])}, SCALE0, None, dropped=dropped)
    assert dropped == ["U2"] and sites[0].seen == [1.0] and new["w"].item() == pytest.approx(11.0)
    every = [Stub("L1", True, 10, float("nan"))]
    assert ref.one_round("wfedavg", every, {"w": t([3.0])}, SCALE0, None)["w"].item() == 3.0  # start kept


# ---------------------------------------------------------------- FedMix (benchmarks/reference/fedmix.py)


def test_fedmix_reference_rules_by_hand():
    from reference import fedmix as rf

    box = torch.zeros(1, 1, 4, 4)
    box[..., :2, :] = 1                       # the box: the top 8 pixels
    y1 = torch.zeros(1, 1, 4, 4)
    y1[..., 0, :] = 1                         # 4 pixels inside it
    y2 = y1.clone()
    y2[..., 0, 0] = 0                         # 3 of them: dice(y1, y2) = 6 / 7
    assert float(rf.dice(y1, y2, 0.0)) == pytest.approx(6 / 7)
    assert float(rf.dice(torch.zeros_like(y1), torch.zeros_like(y1), 1e-4)) == 1.0  # two empty labels agree
    assert bool(rf.keep(y1, y2, box, rf.NONE, 0.85, True, 0.0)) and not rf.keep(y1, y2, box, rf.NONE, 0.9, True, 0.0)
    # dice(y1, box) = 8 / 12 >= 0.5: kept; a box twice as large (16 px) gives 8 / 20 < 0.5: dropped
    assert bool(rf.keep(y1, y1, box, rf.BOX, 0.9, True, 0.0))
    assert not rf.keep(y1, y1, torch.ones_like(box), rf.BOX, 0.9, True, 0.0)
    assert bool(rf.keep(y1, y1, torch.ones_like(box), rf.BOX, 0.9, False, 0.0))
    assert not rf.keep(y1, y1, torch.zeros_like(box), rf.IMAGE, 0.9, True, 0.0)  # tagged background only
    assert torch.equal(rf.refine(y1, box * 0, rf.BOX), torch.zeros_like(y1))
    assert torch.equal(rf.refine(y1, box * 0, rf.NONE), y1)
    # Eqs. 4-5: n = (10, 30), L = (0.2, 0.4), beta 2, lam 1: c = (.25, .75), d = (.2, .8), w = (.45, 1.55) / 2
    np.testing.assert_allclose(rf.adaptive_weights([10, 30], [0.2, 0.4], 1.0, 2.0), [0.225, 0.775])
    # the project's server rule gives the same weights on other inputs
    from fedlabels.methods.fedmix import adaptive_weights

    rng = np.random.default_rng(0)
    for _ in range(5):
        n, loss = rng.integers(1, 50, 4), rng.uniform(0.05, 0.9, 4)
        np.testing.assert_allclose(adaptive_weights(n, loss, 10.0, 2.5), rf.adaptive_weights(n, loss, 10.0, 2.5))


def test_fedmix_reference_fedavg_weighs_by_cases_and_one_pixel_site_is_that_site_alone(tmp_path):
    """The reference's FedAvg (the lesion plan's FedAvg, ``oracle:fedavg`` and LL rows): Eq. 5 with lambda = 0,
    weights the sites' case shares whatever their losses; with one pixel-labeled site, FedAvg is that site alone
    (``only``) to every digit."""
    import json

    from fedlabels.data.synthetic import generate
    from reference import fedmix as rf

    data = generate("lesion", tmp_path / "l", seed=0, size=16, cases=10, test_cases=6, sites=3,
                    supervision=["none", "none", "pixel"])
    oracle = data / "site-1" / "oracle.json"  # three cases fewer at site 1: unequal counts
    doc = json.loads(oracle.read_text())
    doc["training"] = doc["training"][3:]
    oracle.write_text(json.dumps(doc))
    n = [len(json.loads((data / s / "oracle.json").read_text())["training"]) for s in ("site-1", "site-2", "site-3")]
    assert len(set(n)) > 1, n
    kw = {"batch_size": 4, "log": lambda m: None}
    full = rf.run(data, 2, {2}, method="fedavg", oracle=True, **kw)
    shares = [round(c / sum(n), 4) for c in n]
    assert full["weights"] == [shares, shares]
    adapt = rf.run(data, 2, {2}, method="fedadaptagg", oracle=True, **kw)  # lam 10: the losses move the weights
    assert all(max(abs(a - b) for a, b in zip(w, shares)) > 1e-3 for w in adapt["weights"])
    fed = rf.run(data, 2, {1, 2}, method="fedavg", **kw)
    alone = rf.run(data, 2, {1, 2}, method="fedavg", only="site-3", **kw)
    assert fed["weights"] == alone["weights"] == [[1.0], [1.0]]
    assert [m["dice"] for m in fed["metrics"].values()] == [m["dice"] for m in alone["metrics"].values()]
    with pytest.raises(ValueError, match="needs a site with pixel masks"):
        rf.run(data, 1, {1}, method="fedavg", only="site-1", **kw)
    with pytest.raises(ValueError, match="field 'sites' has no site 'site-9'"):
        rf.run(data, 1, {1}, method="fedavg", only="site-9", **kw)


def test_project_fedmix_client_equals_the_reference_over_two_rounds():
    """FedMix's box site, two rounds with Adam carried: the received F1, F2 pseudo-label the cases, refine them
    by the boxes, keep those Eq. 2 keeps (some are dropped here), and train F1 on F2's label and F2 on F1's. One
    batch holding every case and no augmentation, so the reference's re-batching of the kept cases and the
    project's selection within its batch train on the same cases."""
    from fedlabels.methods import get
    from fedlabels.methods.base import to_numpy
    from fedlabels.methods.fedmix import BOX
    from fedlabels.nets import TwinUNet
    from fedlabels.profile import SiteProfile
    from reference import fedmix as rf

    g = torch.Generator().manual_seed(5)
    n = 8
    x = torch.rand(n, 1, 16, 16, generator=g)
    prior = torch.zeros(n, 1, 16, 16)
    for i in range(n):  # boxes from 4x4 to the whole image
        side = 4 + 2 * i
        prior[i, 0, :side, :side] = 1
    # epsilon 0.4 with this draw: round 0 keeps cases 0 and 1, drops 2 and 4-7 (they disagree) and 3 (its F1
    # label covers under half its box: the box rule)
    s = {**rf.CHECK, "lr": 0.01, "epsilon": 0.4, "batch_size": n, "dice_eps": 1e-5}
    profile = SiteProfile("site-1", "segmentation", ("lesion",), ("lesion",), "bbox")
    ctx = site_context(profile, [{"image": x, "label": prior, "level": torch.full((n,), BOX)}],
                       {"supervision": "bbox", "labeled": True, "cases": n})
    torch.manual_seed(1)
    net = TwinUNet(in_channels=1, features=(4, 4, 4, 4, 4, 4), num_groups=2)
    start = to_numpy(net.state_dict())
    client = get("fedmix").make_client(net, ctx, epsilon=s["epsilon"], box_rule=s["box_rule"],
                                       threshold=s["threshold"], optimizer="adam", lr=s["lr"],
                                       weight_decay=s["weight_decay"], reset_optimizer=not s["carry_optimizer"])
    rnet = TwinUNet(in_channels=1, features=(4, 4, 4, 4, 4, 4), num_groups=2)
    ropt = torch.optim.Adam(list(rnet.f1.parameters()) + list(rnet.f2.parameters()), lr=s["lr"],
                            weight_decay=s["weight_decay"])
    gen = torch.Generator().manual_seed(0)
    weights, kept = start, []
    for rnd in (0, 1):
        update = client.train(weights, rnd)
        rnet.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
        xs, r1, r2 = rf.sample_and_refine(rnet.f1, rnet.f2, x, prior, rf.BOX, s, gen, augment=False)
        kept.append(len(xs))
        assert update.n == len(xs)
        loss = rf.update([rnet.f1, rnet.f2], ropt, xs, [r2, r1], s, gen, augment=False)
        assert update.metrics["train_loss"] == pytest.approx(loss / 2, abs=1e-5)  # the project's: the mean of two
        for k, v in rnet.state_dict().items():
            np.testing.assert_allclose(update.weights[k], v.detach().numpy(), rtol=0, atol=1e-5,
                                       err_msg=f"round {rnd} {k}")
        weights = {k: np.asarray(v) + 0.01 * (np.asarray(v).dtype.kind == "f") for k, v in update.weights.items()}
    assert all(0 < k < n for k in kept), kept  # the selection dropped some cases and kept others


def test_fedst_reference_rules_by_hand():
    from fedlabels.losses import soft_dice
    from fedlabels.methods.fedmix import FedSTServer
    from reference import fedst as rs

    p = torch.tensor([0.95, 0.6, 0.05, 0.4]).view(1, 1, 2, 2)
    target, mask = rs.confident_targets(p, 0.5, 0.9)
    assert target.flatten().tolist() == [1, 1, 0, 0] and mask.flatten().tolist() == [1, 0, 1, 0]
    # sigmoid = (0.8, 0.3, 0.1, 0.9) over the confident pixels 1 and 3: dice = 2 x 0.8 / (0.8 + 0.1 + 1)
    logits = torch.logit(torch.tensor([0.8, 0.3, 0.1, 0.9], dtype=torch.float64)).view(1, 1, 2, 2)
    want = 1 - 1.6 / 1.9
    t64, m64 = target.double(), mask.double()
    assert float(rs.masked_soft_dice_loss(logits, t64, m64, 0.0)) == pytest.approx(want)
    assert float(soft_dice(logits, t64, m64, smooth=0.0).mean()) == pytest.approx(want)  # the project's loss
    # every pixel kept: FedMix's L_dice, 1 - 2 (0.8 + 0.3) / (2.1 + 2)
    ones = torch.ones_like(m64)
    assert float(rs.masked_soft_dice_loss(logits, t64, ones, 0.0)) == pytest.approx(1 - 2.2 / 4.1)
    # the warm-up: the project's rounds count from 0, the reference's from 1; both self-train from the 4th
    server = FedSTServer(warmup_rounds=3)
    assert [server.extras(r, None)["self_training"] for r in range(6)] == [rs.self_training(r + 1, 3)
                                                                           for r in range(6)]
    assert [rs.self_training(r, 3) for r in range(1, 7)] == [False, False, False, True, True, True]


def test_project_fedst_client_equals_the_reference_over_three_rounds():
    """FedST's site without masks: in the warm-up it sends nothing; then, two rounds with Adam carried, each case
    learns the received model's confident pixels. One batch holding every case and no augmentation, so both
    sides see the same views; the received model differs between rounds."""
    from fedlabels.methods import get
    from fedlabels.methods.base import to_numpy
    from fedlabels.methods.fedmix import NONE, STAGE
    from fedlabels.nets import GroupNormUNet
    from fedlabels.profile import SiteProfile
    from reference import fedst as rs

    g = torch.Generator().manual_seed(3)
    n = 6
    x = torch.rand(n, 1, 16, 16, generator=g)
    s = {**rs.CHECK, "lr": 0.01, "batch_size": n, "dice_eps": 1e-5, "confidence": 0.6}
    profile = SiteProfile("site-1", "segmentation", ("lesion",), ("lesion",), "none")
    ctx = site_context(profile, [{"image": x, "label": torch.ones_like(x), "level": torch.full((n,), NONE)}],
                       {"supervision": "none", "labeled": False, "cases": n})
    torch.manual_seed(1)
    net = GroupNormUNet(in_channels=1, features=(4, 4, 4, 4, 4, 4), num_groups=2)
    weights = to_numpy(net.state_dict())
    client = get("fedst").make_client(net, ctx, confidence=s["confidence"], optimizer="adam", lr=s["lr"],
                                      weight_decay=s["weight_decay"], reset_optimizer=not s["carry_optimizer"])
    warm = client.train(weights, 0, {STAGE: False})
    assert warm.abstain and warm.n == 0
    rnet = GroupNormUNet(in_channels=1, features=(4, 4, 4, 4, 4, 4), num_groups=2)
    ropt = torch.optim.Adam(rnet.parameters(), lr=s["lr"], weight_decay=s["weight_decay"])
    gen = torch.Generator().manual_seed(0)
    confident = []
    for rnd in (1, 2):
        update = client.train(weights, rnd, {STAGE: True})
        rnet.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
        teacher = GroupNormUNet(in_channels=1, features=(4, 4, 4, 4, 4, 4), num_groups=2).eval()
        teacher.load_state_dict(rnet.state_dict())
        with torch.no_grad():
            confident.append(float(rs.confident_targets(torch.sigmoid(teacher(x)), 0.5, s["confidence"])[1].mean()))
        loss = rs.self_train(rnet, teacher, ropt, x, s, gen, augment=False)
        assert update.n == n and update.metrics["train_loss"] == pytest.approx(loss, abs=1e-5)
        for k, v in rnet.state_dict().items():
            np.testing.assert_allclose(update.weights[k], v.detach().numpy(), rtol=0, atol=1e-5,
                                       err_msg=f"round {rnd} {k}")
        weights = {k: np.asarray(v) + 0.01 * (np.asarray(v).dtype.kind == "f") for k, v in update.weights.items()}
    assert all(0 < c < 1 for c in confident), confident  # the mask keeps some pixels and drops others


def test_fedmlp_reference_rules_by_hand():
    from reference import fedmlp as rm

    # Eq. 3 as a shift: pi1 = 1/4 -> log(1/3); a rate of 0, 1 or nothing labeled -> 0
    np.testing.assert_allclose(rm.logit_shift([1, 0, 3, 0], [4, 4, 3, 0]).numpy(), [math.log(1 / 3), 0, 0, 0],
                               rtol=1e-6)
    # Eq. 4: BCE of the two labeled entries (logit 0 -> log 2 each), over batch x C = 2 x 2
    logits, target = torch.zeros(2, 2), torch.tensor([[1.0, -1.0], [0.0, -1.0]])
    assert float(rm.wpc(logits, target, torch.zeros(2))) == pytest.approx(2 * math.log(2) / 4)
    # the shift moves the logit: log(1 + e^-1) for the positive, log(1 + e^1) for the negative
    got = float(rm.wpc(logits, target, torch.tensor([1.0, 0.0])))
    assert got == pytest.approx((math.log1p(math.exp(-1)) + math.log1p(math.exp(1))) / 4)
    # consistency over the masked entries only
    assert float(rm.consistency(torch.tensor([[0.5, 0.9]]), torch.tensor([[0.1, 0.0]]),
                                torch.tensor([[1.0, 0.0]]))) == pytest.approx(0.16)
    # Eq. 7: F along P0 -> 1 - cos(P1, F)
    z = rm.z_scores(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), [1.0, 0.0], [0.0, 1.0])
    np.testing.assert_allclose(z.numpy(), [1.0, -1.0, 0.0], atol=1e-12)
    # Eqs. 8-9: z >= 0: [0.9, 0.2, 0.0, 0.2] (n0 = 4), z < 0: [-0.5, -0.8] (n1 = 2); tau 0.5 -> 2 and 1
    neg, pos = rm.select([0.9, 0.2, -0.5, 0.0, -0.8, 0.2], 0.5, 0.5)
    assert neg.tolist() == [0, 1] and pos.tolist() == [4]  # the tie at 0.2 keeps the earlier case
    assert [len(v) for v in rm.select([0.9, -0.5], 0.99, 0.99)] == [0, 0]  # int(0.99 x 1) = 0
    # Eq. 5 / Eq. 6
    f = torch.tensor([[0.0, 2.0], [2.0, 0.0], [4.0, 0.0]])
    y = torch.tensor([[0.0, -1.0], [1.0, -1.0], [1.0, -1.0]])
    means = rm.class_means(f, y, [0, 1])
    assert list(means) == [0] and means[0].tolist() == [[0.0, 2.0], [3.0, 0.0]]  # class 1: nothing labeled
    g = rm.global_prototypes([{0: torch.ones(2, 2)}, {0: 3 * torch.ones(2, 2), 1: torch.zeros(2, 2)}])
    assert g[0].tolist() == [[2.0, 2.0], [2.0, 2.0]] and g[1].tolist() == [[0.0, 0.0], [0.0, 0.0]]
    # d_c^G by size over the sites given; 1 where none
    d = rm.global_degree([torch.tensor([0.2, 0.4]), torch.tensor([0.8, 0.4])], [10, 30], [[0, 1], []])
    assert d.tolist() == pytest.approx([0.65, 1.0])
    # a missing class's prior: the rate among the site's tags (1 of 2 -> no shift) or over all its cases (1 of 4)
    site = rm.Site(torch.zeros(4, 1, 2, 2), torch.tensor([[1.0, -1.0], [0.0, -1.0], [0.0, -1.0], [0.0, -1.0]]))
    site.tags[0, 1], site.tags[1, 1] = 1.0, 0.0
    np.testing.assert_allclose(site.shift().numpy(), [math.log(1 / 3), 0.0], rtol=1e-6)
    site.missing_prior = "cases"
    np.testing.assert_allclose(site.shift().numpy(), [math.log(1 / 3), math.log(1 / 3)], rtol=1e-6)
    # FedAvg by case counts; integer buffers rounded
    avg = rm.fedavg([{"w": torch.tensor([0.0]), "n": torch.tensor(1)},
                     {"w": torch.tensor([4.0]), "n": torch.tensor(4)}], [3, 1])
    assert avg["w"].tolist() == [1.0] and int(avg["n"]) == 2 and avg["n"].dtype == torch.int64


def test_project_fedmlp_federation_equals_the_reference_over_three_rounds():
    """FedMLP, three sites of different sizes (site-1: 8 cases, classes a and b; site-2: 6, b and c; site-3: 5, a),
    warm-up of one round, Adam fresh each round. Round 0: stage 1 (WPC with the logit shift), then every site sends
    prototypes and degrees; rounds 1-2: stage 2 (each site tags its missing classes with the received model and the
    adaptive ratios, and trains WPC plus the consistency term). The project's clients and server against the
    reference's sites and rules: the tags, each site's prototypes, degrees and weights, and the server's global
    prototypes (Eq. 6, two sites for a and for b), global degrees (by size over the sites lacking the class) and
    weights (by size). One batch holding every case, fixed views."""
    from fedlabels.methods import get
    from fedlabels.methods.base import to_numpy
    from fedlabels.profile import SiteProfile
    from reference import fedmlp as rm

    s = {**rm.CHECK, "lr": 0.05, "warmup_rounds": 1, "tau0": 0.7, "tau1": 0.7, "low": 0.45, "high": 0.55}
    g = torch.Generator().manual_seed(11)
    classes = ("a", "b", "c")
    spec, sizes = {"site-1": ("a", "b"), "site-2": ("b", "c"), "site-3": ("a",)}, {"site-1": 8, "site-2": 6, "site-3": 5}
    data = {}
    for site, mine in spec.items():
        n = sizes[site]
        y = (torch.rand(n, 3, generator=g) < 0.5).float()
        y[:, [c for c in range(3) if classes[c] not in mine]] = -1.0
        data[site] = (torch.randn(n, 1, 5, 5, generator=g), torch.randn(n, 1, 5, 5, generator=g), y)
    method = get("fedmlp")
    client_opts = {"optimizer": "adam", "lr": s["lr"], "weight_decay": s["weight_decay"],
                   "reset_optimizer": not s["carry_optimizer"], "degree_low": s["low"], "degree_high": s["high"]}
    server = method.make_server(warmup_rounds=s["warmup_rounds"], tau0=s["tau0"], tau1=s["tau1"],
                                adaptive_threshold=s["adaptive_threshold"], degree_sites=s["degree_sites"])
    torch.manual_seed(0)
    clients, sites = {}, {}
    for site, (x, xs, y) in data.items():
        profile = SiteProfile(site, "multilabel", classes, spec[site], "image")
        batch = {"image": x, "image_strong": xs, "label": y, "index": torch.arange(sizes[site])}
        ctx = site_context(profile, [batch], labels=y.long().tolist())
        clients[site] = method.make_client(_TinyResNet(), ctx, **client_opts)
        sites[site] = rm.Site(x, y, missing_prior=s["missing_prior"])
    server.setup({site: c.ctx.summary for site, c in clients.items()})
    weights = to_numpy(_TinyResNet().state_dict())
    n = list(sizes.values())
    lacking = [[k for k, site in enumerate(spec) if classes[c] not in spec[site]] for c in range(3)]

    rnet = _TinyResNet()
    rglobal = _TinyResNet()
    rglobal.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
    protos, degree = {}, None
    tagged = []
    for rnd in range(3):
        extras = server.extras(rnd, 0)
        updates = [clients[site].train(weights, rnd, extras) for site in spec]
        # the reference's round
        d = degree if degree is not None else torch.ones(3, dtype=torch.float64)
        states, sent, degrees = [], [], []
        for site, (x, xs, y) in data.items():
            ref = sites[site]
            rnet.load_state_dict(rglobal.state_dict())
            if rnd >= s["warmup_rounds"] and protos:
                ref.tag(rglobal, protos, d * s["tau0"], d * s["tau1"], lambda v: v)
            np.testing.assert_array_equal(clients[site].tags, ref.tags.numpy().astype(np.int8), err_msg=f"{rnd} {site}")
            teacher = rm.teacher_of(rglobal) if rnd >= s["warmup_rounds"] else None
            ref.train(rnet, teacher, lambda m: [torch.arange(m)], 1, lambda v, xs=xs: [v, xs], s["consistency_weight"],
                      lambda net: torch.optim.Adam(net.parameters(), lr=s["lr"], weight_decay=s["weight_decay"]),
                      s["carry_optimizer"])
            states.append({k: v.detach().clone() for k, v in rnet.state_dict().items()})
            p, dk = ref.summary(rnet, lambda v: v, s["low"], s["high"])
            sent.append(p)
            degrees.append(dk)
        for u, state, p, dk in zip(updates, states, sent, degrees):
            for k, v in state.items():
                np.testing.assert_allclose(u.weights[k], v.numpy(), rtol=0, atol=1e-5, err_msg=f"{rnd} {u.site} {k}")
            assert sorted(int(c) for c in u.extras["prototypes"]) == sorted(p)
            for c, pc in p.items():
                np.testing.assert_allclose(u.extras["prototypes"][str(c)], pc.numpy(), rtol=0, atol=1e-5)
            np.testing.assert_allclose(u.extras["degree"], dk.numpy(), atol=1e-12)
        weights = server.aggregate(updates, weights, rnd)
        rglobal.load_state_dict(rm.fedavg(states, n))
        protos = {**protos, **rm.global_prototypes(sent)}
        degree = rm.global_degree(degrees, n, lacking)
        for k, v in rglobal.state_dict().items():
            np.testing.assert_allclose(weights[k], v.numpy(), rtol=0, atol=1e-5, err_msg=f"global {rnd} {k}")
        assert sorted(server.prototypes) == sorted(protos)
        for c, pc in protos.items():
            np.testing.assert_allclose(server.prototypes[c], pc.numpy(), rtol=0, atol=1e-5, err_msg=f"{rnd} {c}")
        np.testing.assert_allclose(server.degree, degree.numpy(), atol=1e-12)
        tagged.append([int((ref.tags >= 0).sum()) for ref in sites.values()])
    # the rounds exercised the detection: no tags after stage 1, tags on every site after it, more in round 2
    assert tagged[0] == [0, 0, 0] and all(t > 0 for t in tagged[1]) and sum(tagged[2]) > sum(tagged[1]), tagged
    # the rules the sizes tell apart were used: two sites sent a's and b's prototypes, two lack c
    assert len(lacking[2]) == 2 and all(sum(c in p for p in sent) == 2 for c in (0, 1))


def test_fedpsl_reference_rules_by_hand():
    from reference import fedpsl as rp

    y = torch.tensor([[1.0, -1.0], [0.0, -1.0], [0.0, -1.0], [0.0, 1.0]])
    assert rp.pos_weight(y).tolist() == [3.0, 1.0]  # class 0: 3 negatives / 1 positive; class 1: no negative
    # BCE of the 5 labeled entries at logit 0, class 0's positive weighted 3: (3 + 1 + 1 + 1 + 1) log 2 / 5
    assert float(rp.loss_fn(torch.zeros(4, 2), y, torch.tensor([3.0, 1.0]))) == pytest.approx(7 * math.log(2) / 5)
    # Eq. 9: the feature by n_k (1:1), head rows by n_k^c (1:0, 3:1); class 2 labeled by nobody keeps its row
    states = [{"f": torch.tensor([0.0]), "fc.weight": torch.tensor([[1.0], [1.0], [5.0]]), "fc.bias": torch.ones(3)},
              {"f": torch.tensor([4.0]), "fc.weight": torch.tensor([[9.0], [3.0], [7.0]]), "fc.bias": torch.zeros(3)}]
    glob = {"f": torch.tensor([0.0]), "fc.weight": torch.full((3, 1), 2.0), "fc.bias": torch.full((3,), 2.0)}
    out = rp.tdma(states, [1, 1], [[1, 3, 0], [0, 1, 0]], glob)  # n_k^c is not proportional to n_k
    assert out["f"].tolist() == [2.0]
    assert out["fc.weight"].flatten().tolist() == [1.0, 1.5, 2.0] and out["fc.bias"].tolist() == [1.0, 0.75, 2.0]


def _two_site_federation(name, seed, edit=None, **options):
    """The project's ``name`` over two sites of different sizes (site-1: 8 cases annotating a and b; site-2: 6
    cases annotating b and c), labels and images drawn from ``seed``, one batch holding every case, no
    augmentation; ``edit(site, y, annotated)`` changes a site's labels. Returns the sites' (x, y), the clients
    (``options`` are theirs), the server (set up) and the sizes."""
    from fedlabels.methods import get
    from fedlabels.profile import SiteProfile

    g = torch.Generator().manual_seed(seed)
    classes, spec, sizes = ("a", "b", "c"), {"site-1": ("a", "b"), "site-2": ("b", "c")}, {"site-1": 8, "site-2": 6}
    method = get(name)
    server = method.make_server()
    data, clients = {}, {}
    torch.manual_seed(0)
    for site, mine in spec.items():
        n = sizes[site]
        y = (torch.rand(n, 3, generator=g) < 0.4).float()
        y[:, [c for c in range(3) if classes[c] not in mine]] = -1.0
        if edit:
            edit(site, y, [classes.index(c) for c in mine])
        x = torch.randn(n, 1, 5, 5, generator=g)
        data[site] = (x, y)
        ctx = site_context(SiteProfile(site, "multilabel", classes, mine, "image"), [{"image": x, "label": y}],
                           labels=y.long().tolist())
        clients[site] = method.make_client(_TinyResNet(), ctx, **options)
    server.setup({site: c.ctx.summary for site, c in clients.items()})
    return data, clients, server, sizes


@pytest.mark.parametrize("row,local,aggregation", [("fedpsl", "tadl", "tdma"), ("fedpsl_tdma", "plain", "tdma"),
                                                   ("fedpsl_tadl", "tadl", "fedavg")])
def test_project_fedpsl_federation_equals_the_reference_over_two_rounds(row, local, aggregation):
    """FedPSL and its two ablations, two sites of different sizes (site-1: 8 cases labeled for a and b; site-2: 6
    cases labeled for b and c), Adam fresh each round: TADL on each site's one batch (halves of 4 and 3 cases,
    batch norm in training mode, the meta-gradient through theta') or a plain Adam step ("w/ TDMA"), then TDMA or
    FedAvg by n_k ("w/ TADL"). The project's clients and server against the reference's steps and rule, weights
    compared after each site and each round."""
    from fedlabels.methods.base import to_numpy
    from reference import fedpsl as rp

    s = {**rp.CHECK, "lr": 0.01, "epochs": 2}

    def edit(site, y, annotated):
        if site == "site-2":
            y[:2, 1] = -1.0  # two cases without a label for b: n_k^c 4 of 6 cases

    data, clients, server, sizes = _two_site_federation(
        row, 4, edit, optimizer="adam", lr=s["lr"], epochs=s["epochs"],
        reset_optimizer=not s["carry_optimizer"], first_order=not s["second_order"])
    spec = list(clients)
    weights = to_numpy(_TinyResNet().state_dict())
    rglobal = _TinyResNet()
    rglobal.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
    rnet = _TinyResNet()
    for rnd in range(2):
        updates = [clients[site].train(weights, rnd) for site in spec]
        states, start = [], {k: v.clone() for k, v in rglobal.state_dict().items()}
        for (site, (x, y)), u in zip(data.items(), updates):
            rnet.load_state_dict(start)
            rp.train_site(rnet, rp.make_optimizers(rnet, local, s["lr"]), x, y, rp.pos_weight(y), s["epochs"],
                          lambda n: [torch.arange(n)], lambda v: v, local, s["lr"], s["second_order"])
            states.append({k: v.detach().clone() for k, v in rnet.state_dict().items()})
            for k, v in states[-1].items():
                np.testing.assert_allclose(u.weights[k], v.numpy(), rtol=0, atol=1e-5, err_msg=f"{rnd} {site} {k}")
        weights = server.aggregate(updates, weights, rnd)
        labeled = [(y >= 0).sum(0).tolist() for _, y in data.values()]
        rglobal.load_state_dict(rp.tdma(states, list(sizes.values()), labeled, rglobal.state_dict())
                                if aggregation == "tdma" else rp.fedmlp.fedavg(states, list(sizes.values())))
        for k, v in rglobal.state_dict().items():
            np.testing.assert_allclose(weights[k], v.numpy(), rtol=0, atol=1e-5, err_msg=f"global {rnd} {k}")
    # TDMA: the rows of a class one site labels are that site's (n_k^c = 0 at the other), not the n_k-weighted
    # mean, which is FedAvg's
    by_size = (8 * states[0]["fc.weight"][0] + 6 * states[1]["fc.weight"][0]) / 14
    if aggregation == "tdma":
        np.testing.assert_allclose(weights["fc.weight"][0], states[0]["fc.weight"][0].numpy(), atol=1e-6)
        np.testing.assert_allclose(weights["fc.weight"][2], states[1]["fc.weight"][2].numpy(), atol=1e-6)
        assert not np.allclose(weights["fc.weight"][0], by_size.numpy())
    else:
        np.testing.assert_allclose(weights["fc.weight"][0], by_size.numpy(), atol=1e-6)
    # the local rules differ at this tolerance: the other rule from the last round's start gives another model
    x, y = data["site-1"]
    rnet.load_state_dict(start)
    other = "plain" if local == "tadl" else "tadl"
    rp.train_site(rnet, rp.make_optimizers(rnet, other, s["lr"]), x, y, rp.pos_weight(y), s["epochs"],
                  lambda n: [torch.arange(n)], lambda v: v, other, s["lr"], s["second_order"])
    assert max(float((rnet.state_dict()[k] - states[0][k]).abs().max()) for k in states[0]) > 1e-3


def test_partial_fedavg_reference_rules_by_hand():
    from reference import partial_fedavg as rf

    y = torch.tensor([[1.0, -1.0], [0.0, -1.0], [0.0, -1.0], [0.0, 1.0]])
    assert rf.class_weights(y, "none") is None
    assert rf.class_weights(y, "neg_over_pos").tolist() == [3.0, 1.0]  # class 1: no annotated negative
    with pytest.raises(ValueError, match="pos_weight"):
        rf.class_weights(y, "cases_over_pos")
    w = torch.tensor([3.0, 1.0])
    # at logit 0 every entry costs log 2, a positive of class 0 three times that.
    # FedAvg (Eq. 1): all 8 entries, the 3 missing ones as negatives: (3 + 3 + 3 + 1) log 2 / 8
    assert float(rf.naive_loss(torch.zeros(4, 2), y, w)) == pytest.approx(10 * math.log(2) / 8)
    # FedAvg-PL: the 5 annotated entries only: (3 + 3 + 1) log 2 / 5
    assert float(rf.partial_loss(torch.zeros(4, 2), y, w)) == pytest.approx(7 * math.log(2) / 5)
    # a missing entry scored positive costs FedAvg (as a negative) and nothing to FedAvg-PL
    logits = torch.tensor([[0.0, 2.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert float(rf.naive_loss(logits, y)) - float(rf.naive_loss(torch.zeros(4, 2), y)) == \
        pytest.approx((math.log1p(math.exp(2.0)) - math.log(2)) / 8)
    assert float(rf.partial_loss(logits, y)) == pytest.approx(float(rf.partial_loss(torch.zeros(4, 2), y)))


@pytest.mark.parametrize("row,pos_weight", [("fedavg", "none"), ("fedavg_pl", "none"), ("fedavg", "neg_over_pos"),
                                            ("fedavg_pl", "neg_over_pos")])
def test_project_partial_fedavg_federation_equals_the_reference_over_two_rounds(row, pos_weight):
    """FedMLP's baselines, two sites of different sizes (site-1: 8 cases labeled for a and b; site-2: 6 cases
    labeled for b and c), Adam fresh each round, one batch holding every case, no augmentation: the project's
    clients and server against the reference's loss and FedAvg, after each site and each round."""
    from fedlabels.methods.base import to_numpy
    from reference import fedmlp as rm
    from reference import partial_fedavg as rf

    s = {**rf.CHECK, "lr": 0.01, "epochs": 2, "pos_weight": pos_weight}

    def edit(site, y, annotated):  # every annotated class has a positive and a negative
        y[0, annotated], y[1, annotated] = 1.0, 0.0

    data, clients, server, sizes = _two_site_federation(
        row, 5, edit, optimizer="adam", lr=s["lr"], epochs=s["epochs"], weight_decay=s["weight_decay"],
        reset_optimizer=not s["carry_optimizer"], pos_weighted=pos_weight == "neg_over_pos")
    spec = list(clients)
    weights = to_numpy(_TinyResNet().state_dict())
    rglobal = _TinyResNet()
    rglobal.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
    rnet = _TinyResNet()
    loss = rf.partial_loss if row == "fedavg_pl" else rf.naive_loss
    for rnd in range(2):
        updates = [clients[site].train(weights, rnd) for site in spec]
        start = {k: v.clone() for k, v in rglobal.state_dict().items()}
        states = []
        for (site, (x, y)), u in zip(data.items(), updates):
            rnet.load_state_dict(rglobal.state_dict())
            opt = torch.optim.Adam(rnet.parameters(), lr=s["lr"], weight_decay=s["weight_decay"])
            rnet.train()
            for _ in range(s["epochs"]):
                batch_loss = loss(rnet(x), y, rf.class_weights(y, pos_weight))
                opt.zero_grad()
                batch_loss.backward()
                opt.step()
            states.append({k: v.detach().clone() for k, v in rnet.state_dict().items()})
            for k, v in states[-1].items():
                np.testing.assert_allclose(u.weights[k], v.numpy(), rtol=0, atol=1e-5, err_msg=f"{rnd} {site} {k}")
        weights = server.aggregate(updates, weights, rnd)
        rglobal.load_state_dict(rm.fedavg(states, list(sizes.values())))
        for k, v in rglobal.state_dict().items():
            np.testing.assert_allclose(weights[k], v.numpy(), rtol=0, atol=1e-5, err_msg=f"global {rnd} {k}")
    # the data tell the two rules apart at the tolerance above: the other row's loss moves site-2's last update
    # elsewhere (Adam's steps are about lr whatever the gradient's size, so the gap is small but not float noise)
    other = rf.naive_loss if row == "fedavg_pl" else rf.partial_loss
    rnet.load_state_dict(start)
    opt = torch.optim.Adam(rnet.parameters(), lr=s["lr"], weight_decay=s["weight_decay"])
    x, y = data["site-2"]
    for _ in range(s["epochs"]):
        batch_loss = other(rnet(x), y, rf.class_weights(y, pos_weight))
        opt.zero_grad()
        batch_loss.backward()
        opt.step()
    gap = np.abs(updates[1].weights["fc.weight"] - rnet.state_dict()["fc.weight"].numpy()).max()
    assert gap > 1e-5 * 5, gap


@pytest.mark.parametrize("row,carry,mu", [("fedavg_pl", False, 0.0), ("fedavg_pl", True, 0.0),
                                         ("fedprox", False, 0.5), ("fedprox", True, 0.5)])
def test_shared_fedavg_rounds_equal_the_project_federation_with_adam_fresh_or_carried(row, carry, mu):
    """``benchmarks/reference/fedavg.run`` (every multi-label reference's rounds) against the project's
    ``fedavg_pl`` or ``fedprox`` sites and server: two sites of 8 and 6 cases, three rounds of two local epochs, one
    batch holding every case, Adam fresh each round or carried (``reset_optimizer`` False, its moments kept), with
    FedProx's proximal term at ``mu`` (large, so that it matters at the tolerance): the global model after each
    round equal. The other Adam rule, and for FedProx no proximal term, give a different model."""
    from fedlabels.methods.base import to_numpy
    from reference import fedavg as rfa
    from reference import partial_fedavg as rf

    def edit(site, y, annotated):  # every annotated class has a positive and a negative
        y[0, annotated], y[1, annotated] = 1.0, 0.0

    data, clients, server, _ = _two_site_federation(row, 6, edit, optimizer="adam", lr=0.01, epochs=2,
                                                    reset_optimizer=not carry, pos_weighted=False,
                                                    **({"mu": mu} if row == "fedprox" else {}))
    start = to_numpy(_TinyResNet().state_dict())
    weights, project = start, []
    for rnd in range(3):
        updates = [c.train(weights, rnd) for c in clients.values()]
        weights = server.aggregate(updates, weights, rnd)
        project.append(weights)

    def reference(carry_optimizer, mu=mu):
        def make_net():
            net = _TinyResNet()
            net.load_state_dict({k: torch.as_tensor(v) for k, v in start.items()})
            return net

        seen = []
        rfa.run(make_net, list(data.values()), lambda net, x, y, k: rf.partial_loss(net(x), y),
                lambda net: seen.append({k: v.clone() for k, v in net.state_dict().items()}) or {}, 3, {1, 2, 3},
                torch.Generator().manual_seed(0), 0.01, batch_size=8, epochs=2, carry_optimizer=carry_optimizer,
                log=lambda m: None, mu=mu)
        return seen

    assert_same_rounds(project, reference(carry))
    others = [reference(not carry)[-1]] + ([reference(carry, mu=0.0)[-1]] if mu else [])
    for other in others:
        assert_differs(project[-1], other)



# ---------------------------------------------------------------- FedFixMatch (benchmarks/reference/fedfixmatch.py)


def test_fedfixmatch_reference_rules_by_hand():
    from reference import fedfixmatch as rx

    # three cases, classes a (annotated) and b, c (missing); confidence 0.8
    y = torch.tensor([[1.0, -1.0, -1.0], [0.0, -1.0, -1.0], [1.0, -1.0, -1.0]])
    probs = torch.tensor([[0.5, 0.9, 0.1], [0.5, 0.85, 0.5], [0.5, 0.05, 0.95]])
    target, mask = rx.pseudo_labels(probs, y, 0.8)
    # case 2 has an unsure missing class (c at 0.5): all its entries out; the annotated class is never a target
    assert mask.tolist() == [[False, True, True], [False, False, False], [False, True, True]]
    assert target[:, 1:].tolist() == [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    # a site missing nothing keeps no case
    assert not rx.pseudo_labels(probs, torch.zeros(3, 3), 0.8)[1].any()
    # loss at weak logits giving those probabilities and strong logits 0: the supervised BCE over the 3 annotated
    # entries at p = 0.5 is log 2; the 4 kept entries each cost log 2 against logit 0, whatever their target
    weak = torch.logit(probs)
    got = rx.loss_fn(weak, torch.zeros(3, 3), y, None, 0.8, 0.5)
    assert float(got) == pytest.approx(math.log(2) + 0.5 * math.log(2))
    # strong logits 2 on the kept entries: targets 1 cost log(1 + e^-2), targets 0 cost log(1 + e^2)
    strong = torch.full((3, 3), 2.0)
    want = math.log(2) + 1.0 * (2 * math.log1p(math.exp(-2)) + 2 * math.log1p(math.exp(2))) / 4
    assert float(rx.loss_fn(weak, strong, y, None, 0.8, 1.0)) == pytest.approx(want)
    # nothing confident: the supervised term alone
    assert float(rx.loss_fn(torch.zeros(3, 3), strong, y, None, 0.8, 1.0)) == pytest.approx(math.log(2))


@pytest.mark.parametrize("pos_weight", ["none", "neg_over_pos"])
def test_project_fedfixmatch_federation_equals_the_reference_over_two_rounds(pos_weight):
    """FedFixMatch, two sites of different sizes (site-1: 8 cases labeled for a and b; site-2: 6 cases labeled for
    b and c), fixed weak and strong views, one batch holding every case, Adam fresh each round, two epochs: the
    project's clients and server against the reference's loss in the shared FedAvg rounds. The confidence is set
    between the cases' certainties on the start model, so some cases are kept and some are not."""
    from fedlabels.methods import get
    from fedlabels.methods.base import to_numpy
    from fedlabels.profile import SiteProfile
    from reference import fedavg as rfa
    from reference import fedfixmatch as rx
    from reference import partial_fedavg as rf

    g = torch.Generator().manual_seed(21)
    classes, spec, sizes = ("a", "b", "c"), {"site-1": ("a", "b"), "site-2": ("b", "c")}, {"site-1": 8, "site-2": 6}
    data = {}
    for site, mine in spec.items():
        y = (torch.rand(sizes[site], 3, generator=g) < 0.4).float()
        annotated = [classes.index(c) for c in mine]
        y[0, annotated], y[1, annotated] = 1.0, 0.0
        y[:, [c for c in range(3) if classes[c] not in mine]] = -1.0
        x = torch.randn(sizes[site], 1, 5, 5, generator=g)
        data[site] = (x, x + 0.5 * torch.randn(x.shape, generator=g), y)
    torch.manual_seed(0)
    start = to_numpy(_TinyResNet().state_dict())
    net0 = _TinyResNet()
    net0.load_state_dict({k: torch.as_tensor(v) for k, v in start.items()})
    with torch.no_grad():  # each case's least certain missing class on the start model (training mode, as trained)
        sure = [torch.where(y < 0, (torch.sigmoid(net0(x)) - 0.5).abs(), torch.ones(1)).amin(1).sort().values
                for x, _, y in data.values()]
    # below every site's third most certain case: each site keeps some cases and not others (the released code
    # forwards the strong view every step, the project only when a case is kept: batch norm's running statistics
    # differ on a step that keeps none)
    confidence = 0.5 + 0.9 * min(float(v[-3]) for v in sure)
    method = get("fedfixmatch")
    server = method.make_server()
    clients = {}
    for site, (x, xs, y) in data.items():
        ctx = site_context(SiteProfile(site, "multilabel", classes, spec[site], "image"),
                           [{"image": x, "image_strong": xs, "label": y}], labels=y.long().tolist())
        clients[site] = method.make_client(_TinyResNet(), ctx, optimizer="adam", lr=0.01, epochs=2,
                                           reset_optimizer=True, pos_weighted=pos_weight == "neg_over_pos",
                                           confidence=confidence, lambda_u=1.0)
    server.setup({site: c.ctx.summary for site, c in clients.items()})
    weights, project, kept = start, [], []
    for rnd in range(2):
        updates = [c.train(weights, rnd) for c in clients.values()]
        kept += [f for c in clients.values() for f in c.confident]
        weights = server.aggregate(updates, weights, rnd)
        project.append(weights)
    # the selection was exercised: some steps kept some cases and dropped others
    assert any(0 < f < 1 for f in kept), kept

    def reference(conf):
        def make_net():
            net = _TinyResNet()
            net.load_state_dict({k: torch.as_tensor(v) for k, v in start.items()})
            return net

        stacked = [(torch.cat([x, xs], 1), y) for x, xs, y in data.values()]  # the views travel with their case
        w = [rf.class_weights(y, pos_weight) for _, _, y in data.values()]
        seen = []
        rfa.run(make_net, stacked,
                lambda net, x, y, k: rx.loss_fn(net(x[:, :1]), net(x[:, 1:]), y, w[k], conf, 1.0),
                lambda net: seen.append({k: v.clone() for k, v in net.state_dict().items()}) or {}, 2, {1, 2},
                torch.Generator().manual_seed(0), 0.01, batch_size=8, epochs=2, log=lambda m: None)
        return seen

    assert_same_rounds(project, reference(confidence))
    # the selection matters at this tolerance: keeping every case (confidence 0.5) gives another model
    other = reference(0.5)[-1]
    assert_differs(project[-1], other)


# ---------------------------------------------------------------- FedNoRo (benchmarks/reference/fednoro.py)


def test_fednoro_reference_rules_by_hand():
    from reference import fednoro as rn

    # the released sigmoid_rampup times a: exp(-5) before begin, exp(-5/4) half way, 1 from end on
    assert rn.ramp_weight(0, 0.8, 10, 20) == pytest.approx(0.8 * math.exp(-5))
    assert rn.ramp_weight(15, 0.8, 10, 20) == pytest.approx(0.8 * math.exp(-1.25))
    assert rn.ramp_weight(25, 0.8, 10, 20) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="rampup_end"):
        rn.ramp_weight(0, 0.8, 5, 5)
    # two cases, class a annotated, b missing; logits 0 (p = 0.5); the teacher's logit 0.8 ln 3 at T = 0.8 gives
    # p = 0.75: the missing entries differ by 0.25, squared 1/16; the annotated ones cost log 2
    y = torch.tensor([[1.0, -1.0], [0.0, -1.0]])
    teacher = torch.full((2, 2), 0.8 * math.log(3))
    got = rn.loss_fn(torch.zeros(2, 2), teacher, y, None, 0.25, 0.8)
    assert float(got) == pytest.approx(0.75 * math.log(2) + 0.25 / 16)
    # nothing missing: the BCE's share alone
    assert float(rn.loss_fn(torch.zeros(2, 2), teacher, torch.zeros(2, 2), None, 0.25, 0.8)) == \
        pytest.approx(0.75 * math.log(2))


@pytest.mark.parametrize("pos_weight", ["none", "neg_over_pos"])
def test_project_fednoro_federation_equals_the_reference_over_three_rounds(pos_weight):
    """FedNoRo, two sites of different sizes (site-1: 8 cases labeled for a and b; site-2: 6 cases labeled for b
    and c), the ramp over rounds 0-2 (w = 0.8 e^-5, 0.8 e^-1.25, 0.8), one batch holding every case, no
    augmentation, Adam fresh each round, two epochs: the project's clients and server against the reference's
    rule in the shared FedAvg rounds, the global model after each round."""
    from fedlabels.methods.base import to_numpy
    from reference import fedavg as rfa
    from reference import fednoro as rn
    from reference import partial_fedavg as rf

    def edit(site, y, annotated):  # every annotated class has a positive and a negative
        y[0, annotated], y[1, annotated] = 1.0, 0.0

    opts = {"kd_weight": 0.8, "temperature": 0.8, "rampup_begin": 0, "rampup_end": 2}
    data, clients, server, _ = _two_site_federation("fednoro", 8, edit, optimizer="adam", lr=0.01, epochs=2,
                                                    reset_optimizer=True, pos_weighted=pos_weight == "neg_over_pos",
                                                    **opts)
    start = to_numpy(_TinyResNet().state_dict())
    weights, project = start, []
    for rnd in range(3):
        updates = [c.train(weights, rnd) for c in clients.values()]
        assert all(u.metrics["kd_weight"] == pytest.approx(rn.ramp_weight(rnd, 0.8, 0, 2)) for u in updates)
        weights = server.aggregate(updates, weights, rnd)
        project.append(weights)

    def reference(temperature):
        def make_net():
            net = _TinyResNet()
            net.load_state_dict({k: torch.as_tensor(v) for k, v in start.items()})
            return net

        begin, loss = rn.rule([rf.class_weights(y, pos_weight) for _, y in data.values()], 0.8, temperature, 0, 2,
                              lambda x: x)
        seen = []
        rfa.run(make_net, list(data.values()), loss,
                lambda net: seen.append({k: v.clone() for k, v in net.state_dict().items()}) or {}, 3, {1, 2, 3},
                torch.Generator().manual_seed(0), 0.01, batch_size=8, epochs=2, log=lambda m: None, start=begin)
        return seen

    assert_same_rounds(project, reference(0.8))
    # the distillation matters at this tolerance: the teacher without its temperature gives another model
    other = reference(1.0)[-1]
    assert_differs(project[-1], other)


# ---------------------------------------------------------------- RSCFed on partial labels (benchmarks/reference/rscfed_pl.py)


def _partial_label_data(spec: dict, classes: tuple, g: torch.Generator) -> dict:
    """Per site of ``spec`` (site -> (annotated classes, cases)): images, a second view of them, and labels with -1
    where the site does not annotate; cases 0 and 1 are a positive and a negative of each annotated class."""
    data = {}
    for site, (mine, n) in spec.items():
        y = (torch.rand(n, len(classes), generator=g) < 0.4).float()
        annotated = [classes.index(c) for c in mine]
        y[0, annotated], y[1, annotated] = 1.0, 0.0
        y[:, [c for c in range(len(classes)) if classes[c] not in mine]] = -1.0
        x = torch.randn(n, 1, 5, 5, generator=g)
        data[site] = (x, x + 0.5 * torch.randn(x.shape, generator=g), y)
    return data


def _reference_sites(data: dict, start: dict) -> list:
    """``rscfed_pl.Site`` s over ``_partial_label_data`` (both views stacked as channels), each network starting
    from ``start``, positives weighted by N_neg / N_pos."""
    from reference import partial_fedavg as rf
    from reference import rscfed_pl as rr

    def make_net():
        net = _TinyResNet()
        net.load_state_dict({k: torch.as_tensor(v) for k, v in start.items()})
        return net

    return [rr.Site(torch.cat([x, xs], 1), y, make_net, rf.class_weights(y, "neg_over_pos"))
            for x, xs, y in data.values()]


def test_rscfed_pl_reference_rules_by_hand():
    from reference import rscfed_pl as rr

    # two cases, class a annotated, b missing; the student's logits 0 (p = 0.5) on both views; the teacher's logit
    # ln 3 (p = 0.75): the missing entries differ by 0.25, squared 1/16; the annotated ones cost log 2
    y = torch.tensor([[1.0, -1.0], [0.0, -1.0]])
    teacher = torch.full((2, 2), math.log(3))
    got = rr.loss_fn(torch.zeros(2, 2), torch.zeros(2, 2), teacher, y, None, 0.5)
    assert float(got) == pytest.approx(math.log(2) + 0.5 / 16)
    # nothing missing, or no strong view: the BCE alone
    assert float(rr.loss_fn(torch.zeros(2, 2), torch.zeros(2, 2), teacher, torch.zeros(2, 2), None, 0.5)) == \
        pytest.approx(math.log(2))
    assert float(rr.loss_fn(torch.zeros(2, 2), None, None, y, None, 0.5)) == pytest.approx(math.log(2))
    # the teacher's parameters move by alpha; its buffers (batch norm) become the student's
    student, teacher_net = torch.nn.BatchNorm1d(2), torch.nn.BatchNorm1d(2)
    with torch.no_grad():
        student.weight.fill_(3.0), teacher_net.weight.fill_(1.0), student.running_mean.fill_(7.0)
    rr.ema(teacher_net, student, 0.25)
    assert teacher_net.weight.tolist() == [1.5, 1.5] and teacher_net.running_mean.tolist() == [7.0, 7.0]
    # a draw whose only member annotates nothing trains nothing: the round keeps the global model
    blank = rr.Site(torch.zeros(3, 1, 4, 4), -torch.ones(3, 2), lambda: torch.nn.Linear(2, 2), None)
    start = {k: v.clone() for k, v in torch.nn.Linear(2, 2).state_dict().items()}
    assert not blank.annotated and rr.one_round([blank], start, [[0]], rr.CHECK, None, None) is start


def test_rscfed_pl_reference_drops_a_last_batch_of_one():
    """9 cases in batches of 8: each epoch's last batch of one is dropped, as the project's loader drops it (batch
    norm raises on one case), and n_k is the 8 cases an epoch trained on, the project's update count."""
    from reference import rscfed_pl as rr

    g = torch.Generator().manual_seed(0)
    y = (torch.rand(9, 2, generator=g) < 0.5).float()
    y[:, 1] = -1.0
    y[0, 0], y[1, 0] = 1.0, 0.0
    site = rr.Site(torch.randn(9, 2, 4, 4, generator=g), y,
                   lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4),
                                               torch.nn.Linear(4, 2)), None)
    start = {k: v.clone() for k, v in site.net.state_dict().items()}
    s = {**rr.CHECK, "batch_size": 8, "epochs": 2, "consistency_weight": 1.0}
    out = site.train(start, s, torch.Generator().manual_seed(1), lambda x, gen: (x[:, :1], x[:, 1:]))
    assert site.n == 8 and any(not torch.equal(out[k], start[k]) for k in start)


def test_the_mean_teacher_references_run_with_a_site_annotating_nothing(tmp_path, monkeypatch):
    """The mixed protocol's site annotating nothing: in RSCFed's draws it is loaded, not dropped, and trains
    nothing; in the composed method it trains (the isolated step)."""
    import json

    from fedlabels.data.synthetic import generate
    from reference import rscfed_pl as rr

    data = generate("cxr", tmp_path / "cxr", seed=0, size=16, cases=10, test_cases=30)
    last = sorted(p.name for p in data.iterdir() if p.name.startswith("site-"))[-1]
    items = json.loads((data / last / "datalist.json").read_text())
    for it in items["training"]:
        it["label"] = [-1] * len(it["label"])
    (data / last / "datalist.json").write_text(json.dumps(items))
    trained, loaded = [], []
    train, init = rr.Site.train, rr.Site.__init__
    monkeypatch.setattr(rr.Site, "train", lambda self, *a: trained.append(self.annotated) or train(self, *a))
    monkeypatch.setattr(rr.Site, "__init__", lambda self, *a: init(self, *a) or loaded.append(self.annotated))
    out = rr.run(data, 2, {2}, batch_size=8, subsets=2, subset_size=2, log=lambda m: None)
    assert 0 <= out["metrics"][2]["auroc"] <= 1 and trained and all(trained)
    # every site loaded, the one annotating nothing among them
    assert loaded.count(False) == 1 and len(loaded) == len([p for p in data.iterdir() if p.name.startswith("site-")])
    # the composed method's reference on the same sites: the site annotating nothing trains in the isolated step
    from reference import composed as rcm

    trained.clear()
    out = rcm.run(data, 1, {1}, batch_size=8, log=lambda m: None)
    assert 0 <= out["metrics"][1]["auroc"] <= 1 and False in trained and True in trained


def test_project_rscfed_pl_federation_equals_the_reference_over_two_rounds():
    """RSCFed on partial labels, three sites (site-1: 8 cases annotating a and b; site-2: 6 annotating b and c;
    site-3: 5 annotating nothing), two draws of two sites a round taken from the project's server and given to the
    reference, fixed weak and strong views, one batch holding every case, Adam fresh each time a site trains,
    positives weighted by N_neg / N_pos, lambda_c 100 (the distance weights matter): the global model after each
    round. A site drawn twice trains twice from the global model; site-3 sits out of its draws on both sides."""
    from fedlabels.methods import get
    from fedlabels.methods.base import DRAW, to_numpy
    from fedlabels.profile import SiteProfile
    from reference import rscfed_pl as rr

    g = torch.Generator().manual_seed(5)
    classes = ("a", "b", "c")
    spec = {"site-1": (("a", "b"), 8), "site-2": (("b", "c"), 6), "site-3": ((), 5)}
    opts = {"optimizer": "adam", "lr": 0.01, "reset_optimizer": True, "pos_weighted": True,
            "consistency_weight": 2.0, "ema_alpha": 0.3}
    method = get("rscfed_pl")
    server = method.make_server(subsets=2, subset_size=2, seed=3, lambda_c=100.0)
    data, clients = _partial_label_data(spec, classes, g), {}
    torch.manual_seed(0)
    for site, (x, xs, y) in data.items():
        mine = spec[site][0]
        # a site annotating nothing has an empty training loader (the bundle keeps annotated cases only): it abstains
        batches = [{"image": x, "image_strong": xs, "label": y}] if mine else []
        ctx = site_context(SiteProfile(site, "multilabel", classes, mine, "image"), batches, labels=y.long().tolist())
        clients[site] = method.make_client(_TinyResNet(), ctx, **opts)
    server.setup({site: c.ctx.summary for site, c in clients.items()})
    names = list(spec)
    start = to_numpy(_TinyResNet().state_dict())
    weights, project, draws = start, [], []
    for rnd in range(2):
        (step,) = server.plan(rnd, names)
        results = []
        for k, group in enumerate(step.groups):
            updates = [u for u in (clients[s].train(weights, rnd, {DRAW: k}) for s in group) if not u.abstain]
            assert [u.site for u in updates] == [s for s in group if s != "site-3"]
            if updates:
                results.append(server.aggregate(updates, weights, rnd))
        draws.append([[names.index(s) for s in group] for group in step.groups])
        weights = server.combine(results, weights, rnd, step)
        project.append(weights)
    # the draws exercise both cases: a draw with site-3 (one site trains) and a site drawn twice in a round
    assert any(2 in d for rd in draws for d in rd) and any(d[0] in rd[1] for rd in draws for d in rd[:1])

    def reference(scale):
        s = {**rr.CHECK, "lr": 0.01, "batch_size": 8, "epochs": 1, "consistency_weight": 2.0, "ema_alpha": 0.3,
             "sup_scale": scale, "pos_weight": "neg_over_pos", "weight_decay": 0.0}
        sites = _reference_sites(data, start)
        w, seen = {k: torch.as_tensor(v) for k, v in start.items()}, []
        for rd in draws:
            w = rr.one_round(sites, w, rd, s, torch.Generator().manual_seed(0), lambda x, gen: (x[:, :1], x[:, 1:]))
            seen.append(w)
        return seen

    assert_same_rounds(project, reference(100.0))
    # the distance weights matter at this tolerance: lambda 0 (FedAvg by n within each draw) gives another model
    other = reference(0.0)[-1]
    assert_differs(project[-1], other)


def test_project_rscfed_pl_site_equals_the_reference_over_two_epochs():
    """One site annotating a and b of a, b, c, two epochs of one batch each: the second step's consistency target is
    the teacher after one EMA step, so the EMA rate shows; Adam fresh, positives weighted by N_neg / N_pos. The
    update's case count is the site's 8 cases."""
    from fedlabels.methods import get
    from fedlabels.methods.base import to_numpy
    from fedlabels.profile import SiteProfile
    from reference import partial_fedavg as rf
    from reference import rscfed_pl as rr

    g = torch.Generator().manual_seed(5)
    y = (torch.rand(8, 3, generator=g) < 0.4).float()
    y[0, :2], y[1, :2], y[:, 2] = 1.0, 0.0, -1.0
    x = torch.randn(8, 1, 5, 5, generator=g)
    xs = x + 0.5 * torch.randn(x.shape, generator=g)
    torch.manual_seed(0)
    start = to_numpy(_TinyResNet().state_dict())
    ctx = site_context(SiteProfile("site-1", "multilabel", ("a", "b", "c"), ("a", "b"), "image"),
                       [{"image": x, "image_strong": xs, "label": y}], labels=y.long().tolist())
    client = get("rscfed_pl").make_client(_TinyResNet(), ctx, optimizer="adam", lr=0.01, reset_optimizer=True,
                                          pos_weighted=True, consistency_weight=2.0, ema_alpha=0.3, epochs=2)
    update = client.train(start, 0, {})
    got = update.weights
    assert update.n == 8  # the site's cases (the papers' n_k), not cases x epochs: Eq. 3's exponent divides by it

    def reference(alpha):
        def make_net():
            net = _TinyResNet()
            net.load_state_dict({k: torch.as_tensor(v) for k, v in start.items()})
            return net

        site = rr.Site(torch.cat([x, xs], 1), y, make_net, rf.class_weights(y, "neg_over_pos"))
        s = {**rr.CHECK, "lr": 0.01, "batch_size": 8, "epochs": 2, "consistency_weight": 2.0, "ema_alpha": alpha,
             "pos_weight": "neg_over_pos", "weight_decay": 0.0}
        return site.train({k: torch.as_tensor(v) for k, v in start.items()}, s, torch.Generator().manual_seed(0),
                          lambda v, gen: (v[:, :1], v[:, 1:]))

    want = reference(0.3)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v.numpy(), rtol=0, atol=1e-5, err_msg=k)
    other = reference(1.0)  # the teacher one step behind the student: another model
    assert_differs(got, other)


# ---------------------------------------------------------------- the composed method (benchmarks/reference/composed.py)


@pytest.mark.parametrize("isolate,classwise_head,weight", [(True, True, 2.0), (False, True, 2.0), (True, False, 2.0),
                                                          (True, True, 0.0)])
def test_project_composed_federation_equals_the_reference_over_two_rounds(isolate, classwise_head, weight):
    """The composed method and its three ablations on the real engine, three sites (F: 6 cases annotating every
    class; P: 8 annotating a; U: 5 annotating nothing), fixed weak and strong views, one batch holding every case,
    Adam fresh each round, positives weighted by N_neg / N_pos: the global model after each round against the
    reference's. U trains the teacher term alone (first, with isolation), or sits out without it."""
    from fedlabels.engine import RoundEngine
    from fedlabels.methods import get
    from fedlabels.methods.base import to_numpy
    from fedlabels.profile import SiteProfile
    from reference import composed as rc_

    g = torch.Generator().manual_seed(8)
    classes = ("a", "b", "c")
    spec = {"F": (classes, 6), "P": (("a",), 8), "U": ((), 5)}
    method = get("composed")
    server = method.make_server(isolate=isolate, classwise_head=classwise_head)
    data, clients = _partial_label_data(spec, classes, g), {}
    torch.manual_seed(0)
    for site, (x, xs, y) in data.items():
        mine = spec[site][0]
        ctx = site_context(SiteProfile(site, "multilabel", classes, mine, "image"),
                           [{"image": x, "image_strong": xs, "label": y}], labels=y.long().tolist())
        clients[site] = method.make_client(_TinyResNet(), ctx, optimizer="adam", lr=0.01, reset_optimizer=True,
                                           pos_weighted=True, consistency_weight=weight, ema_alpha=0.3)
    server.setup({site: c.ctx.summary for site, c in clients.items()})
    start = to_numpy(_TinyResNet().state_dict())
    engine = RoundEngine(server, lambda step, targets, w, rnd, extras: [clients[s].train(w, rnd, extras)
                                                                         for s in targets],
                         key_metric="val_auroc", log=lambda *a: None)
    weights, project = start, []
    for rnd in range(2):
        weights, record, _ = engine.run_round(rnd, weights, list(spec))
        assert ("U" in record["abstained"]) == (weight == 0)
        project.append(weights)

    def reference(s_over):
        s = {**rc_.CHECK, "lr": 0.01, "batch_size": 8, "epochs": 1, "consistency_weight": weight, "ema_alpha": 0.3,
             "pos_weight": "neg_over_pos", "weight_decay": 0.0, "isolate": isolate, "classwise_head": classwise_head,
             **s_over}
        sites = _reference_sites(data, start)
        w, seen = {k: torch.as_tensor(v) for k, v in start.items()}, []
        for _ in range(2):
            w = rc_.one_round(sites, w, s, torch.Generator().manual_seed(0), lambda x, gen: (x[:, :1], x[:, 1:]))
            seen.append(w)
        return seen

    assert_same_rounds(project, reference({}))
    # the part under test matters at this tolerance: its switch flipped gives another model
    flip = {"consistency_weight": 2.0} if not weight else {"isolate": not isolate} if classwise_head else \
        {"classwise_head": True}
    other = reference(flip)[-1]
    assert_differs(project[-1], other)


# ---------------------------------------------------------------- the multi-label references' network


@pytest.mark.parametrize("widen", [0.25, 1.0])
def test_reference_resnet18_is_the_bundles_network(widen):
    """benchmarks/reference/fedavg_multilabel.ResNet18 (written without MONAI) and the chest X-ray bundles'
    network: the same tensors in the same order, the same outputs in training and inference mode once the
    weights are copied, and the same initial weights from the same torch seed but for the three 1x1
    shortcut convolutions' biases, which both draw from PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)) in
    another order."""
    from fedlabels.nets import ResNet18Classifier
    from reference.fedavg_multilabel import ResNet18

    torch.manual_seed(3)
    project = ResNet18Classifier(spatial_dims=2, in_channels=1, out_channels=5, widen_factor=widen)
    torch.manual_seed(3)
    reference = ResNet18(1, 5, widen)
    sp, sr = project.state_dict(), reference.state_dict()
    assert [tuple(v.shape) for v in sp.values()] == [tuple(v.shape) for v in sr.values()]
    drawn_apart = []
    for (kp, vp), (kr, vr) in zip(sp.items(), sr.items()):
        if not torch.equal(vp, vr):
            drawn_apart.append(kr)
            fan_in = sp[kp.replace(".bias", ".weight")].shape[1]  # a 1x1 convolution: its input channels
            assert float(vp.abs().max()) <= fan_in ** -0.5 and float(vr.abs().max()) <= fan_in ** -0.5
    assert drawn_apart == [f"layers.{i}.short.0.bias" for i in (2, 4, 6)]
    torch.manual_seed(4)
    reference.load_state_dict({kr: torch.randn_like(v) if v.is_floating_point() else v
                               for kr, v in sr.items()})
    project.load_state_dict(dict(zip(sp, reference.state_dict().values())))
    x = torch.randn(3, 1, 32, 32)
    for mode in (True, False):
        project.train(mode)
        reference.train(mode)
        with torch.no_grad():
            np.testing.assert_allclose(project(x).numpy(), reference(x).numpy(), rtol=0, atol=1e-5)


def test_reference_grey_rules_and_the_bundles_rule(tmp_path):
    """Colour images to one grey channel: Pillow's luma (``convert("L")``) or the mean of R, G and B, which is the
    chest X-ray bundles' rule (``Ensure2DChannelsd``); a grey image is the same either way."""
    from PIL import Image

    from fedlabels.bundle.data import Ensure2DChannelsd
    from reference.fedavg_multilabel import grey

    rgb = np.zeros((2, 3, 3), dtype=np.uint8)
    rgb[0, 0] = (200, 100, 30)  # luma 0.299*200 + 0.587*100 + 0.114*30 = 121.92; mean 110
    Image.fromarray(rgb).save(tmp_path / "c.png")
    Image.fromarray(rgb[..., 0]).save(tmp_path / "g.png")
    assert grey(tmp_path / "c.png", "luma")[0, 0] == 122 and grey(tmp_path / "c.png", "mean")[0, 0] == 110
    assert np.array_equal(grey(tmp_path / "g.png", "luma"), grey(tmp_path / "g.png", "mean"))
    with pytest.raises(ValueError, match="grey"):
        grey(tmp_path / "c.png", "max")
    bundle = Ensure2DChannelsd("image", channels=1)({"image": torch.from_numpy(rgb).permute(2, 0, 1).float()})
    np.testing.assert_allclose(bundle["image"][0].numpy(), grey(tmp_path / "c.png", "mean"), atol=1e-4)


def test_crop_hflip_is_a_crop_of_the_bundles_resize_at_every_offset():
    """RSCFed's weak view (isofed_rscfed preset): each output is a 28 px window of MONAI's bilinear resize to 35 px,
    mirrored or not, and every offset 0-7 occurs."""
    from monai.transforms import Resize

    x = torch.rand(64, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    big = torch.stack([torch.as_tensor(Resize((35, 35), mode="bilinear", anti_aliasing=False)(im)) for im in x])
    gen = torch.Generator().manual_seed(1)
    out = torch.cat([ref.crop_hflip(x, gen) for _ in range(4)])
    assert out.shape == (256, 3, 28, 28)
    offsets = set()
    for i, o in enumerate(out):
        b = big[i % 64]
        hits = [(a, c, f) for a in range(8) for c in range(8) for f in (False, True)
                if torch.allclose(torch.flip(o, dims=(2,)) if f else o, b[:, a:a + 28, c:c + 28], atol=1e-5)]
        assert hits, f"case {i}: not a window of the resized image"
        offsets |= {h[:2] for h in hits}
    assert {a for a, _ in offsets} == set(range(8)) and {c for _, c in offsets} == set(range(8))


def test_photometric_view_matches_the_bundles_transforms():
    """The strong view's contrast is MONAI's AdjustContrast; its hole is one 7 x 7 square of zeros on 28 px."""
    from monai.transforms import AdjustContrast

    img = torch.rand(3, 28, 28, generator=torch.Generator().manual_seed(2)) * 2 - 1
    for gamma in (0.5, 1.3, 2.0):
        np.testing.assert_allclose(ref.adjust_contrast(img, gamma).numpy(),
                                   np.asarray(AdjustContrast(gamma)(img)), atol=1e-5)
    x = torch.ones(200, 1, 28, 28)
    out = ref.photometric(x, torch.Generator().manual_seed(3))
    holes = [(o == 0).sum().item() for o in out]
    assert set(holes) <= {0, 49} and 0.35 < np.mean([h == 49 for h in holes]) < 0.65  # p 0.5, one 7 x 7 hole
    noisy = [not torch.allclose(o[o != 0], torch.ones(1)) for o in out]
    assert 0.65 < np.mean(noisy) < 0.95  # noise with p 0.8 (a constant image has no contrast to change)


def test_warmup_rounds_train_the_labeled_sites_alone(tmp_path, monkeypatch):
    """While ``warmup_rounds`` last, IsoFed's reference is the labeled sites' wFedAvg, step for step; after them
    the unlabeled sites train."""
    _scenario(tmp_path / "d", {"site-1": [0, 1, 0, 1], "site-2": [-1, -1, -1], "site-3": [-1, -1, -1]}, size=28)
    # "metrics": the global model's weights at each eval round
    monkeypatch.setattr(ref, "test_metrics", lambda net, *a: {"w": torch.cat([p.detach().flatten() for p in net.parameters()])})
    s = {"batch_size": 2, "pretrain_epochs": 1, "channels": 1, "log": lambda m: None}
    warm = ref.run(tmp_path / "d", "isofed", 3, {2, 3}, warmup_rounds=2, **s)["metrics"]
    alone = ref.run(tmp_path / "d", "wfedavg", 3, {1, 2, 3}, **s)["metrics"]
    torch.testing.assert_close(warm[2]["w"], alone[2]["w"], rtol=0, atol=0)
    assert not torch.equal(alone[1]["w"], alone[2]["w"])  # the labeled site trained in the warm-up rounds
    assert not torch.allclose(warm[3]["w"], alone[3]["w"])  # round 3: IsoFed's unlabeled group trained first
    assert ref.left_out({"warmup_rounds": 2})["warm_start"] == ref.INSTEAD["warm_start"]
    assert ref.left_out(ref.CHECK) == ref.LEFT_OUT


@pytest.mark.parametrize("name", ["partial_fedavg", "fedfixmatch", "fednoro", "surgical", "fedmlp", "fedpsl"])
def test_a_site_annotating_no_class_sits_out(tmp_path, name):
    """The mixed protocol's site annotating nothing: the multi-label references train as if it were not there
    (the project's sites abstain likewise)."""
    import importlib
    import json
    import shutil

    import yaml
    from fedlabels.data.synthetic import generate

    module = importlib.import_module(f"reference.{name}")
    data = generate("cxr", tmp_path / "cxr", seed=0, size=16, cases=10, test_cases=30)
    blank = tmp_path / "blank"
    shutil.copytree(data, blank)
    scenario = yaml.safe_load((data / "scenario.yaml").read_text())
    last = scenario["sites"][-1]
    items = json.loads((blank / last / "datalist.json").read_text())
    for it in items["training"]:
        it["label"] = [-1] * len(it["label"])
    (blank / last / "datalist.json").write_text(json.dumps(items))
    (data / "scenario.yaml").write_text(yaml.safe_dump({**scenario, "sites": scenario["sites"][:-1]}))
    kw = {"batch_size": 8, "log": lambda m: None}
    without, blanked = (module.run(d, 2, {2}, **kw)["metrics"][2] for d in (data, blank))
    assert without == blanked
    assert module.LEFT_OUT["unannotated_site"]


def test_the_upper_bound_reference_trains_on_every_sites_oracle_labels(tmp_path):
    """``partial_fedavg.run(oracle=True)``: the same run as a scenario whose sites were given their oracle labels,
    and not the run on the partial ones."""
    import shutil

    from fedlabels.data.synthetic import generate
    from reference import partial_fedavg

    data = generate("cxr", tmp_path / "cxr", seed=0, size=16, cases=10, test_cases=30)
    full = tmp_path / "full"
    shutil.copytree(data, full)
    for site in full.iterdir():
        if (site / "oracle.json").exists():
            shutil.copy(site / "oracle.json", site / "datalist.json")
    kw = {"batch_size": 8, "log": lambda m: None}
    oracle = partial_fedavg.run(data, 2, {2}, oracle=True, **kw)["metrics"][2]
    assert oracle == partial_fedavg.run(full, 2, {2}, **kw)["metrics"][2]
    assert oracle != partial_fedavg.run(data, 2, {2}, **kw)["metrics"][2]


def test_the_floor_reference_trains_the_site_alone(tmp_path):
    """``partial_fedavg.run(only=...)``: the same run as a scenario holding that site alone, not the federation's;
    a site the scenario lacks, or one annotating nothing, is refused."""
    import json
    import shutil

    import yaml
    from fedlabels.data.synthetic import generate
    from reference import partial_fedavg

    data = generate("cxr", tmp_path / "cxr", seed=0, size=16, cases=10, test_cases=30)
    alone = tmp_path / "alone"
    shutil.copytree(data, alone)
    scenario = yaml.safe_load((data / "scenario.yaml").read_text())
    (alone / "scenario.yaml").write_text(yaml.safe_dump({**scenario, "sites": ["site-1"]}))
    kw = {"batch_size": 8, "log": lambda m: None}
    only = partial_fedavg.run(data, 2, {2}, only="site-1", **kw)["metrics"][2]
    assert only == partial_fedavg.run(alone, 2, {2}, **kw)["metrics"][2]
    assert only != partial_fedavg.run(data, 2, {2}, **kw)["metrics"][2]
    with pytest.raises(ValueError, match="site-9"):
        partial_fedavg.run(data, 1, {1}, only="site-9", **kw)
    # a site annotating nothing: refused naming its labels file, before anything trains
    items = json.loads((data / "site-2" / "datalist.json").read_text())
    for it in items["training"]:
        it["label"] = [-1] * len(it["label"])
    (data / "site-2" / "datalist.json").write_text(json.dumps(items))
    with pytest.raises(ValueError, match=r"site-2.datalist\.json annotates no class"):
        partial_fedavg.run(data, 1, {1}, only="site-2", **kw)


def test_the_classification_floor_reference_trains_the_labeled_site_alone(tmp_path):
    """``semisup.run(only=...)``: wFedAvg on a scenario holding that labeled site alone, not the federation's; an
    unknown or unlabeled site is refused."""
    import shutil

    import yaml
    from fedlabels.data.synthetic import generate

    data = generate("medmnist", tmp_path / "m", seed=0, cases=160, test_cases=16, labeled=[0])
    scenario = yaml.safe_load((data / "scenario.yaml").read_text())
    alone = tmp_path / "alone"
    shutil.copytree(data, alone)
    (alone / "scenario.yaml").write_text(yaml.safe_dump({**scenario, "sites": ["site-1"]}))
    kw = {"batch_size": 16, "log": lambda m: None}
    only = ref.run(data, "wfedavg", 2, {2}, only="site-1", **kw)["metrics"][2]
    assert only == ref.run(alone, "wfedavg", 2, {2}, **kw)["metrics"][2]
    assert only != ref.run(data, "wfedavg", 2, {2}, oracle=True, **kw)["metrics"][2]
    with pytest.raises(ValueError, match="site-9"):
        ref.run(data, "wfedavg", 1, {1}, only="site-9", **kw)
    with pytest.raises(ValueError, match="site-2 is unlabeled"):
        ref.run(data, "wfedavg", 1, {1}, only="site-2", **kw)


def test_im_loss_stays_finite_when_a_class_gets_no_probability():
    """A collapsed model gives a class probability 0 in float32; 0 log 0 counts 0 and the gradient stays finite
    (the reference's sites turned non-finite on BloodMNIST gamma 0.8 before this)."""
    logits = torch.tensor([[200.0, 0.0, 0.0], [150.0, 0.0, 0.0]], requires_grad=True)
    loss = ref.im_loss(logits)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    assert float(loss) == pytest.approx(0.0, abs=1e-6)  # every case certain of class 0: both entropies 0
    x = torch.tensor([[1.0, 2.0, 0.5], [0.3, -1.0, 2.0]])
    p = torch.softmax(x, 1)
    by_hand = -(p * p.log()).sum(1).mean() + (p.mean(0) * p.mean(0).log()).sum()
    assert float(ref.im_loss(x)) == pytest.approx(float(by_hand), rel=1e-6)
