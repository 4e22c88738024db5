"""The one decoder of DICOM pixels, for every path an image takes: ``fedlabels import``
and ``fedlabels prepare`` (the scenario's PNG images), training (which reads those PNGs)
and an exported bundle's inference (``bundle.dicom.DicomReader``, which reads the hospital's
DICOM files directly). The same file gives the same array everywhere.

``read_dicom_image(path, window=None)`` returns the image as it is displayed, on the 8-bit
scale (uint8, 0-255) the scenario's images are stored in:

* grey (MONOCHROME1/2): pydicom's ``apply_modality_lut`` (rescale slope / intercept or a
  modality LUT), then pydicom's ``apply_voi_lut`` with the file's first VOI LUT or window
  (or the ``window`` given: a name of ``WINDOWS``, ``"LEVEL,WIDTH"``, or ``"multi"``, three
  windows as the three channels of a colour image), its output range mapped to 0-255;
  without any VOI, the image's own range mapped to 0-255; MONOCHROME1 (lowest value
  displayed white) inverted to the MONOCHROME2 convention of every other input; rounded;
* RGB (pydicom converts YBR) as stored; PALETTE COLOR through pydicom's ``apply_color_lut``;
  more than 8 bits scaled to 8.

MONAI's ``PydicomReader`` applies the rescale but no VOI LUT, window or MONOCHROME1
inversion, so the bundles read DICOM through this function (``bundle.dicom.DicomReader``,
a MONAI ``ImageReader``). Anything not decodable raises ``DicomError`` (a ``ValueError``)
with one line naming the field.

Also here: ``read_dicom_header`` (selected fields, no pixels) and ``write_dicom`` (test
fixtures).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Named windows (level, width) in Hounsfield units, for CT; "multi" = brain, subdural, bone as RGB.
WINDOWS = {"brain": (40, 80), "subdural": (80, 200), "bone": (600, 2800)}
MULTI = ("multi", "rgb")

# The header fields the preparers read.
FIELDS = ("SOPInstanceUID", "PatientID", "StudyInstanceUID", "SeriesInstanceUID", "SamplesPerPixel",
          "PhotometricInterpretation", "Rows", "Columns", "BitsAllocated", "BitsStored", "PixelRepresentation",
          "RescaleIntercept", "RescaleSlope")


class DicomError(ValueError):
    """A DICOM file that cannot be read, or whose pixels cannot be decoded; the message names the file or field."""


def parse_window(window) -> list | None:
    """``None`` / ``"auto"`` (the file's own VOI) -> None; a name, ``"LEVEL,WIDTH"``, ``(level, width)``
    or ``"multi"`` -> a list of (level, width). An unknown window raises ``DicomError``."""
    if window is None or window == "auto":
        return None
    if isinstance(window, (tuple, list)) and len(window) == 2 and not isinstance(window[0], (tuple, list)):
        return [(float(window[0]), float(window[1]))]
    if isinstance(window, str):
        if window in MULTI:
            return [WINDOWS[w] for w in ("brain", "subdural", "bone")]
        if window in WINDOWS:
            return [WINDOWS[window]]
        if "," in window:
            try:
                level, width = (float(v) for v in window.split(","))
            except ValueError:
                pass
            else:
                if width >= 1:
                    return [(level, width)]
    raise DicomError(f"unknown window {window!r}: use auto (the file's own), one of {sorted(WINDOWS)}, "
                     "'multi' or 'LEVEL,WIDTH' (width >= 1)")


def _luts():
    from pydicom.pixels import apply_color_lut, apply_modality_lut, apply_voi_lut

    return apply_modality_lut, apply_voi_lut, apply_color_lut


def has_voi(ds) -> bool:
    return "VOILUTSequence" in ds or ("WindowCenter" in ds and "WindowWidth" in ds)


def _windowing_header(ds, level: float, width: float):
    """A header holding what pydicom's windowing reads: the pixel module and modality LUT of ``ds``
    and the given window (LINEAR) instead of the file's VOI."""
    from pydicom.dataset import Dataset

    w = Dataset()
    for name in ("PhotometricInterpretation", "BitsStored", "PixelRepresentation", "RescaleSlope",
                 "RescaleIntercept", "ModalityLUTSequence"):
        if name in ds:
            setattr(w, name, ds[name].value)
    w.WindowCenter, w.WindowWidth, w.VOILUTFunction = level, width, "LINEAR"
    return w


def _voi(arr: np.ndarray, ds) -> np.ndarray:
    """pydicom's first VOI LUT or window of ``ds`` applied to modality values, mapped from its
    output range to 0-255 (float)."""
    _, voi_lut, _ = _luts()
    if "VOILUTSequence" in ds:  # a LUT wins over a window, as in pydicom (prefer_lut)
        n, first, bits = (int(v) for v in ds.VOILUTSequence[0].LUTDescriptor)
        n = n or 2 ** 16
        # pydicom indexes the LUT in its entries' dtype: clip to the LUT's input range first, or values wrap
        arr = np.clip(np.rint(arr), first, first + n - 1).astype(np.int64)
        lo, hi = 0.0, float(2 ** bits - 1)  # the LUT's output range (PS3.3 C.11.2.1.1)
        if bits == 8 and n > 256:
            # pydicom (3.0) indexes an 8-bit LUT with uint8 indices, so entry 256 and beyond wrap to the
            # start; the same entries declared 16-bit are indexed in uint16 (the output range stays 8-bit)
            from pydicom.dataset import Dataset
            from pydicom.sequence import Sequence

            item, lut, wide = ds.VOILUTSequence[0], Dataset(), Dataset()
            lut.LUTDescriptor = [n if n < 2 ** 16 else 0, first, 16]
            lut.add_new(0x00283006, item["LUTData"].VR, item.LUTData)
            wide.VOILUTSequence = Sequence([lut])
            if hasattr(ds, "file_meta"):
                wide.file_meta = ds.file_meta
            ds = wide
    else:
        # the window's output range, read off pydicom's function itself: its values at the extremes
        lo, hi = (float(v) for v in voi_lut(np.array([-2.0 ** 31, 2.0 ** 31 - 1]), ds, index=0))
    out = np.asarray(voi_lut(arr, ds, index=0), dtype=np.float64)
    return np.clip((out - lo) / (hi - lo), 0.0, 1.0) * 255.0 if hi != lo else np.zeros_like(out)


def _stretch(arr: np.ndarray) -> np.ndarray:
    """No VOI: the image's own range -> 0-255 (float)."""
    lo, hi = float(arr.min()), float(arr.max())
    return (arr - lo) / (hi - lo) * 255.0 if hi > lo else np.zeros_like(arr, dtype=np.float64)


def _to8(arr: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(arr), 0, 255).astype(np.uint8)


def decode(ds, window=None) -> np.ndarray:
    """The pixels of data set ``ds`` as displayed, uint8 (rows x columns, x 3 for colour); see the module."""
    windows = parse_window(window)
    if "PixelData" not in ds:
        sop = getattr(ds, "SOPClassUID", None)
        what = getattr(sop, "name", None) or sop or "no SOP class"
        raise DicomError(f"a DICOM object without pixels (field 'PixelData' missing; {what})")
    frames = int(getattr(ds, "NumberOfFrames", 1) or 1)
    if frames > 1:
        raise DicomError(f"a multi-frame DICOM (field 'NumberOfFrames' = {frames}); only single 2D images are read")
    try:
        px = ds.pixel_array
    except Exception as e:  # noqa: BLE001 - truncated data, an unsupported compression
        raise DicomError(f"DICOM pixel data cannot be decoded ({' '.join(str(e).split())})") from None
    modality_lut, _, color_lut = _luts()
    photometric = str(getattr(ds, "PhotometricInterpretation", "")).strip().upper()
    samples = int(getattr(ds, "SamplesPerPixel", 1) or 1)
    if photometric == "PALETTE COLOR":
        bits = int(ds.RedPaletteColorLookupTableDescriptor[2])
        return _to8(color_lut(px, ds).astype(np.float64) * 255.0 / (2 ** bits - 1))
    if samples == 3:
        bits = int(getattr(ds, "BitsStored", 8) or 8)
        px = np.asarray(px)
        return px.astype(np.uint8) if bits <= 8 else _to8(px.astype(np.float64) * 255.0 / (2 ** bits - 1))
    if samples != 1 or photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise DicomError(f"field 'PhotometricInterpretation' {photometric or 'missing'} with {samples} samples per "
                         "pixel: expected MONOCHROME1/2, RGB or PALETTE COLOR")
    values = np.asarray(modality_lut(px, ds), dtype=np.float64)
    if windows is not None:
        shown = [_voi(values, _windowing_header(ds, level, width)) for level, width in windows]
    elif has_voi(ds):
        shown = [_voi(values, ds)]
    else:
        shown = [_stretch(values)]
    if photometric == "MONOCHROME1":
        shown = [255.0 - s for s in shown]
    return _to8(shown[0] if len(shown) == 1 else np.stack(shown, -1))


def read_dicom_image(path, window=None, fix=None) -> tuple:
    """``(pixels, header)`` of the DICOM file ``path``: pixels as ``decode`` gives them (uint8), the
    header a pydicom ``Dataset``. ``fix(ds)`` may correct a data set's header before decoding (a
    dataset's known error, e.g. ``rsna_ich_intercept``). Raises ``DicomError`` naming the problem."""
    import pydicom

    try:
        ds = pydicom.dcmread(str(path), force=True)
    except Exception as e:  # noqa: BLE001 - any parser failure is an unreadable file
        raise DicomError(f"not a readable DICOM file ({' '.join(str(e).split())})") from None
    if fix is not None:
        fix(ds)
    return decode(ds, window), ds


def rsna_ich_intercept(ds) -> None:
    """The known RSNA-ICH header error: 12-bit unsigned images stored with an intercept above -100;
    their stored values are shifted back so air reads about -1000 HU (as the challenge's kernels do)."""
    if getattr(ds, "BitsStored", None) == 12 and getattr(ds, "PixelRepresentation", None) == 0 \
            and float(getattr(ds, "RescaleIntercept", None) or 0.0) > -100:
        px = ds.pixel_array.astype(np.int32) + 1000
        px[px >= 4096] -= 4096
        ds.PixelData = px.astype(ds.pixel_array.dtype).tobytes()
        ds.RescaleIntercept = -1000


def _read_header(path):
    import pydicom

    path = Path(path)
    if not path.is_file():
        raise DicomError(f"{path}: DICOM file not found")
    try:
        return pydicom.dcmread(str(path), stop_before_pixels=True)
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad file
        raise DicomError(f"{path}: not a readable DICOM file ({e})") from None


def read_dicom_header(path) -> dict:
    """Selected header fields (PatientID, Rows, ...) without reading the pixels."""
    ds = _read_header(path)
    return {name: getattr(ds, name, None) for name in FIELDS}


def write_dicom(path, pixels: np.ndarray, patient_id: str, sop_uid: str = "1.2.3", intercept: float = -1024.0,
                slope: float = 1.0, explicit: bool = True, photometric: str = "MONOCHROME2",
                window: tuple | None = None) -> None:
    """Write a minimal uncompressed CT DICOM (used to build test fixtures); ``photometric``
    "MONOCHROME1" stores the pixels as given, to be displayed inverted; ``window`` (center, width)
    writes a VOI window."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, ImplicitVRLittleEndian

    pixels = np.asarray(pixels)
    signed = pixels.dtype.kind == "i"
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = CTImageStorage, sop_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian if explicit else ImplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID, ds.PatientID, ds.Modality = CTImageStorage, sop_uid, patient_id, "CT"
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, photometric
    ds.Rows, ds.Columns = pixels.shape
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, int(signed)
    ds.RescaleIntercept, ds.RescaleSlope = f"{intercept:g}", f"{slope:g}"
    if window is not None:
        ds.WindowCenter, ds.WindowWidth = f"{window[0]:g}", f"{window[1]:g}"
    ds.PixelData = np.ascontiguousarray(pixels, dtype="<i2" if signed else "<u2").tobytes()
    ds.save_as(str(path), enforce_file_format=True)
