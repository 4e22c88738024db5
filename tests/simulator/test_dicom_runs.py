"""DICOM outputs of bundles exported from federated runs in the real simulator, and docs/clinical-bundle.md run as written (the DICOM readers and writers themselves are tests/unit/test_dicom_outputs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
import pytest
from PIL import Image
from pydicom.uid import ComputedRadiographyImageStorage, generate_uid

import dciodvfy
from fedlabels import cli
from fedlabels.data.dicom import read_dicom_image

# test_flare's cxr scenario and job runs, test_fedmix_flare's lesion scenarios and runs: the same
# fixtures here, so a session simulates each job once
from dicom_files import GUIDE, _csv, _dicom_outputs, write_image, write_unreadable
from helpers import one_cpu_thread  # noqa: F401  (autouse fixture)
from test_fedmix_flare import lesion, runs  # noqa: F401  (pytest fixtures)
from test_flare_runs import data, job_runs  # noqa: F401  (pytest fixtures)




ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def full_range(picture) -> np.ndarray:
    """A grey picture stretched to 0..255 (uint8): as a DICOM of it without a window is displayed."""
    p = np.asarray(picture, dtype=np.float64)
    return np.rint((p - p.min()) / (p.max() - p.min()) * 255).astype(np.uint8)


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


def _guide_commands() -> list:
    import re
    import shlex

    text = GUIDE.read_text()
    lines = [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


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
