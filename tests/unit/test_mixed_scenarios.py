"""The "mixed" scenarios: one federation whose sites label differently at once.

Site 1 annotates every class, the last site none (``supervision: none``, every label entry -1), and the
sites between them a partition of the classes. ``fedlabels synth mixed`` fixes the partition (the
classes in order, in contiguous blocks); ``fedlabels prepare --protocol mixed`` draws it from the seed.

The real-data tests read BloodMNIST from ``FEDLABELS_SHARED_DATA`` (else ``shared/data`` beside the
clone) and skip without it, failing under ``CI=true`` instead, as tests/unit/test_prepare_real.py does.
"""

from __future__ import annotations


import numpy as np
import pytest
import yaml

from fedlabels.data import partition as P
from fedlabels.data import prepare, synthetic
from fedlabels.data.common import PrepareError
from fedlabels.data.synthetic import MEDMNIST_CLASSES, generate, mixed_site_classes
from fedlabels.profile import load_scenario
from helpers import digest, image, need, run_cli

FIRST, SECOND = MEDMNIST_CLASSES[:4], MEDMNIST_CLASSES[4:]


def items(site):
    return site.training + site.validation


def labels_of(site):
    return np.array([i["label"] for i in items(site)])


def oracle_of(site):
    o = site.oracle()
    assert [i["image"] for i in o["training"] + o["validation"]] == [i["image"] for i in items(site)]
    return np.array([i["label"] for i in o["training"] + o["validation"]])


# ------------------------------------------------------------------ the class sets


def test_mixed_class_sets_full_partition_none():
    assert P.mixed_class_sets(8, 4) == [list(range(8)), [0, 1, 2, 3], [4, 5, 6, 7], []]
    assert P.mixed_class_sets(8, 5) == [list(range(8)), [0, 1, 2], [3, 4, 5], [6, 7], []]
    assert P.mixed_class_sets(3, 3) == [[0, 1, 2], [0, 1, 2], []]
    assert P.mixed_class_sets(8, 10)[1:-1] == [[c] for c in range(8)]
    drawn = set()
    for seed in range(40):
        sets = P.mixed_class_sets(8, 4, np.random.default_rng(seed))
        assert sets[0] == list(range(8)) and sets[-1] == []
        assert sorted(sets[1] + sets[2]) == list(range(8)) and len(sets[1]) == len(sets[2]) == 4
        # the one draw: a permutation of the classes, cut in two, each half sorted
        perm = np.random.default_rng(seed).permutation(8)
        assert sets[1:3] == [sorted(perm[:4].tolist()), sorted(perm[4:].tolist())]
        drawn.add(tuple(sets[1]))
    assert len(drawn) > 20  # the seed decides the partition
    for k in (7, 3):  # every class at site 1 and exactly one partial site, shares of near-equal size
        sets = P.mixed_class_sets(7, k, np.random.default_rng(1))
        counts = np.bincount([c for s in sets[1:-1] for c in s], minlength=7)
        assert (counts == 1).all() and max(map(len, sets[1:-1])) - min(map(len, sets[1:-1])) <= 1
    for k in (2, 11):
        with pytest.raises(PrepareError, match="needs 3 to 10 sites"):
            P.mixed_class_sets(8, k)
    assert P.mixed_roles(P.mixed_class_sets(8, 4), 8) == ["full", "partial", "partial", "none"]
    assert P.mixed_roles([[0, 1, 2], [2, 0, 1], [1], []], 3) == ["full", "full", "partial", "none"]


def test_parse_site_classes_star_and_dash():
    classes = ["a", "b", "c"]
    assert P.parse_site_classes("*;a;b,2;-", classes, allow_none=True) == [[0, 1, 2], [0], [1, 2], []]
    assert P.parse_site_classes(" * ; 1", classes) == [[0, 1, 2], [1]]  # '*' everywhere
    assert P.parse_site_classes("a,b;c;0", classes) == [[0, 1], [2], [0]]  # as before
    with pytest.raises(PrepareError, match=r"^--site-classes: site 2: '-' \(no class\) is for protocols"):
        P.parse_site_classes("*;-", classes)  # partial: every site annotates something
    with pytest.raises(PrepareError, match=r"^--site-classes: site 1: '\*' \(every class\) and '-' \(none\) stand alone"):
        P.parse_site_classes("*,a;-", classes, allow_none=True)
    with pytest.raises(PrepareError, match=r"^--site-classes: site 2 annotates no class \(write '-'"):
        P.parse_site_classes("*;;-", classes, allow_none=True)
    with pytest.raises(PrepareError, match="^--site-classes: site 3: unknown class 'zz'"):
        P.parse_site_classes("*;a;zz;-", classes, allow_none=True)


# ------------------------------------------------------------------ fedlabels synth mixed


def test_synth_mixed_roles_masks_oracle_and_test(tmp_path):
    root = generate("mixed", tmp_path / "m", seed=2, cases=320, test_cases=24)
    sc = load_scenario(root)
    assert sc.task == "multilabel" and sc.classes == tuple(MEDMNIST_CLASSES) and list(sc.sites) == [
        "site-1", "site-2", "site-3", "site-4"]
    profiles = {name: (list(s.profile.annotated), s.profile.supervision) for name, s in sc.sites.items()}
    assert profiles == {"site-1": (MEDMNIST_CLASSES, "image"), "site-2": (FIRST, "image"),
                        "site-3": (SECOND, "image"), "site-4": ([], "none")}
    total = 0
    for name, site in sc.sites.items():
        y, full = labels_of(site), oracle_of(site)
        total += len(y)
        assert y.shape[1] == 8 and len(y) >= 2 and site.training and site.validation
        assert (full.sum(1) == 1).all() and set(np.unique(full)) == {0, 1}  # one-hot
        mask = site.profile.labeled_mask
        assert (y[:, ~mask] == -1).all() and (y[:, mask] == full[:, mask]).all()  # -1 exactly where not annotated
    # the documented masks, entry by entry
    assert (labels_of(sc.site("site-1")) >= 0).all() and (labels_of(sc.site("site-1")).sum(1) == 1).all()
    s2, s3 = labels_of(sc.site("site-2")), labels_of(sc.site("site-3"))
    assert (s2[:, 4:] == -1).all() and (s2[:, :4] >= 0).all()
    assert (s3[:, :4] == -1).all() and (s3[:, 4:] >= 0).all()
    assert (labels_of(sc.site("site-4")) == -1).all()
    assert sc.site("site-4").summary()["annotated"] == [0] * 8 and not sc.site("site-4").summary()["labeled"]
    assert total == 320
    test = np.array([i["label"] for i in sc.test])
    assert test.shape == (24, 8) and (test.sum(1) == 1).all() and (test.argmax(1) == np.arange(24) % 8).all()
    assert [i["group"] for i in sc.test[:5]] == ["site-1", "site-2", "site-3", "site-4", "site-1"]
    img = np.asarray(image(sc.test[0]["image"]))
    assert img.shape == (28, 28, 3) and img.dtype == np.uint8
    meta = yaml.safe_load((root / "scenario.yaml").read_text())
    assert meta["name"] == "synthetic-mixed" and meta["channels"] == 3 and meta["image_size"] == [28, 28]
    prov = meta["provenance"]
    assert prov["family"] == "mixed" and prov["gamma"] == 0.8
    assert prov["site_classes"] == {"site-1": MEDMNIST_CLASSES, "site-2": FIRST, "site-3": SECOND, "site-4": []}
    assert prov["site_roles"] == {"site-1": "full", "site-2": "partial", "site-3": "partial", "site-4": "none"}


def test_synth_mixed_same_seed_same_folder_other_seed_other_split(tmp_path):
    a = generate("mixed", tmp_path / "a", seed=5, cases=160, test_cases=8)
    b = generate("mixed", tmp_path / "b", seed=5, cases=160, test_cases=8)
    c = generate("mixed", tmp_path / "c", seed=6, cases=160, test_cases=8)
    assert digest(a) == digest(b) and digest(a) != digest(c)

    def split(root):  # per site: its true classes, case by case
        return [oracle_of(s).argmax(1).tolist() for s in load_scenario(root).sites.values()]

    assert split(a) == split(b) and split(a) != split(c)
    # the roles are the same for every seed
    assert [list(s.profile.annotated) for s in load_scenario(c).sites.values()] == mixed_site_classes(4)


def test_synth_mixed_gamma_skews_the_sites_labels(tmp_path):
    def skew(gamma):
        sc = load_scenario(generate("mixed", tmp_path / f"g{gamma}", seed=0, cases=480, test_cases=8, gamma=gamma))
        hists = np.array([oracle_of(s).sum(0) for s in sc.sites.values()], float)
        pooled = hists.sum(0) / hists.sum()
        return np.mean(0.5 * np.abs(hists / hists.sum(1, keepdims=True) - pooled).sum(1))

    assert skew(0.1) > skew(100.0) + 0.2


@pytest.mark.parametrize("sites,expected", [
    (3, [MEDMNIST_CLASSES, MEDMNIST_CLASSES, []]),
    (6, [MEDMNIST_CLASSES, ["disc", "ring"], ["square", "cross"], ["pair", "bar"], ["triangle", "ellipse"], []]),
])
def test_synth_mixed_other_site_counts(tmp_path, sites, expected):
    assert mixed_site_classes(sites) == expected
    sc = load_scenario(generate("mixed", tmp_path / "m", seed=1, cases=30 * sites, test_cases=6, sites=sites))
    assert [list(s.profile.annotated) for s in sc.sites.values()] == expected
    assert [s.profile.supervision for s in sc.sites.values()] == ["image"] * (sites - 1) + ["none"]
    roles = sc.meta["provenance"]["site_roles"]
    assert list(roles.values()) == (["full", "full", "none"] if sites == 3 else ["full"] + ["partial"] * 4 + ["none"])


def test_synth_mixed_refuses_what_does_not_apply(tmp_path):
    for sites in (2, 11):
        with pytest.raises(ValueError, match=f"needs 3 to 10 sites .*, not {sites}"):
            generate("mixed", tmp_path / "m", seed=0, cases=40, sites=sites)
    with pytest.raises(ValueError, match="labeled applies to the medmnist family"):
        generate("mixed", tmp_path / "m", seed=0, cases=40, labeled=[0])
    assert not (tmp_path / "m").exists()


def test_synth_mixed_cli_and_default_scenario(tmp_path, monkeypatch):
    out = tmp_path / "cli"
    code, stdout, stderr = run_cli(["synth", "mixed", "--out", out, "--seed", 4, "--cases", 120, "--test-cases", 16])
    assert code == 0, stderr
    assert f"wrote {out}" in stdout and "site-2: " in stdout and "(none: no class)" in stdout
    table = [line.split() for line in stdout.splitlines() if line.startswith("site-4 ")]
    assert table and table[-1][2:] == ["-"] * 8  # the unlabeled site annotates no class
    assert digest(out) == digest(generate("mixed", tmp_path / "api", seed=4, cases=120, test_cases=16))
    code, _, stderr = run_cli(["synth", "mixed", "--out", tmp_path / "x", "--labeled", "1"])
    assert code == 2 and stderr.startswith("fedlabels: --labeled applies to the medmnist family") and \
        stderr.count("\n") == 1
    code, _, stderr = run_cli(["synth", "mixed", "--out", tmp_path / "x", "--sites", "2"])
    assert code == 2 and "needs 3 to 10 sites" in stderr and stderr.count("\n") == 1
    # the embedded default: 1200 cases over the 4 sites, 400 test cases, cached
    monkeypatch.setenv("FEDLABELS_CACHE", str(tmp_path / "cache"))
    root = synthetic.default_scenario("mixed")
    assert synthetic.default_scenario("mixed") == root
    sc = load_scenario(root)
    assert sum(len(items(s)) for s in sc.sites.values()) == 1200 and len(sc.test) == 400
    assert sc.meta["provenance"]["site_roles"]["site-4"] == "none"


# ------------------------------------------------------------------ fedlabels prepare --protocol mixed


def run(*argv):
    args = prepare.build_standalone_parser().parse_args([str(a) for a in argv] + ["--workers", "1", "--quiet"])
    return prepare.run(args)


def test_prepare_mixed_bloodmnist_draws_the_partial_sets_per_seed(tmp_path):
    src = need("medmnist", "bloodmnist.npz")
    limit, test_cases = 240, 40
    sets = {}
    for seed in (0, 1):
        out = run("bloodmnist", "--src", src.parent, "--protocol", "mixed", "--seed", seed, "--limit", limit,
                  "--test-cases", test_cases, "--out", tmp_path / f"s{seed}")
        sc = load_scenario(out)
        classes = list(sc.classes)
        assert sc.task == "multilabel" and len(classes) == 8 and list(sc.sites) == [f"site-{k}" for k in (1, 2, 3, 4)]
        annotated = [list(s.profile.annotated) for s in sc.sites.values()]
        # site 1 every class, the last none, each class at site 1 and exactly one partial site, 4 each
        assert annotated[0] == classes and annotated[3] == []
        assert sorted(annotated[1] + annotated[2], key=classes.index) == classes
        assert len(annotated[1]) == len(annotated[2]) == 4
        # the documented draw: the seed's first draw permutes the classes, cut in two halves
        perm = np.random.default_rng(seed).permutation(8)
        assert annotated[1:3] == [[classes[c] for c in sorted(perm[:4])], [classes[c] for c in sorted(perm[4:])]]
        sets[seed] = annotated[1]
        assert [s.profile.supervision for s in sc.sites.values()] == ["image", "image", "image", "none"]
        sizes = []
        for site in sc.sites.values():
            y, full = labels_of(site), oracle_of(site)
            mask = site.profile.labeled_mask
            assert (full.sum(1) == 1).all()  # one-vs-rest of one class
            assert (y[:, ~mask] == -1).all() and (y[:, mask] == full[:, mask]).all()
            sizes.append(len(y))
        assert (labels_of(sc.site("site-4")) == -1).all()
        assert sum(sizes) == limit and max(sizes) - min(sizes) <= 1  # IID equal shares without --gamma
        test = np.array([i["label"] for i in sc.test])
        assert test.shape == (test_cases, 8) and (test.sum(1) == 1).all()
        meta = yaml.safe_load((out / "scenario.yaml").read_text())
        profile = yaml.safe_load((out / "site-4" / "profile.yaml").read_text())
        assert profile["annotated"] == [] and profile["supervision"] == "none"
        proto = meta["protocol"]
        assert proto["name"] == "mixed" and proto["sites"] == 4 and proto["site_classes"] == annotated
        assert proto["site_roles"] == ["full", "partial", "partial", "none"]
        assert proto["class_sets"].startswith("random partition") and meta["provenance"]["protocol"] == "mixed"
    assert sets[0] != sets[1]


def test_prepare_mixed_given_site_classes_and_bad_ones(tmp_path, capsys):
    src = need("medmnist", "bloodmnist.npz")
    out = run("bloodmnist", "--src", src.parent, "--protocol", "mixed", "--site-classes",
              "*;basophil,1;-;2,3,4,5,6,7", "--gamma", 1.0, "--limit", 160, "--test-cases", 8, "--out", tmp_path / "g")
    sc = load_scenario(out)
    classes = list(sc.classes)
    assert [list(s.profile.annotated) for s in sc.sites.values()] == [classes, classes[:2], [], classes[2:]]
    assert [s.profile.supervision for s in sc.sites.values()] == ["image", "image", "none", "image"]
    assert (labels_of(sc.site("site-3")) == -1).all()
    proto = yaml.safe_load((out / "scenario.yaml").read_text())["protocol"]
    assert proto["site_roles"] == ["full", "partial", "none", "partial"] and proto["class_sets"].startswith("given")
    assert proto["split"] == "Dirichlet(gamma=1.0)"
    capsys.readouterr()
    for site_classes, extra, said in [
        ("*;basophil;zz;-", [], "--site-classes: site 3: unknown class 'zz'"),
        ("*,basophil;0;-", [], "--site-classes: site 1: '*' (every class) and '-' (none) stand alone"),
        ("*;;1;-", [], "--site-classes: site 2 annotates no class"),
        ("*;0,1,2,3;4,5,6,7;-", ["--sites", 5], "--site-classes lists 4 sites but --sites is 5"),
        ("-;-;-", [], "--site-classes: no site annotates any class"),
    ]:
        rc = prepare.main(["bloodmnist", "--src", str(src.parent), "--protocol", "mixed", "--limit", "40",
                           f"--site-classes={site_classes}", "--out", str(tmp_path / "bad"), "--quiet",
                           *map(str, extra)])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("fedlabels prepare: --site-classes") and err.count("\n") == 1, err
        assert said in err and "Traceback" not in err
        assert not (tmp_path / "bad").exists()
    for argv, said in [(["--sites", "2"], "--sites 2: mixed needs at least 3 sites"),
                       (["--sites", "11"], "so at most 10 sites"),
                       (["--missing", "2"], "--missing applies to fedmlp and partial")]:
        rc = prepare.main(["bloodmnist", "--src", str(src.parent), "--protocol", "mixed", "--limit", "40",
                           "--out", str(tmp_path / "bad"), "--quiet", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and said in err and err.count("\n") == 1, err
