"""FedMLP and its pseudo-label baselines (methods/fedmlp.py, methods/pseudo_labels.py) against
hand-computed values, on data where the rules give different answers."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedlabels import methods
from fedlabels.bundle import bundle_path
from fedlabels.data.synthetic import generate
from fedlabels.losses import partial_bce
from fedlabels.methods.base import Update
from fedlabels.losses import masked_mse as consistency_loss
from fedlabels.methods.fedmlp import (FedMLPServer, average_prototypes, global_degree, learning_degree, logit_shift,
                                      select_tags, wpc_loss, z_scores)
from fedlabels.methods.pseudo_labels import distillation_loss, fixmatch_targets, rampup
from fedlabels.references import setups
from helpers import site_context

SMALL = dict(batch_size=8, config={"image_size": 32}, network_overrides={"widen_factor": 0.25})


# ---------------------------------------------------------------- Eq. 3-4


def test_logit_shift_is_the_multilabel_logit_adjustment():
    # pi1 = 1/4: p' = p pi1 / (p pi1 + (1 - p) pi0); at p = 0.6: 0.15 / (0.15 + 0.3) = 1/3
    shift = logit_shift([1, 0, 3, 0], [4, 5, 3, 0])
    np.testing.assert_allclose(shift, [math.log(1 / 3), 0, 0, 0], rtol=1e-6)  # rates 0, 1, undefined: no shift
    p = 0.6
    adjusted = torch.sigmoid(torch.logit(torch.tensor(p)) + float(shift[0]))
    assert float(adjusted) == pytest.approx(1 / 3, abs=1e-6)


def test_wpc_sums_labeled_entries_and_divides_by_c():
    logits = torch.tensor([[0.0, 2.0], [1.0, -1.0]])
    target = torch.tensor([[1.0, -1.0], [0.0, 1.0]])
    sp1 = math.log1p(math.e)  # softplus(1): BCE(1, y=0) = BCE(-1, y=1)
    # three labeled entries: log 2 + softplus(1) + softplus(1), over B x C = 4 (the partial mean would be / 3)
    assert float(wpc_loss(logits, target)) == pytest.approx((math.log(2) + 2 * sp1) / 4, rel=1e-6)
    # with the adjustment the logits move by the shift before the BCE
    shift = np.array([1.0, 0.0], np.float32)
    expected = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(2.0)) + sp1) / 4
    assert float(wpc_loss(logits, target, shift)) == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------- Eq. 6


def test_server_prototype_average_by_count_and_by_size():
    sent = {"A": {0: np.array([[0, 0], [2, 2]]), 1: np.array([[5, 5], [7, 7]])},
            "B": {0: np.array([[2, 2], [4, 4]])}}
    sizes = {"A": 10, "B": 30}
    mean = average_prototypes(sent, sizes, "mean")
    np.testing.assert_allclose(mean[0], [[1, 1], [3, 3]])
    np.testing.assert_allclose(mean[1], [[5, 5], [7, 7]])  # one annotating site: its own
    assert 2 not in mean  # annotated by none: no prototype
    size = average_prototypes(sent, sizes, "size")
    np.testing.assert_allclose(size[0], [[1.5, 1.5], [3.5, 3.5]])  # (10 x 0 + 30 x 2) / 40
    with pytest.raises(ValueError, match="prototype_weighting"):
        average_prototypes(sent, sizes, "median")


# ---------------------------------------------------------------- Eq. 7-9


def test_z_score_by_hand():
    z = z_scores([[1, 0], [0, 1], [1, 1], [2, -1]], [1, 0], [0, 1])
    np.testing.assert_allclose(z, [1, -1, 0, 3 / math.sqrt(5)], atol=1e-12)


def test_tau_selection_with_ties_and_an_empty_pool():
    z = np.array([0.5, -0.2, 0.5, 0.1, -0.9, 0.0, -0.2, 0.3])
    # Z >= 0 at 0, 2, 3, 5, 7: floor(0.5 x 5) = 2 -> the tie at 0.5 (0 and 2)
    # Z < 0 at 1, 4, 6: floor(0.67 x 3) = 2 -> -0.9 (4), then the tie at -0.2 in pool order (1 before 6)
    neg, pos = select_tags(z, 0.5, 0.67)
    assert neg.tolist() == [0, 2] and pos.tolist() == [4, 1]
    neg, pos = select_tags(z, 0.2, 0.3)  # floor(1.0) = 1 -> the first of the tie; floor(0.9) = 0
    assert neg.tolist() == [0] and pos.tolist() == []
    neg, pos = select_tags(np.array([]), 0.5, 0.5)
    assert neg.size == 0 and pos.size == 0
    neg, pos = select_tags(np.array([0.2, 0.4]), 1.0, 1.0)  # no Z < 0: no pseudo-positive
    assert sorted(neg.tolist()) == [0, 1] and pos.size == 0


# ---------------------------------------------------------------- Eq. 10


def test_learning_degree_and_the_global_degree():
    probs = np.array([[0.1, 0.5], [0.8, 0.65], [0.3, 0.71]])
    # class 0: 0.1 < 0.3, 0.8 > 0.7, 0.3 is not < 0.3 -> 2/3; class 1: only 0.71 -> 1/3
    np.testing.assert_allclose(learning_degree(probs, 0.3, 0.7), [2 / 3, 1 / 3])
    degrees = {"A": np.array([0.2, 0.9, 0.5]), "B": np.array([0.6, 0.1, 0.5])}
    d = global_degree(degrees, {"A": 100, "B": 300}, {0: ["A", "B"], 1: ["A"], 2: []})
    np.testing.assert_allclose(d, [(100 * 0.2 + 300 * 0.6) / 400, 0.9, 1.0])


def test_consistency_covers_only_the_masked_entries():
    p = torch.tensor([[0.2, 0.9], [0.5, 0.5]])
    t = torch.tensor([[0.4, 0.0], [0.1, 0.5]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert float(consistency_loss(p, t, mask)) == pytest.approx((0.04 + 0.16 + 0.0) / 3)
    assert float(consistency_loss(p, t, torch.zeros_like(mask))) == 0.0


# ---------------------------------------------------------------- the server


def summaries():
    # three classes; class 2 annotated by no site
    return {"s1": {"labeled_mask": [1, 0, 0], "cases": 10}, "s2": {"labeled_mask": [0, 1, 0], "cases": 30}}


def update(site, protos=None, degree=None):
    u = Update(site, {"w": np.ones(2, np.float32)}, 5)
    u.extras = {}
    if protos is not None:
        u.extras["prototypes"] = protos
    if degree is not None:
        u.extras["degree"] = degree
    return u


def test_server_schedule_adaptive_tau_and_what_it_drops():
    server = FedMLPServer(warmup_rounds=2, tau0=0.1, tau1=0.2)
    lines = server.setup(summaries())
    assert any("[2]" in line and "no site" in line for line in lines)
    assert server.extras(0, None) == {"stage": 1, "collect": False}
    assert server.extras(1, None) == {"stage": 1, "collect": True}  # the last warm-up round sends prototypes
    good = [[0.0, 1.0], [1.0, 0.0]]
    ups = [update("s1", {"0": good, "1": good}, [0.5, 0.4, 0.2]),            # class 1 is not s1's
           update("s2", {"1": [[np.nan, 0], [1, 1]]}, [0.3, 0.8, 0.2])]        # non-finite
    new = server.aggregate(ups, {"w": np.zeros(2, np.float32)}, 1)
    np.testing.assert_allclose(new["w"], 1.0)  # the weights are still used
    notes = server.take_notes()
    assert any("s1" in n and "'1'" in n and "does not annotate" in n for n in notes)
    assert any("s2" in n and "non-finite" in n for n in notes)
    assert server.take_notes() == []
    assert set(server.prototypes) == {0}
    extras = server.extras(2, None)
    assert extras["stage"] == 2 and set(extras["prototypes"]) == {"0"}
    # degree over the sites that lack the class: class 0 -> s2 (0.3), class 1 -> s1 (0.4), class 2 -> both
    d2 = (10 * 0.2 + 30 * 0.2) / 40
    np.testing.assert_allclose(extras["tau0"], [0.03, 0.04, 0.1 * d2])
    np.testing.assert_allclose(extras["tau1"], [0.06, 0.08, 0.2 * d2])
    fixed = FedMLPServer(warmup_rounds=2, tau0=0.1, tau1=0.2, adaptive_threshold=False)
    fixed.setup(summaries())
    fixed.aggregate(ups, {"w": np.zeros(2, np.float32)}, 1)
    np.testing.assert_allclose(fixed.extras(2, None)["tau0"], [0.1] * 3)
    # wrong shape against the first prototype seen
    server.aggregate([update("s1", {"0": [[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]]}, [0.5, 0.4, 0.2])],
                     {"w": np.zeros(2, np.float32)}, 2)
    assert any("shape (2, 3)" in n for n in server.take_notes())


def test_options_out_of_range_fail_with_their_names():
    for kw, name in [({"tau0": 1.5}, "tau0"), ({"tau1": -0.1}, "tau1"), ({"warmup_rounds": 0}, "warmup_rounds"),
                     ({"prototype_weighting": "x"}, "prototype_weighting"), ({"degree_sites": "x"}, "degree_sites")]:
        with pytest.raises(ValueError, match=name):
            FedMLPServer(**kw)
    with pytest.raises(ValueError, match="no client option"):
        methods.get("fedmlp").client_options(tau=0.1)


# ---------------------------------------------------------------- the client on real data


@pytest.fixture(scope="module")
def cxr(tmp_path_factory):
    return generate("cxr", tmp_path_factory.mktemp("fedmlp") / "cxr", seed=0, cases=16, test_cases=8)


def make_client(cxr, site="site-1", **options):
    st = setups(bundle_path("cxr_resnet18"), cxr, sites=[site], method="fedmlp", **SMALL)[site]
    return st, methods.get("fedmlp").make_client(st.net, st.context(), lr=1e-3, **options)


def test_tags_accumulate_across_rounds_and_survive_a_resume(cxr):
    st, client = make_client(cxr)
    missing = np.flatnonzero(~client.labeled)
    n = len(client.tags)
    dim = client.net.head.in_features
    rng = np.random.default_rng(0)
    extras = {"stage": 2, "prototypes": {str(c): rng.normal(size=(2, dim)).tolist() for c in missing},
              "tau0": [0.5] * len(client.labeled), "tau1": [0.5] * len(client.labeled)}
    client.begin_round(5, extras)
    first = client.tags.copy()
    tagged = (first[:, missing] >= 0).sum(0)
    assert (tagged > 0).all() and (tagged < n).all()
    assert (first[:, client.labeled] == -1).all()  # annotated classes are never tagged
    client.begin_round(6, extras)
    second = client.tags.copy()
    kept = first >= 0
    assert (second[kept] == first[kept]).all()  # permanent
    assert ((second >= 0).sum() > kept.sum())  # more tags from the residual pool
    st2, again = make_client(cxr)
    again.load_state_dict(client.state_dict())
    np.testing.assert_array_equal(again.tags, second)
    np.testing.assert_array_equal(again.tagged_at, client.tagged_at)
    assert set(np.unique(client.tagged_at[first >= 0])) == {5}  # the round each tag was made
    assert set(np.unique(client.tagged_at[(second >= 0) & (first < 0)])) == {6}
    for c in (again, client):  # as ClientRule.train does: each round's draws are seeded by (site, round)
        c.ctx.reseed(7)
        c.begin_round(7, extras)
    np.testing.assert_array_equal(again.tags, client.tags)


def test_targets_fill_missing_entries_with_tags_and_mask_the_rest(cxr):
    _, client = make_client(cxr)
    missing = np.flatnonzero(~client.labeled)
    client.tags[0, missing[0]] = 1
    client.tags[1, missing[0]] = 0
    labels = torch.full((2, len(client.labeled)), -1.0)
    labels[:, client.labeled] = torch.tensor([1.0, 0.0])[:, None]
    target, mask = client.targets(labels, torch.tensor([0, 1]))
    assert target[0, missing[0]] == 1 and target[1, missing[0]] == 0
    assert (target[:, missing[1:]] == -1).all() and mask[:, missing[1:]].all() and mask[:, missing[0]].sum() == 0
    assert (mask[:, client.labeled] == 0).all()
    _, naive = make_client(cxr, wpc=False)
    naive.tags[:] = client.tags
    target, _ = naive.targets(labels, torch.tensor([0, 1]))
    assert (target[:, missing[1:]] == 0).all()  # without WPC an untagged missing entry is a negative
    # ... and the weighting half of WPC goes too (Table 3's rows are cumulative), whatever logit_adjustment says
    assert client.shift() is not None and naive.shift() is None
    assert make_client(cxr, wpc=False, logit_adjustment=True)[1].shift() is None


def test_prototypes_are_class_means_of_the_first_view_features_in_eval_mode(cxr):
    st, client = make_client(cxr)
    client.ctx.reseed(3)
    out = client.summarise()
    # independently: the same draws, the first view only, the network in eval mode
    client.ctx.reseed(3)
    cases = st.train_loader.dataset
    cases.strong_on = False
    net = copy.deepcopy(client.net).eval()
    feats, labels, probs = {}, {}, {}
    with torch.no_grad():
        for batch in st.train_loader:
            f = net.extract(batch["image"])
            for i, fi, yi, pi in zip(batch["index"].tolist(), f, batch["label"], torch.sigmoid(net(batch["image"]))):
                feats[i], labels[i], probs[i] = fi.numpy(), yi.numpy(), pi.numpy()
    order = sorted(feats)
    feats, labels = np.stack([feats[i] for i in order]), np.stack([labels[i] for i in order])
    assert out["prototypes"]
    for key, (p0, p1) in out["prototypes"].items():
        c = int(key)
        assert client.labeled[c]
        np.testing.assert_allclose(p0, feats[labels[:, c] == 0].mean(0), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(p1, feats[labels[:, c] == 1].mean(0), rtol=1e-4, atol=1e-6)
    p = np.stack([probs[i] for i in order])
    np.testing.assert_allclose(out["degree"], ((p < 0.3) | (p > 0.7)).mean(0))


class Tiny(torch.nn.Module):
    head_name = "head"

    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Linear(4, 3), torch.nn.Linear(3, 3)

    def extract(self, x):
        return torch.tanh(self.body(x))

    def forward(self, x):
        return self.head(self.extract(x))


@pytest.mark.parametrize("options", [{}, {"two_views": False}, {"stage2_consistency": False},
                                     {"logit_adjustment": False, "consistency_weight": 0.5}])
def test_fedmlp_step_matches_a_reference_loop(options):
    """Stage 2: WPC over labels and tags with the logit shift, consistency on the untagged missing
    entries against the received model, averaged over the two views."""
    from fedlabels.profile import SiteProfile

    g = torch.Generator().manual_seed(2)
    profile = SiteProfile("s", "multilabel", ("a", "b", "c"), ("a",))
    y = torch.full((6, 3), -1.0)
    y[:, 0] = torch.tensor([1.0, 0, 0, 1, 0, 0])
    batch = {"image": torch.randn(6, 4, generator=g), "image_strong": torch.randn(6, 4, generator=g), "label": y,
             "index": torch.arange(6)}
    ctx = site_context(profile, [batch], labels=[r.long().tolist() for r in y])
    torch.manual_seed(0)
    net = Tiny()
    ref = copy.deepcopy(net)
    client = methods.get("fedmlp").make_client(net, ctx, lr=0.1, optimizer="sgd", **options)
    client.tags[:] = -1
    client.tags[[0, 2], 1] = [1, 0]  # class b tagged for two cases, class c never
    client.begin_round(12, {"stage": 2})
    client.optimizer = client.make_optimizer(client.net.parameters())
    got = client.train_step(batch)

    # by hand: pi1(a) = 2/6 (shift log(2/4)); pi1(b) = 1 of 2 tags (shift 0); c untagged (shift 0)
    shift = torch.tensor([math.log(2 / 4), 0.0, 0.0]) if options.get("logit_adjustment", True) else torch.zeros(3)
    target = y.clone()
    target[0, 1], target[2, 1] = 1.0, 0.0
    mask = (target < 0).float()
    w = options.get("consistency_weight", 1.0) if options.get("stage2_consistency", True) else 0.0
    views = [batch["image"]] + ([batch["image_strong"]] if options.get("two_views", True) else [])
    teacher = copy.deepcopy(ref)
    expected = 0
    for v in views:
        logits = ref(v)
        bce = F.binary_cross_entropy_with_logits(logits + shift, target.clamp(min=0), reduction="none")
        term = (bce * (target >= 0)).sum() / (6 * 3)
        with torch.no_grad():
            t = torch.sigmoid(teacher(v))
        term = term + w * (((torch.sigmoid(logits) - t) ** 2) * mask).sum() / mask.sum()
        expected = expected + term / len(views)
    assert got == pytest.approx(float(expected), rel=1e-5)
    expected.backward()
    with torch.no_grad():
        for p_ref, p_got in zip(ref.parameters(), client.net.parameters()):
            torch.testing.assert_close(p_got, p_ref - 0.1 * p_ref.grad, rtol=1e-5, atol=1e-6)


def test_pos_weighted_on_adds_the_shared_weighting_to_wpc():
    logits = torch.tensor([[0.5, -1.0]])
    target = torch.tensor([[1.0, 0.0]])
    w = torch.tensor([3.0, 1.0])
    # positives count 3 times: (3 softplus(-0.5) + softplus(-1) ... ) over C = 2
    expected = (3 * math.log1p(math.exp(-0.5)) + math.log1p(math.exp(-1.0))) / 2
    assert float(wpc_loss(logits, target, None, w)) == pytest.approx(expected, rel=1e-6)


def test_the_engine_logs_what_the_rule_dropped_and_records_it():
    from fedlabels.engine import RoundEngine

    server = FedMLPServer(warmup_rounds=1)
    server.setup(summaries())
    logged = []

    def send(step, targets, weights, rnd, extras):
        return [update("s1", {"1": [[0.0, 1.0], [1.0, 0.0]]}, [0.5, 0.4, 0.2]),
                update("s2", {"1": [[0.0, 1.0], [1.0, 0.0]]}, [0.5, 0.4, 0.2])]

    engine = RoundEngine(server, send, key_metric="val_auroc", log=lambda level, msg: logged.append((level, msg)))
    _, record, _ = engine.run_round(0, {"w": np.zeros(2, np.float32)}, ["s1", "s2"])
    assert any("s1" in n and "does not annotate" in n for n in record["notes"])
    assert any(level == "warning" and "does not annotate" in msg for level, msg in logged)
    _, record, _ = engine.run_round(1, {"w": np.zeros(2, np.float32)}, ["s1", "s2"])
    assert any("without prototypes for classes [0]" in n for n in record["notes"])  # s1 never sent a usable one


# ---------------------------------------------------------------- baselines


def test_fixmatch_keeps_a_case_only_when_every_missing_class_is_confident():
    probs = torch.tensor([[0.9, 0.1, 0.5], [0.95, 0.05, 0.85], [0.1, 0.9, 0.9]])
    missing = torch.tensor([[False, True, True], [False, True, True], [True, True, True]])
    target, mask = fixmatch_targets(probs, missing, 0.8)
    assert mask.tolist() == [[False, False, False], [False, True, True], [True, True, True]]
    assert target[1].tolist() == [1.0, 0.0, 1.0]
    _, none = fixmatch_targets(probs, torch.zeros_like(missing), 0.8)
    assert not none.any()


def test_fednoro_rampup_and_distillation_by_hand():
    assert rampup(10, 10, 20) == pytest.approx(math.exp(-5))
    assert rampup(15, 10, 20) == pytest.approx(math.exp(-1.25))
    assert rampup(0, 10, 20) == pytest.approx(math.exp(-5)) and rampup(30, 10, 20) == 1.0
    logits = torch.tensor([[0.0, 0.0]])
    teacher = torch.tensor([[0.8, 100.0]])
    # sigmoid(0.8 / 0.8) = sigmoid(1); only entry 0 is missing
    expected = (0.5 - 1 / (1 + math.exp(-1))) ** 2
    got = distillation_loss(logits, teacher, torch.tensor([[1.0, 0.0]]), 0.8)
    assert float(got) == pytest.approx(expected, rel=1e-6)


def tiny_site():
    """A 3-class site annotating class 0 only; a batch with a weak and a strong view."""
    from fedlabels.profile import SiteProfile

    g = torch.Generator().manual_seed(1)
    profile = SiteProfile("s", "multilabel", ("a", "b", "c"), ("a",))
    y = torch.full((6, 3), -1.0)
    y[:, 0] = torch.tensor([1.0, 0, 0, 1, 0, 0])
    batch = {"image": torch.randn(6, 4, generator=g), "image_strong": torch.randn(6, 4, generator=g), "label": y}
    return site_context(profile, [batch], labels=[r.long().tolist() for r in y]), batch


def test_fixmatch_and_fednoro_steps_match_a_reference_loop():
    ctx, batch = tiny_site()
    pw = torch.tensor([2.0, 1.0, 1.0])  # 4 negatives / 2 positives for class a
    for name, options in (("fedfixmatch", {"confidence": 0.6}), ("fednoro", {"rampup_begin": 0, "rampup_end": 1})):
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3)
        with torch.no_grad():
            net.weight.mul_(8)  # confident outputs, so some cases pass FixMatch's test
        ref = copy.deepcopy(net)
        client = methods.get(name).make_client(net, ctx, lr=0.1, optimizer="sgd", **options)
        client.begin_round(1, {})
        client.optimizer = client.make_optimizer(client.net.parameters())
        got = client.train_step(batch)
        x, y = batch["image"], batch["label"]
        logits = ref(x)
        sup = partial_bce(logits, y, pos_weight=pw)
        missing = y < 0
        if name == "fedfixmatch":
            p = torch.sigmoid(logits.detach())
            ok = (((p > 0.6) | (p < 0.4)) | ~missing).all(1)
            assert 0 < ok.sum() < 6  # the rule keeps some cases and not others here
            mask = missing & ok[:, None]
            bce = F.binary_cross_entropy_with_logits(ref(batch["image_strong"]), (p > 0.5).float(), reduction="none")
            expected = sup + (bce * mask).sum() / mask.sum()
        else:
            w = 0.8  # the ramp is complete at round 1 of 0..1
            t = torch.sigmoid(ref(x).detach() / 0.8)
            expected = (1 - w) * sup + w * (((torch.sigmoid(logits) - t) ** 2) * missing).sum() / missing.sum()
        assert got == pytest.approx(float(expected), rel=1e-5), name
        expected.backward()
        with torch.no_grad():
            for p_ref, p_got in zip(ref.parameters(), client.net.parameters()):
                step = p_ref - 0.1 * p_ref.grad  # SGD momentum's first step is a plain step
                torch.testing.assert_close(p_got, step, rtol=1e-5, atol=1e-6)


def test_rscfed_partial_step_matches_a_reference_loop():
    """Partial BCE (weak view) + MSE of the strong-view student to the weak-view teacher on the missing
    entries; the teacher then moves by EMA towards the stepped student."""
    ctx, batch = tiny_site()
    pw = torch.tensor([2.0, 1.0, 1.0])
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    ref = copy.deepcopy(net)
    client = methods.get("rscfed_pl").make_client(net, ctx, lr=0.1, optimizer="sgd", ema_alpha=0.25)
    client.begin_round(0, {})
    client.optimizer = client.make_optimizer(client.net.parameters())
    got = client.train_step(batch)
    y = batch["label"]
    missing = (y < 0).float()
    with torch.no_grad():
        t = torch.sigmoid(ref(batch["image"]))
    expected = partial_bce(ref(batch["image"]), y, pos_weight=pw) + \
        (((torch.sigmoid(ref(batch["image_strong"])) - t) ** 2) * missing).sum() / missing.sum()
    assert got == pytest.approx(float(expected), rel=1e-5)
    teacher0 = copy.deepcopy(ref)
    expected.backward()
    with torch.no_grad():
        for p_ref, p_got, p_t, p_t0 in zip(ref.parameters(), client.net.parameters(), client.teacher.parameters(),
                                           teacher0.parameters()):
            stepped = p_ref - 0.1 * p_ref.grad
            torch.testing.assert_close(p_got, stepped, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(p_t, 0.75 * p_t0 + 0.25 * stepped, rtol=1e-5, atol=1e-6)


def test_prototypes_are_checked_against_the_networks_feature_size_not_the_first_sites():
    """A hostile first site sends prototypes of another size: it is the one dropped, not every honest site
    after it. The size comes from the global model's head (the last weight with a row per class)."""
    from fedlabels.engine import RoundEngine
    from fedlabels.methods.fedmlp import feature_size
    from fedlabels.nets import ResNet18Classifier

    net = ResNet18Classifier(out_channels=3, widen_factor=0.25)
    weights = {k: v.numpy() for k, v in net.state_dict().items()}
    assert feature_size(weights, 3) == net.head.in_features
    server = FedMLPServer(warmup_rounds=1)
    server.setup(summaries())
    honest = [[0.0, 1.0], [1.0, 0.0]]

    def send(step, targets, w, rnd, extras):
        return [update("s2", {"1": [[0.0, 1.0, 2.0], [1.0, 0.0, 2.0]]}, [0.5, 0.4, 0.2]),  # 3 features, first
                update("s1", {"0": honest}, [0.5, 0.4, 0.2])]

    head = {"head.weight": np.zeros((3, 2), np.float32), "w": np.zeros(2, np.float32)}  # 2 features
    engine = RoundEngine(server, send, key_metric="val_auroc")
    _, record, _ = engine.run_round(0, head, ["s2", "s1"])
    assert any("s2: prototype for class '1' dropped: shape (2, 3), expected (2, 2)" in n for n in record["notes"])
    assert sorted(server.prototypes) == [0]  # s1's honest prototype kept
