"""The preparers on the real data in ../shared/data.

BloodMNIST / PneumoniaMNIST IsoFed splits, BloodMNIST as a 4-site partial-label
scenario, and PH2 as a FedMix scenario with pixel / box / image-level sites.
Subsampled with --limit so the file runs in seconds; the preparers themselves
handle the full sets.

Where the data is: ``FEDLABELS_SHARED_DATA`` if set, else ``shared/data`` beside the
clone (``../shared/data`` from the repository root). A missing file skips its test on
a developer's machine; under ``CI=true`` it fails the test, so that a CI clone placed
elsewhere cannot pass by skipping every real-data check.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedlabels.data import medmnist, partition, prepare
from fedlabels.profile import load_scenario
from helpers import DATA, image, need, pixels



def run(*argv):
    args = prepare.build_standalone_parser().parse_args([str(a) for a in argv] + ["--quiet"])
    return prepare.run(args)


def items(site):
    return site.training + site.validation


def site_skew(sc):
    """Mean total-variation distance between each site's class mix and the pooled mix."""
    hists = []
    for site in sc.sites.values():
        o = site.oracle()
        y = [i["label"] for i in o["training"] + o["validation"]]
        hists.append(np.bincount(y, minlength=len(sc.classes)))
    hists = np.array(hists, float)
    pooled = hists.sum(0) / hists.sum()
    return float(np.mean(0.5 * np.abs(hists / hists.sum(1, keepdims=True) - pooled).sum(1)))


@pytest.mark.parametrize("name", ["bloodmnist", "pneumoniamnist"])
def test_isofed_splits_on_real_medmnist(tmp_path, name):
    src = need("medmnist", f"{name}.npz")
    limit, test_cases = 1000, 200
    skews = {}
    for gamma in (0.5, 100.0):
        out = run(name, "--src", src.parent, "--protocol", "isofed", "--gamma", gamma, "--labeled", 1,
                  "--limit", limit, "--test-cases", test_cases, "--out", tmp_path / f"g{gamma}")
        sc = load_scenario(out)
        # counts add up: every subsampled training image at exactly one site, test as asked
        assert sum(len(items(s)) for s in sc.sites.values()) == limit and len(sc.test) == test_cases
        names = [Path(i["image"]).name for s in sc.sites.values() for i in items(s)]
        assert len(set(names)) == limit
        # labeled / unlabeled flags
        for k, site in enumerate(sc.sites.values()):
            labels = [i["label"] for i in items(site)]
            if k == 0:
                assert site.profile.supervision == "image" and site.profile.annotated == sc.classes
                assert min(labels) >= 0
            else:
                assert site.profile.supervision == "none" and site.profile.annotated == ()
                assert set(labels) == {-1}
            oracle = site.oracle()
            assert [i["image"] for i in oracle["training"]] == [i["image"] for i in site.training]
            assert min(i["label"] for i in oracle["training"]) >= 0
        skews[gamma] = site_skew(sc)
        img = image(sc.test[0]["image"])
        meta = yaml.safe_load((out / "scenario.yaml").read_text())
        assert img.size == (28, 28) and meta["image_size"] == [28, 28]
        assert img.mode == ("RGB" if name == "bloodmnist" else "L") and meta["channels"] == len(img.getbands())
        files = meta["provenance"]["sources"][0]["files"][f"{name}.npz"]
        assert files["md5"] == medmnist.md5_of(src) and files["official_md5"] == medmnist.INFO[name][0]
    assert skews[0.5] > skews[100.0] + 0.05


@pytest.mark.parametrize("name", ["bloodmnist", "pneumoniamnist"])
def test_smaller_gamma_skews_real_labels_more(name):
    """The paper's two settings, averaged over seeds: gamma 0.5 is more non-IID than 0.8."""
    src = need("medmnist", f"{name}.npz")
    with np.load(src) as d:
        y = d["train_labels"].reshape(-1)
    c = int(y.max()) + 1
    pooled = np.bincount(y, minlength=c) / len(y)

    def skew(gamma, seed):
        parts = partition.dirichlet_split(y, 4, gamma, np.random.default_rng(seed))
        return np.mean([0.5 * np.abs(np.bincount(y[p], minlength=c) / len(p) - pooled).sum() for p in parts])

    assert np.mean([skew(0.5, s) for s in range(30)]) > np.mean([skew(0.8, s) for s in range(30)])


def test_partial_bloodmnist_four_sites(tmp_path):
    src = need("medmnist", "bloodmnist.npz")
    out = run("bloodmnist", "--src", src.parent, "--protocol", "partial", "--sites", 4, "--missing", 4,
              "--limit", 1200, "--test-cases", 200, "--out", tmp_path / "p")
    sc = load_scenario(out)
    assert sc.task == "multilabel" and len(sc.classes) == 8 and len(sc.sites) == 4
    covered = set()
    sizes = []
    for site in sc.sites.values():
        mask = site.profile.labeled_mask
        assert mask.sum() == 4
        covered |= set(site.profile.annotated)
        labels = np.array([i["label"] for i in items(site)])
        assert (labels[:, ~mask] == -1).all() and set(np.unique(labels[:, mask])) <= {0, 1}
        o = site.oracle()
        full = np.array([i["label"] for i in o["training"] + o["validation"]])
        assert (full.sum(1) == 1).all() and (full[:, mask] == labels[:, mask]).all()
        sizes.append(len(labels))
    assert covered == set(sc.classes)
    assert sum(sizes) == 1200 and max(sizes) - min(sizes) <= 1
    test = np.array([i["label"] for i in sc.test])
    assert test.shape == (200, 8) and (test.sum(1) == 1).all()


def test_fedmix_ph2_pixel_box_image_sites(tmp_path):
    src = need("ph2")
    out = run("ph2", "--src", src, "--protocol", "fedmix", "--sites", 3, "--supervision", "L,B,I",
              "--out", tmp_path / "ph2", "--workers", 2)
    sc = load_scenario(out)
    assert [s.profile.supervision for s in sc.sites.values()] == ["pixel", "bbox", "image"]
    assert sum(len(items(s)) for s in sc.sites.values()) + len(sc.test) == 200
    names = [Path(i["image"]).name for s in sc.sites.values() for i in items(s)] + [Path(i["image"]).name for i in sc.test]
    assert len(set(names)) == 200
    size = 256
    # pixel site: masks in {0, 255} at the written size
    for it in sc.site("site-1").training[:10]:
        m = pixels(it["seg"])
        assert m.shape == (size, size) and set(np.unique(m)) <= {0, 255}
    # box site: every box holds its whole mask, margins 1-10 px (unless clamped at the border)
    site = sc.site("site-2")
    oracle = {i["image"]: i["seg"] for i in site.oracle()["training"] + site.oracle()["validation"]}
    n_boxes = 0
    for it in items(site):
        mask = pixels(oracle[it["image"]]) > 0
        assert image(it["image"]).size == (size, size)
        if not mask.any():
            assert it["boxes"] == []
            continue
        (x0, y0, x1, y1, cls), = it["boxes"]
        ys, xs = np.nonzero(mask)
        assert cls == 0 and x0 <= xs.min() and xs.max() < x1 and y0 <= ys.min() and ys.max() < y1
        for margin, border in ((xs.min() - x0, x0 == 0), (ys.min() - y0, y0 == 0),
                               (x1 - 1 - xs.max(), x1 == size), (y1 - 1 - ys.max(), y1 == size)):
            assert border or 1 <= margin <= 10
        n_boxes += 1
    assert n_boxes > 40
    # image-level site: lesion present exactly where its (hidden) mask is non-empty
    site = sc.site("site-3")
    oracle = {i["image"]: i["seg"] for i in site.oracle()["training"]}
    for it in site.training:
        assert it["classes"] == ([0] if (pixels(oracle[it["image"]]) > 0).any() else [])
        assert "seg" not in it and "boxes" not in it
    assert {i["site"] for i in sc.test} == {"site-1", "site-2", "site-3"}


@pytest.mark.parametrize("bundle,dataset,protocol,extra,overrides", [
    ("medmnist_cnn", "bloodmnist", "isofed", ["--limit", 300, "--labeled", 1], {}),
    ("cxr_resnet18", "bloodmnist", "partial", ["--limit", 300, "--sites", 4], {"in_channels": 3, "image_size": 28}),
    ("lesion_unet", "ph2", "fedmix", ["--limit", 20, "--sites", 3, "--supervision", "L,B,I"], {}),
])
def test_a_bundle_trains_one_epoch_on_each_real_scenario(tmp_path, bundle, dataset, protocol, extra, overrides):
    """The prepared folders are what the MONAI bundles read (same format as the synthetic ones)."""
    from fedlabels.bundle import workflows as export  # an import error fails the test, it does not skip it

    bundle_dir = Path(__file__).resolve().parents[2] / "bundles" / bundle
    assert (bundle_dir / "configs" / "train.json").is_file(), bundle_dir
    src = need("ph2") if dataset == "ph2" else need("medmnist", f"{dataset}.npz").parent
    out = run(dataset, "--src", src, "--protocol", protocol, "--test-cases", 20, "--out", tmp_path / "s", *extra)
    classes = load_scenario(out).classes
    ckpt = export.train_bundle(bundle_dir, out, tmp_path / "train", site="site-1", epochs=1, num_workers=0,
                               class_names=list(classes), **overrides)
    assert Path(ckpt).is_file()


# ------------------------------------------------------------------ the preparer traced back to its source file


def _dirichlet_rule(labels, k, gamma, rng, min_size):
    """``partition.dirichlet_split``'s documented rule, written out again: per class (ascending), its
    cases permuted, proportions ~ Dir(gamma) over the k sites, cut at round(cumsum x n_c); redrawn until
    every site holds ``min_size`` cases."""
    while True:
        owner = np.empty(len(labels), dtype=int)
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet([gamma] * k))[:-1] * len(idx)).round().astype(int)
            for s, part in enumerate(np.split(idx, cuts)):
                owner[part] = s
        if np.bincount(owner, minlength=k).min() >= min_size:
            return [set(np.flatnonzero(owner == s)) for s in range(k)]


def _rscfed_rule(labels, k, gamma, rng, min_size, fraction=0.1):
    """``partition.rscfed_split``'s documented rule for one labeled site, written out again."""
    order = rng.permutation(len(labels))
    block = int(len(labels) * fraction)
    pool = order[block:]
    while True:
        shares = [[] for _ in range(k - 1)]
        for c in np.unique(labels):
            idx = rng.permutation(pool[labels[pool] == c])
            p = rng.dirichlet([gamma] * k)[:k - 1] * np.array([len(s) < len(pool) / (k - 1) for s in shares])
            for s, part in zip(shares, np.split(idx, (np.cumsum(p / p.sum()) * len(idx)).astype(int)[:-1])):
                s.extend(part.tolist())
        if min(map(len, shares)) >= min_size:
            return [set(order[:block].tolist())] + [set(s) for s in shares]


@pytest.mark.parametrize("name,partition_rule", [("pneumoniamnist", "dirichlet"), ("bloodmnist", "rscfed")])
def test_every_prepared_case_is_its_source_row_and_the_sites_are_the_seeds_split(tmp_path, name, partition_rule):
    """Each written image is traced to the row of the .npz it came from by the hash of its pixels
    (MedMNIST images are written at their native 28 px, so the PNG holds the stored array unchanged,
    data/build.py), with that row's label; and the rows each site holds are the ones the seed draws,
    recomputed here from the documented rules (``rng = default_rng(seed)``; ``--limit`` and
    ``--test-cases`` subsample the official train and test splits with ``rng.choice``, then the split)."""
    src = need("medmnist", f"{name}.npz")
    seed, limit, test_cases, gamma = 5, 400, 60, 0.5
    out = run(name, "--src", src.parent, "--protocol", "isofed", "--gamma", gamma, "--labeled", 1, "--seed", seed,
              "--partition", partition_rule, "--limit", limit, "--test-cases", test_cases, "--out", tmp_path / "s")
    sc = load_scenario(out)
    with np.load(src) as d:
        arrays = {s: (d[f"{s}_images"], d[f"{s}_labels"].reshape(-1)) for s in ("train", "val", "test")}
    rows = {}  # pixel hash -> [(split, row, label)]: MedMNIST holds some identical images
    for split, (images, labels) in arrays.items():
        for r in range(len(images)):
            rows.setdefault(hashlib.sha256(images[r].tobytes()).hexdigest(), []).append((split, r, int(labels[r])))

    def trace(item, label):
        """The (split, row) this written case is: its pixels' hash names the row, with the same label."""
        px = pixels(item["image"])
        found = rows.get(hashlib.sha256(px.tobytes()).hexdigest(), [])
        split, r = Path(item["image"]).stem.rsplit("_", 1)  # the case id the preparer names the file by
        assert (split, int(r), label) in found, f"{item['image']}: not row {r} of {split} with label {label}"
        return split, int(r)

    held = []
    for k, site in enumerate(sc.sites.values()):
        oracle = site.oracle()
        traced = [trace(i, i["label"]) for i in oracle["training"] + oracle["validation"]]
        assert {s for s, _ in traced} == {"train"}  # the sites draw from the official train split only
        if k == 0:  # the labeled site's own labels are the source's
            assert [i["label"] for i in items(site)] == [i["label"] for i in oracle["training"] + oracle["validation"]]
        held.append({r for _, r in traced})
    test = [trace(i, i["label"]) for i in sc.test]
    assert {s for s, _ in test} == {"test"} and len({r for _, r in test}) == test_cases

    # the split the seed draws, recomputed from the rules
    rng = np.random.default_rng(seed)
    pool = sorted(int(i) for i in rng.choice(np.arange(len(arrays["train"][0])), size=limit, replace=False))
    chosen_test = sorted(int(i) for i in rng.choice(np.arange(len(arrays["test"][0])), size=test_cases, replace=False))
    y = arrays["train"][1][pool]
    rule = _dirichlet_rule(y, 4, gamma, rng, 4) if partition_rule == "dirichlet" else _rscfed_rule(y, 4, gamma, rng, 10)
    expected = [{pool[j] for j in part} for part in rule]
    assert held == expected
    assert [len(h) for h in held] == [len(e) for e in expected] and sum(map(len, held)) == limit
    assert sorted(r for _, r in test) == chosen_test
