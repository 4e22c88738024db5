"""The round engine: one FLARE-free owner of a federated round.

Per round it asks the server rule for its plan, sends each step's start
model (and the rule's extras) through a ``send`` function, screens what comes
back (faults are dropped with a reason; an abstention is weight 0, not a
fault), aggregates through an ``aggregate`` hook, refuses a non-finite
result, applies ``min_sites``, tracks the best model on site validation and
writes the round's record. The nvflare controller supplies ``send``
(``send_model_and_wait``) and an ``aggregate`` hook that goes through
``BaseFedAvg.aggregate`` so nvflare's aggregation events fire; the in-process
loop (``references.federate``) supplies direct calls. Both therefore compute
the same global weights.

``send(step, sites, weights, round, extras) -> list[Update]``: one update per
site that answered (a crashed site is simply missing). ``Update.n`` is None
when a site sent no case count.
"""

from __future__ import annotations

import numpy as np

from .methods.base import DRAW, START_PREVIOUS, Update


class NoProgress(RuntimeError):
    """No round of the run aggregated anything."""


def screen_update(update: Update, reference: dict, extra_shapes: dict | None = None) -> str | None:
    """Why an update must be dropped, or None when it is usable."""
    if update.n is None:
        return "no case count (meta 'n'): an update is never weighted by a guess"
    if isinstance(update.n, bool) or not isinstance(update.n, (int, np.integer)) or update.n <= 0:
        return f"case count {update.n!r} is not a positive integer (a site with nothing to train on abstains)"
    if not update.weights:
        return "empty update"
    unknown = sorted(set(update.weights) - set(reference))
    if unknown:
        return f"unknown keys {unknown[:3]}"
    for key, value in update.weights.items():
        arr = np.asarray(value)
        if arr.shape != np.shape(reference[key]):
            return f"shape of {key} is {arr.shape}, expected {np.shape(reference[key])}"
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"non-finite values in {key}"
    for key, value in (update.extras or {}).items():
        arr = np.asarray(value)
        if extra_shapes and key in extra_shapes and arr.shape != tuple(extra_shapes[key]):
            return f"shape of extra {key!r} is {arr.shape}, expected {tuple(extra_shapes[key])}"
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
            return f"non-finite values in extra {key!r}"
    return None


def finite(weights: dict) -> bool:
    return all(np.isfinite(np.asarray(v)).all() for v in weights.values() if np.asarray(v).dtype.kind == "f")


def _direct(updates, fn):
    return fn()


class RoundEngine:
    """Runs rounds of one server rule. ``log(level, message)``; levels "info", "warning"."""

    def __init__(self, server, send, *, key_metric: str, min_sites: int = 1, aggregate=_direct, log=None):
        if min_sites < 1:
            raise ValueError(f"min_sites must be >= 1, got {min_sites}")
        self.server, self.send, self.aggregate_hook = server, send, aggregate
        self.key_metric, self.min_sites = key_metric, min_sites
        self.log = log or (lambda level, msg: None)
        self.best, self.scorers, self.aggregated_rounds = None, None, 0

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"server": self.server.state_dict(), "best": self.best,
                "scorers": self.scorers, "aggregated_rounds": self.aggregated_rounds}

    def load_state_dict(self, state: dict) -> None:
        self.server.load_state_dict(state["server"])
        self.best, self.scorers = state["best"], state["scorers"]
        self.aggregated_rounds = state["aggregated_rounds"]

    # ---------------------------------------------------------------- round
    def run_round(self, rnd: int, weights: dict, sites: list) -> tuple:
        """One round from ``weights``. Returns (new weights, record, best) where ``best``
        is the model the scoring sites validated when it is the best so far, else None.
        That model is the one they received: ``weights``, or a step's start
        within the round (IsoFed's labeled sites receive W_u)."""
        record = {"round": rnd, "sites": {}, "dropped": {}, "abstained": [], "steps": []}
        scores, scored = {}, {}
        start, previous = weights, weights
        for step in self.server.plan(rnd, list(sites)):
            origin = previous if step.start == START_PREVIOUS else start
            if step.groups:
                results = [self._train(step, list(g), origin, rnd, record, scores, scored, draw)
                           for draw, g in enumerate(step.groups)]
                results = [r for r in results if r is not None]
                new = self.server.combine(results, origin, rnd, step) if results else None
            else:
                new = self._train(step, list(step.sites), origin, rnd, record, scores, scored)
            if new is not None and not finite(new):
                self.log("warning", f"round {rnd} step {step.name}: the aggregate is not finite; model kept")
                new = None
            record["steps"].append({"name": step.name, "sites": list(step.sites), "aggregated": new is not None})
            previous = origin if new is None else new
        record["aggregated"] = any(s["aggregated"] for s in record["steps"])
        self.aggregated_rounds += record["aggregated"]
        record[f"mean_{self.key_metric}"] = score = self._score(rnd, scores)
        models = list({id(m): m for m in scored.values()}.values())
        if score is not None and len(models) > 1:
            self.log("warning", f"round {rnd}: the scoring sites validated different models (steps from different "
                                "starts); the round is not a best-model candidate")
            return previous, record, None
        if score is None or (self.best is not None and score <= self.best):
            return previous, record, None
        self.best = score
        return previous, record, models[0]

    def _train(self, step, targets, weights, rnd, record, scores, scored, draw=None):
        """Send one group, screen, aggregate; None when nothing was aggregated."""
        extras = self.server.extras(rnd, step)
        if draw is not None:  # a site may train in several groups of a step: each is its own draw
            extras = {**extras, DRAW: draw}
        updates = self.send(step, targets, weights, rnd, extras)
        usable = []
        for u in updates:
            if self.key_metric in u.metrics:  # the site's score of the model it received (``weights``)
                scores[u.site], scored[u.site] = float(u.metrics[self.key_metric]), weights
            record["sites"].setdefault(u.site, {}).update({"n": u.n, **u.metrics})
            if u.abstain and u.reason:
                record["dropped"][u.site] = u.reason
                self.log("warning", f"round {rnd} {u.site}: stopped its round: {u.reason}")
                continue
            if u.abstain:
                record["abstained"].append(u.site)
                self.log("info", f"round {rnd} {u.site}: abstains from step {step.name}")
                continue
            why = screen_update(u, weights, self.server.extra_shapes(rnd, step))
            if why:
                record["dropped"][u.site] = why
                self.log("warning", f"round {rnd} {u.site}: update dropped: {why}")
                continue
            usable.append(u)
        for site in sorted(set(targets) - {u.site for u in updates}):
            record["dropped"][site] = "no result (the site failed)"
            self.log("warning", f"round {rnd} {site}: update dropped: no result (the site failed)")
        if not usable:
            if updates and all(u.abstain for u in updates):
                self.log("info", f"round {rnd} step {step.name}: every site abstained; model kept")
            else:
                self.log("warning", f"round {rnd} step {step.name}: no usable update; model kept")
            return None
        if len(usable) < self.min_sites:
            self.log("warning", f"round {rnd} step {step.name}: {len(usable)} usable update(s) < "
                                f"min_sites={self.min_sites}; model kept")
            return None
        new = self.aggregate_hook(usable, lambda: self.server.aggregate(usable, dict(weights), rnd))
        for note in self.server.take_notes():
            record.setdefault("notes", []).append(note)
            self.log("warning", f"round {rnd} step {step.name}: {note}")
        return new

    def _score(self, rnd, scores: dict):
        """Mean key metric of the received model over the same sites every round, or None."""
        if not scores:
            return None
        if self.scorers is None:
            self.scorers = sorted(scores)
        missing = sorted(set(self.scorers) - set(scores))
        if missing:
            self.log("warning", f"round {rnd}: {missing} reported no {self.key_metric}; the round is not a "
                                "best-model candidate")
            return None
        return float(np.mean([scores[s] for s in self.scorers]))

    def score_final(self, scores: dict):
        """The final model's mean key metric over the scoring sites; True when it beats the best."""
        score = self._score("final", scores)
        is_best = score is not None and (self.best is None or score > self.best)
        if is_best:
            self.best = score
        return score, is_best

    def check_progress(self) -> None:
        if self.aggregated_rounds == 0:
            raise NoProgress("no round aggregated any update (every update was dropped or abstained, or "
                             "min_sites was never reached): the global model is the initial one")
