"""RETOUCH retinal OCT fluid segmentation (Bogunovic et al., TMI 2019): one site per device.

Layout of the training set (the volumes with reference annotations):
``RETOUCH-TrainingSet-Cirrus/TRAIN001/oct.mhd`` (+ ``oct.raw``) and
``reference.mhd`` (+ ``.raw``), likewise for Topcon and Spectralis (the
``RETOUCH-TrainingSet-`` prefix is optional). Every B-scan (first array axis
of the MetaImage volume) becomes one 2D case; all slices of a volume belong
to one patient. Reference labels: 0 background, 1 IRF, 2 SRF, 3 PED.
"""

from __future__ import annotations

from pathlib import Path

from .common import Case, PrepareError, Source, VolumeSlice, read_mhd_header, require_dir

OCT_CLASSES = ["irf", "srf", "ped"]
DEVICES = ["Cirrus", "Topcon", "Spectralis"]


def _device_dir(root: Path, device: str):
    for name in (f"RETOUCH-TrainingSet-{device}", device, device.lower()):
        if (root / name).is_dir():
            return root / name
    return None


def read(src, say=print) -> Source:
    root = require_dir(src, "RETOUCH")
    cases = []
    sites = []
    skipped = []
    for device in DEVICES:
        folder = _device_dir(root, device)
        if folder is None:
            raise PrepareError(f"{root}: no folder for {device} (expected {root / f'RETOUCH-TrainingSet-{device}'})")
        n_vol = 0
        for vol in sorted(p for p in folder.iterdir() if p.is_dir()):
            img, ref = vol / "oct.mhd", vol / "reference.mhd"
            if not img.is_file():
                raise PrepareError(f"{vol}: oct.mhd not found")
            if not ref.is_file():
                skipped.append(f"{device}/{vol.name}")
                continue
            dims = [int(v) for v in read_mhd_header(img)["DimSize"].split()]
            rdims = [int(v) for v in read_mhd_header(ref)["DimSize"].split()]
            if dims != rdims:
                raise PrepareError(f"{ref}: reference size {rdims} differs from the volume's {dims} ({img})")
            if len(dims) != 3:
                raise PrepareError(f"{img}: expected a 3D volume, got DimSize {dims}")
            for z in range(dims[2]):
                cases.append(Case(f"{device.lower()}_{vol.name}_{z:03d}", VolumeSlice(str(img), z),
                                  f"{device.lower()}-{vol.name}", None, VolumeSlice(str(ref), z),
                                  meta={"site": device.lower(), "volume": vol.name}))
            n_vol += 1
        if n_vol == 0:
            raise PrepareError(f"{folder}: no volume with a reference.mhd")
        sites.append([device.lower(), f"RETOUCH {device} ({n_vol} volumes)"])
    say(f"RETOUCH: {len(cases)} B-scans from {', '.join(s[1] for s in sites)}")
    return Source("retouch", "segmentation", list(OCT_CLASSES), cases, 1, root, {},
                  meta={"sites": sites, "seg_classes": list(OCT_CLASSES), "volumes_without_reference": skipped},
                  mask_mode="labels")
