"""Breast ultrasound tumour segmentation: BUS (BUSI), BUSIS and UDIAT, one site each (FedMix Table I).

* BUS  -- "Dataset_BUSI_with_GT" (Al-Dhabyani et al. 2020): ``benign/``,
  ``malignant/``, ``normal/`` with ``<name>.png`` and ``<name>_mask.png``
  (extra lesions as ``<name>_mask_1.png``; their union is the mask).
* BUSIS -- (Xian et al. 2018): an image folder and a ground-truth folder.
* UDIAT -- "Dataset B" (Yap et al. 2018): ``original/`` and ``GT/``.

The two paired-folder datasets accept any of the usual folder names (see
``IMAGE_DIRS`` / ``MASK_DIRS``); masks are matched to images by file stem,
optionally with a ``_GT``/``_mask``/``_segmentation`` suffix.
"""

from __future__ import annotations

import re
from pathlib import Path

from .common import IMAGE_EXTS, Case, PrepareError, Source, missing_error, require_dir, strip_ext

IMAGE_DIRS = ["original", "Original", "images", "Images", "image", "img", "imgs"]
MASK_DIRS = ["GT", "gt", "Ground Truth", "ground_truth", "GroundTruth", "masks", "Masks", "mask", "labels"]
MASK_SUFFIXES = ["", "_GT", "_gt", "_mask", "_Mask", "_segmentation", "_lesion", "_seg", "-mask", "_anno"]
SITES = [("bus", "BUS (BUSI, Al-Dhabyani et al. 2020)"), ("busis", "BUSIS (Xian et al. 2018)"),
         ("udiat", "UDIAT Dataset B (Yap et al. 2018)")]
FOLDER_NAMES = {"bus": ["BUSI", "Dataset_BUSI_with_GT", "BUS"], "busis": ["BUSIS"],
                "udiat": ["UDIAT", "BUS_Dataset_B", "DatasetB", "Dataset_B"]}


def _images(folder: Path) -> list:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTS and not p.name.startswith("."))


def read_paired(src, site: str, patient_prefix: str | None = None) -> list:
    """Cases from an image folder + mask folder pair, matched by stem."""
    root = require_dir(src, site)
    img_dir = next((root / d for d in IMAGE_DIRS if (root / d).is_dir()), None)
    mask_dir = next((root / d for d in MASK_DIRS if (root / d).is_dir()), None)
    if img_dir is None or mask_dir is None:
        raise PrepareError(f"{root}: expected an image folder ({' / '.join(IMAGE_DIRS[:3])}) and a mask folder "
                           f"({' / '.join(MASK_DIRS[:3])}); found {sorted(p.name for p in root.iterdir())}")
    masks = {strip_ext(p.name): p for p in _images(mask_dir)}
    cases, missing = [], []
    for p in _images(img_dir):
        stem = strip_ext(p.name)
        m = next((masks[stem + s] for s in MASK_SUFFIXES if stem + s in masks), None)
        if m is None:
            missing.append(p.name)
            continue
        cid = f"{site}_{stem}"
        cases.append(Case(cid, p, f"{patient_prefix or site}-{stem}", None, m, meta={"site": site}))
    if missing:
        raise missing_error(mask_dir, "images have no mask", missing)
    if not cases:
        raise PrepareError(f"{img_dir}: no images")
    return cases


def read_busi(src) -> list:
    root = require_dir(src, "BUS (Dataset_BUSI_with_GT)")
    cases, missing = [], []
    found = False
    for cat in ("benign", "malignant", "normal"):
        folder = root / cat
        if not folder.is_dir():
            continue
        found = True
        files = _images(folder)
        mask_files = [p for p in files if "_mask" in p.stem]
        for p in files:
            if "_mask" in p.stem:
                continue
            stem = p.stem
            ms = sorted(m for m in mask_files if re.fullmatch(re.escape(stem) + r"_mask(_\d+)?", m.stem))
            if not ms:
                missing.append(f"{cat}/{p.name}")
                continue
            num = re.sub(r"\D+", "", stem) or stem
            cases.append(Case(f"bus_{cat}_{num}", p, f"bus-{cat}-{num}", None, ms, meta={"site": "bus", "category": cat}))
    if not found:
        raise PrepareError(f"{root}: BUSI folders benign/, malignant/, normal/ not found")
    if missing:
        raise missing_error(root, "BUSI images have no <name>_mask.png", missing)
    return cases


def resolve_sources(srcs: dict) -> dict:
    """{'bus': path, 'busis': path, 'udiat': path} from named --src or subfolders of one --src."""
    out = {}
    default = srcs.get("")
    for key, _ in SITES:
        if key in srcs:
            out[key] = Path(srcs[key])
        elif default is not None:
            hit = next((Path(default) / n for n in FOLDER_NAMES[key] if (Path(default) / n).is_dir()), None)
            if hit is not None:
                out[key] = hit
    missing = [k for k, _ in SITES if k not in out]
    if missing:
        where = f" under {default}" if default else ""
        raise PrepareError(f"breast: no folder for {missing}{where}; pass --src DIR holding "
                           f"{' / '.join(FOLDER_NAMES[missing[0]])}, or --src {missing[0]}=DIR")
    return out


def read(srcs: dict, say=print) -> Source:
    paths = resolve_sources(srcs)
    cases = read_busi(paths["bus"]) + read_paired(paths["busis"], "busis") + read_paired(paths["udiat"], "udiat")
    counts = {k: sum(c.meta["site"] == k for c in cases) for k, _ in SITES}
    say(f"breast: {counts}")
    return Source("breast", "segmentation", ["tumor"], cases, 1, Path(srcs.get("") or paths["bus"]), {},
                  meta={"sites": SITES, "seg_classes": ["tumor"], "paths": {k: str(v) for k, v in paths.items()}})
