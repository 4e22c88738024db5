"""DICOM in, DICOM out for the exported clinical bundles (``fedlabels.bundle.dicom``).

What a clinical engineer would check before plugging a bundle into a PACS:

* DICOM files are found by content (no ``.dcm`` needed) and read as they are
  displayed: rescale (modality LUT) and window / VOI LUT applied, MONOCHROME1
  inverted -- against pixel values computed by hand;
* (tests/simulator/test_dicom_runs.py) a federated classification run (FedAvg in the nvflare simulator) and a FedMix
  segmentation run, exported with ``fedlabels export``, run with ``python -m
  monai.bundle run`` and ``configs/inference_dicom.json`` on generated DICOM
  series: the SR and the SEG read back with pydicom and highdicom, reference
  exactly the input instances, the SR's decisions are the CSV's, the SEG is the
  PNG mask of the same picture, a non-DICOM input gives no DICOM object, an
  unreadable DICOM is named in one warning and the run goes on.

The two federated runs are test_flare_runs's and test_fedmix_flare's (their fixtures,
imported there): in one session each job runs in the simulator once. The DICOM test inputs
and output readers both modules use are tests/dicom_files.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
import pytest
import torch
from monai.bundle import ConfigParser
from monai.bundle import run as bundle_run
from PIL import Image
from pydicom.dataset import Dataset
from pydicom.uid import ComputedRadiographyImageStorage, generate_uid

import dciodvfy
from fedlabels.bundle import bundle_path
from fedlabels.bundle import data as bundle_data
from fedlabels.bundle.dicom import is_dicom
from fedlabels.data.dicom import read_dicom_image
from fedlabels.bundle.workflows import export_bundle

# test_flare's cxr scenario and job runs, test_fedmix_flare's lesion scenarios and runs: the same
# fixtures here, so a session simulates each job once
from dicom_files import GUIDE, _csv, _dicom_outputs, write_image, write_unreadable
from helpers import one_cpu_thread  # noqa: F401  (autouse fixture)


# ------------------------------------------------------------ DICOM inputs


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
