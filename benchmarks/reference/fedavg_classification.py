"""An independent FedAvg of a classification protocol in plain PyTorch: no MONAI, no fedlabels.

It reads a prepared scenario folder itself (``scenario.yaml``, each site's
``oracle.json``: every site fully labeled; ``test/datalist.json``), loads the
PNG files with Pillow and trains IsoFed's CNN with FedAvg: every round each
site starts from the global model with a fresh Adam, trains ``epochs`` passes
in shuffled batches (``augment``: a random left-right flip per image, a random
flip / 90-degree turn, or none), and the
server averages the weights by the sites' case counts. ``scaling`` is the
input scaling under test: ``fixed`` = x / 127.5 - 1 (MedMNIST's
``Normalize(0.5, 0.5)``), ``minmax`` = each image to [0, 1] by its own min and
max. Used by ``benchmarks/reference_check.py``; deliberately short, so it can
be read against the protocol in one sitting.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image
from torch import nn

from . import fedavg


class IsoFedCNN(nn.Module):
    """Two 5x5 conv + 2x2 max-pool, two FC layers, a two-layer MLP, a linear head (28 px input)."""

    def __init__(self, in_channels: int, classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, 84), nn.ReLU(), nn.Linear(84, 84), nn.ReLU(), nn.Linear(84, classes))

    def forward(self, x):
        return self.body(x)


def load_split(folder: Path, items: list, channels: int, scaling: str):
    """(N, C, H, W) float images and (N,) class labels."""
    images = np.stack([np.asarray(Image.open(folder / it["image"])) for it in items]).astype(np.float32)
    if images.ndim == 3:
        images = images[..., None]
    images = np.repeat(images, channels // images.shape[-1], axis=-1).transpose(0, 3, 1, 2)
    if scaling == "fixed":
        images = images / 127.5 - 1.0
    elif scaling == "minmax":
        lo = images.min(axis=(1, 2, 3), keepdims=True)
        hi = images.max(axis=(1, 2, 3), keepdims=True)
        images = (images - lo) / np.maximum(hi - lo, 1e-8)
    else:
        raise ValueError(f"scaling {scaling!r}: use fixed or minmax")
    labels = np.array([int(np.ravel(it["label"])[0]) for it in items])
    return torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels)


def hflip(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Each image mirrored left-right with probability 1/2."""
    flip = torch.randint(0, 2, (len(x),), generator=gen).bool()
    out = x.clone()
    out[flip] = torch.flip(x[flip], dims=(3,))
    return out


def dihedral_pair(x: torch.Tensor, y: torch.Tensor | None, gen: torch.Generator):
    """Each image (and its mask ``y``) turned by a random multiple of 90 degrees, then flipped with probability 1/2."""
    k = torch.randint(0, 4, (len(x),), generator=gen)
    flip = torch.randint(0, 2, (len(x),), generator=gen).bool()
    outs = []
    for t in (x, y):
        if t is None:
            outs.append(None)
            continue
        out = t.clone()
        for turns in range(1, 4):
            sel = k == turns
            if sel.any():
                out[sel] = torch.rot90(t[sel], turns, dims=(2, 3))
        out[flip] = torch.flip(out[flip], dims=(3,))
        outs.append(out)
    return outs


def dihedral(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return dihedral_pair(x, None, gen)[0]


@torch.no_grad()
def test_metrics(net, images, labels, classes: int) -> dict:
    from sklearn.metrics import roc_auc_score

    net.eval()
    probs = torch.cat([torch.softmax(net(images[i:i + 256]), 1) for i in range(0, len(images), 256)]).numpy()
    y = labels.numpy()
    auroc = roc_auc_score(y, probs[:, 1]) if classes == 2 else roc_auc_score(y, probs, multi_class="ovr")
    return {"accuracy": float((probs.argmax(1) == y).mean()), "auroc": float(auroc),
            "classes_predicted": int(len(set(probs.argmax(1).tolist())))}


AUGMENT = {"hflip": hflip, "dihedral": dihedral, "none": lambda x, gen: x}


def run(data, rounds: int, eval_rounds, seed: int = 0, scaling: str = "fixed", augment: str = "hflip",
        lr: float = 1e-3, batch_size: int = 64, epochs: int = 1, channels: int = 3, log=print) -> dict:
    """FedAvg with every site labeled; test metrics at each eval round and the training seconds per round."""
    data = Path(data)
    scenario = yaml.safe_load((data / "scenario.yaml").read_text())
    classes = len(scenario["classes"])
    sites = []
    for name in scenario["sites"]:
        items = json.loads((data / name / "oracle.json").read_text())["training"]
        sites.append(load_split(data / name, items, channels, scaling))
    test = load_split(data / "test", json.loads((data / "test" / "datalist.json").read_text())["testing"],
                      channels, scaling)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    def loss(net, x, y, site):
        return nn.functional.cross_entropy(net(AUGMENT[augment](x, gen)), y)

    return fedavg.run(lambda: IsoFedCNN(channels, classes), sites, loss,
                      lambda net: test_metrics(net, *test, classes), rounds, eval_rounds, gen, lr, batch_size,
                      epochs, log=log, tag=f"seed {seed} ")
