"""Scenario validation: one test per kind of bad input, each naming file and field."""

import json
import shutil

import numpy as np
import pytest
import yaml

from fedlabels.data.synthetic import generate
from fedlabels.profile import ScenarioError, load_scenario, scenario_writer


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("scen")
    sizes = {"cxr": 12, "medmnist": 120, "lesion": 12}
    return {f: generate(f, root / f, seed=1, cases=n, test_cases=8) for f, n in sizes.items()}


@pytest.fixture
def scen(pristine, tmp_path):
    def copy(family):
        dst = tmp_path / family
        shutil.copytree(pristine[family], dst)
        return dst

    return copy


def edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def edit_yaml(path, fn):
    data = yaml.safe_load(path.read_text())
    fn(data)
    path.write_text(yaml.safe_dump(data))


def expect(root, *fragments):
    with pytest.raises(ScenarioError) as err:
        load_scenario(root)
    for frag in fragments:
        assert frag in str(err.value), str(err.value)
    return err.value


def test_valid_scenarios_load(pristine):
    for family, root in pristine.items():
        sc = load_scenario(root)
        assert sc.task == {"cxr": "multilabel", "medmnist": "multiclass", "lesion": "segmentation"}[family]
        assert list(sc.sites) == ["site-1", "site-2", "site-3", "site-4"]
        assert sc.test and all(p.startswith("/") for p in (sc.test[0]["image"],))


def test_missing_image_file(scen):
    root = scen("cxr")
    item = json.loads((root / "site-2/datalist.json").read_text())["training"][3]
    (root / "site-2" / item["image"]).unlink()
    err = expect(root, "site-2/datalist.json", "item training[3]", "field 'image'", "file not found")
    assert err.field == "image"


def test_missing_profile(scen):
    root = scen("cxr")
    (root / "site-3/profile.yaml").unlink()
    expect(root, "site-3/profile.yaml", "missing file")


def test_label_vector_wrong_length(scen):
    root = scen("cxr")
    edit_json(root / "site-1/datalist.json", lambda d: d["validation"][0].update(label=[0, 1, 0]))
    expect(root, "site-1/datalist.json", "item validation[0]", "field 'label'", "expected a list of 6 entries", "got 3")


def test_label_on_class_site_does_not_annotate(scen):
    root = scen("cxr")
    def fn(d):
        d["training"][0]["label"][5] = 1  # pneumothorax: site-1 does not annotate it
    edit_json(root / "site-1/datalist.json", fn)
    expect(root, "item training[0]", "'pneumothorax'", "does not annotate")


def test_unknown_class_name(scen):
    root = scen("cxr")
    edit_yaml(root / "site-2/profile.yaml", lambda d: d["annotated"].append("cardiomegaly"))
    expect(root, "site-2/profile.yaml", "field 'annotated'", "unknown class name 'cardiomegaly'")


def test_class_list_disagrees_with_scenario(scen):
    root = scen("cxr")
    edit_yaml(root / "site-4/profile.yaml", lambda d: d["classes"].reverse())
    expect(root, "site-4/profile.yaml", "field 'classes'", "disagrees")


def test_box_outside_image(scen):
    root = scen("lesion")
    def fn(d):
        d["training"][0]["boxes"] = [[10, 10, 70, 20, 0]]  # image is 64 px wide
    edit_json(root / "site-2/datalist.json", fn)
    expect(root, "site-2/datalist.json", "item training[0]", "field 'boxes'", "outside the 64x64 image")


def test_unknown_supervision_level(scen):
    root = scen("lesion")
    edit_json(root / "site-1/datalist.json", lambda d: d["training"][1].update(supervision="scribble"))
    expect(root, "item training[1]", "field 'supervision'", "unknown supervision level 'scribble'")


def test_unknown_site_supervision(scen):
    root = scen("cxr")
    edit_yaml(root / "site-1/profile.yaml", lambda d: d.update(supervision="weak"))
    expect(root, "site-1/profile.yaml", "field 'supervision'")


def test_site_that_labels_nothing(scen):
    root = scen("cxr")
    edit_yaml(root / "site-3/profile.yaml", lambda d: d.update(annotated=[]))
    # the datalist still carries labels, but the profile check comes first
    expect(root, "site-3/profile.yaml", "field 'annotated'", "annotates no class")


def test_multiclass_label_out_of_range(scen):
    root = scen("medmnist")
    edit_json(root / "site-1/datalist.json", lambda d: d["training"][0].update(label=8))
    expect(root, "site-1/datalist.json", "field 'label'", "[-1, 7]")


def test_unlabeled_site_with_labels(scen):
    root = scen("medmnist")
    edit_json(root / "site-2/datalist.json", lambda d: d["training"][0].update(label=2))
    expect(root, "site-2/datalist.json", "supervision 'none'")


def test_pixel_case_without_mask(scen):
    root = scen("lesion")
    edit_json(root / "site-1/datalist.json", lambda d: d["training"][0].pop("seg"))
    expect(root, "site-1/datalist.json", "field 'seg'", "missing")


def test_invalid_json(scen):
    root = scen("medmnist")
    (root / "site-4/datalist.json").write_text("{not json")
    expect(root, "site-4/datalist.json", "not valid JSON")


def test_label_summary_counts(pristine):
    sc = load_scenario(pristine["cxr"])
    site = sc.site("site-4")
    summ = site.summary()
    labels = np.array([i["label"] for i in site.training])
    assert summ["cases"] == len(labels)
    assert summ["annotated"] == (labels >= 0).sum(0).tolist()
    assert summ["positives"] == (labels == 1).sum(0).tolist()
    assert summ["labeled_mask"] == [False, False, False, True, True, True]


def test_every_real_summary_passes_the_servers_screen_and_each_hostile_one_is_named(pristine):
    from fedlabels.profile import check_summaries, check_summary

    for family, root in pristine.items():  # every site of every embedded family, labeled or not
        for name, site in load_scenario(root).sites.items():
            assert check_summary(site.summary()) is None, (family, name)
    good = load_scenario(pristine["cxr"]).site("site-4").summary()
    cases = good["cases"]
    for change, reason in [
        ("not a dict", "a str, not a mapping"),
        ({"task": "detection"}, "field 'task': 'detection'"),
        ({"cases": "many"}, "field 'cases': 'many' is not a count"),
        ({"cases": True}, "field 'cases': True is not a count"),
        ({"labeled": 1}, "field 'labeled': 1 is not true or false"),
        ({"annotated": "all"}, "field 'annotated': 'all' is not a list"),
        ({"positives": good["positives"][:-1]}, "lengths [6, 5, 6] differ"),
        ({"labeled_mask": [1] * 6}, "field 'labeled_mask': not all true or false"),
        ({"annotated": [cases + 1] * 6}, f"field 'annotated': not all counts between 0 and the site's {cases} cases"),
        ({"annotated": [0] * 6, "positives": [0] * 6}, "field 'labeled': True, but the site annotated 0 cases"),
        ({"annotated": [0] * 6}, "more positives than annotated"),
        ({"privacy": "spent nothing"}, "field 'privacy': not a report"),
        ({"privacy": {"epsilon": 1.0}}, "field 'privacy': not a report"),
        ({"cases": 10**8, "annotated": [10**8] * 6}, "field 'cases': 100000000 is more than the 10000000"),
        # a report that would widen the site's case bound without limit (6 x noise_multiplier x clip cases)
        ({"privacy": {"noise_multiplier": 1e12, "clip": 4.0, "epsilon": 1.0, "delta": 1e-5, "releases": 1}},
         "field 'privacy.noise_multiplier': 1000000000000.0 is not in (0, 20.0]"),
        ({"privacy": {"noise_multiplier": float("inf"), "clip": 4.0, "epsilon": 1.0, "delta": 1e-5, "releases": 1}},
         "not a report with the finite numbers"),
        ({"privacy": {"noise_multiplier": 1.0, "clip": 500.0, "epsilon": 1.0, "delta": 1e-5, "releases": 1}},
         "field 'privacy.clip': 500.0 is not in (0, 20.0]"),
    ]:
        hostile = change if isinstance(change, str) else {**good, **change}
        assert reason in (check_summary(hostile) or ""), (change, check_summary(hostile))
    medmnist = load_scenario(pristine["medmnist"]).site("site-1").summary()
    assert check_summaries({"site-1": good, "site-2": dict(good)}) is None
    assert check_summaries({"site-1": good, "site-2": {**good, "cases": -1}}).startswith("site-2's label summary: ")
    assert "different tasks" in check_summaries({"site-1": good, "site-2": medmnist})
    short = {**good, **{k: good[k][:5] for k in ("annotated", "positives", "labeled_mask")}}
    assert "different numbers of classes: {'site-1': 6, 'site-2': 5}" in check_summaries({"site-1": good, "site-2": short})


def test_interrupted_write_leaves_previous_scenario(pristine, tmp_path):
    root = tmp_path / "s"
    shutil.copytree(pristine["cxr"], root)
    with pytest.raises(RuntimeError):
        with scenario_writer(root) as tmp:
            (tmp / "half").mkdir()
            raise RuntimeError("interrupted")
    load_scenario(root)  # the previous complete scenario is intact
    assert not list(tmp_path.glob("s.partial-*"))
