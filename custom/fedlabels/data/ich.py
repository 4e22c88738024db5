"""RSNA Intracranial Hemorrhage Detection (2019): five subtypes, "any" dropped.

Layout: ``stage_2_train.csv`` (columns ``ID,Label``; one row per image and
subtype, ``ID_<image>_<subtype>``) and the images as DICOM
(``stage_2_train/ID_<image>.dcm``) or already converted PNG/JPEG (any of the
folders below). DICOMs are windowed (brain window by default) at preparation.
Patient ids come from the DICOM headers, or from an optional CSV
(``patients.csv``: columns ``ID``/``SOPInstanceUID`` and ``PatientID``) for PNG
copies; without either, each image is its own patient (recorded as a note).
"""

from __future__ import annotations

from pathlib import Path

from .common import (Case, PrepareError, Progress, Source, find_first, find_optional, index_images, iter_csv,
                     missing_error, read_csv, record_file, require_dir, warn)

ICH_CLASSES = ["epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural"]
IMAGE_FOLDERS = ["stage_2_train", "stage_2_train_images", "stage_1_train_images", "train_images", "train", "images", "png"]
LABEL_FILES = ["stage_2_train.csv", "stage_1_train.csv", "train.csv"]
PATIENT_FILES = ["patients.csv", "metadata.csv", "train_metadata.csv"]


def read(src, allow_missing: bool = False, say=print) -> Source:
    root = require_dir(src, "RSNA Intracranial Hemorrhage")
    csv_path = find_first(root, LABEL_FILES, "the label file stage_2_train.csv")
    files: dict = {}
    record_file(files, root, csv_path)
    subs = ICH_CLASSES + ["any"]
    labels: dict = {}  # image id -> bytearray of the 6 subtype labels (255 = no row yet)
    for i, row in enumerate(iter_csv(csv_path, ["ID", "Label"])):
        head, _, sub = row["ID"].rpartition("_")
        if not head.startswith("ID_") or sub not in subs:
            raise PrepareError(f"{csv_path}: row {i + 2}: unexpected ID {row['ID']!r} "
                               f"(expected ID_<image>_<subtype>, subtype one of {subs})")
        if row["Label"] not in ("0", "1"):
            raise PrepareError(f"{csv_path}: row {i + 2}: label {row['Label']!r} is not 0 or 1")
        entry = labels.get(head)
        if entry is None:
            entry = labels[head] = bytearray(b"\xff" * len(subs))
        j, v = subs.index(sub), int(row["Label"])
        if entry[j] not in (255, v):
            raise PrepareError(f"{csv_path}: image {head} subtype {sub} is labeled both 0 and 1")
        entry[j] = v
    if not labels:
        raise PrepareError(f"{csv_path}: no rows")
    incomplete = [k for k, v in labels.items() if 255 in v[:5]]
    if incomplete:
        raise missing_error(csv_path, f"images lack a row for some of the subtypes {ICH_CLASSES}", incomplete, len(labels))
    folders = [root / f for f in IMAGE_FOLDERS if (root / f).is_dir()]
    if not folders:
        raise PrepareError(f"{root}: no image folder (looked for {', '.join(IMAGE_FOLDERS)})")
    say(f"ICH: indexing images under {', '.join(str(f) for f in folders)}")
    index = index_images(folders)
    patients = _patient_table(root, files)
    cases, missing = [], []
    for image_id in sorted(labels):
        path = index.get(image_id)
        if path is None:
            missing.append(image_id)
            continue
        lab = list(labels[image_id][:5])
        cases.append(Case(image_id, path, patients.get(image_id), lab))
    if missing:
        if not allow_missing:
            raise missing_error(csv_path, "labeled images have no image file", missing, len(labels))
        warn(f"{csv_path}: {len(missing)} labeled images have no file; left out (--allow-missing)")
    return Source("ich", "multilabel", list(ICH_CLASSES), cases, 1, root, files,
                  meta={"patient_ids": "table" if patients else "dicom-or-none", "missing_images": len(missing)})


def _patient_table(root: Path, files: dict) -> dict:
    path = find_optional(root, PATIENT_FILES)
    if path is None:
        return {}
    record_file(files, root, path)
    rows = read_csv(path, ["PatientID"])
    key = next((k for k in ("ID", "SOPInstanceUID", "image", "Image") if k in rows[0]), None)
    if key is None:
        raise PrepareError(f"{path}: unexpected CSV header {list(rows[0])}; need an ID (or SOPInstanceUID) and a PatientID column")
    return {(r[key] if r[key].startswith("ID_") else f"ID_{r[key]}"): r["PatientID"] for r in rows}


def fill_patients(cases: list, say=print) -> str:
    """Give each case a patient id: from the table, else its DICOM header, else the image id."""
    todo = [c for c in cases if c.patient is None]
    if not todo:
        return "table"
    dicoms = [c for c in todo if str(c.image).lower().endswith(".dcm")]
    if dicoms:
        from .dicom import DicomError, read_dicom_header

        progress = Progress(len(dicoms), "DICOM headers read", say)
        for c in dicoms:
            try:
                pid = read_dicom_header(c.image).get("PatientID")
            except DicomError as e:
                raise PrepareError(str(e)) from None
            c.patient = f"ich-{pid}" if pid else c.id
            progress.step()
    rest = [c for c in todo if c.patient is None]
    for c in rest:
        c.patient = c.id
    if rest:
        warn(f"{len(rest)} ICH images have no patient id (PNG without patients.csv): split per image")
        return "image"
    return "dicom"
