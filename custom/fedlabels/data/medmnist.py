"""MedMNIST v2 2D sets from their official ``.npz`` files (Yang et al., Sci. Data 2023).

Each file holds ``{train,val,test}_images`` (N, H, W[, 3]) uint8 and
``{train,val,test}_labels`` (N, 1) class indices. Any 2D multi-class set in
that format works; the table below knows the official ones (class names,
Zenodo URL and MD5) so ``--download`` can fetch and verify them.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

from .common import Case, PrepareError, Source, file_digest, warn

ZENODO = "https://zenodo.org/records/10519652/files/{name}.npz?download=1"

# name: (MD5 of the official 28 px file, class names). Multi-class 2D sets only.
INFO = {
    "pathmnist": ("a8b06965200029087d5bd730944a56c1", ["adipose", "background", "debris", "lymphocytes", "mucus",
                  "smooth_muscle", "normal_colon_mucosa", "cancer_associated_stroma",
                  "colorectal_adenocarcinoma_epithelium"]),
    "dermamnist": ("0744692d530f8e62ec473284d019b0c7", ["actinic_keratoses", "basal_cell_carcinoma",
                   "benign_keratosis", "dermatofibroma", "melanoma", "melanocytic_nevi", "vascular_lesions"]),
    "octmnist": ("c68d92d5b585d8d81f7112f81e2d0842", ["choroidal_neovascularization", "diabetic_macular_edema",
                 "drusen", "normal"]),
    "pneumoniamnist": ("28209eda62fecd6e6a2d98b1501bb15f", ["normal", "pneumonia"]),
    "retinamnist": ("bd4c0672f1bba3e3a89f0e4e876791e4", ["grade_0", "grade_1", "grade_2", "grade_3", "grade_4"]),
    "breastmnist": ("750601b1f35ba3300ea97c75c52ff8f6", ["malignant", "normal_or_benign"]),
    "bloodmnist": ("7053d0359d879ad8a5505303e11de1dc", ["basophil", "eosinophil", "erythroblast",
                   "immature_granulocytes", "lymphocyte", "monocyte", "neutrophil", "platelet"]),
    "tissuemnist": ("ebe78ee8b05294063de985d821c1c34b", ["collecting_duct_connecting_tubule",
                    "distal_convoluted_tubule", "glomerular_endothelial_cells", "interstitial_endothelial_cells",
                    "leukocytes", "podocytes", "proximal_tubule_segments", "thick_ascending_limb"]),
    "organamnist": ("68e3f8846a6bd62f0c9bf841c0d9eacc", ["bladder", "femur_left", "femur_right", "heart",
                    "kidney_left", "kidney_right", "liver", "lung_left", "lung_right", "pancreas", "spleen"]),
    "organcmnist": ("b9ceb9546e10131b32923c5bbeaea2b1", None),
    "organsmnist": ("9ab87b696fb54e2a387ebe992d6ed5f1", None),
}
INFO["organcmnist"] = (INFO["organcmnist"][0], INFO["organamnist"][1])
INFO["organsmnist"] = (INFO["organsmnist"][0], INFO["organamnist"][1])
SPLITS = ("train", "val", "test")


def md5_of(path) -> str:
    return file_digest(path, "md5")


def verify_md5(path, expected: str) -> None:
    """Raise PrepareError naming the file when its MD5 is not ``expected``."""
    got = md5_of(path)
    if got != expected:
        raise PrepareError(f"{path}: MD5 checksum mismatch: got {got}, expected {expected} "
                           f"(corrupt or different download; delete it and download again)")


def download(name: str, folder, url: str | None = None, md5: str | None = None, say=print, timeout=60) -> Path:
    """Fetch ``<name>.npz`` into ``folder`` and verify its MD5 (official table by default).

    The file is written under a temporary name and only renamed into place
    once its checksum matches, so a broken download never looks complete.
    """
    name = name.lower()
    if url is None or md5 is None:
        if name not in INFO:
            raise PrepareError(f"no official URL/MD5 known for {name!r}; known: {sorted(INFO)}")
        url = url or ZENODO.format(name=name)
        md5 = md5 or INFO[name][0]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / f"{name}.npz"
    if dest.is_file():
        verify_md5(dest, md5)
        say(f"{dest}: present, MD5 ok")
        return dest
    say(f"downloading {url}")
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=folder)
    try:
        h = hashlib.md5()
        with open(fd, "wb") as f, urllib.request.urlopen(url, timeout=timeout) as r:
            while True:
                block = r.read(1 << 20)
                if not block:
                    break
                h.update(block)
                f.write(block)
        if h.hexdigest() != md5:
            raise PrepareError(f"{url}: MD5 checksum mismatch after download: got {h.hexdigest()}, expected {md5}")
        shutil.move(tmp, dest)
    except OSError as e:
        raise PrepareError(f"{url}: download failed ({e}); download the file by hand into {folder}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    say(f"{dest}: downloaded, MD5 ok")
    return dest


def locate(src, name: str) -> Path:
    src = Path(src)
    if src.is_file():
        return src
    for cand in (src / f"{name}.npz", src / name / f"{name}.npz", src / "medmnist" / f"{name}.npz"):
        if cand.is_file():
            return cand
    raise PrepareError(f"{src}: {name}.npz not found (expected {src / f'{name}.npz'}; "
                       f"get it from {ZENODO.format(name=name)} or pass --download)")


def read(src, name: str, strict_md5: bool = False) -> Source:
    """Read a MedMNIST npz; cases carry ``meta['split']`` (train/val/test)."""
    name = name.lower()
    path = locate(src, name)
    try:
        data = np.load(path)
        keys = set(data.files)
    except Exception as e:  # noqa: BLE001 - zip/pickle errors are a bad file
        raise PrepareError(f"{path}: not a readable .npz file ({e})") from None
    need = {f"{s}_{k}" for s in SPLITS for k in ("images", "labels")}
    if not need <= keys:
        raise PrepareError(f"{path}: unexpected arrays {sorted(keys)}; expected {sorted(need)}")
    md5 = md5_of(path)
    official = INFO.get(name, (None, None))[0]
    entry = {"md5": md5, "sha256": file_digest(path), "bytes": path.stat().st_size,
             "official_md5": official, "md5_matches_official": md5 == official if official else None}
    if official and md5 != official:
        if strict_md5:
            verify_md5(path, official)
        warn(f"{path}: MD5 {md5} differs from the official {official} (re-packaged file?); recorded in provenance")
    cases = []
    n_classes = 0
    channels = 1
    for split in SPLITS:
        try:
            images = data[f"{split}_images"]
            labels = data[f"{split}_labels"]
        except Exception as e:  # noqa: BLE001
            raise PrepareError(f"{path}: cannot read {split} arrays ({e})") from None
        if images.ndim not in (3, 4) or len(images) != len(labels):
            raise PrepareError(f"{path}: {split}_images has shape {images.shape} and {split}_labels {labels.shape}; "
                               f"expected (N, H, W[, 3]) and (N, 1)")
        if labels.ndim == 2 and labels.shape[1] != 1:
            raise PrepareError(f"{path}: {split}_labels has shape {labels.shape}: a multi-label set; "
                               "only multi-class 2D MedMNIST sets are supported")
        labels = labels.reshape(-1).astype(int)
        if len(labels) and labels.min() < 0:
            raise PrepareError(f"{path}: negative class index in {split}_labels")
        n_classes = max(n_classes, int(labels.max()) + 1 if len(labels) else 0)
        channels = 3 if images.ndim == 4 and images.shape[-1] == 3 else 1
        for i in range(len(images)):
            cid = f"{split}_{i:06d}"
            cases.append(Case(cid, images[i], cid, int(labels[i]), meta={"split": split}))
    classes = INFO.get(name, (None, None))[1]
    if classes is None or len(classes) < n_classes:
        classes = [f"class_{k}" for k in range(n_classes)]
    return Source(name, "multiclass", list(classes), cases, channels, path.parent,
                  files={path.name: entry}, meta={"native_size": int(cases[0].image.shape[0]) if cases else None})
