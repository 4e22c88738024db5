"""Losses that respect what a site labels.

Label convention (profile.py): multi-label targets hold 1, 0, or -1 for
"not annotated here"; -1 entries never contribute to a loss.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def pos_weight_from_counts(annotated, positives, min_pos: int = 1) -> np.ndarray:
    """The one positive-weight rule: per class N_neg / N_pos over the cases annotated for it.

    ``annotated`` / ``positives`` are per-class counts (a label summary's
    ``annotated`` and ``positives``). Classes with fewer than ``min_pos``
    positives, not annotated, or without negatives get 1.
    """
    annotated = np.asarray(annotated, dtype=np.float64)
    pos = np.asarray(positives, dtype=np.float64)
    neg = annotated - pos
    w = np.where(pos >= min_pos, neg / np.maximum(pos, 1), 1.0)
    return np.where(w > 0, w, 1.0).astype(np.float32)


def pos_weights(labels: torch.Tensor, min_pos: int = 1) -> torch.Tensor:
    """``pos_weight_from_counts`` over a label matrix (-1 = not annotated)."""
    labels = torch.as_tensor(labels)
    w = pos_weight_from_counts((labels >= 0).sum(0).numpy(), (labels == 1).sum(0).numpy(), min_pos)
    return torch.as_tensor(w)


def partial_bce(logits: torch.Tensor, target: torch.Tensor, pos_weight: torch.Tensor | None = None,
                divisor: float | None = None) -> torch.Tensor:
    """BCE over annotated entries only (target >= 0).

    Averaged over the annotated entries by default; with ``divisor`` the sum is
    divided by ``batch * divisor`` instead (FedMLP's WPC divides by C).
    A batch with no annotated entry returns 0 connected to the graph.
    """
    target = target.to(logits.dtype)
    mask = target >= 0
    loss = F.binary_cross_entropy_with_logits(logits, target.clamp(min=0), pos_weight=pos_weight, reduction="none")
    loss = loss * mask
    if divisor is not None:
        return loss.sum() / (logits.shape[0] * divisor)
    return loss.sum() / mask.sum().clamp(min=1)


def naive_bce(logits: torch.Tensor, target: torch.Tensor, pos_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Missing labels (-1) treated as negatives: the naive FedAvg baseline."""
    return F.binary_cross_entropy_with_logits(logits, target.clamp(min=0).to(logits.dtype), pos_weight=pos_weight)


def masked_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Multi-class cross-entropy over labeled cases (target >= 0), averaged over them.

    A batch of only unlabeled cases (-1) gives 0 connected to the graph, where
    the mean reduction would give NaN.
    """
    target = target.long().view(-1)
    return F.cross_entropy(logits, target, ignore_index=-1, reduction="sum") / (target >= 0).sum().clamp(min=1)


def sharpen(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """p_i^(1/T) / sum_j p_j^(1/T) along dim 1 (T < 1 sharpens, T = 1 is the identity)."""
    p = probs.clamp(min=1e-12) ** (1.0 / temperature)
    return p / p.sum(1, keepdim=True)


def consistency_mse(target_probs: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """||target - p||_2^2 per case (summed over classes), averaged over the batch."""
    return ((target_probs - probs) ** 2).sum(1).mean()


def masked_mse(probs: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared difference over the entries in ``mask`` (0, connected to the graph, when none)."""
    return (((probs - target) ** 2) * mask).sum() / mask.sum().clamp(min=1)


def information_maximization(logits: torch.Tensor) -> torch.Tensor:
    """IsoFed's Eq. 4: mean per-case entropy minus the entropy of the mean prediction.

    Minimal (-log C) for confident predictions spread evenly over the C
    classes; entropy minimisation alone would collapse every case to one class.
    """
    p = torch.softmax(logits, 1)
    logp = torch.log_softmax(logits, 1)
    mean_entropy = -(p * logp).sum(1).mean()
    p_bar = p.mean(0)
    entropy_of_mean = -(p_bar * torch.log(p_bar.clamp(min=1e-12))).sum()
    return mean_entropy - entropy_of_mean


def soft_dice(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None,
              smooth: float = 1e-5) -> torch.Tensor:
    """Per case: 1 - soft Dice of sigmoid(logits) against a {0,1} target, averaged over the channels.

    The formula of MONAI's ``DiceLoss(sigmoid=True)`` (what the lesion bundle
    trains with), so ``soft_dice(x, y).mean()`` is that loss; ``smooth`` makes
    two empty masks score 1. ``mask`` (same shape, {0,1}) keeps only its
    pixels in every sum (FedST's confident pixels). Returns shape (batch,).
    """
    prob = torch.sigmoid(logits)
    if mask is not None:
        prob, target = prob * mask, target * mask
    dims = tuple(range(2, prob.ndim))
    inter = (prob * target).sum(dims)
    denom = prob.sum(dims) + target.sum(dims)
    return (1 - (2 * inter + smooth) / (denom + smooth)).mean(1)


class PartialBCELoss(torch.nn.Module):
    """``partial_bce`` as a module, for MONAI bundle configs and trainers.

    ``loss(logits, target)``: target entries of -1 (class not annotated at the
    site) are left out; see ``partial_bce`` for the reduction.
    """

    def __init__(self, pos_weight=None, divisor: float | None = None):
        super().__init__()
        self.register_buffer("pos_weight", None if pos_weight is None else torch.as_tensor(pos_weight, dtype=torch.float32))
        self.divisor = divisor

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return partial_bce(logits, target, pos_weight=self.pos_weight, divisor=self.divisor)
