"""The round engine (fedlabels.engine) without FLARE.

Unit part: a fake in-memory ``send`` (plain functions returning ``Update``
objects) and real server rules, every result computed by hand. Resume part:
the real in-process pieces (bundle, synthetic cxr data, client rules,
``site.save_state`` / ``load_state``): a run stopped after round 1 and resumed
from its saved state ends with the global weights of the uninterrupted run.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

import fedlabels.methods as methods
from fedlabels.engine import NORM_RATIO, NoProgress, RoundEngine, in_range, outsized, screen_update
from fedlabels.methods import Update
from fedlabels.methods.base import START_GLOBAL, START_PREVIOUS, Step, to_numpy
from fedlabels.methods.fedavg import FedAvgServer

KEY = "val_auroc"
GLOBAL = {"w": np.array([0.0, 0.0], dtype=np.float32), "nbt": np.array(0, dtype=np.int64)}


def upd(site, n, w, nbt=1, metrics=None, extras=None):
    return Update(site, {"w": np.array(w, dtype=np.float32), "nbt": np.array(nbt, dtype=np.int64)}, n,
                  {}, dict(metrics or {}), dict(extras or {}))


def abstain(site, metrics=None):
    return Update(site, {}, 0, {}, dict(metrics or {}), abstain=True)


class FakeSend:
    """``send``: each site answers ``answers[site](weights, rnd, step)``; every call is logged."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def __call__(self, step, targets, weights, rnd, extras):
        self.calls.append({"step": step.name, "targets": list(targets), "rnd": rnd, "extras": extras,
                           "weights": {k: np.array(v, copy=True) for k, v in weights.items()}})
        out = []
        for s in targets:
            answer = self.answers[s]
            u = answer(weights, rnd, step) if callable(answer) else answer
            if u is not None:  # None: the site crashed, nothing comes back
                out.append(u)
        return out


def engine(answers, server=None, **kw):
    send = FakeSend(answers)
    logs = []
    eng = RoundEngine(server or FedAvgServer(), send, key_metric=KEY, log=lambda lvl, msg: logs.append((lvl, msg)),
                      **kw)
    eng.logs = logs
    return eng, send


# ------------------------------------------------------------------ screening and weights

def test_weighted_round_by_hand():
    eng, _ = engine({"A": upd("A", 1, [1, 2], nbt=2), "B": upd("B", 3, [5, 6], nbt=4)})
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B"])
    np.testing.assert_allclose(out["w"], [(1 * 1 + 3 * 5) / 4, (1 * 2 + 3 * 6) / 4])  # [4, 5]
    assert out["nbt"].dtype == np.int64 and int(out["nbt"]) == 4  # 3.5 -> rint (even) 4
    assert record["aggregated"] and record["dropped"] == {} and record["abstained"] == []
    assert record["sites"]["A"]["n"] == 1 and record["sites"]["B"]["n"] == 3
    assert eng.aggregated_rounds == 1


def test_an_abstaining_site_has_weight_zero_and_is_not_dropped():
    eng, _ = engine({"A": upd("A", 1, [1, 1]), "B": upd("B", 3, [5, 5]), "C": abstain("C")})
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B", "C"])
    np.testing.assert_allclose(out["w"], [4.0, 4.0])  # (1*1 + 3*5) / 4: C counts for nothing
    assert record["abstained"] == ["C"]
    assert "C" not in record["dropped"]
    assert record["sites"]["C"]["n"] == 0
    assert any("abstains" in m for lvl, m in eng.logs if lvl == "info")


def test_every_site_abstaining_keeps_the_model_and_does_not_count():
    eng, _ = engine({"A": abstain("A"), "B": abstain("B")})
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B"])
    assert out is GLOBAL or all(np.array_equal(out[k], GLOBAL[k]) for k in GLOBAL)
    assert record["aggregated"] is False and record["steps"][0]["aggregated"] is False
    assert record["abstained"] == ["A", "B"] and record["dropped"] == {}
    assert eng.aggregated_rounds == 0
    with pytest.raises(NoProgress):
        eng.check_progress()


def test_missing_case_count_is_dropped_never_weighted_one():
    eng, _ = engine({"A": upd("A", 1, [1, 1]), "B": upd("B", None, [100, 100])})
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B"])
    np.testing.assert_allclose(out["w"], [1.0, 1.0])  # A alone; with B weighted 1 it would be 50.5
    assert "case count" in record["dropped"]["B"]
    assert screen_update(upd("B", None, [1, 1]), GLOBAL) is not None
    for bad in (0, -2, 1.5, 2.0):
        assert "case count" in screen_update(upd("B", bad, [1, 1]), GLOBAL), bad


@pytest.mark.parametrize("bad, reason", [
    (upd("B", 3, [np.nan, 1]), "non-finite"),
    (upd("B", 3, [np.inf, 1]), "non-finite"),
    (Update("B", {"w": np.zeros(3, dtype=np.float32)}, 3), "shape"),
    (Update("B", {"w": np.zeros(2, dtype=np.float32), "stray": np.zeros(1)}, 3), "unknown keys"),
    (Update("B", {}, 3), "empty"),
    (upd("B", 3, [5, 5], extras={"counts": np.array([1.0, np.nan])}), "extra 'counts'"),
])
def test_faulty_updates_are_dropped_with_a_reason(bad, reason):
    eng, _ = engine({"A": upd("A", 1, [1, 1]), "B": bad, "C": upd("C", 1, [3, 3])})
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B", "C"])
    np.testing.assert_allclose(out["w"], [2.0, 2.0])  # A and C only
    assert reason in record["dropped"]["B"], record["dropped"]
    assert list(record["dropped"]) == ["B"] and record["aggregated"]
    assert any("B: update dropped" in m for lvl, m in eng.logs if lvl == "warning")


# Hostile or broken replies (tracker issue 22, item 3): each is dropped with its reason, the others
# aggregate, and nothing of it reaches the global model or stops the round.
HOSTILE = [
    (upd("B", "3", [5, 5]), "case count '3' is not a positive integer"),
    (upd("B", np.float32(3), [5, 5]), "is not a positive integer"),
    (upd("B", 10**9, [5, 5]), "exceeds the 40 the site can train on"),  # B declared 40 cases
    (Update("B", {"w": np.array([5, 5], dtype=np.float64), "nbt": np.array(1)}, 3), "dtype of w is float64"),
    (Update("B", {"w": np.array(["5", "5"]), "nbt": np.array(1)}, 3), "dtype of w is <U1"),
    (Update("B", {"w": np.array([5, None], dtype=object), "nbt": np.array(1)}, 3), "dtype of w is object"),
    (Update("B", [np.zeros(2)], 3), "not a mapping of arrays"),
    (Update("B", upd("B", 3, [5, 5]).weights, 3, {}, {}, ["x"]), "extras are a list"),
    (upd("B", 3, [5, 5], extras={"counts": np.array(["a", "b"])}), "extra 'counts' is not numeric"),
    (upd("B", 3, [5, 5], extras={"counts": [1.0, [2.0]]}), "extra 'counts' is not an array"),
]


@pytest.mark.parametrize("bad, reason", HOSTILE)
def test_hostile_replies_are_dropped_with_a_reason(bad, reason):
    bound = {"max_n": {"A": 40, "B": 40}} if "exceeds" in reason else {}  # the sites' declared cases
    eng, _ = engine({"A": upd("A", 1, [1, 1]), "B": bad, "C": upd("C", 1, [3, 3])}, **bound)
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B", "C"])
    np.testing.assert_allclose(out["w"], [2.0, 2.0])  # A and C only
    assert out["w"].dtype == np.float32 and out["nbt"].dtype == np.int64
    assert reason in record["dropped"]["B"], record["dropped"]
    assert list(record["dropped"]) == ["B"] and record["aggregated"]
    json.dumps(record)  # the record stays writable (metrics.jsonl)
    assert any("B: update dropped: " in m and reason in m for lvl, m in eng.logs if lvl == "warning"), eng.logs


def test_a_case_count_within_the_declared_bound_is_used():
    eng, _ = engine({"A": upd("A", 1, [1, 1]), "B": upd("B", 40, [5, 5])}, max_n={"B": 40})
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B"])
    assert record["dropped"] == {} and out["w"][0] == pytest.approx((1 + 40 * 5) / 41)


def test_a_rule_error_on_site_sent_data_keeps_the_model_and_the_job_goes_on():
    """A rule that raises inside aggregate on what a site sent (a check it did not declare in
    ``screen``) loses that step, logged; the engine itself never raises."""
    class Picky(FedAvgServer):
        def aggregate(self, updates, global_weights, round):
            raise ValueError("site 'B' sent something this rule cannot read")

    eng, _ = engine({"A": upd("A", 1, [1, 1]), "B": upd("B", 1, [5, 5])}, server=Picky())
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B"])
    np.testing.assert_array_equal(out["w"], GLOBAL["w"])
    assert record["aggregated"] is False
    assert any("aggregation failed on the sites' updates (ValueError: " in m for _, m in eng.logs)


def test_a_site_that_sends_nothing_back_is_dropped():
    eng, _ = engine({"A": upd("A", 1, [1, 1]), "B": None})
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B"])
    np.testing.assert_allclose(out["w"], [1.0, 1.0])
    assert "no result" in record["dropped"]["B"]


class ShapedExtras(FedAvgServer):
    def extra_shapes(self, round, step):
        return {"counts": (3,)}


def test_extra_shapes_mismatch_is_dropped():
    good = upd("A", 1, [1, 1], extras={"counts": np.ones(3), "free": np.ones(7)})  # unlisted: any shape
    bad = upd("B", 3, [5, 5], extras={"counts": np.ones(2)})
    eng, _ = engine({"A": good, "B": bad}, server=ShapedExtras())
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B"])
    np.testing.assert_allclose(out["w"], [1.0, 1.0])
    assert "shape of extra 'counts'" in record["dropped"]["B"]
    assert "A" not in record["dropped"]


def test_min_sites():
    answers = {"A": upd("A", 1, [1, 1]), "B": upd("B", 3, [5, 5]), "C": upd("C", 1, [np.nan, 0])}
    eng, _ = engine(answers, min_sites=3)
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B", "C"])  # 2 usable < 3
    np.testing.assert_array_equal(out["w"], GLOBAL["w"])
    assert record["aggregated"] is False and eng.aggregated_rounds == 0
    assert any("min_sites=3" in m for _, m in eng.logs)
    eng, _ = engine(answers, min_sites=2)
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B", "C"])
    np.testing.assert_allclose(out["w"], [4.0, 4.0])
    with pytest.raises(ValueError, match="min_sites"):
        RoundEngine(FedAvgServer(), FakeSend({}), key_metric=KEY, min_sites=0)


def test_min_sites_counts_the_sites_a_step_can_reach():
    """A production min_sites (every site) with a plan of two steps (IsoFed's: 3 sites, then 1) and an
    abstaining site: each step needs every target that did not abstain, less the sites the federation may
    lose (4 - min_sites); with min_sites counted per step (the old rule) neither step could ever reach 4."""
    from fedlabels.methods.base import Step

    class TwoSteps(FedAvgServer):
        def plan(self, round, sites):
            return [Step(("A", "B", "C"), name="unlabeled"), Step(("D",), name="labeled")]

    answers = {"A": upd("A", 1, [1, 1]), "B": upd("B", 3, [5, 5]), "C": abstain("C"), "D": upd("D", 2, [9, 9])}
    eng, _ = engine(answers, server=TwoSteps(), min_sites=4)
    out, record, _ = eng.run_round(0, GLOBAL, ["A", "B", "C", "D"])
    assert [st["aggregated"] for st in record["steps"]] == [True, True]
    np.testing.assert_allclose(out["w"], [9.0, 9.0])  # the labeled step starts from the global model
    # a target that fails: with min_sites = 4 of 4 nothing may be missing, so that step keeps its model ...
    crashed = {**answers, "B": None}
    eng, _ = engine(crashed, server=TwoSteps(), min_sites=4)
    _, record, _ = eng.run_round(0, GLOBAL, ["A", "B", "C", "D"])
    assert [st["aggregated"] for st in record["steps"]] == [False, True]
    assert any("1 usable update(s) of 2 expected < 2 (min_sites=4 of 4 sites" in m for _, m in eng.logs)
    # ... and with min_sites = 3 one site may be missing
    eng, _ = engine(crashed, server=TwoSteps(), min_sites=3)
    _, record, _ = eng.run_round(0, GLOBAL, ["A", "B", "C", "D"])
    assert [st["aggregated"] for st in record["steps"]] == [True, True]


def test_a_non_finite_aggregate_keeps_the_model():
    class Broken(FedAvgServer):
        def aggregate(self, updates, global_weights, round):
            return {**global_weights, "w": np.array([np.nan, 0], dtype=np.float32)}

    eng, _ = engine({"A": upd("A", 1, [1, 1])}, server=Broken())
    out, record, _ = eng.run_round(0, GLOBAL, ["A"])
    np.testing.assert_array_equal(out["w"], GLOBAL["w"])
    assert record["aggregated"] is False


# ------------------------------------------------------------------ plans: steps and groups

class TwoSteps(FedAvgServer):
    """Step 1: site a from the round's model; step 2: b from step 1's result; step 3: c from the round's model."""

    def __init__(self):
        super().__init__(weighted=True)
        self.seen_extras = []

    def plan(self, round, sites):
        return [Step(("a",), name="one"), Step(("b",), start=START_PREVIOUS, name="two"),
                Step(("c",), start=START_GLOBAL, name="three")]

    def extras(self, round, step):
        return {"step": step.name, "round": round}


def moved(site, delta, n=1):
    """A site that adds ``delta`` to what it received."""
    return lambda weights, rnd, step: Update(site, {"w": np.asarray(weights["w"]) + delta,
                                                    "nbt": np.asarray(weights["nbt"]) + 1}, n)


def test_steps_start_from_the_previous_result_or_the_global_model():
    start = {"w": np.array([10.0, 10.0], dtype=np.float32), "nbt": np.array(0, dtype=np.int64)}
    eng, send = engine({"a": moved("a", 1.0), "b": moved("b", 100.0), "c": moved("c", -5.0)}, server=TwoSteps())
    out, record, _ = eng.run_round(0, start, ["a", "b", "c"])
    received = {c["step"]: c["weights"]["w"].tolist() for c in send.calls}
    assert received == {"one": [10, 10], "two": [11, 11], "three": [10, 10]}  # two: from one's result
    assert [c["extras"] for c in send.calls] == [{"step": s, "round": 0} for s in ("one", "two", "three")]
    np.testing.assert_allclose(out["w"], [5.0, 5.0])  # the last step's result: 10 - 5
    assert [s["name"] for s in record["steps"]] == ["one", "two", "three"]
    assert all(s["aggregated"] for s in record["steps"])


def test_a_step_after_a_failed_step_starts_from_the_last_good_model():
    start = {"w": np.array([10.0, 10.0], dtype=np.float32), "nbt": np.array(0, dtype=np.int64)}
    eng, send = engine({"a": lambda w, r, s: upd("a", 1, [np.nan, 0]), "b": moved("b", 100.0), "c": moved("c", -5.0)},
                       server=TwoSteps())
    eng.run_round(0, start, ["a", "b", "c"])
    assert send.calls[1]["weights"]["w"].tolist() == [10, 10]  # step one aggregated nothing


class Groups(FedAvgServer):
    """One step, two overlapping groups aggregated on their own from the same start."""

    def plan(self, round, sites):
        return [Step(("a", "b", "c"), groups=(("a", "b"), ("b", "c")), name="rsc")]


def test_groups_aggregate_separately_and_combine_by_unweighted_mean():
    answers = {"a": upd("a", 1, [1, 1], nbt=1), "b": upd("b", 3, [5, 5], nbt=2), "c": upd("c", 1, [9, 13], nbt=4)}
    eng, send = engine(answers, server=Groups())
    out, record, _ = eng.run_round(0, GLOBAL, ["a", "b", "c"])
    assert [c["targets"] for c in send.calls] == [["a", "b"], ["b", "c"]]
    for c in send.calls:  # both groups from the same start
        np.testing.assert_array_equal(c["weights"]["w"], GLOBAL["w"])
    g1 = [(1 * 1 + 3 * 5) / 4, (1 * 1 + 3 * 5) / 4]  # [4, 4]
    g2 = [(3 * 5 + 1 * 9) / 4, (3 * 5 + 1 * 13) / 4]  # [6, 7]
    np.testing.assert_allclose(out["w"], [(g1[0] + g2[0]) / 2, (g1[1] + g2[1]) / 2])  # [5, 5.5]
    # nbt: group 1 rint(7/4)=2, group 2 rint(10/4)=2 (half to even); combined 2
    assert int(out["nbt"]) == 2
    assert record["aggregated"]


def test_steps_check_their_groups():
    with pytest.raises(ValueError, match="outside"):
        Step(("a", "b"), groups=(("a", "z"),))
    with pytest.raises(ValueError, match="start"):
        Step(("a",), start="elsewhere")


# ------------------------------------------------------------------ best model

def scripted(site, script):
    """Answers per round from ``script[rnd]``: (n, w, metric or None), "abstain", or "nan"."""
    def answer(weights, rnd, step):
        kind = script[rnd]
        if kind == "abstain":
            return abstain(site, {KEY: 0.5})
        n, w, metric = kind
        return upd(site, n, w, metrics={} if metric is None else {KEY: metric})
    return answer


def test_best_tracks_the_same_sites_every_round():
    answers = {
        "A": scripted("A", [(1, [1, 1], 0.5), (1, [np.nan, 0], 0.9), (1, [1, 1], 0.9), (1, [1, 1], 0.3),
                            (1, [1, 1], 0.95)]),
        "B": scripted("B", [(1, [1, 1], 0.7), (1, [1, 1], 0.7), (1, [1, 1], None), (1, [1, 1], 0.3),
                            "abstain"]),
        "C": scripted("C", [(1, [1, 1], None), (1, [1, 1], 0.0), (1, [1, 1], 0.0), (1, [1, 1], 0.0),
                            (1, [1, 1], 0.0)]),
    }
    eng, _ = engine(answers)
    w, results = GLOBAL, []
    for rnd in range(5):
        w, record, best = eng.run_round(rnd, w, ["A", "B", "C"])
        results.append((record[f"mean_{KEY}"], best is not None, record["scored_by"]))
        if rnd == 1:
            assert "A" in record["dropped"]  # dropped update, yet its score of the received model counts
    assert eng.scorers == ["A", "B"]  # fixed by round 0; C (no metric then) never enters the mean
    assert results[0] == (pytest.approx(0.6), True, ["A", "B"])
    assert results[1] == (pytest.approx(0.8), True, ["A", "B"])
    # B reported nothing: scored over A alone, against the best's score at A (0.9): not better
    assert results[2] == (pytest.approx(0.9), False, ["A"])
    assert any("['B'] reported no finite val_auroc; the round is scored over ['A']" in m for _, m in eng.logs)
    assert results[3] == (pytest.approx(0.3), False, ["A", "B"])
    assert results[4] == (pytest.approx(0.725), False, ["A", "B"])  # an abstaining site still scores: (0.95 + 0.5) / 2
    assert eng.best == pytest.approx(0.8) and eng.best_round == 1
    assert eng.score_final({"A": 0.9, "B": 0.9, "C": 0.0}, rounds=5) == (pytest.approx(0.9), True)
    assert eng.best_round == 5
    # B lost for good: the final model still competes, over A (1.0 > the best's 0.9 at A)
    assert eng.score_final({"A": 1.0}, rounds=6) == (pytest.approx(1.0), True)
    assert eng.best == pytest.approx(1.0) and eng.best_scores == {"A": 1.0} and eng.best_round == 6


def test_a_lost_scoring_site_does_not_end_best_model_tracking():
    """The "kill a hospital" drill: B scores rounds 0-1 and is gone after; A's later, better scores
    still make new best models, compared with the best's score at A, not with the A+B mean."""
    gone = lambda w, r, s: None  # noqa: E731
    answers = {"A": scripted("A", [(1, [1, 1], 0.5), (1, [1, 1], 0.6), (1, [1, 1], 0.45), (1, [1, 1], 0.7)]),
               "B": lambda w, r, s: scripted("B", [(1, [1, 1], 0.9), (1, [1, 1], 0.8)])(w, r, s) if r < 2
               else gone(w, r, s)}
    eng, _ = engine(answers)
    w, bests = GLOBAL, []
    for rnd in range(4):
        w, record, best = eng.run_round(rnd, w, ["A", "B"])
        bests.append(best is not None)
    # round 1: 0.7 = 0.7 over A+B, not better; rounds 2-3: A alone against the best's 0.5 at A
    assert bests == [True, False, False, True]
    assert eng.best_round == 3 and record["scored_by"] == ["A"] and eng.best == pytest.approx(0.7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "0.99", [0.9], None])
def test_a_non_finite_or_non_numeric_score_never_becomes_best(bad):
    """NaN would replace the best (every comparison with NaN is False, so nothing beats it again) and +inf
    would pin it for good; a string or list would stop the job in float(). Each is left unscored,
    logged, and the round goes on."""
    metrics = {KEY: bad, "other": object()}
    answers = {"A": scripted("A", [(1, [1, 1], 0.5), (1, [1, 1], 0.6), (1, [1, 1], 0.7)]),
               "B": lambda w, r, s: upd("B", 1, [1, 1], metrics={KEY: 0.5} if r != 1 else metrics)}
    eng, _ = engine(answers)
    w, bests = GLOBAL, []
    for rnd in range(3):
        w, record, best = eng.run_round(rnd, w, ["A", "B"])
        bests.append(best is not None)
        json.dumps(record)  # the record stays writable (metrics.jsonl)
        if rnd == 1:
            assert record["scored_by"] == ["A"] and record["aggregated"]
            assert record["sites"]["B"]["n"] == 1 and "other" not in record["sites"]["B"]
    assert bests == [True, True, True] and eng.best == pytest.approx(0.6) and eng.best_round == 2
    if bad is not None:
        assert any("B:" in m and ("not finite" in m or "not a number" in m) for _, m in eng.logs), eng.logs


def test_no_metric_anywhere_is_never_best():
    eng, _ = engine({"A": upd("A", 1, [1, 1])})
    _, record, best = eng.run_round(0, GLOBAL, ["A"])
    assert record[f"mean_{KEY}"] is None and best is None and eng.best is None


def test_check_progress():
    eng, _ = engine({"A": upd("A", None, [1, 1])})
    for rnd in range(3):
        eng.run_round(rnd, GLOBAL, ["A"])
    with pytest.raises(NoProgress, match="no round aggregated"):
        eng.check_progress()
    eng.send.answers["A"] = upd("A", 2, [1, 1])
    eng.run_round(3, GLOBAL, ["A"])
    eng.check_progress()
    assert eng.aggregated_rounds == 1


# ------------------------------------------------------------------ state

class Counting(FedAvgServer):
    """A server rule with state: how many updates it aggregated."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def aggregate(self, updates, global_weights, round):
        self.count += len(updates)
        return super().aggregate(updates, global_weights, round)

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_state_dict_round_trip():
    answers = {"A": scripted("A", [(1, [1, 1], 0.5), (1, [2, 2], 0.8), (1, [3, 3], 0.6), (1, [4, 4], 0.9)]),
               "B": scripted("B", [(3, [5, 5], 0.7), (3, [6, 6], None), (3, [7, 7], 0.6), (3, [8, 8], 0.9)]),
               "C": scripted("C", [(1, [0, 0], None)] * 4)}
    sites = ["A", "B", "C"]
    whole, _ = engine(answers, server=Counting())
    w_whole, out_whole = GLOBAL, []
    for rnd in range(4):
        w_whole, record, best = whole.run_round(rnd, w_whole, sites)
        out_whole.append((record[f"mean_{KEY}"], best is not None))

    first, _ = engine(answers, server=Counting())
    w = GLOBAL
    for rnd in range(2):
        w, _, _ = first.run_round(rnd, w, sites)
    saved = pickle.loads(pickle.dumps(first.state_dict()))
    # round 1: B sent no score, A's 0.8 beats the best's 0.5 at A: the best is scored over A alone
    assert saved == {"server": {"count": 6}, "best": pytest.approx(0.8), "scorers": ["A", "B"], "aggregated_rounds": 2,
                     "best_scores": {"A": pytest.approx(0.8)}, "best_round": 1}
    second, _ = engine(answers, server=Counting())
    second.load_state_dict(saved)
    out = []
    for rnd in range(2, 4):
        w, record, best = second.run_round(rnd, w, sites)
        out.append((record[f"mean_{KEY}"], best is not None))
    assert out == out_whole[2:]
    assert out[0] == (pytest.approx(0.6), False)  # A's 0.6 is not better than the saved best's 0.8 at A
    for k in GLOBAL:
        np.testing.assert_array_equal(w[k], w_whole[k])
    assert second.state_dict() == whole.state_dict()
    assert second.server.count == 12


# ------------------------------------------------------------------ exact resume, real pieces

@pytest.fixture(scope="module")
def cxr(tmp_path_factory):
    from fedlabels.data.synthetic import generate
    from fedlabels.bundle import bundle_path

    data = generate("cxr", tmp_path_factory.mktemp("engine") / "cxr", seed=0, cases=8, test_cases=4)
    return bundle_path("cxr_resnet18"), data


SITES = ["site-1", "site-2"]
ROUNDS, STOP = 4, 2


def fresh(method, bundle, data, client_options):
    """Setups, client rules, server rule and engine as ``references.federate`` builds them."""
    from fedlabels.config import KEY_METRICS
    from fedlabels.references import setups, site_round

    m = methods.get(method)
    st = setups(bundle, data, sites=SITES, batch_size=8, seed=0)
    server = m.make_server()
    clients = {s: m.make_client(x.net, x.context(), **client_options) for s, x in st.items()}
    server.setup({s: x.site.summary() for s, x in st.items()})

    def send(step, targets, weights, rnd, extras):
        return [site_round(clients[s], st[s], weights, rnd, extras) for s in targets]

    eng = RoundEngine(server, send, key_metric=KEY_METRICS[next(iter(st.values())).task])
    return st, clients, eng


@pytest.mark.parametrize("method, client_options", [("surgical", {"warmup_epochs": 1}), ("fedbn", {})])
def test_resume_from_saved_state_is_exact(cxr, tmp_path, method, client_options):
    from fedlabels.nets import rebuild
    from fedlabels.references import federate, setups
    from fedlabels.site import load_state, save_state

    bundle, data = cxr
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = federate(method, setups(bundle, data, sites=SITES, batch_size=8, seed=0), ROUNDS, seed=0, log=None,
                         client_options=client_options)

        # Rounds 0..STOP-1, then every site's state, the engine's and the global model go to disk.
        st, clients, eng = fresh(method, bundle, data, client_options)
        torch.manual_seed(0)  # federate's initial global model
        weights = to_numpy(rebuild(next(iter(st.values())).net).state_dict())
        records = []
        for rnd in range(STOP):
            weights, record, _ = eng.run_round(rnd, weights, SITES)
            records.append(record)
            for s, c in clients.items():
                save_state(tmp_path / s, c, rnd)
        torch.save({"engine": eng.state_dict(), "weights": weights}, tmp_path / "server.pt")
        del st, clients, eng, weights

        # A new process would start here: everything rebuilt, then the saved state loaded.
        st, clients, eng = fresh(method, bundle, data, client_options)
        saved = torch.load(tmp_path / "server.pt", weights_only=False)
        eng.load_state_dict(saved["engine"])
        weights = saved["weights"]
        for s, c in clients.items():
            assert load_state(tmp_path / s, c, before=STOP) == STOP - 1
        if method == "surgical":
            assert all(c.warmed_up for c in clients.values())  # no second warm-up after the resume
        for rnd in range(STOP, ROUNDS):
            weights, record, _ = eng.run_round(rnd, weights, SITES)
            records.append(record)
    finally:
        torch.set_num_threads(threads)

    assert set(weights) == set(whole["last"])
    for k, v in whole["last"].items():
        np.testing.assert_allclose(weights[k], v, atol=1e-6, rtol=0, err_msg=k)
    for ours, theirs in zip(records, whole["records"]):
        assert ours["round"] == theirs["round"]
        assert ours["aggregated"] and ours["dropped"] == {} and ours["abstained"] == []
        for s in SITES:
            loss, ref = ours["sites"][s]["train_loss"], theirs["sites"][s]["train_loss"]
            assert loss == pytest.approx(ref, abs=1e-6), (s, ours["round"])
        mine, ref = ours[f"mean_{eng.key_metric}"], theirs[f"mean_{eng.key_metric}"]
        assert (mine is None and ref is None) or mine == pytest.approx(ref, abs=1e-6), (mine, ref)


# ------------------------------------------------------------------ rules reading site-sent meta and metrics

HEADED = {"feat": np.zeros(2, dtype=np.float32), "head.weight": np.zeros((3, 2), dtype=np.float32),
          "head.bias": np.zeros(3, dtype=np.float32)}
SUMMARY = {"cases": 10, "annotated": [10, 10, 0], "labeled_mask": [1, 1, 0]}


def headed(site, value, meta=None, metrics=None):
    w = {k: np.full_like(v, value) for k, v in HEADED.items()}
    return Update(site, w, 10, {"head_name": "head", **SUMMARY, **(meta or {})},
                  {"train_loss": 0.5, **(metrics or {})})


def _surgical():
    from fedlabels.methods.surgical import SurgicalServer

    return SurgicalServer()


def _tdma():
    from fedlabels.methods.fedpsl import TDMAServer

    return TDMAServer()


def _fedmix():
    from fedlabels.methods.fedmix import AdaptiveAggServer

    return AdaptiveAggServer()


@pytest.mark.parametrize("make, meta, metrics, reason", [
    (_surgical, {"labeled_mask": [1, 1]}, {}, "has shape (2,), the head has 3 classes"),
    (_surgical, {"labeled_mask": ["a", "b", "c"]}, {}, "could not convert"),
    (_surgical, {"labeled_mask": [1, 1, 1]}, {}, "differs from the label summary the site declared"),
    (_surgical, {"head_name": "feat"}, {}, "names no head of the global model"),
    (_tdma, {"annotated": [10, 1e12, 0]}, {}, "differs from the label summary the site declared"),
    (_tdma, {"annotated": [10, float("nan"), 0]}, {}, "not finite and >= 0"),
    (_tdma, {"annotated": [10, -5, 0]}, {}, "not finite and >= 0"),
    (_fedmix, {}, {"train_loss": "low"}, "train_loss='low' is not a Dice loss in [0, 1]"),
    (_fedmix, {}, {"train_loss": float("nan")}, "is not a Dice loss in [0, 1]"),
    (_fedmix, {}, {"train_loss": -1.0}, "is not a Dice loss in [0, 1]"),
    (_fedmix, {}, {"train_loss": 1e6}, "train_loss='1000000.0' is not a Dice loss in [0, 1]"),  # would take ~0.91
])
def test_rules_drop_a_site_whose_meta_or_metrics_they_cannot_use(make, meta, metrics, reason):
    """Surgical / FedPSL read per-class weights from the site's meta, FedMix its train_loss: a bad one
    is the site's fault, dropped with the rule's reason; the other sites aggregate as if it never came."""
    server = make()
    server.setup({s: dict(SUMMARY) for s in "ABC"})
    eng, _ = engine({"A": headed("A", 1.0), "B": headed("B", 100.0, meta, metrics), "C": headed("C", 3.0)},
                    server=server)
    out, record, _ = eng.run_round(0, HEADED, ["A", "B", "C"])
    assert reason in record["dropped"].get("B", ""), (record["dropped"], eng.logs)
    assert list(record["dropped"]) == ["B"] and record["aggregated"]
    clean = make()
    clean.setup({s: dict(SUMMARY) for s in "ABC"})
    ref, _ = engine({"A": headed("A", 1.0), "C": headed("C", 3.0)}, server=clean)
    expected, _, _ = ref.run_round(0, HEADED, ["A", "C"])
    for k in HEADED:
        np.testing.assert_allclose(out[k], expected[k], err_msg=k)


def test_the_final_evaluation_ignores_scores_that_are_not_finite_numbers():
    """The final model's scores come from the sites too: text, NaN or inf never become the best."""
    eng, _ = engine({"A": upd("A", 1, [1, 1], metrics={KEY: 0.5}), "B": upd("B", 1, [1, 1], metrics={KEY: 0.5})})
    eng.run_round(0, GLOBAL, ["A", "B"])
    assert eng.score_final({"A": "0.99", "B": float("inf")}, rounds=1) == (None, False)
    assert eng.score_final({"A": float("nan"), "B": 0.7}, rounds=1) == (pytest.approx(0.7), True)
    assert eng.best_scores == {"B": 0.7} and eng.best_round == 1


# ------------------------------------------------------------------ what a deployment bounds


def test_a_score_outside_its_range_is_not_scored():
    eng, _ = engine({"A": upd("A", 1, [1, 2], metrics={KEY: 1e9}), "B": upd("B", 1, [1, 2], metrics={KEY: 0.7})})
    _, record, best = eng.run_round(0, GLOBAL, ["A", "B"])
    assert record["scored_by"] == ["B"] and eng.best == pytest.approx(0.7)
    assert any("val_auroc=1000000000.0 is not in [0, 1]: not scored" in msg for _, msg in eng.logs)
    assert eng.score_final({"A": 5.0, "B": 0.9}) == (pytest.approx(0.9), True)  # A's 5.0 is no AUROC
    assert in_range("val_loss", 7.5) and not in_range("val_loss", float("inf"))  # an unbounded metric


def test_an_update_whose_norm_strays_tenfold_is_dropped_in_a_deployment():
    """Received w = [3, 4] (norm 5). A: norm 5.1 (ratio 1.02), B: 4.9, C scaled 100x (ratio ~100): C strays
    from the received model and from the median of [1.02, 0.98, 100, 1] = 1.01; FedAvg of A and B only."""
    start = {"w": np.array([3.0, 4.0], dtype=np.float32), "nbt": np.array(0, dtype=np.int64)}
    answers = {"A": upd("A", 1, [3.06, 4.08]), "B": upd("B", 1, [2.94, 3.92]), "C": upd("C", 1, [300.0, 400.0])}
    eng, _ = engine(answers, norm_ratio=NORM_RATIO)
    out, record, _ = eng.run_round(0, start, ["A", "B", "C"])
    assert sorted(record["dropped"]) == ["C"] and "weight norm 100 x the received model's" in record["dropped"]["C"]
    np.testing.assert_allclose(out["w"], [3.0, 4.0], rtol=1e-6)  # the mean of A and B
    zeroed = {**answers, "C": upd("C", 1, [0.0, 0.0])}  # shrinking to nothing strays too
    eng, _ = engine(zeroed, norm_ratio=NORM_RATIO)
    _, record, _ = eng.run_round(0, start, ["A", "B", "C"])
    assert "weight norm 0 x" in record["dropped"]["C"]
    eng, _ = engine(answers)  # in-process studies: no bound unless asked for
    _, record, _ = eng.run_round(0, start, ["A", "B", "C"])
    assert record["dropped"] == {}
    # two sites: the received model keeps the median honest (median of [1.02, 100, 1] = 1.02)
    eng, _ = engine({"A": answers["A"], "C": answers["C"]}, norm_ratio=NORM_RATIO)
    _, record, _ = eng.run_round(0, start, ["A", "C"])
    assert sorted(record["dropped"]) == ["C"]
    assert outsized([upd("A", 1, [5.0, 5.0])], GLOBAL) == []  # a zero received model: no ratio to judge by
