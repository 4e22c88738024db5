"""Embedded default data: small deterministic scenarios generated from a seed.

Four families, each written as a scenario folder (profile.py):

* ``cxr`` -- multi-label chest-X-ray-like grayscale images, 6 co-occurring
  findings, 4 sites labeling the classes of FedPSL's Table I (with more
  sites, site k takes the label set, size and annotated fractions of Table I's
  site k mod 4, and its own acquisition shift), per-site
  acquisition shift (contrast, gamma, noise), imbalanced prevalence, unequal
  site sizes (``CXR_SITE_SCALE``) and partial annotation inside a site: a
  site annotates some of its classes on only part of its cases
  (``CXR_ANNOTATED_FRACTION``; the other cases hold -1 for that class), so
  a site's case count n_k and its per-class annotated counts n_k^c differ,
  and not in the same proportion at every site;
* ``medmnist`` -- 28 px RGB multi-class images, 8 classes, Dirichlet(gamma)
  label split over the sites, some sites unlabeled;
* ``lesion`` -- 2D lesion segmentation (some images lesion-free), per-site
  supervision pixel | bbox | image | none (repeated in that order for more than
  4 sites), boxes from masks plus a random
  1-10 px margin; ``lesion_classes=2`` is a two-class flavour (pigmented and
  vascular lesions, each present or not) whose image-level tags carry class
  presence, as RETOUCH's do;
* ``mixed`` -- one federation whose sites label differently at once: the
  ``medmnist`` images and Dirichlet(gamma) label split, viewed one-vs-rest as
  multi-label (one-hot labels), and per site a role (``mixed_site_classes``):
  site-1 annotates every class, the last site none (``supervision: none``,
  every label entry -1), and the sites between them share the classes out in
  contiguous blocks (4 sites: site-2 disc, ring, square, cross; site-3 pair,
  bar, triangle, ellipse), each class annotated by site-1 and exactly one of
  them. 3 to 10 sites; 3: site-2 annotates every class.

``default_scenario(family)`` generates into a cache folder on first use (under
a file lock, so simultaneous simulator clients generate it once).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import numpy as np
from PIL import Image

from ..profile import SiteProfile, scenario_writer, write_json_atomic, write_site, write_yaml
from .partition import (FEDPSL_CLASSES_6, FEDPSL_SITE_CLASSES_6, dirichlet_split, missing_class_sets,
                        mixed_class_sets, mixed_roles)

FAMILIES = ("cxr", "medmnist", "lesion", "mixed")
# Part of the cache key: bump when what a seed produces changes (images, labels, site sizes).
GENERATOR_VERSION = "v5"

# FedPSL Table I: the six findings and which of them each of the four sites annotates.
CXR_CLASSES, CXR_SITE_CLASSES = FEDPSL_CLASSES_6, FEDPSL_SITE_CLASSES_6
CXR_PREVALENCE = [0.22, 0.2, 0.18, 0.14, 0.1, 0.08]
# Site k holds round(CXR_SITE_SCALE[k] * cases) cases (at least 2): ``cases`` is
# the size of a reference site, and the scales average 1, so the four sites
# hold 4 * cases in all (cases=150: 150, 90, 240, 120).
CXR_SITE_SCALE = (1.0, 0.6, 1.6, 0.8)
# Per site, the fraction of its cases annotated for each class it annotates.
# In each split (training, validation) of m cases, class c is annotated on
# max(1, round(f * m)) cases drawn at random; the rest hold -1 for c. site-1
# annotates its classes on every case; each other site annotates one class
# fully and two in part, with fractions that differ from site to site.
CXR_ANNOTATED_FRACTION = [
    {"infiltration": 1.0, "effusion": 1.0, "atelectasis": 1.0},
    {"effusion": 0.5, "atelectasis": 1.0, "nodule": 0.75},
    {"atelectasis": 0.6, "nodule": 0.8, "consolidation": 1.0},
    {"nodule": 0.5, "consolidation": 1.0, "pneumothorax": 0.75},
]

MEDMNIST_CLASSES = ["disc", "ring", "square", "cross", "pair", "bar", "triangle", "ellipse"]
LESION_CLASSES = ["lesion"]
# The multi-class flavour (``lesion_classes=2``): a brown pigmented and a red vascular lesion, each
# present or not in an image on its own, so an image-level tag says which classes are present.
LESION_CLASSES_2 = ["pigmented", "vascular"]
VASCULAR_COLOUR = (0.70, 0.18, 0.22)


def mixed_site_classes(sites: int = 4, classes=MEDMNIST_CLASSES) -> list:
    """The classes each site of the ``mixed`` family annotates (``partition.mixed_class_sets`` over the
    classes in order): 4 sites -> all 8, disc..cross, pair..ellipse, none. 3 to len(classes) + 2 sites."""
    return [[classes[c] for c in s] for s in mixed_class_sets(len(classes), sites)]


def _grid(size):
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    return 2 * y / (size - 1) - 1, 2 * x / (size - 1) - 1


def _smooth_noise(rng, size, scale):
    """Low-frequency noise: a coarse random grid upsampled bilinearly."""
    coarse = rng.standard_normal((scale, scale)).astype(np.float32)
    im = Image.fromarray(coarse).resize((size, size), Image.BILINEAR)
    return np.asarray(im)


def _shift(rng):
    """One site's acquisition: contrast, gamma, offset, noise level."""
    return {
        "contrast": float(rng.uniform(0.75, 1.25)),
        "gamma": float(rng.uniform(0.75, 1.35)),
        "offset": float(rng.uniform(-0.06, 0.06)),
        "noise": float(rng.uniform(0.02, 0.06)),
    }


def _acquire(img, shift, rng):
    img = np.clip(img, 0, 1) ** shift["gamma"]
    img = (img - 0.5) * shift["contrast"] + 0.5 + shift["offset"]
    img = img + rng.normal(0, shift["noise"], img.shape)
    return np.clip(img, 0, 1)


# ------------------------------------------------------------------ cxr


def cxr_image(rng, labels, size, shift):
    """A chest-like radiograph with the findings flagged in ``labels``."""
    y, x = _grid(size)
    sx, sy = rng.uniform(0.9, 1.08), rng.uniform(0.9, 1.08)
    dx, dy = rng.uniform(-0.05, 0.05, 2)
    y, x = (y - dy) / sy, (x - dx) / sx
    body = ((x / 0.92) ** 2 + (y / 1.05) ** 2 < 1).astype(np.float32)
    img = 0.15 + 0.45 * body
    lungs = []
    for side in (-1, 1):
        lung = ((x - side * 0.4) / 0.3) ** 2 + ((y + 0.05) / 0.6) ** 2 < 1
        lungs.append(lung)
        img = np.where(lung, 0.22, img)
    img = img + 0.03 * np.sin(y * 22) * (lungs[0] | lungs[1])  # ribs
    heart = ((x - 0.1) / 0.24) ** 2 + ((y - 0.3) / 0.2) ** 2 < 1
    img = np.where(heart, 0.58, img)
    img = img + 0.03 * _smooth_noise(rng, size, 8)
    side = rng.integers(2)
    lung = lungs[side]
    cx = (side * 2 - 1) * 0.4
    if labels[0]:  # infiltration: hazy patchy opacity over one lung
        haze = np.clip(_smooth_noise(rng, size, 6), 0, None)
        img = img + rng.uniform(0.2, 0.3) * haze * lung
    if labels[1]:  # effusion: fluid level at the lung base
        level = rng.uniform(0.25, 0.4)
        fluid = lung & (y > level + 0.08 * np.abs(x - cx))
        img = np.where(fluid, img + rng.uniform(0.2, 0.3), img)
    if labels[2]:  # atelectasis: a thin dense band across the lung
        ang = rng.uniform(-0.6, 0.6)
        off = rng.uniform(-0.3, 0.2)
        dist = np.abs((y - off) * np.cos(ang) - (x - cx) * np.sin(ang))
        img = img + rng.uniform(0.2, 0.3) * np.exp(-(dist / 0.05) ** 2) * lung
    if labels[3]:  # nodule: one or two small round opacities
        for _ in range(rng.integers(1, 3)):
            ny, nx = rng.uniform(-0.45, 0.35), cx + rng.uniform(-0.15, 0.15)
            r = rng.uniform(0.07, 0.1)
            img = img + rng.uniform(0.2, 0.3) * np.exp(-(((x - nx) ** 2 + (y - ny) ** 2) / r**2) ** 2)
    if labels[4]:  # consolidation: a large dense irregular region
        cy_, cx_ = rng.uniform(-0.3, 0.3), cx + rng.uniform(-0.1, 0.1)
        blob = np.exp(-((x - cx_) ** 2 + (y - cy_) ** 2) / 0.03) + 0.4 * _smooth_noise(rng, size, 10)
        img = img + rng.uniform(0.18, 0.28) * (blob > 0.5) * lung
    if labels[5]:  # pneumothorax: dark lucent rim, no markings, at the lateral apex
        rim = lung & ((x - cx) * (side * 2 - 1) > 0.12) & (y < 0.15)
        img = np.where(rim, 0.06, img)
    return _acquire(img, shift, rng)


def cxr_site_cases(cases: int, sites: int = 4) -> list:
    """Cases per site for a reference site size ``cases`` (``CXR_SITE_SCALE``, cycled)."""
    return [max(2, int(CXR_SITE_SCALE[k % len(CXR_SITE_SCALE)] * cases + 0.5)) for k in range(sites)]


def _annotate_part(items, fractions, rng):
    """Set -1 for class c on all but max(1, round(f_c * m)) of the m ``items`` (in place)."""
    m = len(items)
    for c, name in enumerate(CXR_CLASSES):
        f = fractions.get(name)
        if f is None or f >= 1 or m == 0:
            continue
        keep = min(m, max(1, int(f * m + 0.5)))
        for i in rng.permutation(m)[keep:]:
            items[i]["label"][c] = -1


def _cxr_labels(rng, n):
    # Prevalence plus a shared latent "severity" so findings co-occur.
    severity = rng.normal(0, 1, (n, 1))
    logits = np.log(np.array(CXR_PREVALENCE) / (1 - np.array(CXR_PREVALENCE))) + 0.6 * severity
    return (rng.random((n, len(CXR_CLASSES))) < 1 / (1 + np.exp(-logits))).astype(int)


# ------------------------------------------------------------- medmnist


def medmnist_image(rng, label, size, shift):
    y, x = _grid(size)
    cy, cx = rng.uniform(-0.2, 0.2, 2)
    s = rng.uniform(0.75, 1.1)
    ang = rng.uniform(0, np.pi)
    yr = ((y - cy) * np.cos(ang) - (x - cx) * np.sin(ang)) / s
    xr = ((y - cy) * np.sin(ang) + (x - cx) * np.cos(ang)) / s
    r = np.sqrt(xr**2 + yr**2)
    shape = {
        0: r < 0.45,
        1: (r < 0.55) & (r > 0.32),
        2: (np.abs(xr) < 0.4) & (np.abs(yr) < 0.4),
        3: ((np.abs(xr) < 0.13) | (np.abs(yr) < 0.13)) & (r < 0.6),
        4: (np.hypot(xr - 0.3, yr) < 0.25) | (np.hypot(xr + 0.3, yr) < 0.25),
        5: (np.abs(xr) < 0.6) & (np.abs(yr) < 0.15),
        6: (yr > -0.4) & (yr < 0.45) & (np.abs(xr) < (yr + 0.4) * 0.6),
        7: (xr / 0.6) ** 2 + (yr / 0.3) ** 2 < 1,
    }[int(label)].astype(np.float32)
    tint = np.array([0.85, 0.45, 0.6]) + rng.normal(0, 0.08, 3)
    bg = np.array([0.92, 0.85, 0.88]) + rng.normal(0, 0.04, 3)
    texture = 0.08 * _smooth_noise(rng, size, 5)
    img = shape[..., None] * tint + (1 - shape[..., None]) * bg + texture[..., None]
    return _acquire(img, shift, rng)


# --------------------------------------------------------------- lesion


def _blob(rng, size, x, y, img, colour, scale=1.0):
    """One irregular lesion painted on ``img``; returns the image and the lesion's mask."""
    field = np.zeros((size, size), np.float32)
    cy, cx = rng.uniform(-0.35, 0.35, 2)
    for _ in range(rng.integers(2, 5)):
        by, bx = cy + rng.normal(0, 0.12 * scale), cx + rng.normal(0, 0.12 * scale)
        sig = rng.uniform(0.12, 0.25) * scale
        field += np.exp(-((x - bx) ** 2 + (y - by) ** 2) / (2 * sig**2))
    field += 0.15 * _smooth_noise(rng, size, 8)
    mask = field > 0.6
    col = np.array(colour) + rng.normal(0, 0.04, 3)
    inner = np.clip((field - 0.6) * 2, 0, 1)[..., None]
    img = np.where(mask[..., None], col * (1 - 0.4 * inner) + 0.04 * _smooth_noise(rng, size, 12)[..., None], img)
    return img, mask


def lesion_image(rng, size, shift, lesion: bool, vascular: bool | None = None):
    """Skin-like RGB image and its lesion mask (all zeros when lesion-free).

    With ``vascular`` (the two-class flavour) the mask is a label map: 1 where the
    pigmented lesion (present when ``lesion``) is, 2 where a smaller red vascular
    one (present when ``vascular``) is painted over it."""
    y, x = _grid(size)
    skin = np.array([0.86, 0.66, 0.56]) + rng.normal(0, 0.03, 3)
    img = np.broadcast_to(skin, (size, size, 3)).copy() + 0.05 * _smooth_noise(rng, size, 6)[..., None]
    mask = np.zeros((size, size), bool)
    if lesion:
        img, mask = _blob(rng, size, x, y, img, (0.42, 0.25, 0.18))
    if vascular is not None:
        mask = mask.astype(np.uint8)
        if vascular:
            img, second = _blob(rng, size, x, y, img, VASCULAR_COLOUR, scale=0.6)
            mask[second] = 2
    # Hairs and small dark specks as distractors.
    for _ in range(rng.integers(0, 3)):
        ang, off = rng.uniform(0, np.pi), rng.uniform(-0.8, 0.8)
        d = np.abs(y * np.cos(ang) - x * np.sin(ang) - off)
        img = np.where((d < 0.015)[..., None], img * 0.5, img)
    return _acquire(img, shift, rng), mask


def box_from_mask(mask, rng, cls=0):
    """Tightest box around the mask plus an independent 1-10 px margin per side,
    clamped to the image; [x0, y0, x1, y1, class] with exclusive x1, y1."""
    ys, xs = np.nonzero(mask)
    h, w = mask.shape
    m = rng.integers(1, 11, 4)
    return [int(max(0, xs.min() - m[0])), int(max(0, ys.min() - m[1])),
            int(min(w, xs.max() + 1 + m[2])), int(min(h, ys.max() + 1 + m[3])), int(cls)]


# ------------------------------------------------------------- writing


def _save_png(path, arr):
    arr = np.asarray(arr)
    if arr.dtype != np.uint8:
        arr = (np.clip(arr, 0, 1) * 255).round().astype(np.uint8)
    Image.fromarray(arr).save(path)


def _split(items, val_fraction, rng):
    idx = rng.permutation(len(items))
    n_val = max(1, int(round(len(items) * val_fraction)))
    return [items[i] for i in sorted(idx[n_val:])], [items[i] for i in sorted(idx[:n_val])]


def generate(family: str, out, seed: int = 0, size: int | None = None, cases: int | None = None,
             test_cases: int | None = None, sites: int = 4, gamma: float = 0.8, labeled=None, supervision=None,
             val_fraction: float = 0.15, progress=None, lesion_classes: int = 1, missing: int | None = None) -> Path:
    """Write one synthetic scenario folder atomically; returns its path.

    ``cases`` is per site (lesion), the size of a reference site (cxr: site k
    holds ``round(CXR_SITE_SCALE[k] * cases)``, see ``cxr_site_cases``) or in
    total (medmnist). ``lesion_classes=2``: the lesion family's two-class flavour
    (``LESION_CLASSES_2``; masks hold class index + 1, boxes and image-level tags
    are per class). ``missing=k`` (cxr): FedMLP's setting instead of FedPSL Table I's label sets: each
    site annotates 6 - k of the findings on every case, every finding somewhere
    (``partition.missing_class_sets``, drawn from its own stream: the images of a seed are the same
    whatever k). ``mixed``: ``cases`` in total (default 1200, test 400), ``gamma`` the Dirichlet label
    skew as for medmnist; the roles are fixed (``mixed_site_classes``), so ``labeled`` is refused.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown synthetic family {family!r}; choose one of {FAMILIES}")
    if missing is not None and family != "cxr":
        raise ValueError(f"missing (classes each site drops) applies to the cxr family, not {family!r}")
    rng = np.random.default_rng(seed)
    # Box margins draw from their own stream: the images and masks of a seed are the same whatever
    # each site's supervision, so two supervision settings differ in the labels only.
    box_rng = np.random.default_rng([seed, 1])
    say = progress or (lambda msg: None)
    names = [f"site-{i + 1}" for i in range(sites)]
    shifts = [_shift(rng) for _ in names]
    extra = {}
    with scenario_writer(out) as tmp:
        if family == "cxr":
            size, cases, test_cases = size or 64, cases or 300, test_cases or 400
            if sites < 1:
                raise ValueError(f"sites must be >= 1, not {sites}")
            task, classes = "multilabel", CXR_CLASSES
            site_cases = cxr_site_cases(cases, sites)
            if missing is None:  # site k copies Table I's site k mod 4: its classes and annotated fractions
                table = [k % len(CXR_SITE_CLASSES) for k in range(sites)]
                site_classes = [CXR_SITE_CLASSES[t] for t in table]
                fractions = [CXR_ANNOTATED_FRACTION[t] for t in table]
            else:
                sets = missing_class_sets(len(CXR_CLASSES), sites, missing, np.random.default_rng([seed, 2]))
                site_classes = [[CXR_CLASSES[c] for c in s] for s in sets]
                fractions = [dict.fromkeys(s, 1.0) for s in site_classes]
                extra["missing"] = missing
            extra.update({"site_cases": dict(zip(names, site_cases)),
                          "annotated_fraction": dict(zip(names, fractions))})
            for k, name in enumerate(names):
                n_k = site_cases[k]
                labels = _cxr_labels(rng, n_k)
                keep = np.array([c in site_classes[k] for c in CXR_CLASSES])
                items, oracle = [], []
                for i in range(n_k):
                    rel = f"images/{i:05d}.png"
                    _save_png(_mk(tmp / name / "images") / f"{i:05d}.png", cxr_image(rng, labels[i], size, shifts[k]))
                    items.append({"image": rel, "label": np.where(keep, labels[i], -1).tolist()})
                    oracle.append({"image": rel, "label": labels[i].tolist()})
                train, val = _split(items, val_fraction, rng)
                for part in (train, val):
                    _annotate_part(part, fractions[k], rng)
                profile = SiteProfile(name, task, tuple(classes), tuple(site_classes[k]), "image")
                write_site(tmp / name, profile, train, val, {"training": _match(oracle, train), "validation": _match(oracle, val)})
                say(f"{name}: {n_k} images")
            labels = _cxr_labels(rng, test_cases)
            test = []
            for i in range(test_cases):
                _save_png(_mk(tmp / "test" / "images") / f"{i:05d}.png", cxr_image(rng, labels[i], size, shifts[i % sites]))
                test.append({"image": f"images/{i:05d}.png", "label": labels[i].tolist(), "group": f"site-{i % sites + 1}"})
        elif family == "medmnist":
            size, cases, test_cases = size or 28, cases or 2400, test_cases or 800
            task, classes = "multiclass", MEDMNIST_CLASSES
            labeled = [0] if labeled is None else list(labeled)
            y = rng.integers(0, len(classes), cases)
            # Dirichlet label skew: each class's cases spread over sites by Dir(gamma).
            owner = np.empty(cases, int)
            for c in range(len(classes)):
                idx = np.flatnonzero(y == c)
                props = rng.dirichlet([gamma] * sites)
                cuts = (np.cumsum(props)[:-1] * len(idx)).astype(int)
                for k, part in enumerate(np.split(rng.permutation(idx), cuts)):
                    owner[part] = k
            for k, name in enumerate(names):
                idx = np.flatnonzero(owner == k)
                is_lab = k in labeled
                items, oracle = [], []
                for j, i in enumerate(idx):
                    rel = f"images/{j:05d}.png"
                    _save_png(_mk(tmp / name / "images") / f"{j:05d}.png", medmnist_image(rng, y[i], size, shifts[k]))
                    items.append({"image": rel, "label": int(y[i]) if is_lab else -1})
                    oracle.append({"image": rel, "label": int(y[i])})
                train, val = _split(items, val_fraction, rng)
                profile = SiteProfile(name, task, tuple(classes), tuple(classes) if is_lab else (), "image" if is_lab else "none")
                write_site(tmp / name, profile, train, val, {"training": _match(oracle, train), "validation": _match(oracle, val)})
                say(f"{name}: {len(idx)} images ({'labeled' if is_lab else 'unlabeled'})")
            test = []
            for i in range(test_cases):
                c = i % len(classes)
                _save_png(_mk(tmp / "test" / "images") / f"{i:05d}.png", medmnist_image(rng, c, size, shifts[i % sites]))
                test.append({"image": f"images/{i:05d}.png", "label": c, "group": f"site-{i % sites + 1}"})
        elif family == "mixed":
            size, cases, test_cases = size or 28, cases or 1200, test_cases or 400
            if labeled is not None:
                raise ValueError("labeled applies to the medmnist family; the mixed family's roles are fixed: site-1 "
                                 "annotates every class, the last site none, the others a share each")
            task, classes = "multilabel", MEDMNIST_CLASSES
            site_classes = mixed_site_classes(sites, classes)
            roles = mixed_roles(mixed_class_sets(len(classes), sites), len(classes))
            extra.update({"site_classes": dict(zip(names, site_classes)), "site_roles": dict(zip(names, roles)),
                          "gamma": gamma})
            y = rng.integers(0, len(classes), cases)
            # Dirichlet label skew, redrawn until every site holds a training and a validation case
            owner = np.empty(cases, int)
            for k, part in enumerate(dirichlet_split(y, sites, gamma, rng, min_size=2)):
                owner[part] = k
            for k, name in enumerate(names):
                idx = np.flatnonzero(owner == k)
                keep = np.array([c in site_classes[k] for c in classes])
                items, oracle = [], []
                for j, i in enumerate(idx):
                    rel = f"images/{j:05d}.png"
                    _save_png(_mk(tmp / name / "images") / f"{j:05d}.png", medmnist_image(rng, y[i], size, shifts[k]))
                    full = np.eye(len(classes), dtype=int)[y[i]]
                    items.append({"image": rel, "label": np.where(keep, full, -1).tolist()})
                    oracle.append({"image": rel, "label": full.tolist()})
                train, val = _split(items, val_fraction, rng)
                profile = SiteProfile(name, task, tuple(classes), tuple(site_classes[k]),
                                      "none" if roles[k] == "none" else "image")
                write_site(tmp / name, profile, train, val, {"training": _match(oracle, train), "validation": _match(oracle, val)})
                say(f"{name}: {len(idx)} images ({roles[k]}: {', '.join(site_classes[k]) or 'no class'})")
            test = []
            for i in range(test_cases):
                c = i % len(classes)
                _save_png(_mk(tmp / "test" / "images") / f"{i:05d}.png", medmnist_image(rng, c, size, shifts[i % sites]))
                test.append({"image": f"images/{i:05d}.png", "label": np.eye(len(classes), dtype=int)[c].tolist(),
                             "group": f"site-{i % sites + 1}"})
        else:
            size, cases, test_cases = size or 64, cases or 120, test_cases or 120
            if lesion_classes not in (1, 2):
                raise ValueError(f"lesion_classes must be 1 or 2, not {lesion_classes}")
            task, classes = "segmentation", LESION_CLASSES if lesion_classes == 1 else LESION_CLASSES_2

            def draw(shift):
                if lesion_classes == 1:
                    img, mask = lesion_image(rng, size, shift, lesion=rng.random() > 0.2)
                    return img, mask, mask.astype(np.uint8) * 255, [0] if mask.any() else []
                img, labels = lesion_image(rng, size, shift, lesion=rng.random() > 0.4, vascular=rng.random() > 0.5)
                return img, labels, labels, [c for c in range(2) if (labels == c + 1).any()]

            levels = list(supervision or [["pixel", "bbox", "image", "none"][k % 4] for k in range(sites)])
            if len(levels) != sites:
                raise ValueError(f"supervision lists {len(levels)} levels for {sites} sites")
            for k, name in enumerate(names):
                items, oracle = [], []
                for i in range(cases):
                    img, mask, stored, present = draw(shifts[k])
                    rel, seg = f"images/{i:05d}.png", f"masks/{i:05d}.png"
                    _save_png(_mk(tmp / name / "images") / f"{i:05d}.png", img)
                    _save_png(_mk(tmp / name / "masks") / f"{i:05d}.png", stored)
                    item = {"image": rel, "supervision": levels[k]}
                    if levels[k] == "pixel":
                        item["seg"] = seg
                    elif levels[k] == "bbox":
                        item["boxes"] = [box_from_mask(mask == c + 1 if lesion_classes > 1 else mask, box_rng, c)
                                         for c in present]
                    elif levels[k] == "image":
                        item["classes"] = present
                    items.append(item)
                    oracle.append({"image": rel, "seg": seg})
                train, val = _split(items, val_fraction, rng)
                profile = SiteProfile(name, task, tuple(classes), tuple(classes) if levels[k] != "none" else (), levels[k])
                write_site(tmp / name, profile, train, val, {"training": _match(oracle, train), "validation": _match(oracle, val)})
                say(f"{name}: {cases} images ({levels[k]})")
            test = []
            for i in range(test_cases):
                img, _, stored, _ = draw(shifts[i % sites])
                _save_png(_mk(tmp / "test" / "images") / f"{i:05d}.png", img)
                _save_png(_mk(tmp / "test" / "masks") / f"{i:05d}.png", stored)
                test.append({"image": f"images/{i:05d}.png", "seg": f"masks/{i:05d}.png", "group": f"site-{i % sites + 1}"})
        write_json_atomic(tmp / "test" / "datalist.json", {"testing": test})
        write_yaml(tmp / "scenario.yaml", {
            "name": f"synthetic-{family}",
            "task": task,
            "classes": list(classes),
            "sites": names,
            "seed": seed,
            "image_size": [size, size],
            "channels": 1 if family == "cxr" else 3,
            "provenance": {"generator": "fedlabels.data.synthetic", "version": GENERATOR_VERSION, "family": family,
                           "seed": seed, "site_shift": dict(zip(names, shifts)), **extra},
        })
    return Path(out)


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _match(oracle, items):
    by_image = {o["image"]: o for o in oracle}
    return [by_image[i["image"]] for i in items]


def cache_dir() -> Path:
    return Path(os.environ.get("FEDLABELS_CACHE", Path.home() / ".cache" / "fedlabels"))


def default_scenario(family: str, seed: int = 0, size: int | None = None, **kwargs) -> Path:
    """The embedded default scenario, generated once and cached."""
    tag = "-".join([family, GENERATOR_VERSION, f"seed{seed}"] + ([f"{size}px"] if size else []) + [f"{k}{v}" for k, v in sorted(kwargs.items())])
    root = cache_dir() / tag
    if (root / "scenario.yaml").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "scenario.yaml").is_file():
            generate(family, root, seed=seed, size=size, **kwargs)
    return root
