"""DICOM in and DICOM out for the exported bundles' inference.

* ``is_dicom(path)`` -- a DICOM file by its content (the 128-byte preamble and
  ``DICM``, or a data set pydicom parses), whatever its name;
* ``DicomReader`` -- MONAI ``ImageReader`` giving ``LoadImage`` the pixels of
  ``data.dicom.read_dicom_image``, the one decoder import, prepare and training use too
  (as displayed, 0-255: modality LUT, the first VOI LUT or window, MONOCHROME1 inverted);
  ``LoadImageOrDicomd`` (``inference.json``) uses it for DICOM inputs, with the
  bundle's ``dicom_window`` (the window ``fedlabels import --window`` trained with);
* ``DicomSegWriter`` -- with ``configs/inference_dicom.json``, a segmentation
  bundle's masks as DICOM SEG (highdicom), one segment per class, referencing the
  source images: one SEG per series (an image without a frame of reference: its
  own SEG, which is all highdicom allows);
* ``DicomSRWriter`` -- a classification bundle's findings as a DICOM structured
  report (TID 1500 measurement report, highdicom), one per study: per image and
  class the probability and, where the class has a decision threshold, the
  decision (present / absent), each group referencing its image.

Both writers identify the algorithm from the bundle's ``metadata.json`` (name,
version, the federated run's method and rounds, the thresholds) and skip every
input that is not DICOM: a PNG or NIfTI never produces a DICOM object.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import torch
from monai.config import KeysCollection
from monai.data import ImageReader
from monai.transforms import MapTransform

from ..data.dicom import DicomError, has_voi, parse_window, read_dicom_image  # noqa: F401 (re-exported)

logger = logging.getLogger("fedlabels.bundle")

# Private coding scheme for what no standard code names: a class without a code in the bundle's metadata
# (its name), and the probability of a class (DICOM PS3.16 8.2: private schemes start with 99; each object
# using one declares it in its CodingSchemeIdentificationSequence, PS3.3 C.12.1.1.4).
SCHEME = "99FEDLABELS"
PRIVATE_SCHEMES = {SCHEME: {"name": "fedlabels class names and probabilities", "responsible_organization": "fedlabels"}}
# Schemes DICOM defines (PS3.16 Table 8-1) that need no declaration in an object.
STANDARD_SCHEMES = ("SCT", "DCM", "UCUM", "LN", "RADLEX", "NCIt", "FMA", "UMLS", "MSH", "ICD10", "SRT")
CODE_KEYS = ("code", "scheme", "meaning")
SEG_SERIES_NUMBER, SR_SERIES_NUMBER = 9901, 9902
# Type 2 attributes highdicom copies from a source image; a missing one is written empty.
TYPE2 = ("PatientName", "PatientID", "PatientBirthDate", "PatientSex", "AccessionNumber", "StudyID", "StudyDate",
         "StudyTime", "ReferringPhysicianName")
REQUIRED = ("SOPClassUID", "SOPInstanceUID", "StudyInstanceUID", "SeriesInstanceUID")


def is_dicom(path) -> bool:
    """True when ``path`` is a DICOM file by its content: the preamble + ``DICM``, or (a file
    without the preamble, as some old archives hold) a data set pydicom reads with an SOP
    class or an image size in it."""
    try:
        with open(path, "rb") as f:
            head = f.read(132)
    except OSError:
        return False
    if len(head) == 132 and head[128:] == b"DICM":
        return True
    # a bare data set starts with group 0002 or 0008 (little endian); anything else is not tried
    if head[:2] not in (b"\x02\x00", b"\x08\x00"):
        return False
    import pydicom

    try:
        ds = pydicom.dcmread(str(path), force=True, stop_before_pixels=True, specific_tags=["SOPClassUID", "Rows"])
    except Exception:  # noqa: BLE001 - not parseable: not DICOM
        return False
    return "SOPClassUID" in ds or "Rows" in ds


class DicomReader(ImageReader):
    """MONAI image reader for DICOM files recognised by content (``is_dicom``), pixels from
    ``data.dicom.read_dicom_image`` (``window``: None = the file's own VOI). Arrays follow MONAI's
    2D convention (x, y: PIL's and NIfTI's order), so the same picture as PNG and as DICOM gives the
    same tensor, and a DICOM file reaches the network as the PNG ``fedlabels import`` made of it."""

    def __init__(self, window=None):
        super().__init__()
        parse_window(window)  # an unknown window fails when the config is parsed, not per image
        self.window = window

    def verify_suffix(self, filename) -> bool:
        names = [filename] if isinstance(filename, (str, os.PathLike)) else list(filename)
        return len(names) == 1 and is_dicom(names[0])

    def read(self, data, **kwargs):
        names = [data] if isinstance(data, (str, os.PathLike)) else list(data)
        if len(names) != 1 or not is_dicom(names[0]):  # MONAI tries a given reader on anything
            raise ValueError(f"DicomReader reads one DICOM file, not {names}")
        return str(names[0])

    def get_data(self, img) -> tuple:
        pixels, ds = read_dicom_image(img, self.window)
        data = np.swapaxes(pixels, 0, 1)  # rows, columns -> x, y
        spacing = [float(v) for v in getattr(ds, "PixelSpacing", None) or [1.0, 1.0]]
        affine = np.diag([spacing[1], spacing[0], 1.0, 1.0])  # x steps along a row: column spacing
        meta = {"spatial_shape": np.asarray(data.shape[:2]), "affine": affine, "original_affine": affine.copy(),
                "original_channel_dim": -1 if data.ndim == 3 else float("nan"), "fedlabels_dicom": True}
        return data, meta


class LoadImageOrDicomd(MapTransform):
    """``LoadImaged(image_only=True)`` of ``inference.json``, except that a DICOM file (by content,
    whatever its name) is read by ``DicomReader``. Not ``LoadImaged(reader=DicomReader())``: with a
    reader given, MONAI stops choosing the others by suffix and tries each in turn, so a PNG could
    reach another reader (and another axis order) than the one training used."""

    def __init__(self, keys: KeysCollection, window=None, allow_missing_keys: bool = False):
        from monai.transforms import LoadImage

        super().__init__(keys, allow_missing_keys)
        self.default = LoadImage(image_only=True)
        self.dicom = LoadImage(reader=DicomReader(window), image_only=True)

    def __call__(self, data):
        d = dict(data)
        for key in self.key_iterator(d):
            path = d[key]
            dicom = isinstance(path, (str, os.PathLike)) and is_dicom(path)
            d[key] = (self.dicom if dicom else self.default)(path)
        return d


# ---------------------------------------------------------------- writers


def _header(path):
    """The source image's header for referencing, with the type 2 attributes highdicom copies."""
    import pydicom

    ds = pydicom.dcmread(str(path), force=True, stop_before_pixels=True)
    for name in REQUIRED:
        if not getattr(ds, name, None):
            raise ValueError(f"field '{name}' missing; no DICOM object can reference this image")
    for name in TYPE2:
        if name not in ds:
            setattr(ds, name, None)
    return ds


def _model_digest(model_file) -> str:
    if not model_file or not Path(model_file).is_file():
        return "unknown"
    h = hashlib.sha256()
    with open(model_file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _save(ds, path: Path) -> Path:
    """Write atomically: a half-written object must never look like a result to a PACS upload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    ds.save_as(str(tmp), enforce_file_format=True)
    os.replace(tmp, path)
    return path


class _DicomResults:
    """Collect each DICOM input's result over an inference run; write per study/series at the end."""

    kind = ""

    def __init__(self, output_dir, class_names, metadata: dict | None = None, model_file=None,
                 thresholds: dict | None = None, pred_key: str = "pred", image_key: str = "image"):
        self.output_dir, self.class_names = Path(str(output_dir)), [str(c) for c in class_names]
        self.metadata = dict(metadata or {})
        self.model_file = model_file
        self.thresholds = {str(k): (None if v is None else float(v)) for k, v in dict(thresholds or {}).items()}
        unknown = sorted(set(self.thresholds) - set(self.class_names))
        if unknown:
            raise ValueError(f"decision thresholds for unknown classes {unknown}; classes are {self.class_names}")
        self.codes = ClassCodes(self.metadata, self.class_names)  # a malformed entry fails here, at parse time
        self.pred_key, self.image_key = pred_key, image_key
        self.results: dict = {}
        self.written: list = []

    def attach(self, engine) -> None:
        from ignite.engine import Events

        engine.add_event_handler(Events.STARTED, self._reset)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._collect)
        engine.add_event_handler(Events.COMPLETED, self._write)

    def _reset(self, engine) -> None:
        self.results, self.written = {}, []

    def _collect(self, engine) -> None:
        batch, output = engine.state.batch, engine.state.output
        if isinstance(output, dict):  # not decollated
            items = [{self.pred_key: p, self.image_key: i}
                     for p, i in zip(output[self.pred_key], batch[self.image_key])]
        else:
            items = output
        for item in items:
            pred, img = item[self.pred_key], item.get(self.image_key)
            source = str((getattr(img, "meta", None) or getattr(pred, "meta", None) or {}).get("filename_or_obj", ""))
            if source and is_dicom(source):  # only a DICOM input gets a DICOM object
                self.results[source] = self.result(pred)

    def result(self, pred):
        raise NotImplementedError

    # what the objects say about the algorithm
    def algorithm(self) -> dict:
        meta, prov = self.metadata, self.metadata.get("provenance") or {}
        params = {k: str(prov[k]) for k in ("method", "rounds", "model_after_rounds", "checkpoint_kind")
                  if prov.get(k) is not None}
        rule = (meta.get("training") or {}).get("threshold_rule")
        if rule:
            params["threshold_rule"] = rule
        return {"name": str(meta.get("name") or "fedlabels bundle"), "version": str(meta.get("version") or "unknown"),
                "parameters": params}

    def device(self) -> dict:
        from pydicom.uid import generate_uid

        digest = _model_digest(self.model_file)
        alg = self.algorithm()
        # same model, same device UID: a PACS can tell results of one model from another's
        return {"uid": generate_uid(entropy_srcs=[alg["name"], alg["version"], digest]), "serial": digest[:16],
                "name": alg["name"], "model": f"{alg['name']} {alg['version']}"[:64]}

    def _write(self, engine) -> None:
        if not self.results:
            logger.info(f"no DICOM inputs: no DICOM {self.kind} written")
            return
        headers = {}
        for source in sorted(self.results):
            try:
                headers[source] = _header(source)
            except Exception as e:  # noqa: BLE001 - one bad header must not stop the others
                logger.warning(f"cannot write a DICOM {self.kind} for {source}: {' '.join(str(e).split())}")
        self.write(headers)

    def write(self, headers: dict) -> None:
        raise NotImplementedError


class ClassCodes:
    """Each class's code, from the bundle's ``metadata.json``:

    * ``class_codes``: ``{class: {"code", "scheme", "meaning", "source", ["category": {"code", "scheme",
      "meaning"}]}}`` -- a standard code (SNOMED CT ``SCT`` where one exists, DICOM ``DCM``, RadLex
      ``RADLEX``) or a private one (scheme ``99...``); ``category`` is a SEG segment's property category
      (default: SNOMED CT 49755003 Morphologically abnormal structure);
    * ``coding_schemes``: ``{designator: {"name", "responsible_organization"}}`` for private schemes.

    A class without a code gets its name in the private scheme ``99FEDLABELS``. ``declarations(used)``
    is the CodingSchemeIdentificationSequence an object using those schemes carries. A malformed
    entry raises ``ValueError`` naming ``metadata.json`` and the field."""

    def __init__(self, metadata: dict, class_names: list):
        import highdicom as hd
        from pydicom.sr.codedict import codes

        where = "metadata.json"
        self.schemes = dict(PRIVATE_SCHEMES)
        declared = metadata.get("coding_schemes") or {}
        if not isinstance(declared, dict):
            raise ValueError(f"{where}: field 'coding_schemes': expected {{designator: {{name, "
                             "responsible_organization}}}}")
        for designator, info in declared.items():
            if not (isinstance(info, dict) and info.get("name") and info.get("responsible_organization")):
                raise ValueError(f"{where}: field 'coding_schemes.{designator}': expected its 'name' and "
                                 "'responsible_organization'")
            self.schemes[str(designator)] = info
        given = metadata.get("class_codes") or {}
        if not isinstance(given, dict):
            raise ValueError(f"{where}: field 'class_codes': expected {{class: {{code, scheme, meaning}}}}")
        unknown = sorted(set(given) - set(class_names))
        if unknown:
            raise ValueError(f"{where}: field 'class_codes': codes for unknown classes {unknown}; classes are "
                             f"{list(class_names)}")
        self.finding, self.category = {}, {}
        for name in class_names:
            entry = given.get(name)
            if entry is None:
                self.finding[name] = hd.sr.CodedConcept(value=name[:64], scheme_designator=SCHEME, meaning=name[:64])
                self.category[name] = codes.SCT.MorphologicallyAbnormalStructure
                continue
            self.finding[name] = self._coded(entry, f"{where}: field 'class_codes.{name}'")
            cat = entry.get("category")
            self.category[name] = (self._coded(cat, f"{where}: field 'class_codes.{name}.category'") if cat
                                   else codes.SCT.MorphologicallyAbnormalStructure)

    def _coded(self, entry, where: str):
        import highdicom as hd

        if not isinstance(entry, dict) or any(not entry.get(k) for k in CODE_KEYS):
            raise ValueError(f"{where}: expected {{'code', 'scheme', 'meaning'}}, not {entry!r}")
        scheme = str(entry["scheme"])
        if scheme not in STANDARD_SCHEMES and scheme not in self.schemes:
            raise ValueError(f"{where}: scheme {scheme!r} is neither a DICOM standard scheme {list(STANDARD_SCHEMES)} "
                             "nor declared in the field 'coding_schemes'")
        return hd.sr.CodedConcept(value=str(entry["code"]), scheme_designator=scheme,
                                  meaning=str(entry["meaning"])[:64])

    def declarations(self, used) -> list:
        """CodingSchemeIdentificationSequence items for the private schemes among ``used``."""
        from pydicom.dataset import Dataset

        items = []
        for designator in sorted(set(used)):
            if designator in STANDARD_SCHEMES:
                continue
            info = self.schemes[designator]
            item = Dataset()
            item.CodingSchemeDesignator = designator
            item.CodingSchemeName = str(info["name"])[:64]
            item.CodingSchemeResponsibleOrganization = str(info["responsible_organization"])[:64]
            items.append(item)
        return items


def _declare(ds, codes: ClassCodes, used) -> None:
    from pydicom.sequence import Sequence

    items = codes.declarations(used)
    if items:
        ds.CodingSchemeIdentificationSequence = Sequence(items)


class DicomSegWriter(_DicomResults):
    """The thresholded masks of a segmentation bundle as DICOM SEG (BINARY, one segment per
    class: the pixels labelled that class, i.e. at or above its threshold and the most probable
    such class), written to ``output_dir/seg_<series UID>.dcm`` for a series with a frame of
    reference, else ``seg_<image UID>.dcm`` per image."""

    kind = "SEG"

    def result(self, pred):
        m = torch.as_tensor(pred).detach().cpu().numpy()
        while m.ndim > 2 and m.shape[0] == 1:
            m = m[0]
        while m.ndim > 2 and m.shape[-1] == 1:
            m = m[..., 0]
        if m.ndim != 2:
            raise ValueError(f"a mask of shape {m.shape}: expected one 2D label map")
        labels = np.swapaxes(m, 0, 1)  # x, y -> rows, columns
        if len(self.class_names) == 1:
            return (labels > 0)[..., None]
        return np.stack([labels == c + 1 for c in range(len(self.class_names))], -1)

    def write(self, headers: dict) -> None:
        from highdicom.spatial import get_image_coordinate_system

        groups: dict = {}
        for source, ds in headers.items():
            key = (ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.get("Rows"), ds.get("Columns"),
                   ds.get("FrameOfReferenceUID"))
            if get_image_coordinate_system(ds) is None:  # highdicom: one frame per SEG without a frame of reference
                key = key + (ds.SOPInstanceUID,)
            groups.setdefault(key, []).append(source)
        for key, sources in groups.items():
            sources = sorted(sources, key=lambda s: (int(headers[s].get("InstanceNumber") or 0), s))
            name = f"seg_{key[-1] if len(key) == 6 else key[1]}.dcm"
            try:
                path = _save(self.segmentation([headers[s] for s in sources], [self.results[s] for s in sources]),
                             self.output_dir / name)
            except Exception as e:  # noqa: BLE001 - a study highdicom refuses must not stop the others
                logger.warning(f"cannot write a DICOM SEG for {', '.join(sources)}: {' '.join(str(e).split())}")
                continue
            self.written.append(path)
            logger.info(f"DICOM SEG of {len(sources)} image(s) of series {key[1]} written to {path}")

    def segmentation(self, sources: list, masks: list):
        import highdicom as hd
        from pydicom.sr.codedict import codes

        for ds, mask in zip(sources, masks):
            if mask.shape[:2] != (ds.Rows, ds.Columns):
                raise ValueError(f"a mask of {mask.shape[:2]} pixels for an image of {(ds.Rows, ds.Columns)}")
        alg, dev = self.algorithm(), self.device()
        segments = []
        for i, name in enumerate(self.class_names):
            cut = self.thresholds.get(name)
            params = {**alg["parameters"], "threshold": "0.5 (default)" if cut is None else f"{cut:.6g}"}
            ident = hd.AlgorithmIdentificationSequence(name=alg["name"], family=codes.cid7162.ArtificialIntelligence,
                                                       version=alg["version"], source="fedlabels", parameters=params)
            segments.append(hd.seg.SegmentDescription(
                segment_number=i + 1, segment_label=name[:64],
                segmented_property_category=self.codes.category[name],
                segmented_property_type=self.codes.finding[name],
                algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
                algorithm_identification=ident))
        seg = hd.seg.Segmentation(
            source_images=sources, pixel_array=np.stack(masks).astype(np.uint8),
            segmentation_type=hd.seg.SegmentationTypeValues.BINARY, segment_descriptions=segments,
            series_instance_uid=hd.UID(), series_number=SEG_SERIES_NUMBER, sop_instance_uid=hd.UID(),
            instance_number=1, manufacturer="fedlabels", manufacturer_model_name=dev["model"],
            software_versions=alg["version"], device_serial_number=dev["serial"],
            content_description="AI segmentation, unverified; not a diagnosis", content_label="AI_SEG",
            omit_empty_frames=False)  # a frame per source image, empty or not: the SEG says what was looked at
        seg.SeriesDescription = f"{alg['name']} segmentation (AI, unverified)"[:64]
        from highdicom.spatial import get_image_coordinate_system

        if get_image_coordinate_system(sources[0]) is None:
            # no patient coordinates (a photograph): the General Image module's Type 2C PatientOrientation,
            # the source image's (empty when it has none)
            orientation = sources[0].get("PatientOrientation")
            seg.PatientOrientation = orientation if orientation else None
        _declare(seg, self.codes, [self.codes.finding[c].scheme_designator for c in self.class_names]
                 + [self.codes.category[c].scheme_designator for c in self.class_names])
        return seg


class DicomSRWriter(_DicomResults):
    """A classification bundle's findings as a DICOM Comprehensive 3D SR holding a TID 1500
    measurement report, one per study (``output_dir/sr_<study UID>.dcm``): per image one
    measurement group referencing the image, with per class the probability (a measurement,
    unit 1) and, where the class has a decision, a qualitative evaluation present / absent
    -- the same decision as ``predictions.csv``: the probability at or above the class's
    threshold, or (``decision="argmax"``, multi-class) the most probable class. A class
    without a threshold gets its probability only. The report is marked preliminary and
    unverified: a person has not read it."""

    kind = "SR"

    def __init__(self, *args, decision: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if decision not in (None, "argmax"):
            raise ValueError(f"decision must be None or 'argmax', not {decision!r}")
        self.decision = decision

    def result(self, pred):
        probs = torch.as_tensor(pred).detach().float().cpu().reshape(-1).tolist()
        if len(probs) != len(self.class_names):
            raise ValueError(f"{len(probs)} outputs for {len(self.class_names)} class names")
        return probs

    def decisions(self, probs: list) -> dict:
        """class -> True / False (present / absent), or absent from the dict: no decision."""
        if self.decision == "argmax":
            best = int(np.argmax(probs))
            return {c: i == best for i, c in enumerate(self.class_names)}
        return {c: p >= self.thresholds[c] for c, p in zip(self.class_names, probs)
                if self.thresholds.get(c) is not None}

    def write(self, headers: dict) -> None:
        studies: dict = {}
        for source, ds in headers.items():
            studies.setdefault(ds.StudyInstanceUID, []).append(source)
        for study, sources in studies.items():
            sources = sorted(sources, key=lambda s: (str(headers[s].SeriesInstanceUID),
                                                     int(headers[s].get("InstanceNumber") or 0), s))
            try:
                path = _save(self.report([headers[s] for s in sources], [self.results[s] for s in sources]),
                             self.output_dir / f"sr_{study}.dcm")
            except Exception as e:  # noqa: BLE001 - a study highdicom refuses must not stop the others
                logger.warning(f"cannot write a DICOM SR for {', '.join(sources)}: {' '.join(str(e).split())}")
                continue
            self.written.append(path)
            logger.info(f"DICOM SR of {len(sources)} image(s) of study {study} written to {path}")

    def report(self, sources: list, probs: list):
        import highdicom as hd
        from pydicom.sr.codedict import codes

        alg, dev = self.algorithm(), self.device()
        params = [f"{k}={v}" for k, v in alg["parameters"].items()]
        params += [f"threshold {c}={'none' if self.thresholds.get(c) is None else f'{self.thresholds[c]:.6g}'}"
                   for c in self.class_names] if self.decision is None else ["decision=most probable class"]
        ident = hd.sr.AlgorithmIdentification(name=alg["name"], version=alg["version"], parameters=params)
        observer = hd.sr.ObserverContext(
            observer_type=codes.DCM.Device,
            observer_identifying_attributes=hd.sr.DeviceObserverIdentifyingAttributes(
                uid=dev["uid"], name=dev["name"][:64], manufacturer_name="fedlabels", model_name=dev["model"],
                serial_number=dev["serial"]))
        groups = []
        for n, (ds, p) in enumerate(zip(sources, probs), 1):
            image = [hd.sr.SourceImageForMeasurement(ds.SOPClassUID, ds.SOPInstanceUID)]
            decided = self.decisions(p)
            measurements = [hd.sr.Measurement(
                name=hd.sr.CodedConcept(value=f"p:{c}", scheme_designator=SCHEME, meaning=f"Probability of {c}"[:64]),
                value=round(float(v), 6), unit=codes.UCUM.NoUnits, algorithm_id=ident, referenced_images=image)
                for c, v in zip(self.class_names, p)]
            evaluations = [hd.sr.QualitativeEvaluation(name=self.codes.finding[c],
                                                        value=codes.SCT.Present if decided[c] else codes.SCT.Absent)
                           for c in self.class_names if c in decided]
            groups.append(hd.sr.MeasurementsAndQualitativeEvaluations(
                tracking_identifier=hd.sr.TrackingIdentifier(uid=hd.UID(), identifier=f"image {n}"),
                algorithm_id=ident, measurements=measurements, qualitative_evaluations=evaluations or None,
                source_images=[hd.sr.SourceImageForMeasurementGroup(ds.SOPClassUID, ds.SOPInstanceUID)]))
        content = hd.sr.MeasurementReport(
            observation_context=hd.sr.ObservationContext(observer_device_context=observer),
            procedure_reported=hd.sr.CodedConcept(value="363679005", scheme_designator="SCT", meaning="Imaging"),
            imaging_measurements=groups)
        sr = hd.sr.Comprehensive3DSR(
            evidence=sources, content=content[0], series_instance_uid=hd.UID(), series_number=SR_SERIES_NUMBER,
            sop_instance_uid=hd.UID(), instance_number=1, manufacturer="fedlabels",
            is_complete=True, is_final=False, is_verified=False)  # preliminary and unverified: no person has read it
        sr.SeriesDescription = f"{alg['name']} findings (AI, unverified)"[:64]
        _declare(sr, self.codes, [SCHEME] + [self.codes.finding[c].scheme_designator for c in self.class_names])
        return sr


__all__ = ["is_dicom", "read_dicom_image", "DicomReader", "LoadImageOrDicomd", "ClassCodes", "DicomSegWriter",
           "DicomSRWriter"]
