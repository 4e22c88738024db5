"""Shared pieces of the public-dataset preparers: errors, cases, files, images.

A preparer reads a dataset in the layout its publisher distributes it
(docs/datasets.md), turns every image into a :class:`Case` (an id, a patient,
its labels and where its pixels come from), and hands the cases to a protocol
(partition.py / protocols.py) that decides which site gets what. The writer
(build.py) then converts each image once -- decoded, resized, saved as PNG --
and writes the scenario folder of DESIGN.md section 4.

Every bad input raises :class:`PrepareError` with one message that names the
file (and the first few offending ids), never a stack trace from a decoder.
"""

from __future__ import annotations

import csv
import functools
import gzip
import hashlib
import io
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..progress import Progress as _Progress

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm", ".gif")


class PrepareError(ValueError):
    """Bad input to a preparer: the message names the file (and ids) at fault."""


# ------------------------------------------------------------------ cases


@dataclass
class Case:
    """One image of a source dataset.

    ``image`` is a path (PNG/JPEG/BMP/TIFF/DICOM), an in-memory array, or a
    ``VolumeSlice``. ``labels`` is a 0/1 vector over the source's classes
    (multi-label; -1 = not stated by the source), a class index (multi-class),
    or None (segmentation). ``mask`` is a path, a list of paths (their union),
    an array, a ``VolumeSlice`` or None (no lesion).
    """

    id: str
    image: Any
    patient: str
    labels: Any = None
    mask: Any = None
    meta: dict = field(default_factory=dict)


@dataclass
class Source:
    """A dataset read from disk: its cases, classes and provenance."""

    name: str
    task: str  # "multilabel" | "multiclass" | "segmentation"
    classes: list
    cases: list
    channels: int
    root: Path
    files: dict = field(default_factory=dict)  # relative path -> {"sha256": ..., ...}
    meta: dict = field(default_factory=dict)
    mask_mode: str = "binary"  # segmentation: "binary" (any > 0) or "labels" (value = class index + 1)

    def provenance(self) -> dict:
        out = {"dataset": self.name, "path": str(self.root), "images": len(self.cases), "files": self.files}
        listing = self.listing_digest()
        if listing:
            out["image_listing_sha256"] = listing
        out.update(self.meta)
        return json.loads(json.dumps(out, default=str))  # plain lists/dicts for YAML


    def listing_digest(self) -> str | None:
        """SHA-256 over the sorted (relative path, size) of the image files: detects a
        changed or incomplete download without hashing every image."""
        paths = set()
        for c in self.cases:
            for spec in (c.image, *(c.mask if isinstance(c.mask, list) else [c.mask])):
                if isinstance(spec, VolumeSlice):
                    spec = spec.path
                if isinstance(spec, (str, Path)):
                    paths.add(Path(spec))
        if not paths:
            return None
        h = hashlib.sha256()
        root = Path(self.root).resolve()
        for p in sorted(paths):
            try:
                rel = str(p.resolve().relative_to(root))
            except ValueError:
                rel = str(p)
            h.update(f"{rel}\t{p.stat().st_size}\n".encode())
        return h.hexdigest()


@dataclass(frozen=True)
class VolumeSlice:
    """Slice ``index`` (first array axis) of a 3D MetaImage volume."""

    path: str
    index: int


# ------------------------------------------------------------------ files


def file_digest(path, algo="sha256", chunk=1 << 20) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def record_file(source_files: dict, root: Path, path: Path, md5: bool = False) -> None:
    """Note a metadata file (CSV, list, npz) and its checksum for provenance."""
    try:
        rel = str(Path(path).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        rel = str(path)
    entry = {"sha256": file_digest(path), "bytes": Path(path).stat().st_size}
    if md5:
        entry["md5"] = file_digest(path, "md5")
    source_files[rel] = entry


def require_dir(path, what: str) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise PrepareError(f"{path}: {what} folder not found")
    return path


def find_first(root: Path, names: Iterable[str], what: str, kind="file") -> Path:
    """The first of ``names`` (relative to root) that exists; a clear error otherwise."""
    names = list(names)
    for name in names:
        p = Path(root) / name
        if (kind == "file" and p.is_file()) or (kind == "dir" and p.is_dir()):
            return p
    raise PrepareError(f"{root}: {what} not found (looked for {', '.join(names)})")


def find_optional(root: Path, names: Iterable[str], kind="file") -> Path | None:
    for name in names:
        p = Path(root) / name
        if (kind == "file" and p.is_file()) or (kind == "dir" and p.is_dir()):
            return p
    return None


def index_images(folders: Iterable[Path], exts=IMAGE_EXTS, recursive=True) -> dict:
    """Map file name (with and without suffix) -> path over the given folders."""
    out: dict = {}
    for folder in folders:
        folder = Path(folder)
        if not folder.is_dir():
            continue
        walker = os.walk(folder) if recursive else [(str(folder), [], os.listdir(folder))]
        for dirpath, dirs, files in walker:
            # sorted walk: the same file wins on every machine; never index a
            # prepared scenario that happens to live under the source folder
            dirs[:] = sorted(d for d in dirs if ".partial-" not in d and not (Path(dirpath) / d / "scenario.yaml").exists())
            for name in sorted(files):
                if name.lower().endswith(exts) and not name.startswith("."):
                    p = Path(dirpath) / name
                    out.setdefault(name, p)
                    out.setdefault(strip_ext(name), p)
    return out


def strip_ext(name: str) -> str:
    name = Path(name).name
    for ext in (".nii.gz",) + IMAGE_EXTS:
        if name.lower().endswith(ext):
            return name[: -len(ext)]
    return Path(name).stem


def missing_error(file, what: str, ids: list, total: int | None = None) -> PrepareError:
    shown = ", ".join(str(i) for i in ids[:5])
    more = f" (and {len(ids) - 5} more)" if len(ids) > 5 else ""
    of = f" of {total}" if total is not None else ""
    return PrepareError(f"{file}: {len(ids)}{of} {what}: {shown}{more}")


def open_text(path: Path):
    path = Path(path)
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def iter_csv(path, required: Iterable[str], delimiter=","):
    """Stream a CSV's rows as dicts (for files of millions of rows, e.g. RSNA's).

    Fails naming the file if it is missing, unreadable, or lacks a required column.
    """
    path = Path(path)
    if not path.is_file():
        raise PrepareError(f"{path}: missing file")
    required = list(required)
    try:
        with open_text(path) as f:
            reader = csv.reader(f, delimiter=delimiter)
            header = [h.strip() for h in next(reader, [])]
            missing = [c for c in required if c not in header]
            if missing:
                raise PrepareError(f"{path}: unexpected CSV header {header}; missing column(s) {missing}")
            for row in reader:
                if row:
                    yield {k: (row[i].strip() if i < len(row) else "") for i, k in enumerate(header)}
    except (UnicodeDecodeError, csv.Error, OSError, EOFError) as e:
        raise PrepareError(f"{path}: not a readable CSV file ({e})") from None


def read_csv(path, required: Iterable[str], delimiter=",") -> list:
    """All rows of a CSV as dicts; fails naming the file on a missing column or no rows."""
    rows = list(iter_csv(path, required, delimiter))
    if not rows:
        raise PrepareError(f"{path}: no rows")
    return rows


def read_list(path) -> list:
    """An image-id list (one per line, e.g. NIH train_val_list.txt)."""
    path = Path(path)
    if not path.is_file():
        raise PrepareError(f"{path}: missing file")
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def safe_id(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("._") or "case"


# ------------------------------------------------------------------ progress


class Progress(_Progress):
    """'<what> i/n, elapsed, about ... left' as the steps go: a bar on a terminal, a line about
    every 5 % otherwise (fedlabels.progress)."""

    def __init__(self, total: int, what: str, say: Callable | None = None, every: int | None = None):
        super().__init__(total, what, prefix="  ", say_fn=say, every=every)


# ------------------------------------------------------------------ images


def load_pixels(spec, window=None) -> np.ndarray:
    """Decode an image spec to an array (H, W) or (H, W, 3); raises PrepareError naming the file."""
    if isinstance(spec, np.ndarray):
        return spec
    if hasattr(spec, "pixels"):  # an image that decodes itself (fedlabels import's DICOM files)
        return spec.pixels()
    if isinstance(spec, VolumeSlice):
        vol = read_volume(spec.path)
        if not 0 <= spec.index < vol.shape[0]:
            raise PrepareError(f"{spec.path}: slice {spec.index} outside the volume of {vol.shape[0]} slices")
        return vol[spec.index]
    path = Path(spec)
    if not path.is_file():
        raise PrepareError(f"{path}: image file not found")
    if path.suffix.lower() == ".dcm":  # a CT slice of the RSNA-ICH data (fedlabels prepare ich)
        from .dicom import DicomError, read_dicom_image, rsna_ich_intercept

        try:
            return read_dicom_image(path, window or "brain", fix=rsna_ich_intercept)[0]
        except DicomError as e:
            raise PrepareError(f"{path}: {e}") from None
    try:
        with Image.open(path) as im:
            im.load()
            if im.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
                return np.asarray(im, dtype=np.float32)
            if im.mode not in ("L", "RGB"):
                im = im.convert("RGB")
            return np.asarray(im)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise PrepareError(f"{path}: corrupt or unreadable image ({e})") from None


def to_uint8(arr: np.ndarray) -> np.ndarray:
    """Scale a non-8-bit image into 0..255 (min-max over its 0.5-99.5 percentiles)."""
    if arr.dtype == np.uint8:
        return arr
    a = arr.astype(np.float32)
    lo, hi = np.percentile(a, [0.5, 99.5]) if a.size > 64 else (a.min(), a.max())
    if hi <= lo:
        hi = lo + 1
    return (np.clip((a - lo) / (hi - lo), 0, 1) * 255).round().astype(np.uint8)


def to_mode(arr: np.ndarray, channels: int) -> Image.Image:
    arr = to_uint8(np.asarray(arr))
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim == 3 and arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)
    if arr.ndim == 3 and arr.shape[-1] == 4:
        arr = arr[..., :3]
    im = Image.fromarray(arr)
    if channels == 1 and im.mode != "L":
        im = im.convert("L")
    elif channels == 3 and im.mode != "RGB":
        im = im.convert("RGB")
    return im


def load_mask(spec, mask_mode: str) -> np.ndarray | None:
    """A mask spec -> integer label map (0 = background, k + 1 = class k), or None."""
    if spec is None:
        return None
    if isinstance(spec, (list, tuple)) and not isinstance(spec, VolumeSlice):
        parts = [load_mask(s, mask_mode) for s in spec]
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        shapes = {p.shape for p in parts}
        if len(shapes) != 1:
            raise PrepareError(f"{spec[0]}: masks of one image differ in size {sorted(shapes)}")
        return np.maximum.reduce(parts)
    arr = load_pixels(spec)
    if arr.ndim == 3:
        arr = arr.max(-1)
    if mask_mode == "binary":
        return (arr > (127 if arr.dtype == np.uint8 and arr.max() > 1 else 0)).astype(np.uint8)
    return np.asarray(arr).astype(np.uint8)


def resize_image(im: Image.Image, size) -> Image.Image:
    if size is None:
        return im
    w, h = (size, size) if isinstance(size, int) else size
    if im.size == (w, h):
        return im
    return im.resize((w, h), Image.BICUBIC)


def resize_mask(mask: np.ndarray, size) -> np.ndarray:
    if size is None:
        return mask
    w, h = (size, size) if isinstance(size, int) else size
    if mask.shape == (h, w):
        return mask
    return np.asarray(Image.fromarray(mask).resize((w, h), Image.NEAREST))


# ------------------------------------------------------------------ MetaImage volumes


_MET_TYPES = {
    "MET_UCHAR": np.uint8, "MET_CHAR": np.int8, "MET_USHORT": np.uint16, "MET_SHORT": np.int16,
    "MET_UINT": np.uint32, "MET_INT": np.int32, "MET_FLOAT": np.float32, "MET_DOUBLE": np.float64,
}


def read_mhd_header(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise PrepareError(f"{path}: volume file not found")
    header = {}
    with open(path, "rb") as f:
        for raw in f:
            try:
                line = raw.decode("ascii").strip()
            except UnicodeDecodeError:
                break
            if "=" not in line:
                continue
            key, value = (s.strip() for s in line.split("=", 1))
            header[key] = value
            if key == "ElementDataFile":
                header["_offset"] = f.tell()
                break
    for key in ("DimSize", "ElementType", "ElementDataFile"):
        if key not in header:
            raise PrepareError(f"{path}: not a MetaImage header (missing {key})")
    if header["ElementType"] not in _MET_TYPES:
        raise PrepareError(f"{path}: unsupported ElementType {header['ElementType']}")
    return header


@functools.lru_cache(maxsize=2)
def read_volume(path) -> np.ndarray:
    """A MetaImage (.mhd + raw, or .mha) volume as a numpy array (z, y, x)."""
    path = Path(path)
    h = read_mhd_header(path)
    dims = [int(v) for v in h["DimSize"].split()]
    dtype = np.dtype(_MET_TYPES[h["ElementType"]])
    msb = h.get("BinaryDataByteOrderMSB", h.get("ElementByteOrderMSB", "False")).lower() == "true"
    dtype = dtype.newbyteorder(">" if msb else "<")
    if h["ElementDataFile"] == "LOCAL":
        data_path, offset = path, h["_offset"]
    else:
        data_path, offset = path.parent / h["ElementDataFile"], int(h.get("HeaderSize", 0) or 0)
    if not data_path.is_file():
        raise PrepareError(f"{path}: its data file {data_path} is missing")
    with open(data_path, "rb") as f:
        f.seek(offset)
        blob = f.read()
    if h.get("CompressedData", "False").lower() == "true":
        import zlib

        try:
            blob = zlib.decompress(blob)
        except zlib.error as e:
            raise PrepareError(f"{data_path}: corrupt compressed volume ({e})") from None
    n = int(np.prod(dims))
    if len(blob) < n * dtype.itemsize:
        raise PrepareError(f"{data_path}: truncated volume ({len(blob)} bytes, expected {n * dtype.itemsize} for {dims})")
    arr = np.frombuffer(blob[: n * dtype.itemsize], dtype=dtype).reshape(dims[::-1])
    return arr.astype(dtype.newbyteorder("="))


def write_mhd(path, arr: np.ndarray) -> None:
    """Write a small MetaImage volume (tests and tools): ``arr`` is (z, y, x)."""
    path = Path(path)
    types = {v: k for k, v in _MET_TYPES.items()}
    et = types[np.dtype(arr.dtype).type]
    raw = path.with_suffix(".raw")
    raw.write_bytes(np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes())
    dims = " ".join(str(d) for d in arr.shape[::-1])
    path.write_text(f"ObjectType = Image\nNDims = {arr.ndim}\nBinaryData = True\nBinaryDataByteOrderMSB = False\n"
                    f"CompressedData = False\nDimSize = {dims}\nElementType = {et}\nElementDataFile = {raw.name}\n")


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)
