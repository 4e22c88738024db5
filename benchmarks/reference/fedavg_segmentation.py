"""An independent FedAvg of a segmentation protocol in plain PyTorch: no MONAI, no fedlabels.

It reads a prepared scenario folder itself (each site's ``oracle.json``: every
case with its pixel mask; ``test/datalist.json``), loads images and masks with
Pillow (they must already be at the training size: prepare with ``--size``),
scales each image to [0, 1] by its own min and max, and trains a U-Net of
MONAI's BasicUNet layout (two 3x3 conv + GroupNorm + LeakyReLU(0.1) per level,
max-pool down, 2x2 transposed conv up, skip concatenation) written out here,
with the soft Dice loss on sigmoid outputs. Every round each site starts from
the global model with a fresh Adam (lr, weight decay), trains ``epochs``
passes with a random flip / 90-degree turn per case (image and mask
together), and the server averages the weights by case counts. Test metric:
Dice of the 0.5-thresholded mask per case, averaged.
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
from .fedavg_classification import dihedral_pair


def two_conv(cin: int, cout: int, groups: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(groups, cout), nn.LeakyReLU(0.1),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(groups, cout), nn.LeakyReLU(0.1))


class UNet(nn.Module):
    def __init__(self, cin=3, cout=1, f=(16, 16, 32, 64, 128, 16), groups=8):
        super().__init__()
        self.enc = nn.ModuleList([two_conv(cin, f[0], groups)] + [two_conv(f[i], f[i + 1], groups) for i in range(4)])
        # decoder level i (deepest first): upsample f[i+1] (halved except at the top), concat skip f[i]
        outs = [f[3], f[2], f[1], f[5]]
        ins = [f[4], f[3], f[2], f[1]]
        skips = [f[3], f[2], f[1], f[0]]
        self.up = nn.ModuleList([nn.ConvTranspose2d(i, i // 2 if j < 3 else i, 2, stride=2) for j, i in enumerate(ins)])
        self.dec = nn.ModuleList([two_conv(s + (i // 2 if j < 3 else i), o, groups)
                                  for j, (i, s, o) in enumerate(zip(ins, skips, outs))])
        self.final = nn.Conv2d(f[5], cout, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.enc):
            x = block(x if i == 0 else nn.functional.max_pool2d(x, 2))
            skips.append(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips[:-1])):
            x = dec(torch.cat([skip, up(x)], 1))
        return self.final(x)


def soft_dice_loss(logits, target, eps=1e-5):
    p = torch.sigmoid(logits)
    inter = (p * target).sum((2, 3))
    return (1 - (2 * inter + eps) / (p.sum((2, 3)) + target.sum((2, 3)) + eps)).mean()


def load_images(folder: Path, items: list) -> torch.Tensor:
    """(N, 3, H, W): each image scaled to [0, 1] by its own min and max."""
    images = []
    for it in items:
        img = np.asarray(Image.open(folder / it["image"]).convert("RGB"), dtype=np.float32).transpose(2, 0, 1)
        lo, hi = img.min(), img.max()
        images.append((img - lo) / max(hi - lo, 1e-8))
    return torch.from_numpy(np.stack(images))


def load_split(folder: Path, items: list):
    masks = [(np.asarray(Image.open(folder / it["seg"]).convert("L")) > 127).astype(np.float32)[None] for it in items]
    return load_images(folder, items), torch.from_numpy(np.stack(masks))


@torch.no_grad()
def test_dice(net, images, masks) -> float:
    net.eval()
    pred = torch.cat([torch.sigmoid(net(images[i:i + 32])) > 0.5 for i in range(0, len(images), 32)]).float()
    inter, total = (pred * masks).sum((1, 2, 3)), pred.sum((1, 2, 3)) + masks.sum((1, 2, 3))
    dice = torch.where(total > 0, 2 * inter / total.clamp(min=1), torch.ones_like(total))
    return float(dice.mean())


def run(data, rounds: int, eval_rounds, seed: int = 0, lr: float = 1e-3, weight_decay: float = 1e-4,
        batch_size: int = 16, epochs: int = 1, log=print) -> dict:
    data = Path(data)
    scenario = yaml.safe_load((data / "scenario.yaml").read_text())
    sites = [load_split(data / s, json.loads((data / s / "oracle.json").read_text())["training"])
             for s in scenario["sites"]]
    test = load_split(data / "test", json.loads((data / "test" / "datalist.json").read_text())["testing"])
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    def loss(net, x, y, site):
        xb, yb = dihedral_pair(x, y, gen)
        return soft_dice_loss(net(xb), yb)

    return fedavg.run(UNet, sites, loss, lambda net: {"dice": test_dice(net, *test)}, rounds, eval_rounds, gen, lr,
                      batch_size, epochs, weight_decay, log=log, tag=f"seed {seed} ")
