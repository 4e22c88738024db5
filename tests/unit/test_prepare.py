"""Public-dataset preparers on tiny fixtures built in each dataset's real layout.

Every preparer x protocol writes a scenario that ``load_scenario`` accepts;
splits are patient-level and seeded; bad input fails with one message that
names the file; an interrupted preparation never leaves a valid folder.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from fedlabels.data import build, medmnist, prepare
from fedlabels.data.build import load_extra_test
from fedlabels.data.chestxray import CHEXPERT_COLUMNS, NIH_CLASSES, UNION20
from fedlabels.data.common import PrepareError, write_mhd
from fedlabels.data.dicom import read_dicom_header, read_dicom_image, write_dicom
from fedlabels.data.partition import FEDPSL_CLASSES_6, FEDPSL_SITE_CLASSES_6
from fedlabels.profile import ScenarioError, format_summary, load_scenario
from helpers import image, pixels
from helpers import digest

NIH_NAMES = {c: n for c, n in zip(NIH_CLASSES, ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass",
                                                "Nodule", "Pneumonia", "Pneumothorax", "Consolidation", "Edema",
                                                "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia"])}


# ---------------------------------------------------------------- helpers


def run(*argv):
    """Run the preparer like the CLI does; returns the scenario folder."""
    args = prepare.build_standalone_parser().parse_args([str(a) for a in argv] + ["--workers", "1", "--quiet"])
    return prepare.run(args)


def fails(capsys, *argv) -> str:
    """The CLI exits 2 with one line naming the problem, and no traceback."""
    rc = prepare.main([str(a) for a in argv] + ["--workers", "1", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and err.startswith("fedlabels prepare: ")
    return err


def seed_of(path) -> int:
    """A fixture image's own seed: a CRC of its last three path parts, the same in every process and
    whatever the temporary folder (Python's ``hash`` of a str changes from process to process)."""
    return zlib.crc32("/".join(Path(path).parts[-3:]).encode())


def gray(path, size=(20, 20), rng=None, value=None):
    rng = rng or np.random.default_rng(seed_of(path))
    arr = rng.integers(0, 255, size[::-1], dtype=np.uint8) if value is None else np.full(size[::-1], value, np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def rgb(path, size=(24, 18), rng=None):
    rng = rng or np.random.default_rng(seed_of(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)


def blob_mask(path, size, rng, empty=False, value=255):
    w, h = size
    m = np.zeros((h, w), np.uint8)
    if not empty:
        x0, y0 = rng.integers(2, w // 2), rng.integers(2, h // 2)
        m[y0:y0 + rng.integers(3, h // 2), x0:x0 + rng.integers(3, w // 2)] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(m).save(path)
    return m


def write_csv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def items(site):
    return site.training + site.validation


def stems(items_):
    return {Path(i["image"]).stem for i in items_}


# ---------------------------------------------------------------- fixtures: chest X-ray


def make_nih(root: Path, per_batch=14, batches=6, seed=0, lists=True):
    """Data_Entry_2017.csv + images_00X/images/*.png (Kaggle layout) + official lists."""
    rng = np.random.default_rng(seed)
    rows, pid, names = [], 0, []
    for b in range(1, batches + 1):
        k = 0
        while k < per_batch:
            pid += 1
            for f in range(min(2, per_batch - k)):
                name = f"{pid:08d}_{f:03d}.png"
                lab = [c for c in NIH_CLASSES if rng.random() < (0.4 if c in FEDPSL_CLASSES_6 else 0.15)]
                finding = "|".join(NIH_NAMES[c] for c in lab) or "No Finding"
                rows.append([name, finding, f, pid, 50, "M", "PA" if rng.random() < 0.7 else "AP", 20, 20, 0.1, 0.1])
                gray(root / f"images_{b:03d}" / "images" / name, rng=rng)
                names.append((name, pid))
                k += 1
    header = ["Image Index", "Finding Labels", "Follow-up #", "Patient ID", "Patient Age", "Patient Gender",
              "View Position", "OriginalImage[Width", "Height]", "OriginalImagePixelSpacing[x", "y]"]
    write_csv(root / "Data_Entry_2017.csv", header, rows)
    if lists:
        test_p = {p for _, p in names if p % 4 == 0}
        (root / "train_val_list.txt").write_text("\n".join(n for n, p in names if p not in test_p) + "\n")
        (root / "test_list.txt").write_text("\n".join(n for n, p in names if p in test_p) + "\n")
    return rows


def make_tb(root: Path, normal=20, tb=8):
    base = root / "TB_Chest_Radiography_Database"
    for i in range(normal):
        gray(base / "Normal" / f"Normal-{i + 1}.png")
    for i in range(tb):
        gray(base / "Tuberculosis" / f"Tuberculosis-{i + 1}.png")
    return root


def make_covid(root: Path):
    base = root / "COVID-19_Radiography_Dataset"
    for cat, n in (("COVID", 9), ("Normal", 20), ("Lung_Opacity", 4), ("Viral Pneumonia", 3)):
        for i in range(n):
            gray(base / cat / "images" / f"{cat.replace(' ', '_')}-{i + 1}.png")
    return root


CHEX_HEADER = ["Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", "No Finding"] + list(CHEXPERT_COLUMNS)


def make_chexpert(root: Path, patients=12, seed=1):
    rng = np.random.default_rng(seed)
    base = root / "CheXpert-v1.0-small"
    rows = []
    for p in range(1, patients + 1):
        for s in (1, 2):
            for view, fl in (("view1_frontal", "Frontal"), ("view2_lateral", "Lateral")):
                rel = f"CheXpert-v1.0-small/train/patient{p:05d}/study{s}/{view}.jpg"
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 255, (22, 18), dtype=np.uint8)).save(root / rel)
                vals = [rng.choice(["1.0", "0.0", "-1.0", ""]) for _ in CHEXPERT_COLUMNS]
                rows.append([rel, "Male", 60, fl, "AP", ""] + vals)
    write_csv(base / "train.csv", CHEX_HEADER, rows)
    return root


def make_mimic(root: Path, subjects=6, seed=2, lt=False):
    rng = np.random.default_rng(seed)
    meta, labs, lt_rows = [], [], []
    for s in range(subjects):
        sid, study = str(10000001 + s), str(50000001 + s)
        labs.append([sid, study, ""] + [rng.choice(["1.0", "0.0", "-1.0", ""]) for _ in CHEXPERT_COLUMNS])
        for d, view in enumerate(("PA", "LATERAL")):
            dicom = f"d{s}x{d}"
            meta.append([dicom, sid, study, view])
            path = root / "files" / f"p{sid[:2]}" / f"p{sid}" / f"s{study}" / f"{dicom}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (20, 20), dtype=np.uint8)).save(path)
            lt_rows.append([dicom] + [int(rng.random() < 0.3) for _ in UNION20])
    write_csv(root / "mimic-cxr-2.0.0-metadata.csv.gz", ["dicom_id", "subject_id", "study_id", "ViewPosition"], meta)
    write_csv(root / "mimic-cxr-2.0.0-chexpert.csv.gz", ["subject_id", "study_id", "No Finding"] + list(CHEXPERT_COLUMNS), labs)
    if lt:
        names = {"effusion": "Pleural Effusion"}
        write_csv(root / "cxr-lt_labels.csv", ["dicom_id"] + [names.get(c, c.replace("_", " ").title()) for c in UNION20], lt_rows)
    return root


@pytest.fixture(scope="module")
def nih(tmp_path_factory):
    root = tmp_path_factory.mktemp("nih")
    make_nih(root)
    return root


def nih_patient(stem: str) -> int:
    return int(stem.split("_")[0])


# ---------------------------------------------------------------- chest X-ray tests


def test_fedpsl6_table1_layout_and_balanced_test(nih, tmp_path):
    out = run("nih", "--src", nih, "--protocol", "fedpsl-6", "--out", tmp_path / "s", "--cases", 8,
              "--test-per-class", 2, "--size", 16)
    sc = load_scenario(out)
    assert sc.classes == tuple(FEDPSL_CLASSES_6) and list(sc.sites) == ["site-1", "site-2", "site-3", "site-4"]
    names = sorted(p.stem for p in nih.rglob("*.png"))
    site_patients = []
    for k, site in enumerate(sc.sites.values()):
        assert list(site.profile.annotated) == FEDPSL_SITE_CLASSES_6[k]
        its = items(site)
        # the first 8 images of batch k + 2 (14 images per fixture batch), as in the paper
        assert stems(its) == set(names[14 * (k + 1): 14 * (k + 1) + 8])
        labels = np.array([i["label"] for i in its])
        mask = site.profile.labeled_mask
        assert (labels[:, ~mask] == -1).all() and (labels[:, mask] >= 0).all()
        oracle = np.array([i["label"] for i in site.oracle()["training"] + site.oracle()["validation"]])
        assert (oracle[:, mask] == labels[:, mask]).all()
        site_patients.append({nih_patient(s) for s in stems(its)})
    test = np.array([i["label"] for i in sc.test])
    assert ((test == 1).sum(0) >= 2).all() and ((test == 0).sum(0) >= 2).all()
    test_patients = {nih_patient(s) for s in stems(sc.test)}
    assert not test_patients & set().union(*site_patients)
    assert {i["source"] for i in sc.test} == {"nih"}
    img = image(sc.test[0]["image"])
    assert img.size == (16, 16) and img.mode == "L"
    meta = yaml.safe_load((out / "scenario.yaml").read_text())
    assert meta["image_size"] == [16, 16] and meta["channels"] == 1
    assert "Data_Entry_2017.csv" in meta["provenance"]["sources"][0]["files"]
    assert meta["provenance"]["sources"][0]["files"]["Data_Entry_2017.csv"]["sha256"]
    summary = (out / "summary.txt").read_text()
    assert format_summary(sc) in summary


def test_fedpsl8_one_class_sites(nih, tmp_path):
    tb, cov = make_tb(tmp_path / "tb"), make_covid(tmp_path / "covid")
    out = run("nih", "--src", nih, "--src", f"tb={tb}", "--src", f"covid={cov}", "--protocol", "fedpsl-8",
              "--out", tmp_path / "s", "--cases", 6, "--test-per-class", 2, "--size", 16)
    sc = load_scenario(out)
    assert len(sc.classes) == 8 and len(sc.sites) == 6
    assert sc.site("site-5").profile.annotated == ("tuberculosis",)
    assert sc.site("site-6").profile.annotated == ("covid19",)
    for name, cls in (("site-5", "tuberculosis"), ("site-6", "covid19")):
        site = sc.site(name)
        assert len(items(site)) == 6
        labels = np.array([i["label"] for i in items(site)])
        j = sc.classes.index(cls)
        assert (np.delete(labels, j, 1) == -1).all() and set(labels[:, j]) <= {0, 1}
    sources = {i["source"] for i in sc.test}
    assert sources == {"nih", "tb", "covid"}
    # the held-out TB/COVID test images never appear at their site
    for name, src in (("site-5", "tb"), ("site-6", "covid")):
        test_stems = {Path(i["image"]).stem for i in sc.test if i["source"] == src}
        assert not test_stems & stems(items(sc.site(name)))
    # COVID negatives: the Normal folder only (default)
    assert all("Lung" not in s and "Viral" not in s for s in stems(items(sc.site("site-6"))))


def test_fedmlp_nih_missing_classes(nih, tmp_path):
    out = run("nih", "--src", nih, "--protocol", "fedmlp", "--missing", 3, "--out", tmp_path / "s", "--size", 16)
    sc = load_scenario(out)
    assert len(sc.classes) == 8 and len(sc.sites) == 8
    covered = set()
    sizes = []
    for site in sc.sites.values():
        assert len(site.profile.annotated) == 5
        covered |= set(site.profile.annotated)
        sizes.append(len(items(site)))
    assert covered == set(sc.classes)
    assert max(sizes) - min(sizes) <= 4  # equal patient-level shares (patients hold 2 images)
    with open(nih / "Data_Entry_2017.csv") as f:
        rows = {r[0][:-4]: r[6] for r in csv.reader(f) if r[0].endswith(".png")}
    all_items = [i for s in sc.sites.values() for i in items(s)] + sc.test
    assert {rows[Path(i["image"]).stem] for i in all_items} == {"PA"}
    train_p = {nih_patient(Path(i["image"]).stem) for s in sc.sites.values() for i in items(s)}
    assert not train_p & {nih_patient(Path(i["image"]).stem) for i in sc.test}


def test_surgical_sim_shared_classes_and_official_split(nih, tmp_path):
    out = run("nih", "--src", nih, "--protocol", "surgical-sim", "--sites", 3, "--shared", 4, "--test-split", "official",
              "--out", tmp_path / "s", "--size", 16)
    sc = load_scenario(out)
    sets = [set(s.profile.annotated) for s in sc.sites.values()]
    assert len(set.intersection(*sets)) == 4 and set.union(*sets) == set(NIH_CLASSES)
    official_test = set((nih / "test_list.txt").read_text().split())
    assert {Path(i["image"]).stem + ".png" for i in sc.test} == official_test
    pats = [{nih_patient(s) for s in stems(items(site))} for site in sc.sites.values()]
    assert not (pats[0] & pats[1]) and not (pats[1] & pats[2]) and not (pats[0] & pats[2])


def test_surgical_real_nih_chexpert_mimic(nih, tmp_path):
    chex = make_chexpert(tmp_path / "chex")
    mimic = make_mimic(tmp_path / "mimic")
    out = run("nih", "--src", nih, "--src", f"chexpert={chex}", "--src", f"mimic={mimic}", "--protocol", "surgical-real",
              "--out", tmp_path / "s", "--size", 16, "--uncertain", "ignore")
    sc = load_scenario(out)
    assert sc.classes == tuple(UNION20) and len(UNION20) == 20
    nih_site, chex_site = sc.site("site-1"), sc.site("site-2")
    assert len(set(nih_site.profile.annotated) & set(chex_site.profile.annotated)) == 7
    assert not (Path(out) / "site-1" / "oracle.json").exists()  # not simulated: no oracle
    lab = np.array([i["label"] for i in items(chex_site)])
    assert (lab == -1).any() and not stems(items(chex_site)) & {"view2_lateral"}
    assert all("lateral" not in s for s in stems(items(chex_site)))
    assert sc.test is None  # MIMIC without CXR-LT labels is not fully labeled
    meta = yaml.safe_load((out / "scenario.yaml").read_text())
    assert set(meta["extra_tests"]) == {"test-nih", "test-chexpert", "test-mimic"}
    mim = load_extra_test(out, "test-mimic")
    assert len(mim) == 6  # frontal only
    chex_test = load_extra_test(out, "test-chexpert")
    pat = lambda s: re.match(r"chexpert_(patient\d+)", s).group(1)  # noqa: E731
    assert not {pat(s) for s in stems(chex_test)} & {pat(s) for s in stems(items(chex_site))}


def test_surgical_real_with_cxr_lt_labels_has_full_test(nih, tmp_path):
    out = run("nih", "--src", nih, "--src", f"chexpert={make_chexpert(tmp_path / 'c')}",
              "--src", f"mimic={make_mimic(tmp_path / 'm', lt=True)}", "--protocol", "surgical-real",
              "--out", tmp_path / "s", "--size", 16)
    sc = load_scenario(out)
    assert sc.test is not None and len(sc.test) == 6 and np.array([i["label"] for i in sc.test]).shape == (6, 20)


# ---------------------------------------------------------------- ICH


ICH_SUBS = ["epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural", "any"]


def make_ich(root: Path, n=30, png=False, seed=3):
    rng = np.random.default_rng(seed)
    rows, pats = [], []
    for i in range(n):
        iid = f"ID_{i:09x}"
        lab = [int(rng.random() < 0.3) for _ in range(5)]
        for sub, v in zip(ICH_SUBS, lab + [max(lab)]):
            rows.append([f"{iid}_{sub}", v])
        pid = f"PAT{i // 3}"
        pats.append([iid, pid])
        px = rng.integers(-1000, 1000, (24, 24)).astype(np.int16)
        if png:
            gray(root / "stage_2_train_images" / f"{iid}.png", (24, 24), rng)
        else:
            (root / "stage_2_train").mkdir(parents=True, exist_ok=True)
            write_dicom(root / "stage_2_train" / f"{iid}.dcm", px, pid, explicit=bool(i % 2))
    write_csv(root / "stage_2_train.csv", ["ID", "Label"], rows)
    if png:
        write_csv(root / "patients.csv", ["ID", "PatientID"], pats)
    return root


def test_dicom_reader_roundtrip(tmp_path):
    px = np.arange(-500, -500 + 12 * 10, dtype=np.int16).reshape(12, 10)
    for explicit in (True, False):
        p = tmp_path / f"x{explicit}.dcm"
        write_dicom(p, px, "P1", intercept=-24.0, explicit=explicit)
        assert read_dicom_header(p)["PatientID"] == "P1"
        hu = px.astype(np.float64) - 24  # the CT window of fedlabels prepare ich (--window LEVEL,WIDTH): 100 HU wide
        expected = np.rint(np.clip((hu - (-450 - 0.5)) / (100 - 1) + 0.5, 0, 1) * 255).astype(np.uint8)
        np.testing.assert_array_equal(read_dicom_image(p, "-450,100")[0], expected)


@pytest.mark.parametrize("png", [False, True])
def test_fedmlp_ich(tmp_path, png):
    src = make_ich(tmp_path / "ich", png=png)
    out = run("ich", "--src", src, "--protocol", "fedmlp", "--missing", 2, "--cases", 21, "--out", tmp_path / "s",
              "--size", 16, "--val-fraction", 0.2)
    sc = load_scenario(out)
    assert sc.classes == tuple(ICH_SUBS[:5]) and len(sc.sites) == 5
    assert all(len(s.profile.annotated) == 3 for s in sc.sites.values())
    # three images per patient: patients never straddle sites or test
    pat = lambda s: int(s[3:], 16) // 3  # noqa: E731
    groups = [{pat(x) for x in stems(items(s))} for s in sc.sites.values()] + [{pat(x) for x in stems(sc.test)}]
    for a in range(len(groups)):
        for b in range(a + 1, len(groups)):
            assert not groups[a] & groups[b]
    assert sum(len(items(s)) for s in sc.sites.values()) + len(sc.test) == 30


# ---------------------------------------------------------------- MedMNIST


def make_npz(path: Path, n=(120, 20, 40), classes=5, rgb_=True, seed=4):
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, k in zip(("train", "val", "test"), n):
        shape = (k, 28, 28, 3) if rgb_ else (k, 28, 28)
        arrays[f"{split}_images"] = rng.integers(0, 255, shape, dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, classes, (k, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return path


def test_isofed_medmnist_fixture(tmp_path):
    make_npz(tmp_path / "mm" / "bloodmnist.npz", classes=8)
    out = run("bloodmnist", "--src", tmp_path / "mm", "--protocol", "isofed", "--gamma", 0.5, "--labeled", "1,3",
              "--out", tmp_path / "s")
    sc = load_scenario(out)
    assert [s.profile.supervision for s in sc.sites.values()] == ["image", "none", "image", "none"]
    assert sum(len(items(s)) for s in sc.sites.values()) == 120 and len(sc.test) == 40
    for k, site in enumerate(sc.sites.values()):
        labels = [i["label"] for i in items(site)]
        assert (min(labels) >= 0) if k in (0, 2) else set(labels) == {-1}
    img = image(sc.test[0]["image"])
    assert img.size == (28, 28) and img.mode == "RGB"
    meta = yaml.safe_load((out / "scenario.yaml").read_text())
    assert meta["provenance"]["sources"][0]["files"]["bloodmnist.npz"]["md5_matches_official"] is False


def test_isofed_rscfed_partition_gives_each_labeled_site_its_block(tmp_path, capsys):
    npz = make_npz(tmp_path / "mm" / "cells.npz", classes=8)  # not an official name: no MD5 warning
    out = run("medmnist", "--src", npz, "--protocol", "isofed", "--partition", "rscfed", "--gamma", 0.5,
              "--labeled", "1,3", "--labeled-fraction", 0.2, "--out", tmp_path / "s")
    sc = load_scenario(out)
    sizes = [len(items(s)) for s in sc.sites.values()]
    # sites 1 and 3 each a block of int(120 x 0.2) = 24 cases, sites 2 and 4 the other 72 (>= 10 each)
    assert sizes[0] == sizes[2] == 24 and sizes[1] + sizes[3] == 72 and min(sizes[1], sizes[3]) >= 10
    assert [s.profile.supervision for s in sc.sites.values()] == ["image", "none", "image", "none"]
    meta = yaml.safe_load((out / "scenario.yaml").read_text())
    assert meta["protocol"]["partition"] == "rscfed" and meta["protocol"]["labeled_fraction"] == 0.2
    capsys.readouterr()
    err = fails(capsys, "medmnist", "--src", npz, "--protocol", "isofed", "--labeled-fraction", 0.2,
                "--out", tmp_path / "t")
    assert "--labeled-fraction applies to --partition rscfed only" in err
    err = fails(capsys, "medmnist", "--src", npz, "--protocol", "isofed", "--partition", "rscfed",
                "--labeled", 4, "--out", tmp_path / "t")
    assert "at least one unlabeled site" in err


def test_partial_medmnist_site_classes(tmp_path):
    npz = make_npz(tmp_path / "x" / "mystery.npz", classes=4, rgb_=False)
    out = run("medmnist", "--src", npz, "--protocol", "partial", "--site-classes", "0,1;2;3,0", "--out", tmp_path / "s",
              "--size", 32)
    sc = load_scenario(out)
    assert sc.task == "multilabel" and len(sc.sites) == 3
    assert [len(s.profile.annotated) for s in sc.sites.values()] == [2, 1, 2]
    for site in sc.sites.values():
        full = np.array([i["label"] for i in site.oracle()["training"]])
        assert (full.sum(1) == 1).all()  # one-vs-rest of a single class
    assert image(sc.test[0]["image"]).size == (32, 32)


def test_md5_verification_and_download_from_local_url(tmp_path):
    npz = make_npz(tmp_path / "a" / "thing.npz")
    good = hashlib.md5(npz.read_bytes()).hexdigest()
    medmnist.verify_md5(npz, good)
    with pytest.raises(PrepareError, match="MD5 checksum mismatch"):
        medmnist.verify_md5(npz, "0" * 32)
    # "download" through urllib from a file:// URL: verified, then renamed into place
    dest = medmnist.download("thing", tmp_path / "dl", url=npz.as_uri(), md5=good, say=lambda m: None)
    assert dest.read_bytes() == npz.read_bytes()
    with pytest.raises(PrepareError, match="MD5 checksum mismatch"):
        medmnist.download("other", tmp_path / "dl2", url=npz.as_uri(), md5="1" * 32, say=lambda m: None)
    assert not list((tmp_path / "dl2").iterdir())  # nothing half-written left behind


def test_download_flag_fetches_only_when_absent(tmp_path, monkeypatch):
    remote = make_npz(tmp_path / "remote" / "bloodmnist.npz", classes=8)
    calls = []

    def fake_download(name, folder, url=None, md5=None, say=print, timeout=60):
        calls.append(name)  # the real one is tested above through a file:// URL
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.npz").write_bytes(remote.read_bytes())
        return Path(folder) / f"{name}.npz"

    monkeypatch.setattr(medmnist, "download", fake_download)
    for out in ("a", "b"):
        run("bloodmnist", "--src", tmp_path / "local", "--protocol", "isofed", "--download", "--out", tmp_path / out)
    assert calls == ["bloodmnist"]
    with pytest.raises(PrepareError, match="pneumoniamnist.npz not found"):
        run("pneumoniamnist", "--src", tmp_path / "local", "--protocol", "isofed", "--out", tmp_path / "c")


# ---------------------------------------------------------------- segmentation datasets


def check_boxes(site, size):
    oracle = {i["image"]: i["seg"] for i in site.oracle()["training"]}
    n = 0
    for it in site.training:
        mask = pixels(oracle[it["image"]])
        labels = [v for v in np.unique(mask) if v > 0]
        assert len(it["boxes"]) == len(labels)
        for box in it["boxes"]:
            x0, y0, x1, y1, cls = box
            value = 255 if mask.max() == 255 and len(labels) == 1 else cls + 1
            ys, xs = np.nonzero(mask == value)
            assert x0 <= xs.min() and xs.max() < x1 and y0 <= ys.min() and ys.max() < y1
            for margin, border in ((xs.min() - x0, x0 == 0), (ys.min() - y0, y0 == 0),
                                   (x1 - 1 - xs.max(), x1 == size), (y1 - 1 - ys.max(), y1 == size)):
                assert border or 1 <= margin <= 10
            n += 1
    return n


def make_breast(root: Path, seed=5):
    rng = np.random.default_rng(seed)
    busi = root / "Dataset_BUSI_with_GT"
    for cat, n in (("benign", 6), ("malignant", 4), ("normal", 6)):
        for i in range(1, n + 1):
            gray(busi / cat / f"{cat} ({i}).png", (30, 26), rng)
            blob_mask(busi / cat / f"{cat} ({i})_mask.png", (30, 26), rng, empty=cat == "normal")
            if cat == "benign" and i == 1:  # a second lesion, bottom-right, in its own mask file
                m = np.zeros((26, 30), np.uint8)
                m[20:25, 24:29] = 255
                Image.fromarray(m).save(busi / cat / f"{cat} ({i})_mask_1.png")
    for i in range(1, 9):
        gray(root / "BUSIS" / "Original" / f"case{i}.png", (36, 28), rng)
        blob_mask(root / "BUSIS" / "GT" / f"case{i}_GT.png", (36, 28), rng)
    for i in range(1, 8):
        gray(root / "UDIAT" / "original" / f"{i:06d}.png", (28, 28), rng)
        blob_mask(root / "UDIAT" / "GT" / f"{i:06d}.png", (28, 28), rng)
    return root


def test_fedmix_breast_u_b_l(tmp_path):
    src = make_breast(tmp_path / "breast")
    (src / "BUSI").symlink_to(src / "Dataset_BUSI_with_GT")
    out = run("breast", "--src", src, "--protocol", "fedmix", "--supervision", "U,B,L", "--folds", 4,
              "--out", tmp_path / "s", "--size", 40, "--val-fraction", 0.2)
    sc = load_scenario(out)
    assert [s.profile.supervision for s in sc.sites.values()] == ["none", "bbox", "pixel"]
    assert sc.site("site-1").profile.annotated == ()
    total = sum(len(items(s)) for s in sc.sites.values()) + len(sc.test)
    assert total == 16 + 8 + 7
    # half of BUS's healthy images moved to BUSIS (FedMix's setup)
    assert sum("normal" in s for s in stems(items(sc.site("site-2"))) | stems(sc.test)) >= 1
    assert check_boxes(sc.site("site-2"), 40) >= 1
    # healthy images: no box, no lesion
    normal = [it for it in sc.site("site-2").training if "normal" in it["image"]]
    assert all(it["boxes"] == [] for it in normal)
    assert {i["site"] for i in sc.test} == {"site-1", "site-2", "site-3"}
    m = pixels(sc.test[0]["seg"])
    assert m.shape == (40, 40) and set(np.unique(m)) <= {0, 255}
    # BUSI's two masks of one image are united (the second lesion sits bottom-right)
    (bus1,) = list(Path(out).glob("*/masks/bus_benign_1.png"))
    assert (pixels(bus1)[31:, 33:] == 255).any()


def make_ham(root: Path, seed=6, with_dataset=True):
    rng = np.random.default_rng(seed)
    rows, k = [], 0
    for src in ("rosendahl", "vidir_modern", "vidir_molemax", "vienna_dermatology"):
        for lesion in range(4):
            for _ in range(2):
                iid = f"ISIC_{k:07d}"
                part = "HAM10000_images_part_1" if k % 2 else "HAM10000_images_part_2"
                p = root / part / f"{iid}.jpg"
                p.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 255, (18, 24, 3), dtype=np.uint8)).save(p)
                blob_mask(root / "HAM10000_segmentations_lesion_tschandl" / f"{iid}_segmentation.png", (24, 18), rng)
                dx = ["akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"][rng.integers(7)]
                rows.append([f"HAM_{src}_{lesion}", iid, dx, "histo", 50, "male", "back"] + ([src] if with_dataset else []))
                k += 1
    write_csv(root / "HAM10000_metadata.csv", ["lesion_id", "image_id", "dx", "dx_type", "age", "sex", "localization"]
              + (["dataset"] if with_dataset else []), rows)
    return root, {r[1]: r[0] for r in rows}


def test_fedmix_ham10000_four_sources(tmp_path):
    src, lesion_of = make_ham(tmp_path / "ham")
    out = run("ham10000", "--src", src, "--protocol", "fedmix", "--supervision", "LBIU", "--folds", 4,
              "--out", tmp_path / "s", "--size", 32, "--val-fraction", 0.25)
    sc = load_scenario(out)
    meta = yaml.safe_load((out / "scenario.yaml").read_text())
    assert list(meta["site_sources"].values())[0].endswith("rosendahl")
    assert [s.profile.supervision for s in sc.sites.values()] == ["pixel", "bbox", "image", "none"]
    # lesion ids (patients) never straddle train/val/test
    for site in sc.sites.values():
        tr = {lesion_of[s] for s in stems(site.training)}
        va = {lesion_of[s] for s in stems(site.validation)}
        te = {lesion_of[Path(i["image"]).stem] for i in sc.test if i["site"] == site.name}
        assert not (tr & va) and not (tr & te) and not (va & te)
    assert image(sc.test[0]["image"]).mode == "RGB"
    check_boxes(sc.site("site-2"), 32)


def test_partial_ham10000_without_masks_and_missing_sources(tmp_path, capsys):
    src, _ = make_ham(tmp_path / "ham", with_dataset=False)
    out = run("ham10000", "--src", src, "--protocol", "partial", "--sites", 2, "--missing", 3, "--out", tmp_path / "s",
              "--size", 16)
    sc = load_scenario(out)
    assert len(sc.classes) == 7 and all(len(s.profile.annotated) == 4 for s in sc.sites.values())
    err = fails(capsys, "ham10000", "--src", src, "--protocol", "fedmix", "--out", tmp_path / "t")
    assert "HAM10000_metadata.csv" in err and "dataset" in err


def make_ph2_original(root: Path, n=12, seed=7):
    rng = np.random.default_rng(seed)
    base = root / "PH2Dataset" / "PH2 Dataset images"
    lines = ["|| Name || Histological Diagnosis || Clinical Diagnosis || Asymmetry ||"]
    for i in range(n):
        k = f"IMD{i + 2:03d}"
        rgb(base / k / f"{k}_Dermoscopic_Image" / f"{k}.bmp", (40, 30), rng)
        blob_mask(base / k / f"{k}_lesion" / f"{k}_lesion.bmp", (40, 30), rng)
        lines.append(f"||   {k}   ||        ||         {i % 3}        ||     {rng.integers(3)}     ||")
    (root / "PH2Dataset" / "PH2_dataset.txt").write_text("\n".join(lines) + "\n")
    return root / "PH2Dataset"


def test_fedmix_ph2_original_layout(tmp_path):
    src = make_ph2_original(tmp_path / "ph2")
    out = run("ph2", "--src", src, "--protocol", "fedmix", "--supervision", "L,B,I", "--folds", 0,
              "--out", tmp_path / "s", "--size", 48, "--val-fraction", 0.25)
    sc = load_scenario(out)
    assert sc.test is None and sum(len(items(s)) for s in sc.sites.values()) == 12
    assert {tuple(i["classes"]) for i in sc.site("site-3").training} == {(0,)}
    assert check_boxes(sc.site("site-2"), 48) == len(sc.site("site-2").training)
    part = run("ph2", "--src", src, "--protocol", "partial", "--sites", 2, "--missing", 1, "--out", tmp_path / "p",
               "--size", 16, "--test-fraction", 0.25)
    assert load_scenario(part).classes == ("common_nevus", "atypical_nevus", "melanoma")


def make_retouch(root: Path, seed=8):
    rng = np.random.default_rng(seed)
    for device, vols, dtype in (("Cirrus", 2, np.uint8), ("Topcon", 2, np.uint8), ("Spectralis", 3, np.uint16)):
        for v in range(vols):
            folder = root / f"RETOUCH-TrainingSet-{device}" / f"TRAIN{v + 1:03d}"
            folder.mkdir(parents=True)
            vol = rng.integers(0, 200 if dtype == np.uint8 else 4000, (3, 24, 16)).astype(dtype)
            ref = np.zeros((3, 24, 16), np.uint8)
            ref[0, 4:9, 3:8] = 1
            ref[1, 10:14, 2:6] = 2
            ref[1, 15:20, 8:14] = 3
            write_mhd(folder / "oct.mhd", vol)
            write_mhd(folder / "reference.mhd", ref)
    test_vol = root / "RETOUCH-TrainingSet-Cirrus" / "TEST001"
    test_vol.mkdir()
    write_mhd(test_vol / "oct.mhd", np.zeros((2, 24, 16), np.uint8))
    return root


def test_fedmix_retouch_multiclass_slices(tmp_path):
    src = make_retouch(tmp_path / "retouch")
    out = run("retouch", "--src", src, "--protocol", "fedmix", "--supervision", "B,I,L", "--folds", 2,
              "--out", tmp_path / "s", "--size", 32, "--val-fraction", 0)
    sc = load_scenario(out)
    assert sc.classes == ("irf", "srf", "ped")
    meta = yaml.safe_load((out / "scenario.yaml").read_text())
    assert meta["mask_values"] == {"background": 0, "irf": 1, "srf": 2, "ped": 3}
    n = sum(len(items(s)) for s in sc.sites.values()) + len(sc.test)
    assert n == (2 + 2 + 3) * 3  # every B-scan of the 7 annotated volumes
    # slices of one volume stay together
    for site in sc.sites.values():
        vol = lambda s: s.rsplit("_", 1)[0]  # noqa: E731
        te = {vol(Path(i["image"]).stem) for i in sc.test if i["site"] == site.name}
        assert not {vol(s) for s in stems(site.training)} & te
    image_site = sc.site("site-2")
    assert {tuple(i["classes"]) for i in image_site.training} <= {(), (0,), (1, 2)}
    check_boxes(sc.site("site-1"), 32)


# ---------------------------------------------------------------- contracts: determinism, atomicity, errors


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    src = make_npz(tmp_path / "mm" / "pathmnist.npz", classes=9)
    a = run("pathmnist", "--src", src.parent, "--protocol", "isofed", "--out", tmp_path / "a", "--seed", 5)
    b = run("pathmnist", "--src", src.parent, "--protocol", "isofed", "--out", tmp_path / "b", "--seed", 5)
    c = run("pathmnist", "--src", src.parent, "--protocol", "isofed", "--out", tmp_path / "c", "--seed", 6)
    assert digest(a) == digest(b) != digest(c)


def test_interrupted_preparation_never_validates_and_rerun_completes(tmp_path, monkeypatch):
    src = make_npz(tmp_path / "mm" / "organamnist.npz", classes=11, rgb_=False)
    out = tmp_path / "scen"
    calls = []
    real = build._convert

    def flaky(job):
        calls.append(1)
        if len(calls) == 50:
            raise KeyboardInterrupt  # the user hits Ctrl-C half-way
        return real(job)

    monkeypatch.setattr(build, "_convert", flaky)
    with pytest.raises(KeyboardInterrupt):
        run("organamnist", "--src", src.parent, "--protocol", "isofed", "--out", out)
    assert not out.exists() and not list(tmp_path.glob("scen.partial-*"))
    # a run killed hard leaves its temporary folder: it never validates...
    killed = tmp_path / "scen.partial-dead"
    (killed / "site-1").mkdir(parents=True)
    with pytest.raises(ScenarioError):
        load_scenario(killed)
    # ...and the next run cleans it up and completes
    monkeypatch.setattr(build, "_convert", real)
    run("organamnist", "--src", src.parent, "--protocol", "isofed", "--out", out)
    assert load_scenario(out).sites and not killed.exists()


def test_bad_inputs_fail_with_one_clear_message(tmp_path, capsys):
    # missing folder / file
    err = fails(capsys, "nih", "--src", tmp_path / "nope", "--protocol", "fedpsl-6", "--out", tmp_path / "o")
    assert str(tmp_path / "nope") in err
    (tmp_path / "empty").mkdir()
    err = fails(capsys, "nih", "--src", tmp_path / "empty", "--protocol", "fedpsl-6", "--out", tmp_path / "o")
    assert "Data_Entry_2017.csv" in err
    # unexpected CSV header
    nih = tmp_path / "nih"
    make_nih(nih, per_batch=4, batches=2)
    good = (nih / "Data_Entry_2017.csv").read_text()
    (nih / "Data_Entry_2017.csv").write_text(good.replace("Finding Labels", "Findings"))
    err = fails(capsys, "nih", "--src", nih, "--protocol", "surgical-sim", "--out", tmp_path / "o")
    assert "Data_Entry_2017.csv" in err and "Finding Labels" in err
    (nih / "Data_Entry_2017.csv").write_text(good)
    # an id in an official list with no image
    (nih / "test_list.txt").write_text("99999999_000.png\n88888888_000.png\n")
    err = fails(capsys, "nih", "--src", nih, "--protocol", "surgical-sim", "--out", tmp_path / "o")
    assert "test_list.txt" in err and "99999999_000.png" in err
    (nih / "test_list.txt").unlink()
    # a listed image whose file is gone
    victim = next(nih.rglob("*.png"))
    victim.rename(victim.with_suffix(".bak"))
    err = fails(capsys, "nih", "--src", nih, "--protocol", "surgical-sim", "--out", tmp_path / "o")
    assert victim.name in err
    victim.with_suffix(".bak").rename(victim)
    # a corrupt image
    victim.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    err = fails(capsys, "nih", "--src", nih, "--protocol", "surgical-sim", "--out", tmp_path / "o", "--size", 8,
                "--sites", 2)
    assert str(victim) in err and "corrupt or unreadable" in err
    assert not (tmp_path / "o").exists()
    # --skip-bad leaves it out and records it
    out = run("nih", "--src", nih, "--protocol", "surgical-sim", "--out", tmp_path / "o", "--size", 8,
              "--sites", 2, "--skip-bad")
    meta = yaml.safe_load((out / "scenario.yaml").read_text())
    assert meta["provenance"]["skipped_unreadable"] == [victim.stem]
    # a corrupt npz and one with the wrong arrays
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "bloodmnist.npz").write_bytes(b"not a zip")
    err = fails(capsys, "bloodmnist", "--src", tmp_path / "mm", "--protocol", "isofed", "--out", tmp_path / "o2")
    assert "bloodmnist.npz" in err
    np.savez(tmp_path / "mm" / "bloodmnist.npz", images=np.zeros((2, 28, 28)))
    err = fails(capsys, "bloodmnist", "--src", tmp_path / "mm", "--protocol", "isofed", "--out", tmp_path / "o2")
    assert "train_images" in err
    # a bad ICH label row; a RETOUCH volume whose raw data is missing
    ich = make_ich(tmp_path / "ich", n=3)
    with open(ich / "stage_2_train.csv", "a") as f:
        f.write("ID_bad_row,1\n")
    err = fails(capsys, "ich", "--src", ich, "--protocol", "fedmlp", "--out", tmp_path / "o3")
    assert "stage_2_train.csv" in err and "ID_bad_row" in err
    ret = make_retouch(tmp_path / "ret")
    raw = ret / "RETOUCH-TrainingSet-Topcon" / "TRAIN002" / "oct.raw"
    raw.unlink()
    err = fails(capsys, "retouch", "--src", ret, "--protocol", "fedmix", "--out", tmp_path / "o4")
    assert "oct.raw" in err or "oct.mhd" in err
    # protocol / dataset mismatch and bad options
    err = fails(capsys, "ph2", "--src", tmp_path, "--protocol", "fedpsl-6", "--out", tmp_path / "o5")
    assert "fedpsl-6" in err
    ph2 = make_ph2_original(tmp_path / "ph2")
    err = fails(capsys, "ph2", "--src", ph2, "--protocol", "fedmix", "--supervision", "L,X,U", "--out", tmp_path / "o6")
    assert "supervision" in err


def test_cli_registers_prepare_subcommand(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    prepare.add_parser(sub)
    make_npz(tmp_path / "pneumoniamnist.npz", classes=2, rgb_=False)
    args = p.parse_args(["prepare", "pneumoniamnist", "--src", str(tmp_path), "--protocol", "partial", "--out",
                         str(tmp_path / "s"), "--quiet", "--workers", "1", "--sites", "2"])
    assert args.fn is prepare.run
    out = args.fn(args)
    sc = load_scenario(out)
    assert json.loads((out / "site-1" / "datalist.json").read_text())["training"]
    assert sum(len(s.profile.annotated) for s in sc.sites.values()) == 2
