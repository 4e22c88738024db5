"""FedFixMatch as FedMLP compares with it (Sun et al., MICCAI 2024, ../shared/papers/001_*, Sec. 3.2, Tables 1-2)
in plain PyTorch: no fedlabels, no MONAI.

The paper names the baseline only ("FedAvg+FixMatch"); what it does is the authors' released code
(github.com/szbonaldo/FedMLP, ``utils/local_training.py`` ``train_FixMatch``), FixMatch (Sohn et al., NeurIPS
2020) on the classes a site does not annotate:

* the site's model sees the weak view and the strong view of each batch (two forward passes every step);
* supervised term: the BCE of the weak view over the entries the site annotates, averaged over them;
* a case is kept when the sigmoid of its weak view is confident, p > ``confidence`` or p < 1 - ``confidence``,
  for *every* class the site lacks; its pseudo labels are the hard p > 0.5;
* unsupervised term: the BCE of the strong view against the pseudo labels over the kept cases' missing entries,
  averaged over them, added with weight ``lambda_u`` (nothing when no case is kept or nothing is missing);
* the server averages every tensor by case counts (the shared rounds of ``fedavg.run``).

Settings (``PAPER``): FedMLP's Sec. 3.1.3 values "for all comparison methods", the released code's where the
paper prints none.

The project's site forwards the strong view only on a step that keeps a case; the loss and its gradient are the
same, but on a step that keeps none batch norm's running statistics see the weak view alone there and both views
here (the released code's two passes).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F

from . import fedavg_multilabel, fedmlp, partial_fedavg
from .surgical import partial_bce

_CODE = "released code utils/local_training.py train_FixMatch"
PAPER = {**{key: partial_fedavg.PAPER[key] for key in ("lr", "batch_size", "epochs", "rounds", "pos_weight")},
         "weight_decay": (5e-4, f"{_CODE}: Adam(weight_decay=5e-4)"),
         "carry_optimizer": (False, f"{_CODE}: a new Adam every round"),
         "confidence": (0.8, f"{_CODE}: a case is kept when every negative (missing) class has p > 0.8 or p < 0.2"),
         "lambda_u": (1.0, f"{_CODE}: loss = loss_sup + 1. * loss_unsup")}
CHECK = {key: value for key, (value, _) in PAPER.items() if key != "rounds"}
LEFT_OUT = {**fedmlp.LEFT_OUT, **fedavg_multilabel.UNANNOTATED,
            "views": "the bundle's weak view and its strong view (the weak view further changed: contrast, Gaussian "
                     "noise, a dropped square), not the released code's weak transforms and RandAugment",
            "unsup_weight": "the unsupervised BCE weighs no class (the released code weighs its positives by a "
                            "per-class loss_w_unknown, which the project cannot run)"}


def pseudo_labels(probs, y, confidence: float) -> tuple:
    """(hard labels p > 0.5, mask): the missing entries (y < 0) of the cases whose missing entries all have
    p > confidence or p < 1 - confidence."""
    missing = y < 0
    sure = (probs > confidence) | (probs < 1 - confidence)
    kept = (sure | ~missing).all(1) & missing.any(1)
    return (probs > 0.5).float(), missing & kept[:, None]


def loss_fn(weak_logits, strong_logits, y, weight, confidence: float, lambda_u: float) -> torch.Tensor:
    """The supervised BCE of the weak view plus ``lambda_u`` x the BCE of the strong view against the weak view's
    pseudo labels over the kept missing entries (averaged over them)."""
    loss = partial_bce(weak_logits, y, weight)
    target, mask = pseudo_labels(torch.sigmoid(weak_logits.detach()), y, confidence)
    if mask.any():
        unsup = F.binary_cross_entropy_with_logits(strong_logits, target, reduction="none")
        loss = loss + lambda_u * (unsup * mask).sum() / mask.sum()
    return loss


def run(data, rounds: int, eval_rounds, seed: int = 0, lr: float = 3e-5, batch_size: int = 32,
        weight_decay: float = 5e-4, carry_optimizer: bool = False, epochs: int = 1, confidence: float = 0.8,
        lambda_u: float = 1.0, pos_weight: str = "none", widen: float = 0.25, scaling: str = "fixed",
        grey: str = "mean", log=print) -> dict:
    """FedFixMatch over a prepared partial-label scenario (label -1: not annotated). Test metric: the mean
    one-vs-rest AUROC of the global model on the pooled test split."""
    from . import fedavg
    from .fedavg_multilabel import ResNet18, augment, load_scenario, macro_auroc

    classes, sites, test = load_scenario(Path(data), scaling, grey_rule=grey)
    weights = [partial_fedavg.class_weights(y, pos_weight) for _, y in sites]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    def loss(net, x, y, k):
        weak = augment(x, gen)
        strong = fedmlp.strong_augment(weak, gen)  # the strong view transforms the weak one further, as the bundle's
        return loss_fn(net(weak), net(strong), y, weights[k], confidence, lambda_u)

    return fedavg.run(lambda: ResNet18(1, len(classes), widen), sites, loss,
                      lambda net: {"auroc": macro_auroc(net, *test)}, rounds, eval_rounds, gen, lr, batch_size,
                      epochs, weight_decay, log=log, tag=f"fedfixmatch seed {seed} ", carry_optimizer=carry_optimizer)
