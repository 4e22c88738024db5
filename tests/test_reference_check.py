"""The project's training path against the independent plain-PyTorch reference (benchmarks/reference/).

On a small PneumoniaMNIST split from ../shared/data (2 Dirichlet sites, one
holding 14 normal and 597 pneumonia cases), FedAvg with every site labeled
must leave the one-class solution and score within 10 points of the reference
loop of the same protocol. With the bundle's scaling switched back to per-image
min-max (``ScaleIntensityd``), the same check must fail: measured on this split,
both the project and the reference then predict one class for 45 rounds, while
with the preset's fixed [-1, 1] scaling both predict both classes by round 30.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("FEDLABELS_SHARED_DATA", ROOT.parent / "shared" / "data"))
ROUNDS, TOLERANCE = 40, 0.10
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    src = DATA / "medmnist" / "pneumoniamnist.npz"
    if not src.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"real data missing under CI: {src} (set FEDLABELS_SHARED_DATA)")
        pytest.skip(f"real data not available: {src}")
    out = tmp_path_factory.mktemp("pneumonia") / "split"
    subprocess.run([sys.executable, "-m", "fedlabels.cli", "prepare", "pneumoniamnist", "--src", str(src.parent),
                    "--protocol", "isofed", "--sites", "2", "--gamma", "0.8", "--labeled", "1", "--limit", "1200",
                    "--test-cases", "300", "--seed", "0", "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


@pytest.fixture(scope="module")
def checked(split, tmp_path_factory):
    import reference_check as rc

    return rc.compare("isofed", split, 0, ROUNDS, [ROUNDS], tmp_path_factory.mktemp("work"), log=lambda m: None)


def test_preset_reaches_both_classes_and_the_reference(checked):
    import reference_check as rc

    assert rc.reference_settings("isofed")["scaling"] == "fixed"
    ref = checked["reference_run"]["metrics"][ROUNDS]
    assert ref["classes_predicted"] == 2, ref  # the reference itself left the one-class solution
    assert rc.problems(checked, TOLERANCE) == [], checked["project"]["metrics"]


def test_check_fails_with_per_image_min_max_scaling(checked, split, tmp_path):
    import reference_check as rc

    minmax = {"intensity": {"_target_": "ScaleIntensityd", "keys": ["image"]}}
    result = rc.compare("isofed", split, 0, ROUNDS, [ROUNDS], tmp_path, config=minmax, log=lambda m: None,
                        reference_run=checked["reference_run"])
    assert result["project"]["metrics"][ROUNDS]["classes_predicted"] == 1
    assert any("class(es)" in p for p in rc.problems(result, TOLERANCE))


def test_the_bundle_default_scales_as_the_preset():
    """The MedMNIST bundle's own default (jobs, `fedlabels train`, the exported bundle) is the preset's scaling."""
    import json

    from fedlabels import presets
    from fedlabels.bundle import read

    preset = json.loads(presets.load("isofed").path.read_text())
    assert read("medmnist_cnn")["intensity"] == preset["intensity"]
    infer = json.loads((ROOT / "bundles" / "medmnist_cnn" / "configs" / "inference.json").read_text())
    assert infer["intensity"] == preset["intensity"]


def test_reference_settings_follow_the_presets():
    import reference_check as rc

    assert rc.reference_settings("isofed") == {"lr": 0.001, "batch_size": 64, "epochs": 1, "scaling": "fixed",
                                               "augment": "hflip"}
    assert rc.reference_settings("fedmix") == {"lr": 0.001, "batch_size": 16, "epochs": 1, "weight_decay": 0.0001}
    assert rc.reference_settings("cxr") == {"lr": 0.001, "batch_size": 16, "epochs": 1, "weight_decay": 0.0,
                                            "scaling": "minmax"}
    assert rc.reference_settings("fedmlp_blood") == {"lr": 0.001, "batch_size": 16, "epochs": 1, "weight_decay": 0.0,
                                                     "scaling": "fixed", "widen": 0.25}


def test_multilabel_reference_scalings(tmp_path):
    """The multi-label reference reads its images itself: fixed = x / 127.5 - 1, minmax = each image to [0, 1]."""
    from PIL import Image
    from reference import fedavg_multilabel as ml

    Image.fromarray(np.array([[0, 51], [102, 204]], dtype=np.uint8)).save(tmp_path / "a.png")
    items = [{"image": "a.png", "label": [1, 0]}]
    fixed, y = ml.load_split(tmp_path, items, "fixed")
    assert np.allclose(fixed.numpy().ravel(), [-1.0, 51 / 127.5 - 1, 102 / 127.5 - 1, 204 / 127.5 - 1])
    minmax, _ = ml.load_split(tmp_path, items, "minmax")
    assert np.allclose(minmax.numpy().ravel(), [0.0, 0.25, 0.5, 1.0])
    assert y.tolist() == [[1.0, 0.0]]


def test_problems_flag_fewer_classes_and_a_gap_beyond_the_tolerance():
    import reference_check as rc

    def result(p, q):
        return {"metric": "accuracy", "project": {"metrics": {5: {"accuracy": 0.5}, 20: p}},
                "reference_run": {"metrics": {5: {"accuracy": 0.9}, 20: q}}}

    ok = result({"accuracy": 0.80, "classes_predicted": 2}, {"accuracy": 0.81, "classes_predicted": 2})
    assert rc.problems(ok, 0.02) == []  # only the last scored round counts
    gap = result({"accuracy": 0.70, "classes_predicted": 2}, {"accuracy": 0.80, "classes_predicted": 2})
    assert len(rc.problems(gap, 0.02)) == 1 and rc.problems(gap, 0.11) == []
    collapsed = result({"accuracy": 0.80, "classes_predicted": 1}, {"accuracy": 0.80, "classes_predicted": 2})
    assert ["class(es)" in p for p in rc.problems(collapsed, 0.02)] == [True]
