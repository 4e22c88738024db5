"""A site's setup from its bundle: the strong second view a method may ask for."""

import pytest
import torch

from fedlabels.data.synthetic import generate
from fedlabels.bundle import bundle_path
from fedlabels.methods.base import SiteContext
from fedlabels.site import setup_site


def test_strong_view_is_a_perturbed_copy_and_reseeds(tmp_path):
    data = generate("lesion", tmp_path / "lesion", seed=0, cases=12, test_cases=4)
    setup = setup_site(bundle_path("lesion_unet"), data, "site-1", batch_size=4, strong_view=True)
    ctx = setup.context()
    ctx.reseed(3)
    batch = next(iter(setup.train_loader))
    assert batch["image_strong"].shape == batch["image"].shape
    assert not torch.equal(batch["image_strong"], batch["image"])
    # photometric only: where dropout left the image alone the structure is the same view's
    assert torch.corrcoef(torch.stack([batch["image"].flatten(), batch["image_strong"].flatten()]))[0, 1] > 0.5
    ctx.reseed(3)
    again = next(iter(setup.train_loader))
    assert torch.equal(again["image_strong"], batch["image_strong"]) and torch.equal(again["label"], batch["label"])
    ctx.reseed(4)
    assert not torch.equal(next(iter(setup.train_loader))["image_strong"], batch["image_strong"])


def test_one_view_unless_asked(tmp_path):
    data = generate("lesion", tmp_path / "lesion", seed=0, cases=12, test_cases=4)
    setup = setup_site(bundle_path("lesion_unet"), data, "site-1", batch_size=4)
    assert "image_strong" not in next(iter(setup.train_loader))
    assert isinstance(setup.context(), SiteContext)


def test_context_keeps_the_raw_items_for_the_method(tmp_path):
    """A supervised loader holds the pixel-labeled cases only; the method still sees every
    case's supervision level and boxes through the context."""
    data = generate("lesion", tmp_path / "lesion", seed=0, cases=12, test_cases=4)
    setup = setup_site(bundle_path("lesion_unet"), data, "site-2", batch_size=4)
    ctx = setup.context()
    levels = {i.get("supervision", setup.site.profile.supervision) for i in ctx.items}
    assert len(ctx.items) == len(setup.site.training) > 0
    assert "pixel" not in levels and len(setup.train_loader.dataset) == 0  # nothing a Dice loss can use
    assert any(i.get("boxes") for i in ctx.items)


@pytest.mark.parametrize("family, bundle", [("medmnist", "medmnist_cnn"), ("cxr", "cxr_resnet18"),
                                            ("lesion", "lesion_unet")])
def test_training_draws_leave_the_cached_cases_unchanged(family, bundle, tmp_path):
    """The cache is not copied before the random transforms: none of them may write into it."""
    data = generate(family, tmp_path / family, seed=0, sites=4 if family == "cxr" else 2, cases=16, test_cases=4)
    setup = setup_site(bundle_path(bundle), data, "site-1", strong_view=True)
    cached = setup.train_loader.dataset.weak
    before = [{k: v.clone() for k, v in case.items() if torch.is_tensor(v)} for case in cached._cache]
    assert before and all(before)
    drawn = sum(len(batch["image_strong"]) for _ in range(3) for batch in setup.train_loader)
    assert drawn == 3 * len(cached)
    for old, case in zip(before, cached._cache):
        assert all(torch.equal(v, case[k]) for k, v in old.items())
