"""An independent FedAvg of a multi-label chest X-ray protocol in plain PyTorch: no MONAI, no fedlabels.

It reads a prepared scenario folder itself (each site's ``oracle.json``: every
class annotated; ``test/datalist.json``), loads the grey PNG files with Pillow
(at the training size), scales each image to [0, 1] by its own min and max,
and trains a ResNet-18 of MONAI's layout (7x7 stride-2 stem, 3x3 max-pool,
basic blocks [2, 2, 2, 2], 1x1-conv shortcuts with bias, Kaiming fan-out init) with a
binary cross-entropy whose positive term is weighted by N_neg / N_pos of the
site's own training cases. Weak augmentation as the bundle's: with
probability 1/2 a random affine (rotation within 0.1 rad, scale within 10 %
per axis, shift within 3 px, border padding), then with probability 0.3 a
gamma contrast change in [0.8, 1.25]. Every round each site starts from the
global model with a fresh Adam; the server averages every tensor by case
counts. Test metric: the mean over classes of the one-vs-rest AUROC.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image
from torch import nn
from torch.nn import functional as F

from . import fedavg


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.short = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
        return F.relu(out + (x if self.short is None else self.short(x)))


class ResNet18(nn.Module):
    def __init__(self, cin: int, classes: int, widen: float = 1.0):
        super().__init__()
        w = [int(c * widen) for c in (64, 128, 256, 512)]
        self.stem = nn.Sequential(nn.Conv2d(cin, w[0], 7, 2, 3, bias=False), nn.BatchNorm2d(w[0]), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], w[0]
        for i, cout in enumerate(w):
            layers += [Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


GREY = ("luma", "mean")


def grey(path: Path, rule: str = "luma") -> np.ndarray:
    """An image as one grey channel: Pillow's ``convert("L")`` (ITU-R 601 luma, 0.299 R + 0.587 G + 0.114 B) or
    (``"mean"``) the plain mean of R, G and B, the chest X-ray bundles' rule (``Ensure2DChannelsd``); a grey
    image is the same either way."""
    if rule not in GREY:
        raise ValueError(f"grey {rule!r}: one of {GREY}")
    im = Image.open(path)
    if rule == "mean" and im.mode not in ("L", "I", "I;16", "F"):
        return np.asarray(im.convert("RGB"), dtype=np.float32).mean(-1)
    return np.asarray(im.convert("L"), dtype=np.float32)


def load_split(folder: Path, items: list, scaling: str = "minmax", grey_rule: str = "luma"):
    images = np.stack([grey(folder / it["image"], grey_rule)[None] for it in items])
    if scaling == "fixed":  # the 0-255 range to [-1, 1] (MedMNIST's Normalize(0.5, 0.5))
        images = images / 127.5 - 1.0
    else:  # each image by its own min and max, to [0, 1]
        lo, hi = images.min(axis=(1, 2, 3), keepdims=True), images.max(axis=(1, 2, 3), keepdims=True)
        images = (images - lo) / np.maximum(hi - lo, 1e-8)
    return torch.from_numpy(images), torch.tensor([it["label"] for it in items], dtype=torch.float32)


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    n, size = len(x), x.shape[-1]
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(n, generator=gen)  # noqa: E731
    apply = torch.rand(n, generator=gen) < 0.5
    angle, sx, sy = u(-0.1, 0.1), 1 + u(-0.1, 0.1), 1 + u(-0.1, 0.1)
    tx, ty = u(-3, 3) * 2 / size, u(-3, 3) * 2 / size
    cos, sin = torch.cos(angle), torch.sin(angle)
    # output -> input sampling grid: the inverse of scale-then-rotate-then-shift, in normalized coordinates
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 1], theta[:, 1, 0], theta[:, 1, 1] = cos / sx, sin / sx, -sin / sy, cos / sy
    theta[:, 0, 2], theta[:, 1, 2] = -(theta[:, 0, 0] * tx + theta[:, 0, 1] * ty), -(theta[:, 1, 0] * tx + theta[:, 1, 1] * ty)
    warped = F.grid_sample(x, F.affine_grid(theta, list(x.shape), align_corners=False), padding_mode="border",
                           align_corners=False)
    x = torch.where(apply[:, None, None, None], warped, x)
    gamma = u(0.8, 1.25)
    contrast = torch.rand(n, generator=gen) < 0.3
    lo = x.amin(dim=(1, 2, 3), keepdim=True)
    rng = x.amax(dim=(1, 2, 3), keepdim=True) - lo
    adjusted = ((x - lo) / (rng + 1e-7)) ** gamma[:, None, None, None] * rng + lo
    return torch.where(contrast[:, None, None, None], adjusted, x)


def load_scenario(data: Path, scaling: str, labels: str = "datalist.json", grey_rule: str = "luma",
                  only: str | None = None, keep_unannotated: bool = False) -> tuple:
    """A prepared scenario: (classes, [(x, y) per site] from each site's ``labels`` file, (x, y) of the test split);
    colour images made grey by ``grey_rule`` (``grey``). A site annotating no class (every label -1) is left out:
    FedMLP's and FedPSL's clients each annotate some class, so the papers say nothing of a site annotating none;
    the multi-label references let it sit out every round (the shared rounds average the others), a stated choice
    (``UNANNOTATED``; ``keep_unannotated``: kept, for a reference that draws sites). ``only``: that site alone (a
    table's floor), refused if unknown or annotating nothing."""
    scenario = yaml.safe_load((data / "scenario.yaml").read_text())
    classes, names = scenario["classes"], scenario["sites"]
    if only is not None and only not in names:
        raise ValueError(f"only={only!r}: the scenario's sites are {names}")
    sites = [load_split(data / s, json.loads((data / s / labels).read_text())["training"], scaling, grey_rule)
             for s in names if only in (None, s)]
    sites = [(x, y) for x, y in sites if keep_unannotated or bool((y >= 0).any())]
    if only is not None and not sites:
        raise ValueError(f"only={only!r}: {data / only / labels} annotates no class, so the site trains nothing")
    test = load_split(data / "test", json.loads((data / "test" / "datalist.json").read_text())["testing"], scaling,
                      grey_rule)
    return classes, sites, test


# what the multi-label references do with a site annotating no class (load_scenario), as their LEFT_OUT says it
UNANNOTATED = {"unannotated_site": "a site annotating no class sits out every round (the papers' clients each "
                                   "annotate some class; the project's sites abstain likewise)"}


def batcher(gen: torch.Generator, batch_size: int, smallest: int = 2):
    """Each epoch's batches of case indices, shuffled by ``gen``; a last batch under ``smallest`` cases is dropped
    (batch norm cannot train on one case)."""
    def batches(n):
        order = torch.randperm(n, generator=gen)
        return [order[i:i + batch_size] for i in range(0, n, batch_size) if min(batch_size, n - i) >= smallest]
    return batches


@torch.no_grad()
def macro_auroc(net, images, labels) -> float:
    from sklearn.metrics import roc_auc_score

    net.eval()
    probs = torch.cat([torch.sigmoid(net(images[i:i + 64])) for i in range(0, len(images), 64)]).numpy()
    y = labels.numpy()
    scores = [roc_auc_score(y[:, c], probs[:, c]) for c in range(y.shape[1]) if 0 < y[:, c].sum() < len(y)]
    return float(np.mean(scores))


def run(data, rounds: int, eval_rounds, seed: int = 0, lr: float = 1e-3, weight_decay: float = 0.0,
        batch_size: int = 16, epochs: int = 1, widen: float = 1.0, scaling: str = "minmax", log=print) -> dict:
    data = Path(data)
    scenario = yaml.safe_load((data / "scenario.yaml").read_text())
    classes = len(scenario["classes"])
    sites = [load_split(data / s, json.loads((data / s / "oracle.json").read_text())["training"], scaling)
             for s in scenario["sites"]]
    test = load_split(data / "test", json.loads((data / "test" / "datalist.json").read_text())["testing"], scaling)
    pos_weights = []
    for _, y in sites:  # N_neg / N_pos per class of the site's own cases; 1 where a class lacks either
        pos, neg = y.sum(0), (1 - y).sum(0)
        pos_weights.append(torch.where((pos > 0) & (neg > 0), neg / pos.clamp(min=1), torch.ones_like(pos)))
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    def loss(net, x, y, site):
        return F.binary_cross_entropy_with_logits(net(augment(x, gen)), y, pos_weight=pos_weights[site])

    return fedavg.run(lambda: ResNet18(1, classes, widen), sites, loss, lambda net: {"auroc": macro_auroc(net, *test)},
                      rounds, eval_rounds, gen, lr, batch_size, epochs, weight_decay, log=log, tag=f"seed {seed} ")


