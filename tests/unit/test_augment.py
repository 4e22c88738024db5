"""fedlabels.bundle.augment: MONAI's random affine and contrast change, drawn per case, applied per batch.

Each case of a batch is checked against MONAI's own deterministic ``Affine`` and ``AdjustContrast``
with the parameters drawn for it; the draws against the ranges and probabilities of the per-case
transforms they replace; a site's loader with the ``cxr`` preset against a reseed (a resumed round
draws what the uninterrupted one drew).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from monai.transforms import AdjustContrast, Affine

from fedlabels.bundle import read
from fedlabels.bundle.augment import BatchCollate, BatchRandAdjustContrast, BatchRandAffine
from fedlabels.methods.base import SiteContext
from fedlabels.profile import SiteProfile
from fedlabels.site import setup_site


def _images(n=6, h=32, w=28):  # not square: rows and columns must not be swapped
    return torch.rand(n, 1, h, w, generator=torch.Generator().manual_seed(0))


def test_each_case_is_monais_affine_with_its_own_drawn_parameters():
    t = BatchRandAffine(prob=0.5, rotate_range=0.1, scale_range=[0.1, 0.1], translate_range=[3, 3])
    t.set_random_state(seed=3)
    images = _images()
    params = t.randomize(len(images))
    assert 0 < params["apply"].sum() < len(images)  # this seed applies to some cases, not all
    out = t(images, params)
    for i, img in enumerate(images):
        if not params["apply"][i]:
            assert torch.equal(out[i], img)
            continue
        ref = Affine(rotate_params=float(params["rotate"][i]), scale_params=tuple(map(float, params["scale"][i])),
                     translate_params=tuple(map(float, params["shift"][i])), padding_mode="border", image_only=True)(img)
        assert torch.allclose(out[i], torch.as_tensor(ref), atol=1e-5), i
        assert not torch.allclose(out[i], img, atol=1e-3)  # the warp did something
    # every case draws its own parameters
    assert len(set(np.round(params["rotate"], 6))) == len(images)


def test_each_case_is_monais_contrast_change_with_its_own_gamma():
    t = BatchRandAdjustContrast(prob=1.0, gamma=(0.8, 1.25))
    t.set_random_state(seed=1)
    images = _images() * 3 - 1  # each case its own min and range
    params = t.randomize(len(images))
    out = t(images, params)
    for i, img in enumerate(images):
        ref = AdjustContrast(gamma=float(params["gamma"][i]))(img)
        assert torch.allclose(out[i], torch.as_tensor(ref), atol=1e-5), i


def test_draws_follow_the_per_case_transforms_ranges_and_probability():
    t = BatchRandAffine(prob=0.5, rotate_range=0.1, scale_range=[0.1, 0.2], translate_range=[3, 1])
    t.set_random_state(seed=0)
    p = t.randomize(20_000)
    assert abs(p["apply"].mean() - 0.5) < 0.02
    assert np.abs(p["rotate"]).max() <= 0.1 and np.abs(p["rotate"]).max() > 0.099
    assert np.abs(p["scale"][:, 0] - 1).max() <= 0.1 and np.abs(p["scale"][:, 1] - 1).max() > 0.19
    assert np.abs(p["shift"][:, 0]).max() <= 3 and np.abs(p["shift"][:, 1]).max() <= 1
    c = BatchRandAdjustContrast(prob=0.3, gamma=(0.8, 1.25))
    c.set_random_state(seed=0)
    q = c.randomize(20_000)
    assert abs(q["apply"].mean() - 0.3) < 0.02 and q["gamma"].min() >= 0.8 and q["gamma"].max() <= 1.25
    assert torch.equal(t(_images(), {**p, "apply": np.zeros(6, bool)}), _images())  # prob 0: untouched
    # single numbers read as MONAI reads them: the first axis's range; a contrast gamma g is U(0.5, g)
    one = BatchRandAffine(prob=1.0, scale_range=0.1, translate_range=2)
    one.set_random_state(seed=0)
    p = one.randomize(1000)
    assert np.all(p["scale"][:, 1] == 1) and np.abs(p["scale"][:, 0] - 1).max() > 0.09
    assert np.all(p["shift"][:, 1] == 0) and np.abs(p["shift"][:, 0]).max() > 1.9
    g = BatchRandAdjustContrast(prob=1.0, gamma=2.0)
    g.set_random_state(seed=0)
    q = g.randomize(1000)["gamma"]
    assert q.min() >= 0.5 and q.min() < 0.6 and q.max() <= 2.0
    with pytest.raises(ValueError, match="above 0.5"):
        BatchRandAdjustContrast(gamma=0.4)


def test_the_cxr_preset_moves_the_augmentation_to_the_batch_and_a_reseed_redraws_it(cxr_data):
    parser = read("cxr_resnet18", cxr_data, preset="cxr")
    assert [t["_target_"] for t in parser.get("train#random_transforms")] == ["EnsureTyped"]
    collate = parser.get_parsed_content("train#dataloader#collate_fn", instantiate=True)  # monai.bundle run's loader
    assert [type(t).__name__ for t in collate.transforms] == ["BatchRandAffine", "BatchRandAdjustContrast"]
    plain = setup_site("cxr_resnet18", cxr_data, "site-1", seed=0)
    st = setup_site("cxr_resnet18", cxr_data, "site-1", seed=0, config={"preset": "cxr"})
    assert isinstance(st.train_loader.collate_fn, BatchCollate) and not isinstance(plain.train_loader.collate_fn,
                                                                                   BatchCollate)
    ctx = SiteContext(SiteProfile("site-1", "multilabel", st.classes, st.classes, "image"), st.train_loader, {},
                      seed=st.seed)

    def one_pass(round):
        ctx.reseed(round)
        return torch.cat([b["image"] for b in st.train_loader])

    first, again, other = one_pass(3), one_pass(3), one_pass(4)
    assert torch.equal(first, again)  # a resumed round draws what the uninterrupted one drew
    assert not torch.equal(first, other)
    # the deterministic view of the same cases, in the same order, is not what trains
    ctx.reseed(3)
    order = torch.cat([b["index"] for b in st.train_loader])
    cached = torch.stack([st.train_loader.dataset[int(i)]["image"] for i in order])
    assert first.shape == cached.shape and not torch.allclose(first, cached)


@pytest.mark.parametrize("bundle", ["cxr_resnet18", "cxr_densenet121"])
def test_without_a_preset_the_bundles_keep_their_per_case_augmentation(bundle, cxr_data):
    parser = read(bundle, cxr_data)
    assert parser.get("train#batch_transforms") == []
    assert "RandAffined" in [t["_target_"] for t in parser.get("train#random_transforms")]
    collate = parser.get_parsed_content("train#dataloader#collate_fn", instantiate=True)
    assert collate.transforms == []
