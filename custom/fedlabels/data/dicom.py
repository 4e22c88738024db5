"""Just enough DICOM for the RSNA hemorrhage CTs, through pydicom: header fields and
pixels in Hounsfield units, and a writer for test fixtures."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .common import PrepareError

# The header fields the preparers read.
FIELDS = ("SOPInstanceUID", "PatientID", "StudyInstanceUID", "SeriesInstanceUID", "SamplesPerPixel",
          "PhotometricInterpretation", "Rows", "Columns", "BitsAllocated", "BitsStored", "PixelRepresentation",
          "RescaleIntercept", "RescaleSlope")


def _read(path, pixels: bool):
    import pydicom

    path = Path(path)
    if not path.is_file():
        raise PrepareError(f"{path}: DICOM file not found")
    try:
        ds = pydicom.dcmread(str(path), stop_before_pixels=not pixels)
        return ds, (ds.pixel_array if pixels else None)
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad file
        raise PrepareError(f"{path}: not a readable DICOM file ({e})") from None


def read_dicom_header(path) -> dict:
    """Selected header fields (PatientID, Rows, ...) without reading the pixels."""
    ds, _ = _read(path, pixels=False)
    return {name: getattr(ds, name, None) for name in FIELDS}


def read_dicom_pixels(path) -> np.ndarray:
    """Pixels in Hounsfield units (float32, HxW), rescale slope/intercept applied.

    Applies the known RSNA-ICH fix: 12-bit unsigned images stored with a
    wrong intercept (> -100) are shifted back so air reads about -1000 HU.
    """
    ds, px = _read(path, pixels=True)
    if (getattr(ds, "SamplesPerPixel", 1) or 1) != 1:
        raise PrepareError(f"{path}: expected a single-channel CT image")
    px = px.astype(np.float32)
    slope = float(getattr(ds, "RescaleSlope", None) or 1.0)
    intercept = float(getattr(ds, "RescaleIntercept", None) or 0.0)
    if getattr(ds, "BitsStored", None) == 12 and getattr(ds, "PixelRepresentation", None) == 0 and intercept > -100:
        px = px + 1000
        px[px >= 4096] -= 4096
        intercept = -1000.0
    return px * slope + intercept


def write_dicom(path, pixels: np.ndarray, patient_id: str, sop_uid: str = "1.2.3", intercept: float = -1024.0,
                slope: float = 1.0, explicit: bool = True, photometric: str = "MONOCHROME2") -> None:
    """Write a minimal uncompressed CT DICOM (used to build test fixtures); ``photometric``
    "MONOCHROME1" stores the pixels as given, to be displayed inverted."""
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
    ds.PixelData = np.ascontiguousarray(pixels, dtype="<i2" if signed else "<u2").tobytes()
    ds.save_as(str(path), enforce_file_format=True)
