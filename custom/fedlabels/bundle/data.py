"""Scenario folders as MONAI datalists, for the bundles in ``bundles/``.

The bundle configs call these functions, so a bundle trained with
``python -m monai.bundle run`` reads exactly what the federated clients read
(``fedlabels.profile``): the same validation, the same error messages.

* ``datalist(dataset_dir, site, split, oracle)`` -- ``[{"image", "label"}]``
  with absolute paths, for one site, several, or all sites pooled
  (centralised training); ``split="test"`` is the held-out test set.
* ``image_files(path)`` -- the inputs of ``inference.json``: images by suffix, DICOM
  files by content (``bundle.dicom.is_dicom``: a series' files often have no suffix).
* ``ReadableImages`` -- the inference dataset: an input that cannot be read
  or converted is named in one log line and left out; the rest go on.
* ``MaskLabeld`` -- a segmentation label (mask file, box, image-level tag or none)
  as one binary channel per class;
* ``MaskFromProbabilitiesd`` -- per-class probabilities to one mask (a label map
  for several classes), each class at its own decision threshold;
* ``SaveMaskd`` -- writes a predicted mask next to its kind of input: PNG for
  PNG/JPEG, NIfTI with the source geometry for NIfTI and DICOM (or, with
  ``configs/inference_dicom.json``, nothing for DICOM: ``bundle.dicom.DicomSegWriter``
  writes a DICOM SEG).
* ``Ensure2DChannelsd`` -- makes any 2D input (grey, RGB, RGBA, a 2D NIfTI
  stored as H x W x 1) the channel count a network expects.
* ``RandDihedrald`` -- cheap random flip / rotate-by-90 for training.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path

import numpy as np
import torch
from monai.config import KeysCollection
from monai.data import Dataset
from monai.transforms import MapTransform, RandomizableTransform, SaveImage

from ..profile import IMAGE_SUFFIXES, ScenarioError, load_scenario

TEST_SPLITS = ("test", "testing")
# A segmentation case's supervision, as the integer ``level`` its training item carries (profile.SUPERVISION).
SEG_LEVELS = ("pixel", "bbox", "image", "none")
INFERENCE_SUFFIXES = (".png", ".jpg", ".jpeg", ".nii", ".nii.gz", ".dcm")

logger = logging.getLogger("fedlabels.bundle")


def _sites(site) -> list | None:
    """None / "" / "all" -> every site; "a,b" or ["a", "b"] -> those sites."""
    if site is None or (isinstance(site, str) and site.strip().lower() in ("", "all", "none", "null")):
        return None
    if isinstance(site, str):
        return [s.strip() for s in site.split(",") if s.strip()]
    return [str(s) for s in site]


def bundle_item(item: dict, task: str, labeled_only: bool) -> dict | None:
    """A validated scenario item -> the ``{"image", "label"}`` the bundle transforms read."""
    if task == "multilabel":
        if labeled_only and all(v < 0 for v in item["label"]):
            return None
        return {"image": item["image"], "label": [int(v) for v in item["label"]]}
    if task == "multiclass":
        if labeled_only and item["label"] < 0:
            return None
        return {"image": item["image"], "label": int(item["label"])}
    # segmentation: only pixel-level cases carry a mask the bundle can learn from; with every case
    # (a mixed-supervision method), the others carry their weak label, which ``MaskLabeld`` renders
    if labeled_only:
        return {"image": item["image"], "label": item["seg"]} if "seg" in item else None
    level = item.get("supervision", "pixel" if "seg" in item else "none")
    if level == "pixel":
        label = item["seg"]
    else:
        label = {"level": level, **{k: item[k] for k in ("boxes", "classes") if k in item}}
    return {"image": item["image"], "label": label, "level": SEG_LEVELS.index(level)}


def datalist(dataset_dir, site=None, split: str = "training", oracle: bool = False, classes=None, task=None,
             labeled_only: bool = True) -> list:
    """Validated bundle items of one split of a scenario folder, with absolute paths.

    Args:
        dataset_dir: scenario folder (``scenario.yaml``, one folder per site, ``test/``).
        site: a site name, a comma-separated list or a list of names; ``None``/``""``
            pools every site (centralised training).
        split: ``training`` | ``validation`` | ``test``.
        oracle: read the sites' ``oracle.json`` (full labels) instead of ``datalist.json``.
        classes, task: what the bundle was built for; a scenario with another class
            list or task fails here with one message instead of a shape error later.
        labeled_only: drop cases the supervised bundle cannot learn from (multi-class
            label -1, multi-label rows of only -1, segmentation cases without a mask).

    Multi-label labels keep their -1 entries (not annotated at the site); the
    bundle's loss and metrics skip them.
    """
    root = Path(str(dataset_dir)).expanduser()
    if split in TEST_SPLITS:
        scenario = load_scenario(root, sites=[], with_test=True)
    else:
        scenario = load_scenario(root, sites=_sites(site), with_test=False)
    where = root / "scenario.yaml"
    if task is not None and scenario.task != task:
        raise ScenarioError(where, f"task {scenario.task!r}, but this bundle is built for {task!r}", field="task")
    if classes is not None and tuple(scenario.classes) != tuple(classes):
        raise ScenarioError(where, f"classes {list(scenario.classes)} differ from the bundle's {list(classes)}; "
                            "override the bundle's class_names to match", field="classes")
    if split in TEST_SPLITS:
        if scenario.test is None:
            raise ScenarioError(root / "test" / "datalist.json", "missing file: this scenario has no test set")
        sources = {"test": scenario.test}
    elif split in ("training", "validation"):
        sources = {}
        for name, sdata in scenario.sites.items():
            sources[name] = sdata.oracle()[split] if oracle else getattr(sdata, split)
    else:
        raise ValueError(f"unknown split {split!r}; expected training, validation or test")
    items = []
    for items_of_site in sources.values():
        for item in items_of_site:
            out = bundle_item(item, scenario.task, labeled_only)
            if out is not None:
                items.append(out)
    if not items:
        what = {"multilabel": "annotated", "multiclass": "labeled", "segmentation": "pixel-labeled (mask)"}[scenario.task]
        names = ", ".join(sources)
        raise ScenarioError(root, f"no {what} cases in split {split!r} of {names}"
                            + ("" if oracle or split in TEST_SPLITS else "; a supervised bundle needs labels "
                               "(use another site, pool all sites, or oracle=True for the oracle baseline)"))
    return items


def scenario_info(dataset_dir) -> dict:
    """Task, classes, image size and channels of a scenario (without checking files)."""
    scenario = load_scenario(dataset_dir, sites=[], with_test=False, check_files=False)
    meta = scenario.meta
    size = meta.get("image_size")
    return {
        "task": scenario.task,
        "classes": list(scenario.classes),
        "sites": list(meta.get("sites", [])),
        "image_size": int(size[0]) if isinstance(size, list) else size,
        "channels": meta.get("channels"),
    }


def default_dataset(family: str, **kwargs) -> str:
    """The embedded synthetic scenario (generated and cached on first use)."""
    from ..data.synthetic import default_scenario

    return str(default_scenario(family, **kwargs))


def image_files(inputs) -> list:
    """Inference inputs: a folder (searched recursively), one file, or a list of files.

    Returns ``[{"image": path}]`` sorted by path; fails with one message when
    nothing readable is found.
    """
    from .dicom import is_dicom

    if isinstance(inputs, (str, os.PathLike)):
        path = Path(inputs).expanduser()
        if path.is_dir():
            # DICOM by content too: files of a series are often named without a suffix (IM0001, 1.2.840...)
            found = [p for p in glob.glob(str(path / "**" / "*"), recursive=True)
                     if p.lower().endswith(INFERENCE_SUFFIXES) or (os.path.isfile(p) and is_dicom(p))]
        elif path.is_file():
            found = [str(path)]
        else:
            raise FileNotFoundError(f"{path}: no such file or folder of input images (pass --dataset_dir <folder>)")
    else:
        found = [str(Path(p).expanduser()) for p in inputs]
        missing = [p for p in found if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"input images not found: {missing[:5]}")
    if not found:
        raise FileNotFoundError(f"{inputs}: no image files ({', '.join(INFERENCE_SUFFIXES)}) and no DICOM files")
    return [{"image": str(Path(p).resolve())} for p in sorted(found)]


class ReadableImages(Dataset):
    """The inputs that ``transform`` can read and convert, transformed once.

    Each input is preprocessed when the dataset is built (the preprocessed
    images are small: the network's input size); one that fails (an
    unreadable file, a 3D volume, channels the network cannot take) is
    reported as ``cannot read <file>: <reason>`` and left out, so one bad
    file in a folder does not stop the others. No readable input at all is
    an error.
    """

    def __init__(self, data, transform):
        ready, refused = [], []
        for item in data:
            try:
                ready.append(transform(item))
            except Exception as e:  # MONAI wraps the reader's error: report its root cause
                cause = e
                while cause.__cause__ is not None:
                    cause = cause.__cause__
                reason = " ".join(str(cause).split())[:300] or type(cause).__name__
                logger.warning(f"cannot read {item['image']}: {reason}")
                refused.append(item["image"])
        if not ready:
            raise ValueError(f"none of the {len(refused)} input images could be read (first: {refused[:1]})")
        if refused:
            logger.warning(f"{len(refused)} of {len(data)} input images left out")
        self.refused = refused
        super().__init__(ready, transform=None)


class MaskLabeld(MapTransform):
    """A segmentation label as ``num_classes`` binary channels on the image's grid (x, y as MONAI reads images).

    The label is a mask file (binary: any value > 0 is the class; several
    classes: value c + 1 is class c) or a weak label, which becomes its prior
    mask: ``{"level": "bbox", "boxes": [[x0, y0, x1, y1, class], ...]}`` -> 1
    inside the class's boxes (exclusive x1, y1, in pixels of the image file);
    ``{"level": "image", "classes": [...]}`` -> the whole image for each class
    present, nothing for the others; ``{"level": "none"}`` -> the whole image.
    Runs after the image is channel-first (``image_key``), whose grid a mask
    file must match.
    """

    def __init__(self, keys: KeysCollection, num_classes: int, image_key: str = "image",
                 allow_missing_keys: bool = False):
        super().__init__(keys, allow_missing_keys)
        self.num_classes, self.image_key = int(num_classes), image_key
        self.reader = None

    def __call__(self, data):
        d = dict(data)
        size = tuple(d[self.image_key].shape[1:])
        for key in self.key_iterator(d):
            d[key] = self.render(d[key], size) if isinstance(d[key], dict) else self.load(d[key], size)
        return d

    def load(self, path, size) -> torch.Tensor:
        from monai.transforms import LoadImage

        self.reader = self.reader or LoadImage(image_only=True)
        m = torch.as_tensor(np.asarray(self.reader(path)))
        while m.ndim > 2 and m.shape[-1] in (1, 3, 4):  # a 2D mask stored with trailing channels
            m = m[..., 0]
        if tuple(m.shape) != size:
            raise ValueError(f"{path}: mask of {tuple(m.shape)} pixels, its image {size} (x, y)")
        if self.num_classes == 1:
            return (m > 0).float()[None]
        if m.max() > self.num_classes:
            raise ValueError(f"{path}: mask values up to {int(m.max())}; a mask of {self.num_classes} classes holds "
                             "class index + 1 (0 = background)")
        return torch.stack([m == c + 1 for c in range(self.num_classes)]).float()

    def render(self, weak: dict, size) -> torch.Tensor:
        level = weak.get("level")
        out = torch.zeros((self.num_classes, *size))
        if level == "bbox":
            for x0, y0, x1, y1, k in weak.get("boxes", []):
                out[k, x0:x1, y0:y1] = 1
        elif level == "image":
            for k in weak.get("classes", []):
                out[k] = 1
        elif level == "none":
            out[:] = 1
        else:
            raise ValueError(f"weak label of unknown level {level!r}: {weak}")
        return out


class MaskFromProbabilitiesd(MapTransform):
    """Per-class probabilities (C channels) -> one mask channel: with one class, 1 where its
    probability reaches its threshold; with several, the label map (class index + 1, the mask
    convention ``MaskLabeld`` reads) of the most probable class among those at or above their
    thresholds, 0 where none is."""

    def __init__(self, keys: KeysCollection, thresholds, allow_missing_keys: bool = False):
        super().__init__(keys, allow_missing_keys)
        self.thresholds = [float(v) for v in thresholds]

    def __call__(self, data):
        d = dict(data)
        for key in self.key_iterator(d):
            p = d[key]
            if p.shape[0] != len(self.thresholds):
                raise ValueError(f"{key}: {p.shape[0]} channels for {len(self.thresholds)} class thresholds")
            t = torch.as_tensor(self.thresholds, dtype=p.dtype, device=p.device).view(-1, *([1] * (p.ndim - 1)))
            positive = p >= t
            if p.shape[0] == 1:
                d[key] = positive.to(p.dtype)
                continue
            best = torch.where(positive, p, torch.full_like(p, -1.0)).argmax(0, keepdim=True)
            d[key] = torch.where(positive.any(0, keepdim=True), best + 1, torch.zeros_like(best)).to(p.dtype)
        return d


class SaveMaskd(MapTransform):
    """Save a mask (channel-first, already inverted to the input's grid) as ``<stem>_<postfix><ext>``.

    ``output_ext="auto"`` follows the input: a NIfTI or DICOM input (by suffix or
    content) gets a NIfTI mask carrying the input's affine (its voxel size and
    orientation); a PNG/JPEG input gets a PNG. A fixed extension writes every mask so.
    ``dicom="seg"`` saves nothing for a DICOM input: its mask goes into a DICOM SEG
    (``bundle.dicom.DicomSegWriter``, ``configs/inference_dicom.json``).
    """

    def __init__(self, keys: KeysCollection, output_dir, output_postfix: str = "seg", output_ext: str = "auto",
                 scale: int = 255, dicom: str = "file", allow_missing_keys: bool = False):
        super().__init__(keys, allow_missing_keys)
        if dicom not in ("file", "seg"):
            raise ValueError(f"dicom must be 'file' (a mask file per DICOM input) or 'seg' (DICOM SEG), not {dicom!r}")
        self.output_ext, self.dicom = output_ext, dicom
        common = dict(output_dir=output_dir, output_postfix=output_postfix, output_dtype=np.uint8, resample=False,
                      separate_folder=False, print_log=False)
        self.savers = {
            ext: SaveImage(output_ext=ext, scale=None if ext.startswith(".nii") else scale,
                           squeeze_end_dims=not ext.startswith(".nii"), **common)
            for ext in {".png", ".nii.gz", output_ext} - {"auto"}}

    @staticmethod
    def is_dicom(source: str) -> bool:
        from .dicom import is_dicom

        return str(source).lower().endswith(".dcm") or is_dicom(source)

    def ext_for(self, source: str) -> str:
        if self.output_ext != "auto":
            return self.output_ext
        return ".nii.gz" if str(source).lower().endswith((".nii", ".nii.gz")) or self.is_dicom(source) else ".png"

    def __call__(self, data):
        from .dicom import is_dicom

        d = dict(data)
        for key in self.key_iterator(d):
            source = (getattr(d[key], "meta", None) or {}).get("filename_or_obj", "")
            if self.dicom == "seg" and is_dicom(source):  # the same test DicomSegWriter applies
                continue
            self.savers[self.ext_for(source)](d[key])
        return d


class Ensure2DChannelsd(MapTransform):
    """Make a channel-first 2D image have ``channels`` channels.

    Trailing singleton spatial dimensions (a 2D NIfTI stored as H x W x 1) are
    dropped; a 2D colour image stored as x, y, channel (RGB NIfTI) gets its
    channels first; an alpha channel is dropped; RGB becomes grey by averaging when
    one channel is wanted; grey is repeated when three are wanted. Anything
    else fails with a message naming the shape.
    """

    def __init__(self, keys: KeysCollection, channels: int, allow_missing_keys: bool = False):
        super().__init__(keys, allow_missing_keys)
        self.channels = int(channels)

    def __call__(self, data):
        d = dict(data)
        for key in self.key_iterator(d):
            img = d[key]
            while img.ndim > 3 and img.shape[-1] == 1:
                img = img[..., 0]
            if img.ndim == 4 and img.shape[0] == 1 and img.shape[-1] in (2, 3, 4):
                # a 2D colour image stored as x, y, channel (e.g. NIfTI): channels last -> first
                img = img[0].permute(2, 0, 1) if isinstance(img, torch.Tensor) else np.moveaxis(img[0], -1, 0)
            if img.ndim != 3:
                raise ValueError(f"{key}: expected a 2D image (channel-first, 3 dims), got shape {tuple(img.shape)}")
            c = img.shape[0]
            if c == 4:
                img, c = img[:3], 3
            if c == 2:  # grey + alpha
                img, c = img[:1], 1
            if c != self.channels:
                if c == 3 and self.channels == 1:
                    img = img.mean(0, keepdim=True) if isinstance(img, torch.Tensor) else np.mean(img, 0, keepdims=True)
                elif c == 1:
                    reps = (self.channels, 1, 1)
                    img = img.repeat(*reps) if isinstance(img, torch.Tensor) else np.tile(img, reps)
                else:
                    raise ValueError(f"{key}: cannot turn {c} channels into the {self.channels} the network expects")
            d[key] = img
        return d




class RandMirrord(RandomizableTransform, MapTransform):
    """With probability ``prob``, the image mirrored along one spatial axis (``spatial_axis``, as MONAI's
    ``RandFlipd``), the same for every key: MONAI's ``RandFlipd`` without its metadata bookkeeping, which on
    28 px images took a third of a training step (measured: 2.7 s of flips in a 5-round PneumoniaMNIST run).
    Not invertible (training only)."""

    def __init__(self, keys: KeysCollection, prob: float = 0.5, spatial_axis: int = 0,
                 allow_missing_keys: bool = False):
        MapTransform.__init__(self, keys, allow_missing_keys)
        RandomizableTransform.__init__(self, prob)
        self.spatial_axis = int(spatial_axis)

    def __call__(self, data):
        d = dict(data)
        self.randomize(None)
        if not self._do_transform:
            return d
        for key in self.key_iterator(d):
            img = d[key]  # channel first: spatial axis a is array axis a + 1
            d[key] = torch.flip(img, dims=(self.spatial_axis + 1,)) if isinstance(img, torch.Tensor) \
                else np.ascontiguousarray(np.flip(img, axis=self.spatial_axis + 1))
        return d


class RandDihedrald(RandomizableTransform, MapTransform):
    """With probability ``prob``, one random flip/rotate-by-90 (an element of the
    dihedral group D4) on the last two (spatial) dimensions, the same for every key.

    A label-preserving augmentation for orientation-free images (MedMNIST-style
    shapes, dermoscopy) at the cost of two tensor ops: MONAI's per-sample
    ``RandFlipd`` + ``RandRotate90d`` track metadata for inversion, which on
    28 px images costs more than the network step. Not invertible (training only).
    """

    def __init__(self, keys: KeysCollection, prob: float = 1.0, allow_missing_keys: bool = False):
        MapTransform.__init__(self, keys, allow_missing_keys)
        RandomizableTransform.__init__(self, prob)
        self._k, self._flip = 0, False

    def randomize(self, data=None) -> None:
        super().randomize(None)
        self._k = int(self.R.randint(4))
        self._flip = bool(self.R.randint(2))

    def __call__(self, data):
        d = dict(data)
        self.randomize()
        if not self._do_transform or (self._k == 0 and not self._flip):
            return d
        for key in self.key_iterator(d):
            img = d[key]
            if isinstance(img, torch.Tensor):
                img = torch.rot90(img, self._k, dims=(-2, -1)) if self._k else img
                img = torch.flip(img, dims=(-1,)) if self._flip else img
            else:
                img = np.rot90(img, self._k, axes=(-2, -1)) if self._k else img
                img = np.ascontiguousarray(np.flip(img, axis=-1) if self._flip else img)
            d[key] = img
        return d


__all__ = ["datalist", "scenario_info", "default_dataset", "image_files", "Ensure2DChannelsd", "RandDihedrald", "MaskLabeld",
           "MaskFromProbabilitiesd",
           "IMAGE_SUFFIXES"]
