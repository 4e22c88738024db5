"""The embedded default data: deterministic, the right layout, boxes that hold their masks."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from fedlabels.data import synthetic
from fedlabels.data.synthetic import CXR_ANNOTATED_FRACTION, CXR_SITE_CLASSES, cxr_site_cases, generate
from fedlabels.profile import load_scenario
from helpers import digest


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = generate("cxr", tmp_path / "a", seed=3, cases=10, test_cases=6)
    b = generate("cxr", tmp_path / "b", seed=3, cases=10, test_cases=6)
    c = generate("cxr", tmp_path / "c", seed=4, cases=10, test_cases=6)
    assert digest(a) == digest(b)
    assert digest(a) != digest(c)


def test_cxr_partial_label_layout(tmp_path):
    sc = load_scenario(generate("cxr", tmp_path / "cxr", seed=0, cases=60, test_cases=20))
    # each test case says whose site style it was drawn in (benchmarks score per group)
    assert [i["group"] for i in sc.test[:5]] == ["site-1", "site-2", "site-3", "site-4", "site-1"]
    counts = {c: 0 for c in sc.classes}
    for k, site in enumerate(sc.sites.values()):
        assert list(site.profile.annotated) == [c for c in sc.classes if c in CXR_SITE_CLASSES[k]]
        labels = np.array([i["label"] for i in site.training + site.validation])
        mask = site.profile.labeled_mask
        assert (labels[:, ~mask] == -1).all()
        for c in site.profile.annotated:
            counts[c] += 1
        # the oracle holds the full labels, agreeing wherever the site labels
        oracle = site.oracle()
        full = np.array([i["label"] for i in oracle["training"]])
        part = np.array([i["label"] for i in site.training])
        seen = part >= 0
        assert (full[seen] == part[seen]).all() and set(np.unique(full)) <= {0, 1}
    # FedPSL Table I: infiltration and pneumothorax are labeled by one site only
    assert counts["infiltration"] == 1 and counts["pneumothorax"] == 1 and counts["atelectasis"] == 3
    test = np.array([i["label"] for i in sc.test])
    assert (test >= 0).all() and test.shape == (20, 6)
    img = np.asarray(Image.open(sc.test[0]["image"]))
    assert img.shape == (64, 64) and img.dtype == np.uint8


def test_cxr_drop_k_classes_keeps_the_images_and_full_labels_of_a_seed_at_every_k(tmp_path):
    """``missing=k``: each site annotates 6 - k findings on every case, every finding somewhere, and the
    images and full labels of a seed are the same at every k (two levels differ in what is annotated;
    FedPSL Table I's default draws its partial annotation from the same stream, so its test images differ)."""
    roots = {k: generate("cxr", tmp_path / f"m{k}", seed=1, cases=12, test_cases=4, size=16, missing=k)
             for k in (1, 4)}
    scs = {k: load_scenario(r) for k, r in roots.items()}
    for k, sc in scs.items():
        covered = set()
        for site in sc.sites.values():
            assert len(site.profile.annotated) == 6 - k
            covered |= set(site.profile.annotated)
            labels = np.array([i["label"] for i in site.training + site.validation])
            mask = site.profile.labeled_mask
            assert (labels[:, mask] >= 0).all() and (labels[:, ~mask] == -1).all()  # every case, only its classes
        assert covered == set(sc.classes)
        assert sc.meta["provenance"]["missing"] == k
    images = {k: sorted((p.relative_to(r), p.read_bytes()) for p in r.rglob("*.png")) for k, r in roots.items()}
    assert images[1] == images[4]
    for a, b in zip(scs[1].sites.values(), scs[4].sites.values()):
        assert [i["label"] for i in a.oracle()["training"]] == [i["label"] for i in b.oracle()["training"]]
    with pytest.raises(ValueError, match="cannot cover all 6 classes"):
        generate("cxr", tmp_path / "m5", seed=1, cases=12, missing=5)  # 4 sites, one finding each
    assert not (tmp_path / "m5").exists()


def test_cxr_site_sizes_differ(tmp_path):
    sc = load_scenario(generate("cxr", tmp_path / "cxr", seed=0, cases=60, test_cases=4))
    sizes = [len(s.training) + len(s.validation) for s in sc.sites.values()]
    # round(CXR_SITE_SCALE[k] * cases): cases is the size of a reference site
    assert sizes == cxr_site_cases(60) == [60, 36, 96, 48]
    assert sc.meta["provenance"]["site_cases"] == dict(zip(sc.sites, sizes))
    assert cxr_site_cases(1) == [2, 2, 2, 2]  # every site keeps a training and a validation case


def test_cxr_partial_annotation_inside_sites(tmp_path):
    """A site annotates some of its classes on part of its cases: n_k^c < n_k, in site-specific proportions."""
    sc = load_scenario(generate("cxr", tmp_path / "cxr", seed=0, cases=60, test_cases=4))
    frac = {}
    for k, site in enumerate(sc.sites.values()):
        for split in (site.training, site.validation):
            labels = np.array([i["label"] for i in split])
            m = len(split)
            for c, name in enumerate(sc.classes):
                n_c = int((labels[:, c] >= 0).sum())
                f = CXR_ANNOTATED_FRACTION[k].get(name)
                if f is None:
                    assert n_c == 0
                else:  # exactly max(1, round(f m)) per split: every annotated class has cases in both
                    assert n_c == min(m, max(1, int(f * m + 0.5))) >= 1, (site.name, name)
        summ = site.summary()
        assert summ["cases"] == len(site.training)
        frac[site.name] = np.array(summ["annotated"]) / summ["cases"]
        # every site annotates at least one class on every case
        assert (np.array([i["label"] for i in site.training]) >= 0).any(1).all()
    # within-site partial annotation: n_k^c < n_k for some annotated class at sites 2-4
    for name in ("site-2", "site-3", "site-4"):
        mask = np.array(sc.site(name).profile.labeled_mask)
        assert (frac[name][mask] < 1).any() and (frac[name][mask] == 1).any()
    assert (frac["site-1"][:3] == 1).all()
    # not proportional across sites: a shared class's annotated share differs between the sites labeling it
    nodule = sc.classes.index("nodule")
    shares = [frac[s][nodule] for s in ("site-2", "site-3", "site-4")]
    assert len({round(v, 2) for v in shares}) == 3, shares
    atelectasis = sc.classes.index("atelectasis")
    assert frac["site-3"][atelectasis] < frac["site-2"][atelectasis] == 1


def test_cxr_prevalence_is_imbalanced(tmp_path):
    sc = load_scenario(generate("cxr", tmp_path / "cxr", seed=0, cases=10, test_cases=600))
    prev = np.array([i["label"] for i in sc.test]).mean(0)
    assert prev[0] > 2 * prev[5] > 0  # infiltration far more common than pneumothorax


def test_medmnist_dirichlet_skew_and_unlabeled_sites(tmp_path):
    def site_hist(gamma):
        sc = load_scenario(generate("medmnist", tmp_path / f"m{gamma}", seed=0, cases=800, test_cases=16, gamma=gamma, labeled=[0, 2]))
        hists = []
        for k, site in enumerate(sc.sites.values()):
            oracle = [i["label"] for i in site.oracle()["training"]]
            hists.append(np.bincount(oracle, minlength=8) / max(len(oracle), 1))
            labels = [i["label"] for i in site.training]
            if k in (0, 2):
                assert site.profile.supervision == "image" and min(labels) >= 0
            else:
                assert site.profile.supervision == "none" and set(labels) == {-1} and not site.profile.annotated
        return np.array(hists)

    # smaller gamma -> class distributions further from uniform
    skew = lambda h: np.abs(h - 1 / 8).sum(1).mean()  # noqa: E731
    assert skew(site_hist(0.1)) > skew(site_hist(100.0))


def test_lesion_supervision_levels_and_boxes(tmp_path):
    root = generate("lesion", tmp_path / "l", seed=0, cases=30, test_cases=4)
    sc = load_scenario(root)
    assert [s.profile.supervision for s in sc.sites.values()] == ["pixel", "bbox", "image", "none"]
    site = sc.site("site-2")
    oracle = {i["image"]: i["seg"] for i in site.oracle()["training"]}
    n_empty = 0
    for item in site.training:
        mask = np.asarray(Image.open(oracle[item["image"]])) > 0
        if not mask.any():
            assert item["boxes"] == []
            n_empty += 1
            continue
        (x0, y0, x1, y1, cls), = item["boxes"]
        ys, xs = np.nonzero(mask)
        assert x0 <= xs.min() and xs.max() < x1 and y0 <= ys.min() and ys.max() < y1
        # margins 1-10 px unless clamped at the border
        for margin, border in ((xs.min() - x0, x0 == 0), (ys.min() - y0, y0 == 0),
                               (x1 - 1 - xs.max(), x1 == 64), (y1 - 1 - ys.max(), y1 == 64)):
            assert border or 1 <= margin <= 10
    assert 0 < n_empty < len(site.training)  # some images are lesion-free
    img_site = sc.site("site-3")
    assert {tuple(i["classes"]) for i in img_site.training} == {(), (0,)}


def test_default_scenario_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLABELS_CACHE", str(tmp_path))
    calls = []
    real = synthetic.generate
    monkeypatch.setattr(synthetic, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = synthetic.default_scenario("lesion", cases=6, test_cases=2)
    b = synthetic.default_scenario("lesion", cases=6, test_cases=2)
    assert a == b and len(calls) == 1 and (a / "scenario.yaml").is_file()
    assert json.loads((a / "test/datalist.json").read_text())["testing"]


def test_default_scenario_is_generated_once_by_simultaneous_sites(tmp_path):
    """Simulated sites start together and each asks for the embedded scenario: one
    generates it under the file lock, the others wait and read it. (A second
    generation would replace the folder by rename, and scenario.yaml's inode would
    differ between the processes.)"""
    code = ("import os; from fedlabels.data.synthetic import default_scenario; "
            "r = default_scenario('lesion', cases=30, test_cases=10); print(os.stat(r / 'scenario.yaml').st_ino)")
    env = {**os.environ, "FEDLABELS_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    inodes = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(inodes) == 1 and "" not in inodes
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1
