"""Surgical Aggregation (Kulkarni et al., ../shared/papers/004_*): its server rule in plain NumPy
(``aggregate``) and its federated training in plain PyTorch (``run``), no fedlabels, no MONAI.

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

import time
from pathlib import Path

import numpy as np
import torch

from .fedavg_multilabel import UNANNOTATED


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


# The paper's settings (Sec. 2.5, "Centralized Setup" and "Federated Setup") and the released code's where the
# paper prints none: (value, source).
PAPER = {
    "lr": (5e-5, "paper Sec. 2.5: all weights trained with a learning rate of 5e-5"),
    "batch_size": (64, "paper Sec. 2.5: a batch size of 64"),
    "epochs": (1, "paper Sec. 2.5: E = 1 epoch before communication"),
    "rounds": (150, "paper Sec. 2.5: T = 150 epochs, E = 1"),
    "warmup_epochs": (15, "paper Sec. 2.5: the heads 'warmed up' for 15 epochs, feature extractor frozen"),
    "warmup_lr": (5e-3, "paper Sec. 2.5: warm-up learning rate 5e-3"),
    "optimizer": ("adam", "released code src/federated.py: keras.optimizers.Adam (the paper names none)"),
    "carry_optimizer": (True, "released code src/federated.py: each client's model is compiled with its Adam once "
                              "and keeps it from round to round"),
    "pos_weight": ("none", "paper Sec. 2.5: binary cross-entropy, each site on its own classes (no positive "
                           "weighting); 'neg_over_pos' weighs a site's positives of class c by its N_neg / N_pos, the "
                           "project's default"),
    "feature_rule": ("mean", "paper Eq. 1: w^(F) = 1/K sum_k w_k^(F) (FedAvg as printed); released code: "
                             "unweighted mean"),
}
# What both sides train with in benchmarks/reference_check.py --rows surgical: the paper's values; the network,
# input and augmentation are the check's preset's (the paper's ImageNet DenseNet121 at 224 px cannot be
# downloaded or trained here).
CHECK = {key: value for key, (value, _) in PAPER.items() if key not in ("rounds", "feature_rule")}
LEFT_OUT = {
    "network": "the preset's ResNet-18 from scratch at the width and size the section names, not an ImageNet DenseNet121 at 224 px",
    "warmup_selection": "the released code keeps the warm-up head of the best validation loss; both sides keep "
                        "the last (the project's client has no validation loader)",
    "rounds": "the check's budget",
    **UNANNOTATED,
}


def partial_bce(logits, y, weight=None):
    """BCE over the annotated entries (label >= 0), averaged over them (the paper: each site on its own classes);
    ``weight``: per-class positive weights (None: the paper's plain BCE)."""
    from torch.nn import functional as F

    mask = (y >= 0).float()
    loss = F.binary_cross_entropy_with_logits(logits, y.clamp(min=0), pos_weight=weight, reduction="none") * mask
    return loss.sum() / mask.sum().clamp(min=1)


def features(net, x):
    """The feature extractor F of the ResNet-18 (``fedavg_multilabel.ResNet18``): everything before ``fc``."""
    from torch.nn import functional as F

    return F.adaptive_avg_pool2d(net.layers(net.stem(x)), 1).flatten(1)


def warm_up(net, x, y, batches, epochs: int, lr: float, augment, weight=None) -> None:
    """The head G alone, a fresh Adam, on features of F frozen and in inference mode (Sec. 2.5)."""
    net.eval()
    opt = torch.optim.Adam(net.fc.parameters(), lr=lr)
    for _ in range(epochs):
        for idx in batches(len(y)):
            with torch.no_grad():
                f = features(net, augment(x[idx]))
            loss = partial_bce(net.fc(f), y[idx], weight)
            opt.zero_grad()
            loss.backward()
            opt.step()


def train_local(net, opt, x, y, batches, epochs: int, augment, weight=None) -> None:
    net.train()
    for _ in range(epochs):
        for idx in batches(len(y)):
            loss = partial_bce(net(augment(x[idx])), y[idx], weight)
            opt.zero_grad()
            loss.backward()
            opt.step()


def run(data, rounds: int, eval_rounds, seed: int = 0, lr: float = 5e-5, batch_size: int = 64, epochs: int = 1,
        warmup_epochs: int = 15, warmup_lr: float = 5e-3, optimizer: str = "adam", carry_optimizer: bool = True,
        pos_weight: str = "none", widen: float = 0.25, scaling: str = "fixed", grey: str = "mean",
        log=print) -> dict:
    """Surgical Aggregation over a prepared partial-label scenario: each site trains the BCE of the classes it
    annotates (label -1: not annotated) from the global model; at the first round a site trains, its head
    is first trained alone (``warm_up``) with the feature extractor frozen and in inference mode; the server
    averages the features unweighted (Eq. 1) and each head row over the sites annotating its class
    (``aggregate``: Eq. 2-3). Augmentation: the bundle's affine and contrast change. ``pos_weight``: the BCE's
    positive weighting (``partial_fedavg.class_weights``; the paper's is "none"). Test metric: the mean
    one-vs-rest AUROC."""
    from .fedavg_multilabel import ResNet18, augment, batcher, load_scenario, macro_auroc
    from .partial_fedavg import class_weights

    if optimizer != "adam":
        raise ValueError(f"optimizer {optimizer!r}: the reference runs the released code's Adam")
    classes, sites, test = load_scenario(Path(data), scaling, grey_rule=grey)
    n_classes = len(classes)
    masks = [(y >= 0).any(0).numpy() for _, y in sites]  # the classes each site annotates
    weights = [class_weights(y, pos_weight) for _, y in sites]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = batcher(gen, batch_size)

    def aug(x):
        return augment(x, gen)

    global_net = ResNet18(1, n_classes, widen)
    nets = [ResNet18(1, n_classes, widen) for _ in sites]
    opts = [None] * len(sites)
    out, seconds = {}, []
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        states = []
        for k, (x, y) in enumerate(sites):
            net = nets[k]
            net.load_state_dict(global_net.state_dict())
            if rnd == 1 and warmup_epochs > 0:
                warm_up(net, x, y, batches, warmup_epochs, warmup_lr, aug, weights[k])
            if opts[k] is None or not carry_optimizer:
                opts[k] = torch.optim.Adam(net.parameters(), lr=lr)
            train_local(net, opts[k], x, y, batches, epochs, aug, weights[k])
            states.append({key: v.detach().numpy().copy() for key, v in net.state_dict().items()})
        g = aggregate(states, masks, {key: v.numpy() for key, v in global_net.state_dict().items()}, "fc")
        global_net.load_state_dict({key: torch.from_numpy(np.asarray(v)) for key, v in g.items()})
        seconds.append(time.perf_counter() - t0)
        if rnd in eval_rounds:
            out[rnd] = {"auroc": macro_auroc(global_net, *test)}
            log(f"[reference] surgical seed {seed} round {rnd}: {out[rnd]}")
    return {"metrics": out, "seconds_per_round": float(np.mean(seconds)), "seconds": seconds}
