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


def screen_update(update: Update, reference: dict, extra_shapes: dict | None = None,
                  max_n: int | None = None) -> str | None:
    """Why an update must be dropped, or None when it is usable.

    Everything here came from a site and may be broken or hostile: the case count
    must be a positive integer no larger than ``max_n`` (what the site declared at
    the handshake: an unbounded count would let one site outweigh all others),
    the weights a mapping of the global model's own keys, shapes and dtypes (a
    string or object array of the right shape would pass a float-only check and
    fail in aggregation; another float dtype would silently change the global
    model's), finite; extras a mapping of finite numbers (or, for a rule that
    reads nested content and checks it itself, mappings)."""
    n = update.n
    if n is None:
        return "no case count (meta 'n'): an update is never weighted by a guess"
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
        return f"case count {_short(n)} is not a positive integer (a site with nothing to train on abstains)"
    if max_n is not None and n > max_n:
        return (f"case count {int(n)} exceeds the {max_n} the site can train on (its declared cases at the "
                "handshake)")
    if not isinstance(update.weights, dict):
        return f"weights are a {type(update.weights).__name__}, not a mapping of arrays"
    if not update.weights:
        return "empty update"
    unknown = sorted(map(str, set(update.weights) - set(reference)))
    if unknown:
        return f"unknown keys {unknown[:3]}"
    for key, value in update.weights.items():
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as e:
            return f"{key} is not an array ({_short(e)})"
        want = np.asarray(reference[key])
        if arr.shape != want.shape:
            return f"shape of {key} is {arr.shape}, expected {want.shape}"
        if arr.dtype != want.dtype:
            return f"dtype of {key} is {arr.dtype}, the global model's is {want.dtype}"
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"non-finite values in {key}"
    extras = update.extras if update.extras is not None else {}
    if not isinstance(extras, dict):
        return f"extras are a {type(extras).__name__}, not a mapping"
    for key, value in extras.items():
        if isinstance(value, dict) and not (extra_shapes and key in extra_shapes):
            continue  # nested content (FedMLP's prototypes): the rule checks it (ServerRule.screen)
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as e:
            return f"extra {key!r} is not an array ({_short(e)})"
        if extra_shapes and key in extra_shapes and arr.shape != tuple(extra_shapes[key]):
            return f"shape of extra {key!r} is {arr.shape}, expected {tuple(extra_shapes[key])}"
        if arr.dtype.kind not in "biuf":
            return f"extra {key!r} is not numeric (dtype {arr.dtype})"
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"non-finite values in extra {key!r}"
    return None


def clean_metrics(metrics) -> tuple:
    """(the numeric metrics of a site's reply as floats, what was left out and why). A site's metrics
    go into the round record (JSON, TensorBoard) and its key metric into the best-model score: a
    value that is not a number is left out there, never passed on."""
    if not isinstance(metrics, dict):
        return {}, [f"metrics are a {type(metrics).__name__}, not a mapping"]
    out, left = {}, []
    for key, value in metrics.items():
        if isinstance(key, str) and isinstance(value, (int, float, np.integer, np.floating)) \
                and not isinstance(value, (bool, np.bool_)):
            out[key] = float(value)
        else:
            left.append(f"metric {_short(key)}={_short(value)} is not a number")
    return out, left


def _short(value, limit: int = 60) -> str:
    """A site-sent value as it may appear in a log line: repr, cut short."""
    try:
        text = repr(value)
    except Exception:  # a hostile object's __repr__
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


# What a server rule's aggregation may raise on what sites sent (a rule's check it
# did not declare in ``screen``): the step keeps its model, the job goes on.
RULE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError)


# Validation metrics that lie in [0, 1]: a site's score outside that range is not a score (one that reported
# 1e9 would pin the best model).
UNIT_METRICS = ("val_auroc", "val_accuracy", "val_dice", "val_ap", "val_bacc")
# How far an update's weight norm may stray from the others' (the median over the step's usable updates and
# the model they received, each update's keys against the received model's same keys): a scaled or zeroed
# update is dropped. Honest training moves the weights' norm by a few percent a round, never tenfold.
NORM_RATIO = 10.0


def in_range(name: str, value: float) -> bool:
    return bool(np.isfinite(value)) and (name not in UNIT_METRICS or 0.0 <= value <= 1.0)


def norm_ratio(update_weights: dict, received: dict) -> float | None:
    """||update|| / ||received|| over the float keys the update sent; None when the received model's are 0."""
    keys = [k for k, v in update_weights.items() if np.asarray(v).dtype.kind == "f"]
    mine = np.sqrt(sum(float(np.sum(np.square(np.asarray(update_weights[k], dtype=np.float64)))) for k in keys))
    theirs = np.sqrt(sum(float(np.sum(np.square(np.asarray(received[k], dtype=np.float64)))) for k in keys))
    return mine / theirs if theirs > 0 else None


def outsized(updates: list, received: dict, limit: float | None = NORM_RATIO) -> list:
    """[(update, reason)] for each update whose weight norm strays more than ``limit`` times from the model
    it received or from the median of the step's norms (the received model's counted as one). None: no bound."""
    ratios = [norm_ratio(u.weights, received) for u in updates] if limit else []
    judged = [(u, r) for u, r in zip(updates, ratios) if r is not None]
    if not judged:
        return []
    median = float(np.median([r for _, r in judged] + [1.0]))
    return [(u, f"weight norm {r:.3g} x the received model's (the step's median {median:.3g}): more than "
                f"{limit:g}x apart") for u, r in judged
            if not all(ref / limit <= r <= ref * limit for ref in (1.0, median))]


def finite(weights: dict) -> bool:
    return all(np.isfinite(np.asarray(v)).all() for v in weights.values() if np.asarray(v).dtype.kind == "f")


def _direct(updates, fn):
    return fn()


class RoundEngine:
    """Runs rounds of one server rule. ``log(level, message)``; levels "info", "warning".

    ``max_n``: per site, the largest case count an update may carry (the cases it declared at the
    handshake; an update counts the cases of one local epoch); a site not in it is not bounded. ``norm_ratio``: how many times its
    weight norm may stray from the received model's and the step's median (``outsized``; the FLARE
    controller sets ``NORM_RATIO``, where sites are other parties)."""

    def __init__(self, server, send, *, key_metric: str, min_sites: int = 1, aggregate=_direct, log=None,
                 max_n: dict | None = None, norm_ratio: float | None = None):
        if min_sites < 1:
            raise ValueError(f"min_sites must be >= 1, got {min_sites}")
        self.server, self.send, self.aggregate_hook = server, send, aggregate
        self.key_metric, self.min_sites = key_metric, min_sites
        self.federation = min_sites  # the number of sites of the round being run (``run_round``)
        self.max_n = dict(max_n or {})
        self.norm_ratio = norm_ratio  # a deployment's bound on an update's weight norm (``outsized``); None: none
        self.log = log or (lambda level, msg: None)
        self.best, self.scorers, self.aggregated_rounds = None, None, 0
        # The best model's per-site scores and the round whose sites validated it (the model they
        # received at its start; "final" rounds = the number of rounds): a later round is compared
        # with it over the sites both have scores from, so losing a site never ends best-model tracking.
        self.best_scores, self.best_round = {}, None

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"server": self.server.state_dict(), "best": self.best, "scorers": self.scorers,
                "aggregated_rounds": self.aggregated_rounds, "best_scores": self.best_scores,
                "best_round": self.best_round}

    def load_state_dict(self, state: dict) -> None:
        self.server.load_state_dict(state["server"])
        self.best, self.scorers = state["best"], state["scorers"]
        self.aggregated_rounds = state["aggregated_rounds"]
        # state saved before these were kept: the best's sites are the scorers (it had all of them)
        self.best_scores = dict(state.get("best_scores") or ({s: self.best for s in self.scorers or []}
                                                             if self.best is not None else {}))
        self.best_round = state.get("best_round")

    # ---------------------------------------------------------------- round
    def run_round(self, rnd: int, weights: dict, sites: list) -> tuple:
        """One round from ``weights``. Returns (new weights, record, best) where ``best``
        is the model the scoring sites validated when it is the best so far, else None.
        That model is the one they received: ``weights``, or a step's start
        within the round (IsoFed's labeled sites receive W_u)."""
        self.federation = len(sites)  # what min_sites is counted against (``_train``)
        record = {"round": rnd, "sites": {}, "dropped": {}, "abstained": [], "steps": []}
        scores, scored = {}, {}
        start, previous = weights, weights
        for step in self.server.plan(rnd, list(sites)):
            origin = previous if step.start == START_PREVIOUS else start
            if step.groups:
                results = [self._train(step, list(g), origin, rnd, record, scores, scored, draw)
                           for draw, g in enumerate(step.groups)]
                results = [r for r in results if r is not None]
                new = self._rule(rnd, step, lambda: self.server.combine(results, origin, rnd, step)) if results \
                    else None
            else:
                new = self._train(step, list(step.sites), origin, rnd, record, scores, scored)
            if new is not None and not finite(new):
                self.log("warning", f"round {rnd} step {step.name}: the aggregate is not finite; model kept")
                new = None
            record["steps"].append({"name": step.name, "sites": list(step.sites), "aggregated": new is not None})
            previous = origin if new is None else new
        record["aggregated"] = any(s["aggregated"] for s in record["steps"])
        self.aggregated_rounds += record["aggregated"]
        score, present = self._score(rnd, scores)
        record[f"mean_{self.key_metric}"] = score
        record["scored_by"] = present
        models = list({id(m): m for m in scored.values()}.values())
        if score is not None and len(models) > 1:
            self.log("warning", f"round {rnd}: the scoring sites validated different models (steps from different "
                                "starts); the round is not a best-model candidate")
            return previous, record, None
        if not self._better(rnd, scores, present):
            return previous, record, None
        return previous, record, models[0]

    def _rule(self, rnd, step, fn):
        """A server rule's aggregation; None (model kept, logged) when it fails on what the sites sent."""
        try:
            return fn()
        except RULE_ERRORS as e:
            self.log("warning", f"round {rnd} step {step.name}: aggregation failed on the sites' updates "
                                f"({type(e).__name__}: {_short(e, 200)}); model kept")
            return None

    def _train(self, step, targets, weights, rnd, record, scores, scored, draw=None):
        """Send one group, screen, aggregate; None when nothing was aggregated."""
        extras = self.server.extras(rnd, step)
        if draw is not None:  # a site may train in several groups of a step: each is its own draw
            extras = {**extras, DRAW: draw}
        updates = self.send(step, targets, weights, rnd, extras)
        usable = []
        for u in updates:
            metrics, left = clean_metrics(u.metrics)
            for why in left:
                self.log("warning", f"round {rnd} {u.site}: {why}: left out of the record")
            value = metrics.get(self.key_metric)
            if value is not None and in_range(self.key_metric, value):  # its score of the model it received
                scores[u.site], scored[u.site] = value, weights
            elif value is not None:
                self.log("warning", f"round {rnd} {u.site}: {self.key_metric}={value} is not "
                                    f"{'finite' if not np.isfinite(value) else 'in [0, 1]'}: not scored")
            valid_n = isinstance(u.n, (int, np.integer)) and not isinstance(u.n, bool)
            record["sites"].setdefault(u.site, {}).update({"n": int(u.n) if valid_n else None, **metrics})
            if u.abstain and u.reason:
                record["dropped"][u.site] = str(u.reason)
                self.log("warning", f"round {rnd} {u.site}: stopped its round: {_short(u.reason, 300)}")
                continue
            if u.abstain:
                record["abstained"].append(u.site)
                self.log("info", f"round {rnd} {u.site}: abstains from step {step.name}")
                continue
            why = screen_update(u, weights, self.server.extra_shapes(rnd, step), self.max_n.get(u.site))
            if not why:
                try:
                    why = self.server.screen(u, weights, rnd, step)
                except RULE_ERRORS as e:
                    why = f"{type(e).__name__}: {_short(e, 200)}"
            if why:
                record["dropped"][u.site] = why
                self.log("warning", f"round {rnd} {u.site}: update dropped: {why}")
                continue
            usable.append(u)
        for u, why in outsized(usable, weights, self.norm_ratio):
            record["dropped"][u.site] = why
            self.log("warning", f"round {rnd} {u.site}: update dropped: {why}")
            usable.remove(u)
        for site in sorted(set(targets) - {u.site for u in updates}):
            record["dropped"][site] = "no result (the site failed or did not answer in time)"
            self.log("warning", f"round {rnd} {site}: update dropped: no result (the site failed or did not answer "
                                "in time)")
        if not usable:
            if updates and all(u.abstain for u in updates):
                self.log("info", f"round {rnd} step {step.name}: every site abstained; model kept")
            else:
                self.log("warning", f"round {rnd} step {step.name}: no usable update; model kept")
            return None
        # min_sites counts the federation's sites, but a step reaches only its targets, and a site that
        # abstains has nothing for this step: it is not missing. So the step needs every target that did
        # not abstain, less the sites the federation may lose (its size - min_sites).
        may_lose = max(0, self.federation - self.min_sites)
        expected = len(targets) - sum(1 for u in updates if u.abstain and not u.reason)
        needed = max(1, expected - may_lose)
        if len(usable) < needed:
            self.log("warning", f"round {rnd} step {step.name}: {len(usable)} usable update(s) of {expected} "
                                f"expected < {needed} (min_sites={self.min_sites} of {self.federation} sites: "
                                f"at most {may_lose} may be missing); model kept")
            return None
        new = self._rule(rnd, step, lambda: self.aggregate_hook(
            usable, lambda: self.server.aggregate(usable, dict(weights), rnd)))
        for note in self.server.take_notes():
            record.setdefault("notes", []).append(note)
            self.log("warning", f"round {rnd} step {step.name}: {note}")
        return new

    def _score(self, rnd, scores: dict) -> tuple:
        """(mean key metric of the received model over the scoring sites still reporting, those sites),
        or (None, []). The scoring sites are those that scored the first scored round; one that is
        lost (killed, dropped out, sent no finite score) leaves the mean to the others, logged."""
        if not scores:
            return None, []
        if self.scorers is None:
            self.scorers = sorted(scores)
        present = [s for s in self.scorers if s in scores]
        missing = sorted(set(self.scorers) - set(scores))
        if not present:
            self.log("warning", f"round {rnd}: none of the scoring sites {self.scorers} reported a finite "
                                f"{self.key_metric}; the round is not a best-model candidate")
            return None, []
        if missing:
            self.log("warning", f"round {rnd}: {missing} reported no finite {self.key_metric}; the round is scored "
                                f"over {present}")
        return float(np.mean([scores[s] for s in present])), present

    def _better(self, rnd, scores: dict, present: list) -> bool:
        """Whether the model ``present`` scored beats the best so far, compared over the sites both have
        scores from (the same sites on both sides: a mean over other sites is not comparable). True
        makes it the best."""
        if not present:
            return False
        common = [s for s in present if s in self.best_scores]
        if self.best_scores and common:
            if np.mean([scores[s] for s in common]) <= np.mean([self.best_scores[s] for s in common]):
                return False
        elif self.best_scores:
            self.log("warning", f"round {rnd}: no site that scored the best model (round {self.best_round}) "
                                f"scored this one; best-model tracking restarts over {present}")
        self.best_scores = {s: scores[s] for s in present}
        self.best = float(np.mean(list(self.best_scores.values())))
        self.best_round = rnd
        return True

    def score_final(self, scores: dict, rounds: int | None = None):
        """The final model's mean key metric over the scoring sites; True when it beats the best.
        ``rounds``: how many rounds the final model has been through (its ``best_round``)."""
        scores = {s: float(v) for s, v in scores.items() if _number(v) and in_range(self.key_metric, float(v))}
        score, present = self._score("final", scores)
        is_best = self._better(rounds if rounds is not None else "final", scores, present)
        return score, is_best

    def check_progress(self) -> None:
        if self.aggregated_rounds == 0:
            raise NoProgress("no round aggregated any update (every update was dropped or abstained, or "
                             "min_sites was never reached): the global model is the initial one")


def _number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
