"""Aggregation arithmetic shared by the server rules (pure NumPy).

Weights travel as ``dict[str, np.ndarray]`` (a state dict). Every mean is
taken in float64 and cast back to the key's dtype; integer buffers (batch
norm's ``num_batches_tracked``) are rounded to the nearest integer, never
truncated.
"""

from __future__ import annotations

import numpy as np


def weighted_mean(arrays: list, weights) -> np.ndarray:
    """sum_k w_k a_k / sum_k w_k in float64, cast back to the first array's dtype (integers rounded)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        raise ValueError("weights sum to zero")
    out = sum(wi * np.asarray(a, dtype=np.float64) for wi, a in zip(w, arrays)) / w.sum()
    dtype = np.asarray(arrays[0]).dtype
    return (np.rint(out) if np.issubdtype(dtype, np.integer) else out).astype(dtype)


def average_keys(updates: list, global_weights: dict, weights) -> dict:
    """Weighted mean of every key of ``global_weights``; a key no update sent keeps its global value."""
    out = dict(global_weights)
    for key in global_weights:
        have = [(u.weights[key], w) for u, w in zip(updates, weights) if key in u.weights]
        if have:
            out[key] = weighted_mean([a for a, _ in have], [w for _, w in have])
    return out


def head_param_keys(head_name: str, keys) -> list:
    """The state-dict keys of the head among ``keys`` (weight, and bias if any)."""
    return [k for k in (f"{head_name}.weight", f"{head_name}.bias") if k in keys]


def meta_vector(update, key: str, size: int) -> np.ndarray:
    """A per-class vector from an update's label summary, checked for length."""
    if key not in update.meta:
        raise ValueError(f"update from site {update.site!r} has no meta[{key!r}]: the client must send its "
                         "label summary (fedlabels.profile.label_summary) as metadata")
    v = np.asarray(update.meta[key], dtype=np.float64)
    if v.shape != (size,):
        raise ValueError(f"site {update.site!r}: meta[{key!r}] has shape {v.shape}, the head has {size} classes")
    return v


def classwise_head_mean(updates: list, global_weights: dict, head_name: str, class_weights: list) -> dict:
    """Head rows averaged class by class.

    ``class_weights[k][c]`` is site k's weight for class c (0 = the site does
    not count for c). Row c of the head weight and entry c of its bias become
    sum_k w_kc row_kc / sum_k w_kc; where every weight of c is 0 the previous
    global row is kept. Returns the new head arrays only.
    """
    keys = head_param_keys(head_name, global_weights)
    if not keys:
        raise KeyError(f"no head keys '{head_name}.weight' / '{head_name}.bias' in the global weights")
    w = np.stack([np.asarray(cw, dtype=np.float64) for cw in class_weights])  # K x C
    if np.any(w < 0):
        raise ValueError("class weights must be non-negative")
    total = w.sum(0)  # C
    out = {}
    for key in keys:
        old = np.asarray(global_weights[key])
        if old.shape[0] != w.shape[1]:
            raise ValueError(f"{key} has {old.shape[0]} rows but the label summaries have {w.shape[1]} classes")
        for u in updates:
            if key not in u.weights:
                raise ValueError(f"site {u.site!r} did not send {key}")
        rows = np.stack([np.asarray(u.weights[key], dtype=np.float64) for u in updates])  # K x C [x N]
        wk = w.reshape(w.shape + (1,) * (rows.ndim - 2))
        num = (wk * rows).sum(0)
        have = total > 0
        new = old.astype(np.float64).copy()
        new[have] = num[have] / total[have].reshape((-1,) + (1,) * (rows.ndim - 2))
        out[key] = new.astype(old.dtype)
    return out


def model_distance(a: dict, b: dict) -> float:
    """||a - b||_2 over every floating-point key, as one flattened vector."""
    sq = 0.0
    for key, value in a.items():
        x = np.asarray(value)
        if x.dtype.kind == "f":
            sq += float(((x.astype(np.float64) - np.asarray(b[key], dtype=np.float64)) ** 2).sum())
    return float(np.sqrt(sq))


def distance_weights(updates: list, global_weights: dict, scale: float, multipliers=None) -> np.ndarray:
    """Dynamically weighted FedAvg's coefficients (IsoFed Eq. 2-3, RSCFed's rule).

    W_avg = sum_k n_k W_k / sum_k n_k; c_k = m_k n_k exp(-scale ||W_k - W_avg||_2 / n_k),
    normalised to sum 1. ``multipliers`` m_k (default 1) amplify some sites'
    coefficients only, not the average their distances are taken from (RSCFed's
    labeled-site multiplier as its README ran it at commit 4872944,
    ``--w_mul_times=6 --un_dist=avg``, train_main.py). An update far from the mean gets an
    exponentially small weight; scale 0 is FedAvg by m_k n_k.
    """
    n = np.asarray([u.n for u in updates], dtype=np.float64)
    m = np.ones_like(n) if multipliers is None else np.asarray(multipliers, dtype=np.float64)
    avg = average_keys(updates, global_weights, n)
    d = np.asarray([model_distance({k: u.weights[k] for k in avg if k in u.weights},
                                   {k: avg[k] for k in avg if k in u.weights}) for u in updates])
    # exp of (exponent - its max): the same ratios without underflow to 0/0.
    z = -scale * d / n
    c = m * n * np.exp(z - z.max())
    return c / c.sum()
