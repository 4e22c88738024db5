"""Input images the way a hospital has them, for the exported bundles' inference tests.

``write_inputs`` saves one 2D picture as PNG, as NIfTI (x, y array order, MONAI's
convention, with a non-identity affine) and as DICOM (written with pydicom);
``write_unreadable`` adds a file that is no image and a 3D volume.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

NIFTI_AFFINE = np.diag([0.5, 0.7, 1.0, 1.0])


def write_dicom(path: Path, arr: np.ndarray) -> None:
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Modality = "DX"
    ds.Rows, ds.Columns = arr.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
    ds.PixelData = np.ascontiguousarray(arr, dtype=np.uint16).tobytes()
    ds.save_as(str(path), enforce_file_format=True)


def write_inputs(folder: Path, png: Path, grey: bool = True) -> dict:
    """``png`` again as ``<stem>.png``, ``<stem>_n.nii.gz`` and (grey only) ``<stem>_d.dcm``."""
    import nibabel as nib

    folder.mkdir(parents=True, exist_ok=True)
    arr = np.asarray(Image.open(png))
    out = {"png": folder / f"{png.stem}.png", "nifti": folder / f"{png.stem}_n.nii.gz"}
    Image.fromarray(arr).save(out["png"])
    xy = np.swapaxes(arr, 0, 1)  # PIL rows are y; MONAI's PILReader and NIfTI arrays index x first
    nib.save(nib.Nifti1Image(xy.astype(np.float32), NIFTI_AFFINE), str(out["nifti"]))
    if grey and arr.ndim == 2:
        out["dicom"] = folder / f"{png.stem}_d.dcm"
        write_dicom(out["dicom"], arr)
    return out


def write_unreadable(folder: Path) -> list:
    import nibabel as nib

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "broken.png").write_bytes(b"not an image")
    nib.save(nib.Nifti1Image(np.random.default_rng(0).random((6, 6, 6)).astype(np.float32), np.eye(4)),
             str(folder / "volume.nii.gz"))
    return [folder / "broken.png", folder / "volume.nii.gz"]
