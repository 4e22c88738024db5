"""Label-aware metrics.

A class that a site does not annotate, or that lacks positives or negatives in
the evaluated cases, is *undefined*: reported as ``None`` and listed, never
averaged in as NaN or 0.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import average_precision_score, roc_auc_score


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def multilabel_metrics(probs, labels, classes) -> dict:
    """Per-class AUROC, AP, balanced accuracy (threshold 0.5) and expected/observed
    ratio (mean predicted probability / prevalence: 1 = calibrated on average,
    below 1 = the class is under-called), plus macro means of the first three.

    ``labels`` holds 1/0/-1; -1 entries are left out of that class's metrics.
    """
    probs, labels = np.asarray(probs, dtype=np.float64), np.asarray(labels)
    per_class, undefined = {}, []
    for c, name in enumerate(classes):
        keep = labels[:, c] >= 0
        y, p = labels[keep, c], probs[keep, c]
        npos, nneg = int((y == 1).sum()), int((y == 0).sum())
        if npos == 0 or nneg == 0:
            per_class[name] = {"auroc": None, "ap": None, "bacc": None, "eo_ratio": None, "n_pos": npos, "n_neg": nneg}
            undefined.append(name)
            continue
        pred = p >= 0.5
        tpr = float((pred & (y == 1)).sum() / npos)
        tnr = float((~pred & (y == 0)).sum() / nneg)
        per_class[name] = {
            "auroc": float(roc_auc_score(y, p)),
            "ap": float(average_precision_score(y, p)),
            "bacc": (tpr + tnr) / 2,
            "eo_ratio": float(p.mean() / y.mean()),
            "n_pos": npos,
            "n_neg": nneg,
        }
    return {
        "per_class": per_class,
        "auroc": _mean(m["auroc"] for m in per_class.values()),
        "ap": _mean(m["ap"] for m in per_class.values()),
        "bacc": _mean(m["bacc"] for m in per_class.values()),
        "undefined": undefined,
    }


def multiclass_metrics(probs, labels, classes) -> dict:
    """Accuracy, macro precision / recall over classes present, macro one-vs-rest AUROC.

    Cases labeled -1 are left out.
    """
    probs, labels = np.asarray(probs, dtype=np.float64), np.asarray(labels).reshape(-1)
    keep = labels >= 0
    probs, labels = probs[keep], labels[keep]
    pred = probs.argmax(1)
    per_class, undefined = {}, []
    for c, name in enumerate(classes):
        tp = int(((pred == c) & (labels == c)).sum())
        npos, npred = int((labels == c).sum()), int((pred == c).sum())
        auroc = None
        if 0 < npos < len(labels):
            auroc = float(roc_auc_score(labels == c, probs[:, c]))
        else:
            undefined.append(name)
        per_class[name] = {
            "precision": tp / npred if npred else (None if npos == 0 else 0.0),
            "recall": tp / npos if npos else None,
            "auroc": auroc,
            "n_pos": npos,
        }
    return {
        "per_class": per_class,
        "accuracy": float((pred == labels).mean()) if len(labels) else None,
        "precision": _mean(m["precision"] for m in per_class.values()),
        "recall": _mean(m["recall"] for m in per_class.values()),
        "auroc": _mean(m["auroc"] for m in per_class.values()),
        "undefined": undefined,
    }


def dice_per_case(pred, target) -> np.ndarray:
    """Hard Dice per case for binary masks shaped [N, ...]; two empty masks score 1."""
    pred = np.asarray(pred).astype(bool).reshape(len(pred), -1)
    target = np.asarray(target).astype(bool).reshape(len(target), -1)
    inter = (pred & target).sum(1)
    denom = pred.sum(1) + target.sum(1)
    return np.where(denom == 0, 1.0, 2 * inter / np.maximum(denom, 1))


def segmentation_metrics(pred, target, classes=None) -> dict:
    """Hard Dice per case; with ``classes`` (masks shaped [N, C, ...]) also per class.

    ``dice`` is the mean over cases (no ``classes``) or over classes."""
    pred, target = np.asarray(pred), np.asarray(target)
    if classes is None:
        dice = dice_per_case(pred, target)
        return {"dice": float(dice.mean()) if len(dice) else None, "dice_per_case": dice.tolist()}
    per_class = {}
    for i, name in enumerate(classes):
        d = dice_per_case(pred[:, i], target[:, i])
        per_class[name] = {"dice": float(d.mean()) if len(d) else None}
    # The two halves of the case mean: Dice where the class is present, and how often an image
    # without it is left empty (an empty image scores 1 or, with any false positive, 0).
    d = dice_per_case(pred, target)
    present = np.asarray(target).reshape(len(target), -1).any(1)
    return {"dice": _mean(m["dice"] for m in per_class.values()), "per_class": per_class,
            "dice_per_case": d.tolist(),
            "dice_present": float(d[present].mean()) if present.any() else None,
            "empty_correct": float(d[~present].mean()) if (~present).any() else None}
