"""Chest X-ray readers: NIH ChestX-ray14, CheXpert, MIMIC-CXR-JPG, TB and COVID-19 radiography.

Each ``read_*`` takes the folder the user downloaded (layouts in
docs/datasets.md) and returns a :class:`Source` whose cases carry 0/1 label
vectors over that dataset's own class names (-1 where the dataset says
"uncertain" and the policy is to ignore it). Protocols map the names onto a
scenario's global class list.
"""

from __future__ import annotations

import re
from pathlib import Path

from .common import (Case, PrepareError, Source, find_first, find_optional, index_images, missing_error, read_csv,
                     read_list, record_file, require_dir, strip_ext, warn)

NIH_CLASSES = ["atelectasis", "cardiomegaly", "effusion", "infiltration", "mass", "nodule", "pneumonia",
               "pneumothorax", "consolidation", "edema", "emphysema", "fibrosis", "pleural_thickening", "hernia"]
# Official image batches images_001 .. images_012 (sorted by image index).
NIH_BATCH_SIZES = [4999] + [10000] * 10 + [7121]

# CheXpert / MIMIC (CheXpert labeler) column -> our class name.
CHEXPERT_COLUMNS = {
    "Enlarged Cardiomediastinum": "enlarged_cardiomediastinum", "Cardiomegaly": "cardiomegaly",
    "Lung Opacity": "lung_opacity", "Lung Lesion": "lung_lesion", "Edema": "edema",
    "Consolidation": "consolidation", "Pneumonia": "pneumonia", "Atelectasis": "atelectasis",
    "Pneumothorax": "pneumothorax", "Pleural Effusion": "effusion", "Pleural Other": "pleural_other",
    "Fracture": "fracture", "Support Devices": "support_devices",
}
CHEXPERT_CLASSES = list(CHEXPERT_COLUMNS.values())
# Surgical Aggregation's 20-class union: NIH's 14, then CheXpert's 6 others (7 shared).
UNION20 = NIH_CLASSES + [c for c in CHEXPERT_CLASSES if c not in NIH_CLASSES]
UNCERTAIN = {"zeros": 0, "ones": 1, "ignore": -1}


def norm_name(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.strip().lower()).strip("_")


# ------------------------------------------------------------------ NIH


def read_nih(src, allow_missing: bool = False, say=print) -> Source:
    """NIH ChestX-ray14: Data_Entry_2017*.csv, images in images*/ folders, optional official lists."""
    root = require_dir(src, "NIH ChestX-ray14")
    csv_path = find_first(root, ["Data_Entry_2017_v2020.csv", "Data_Entry_2017.csv"], "the label file Data_Entry_2017.csv")
    files: dict = {}
    record_file(files, root, csv_path)
    rows = read_csv(csv_path, ["Image Index", "Finding Labels", "Patient ID"])
    known = {c.lower(): c for c in NIH_CLASSES}
    say(f"NIH: indexing images under {root}")
    index = index_images([root])
    cases, missing = [], []
    order = sorted(range(len(rows)), key=lambda i: rows[i]["Image Index"])
    for rank, i in enumerate(order):
        row = rows[i]
        name = row["Image Index"]
        lab = [0] * len(NIH_CLASSES)
        for finding in row["Finding Labels"].split("|"):
            f = finding.strip().lower()
            if f in ("no finding", ""):
                continue
            if f not in known:
                raise PrepareError(f"{csv_path}: row {i + 2} ({name}): unknown finding {finding!r}; "
                                   f"expected 'No Finding' or {NIH_CLASSES}")
            lab[NIH_CLASSES.index(known[f])] = 1
        path = index.get(name)
        if path is None:
            missing.append(name)
        batch = _nih_batch(path)
        cases.append(Case(strip_ext(name), path, f"nih-{row['Patient ID']}", lab,
                          meta={"view": row.get("View Position", ""), "batch": batch, "rank": rank, "name": name}))
    if missing:
        if not allow_missing:
            raise missing_error(csv_path, "listed images have no image file under " + str(root), missing, len(rows))
        warn(f"{csv_path}: {len(missing)} listed images are not under {root}; left out (--allow-missing)")
        cases = [c for c in cases if c.image is not None]
    if any(c.meta["batch"] is None for c in cases) and len(rows) == sum(NIH_BATCH_SIZES):
        # All images in one folder: batch membership from the official order.
        for c in cases:
            c.meta["batch"] = batch_of_rank(c.meta["rank"])
    official = {}
    for split, names in (("train", ["train_val_list.txt"]), ("test", ["test_list.txt"])):
        path = find_optional(root, names)
        if path is None:
            continue
        record_file(files, root, path)
        ids = read_list(path)
        by_name = {c.meta["name"]: c for c in cases}
        unknown = [i for i in ids if i not in by_name]
        if unknown and not allow_missing:
            raise missing_error(path, "listed ids have no image (or no row in Data_Entry)", unknown, len(ids))
        for i in ids:
            if i in by_name:
                by_name[i].meta["official"] = split
        official[split] = len(ids)
    return Source("nih", "multilabel", list(NIH_CLASSES), cases, 1, root, files,
                  meta={"official_lists": official, "missing_images": len(missing)})


def batch_of_rank(rank: int) -> int:
    """Official batch (1..12) of the image at this 0-based position in image-index order."""
    total = 0
    for k, size in enumerate(NIH_BATCH_SIZES):
        total += size
        if rank < total:
            return k + 1
    raise ValueError(f"rank {rank} beyond the {total} NIH images")


def _nih_batch(path):
    if path is None:
        return None
    for part in (path.parent.name, path.parent.parent.name):
        m = re.fullmatch(r"images_(\d{3})", part)
        if m:
            return int(m.group(1))
    return None


# ------------------------------------------------------------------ CheXpert


def _chexpert_value(v: str, policy: str, where: str) -> int:
    v = (v or "").strip()
    if v in ("", "0", "0.0"):
        return 0
    if v in ("1", "1.0"):
        return 1
    if v in ("-1", "-1.0"):
        return UNCERTAIN[policy]
    raise PrepareError(f"{where}: unexpected label value {v!r} (expected 1, 0, -1 or blank)")


def read_chexpert(src, uncertain: str = "zeros", say=print) -> Source:
    """CheXpert (v1.0 or -small): train.csv (+ valid.csv); frontal images only."""
    if uncertain not in UNCERTAIN:
        raise PrepareError(f"--uncertain must be one of {sorted(UNCERTAIN)}, got {uncertain!r}")
    root = require_dir(src, "CheXpert")
    train_csv = find_optional(root, ["train.csv"])
    if train_csv is None:
        subs = sorted(p for p in root.glob("CheXpert-v1.0*/train.csv"))
        if not subs:
            raise PrepareError(f"{root}: CheXpert train.csv not found (looked for {root / 'train.csv'} and "
                               f"{root / 'CheXpert-v1.0-small/train.csv'})")
        train_csv = subs[0]
    base = train_csv.parent
    files: dict = {}
    cases, missing, lateral = [], [], 0
    for csv_path in [train_csv] + ([base / "valid.csv"] if (base / "valid.csv").is_file() else []):
        record_file(files, root, csv_path)
        rows = read_csv(csv_path, ["Path", "Frontal/Lateral"] + list(CHEXPERT_COLUMNS))
        for i, row in enumerate(rows):
            if row["Frontal/Lateral"].lower() != "frontal":
                lateral += 1
                continue
            rel = row["Path"]
            path = _resolve(base, rel)
            if path is None:
                missing.append(rel)
                continue
            where = f"{csv_path}: row {i + 2}"
            lab = [_chexpert_value(row[col], uncertain, f"{where} column {col!r}") for col in CHEXPERT_COLUMNS]
            m = re.search(r"patient(\d+)", rel)
            patient = f"chexpert-{m.group(1)}" if m else f"chexpert-{rel}"
            cid = re.sub(r"^.*?(patient\d+)/(study\d+)/(view\d+_\w+)\.\w+$", r"\1_\2_\3", rel)
            cases.append(Case(f"chexpert_{cid}".replace("/", "_"), path, patient, lab,
                              meta={"split": csv_path.stem, "view": row.get("AP/PA", "")}))
    if missing:
        raise missing_error(train_csv, "frontal images listed in the CSV were not found", missing)
    say(f"CheXpert: {len(cases)} frontal images ({lateral} lateral left out), uncertain -> {uncertain}")
    return Source("chexpert", "multilabel", list(CHEXPERT_CLASSES), cases, 1, root, files,
                  meta={"uncertain": uncertain, "lateral_dropped": lateral})


def _resolve(base: Path, rel: str):
    rel_p = Path(rel)
    for cand in (base.parent / rel_p, base / rel_p, base / Path(*rel_p.parts[1:]) if len(rel_p.parts) > 1 else None):
        if cand is not None and cand.is_file():
            return cand
    return None


# ------------------------------------------------------------------ MIMIC-CXR-JPG


def read_mimic(src, uncertain: str = "zeros", say=print) -> Source:
    """MIMIC-CXR-JPG 2.x: metadata + chexpert label CSVs (.csv or .csv.gz), files/pXX/pID/sID/<dicom>.jpg.

    An optional per-image label file (CXR-LT style: a ``dicom_id`` column and
    one column per finding, e.g. ``cxr-lt*.csv``) adds labels for the classes
    the CheXpert labeler lacks; its values override the study labels.
    """
    root = require_dir(src, "MIMIC-CXR-JPG")
    files: dict = {}
    meta_csv = find_first(root, ["mimic-cxr-2.0.0-metadata.csv.gz", "mimic-cxr-2.0.0-metadata.csv"], "the metadata CSV")
    lab_csv = find_first(root, ["mimic-cxr-2.0.0-chexpert.csv.gz", "mimic-cxr-2.0.0-chexpert.csv"], "the CheXpert label CSV")
    for p in (meta_csv, lab_csv):
        record_file(files, root, p)
    study = {}
    for i, row in enumerate(read_csv(lab_csv, ["subject_id", "study_id"] + list(CHEXPERT_COLUMNS))):
        where = f"{lab_csv}: row {i + 2}"
        study[(row["subject_id"], row["study_id"])] = [
            _chexpert_value(row[c], uncertain, f"{where} column {c!r}") for c in CHEXPERT_COLUMNS]
    classes = list(CHEXPERT_CLASSES)
    extra = {}
    lt = sorted([p for p in root.glob("*.csv") if re.search(r"cxr[-_]?lt|lt[-_]labels", p.name.lower())])
    if lt:
        record_file(files, root, lt[0])
        rows = read_csv(lt[0], ["dicom_id"])
        cols = {c: norm_name(c) for c in rows[0] if c not in ("dicom_id", "subject_id", "study_id", "split", "path")}
        alias = {"pleural_effusion": "effusion", "pleural_thickening": "pleural_thickening"}
        cols = {c: alias.get(n, n) for c, n in cols.items() if alias.get(n, n) in UNION20}
        for c in cols.values():
            if c not in classes:
                classes.append(c)
        for row in rows:
            extra[row["dicom_id"]] = {cols[c]: _chexpert_value(row[c], uncertain, f"{lt[0]} column {c!r}") for c in cols}
    cases, missing, dropped = [], [], 0
    for row in read_csv(meta_csv, ["dicom_id", "subject_id", "study_id", "ViewPosition"]):
        if row["ViewPosition"] not in ("PA", "AP"):
            dropped += 1
            continue
        key = (row["subject_id"], row["study_id"])
        if key not in study:
            dropped += 1
            continue
        sid = row["subject_id"]
        path = root / "files" / f"p{sid[:2]}" / f"p{sid}" / f"s{row['study_id']}" / f"{row['dicom_id']}.jpg"
        if not path.is_file():
            missing.append(row["dicom_id"])
            continue
        lab = study[key] + [-1] * (len(classes) - len(CHEXPERT_CLASSES))
        for name, v in extra.get(row["dicom_id"], {}).items():
            lab[classes.index(name)] = v
        cases.append(Case(f"mimic_{row['dicom_id']}", path, f"mimic-{sid}", lab, meta={"view": row["ViewPosition"]}))
    if missing:
        raise missing_error(meta_csv, f"frontal images have no JPEG under {root / 'files'}", missing)
    say(f"MIMIC: {len(cases)} frontal images with labels ({dropped} lateral/unlabeled left out)")
    return Source("mimic", "multilabel", classes, cases, 1, root, files, meta={"uncertain": uncertain})


# ------------------------------------------------------------------ TB / COVID


def _category_images(folder: Path) -> list:
    sub = folder / "images"
    folder = sub if sub.is_dir() else folder
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))


def _find_child(root: Path, name: str):
    for p in root.iterdir():
        if p.is_dir() and norm_name(p.name) == norm_name(name):
            return p
    return None


def _dataset_root(src, marker: str, nested: list, what: str) -> Path:
    root = require_dir(src, what)
    if _find_child(root, marker) is not None:
        return root
    for n in nested:
        if (root / n).is_dir() and _find_child(root / n, marker) is not None:
            return root / n
    raise PrepareError(f"{root}: {what}: folder {marker!r} not found (expected {root / marker} "
                       f"or {root / nested[0] / marker})")


def read_tb(src, say=print) -> Source:
    """Tuberculosis Chest X-ray Database (Rahman et al.): Normal/ and Tuberculosis/ folders."""
    root = _dataset_root(src, "Tuberculosis", ["TB_Chest_Radiography_Database"], "Tuberculosis Chest X-ray Database")
    cases = []
    for cat, y in (("Normal", 0), ("Tuberculosis", 1)):
        folder = _find_child(root, cat)
        if folder is None:
            raise PrepareError(f"{root}: folder {cat!r} not found")
        imgs = _category_images(folder)
        if not imgs:
            raise PrepareError(f"{folder}: no images")
        for p in imgs:
            cases.append(Case(f"tb_{strip_ext(p.name)}", p, f"tb-{strip_ext(p.name)}", [y], meta={"category": cat.lower()}))
    say(f"TB: {len(cases)} images ({sum(c.labels[0] for c in cases)} tuberculosis)")
    return Source("tb", "multilabel", ["tuberculosis"], cases, 1, root, {}, meta={})


COVID_CATEGORIES = {"covid": "COVID", "normal": "Normal", "lung_opacity": "Lung_Opacity", "viral_pneumonia": "Viral Pneumonia"}


def read_covid(src, negatives=("normal",), say=print) -> Source:
    """COVID-19 Radiography Database: COVID/, Normal/, Lung_Opacity/, Viral Pneumonia/ (images/ inside or not).

    ``negatives`` picks the categories used as COVID-negative cases (default
    Normal only: 3616 COVID of 13808 = 26 %, FedPSL's Table III rate).
    """
    root = _dataset_root(src, "COVID", ["COVID-19_Radiography_Dataset", "COVID-19 Radiography Database"],
                         "COVID-19 Radiography Database")
    bad = [n for n in negatives if n not in COVID_CATEGORIES or n == "covid"]
    if bad:
        raise PrepareError(f"--covid-negatives: unknown categories {bad}; choose from "
                           f"{[c for c in COVID_CATEGORIES if c != 'covid']}")
    cases = []
    for key in ["covid"] + list(negatives):
        folder = _find_child(root, COVID_CATEGORIES[key])
        if folder is None:
            raise PrepareError(f"{root}: folder {COVID_CATEGORIES[key]!r} not found")
        imgs = _category_images(folder)
        if not imgs:
            raise PrepareError(f"{folder}: no images")
        for p in imgs:
            cases.append(Case(f"covid_{strip_ext(p.name)}", p, f"covid-{strip_ext(p.name)}", [int(key == "covid")],
                              meta={"category": key}))
    say(f"COVID-19: {len(cases)} images ({sum(c.labels[0] for c in cases)} COVID)")
    return Source("covid", "multilabel", ["covid19"], cases, 1, root, {}, meta={"negatives": list(negatives)})
