"""DICOM in, DICOM out for the exported clinical bundles (``fedlabels.bundle.dicom``).

What a clinical engineer would check before plugging a bundle into a PACS:

* DICOM files are found by content (no ``.dcm`` needed) and read as they are
  displayed: rescale (modality LUT) and window / VOI LUT applied, MONOCHROME1
  inverted -- against pixel values computed by hand;
* a federated classification run (FedAvg in the nvflare simulator) and a FedMix
  segmentation run, exported with ``fedlabels export``, run with ``python -m
  monai.bundle run`` and ``configs/inference_dicom.json`` on generated DICOM
  series: the SR and the SEG read back with pydicom and highdicom, reference
  exactly the input instances, the SR's decisions are the CSV's, the SEG is the
  PNG mask of the same picture, a non-DICOM input gives no DICOM object, an
  unreadable DICOM is named in one warning and the run goes on.

The two federated runs are test_flare's and test_fedmix_flare's (their fixtures,
imported): in one session each job runs in the simulator once.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
import pytest
import torch
from monai.bundle import ConfigParser
from monai.bundle import run as bundle_run
from PIL import Image
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import (ComputedRadiographyImageStorage, CTImageStorage, ExplicitVRLittleEndian,
                         VLPhotographicImageStorage, generate_uid)

import dciodvfy
from fedlabels import cli
from fedlabels.bundle import bundle_path
from fedlabels.bundle import data as bundle_data
from fedlabels.bundle.dicom import is_dicom
from fedlabels.data.dicom import read_dicom_image
from fedlabels.bundle.workflows import export_bundle

# test_flare's cxr scenario and job runs, test_fedmix_flare's lesion scenarios and runs: the same
# fixtures here, so a session simulates each job once
from test_fedmix_flare import lesion, runs  # noqa: F401  (pytest fixtures)
from test_flare import data, job_runs  # noqa: F401  (pytest fixtures)

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------ DICOM inputs


def write_image(path, pixels, study, series, *, instance=1, sop=None, photometric=None, slope=None, intercept=None,
                center=None, width=None, geometry=False, sop_class=None, frame_of_reference=None) -> str:
    """A DICOM image as a scanner writes it (patient, study, series, instance); ``pixels`` uint16
    grey (rows x columns) or uint8 RGB (rows x columns x 3). Returns its SOP Instance UID."""
    pixels = np.asarray(pixels)
    rgb = pixels.ndim == 3
    sop = sop or generate_uid()
    sop_class = sop_class or (VLPhotographicImageStorage if rgb else CTImageStorage)
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = sop_class, sop
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID, ds.StudyInstanceUID, ds.SeriesInstanceUID = sop_class, sop, study, series
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


def full_range(picture) -> np.ndarray:
    """A grey picture stretched to 0..255 (uint8): as a DICOM of it without a window is displayed."""
    p = np.asarray(picture, dtype=np.float64)
    return np.rint((p - p.min()) / (p.max() - p.min()) * 255).astype(np.uint8)


def loaded(path, bundle="cxr_densenet121") -> np.ndarray:
    """The image as the bundle's ``LoadImaged`` reads it (x, y order: MONAI's 2D convention)."""
    parser = ConfigParser()
    parser.read_config(str(bundle_path(bundle) / "configs" / "inference.json"))
    parser.update({"bundle_root": str(bundle_path(bundle))})
    load = parser.get_parsed_content("preprocessing").transforms[0]
    return np.asarray(load({"image": str(path)})["image"])


def test_dicom_files_are_found_by_content_and_read_as_displayed(tmp_path, caplog):
    study, series = generate_uid(), generate_uid()
    stored = (np.arange(12 * 20, dtype=np.uint16).reshape(12, 20) * 9)  # 0 .. 2151, not square
    folder = tmp_path / "in"
    folder.mkdir()
    # no suffix, no LUTs: the stored values, transposed to x, y
    write_image(folder / "IM0001", stored, study, series)
    # rescale and window (CT-style): HU = 2 s - 1024, then the LINEAR window of PS3.3 C.11.2.1.2.1, c 40, w 400
    write_image(folder / "IM0002", stored, study, series, instance=2, slope=2, intercept=-1024, center=40, width=400)
    # MONOCHROME1 (0 = white): inverted; windowed, inverted within the window
    write_image(folder / "IM0003", stored, study, series, instance=3, photometric="MONOCHROME1")
    write_image(folder / "IM0004.dcm", stored, study, series, instance=4, photometric="MONOCHROME1", slope=2,
                intercept=-1024, center=40, width=400)
    write_unreadable(folder / "IM0005", study, series)
    (folder / "notes").write_text("not an image, no suffix")
    (folder / "header.bin").write_bytes(b"\x08\x00" + os.urandom(200))  # looks like a bare data set, is not one

    names = [Path(item["image"]).name for item in bundle_data.image_files(folder)]
    assert names == ["IM0001", "IM0002", "IM0003", "IM0004.dcm", "IM0005"]
    assert not is_dicom(folder / "notes") and not is_dicom(folder / "header.bin")

    hu = stored * 2.0 - 1024
    # below c - w/2 black, above white, linear between; on the 0-255 scale of the 8-bit training images, rounded
    windowed = np.rint(np.clip((hu - 39.5) / 399 + 0.5, 0, 1) * 255)
    s = stored.astype(np.float64)
    stretched = np.rint((s - s.min()) / (s.max() - s.min()) * 255)  # no window: the image's own range
    by_hand = {"IM0001": stretched, "IM0002": windowed, "IM0003": 255 - stretched, "IM0004.dcm": 255 - windowed}
    for name, expected in by_hand.items():
        pixels, _ = read_dicom_image(folder / name)
        assert pixels.shape == (12, 20) and np.array_equal(pixels, expected), name
        assert np.array_equal(loaded(folder / name), expected.T), name  # what the bundle's reader gives
    assert windowed.min() == 0 and windowed.max() == 255 and 0 < np.mean(windowed) < 255  # clipped at both ends

    # the unreadable one: one warning line naming it, the others go on
    parser = ConfigParser()
    parser.read_config(str(bundle_path("cxr_densenet121") / "configs" / "inference.json"))
    parser.update({"bundle_root": str(bundle_path("cxr_densenet121")), "dataset_dir": str(folder), "image_size": 32})
    with caplog.at_level("WARNING", logger="fedlabels.bundle"):
        ds = parser.get_parsed_content("dataset")
    assert len(ds) == 4 and ds.refused == [str((folder / "IM0005").resolve())]
    named = [r.getMessage() for r in caplog.records if "IM0005" in r.getMessage()]
    assert len(named) == 1 and named[0].startswith(f"cannot read {(folder / 'IM0005').resolve()}: "), named


def test_a_voi_lut_sequence_is_applied_over_its_output_range(tmp_path):
    """A VOI LUT (not a window): values below its first input map to its first entry, above its last
    to its last; output scaled from its bit depth's range to 0-255."""
    from pydicom.sequence import Sequence

    stored = (np.arange(10 * 30, dtype=np.uint16).reshape(10, 30) % 400)
    write_image(tmp_path / "lut", stored, generate_uid(), generate_uid())
    ds = pydicom.dcmread(tmp_path / "lut")
    item = Dataset()
    item.LUTDescriptor = [256, 10, 8]  # 256 entries, first input value 10, 8 bits
    item.add_new(0x00283006, "US", [255 - v for v in range(256)])  # an inverting LUT
    ds.VOILUTSequence = Sequence([item])
    ds.save_as(tmp_path / "lut")
    pixels, _ = read_dicom_image(tmp_path / "lut")
    assert np.allclose(pixels, 255 - np.clip(stored.astype(float) - 10, 0, 255), atol=1e-4)


# ------------------------------------------------- outputs, no simulator


def _csv(path) -> dict:
    with open(path) as fh:
        return {Path(r["image"]).name: r for r in csv.DictReader(fh)}


def _dicom_outputs(out) -> list:
    return sorted(p for p in Path(out).rglob("*") if p.is_file() and is_dicom(p))


def test_multiclass_sr_decides_the_most_probable_class_and_non_dicom_inputs_give_no_dicom_object(tmp_path, caplog):
    """medmnist_cnn (multi-class, RGB) with its initial weights: the SR's present/absent per class
    is the CSV's ``predicted``; an image no SR can reference (no study UID) is named in one warning with
    the field, the others are reported; a folder of PNGs run with the DICOM option writes no DICOM object."""
    torch.manual_seed(0)
    from fedlabels.bundle import network

    exp = export_bundle("medmnist_cnn", network("medmnist_cnn").state_dict(), tmp_path / "exp")
    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 256, (28, 28, 3), dtype=np.uint8) for _ in range(2)]
    inputs, study = tmp_path / "in", generate_uid()
    inputs.mkdir()
    uids = {}
    for k, pic in enumerate(pictures):
        Image.fromarray(pic).save(inputs / f"pic{k}.png")
        uids[f"photo{k}"] = write_image(inputs / f"photo{k}", pic, study, generate_uid())
    write_image(inputs / "nostudy", pictures[0], study, generate_uid())
    ds = pydicom.dcmread(inputs / "nostudy")
    del ds.StudyInstanceUID
    ds.save_as(inputs / "nostudy")
    configs = [str(exp / "configs" / "inference.json"), str(exp / "configs" / "inference_dicom.json")]
    with caplog.at_level("WARNING", logger="fedlabels.bundle"):
        bundle_run(config_file=configs, logging_file=False, bundle_root=str(exp), dataset_dir=str(inputs),
                   output_dir=str(tmp_path / "out"), device="cpu")
    refused = [r.getMessage() for r in caplog.records if "nostudy" in r.getMessage()]
    assert refused == [f"cannot write a DICOM SR for {(inputs / 'nostudy').resolve()}: field 'StudyInstanceUID' "
                       "missing; no DICOM object can reference this image"]
    rows = _csv(tmp_path / "out" / "predictions.csv")
    assert "nostudy" in rows  # its CSV row stays
    classes = json.loads((exp / "configs" / "metadata.json").read_text())["class_names"]
    srs = _dicom_outputs(tmp_path / "out")
    assert [p.name for p in srs] == [f"sr_{study}.dcm"]
    dciodvfy.check(srs)
    groups = hd.sr.srread(srs[0]).content.get_image_measurement_groups()
    assert len(groups) == 2
    for group in groups:
        uid = group.source_images[0].referenced_sop_instance_uid
        name = next(n for n, u in uids.items() if u == uid)
        decided = {q.name.meaning: q.value.meaning for q in group.get_qualitative_evaluations()}
        assert decided == {c: "Present" if c == rows[name]["predicted"] else "Absent" for c in classes}
        probs = {m.name.meaning: m.value for m in group.get_measurements()}
        assert probs == {f"Probability of {c}": pytest.approx(float(rows[name][c]), abs=1e-6) for c in classes}
        k = name[-1]
        assert [float(rows[name][c]) for c in classes] == pytest.approx(
            [float(rows[f"pic{k}.png"][c]) for c in classes], abs=1e-5)  # the DICOM is the PNG's picture

    pngs = tmp_path / "png-only"
    pngs.mkdir()
    for k in range(2):
        Image.fromarray(pictures[k]).save(pngs / f"pic{k}.png")
    bundle_run(config_file=configs, logging_file=False, bundle_root=str(exp), dataset_dir=str(pngs),
               output_dir=str(tmp_path / "out-png"), device="cpu")
    assert len(_csv(tmp_path / "out-png" / "predictions.csv")) == 2
    assert _dicom_outputs(tmp_path / "out-png") == [] and not (tmp_path / "out-png" / "dicom").exists()


# --------------------------------------------- federated runs, exported


def _infer_dicom(exp, inputs, out) -> str:
    """The documented command line: both configs, the bundle's own metadata, on the CPU."""
    configs = f"['{exp / 'configs' / 'inference.json'}','{exp / 'configs' / 'inference_dicom.json'}']"
    proc = subprocess.run([sys.executable, "-m", "monai.bundle", "run", "--config_file", configs,
                           "--bundle_root", str(exp), "--dataset_dir", str(inputs), "--output_dir", str(out),
                           "--device", "cpu"], capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _algorithm_params(items) -> dict:
    """Name, version and parameters of an SR's algorithm identification (TID 4019) content items."""
    out = {"parameters": []}
    for item in items:
        meaning = item.ConceptNameCodeSequence[0].CodeMeaning
        if meaning == "Algorithm Name":
            out["name"] = item.TextValue
        elif meaning == "Algorithm Version":
            out["version"] = item.TextValue
        elif meaning == "Algorithm Parameters":
            out["parameters"].append(item.TextValue)
    return out


def _walk(items):
    for item in items:
        yield item
        yield from _walk(getattr(item, "ContentSequence", []))


@pytest.mark.simulator
def test_a_federated_classification_run_reports_dicom_findings_as_a_structured_report(
        job_runs, data, tmp_path):  # noqa: F811
    run_dir, _ = job_runs("fedavg_cxr")
    exp = tmp_path / "cxr"
    assert cli.main(["export", "--bundle", "cxr_densenet121", "--run", str(run_dir), "--data", str(data),
                     "--out", str(exp)]) == 0
    meta = json.loads((exp / "configs" / "metadata.json").read_text())
    classes, thresholds = meta["class_names"], meta["decision_thresholds"]
    assert meta["provenance"]["method"] == "fedavg" and meta["provenance"]["rounds"] == 2
    assert meta["provenance"]["model_after_rounds"] in (0, 1, 2)

    src = sorted((Path(data) / "test" / "images").glob("*.png"))[:3]
    # grey radiographs over the full 0-255 range: a DICOM without a window is displayed over its own range
    pics = [full_range(np.asarray(Image.open(f))) for f in src]
    assert all(p.ndim == 2 for p in pics)
    inputs = tmp_path / "in"
    inputs.mkdir()
    study_a, study_b, series_a, series_b = (generate_uid() for _ in range(4))
    sops = {}
    # study A, one CR series: the picture as stored, stored inverted (MONOCHROME1), and a windowed one whose
    # few metal-bright pixels the window clips (its PNG twin has them at 255); the first two have no suffix
    sops["IM0001"] = write_image(inputs / "IM0001", pics[0], study_a, series_a,
                                 sop_class=ComputedRadiographyImageStorage)
    inv = 255 - pics[1].astype(np.uint16)
    sops["IM0002"] = write_image(inputs / "IM0002", inv, study_a, series_a, instance=2, photometric="MONOCHROME1",
                                 sop_class=ComputedRadiographyImageStorage)
    bright = pics[2].copy()
    bright[:4, :4] = 255
    stored = pics[2].astype(np.uint16) * 2 + 1000  # HU = stored / 2 - 500 = the picture
    stored[:4, :4] = 9000  # 4000 "HU": far above the window
    sops["IM0003.dcm"] = write_image(inputs / "IM0003.dcm", stored, study_a, series_a, instance=3, slope=0.5,
                                     intercept=-500, center=128, width=256,  # the LINEAR window: 0..255 HU -> 0..255
                                     sop_class=ComputedRadiographyImageStorage)
    # study B: the first picture again, in a series of its own, and a file cut off mid-copy
    (inputs / "b").mkdir()
    sops["1.2.3.4"] = write_image(inputs / "b" / "1.2.3.4", pics[0], study_b, series_b)
    write_unreadable(inputs / "b" / "IM9999", study_b, series_b)
    # the same pictures as PNG, and a text file: no DICOM object may come from them
    Image.fromarray(pics[0]).save(inputs / "p0.png")
    Image.fromarray(pics[1]).save(inputs / "p1.png")
    Image.fromarray(bright).save(inputs / "p2.png")
    (inputs / "README").write_text("study notes")

    assert np.allclose(read_dicom_image(inputs / "IM0003.dcm")[0], bright, atol=1e-3)  # by hand: the PNG twin

    out = tmp_path / "out"
    log = _infer_dicom(exp, inputs, out)
    broken = str((inputs / "b" / "IM9999").resolve())
    assert len([line for line in log.splitlines() if f"cannot read {broken}" in line]) == 1, log[-3000:]

    rows = _csv(out / "predictions.csv")
    assert sorted(rows) == sorted(["IM0001", "IM0002", "IM0003.dcm", "1.2.3.4", "p0.png", "p1.png", "p2.png"])
    probs = {n: np.array([float(r[c]) for c in classes]) for n, r in rows.items()}
    # read as displayed: MONOCHROME1 inverted back, rescale + window applied (unwindowed, the 4000s would
    # squash the picture and change the probabilities)
    twins = {"IM0001": "p0.png", "IM0002": "p1.png", "IM0003.dcm": "p2.png", "1.2.3.4": "p0.png"}
    for dicom_name, png in twins.items():
        assert np.allclose(probs[dicom_name], probs[png], atol=1e-5), dicom_name

    written = _dicom_outputs(out)
    assert [p.name for p in written] == sorted([f"sr_{study_a}.dcm", f"sr_{study_b}.dcm"])
    dciodvfy.check(written)
    path_of = {sop: name for name, sop in sops.items()}
    for path, study, names in ((out / "dicom" / f"sr_{study_a}.dcm", study_a, ["IM0001", "IM0002", "IM0003.dcm"]),
                               (out / "dicom" / f"sr_{study_b}.dcm", study_b, ["1.2.3.4"])):
        ds = pydicom.dcmread(path)
        assert ds.Modality == "SR" and ds.StudyInstanceUID == study and ds.PatientID == "P-24"
        assert ds.VerificationFlag == "UNVERIFIED" and ds.PreliminaryFlag == "PRELIMINARY"
        evidence = [sop.ReferencedSOPInstanceUID for st in ds.CurrentRequestedProcedureEvidenceSequence
                    for se in st.ReferencedSeriesSequence for sop in se.ReferencedSOPSequence]
        assert sorted(evidence) == sorted(sops[n] for n in names)
        sr = hd.sr.srread(path)
        groups = sr.content.get_image_measurement_groups()
        assert sorted(g.source_images[0].referenced_sop_instance_uid for g in groups) == sorted(sops[n] for n in names)
        for group in groups:
            name = path_of[group.source_images[0].referenced_sop_instance_uid]
            measured = {m.name.meaning: m for m in group.get_measurements()}
            for c in classes:  # the probability, referencing its image
                m = measured[f"Probability of {c}"]
                assert m.value == pytest.approx(float(rows[name][c]), abs=1e-6)
                assert m.referenced_images[0].referenced_sop_instance_uid == sops[name]
            # each finding under its standard code (SNOMED CT, the bundle's class_codes)
            decided = {(q.name.scheme_designator, q.name.value): q.value.meaning
                       for q in group.get_qualitative_evaluations()}
            coded = {c: (meta["class_codes"][c]["scheme"], meta["class_codes"][c]["code"]) for c in classes}
            assert all(scheme == "SCT" for scheme, _ in coded.values())
            expected = {coded[c]: "Present" if rows[name][f"{c}_positive"] == "1" else "Absent"
                        for c in classes if rows[name][f"{c}_positive"] != ""}  # no threshold: no decision
            assert decided == expected and expected, name
            alg = _algorithm_params(_walk(group[0].ContentSequence))
            assert alg["name"] == meta["name"] and alg["version"] == meta["version"]
            assert {"method=fedavg", "rounds=2"} <= set(alg["parameters"])
            assert f"model_after_rounds={meta['provenance']['model_after_rounds']}" in alg["parameters"]
            for c in classes:
                cut = thresholds[c]
                assert f"threshold {c}={'none' if cut is None else f'{cut:.6g}'}" in alg["parameters"]


@pytest.mark.simulator
def test_a_fedmix_segmentation_run_writes_dicom_seg_equal_to_its_png_masks(runs, lesion, tmp_path):  # noqa: F811
    run_dir = runs("fedmix_lesion")
    exp = tmp_path / "lesion"
    assert cli.main(["export", "--bundle", "lesion_unet", "--run", str(run_dir), "--data", str(lesion["bbox"]),
                     "--out", str(exp)]) == 0
    meta = json.loads((exp / "configs" / "metadata.json").read_text())
    assert meta["provenance"]["method"] == "fedmix" and meta["class_names"] == ["lesion"]

    src = sorted((Path(lesion["bbox"]) / "test" / "images").glob("*.png"))[:3]
    pics = [np.asarray(Image.open(f))[..., :3] for f in src]
    inputs = tmp_path / "in"
    inputs.mkdir()
    study, ct_series, photo_series = generate_uid(), generate_uid(), generate_uid()
    frame = generate_uid()
    sops, twins = {}, {}
    # a grey cross-sectional series of two slices (one frame of reference): one SEG of two frames
    for k in range(2):
        grey = full_range(pics[k].astype(np.float64).mean(-1))
        sops[f"slice{k}"] = write_image(inputs / f"slice{k}", grey, study, ct_series, instance=k + 1,
                                        geometry=True, frame_of_reference=frame)
        Image.fromarray(grey).save(inputs / f"grey{k}.png")
        twins[f"slice{k}"] = f"grey{k}"
    # a colour photograph (no frame of reference): a SEG of its own
    sops["photo.dcm"] = write_image(inputs / "photo.dcm", pics[2], study, photo_series)
    Image.fromarray(pics[2]).save(inputs / "colour2.png")
    twins["photo.dcm"] = "colour2"

    out = tmp_path / "out"
    _infer_dicom(exp, inputs, out)
    written = _dicom_outputs(out)
    assert [p.name for p in written] == sorted([f"seg_{ct_series}.dcm", f"seg_{sops['photo.dcm']}.dcm"])
    dciodvfy.check(written)
    # PNG inputs keep their PNG masks; DICOM inputs get the SEG instead of a mask file
    assert sorted(p.name for p in out.glob("*_seg.*")) == ["colour2_seg.png", "grey0_seg.png", "grey1_seg.png"]
    cut = meta["decision_thresholds"]["lesion"]
    for path, names in ((out / "dicom" / f"seg_{ct_series}.dcm", ["slice0", "slice1"]),
                        (out / "dicom" / f"seg_{sops['photo.dcm']}.dcm", ["photo.dcm"])):
        ds = pydicom.dcmread(path)
        assert ds.Modality == "SEG" and ds.SegmentationType == "BINARY" and ds.StudyInstanceUID == study
        referenced = [i.ReferencedSOPInstanceUID for s in ds.ReferencedSeriesSequence
                      for i in s.ReferencedInstanceSequence]
        assert sorted(referenced) == sorted(sops[n] for n in names)
        segment = ds.SegmentSequence[0]
        assert segment.SegmentLabel == "lesion" and segment.SegmentAlgorithmType == "AUTOMATIC"
        kind = segment.SegmentedPropertyTypeCodeSequence[0]
        assert (kind.CodingSchemeDesignator, kind.CodeValue, kind.CodeMeaning) == ("SCT", "52988006", "Lesion")
        alg = segment.SegmentationAlgorithmIdentificationSequence[0]
        assert alg.AlgorithmName == meta["name"] and alg.AlgorithmVersion == meta["version"]
        assert "method=fedmix" in alg.AlgorithmParameters and "rounds=2" in alg.AlgorithmParameters
        assert f"threshold={'0.5 (default)' if cut is None else f'{cut:.6g}'}" in alg.AlgorithmParameters
        seg = hd.seg.segread(path)
        masks = seg.get_pixels_by_source_instance(source_sop_instance_uids=[sops[n] for n in names],
                                                  segment_numbers=[1])
        for name, mask in zip(names, masks):
            png = np.asarray(Image.open(out / f"{twins[name]}_seg.png")) > 0
            assert mask.shape[:2] == png.shape and np.array_equal(mask[..., 0] > 0, png), name
    # the comparison above means something: the masks hold lesion and background
    assert any(0 < (np.asarray(Image.open(p)) > 0).mean() < 1 for p in out.glob("*_seg.png"))


# ------------------------------------------------- codes, and dciodvfy on every object


def _sources(folder) -> dict:
    """A CR radiograph, a colour photograph (no patient coordinates) and a two-slice CT series."""
    folder.mkdir(parents=True, exist_ok=True)
    study, rng = generate_uid(), np.random.default_rng(5)
    write_image(folder / "cr", rng.integers(0, 4000, (16, 16)), study, generate_uid(), center=2000, width=4000,
                sop_class=ComputedRadiographyImageStorage)
    write_image(folder / "photo", rng.integers(0, 256, (16, 16, 3)), study, generate_uid())
    series, frame = generate_uid(), generate_uid()
    for k in range(2):
        write_image(folder / f"ct{k}", rng.integers(0, 2000, (16, 16)), study, series, instance=k + 1, geometry=True,
                    frame_of_reference=frame, slope=1, intercept=-1024)
    from fedlabels.bundle.dicom import _header

    return {p.name: _header(p) for p in folder.iterdir()}


def _codes_of(ds) -> set:
    return {(item.CodingSchemeDesignator, item.CodeValue) for item in _walk_all(ds) if "CodeValue" in item}


def _walk_all(ds):
    for elem in ds:
        if elem.VR == "SQ":
            for item in elem.value:
                yield item
                yield from _walk_all(item)


def test_seg_and_sr_carry_the_bundles_standard_codes_and_dciodvfy_finds_no_error(tmp_path):
    """The shipped bundles' classes under their SNOMED CT codes (metadata.json's class_codes) in SR findings
    and SEG segment types; a class without a code (medmnist_cnn's synthetic shapes) and a hospital's own
    scheme keep private codes, each object declaring its private schemes (CodingSchemeIdentificationSequence);
    the SEG of a photograph has PatientOrientation; dciodvfy reports no error on any of them."""
    from fedlabels.bundle.dicom import ClassCodes, DicomSegWriter, DicomSRWriter

    dciodvfy.require_dciodvfy()
    src = _sources(tmp_path / "in")
    out = tmp_path / "out"
    written = []

    cxr = json.loads((bundle_path("cxr_resnet18") / "configs" / "metadata.json").read_text())
    classes = cxr["class_names"]
    probs = [0.1, 0.7, 0.2, 0.9, 0.3, 0.6]
    sr = DicomSRWriter(out, classes, metadata=cxr, thresholds={c: 0.5 for c in classes}).report([src["cr"]], [probs])
    written.append(bundle_dicom_save(sr, out / "cxr_sr.dcm"))
    found = {(q.name.scheme_designator, q.name.value): q.value.meaning
             for q in hd.sr.srread(written[-1]).content.get_image_measurement_groups()[0].get_qualitative_evaluations()}
    assert found == {("SCT", "409609008"): "Absent", ("SCT", "60046008"): "Present", ("SCT", "46621007"): "Absent",
                     ("SCT", "27925004"): "Present", ("SCT", "95436008"): "Absent", ("SCT", "36118008"): "Present"}
    # the probabilities keep the private code (no standard concept names "probability of <finding>"): declared
    schemes = {i.CodingSchemeDesignator: i for i in pydicom.dcmread(written[-1]).CodingSchemeIdentificationSequence}
    assert list(schemes) == ["99FEDLABELS"] and schemes["99FEDLABELS"].CodingSchemeResponsibleOrganization

    lesion = json.loads((bundle_path("lesion_unet") / "configs" / "metadata.json").read_text())
    seg_writer = DicomSegWriter(out, ["lesion"], metadata=lesion)
    mask = np.zeros((16, 16, 1), bool)
    mask[3:9, 4:12] = True
    for name, sources in (("photo_seg.dcm", [src["photo"]]), ("ct_seg.dcm", [src["ct0"], src["ct1"]])):
        seg = seg_writer.segmentation(sources, [mask] * len(sources))
        written.append(bundle_dicom_save(seg, out / name))
        ds = pydicom.dcmread(written[-1])
        segment = ds.SegmentSequence[0]
        assert (segment.SegmentedPropertyTypeCodeSequence[0].CodingSchemeDesignator,
                segment.SegmentedPropertyTypeCodeSequence[0].CodeValue) == ("SCT", "52988006")
        assert segment.SegmentedPropertyCategoryCodeSequence[0].CodeValue == "49755003"
        assert "CodingSchemeIdentificationSequence" not in ds  # standard codes only: nothing to declare
        assert ("PatientOrientation" in ds) == (name == "photo_seg.dcm")  # Type 2C: no patient coordinates

    # a hospital maps a class to a DICOM code and another to its own scheme; a class left unmapped stays private
    own = {"class_codes": {"disc": {"code": "112178", "scheme": "DCM", "meaning": "Coin"},
                           "ring": {"code": "R-17", "scheme": "99STMARY", "meaning": "Ring artefact"}},
           "coding_schemes": {"99STMARY": {"name": "St Mary imaging findings",
                                           "responsible_organization": "St Mary Hospital"}}}
    shapes = ["disc", "ring", "square"]
    sr = DicomSRWriter(out, shapes, metadata=own, decision="argmax").report([src["photo"]], [[0.2, 0.5, 0.3]])
    written.append(bundle_dicom_save(sr, out / "own_sr.dcm"))
    ds = pydicom.dcmread(written[-1])
    assert {("DCM", "112178"), ("99STMARY", "R-17"), ("99FEDLABELS", "square")} <= _codes_of(ds)
    assert sorted(i.CodingSchemeDesignator for i in ds.CodingSchemeIdentificationSequence) == ["99FEDLABELS",
                                                                                               "99STMARY"]
    seg = DicomSegWriter(out, shapes, metadata=own).segmentation([src["photo"]], [np.repeat(mask, 3, -1)])
    written.append(bundle_dicom_save(seg, out / "own_seg.dcm"))

    reports = dciodvfy.check(written)
    assert len(reports) == len(written) == 5
    print("\n".join(f"dciodvfy {p.name}:\n{r}" for p, r in zip(written, reports)))

    # a malformed mapping is one error naming the file and the field
    with pytest.raises(ValueError, match=r"metadata.json: field 'class_codes.ring': scheme '99OTHER' is neither"):
        ClassCodes({"class_codes": {"ring": {"code": "1", "scheme": "99OTHER", "meaning": "x"}}}, shapes)
    with pytest.raises(ValueError, match=r"metadata.json: field 'class_codes': codes for unknown classes \['star'\]"):
        ClassCodes({"class_codes": {"star": {"code": "1", "scheme": "SCT", "meaning": "x"}}}, shapes)
    with pytest.raises(ValueError, match=r"metadata.json: field 'class_codes.disc': expected"):
        ClassCodes({"class_codes": {"disc": {"code": "1"}}}, shapes)


def bundle_dicom_save(ds, path) -> Path:
    from fedlabels.bundle.dicom import _save

    return _save(ds, Path(path))


# ------------------------------------------------- docs/clinical-bundle.md, as written

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "clinical-bundle.md"


def _guide_commands() -> list:
    import re
    import shlex

    text = GUIDE.read_text()
    lines = [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def test_the_guides_class_codes_example_is_what_the_writers_read():
    """The metadata example of docs/clinical-bundle.md, given to a chest X-ray bundle's classes: SNOMED CT for
    effusion, the hospital's declared scheme for nodule, the private default for the others."""
    import re

    from fedlabels.bundle.dicom import ClassCodes

    (example,) = re.findall(r"```json\n(.*?)```", GUIDE.read_text(), re.S)
    classes = json.loads((bundle_path("cxr_resnet18") / "configs" / "metadata.json").read_text())["class_names"]
    codes = ClassCodes(json.loads(example), classes)
    assert (codes.finding["effusion"].scheme_designator, codes.finding["effusion"].value) == ("SCT", "60046008")
    assert (codes.finding["nodule"].scheme_designator, codes.finding["nodule"].value) == ("99STMARY", "N-12")
    assert codes.finding["pneumothorax"].scheme_designator == "99FEDLABELS"
    assert [i.CodingSchemeDesignator for i in codes.declarations(["SCT", "99STMARY", "99FEDLABELS"])] == \
        ["99FEDLABELS", "99STMARY"]


@pytest.mark.simulator
def test_the_clinical_bundle_guide_runs_as_written(job_runs, data, tmp_path):  # noqa: F811
    """Every command of docs/clinical-bundle.md, its placeholders filled in: the export of a FedAvg run, its
    inference on PNG and DICOM inputs, the DICOM objects (dciodvfy), and a FedBN hospital's own export."""
    run_dir, _ = job_runs("fedavg_cxr")
    fedbn_dir, _ = job_runs("fedbn_cxr")
    state = fedbn_dir.parents[2] / "ws.state" / json.loads((fedbn_dir / "progress.json").read_text())["run"]
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    src = sorted((Path(data) / "test" / "images").glob("*.png"))[:2]
    study, series = generate_uid(), generate_uid()
    for k, f in enumerate(src):
        pic = full_range(np.asarray(Image.open(f)))
        Image.fromarray(pic).save(inputs / f"p{k}.png")
        write_image(inputs / f"IM{k}", pic, study, series, instance=k + 1, sop_class=ComputedRadiographyImageStorage)
    places = {"RESULT/workspace": str(run_dir), "SCENARIO": str(data), "/images": str(inputs),
              "/dicom/incoming": str(inputs), "RUN": str(fedbn_dir),
              "fedlabels_state/RUN_NAME/hospital-a": str(state / "site-1")}
    commands = _guide_commands()
    assert [c[:2] for c in commands] == [["fedlabels", "export"], ["python", "-m"], ["python", "-m"],
                                         ["fedlabels", "export"]], commands
    for k, argv in enumerate(commands):
        argv = [places.get(a, f"predictions-{k}" if a == "/predictions" else a) for a in argv]
        if argv[0] == "fedlabels":
            assert subprocess.run([sys.executable, "-m", "fedlabels.cli", *argv[1:]], cwd=tmp_path, env=ENV,
                                  capture_output=True, text=True, timeout=600).returncode == 0, argv
        else:
            proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=ENV, capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, (argv, proc.stderr[-3000:])
    assert len(_csv(tmp_path / "predictions-1" / "predictions.csv")) == 4  # two PNGs, two DICOMs
    srs = _dicom_outputs(tmp_path / "predictions-2")
    assert [p.name for p in srs] == [f"sr_{study}.dcm"]
    dciodvfy.check(srs)
    assert (tmp_path / "deploy" / "hospital-a" / "models" / "model.pt").is_file()
