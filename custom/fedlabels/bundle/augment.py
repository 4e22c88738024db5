"""Random augmentation of a whole training batch at once: a draw per case, one warp for the batch.

MONAI's ``RandAffined`` and ``RandAdjustContrastd`` run per case in the data loader; at 32 px that
costs about 0.6 ms a case, a third of a narrow ResNet-18's training step. The classes here draw
their parameters per case exactly as those transforms do (same ranges, same probability, from the
transform's ``R``) and apply them to the collated batch in one ``grid_sample``: the same
augmentation (``tests/unit/test_augment.py`` checks each case against MONAI's ``Affine`` and
``AdjustContrast`` with the drawn parameters), a fraction of the cost. A bundle opts in with
``train#batch_transforms`` (``BatchCollate`` becomes its training loader's ``collate_fn``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from monai.data import list_data_collate
from monai.transforms import Randomizable


def _ranges(value, axes: int) -> list:
    """MONAI's reading of a RandAffine range: one entry per axis (a number f: U(-f, f); a pair: U(lo, hi));
    a single number is the first axis's, the axes not given do not move."""
    value = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    value = (value + [None] * axes)[:axes]
    return [(0.0, 0.0) if f is None else (float(f[0]), float(f[1])) if isinstance(f, Sequence) else (-float(f), float(f))
            for f in value]


class BatchRandAffine(Randomizable):
    """``RandAffine(prob, rotate_range, scale_range, translate_range, padding_mode)`` of 2D images, per case of a
    (B, C, H, W) batch: with probability ``prob`` a rotation drawn from ``rotate_range`` (rad), a scale of
    1 + a draw from ``scale_range`` and a shift of a draw from ``translate_range`` (pixels) per axis, about
    the image centre, read and applied as MONAI does; bilinear."""

    def __init__(self, prob=0.1, rotate_range=0.0, scale_range=0.0, translate_range=0.0, padding_mode="border"):
        self.prob = float(prob)
        self.rotate = _ranges(rotate_range, 1)[0]  # 2D: one angle
        self.scale, self.shift = _ranges(scale_range, 2), _ranges(translate_range, 2)
        self.padding_mode = padding_mode

    def randomize(self, n: int) -> dict:
        draw = lambda r: self.R.uniform(r[0], r[1], n)  # noqa: E731
        return {"apply": self.R.rand(n) < self.prob, "rotate": draw(self.rotate),
                "scale": np.stack([1 + draw(self.scale[0]), 1 + draw(self.scale[1])], 1),
                "shift": np.stack([draw(self.shift[0]), draw(self.shift[1])], 1)}

    @staticmethod
    def theta(params: dict, size: tuple) -> torch.Tensor:
        """grid_sample's (B, 2, 3) matrices: MONAI's rotate @ translate @ scale in centred pixel coordinates
        (row, column), moved to normalized (x, y) coordinates."""
        rot = torch.as_tensor(params["rotate"], dtype=torch.float32)
        scale = torch.as_tensor(params["scale"], dtype=torch.float32)
        shift = torch.as_tensor(params["shift"], dtype=torch.float32)
        n = len(rot)
        a = torch.zeros(n, 3, 3)
        a[:, 0, 0], a[:, 0, 1] = torch.cos(rot) * scale[:, 0], -torch.sin(rot) * scale[:, 1]
        a[:, 1, 0], a[:, 1, 1] = torch.sin(rot) * scale[:, 0], torch.cos(rot) * scale[:, 1]
        a[:, 0, 2] = torch.cos(rot) * shift[:, 0] - torch.sin(rot) * shift[:, 1]
        a[:, 1, 2] = torch.sin(rot) * shift[:, 0] + torch.cos(rot) * shift[:, 1]
        a[:, 2, 2] = 1
        h, w = size
        swap = torch.tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, 1]])  # (row, column) <-> (x, y)
        to_norm, from_norm = torch.diag(torch.tensor([2 / w, 2 / h, 1.0])), torch.diag(torch.tensor([w / 2, h / 2, 1.0]))
        return (to_norm @ swap @ a @ swap @ from_norm)[:, :2]

    def __call__(self, images: torch.Tensor, params: dict | None = None) -> torch.Tensor:
        params = params or self.randomize(len(images))
        apply = torch.as_tensor(params["apply"])
        if not apply.any():
            return images
        theta = self.theta(params, tuple(images.shape[-2:])).to(images)
        grid = F.affine_grid(theta, list(images.shape), align_corners=False)
        warped = F.grid_sample(images, grid, mode="bilinear", padding_mode=self.padding_mode, align_corners=False)
        return torch.where(apply.to(images.device)[:, None, None, None], warped, images)


class BatchRandAdjustContrast(Randomizable):
    """``RandAdjustContrast(prob, gamma)`` per case of a batch: with probability ``prob`` the case's intensities
    x -> ((x - min) / range) ** g * range + min, g in U(gamma) (a single number: U(0.5, gamma), as MONAI),
    min and range the case's own."""

    def __init__(self, prob=0.1, gamma=(0.5, 4.5)):
        self.prob = float(prob)
        if isinstance(gamma, Sequence):
            self.gamma = (float(gamma[0]), float(gamma[1]))
        elif gamma > 0.5:
            self.gamma = (0.5, float(gamma))
        else:
            raise ValueError(f"gamma: a single number must be above 0.5 (the range is (0.5, gamma)), got {gamma}")

    def randomize(self, n: int) -> dict:
        return {"apply": self.R.rand(n) < self.prob, "gamma": self.R.uniform(self.gamma[0], self.gamma[1], n)}

    def __call__(self, images: torch.Tensor, params: dict | None = None) -> torch.Tensor:
        params = params or self.randomize(len(images))
        apply = torch.as_tensor(params["apply"])
        if not apply.any():
            return images
        dims = tuple(range(1, images.ndim))
        lo = images.amin(dim=dims, keepdim=True)
        span = images.amax(dim=dims, keepdim=True) - lo
        gamma = torch.as_tensor(params["gamma"], dtype=images.dtype).view(-1, *([1] * (images.ndim - 1)))
        adjusted = ((images - lo) / (span + 1e-7)) ** gamma * span + lo
        return torch.where(apply.view(-1, *([1] * (images.ndim - 1))), adjusted, images)


class BatchCollate(Randomizable):
    """A training loader's ``collate_fn``: MONAI's ``list_data_collate``, then each transform on the batch's
    ``keys`` in order. ``set_random_state`` seeds every transform (a site reseeds it each round)."""

    def __init__(self, transforms: Sequence = (), keys: Sequence[str] = ("image",)):
        self.transforms, self.keys = list(transforms), tuple(keys)
        self._worker = None

    def set_random_state(self, seed=None, state=None):
        super().set_random_state(seed, state)
        for i, t in enumerate(self.transforms):
            # offsets no other per-round seed of a site uses (TwoViews seeds its strong view with seed + 1)
            t.set_random_state(seed=None if seed is None else (int(seed) + 7_919 * (i + 1)) % 2**32)
        return self

    def randomize(self, data=None) -> None:  # the transforms draw for themselves
        pass

    def __call__(self, batch):
        worker = torch.utils.data.get_worker_info()
        if worker is not None and self._worker != worker.id:  # each loader worker process its own draws
            self._worker = worker.id
            self.set_random_state(seed=worker.seed % 2**32)
        out = list_data_collate(batch)
        for key in self.keys:
            for t in self.transforms:
                out[key] = t(out[key])
        return out
