"""FedMix's jobs in the real nvflare simulator (2 sites x 2 rounds, one pixel site and one box or
image-level site, 32 px), and the exported FedMix bundle writing masks for PNG and NIfTI inputs.

The runs are the session's shared ones (``sim_run``): fedmix_lesion also serves
tests/simulator/test_dicom_runs.py. fedavg_full_lesion has no run of its own: FedAvg on the lesion
bundle runs in tests/simulator/test_flare_runs.py (fedavg_lesion) and every site's masks (oracle) here in
fedadaptagg_lesion (tests/simulator/test_flare_runs.py, ``COVERED_BY``).
"""

import json

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.bundle import run as bundle_run
from PIL import Image

from clinical_inputs import NIFTI_AFFINE, write_inputs
from fedlabels.bundle import bundle_path
from fedlabels.bundle.workflows import export_bundle
from fedlabels.flare.commands import evaluate_global
from shared_runs import PRODUCTION, job

pytestmark = pytest.mark.simulator

# FedST's warm-up ends after round 0, so round 1 self-trains at the image-level site.
CHANGES = {"fedst_lesion": {"server": {"warmup_rounds": 1}}}


@pytest.fixture(scope="module")
def lesion(lesion_data):
    """The session's 32 px lesion scenarios: "bbox" (pixel + box site), "image" (pixel + image-level site)."""
    return lesion_data


def lesion_job(name):
    return job(name, image_size=32, **{**PRODUCTION, **CHANGES.get(name, {})})


@pytest.fixture(scope="module")
def runs(sim_run, lesion):
    """``runs(name, kind="bbox")`` -> the server run folder of the job on ``lesion[kind]`` (32 px), once per session."""
    def get(name, kind="bbox"):
        return sim_run(lesion_job(name), lesion[kind])[0]
    return get


# The shared runs each test asks for, started in the background as the session starts (tests/conftest.py).
SHARED_RUNS = {
    "test_fedmix_job_federates_two_unets_with_adaptive_weights":
        lambda p: [("lesion_data", "bbox", lesion_job("fedmix_lesion"), {})],
    "test_fedst_job_self_trains_the_image_level_site_after_warmup":
        lambda p: [("lesion_data", "image", lesion_job("fedst_lesion"), {})],
    "test_full_label_jobs_train_every_site_on_its_masks": lambda p: [("lesion_data", "bbox", lesion_job(p["name"]), {})],
    "test_exported_fedmix_bundle_writes_masks_for_png_and_nifti":
        lambda p: [("lesion_data", "bbox", lesion_job("fedmix_lesion"), {})],
}


def rounds(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def global_state(run_dir, name="FL_global_model.pt"):
    return torch.load(run_dir / "app_server" / name, weights_only=False)["model"]


def test_fedmix_job_federates_two_unets_with_adaptive_weights(runs, lesion):
    run_dir = runs("fedmix_lesion")
    recs = rounds(run_dir)
    assert [r["round"] for r in recs] == [0, 1] and all(r["aggregated"] and not r["dropped"] for r in recs)
    state = global_state(run_dir)
    assert {k.split(".")[0] for k in state} == {"f1", "f2"}
    assert not all(torch.equal(state[f"f1.{k}"], state[f"f2.{k}"]) for k in
                   [k[3:] for k in state if k.startswith("f1.")])  # two networks, not one copied
    for r in recs:
        # the pixel site keeps every case; the box site keeps some or abstains (weight 0), never fails
        assert r["sites"]["site-1"]["n"] == r["sites"]["site-1"]["kept_cases"] > 0
        assert "site-2" in r["abstained"] or r["sites"]["site-2"]["n"] > 0
        assert any(note.startswith("adaptive weights: site-1") for note in r.get("notes", [])), r.get("notes")
    assert evaluate_global(run_dir, bundle_path("lesion_unet"), lesion["bbox"], "best")["dice"] is not None


def test_fedst_job_self_trains_the_image_level_site_after_warmup(runs):
    recs = rounds(runs("fedst_lesion", "image"))
    assert recs[0]["abstained"] == ["site-2"]           # warm-up: pixel-labeled sites only
    assert recs[1]["abstained"] == [] and recs[1]["sites"]["site-2"]["n"] > 0


@pytest.mark.parametrize("name", ["fedadaptagg_lesion"])
def test_full_label_jobs_train_every_site_on_its_masks(name, runs):
    recs = rounds(runs(name))
    assert all(not r["abstained"] and r["aggregated"] for r in recs)
    assert all(r["sites"][s]["n"] > 0 for r in recs for s in ("site-1", "site-2"))
    if name == "fedadaptagg_lesion":
        assert all(any(n.startswith("adaptive weights") for n in r.get("notes", [])) for r in recs)


def _infer(exp, inputs, out):
    bundle_run(config_file=str(exp / "configs" / "inference.json"), meta_file=str(exp / "configs" / "metadata.json"),
               logging_file=False, bundle_root=str(exp), dataset_dir=str(inputs), output_dir=str(out), device="cpu")


def test_exported_fedmix_bundle_writes_masks_for_png_and_nifti(runs, lesion, tmp_path):
    run_dir = runs("fedmix_lesion")
    ckpt = run_dir / "app_server" / "best_FL_global_model.pt"
    first = export_bundle("lesion_unet", ckpt, tmp_path / "first", run=run_dir)
    both = export_bundle("lesion_unet", ckpt, tmp_path / "mean", run=run_dir, twin="mean")
    infer = json.loads((first / "configs" / "inference.json").read_text())
    assert infer["network_def"]["_target_"] == "BasicUNet" and infer["image_size"] == 32
    shipped = torch.load(first / "models" / "model.pt", weights_only=True)
    state = global_state(run_dir, "best_FL_global_model.pt")
    assert set(shipped) == {k[3:] for k in state if k.startswith("f1.")}
    assert all(torch.equal(shipped[k], state[f"f1.{k}"]) for k in shipped)  # F1 ships, unchanged
    assert json.loads((both / "configs" / "inference.json").read_text())["network_def"]["output"] == "mean"

    src = sorted((lesion["bbox"] / "test" / "images").glob("*.png"))[:2]
    inputs = tmp_path / "in"
    for f in src:
        write_inputs(inputs, f)
    for exp in (first, both):
        out = tmp_path / f"out-{exp.name}"
        _infer(exp, inputs, out)
        for f in src:
            shape_yx = np.asarray(Image.open(f)).shape[:2]
            png = np.asarray(Image.open(out / f"{f.stem}_seg.png"))
            assert png.shape == shape_yx and set(np.unique(png)) <= {0, 255}
            mask = nib.load(str(out / f"{f.stem}_n_seg.nii.gz"))
            assert mask.get_fdata().squeeze().shape == shape_yx[::-1] and np.allclose(mask.affine, NIFTI_AFFINE)
            assert set(np.unique(mask.get_fdata())) <= {0, 1}
