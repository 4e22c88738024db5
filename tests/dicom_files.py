"""DICOM test inputs and the outputs a bundle writes (tests/unit/test_dicom_outputs.py,
tests/simulator/test_dicom_runs.py)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import (ComputedRadiographyImageStorage, CTImageStorage, ExplicitVRLittleEndian,
                         VLPhotographicImageStorage, generate_uid)

from fedlabels.bundle.dicom import is_dicom

def write_image(path, pixels, study, series, *, instance=1, sop=None, photometric=None, slope=None, intercept=None,
                center=None, width=None, geometry=False, sop_class=None, frame_of_reference=None) -> str:
    """A DICOM image as a scanner writes it (patient, study, series, instance); ``pixels`` uint16
    grey (rows x columns) or uint8 RGB (rows x columns x 3). Returns its SOP Instance UID."""
    pixels = np.asarray(pixels)
    rgb = pixels.ndim == 3
    sop = sop or generate_uid()
    sop_class = sop_class or (VLPhotographicImageStorage if rgb else CTImageStorage)
    ds = dataset(sop_class, sop, study, series)
    ds.PatientID, ds.PatientName, ds.StudyID, ds.StudyDate = "P-24", "Test^Patient", "1", "20240101"
    ds.Modality = {CTImageStorage: "CT", ComputedRadiographyImageStorage: "CR"}.get(sop_class, "XC")
    ds.SeriesNumber, ds.InstanceNumber = 1, instance
    ds.Rows, ds.Columns = pixels.shape[:2]
    if rgb:
        ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
        ds.BitsAllocated, ds.BitsStored, ds.HighBit = 8, 8, 7
        data_bytes = np.ascontiguousarray(pixels, dtype=np.uint8).tobytes()
    else:
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, photometric or "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit = 16, 16, 15
        data_bytes = np.ascontiguousarray(pixels, dtype="<u2").tobytes()
    ds.PixelRepresentation = 0
    if slope is not None:
        ds.RescaleSlope, ds.RescaleIntercept = f"{slope:g}", f"{intercept:g}"
    if center is not None:
        ds.WindowCenter, ds.WindowWidth = f"{center:g}", f"{width:g}"
    if geometry:  # a cross-sectional series: one frame of reference, a position per slice
        ds.FrameOfReferenceUID = frame_of_reference
        ds.ImagePositionPatient = [0.0, 0.0, float(instance)]
        ds.ImageOrientationPatient = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        ds.PixelSpacing, ds.SliceThickness = [0.5, 0.5], 1.0
    ds.PixelData = data_bytes
    ds.save_as(str(path), enforce_file_format=True)
    return sop


def write_unreadable(path, study, series) -> None:
    """A DICOM file (preamble, DICM, header) cut off inside its pixel data, as an interrupted copy leaves it."""
    write_image(path, np.ones((16, 16), np.uint16), study, series)
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw[:-300])


def _csv(path) -> dict:
    with open(path) as fh:
        return {Path(r["image"]).name: r for r in csv.DictReader(fh)}


def _dicom_outputs(out) -> list:
    return sorted(p for p in Path(out).rglob("*") if p.is_file() and is_dicom(p))


GUIDE = Path(__file__).resolve().parents[1] / "docs" / "clinical-bundle.md"


def dataset(sop_class, sop, study, series) -> Dataset:
    """An empty DICOM dataset with its file meta and the four identifying UIDs."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = sop_class, sop
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID, ds.StudyInstanceUID, ds.SeriesInstanceUID = sop_class, sop, study, series
    return ds
