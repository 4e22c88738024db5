"""The project's training path against the independent plain-PyTorch reference (benchmarks/reference/).

On a small PneumoniaMNIST split from ../shared/data (2 Dirichlet sites, one
holding 14 normal and 597 pneumonia cases), FedAvg with every site labeled
must leave the one-class solution and score within 10 points of the reference
loop of the same protocol. With the bundle's scaling switched back to per-image
min-max (``ScaleIntensityd``), the same check must fail: measured on this split,
both the project and the reference then predict one class for 45 rounds, while
with the preset's fixed [-1, 1] scaling both predict both classes by round 30.

The equivalence criterion's arithmetic (the 90 % t interval of the mean paired
difference, the widest split against the widest seed-to-seed difference) is
checked on hand-computed numbers, and so is the mapping of the method
reference's settings onto the project's row options.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
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


# ---------------------------------------------------------------- the equivalence criterion, by hand
# t quantile used below: t_{0.95, 2} = 2.919986 (3 splits; the 90 % two-sided interval), from a t table.
T95_2 = 2.919986


def test_criterion_a_is_the_90_percent_t_interval_inside_the_margin():
    import reference_check as rc

    # d = 1, 2, 3 points: mean 2, sd 1, half-width 2.919986 / sqrt(3) = 1.685855 points -> 0.314 to 3.686
    a = rc.criterion_a([0.01, 0.02, 0.03], margin=0.02)
    assert a["mean"] == pytest.approx(0.02)
    assert a["low"] == pytest.approx(0.02 - T95_2 * 0.01 / np.sqrt(3))
    assert a["high"] == pytest.approx(0.02 + T95_2 * 0.01 / np.sqrt(3))
    assert a["pass"] is False  # the mean is inside 2 points, the interval is not
    # d = 0, +1, -1 points: -1.686 to +1.686, inside 2 points, not inside 1.6
    assert rc.criterion_a([0.0, 0.01, -0.01], margin=0.02)["pass"] is True
    assert rc.criterion_a([0.0, 0.01, -0.01], margin=0.016)["pass"] is False
    one = rc.criterion_a([0.0], margin=0.02)  # one split: no interval, no pass
    assert one["low"] is None and one["pass"] is False


def test_criterion_b_compares_the_widest_split_with_the_widest_seed_to_seed_difference():
    import reference_check as rc

    d = [0.01, -0.03, 0.02]
    b = rc.criterion_b(d, [0.04, 0.0, -0.01])
    assert (b["max_diff"], b["max_seed"], b["pass"]) == (pytest.approx(0.03), pytest.approx(0.04), True)
    assert rc.criterion_b(d, [0.02, 0.01, -0.025])["pass"] is False  # 3 points against 2.5
    assert rc.criterion_b(d, [])["pass"] is None                      # one training seed: unmeasured


def test_per_split_pairs_the_mean_of_the_two_seeds_with_the_reference():
    import reference_check as rc

    def cell(a, b, ref):
        return {"projects": [{"metrics": {"20": {"accuracy": a}}}, {"metrics": {"20": {"accuracy": b}}}],
                "reference_run": {"metrics": {"20": {"accuracy": ref}}}}

    # split 1: (0.80 + 0.84) / 2 - 0.81 = +0.01, seeds 0.80 - 0.84 = -0.04; split 2: (0.70 + 0.70) / 2 - 0.75 = -0.05, 0
    d, s = rc.per_split([cell(0.80, 0.84, 0.81), cell(0.70, 0.70, 0.75)], 20, "accuracy")
    assert d == pytest.approx([0.01, -0.05]) and s == pytest.approx([-0.04, 0.0])
    b = rc.criterion_b(d, s)
    assert b["pass"] is False  # 5 points from the reference, at most 4 between its own seeds
    # an older cell (one project run): d only
    old = {"project": {"metrics": {20: {"accuracy": 0.9}}}, "reference_run": {"metrics": {"20": {"accuracy": 0.8}}}}
    d, s = rc.per_split([old], 20, "accuracy")
    assert d == pytest.approx([0.1]) and s == []


def test_several_reference_runs_compare_by_their_mean_and_show_their_spread():
    import reference_check as rc

    def run(v):
        return {"metrics": {"30": {"auroc": v}}}

    # the reference at 0.90 and 0.74 on this split (seeds s and s + 1000): d = (0.80 + 0.78) / 2 - 0.82 = -0.03
    cell = {"kind": "methods", "label": "x", "preset": "fedmlp_blood", "row": "fednoro", "metric": "auroc", "seed": 0,
            "reference": {}, "projects": [run(0.80), run(0.78)], "reference_run": run(0.90),
            "more_reference_runs": [run(0.74)]}
    d, s = rc.per_split([cell], 30, "auroc")
    assert d == pytest.approx([-0.03]) and s == pytest.approx([0.02])
    assert rc.reference_metric({"reference_run": run(0.9)}, 30, "auroc") == pytest.approx(0.9)  # one run: itself
    lines = rc._reference_spread_lines([cell], "auroc")
    assert "2 times per split" in lines[0] and "90.0, 74.0 (max - min 16.0)" in lines[0]
    assert rc._reference_spread_lines([{**cell, "more_reference_runs": []}], "auroc") == []


def test_the_released_code_preset_rows_get_its_views_and_warm_start(tmp_path):
    """isofed_rscfed's published rows: its resize-crop-flip and the bundle's strong view reach the reference by
    name (both checked against the preset's transforms), its warm-up rounds and lambda_c reach the project."""
    import reference_check as rc
    from reference import semisup

    assert rc.reference_settings("isofed_rscfed", fedavg_loop=False)["augment"] == "crop_hflip"
    assert rc.reference_settings("isofed_rscfed", fedavg_loop=False)["strong"] == "photometric"
    with pytest.raises(ValueError, match="fresh Adam"):  # the FedAvg loop cannot run this preset
        rc.reference_settings("isofed_rscfed")
    with pytest.raises(SystemExit, match="--preset isofed_rscfed: .*isofed_rscfed.json.*fresh Adam"):
        rc.main(["--preset", "isofed_rscfed", "--data", "x{seed}", "--rounds", "1", "--label", "x",
                 "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    # a preset it can run goes on to read the splits, and stops at one that is not prepared, before writing
    with pytest.raises(SystemExit, match="x0: no scenario.yaml"):
        rc.main(["--preset", "isofed", "--data", str(tmp_path / "x{seed}"), "--rounds", "1", "--label", "x",
                 "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    s = {**semisup.CHECK, "augment": "crop_hflip", "strong": "photometric", "warmup_rounds": 7, "sup_scale": 100.0}
    got = rc.project_settings("isofed_rscfed", "isofed", s)
    opts = dict(o.split(":", 1)[1].split("=", 1) for o in got["opts"])
    assert int(opts["warmup_rounds"]) == 7 and float(opts["lambda_c"]) == 100.0
    assert got["config"] == {}  # the preset's own strong view, not the second flip
    assert int(dict(o.split(":", 1)[1].split("=", 1) for o in
                    rc.project_settings("isofed", "isofed", semisup.CHECK)["opts"])["warmup_rounds"]) == 0
    with pytest.raises(ValueError, match="augment is 'hflip'"):  # the isofed preset has no crop
        rc.project_settings("isofed", "isofed", s)
    with pytest.raises(ValueError, match="strong view 'cutout'"):
        rc.project_settings("isofed_rscfed", "isofed", {**s, "strong": "cutout"})
    text = rc._settings_text(s, "isofed")
    assert "warmup_rounds 7" in text and semisup.INSTEAD["augment"] in text and semisup.INSTEAD["strong"] in text
    assert "no random crop" not in text and "no random crop" in rc._settings_text(dict(semisup.CHECK), "isofed")


def test_the_floor_row_takes_only_the_settings_of_a_site_alone():
    """The labeled site alone has no student and no aggregation: a strong view or a distance the project
    cannot express refuses the methods, not the floor, and the floor's section text names no student's view."""
    import reference_check as rc
    from reference import semisup

    s = {**semisup.CHECK, "distance": "rscfed", "strong": "cutout"}
    floor = rc.project_settings("isofed", "local:site-1", s)
    assert floor["config"] == {} and all(o.startswith("local:") for o in floor["opts"])
    for row, match in (("isofed", "distance 'rscfed'"), ("mt_wfedavg", "distance 'rscfed'")):
        with pytest.raises(ValueError, match=match):
            rc.project_settings("isofed", row, s)
    with pytest.raises(ValueError, match="strong view 'cutout'"):
        rc.project_settings("isofed", "isofed", {**s, "distance": "paper"})
    assert "student" not in rc._settings_text(dict(semisup.CHECK), "local:site-1", "isofed")
    assert "the student's view is a second independent flip" in rc._settings_text(dict(semisup.CHECK), "isofed",
                                                                                  "isofed")


def test_the_isofed_presets_own_settings_reach_the_project_as_its_defaults_and_the_page_names_them():
    """The published isofed-preset rows train with the preset's Adam 1e-3, a fresh optimizer each round, no clip,
    consistency weight 1: set on the reference, the project's options are exactly those defaults, and the section
    names each training setting that left RSCFed's value, with RSCFed's beside it (momentum only with SGD)."""
    import reference_check as rc
    from reference import semisup

    preset = {"optimizer": "adam", "lr": 0.001, "lr_unlabeled": None, "weight_decay": 0.0, "carry_optimizer": False,
              "max_grad_norm": None, "lambda_u": 1.0, "strong": "photometric"}
    s = {**semisup.CHECK, **preset}
    opts = dict(o.split(":", 1)[1].split("=", 1) for o in rc.project_settings("isofed", "isofed", s)["opts"])
    assert (opts["optimizer"], opts["lr"], opts["reset_optimizer"], opts["clip_grad_norm"]) == \
        ('"adam"', "0.001", "true", "null")
    assert opts["consistency_weight"] == "1.0" and "momentum" not in opts
    text = rc._settings_text(s, "isofed", "isofed")
    assert "with optimizer, lr, lr_unlabeled, weight_decay, max_grad_norm, lambda_u, carry_optimizer changed" in text
    assert "optimizer: adam (RSCFed's: sgd)" in text and "lambda_u: 1.0 (RSCFed's: 0.02)" in text
    assert "momentum" not in text  # Adam has none
    assert "changed by `--set`" not in rc._settings_text(dict(semisup.CHECK), "isofed", "isofed")
    assert "momentum: 0.5 (RSCFed's: 0.9)" in rc._settings_text({**semisup.CHECK, "momentum": 0.5}, "isofed")


def test_a_section_names_a_rows_settings_where_they_differ_from_its_first_cell():
    """An older cell records no ``w_mul_times`` (the reference's 1 then); a row run with 6 is named with it."""
    import reference_check as rc
    from reference import semisup

    old = {k: v for k, v in semisup.CHECK.items() if k != "w_mul_times"}
    cells = [{"preset": "isofed_rscfed", "row": "isofed", "reference": old},
             {"preset": "isofed_rscfed", "row": "mt_wfedavg", "reference": {**old, "w_mul_times": 6}},
             {"preset": "isofed_rscfed", "row": "oracle:wfedavg", "reference": {**old, "w_mul_times": 1.0}}]
    assert rc._row_settings_text(cells) == " Where a row's settings differ from these: `mt_wfedavg` w_mul_times 6."
    assert rc._row_settings_text(cells[::2]) == ""


def test_verdict_needs_both_criteria():
    import reference_check as rc

    assert rc.verdict({"pass": True}, {"pass": True}) == "equivalent"
    assert rc.verdict({"pass": True}, {"pass": False}) == "not shown"
    assert rc.verdict({"pass": False}, {"pass": True}) == "not shown"
    assert rc.verdict({"pass": True}, {"pass": None}).startswith("not shown")


def test_the_project_rows_get_the_references_settings():
    import reference_check as rc
    from reference import semisup

    s = dict(semisup.CHECK)
    got = rc.project_settings("isofed", "isofed", s)
    opts = dict(o.split(":", 1)[1].split("=", 1) for o in got["opts"])
    assert opts["optimizer"] == '"sgd"' and float(opts["lr"]) == s["lr"] == 0.03
    assert float(opts["weight_decay"]) == 5e-4 and opts["reset_optimizer"] == "false"
    assert float(opts["consistency_weight"]) == 0.02 and float(opts["temperature"]) == 0.5
    assert float(opts["ema_alpha"]) == pytest.approx(0.001)
    assert float(opts["lambda_c"]) == 1.0 and float(opts["lambda_unlabeled"]) == 1e4
    assert opts["pretrain"] == "true" and got["batch_size"] == 64 and got["local_epochs"] == 1
    assert got["config"]["train#strong_random_transforms"][0]["prob"] == 0.5
    upper = dict(o.split(":", 1)[1].split("=", 1) for o in rc.project_settings("isofed", "oracle:wfedavg", s)["opts"])
    assert "consistency_weight" not in upper and all(o.startswith("oracle:wfedavg:") for o in
                                                     rc.project_settings("isofed", "oracle:wfedavg", s)["opts"])
    # RSCFed's momentum, clipping and unlabeled lr reach the project's row as they reach the reference
    assert float(opts["momentum"]) == 0.9 and float(opts["clip_grad_norm"]) == s["max_grad_norm"] == 5.0
    assert float(opts["lr_unlabeled"]) == s["lr_unlabeled"] == 0.021
    other = dict(o.split(":", 1)[1].split("=", 1) for o in
                 rc.project_settings("isofed", "isofed", {**s, "momentum": 0.5, "max_grad_norm": None})["opts"])
    assert float(other["momentum"]) == 0.5 and other["clip_grad_norm"] == "null"
    # RSCFed's subsets reach the project's server; the other rows' servers take no such option
    rsc = dict(o.split(":", 1)[1].split("=", 1) for o in
               rc.project_settings("isofed", "rscfed", {**s, "subsets": 2, "subset_size": 4})["opts"])
    assert (int(rsc["subsets"]), int(rsc["subset_size"])) == (2, 4) and "pretrain" not in rsc
    assert (s["subsets"], s["subset_size"]) == (3, 3) and "subsets" not in opts


def test_the_fedmix_rows_get_the_references_settings_and_set_changes_both_sides():
    import reference_check as rc
    from reference import fedmix

    def opts(row, s):
        got = rc.project_settings("fedmix", row, s)
        assert got["batch_size"] == s["batch_size"] and got["local_epochs"] == s["epochs"] and got["config"] == {}
        assert all(o.startswith(f"{row}:") for o in got["opts"])
        return dict(o.split(":", 1)[1].rsplit(":", 1)[-1].split("=", 1) for o in got["opts"])

    s = dict(fedmix.CHECK)
    got = opts("fedmix", s)
    assert got["optimizer"] == '"adam"' and float(got["lr"]) == 1e-3 and float(got["weight_decay"]) == 1e-4
    assert got["reset_optimizer"] == "false" and float(got["epsilon"]) == 0.9 and got["box_rule"] == "true"
    assert float(got["lam"]) == 10.0 and float(got["beta"]) == 2.5 and float(got["threshold"]) == 0.5
    upper = opts("oracle:fedadaptagg", s)
    assert "epsilon" not in upper and float(upper["beta"]) == 2.5
    # --set reaches the reference's settings and through them the project's options
    changed = rc._settings(["beta=3", "carry_optimizer=false"], ["fedmix", "oracle:fedadaptagg"])
    assert changed == {"beta": 3, "carry_optimizer": False}
    got = opts("fedmix", {**s, **changed})
    assert float(got["beta"]) == 3 and got["reset_optimizer"] == "true"
    with pytest.raises(SystemExit, match="epsilon: not a setting of row isofed"):
        rc._settings(["epsilon=0.5"], ["fedmix", "isofed"])
    with pytest.raises(ValueError, match="dice_eps"):
        rc.project_settings("fedmix", "fedmix", {**s, "dice_eps": 0.5})


@pytest.mark.parametrize("row", ["rscfed_pl", "composed"])
def test_the_mean_teacher_rows_get_the_references_settings_as_options_the_method_takes(row):
    import reference_check as rc
    from fedlabels.methods import get

    ref = rc.method_reference(row, "fedmlp_blood")
    s = {**ref.CHECK, "lr": 0.002, "consistency_weight": 1.0, "carry_optimizer": True, "pos_weight": "neg_over_pos"}
    got = rc.project_settings("fedmlp_blood", row, s)
    assert got["batch_size"] == s["batch_size"] and got["local_epochs"] == s["epochs"] and got["config"] == {}
    opts = {k.split(":", 1)[1]: json.loads(v) for k, v in (o.split("=", 1) for o in got["opts"])}
    method = get(row)
    assert set(opts) <= method.client_option_names() | method.server_option_names()
    assert (opts["lr"], opts["consistency_weight"], opts["reset_optimizer"]) == (0.002, 1.0, False)
    assert opts["ema_alpha"] == s["ema_alpha"] and opts["pos_weighted"] is True
    if row == "composed":
        assert (opts["isolate"], opts["classwise_head"]) == (True, True)
    else:
        assert (opts["subsets"], opts["subset_size"], opts["lambda_c"]) == (s["subsets"], s["subset_size"],
                                                                            s["sup_scale"])
    plain = rc.project_settings("fedmlp_blood", row, {**s, "pos_weight": "none"})["opts"]
    assert f"{row}:pos_weighted=false" in plain
    with pytest.raises(ValueError, match="pos_weight"):
        rc.project_settings("fedmlp_blood", row, {**s, "pos_weight": "sqrt"})


def test_the_segmentation_baselines_get_fedmixs_reference_and_options_the_methods_take(tmp_path):
    """On a segmentation preset ``fedavg``, ``oracle:fedavg`` and a floor row are checked against FedMix's
    reference at lambda = 0 (FedAvg by case counts; the floor: its site alone), the project given the reference's
    client settings, FedAvg's server by case counts and the floor no server; a floor on a site without pixel
    masks stops before anything trains, naming the file and field."""
    import reference_check as rc
    from fedlabels.data.synthetic import generate
    from fedlabels.methods import get
    from reference import fedmix

    s = {**fedmix.CHECK, "beta": 3}
    client = {"optimizer": "adam", "lr": 1e-3, "weight_decay": 1e-4, "reset_optimizer": False}
    for row, target, server in (("fedavg", "fedavg", {"weighted": True}),
                                ("oracle:fedavg", "oracle:fedavg", {"weighted": True}),
                                ("local:site-3", "local", {})):
        assert rc.method_reference(row, "fedmix") is fedmix and rc.row_kind(row, "fedmix") == "segmentation"
        got = rc.project_settings("fedmix", row, s)
        assert got["batch_size"] == 16 and got["local_epochs"] == 1 and got["config"] == {}
        opts = {k.rsplit(":", 1)[1]: json.loads(v) for k, v in (o.split("=", 1) for o in got["opts"])}
        assert {o.split("=", 1)[0].rsplit(":", 1)[0] for o in got["opts"]} == {target}
        assert opts == {**client, **server}
        method = get("fedavg")
        assert set(opts) <= method.client_option_names() | method.server_option_names()
        assert ("masks alone" if target == "local" else "averages by case counts") in rc._settings_text(s, row,
                                                                                                        "fedmix")
    assert rc.row_kind("fedavg", "fedmlp_blood") == "multilabel"  # elsewhere FedAvg keeps its multi-label reference
    with pytest.raises(SystemExit, match=r"oracle:fedavg.*not a method of the classification preset"):
        rc.main(["--preset", "isofed", "--rows", "oracle:fedavg", "--data", str(tmp_path / "x"), "--rounds", "1",
                 "--label", "x", "--out", str(tmp_path / "out")])
    data = generate("lesion", tmp_path / "l-s0", seed=0, size=32, cases=6, test_cases=3, sites=3,
                    supervision=["none", "none", "pixel"])
    with pytest.raises(SystemExit, match=r"site-1/datalist.json: field 'training\[\]\.supervision' is 'none'"):
        rc.main(["--preset", "fedmix", "--image-size", "32", "--rows", "local:site-1", "--data",
                 str(tmp_path / "l-s{seed}"), "--seeds", "0", "--rounds", "1", "--label", "x",
                 "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "cells").exists()  # nothing trained
    with pytest.raises(ValueError, match="site-1/datalist.json"):
        rc.compare_methods("fedmix", "local:site-1", data, 0, 1, [1], tmp_path / "work", image_size=32)
    assert not (tmp_path / "work").exists()


def test_the_fedst_row_gets_the_references_settings_as_options_the_method_takes():
    import reference_check as rc
    from fedlabels.methods import get
    from reference import fedst

    assert rc.method_reference("fedst", "fedmix") is fedst and rc.row_kind("fedst", "fedmix") == "segmentation"
    s = {**fedst.CHECK, "confidence": 0.8, "warmup_rounds": 7}
    got = rc.project_settings("fedmix", "fedst", s)
    assert got["batch_size"] == 16 and got["local_epochs"] == 1 and got["config"] == {}
    opts = {k.split(":", 1)[1]: json.loads(v) for k, v in (o.split("=", 1) for o in got["opts"])}
    assert opts == {"optimizer": "adam", "lr": 1e-3, "weight_decay": 1e-4, "reset_optimizer": False,
                    "confidence": 0.8, "warmup_rounds": 7, "weighted": True}
    method = get("fedst")
    server = method.make_server(**{k: opts[k] for k in ("warmup_rounds", "weighted")})
    assert server.warmup_rounds == 7 and server.weighted
    with pytest.raises(ValueError, match="threshold"):
        rc.project_settings("fedmix", "fedst", {**s, "threshold": 0.6})
    assert rc._settings(["warmup_rounds=25"], ["fedst"]) == {"warmup_rounds": 25}
    with pytest.raises(SystemExit, match="warmup_rounds: not a setting of row fedmix"):
        rc._settings(["warmup_rounds=25"], ["fedst", "fedmix"])


def test_the_fedmlp_row_gets_the_references_settings_as_options_the_method_takes():
    import reference_check as rc
    from fedlabels.methods import get
    from reference import fedmlp

    got = rc.project_settings("fedmlp_blood", "fedmlp", dict(fedmlp.CHECK))
    assert got["batch_size"] == 32 and got["local_epochs"] == 1 and got["config"] == {}
    opts = {k.split(":", 1)[1]: json.loads(v) for k, v in (o.split("=", 1) for o in got["opts"])}
    assert opts["lr"] == 3e-5 and opts["weight_decay"] == 5e-4 and opts["reset_optimizer"] is True
    assert opts["warmup_rounds"] == 50 and (opts["tau0"], opts["tau1"]) == (0.005, 0.01)
    assert (opts["degree_low"], opts["degree_high"]) == (0.3, 0.7) and opts["degree_sites"] == "missing"
    assert opts["logit_adjustment"] is True and opts["adaptive_threshold"] is True and opts["two_views"] is True
    # every option is one of the method's own (an unknown name would stop the run)
    method = get("fedmlp")
    known = set(method.client_option_names()) | set(method.server_option_names())
    assert set(opts) <= known, set(opts) - known
    # --set changes both sides
    changed = rc._settings(["tau0=0.1", "adaptive_threshold=false"], ["fedmlp"])
    opts = rc.project_settings("fedmlp_blood", "fedmlp", {**fedmlp.CHECK, **changed})["opts"]
    opts = dict(o.split("=", 1) for o in opts)
    assert opts["fedmlp:tau0"] == "0.1" and opts["fedmlp:adaptive_threshold"] == "false"
    with pytest.raises(ValueError, match="multi-label preset"):
        rc.project_settings("isofed", "fedmlp", dict(fedmlp.CHECK))
    with pytest.raises(ValueError, match="missing_prior"):  # the released code's rule: the project has no option
        rc.project_settings("fedmlp_blood", "fedmlp", {**fedmlp.CHECK, "missing_prior": "cases"})


def test_the_fedpsl_row_gets_the_references_settings_as_options_the_method_takes():
    import reference_check as rc
    from fedlabels.methods import get
    from reference import fedpsl

    got = rc.project_settings("fedmlp_blood", "fedpsl", dict(fedpsl.CHECK))
    assert got["batch_size"] == 16 and got["local_epochs"] == 10 and got["config"] == {}
    opts = {k.split(":", 1)[1]: json.loads(v) for k, v in (o.split("=", 1) for o in got["opts"])}
    assert opts == {"optimizer": "adam", "lr": 1e-3, "weight_decay": 0.0, "reset_optimizer": True,
                    "first_order": False, "pos_weighted": True}
    assert set(opts) <= get("fedpsl").client_option_names()  # an unknown name would stop the run
    opts = rc.project_settings("fedmlp_blood", "fedpsl", {**fedpsl.CHECK, **rc._settings(["second_order=false"],
                                                                                       ["fedpsl"])})["opts"]
    assert "fedpsl:first_order=true" in opts
    # the ablations: "w/ TDMA" trains without TADL (no meta-gradient option), "w/ TADL" aggregates by FedAvg
    tdma = rc.project_settings("fedmlp_blood", "fedpsl_tdma", dict(fedpsl.CHECK))["opts"]
    tadl = rc.project_settings("fedmlp_blood", "fedpsl_tadl", dict(fedpsl.CHECK))["opts"]
    assert all(o.startswith("fedpsl_tdma:") for o in tdma) and not any("first_order" in o for o in tdma)
    assert "fedpsl_tadl:first_order=false" in tadl and "fedpsl_tadl:weighted=true" in tadl
    for row, got in (("fedpsl_tdma", tdma), ("fedpsl_tadl", tadl)):
        names = {o.split(":", 1)[1].split("=", 1)[0] for o in got}
        assert names <= get(row).client_option_names() | get(row).server_option_names()
    assert rc.FEDPSL_ABLATIONS["fedpsl_tdma"] == ("plain", "tdma") and rc.method_reference("fedpsl_tadl") is fedpsl


@pytest.mark.parametrize("row", ["fedavg", "fedavg_pl"])
def test_the_fedavg_rows_get_the_references_settings_as_options_the_method_takes(row):
    import reference_check as rc
    from fedlabels.methods import get
    from reference import partial_fedavg

    assert rc.method_reference(row) is partial_fedavg
    got = rc.project_settings("fedmlp_blood", row, dict(partial_fedavg.CHECK))
    assert got["batch_size"] == 32 and got["local_epochs"] == 1 and got["config"] == {}
    opts = {k.split(":", 1)[1]: json.loads(v) for k, v in (o.split("=", 1) for o in got["opts"])}
    assert opts == {"optimizer": "adam", "lr": 3e-5, "weight_decay": 5e-4, "reset_optimizer": True,
                    "pos_weighted": False, "weighted": True}  # Eq. 1: no positive weighting
    method = get(row)
    known = set(method.client_option_names()) | set(method.server_option_names())
    assert set(opts) <= known, set(opts) - known  # an unknown name would stop the run
    # the published rows' settings by --set, on both sides
    changed = rc._settings(["lr=0.001", "batch_size=16", "weight_decay=0", "pos_weight=neg_over_pos"], [row])
    got = rc.project_settings("fedmlp_blood", row, {**partial_fedavg.CHECK, **changed})
    assert got["batch_size"] == 16 and f"{row}:pos_weighted=true" in got["opts"] and f"{row}:lr=0.001" in got["opts"]
    with pytest.raises(ValueError, match="pos_weight"):  # the released code's N / N_pos: the project has no option
        rc.project_settings("fedmlp_blood", row, {**partial_fedavg.CHECK, "pos_weight": "cases_over_pos"})
    with pytest.raises(ValueError, match="multi-label preset"):
        rc.project_settings("isofed", row, dict(partial_fedavg.CHECK))


def test_the_upper_bound_row_gets_fedavg_pls_options_and_its_reference_reads_every_label():
    """``oracle:fedavg_pl`` (the mixed federation's upper bound) is FedAvg-PL with every site on every label: the
    project row is given the options under its own name, and the reference reads each site's ``oracle.json``."""
    import reference_check as rc
    from fedlabels.bench.plan import parse_opts
    from reference import partial_fedavg

    assert rc.METHOD_ROWS["oracle:fedavg_pl"] == ("fedavg_pl", True)
    assert rc.method_reference("oracle:fedavg_pl") is partial_fedavg
    got = rc.project_settings("fedmlp_blood", "oracle:fedavg_pl", dict(partial_fedavg.CHECK))
    parsed = parse_opts(got["opts"])
    assert {target for target, _, _ in parsed} == {"oracle:fedavg_pl"}
    assert {key: value for _, key, value in parsed} == {"optimizer": "adam", "lr": 3e-5, "weight_decay": 5e-4,
                                                       "reset_optimizer": True, "pos_weighted": False,
                                                       "weighted": True}


def test_the_floor_row_is_site_1_alone_on_both_sides(tmp_path):
    """``local:site-1``: the project's floor gets FedAvg-PL's client options as ``local:`` options (no server), its
    reference trains site-1 alone one round per stretch between eval rounds, reported at the eval rounds; eval
    rounds that are not evenly spaced are refused before anything trains."""
    import reference_check as rc
    from fedlabels.bench.plan import parse_opts
    from fedlabels.data.synthetic import generate
    from reference import partial_fedavg

    got = rc.project_settings("fedmlp_blood", rc.FLOOR_ROWS[0], dict(partial_fedavg.CHECK))
    assert {target for target, _, _ in parse_opts(got["opts"])} == {"local"}
    assert not any("weighted=" in o and "pos_weighted" not in o for o in got["opts"])
    with pytest.raises(ValueError, match="evenly spaced"):
        rc.refuse_options(rc.FLOOR_ROWS[0], eval_rounds=[5, 10, 20])
    rc.refuse_options(rc.FLOOR_ROWS[0], eval_rounds=[10, 20, 30])
    calls = []

    def run(data, rounds, eval_rounds, seed, log, **kw):
        calls.append((rounds, sorted(eval_rounds), kw["epochs"], kw["only"]))
        return {"metrics": {r: {"auroc": r / 10} for r in eval_rounds}, "seconds": [2.0] * rounds}

    out = rc.floor_reference(run, tmp_path, [10, 20, 30], 0, print, {"epochs": 1, "only": "site-1"})
    assert calls == [(3, [1, 2, 3], 10, "site-1")]
    assert out["metrics"] == {10: {"auroc": 0.1}, 20: {"auroc": 0.2}, 30: {"auroc": 0.3}}
    assert len(out["seconds"]) == 30 and out["seconds_per_round"] == pytest.approx(0.2)
    # an optimizer carried across: one continuous run, in rounds of the eval rounds' greatest common divisor
    rc.refuse_options(rc.FLOOR_ROWS[0], eval_rounds=[5, 10, 20], carry_optimizer=True)
    out = rc.floor_reference(run, tmp_path, [5, 10, 20], 0, print, {"epochs": 2, "only": "site-1",
                                                                    "carry_optimizer": True})
    assert calls[-1] == (4, [1, 2, 4], 10, "site-1") and sorted(out["metrics"]) == [5, 10, 20]
    # the whole cell, both sides, on a tiny scenario
    data = generate("cxr", tmp_path / "cxr", seed=0, size=32, cases=12, test_cases=24)
    cell = rc.compare_methods("fedmlp_blood", rc.FLOOR_ROWS[0], data, 0, 2, [1, 2], tmp_path / "work", log=lambda m: None,
                              settings={"batch_size": 8, "lr": 1e-3})
    assert [sorted(p["metrics"]) for p in cell["projects"]] == [["1", "2"], ["1", "2"]]
    assert sorted(cell["reference_run"]["metrics"]) == ["1", "2"]
    assert all(0 <= run["metrics"]["2"]["auroc"] <= 1 for run in (*cell["projects"], cell["reference_run"]))
    # the project's seconds per round are its measured training per stretch (one round each here), not its whole run
    assert all(len(p["train_seconds"]) == 2 and p["seconds"] == p["train_seconds"] for p in cell["projects"])
    # one stretch of two rounds: its measured seconds spread over both
    two = rc.compare_methods("fedmlp_blood", rc.FLOOR_ROWS[0], data, 0, 2, [2], tmp_path / "work2", log=lambda m: None,
                             settings={"batch_size": 8, "lr": 1e-3})
    assert all(len(p["train_seconds"]) == 1 and p["seconds"] == [p["train_seconds"][0] / 2] * 2 for p in two["projects"])


def test_a_classification_floor_row_is_the_labeled_site_alone_on_both_sides(tmp_path):
    """``local:site-1`` on a classification preset: the project's floor gets the semi-supervised reference's client
    options as ``local:`` items (no server, no unlabeled-site options); the reference is wFedAvg's on that site
    alone (a segmentation preset's floor: test_the_segmentation_baselines_...)."""
    import reference_check as rc
    from fedlabels.data.synthetic import generate
    from reference import semisup

    row = rc.FLOOR_ROWS[0]
    assert rc.method_reference(row, "isofed") is semisup and rc.row_kind(row, "isofed") == "classification"
    got = rc.project_settings("isofed", row, dict(semisup.CHECK))
    opts = dict(o.split("=", 1) for o in got["opts"])
    assert {o.split(":", 1)[0] for o in opts} == {"local"}
    assert opts["local:optimizer"] == '"sgd"' and opts["local:reset_optimizer"] == "false"
    assert not {"local:lambda_c", "local:consistency_weight", "local:warmup_rounds"} & set(opts)
    data = generate("medmnist", tmp_path / "m", seed=0, cases=160, test_cases=16, labeled=[0])
    cell = rc.compare_methods("isofed", row, data, 0, 2, [1, 2], tmp_path / "work", log=lambda m: None,
                              settings={"batch_size": 16})
    assert [sorted(p["metrics"]) for p in cell["projects"]] == [["1", "2"], ["1", "2"]]
    assert sorted(cell["reference_run"]["metrics"]) == ["1", "2"]
    assert all(0 <= run["metrics"]["2"]["accuracy"] <= 1 for run in (*cell["projects"], cell["reference_run"]))
    text = rc._settings_text(cell["reference"], row, "isofed")
    assert "labeled site trains alone" in text and "batch_size 16" in text
    assert not any(k in text for k in ("lambda_u", "warmup_rounds", "warm_start", "subsets"))  # no federation here


def test_the_fedprox_row_gets_the_references_settings_as_options_the_method_takes():
    import reference_check as rc
    from fedlabels.methods import get
    from reference import fedprox

    assert rc.method_reference("fedprox") is fedprox
    got = rc.project_settings("cxr", "fedprox", dict(fedprox.CHECK))
    opts = {k.split(":", 1)[1]: json.loads(v) for k, v in (o.split("=", 1) for o in got["opts"])}
    assert got["batch_size"] == 16 and got["local_epochs"] == 10 and got["config"] == {}
    assert opts == {"optimizer": "adam", "lr": 1e-3, "weight_decay": 0.0, "reset_optimizer": True,
                    "pos_weighted": True, "mu": 0.001, "weighted": True}  # FedPSL Sec. VII-C, VII-D3
    method = get("fedprox")
    assert set(opts) <= set(method.client_option_names()) | set(method.server_option_names())
    got = rc.project_settings("cxr", "fedprox", {**fedprox.CHECK, **rc._settings(["mu=0.01"], ["fedprox"])})
    assert "fedprox:mu=0.01" in got["opts"]


def test_the_fedfixmatch_row_gets_the_references_settings_as_options_the_method_takes():
    import reference_check as rc
    from fedlabels.methods import get
    from reference import fedfixmatch

    got = rc.project_settings("fedmlp_blood", "fedfixmatch", dict(fedfixmatch.CHECK))
    opts = dict(o.split(":", 1)[1].split("=", 1) for o in got["opts"])
    assert float(opts["confidence"]) == 0.8 and float(opts["lambda_u"]) == 1.0 and float(opts["lr"]) == 3e-5
    assert float(opts["weight_decay"]) == 5e-4 and opts["reset_optimizer"] == "true" and opts["pos_weighted"] == "false"
    assert (got["batch_size"], got["local_epochs"]) == (32, 1)
    method = get("fedfixmatch")  # every option is one the method takes
    assert set(opts) <= set(method.client_option_names()) | set(method.server_option_names())
    changed = rc._settings(["confidence=0.9", "pos_weight=\"neg_over_pos\""], ["fedfixmatch"])
    opts = dict(o.split(":", 1)[1].split("=", 1) for o in
                rc.project_settings("fedmlp_blood", "fedfixmatch", {**fedfixmatch.CHECK, **changed})["opts"])
    assert float(opts["confidence"]) == 0.9 and opts["pos_weighted"] == "true"


def test_the_fednoro_row_gets_the_references_settings_as_options_the_method_takes():
    import reference_check as rc
    from fedlabels.methods import get
    from reference import fednoro

    got = rc.project_settings("fedmlp_blood", "fednoro", dict(fednoro.CHECK))
    opts = dict(o.split(":", 1)[1].split("=", 1) for o in got["opts"])
    assert (float(opts["kd_weight"]), float(opts["temperature"])) == (0.8, 0.8)
    assert (int(opts["rampup_begin"]), int(opts["rampup_end"])) == (10, 499) and opts["reset_optimizer"] == "true"
    method = get("fednoro")
    assert set(opts) <= set(method.client_option_names()) | set(method.server_option_names())
    # the published row's ramp over its 30 rounds reaches both sides
    changed = rc._settings(["rampup_begin=0", "rampup_end=29"], ["fednoro"])
    opts = dict(o.split(":", 1)[1].split("=", 1) for o in
                rc.project_settings("fedmlp_blood", "fednoro", {**fednoro.CHECK, **changed})["opts"])
    assert (int(opts["rampup_begin"]), int(opts["rampup_end"])) == (0, 29)


def test_the_surgical_row_gets_the_references_settings_as_options_the_method_takes():
    import reference_check as rc
    from fedlabels.methods import get
    from reference import surgical

    got = rc.project_settings("cxr", "surgical", dict(surgical.CHECK))
    opts = {k.split(":", 1)[1]: json.loads(v) for k, v in (o.split("=", 1) for o in got["opts"])}
    assert got["batch_size"] == 64 and got["local_epochs"] == 1 and got["config"] == {}
    assert opts == {"optimizer": "adam", "lr": 5e-5, "weight_decay": 0.0, "reset_optimizer": False,
                    "warmup_epochs": 15, "warmup_lr": 5e-3, "pos_weighted": False,  # the paper's plain BCE
                    "weighted": False}  # Eq. 1 as printed
    method = get("surgical")
    assert set(opts) <= set(method.client_option_names()) | set(method.server_option_names())
    # bench_cxr's published row by --set, on both sides: the project's weighting, no warm-up, lr 1e-3, batch 16
    changed = rc._settings(["pos_weight=neg_over_pos", "warmup_epochs=0", "lr=0.001", "batch_size=16"], ["surgical"])
    got = rc.project_settings("cxr", "surgical", {**surgical.CHECK, **changed})
    assert {"surgical:pos_weighted=true", "surgical:warmup_epochs=0", "surgical:lr=0.001"} <= set(got["opts"])
    assert got["batch_size"] == 16
    with pytest.raises(ValueError, match="pos_weight"):
        rc.project_settings("cxr", "surgical", {**surgical.CHECK, "pos_weight": "cases_over_pos"})


def test_one_class_everywhere_reads_every_run_of_both_sides():
    import reference_check as rc

    def cell(a, b, ref):
        return {"projects": [{"metrics": {"5": {"classes_predicted": a}}}, {"metrics": {"5": {"classes_predicted": b}}}],
                "reference_run": {"metrics": {"5": {"classes_predicted": ref}}}}

    assert rc.one_class_everywhere([cell(1, 1, 1), cell(1, 1, 1)], 5)
    assert not rc.one_class_everywhere([cell(1, 1, 1), cell(1, 2, 1)], 5)
    assert not rc.one_class_everywhere([cell(1, 1, 2)], 5)


def test_tag_counts_sum_the_sites_tags_made_before_each_eval_round():
    import reference_check as rc

    # engine records: 0-based rounds; FedMLP reports the tags each site made in that round
    records = [{"round": 0, "sites": {"a": {"tagged_negatives": 0, "tagged_positives": 0}, "b": {}}},
               {"round": 1, "sites": {"a": {"tagged_negatives": 5, "tagged_positives": 2},
                                      "b": {"tagged_negatives": 1, "tagged_positives": 3}}},
               {"round": 2, "sites": {"a": {"tagged_negatives": 4, "tagged_positives": 0}}}]
    assert rc.tag_counts(records, [1, 2, 3]) == {1: [0, 0], 2: [6, 5], 3: [10, 5]}
    assert rc.tag_counts([{"round": 0, "sites": {"a": {"loss": 0.3}}}], [1]) == {}  # a row that tags nothing


def test_no_augmentation_reaches_the_fedavg_reference_and_is_refused_elsewhere(tmp_path, monkeypatch):
    import reference_check as rc
    from fedlabels.data.synthetic import generate
    from reference import fedavg_multilabel, partial_fedavg

    data = generate("cxr", tmp_path / "cxr", seed=0, size=16, cases=10, test_cases=30)

    def refuse(x, gen):
        raise AssertionError("augmented")

    monkeypatch.setattr(fedavg_multilabel, "augment", refuse)
    out = partial_fedavg.run(data, 1, {1}, augment=False, batch_size=8, log=lambda m: None)
    assert 0 <= out["metrics"][1]["auroc"] <= 1
    with pytest.raises(AssertionError, match="augmented"):
        partial_fedavg.run(data, 1, {1}, batch_size=8, log=lambda m: None)
    with pytest.raises(ValueError, match="no-augmentation"):  # before the project trains
        rc.compare_methods("cxr", "surgical", data, 0, 1, [1], tmp_path / "work", augment=False)
    with pytest.raises(SystemExit, match="--rows fedpsl: --no-augmentation"):  # the row that cannot, named
        rc.main(["--preset", "cxr", "--rows", "fedavg_pl,fedpsl", "--no-augmentation", "--data", str(data),
                 "--rounds", "1", "--label", "x", "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="widen"):  # the classification references have no width option
        rc.compare_methods("isofed", "isofed", data, 0, 1, [1], tmp_path / "work", widen=0.5)
    with pytest.raises(SystemExit, match="reference-grey"):  # the classification references keep the channels
        rc.main(["--preset", "isofed", "--rows", "isofed", "--reference-grey", "mean", "--data", str(data),
                 "--rounds", "1", "--label", "x", "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="reference-grey"):
        rc.compare_methods("isofed", "isofed", data, 0, 1, [1], tmp_path / "work", grey="mean")
    with pytest.raises(ValueError, match="reference-runs"):  # before the project trains
        rc.compare_methods("isofed", "isofed", data, 0, 1, [1], tmp_path / "work", reference_runs=2)
    with pytest.raises(SystemExit, match="reference-runs"):
        rc.main(["--preset", "isofed", "--rows", "isofed", "--reference-runs", "2", "--data", str(data),
                 "--rounds", "1", "--label", "x", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "work").exists() and not (tmp_path / "out" / "cells").exists()  # nothing trained


def test_a_segmentation_reference_runs_as_often_as_told(tmp_path, monkeypatch):
    import reference_check as rc
    from reference import fedst

    seen = []
    monkeypatch.setattr(rc, "project_cell", lambda *a, **kw: {"metrics": {1: {"dice": 0.5}}})
    monkeypatch.setattr(fedst, "run", lambda data, rounds, ev, seed, log, **s:
                        seen.append((seed, s["warmup_rounds"])) or {"metrics": {1: {"dice": seed / 1e4}}})
    cell = rc.compare_methods("fedmix", "fedst", tmp_path, 2, 1, [1], tmp_path / "work", reference_runs=3,
                              settings={"warmup_rounds": 4})
    assert seen == [(2, 4), (2 + rc.SEED_OFFSET, 4), (2 + 2 * rc.SEED_OFFSET, 4)]
    assert [r["metrics"]["1"]["dice"] for r in rc.reference_runs(cell)] == [s / 1e4 for s, _ in seen]
    assert rc.reference_metric(cell, 1, "dice") == pytest.approx(np.mean([s / 1e4 for s, _ in seen]))


def test_fednoro_reference_trains_unaugmented_when_told(tmp_path, monkeypatch):
    from fedlabels.data.synthetic import generate
    from reference import fedavg_multilabel, fednoro

    data = generate("cxr", tmp_path / "cxr", seed=0, size=16, cases=10, test_cases=30)

    def refuse(x, gen):
        raise AssertionError("augmented")

    monkeypatch.setattr(fedavg_multilabel, "augment", refuse)
    out = fednoro.run(data, 2, {2}, augment=False, batch_size=8, rampup_begin=0, rampup_end=1, log=lambda m: None)
    assert 0 <= out["metrics"][2]["auroc"] <= 1
    with pytest.raises(AssertionError, match="augmented"):
        fednoro.run(data, 1, {1}, batch_size=8, log=lambda m: None)


MULTILABEL_ROWS = ["fedavg", "fedavg_pl", "oracle:fedavg_pl", *(f"local:site-{k}" for k in range(1, 9)), "fedprox", "surgical", "fedmlp", "fedpsl", "fedpsl_tdma", "fedpsl_tadl",
                   "fedfixmatch", "fednoro", "rscfed_pl", "composed"]


@pytest.mark.parametrize("row", MULTILABEL_ROWS)
def test_every_multilabel_reference_reads_colour_as_the_bundles_do_unless_told(tmp_path, monkeypatch, row):
    """The multi-label references make colour images grey by the bundles' rule (the mean of R, G and B) unless
    ``--reference-grey luma`` says otherwise; each cell records the rule its reference read."""
    import reference_check as rc
    from reference import fedavg_multilabel

    assert sorted(r for r, kind in rc.ROW_KIND.items() if kind == "multilabel") == sorted(MULTILABEL_ROWS)
    seen = []

    def load(data, scaling, labels="datalist.json", grey_rule="luma", only=None, keep_unannotated=False):
        seen.append(grey_rule)
        raise RuntimeError("loaded")

    monkeypatch.setattr(fedavg_multilabel, "load_scenario", load)
    monkeypatch.setattr(rc, "project_cell", lambda *a, **k: {"metrics": {}})  # the project side is not under test
    for grey, expect in ((None, "mean"), ("luma", "luma")):
        with pytest.raises(RuntimeError, match="loaded"):
            rc.compare_methods("fedmlp_blood", row, tmp_path, 0, 1, [1], tmp_path / "work", grey=grey)
        assert seen.pop() == expect


def test_sections_list_dropped_sites_by_site_and_rounds():
    """A site out of many rounds reads as one entry per site ("site-4 in 3 round(s), 1-3"), on either side."""
    import json

    import reference_check as rc

    def run(dropped):
        return {"metrics": {"1": {"auroc": 0.8}, "3": {"auroc": 0.9}}, "seconds": [1.0, 1.0], "dropped": dropped}

    cells = [{"kind": "methods", "label": "x", "preset": "fedmlp_blood", "row": "fedavg", "metric": "auroc",
              "seed": s, "reference": json.loads(json.dumps(rc.method_reference("fedavg").CHECK)),
              "projects": [{**run({"1": ["site-4"], "2": ["site-4"], "3": ["site-4", "site-2"]}), "train_seed": s},
                           {**run({}), "train_seed": s + 1000}],
              "reference_run": run({"2": ["site-3"]}), "reference_grey": "mean"} for s in (0, 1)]
    text = "\n".join(rc._methods_section("x", "fedmlp_blood", cells, rc.TOLERANCE))
    assert "`fedavg` split 0 seed 0: site-2 in 1 round(s), 3-3, site-4 in 3 round(s), 1-3;" in text
    assert "seed 1000" not in text.split("Project sites")[1].split("\n")[0]  # a run that dropped none is not listed
    assert "`fedavg` split 1: site-3 in 1 round(s), 2-2." in text


def test_a_kept_cell_written_by_other_code_says_so(tmp_path, capsys):
    import reference_check as rc
    from fedlabels.release import code_version

    cell = tmp_path / "x-seed0.json"
    cell.write_text(json.dumps({"code": code_version()}))
    rc._skipped(cell, {}, [])
    assert capsys.readouterr().out == "[check] x-seed0.json: done, skipped\n"
    cell.write_text(json.dumps({"code": "0.0.9 0123abc"}))
    rc._skipped(cell, {}, [])
    assert capsys.readouterr().out == (f"[check] x-seed0.json: done, skipped (written by 0.0.9 0123abc; the code "
                                       f"now: {code_version()})\n")
    cell.write_text(json.dumps({}))
    rc._skipped(cell, {}, [])
    assert "(written by code not recorded;" in capsys.readouterr().out


def test_a_multilabel_cell_is_resumed_without_naming_the_default_grey_rule(tmp_path, capsys):
    """A multi-label cell records the grey rule it ran (the default, the mean of R, G and B, when none is given): the
    same command without --reference-grey keeps it instead of refusing it."""
    import shutil

    import reference_check as rc
    from fedlabels.data.synthetic import generate

    generate("cxr", tmp_path / "d-s0", seed=0, size=32, cases=6, test_cases=12)  # the size the preset trains at
    name = "bloodmnist-mixed-baselines-fedavg_pl-seed0.json"
    (tmp_path / "out" / "cells").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "results" / "reference_check" / "cells" / name, tmp_path / "out" / "cells")
    assert json.loads((tmp_path / "out" / "cells" / name).read_text())["reference_grey"] == "mean"
    rc.main(["--preset", "fedmlp_blood", "--rows", "fedavg_pl", "--data", str(tmp_path / "d-s{seed}"), "--seeds", "0",
             "--rounds", "30", "--eval-rounds", "10,20,30", "--label", "bloodmnist-mixed-baselines",
             "--out", str(tmp_path / "out"), "--set", "lr=0.001", "--set", "batch_size=16", "--set", "weight_decay=0",
             "--set", "pos_weight=neg_over_pos"])
    assert f"{name}: done, skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="field 'reference_grey' is 'mean' in the finished cell, this command asks "
                                         "'luma'"):
        rc.main(["--preset", "fedmlp_blood", "--rows", "fedavg_pl", "--data", str(tmp_path / "d-s{seed}"),
                 "--seeds", "0", "--rounds", "30", "--eval-rounds", "10,20,30", "--label", "bloodmnist-mixed-baselines",
                 "--out", str(tmp_path / "out"), "--set", "lr=0.001", "--set", "batch_size=16", "--set",
                 "weight_decay=0", "--set", "pos_weight=neg_over_pos", "--reference-grey", "luma"])


def test_a_cell_of_the_same_label_but_other_settings_is_refused_naming_the_field(tmp_path, capsys):
    """A cell is found by its label: one another command wrote with other rounds, a reference setting or too few
    scored rounds stops the check with the cell and the field; a field the cell does not record is not compared."""
    import reference_check as rc

    cell = tmp_path / "x-isofed-seed0.json"
    cell.write_text(json.dumps({"preset": "isofed_rscfed", "row": "isofed", "rounds": 60, "image_size": None,
                                "reference": {"lr": 0.03, "warmup_rounds": 7},
                                "reference_run": {"metrics": {"20": {}, "40": {}, "60": {}}}}))
    asked = {"preset": "isofed_rscfed", "row": "isofed", "rounds": 60, "image_size": None, "widen": 2.0,
             "reference.warmup_rounds": 7}
    rc._skipped(cell, asked, [20, 60])  # widen: not recorded by this cell
    assert "done, skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"x-isofed-seed0.json: field 'rounds' is 60 in the finished cell, this "
                                         r"command asks 30"):
        rc._skipped(cell, {**asked, "rounds": 30}, [30])
    with pytest.raises(SystemExit, match=r"field 'reference.warmup_rounds' is 7 in the finished cell, this command "
                                         r"asks 0"):
        rc._skipped(cell, {**asked, "reference.warmup_rounds": 0}, [60])
    with pytest.raises(SystemExit, match=r"field 'eval rounds' is \[20, 40, 60\] in the finished cell, this command "
                                         r"asks \[10, 60\]"):
        rc._skipped(cell, asked, [10, 60])
    with pytest.raises(SystemExit, match=r"field 'reference runs' is 1 in the finished cell, this command asks 3"):
        rc._skipped(cell, asked, [60], runs=3)
    assert capsys.readouterr().out == ""
    rc._skipped(cell, asked, [60], runs=1)
    assert "done, skipped" in capsys.readouterr().out


def test_a_split_prepared_at_another_size_than_the_project_trains_at_stops_before_training(tmp_path):
    """The reference reads the prepared images at their size and the project resizes them to the preset's size: a
    32 px split under the fedmix preset (which trains at 224 px) stops, naming the file and field,
    before anything is written; given --image-size 32 the same split passes."""
    import reference_check as rc
    from types import SimpleNamespace

    data = tmp_path / "ph2-s0"
    data.mkdir()
    (data / "scenario.yaml").write_text("name: x\nimage_size: [32, 32]\n")
    with pytest.raises(SystemExit, match=r"ph2-s0/scenario.yaml: field 'image_size' is 32 px, but the project "
                                         r"would train at 224 px \(preset 'fedmix'\).*--image-size 32"):
        rc.main(["--preset", "fedmix", "--rows", "fedmix", "--data", str(tmp_path / "ph2-s{seed}"), "--seeds", "0",
                 "--rounds", "1", "--label", "x", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    rc._check_sizes(SimpleNamespace(preset="fedmix", image_size=32, data=str(data)), [0])  # its own size: no stop
    with pytest.raises(SystemExit, match="field 'image_size' is 32 px, but the project would train at 48 px "
                                         r"\(--image-size\)"):
        rc._check_sizes(SimpleNamespace(preset="fedmix", image_size=48, data=str(data)), [0])
