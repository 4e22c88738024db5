"""The composed method (the project's ``composed`` row, docs/methods/composed.md) in plain PyTorch and NumPy: no
fedlabels, no MONAI.

No paper prints this method: it is the project's composition of three papers' rules, each where a site's labels
call for it. This reference is written from that page and the papers it cites, reusing the independent pieces of
``rscfed_pl`` (the site's rule) and ``surgical`` (the class-wise head):

* every site trains the BCE of the weak view over the entries it annotates plus ``consistency_weight`` x the mean
  squared difference between the student's sigmoid on the strong view and a mean teacher's on the weak view over
  the entries it does not annotate (``rscfed_pl.Site``: the teacher is the received model, moved by EMA after
  every step); a site annotating nothing trains the teacher term on every entry, and sits out when the weight is 0;
* ``isolate`` (IsoFed's isolated aggregation): when some sites annotate nothing and some something, the former
  train from the global model and are averaged, every tensor by case counts, into W_u; the latter train from W_u;
  otherwise every site trains from the global model in one step;
* the step of the annotating sites is aggregated with ``classwise_head`` (Surgical Aggregation, Eq. 2:
  ``surgical.aggregate``): every tensor but the head's by case counts over the step's sites; head row c (weight
  row and bias entry) the unweighted mean of the rows of the step's sites annotating c, a class none of them
  annotates keeping the step's starting row; off, every tensor by case counts. A step of sites annotating nothing
  averages every tensor by case counts.

Settings (``PAPER``): FedMLP's values for every comparison method and RSCFed's released code's (those of
``rscfed_pl``), the page's defaults for the two parts that are this project's own.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from . import fedavg_multilabel, partial_fedavg, rscfed_pl, semisup, surgical

PAPER = {**{key: rscfed_pl.PAPER[key] for key in ("lr", "batch_size", "epochs", "rounds", "weight_decay",
                                                 "carry_optimizer", "pos_weight", "consistency_weight", "ema_alpha")},
         "isolate": (True, "docs/methods/composed.md: IsoFed's isolated step for the sites annotating nothing"),
         "classwise_head": (True, "docs/methods/composed.md: Surgical Aggregation's Eq. 2 over the annotating sites")}
CHECK = {key: value for key, (value, _) in PAPER.items() if key != "rounds"}
LEFT_OUT = {key: value for key, value in rscfed_pl.LEFT_OUT.items()
            if key not in ("unannotated_site", "w_mul_times", "clip", "ema_warmup")}


def head_mask(y: torch.Tensor) -> list:
    """Per class: the site annotates it (some case's label is not -1)."""
    return [bool(v) for v in (y >= 0).any(0).tolist()]


def _torch(state: dict, like: dict) -> dict:
    return {k: torch.as_tensor(np.asarray(v)).to(like[k].dtype) for k, v in state.items()}


def one_round(sites: list, weights: dict, s: dict, gen, views, head: str = "fc") -> dict:
    """One round from the global ``weights`` (``rscfed_pl.Site`` objects): the new global weights."""
    teaching = s["consistency_weight"] > 0
    unlabeled = [t for t in sites if not t.annotated and teaching]
    labeled = [t for t in sites if t.annotated]

    def by_counts(members, start):
        states = [t.train(start, s, gen, views) for t in members]
        return semisup.mean_state(states, [t.n for t in members])

    def step(members, start):
        if not any(t.annotated for t in members) or not s["classwise_head"]:
            return by_counts(members, start)
        states = [t.train(start, s, gen, views) for t in members]
        out = surgical.aggregate([{k: v.numpy() for k, v in st.items()} for st in states],
                                 [head_mask(t.y) if t.annotated else [False] * t.y.shape[1] for t in members],
                                 {k: v.numpy() for k, v in start.items()}, head, weights=[t.n for t in members])
        return _torch(out, start)

    if s["isolate"] and unlabeled and labeled:
        return step(labeled, by_counts(unlabeled, weights))
    return step(unlabeled + labeled, weights)


def run(data, rounds: int, eval_rounds, seed: int = 0, widen: float = 0.25, scaling: str = "fixed",
        grey: str = "mean", log=print, **settings) -> dict:
    """The composed method over a prepared scenario (label -1: not annotated; a site may annotate nothing). Test
    metric: the mean one-vs-rest AUROC of the global model on the pooled test split."""
    s = {**CHECK, **settings}
    unknown = set(settings) - set(CHECK)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; settings: {sorted(CHECK)}")
    classes, raw, test = fedavg_multilabel.load_scenario(Path(data), scaling, grey_rule=grey, keep_unannotated=True)
    if not any(bool((y >= 0).any()) for _, y in raw):
        raise ValueError(f"{data}: no site annotates any class")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    def make_net():
        return fedavg_multilabel.ResNet18(1, len(classes), widen)

    global_net = make_net()
    weights = {k: v.clone() for k, v in global_net.state_dict().items()}
    sites = [rscfed_pl.Site(x, y, make_net, partial_fedavg.class_weights(y, s["pos_weight"])) for x, y in raw]
    out, seconds = {}, []
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        weights = one_round(sites, weights, s, gen, rscfed_pl.weak_and_strong)
        seconds.append(time.perf_counter() - t0)
        if rnd in eval_rounds:
            global_net.load_state_dict(weights)
            out[rnd] = {"auroc": fedavg_multilabel.macro_auroc(global_net, *test)}
            log(f"[reference] composed seed {seed} round {rnd}: {out[rnd]}")
    return {"metrics": out, "seconds_per_round": float(np.mean(seconds)), "seconds": seconds}
