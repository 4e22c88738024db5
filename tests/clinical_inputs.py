"""Input images the way a hospital has them, for the exported bundles' inference tests.

``write_inputs`` saves one 2D picture as PNG, as NIfTI (x, y array order, MONAI's
convention, with a non-identity affine) and as grey DICOM twice: MONOCHROME2, and
MONOCHROME1 (stored inverted, as computed radiography often is), both with the window
(center 128, width 256) that displays stored values 0..255 as themselves (DICOM PS3.3
C.11.2.1.2.1), so the DICOM is displayed as the PNG is; ``write_unreadable`` adds a file
that is no image and a 3D volume.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from fedlabels.data.dicom import write_dicom

NIFTI_AFFINE = np.diag([0.5, 0.7, 1.0, 1.0])


def write_inputs(folder: Path, png: Path) -> dict:
    """``png`` again as ``<stem>.png``, ``<stem>_n.nii.gz``, ``<stem>_d.dcm`` and ``<stem>_i.dcm``
    (MONOCHROME1); the DICOMs are grey (a colour picture's channel mean)."""
    import nibabel as nib

    folder.mkdir(parents=True, exist_ok=True)
    arr = np.asarray(Image.open(png))
    out = {"png": folder / f"{png.stem}.png", "nifti": folder / f"{png.stem}_n.nii.gz"}
    Image.fromarray(arr).save(out["png"])
    xy = np.swapaxes(arr, 0, 1)  # PIL rows are y; MONAI's PILReader and NIfTI arrays index x first
    nib.save(nib.Nifti1Image(xy.astype(np.float32), NIFTI_AFFINE), str(out["nifti"]))
    grey = (arr if arr.ndim == 2 else arr[..., :3].mean(-1)).astype(np.uint16)
    out["dicom"], out["dicom_inverted"] = folder / f"{png.stem}_d.dcm", folder / f"{png.stem}_i.dcm"
    write_dicom(out["dicom"], grey, "P1", intercept=0.0, window=(128, 256))
    # stored inverted within the window (0 = white): displayed inverted back
    write_dicom(out["dicom_inverted"], 255 - grey, "P1", intercept=0.0, photometric="MONOCHROME1", window=(128, 256))
    return out


def write_unreadable(folder: Path) -> list:
    import nibabel as nib

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "broken.png").write_bytes(b"not an image")
    nib.save(nib.Nifti1Image(np.random.default_rng(0).random((6, 6, 6)).astype(np.float32), np.eye(4)),
             str(folder / "volume.nii.gz"))
    return [folder / "broken.png", folder / "volume.nii.gz"]
