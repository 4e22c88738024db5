"""Noised label summaries (fedlabels.privacy): clipping, the noise, the accountant's
(epsilon, delta), the option's validation, and one release reused for every message. The noised summary
in every message of a real simulator run is tests/simulator/test_privacy_runs.py."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp

from fedlabels import privacy
from fedlabels.config import ConfigError, RunConfig
from fedlabels.data.synthetic import generate
from fedlabels.profile import SiteProfile, label_summary, load_scenario
from shared_runs import PRIVACY

OPTS = {"noise_multiplier": 1.0, "clip": 4.0, "delta": 1e-5}
assert OPTS == PRIVACY  # the option the fedpsl_cxr smoke run carries (tests/shared_runs.py)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate("cxr", tmp_path_factory.mktemp("cxr") / "cxr", seed=0, cases=16, test_cases=4)


# ---------------------------------------------------------------- clipping and noise


def test_clipping_against_hand_computed_rows():
    x = np.array([[3.0, 4.0, 0.0], [0.3, 0.4, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    out = privacy.clip_rows(x, 1.0)
    expected = [[0.6, 0.8, 0.0], [0.3, 0.4, 0.0], [0.0, 0.0, 0.0], [1 / math.sqrt(3)] * 3]
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(privacy.clip_rows(x, 5.0), x)  # within the bound: unchanged
    # the noised sum is the clipped sum plus the draws of N(0, (s * clip)^2), in order
    noised = privacy.gaussian_sum(x, 2.0, 1.0, random.Random(7))
    rng = random.Random(7)
    np.testing.assert_allclose(noised, np.sum(expected, 0) + [rng.gauss(0.0, 2.0) for _ in range(3)], atol=1e-12)


def test_a_case_contributes_its_own_summary():
    p = SiteProfile("a", "multilabel", ("x", "y", "z"), ("x", "y"))
    items = [{"label": [1, 0, -1]}, {"label": [1, 1, -1]}, {"label": [-1, 0, -1]}]
    rows = privacy.contributions(p, items)
    #           cases  annotated  positives
    expected = [[1, 1, 1, 0, 1, 0, 0],
                [1, 1, 1, 0, 1, 1, 0],
                [1, 0, 1, 0, 0, 0, 0]]
    np.testing.assert_array_equal(rows, expected)
    s = label_summary(p, items)
    np.testing.assert_array_equal(rows.sum(0), [s["cases"], *s["annotated"], *s["positives"]])
    # the largest possible norm, sqrt(1 + 2 * annotated classes): a clip at least this keeps counts unbiased
    assert np.linalg.norm(rows, axis=1).max() == pytest.approx(math.sqrt(5))


def test_noise_has_the_standard_deviation_noise_multiplier_times_clip():
    """The default source (the operating system's): 20,000 draws; the sample standard
    deviation's standard error is 0.5 % of it, the margin 5 % (ten standard errors)."""
    sigma, clip = 1.5, 3.0
    x = np.array([[3.0, 4.0] + [0.0] * 8])  # one case, clipped from norm 5 to 3
    total = privacy.clip_rows(x, clip).sum(0)
    draws = np.stack([privacy.gaussian_sum(x, sigma, clip, random.SystemRandom()) - total for _ in range(2000)])
    assert draws.std() == pytest.approx(sigma * clip, rel=0.05)
    assert abs(draws.mean()) < 5 * sigma * clip / math.sqrt(draws.size)
    # a wrong scale (the unclipped norm, or sigma alone) would be far outside the margin
    assert not draws.std() == pytest.approx(sigma * 5.0, rel=0.05)
    assert not draws.std() == pytest.approx(sigma, rel=0.05)


# ---------------------------------------------------------------- the accountant


def test_epsilon_is_the_accountants_own_and_within_the_gaussian_bounds():
    sigma, delta = 1.0, 1e-5
    eps = privacy.epsilon(sigma, delta, releases=1)
    # opacus itself
    acc = RDPAccountant()
    acc.step(noise_multiplier=sigma, sample_rate=1.0)
    assert eps == acc.get_epsilon(delta=delta)
    # independently: the Gaussian mechanism's RDP is alpha / (2 sigma^2) (Mironov 2017, Prop. 7) ...
    alphas = np.array(RDPAccountant.DEFAULT_ALPHAS, dtype=float)
    rdp = alphas / (2 * sigma**2)
    np.testing.assert_allclose(compute_rdp(q=1.0, noise_multiplier=sigma, steps=1, orders=alphas), rdp)
    # ... converted to (epsilon, delta) by Balle et al. 2020, Thm 21, minimised over the same orders
    balle = np.min(rdp + np.log((alphas - 1) / alphas) - (math.log(delta) + np.log(alphas)) / (alphas - 1))
    assert eps == pytest.approx(balle, rel=1e-12)
    # ... above the exact epsilon of the Gaussian mechanism (Balle & Wang 2018) and below Mironov's
    # closed form 1/(2 sigma^2) + sqrt(2 log(1/delta))/sigma
    assert exact_gaussian_epsilon(sigma, delta) < eps < 1 / (2 * sigma**2) + math.sqrt(2 * math.log(1 / delta)) / sigma
    assert eps == pytest.approx(4.7285, abs=1e-4)
    # k releases at sigma spend what one release at sigma / sqrt(k) does (RDP adds up)
    assert privacy.epsilon(sigma, delta, releases=4) == pytest.approx(privacy.epsilon(sigma / 2, delta), rel=1e-12)
    assert privacy.composed_epsilon([1.0, 2.0], delta) == pytest.approx(privacy.epsilon(1 / math.sqrt(1.25), delta))


def exact_gaussian_epsilon(sigma, delta):
    """The smallest epsilon of the Gaussian mechanism (sensitivity 1), by bisection on
    delta(eps) = Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma)."""
    def phi(x):
        return 0.5 * math.erfc(-x / math.sqrt(2))

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if phi(1 / (2 * sigma) - mid * sigma) - math.exp(mid) * phi(-1 / (2 * sigma) - mid * sigma) > delta:
            lo = mid
        else:
            hi = mid
    return hi


# ---------------------------------------------------------------- the option


@pytest.mark.parametrize("value, field, message", [
    ({**OPTS, "noise_multiplier": -1.0}, "privacy.noise_multiplier", "must be > 0"),
    ({**OPTS, "noise_multiplier": 0}, "privacy.noise_multiplier", "adds no noise"),
    ({**OPTS, "clip": 0.0}, "privacy.clip", "must be > 0"),
    ({**OPTS, "delta": 0.0}, "privacy.delta", r"\(0, 1\)"),
    ({**OPTS, "delta": 1.0}, "privacy.delta", r"\(0, 1\)"),
    ({**OPTS, "delta": 1.5}, "privacy.delta", r"\(0, 1\)"),
    ({**OPTS, "delta": "1e-5"}, "privacy.delta", "finite number"),
    ({**OPTS, "clip": True}, "privacy.clip", "finite number"),
    ({**OPTS, "clip": float("inf")}, "privacy.clip", "finite number"),
    ({**OPTS, "epsilon": 1.0}, "privacy.epsilon", "unknown option"),
    ({"noise_multiplier": 1.0, "delta": 1e-5}, "privacy.clip", "missing"),
])
@pytest.mark.parametrize("side", ["client", "server"])
def test_bad_options_fail_with_file_and_field_named(value, field, message, side):
    cfg = RunConfig.from_json({"method": "fedpsl", "privacy": value}, "job/fedlabels.json")
    with pytest.raises(ConfigError, match=rf"^job/fedlabels.json: field '{field}': .*{message}"):
        cfg.validate(side)


def test_the_option_reads_back_and_off_leaves_configurations_unchanged(tmp_path):
    with pytest.raises(ConfigError, match="field 'privacy': expected dict"):
        RunConfig.from_json({"method": "fedavg", "privacy": 1.0}, "job/fedlabels.json")
    on = RunConfig("fedpsl", privacy=dict(OPTS))
    on.validate("client")
    loaded = RunConfig.load(on.save(tmp_path / "on.json"))
    assert loaded.privacy == OPTS and type(loaded.privacy["delta"]) is float
    off = RunConfig("fedpsl")
    assert "privacy" not in off.to_json()  # job folders written before the option stay byte-identical
    assert RunConfig.load(off.save(tmp_path / "off.json")).privacy == {}


# ---------------------------------------------------------------- one release, reused


def test_release_is_post_processed_into_valid_counts(data):
    site = load_scenario(data).site("site-2")
    exact = site.summary()
    for seed in range(20):
        s, _ = privacy.release(site.profile, site.training, privacy.options({**OPTS, "clip": 1.0}), seed=seed)
        assert set(s) == set(exact) | {privacy.REPORT}
        assert {k: s[k] for k in ("site", "task", "supervision", "labeled_mask")} == \
               {k: exact[k] for k in ("site", "task", "supervision", "labeled_mask")}
        ann, pos = np.array(s["annotated"]), np.array(s["positives"])
        assert s["cases"] >= 0 and (0 <= ann).all() and (ann <= s["cases"]).all() and (0 <= pos).all()
        assert (pos <= ann).all() and all(isinstance(v, int) for v in [s["cases"], *s["annotated"], *s["positives"]])
        assert not ann[~np.array(exact["labeled_mask"])].any()  # classes it does not annotate stay 0
        assert s["labeled"] == bool(ann.any())
    a, _ = privacy.release(site.profile, site.training, privacy.options(OPTS))
    b, _ = privacy.release(site.profile, site.training, privacy.options(OPTS))
    assert (a["cases"], a["annotated"], a["positives"]) != (b["cases"], b["annotated"], b["positives"])  # unseeded


def test_a_release_is_kept_and_reused_and_new_releases_compose(data, tmp_path):
    """One ledger per site: the same data and options reuse the release (another run, another workspace);
    other options or data make a new release, and every release of the site composes, whatever its data."""
    site = load_scenario(data).site("site-1")
    ledger = tmp_path / "ledger.json"
    opts = privacy.options(OPTS)
    first, reused = privacy.release(site.profile, site.training, opts, ledger, note="job-a")
    assert not reused and first[privacy.REPORT]["releases"] == 1
    assert first[privacy.REPORT]["epsilon"] == privacy.epsilon(1.0, 1e-5)
    assert first[privacy.REPORT]["exact"][0] == "n" and first[privacy.REPORT]["unit"] == "image"
    again, reused = privacy.release(site.profile, site.training, opts, ledger, note="job-b")
    assert reused and again == first  # a new process of the same run, or a later run or job on the same data
    entries = json.loads(ledger.read_text())["sites"]["site-1"]
    assert len(entries) == 1 and "fingerprint" in entries[0] and entries[0]["note"] == "job-a"
    # other options: a new release; the report composes both with the accountant
    other, reused = privacy.release(site.profile, site.training, privacy.options({**OPTS, "noise_multiplier": 2.0}),
                                    ledger)
    acc = RDPAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=1.0)
    acc.step(noise_multiplier=2.0, sample_rate=1.0)
    assert not reused and other[privacy.REPORT]["releases"] == 2
    assert other[privacy.REPORT]["epsilon"] == acc.get_epsilon(delta=1e-5)
    # changed data: a new release as well, composed with the two before
    third, reused = privacy.release(site.profile, site.training[1:], privacy.options({**OPTS, "noise_multiplier": 2.0}),
                                    ledger)
    acc.step(noise_multiplier=2.0, sample_rate=1.0)
    assert not reused and third[privacy.REPORT]["releases"] == 3
    assert privacy.spent(ledger, "site-1", 1e-5) == (pytest.approx(acc.get_epsilon(delta=1e-5)), 3)
    # another site at the same ledger has its own account
    two = load_scenario(data).site("site-2")
    s2, _ = privacy.release(two.profile, two.training, opts, ledger)
    assert s2[privacy.REPORT]["releases"] == 1 and privacy.spent(ledger, "site-1", 1e-5)[1] == 3
    # without a ledger nothing is kept
    _, reused = privacy.release(site.profile, site.training, opts)
    assert not reused
    ledger.write_text("{truncated")
    with pytest.raises(ValueError, match=rf"^{ledger}: not valid JSON"):
        privacy.release(site.profile, site.training, opts, ledger)


def test_the_ledger_survives_concurrent_releases(data, tmp_path):
    """Two jobs of one hospital releasing at once (two processes): both releases are recorded."""
    import subprocess
    import sys

    ledger = tmp_path / "ledger.json"
    code = ("import sys; from fedlabels import privacy; from fedlabels.profile import load_scenario; "
            "s = load_scenario(sys.argv[1]).site('site-1'); "
            "privacy.release(s.profile, s.training[int(sys.argv[3]):], privacy.options("
            "{'noise_multiplier': 1.0, 'clip': 4.0, 'delta': 1e-5}), sys.argv[2])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(data), str(ledger), str(k)]) for k in range(2)]
    assert [p.wait() for p in procs] == [0, 0]
    assert len(json.loads(ledger.read_text())["sites"]["site-1"]) == 2


def test_the_site_sends_and_trains_with_the_one_noised_summary(data, tmp_path, monkeypatch):
    """What the handshake sends (``setup.summary()``), what every training update
    carries (``ClientRule.make_update``: ``Update.meta``) and what the method itself
    uses (positive weights) is the one release, the same in a second process of the run."""
    from fedlabels.flare.client import build_parser, prepare
    from fedlabels.losses import pos_weight_from_counts
    from fedlabels.methods.fedpsl import TDMAServer

    monkeypatch.setenv("FEDLABELS_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("FEDLABELS_PRIVACY_LEDGER", str(tmp_path / "ledger.json"))
    cfg = RunConfig("fedpsl", data={"family": "cxr", "batch_size": 4}, privacy=dict(OPTS))
    args = build_parser().parse_args(["--data", str(data), "--device", "cpu"])
    setup, client = prepare(cfg, args, "site-1", None)
    sent = setup.summary()
    exact = load_scenario(data).site("site-1").summary()
    report = sent[privacy.REPORT]
    assert report["epsilon"] == privacy.epsilon(1.0, 1e-5) and report["delta"] == 1e-5
    assert (sent["cases"], sent["annotated"], sent["positives"]) != (exact["cases"], exact["annotated"], exact["positives"])
    assert client.ctx.summary == sent
    np.testing.assert_array_equal(client.pos_weight.numpy(), pos_weight_from_counts(sent["annotated"], sent["positives"]))
    updates = [client.make_update(4, {}) for _ in range(2)]  # two rounds' updates
    for u in updates:
        assert {k: u.meta[k] for k in sent} == sent
    # the server's class-wise head weights come from the noised counts
    server = TDMAServer()
    server.setup({"site-1": sent})
    mask = np.array(sent["labeled_mask"])
    np.testing.assert_array_equal(server.head_weights(updates[:1], len(mask))[0], np.array(sent["annotated"]) * mask)
    # the site's process restarts within the run (nvflare's simulator may start one per task)
    setup2, client2 = prepare(cfg, args, "site-1", None)
    assert setup2.summary() == sent and client2.ctx.summary == sent


def test_the_server_reports_each_site_and_refuses_exact_counts_when_asked(data):
    sc = load_scenario(data)
    noised = {s: privacy.release(sc.site(s).profile, sc.site(s).training, privacy.options(OPTS))[0]
              for s in ("site-1", "site-2")}
    lines = privacy.server_lines(noised, required=True)
    assert lines == [f"privacy: {s}: label summary noised (Gaussian, noise_multiplier=1, clip=4): "
                     f"(epsilon=4.729, delta=1e-05) spent over 1 release of this site's counts (opacus RDP "
                     f"accountant), per image, not per patient; n, sent exactly every round, gives the case count"
                     for s in ("site-1", "site-2")]
    exact = {"site-1": noised["site-1"], "site-2": sc.site("site-2").summary()}
    with pytest.raises(ValueError, match="site-2 sent an exact label summary"):
        privacy.server_lines(exact, required=True)
    assert privacy.server_lines({"site-2": exact["site-2"]}, required=False) == []


def test_a_validation_reply_carries_no_per_case_values_and_no_counts_under_privacy():
    from fedlabels.flare.client import shareable

    result = {"dice": 0.8, "dice_per_case": [0.7, 0.9],
              "per_class": {"a": {"auroc": 0.7, "n_pos": 3, "n_neg": 9}, "b": {"auroc": None, "n_pos": 0, "n_neg": 12}}}
    assert shareable(result, counts=True) == {"dice": 0.8, "per_class": {"a": {"auroc": 0.7, "n_pos": 3, "n_neg": 9},
                                                                          "b": {"auroc": None, "n_pos": 0, "n_neg": 12}}}
    assert shareable(result, counts=False) == {"dice": 0.8, "per_class": {"a": {"auroc": 0.7}, "b": {"auroc": None}}}


def test_an_error_sent_to_the_server_names_no_local_path_or_file():
    from fedlabels.flare.client import redact

    assert redact("/data/hospital/site-1/datalist.json: field 'training': no training cases") == \
        "<local file>: field 'training': no training cases (the site's log has the full message)"
    assert redact("scans/patient_0042.dcm: not a DICOM file; see C:\\PACS\\export") == \
        "<local file>: not a DICOM file; see <local file> (the site's log has the full message)"
    assert redact("profile.yaml: field 'classes': class list").startswith("<local file>: field 'classes'")
    # numbers, dotted names and plain reasons pass unchanged
    assert redact("training loss is NaN at round 3 (lr 0.001, torch.float32)") == \
        "training loss is NaN at round 3 (lr 0.001, torch.float32) (the site's log has the full message)"
    assert redact(None) is None and redact("") == ""
