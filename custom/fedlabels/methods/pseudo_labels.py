"""Partial-label baselines that learn a site's missing classes from a model's own outputs
(docs/methods/fedmlp.md, the baselines of its Tables 1-2).

Both train the annotated classes with the shared partial BCE (``partial_bce``,
pos-weighted like every multi-label row) and aggregate with FedAvg by n_k, so
each differs from ``fedavg_pl`` only in its term for the missing classes.

* ``fedfixmatch`` -- FixMatch (Sohn et al. 2020) on the missing classes of a
  multi-label site, as FedMLP's released code runs it: the model's own
  sigmoid on the weak view (``image``) gives hard pseudo labels (p > 0.5); a
  case contributes only when *every* missing class is confident (p >
  ``confidence`` or p < 1 - ``confidence``); the BCE of the strong view
  (``image_strong``) against those labels, over the missing entries of the
  confident cases, is added with weight ``lambda_u``.
* ``fednoro`` -- FedNoRo's second stage (Wu et al., IJCAI 2023) with every
  site noisy, as in FedMLP's comparison: the received global model, frozen,
  is the teacher; the loss is (1 - w) x partial BCE + w x the mean squared
  difference between the local sigmoid and the teacher's sigmoid at
  temperature ``temperature`` on the missing entries, with
  w = ``kd_weight`` x exp(-5 (1 - t)^2), t = (round - ``rampup_begin``) /
  (``rampup_end`` - ``rampup_begin``) clipped to [0, 1] (the released code's
  ramp). Its distance-aware aggregation is not used: with every site noisy
  it has no clean site to measure distances to (the released code calls
  plain FedAvg as well).
* ``rscfed_pl`` -- RSCFed (Liang et al., CVPR 2022) on partial labels, as
  FedMLP compares with it: the server is IsoFed's ``RSCFedServer`` (random
  subsets of sites, each distance-weighted from the same start, the global
  model the mean of the subset models); each site trains the partial BCE on
  its annotated entries and distils to a mean teacher on its missing ones:
  the teacher starts each round as the received model, sees the weak view,
  the student the strong view, the loss adds ``consistency_weight`` x the
  mean squared difference of their sigmoids over the missing entries, and
  the teacher follows the student by EMA after each step (``ema_alpha``,
  RSCFed's decay 0.999 = 0.001).

What a site sends: the model and its label summary, as FedAvg.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..losses import masked_mse, partial_bce
from .base import ClientRule, ema_update, frozen_copy
from .fedavg import FedAvgServer
from .semisup import RSCFedServer, _strong_views


def _multilabel(client, name):
    if client.profile.task != "multilabel":
        raise ValueError(f"{name} is for multi-label tasks, not {client.profile.task!r}")


def fixmatch_targets(probs, missing, confidence: float):
    """(hard pseudo labels, entry mask): entries of ``missing`` in cases whose missing entries are all
    confident (p > confidence or p < 1 - confidence). A case with no missing entry contributes nothing."""
    confident = (probs > confidence) | (probs < 1 - confidence)
    case_ok = (confident | ~missing).all(1) & missing.any(1)
    return (probs > 0.5).to(probs.dtype), missing & case_ok[:, None]


class FixMatchClient(ClientRule):
    """Partial BCE on the weak view + ``lambda_u`` x FixMatch on the missing classes."""

    def __init__(self, net, ctx, *, confidence=0.8, lambda_u=1.0, **kw):
        super().__init__(net, ctx, **kw)
        _multilabel(self, "FedFixMatch")
        if not 0.5 <= confidence < 1:
            raise ValueError(f"confidence must be in [0.5, 1), got {confidence}")
        if lambda_u < 0:
            raise ValueError(f"lambda_u must be >= 0, got {lambda_u}")
        self.confidence, self.lambda_u = float(confidence), float(lambda_u)
        _strong_views(ctx, True)
        self.confident = []

    def begin_round(self, round, extras):
        self.confident = []

    def train_step(self, batch):
        weak, y = batch["image"].to(self.device), batch["label"].to(self.device)
        logits = self.net(weak)
        loss = partial_bce(logits, y, pos_weight=self.pos_weight)
        missing = y < 0
        target, mask = fixmatch_targets(torch.sigmoid(logits.detach()), missing, self.confidence)
        self.confident.append(float(mask.any(1).float().mean()) if missing.any() else float("nan"))
        if mask.any() and self.lambda_u > 0:
            strong = self.net(batch["image_strong"].to(self.device))
            unsup = F.binary_cross_entropy_with_logits(strong, target, reduction="none")
            loss = loss + self.lambda_u * (unsup * mask).sum() / mask.sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def make_update(self, n, metrics):
        seen = [c for c in self.confident if not math.isnan(c)]
        extra = {"confident_fraction": sum(seen) / len(seen)} if seen else {}
        return super().make_update(n, {**metrics, **extra})


def rampup(round: int, begin: int, end: int) -> float:
    """exp(-5 (1 - t)^2), t = (round - begin) / (end - begin) clipped to [0, 1]."""
    t = min(max((round - begin) / max(end - begin, 1), 0.0), 1.0)
    return math.exp(-5.0 * (1.0 - t) ** 2)


def distillation_loss(logits, teacher_logits, missing, temperature: float):
    """Mean squared difference of sigmoid(logits) and sigmoid(teacher / T) over the ``missing`` entries."""
    return masked_mse(torch.sigmoid(logits), torch.sigmoid(teacher_logits / temperature), missing)


class NoRoClient(ClientRule):
    """(1 - w) partial BCE + w distillation to the received global model on the missing classes."""

    def __init__(self, net, ctx, *, kd_weight=0.8, temperature=0.8, rampup_begin=10, rampup_end=499, **kw):
        super().__init__(net, ctx, **kw)
        _multilabel(self, "FedNoRo")
        if not 0 <= kd_weight <= 1:
            raise ValueError(f"kd_weight must be in [0, 1], got {kd_weight}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if int(rampup_end) < int(rampup_begin):
            raise ValueError(f"rampup_end ({rampup_end}) must be >= rampup_begin ({rampup_begin})")
        self.kd_weight, self.temperature = float(kd_weight), float(temperature)
        self.begin, self.end = int(rampup_begin), int(rampup_end)
        self.teacher, self.w = None, 0.0

    def begin_round(self, round, extras):
        self.w = self.kd_weight * rampup(round, self.begin, self.end)
        self.teacher = frozen_copy(self.net)

    def train_step(self, batch):
        x, y = batch["image"].to(self.device), batch["label"].to(self.device)
        logits = self.net(x)
        loss = (1 - self.w) * partial_bce(logits, y, pos_weight=self.pos_weight)
        missing = (y < 0).to(logits.dtype)
        if self.w > 0 and missing.any():
            with torch.no_grad():
                teacher = self.teacher(x)
            loss = loss + self.w * distillation_loss(logits, teacher, missing, self.temperature)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def make_update(self, n, metrics):
        return super().make_update(n, {**metrics, "kd_weight": self.w})


class PartialMeanTeacherClient(ClientRule):
    """Partial BCE on the annotated entries + mean-teacher consistency on the missing ones."""

    def __init__(self, net, ctx, *, ema_alpha=0.001, consistency_weight=1.0, **kw):
        super().__init__(net, ctx, **kw)
        _multilabel(self, "RSCFed on partial labels")
        if not 0 <= ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in [0, 1], got {ema_alpha}")
        if consistency_weight < 0:
            raise ValueError(f"consistency_weight must be >= 0, got {consistency_weight}")
        self.ema_alpha, self.consistency_weight = float(ema_alpha), float(consistency_weight)
        _strong_views(ctx, True)
        self.teacher = None

    def begin_round(self, round, extras):
        self.teacher = frozen_copy(self.net)

    def train_step(self, batch):
        weak, y = batch["image"].to(self.device), batch["label"].to(self.device)
        loss = partial_bce(self.net(weak), y, pos_weight=self.pos_weight)
        missing = (y < 0).to(weak.dtype)
        if missing.any() and self.consistency_weight > 0:
            with torch.no_grad():
                target = torch.sigmoid(self.teacher(weak))
            student = torch.sigmoid(self.net(batch["image_strong"].to(self.device)))
            loss = loss + self.consistency_weight * masked_mse(student, target, missing)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        ema_update(self.teacher, self.net, self.ema_alpha)
        return float(loss.detach())


class PartialRSCFedServer(RSCFedServer):
    """IsoFed's RSCFed server; every site holds labels here, and its mean teacher covers the missing classes."""

    def setup(self, summaries):
        super().setup(summaries)
        return [f"RSCFed on partial labels: {self.subsets} random subsets of {self.subset_size} of the "
                f"{len(summaries)} sites each round, distance-weighted (lambda_c = {self.lambda_c})"]


def _register():
    from . import FROM_MODEL, Method, register

    ml = ("multilabel",)
    register(Method("fedfixmatch", FixMatchClient, FedAvgServer, ml, strong_view=True, partial_site=FROM_MODEL,
                    doc="FedFixMatch: confident weak-view pseudo labels on the missing classes, strong-view BCE"))
    register(Method("fednoro", NoRoClient, FedAvgServer, ml, partial_site=FROM_MODEL,
                    doc="FedNoRo stage 2: partial BCE + ramped distillation to the global model on missing classes"))
    register(Method("rscfed_pl", PartialMeanTeacherClient, PartialRSCFedServer, ml, strong_view=True,
                    partial_site=FROM_MODEL,
                    doc="RSCFed on partial labels: random distance-weighted subsets; mean teacher on missing classes"))


_register()
