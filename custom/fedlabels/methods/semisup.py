"""Semi-supervised FL: fully labeled and fully unlabeled sites (docs/methods/isofed.md).

IsoFed (Saha et al., MICCAI 2023) and the baselines it is compared with:

* ``isofed``      -- isolated aggregation every round: the unlabeled sites
  train from the global model and are aggregated into W_u, then the labeled
  sites train from W_u and are aggregated into the new global model; an
  unlabeled site first adapts the received model with the
  information-maximisation loss (``pretrain``), then trains a mean teacher;
* ``isofed_nopt`` -- the same without that pretraining (the paper's "w/o PT");
* ``mt_wfedavg``  -- every site at once (labeled: cross-entropy, unlabeled:
  mean teacher), one dynamically weighted FedAvg;
* ``rscfed``      -- RSCFed (Liang et al., CVPR 2022): each round M random
  subsets of K sites, each aggregated with the distance weighting from the
  same start, the global model the mean of the subset models;
* ``wfedavg``     -- dynamically weighted FedAvg, supervised only (the
  paper's upper bound when every site is labeled: ``oracle:wfedavg`` in
  ``fedlabels bench``).

The server learns which sites are labeled from their label summaries before
round 0 (``labeled``: the site has at least one labeled training case).

Dynamically weighted FedAvg (IsoFed Eq. 2-3, RSCFed's rule) weighs site k by
n_k exp(-lambda ||W_k - W_avg||_2 / n_k). As in RSCFed's released code the
scale depends on the group: ``lambda_c`` when the group holds a labeled site
(RSCFed ``sup_scale``: options.py default 1, README run 100), ``lambda_unlabeled``
when it holds unlabeled sites only (RSCFed ``dist_scale``, 1e4).

What a site sends: the weights, n and its label summary (counts per class),
as every method here; nothing else.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from ..losses import consistency_mse, information_maximization, masked_cross_entropy, sharpen
from .aggregate import average_keys, distance_weights
from .base import START_GLOBAL, START_PREVIOUS, ClientRule, ServerRule, Step, StopRound, ema_update, frozen_copy


class SupervisedClient(ClientRule):
    """Cross-entropy over the site's labeled cases (unlabeled ones, -1, are left out)."""

    def loss(self, logits, labels):
        return masked_cross_entropy(logits, labels)


class SemiSupClient(SupervisedClient):
    """A labeled site trains with cross-entropy; an unlabeled site trains a mean teacher.

    Mean teacher (IsoFed Sec. 2.2): the teacher starts each round as the
    received model (after ``pretrain``); per step it sees the weak view
    (``image``), the student the strong view (``image_strong``); the loss is
    ``consistency_weight`` x ||Sharpen(p_teacher, temperature) - p_student||^2
    (summed over classes, averaged over cases); after each step the teacher
    moves by Eq. 1, W_t <- ema_alpha W_s + (1 - ema_alpha) W_t (RSCFed's
    decay 0.999 = ema_alpha 0.001). The student is what the site sends.

    ``pretrain`` (IsoFed Sec. 2.4): before the mean teacher, ``pretrain_epochs``
    passes over the weak views minimising the information-maximisation loss,
    all parameters, a fresh optimizer of the same kind each round, at
    ``pretrain_lr`` (None: the client's lr). The paper leaves open what the
    adapted model initialises and where it runs; both are options:
    ``pretrain_target`` "both" (default: the adapted model starts the teacher
    and the student) or "teacher" (the student starts from the received model);
    ``pretrain_sites`` "unlabeled" (default: the sites that have a teacher) or
    "all" (the abstract and Fig. 2: every client; a labeled site then trains
    its cross-entropy from the adapted model).

    ``lr_unlabeled`` (None: the client's ``lr``): the learning rate of an unlabeled site (RSCFed's
    released code trains labeled clients at ``--base_lr``, unlabeled ones at ``--unsup_lr``).
    ``consistency_rampup`` (local epochs; 0: off): the consistency weight is multiplied by
    min(1, t / consistency_rampup), t = round x epochs + the local epoch (0-based), the count of
    local epochs before this one -- RSCFed's ``LinearRampUp`` called with ``com_round * local_ep``
    and advanced once per local epoch (local_unsupervised.py).

    A non-finite teacher or student output stops the site's round with the reason.
    """

    def __init__(self, net, ctx, *, temperature=0.5, ema_alpha=0.001, consistency_weight=1.0, consistency_rampup=0,
                 lr_unlabeled=None, pretrain=False, pretrain_epochs=1, pretrain_lr=None, pretrain_target="both",
                 pretrain_sites="unlabeled", **kw):
        super().__init__(net, ctx, **kw)
        if lr_unlabeled is not None and not float(lr_unlabeled) > 0:
            raise ValueError(f"lr_unlabeled must be > 0 (or None: the client's lr), got {lr_unlabeled}")
        if not float(consistency_rampup) >= 0:
            raise ValueError(f"consistency_rampup must be >= 0 local epochs (0: off), got {consistency_rampup}")
        self.consistency_rampup = float(consistency_rampup)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0 <= ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in [0, 1], got {ema_alpha}")
        if pretrain and int(pretrain_epochs) < 1:
            raise ValueError(f"pretrain_epochs must be >= 1 with pretrain on, got {pretrain_epochs}")
        self.temperature, self.ema_alpha = float(temperature), float(ema_alpha)
        if pretrain_lr is not None and not float(pretrain_lr) > 0:
            raise ValueError(f"pretrain_lr must be > 0 (or None: the client's lr), got {pretrain_lr}")
        if pretrain_target not in ("both", "teacher"):
            raise ValueError(f"pretrain_target must be 'both' or 'teacher', got {pretrain_target!r}")
        if pretrain_sites not in ("unlabeled", "all"):
            raise ValueError(f"pretrain_sites must be 'unlabeled' or 'all', got {pretrain_sites!r}")
        self.consistency_weight, self.pretrain, self.pretrain_epochs = float(consistency_weight), bool(pretrain), int(pretrain_epochs)
        self.pretrain_lr = None if pretrain_lr is None else float(pretrain_lr)
        self.pretrain_target, self.pretrain_sites = pretrain_target, pretrain_sites
        self.labeled = bool(ctx.summary.get("labeled"))
        if not self.labeled and lr_unlabeled is not None:
            self.lr = float(lr_unlabeled)  # the unlabeled site's every optimizer (pretraining's default too)
        _strong_views(ctx, not self.labeled)  # a labeled site trains on the weak view only
        self.teacher = None
        self.round_stats = {}

    def begin_round(self, round, extras):
        self.round_stats = {}
        adapts = self.pretrain and (not self.labeled or self.pretrain_sites == "all")
        if self.labeled:
            if adapts:
                self.round_stats["pretrain_loss"] = self.adapt(self.net)
            return
        if adapts and self.pretrain_target == "teacher":  # adapt a copy: the student starts from the received model
            adapted = copy.deepcopy(self.net)
            self.round_stats["pretrain_loss"] = self.adapt(adapted)
            self.teacher = frozen_copy(adapted)
            return
        if adapts:
            self.round_stats["pretrain_loss"] = self.adapt(self.net)
        self.teacher = frozen_copy(self.net)

    def adapt(self, net) -> float:
        """Client-adaptive pretraining of ``net``: the information-maximisation loss on local images (weak views)."""
        opt = self.make_optimizer(net.parameters(), lr=self.pretrain_lr or self.lr)
        losses = []
        strong_was = _strong_views(self.ctx, False)
        try:
            for _ in range(self.pretrain_epochs):
                for batch in self.ctx.train:
                    logits = net(batch["image"].to(self.device))
                    _check(logits, "pretraining output")
                    loss = information_maximization(logits)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    losses.append(float(loss.detach()))
        finally:
            _strong_views(self.ctx, strong_was)
        return float(np.mean(losses)) if losses else float("nan")

    def train_step(self, batch):
        if self.labeled:
            return super().train_step(batch)
        weak, strong = batch["image"].to(self.device), batch["image_strong"].to(self.device)
        with torch.no_grad():
            t_logits = self.teacher(weak)
            _check(t_logits, "teacher output")
            target = sharpen(torch.softmax(t_logits, 1), self.temperature)
        s_logits = self.net(strong)
        _check(s_logits, "student output")
        loss = self.unlabeled_weight() * consistency_mse(target, torch.softmax(s_logits, 1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.update_teacher()
        return float(loss.detach())

    def unlabeled_weight(self) -> float:
        """The consistency weight of this local epoch: ``consistency_weight`` times the linear ramp."""
        if not self.consistency_rampup:
            return self.consistency_weight
        t = self.current_round * self.epochs + self.local_epoch
        return self.consistency_weight * min(1.0, t / self.consistency_rampup)

    def update_teacher(self):
        """Eq. 1 on parameters; buffers (if any) follow the student."""
        ema_update(self.teacher, self.net, self.ema_alpha)

    def make_update(self, n, metrics):
        return super().make_update(n, {**metrics, **self.round_stats})


def _strong_views(ctx, on: bool) -> bool:
    """Compute the strong view only where it is used (it costs as much as the training step on 28 px);
    returns the setting before."""
    dataset = getattr(ctx.train, "dataset", None)
    before = bool(getattr(dataset, "strong_on", False))
    if hasattr(dataset, "strong_on"):
        dataset.strong_on = on
    return before


def _check(logits, what):
    if not torch.isfinite(logits).all():
        raise StopRound(f"non-finite {what}")


class WeightedFedAvgServer(ServerRule):
    """One dynamically weighted FedAvg over every site (IsoFed Eq. 3).

    ``warmup_rounds`` (default 0, the papers): the first rounds train the
    labeled sites only. RSCFed's released code (README ``--resume
    --from_labeled``) starts its semi-supervised rounds at round 7 from a
    checkpoint trained on the labeled client; 7 warm-up rounds with the
    clients' optimizers kept (``reset_optimizer`` False) are that warm start
    (preset ``isofed_rscfed``, docs/methods/presets.md). Every semi-supervised rule
    here inherits it."""

    needs_labeled = True

    def __init__(self, lambda_c=1.0, lambda_unlabeled=1e4, labeled_multiplier=1.0, warmup_rounds=0):
        if lambda_c < 0 or lambda_unlabeled < 0:
            raise ValueError(f"lambda_c and lambda_unlabeled must be >= 0, got {lambda_c}, {lambda_unlabeled}")
        if labeled_multiplier <= 0:
            raise ValueError(f"labeled_multiplier must be > 0, got {labeled_multiplier}")
        self.lambda_c, self.lambda_unlabeled = float(lambda_c), float(lambda_unlabeled)
        self.labeled_multiplier = float(labeled_multiplier)
        if int(warmup_rounds) < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {warmup_rounds}")
        self.warmup_rounds = int(warmup_rounds)
        self.labeled = set()

    def warming_up(self, round, sites) -> list | None:
        """The warm-up plan (labeled sites only) while ``round < warmup_rounds``, else None."""
        if round >= self.warmup_rounds:
            return None
        return [Step(tuple(s for s in sites if s in self.labeled), START_GLOBAL, name="warmup")]

    def plan(self, round, sites):
        return self.warming_up(round, sites) or [Step(tuple(sites))]

    def setup(self, summaries):
        super().setup(summaries)
        self.labeled = {s for s, v in summaries.items() if v.get("labeled")}
        if self.needs_labeled and not self.labeled:
            raise ValueError(f"no site has a labeled training case ({sorted(summaries)} are all unlabeled); this "
                             "method needs at least one labeled site")
        if not set(summaries) - self.labeled:
            return [f"every site is labeled ({sorted(self.labeled)}): no unlabeled site, so this runs as the "
                    "labeled-only special case (dynamically weighted FedAvg of supervised sites)"]
        return [f"labeled sites {sorted(self.labeled)}, unlabeled sites {sorted(set(summaries) - self.labeled)}"]

    def weights(self, updates, global_weights) -> np.ndarray:
        has_labeled = any(u.site in self.labeled for u in updates)
        scale = self.lambda_c if has_labeled else self.lambda_unlabeled
        mult = [self.labeled_multiplier if u.site in self.labeled else 1.0 for u in updates]
        return distance_weights(updates, global_weights, scale, mult)

    def aggregate(self, updates, global_weights, round):
        return average_keys(updates, global_weights, self.weights(updates, global_weights))


class IsoFedServer(WeightedFedAvgServer):
    """Isolated aggregation: unlabeled group from the global model, then the labeled group from W_u."""

    def plan(self, round, sites):
        warm = self.warming_up(round, sites)
        if warm:
            return warm
        unlabeled = tuple(s for s in sites if s not in self.labeled)
        labeled = tuple(s for s in sites if s in self.labeled)
        steps = [Step(unlabeled, START_GLOBAL, name="unlabeled")] if unlabeled else []
        if labeled:
            steps.append(Step(labeled, START_PREVIOUS if unlabeled else START_GLOBAL, name="labeled"))
        return steps


class RSCFedServer(WeightedFedAvgServer):
    """M random subsets of K sites a round (``subsets``, ``subset_size``), drawn
    from (``seed``, round) so a resumed run draws the same; a site may be in
    several subsets (it trains once per subset, each its own draw)."""

    def __init__(self, subsets=3, subset_size=3, seed=0, **kw):
        super().__init__(**kw)
        if int(subsets) < 1 or int(subset_size) < 1:
            raise ValueError(f"subsets and subset_size must be >= 1, got {subsets}, {subset_size}")
        self.subsets, self.subset_size, self.seed = int(subsets), int(subset_size), int(seed)

    @property
    def sites_needed(self) -> int:  # a subset holds distinct sites
        return self.subset_size

    def setup(self, summaries):
        if self.subset_size > len(summaries):
            raise ValueError(f"subset_size={self.subset_size} is larger than the number of sites ({len(summaries)}: "
                             f"{sorted(summaries)}); RSCFed samples subsets of distinct sites")
        return super().setup(summaries)

    def draw(self, round, sites) -> tuple:
        rng = np.random.default_rng([self.seed, round])
        ordered = sorted(sites)
        return tuple(tuple(ordered[i] for i in sorted(rng.choice(len(ordered), self.subset_size, replace=False)))
                     for _ in range(self.subsets))

    def plan(self, round, sites):
        warm = self.warming_up(round, sites)
        if warm:
            return warm
        if self.subset_size > len(sites):
            raise ValueError(f"subset_size={self.subset_size} is larger than the {len(sites)} sites of round {round}")
        groups = self.draw(round, sites)
        members = tuple(s for s in sorted(sites) if any(s in g for g in groups))
        return [Step(members, START_GLOBAL, groups=groups, name="subsets")]


def _register():
    from . import WITHOUT_LABELS, Method, register

    mc = ("multiclass",)
    # a site annotating some classes of a multi-class task has cases with no label it could take
    semi = {"partial_site": None, "unlabeled_site": WITHOUT_LABELS, "needs_full_site": True}
    register(Method("isofed", SemiSupClient, IsoFedServer, mc, {"pretrain": True}, uses_unlabeled=True, **semi,
                    strong_view=True, doc="IsoFed: isolated aggregation, mean teacher after client-adaptive pretraining"))
    register(Method("isofed_nopt", SemiSupClient, IsoFedServer, mc, {"pretrain": False}, uses_unlabeled=True, **semi,
                    strong_view=True, doc="IsoFed without client-adaptive pretraining (the paper's w/o PT)"))
    register(Method("mt_wfedavg", SemiSupClient, WeightedFedAvgServer, mc, {"pretrain": False}, uses_unlabeled=True, **semi,
                    strong_view=True, doc="every site at once (labeled: cross-entropy, unlabeled: mean teacher), wFedAvg"))
    register(Method("rscfed", SemiSupClient, RSCFedServer, mc, {"pretrain": False}, uses_unlabeled=True, **semi,
                    strong_view=True, doc="RSCFed: random subsets, distance-weighted, mean of the subset models"))
    register(Method("wfedavg", SupervisedClient, WeightedFedAvgServer, mc, partial_site=None, needs_full_site=True,
                    doc="dynamically weighted FedAvg of the labeled sites (upper bound: oracle:wfedavg)"))


_register()
