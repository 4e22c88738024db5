"""Dermoscopy: HAM10000 (four sources = four sites, FedMix Table II) and PH2.

HAM10000 (Tschandl et al. 2018; masks: Tschandl et al. 2020):
``HAM10000_metadata.csv`` with columns ``lesion_id, image_id, dx, dataset``
(the ``dataset`` column -- rosendahl, vidir_modern, vidir_molemax and the
old Vienna set -- is in the Harvard Dataverse release), images in
``HAM10000_images_part_1/`` and ``_part_2/`` (or ``HAM10000_images/``), masks
in ``HAM10000_segmentations_lesion_tschandl/<image_id>_segmentation.png``.
Patient = lesion_id (several images of one lesion never straddle a split).

PH2 (Mendonça et al. 2013), either the original release
(``PH2 Dataset images/IMD003/IMD003_Dermoscopic_Image/IMD003.bmp``,
``.../IMD003_lesion/IMD003_lesion.bmp``, ``PH2_dataset.txt``) or a flat copy
(``images/IMD003.png``, ``masks/IMD003_lesion.png``, ``diagnosis.csv`` with
columns ``image, diagnosis``).
"""

from __future__ import annotations

import re
from pathlib import Path

from .common import (Case, PrepareError, Source, find_first, find_optional, index_images, missing_error, read_csv,
                     record_file, require_dir)

HAM_CLASSES = ["akiec", "bcc", "bkl", "df", "mel", "nv", "vasc"]
HAM_SOURCE_ORDER = ["rosendahl", "vidir_modern", "vidir_old", "vienna_dermatology", "vidir_molemax"]
PH2_CLASSES = ["common_nevus", "atypical_nevus", "melanoma"]


def read_ham(src, need_masks: bool = True, say=print) -> Source:
    root = require_dir(src, "HAM10000")
    meta_csv = find_first(root, ["HAM10000_metadata.csv", "HAM10000_metadata"], "HAM10000_metadata.csv")
    files: dict = {}
    record_file(files, root, meta_csv)
    rows = read_csv(meta_csv, ["lesion_id", "image_id", "dx"])
    has_sources = "dataset" in rows[0]
    if need_masks and not has_sources:
        raise PrepareError(f"{meta_csv}: no 'dataset' column (the four image sources that are FedMix's sites); "
                           "use the metadata file of the Harvard Dataverse release")
    img_dirs = [p for p in root.iterdir() if p.is_dir() and p.name.lower().startswith("ham10000_images")]
    if not img_dirs:
        raise PrepareError(f"{root}: no HAM10000_images_part_1/ (or HAM10000_images/) folder")
    index = index_images(img_dirs)
    masks = {}
    if need_masks:
        mask_dir = find_first(root, ["HAM10000_segmentations_lesion_tschandl", "masks"], "the lesion masks folder", kind="dir")
        masks = index_images([mask_dir])
    cases, missing, no_mask = [], [], []
    for i, row in enumerate(rows):
        dx = row["dx"].lower()
        if dx not in HAM_CLASSES:
            raise PrepareError(f"{meta_csv}: row {i + 2}: unknown dx {row['dx']!r}; expected one of {HAM_CLASSES}")
        iid = row["image_id"]
        path = index.get(iid)
        if path is None:
            missing.append(iid)
            continue
        mask = None
        if need_masks:
            mask = masks.get(f"{iid}_segmentation") or masks.get(iid)
            if mask is None:
                no_mask.append(iid)
                continue
        site = row.get("dataset", "").strip().lower() or None
        cases.append(Case(iid, path, f"ham-{row['lesion_id']}", HAM_CLASSES.index(dx), mask, meta={"site": site}))
    if missing:
        raise missing_error(meta_csv, "listed images have no image file", missing, len(rows))
    if no_mask:
        raise missing_error(meta_csv, "listed images have no lesion mask", no_mask, len(rows))
    sites = []
    if has_sources:
        present = sorted({c.meta["site"] for c in cases})
        order = [s for s in HAM_SOURCE_ORDER if s in present] + [s for s in present if s not in HAM_SOURCE_ORDER]
        sites = [[s, f"HAM10000 source {s}"] for s in order]
    say(f"HAM10000: {len(cases)} images from {len(sites) or 'unknown'} sources")
    return Source("ham10000", "multiclass", list(HAM_CLASSES), cases, 3, root, files,
                  meta={"sites": sites, "seg_classes": ["lesion"]})


def read_ph2(src, say=print) -> Source:
    root = require_dir(src, "PH2")
    files: dict = {}
    if (root / "images").is_dir():
        diag = find_first(root, ["diagnosis.csv"], "diagnosis.csv")
        record_file(files, root, diag)
        rows = read_csv(diag, ["image", "diagnosis"])
        images = index_images([root / "images"])
        masks = index_images([find_first(root, ["masks", "lesions"], "the masks folder", kind="dir")])
        labels = {}
        for i, r in enumerate(rows):
            d = r["diagnosis"].strip().lower().replace(" ", "_")
            if d not in PH2_CLASSES:
                raise PrepareError(f"{diag}: row {i + 2}: unknown diagnosis {r['diagnosis']!r}; expected {PH2_CLASSES}")
            labels[r["image"]] = PH2_CLASSES.index(d)
        pairs = {k: (images.get(k), masks.get(f"{k}_lesion") or masks.get(k)) for k in labels}
    else:
        base = root / "PH2 Dataset images" if (root / "PH2 Dataset images").is_dir() else root
        txt = find_optional(root, ["PH2_dataset.txt", "PH2Dataset/PH2_dataset.txt"])
        if txt is None:
            raise PrepareError(f"{root}: neither a flat PH2 copy (images/, masks/, diagnosis.csv) nor the original "
                               f"release (PH2 Dataset images/ and PH2_dataset.txt)")
        record_file(files, root, txt)
        labels = _parse_ph2_txt(txt)
        pairs = {}
        for k in labels:
            folder = base / k
            img = next(iter(sorted((folder / f"{k}_Dermoscopic_Image").glob(f"{k}.*"))), None) if folder.is_dir() else None
            msk = next(iter(sorted((folder / f"{k}_lesion").glob(f"{k}_lesion.*"))), None) if folder.is_dir() else None
            pairs[k] = (img, msk)
    missing = [k for k, (img, _m) in pairs.items() if img is None]
    if missing:
        raise missing_error(root, "PH2 cases listed in the diagnosis file have no image", missing, len(pairs))
    no_mask = [k for k, (_i, m) in pairs.items() if m is None]
    if no_mask:
        raise missing_error(root, "PH2 cases have no lesion mask", no_mask, len(pairs))
    cases = [Case(k, img, f"ph2-{k}", labels[k], m, meta={}) for k, (img, m) in sorted(pairs.items())]
    say(f"PH2: {len(cases)} images")
    return Source("ph2", "multiclass", list(PH2_CLASSES), cases, 3, root, files,
                  meta={"sites": [], "seg_classes": ["lesion"]})


def _parse_ph2_txt(path: Path) -> dict:
    """PH2_dataset.txt: '|| IMD003 || <histology> || 0 || ...' with clinical diagnosis 0/1/2."""
    labels = {}
    for line in path.read_text(errors="replace").splitlines():
        cells = [c.strip() for c in line.split("||")]
        cells = [c for c in cells if c != ""]
        if not cells or not re.fullmatch(r"IMD\d+", cells[0]):
            continue
        ints = [c for c in cells[1:] if re.fullmatch(r"[0-2]", c)]
        if not ints:
            raise PrepareError(f"{path}: line for {cells[0]} has no clinical diagnosis (0, 1 or 2)")
        labels[cells[0]] = int(ints[0])
    if not labels:
        raise PrepareError(f"{path}: no '|| IMDxxx || ...' rows found")
    return labels
