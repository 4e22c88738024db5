"""FedNoRo as FedMLP compares with it (Sun et al., MICCAI 2024, ../shared/papers/001_*, Sec. 3.2, Tables 1-2) in
plain PyTorch: no fedlabels, no MONAI.

The paper names the baseline only; what runs is the authors' released code (github.com/szbonaldo/FedMLP,
``main.py`` and ``utils/local_training.py`` ``train_FedNoRo``, ``utils/FedNoRo.py`` ``LA_KD``): the distillation
loss of FedNoRo's (Wu et al., IJCAI 2023) second stage, every site treated as noisy, which the released code runs
in every round (the branch ``rnd < --rounds_FedNoRo_warmup``, 500, covers all its rounds):

* the teacher is the received global model, frozen, in inference mode;
* a site's loss on a batch is (1 - w) x the BCE over the entries it annotates (averaged over them) + w x the mean
  squared difference between the local sigmoid and the teacher's sigmoid at temperature T (sigmoid(z / T)) over
  the missing entries (averaged over them);
* w = a x exp(-5 (1 - t)^2), t = (round - begin) / (end - begin) clipped to [0, 1], rounds from 0 (``main.py``
  ``get_current_consistency_weight(rnd, begin, end) * a``);
* the server averages every tensor by case counts (the shared rounds of ``fedavg.run``).

Settings (``PAPER``): FedMLP's Sec. 3.1.3 values "for all comparison methods", the released code's where the
paper prints none.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from . import fedavg_multilabel, fedmlp, partial_fedavg
from .surgical import partial_bce

_OPTIONS = "released code utils/options.py"
_CODE = "released code utils/local_training.py train_FedNoRo"
PAPER = {**{key: partial_fedavg.PAPER[key] for key in ("lr", "batch_size", "epochs", "rounds", "pos_weight")},
         "weight_decay": (5e-4, f"{_CODE}: Adam(weight_decay=5e-4)"),
         "carry_optimizer": (False, f"{_CODE}: a new Adam every round"),
         "kd_weight": (0.8, f"{_OPTIONS} --a default 0.8"),
         "temperature": (0.8, f"{_CODE}: soft_label = sigmoid(teacher_output / 0.8)"),
         "rampup_begin": (10, f"{_OPTIONS} --begin default 10"),
         "rampup_end": (499, f"{_OPTIONS} --end default 499 (of its 500 rounds)")}
CHECK = {key: value for key, (value, _) in PAPER.items() if key != "rounds"}
LEFT_OUT = {**fedmlp.LEFT_OUT, **fedavg_multilabel.UNANNOTATED,
            "detection": "FedNoRo's noisy-site detection and distance-aware aggregation are not run, as in the "
                         "released code's comparison (plain FedAvg every round)"}
del LEFT_OUT["views"]  # one view


def ramp_weight(rnd: int, a: float, begin: int, end: int) -> float:
    """w = a exp(-5 (1 - t)^2), t = (rnd - begin) / (end - begin) clipped to [0, 1] (the released sigmoid_rampup)."""
    if end <= begin:
        raise ValueError(f"rampup_end {end} must be after rampup_begin {begin} (the released ramp divides by end - begin)")
    t = min(max((rnd - begin) / (end - begin), 0.0), 1.0)
    return a * math.exp(-5.0 * (1.0 - t) ** 2)


def loss_fn(logits, teacher_logits, y, weight, w: float, temperature: float) -> torch.Tensor:
    """(1 - w) x the BCE over the annotated entries + w x the mean squared difference of sigmoid(logits) and
    sigmoid(teacher_logits / T) over the missing entries (0 where there are none)."""
    missing = (y < 0).float()
    sq = (torch.sigmoid(logits) - torch.sigmoid(teacher_logits / temperature)) ** 2
    kd = (sq * missing).sum() / missing.sum().clamp(min=1)
    return (1 - w) * partial_bce(logits, y, weight) + w * kd


def rule(weights: list, kd_weight: float, temperature: float, rampup_begin: int, rampup_end: int, augment):
    """(start, loss) for the shared rounds (``fedavg.run``): ``start`` keeps the received model, frozen and in
    inference mode, and the round's w; ``loss`` is ``loss_fn`` on the augmented batch. ``weights``: each site's
    positive weights (None: unweighted)."""
    now = {}

    def start(net, k, rnd):  # fedavg.run counts rounds from 1, the released code from 0
        now.update(teacher=fedmlp.teacher_of(net), w=ramp_weight(rnd - 1, kd_weight, rampup_begin, rampup_end))

    def loss(net, x, y, k):
        x = augment(x)
        with torch.no_grad():
            teacher = now["teacher"](x)
        return loss_fn(net(x), teacher, y, weights[k], now["w"], temperature)

    return start, loss


def run(data, rounds: int, eval_rounds, seed: int = 0, lr: float = 3e-5, batch_size: int = 32,
        weight_decay: float = 5e-4, carry_optimizer: bool = False, epochs: int = 1, kd_weight: float = 0.8,
        temperature: float = 0.8, rampup_begin: int = 10, rampup_end: int = 499, pos_weight: str = "none",
        widen: float = 0.25, scaling: str = "fixed", grey: str = "mean", augment: bool = True,
        log=print) -> dict:
    """FedNoRo over a prepared partial-label scenario (label -1: not annotated). Test metric: the mean
    one-vs-rest AUROC of the global model on the pooled test split. ``grey``: how colour images become grey
    (``fedavg_multilabel.grey``); ``augment=False`` trains on the images as loaded (a diagnostic)."""
    from . import fedavg
    from .fedavg_multilabel import ResNet18, load_scenario, macro_auroc
    from .fedavg_multilabel import augment as weak

    classes, sites, test = load_scenario(Path(data), scaling, grey_rule=grey)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    start, loss = rule([partial_fedavg.class_weights(y, pos_weight) for _, y in sites], kd_weight, temperature,
                       rampup_begin, rampup_end, (lambda x: weak(x, gen)) if augment else (lambda x: x))
    return fedavg.run(lambda: ResNet18(1, len(classes), widen), sites, loss,
                      lambda net: {"auroc": macro_auroc(net, *test)}, rounds, eval_rounds, gen, lr, batch_size,
                      epochs, weight_decay, log=log, tag=f"fednoro seed {seed} ", carry_optimizer=carry_optimizer,
                      start=start)
