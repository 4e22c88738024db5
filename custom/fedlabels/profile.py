"""Site label profiles and scenario folders: read, validate, summarise, write.

A scenario folder (DESIGN.md section 4)::

    <root>/scenario.yaml          name, task, classes, sites, seed, provenance
    <root>/<site>/profile.yaml    what this site labels
    <root>/<site>/datalist.json   {"training": [...], "validation": [...]}
    <root>/<site>/oracle.json     optional full labels (oracle baseline only)
    <root>/test/datalist.json     fully labeled held-out test set

Every malformed input raises one ``ScenarioError`` naming the file, the item
and the field, before any training starts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import yaml

TASKS = ("multilabel", "multiclass", "segmentation")
SUPERVISION = ("pixel", "bbox", "image", "none")
# A site's supervision may also be "mixed": each case then says its own level.
SITE_SUPERVISION = SUPERVISION + ("mixed",)
SPLITS = ("training", "validation")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".nii", ".nii.gz", ".dcm", ".npy")


class ScenarioError(ValueError):
    """Malformed scenario input: the message names the file, item and field."""

    def __init__(self, file, message, item=None, field=None):
        where = str(file)
        if item is not None:
            where += f": item {item}"
        if field is not None:
            where += f": field '{field}'"
        super().__init__(f"{where}: {message}")
        self.file, self.item, self.field = str(file), item, field


@dataclass(frozen=True)
class SiteProfile:
    """What one site labels. ``annotated`` is a subset of the global ``classes``."""

    site: str
    task: str
    classes: tuple
    annotated: tuple
    supervision: str = "image"

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def labeled_mask(self) -> np.ndarray:
        """Boolean [C]: True where this site annotates the class."""
        return np.array([c in self.annotated for c in self.classes], dtype=bool)

    @property
    def labeled_indices(self) -> list:
        return [i for i, c in enumerate(self.classes) if c in self.annotated]

    def to_dict(self) -> dict:
        return {
            "site": self.site,
            "task": self.task,
            "classes": list(self.classes),
            "annotated": list(self.annotated),
            "supervision": self.supervision,
        }


@dataclass
class SiteData:
    """A validated site: its profile and datalists with absolute paths."""

    profile: SiteProfile
    folder: Path
    training: list = field(default_factory=list)
    validation: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.profile.site

    def summary(self) -> dict:
        """Per-class counts over the training split (what a client sends as metadata)."""
        return label_summary(self.profile, self.training)

    def oracle(self) -> dict:
        """Full labels of this site's cases, for the oracle baseline only."""
        path = self.folder / "oracle.json"
        if not path.exists():
            raise ScenarioError(path, "missing: this scenario has no oracle labels for the site")
        return _read_datalist(path, self.profile.classes, self.profile.task, oracle=True)


@dataclass
class Scenario:
    root: Path
    name: str
    task: str
    classes: tuple
    seed: int
    sites: dict
    meta: dict
    test: list | None = None

    def site(self, name: str) -> SiteData:
        if name not in self.sites:
            raise ScenarioError(self.root / "scenario.yaml", f"no site named {name!r}; sites are {list(self.sites)}", field="sites")
        return self.sites[name]


def label_summary(profile: SiteProfile, items: list) -> dict:
    """Cases, per-class annotated counts n_k^c and positives, labeled-class mask."""
    c = profile.num_classes
    annotated = np.zeros(c, dtype=np.int64)
    positives = np.zeros(c, dtype=np.int64)
    for item in items:
        if profile.task == "multilabel":
            lab = np.asarray(item["label"])
            annotated += lab >= 0
            positives += lab == 1
        elif profile.task == "multiclass":
            if item["label"] >= 0:
                annotated += 1
                positives[item["label"]] += 1
        else:
            level = item.get("supervision", profile.supervision)
            if level != "none":
                annotated += 1
    return {
        "site": profile.site,
        "task": profile.task,
        "supervision": profile.supervision,
        "labeled": bool(annotated.any()),
        "cases": len(items),
        "annotated": annotated.tolist(),
        "positives": positives.tolist(),
        "labeled_mask": profile.labeled_mask.tolist(),
    }


# What a site may declare before round 0. Its case count bounds the weight of its updates (an update counts
# the cases of one local epoch), so the server caps it: no site of a study holds ten million images. A noised
# summary's report widens that bound by 6 noise standard deviations (noise_multiplier x clip): each is capped so that no
# report widens it by more than 6 x 20 x 20 = 2,400 cases (a noise multiplier above ~10 already leaves the
# counts meaningless; a clip above the largest row norm, sqrt(1 + 2 x classes), only adds noise).
MAX_CASES = 10_000_000
MAX_NOISE_MULTIPLIER = 20.0
MAX_CLIP = 20.0


def check_summary(summary) -> str | None:
    """Why a label summary a site sent cannot be used (its fields as ``label_summary`` writes them, the
    counts possibly noised but always whole and consistent), or None. The server reads nothing else
    from a site before round 0, so it screens this before any method sees it."""
    def count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(summary, dict):
        return f"a {type(summary).__name__}, not a mapping"
    if summary.get("task") not in TASKS:
        return f"field 'task': {summary.get('task')!r}, not one of {list(TASKS)}"
    if not count(summary.get("cases")):
        return f"field 'cases': {summary.get('cases')!r} is not a count"
    if not isinstance(summary.get("labeled"), bool):
        return f"field 'labeled': {summary.get('labeled')!r} is not true or false"
    fields = {k: summary.get(k) for k in ("annotated", "positives", "labeled_mask")}
    for k, v in fields.items():
        if not isinstance(v, list) or not v:
            return f"field {k!r}: {v!r} is not a list of one value per class"
    if len({len(v) for v in fields.values()}) > 1:
        return f"fields 'annotated', 'positives', 'labeled_mask': lengths {[len(v) for v in fields.values()]} differ"
    if not all(isinstance(b, bool) for b in fields["labeled_mask"]):
        return "field 'labeled_mask': not all true or false"
    for k in ("annotated", "positives"):
        if not all(count(n) and n <= summary["cases"] for n in fields[k]):
            return f"field {k!r}: not all counts between 0 and the site's {summary['cases']} cases"
    if any(p > a for p, a in zip(fields["positives"], fields["annotated"])):
        return "field 'positives': more positives than annotated cases in a class"
    if summary["labeled"] != any(n > 0 for n in fields["annotated"]):
        return f"field 'labeled': {summary['labeled']}, but the site annotated {sum(fields['annotated'])} cases"
    if summary["cases"] > MAX_CASES:
        return f"field 'cases': {summary['cases']} is more than the {MAX_CASES} cases a site may declare"
    report = summary.get("privacy")  # the noised release's report (fedlabels.privacy.REPORT), when there is one
    if report is not None:
        numbers = ("noise_multiplier", "clip", "epsilon", "delta", "releases")
        if not isinstance(report, dict) or not all(isinstance(report.get(k), (int, float))
                                                   and not isinstance(report.get(k), bool)
                                                   and math.isfinite(report.get(k)) for k in numbers):
            return f"field 'privacy': not a report with the finite numbers {list(numbers)}"
        for key, top in (("noise_multiplier", MAX_NOISE_MULTIPLIER), ("clip", MAX_CLIP)):
            if not 0 < report[key] <= top:
                return (f"field 'privacy.{key}': {report[key]!r} is not in (0, {top}] (the server widens the "
                        "site's case bound by the noise its report states)")
    return None


def check_summaries(summaries: dict) -> str | None:
    """``check_summary`` for every site, then what the sites must share (the task, one value per class
    of the same classes); the reason names the site."""
    for site, summary in sorted(summaries.items()):
        why = check_summary(summary)
        if why:
            return f"{site}'s label summary: {why}"
    tasks = {site: s["task"] for site, s in summaries.items()}
    if len(set(tasks.values())) > 1:
        return f"the sites' label summaries name different tasks: {tasks}"
    classes = {site: len(s["annotated"]) for site, s in summaries.items()}
    if len(set(classes.values())) > 1:
        return f"the sites' label summaries count different numbers of classes: {classes}"
    return None


# ---------------------------------------------------------------- reading


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ScenarioError(path, "missing file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ScenarioError(path, f"not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ScenarioError(path, "expected a mapping at the top level")
    return data


def _require(data: dict, key: str, path: Path, kind=None):
    if key not in data:
        raise ScenarioError(path, "missing", field=key)
    value = data[key]
    if kind is not None and not isinstance(value, kind):
        raise ScenarioError(path, f"expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}", field=key)
    return value


def image_size(path: Path) -> tuple:
    """(width, height) of a 2D image file without decoding its pixels."""
    name = path.name.lower()
    if name.endswith((".nii", ".nii.gz")):
        import nibabel as nib

        shape = nib.load(str(path)).shape
        return int(shape[0]), int(shape[1])
    if name.endswith(".npy"):
        shape = np.load(path, mmap_mode="r").shape
        return int(shape[-1]), int(shape[-2])
    if name.endswith(".dcm"):
        import pydicom

        ds = pydicom.dcmread(str(path), stop_before_pixels=True)
        return int(ds.Columns), int(ds.Rows)
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def _check_file(base: Path, value, file: Path, item, key) -> str:
    if not isinstance(value, str) or not value:
        raise ScenarioError(file, "expected a relative path", item, key)
    full = (base / value).resolve()
    if not full.is_file():
        raise ScenarioError(file, f"file not found: {full}", item, key)
    return str(full)


def _check_item(raw, i, file: Path, base: Path, classes: tuple, task: str, profile: SiteProfile | None, oracle=False, check_files=True) -> dict:
    if not isinstance(raw, dict):
        raise ScenarioError(file, "expected a mapping", i)
    item = dict(raw)
    if "image" not in item:
        raise ScenarioError(file, "missing", i, "image")
    item["image"] = _check_file(base, item["image"], file, i, "image") if check_files else str(base / item["image"])
    c = len(classes)
    if task == "multilabel":
        lab = _require_item(item, "label", file, i)
        if not isinstance(lab, list) or len(lab) != c:
            got = len(lab) if isinstance(lab, list) else type(lab).__name__
            raise ScenarioError(file, f"expected a list of {c} entries (one per class {list(classes)}), got {got}", i, "label")
        allowed = (0, 1) if oracle else (-1, 0, 1)
        for j, v in enumerate(lab):
            if v not in allowed or isinstance(v, bool):
                raise ScenarioError(file, f"entry {j} ({classes[j]}) is {v!r}; allowed values are {allowed}", i, "label")
            if profile is not None and not oracle and v != -1 and classes[j] not in profile.annotated:
                raise ScenarioError(file, f"class {classes[j]!r} is labeled {v} but the site profile does not annotate it (use -1)", i, "label")
    elif task == "multiclass":
        lab = _require_item(item, "label", file, i)
        if isinstance(lab, list) and len(lab) == 1:
            lab = item["label"] = lab[0]
        lo = 0 if oracle else -1
        if not isinstance(lab, int) or isinstance(lab, bool) or not lo <= lab < c:
            raise ScenarioError(file, f"expected an integer class index in [{lo}, {c - 1}], got {lab!r}", i, "label")
        if profile is not None and profile.supervision == "none" and lab != -1 and not oracle:
            raise ScenarioError(file, "the site profile says supervision 'none' but the case is labeled", i, "label")
    else:
        _check_seg_item(item, i, file, base, classes, profile, oracle, check_files)
    return item


def _require_item(item, key, file, i):
    if key not in item:
        raise ScenarioError(file, "missing", i, key)
    return item[key]


def _check_seg_item(item, i, file, base, classes, profile, oracle, check_files):
    default = profile.supervision if profile is not None and profile.supervision != "mixed" else None
    level = "pixel" if oracle else item.setdefault("supervision", default)
    if level not in SUPERVISION:
        raise ScenarioError(file, f"unknown supervision level {level!r}; expected one of {SUPERVISION}", i, "supervision")
    if profile is not None and profile.supervision not in ("mixed", level) and not oracle:
        raise ScenarioError(file, f"case says {level!r} but the site profile says {profile.supervision!r}", i, "supervision")
    if level == "pixel":
        if not check_files:
            item["seg"] = str(base / _require_item(item, "seg", file, i))
        else:
            item["seg"] = _check_file(base, _require_item(item, "seg", file, i), file, i, "seg")
            if image_size(Path(item["seg"])) != image_size(Path(item["image"])):
                raise ScenarioError(file, f"the mask is {image_size(Path(item['seg']))} pixels (width, height), its "
                                    f"image {image_size(Path(item['image']))}", i, "seg")
    elif "seg" in item:  # a mask on a weaker case would reach training as its label
        raise ScenarioError(file, f"a {level!r} case carries a mask; only 'pixel' cases may (remove the field or "
                            "set supervision: pixel)", i, "seg")
    if level == "bbox":
        boxes = _require_item(item, "boxes", file, i)
        if not isinstance(boxes, list):
            raise ScenarioError(file, "expected a list of [x0, y0, x1, y1, class]", i, "boxes")
        width, height = image_size(Path(item["image"])) if check_files else (None, None)
        for b, box in enumerate(boxes):
            if not (isinstance(box, list) and len(box) == 5 and all(isinstance(v, int) for v in box)):
                raise ScenarioError(file, f"box {b} is {box!r}; expected five integers [x0, y0, x1, y1, class]", i, "boxes")
            x0, y0, x1, y1, k = box
            if not 0 <= k < len(classes):
                raise ScenarioError(file, f"box {b} has class {k}; classes are 0..{len(classes) - 1}", i, "boxes")
            if not (0 <= x0 < x1 and 0 <= y0 < y1) or (width is not None and (x1 > width or y1 > height)):
                raise ScenarioError(file, f"box {b} {box[:4]} lies outside the {width}x{height} image (x0 < x1 <= width, y0 < y1 <= height)", i, "boxes")
    elif level == "image":
        present = _require_item(item, "classes", file, i)
        if not isinstance(present, list) or any(not isinstance(k, int) or not 0 <= k < len(classes) for k in present):
            raise ScenarioError(file, f"expected a list of class indices in 0..{len(classes) - 1} present in the image, got {present!r}", i, "classes")


def _read_datalist(path: Path, classes, task, profile=None, oracle=False, check_files=True, splits=SPLITS) -> dict:
    if not path.is_file():
        raise ScenarioError(path, "missing file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ScenarioError(path, f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ScenarioError(path, "expected an object with 'training' and 'validation' lists")
    out = {}
    for split in splits:
        items = data.get(split, [])
        if not isinstance(items, list):
            raise ScenarioError(path, "expected a list", field=split)
        out[split] = [
            _check_item(raw, f"{split}[{i}]", path, path.parent, classes, task, profile, oracle, check_files)
            for i, raw in enumerate(items)
        ]
    return out


def read_profile(path: Path, classes=None, task=None) -> SiteProfile:
    path = Path(path)
    data = _read_yaml(path)
    site = _require(data, "site", path, str)
    ptask = _require(data, "task", path, str)
    if ptask not in TASKS:
        raise ScenarioError(path, f"unknown task {ptask!r}; expected one of {TASKS}", field="task")
    if task is not None and ptask != task:
        raise ScenarioError(path, f"task {ptask!r} disagrees with the scenario's {task!r}", field="task")
    pclasses = tuple(_require(data, "classes", path, list))
    if classes is not None and pclasses != tuple(classes):
        raise ScenarioError(path, f"class list {list(pclasses)} disagrees with the scenario's {list(classes)}", field="classes")
    annotated = _require(data, "annotated", path, list)
    for name in annotated:
        if name not in pclasses:
            raise ScenarioError(path, f"unknown class name {name!r}; classes are {list(pclasses)}", field="annotated")
    supervision = data.get("supervision", "image")
    if supervision not in SITE_SUPERVISION:
        raise ScenarioError(path, f"unknown supervision level {supervision!r}; expected one of {SITE_SUPERVISION}", field="supervision")
    if supervision != "none" and not annotated:
        raise ScenarioError(path, "the site annotates no class (set supervision: none for an unlabeled site)", field="annotated")
    if supervision == "none" and annotated and ptask != "segmentation":
        raise ScenarioError(path, "supervision 'none' but classes are listed as annotated", field="annotated")
    return SiteProfile(site, ptask, pclasses, tuple(c for c in pclasses if c in annotated), supervision)


def load_site(folder, classes, task, check_files=True) -> SiteData:
    folder = Path(folder)
    profile = read_profile(folder / "profile.yaml", classes, task)
    if profile.site != folder.name:
        raise ScenarioError(folder / "profile.yaml", f"site {profile.site!r} disagrees with its folder name {folder.name!r}", field="site")
    lists = _read_datalist(folder / "datalist.json", profile.classes, task, profile, check_files=check_files)
    if not lists["training"]:
        raise ScenarioError(folder / "datalist.json", "no training cases", field="training")
    return SiteData(profile, folder, lists["training"], lists["validation"])


def held_sites(root, wanted=None) -> list:
    """The scenario's sites that have a folder under ``root`` (a hospital's copy holds only its
    own), in ``scenario.yaml`` order, limited to ``wanted`` when given."""
    root = Path(root)
    listed = _require(_read_yaml(root / "scenario.yaml"), "sites", root / "scenario.yaml", list)
    return [s for s in listed if (root / s).is_dir() and (wanted is None or s in wanted)]


def load_scenario(root, sites=None, check_files=True, with_test=True) -> Scenario:
    """Load and validate a scenario folder (all sites, or only ``sites``)."""
    root = Path(root)
    path = root / "scenario.yaml"
    if not root.is_dir():
        raise ScenarioError(root, "scenario folder not found")
    meta = _read_yaml(path)
    name = _require(meta, "name", path, str)
    task = _require(meta, "task", path, str)
    if task not in TASKS:
        raise ScenarioError(path, f"unknown task {task!r}; expected one of {TASKS}", field="task")
    classes = tuple(_require(meta, "classes", path, list))
    if not classes or len(set(classes)) != len(classes):
        raise ScenarioError(path, "expected a non-empty list of distinct class names", field="classes")
    all_sites = _require(meta, "sites", path, list)
    wanted = all_sites if sites is None else list(sites)
    for s in wanted:
        if s not in all_sites:
            raise ScenarioError(path, f"no site named {s!r}; sites are {all_sites}", field="sites")
    loaded = {s: load_site(root / s, classes, task, check_files) for s in wanted}
    test = None
    test_path = root / "test" / "datalist.json"
    if with_test and test_path.exists():
        test = _read_datalist(test_path, classes, task, oracle=True, check_files=check_files, splits=("testing",))["testing"]
    return Scenario(root, name, task, classes, int(meta.get("seed", 0)), loaded, meta, test)


def format_summary(scenario: Scenario) -> str:
    """A per-site table like FedPSL's Table I: annotated/positives per class."""
    heads = ["site", "cases"] + list(scenario.classes)
    rows = []
    for s in scenario.sites.values():
        summ = s.summary()
        cells = [s.name, str(summ["cases"])]
        for c in range(len(scenario.classes)):
            if not summ["labeled_mask"][c]:
                cells.append("-")
            elif scenario.task == "segmentation":
                cells.append(f"{summ['annotated'][c]} ({s.profile.supervision})")
            else:
                cells.append(f"{summ['annotated'][c]}/{summ['positives'][c]}")
        rows.append(cells)
    widths = [max(len(r[i]) for r in [heads] + rows) for i in range(len(heads))]
    fmt = lambda r: "  ".join(v.rjust(w) for v, w in zip(r, widths))  # noqa: E731
    note = "cells: annotated/positive cases; '-' = not annotated at the site"
    return "\n".join([fmt(heads)] + [fmt(r) for r in rows] + [note])


# ---------------------------------------------------------------- writing


def write_atomic(path, data: bytes) -> None:
    """Write bytes to a temporary name in the same folder, flush them to the disk, then rename (and flush
    the folder): never half a file, and after a power loss the old file or the new one, never an empty one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # the rename itself survives a crash once the folder's entry is on the disk
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:  # a platform whose folders cannot be opened (Windows)
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def write_json_atomic(path, data) -> None:
    """Write JSON atomically (``write_atomic``)."""
    write_atomic(path, json.dumps(data, indent=1).encode())


def write_yaml(path, data) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


def check_output_dir(path, markers, what: str, force: bool = False, option: str = "--out") -> None:
    """Refuse to write into ``path`` when the command could delete or overwrite what it did not write:
    a non-empty folder that holds none of ``markers`` (files or folders an earlier output of the same
    command always has). ``force`` allows it. Raises ValueError naming the folder and the option."""
    path = Path(path)
    if force or not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"{path}: {option} is a file, not a folder")
    if not any(path.iterdir()) or any((path / m).exists() for m in markers):
        return
    raise ValueError(f"{path}: {option} is a folder that is not empty and not an earlier {what} (it holds none of "
                     f"{list(markers)}); nothing was written. Choose a new folder, or pass --force to write there "
                     "(what the command writes replaces what is in it)")


@contextlib.contextmanager
def scenario_writer(root) -> Iterator[Path]:
    """Build a scenario in a sibling temporary folder, then swap it in.

    ``scenario.yaml`` must be written last by the caller: an interrupted
    preparation leaves only ``<root>.partial-*``, which never validates, and
    the previous complete scenario at ``root`` (if any) stays untouched.
    """
    root = Path(root).resolve()
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{root.name}.partial-", dir=root.parent))
    try:
        yield tmp
        if not (tmp / "scenario.yaml").is_file():
            raise RuntimeError(f"{tmp}: scenario.yaml was not written")
        old = None
        if root.exists():
            old = root.with_name(f"{root.name}.old-{os.getpid()}")
            os.replace(root, old)
        os.replace(tmp, root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_site(folder, profile: SiteProfile, training: list, validation: list, oracle: dict | None = None) -> None:
    """Write one site's profile.yaml, datalist.json (and oracle.json)."""
    folder = Path(folder)
    write_yaml(folder / "profile.yaml", profile.to_dict())
    write_json_atomic(folder / "datalist.json", {"training": training, "validation": validation})
    if oracle is not None:
        write_json_atomic(folder / "oracle.json", oracle)
