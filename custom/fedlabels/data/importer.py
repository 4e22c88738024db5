"""``fedlabels import``: your own images and a CSV -> a validated scenario folder.

    fedlabels import LABELS.csv [SITE=OTHER.csv ...] --out DIR [--task multilabel|multiclass|segmentation]
        [--classes a,b,c] [--sites s1,s2] [--test-fraction 0.2] [--val-fraction 0.15] [--seed 0]
        [--size N] [--channels 1|3] [--window auto|brain|LEVEL,WIDTH] [--name NAME] [--force]

One row per image. Columns (header names, any case; other columns are ignored
unless they are class columns of a multi-label CSV):

  image      path of the image (PNG, JPEG, BMP, TIFF or DICOM), relative to the CSV's folder
  site       which hospital holds it; 'test' = the held-out, fully labeled test set. A CSV
             without the column is one site's, given as SITE=FILE (otherwise it is refused)
  patient    optional: a patient's images stay in one split (ids are per site)
  multi-label:  one column per class: 1, 0, or blank (-1) = not annotated for this image
  multi-class:  label = the class name, blank = unlabeled
  segmentation: mask = a mask image of the image's size (binary, or class index + 1),
                box = 'x0,y0,x1,y1[,class]' (x1, y1 exclusive; several separated by ';'),
                classes = the class names present, separated by ';' ('none' for none: also
                'none' in box). The strongest label a row gives is used (mask > box > classes).

The task is inferred when --task is not given: segmentation when a mask, box or
classes column exists, multi-class with a label column, multi-label otherwise.
A site annotates the classes it gives at least one 0/1 for; a site with no
label is unlabeled (supervision none). Without rows for site 'test', each site
gives --test-fraction of its patients whose images are fully labeled to the
test split; every site gives --val-fraction of its patients to validation.

Every check runs before anything is written; a bad cell stops the import with
one line naming the file, the row (as a spreadsheet shows it: the header is
row 1) and the column. The folder is then written atomically by
``build.write_plan`` (a temporary name, validated, renamed into place). An
existing non-empty --out is replaced only if ``fedlabels import`` wrote it, or
with --force.

Example:
  fedlabels import labels.csv --out scenarios/mine
  fedlabels bench --data scenarios/mine --bundle cxr_resnet18 --methods fedavg,surgical --rounds 10 --out runs/mine
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ..profile import TASKS
from .common import Case, PrepareError, Progress, Source, record_file, safe_id

GENERATOR = "fedlabels.data.importer"
TEST_SITE = "test"
IMAGE_COLUMN, SITE_COLUMN, PATIENT_COLUMN, LABEL_COLUMN = "image", "site", "patient", "label"
SEG_COLUMNS = ("mask", "box", "classes")
RESERVED = {IMAGE_COLUMN, SITE_COLUMN, PATIENT_COLUMN, LABEL_COLUMN, *SEG_COLUMNS}
COLOR_MODES = ("RGB", "RGBA", "P", "PA", "CMYK", "YCbCr", "LAB", "HSV")
SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
NONE_WORDS = ("none",)


class RowError(PrepareError):
    """A bad cell: one line naming the file, the row (header = row 1) and the column."""

    def __init__(self, file, row, column, message):
        where = f"{file}: row {row}"
        if column is not None:
            where += f": column '{column}'"
        super().__init__(f"{where}: {message}")


@dataclass
class Table:
    """One input CSV: its rows as dicts keyed by lower-case column name."""

    path: Path
    site: str | None  # from SITE=FILE
    columns: dict  # lower-case name -> the header as written
    rows: list  # (row number, {lower name: stripped cell})

    def col(self, name) -> str:
        return self.columns.get(name, name)


@dataclass
class Row:
    table: Table
    number: int
    site: str
    image: Path
    patient: str
    size: tuple  # (width, height)
    color: bool
    label: Any = None  # multilabel list (-1 blank) | multiclass index (-1 blank) | None
    level: str | None = None  # segmentation: pixel | bbox | image | none
    mask: Path | None = None
    boxes: list | None = None  # [[x0, y0, x1, y1, class], ...] in the image's pixels
    present: list | None = None  # image-level class indices
    full: bool = False  # fully labeled: may go to the test split
    id: str = ""
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DicomImage:
    """A DICOM file that ``load_pixels`` decodes with ``data.dicom.read_dicom_image``, the decoder an
    exported bundle's inference uses too: as displayed (the file's VOI LUT or window, or ``window``),
    on the 0-255 scale."""

    path: str
    window: str = "auto"

    def __str__(self) -> str:
        return self.path

    def pixels(self) -> np.ndarray:
        from .dicom import DicomError, read_dicom_image

        try:
            return read_dicom_image(self.path, None if self.window == "auto" else self.window)[0]
        except DicomError as e:
            raise PrepareError(f"{self.path}: {e}") from None


# ------------------------------------------------------------------ reading


def parse_inputs(specs) -> list:
    """``FILE`` or ``SITE=FILE`` -> [(site or None, path)]."""
    out = []
    for spec in specs:
        name, sep, path = str(spec).partition("=")
        if sep and name and not os.path.exists(spec):
            out.append((name.strip(), Path(path).expanduser()))
        else:
            out.append((None, Path(spec).expanduser()))
    for _, path in out:
        if not path.is_file():
            raise PrepareError(f"{path}: CSV file not found")
    return out


def read_table(path: Path, site: str | None) -> Table:
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            records = list(csv.reader(f))
    except (UnicodeDecodeError, csv.Error, OSError) as e:
        raise PrepareError(f"{path}: not a readable CSV file ({e})") from None
    if not records or not any(h.strip() for h in records[0]):
        raise PrepareError(f"{path}: row 1: empty: expected a header row (image, site, ...)")
    header = [h.strip() for h in records[0]]
    columns = {}
    for h in header:
        if not h:
            raise RowError(path, 1, None, f"a column without a name (header {header})")
        if h.lower() in columns:
            raise RowError(path, 1, h, "the column appears twice")
        columns[h.lower()] = h
    if IMAGE_COLUMN not in columns:
        raise RowError(path, 1, IMAGE_COLUMN, f"missing: every row names its image there (header {header})")
    rows = []
    for n, rec in enumerate(records[1:], start=2):
        if not any(v.strip() for v in rec):
            continue
        if len(rec) > len(header):
            raise RowError(path, n, None, f"{len(rec)} cells but the header has {len(header)} columns")
        rows.append((n, {h.lower(): (rec[i].strip() if i < len(rec) else "") for i, h in enumerate(header)}))
    if not rows:
        raise PrepareError(f"{path}: no rows below the header")
    return Table(path, site, columns, rows)


def infer_task(tables, task: str | None) -> str:
    if task is not None:
        if task not in TASKS:
            raise PrepareError(f"--task must be one of {list(TASKS)}, not {task!r}")
        return task
    cols = set().union(*(t.columns for t in tables))
    if cols & set(SEG_COLUMNS):
        return "segmentation"
    if LABEL_COLUMN in cols:
        return "multiclass"
    return "multilabel"


def _split_list(text) -> list:
    return [v.strip() for v in text.split(",") if v.strip()] if text else []


def _round(x: float) -> int:
    return int(math.floor(x + 0.5))


def probe_image(path: Path) -> tuple:
    """(width, height, colour) from the file's header; raises PrepareError naming the problem."""
    if not path.is_file():
        raise PrepareError(f"file not found: {path}")
    if path.suffix.lower() == ".dcm":
        from .dicom import DicomError, read_dicom_header

        try:
            h = read_dicom_header(path)
        except DicomError:
            raise PrepareError(f"not a readable DICOM file: {path}") from None
        if not h.get("Rows") or not h.get("Columns"):
            raise PrepareError(f"a DICOM file without image size (Rows, Columns): {path}")
        return int(h["Columns"]), int(h["Rows"]), (h.get("SamplesPerPixel") or 1) == 3
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return im.size[0], im.size[1], im.mode in COLOR_MODES
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise PrepareError(f"not a readable image: {path} ({type(e).__name__})") from None


class Importer:
    """Reads and checks every row; ``plan()`` turns them into a build.SplitPlan."""

    def __init__(self, args):
        self.args = args
        self.inputs = parse_inputs(args.csv)
        self.tables = [read_table(p, s) for s, p in self.inputs]
        self.task = infer_task(self.tables, args.task)
        self.given_classes = _split_list(args.classes)
        if len(set(self.given_classes)) != len(self.given_classes):
            raise PrepareError(f"--classes names a class twice: {self.given_classes}")
        self.given_sites = _split_list(args.sites)
        for s in self.given_sites:
            if not SITE_NAME.match(s) or s == TEST_SITE:
                raise PrepareError(f"--sites: {s!r} is not a site name (letters, digits, '-', '_', '.'; "
                                   f"{TEST_SITE!r} is the test set)")
        for name in ("test_fraction", "val_fraction"):
            v = getattr(args, name)
            if not 0 <= v < 1:
                raise PrepareError(f"--{name.replace('_', '-')} must be in [0, 1), not {v}")
        if args.size is not None and args.size < 1:
            raise PrepareError(f"--size must be a positive number of pixels, not {args.size}")
        if args.window != "auto":
            from .dicom import DicomError, parse_window

            try:
                parse_window(args.window)
            except DicomError as e:
                raise PrepareError(f"--window: {e}") from None
        self._sizes: dict = {}
        self.classes = self._classes()
        self.rows = self._rows()

    # -- columns and classes

    def _classes(self) -> list:
        task, given = self.task, self.given_classes
        if task == "multilabel":
            for t in self.tables:
                for c in given:
                    if c.lower() not in t.columns:
                        raise RowError(t.path, 1, c, "missing: --classes names this class")
            if given:
                return given
            first = self.tables[0]
            classes = [h for k, h in first.columns.items() if k not in RESERVED]
            if not classes:
                raise RowError(first.path, 1, None, f"no class column: a multi-label CSV has one column per class "
                               f"besides {sorted(RESERVED)} (header {list(first.columns.values())})")
            for t in self.tables[1:]:
                theirs = [h for k, h in t.columns.items() if k not in RESERVED]
                for c in classes:
                    if c.lower() not in t.columns:
                        raise RowError(t.path, 1, c, f"missing: a class column of {first.path.name}")
                for h in theirs:
                    if h.lower() not in {c.lower() for c in classes}:
                        raise RowError(t.path, 1, h, f"not a class column of {first.path.name} (pass --classes "
                                       "to name the class columns)")
            return classes
        if task == "multiclass":
            for t in self.tables:
                if LABEL_COLUMN not in t.columns:
                    raise RowError(t.path, 1, LABEL_COLUMN, "missing: a multi-class CSV gives each image's class "
                                   "name there (blank = unlabeled)")
            if given:
                return given
            names = sorted({r[LABEL_COLUMN] for t in self.tables for _, r in t.rows if r[LABEL_COLUMN]})
            if all(n.lstrip("-").isdigit() for n in names):
                names = sorted(names, key=int)
            if not names:
                raise PrepareError(f"{self.tables[0].path}: no row has a class in column 'label'")
            return names
        for t in self.tables:
            if not set(SEG_COLUMNS) & set(t.columns):
                raise RowError(t.path, 1, "mask", "missing: a segmentation CSV has a 'mask', 'box' or 'classes' "
                               "column")
        if given:
            return given
        names = set()
        for t in self.tables:
            for _, r in t.rows:
                for part in re.split(r"[;|]", r.get("box", "")):
                    bits = [b.strip() for b in part.split(",")]
                    if len(bits) == 5 and not _is_number(bits[4]):
                        names.add(bits[4])
                names.update(n for n in _names(r.get("classes", "")) if n.lower() not in NONE_WORDS)
        return sorted(names) or ["foreground"]

    # -- rows

    def _rows(self) -> list:
        rows, seen, site_order = [], {}, []
        # each row opens its image (and mask) header: long for a large dataset on a network drive
        quiet = getattr(self.args, "quiet", False)
        # a bad row stops the loop: the bar's line is ended before its one-line error
        with Progress(sum(len(t.rows) for t in self.tables), "rows checked",
                      (lambda msg: None) if quiet else None) as checked:
            for t in self.tables:
                for n, cells in t.rows:
                    row = self._row(t, n, cells)
                    checked.step()
                    key = str(row.image.resolve())
                    if key in seen:
                        ft, fn = seen[key]
                        raise RowError(t.path, n, t.col(IMAGE_COLUMN), f"the same image as {ft.name} row {fn}")
                    seen[key] = (t.path, n)
                    if row.site != TEST_SITE and row.site not in site_order:
                        site_order.append(row.site)
                    rows.append(row)
        self.sites = [s for s in self.given_sites if s in site_order] if self.given_sites else site_order
        if not self.sites:
            raise PrepareError(f"{self.tables[0].path}: every row is a test row (site {TEST_SITE!r}); "
                               "no site to train on")
        # case ids (the written file names): the image's name; where two share it, its path
        # relative to its CSV's folder; the CSV and row where that too is taken
        used = set()
        for row in rows:
            cid = safe_id(row.image.stem)
            if cid in used:
                try:
                    cid = safe_id(str(row.image.relative_to(row.table.path.parent.resolve()).with_suffix("")))
                except ValueError:
                    cid = safe_id(f"{row.image.parent.name}_{row.image.stem}")
            if cid in used:
                cid = f"{safe_id(row.image.stem)}_{safe_id(row.table.path.stem)}_r{row.number}"
            used.add(cid)
            row.id = cid
        return rows

    def _site(self, t: Table, n: int, cells: dict) -> str:
        if SITE_COLUMN in t.columns:
            site = cells[SITE_COLUMN]
            col = t.col(SITE_COLUMN)
            if not site:
                raise RowError(t.path, n, col, "blank: every row names its site (or 'test')")
            if t.site is not None and site != t.site:
                raise RowError(t.path, n, col, f"site {site!r} in a file given as {t.site}={t.path.name}")
        elif t.site is not None:
            site, col = t.site, None
        else:  # never guessed from the file's name: a hospital's rows must not merge into one site silently
            raise RowError(t.path, 1, SITE_COLUMN, "missing: name each row's hospital (or 'test') in a 'site' "
                           f"column, or give the whole file to one site as SITE={t.path.name}")
        if site != TEST_SITE:
            if not SITE_NAME.match(site):
                raise RowError(t.path, n, col, f"{site!r} is not a site name (letters, digits, '-', '_', '.')")
            if self.given_sites and site not in self.given_sites:
                raise RowError(t.path, n, col, f"unknown site {site!r}; --sites lists {self.given_sites}")
        return site

    def _probe(self, t, n, column, path) -> tuple:
        key = str(path)
        if key not in self._sizes:
            try:
                self._sizes[key] = probe_image(path)
            except PrepareError as e:
                raise RowError(t.path, n, column, str(e)) from None
        return self._sizes[key]

    def _row(self, t: Table, n: int, cells: dict) -> Row:
        site = self._site(t, n, cells)
        icol = t.col(IMAGE_COLUMN)
        if not cells[IMAGE_COLUMN]:
            raise RowError(t.path, n, icol, "blank: every row names its image")
        image = (t.path.parent / cells[IMAGE_COLUMN]).resolve()
        w, h, color = self._probe(t, n, icol, image)
        patient = cells.get(PATIENT_COLUMN) or f"image:{image}"
        row = Row(t, n, site, image, patient, (w, h), color)
        if self.task == "multilabel":
            self._multilabel(t, n, cells, row)
        elif self.task == "multiclass":
            self._multiclass(t, n, cells, row)
        else:
            self._segmentation(t, n, cells, row)
        return row

    def _multilabel(self, t, n, cells, row):
        label = []
        for c in self.classes:
            v = cells[c.lower()]
            if v in ("", "-1"):
                label.append(-1)
            elif v in ("0", "1", "0.0", "1.0"):
                label.append(int(float(v)))
            else:
                raise RowError(t.path, n, t.col(c.lower()), f"{v!r} is not a label: expected 1, 0, or blank "
                               "(not annotated)")
        if row.site == TEST_SITE and -1 in label:
            c = self.classes[label.index(-1)]
            raise RowError(t.path, n, t.col(c.lower()), "blank in a test row: the test set is fully labeled (1 or 0)")
        row.label, row.full = label, -1 not in label

    def _multiclass(self, t, n, cells, row):
        v = cells[LABEL_COLUMN]
        if not v:
            if row.site == TEST_SITE:
                raise RowError(t.path, n, t.col(LABEL_COLUMN), "blank in a test row: the test set is fully labeled")
            row.label = -1
            return
        if v not in self.classes:
            raise RowError(t.path, n, t.col(LABEL_COLUMN), f"unknown class {v!r}; classes are {self.classes}")
        row.label, row.full = self.classes.index(v), True

    def _class_index(self, t, n, col, name) -> int:
        if name in self.classes:
            return self.classes.index(name)
        if name.isdigit() and int(name) < len(self.classes):
            return int(name)
        raise RowError(t.path, n, col, f"unknown class {name!r}; classes are {self.classes}")

    def _segmentation(self, t, n, cells, row):
        w, h = row.size
        mask_cell, box_cell, cls_cell = (cells.get(c, "") for c in SEG_COLUMNS)
        if mask_cell:
            col = t.col("mask")
            row.mask = (t.path.parent / mask_cell).resolve()
            mw, mh, _ = self._probe(t, n, col, row.mask)
            if (mw, mh) != (w, h):
                raise RowError(t.path, n, col, f"the mask is {mw}x{mh} pixels but its image {row.image.name} is "
                               f"{w}x{h}")
        if box_cell:
            col = t.col("box")
            boxes = []
            if box_cell.lower() not in NONE_WORDS:
                for b, part in enumerate(p for p in re.split(r"[;|]", box_cell) if p.strip()):
                    bits = [x.strip() for x in part.split(",")]
                    if len(bits) not in (4, 5) or not all(_is_number(x) for x in bits[:4]):
                        raise RowError(t.path, n, col, f"box {b} is {part.strip()!r}; expected x0,y0,x1,y1[,class] "
                                       "(several separated by ';', or 'none')")
                    x0, y0, x1, y1 = (float(x) for x in bits[:4])
                    if len(bits) == 5:
                        k = self._class_index(t, n, col, bits[4])
                    elif len(self.classes) == 1:
                        k = 0
                    else:
                        raise RowError(t.path, n, col, f"box {b} has no class (a fifth value) and there are "
                                       f"{len(self.classes)} classes")
                    if not (0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h):
                        raise RowError(t.path, n, col, f"box {b} {[_num(x0), _num(y0), _num(x1), _num(y1)]} lies "
                                       f"outside the {w}x{h} image (0 <= x0 < x1 <= width, 0 <= y0 < y1 <= height)")
                    boxes.append([x0, y0, x1, y1, k])
            row.boxes = boxes
        if cls_cell:
            col = t.col("classes")
            names = [] if cls_cell.lower() in NONE_WORDS else _names(cls_cell)
            row.present = sorted({self._class_index(t, n, col, name) for name in names})
        row.level = ("pixel" if row.mask is not None else "bbox" if row.boxes is not None
                     else "image" if row.present is not None else "none")
        row.full = row.level == "pixel"
        if row.site == TEST_SITE and not row.full:
            raise RowError(t.path, n, t.col("mask") if "mask" in t.columns else "mask",
                           "a test row needs a mask: the test set is fully labeled")

    # -- splits

    def split(self) -> tuple:
        """{site: (training rows, validation rows)}, test rows; patient-level, seeded."""
        args = self.args
        explicit_test = [r for r in self.rows if r.site == TEST_SITE]
        draw_test = not explicit_test and args.test_fraction > 0
        out, test = {}, list(explicit_test)
        for s_idx, site in enumerate(self.sites):
            rows = [r for r in self.rows if r.site == site]
            patients = list(dict.fromkeys(r.patient for r in rows))
            full = {p for p in patients if all(r.full for r in rows if r.patient == p)}
            rng = np.random.default_rng([args.seed, s_idx])
            order = [patients[i] for i in rng.permutation(len(patients))]
            n_test = min(len(full), _round(args.test_fraction * len(patients))) if draw_test else 0
            test_p = set([p for p in order if p in full][:n_test])
            rest = [p for p in order if p not in test_p]
            n_val = min(len(rest), _round(args.val_fraction * len(patients)))
            val_p = set(rest[:n_val])
            train = [r for r in rows if r.patient not in test_p and r.patient not in val_p]
            if not train:
                first = rows[0]
                col = first.table.col(PATIENT_COLUMN) if PATIENT_COLUMN in first.table.columns else None
                raise RowError(first.table.path, first.number, col,
                               f"site {site}: the patient-level split leaves no training case ({len(patients)} "
                               f"patient(s): {n_test} to test, {n_val} to validation); lower --test-fraction / "
                               "--val-fraction or add cases")
            val = [r for r in rows if r.patient in val_p]
            for r in rows:
                if r.patient in test_p:
                    r.extra = {"site": site}
                    test.append(r)
            out[site] = (train, val)
        return out, test

    # -- the plan

    def plan(self):
        from .build import Entry, SplitPlan, SitePlan

        args = self.args
        splits, test = self.split()
        sizes = {r.size for r in self.rows}
        if args.size:
            size = (args.size, args.size)
        else:
            size = next(iter(sizes)) if len(sizes) == 1 else None
        channels = args.channels or (3 if any(r.color for r in self.rows) or args.window in ("multi", "rgb") else 1)
        window = args.window

        def case(r: Row) -> Case:
            image = DicomImage(str(r.image), window) if r.image.suffix.lower() == ".dcm" else str(r.image)
            return Case(r.id, image, f"{r.site}/{r.patient}", mask=str(r.mask) if r.mask is not None else None)

        def entry(r: Row, testing=False) -> Entry:
            if self.task != "segmentation":
                return Entry(case(r), None if testing else r.label, r.label if testing else None, extra=dict(r.extra))
            if testing:
                return Entry(case(r), supervision="pixel", extra=dict(r.extra))
            extra = {}
            if r.level == "bbox":
                extra["boxes"] = [_scale_box(b, r.size, size) for b in r.boxes]
            elif r.level == "image":
                extra["classes"] = list(r.present)
            return Entry(case(r), supervision=r.level, extra=extra)

        sites = []
        for site in self.sites:
            train, val = splits[site]
            annotated, level = self._annotated(train + val)
            listed = ", ".join(sorted({r.table.path.name for r in train + val}))
            sites.append(SitePlan(site, annotated, level, [entry(r) for r in train], [entry(r) for r in val],
                                  f"{len(train) + len(val)} rows of {listed}"))
        notes = []
        if not test:
            notes.append("no test split: no patient's images are all fully labeled and no row has site 'test'")
        if size is None:
            notes.append(f"images kept at their own sizes ({len(sizes)} different); the bundles resize them")
        tables = self.tables
        root = Path(os.path.commonpath([str(t.path.parent.resolve()) for t in tables]))
        files: dict = {}
        for t in tables:
            record_file(files, root, t.path)
        cases = [case(r) for r in self.rows]
        source = Source("csv", self.task, list(self.classes), cases, channels, root, files,
                        meta={"rows": len(self.rows)})
        mask_mode = "binary" if len(self.classes) == 1 else "labels"
        name = args.name or Path(args.out).name
        return SplitPlan(name, self.task, list(self.classes), channels, size, sites,
                         [entry(r, True) for r in test] or None,
                    oracle=False, mask_mode=mask_mode, sources=[source], notes=notes, generator=GENERATOR,
                    window=None if window == "auto" else window,
                    protocol={"name": "import", "csv": [str(t.path) for t in tables],
                              "test": "site 'test' rows" if any(r.site == TEST_SITE for r in self.rows)
                              else f"{args.test_fraction} of each site's fully labeled patients",
                              "val_fraction": args.val_fraction, "seed": args.seed})

    def _annotated(self, rows) -> tuple:
        if self.task == "multilabel":
            ann = [c for j, c in enumerate(self.classes) if any(r.label[j] != -1 for r in rows)]
            return ann, "image" if ann else "none"
        if self.task == "multiclass":
            labeled = any(r.label != -1 for r in rows)
            return (list(self.classes), "image") if labeled else ([], "none")
        levels = {r.level for r in rows}
        level = levels.pop() if len(levels) == 1 else "mixed"
        return (list(self.classes) if level != "none" else []), level


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _num(x: float):
    return int(x) if float(x).is_integer() else x


def _names(text: str) -> list:
    return [v.strip() for v in re.split(r"[;|,]", text or "") if v.strip()]


def _scale_box(box, src, dst) -> list:
    """A box in the source image's pixels -> integer pixels of the written image (outward, clamped)."""
    x0, y0, x1, y1, k = box
    (w, h), (W, H) = src, (dst or src)
    sx, sy = W / w, H / h
    nx0, ny0 = int(math.floor(x0 * sx)), int(math.floor(y0 * sy))
    nx1, ny1 = min(W, int(math.ceil(x1 * sx))), min(H, int(math.ceil(y1 * sy)))
    return [nx0, ny0, max(nx1, nx0 + 1), max(ny1, ny0 + 1), int(k)]


# ------------------------------------------------------------------ the command


def check_out(out, inputs, force: bool) -> None:
    """Refuse an --out that is a file, holds the input, or is a non-empty folder this command did not write."""
    out = Path(out).resolve()
    if out.is_file():
        raise PrepareError(f"--out {out}: is a file")
    for p in inputs:
        p = Path(p).resolve()
        if p == out or out in p.parents:
            raise PrepareError(f"--out {out}: holds the input {p}; write the scenario elsewhere")
    if out.is_dir() and any(out.iterdir()):
        generator = None
        try:
            meta = yaml.safe_load((out / "scenario.yaml").read_text())
            generator = ((meta or {}).get("provenance") or {}).get("generator")
        except (OSError, yaml.YAMLError, AttributeError):
            pass
        if generator != GENERATOR and not force:
            raise PrepareError(f"--out {out}: exists, is not empty and is not a scenario written by fedlabels "
                               "import; pass --force to replace it")


def run(args) -> Path:
    """Import the CSV(s) of ``args`` into a scenario folder; returns it."""
    from .. import progress
    from .build import write_plan

    # the default printer draws a progress bar on a terminal (fedlabels.progress)
    say = (lambda msg: None) if getattr(args, "quiet", False) else progress.say
    imp = Importer(args)
    plan = imp.plan()
    check_out(args.out, [t.path for t in imp.tables] + [r.image for r in imp.rows]
              + [r.mask for r in imp.rows if r.mask is not None], args.force)
    n_test = len(plan.test or [])
    say(f"read {len(imp.rows)} rows from {', '.join(str(t.path) for t in imp.tables)}: {imp.task}, "
        f"classes {list(imp.classes)}, sites {imp.sites}, test {n_test} cases "
        f"({plan.protocol['test']}; by patient)")
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
               if k not in ("fn", "quiet", "workers", "command", "force")}
    where = {}
    for r in imp.rows:
        where[str(r.image)] = (r.table, r.number, IMAGE_COLUMN)
        if r.mask is not None:
            where[str(r.mask)] = (r.table, r.number, "mask")
    try:
        return write_plan(plan, args.out, args.seed, workers=max(1, args.workers), say=say, command=options)
    except PrepareError as e:  # a file whose header read but whose pixels do not: name its row
        msg = str(e)
        for path, (t, n, col) in where.items():
            if msg.startswith(path + ":"):
                raise RowError(t.path, n, t.col(col), msg[len(path) + 1:].strip()) from None
        raise


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("csv", nargs="+", metavar="CSV|SITE=CSV",
                   help="the label table(s): one row per image; SITE=FILE names the site of a file without a "
                        "'site' column")
    p.add_argument("--out", required=True, help="scenario folder to write (atomically)")
    p.add_argument("--task", choices=list(TASKS), help="default: inferred from the columns")
    p.add_argument("--classes", help="comma-separated class names, in this order (default: the CSV's class "
                   "columns / the names found, sorted)")
    p.add_argument("--sites", help="comma-separated site names, in this order; a row naming another site fails")
    p.add_argument("--test-fraction", type=float, default=0.2,
                   help="share of each site's patients (fully labeled ones only) in the test split, when no row "
                        "has site 'test' (default 0.2)")
    p.add_argument("--val-fraction", type=float, default=0.15, help="share of each site's patients in its "
                   "validation split (default 0.15)")
    p.add_argument("--seed", type=int, default=0, help="drives the splits (default 0)")
    p.add_argument("--size", type=int, help="resize every image to N x N pixels (default: keep their size)")
    p.add_argument("--channels", type=int, choices=[1, 3], help="default: 3 if any image is in colour, else 1")
    p.add_argument("--window", default="auto", help="DICOM: auto (the file's own VOI LUT or window; without one, "
                   "the image's range) | brain | subdural | bone | multi | LEVEL,WIDTH; an exported bundle applies the "
                   "same (its inference config's dicom_window)")
    p.add_argument("--name", help="scenario name (default: the --out folder's name)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out that fedlabels import did not write")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="image conversion processes")
    p.add_argument("--quiet", action="store_true")


def add_parser(subparsers):
    """Register ``import`` on the main CLI's subparsers; dispatches to :func:`run`."""
    p = subparsers.add_parser("import", help="turn your own images and a label CSV into a scenario folder",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(fn=run)
    return p
