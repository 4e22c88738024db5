"""The four MONAI bundles, end to end, through MONAI's own bundle machinery.

Per bundle, on a tiny generated scenario (module-scoped, built once): train one
epoch with ``monai.bundle.ConfigWorkflow`` (``fedlabels.bundle.workflows.train_bundle``),
evaluate on the test split, export (``monai.bundle.ckpt_export``), compare
TorchScript with eager, run ``configs/inference.json`` on new images,
``verify_net_in_out``, and check the metadata against the MONAI bundle
specification's mandatory keys. No mocks: every check can fail.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from monai.bundle import ConfigParser, ConfigWorkflow, run, verify_metadata, verify_net_in_out
from PIL import Image

from fedlabels.bundle import data as bundle_data
from fedlabels.data.synthetic import generate
from fedlabels.bundle import bundle_path
from fedlabels.bundle.workflows import check_torchscript, evaluate_bundle, export_bundle, load_state_dict, train_bundle
from fedlabels.profile import ScenarioError, load_scenario

from clinical_inputs import NIFTI_AFFINE, write_inputs, write_unreadable
from helpers import one_cpu_thread  # noqa: F401  (autouse fixture)

REPO = Path(__file__).resolve().parents[2]
# bundle -> (synthetic family, image size used in the tests)
BUNDLES = {
    "cxr_densenet121": ("cxr", 32),
    "cxr_resnet18": ("cxr", 32),
    "medmnist_cnn": ("medmnist", 28),
    "lesion_unet": ("lesion", 32),
}
TASK = {"cxr": "multilabel", "medmnist": "multiclass", "lesion": "segmentation"}

# MONAI Bundle Specification (docs/source/mb_specification.rst), "metadata.json File":
# the mandatory keys, and the keys every tensor format specifier must hold. The JSON
# schema is not downloadable here, so the list is written out.
MANDATORY_META = ["version", "monai_version", "pytorch_version", "numpy_version", "required_packages_version",
                  "task", "description", "authors", "copyright", "network_data_format"]
TENSOR_KEYS = ["type", "format", "modality", "num_channels", "spatial_shape", "dtype", "value_range",
               "is_patch_data", "channel_def"]
RECOMMENDED_META = ["changelog", "intended_use", "data_source", "data_type", "references"]
# The same specification as a JSON schema, for monai.bundle.verify_metadata offline.
SPEC_SCHEMA = Path(__file__).resolve().parents[1] / "monai_bundle_metadata.schema.json"


def cfg(name, which):
    return str(REPO / "bundles" / name / "configs" / which)


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    root = tmp_path_factory.mktemp("scenarios")
    return {
        "cxr": generate("cxr", root / "cxr", seed=0, size=32, cases=24, test_cases=16),
        "medmnist": generate("medmnist", root / "medmnist", seed=0, cases=160, test_cases=16),
        "lesion": generate("lesion", root / "lesion", seed=0, size=32, cases=24, test_cases=16),
    }


@pytest.fixture(scope="module", params=list(BUNDLES))
def trained(request, scenarios, tmp_path_factory):
    """Train (1 epoch, site-1), evaluate on the test split, export: once per bundle."""
    name = request.param
    family, size = BUNDLES[name]
    data = scenarios[family]
    out = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    ckpt = train_bundle(name, data, out / "train", site="site-1", epochs=1, batch_size=8, image_size=size)
    metrics = evaluate_bundle(name, ckpt, data, out=out / "eval", image_size=size)
    exported = export_bundle(name, ckpt, out / "export", image_size=size, data=data)
    return {"name": name, "family": family, "size": size, "data": Path(data), "out": out, "ckpt": ckpt,
            "metrics": metrics, "export": exported}


# ------------------------------------------------------------------ train


def test_training_writes_checkpoints_and_logs(trained):
    train = trained["out"] / "train"
    best, final = train / "models" / "model.pt", train / "models" / "model_final.pt"
    assert final.is_file()
    assert trained["ckpt"] in (best, final)
    assert list(train.glob("events.out.tfevents.*")), "no TensorBoard event file"
    summary = json.loads((train / "train_summary.json").read_text())
    assert summary["epochs"] == 1 and summary["iterations"] >= 1

    # the weights moved away from the seeded initialisation
    parser = ConfigParser()
    parser.read_config(cfg(trained["name"], "train.json"))
    parser.update({"bundle_root": str(bundle_path(trained["name"])), "image_size": trained["size"]})
    from monai.utils import set_determinism

    set_determinism(seed=0)
    init = parser.get_parsed_content("network_def").state_dict()
    state = load_state_dict(final)
    assert set(state) == set(init)
    moved = [k for k in init if init[k].is_floating_point() and not torch.equal(init[k], state[k])]
    assert len(moved) > len(init) // 4


def test_train_checks_bundle_properties(trained):
    """The train config defines every property MONAI FL (MonaiAlgo) reads, with the right ids."""
    common = dict(logging_file=False, bundle_root=str(trained["out"]), image_size=trained["size"])
    wf = ConfigWorkflow(config_file=cfg(trained["name"], "train.json"), workflow_type="train",
                        dataset_dir=str(trained["data"]), site="site-1", **common)
    wf.initialize()
    assert wf.check_properties() == []
    infer = ConfigWorkflow(config_file=cfg(trained["name"], "inference.json"), workflow_type="infer",
                           dataset_dir=str(trained["data"] / "test" / "images"), **common)
    infer.initialize()
    assert infer.check_properties() == []


# --------------------------------------------------------------- evaluate


def test_evaluate_reports_label_aware_metrics(trained):
    result = trained["metrics"]
    saved = json.loads((trained["out"] / "eval" / "metrics.json").read_text())
    assert saved["metrics"] == result["metrics"]
    assert saved["split"] == "test"
    metrics = result["metrics"]
    if trained["family"] == "cxr":
        details = result["details"]["val_auroc"]
        assert details["n_cases"] == 16
        assert set(details["per_class"]) == set(json.loads(Path(cfg(trained["name"], "metadata.json")).read_text())["class_names"])
        for c in details["per_class"].values():  # test set is fully labeled
            assert c["n_pos"] + c["n_neg"] == 16
        assert metrics["val_auroc"] is None or 0.0 <= metrics["val_auroc"] <= 1.0
    elif trained["family"] == "medmnist":
        assert 0.0 <= metrics["val_accuracy"] <= 1.0
        assert result["details"]["val_accuracy"]["n_cases"] == 16
    else:
        assert 0.0 <= metrics["val_mean_dice"] <= 1.0
        assert result["details"]["val_mean_dice"]["n_cases"] == 16


def test_site_validation_skips_classes_the_site_does_not_label(scenarios, tmp_path):
    """Scored on site-2's validation split: classes site-2 does not annotate have no cases."""
    from fedlabels.nets import ResNet18Classifier

    data = scenarios["cxr"]
    torch.manual_seed(0)
    torch.save(ResNet18Classifier(in_channels=1, out_channels=6).state_dict(), tmp_path / "init.pt")
    result = evaluate_bundle("cxr_resnet18", tmp_path / "init.pt", data, out=tmp_path, split="site-2", image_size=32)
    assert result["site"] == "site-2" and result["split"] == "validation"
    per_class = result["details"]["val_auroc"]["per_class"]
    labeled = {"effusion", "atelectasis", "nodule"}  # FedPSL Table I, site 2
    for name, c in per_class.items():
        if name not in labeled:
            assert c["n_pos"] == c["n_neg"] == 0 and c["auroc"] is None
            assert name in result["details"]["val_auroc"]["undefined"]
        else:
            assert c["n_pos"] + c["n_neg"] > 0


# ------------------------------------------------------------------ export


def test_export_layout_and_metadata(trained):
    exp = trained["export"]
    for rel in ["configs/metadata.json", "configs/inference.json", "configs/train.json", "configs/evaluate.json",
                "configs/logging.conf", "docs/README.md", "LICENSE", "models/model.pt", "models/model.ts"]:
        assert (exp / rel).is_file(), rel
    meta = json.loads((exp / "configs" / "metadata.json").read_text())
    infer = json.loads((exp / "configs" / "inference.json").read_text())
    assert meta["class_names"] == infer["class_names"]
    assert meta["network_data_format"]["inputs"]["image"]["spatial_shape"] == [trained["size"]] * 2
    # a plain state dict (bundle spec), loadable into the inference network strictly
    state = torch.load(exp / "models" / "model.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())


def test_torchscript_matches_eager(trained):
    exp = trained["export"]
    parser = ConfigParser()
    parser.read_config(str(exp / "configs" / "inference.json"))
    parser.update({"bundle_root": str(exp)})
    eager = parser.get_parsed_content("network_def")
    eager.load_state_dict(torch.load(exp / "models" / "model.pt", weights_only=True))
    eager.eval()
    # the training network (fedlabels class) has the same state-dict keys as the plain MONAI one
    train_parser = ConfigParser()
    train_parser.read_config(cfg(trained["name"], "train.json"))
    train_parser.update({"bundle_root": str(exp), "image_size": trained["size"]})
    train_net = train_parser.get_parsed_content("network_def")
    train_net.load_state_dict(load_state_dict(trained["ckpt"]), strict=True)
    train_net.eval()

    ts = torch.jit.load(str(exp / "models" / "model.ts"))
    channels = parser.get_parsed_content("in_channels")
    x = torch.rand(3, channels, trained["size"], trained["size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b, c = eager(x), ts(x), train_net(x)
    spatial = (trained["size"],) * 2 if trained["family"] == "lesion" else ()
    assert a.shape == (3, parser.get_parsed_content("num_classes"), *spatial)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert torch.allclose(a, c, atol=1e-5, rtol=1e-4)
    assert check_torchscript(exp) < 1e-4


def test_export_accepts_a_plain_federated_state_dict(tmp_path):
    """FLARE's global model: a torch.save'd dict of NumPy arrays keyed like the network."""
    from fedlabels.nets import SimpleCNN

    torch.manual_seed(3)
    net = SimpleCNN(in_channels=3, out_channels=8)
    global_model = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    torch.save(global_model, tmp_path / "global.pt")
    out = export_bundle("medmnist_cnn", tmp_path / "global.pt", tmp_path / "deploy",
                        metrics={"accuracy": 0.5}, provenance={"method": "fedavg", "round": 2})
    state = torch.load(out / "models" / "model.pt", weights_only=True)
    for k, v in net.state_dict().items():
        assert torch.equal(state[k], v)
    meta = json.loads((out / "configs" / "metadata.json").read_text())
    assert meta["eval_metrics"] == {"accuracy": 0.5} and meta["provenance"]["round"] == 2
    ts = torch.jit.load(str(out / "models" / "model.ts"))
    x = torch.rand(2, 3, 28, 28)
    with torch.no_grad():
        assert torch.allclose(ts(x), net.eval()(x), atol=1e-6)

    # weights of another network fail with one message naming the problem
    bad = dict(global_model)
    bad.pop("head.weight")
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="missing 1 keys.*head.weight"):
        export_bundle("medmnist_cnn", tmp_path / "bad.pt", tmp_path / "deploy2")
    assert not (tmp_path / "deploy2").exists()


def test_export_from_a_run_follows_its_network_options_and_input_size(scenarios, tmp_path):
    """A run trained with ``network={"widen_factor": 0.25}`` and ``data.image_size`` 32: ``--run`` exports
    the same narrower network at that size, and the weights fit it exactly."""
    from fedlabels.config import RunConfig
    from fedlabels.nets import ResNet18Classifier

    run = tmp_path / "run"
    RunConfig("fedavg", bundle="cxr_resnet18", network={"widen_factor": 0.25},
              data={"image_size": 32}).save(run / "app_server" / "custom" / "fedlabels.json")
    torch.manual_seed(0)
    net = ResNet18Classifier(in_channels=1, out_channels=6, widen_factor=0.25)
    torch.save({k: v.numpy() for k, v in net.state_dict().items()}, run / "app_server" / "FL_global_model.pt")
    out = export_bundle("cxr_resnet18", run / "app_server" / "FL_global_model.pt", tmp_path / "deploy", run=run)
    infer = json.loads((out / "configs" / "inference.json").read_text())
    meta = json.loads((out / "configs" / "metadata.json").read_text())
    assert infer["network_def"]["widen_factor"] == 0.25 and infer["image_size"] == 32
    assert meta["network_data_format"]["inputs"]["image"]["spatial_shape"] == [32, 32]
    assert meta["provenance"]["method"] == "fedavg"
    ts = torch.jit.load(str(out / "models" / "model.ts"))
    x = torch.rand(2, 1, 32, 32)
    with torch.no_grad():
        assert torch.allclose(ts(x), net.eval()(x), atol=1e-5)
    # a network option the inference network cannot carry fails, naming it, and writes nothing
    RunConfig("fedavg", bundle="cxr_resnet18", network={"hidden": 64}).save(run / "app_server" / "custom" / "fedlabels.json")
    with pytest.raises(ValueError, match="network_def has no 'hidden'"):
        export_bundle("cxr_resnet18", run / "app_server" / "FL_global_model.pt", tmp_path / "deploy2", run=run)
    assert not (tmp_path / "deploy2").exists()


# --------------------------------------------------------------- inference


def test_inference_config_runs_on_new_images(trained, tmp_path):
    images = trained["data"] / "test" / "images"
    files = sorted(images.glob("*.png"))
    exp = trained["export"]
    run(config_file=str(exp / "configs" / "inference.json"), meta_file=str(exp / "configs" / "metadata.json"),
        logging_file=str(exp / "configs" / "logging.conf"), bundle_root=str(exp), dataset_dir=str(images),
        output_dir=str(tmp_path))
    if trained["family"] == "lesion":
        masks = sorted(tmp_path.glob("*_seg.png"))
        assert [m.name for m in masks] == [f"{f.stem}_seg.png" for f in files]
        for f, m in zip(files, masks):
            mask = np.asarray(Image.open(m))
            assert mask.shape == np.asarray(Image.open(f)).shape[:2]
            assert set(np.unique(mask)) <= {0, 255}
        return
    with open(tmp_path / "predictions.csv") as fh:
        rows = list(csv.reader(fh))
    names = json.loads((exp / "configs" / "metadata.json").read_text())["class_names"]
    meta = json.loads((exp / "configs" / "metadata.json").read_text())
    decisions = [f"{c}_positive" for c in names] if meta.get("decision_thresholds") else []
    assert rows[0] == ["image"] + names + decisions + (["predicted"] if trained["family"] == "medmnist" else [])
    assert [Path(r[0]).name for r in rows[1:]] == [f.name for f in files]
    probs = np.array([[float(v) for v in r[1:len(names) + 1]] for r in rows[1:]])
    assert probs.shape == (len(files), len(names))
    assert ((probs >= 0) & (probs <= 1)).all()
    if trained["family"] == "medmnist":
        assert np.allclose(probs.sum(1), 1, atol=1e-4)
    # the CSV holds what the TorchScript model computes on the same preprocessing
    parser = ConfigParser()
    parser.read_config(str(exp / "configs" / "inference.json"))
    parser.update({"bundle_root": str(exp), "dataset_dir": str(images)})
    pre = parser.get_parsed_content("preprocessing")
    ts = torch.jit.load(str(exp / "models" / "model.ts"))
    x = torch.stack([torch.as_tensor(pre({"image": str(files[0])})["image"])])
    with torch.no_grad():
        logits = ts(x)
    ref = torch.softmax(logits, 1) if trained["family"] == "medmnist" else torch.sigmoid(logits)
    assert np.allclose(probs[0], ref[0].numpy(), atol=1e-5)


def test_inference_reads_png_jpeg_nifti_and_dicom_and_skips_what_it_cannot_read(trained, tmp_path, caplog):
    """One picture as PNG, NIfTI (x, y array order, MONAI's convention), DICOM (grey bundles) and
    RGB JPEG, next to a file that is no image and a 3D volume: those two are named in one log
    line each and left out, the others are predicted."""
    import nibabel as nib

    exp = trained["export"]
    src = sorted((trained["data"] / "test" / "images").glob("*.png"))[:2]
    inputs = tmp_path / "in"
    written = {}
    for f in src:
        written[f.stem] = write_inputs(inputs, f)
        arr = np.asarray(Image.open(f))
        rgb = np.repeat(arr[..., None], 3, -1) if arr.ndim == 2 else arr
        Image.fromarray(rgb).save(inputs / f"{f.stem}_j.jpg", quality=95, subsampling=0)
    bad = write_unreadable(inputs)
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="fedlabels.bundle"):
        run(config_file=str(exp / "configs" / "inference.json"), meta_file=str(exp / "configs" / "metadata.json"),
            logging_file=False, bundle_root=str(exp), dataset_dir=str(inputs), output_dir=str(out), device="cpu")
    for f in bad:
        assert sum(f"cannot read {f}" in r.getMessage() for r in caplog.records) == 1
    if trained["family"] == "lesion":  # masks follow the input: NIfTI (source geometry) for NIfTI/DICOM, else PNG
        for f in src:
            shape_yx = np.asarray(Image.open(f)).shape[:2]
            for stem in (f.stem, f"{f.stem}_j"):
                assert np.asarray(Image.open(out / f"{stem}_seg.png")).shape == shape_yx
            mask = nib.load(str(out / f"{f.stem}_n_seg.nii.gz"))
            assert mask.get_fdata().squeeze().shape == shape_yx[::-1]  # x, y order
            assert np.allclose(mask.affine, NIFTI_AFFINE)
            assert set(np.unique(mask.get_fdata())) <= {0, 1}
            for stem in (f"{f.stem}_d", f"{f.stem}_i"):  # a DICOM input's mask: NIfTI on the DICOM's grid
                dmask = nib.load(str(out / f"{stem}_seg.nii.gz"))
                assert sorted(dmask.get_fdata().squeeze().shape) == sorted(shape_yx)
            assert np.array_equal(nib.load(str(out / f"{f.stem}_i_seg.nii.gz")).get_fdata(),
                                  nib.load(str(out / f"{f.stem}_d_seg.nii.gz")).get_fdata())
        assert not list(out.glob("broken*")) and not list(out.glob("volume*"))
        return
    with open(out / "predictions.csv") as fh:
        rows = {Path(r[0]).name: np.array([float(v) for v in r[1:len(trained_names(exp)) + 1]])
                for r in list(csv.reader(fh))[1:]}
    grey = trained["family"] == "cxr"
    assert sorted(rows) == sorted([p.name for w in written.values() for p in w.values()]
                                  + [f"{f.stem}_j.jpg" for f in src])
    assert len(rows) == 5 * len(src)
    for f in src:
        png = rows[f"{f.stem}.png"]
        assert np.allclose(rows[f"{f.stem}_n.nii.gz"], png, atol=1e-5)  # same pixels, same orientation
        assert np.allclose(rows[f"{f.stem}_i.dcm"], rows[f"{f.stem}_d.dcm"], atol=1e-5)  # MONOCHROME1 inverted back
        if grey:  # a grey picture's DICOM is the PNG's pixels
            assert np.allclose(rows[f"{f.stem}_d.dcm"], png, atol=1e-5)
        assert np.allclose(rows[f"{f.stem}_j.jpg"], png, atol=0.1)  # lossy JPEG, RGB -> grey where needed


def trained_names(exp) -> list:
    return json.loads((exp / "configs" / "metadata.json").read_text())["class_names"]


def test_exported_bundle_carries_thresholds_test_intervals_label_table_and_model_card(trained, tmp_path):
    """``export_bundle(..., data=)``: metadata that passes ``verify_metadata`` and holds the clinical
    fields; the CSV's decisions are the probabilities at those thresholds; the model card says it."""
    exp, data = trained["export"], trained["data"]
    verify_metadata(meta_file=str(exp / "configs" / "metadata.json"), filepath=str(SPEC_SCHEMA))
    meta = json.loads((exp / "configs" / "metadata.json").read_text())
    names, task = meta["class_names"], TASK[trained["family"]]
    assert meta["training"]["task"] == task and meta["task"] == json.loads(Path(cfg(trained["name"], "metadata.json"))
                                                                          .read_text())["task"]
    scenario = load_scenario(data)
    table = meta["training"]["label_table"]
    assert sorted(table) == sorted(scenario.sites)
    for site, row in table.items():
        summary = scenario.site(site).summary()
        assert [row["annotated"][c] for c in names] == summary["annotated"]
        assert [row["labels"][c] for c in names] == list(map(bool, summary["labeled_mask"]))
        assert row["cases"] == summary["cases"]
    test = meta["test_metrics"]
    assert test["cases"] == len(scenario.test) and test["confidence"] == 0.95
    thresholds = meta["decision_thresholds"]
    if task == "multiclass":
        assert thresholds == {} and 0 <= test["accuracy"]["value"] <= 1
    else:
        assert sorted(thresholds) == sorted(names)
        assert any(t is not None for t in thresholds.values())
    for name, m in test["per_class"].items():
        value, ci = (m["dice"], m["dice_ci"]) if task == "segmentation" else (m["auroc"], m["auroc_ci"])
        if ci is not None:
            assert ci[0] <= value <= ci[1]
    card = (exp / "docs" / "README.md").read_text()
    for heading in ("## Intended use", "## Training", "## Performance", "## Known limitations"):
        assert heading in card
    assert all(site in card for site in scenario.sites)
    if task != "multilabel":
        return
    # the decision columns are the probabilities at the metadata's thresholds
    images = data / "test" / "images"
    run(config_file=str(exp / "configs" / "inference.json"), logging_file=False, bundle_root=str(exp),
        dataset_dir=str(images), output_dir=str(tmp_path))
    with open(tmp_path / "predictions.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(list(images.glob("*.png")))
    checked = 0
    for r in rows:
        for c in names:
            if thresholds[c] is None:
                assert r[f"{c}_positive"] == ""
            else:
                assert r[f"{c}_positive"] == str(int(float(r[c]) >= thresholds[c]))
                checked += 1
    assert checked


def test_segmentation_masks_keep_orientation_and_size(tmp_path):
    """Inference postprocessing (invert resize, threshold, save) returns a mask aligned with the input."""
    from monai.transforms import Compose

    img = np.zeros((40, 24, 3), np.uint8)  # not square: a transposed mask cannot pass
    img[5:15, 2:20] = 255
    Image.fromarray(img).save(tmp_path / "case.png")
    parser = ConfigParser()
    parser.read_config(cfg("lesion_unet", "inference.json"))
    parser.read_meta(cfg("lesion_unet", "metadata.json"))  # as `monai.bundle run` does by default
    parser.update({"bundle_root": str(tmp_path), "output_dir": str(tmp_path / "out"), "image_size": 32})
    pre = parser.get_parsed_content("preprocessing")
    post = parser.get_parsed_content("postprocessing")
    item = pre({"image": str(tmp_path / "case.png")})
    item["pred"] = item["image"][:1] * 20 - 10  # a "logit" map: > 0 where the image is bright
    Compose(post.transforms)(item)
    mask = np.asarray(Image.open(tmp_path / "out" / "case_seg.png"))
    assert mask.shape == (40, 24)
    assert (mask > 0).sum() > 0
    assert ((mask > 0) == (img[..., 0] > 0)).mean() > 0.97


# ------------------------------------------------------------------ checks


@pytest.mark.parametrize("name", list(BUNDLES))
@pytest.mark.parametrize("config", ["train.json", "inference.json"])
def test_verify_net_in_out(name, config):
    verify_net_in_out(net_id="network_def", meta_file=cfg(name, "metadata.json"), config_file=cfg(name, config),
                      device="cpu", bundle_root=str(REPO / "bundles" / name))


@pytest.mark.parametrize("name", list(BUNDLES))
def test_metadata_has_the_specification_keys(name):
    meta = json.loads(Path(cfg(name, "metadata.json")).read_text())
    missing = [k for k in MANDATORY_META + RECOMMENDED_META if k not in meta]
    assert not missing, f"{name}: metadata lacks {missing}"
    assert meta["version"] in meta["changelog"]
    for key in ("monai_version", "pytorch_version", "numpy_version"):
        assert isinstance(meta[key], str) and meta[key][0].isdigit()
    fmt = meta["network_data_format"]
    assert set(fmt) >= {"inputs", "outputs"} and "image" in fmt["inputs"] and "pred" in fmt["outputs"]
    for kind in ("inputs", "outputs"):
        for tname, spec in fmt[kind].items():
            missing = [k for k in TENSOR_KEYS if k not in spec]
            assert not missing, f"{name}: {kind}.{tname} lacks {missing}"
            assert isinstance(spec["is_patch_data"], bool)
            assert len(spec["channel_def"]) == spec["num_channels"]
    # class names agree between metadata and every config
    names = meta["class_names"]
    pred = fmt["outputs"]["pred"]
    if pred["format"] == "classes":
        assert [pred["channel_def"][str(i)] for i in range(len(names))] == names
    for config in ("train.json", "inference.json"):
        assert json.loads(Path(cfg(name, config)).read_text())["class_names"] == names
    train = json.loads(Path(cfg(name, "train.json")).read_text())
    assert fmt["inputs"]["image"]["num_channels"] == train["in_channels"]
    assert fmt["inputs"]["image"]["spatial_shape"] == [train["image_size"]] * 2
    for rel in ("LICENSE", "docs/README.md", "configs/logging.conf", "configs/evaluate.json"):
        assert (REPO / "bundles" / name / rel).is_file()
    assert "Apache License" in (REPO / "bundles" / name / "LICENSE").read_text()


# -------------------------------------------------------------- datalists


def test_datalists_pool_sites_keep_missing_labels_and_read_oracle(scenarios):
    data = scenarios["cxr"]
    one = bundle_data.datalist(data, site="site-1")
    pooled = bundle_data.datalist(data)
    assert len(pooled) > len(one) > 0 and all(os.path.isabs(i["image"]) for i in pooled)
    labels = np.array([i["label"] for i in one])
    assert (labels[:, 3:] == -1).all() and (labels[:, :3] >= 0).all()  # site-1 labels the first three
    oracle = np.array([i["label"] for i in bundle_data.datalist(data, site="site-1", oracle=True)])
    assert oracle.shape == labels.shape and (oracle >= 0).all()
    assert len(bundle_data.datalist(data, split="test")) == 16
    with pytest.raises(ScenarioError, match="classes"):
        bundle_data.datalist(data, classes=["a", "b"])
    with pytest.raises(ScenarioError, match="no site named"):
        bundle_data.datalist(data, site="site-9")


def test_datalist_refuses_unlabeled_sites_for_supervised_training(scenarios):
    data = scenarios["medmnist"]
    with pytest.raises(ScenarioError, match="no labeled cases.*site-2"):
        bundle_data.datalist(data, site="site-2")
    assert len(bundle_data.datalist(data, site="site-2", oracle=True)) > 0
    seg = bundle_data.datalist(scenarios["lesion"])  # only the pixel-labeled site's cases
    assert seg and all(Path(i["label"]).parent.name == "masks" for i in seg)
    with pytest.raises(ScenarioError, match="mask"):
        bundle_data.datalist(scenarios["lesion"], site="site-2")


def test_partial_bce_in_the_bundle_ignores_missing_labels():
    parser = ConfigParser()
    parser.read_config(cfg("cxr_densenet121", "train.json"))
    loss = parser.get_parsed_content("loss")
    target = torch.tensor([[1.0, 0.0, -1.0], [-1.0, 1.0, -1.0]])
    a = torch.zeros(2, 3, requires_grad=True)
    b = torch.tensor([[0.0, 0.0, 9.0], [-7.0, 0.0, 5.0]], requires_grad=True)
    la, lb = loss(a, target), loss(b, target)
    assert torch.isclose(la, lb)
    lb.backward()
    assert (b.grad[target < 0] == 0).all()


@pytest.mark.parametrize("name", list(BUNDLES))
def test_augmentation_leaves_the_cache_intact(name, scenarios):
    """``copy_cache: false`` is only safe while no random transform edits its input in place."""
    import copy

    family, size = BUNDLES[name]
    parser = ConfigParser()
    parser.read_config(cfg(name, "train.json"))
    parser.update({"bundle_root": str(REPO / "bundles" / name), "dataset_dir": str(scenarios[family]),
                   "site": "site-1", "image_size": size})
    ds = parser.get_parsed_content("train#dataset")
    assert ds.copy_cache is False
    before = copy.deepcopy(ds._cache)
    for _ in range(2):
        for i in range(len(ds)):
            item = ds[i]
            assert type(item["image"]) is torch.Tensor  # plain tensors reach the network, not MetaTensors
            assert item["image"].shape == (parser.get_parsed_content("in_channels"), size, size)
    for a, b in zip(before, ds._cache):
        assert torch.equal(torch.as_tensor(a["image"]), torch.as_tensor(b["image"]))
        assert torch.equal(torch.as_tensor(a["label"]), torch.as_tensor(b["label"]))


def test_rand_dihedral_moves_image_and_mask_together():
    t = bundle_data.RandDihedrald(keys=["image", "label"], prob=1.0)
    t.set_random_state(0)
    img = torch.arange(2 * 5 * 7, dtype=torch.float32).reshape(2, 5, 7)
    seen = set()
    for _ in range(64):
        out = t({"image": img, "label": img[:1].clone()})
        assert torch.equal(out["image"][:1], out["label"])
        assert sorted(out["image"].flatten().tolist()) == sorted(img.flatten().tolist())
        seen.add(tuple(out["image"][0].flatten()[:3].tolist()) + tuple(out["image"].shape))
    assert len(seen) == 8  # all of D4


@pytest.mark.parametrize("saver_cls", ["monai", "fedlabels"])
def test_best_checkpoint_skips_undefined_key_metric(saver_cls, tmp_path):
    """A NaN key metric at the first validation must not freeze model.pt (plain MONAI saver: it does)."""
    from ignite.engine import Engine, Events
    from monai.handlers import CheckpointSaver

    from fedlabels.bundle.handlers import BestMetricCheckpointSaver

    net = torch.nn.Linear(1, 1)
    scores = [float("nan"), 0.5, 0.4, 0.7, 0.6]
    engine = Engine(lambda e, b: None)

    @engine.on(Events.EPOCH_COMPLETED)
    def _epoch(e):  # registered before the saver: the "metric" of this epoch, weights = epoch number
        e.state.metrics["m"] = scores[e.state.epoch - 1]
        torch.nn.init.constant_(net.weight, float(e.state.epoch))

    cls = CheckpointSaver if saver_cls == "monai" else BestMetricCheckpointSaver
    cls(save_dir=str(tmp_path), save_dict={"model": net}, save_key_metric=True, key_metric_name="m",
        key_metric_filename="model.pt").attach(engine)
    engine.run([0], max_epochs=len(scores))
    saved = load_state_dict(tmp_path / "model.pt")["weight"].item()
    assert saved == (1.0 if saver_cls == "monai" else 4.0)


# -------------------------------------------------------------------- CLI


def test_documented_command_line_trains(scenarios, tmp_path):
    """``python -m monai.bundle run --config_file .../train.json`` as the bundle README shows it."""
    bundle = REPO / "bundles" / "medmnist_cnn"
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", str(bundle / "configs" / "train.json"),
           "--bundle_root", str(bundle), "--dataset_dir", str(scenarios["medmnist"]), "--epochs", "1",
           "--output_dir", str(tmp_path), "--ckpt_dir", str(tmp_path / "models")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "models" / "model_final.pt").is_file()
    assert "train epoch 1/1" in proc.stdout + proc.stderr
    assert not (bundle / "models").exists(), "training wrote into the committed bundle folder"


def test_nothing_was_written_into_the_committed_bundles():
    """Runs above pass output folders explicitly; the bundle folders stay as committed."""
    for name in BUNDLES:
        folder = REPO / "bundles" / name
        extra = sorted(p.name for p in folder.iterdir() if p.name not in ("configs", "docs", "LICENSE"))
        assert not extra, f"{folder}: unexpected {extra}"
    assert not (REPO / "eval").exists() and not (REPO / "models").exists()


def test_a_network_is_built_again_when_another_thread_imported_during_monais_component_scan():
    """MONAI builds its component table by iterating sys.modules; an nvflare client thread importing at
    that moment makes it raise (seen once in CI). The build is tried again; other errors are not."""
    from unittest import mock

    from monai.bundle import config_item

    from fedlabels.bundle import network

    scan, calls = config_item.ComponentLocator._find_module_names, []

    def racing(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return scan(self)

    with mock.patch.object(config_item.ComponentLocator, "_find_module_names", racing):
        assert isinstance(network("medmnist_cnn"), torch.nn.Module)
    assert len(calls) == 2

    def broken(self):
        raise RuntimeError("something else")

    with mock.patch.object(config_item.ComponentLocator, "_find_module_names", broken), \
            pytest.raises(RuntimeError, match="something else"):
        network("medmnist_cnn")
