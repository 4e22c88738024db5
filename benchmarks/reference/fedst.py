"""FedST, FedMix's semi-supervised baseline, in plain PyTorch: no fedlabels, no MONAI.

FedMix (Wicaksana et al., IEEE TMI 2023, ../shared/papers/002_*, Sec. IV-B3) compares with "semi-supervised
federated learning via self-training [33]" and says of it only that it "makes use of only confident
predictions"; ref. [33]'s code is not available here. This loop is that description made concrete, with
FedMix's training settings (Sec. IV-B4) where it needs any:

1. **Warm-up**: for the first ``warmup_rounds`` rounds only the sites with pixel masks train, on their masks;
   the others send nothing (a model that has seen no mask has no confident predictions to learn from).
2. **Self-training**, every later round: a pixel site trains on its masks; at every other site each case
   learns the received global model's prediction on the same augmented view (foreground where p > 0.5), the
   soft Dice taken over its confident pixels only (p >= ``confidence`` or p <= 1 - ``confidence``). Boxes
   and image-level tags are not used: FedST is semi-supervised.
3. **FedAvg** by the cases each site trained on.

Images, masks, the U-Net and the test Dice are ``fedavg_segmentation``'s; a site's supervision is read as
``fedmix.read_site`` reads it.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from . import fedmix, semisup
from .fedavg_classification import dihedral_pair
from .fedavg_segmentation import UNet, load_split, test_dice

# (value, source): FedMix's settings for every method it compares (FedST among them), or a stated choice.
PAPER = {
    **{key: fedmix.PAPER[key] for key in ("lr", "weight_decay", "batch_size", "epochs", "threshold", "dice_eps",
                                          "carry_optimizer")},
    "confidence": (0.9, "stated choice: FedMix prints no threshold for FedST's 'confident predictions' and ref. "
                        "[33]'s code is not available here; a pixel is confident at p >= 0.9 or p <= 0.1"),
    "warmup_rounds": (25, "stated choice: the published row's (benchmarks/plans/fedmix-ph2.yaml, a quarter of its "
                          "100 rounds); FedMix prints none"),
}
CHECK = {k: v for k, (v, _) in PAPER.items()}
LEFT_OUT = {**{key: value for key, value in fedmix.LEFT_OUT.items() if "L_i" not in key and "Xavier" not in key},
            "Xavier initialisation (paper Sec. IV-B4)": "PyTorch's default initialisation; the project's network "
                                                        "takes MONAI's default, and the project has no Xavier option"}


def confident_targets(p: torch.Tensor, threshold: float, confidence: float):
    """A prediction's pseudo label (p > threshold) and its confident pixels (p >= c or p <= 1 - c), as 0/1."""
    return (p > threshold).float(), ((p >= confidence) | (p <= 1 - confidence)).float()


def masked_soft_dice_loss(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """1 - the per-case soft Dice of sigmoid(logits) against ``target`` over the pixels ``mask`` keeps, averaged
    over the batch (every pixel kept: FedMix's L_dice)."""
    return (1 - fedmix.dice(torch.sigmoid(logits) * mask, target * mask, eps)).mean()


def self_training(rnd: int, warmup_rounds: int) -> bool:
    """Whether round ``rnd`` (counted from 1) is past the warm-up."""
    return rnd > warmup_rounds


def self_train(net, teacher, opt, x, s: dict, gen: torch.Generator, augment: bool = True) -> float:
    """Step 2 at a site without masks: shuffled batches of one augmented view each (``augment``), the frozen
    ``teacher`` (the received model) labelling the view the student sees. Returns the mean batch loss."""
    net.train()
    losses = []
    for _ in range(s["epochs"]):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), s["batch_size"]):
            xb = x[order[i:i + s["batch_size"]]]
            if augment:
                xb = dihedral_pair(xb, None, gen)[0]
            with torch.no_grad():
                target, mask = confident_targets(torch.sigmoid(teacher(xb)), s["threshold"], s["confidence"])
            loss = masked_soft_dice_loss(net(xb), target, mask, s["dice_eps"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return float(np.mean(losses))


def run(data, rounds: int, eval_rounds, seed: int = 0, log=print, **settings) -> dict:
    """FedST over the prepared scenario ``data`` (``settings`` over ``CHECK``): the global model's test Dice per
    eval round, and per round the sites that trained."""
    s = {**CHECK, **settings}
    data = Path(data)
    scenario = yaml.safe_load((data / "scenario.yaml").read_text())
    sites = [fedmix.read_site(data / name) for name in scenario["sites"]]
    if not any(level == fedmix.PIXEL for _, _, level in sites):
        raise ValueError(f"{data}: FedST needs a site with pixel masks")
    test = load_split(data / "test", json.loads((data / "test" / "datalist.json").read_text())["testing"])
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    glob = UNet()
    opts, out, seconds, trained_log = {}, {}, [], []
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        past_warmup = self_training(rnd, s["warmup_rounds"])
        teacher = copy.deepcopy(glob).eval()
        states, counts, trained = [], [], []
        for k, (x, y, level) in enumerate(sites):
            if level != fedmix.PIXEL and not past_warmup:
                continue
            net = UNet()
            net.load_state_dict(glob.state_dict())
            opt = torch.optim.Adam(net.parameters(), lr=s["lr"], weight_decay=s["weight_decay"])
            if s["carry_optimizer"] and k in opts:
                opt.load_state_dict(opts[k])
            if level == fedmix.PIXEL:
                fedmix.update([net], opt, x, [y], s, gen, augment=True)
            else:
                self_train(net, teacher, opt, x, s, gen)
            opts[k] = opt.state_dict()
            states.append(net.state_dict())
            counts.append(len(x))
            trained.append(k)
        glob.load_state_dict(semisup.mean_state(states, counts))
        trained_log.append(trained)
        seconds.append(time.perf_counter() - t0)
        if rnd in eval_rounds:
            out[rnd] = {"dice": test_dice(glob, *test)}
            log(f"[reference] fedst seed {seed} round {rnd}: {out[rnd]}")
    return {"metrics": out, "seconds_per_round": float(np.mean(seconds)), "seconds": seconds, "trained": trained_log}
