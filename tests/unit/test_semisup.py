"""Semi-supervised rules (methods/semisup.py) against hand-computed values and small reference loops."""

import copy
import math

import numpy as np
import pytest
import torch

from fedlabels import methods
from fedlabels.engine import RoundEngine
from fedlabels.losses import consistency_mse, information_maximization, sharpen
from fedlabels.methods.aggregate import distance_weights
from fedlabels.methods.base import DRAW, Update, to_numpy
from fedlabels.methods.semisup import IsoFedServer, RSCFedServer, SemiSupClient, WeightedFedAvgServer
from fedlabels.profile import SiteProfile
from helpers import site_context

CLASSES = ("a", "b")


def upd(site, w, n):
    return Update(site, {"w": np.asarray(w, dtype=np.float32)}, n)


def summaries(labeled=(), unlabeled=()):
    return {**{s: {"labeled": True} for s in labeled}, **{s: {"labeled": False} for s in unlabeled}}


# ---------------------------------------------------------------- Eq. 2-3


def test_dynamic_weights_match_eq3_by_hand():
    # n = (2, 1, 1); W_avg = (2*[0,0] + [0,0] + [3,4]) / 4 = [0.75, 1]
    # d = (1.25, 1.25, 3.75); c_k = n_k exp(-d_k / n_k) with lambda = 1
    ups = [upd("s1", [0, 0], 2), upd("s2", [0, 0], 1), upd("s3", [3, 4], 1)]
    c = np.array([2 * math.exp(-0.625), math.exp(-1.25), math.exp(-3.75)])
    got = distance_weights(ups, {"w": np.zeros(2, np.float32)}, scale=1.0)
    np.testing.assert_allclose(got, c / c.sum(), rtol=1e-9)
    np.testing.assert_allclose(got, [0.7755, 0.2075, 0.0170], atol=1e-4)
    # the far-away update gets a small weight (FedAvg would give it 0.25); scale 0 is FedAvg by n
    assert got[2] < 0.02
    np.testing.assert_allclose(distance_weights(ups, {"w": np.zeros(2, np.float32)}, scale=0.0), [0.5, 0.25, 0.25])


def test_dynamic_weights_survive_huge_scales():
    # RSCFed's 1e4 scale: exp underflows to 0 for every site; the ratios must still come out
    ups = [upd("s1", [0, 0], 2), upd("s2", [0, 0], 1), upd("s3", [3, 4], 1)]
    got = distance_weights(ups, {"w": np.zeros(2, np.float32)}, scale=1e4)
    assert np.isfinite(got).all() and got.sum() == pytest.approx(1.0)
    assert got[0] == pytest.approx(1.0)  # the closest per case dominates


def test_scale_depends_on_whether_the_group_holds_a_labeled_site():
    server = WeightedFedAvgServer(lambda_c=0.0, lambda_unlabeled=1.0, labeled_multiplier=3.0)
    server.setup(summaries(labeled=["L"], unlabeled=["U1", "U2"]))
    g = {"w": np.zeros(2, np.float32)}
    unlabeled_only = [upd("U1", [0, 0], 2), upd("U2", [3, 4], 2)]
    # no labeled site: lambda_unlabeled = 1; W_avg = [1.5, 2], d = 2.5 each -> equal weights
    np.testing.assert_allclose(server.weights(unlabeled_only, g), [0.5, 0.5])
    mixed = [upd("L", [0, 0], 1), upd("U1", [3, 4], 1)]
    # labeled site present: lambda_c = 0, the labeled site's n multiplied by 3
    np.testing.assert_allclose(server.weights(mixed, g), [0.75, 0.25])
    out = server.aggregate(mixed, g, 0)
    np.testing.assert_allclose(out["w"], [0.75, 1.0])


def test_labeled_multiplier_weighs_the_coefficient_not_the_average():
    """RSCFed's README run (--w_mul_times=6 --un_dist=avg): the distances are taken from the average by counts;
    the multiplier scales the labeled site's coefficient only."""
    server = WeightedFedAvgServer(lambda_c=1.0, labeled_multiplier=3.0)
    server.setup(summaries(labeled=["L"], unlabeled=["U1"]))
    mixed = [upd("L", [0, 0], 1), upd("U1", [3, 4], 1)]
    # W_avg = [1.5, 2] (by counts), d = 2.5 for both; c = (3 exp(-2.5), exp(-2.5)) -> (0.75, 0.25). Had the
    # multiplier weighed the average too ([0.75, 1]: d = 1.25, 3.75), L would get 3 e^-1.25 / (3 e^-1.25 + e^-3.75)
    np.testing.assert_allclose(server.weights(mixed, {"w": np.zeros(2, np.float32)}), [0.75, 0.25])


def test_setup_needs_a_labeled_site_and_says_when_none_is_unlabeled():
    with pytest.raises(ValueError, match="no site has a labeled training case"):
        IsoFedServer().setup(summaries(unlabeled=["a", "b"]))
    notes = IsoFedServer().setup(summaries(labeled=["a", "b"]))
    assert "labeled-only special case" in notes[0]


# ---------------------------------------------------------------- isolated order


def run_toy(server, deltas, start=0.0):
    """Sites return start + their delta; records which start each site received."""
    seen = {}

    def send(step, targets, weights, rnd, extras):
        out = []
        for s in targets:
            seen.setdefault(s, []).append(float(weights["w"][0]))
            # only labeled sites hold validation data: they score the model they received
            metrics = {"val_accuracy": 0.5} if s.startswith("L") else {}
            out.append(Update(s, {"w": np.asarray(weights["w"]) + deltas[s]}, 10, metrics=metrics))
        return out

    server.setup(summaries(labeled=[s for s in deltas if s.startswith("L")],
                           unlabeled=[s for s in deltas if s.startswith("U")]))
    engine = RoundEngine(server, send, key_metric="val_accuracy")
    new, record, best = engine.run_round(0, {"w": np.array([start], np.float64)}, sorted(deltas))
    return new, record, seen, best


def test_isofed_trains_the_unlabeled_group_first_and_the_labeled_group_from_w_u():
    new, record, seen, best = run_toy(IsoFedServer(lambda_c=0.0, lambda_unlabeled=0.0),
                                      {"U1": 1.0, "U2": 3.0, "L1": 10.0})
    assert [s["name"] for s in record["steps"]] == ["unlabeled", "labeled"]
    assert seen["U1"] == seen["U2"] == [0.0]      # the unlabeled group starts from the global model
    assert seen["L1"] == [2.0]                    # the labeled group starts from W_u = mean(1, 3)
    assert new["w"][0] == pytest.approx(12.0)     # the new global model: the labeled group's aggregate
    # the validation score is of W_u (what the labeled site received), so W_u is the best-model candidate
    assert best["w"][0] == pytest.approx(2.0)


def test_mt_wfedavg_trains_every_site_at_once_from_the_global_model():
    new, record, seen, best = run_toy(WeightedFedAvgServer(lambda_c=0.0), {"U1": 1.0, "U2": 3.0, "L1": 10.0})
    assert len(record["steps"]) == 1 and all(v == [0.0] for v in seen.values())
    assert best["w"][0] == 0.0  # the round's start model was scored
    assert new["w"][0] == pytest.approx(14.0 / 3)


def test_isofed_with_every_site_labeled_is_one_labeled_step():
    server = IsoFedServer()
    server.setup(summaries(labeled=["L1", "L2"]))
    steps = server.plan(0, ["L1", "L2"])
    assert [(s.name, s.sites, s.start) for s in steps] == [("labeled", ("L1", "L2"), "global")]


@pytest.mark.parametrize("server", [WeightedFedAvgServer(warmup_rounds=2), IsoFedServer(warmup_rounds=2),
                                    RSCFedServer(subset_size=2, warmup_rounds=2)])
def test_warmup_rounds_train_the_labeled_sites_only(server):
    server.setup(summaries(labeled=["L1"], unlabeled=["U1", "U2"]))
    for rnd in (0, 1):
        assert [(s.name, s.sites) for s in server.plan(rnd, ["L1", "U1", "U2"])] == [("warmup", ("L1",))]
    assert "U1" in {x for s in server.plan(2, ["L1", "U1", "U2"]) for x in s.sites}
    assert WeightedFedAvgServer().plan(0, ["L1", "U1"])[0].sites == ("L1", "U1")  # default: the papers, none


# ---------------------------------------------------------------- RSCFed


def test_rscfed_subsets_are_seeded_repeatable_and_distinct_sites():
    sites = ["s1", "s2", "s3", "s4"]
    a = RSCFedServer(subsets=3, subset_size=3, seed=5)
    b = RSCFedServer(subsets=3, subset_size=3, seed=5)
    draws = [a.draw(r, sites) for r in range(6)]
    assert draws == [b.draw(r, sites) for r in range(6)]          # same seed, same subsets (a resume redraws them)
    assert draws != [RSCFedServer(seed=6).draw(r, sites) for r in range(6)]
    assert len(set(draws)) > 1                                     # rounds differ
    for groups in draws:
        assert len(groups) == 3 and all(len(set(g)) == 3 and set(g) <= set(sites) for g in groups)


def test_rscfed_refuses_subsets_larger_than_the_federation_before_training():
    with pytest.raises(ValueError, match="subset_size=5 is larger than the number of sites"):
        RSCFedServer(subset_size=5).setup(summaries(labeled=["s1"], unlabeled=["s2", "s3", "s4"]))


def test_rscfed_global_is_the_mean_of_the_subset_models_and_each_training_is_its_own_draw():
    draws = []

    def send(step, targets, weights, rnd, extras):
        draws.append((tuple(targets), extras[DRAW]))
        return [Update(s, {"w": np.asarray(weights["w"]) + {"L1": 1.0, "U1": 2.0, "U2": 6.0}[s]}, 10) for s in targets]

    server = RSCFedServer(subsets=3, subset_size=2, seed=0, lambda_c=0.0, lambda_unlabeled=0.0)
    server.setup(summaries(labeled=["L1"], unlabeled=["U1", "U2"]))
    groups = server.draw(0, ["L1", "U1", "U2"])
    new, record, _ = RoundEngine(server, send, key_metric="val_accuracy").run_round(
        0, {"w": np.zeros(1)}, ["L1", "U1", "U2"])
    assert [d for _, d in draws] == [0, 1, 2] and [t for t, _ in draws] == [tuple(g) for g in groups]
    delta = {"L1": 1.0, "U1": 2.0, "U2": 6.0}
    expected = np.mean([np.mean([delta[s] for s in g]) for g in groups])
    assert new["w"][0] == pytest.approx(expected)


# ---------------------------------------------------------------- losses


def test_sharpen_by_hand():
    got = sharpen(torch.tensor([[0.6, 0.4]]), 0.5)
    np.testing.assert_allclose(got.numpy(), [[0.36 / 0.52, 0.16 / 0.52]], rtol=1e-6)
    np.testing.assert_allclose(sharpen(torch.tensor([[0.6, 0.4]]), 1.0).numpy(), [[0.6, 0.4]], rtol=1e-6)


def test_information_maximization_by_hand_and_its_minimum():
    logits = torch.log(torch.tensor([[0.8, 0.2], [0.2, 0.8]]))
    h = -(0.8 * math.log(0.8) + 0.2 * math.log(0.2))   # each case's entropy, 0.5004
    assert float(information_maximization(logits)) == pytest.approx(h - math.log(2), abs=1e-6)
    confident_balanced = torch.tensor([[30.0, 0.0], [0.0, 30.0]])
    confident_one_class = torch.tensor([[30.0, 0.0], [30.0, 0.0]])
    uniform = torch.zeros(2, 2)
    assert float(information_maximization(confident_balanced)) == pytest.approx(-math.log(2), abs=1e-6)
    assert float(information_maximization(confident_one_class)) == pytest.approx(0.0, abs=1e-6)
    assert float(information_maximization(uniform)) == pytest.approx(0.0, abs=1e-6)
    rng = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert float(information_maximization(torch.randn(8, 4, generator=rng) * 3)) >= -math.log(4) - 1e-6


def test_consistency_mse_by_hand():
    got = consistency_mse(torch.tensor([[1.0, 0.0], [0.5, 0.5]]), torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    assert float(got) == pytest.approx((0.25 + 0.25 + 0) / 2)


# ---------------------------------------------------------------- the mean-teacher client


def _site(labeled: bool, batches, name="site-u"):
    profile = SiteProfile(name, "multiclass", CLASSES, CLASSES if labeled else (), "image" if labeled else "none")
    return site_context(profile, batches, labels=[0 if labeled else -1] * sum(len(b["image"]) for b in batches))


def _batches(seed=0, n=2, nan=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        weak = torch.randn(4, 3, generator=g)
        out.append({"image": weak, "image_strong": weak + 0.3 * torch.randn(4, 3, generator=g),
                    "label": torch.full((4,), -1)})
    if nan:
        out[0]["image"][0, 0] = float("nan")
    return out


def test_mean_teacher_step_matches_a_reference_loop():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    start = to_numpy(net.state_dict())
    batches = _batches()
    temperature, alpha, lr = 0.5, 0.3, 0.1
    client = SemiSupClient(net, _site(False, batches), temperature=temperature, ema_alpha=alpha, lr=lr,
                           optimizer="sgd", consistency_weight=2.0)
    update = client.train(start, 0)

    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict({k: torch.as_tensor(v) for k, v in start.items()})
    teacher = copy.deepcopy(ref)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    for b in batches:
        with torch.no_grad():
            p_t = torch.softmax(teacher(b["image"]), 1)
            p_t = p_t ** (1 / temperature) / (p_t ** (1 / temperature)).sum(1, keepdim=True)
        p_s = torch.softmax(ref(b["image_strong"]), 1)
        loss = 2.0 * ((p_t - p_s) ** 2).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), ref.parameters()):
                t.copy_(alpha * s + (1 - alpha) * t)
    for k, v in ref.state_dict().items():   # the student is sent
        np.testing.assert_allclose(update.weights[k], v.numpy(), rtol=0, atol=1e-6)
    for (k, v), t in zip(ref.state_dict().items(), teacher.state_dict().values()):
        np.testing.assert_allclose(client.teacher.state_dict()[k].numpy(), t.numpy(), rtol=0, atol=1e-6)
    assert update.n == 8 and not update.abstain


def test_a_labeled_site_trains_with_cross_entropy_only():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    batches = [{"image": torch.randn(4, 3), "label": torch.tensor([0, 1, 0, -1])}]
    client = SemiSupClient(net, _site(True, batches), lr=0.1, optimizer="sgd")
    start = to_numpy(net.state_dict())
    client.train(start, 0)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict({k: torch.as_tensor(v) for k, v in start.items()})
    loss = torch.nn.functional.cross_entropy(ref(batches[0]["image"][:3]), torch.tensor([0, 1, 0]))
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(net.state_dict()[k].numpy(), v.numpy(), atol=1e-6)
    assert client.teacher is None


def test_pretraining_lowers_the_information_maximization_loss():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    batches = _batches(n=4)
    before = float(np.mean([float(information_maximization(net(b["image"]))) for b in batches]))
    client = SemiSupClient(net, _site(False, batches), pretrain=True, pretrain_epochs=20, lr=0.05, ema_alpha=0.0)
    client.begin_round(0, {})
    after = float(np.mean([float(information_maximization(net(b["image"]))) for b in batches]))
    assert after < before - 0.05
    # the teacher starts as the adapted model
    for k, v in net.state_dict().items():
        assert torch.equal(client.teacher.state_dict()[k], v)


def _im_reference(start: dict, batches, lr, epochs):
    """The pretraining by hand: Adam at ``lr`` on the information-maximisation loss of the weak views."""
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(start)
    opt = torch.optim.Adam(ref.parameters(), lr=lr)
    for _ in range(epochs):
        for b in batches:
            loss = information_maximization(ref(b["image"]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return ref.state_dict()


@pytest.mark.parametrize("target", ["both", "teacher"])
def test_pretraining_options_match_a_reference_loop(target):
    """pretrain_lr sets the IM steps' lr; pretrain_target "teacher" adapts the teacher only."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    start = copy.deepcopy(net.state_dict())
    batches = _batches(n=3)
    client = SemiSupClient(net, _site(False, batches), pretrain=True, pretrain_epochs=2, pretrain_lr=0.05, lr=1e-4,
                           pretrain_target=target)
    client.begin_round(0, {})
    expected = _im_reference(start, batches, lr=0.05, epochs=2)
    for k, v in expected.items():
        torch.testing.assert_close(client.teacher.state_dict()[k], v, atol=1e-6, rtol=0)
        # the student: the adapted model ("both") or the received one ("teacher")
        torch.testing.assert_close(net.state_dict()[k], v if target == "both" else start[k], atol=1e-6, rtol=0)
    assert not torch.equal(expected["weight"], start["weight"])


def test_pretraining_at_every_site_adapts_a_labeled_site_before_its_cross_entropy():
    torch.manual_seed(0)
    batches = [{**b, "label": torch.tensor([0, 1, 0, 1])} for b in _batches(n=2)]
    for sites, adapted in (("unlabeled", False), ("all", True)):
        net = torch.nn.Linear(3, 2)
        start = copy.deepcopy(net.state_dict())
        client = SemiSupClient(net, _site(True, batches), pretrain=True, pretrain_lr=0.05, pretrain_sites=sites)
        client.begin_round(0, {})
        expected = _im_reference(start, batches, lr=0.05, epochs=1) if adapted else start
        for k, v in expected.items():
            torch.testing.assert_close(net.state_dict()[k], v, atol=1e-6, rtol=0)
        assert ("pretrain_loss" in client.round_stats) == adapted and client.teacher is None


def test_pretraining_options_are_checked():
    batches = _batches()
    for bad in ({"pretrain_lr": 0}, {"pretrain_target": "student"}, {"pretrain_sites": "some"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SemiSupClient(torch.nn.Linear(3, 2), _site(False, batches), pretrain=True, **bad)


def test_non_finite_teacher_output_stops_the_site_round_and_the_round_completes():
    torch.manual_seed(0)
    bad_net, good_net = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    bad = SemiSupClient(bad_net, _site(False, _batches(nan=True), "bad"))
    good = SemiSupClient(good_net, _site(False, _batches(seed=1), "good"))
    start = to_numpy(good_net.state_dict())
    u = bad.train(start, 0)
    assert u.abstain and u.reason == "non-finite teacher output" and not u.weights

    def send(step, targets, weights, rnd, extras):
        return [(bad if s == "bad" else good).train(weights, rnd, extras) for s in targets]

    server = WeightedFedAvgServer()
    server.setup(summaries(labeled=["good"], unlabeled=["bad"]))  # "good" counted labeled for the toy
    new, record, _ = RoundEngine(server, send, key_metric="val_accuracy").run_round(0, start, ["bad", "good"])
    assert record["dropped"] == {"bad": "non-finite teacher output"} and record["aggregated"]
    assert all(np.isfinite(v).all() for v in new.values())


def test_options_are_checked_by_name_and_range():
    m = methods.get("isofed")
    assert m.client_options()["pretrain"] is True and methods.get("isofed_nopt").client_options()["pretrain"] is False
    assert {"lambda_c", "lambda_unlabeled", "labeled_multiplier"} <= m.server_option_names()
    assert {"subsets", "subset_size", "seed"} <= methods.get("rscfed").server_option_names()
    with pytest.raises(ValueError, match="no client option"):
        m.client_options(temprature=0.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SemiSupClient(torch.nn.Linear(3, 2), _site(False, _batches()), temperature=0)
    # the run's seed reaches RSCFed's draws unless the job sets one
    assert methods.get("rscfed").make_server(run_seed=7).seed == 7
    assert methods.get("rscfed").make_server(run_seed=7, seed=1).seed == 1


# ---------------------------------------------------------------- the released-code settings (preset isofed_rscfed)


def test_sgd_momentum_weight_decay_and_clipping_by_hand():
    """One parameter p = (3, 4) with the gradient (6, 8) (norm 10) twice; clip 5, lr 0.1, momentum 0.9,
    weight decay 5e-4: the clip rescales the raw gradient to (3, 4), SGD then adds wd * p (RSCFed's order:
    clip_grad_norm_, then optimizer.step)."""
    from fedlabels.methods.base import make_optimizer

    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = make_optimizer("sgd", [p], lr=0.1, weight_decay=5e-4, momentum=0.9, clip_grad_norm=5)
    p.grad = torch.tensor([6.0, 8.0])
    opt.step()
    d1 = np.array([3.0, 4.0]) + 5e-4 * np.array([3.0, 4.0])  # clipped gradient + weight decay
    p1 = np.array([3.0, 4.0]) - 0.1 * d1                       # = (2.69985, 3.5998); buffer = d1
    np.testing.assert_allclose(p.detach().numpy(), p1, rtol=0, atol=1e-6)
    p.grad = torch.tensor([6.0, 8.0])
    opt.step()
    buf = 0.9 * d1 + (np.array([3.0, 4.0]) + 5e-4 * p1)
    np.testing.assert_allclose(p.detach().numpy(), p1 - 0.1 * buf, rtol=0, atol=1e-6)
    # without the clip the same step moves twice as far (the clip is what changed it)
    q = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = make_optimizer("sgd", [q], lr=0.1, momentum=0.0)
    q.grad = torch.tensor([6.0, 8.0])
    opt.step()
    np.testing.assert_allclose(q.detach().numpy(), [2.4, 3.2], rtol=0, atol=1e-6)


def _mt_reference(start, teacher_start, batches, rounds, lr, weight, rampup, clip, wd, temperature=0.5, alpha=0.3):
    """A mean-teacher client by hand over ``rounds`` rounds of one local epoch, each from ``start`` (the
    same global model every round), the SGD optimizer (momentum 0.9) carried from round to round, the
    consistency weight ``weight`` x min(1, round / rampup), gradients clipped at ``clip``."""
    ref = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9, weight_decay=wd)
    for rnd in range(rounds):
        ref.load_state_dict(start)
        teacher = copy.deepcopy(ref) if teacher_start is None else teacher_start
        for b in batches:
            with torch.no_grad():
                p_t = torch.softmax(teacher(b["image"]), 1)
                p_t = p_t ** (1 / temperature) / (p_t ** (1 / temperature)).sum(1, keepdim=True)
            p_s = torch.softmax(ref(b["image_strong"]), 1)
            loss = weight * min(1.0, rnd / rampup) * ((p_t - p_s) ** 2).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            opt.step()
            with torch.no_grad():
                for t, s in zip(teacher.parameters(), ref.parameters()):
                    t.copy_(alpha * s + (1 - alpha) * t)
    return ref.state_dict()


def test_unlabeled_site_lr_ramp_clip_and_carried_optimizer_match_a_reference_loop():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    start = copy.deepcopy(net.state_dict())
    batches = _batches(n=3)
    opts = dict(optimizer="sgd", lr=0.03, lr_unlabeled=2.0, consistency_weight=4.0, consistency_rampup=2,
                clip_grad_norm=0.05, weight_decay=5e-4, ema_alpha=0.3)
    client = SemiSupClient(net, _site(False, batches), **opts)
    for rnd in range(3):
        update = client.train(to_numpy(start), rnd)
    expected = _mt_reference(start, None, batches, rounds=3, lr=2.0, weight=4.0, rampup=2, clip=0.05, wd=5e-4)
    for k, v in expected.items():
        np.testing.assert_allclose(update.weights[k], v.numpy(), rtol=0, atol=1e-5)
    assert client.optimizer.param_groups[0]["lr"] == 2.0  # the unlabeled site's lr, not lr
    # each setting changes the result: a fresh optimizer every round, no clip, or no ramp
    for change in ({"reset_optimizer": True}, {"clip_grad_norm": None}, {"consistency_rampup": 0}):
        other = SemiSupClient(torch.nn.Linear(3, 2), _site(False, batches), **{**opts, **change})
        for rnd in range(3):
            u = other.train(to_numpy(start), rnd)
        assert not np.allclose(u.weights["weight"], update.weights["weight"], atol=1e-5), change


def test_the_ramp_by_hand_and_round_zero_of_a_ramp_leaves_the_student_where_it_was():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    batches = _batches()
    client = SemiSupClient(net, _site(False, batches), consistency_weight=0.02, consistency_rampup=4, epochs=2)
    got = []
    for rnd in range(3):
        for e in range(2):
            client.current_round, client.local_epoch = rnd, e
            got.append(client.unlabeled_weight())
    assert got == pytest.approx([0.0, 0.005, 0.01, 0.015, 0.02, 0.02])  # 0.02 x t/4, t = 2 round + epoch, capped
    start = to_numpy(net.state_dict())
    flat = SemiSupClient(net, _site(False, batches), consistency_weight=0.02, consistency_rampup=4, optimizer="sgd")
    u = flat.train(start, 0)  # weight 0 at t = 0: no gradient, no weight decay: nothing moves
    for k, v in start.items():
        np.testing.assert_array_equal(u.weights[k], v)


def test_a_labeled_site_keeps_lr_when_lr_unlabeled_is_set():
    batches = [{"image": torch.randn(4, 3), "label": torch.tensor([0, 1, 0, 1])}]
    net = torch.nn.Linear(3, 2)
    client = SemiSupClient(net, _site(True, batches), lr=0.03, lr_unlabeled=0.021, optimizer="sgd")
    client.train(to_numpy(net.state_dict()), 0)
    assert client.optimizer.param_groups[0]["lr"] == 0.03
    for bad in ({"lr_unlabeled": 0}, {"consistency_rampup": -1}, {"clip_grad_norm": -1}, {"momentum": 1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SemiSupClient(torch.nn.Linear(3, 2), _site(False, _batches()), **bad)


def test_warm_start_then_isofed_rounds_match_a_reference_loop():
    """IsoFed with one warm-up round (the labeled site alone), then one isolated round, under the
    released-code settings: SGD kept across rounds at lr 0.1 (labeled) / 0.5 (unlabeled), clip 1,
    lambda_u 3. By hand: round 0, the labeled site trains from W0 -> W1 (a group of one is its own
    aggregate); round 1, the unlabeled site trains a mean teacher from W1 -> W_u, the labeled site
    trains from W_u with the momentum of round 0 -> W2."""
    torch.manual_seed(0)
    lab_batches = [{**b, "label": torch.tensor([0, 1, 1, 0])} for b in _batches(seed=3)]
    unl_batches = _batches(seed=4)
    opts = dict(optimizer="sgd", lr=0.1, lr_unlabeled=0.5, clip_grad_norm=1.0, consistency_weight=3.0, ema_alpha=0.3)
    nets = {"L": torch.nn.Linear(3, 2), "U": torch.nn.Linear(3, 2)}
    clients = {"L": SemiSupClient(nets["L"], _site(True, lab_batches, "L"), **opts),
               "U": SemiSupClient(nets["U"], _site(False, unl_batches, "U"), **opts)}
    server = IsoFedServer(warmup_rounds=1)
    server.setup(summaries(labeled=["L"], unlabeled=["U"]))

    def send(step, targets, weights, rnd, extras):
        return [clients[s].train(weights, rnd, extras) for s in targets]

    engine = RoundEngine(server, send, key_metric="val_accuracy")
    w0 = to_numpy(torch.nn.Linear(3, 2).state_dict())
    w1, rec0, _ = engine.run_round(0, w0, ["L", "U"])
    w2, rec1, _ = engine.run_round(1, w1, ["L", "U"])
    assert [s["name"] for s in rec0["steps"]] == ["warmup"] and [s["name"] for s in rec1["steps"]] == ["unlabeled", "labeled"]

    lab = torch.nn.Linear(3, 2)
    lab.load_state_dict({k: torch.as_tensor(v) for k, v in w0.items()})
    opt_l = torch.optim.SGD(lab.parameters(), lr=0.1, momentum=0.9)

    def ce_epoch():
        for b in lab_batches:
            loss = torch.nn.functional.cross_entropy(lab(b["image"]), b["label"])
            opt_l.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lab.parameters(), 1.0)
            opt_l.step()

    ce_epoch()
    ref_w1 = copy.deepcopy(lab.state_dict())
    unl = torch.nn.Linear(3, 2)  # the unlabeled site's mean teacher from W1 (sharpening at 0.5: p^2 renormalised)
    unl.load_state_dict(ref_w1)
    teacher = copy.deepcopy(unl)
    opt_u = torch.optim.SGD(unl.parameters(), lr=0.5, momentum=0.9)
    for b in unl_batches:
        with torch.no_grad():
            p_t = torch.softmax(teacher(b["image"]), 1) ** 2
            p_t = p_t / p_t.sum(1, keepdim=True)
        loss = 3.0 * ((p_t - torch.softmax(unl(b["image_strong"]), 1)) ** 2).sum(1).mean()
        opt_u.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unl.parameters(), 1.0)
        opt_u.step()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), unl.parameters()):
                t.copy_(0.3 * s + 0.7 * t)
    w_u = unl.state_dict()
    with torch.no_grad():
        for k, p in lab.state_dict().items():
            p.copy_(w_u[k])  # the labeled site starts from W_u; its optimizer (momentum) carries on
    ce_epoch()
    for k, v in ref_w1.items():
        np.testing.assert_allclose(w1[k], v.numpy(), rtol=0, atol=1e-5)
    for k, v in lab.state_dict().items():
        np.testing.assert_allclose(w2[k], v.numpy(), rtol=0, atol=1e-5)
