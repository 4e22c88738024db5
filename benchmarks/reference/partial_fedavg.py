"""FedMLP's two baselines, FedAvg and FedAvg-PL (Sun et al., MICCAI 2024, ../shared/papers/001_*, Sec. 2.1
and 3.2), in plain PyTorch: no fedlabels, no MONAI.

* **FedAvg** (``partial_loss=False``): Eq. 1, the BCE over every class with a missing label counted as a
  negative (Sec. 2.1: "Previous works regard missing classes as negative ... and use a binary cross entropy
  (BCE) loss"), averaged over the batch and the C classes.
* **FedAvg-PL** (``partial_loss=True``): "a partial loss to include only active classes" (Sec. 3.2): the BCE
  over the entries the site annotates, averaged over them (the released code's commented alternative in
  ``utils/local_training.py`` ``train``: the active classes' sum over batch x ``annotation_num``).
* The server averages every tensor by case counts (FedAvg [16]); every site trains every round.

Training settings (``PAPER``): Sec. 3.1.3 gives them "for both datasets and all comparison methods"; the
released code where the paper prints none. Positive weighting (``pos_weight``): ``"none"`` is Eq. 1 as
printed; ``"neg_over_pos"`` weights a class's positives by N_neg / N_pos over the site's cases annotated for
it (1 for a class the site lacks, or that lacks positives or negatives) -- the project's default, which the
published rows train with. The released code weights by N / N_pos (``loss_w``), which neither side runs.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

# (value, source): the paper's, or the released code's where the paper prints none.
PAPER = {
    "lr": (3e-5, "paper Sec. 3.1.3 (all comparison methods): Adam with a learning rate of 3e-5"),
    "batch_size": (32, "paper Sec. 3.1.3: a batch size of 32"),
    "weight_decay": (5e-4, "released code utils/local_training.py train: Adam(weight_decay=5e-4) (the paper prints "
                           "'L2 regularization on model parameters' and no value)"),
    "carry_optimizer": (False, "released code utils/local_training.py train: a new Adam every round"),
    "epochs": (1, "paper Sec. 3.1.3: one local training round before each communication round"),
    "rounds": (500, "paper Sec. 3.1.3: 500 rounds"),
    "pos_weight": ("none", "paper Eq. 1: BCE without class weights (the released code weights positives by "
                           "N / N_pos)"),
}
# What both sides train with in benchmarks/reference_check.py --rows fedavg,fedavg_pl: the paper's values; the
# network, the input and the augmentation are the check's preset's.
CHECK = {key: value for key, (value, _) in PAPER.items() if key != "rounds"}
LEFT_OUT = {
    "network": "the preset's ResNet-18 (width 0.25) from scratch at 32 px, not an ImageNet ResNet-18 at 224 px",
    "input": "the preset's 0-255 to [-1, 1] scaling and its weak augmentation (an affine and a contrast change), "
             "not the released code's ImageNet normalisation and transforms at 224 px",
    "rounds": "the check's budget",
}
POS_WEIGHTS = ("none", "neg_over_pos")


def class_weights(y, rule: str) -> torch.Tensor | None:
    """Per class: None for ``"none"``; N_neg / N_pos over the cases annotated for it (y >= 0) for
    ``"neg_over_pos"``, 1 where the class has no positive or no negative (a class the site lacks)."""
    if rule not in POS_WEIGHTS:
        raise ValueError(f"pos_weight {rule!r}: one of {POS_WEIGHTS}")
    if rule == "none":
        return None
    pos, neg = (y == 1).sum(0).double(), (y == 0).sum(0).double()
    return torch.where((pos > 0) & (neg > 0), neg / pos.clamp(min=1), torch.ones_like(pos)).float()


def naive_loss(logits, y, weight=None) -> torch.Tensor:
    """FedAvg, Eq. 1: a missing label (-1) is a negative; the mean over batch x C."""
    return F.binary_cross_entropy_with_logits(logits, y.clamp(min=0), pos_weight=weight)


def partial_loss(logits, y, weight=None) -> torch.Tensor:
    """FedAvg-PL: the BCE over the annotated entries (y >= 0), averaged over them (0 when there are none)."""
    mask = (y >= 0).float()
    bce = F.binary_cross_entropy_with_logits(logits, y.clamp(min=0), pos_weight=weight, reduction="none")
    return (bce * mask).sum() / mask.sum().clamp(min=1)


def run(data, rounds: int, eval_rounds, seed: int = 0, partial: bool = True, lr: float = 3e-5,
        batch_size: int = 32, weight_decay: float = 5e-4, carry_optimizer: bool = False, epochs: int = 1,
        pos_weight: str = "none", widen: float = 0.25, scaling: str = "fixed", log=print) -> dict:
    """FedAvg (``partial=False``) or FedAvg-PL (``partial=True``) over a prepared partial-label scenario (label
    -1: not annotated). Test metric: the mean one-vs-rest AUROC of the global model on the pooled test split."""
    from .fedavg_multilabel import ResNet18, augment, batcher, load_scenario, macro_auroc
    from .fedmlp import fedavg

    classes, sites, test = load_scenario(Path(data), scaling)
    weights = [class_weights(y, pos_weight) for _, y in sites]
    loss = partial_loss if partial else naive_loss
    sizes = [len(y) for _, y in sites]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = batcher(gen, batch_size)
    global_net = ResNet18(1, len(classes), widen)
    nets = [ResNet18(1, len(classes), widen) for _ in sites]
    opts = [None] * len(sites)
    name = "fedavg_pl" if partial else "fedavg"
    out, seconds = {}, []
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        states = []
        for k, ((x, y), net) in enumerate(zip(sites, nets)):
            net.load_state_dict(global_net.state_dict())
            if opts[k] is None or not carry_optimizer:
                opts[k] = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
            net.train()
            for _ in range(epochs):
                for idx in batches(len(y)):
                    batch_loss = loss(net(augment(x[idx], gen)), y[idx], weights[k])
                    opts[k].zero_grad()
                    batch_loss.backward()
                    opts[k].step()
            states.append({key: v.detach().clone() for key, v in net.state_dict().items()})
        global_net.load_state_dict(fedavg(states, sizes))
        seconds.append(time.perf_counter() - t0)
        if rnd in eval_rounds:
            out[rnd] = {"auroc": macro_auroc(global_net, *test)}
            log(f"[reference] {name} seed {seed} round {rnd}: {out[rnd]}")
    return {"metrics": out, "seconds_per_round": float(np.mean(seconds)), "seconds": seconds}
