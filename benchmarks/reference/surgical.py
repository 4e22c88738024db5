"""Surgical Aggregation's server rule (Kulkarni et al., ../shared/papers/004_*), in plain NumPy.

Sec. 2.1.2: the model is a feature extractor F and a fully-connected head G.
Feature extractor update: Eq. 1 as printed, w^(F) = 1/K sum_k w_k^(F) (an
unweighted mean; ``weights`` gives another rule f, e.g. the sites' case
counts). Classification head update: Eq. 2, the global class-specific weights
of class c are the mean over the K_c sites whose local classes include c; Eq. 3,
a class unique to one site takes that site's weights. A site's weights for a
class it does not have are 0 in the paper and take no part here.

The paper's class-specific weights are column c of the N x M head kernel (a
Keras Dense layer); a PyTorch ``Linear`` stores the kernel as M x N, so here
they are row c of ``<head>.weight``, and entry c of ``<head>.bias`` follows the
same rule (the paper does not mention the bias: the reference's choice). A
class that no participating site has (outside the paper's C, the union of the
sites' classes) keeps its previous global row.
"""

from __future__ import annotations

import numpy as np


def aggregate(states: list, masks: list, global_state: dict, head: str, weights=None) -> dict:
    """``states``: the sites' state dicts (name -> array); ``masks[k][c]``: site k has class c."""
    head_keys = [k for k in (f"{head}.weight", f"{head}.bias") if k in global_state]
    if not head_keys:
        raise KeyError(f"no {head}.weight in the global state")
    w = np.ones(len(states)) if weights is None else np.asarray(weights, dtype=np.float64)
    out = {}
    for key, old in global_state.items():
        old = np.asarray(old)
        stack = np.stack([np.asarray(s[key], dtype=np.float64) for s in states])
        if key in head_keys:
            new = old.astype(np.float64).copy()
            for c in range(old.shape[0]):
                have = [k for k in range(len(states)) if masks[k][c]]
                if have:  # Eq. 2 (and Eq. 3 when len(have) == 1)
                    new[c] = sum(stack[k][c] for k in have) / len(have)
        else:  # Eq. 1 (f = FedAvg as printed: 1/K sum_k), or the weighted rule given
            new = np.tensordot(w, stack, axes=1) / w.sum()
        if not np.issubdtype(old.dtype, np.floating):
            new = np.rint(new)
        out[key] = new.astype(old.dtype)
    return out
