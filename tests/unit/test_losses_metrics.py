"""Losses and metrics against hand-computed values."""

import math

import numpy as np
import pytest
import torch

from fedlabels.losses import naive_bce, partial_bce, pos_weights, soft_dice
from fedlabels.metrics import dice_per_case, multiclass_metrics, multilabel_metrics


def bce(z, y, w=1.0):
    p = 1 / (1 + math.exp(-z))
    return -(w * y * math.log(p) + (1 - y) * math.log(1 - p))


def test_partial_bce_ignores_missing_entries():
    logits = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.0, -0.3]])
    target = torch.tensor([[1, -1, 0], [-1, 0, 1]])
    expected = (bce(0.5, 1) + bce(2.0, 0) + bce(0.0, 0) + bce(-0.3, 1)) / 4
    assert partial_bce(logits, target).item() == pytest.approx(expected, rel=1e-6)
    # divisor: sum / (batch * C), FedMLP's WPC normalisation
    assert partial_bce(logits, target, divisor=3).item() == pytest.approx(expected * 4 / 6, rel=1e-6)
    # naive: missing treated as negative
    naive = (bce(0.5, 1) + bce(-1.0, 0) + bce(2.0, 0) + bce(1.5, 0) + bce(0.0, 0) + bce(-0.3, 1)) / 6
    assert naive_bce(logits, target).item() == pytest.approx(naive, rel=1e-6)


def test_partial_bce_all_missing_is_zero_with_grad():
    logits = torch.zeros(2, 2, requires_grad=True)
    loss = partial_bce(logits, -torch.ones(2, 2))
    loss.backward()
    assert loss.item() == 0 and logits.grad.abs().sum() == 0


def test_pos_weight():
    labels = torch.tensor([[1, 0, -1], [0, 0, -1], [0, 1, -1], [0, 0, -1]])
    w = pos_weights(labels)
    assert w.tolist() == [3.0, 3.0, 1.0]  # 3 neg / 1 pos; unannotated -> 1
    logits, target = torch.tensor([[0.2, -0.4, 0.0]]), torch.tensor([[1, 0, -1]])
    expected = (bce(0.2, 1, 3.0) + bce(-0.4, 0, 3.0)) / 2
    assert partial_bce(logits, target, pos_weight=w).item() == pytest.approx(expected, rel=1e-6)


def test_soft_dice():
    logits = torch.tensor([[[[10.0, -10.0], [-10.0, -10.0]]]])  # prob ~ [1,0,0,0]
    target = torch.tensor([[[[1.0, 1.0], [0.0, 0.0]]]])
    assert soft_dice(logits, target).item() == pytest.approx(1 - 2 * 1 / 3, abs=1e-3)
    empty = torch.full((1, 1, 2, 2), -30.0)
    assert soft_dice(empty, torch.zeros(1, 1, 2, 2)).item() == pytest.approx(0.0, abs=1e-4)


def test_multilabel_metrics_hand_values_and_undefined():
    probs = np.array([[0.9, 0.2, 0.6], [0.4, 0.7, 0.1], [0.3, 0.1, 0.8], [0.6, 0.9, 0.3]])
    labels = np.array([[1, 0, -1], [0, 1, -1], [0, 0, -1], [1, -1, -1]])
    m = multilabel_metrics(probs, labels, ["a", "b", "c"])
    assert m["per_class"]["a"]["auroc"] == 1.0
    # class b over cases 0-2: positives {0.7}, negatives {0.2, 0.1} -> AUROC 1; AP 1
    assert m["per_class"]["b"]["auroc"] == 1.0 and m["per_class"]["b"]["ap"] == 1.0
    # bacc a at 0.5: TPR = 2/2, TNR = 2/2 -> 1; b: TPR 1/1, TNR 2/2
    assert m["per_class"]["a"]["bacc"] == 1.0
    # expected / observed, class a: mean prob (0.9+0.4+0.3+0.6)/4 = 0.55 over prevalence 2/4 -> 1.1
    assert m["per_class"]["a"]["eo_ratio"] == pytest.approx(1.1)
    assert m["per_class"]["c"]["eo_ratio"] is None
    assert m["per_class"]["c"]["auroc"] is None and m["undefined"] == ["c"]
    assert m["auroc"] == 1.0  # mean over defined classes only, never NaN
    probs2 = np.array([[0.2], [0.6], [0.7], [0.4]])
    m2 = multilabel_metrics(probs2, np.array([[1], [0], [1], [0]]), ["x"])
    # pairs (pos, neg): (0.2,0.6) no, (0.2,0.4) no, (0.7,0.6) yes, (0.7,0.4) yes -> 0.5
    assert m2["auroc"] == pytest.approx(0.5)
    # bacc: pred [0,1,1,0]; TPR 1/2, TNR 1/2
    assert m2["bacc"] == pytest.approx(0.5)


def test_multiclass_metrics():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1]])
    labels = np.array([0, 1, 1, 2, -1])
    m = multiclass_metrics(probs, labels, ["a", "b", "c"])
    assert m["accuracy"] == pytest.approx(3 / 4)
    # precision: a 1/2, b 1/1, c 1/1; recall: a 1/1, b 1/2, c 1/1
    assert m["precision"] == pytest.approx((0.5 + 1 + 1) / 3)
    assert m["recall"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert m["per_class"]["c"]["auroc"] == 1.0


def test_dice_per_case():
    pred = np.array([[[1, 1], [0, 0]], [[0, 0], [0, 0]], [[1, 0], [0, 0]]])
    gt = np.array([[[1, 0], [0, 0]], [[0, 0], [0, 0]], [[0, 0], [0, 1]]])
    assert dice_per_case(pred, gt).tolist() == pytest.approx([2 / 3, 1.0, 0.0])
