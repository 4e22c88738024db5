"""FedMix (Wicaksana et al., IEEE TMI 2023): segmentation when sites hold pixel masks, boxes,
image-level tags or nothing, and its baselines FedAdaptAgg and FedST (docs/methods/fedmix.md).

Every training batch carries ``label`` (a site's mask, or its weak label rendered by the bundle's
``MaskLabeld`` as a prior: 1 inside the case's boxes / over the classes its tag names / everywhere
for an unlabeled case) and ``level`` (``bundle.data.SEG_LEVELS``: 0 pixel, 1 box, 2 image, 3 none).

* ``fedmix`` -- two UNets F1, F2 (``nets.TwinUNet``, one state dict) federated together. Each
  round, a case's pseudo labels come from the *received* global F1 and F2 (probability > 0.5),
  refined by its weak label (``refine``); the case is kept when the two agree (``select``);
  F1 learns from F2's refined label and F2 from F1's (cross pseudo supervision, soft Dice).
  The server weighs each site by the cases it kept and its training loss (``adaptive_weights``).
* ``fedadaptagg`` -- that aggregation with plain supervised training (the pixel-labeled cases).
* ``fedst`` -- self-training: the pixel-labeled sites train alone for ``warmup_rounds``, then
  every site also trains on the received model's confident pixels.

A site that keeps no case in a round abstains (weight 0): it never trains on labels it lacks.
"""

from __future__ import annotations

import numpy as np
import torch

from ..losses import soft_dice
from .aggregate import average_keys
from .base import ClientRule, ServerRule, Update, frozen_copy
from .fedavg import FedAvgClient, FedAvgServer

PIXEL, BOX, IMAGE, NONE = 0, 1, 2, 3  # bundle.data.SEG_LEVELS
STAGE = "self_training"  # FedST extras: True once the warm-up is over


# ---------------------------------------------------------------- the rules, on tensors


def dice_agreement(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per case, 2|a & b| / (|a| + |b|) of two {0,1} masks (B, C, ...) over all channels; two empty masks: 1."""
    dims = tuple(range(1, a.ndim))
    inter, total = (a * b).sum(dims), a.sum(dims) + b.sum(dims)
    return torch.where(total > 0, 2 * inter / total.clamp(min=1e-12), torch.ones_like(total))


def refine(pred: torch.Tensor, label: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    """A pseudo label refined by the case's own label: its mask at pixel level, else pred x prior mask."""
    pixel = (level == PIXEL).view(-1, *([1] * (pred.ndim - 1)))
    return torch.where(pixel, label, pred * label)


def select(r1: torch.Tensor, r2: torch.Tensor, label: torch.Tensor, level: torch.Tensor, epsilon: float,
           box_rule: bool = True) -> torch.Tensor:
    """FedMix's dynamic sample selection (Eq. 2), per case.

    Pixel cases are always kept. An image-level case tagged background-only (its prior is empty)
    drops out. Another case is kept when its refined pseudo labels agree, dice(r1, r2) >= epsilon
    (two empty ones agree); a box case also needs dice(r1, box mask) >= 0.5 (``box_rule``, the
    released code's reading of the garbled printed rule), so two empty predictions inside a real
    box are not kept.
    """
    dims = tuple(range(1, label.ndim))
    keep = dice_agreement(r1, r2) >= epsilon
    if box_rule:
        keep &= (level != BOX) | (dice_agreement(r1, label) >= 0.5)
    keep &= (level != IMAGE) | (label.sum(dims) > 0)
    return keep | (level == PIXEL)


def adaptive_weights(counts, losses, lam: float, beta: float) -> np.ndarray:
    """FedMix's Eqs. 4-5: c_i = n_i / sum n, d_i = L_i^beta / sum L^beta, w_i = (c_i + lam d_i) / sum (c + lam d).

    ``counts`` are the cases each site kept, ``losses`` its mean training Dice loss. With every
    loss 0 the d_i are 0 (nothing to tell the sites apart by); lam = 0 is count weighting.
    """
    n = np.asarray(counts, dtype=np.float64)
    loss = np.asarray(losses, dtype=np.float64)
    if n.sum() <= 0:
        raise ValueError("adaptive aggregation needs at least one site with a kept case")
    c = n / n.sum()
    q = loss ** beta
    d = q / q.sum() if q.sum() > 0 else np.zeros_like(q)
    w = c + lam * d
    return w / w.sum()


# ---------------------------------------------------------------- clients


class _CountingClient(ClientRule):
    """Counts the cases it actually trains on (``used``): the update's n, and abstention when it is 0."""

    def begin_round(self, round, extras):
        self.used, self.seen = 0, 0

    def make_update(self, n, metrics) -> Update:
        used = self.used / max(self.epochs, 1)
        metrics = {**metrics, "kept_cases": used, "kept_fraction": self.used / max(self.seen, 1)}
        if self.used == 0:  # nothing to learn from this round: weight 0, not a fault (the engine logs it)
            return Update(self.profile.site, {}, 0, dict(self.ctx.summary), metrics, abstain=True)
        return super().make_update(max(1, int(used + 0.5)), metrics)


class FedMixClient(_CountingClient):
    """Cross pseudo supervision of F1 and F2 on every case the selection keeps.

    ``epsilon`` (0.9): the agreement a case needs (0: keep every case, the paper's w/o selection);
    ``box_rule``: box cases also need dice(F1's refined label, box) >= 0.5; ``threshold`` (0.5):
    probability above which a pixel is foreground in a pseudo label.
    """

    def __init__(self, net, ctx, *, epsilon=0.9, box_rule=True, threshold=0.5, **kw):
        if not (isinstance(getattr(net, "f1", None), torch.nn.Module) and isinstance(getattr(net, "f2", None), torch.nn.Module)):
            raise ValueError(f"fedmix trains two networks F1, F2 as one: the network must be fedlabels.nets.TwinUNet "
                             f"(network option _target_), not {type(net).__name__}")
        if ctx.profile.task != "segmentation":
            raise ValueError(f"fedmix is a segmentation method; this site's task is {ctx.profile.task!r}")
        super().__init__(net, ctx, **kw)
        self.epsilon, self.box_rule, self.threshold = float(epsilon), bool(box_rule), float(threshold)
        if not 0 <= self.epsilon <= 1:
            raise ValueError(f"epsilon must be in [0, 1], not {epsilon}")
        self.teacher = None

    def begin_round(self, round, extras):
        super().begin_round(round, extras)
        self.teacher = frozen_copy(self.net)  # the received global F1, F2: this round's pseudo labels

    @torch.no_grad()
    def pseudo_labels(self, x, label, level):
        """Refined pseudo labels of F1 and F2 (received models) and which cases the selection keeps."""
        p1 = (torch.sigmoid(self.teacher.f1(x)) > self.threshold).to(label.dtype)
        p2 = (torch.sigmoid(self.teacher.f2(x)) > self.threshold).to(label.dtype)
        r1, r2 = refine(p1, label, level), refine(p2, label, level)
        return r1, r2, select(r1, r2, label, level, self.epsilon, self.box_rule)

    def train_step(self, batch):
        x, label = batch["image"].to(self.device), batch["label"].to(self.device)
        level = torch.as_tensor(batch["level"], device=self.device)
        r1, r2, keep = self.pseudo_labels(x, label, level)
        self.seen += len(x)
        if not keep.any():
            return None
        self.used += int(keep.sum())
        x, r1, r2 = x[keep], r1[keep], r2[keep]
        self.optimizer.zero_grad(set_to_none=True)
        # each network learns from the other's refined label (pixel cases: both from the mask)
        l1, l2 = soft_dice(self.net.f1(x), r2).mean(), soft_dice(self.net.f2(x), r1).mean()
        (l1 + l2).backward()
        self.optimizer.step()
        return float((l1 + l2).detach()) / 2


class FedSTClient(_CountingClient):
    """Self-training: pixel cases on their masks; once the server says so (``self_training`` in the
    extras), every other case on the received model's confident pixels (p >= ``confidence`` or
    p <= 1 - ``confidence``, foreground above 0.5). Weak labels are not used (FedST is semi-supervised)."""

    def __init__(self, net, ctx, *, confidence=0.9, **kw):
        if ctx.profile.task != "segmentation":
            raise ValueError(f"fedst is a segmentation method; this site's task is {ctx.profile.task!r}")
        super().__init__(net, ctx, **kw)
        self.confidence = float(confidence)
        if not 0.5 <= self.confidence <= 1:
            raise ValueError(f"confidence must be in [0.5, 1], not {confidence}")
        self.teacher, self.self_training = None, False

    def begin_round(self, round, extras):
        super().begin_round(round, extras)
        self.self_training = bool(extras.get(STAGE, False))
        self.teacher = frozen_copy(self.net) if self.self_training else None

    @torch.no_grad()
    def pseudo_labels(self, x):
        """The received model's foreground (p > 0.5) and its confident pixels."""
        p = torch.sigmoid(self.teacher(x))
        return (p > 0.5).to(x.dtype), ((p >= self.confidence) | (p <= 1 - self.confidence)).to(x.dtype)

    def train_step(self, batch):
        x, label = batch["image"].to(self.device), batch["label"].to(self.device)
        level = torch.as_tensor(batch["level"], device=self.device)
        pixel = level == PIXEL
        keep = pixel if not self.self_training else torch.ones_like(pixel)
        self.seen += len(x)
        if not keep.any():
            return None
        self.used += int(keep.sum())
        x, label, pixel = x[keep], label[keep], pixel[keep]
        target, mask = label, torch.ones_like(label)
        if not pixel.all():
            pseudo, confident = self.pseudo_labels(x)
            p = pixel.view(-1, *([1] * (label.ndim - 1)))
            target, mask = torch.where(p, label, pseudo), torch.where(p, mask, confident)
        self.optimizer.zero_grad(set_to_none=True)
        loss = soft_dice(self.net(x), target, mask).mean()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


# ---------------------------------------------------------------- servers


def _needs_pixel_site(name: str, summaries: dict) -> None:
    """Pseudo labels come from a model trained on masks: without a pixel-labeled site they would come
    from an untrained one."""
    levels = {s: summ.get("supervision") for s, summ in summaries.items()}
    if not any(level in ("pixel", "mixed") and summaries[s].get("labeled") for s, level in levels.items()):
        raise ValueError(f"{name} needs at least one site with pixel-level masks (supervision 'pixel'): its "
                         f"pseudo labels would come from an untrained model. The sites' supervision: {levels}")


class AdaptiveAggServer(ServerRule):
    """FedMix's adaptive aggregation (``adaptive_weights``) of every key, F1's and F2's alike.

    n_i is the cases the site kept (``Update.n``), L_i its mean training Dice loss
    (``metrics["train_loss"]``). ``lam`` (10) and ``beta`` (1.5: the paper's breast setting; the paper prints 2.5
    for skin lesions and 3 for RETOUCH, the released skin notebook uses 3); lam = 0 is FedAvg's
    count weighting.
    """

    def __init__(self, lam=10.0, beta=1.5):
        self.lam, self.beta = float(lam), float(beta)
        if self.lam < 0 or self.beta < 0:
            raise ValueError(f"lam and beta must be >= 0, not {lam}, {beta}")
        self.notes = []

    def screen(self, update, global_weights, round, step):
        loss = (update.metrics or {}).get("train_loss") if isinstance(update.metrics, dict) else None
        if isinstance(loss, bool) or not isinstance(loss, (int, float, np.integer, np.floating)) \
                or not np.isfinite(loss) or not 0 <= loss <= 1:
            # a Dice loss lies in [0, 1]: a site claiming more would take most of the aggregate (loss^beta)
            return (f"train_loss={str(loss)[:60]!r} is not a Dice loss in [0, 1]: adaptive aggregation weighs "
                    "a site by its mean training loss")
        return None

    def aggregate(self, updates, global_weights, round):
        losses = []
        for u in updates:
            loss = u.metrics.get("train_loss")
            if loss is None or not np.isfinite(loss) or loss < 0:
                raise ValueError(f"site {u.site!r} sent train_loss={loss!r}: adaptive aggregation weighs a site "
                                 "by its mean training loss")
            losses.append(loss)
        w = adaptive_weights([u.n for u in updates], losses, self.lam, self.beta)
        self.notes = ["adaptive weights: " + ", ".join(f"{u.site} {wi:.3f} (n={u.n}, loss={l:.3f})"
                                                      for u, wi, l in zip(updates, w, losses))]
        return average_keys(updates, global_weights, w)

    def take_notes(self):
        notes, self.notes = self.notes, []
        return notes


class FedMixServer(AdaptiveAggServer):
    def setup(self, summaries):
        _needs_pixel_site("fedmix", summaries)
        return super().setup(summaries)


class FedSTServer(FedAvgServer):
    """FedAvg by n_i; tells the sites when the warm-up (``warmup_rounds``, pixel-labeled sites only) is over."""

    def __init__(self, warmup_rounds=10, weighted=True):
        super().__init__(weighted)
        self.warmup_rounds = int(warmup_rounds)
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, not {warmup_rounds}")

    def setup(self, summaries):
        _needs_pixel_site("fedst", summaries)
        return super().setup(summaries)

    def extras(self, round, step):
        return {STAGE: round >= self.warmup_rounds}


def _register():
    from . import WEAK_LABELS, WITHOUT_LABELS, Method, register

    seg = ("segmentation",)
    register(Method("fedmix", FedMixClient, FedMixServer, seg, uses_unlabeled=True, weak_site=WEAK_LABELS,
                    unlabeled_site=WITHOUT_LABELS,
                    network={"_target_": "fedlabels.nets.TwinUNet"},
                    doc="FedMix: two UNets, refined cross pseudo labels, dynamic selection, adaptive aggregation"))
    register(Method("fedadaptagg", FedAvgClient, AdaptiveAggServer, seg, {"partial_loss": False},
                    doc="FedMix's adaptive aggregation with plain supervised training (pixel-labeled cases)"))
    register(Method("fedst", FedSTClient, FedSTServer, seg, uses_unlabeled=True, weak_site=WITHOUT_LABELS,
                    unlabeled_site=WITHOUT_LABELS,
                    doc="FedST: self-training on confident pseudo labels after a pixel-only warm-up"))


_register()
