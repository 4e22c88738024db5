"""Write a planned scenario: convert every image once, write the folder atomically.

A protocol returns a :class:`SplitPlan` -- which case goes to which site and split,
with which (partial) label -- and :func:`write_plan` turns it into the folder
of DESIGN.md section 4, exactly like ``synthetic.generate`` does:

    <out>/scenario.yaml      name, task, classes, sites, seed, image_size, channels, provenance
    <out>/<site>/profile.yaml, datalist.json {"training", "validation"}, oracle.json, images/, masks/
    <out>/test/datalist.json {"testing": [...]} (full labels)
    <out>/<extra-test>/datalist.json   held-out sets that are *not* fully labeled (optional)
    <out>/summary.txt        the per-site table (also printed)

Images are decoded, resized to ``size`` and saved as 8-bit PNG (gray or RGB);
masks as PNG, {0, 255} for one class or the class index + 1 for several.
The folder is built under a temporary name and swapped in at the end
(``profile.scenario_writer``), after it passed ``profile.load_scenario``.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..progress import say as default_say
from ..profile import (SiteProfile, _read_datalist, format_summary, label_summary, load_scenario,
                       scenario_writer, write_json_atomic, write_site, write_yaml)
from .common import (Case, PrepareError, Progress, load_mask, load_pixels, resize_image, resize_mask,
                     safe_id, to_mode)
from .synthetic import box_from_mask


@dataclass
class Entry:
    """One case placed in a split, with the label the site sees and the full one."""

    case: Case
    label: Any = None  # what the datalist says (-1 where not annotated / unlabeled)
    oracle: Any = None  # the full label (None when the truth is not known)
    supervision: str | None = None  # segmentation: pixel | bbox | image | none
    extra: dict = field(default_factory=dict)  # extra keys for the item (e.g. "site", "source")


@dataclass
class SitePlan:
    name: str
    annotated: list
    supervision: str
    training: list
    validation: list
    description: str = ""


@dataclass
class ExtraTest:
    """A held-out set whose labels are partial (-1 where its source does not label)."""

    name: str
    annotated: list
    entries: list
    description: str = ""


@dataclass
class SplitPlan:
    name: str
    task: str
    classes: list
    channels: int
    size: Any  # int (square) or (width, height) or None (keep)
    sites: list
    test: list | None
    oracle: bool = True
    extra_tests: list = field(default_factory=list)
    mask_mode: str = "binary"
    protocol: dict = field(default_factory=dict)
    sources: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    window: Any = None
    generator: str = "fedlabels.data.prepare"  # recorded as provenance.generator


# ------------------------------------------------------------------ conversion


def _convert(job):
    idx, image, mask, img_path, mask_path, size, channels, mask_mode, window, seed, num_classes = job
    try:
        arr = load_pixels(image, window)
        im = resize_image(to_mode(arr, channels), size)
        present, boxes = None, None
        if mask_path is not None:
            m = load_mask(mask, mask_mode)
            h, w = arr.shape[:2]
            if m is None:
                m = np.zeros((h, w), np.uint8)
            elif m.shape != (h, w):
                mh, mw = m.shape
                if abs(mh / mw - h / w) > 0.02 * (h / w):
                    raise PrepareError(f"{mask if not isinstance(mask, list) else mask[0]}: mask is {mw}x{mh} "
                                       f"but its image {image} is {w}x{h}")
                m = resize_mask(m, (w, h))
            m = resize_mask(m, size)
            if m.max() > num_classes:
                raise PrepareError(f"{mask}: mask value {int(m.max())} but the scenario has {num_classes} class(es)")
            _save_mask(m * 255 if mask_mode == "binary" else m, mask_path)
            present = [int(v) - 1 for v in np.unique(m) if v > 0]
            rng = np.random.default_rng([seed, idx])
            boxes = [box_from_mask(m == c + 1, rng, c) for c in present]
        im.save(img_path, format="PNG")
        return idx, None, present, boxes
    except PrepareError as e:
        return idx, str(e), None, None
    except Exception as e:  # noqa: BLE001 - report which file, not a deep trace
        where = image if not isinstance(image, np.ndarray) else f"array image of case {idx}"
        return idx, f"{where}: {type(e).__name__}: {e}", None, None


def _save_mask(arr, path):
    from PIL import Image

    Image.fromarray(np.asarray(arr, dtype=np.uint8)).save(path, format="PNG")


def _run_jobs(jobs, workers, say, skip_bad):
    results = {}
    errors = []
    progress = Progress(len(jobs), "images written", say)
    pool = None
    try:
        # Small in-memory images (MedMNIST) convert faster than they pickle: stay serial.
        heavy = any(not isinstance(j[1], np.ndarray) or j[1].size > 128 * 128 * 3 for j in jobs[:32])
        if workers > 1 and len(jobs) > 64 and heavy:
            pool = mp.get_context("fork").Pool(workers)
            it = pool.imap(_convert, jobs, chunksize=16)
        else:
            it = map(_convert, jobs)
        for idx, err, present, boxes in it:
            progress.step()
            if err is not None:
                errors.append((idx, err))
                if not skip_bad and len(errors) >= 5:
                    break
                continue
            results[idx] = (present, boxes)
    finally:
        progress.close()  # stopped early by bad images: end the bar's line before the error
        if pool is not None:
            pool.terminate()
            pool.join()
    if errors and not skip_bad:
        first = errors[0][1]
        if len(errors) == 1:
            raise PrepareError(first)
        others = "; ".join(e for _, e in errors[1:4])
        raise PrepareError(f"{first} (and more unreadable images: {others}) -- fix or remove them, "
                           f"or pass --skip-bad to leave them out")
    return results, errors


# ------------------------------------------------------------------ writing


def _lock(out: Path):
    """An exclusive lock on ``.<out name>.lock`` beside ``out``, for the time one writer prepares ``out``;
    ``_unlock`` removes the file. A writer that was waiting on a file its holder removed locks the new one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f".{out.name}.lock"
    while True:
        f = open(path, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()  # removed (and maybe made anew) while we waited: lock the file that is there now
    # Under the lock nobody else prepares this folder: leftovers of a killed
    # run (scenario_writer's temporary folders) can go.
    for stale in out.parent.glob(f"{out.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return f


def _unlock(f) -> None:
    """Remove the lock file (still holding it, so no writer locks a file that is going), then release it."""
    try:
        os.unlink(f.name)
    except FileNotFoundError:
        pass
    f.close()


def write_plan(plan: SplitPlan, out, seed: int, workers: int = 1, say=None, skip_bad: bool = False,
               command: list | None = None) -> Path:
    """Write ``plan`` as a scenario folder at ``out`` (atomically); returns the path."""
    say = say or default_say
    out = Path(out).resolve()
    seg = plan.task == "segmentation"
    folders = [(s.name, "training", e) for s in plan.sites for e in s.training]
    folders += [(s.name, "validation", e) for s in plan.sites for e in s.validation]
    if plan.test:
        folders += [("test", "testing", e) for e in plan.test]
    for x in plan.extra_tests:
        folders += [(x.name, "testing", e) for e in x.entries]
    for s in plan.sites:
        if not s.training:
            raise PrepareError(f"protocol {plan.protocol.get('name')}: {s.name} has no training cases "
                               f"(too few source images; lower --val-fraction or raise --limit)")

    lock = _lock(out)
    try:
        with scenario_writer(out) as tmp:
            names = {}  # (folder, case id) -> relative image name
            used = set()
            jobs = []
            rel = []
            for folder, _split, e in folders:
                key = (folder, e.case.id)
                if key in names:
                    raise PrepareError(f"internal: case {e.case.id} placed twice in {folder}")
                stem = safe_id(e.case.id)
                n = 1
                while (folder, stem) in used:
                    n += 1
                    stem = f"{safe_id(e.case.id)}_{n}"
                used.add((folder, stem))
                names[key] = stem
                (tmp / folder / "images").mkdir(parents=True, exist_ok=True)
                mask_path = None
                # a mask for every case that has or needs one (test, oracle, pixel level); a box or
                # image-level case of a plan without oracle labels carries its own label in ``extra``
                if seg and (plan.oracle or _split == "testing" or e.supervision == "pixel" or e.case.mask is not None):
                    (tmp / folder / "masks").mkdir(parents=True, exist_ok=True)
                    mask_path = str(tmp / folder / "masks" / f"{stem}.png")
                jobs.append((len(jobs), e.case.image, e.case.mask, str(tmp / folder / "images" / f"{stem}.png"),
                             mask_path, plan.size, plan.channels, plan.mask_mode, plan.window, seed,
                             len(plan.classes)))
                rel.append(stem)
            say(f"writing {len(jobs)} images ({plan.channels} channel(s), size {plan.size}) to {out}")
            results, errors = _run_jobs(jobs, workers, say, skip_bad)
            skipped = [str(folders[i][2].case.id) for i, _ in errors]

            def item(j, e, split_kind):
                stem = rel[j]
                img = f"images/{stem}.png"
                if seg:
                    present, boxes = results[j]
                    if split_kind == "oracle" or split_kind == "testing":
                        return {"image": img, "seg": f"masks/{stem}.png", **e.extra}
                    level = e.supervision
                    it = {"image": img, "supervision": level}
                    if level == "pixel":
                        it["seg"] = f"masks/{stem}.png"
                    elif level == "bbox":
                        it["boxes"] = boxes
                    elif level == "image":
                        it["classes"] = present
                    it.update(e.extra)
                    return it
                label = e.oracle if split_kind in ("oracle", "testing") else e.label
                return {"image": img, "label": _jsonable(label), **e.extra}

            j = 0
            lists = {}
            for folder, split, e in folders:
                if j in results:
                    lists.setdefault((folder, split), []).append((j, e))
                j += 1

            for s in plan.sites:
                train = lists.get((s.name, "training"), [])
                val = lists.get((s.name, "validation"), [])
                profile = SiteProfile(s.name, plan.task, tuple(plan.classes), tuple(c for c in plan.classes if c in s.annotated),
                                      s.supervision)
                oracle = None
                if plan.oracle:
                    oracle = {"training": [item(j, e, "oracle") for j, e in train],
                              "validation": [item(j, e, "oracle") for j, e in val]}
                write_site(tmp / s.name, profile, [item(j, e, "site") for j, e in train],
                           [item(j, e, "site") for j, e in val], oracle)
            if plan.test:
                write_json_atomic(tmp / "test" / "datalist.json",
                                  {"testing": [item(j, e, "testing") for j, e in lists.get(("test", "testing"), [])]})
            for x in plan.extra_tests:
                write_json_atomic(tmp / x.name / "datalist.json",
                                  {"testing": [item(j, e, "site") for j, e in lists.get((x.name, "testing"), [])]})

            meta = _scenario_meta(plan, seed, command, skipped)
            write_yaml(tmp / "scenario.yaml", meta)
            # Validate exactly as training will, before the folder is swapped in.
            sc = load_scenario(tmp)
            for x in plan.extra_tests:
                load_extra_test(tmp, x.name)
            table = format_summary(sc)
            if plan.oracle and sc.task == "multiclass" and any(s.supervision == "none" for s in plan.sites):
                table += "\n" + _oracle_table(sc)
            test_line = _test_line(sc)
            meta["summary"] = {name: _site_summary(site) for name, site in sc.sites.items()}
            if sc.test is not None:
                meta["summary"]["test"] = {"cases": len(sc.test)}
            write_yaml(tmp / "scenario.yaml", meta)
            text = "\n".join([f"{plan.name}: {plan.task}, {len(plan.classes)} classes, {len(plan.sites)} sites",
                              table, test_line] + [f"note: {n}" for n in plan.notes]) + "\n"
            (tmp / "summary.txt").write_text(text)
        say(text.rstrip())
        say(f"wrote {out}")
    finally:
        _unlock(lock)
    return out


def _jsonable(v):
    if isinstance(v, np.ndarray):
        return [int(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    return v


def _site_summary(site) -> dict:
    """Training cases per class as 'annotated/positives' ('-' = not annotated), like the printed table."""
    s = label_summary(site.profile, site.training)
    per_class = {}
    for c, name in enumerate(site.profile.classes):
        if not s["labeled_mask"][c]:
            per_class[name] = "-"
        elif site.profile.task == "segmentation":
            per_class[name] = str(s["annotated"][c])
        else:
            per_class[name] = f"{s['annotated'][c]}/{s['positives'][c]}"
    return {"training": s["cases"], "validation": len(site.validation), "supervision": site.profile.supervision,
            "per_class": per_class}


def _oracle_table(sc) -> str:
    """Training cases per class from oracle.json: the label skew unlabeled sites hide."""
    heads = ["site", "cases"] + list(sc.classes)
    rows = []
    for name, site in sc.sites.items():
        y = [i["label"] for i in site.oracle()["training"]]
        rows.append([name, str(len(y))] + [str(v) for v in np.bincount(y, minlength=len(sc.classes))])
    widths = [max(len(r[i]) for r in [heads] + rows) for i in range(len(heads))]
    fmt = lambda r: "  ".join(v.rjust(w) for v, w in zip(r, widths))  # noqa: E731
    return "\n".join(["true classes (oracle.json, training split):", fmt(heads)] + [fmt(r) for r in rows])


def _test_line(sc) -> str:
    if sc.test is None:
        return "test: none (see extra_tests in scenario.yaml)"
    if sc.task == "multilabel":
        pos = np.array([i["label"] for i in sc.test]).sum(0).astype(int).tolist()
        return f"test: {len(sc.test)} cases; positives per class {dict(zip(sc.classes, pos))}"
    if sc.task == "multiclass":
        counts = np.bincount([i["label"] for i in sc.test], minlength=len(sc.classes)).tolist()
        return f"test: {len(sc.test)} cases; per class {dict(zip(sc.classes, counts))}"
    return f"test: {len(sc.test)} cases (pixel masks)"


def _scenario_meta(plan: SplitPlan, seed: int, command, skipped) -> dict:
    size = plan.size
    image_size = None if size is None else ([size, size] if isinstance(size, int) else list(size))
    meta = {
        "name": plan.name,
        "task": plan.task,
        "classes": list(plan.classes),
        "sites": [s.name for s in plan.sites],
        "seed": seed,
        "image_size": image_size,
        "channels": plan.channels,
        "protocol": plan.protocol,
        "site_sources": {s.name: s.description for s in plan.sites},
    }
    if plan.task == "segmentation":
        meta["mask_values"] = ({"background": 0, plan.classes[0]: 255} if plan.mask_mode == "binary"
                               else {"background": 0, **{c: i + 1 for i, c in enumerate(plan.classes)}})
    if plan.window is not None:  # DICOM decoded with this window: an exported bundle applies it too
        meta["dicom_window"] = plan.window
    if plan.extra_tests:
        meta["extra_tests"] = {x.name: {"datalist": f"{x.name}/datalist.json", "annotated": list(x.annotated),
                                        "description": x.description} for x in plan.extra_tests}
    meta["provenance"] = {
        "generator": plan.generator,
        "command": command,
        "protocol": plan.protocol.get("name"),
        "seed": seed,
        "sources": [s.provenance() for s in plan.sources],
        "notes": list(plan.notes),
    }
    if skipped:
        meta["provenance"]["skipped_unreadable"] = skipped
    return meta


def load_extra_test(root, name) -> list:
    """Read and validate a partially labeled held-out set listed under ``extra_tests``."""
    import yaml

    root = Path(root)
    meta = yaml.safe_load((root / "scenario.yaml").read_text())
    info = (meta.get("extra_tests") or {}).get(name)
    if info is None:
        raise PrepareError(f"{root / 'scenario.yaml'}: no extra test set named {name!r}")
    classes = tuple(meta["classes"])
    profile = SiteProfile(name, meta["task"], classes, tuple(c for c in classes if c in info["annotated"]), "image")
    return _read_datalist(root / info["datalist"], classes, meta["task"], profile, splits=("testing",))["testing"]
