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

from pathlib import Path

import torch
from torch.nn import functional as F

from . import fedavg_multilabel, fedmlp
from .surgical import partial_bce

# (value, source): FedMLP's settings are for "all comparison methods" (Sec. 3.1.3), so the shared ones are its
# reference's; the released code trains the baselines in ``train``, not ``train_FedMLP``.
PAPER = {**{key: fedmlp.PAPER[key] for key in ("lr", "batch_size", "epochs", "rounds")},
         "weight_decay": (5e-4, "released code utils/local_training.py train: Adam(weight_decay=5e-4) (the paper "
                                "prints 'L2 regularization on model parameters' and no value)"),
         "carry_optimizer": (False, "released code utils/local_training.py train: a new Adam every round"),
         "pos_weight": ("none", "paper Eq. 1: BCE without class weights (the released code weights positives by "
                                "N / N_pos)")}
# What both sides train with in benchmarks/reference_check.py --rows fedavg,fedavg_pl: the paper's values; the
# network, the input and the augmentation are the check's preset's.
CHECK = {key: value for key, (value, _) in PAPER.items() if key != "rounds"}
LEFT_OUT = {**fedmlp.LEFT_OUT, **fedavg_multilabel.UNANNOTATED,
            "input": "the preset's scaling (the section names it) and its weak augmentation (an affine and a contrast "
                     "change), not the released code's ImageNet normalisation and transforms at 224 px"}
del LEFT_OUT["views"]  # the baselines train on one view
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


# FedAvg-PL: the BCE over the annotated entries (y >= 0), averaged over them (0 when there are none): the same
# rule as each Surgical site's loss.
partial_loss = partial_bce


def run(data, rounds: int, eval_rounds, seed: int = 0, partial: bool = True, lr: float = 3e-5,
        batch_size: int = 32, weight_decay: float = 5e-4, carry_optimizer: bool = False, epochs: int = 1,
        pos_weight: str = "none", widen: float = 0.25, scaling: str = "fixed", log=print, mu: float = 0.0,
        augment: bool = True, grey: str = "mean", oracle: bool = False, only: str | None = None) -> dict:
    """FedAvg (``partial=False``) or FedAvg-PL (``partial=True``) over a prepared partial-label scenario (label
    -1: not annotated), in the shared FedAvg rounds of ``fedavg.run`` (``mu`` > 0 adds FedProx's proximal term:
    ``fedprox.run``). Test metric: the mean one-vs-rest AUROC of the global model on the pooled test split.
    ``augment=False`` trains on the images as loaded (a diagnostic: ``reference_check.py --no-augmentation``);
    ``grey``: how colour images become grey (``fedavg_multilabel.grey``; ``reference_check.py --reference-grey``).
    ``oracle``: every site trains on every label (each site's ``oracle.json``), the upper bound's scenario.
    ``only``: that site trains alone (a table's floor); averaging one site's model is the model itself."""
    from . import fedavg
    from .fedavg_multilabel import ResNet18, load_scenario, macro_auroc
    from .fedavg_multilabel import augment as weak

    classes, sites, test = load_scenario(Path(data), scaling, "oracle.json" if oracle else "datalist.json", grey,
                                         only)
    weights = [class_weights(y, pos_weight) for _, y in sites]
    loss_fn = partial_loss if partial else naive_loss
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    def loss(net, x, y, k):
        return loss_fn(net(weak(x, gen) if augment else x), y, weights[k])

    return fedavg.run(lambda: ResNet18(1, len(classes), widen), sites, loss,
                      lambda net: {"auroc": macro_auroc(net, *test)}, rounds, eval_rounds, gen, lr, batch_size,
                      epochs, weight_decay, log=log, tag=f"{'oracle:' if oracle else ''}{'fedprox' if mu > 0 else 'fedavg_pl' if partial else 'fedavg'} seed {seed} ",
                      carry_optimizer=carry_optimizer, mu=mu)
