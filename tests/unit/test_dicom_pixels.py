"""One decoder of DICOM pixels (``fedlabels.data.dicom``): the same file gives the same array on
every path.

A hospital's DICOM studies (written here with pydicom: a CT series with rescale and a window, a
computed radiography series stored MONOCHROME1 without a window, a radiograph with a VOI LUT
sequence, and one with a window and a rescale slope) are imported with ``fedlabels import``,
the bundle trains one epoch on them (``fedlabels train``: the bundle's own ``train.json``),
``fedlabels export`` writes the clinical bundle, and for every imported image the array the
bundle's inference (``inference.json``'s preprocessing, reading the original DICOM file) hands
the network is exactly the array training (``train.json``'s deterministic transforms, reading
the scenario's image) handed it. Once with the files' own windows, once with ``--window``,
which the exported bundle carries (``dicom_window``).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pydicom
import pytest
import torch
from monai.bundle import ConfigParser
from monai.transforms import Compose
from pydicom.dataset import Dataset
from pydicom.sequence import Sequence
from pydicom.uid import ComputedRadiographyImageStorage, CTImageStorage, generate_uid

from fedlabels import cli
from dicom_files import dataset
from fedlabels.data.dicom import DicomError, parse_window, read_dicom_image

BUNDLE = "cxr_resnet18"
# the bundle's own classes (chest X-ray findings)
CLASSES = ("infiltration", "effusion", "atelectasis", "nodule", "consolidation", "pneumothorax")


def write_study_image(path: Path, stored: np.ndarray, study: str, series: str, patient: str, kind: str,
                      instance: int) -> None:
    """A DICOM image as a modality writes it; ``kind`` picks the pixel module and VOI."""
    sop_class = CTImageStorage if kind == "ct" else ComputedRadiographyImageStorage
    sop = generate_uid()
    ds = dataset(sop_class, sop, study, series)
    ds.PatientID, ds.PatientName, ds.Modality = patient, f"Test^{patient}", "CT" if kind == "ct" else "CR"
    ds.InstanceNumber = instance
    ds.Rows, ds.Columns = stored.shape
    ds.SamplesPerPixel, ds.BitsAllocated, ds.HighBit = 1, 16, 15
    ds.PhotometricInterpretation = "MONOCHROME1" if kind == "cr_inverted" else "MONOCHROME2"
    if kind == "ct":  # signed, HU = stored - 1024, a soft-tissue window
        ds.BitsStored, ds.PixelRepresentation = 16, 1
        ds.RescaleSlope, ds.RescaleIntercept, ds.RescaleType = "1", "-1024", "HU"
        ds.WindowCenter, ds.WindowWidth = "40", "400"
        data = stored.astype("<i2")
    else:
        ds.BitsStored, ds.PixelRepresentation = 12, 0
        data = stored.astype("<u2")
    if kind == "cr_lut":  # a VOI LUT sequence (a LUT wins over any window)
        item = Dataset()
        item.LUTDescriptor = [1024, 0, 8]
        item.add_new(0x00283006, "US", [min(255, v // 3) for v in range(1024)])
        ds.VOILUTSequence = Sequence([item])
    if kind == "cr_window":  # rescale slope and a window
        ds.RescaleSlope, ds.RescaleIntercept = "0.5", "0"
        ds.WindowCenter, ds.WindowWidth = "600", "900"
    ds.PixelData = np.ascontiguousarray(data).tobytes()
    ds.save_as(str(path), enforce_file_format=True)


def hospital(root: Path) -> Path:
    """Two hospitals' studies (site-1 labels the first three findings, site-2 the last three) and fully
    labeled test rows; a patient is a study; effusion and nodule are bright blobs."""
    rng = np.random.default_rng(7)
    rows = [["image", "site", "patient", *CLASSES]]
    kinds = ["ct", "cr_inverted", "cr_lut", "cr_window"]
    n = 0
    for site, labels in (("site-1", CLASSES[:3]), ("site-2", CLASSES[3:]), ("test", CLASSES)):
        for p in range(4):
            study, series, patient = generate_uid(), generate_uid(), f"{site}-P{p}"
            for i in range(2):
                y = rng.integers(0, 2, len(CLASSES))
                kind = kinds[n % len(kinds)]
                n += 1
                base = rng.normal(1200 if kind == "ct" else 1500, 300, (24, 24))
                base[4:10, 4:10] += 900 * y[1]
                base[14:20, 12:18] += 600 * y[3]
                stored = np.clip(base, 0, 4095).astype(np.int32)
                name = f"{site}_{patient}_{i}.dcm"
                (root / "dicom").mkdir(parents=True, exist_ok=True)
                write_study_image(root / "dicom" / name, stored, study, series, patient, kind, i + 1)
                rows.append([f"dicom/{name}", site, patient]
                            + [str(v) if c in labels else "" for c, v in zip(CLASSES, y)])
    path = root / "labels.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


def _stages(parser: ConfigParser, key: str) -> Compose:
    parsed = parser.get_parsed_content(key)
    return parsed if isinstance(parsed, Compose) else Compose(parsed)


def roundtrip(root: Path, window: str) -> int:
    """Import ``hospital(root / "hospital")`` with ``--window window``, train one epoch, export, and check
    every imported image against its DICOM file through the exported bundle's configs; returns how many
    were compared. (tests/deploy/test_release.py runs it again with the installed wheel.)"""
    labels = hospital(root / "hospital")
    scen, run, exp = root / "scen", root / "run", root / "exp"
    assert cli.main(["import", str(labels), "--out", str(scen), "--workers", "1", "--quiet", "--window", window]) == 0
    assert cli.main(["train", "--bundle", BUNDLE, "--data", str(scen), "--site", "site-1", "--epochs", "1",
                     "--out", str(run)]) == 0
    ckpt = next(p for p in (run / "models" / "model.pt", run / "models" / "model_final.pt") if p.is_file())
    assert cli.main(["export", "--bundle", BUNDLE, "--ckpt", str(ckpt), "--data", str(scen), "--out", str(exp)]) == 0
    infer_cfg = json.loads((exp / "configs" / "inference.json").read_text())
    assert infer_cfg["dicom_window"] == (None if window == "auto" else window)

    # training's view: the exported bundle's train.json, its deterministic transforms on the scenario's images
    train = ConfigParser()
    train.read_config(str(exp / "configs" / "train.json"))
    train.update({"bundle_root": str(exp), "dataset_dir": str(scen), "image_size": infer_cfg["image_size"]})
    train_load = _stages(train, "train#deterministic_transforms")
    # the clinic's view: inference.json's preprocessing on the original DICOM files
    infer = ConfigParser()
    infer.read_config(str(exp / "configs" / "inference.json"))
    infer.update({"bundle_root": str(exp)})
    infer_load = _stages(infer, "preprocessing")

    originals = {p.stem: p for p in (root / "hospital" / "dicom").glob("*.dcm")}
    compared = 0
    for folder in ["site-1", "site-2", "test"]:
        lists = json.loads((scen / folder / "datalist.json").read_text())
        for item in [i for split in lists.values() for i in split]:
            written = (scen / folder / item["image"]).resolve()
            source = originals[written.stem]
            # the loaders first: the PNG import wrote and the DICOM the clinic sends, the same array
            png_read = np.asarray(train_load.transforms[0]({"image": str(written)})["image"])
            dicom_read = np.asarray(infer_load.transforms[0]({"image": str(source)})["image"])
            assert png_read.shape == dicom_read.shape and np.array_equal(png_read, dicom_read), source.name
            # then what reaches the network
            seen_in_training = torch.as_tensor(train_load({"image": str(written), "label": item["label"]})["image"])
            seen_in_clinic = torch.as_tensor(infer_load({"image": str(source)})["image"])
            assert seen_in_training.shape == seen_in_clinic.shape == (1, infer_cfg["image_size"],
                                                                       infer_cfg["image_size"])
            assert torch.equal(seen_in_training.float(), seen_in_clinic.float()), source.name
            compared += 1
    assert compared == len(originals)
    # the comparison means something: the decoder is the one both sides used, and it differs from
    # the raw stored values (rescale, window or LUT applied)
    one = originals["site-1_site-1-P0_0"]
    pixels, _ = read_dicom_image(one, None if window == "auto" else window)
    assert pixels.dtype == np.uint8 and not np.array_equal(pixels, pydicom.dcmread(one).pixel_array)
    return compared


@pytest.mark.parametrize("window", ["auto", "40,400"])
def test_imported_dicom_reaches_the_network_as_in_training(tmp_path, window):
    assert roundtrip(tmp_path, window) == 24


def test_the_decoder_applies_pydicom_luts_as_displayed(tmp_path):
    """Each kind of file against values computed by hand (DICOM PS3.3 C.11.2.1.2.1's LINEAR window)."""
    study, series = generate_uid(), generate_uid()
    stored = (np.arange(12 * 20).reshape(12, 20) * 9).astype(np.int32)
    for kind in ("ct", "cr_inverted", "cr_lut", "cr_window"):
        write_study_image(tmp_path / kind, stored, study, series, "P", kind, 1)
    hu = stored - 1024.0
    window = lambda x, c, w: np.clip((x - (c - 0.5)) / (w - 1) + 0.5, 0, 1) * 255  # noqa: E731
    s = stored.astype(np.float64)
    by_hand = {"ct": window(hu, 40, 400), "cr_inverted": 255 - (s - s.min()) / (s.max() - s.min()) * 255,
               "cr_lut": np.minimum(255, np.clip(s, 0, 1023) // 3), "cr_window": window(s * 0.5, 600, 900)}
    for kind, expected in by_hand.items():
        pixels, _ = read_dicom_image(tmp_path / kind)
        assert pixels.dtype == np.uint8 and pixels.shape == (12, 20), kind
        assert np.array_equal(pixels, np.rint(expected).astype(np.uint8)), kind
    # a window given (fedlabels import --window, a bundle's dicom_window) replaces the file's own
    assert np.array_equal(read_dicom_image(tmp_path / "ct", "brain")[0], np.rint(window(hu, 40, 80)).astype(np.uint8))
    rgb = read_dicom_image(tmp_path / "ct", "multi")[0]
    assert rgb.shape == (12, 20, 3)
    assert np.array_equal(rgb[..., 2], np.rint(window(hu, 600, 2800)).astype(np.uint8))
    with pytest.raises(DicomError, match="unknown window 'lung'"):
        parse_window("lung")
    with pytest.raises(DicomError, match="field 'PixelData' missing"):
        ds = pydicom.dcmread(tmp_path / "ct")
        del ds.PixelData
        ds.save_as(tmp_path / "nopixels")
        read_dicom_image(tmp_path / "nopixels")
