"""A site's setup from its bundle: the strong second view a method may ask for."""

import pickle

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


class _RunsCode:
    """A pickled object that, unpickled in full, runs code (here: writes a file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_state_file_is_loaded_as_data_never_as_code(tmp_path):
    """A site state file may come from another machine (a FedBN hospital's personal model is built from
    it): it is read with weights_only=True, so a file naming code is refused and the code never runs.
    A real one, NumPy arrays included (FedMLP's tags), still loads."""
    import numpy as np

    from fedlabels.methods.base import load_state_file, personal_model
    from fedlabels.site import load_state

    marker = tmp_path / "ran"
    torch.save({"round": 0, "run": None, "state": {"bn": {"bn.weight": torch.ones(2)}, "x": _RunsCode(marker)}},
               tmp_path / "evil.pt")
    (tmp_path / "site").mkdir()
    torch.save({"round": 0, "state": {"x": _RunsCode(marker)}}, tmp_path / "site" / "round-00000.pt")
    with pytest.raises(ValueError, match="not a site state file"):
        personal_model({"bn.weight": np.zeros(2, dtype=np.float32)}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_state(tmp_path / "site", None, before=1)
    assert not marker.exists()
    good = {"round": 3, "run": "r", "state": {"bn": {"bn.weight": torch.ones(2)}, "tags": np.zeros((2, 3), np.int8),
                                             "lr": np.float64(0.5)}}
    torch.save(good, tmp_path / "good.pt")
    assert load_state_file(tmp_path / "good.pt")["state"]["tags"].shape == (2, 3)
    assert personal_model({"bn.weight": np.zeros(2, dtype=np.float32)}, tmp_path / "good.pt")["bn.weight"].sum() == 2


def test_a_provisioned_site_without_data_refuses_to_start(tmp_path, monkeypatch):
    """A hospital's kit named site-1 (as the embedded scenario's sites are) with FEDLABELS_DATA unset refuses
    in one line, instead of training on the synthetic data and reporting it as its own. The
    simulator's site workspace (no root certificate) and FEDLABELS_DATA=embedded still get the
    embedded data; a folder named in FEDLABELS_DATA is used as is."""
    import argparse

    from fedlabels.config import RunConfig
    from fedlabels.flare.client import data_root

    kit = tmp_path / "site-1"
    here = kit / "1234-job" / "app_site-1" / "custom"
    here.mkdir(parents=True)
    (kit / "startup").mkdir()
    (kit / "startup" / "rootCA.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    args, cfg = argparse.Namespace(data=None), RunConfig(method="fedavg")
    monkeypatch.delenv("FEDLABELS_DATA", raising=False)
    with pytest.raises(ValueError, match="FEDLABELS_DATA is not set: a provisioned site"):
        data_root(args, cfg, here)
    monkeypatch.setenv("FEDLABELS_DATA", str(tmp_path / "hospital-data"))
    assert data_root(args, cfg, here) == tmp_path / "hospital-data"
    monkeypatch.delenv("FEDLABELS_DATA")
    (kit / "startup" / "rootCA.pem").unlink()  # the simulator's workspace: the embedded data
    assert (data_root(args, cfg, here) / "scenario.yaml").is_file()


class _Counter:
    """A client rule whose whole state is one number: which saved round was restored is visible."""

    def __init__(self):
        self.value = -1

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_a_site_keeps_its_last_two_rounds_per_run_and_resumes_before_the_resumed_round(tmp_path):
    from fedlabels.site import latest_state, load_state, save_state, state_folder, state_site

    a, b = state_folder(tmp_path, "fedavg-run1", "site-1"), state_folder(tmp_path, "fedavg-run2", "site-1")
    c = _Counter()
    for rnd in (0, 1, 2):
        c.value = 10 + rnd
        save_state(a, c, rnd)
    assert sorted(p.name for p in a.iterdir()) == ["round-00001.pt", "round-00002.pt"]
    c.value = 99
    save_state(b, c, 0)  # another job at the same hospital: its own folder
    r = _Counter()
    # resumed at round 2 by a server that died before aggregating it: the state the site had entering round 2
    assert load_state(a, r, before=2) == 1 and r.value == 11
    # a new process inside round 2 (a second draw of that round): the state after its first draw
    assert load_state(a, r, through=2) == 2 and r.value == 12
    assert load_state(a, r, before=1) is None and r.value == 12  # nothing kept that early: untouched
    assert load_state(state_folder(tmp_path, "fedavg-run3", "site-1"), r, before=5) is None  # a site new to the run
    assert load_state(b, r, through=0) == 0 and r.value == 99
    assert latest_state(a).name == "round-00002.pt" and state_site(a) == "site-1"
    assert state_site(latest_state(a)) == "site-1"
    with pytest.raises(FileNotFoundError, match="no saved site state"):
        latest_state(state_folder(tmp_path, "fedavg-run1", "site-9").parent)


def test_the_server_checkpoint_refuses_another_method_and_a_folder_without_one(tmp_path):
    import numpy as np

    from fedlabels.checkpoint import read_checkpoint, write_checkpoint

    with pytest.raises(ValueError, match="no resume checkpoint"):
        read_checkpoint(tmp_path, "fedavg", 3)
    write_checkpoint(tmp_path, next_round=2, method="fedavg", run="fedavg-abc", weights={"w": np.ones(2)},
                     engine={"best": 0.5}, best_weights=None)
    saved = read_checkpoint(tmp_path, "fedavg", 3)
    assert saved["next_round"] == 2 and saved["run"] == "fedavg-abc" and saved["engine"] == {"best": 0.5}
    with pytest.raises(ValueError, match=r"fedlabels_server_state\.pt: field 'method': the run trained 'fedavg', "
                                         r"this job runs 'fedprox'"):
        read_checkpoint(tmp_path, "fedprox", 3)
    with pytest.raises(ValueError, match="field 'next_round'"):
        read_checkpoint(tmp_path, "fedavg", 1)
