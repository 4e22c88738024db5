"""FedMix (Wicaksana et al., IEEE TMI 2023, ../shared/papers/002_*) in plain PyTorch: no fedlabels, no MONAI.

Written from the paper's Algorithm 1 and Sec. III-C/D, and from the authors' released code
(github.com/Jwicaksana/FedMix: ``helper.py`` and the skin-lesion notebook) where the paper prints
nothing. Each round, at each site:

1. **Sample & Refine** (Algorithm 1; ``helper.select_pl_singleclass``): the received F1 and F2
   predict every training case once (probability > 0.5), on one augmented view of it; the
   predictions are refined by the case's weak label (Sec. III-C: box -> times the box mask,
   image-level -> times the class-presence mask, none -> as is), and a case is kept by Eq. 2.
   Pixel-labeled sites keep every case with its mask (and are augmented in their own batches).
2. **Update** on the kept cases only, re-batched (Algorithm 1 trains on d_i): F1 learns from F2's
   refined label and F2 from F1's, the soft Dice loss of Eq. 1.
3. **Aggregate** (Eqs. 4-5): w_i from the kept-case counts and the sites' mean training loss.

FedAdaptAgg (``method="fedadaptagg"``, the paper's baseline) is step 3 with plain supervised training of
one network on the pixel-labeled cases (``oracle=True``: every site's masks, the paper's [L, L, L] row).
FedAvg (``method="fedavg"``, the paper's other baseline) is the same training averaged by case counts
alone: Eq. 5 with lambda = 0 (w_i = c_i). ``only`` trains one site alone (the local-learning row, LL):
averaging one model is that model.

A site that keeps no case sends nothing that round (weight 0; the released code would train it on a
stale loader). Images and masks are read as ``fedavg_segmentation`` reads them (each image scaled by
its own min and max; its U-Net of MONAI's BasicUNet layout, written out there), and the test metric
is F1's Dice on the pooled test split, as that loop scores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from .fedavg_classification import dihedral_pair
from .fedavg_segmentation import UNet, load_images, load_split, test_dice

PIXEL, BOX, IMAGE, NONE = "pixel", "bbox", "image", "none"

# (value, source): the paper's, or the released code's where the paper prints none.
PAPER = {
    "lr": (1e-3, "paper Sec. IV-B4: Adam, learning rate 1e-3"),
    "weight_decay": (1e-4, "paper Sec. IV-B4: weight decay 1e-4"),
    "batch_size": (16, "paper Sec. IV-B4: batch size 16"),
    "epochs": (1, "paper Sec. IV-B4: one local epoch a round"),
    "epsilon": (0.9, "paper Sec. IV-B4: epsilon = 0.9"),
    "lam": (10.0, "paper Sec. IV-B4: lambda = 10"),
    "beta": (2.5, "paper Sec. IV-B4: beta = 2.5 for skin lesions (1.5 breast; the released skin notebook sets 3)"),
    "threshold": (0.5, "released code helper.select_pl_singleclass: (sigmoid > 0.5)"),
    "box_rule": (True, "released code helper.select_pl_singleclass: a box case also needs dice(refined Y1, box) "
                       ">= 0.5 (the paper's Eq. 2 prints the constraint garbled)"),
    "dice_eps": (1e-4, "released code dice_loss.DiceCoeff: (2 a.b + 1e-4) / (sum a + sum b + 1e-4), per case"),
    "carry_optimizer": (True, "released code skin notebook: each client's two Adams are made once and kept from "
                              "round to round (the paper says nothing)"),
}
CHECK = {k: v for k, (v, _) in PAPER.items()}
# What the check runs instead of the paper's, and why.
LEFT_OUT = {
    "Xavier initialisation (paper Sec. IV-B4)": "PyTorch's default initialisation (FedMix: two independent "
        "draws); the project's networks take MONAI's default, and the project has no Xavier option",
    "256 px resize, random 224 px crop and flips (paper Sec. IV-A1)": "the prepared 32 px images and a random "
        "90-degree turn and flip per case (the preset's augmentation; a crop would cut the boxes)",
    "grayscale input (released code: convert('L'))": "the prepared RGB images, each scaled by its own min and max "
        "(the bundle's scaling)",
    "the released code's L_i (F1's training loss alone)": "the paper's: Eq. 1, both networks' losses, averaged over "
        "the round's batches (the project averages the two networks' losses: a factor 1/2, which cancels in d_i)",
}


def dice(a: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """Per case (B, 1, H, W): (2 a.b + eps) / (sum a + sum b + eps), the released code's coefficient."""
    inter = (a * b).sum((1, 2, 3))
    return (2 * inter + eps) / (a.sum((1, 2, 3)) + b.sum((1, 2, 3)) + eps)


def refine(pred: torch.Tensor, prior: torch.Tensor, level: str) -> torch.Tensor:
    """Sec. III-C: a pseudo label times the case's box / class-presence mask; unlabeled cases as predicted."""
    return pred if level == NONE else pred * prior


def keep(y1: torch.Tensor, y2: torch.Tensor, prior: torch.Tensor, level: str, epsilon: float, box_rule: bool,
         eps: float) -> torch.Tensor:
    """Eq. 2 per case, ``y1``/``y2`` refined: the two agree (dice >= epsilon; two empty labels agree), and a box
    case's Y1 also covers half its box (dice(Y1, box) >= 0.5); an image tagged background-only drops out."""
    ok = dice(y1, y2, eps) >= epsilon
    if level == BOX and box_rule:
        ok &= dice(y1, prior, eps) >= 0.5
    if level == IMAGE:
        ok &= prior.sum((1, 2, 3)) > 0
    return ok


def adaptive_weights(counts, losses, lam: float, beta: float) -> np.ndarray:
    """Eqs. 4-5: c_i = n_i / sum n, d_i = L_i^beta / sum L^beta, w_i = (c_i + lam d_i) / sum (c + lam d)."""
    c = np.asarray(counts, dtype=np.float64)
    c = c / c.sum()
    q = np.asarray(losses, dtype=np.float64) ** beta
    d = q / q.sum() if q.sum() > 0 else np.zeros_like(q)
    w = c + lam * d
    return w / w.sum()


def soft_dice_loss(logits: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """Eq. 1's L_dice: 1 - the per-case soft Dice of sigmoid(logits), averaged over the batch."""
    return (1 - dice(torch.sigmoid(logits), target, eps)).mean()


@torch.no_grad()
def sample_and_refine(f1, f2, x, prior, level: str, s: dict, gen: torch.Generator, augment: bool = True):
    """Algorithm 1's Sample&Refine at one weakly-labeled or unlabeled site: one augmented view per case (image
    and prior together), the received models' refined pseudo labels, and the cases Eq. 2 keeps."""
    f1.eval(), f2.eval()
    xv, pv = dihedral_pair(x, prior, gen) if augment else (x, prior)
    y1 = refine((torch.sigmoid(f1(xv)) > s["threshold"]).float(), pv, level)
    y2 = refine((torch.sigmoid(f2(xv)) > s["threshold"]).float(), pv, level)
    ok = keep(y1, y2, pv, level, s["epsilon"], s["box_rule"], s["dice_eps"])
    return xv[ok], y1[ok], y2[ok]


def update(nets, opt, x, targets, s: dict, gen: torch.Generator, augment: bool) -> float:
    """One epoch on the kept cases in shuffled batches, network j learning ``targets[j]``: FedMix's F1 learns F2's
    label and F2 F1's; at a pixel site every network learns the mask, augmented here. Returns the mean over
    batches of the summed soft Dice losses (Eq. 1 for FedMix)."""
    for net in nets:
        net.train()
    losses = []
    for _ in range(s["epochs"]):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), s["batch_size"]):
            idx = order[i:i + s["batch_size"]]
            xb, ts = x[idx], [t[idx] for t in targets]
            if augment:
                xb, tb = dihedral_pair(xb, torch.cat(ts, 1), gen)
                ts = list(tb.split(1, 1))
            loss = sum(soft_dice_loss(net(xb), t, s["dice_eps"]) for net, t in zip(nets, ts))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return float(np.mean(losses))


def site_level(folder: Path) -> str:
    """A site's supervision level as its ``datalist.json`` names it (one level a site), without reading images."""
    items = json.loads((Path(folder) / "datalist.json").read_text())["training"]
    levels = {it.get("supervision", NONE) for it in items}
    if len(levels) != 1 or not levels <= {PIXEL, BOX, IMAGE, NONE}:
        raise ValueError(f"{Path(folder) / 'datalist.json'}: field 'training[].supervision': one of pixel, bbox, "
                         f"image, none for every case, not {sorted(levels)}")
    return levels.pop()


def read_site(folder: Path, oracle: bool = False):
    """A site's training cases: images (N, 3, H, W), its supervision level, and per case the mask (pixel sites)
    or the prior its weak label gives (boxes [x0, y0, x1, y1, class], exclusive ends, x along the columns).
    ``oracle``: every case with its mask (``oracle.json``), the fully supervised rows."""
    if oracle:
        return (*load_split(folder, json.loads((folder / "oracle.json").read_text())["training"]), PIXEL)
    items = json.loads((folder / "datalist.json").read_text())["training"]
    level = site_level(folder)
    if level == PIXEL:
        x, y = load_split(folder, items)
        return x, y, level
    x = load_images(folder, items)  # no mask is read
    h, w = x.shape[2:]
    prior = torch.zeros(len(items), 1, h, w)
    for n, it in enumerate(items):
        if level == BOX:
            for x0, y0, x1, y1, _k in it["boxes"]:
                prior[n, 0, y0:y1, x0:x1] = 1
        elif level == IMAGE:
            prior[n] = float(bool(it.get("classes")))
        else:
            prior[n] = 1
    return x, prior, level


METHODS = ("fedmix", "fedadaptagg", "fedavg")


def run(data, rounds: int, eval_rounds, seed: int = 0, method: str = "fedmix", oracle: bool = False, log=print,
        only: str | None = None, **settings) -> dict:
    """FedMix, FedAdaptAgg or FedAvg (``method``: plain supervised training of one network on the pixel-labeled
    cases, aggregated by Eqs. 4-5 or by case counts; ``oracle``: every site's masks; ``only``: that site alone),
    over the prepared scenario ``data`` (``settings`` over ``CHECK``): the test Dice of F1 (FedAdaptAgg, FedAvg:
    its network) per eval round."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}: one of {METHODS}")
    s = {**CHECK, **settings}
    data = Path(data)
    scenario = yaml.safe_load((data / "scenario.yaml").read_text())
    site_names = [name for name in scenario["sites"] if only in (None, name)]
    if not site_names:
        raise ValueError(f"{data / 'scenario.yaml'}: field 'sites' has no site {only!r}")
    sites = [read_site(data / name, oracle) for name in site_names]
    if not any(level == PIXEL for _, _, level in sites):
        raise ValueError(f"{data}: {method} needs a site with pixel masks")
    test = load_split(data / "test", json.loads((data / "test" / "datalist.json").read_text())["testing"])
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    names = ("f1", "f2") if method == "fedmix" else ("f1",)
    glob = {name: UNet() for name in names}  # FedMix: two independent draws, F1 and F2 must start different
    opts = {}
    out, seconds, weights_log = {}, [], []
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        states, counts, losses, kept = [], [], [], [0] * len(sites)
        for k, (x, y, level) in enumerate(sites):
            nets = [UNet() for _ in names]
            for net, name in zip(nets, names):
                net.load_state_dict(glob[name].state_dict())
            opt = torch.optim.Adam([p for net in nets for p in net.parameters()], lr=s["lr"],
                                   weight_decay=s["weight_decay"])
            if s["carry_optimizer"] and k in opts:  # Adam's moments carried: the state only, onto the new tensors
                opt.load_state_dict(opts[k])
            if level == PIXEL:
                xs, targets, augment = x, [y] * len(names), True
            elif method == "fedmix":
                xs, r1, r2 = sample_and_refine(*nets, x, y, level, s, gen)
                xs, targets, augment = xs, [r2, r1], False  # F1 learns F2's refined label, F2 learns F1's
            else:
                continue  # FedAdaptAgg and FedAvg train on masks only
            if len(xs) == 0:
                continue  # nothing kept: no update this round
            losses.append(update(nets, opt, xs, targets, s, gen, augment))
            opts[k] = opt.state_dict()
            counts.append(len(xs))
            states.append([net.state_dict() for net in nets])
            kept[k] = len(xs)
        w = adaptive_weights(counts, losses, 0.0 if method == "fedavg" else s["lam"], s["beta"])
        weights_log.append([round(float(v), 4) for v in w])
        for j, name in enumerate(names):
            glob[name].load_state_dict({key: sum(float(wi) * st[j][key].double() for wi, st in zip(w, states))
                                        .to(states[0][j][key].dtype) for key in states[0][j]})
        seconds.append(time.perf_counter() - t0)
        if rnd in eval_rounds:
            out[rnd] = {"dice": test_dice(glob["f1"], *test), "kept": kept}
            log(f"[reference] {method} seed {seed} round {rnd}: {out[rnd]}")
    return {"metrics": out, "seconds_per_round": float(np.mean(seconds)), "seconds": seconds,
            "weights": weights_log}
