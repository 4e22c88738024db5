"""``fedlabels import``: hand-made datasets (PNG and DICOM images, CSVs) -> scenario folders.

Multi-label with blanks at two sites (validated, then one bench round), segmentation
with masks at one site, boxes at another and image-level tags at a third (validated, then
one FedMix bench round), multi-class split by patient, and
malformed rows: one line naming file, row and column, exit status 2, nothing written.
The "Bring your own data" example of docs/datasets.md runs as written.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from fedlabels import cli
from fedlabels.data.dicom import write_dicom
from fedlabels.profile import load_scenario

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- helpers


def png(path: Path, arr) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(arr, dtype=np.uint8)).save(path)
    return path.name


def write_csv(path: Path, rows: list) -> Path:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


def fedlabels(capsys, *argv) -> tuple:
    """``fedlabels ARGV`` in process: (exit status, stdout, stderr)."""
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def imported(capsys, *argv) -> str:
    rc, out, err = fedlabels(capsys, "import", *argv, "--workers", "1")
    assert rc == 0, err
    return out


def multilabel_dataset(root: Path, n=12) -> Path:
    """site-1 labels a, b; site-2 labels b, c (the other column blank); 'test' rows label all three."""
    rng = np.random.default_rng(0)
    rows = [["image", "site", "patient", "a", "b", "c"]]
    for site, labels in (("site-1", "ab"), ("site-2", "bc"), ("test", "abc")):
        for i in range(n):
            y = rng.integers(0, 2, 3)
            arr = rng.random((32, 32)) * 60 + 90 * y[0] + 50 * y[1] + 30 * y[2]
            name = png(root / "images" / f"{site}_{i}.png", arr)
            rows.append([f"images/{name}", site, f"{site}-p{i // 2}"]
                        + [str(v) if "abc"[j] in labels else "" for j, v in enumerate(y)])
    return write_csv(root / "labels.csv", rows)


def square(size, x0, y0, x1, y1, value=255):
    m = np.zeros((size, size), np.int32)
    m[y0:y1, x0:x1] = value
    return m


# ---------------------------------------------------------------- (a) multi-label with blanks


def test_multilabel_with_blanks_validates_and_benches(tmp_path, capsys):
    labels = multilabel_dataset(tmp_path / "data")
    out = tmp_path / "scen"
    printed = imported(capsys, labels, "--out", out)
    assert "site-1" in printed and "site-2" in printed and f"wrote {out}" in printed
    assert sorted(p.name for p in out.parent.iterdir()) == ["data", "scen"]  # no lock file left behind

    rc, table, err = fedlabels(capsys, "validate", out)
    assert rc == 0, err
    assert re.search(r"site-1\s+\d+\s+\d+/\d+\s+\d+/\d+\s+-", table)  # c not annotated at site-1
    assert re.search(r"site-2\s+\d+\s+-\s+\d+/\d+\s+\d+/\d+", table)  # a not annotated at site-2

    sc = load_scenario(out)
    assert sc.task == "multilabel" and sc.classes == ("a", "b", "c")
    assert sc.sites["site-1"].profile.annotated == ("a", "b")
    assert sc.sites["site-2"].profile.annotated == ("b", "c")
    assert all(item["label"][2] == -1 for item in sc.sites["site-1"].training)
    assert len(sc.test) == 12 and all(-1 not in item["label"] for item in sc.test)
    meta = yaml.safe_load((out / "scenario.yaml").read_text())
    assert meta["provenance"]["generator"] == "fedlabels.data.importer"
    assert not (out / "site-1" / "oracle.json").exists()  # the truth behind a blank is unknown

    bench = tmp_path / "bench"
    rc, text, err = fedlabels(capsys, "bench", "--data", out, "--bundle", "cxr_resnet18", "--methods", "fedavg_pl",
                              "--rounds", "1", "--network", "widen_factor=0.25", "--image-size", "32", "--out", bench)
    assert rc == 0, err
    rows = list(csv.DictReader(open(bench / "results.csv")))
    assert {r["method"] for r in rows} >= {"fedavg_pl", "local:site-1", "local:site-2"}


def test_reimport_replaces_own_scenario_and_refuses_other_folders(tmp_path, capsys):
    labels = multilabel_dataset(tmp_path / "data", n=6)
    out = tmp_path / "scen"
    imported(capsys, labels, "--out", out, "--quiet")
    imported(capsys, labels, "--out", out, "--quiet", "--seed", "1")  # its own scenario: replaced
    assert yaml.safe_load((out / "scenario.yaml").read_text())["seed"] == 1

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    rc, _, err = fedlabels(capsys, "import", labels, "--out", other)
    assert rc == 2 and "--force" in err and len(err.strip().splitlines()) == 1
    assert (other / "notes.txt").read_text() == "keep me" and not (other / "scenario.yaml").exists()
    imported(capsys, labels, "--out", other, "--quiet", "--force")
    assert not (other / "notes.txt").exists()
    load_scenario(other)

    rc, _, err = fedlabels(capsys, "import", labels, "--out", tmp_path / "data", "--force")  # would delete its input
    assert rc == 2 and "holds the input" in err and labels.exists()


def test_one_csv_per_site(tmp_path, capsys):
    """SITE=FILE names the site of a CSV without a site column; 'test=' gives the test set."""
    rng = np.random.default_rng(2)
    files = []
    for site, labels in (("north", "ab"), ("south", "b"), ("test", "ab")):
        rows = [["Image", "A", "B"]]  # header names in any case
        for i in range(6):
            y = rng.integers(0, 2, 2)
            png(tmp_path / site / f"{i}.png", np.full((8, 8), 40 * i))
            rows.append([f"{site}/{i}.png"] + [str(v) if "ab"[j] in labels else "" for j, v in enumerate(y)])
        files.append(f"{site}={write_csv(tmp_path / f'{site}.csv', rows)}")
    out = tmp_path / "scen"
    imported(capsys, *files, "--out", out, "--quiet")
    sc = load_scenario(out)
    assert list(sc.sites) == ["north", "south"] and sc.classes == ("A", "B") and len(sc.test) == 6
    assert sc.sites["south"].profile.annotated == ("B",)
    names = {Path(i["image"]).name for s in sc.sites.values() for i in s.training + s.validation}
    assert len(names) == 12  # 0.png ... 5.png twice: written under their folder's name


# ---------------------------------------------------------------- (b) segmentation: masks and boxes


def test_segmentation_masks_boxes_and_image_level_classes(tmp_path, capsys):
    data = tmp_path / "data"
    rows = [["image", "site", "mask", "box"]]
    for i in range(10):  # site-1: pixel masks
        x = 4 + i
        png(data / "s1" / f"img{i}.png", square(32, x, 6, x + 10, 20, 200) + 20)
        png(data / "s1" / f"img{i}_mask.png", square(32, x, 6, x + 10, 20))
        rows.append([f"s1/img{i}.png", "site-1", f"s1/img{i}_mask.png", ""])
    boxes = {}
    for i in range(8):  # site-2: boxes, one image lesion-free, one a DICOM
        x = 2 + i
        box = f"{x},5,{x + 12},18" if i != 3 else "none"
        if i == 5:
            write_dicom(data / "s2" / f"ct{i}.dcm", (square(32, x, 5, x + 12, 18, 400).astype(np.int16) - 100),
                        patient_id=f"P{i}", sop_uid=f"1.2.3.{i}")
            name = f"s2/ct{i}.dcm"
        else:
            png(data / "s2" / f"img{i}.png", square(32, x, 5, x + 12, 18, 200) + 20)
            name = f"s2/img{i}.png"
        # site-1 has an img{i}.png too: a name used twice is written under its folder's name
        boxes["s2_" + Path(name).stem if i != 5 else "ct5"] = [] if box == "none" else [[x, 5, x + 12, 18, 0]]
        rows.append([name, "site-2", "", box])
    rows[0].append("classes")
    for i in range(6):  # site-3: image-level classes
        png(data / "s3" / f"c{i}.png", np.full((32, 32), 30 * i))
        rows.append([f"s3/c{i}.png", "site-3", "", "", "lesion" if i % 2 else "none"])
    rows = [r + [""] * (len(rows[0]) - len(r)) for r in rows]
    labels = write_csv(data / "labels.csv", rows)
    out = tmp_path / "scen"
    imported(capsys, labels, "--out", out, "--classes", "lesion", "--test-fraction", "0.3")

    rc, table, err = fedlabels(capsys, "validate", out)
    assert rc == 0, err
    assert "(pixel)" in table and "(bbox)" in table and "(image)" in table
    sc = load_scenario(out)
    assert sc.task == "segmentation" and sc.classes == ("lesion",)
    assert sc.sites["site-1"].profile.supervision == "pixel"
    assert sc.sites["site-2"].profile.supervision == "bbox"
    assert yaml.safe_load((out / "site-2" / "profile.yaml").read_text())["supervision"] == "bbox"
    items = sc.sites["site-2"].training + sc.sites["site-2"].validation
    assert len(items) == 8
    for item in items:
        assert item["supervision"] == "bbox" and "seg" not in item
        assert item["boxes"] == boxes[Path(item["image"]).stem]
    assert not (out / "site-2" / "masks").exists()  # no made-up masks at a box site
    site3 = sc.sites["site-3"]
    assert site3.profile.supervision == "image" and len(site3.training + site3.validation) == 6
    assert {tuple(i["classes"]) for i in site3.training + site3.validation} == {(), (0,)}
    assert all(i["supervision"] == "image" and "seg" not in i for i in site3.training + site3.validation)
    # the test split: site-1's masked cases only (30 % of its patients), marked with their site
    assert len(sc.test) == 3 and all(t["site"] == "site-1" and t["seg"] for t in sc.test)
    dcm_png = next(Path(i["image"]) for i in items if Path(i["image"]).stem == "ct5")
    arr = np.asarray(Image.open(dcm_png))
    assert arr.shape == (32, 32) and arr[10, 10] > arr[0, 0]  # the DICOM's lesion is bright, scaled to 8 bits

    # and bench runs on it: FedMix, the method for masks, boxes and image-level tags, one round
    bench = tmp_path / "bench"
    rc, text, err = fedlabels(capsys, "bench", "--data", out, "--bundle", "lesion_unet", "--methods", "fedmix",
                              "--rounds", "1", "--image-size", "32", "--out", bench)
    assert rc == 0, err
    rows = list(csv.DictReader(open(bench / "results.csv")))
    assert {r["method"] for r in rows} >= {"fedmix", "local:site-1"}
    assert any(r["metric"] == "dice" and r["method"] == "fedmix" and r["value"] for r in rows)


def test_segmentation_of_two_classes_resized(tmp_path, capsys):
    """Label-map masks (class index + 1), boxes naming their class, --size scaling both."""
    rows = [["image", "site", "mask", "box"]]
    for i in range(8):
        m = square(20, 2, 2, 6, 6, 1) + square(20, 10, 10, 15, 15, 2)
        png(tmp_path / f"i{i}.png", m * 40 + 30)
        png(tmp_path / f"m{i}.png", m)
        rows.append([f"i{i}.png", "a", f"m{i}.png", ""])
    for i in range(8, 12):
        png(tmp_path / f"i{i}.png", np.full((20, 20), 50))
        rows.append([f"i{i}.png", "b", "", "2,2,6,6,fluid;10,10,15,15,cyst"])
    out = tmp_path / "scen"
    imported(capsys, write_csv(tmp_path / "labels.csv", rows), "--out", out, "--size", "40", "--quiet")
    sc = load_scenario(out)
    assert sc.classes == ("cyst", "fluid")  # names found in the boxes, sorted
    assert yaml.safe_load((out / "scenario.yaml").read_text())["mask_values"] == {"background": 0, "cyst": 1,
                                                                                    "fluid": 2}
    for item in sc.sites["b"].training + sc.sites["b"].validation:
        assert item["boxes"] == [[4, 4, 12, 12, 1], [20, 20, 30, 30, 0]]
    for item in sc.test + sc.sites["a"].training:
        mask = np.asarray(Image.open(item["seg"]))
        assert mask.shape == (40, 40) and set(np.unique(mask)) == {0, 1, 2}


# ---------------------------------------------------------------- (c) multi-class split by patient


def test_multiclass_patient_stays_in_one_split(tmp_path, capsys):
    data = tmp_path / "data"
    rng = np.random.default_rng(1)
    rows = [["image", "site", "patient", "label"]]
    for s in range(3):
        for p in range(10):
            for k in range(3):  # three images per patient
                name = f"s{s}p{p}k{k}"
                png(data / "img" / f"{name}.png", np.stack([rng.integers(0, 255, (16, 16))] * 3, -1))
                label = ["benign", "malignant", "normal"][(p + k) % 3] if (s, p, k) != (2, 0, 0) else ""
                rows.append([f"img/{name}.png", f"hospital-{s + 1}", f"P{p}", label])
    labels = write_csv(data / "labels.csv", rows)
    out = tmp_path / "scen"
    imported(capsys, labels, "--out", out, "--test-fraction", "0.2", "--val-fraction", "0.2", "--seed", "3")
    sc = load_scenario(out)
    assert sc.task == "multiclass" and sc.classes == ("benign", "malignant", "normal")
    assert list(sc.sites) == ["hospital-1", "hospital-2", "hospital-3"]
    meta = yaml.safe_load((out / "scenario.yaml").read_text())
    assert meta["channels"] == 3

    where = {}  # (site, patient) -> the splits its images are in
    for name, site in sc.sites.items():
        for split in ("training", "validation"):
            for item in getattr(site, split):
                s, p = re.match(r"s(\d)p(\d+)k", Path(item["image"]).stem).groups()
                assert f"hospital-{int(s) + 1}" == name
                where.setdefault((s, p), set()).add(split)
    for item in sc.test:
        s, p = re.match(r"s(\d)p(\d+)k", Path(item["image"]).stem).groups()
        where.setdefault((s, p), set()).add("test")
    assert len(where) == 30 and all(len(splits) == 1 for splits in where.values()), where
    counts = {sp: sum(sp in v for v in where.values()) for sp in ("training", "validation", "test")}
    assert counts == {"training": 18, "validation": 6, "test": 6}
    # the patient with an unlabeled image is never drawn for the test split
    assert where[("2", "0")] != {"test"}
    assert sum(item["label"] == -1 for item in sc.sites["hospital-3"].training + sc.sites["hospital-3"].validation) == 1


# ---------------------------------------------------------------- (d) malformed rows


def _base(root: Path) -> list:
    """A good multi-label table (rows 2-9) whose cells the cases below break."""
    rows = [["image", "site", "patient", "a", "b"]]
    for i in range(8):
        png(root / f"i{i}.png", np.full((16, 16), 10 * i))
        rows.append([f"i{i}.png", f"site-{1 + i % 2}", f"p{i}", str(i % 2), "" if i % 2 else "1"])
    return rows


def _set(rows, row, column, value):
    rows[row - 1][rows[0].index(column)] = value


def _seg(root):
    for name, shape in (("s", (16, 16)), ("s_mask", (16, 16)), ("t", (16, 16)), ("big_mask", (20, 16))):
        png(root / f"{name}.png", np.zeros(shape))
    return [["image", "site", "mask", "box"],
            ["s.png", "site-1", "s_mask.png", ""],
            ["t.png", "site-2", "", "2,2,9,9"]]


def _broken(kind, root):
    """(rows, extra arguments, row, column, words of the message)"""
    rows = _base(root)
    if kind == "missing image":
        _set(rows, 4, "image", "nope.png")
        return rows, [], 4, "image", "file not found"
    if kind == "unreadable image":
        (root / "bad.png").write_bytes(b"not a png at all")
        _set(rows, 5, "image", "bad.png")
        return rows, [], 5, "image", "not a readable image"
    if kind == "unknown site":
        _set(rows, 6, "site", "site-9")
        return rows, ["--sites", "site-1,site-2"], 6, "site", "unknown site 'site-9'"
    if kind == "label not 0/1/blank":
        _set(rows, 7, "b", "2")
        return rows, [], 7, "b", "'2' is not a label"
    if kind == "class column missing":
        return rows, ["--classes", "a,b,c"], 1, "c", "missing: --classes names this class"
    if kind == "same image twice":
        _set(rows, 8, "image", "i0.png")
        return rows, [], 8, "image", "the same image as labels.csv row 2"
    if kind == "site column missing":  # several hospitals' rows would merge into one site named after the file
        rows = [[c for j, c in enumerate(r) if j != 1] for r in rows]
        return rows, [], 1, "site", "missing: name each row's hospital (or 'test') in a 'site' column, or give " \
            "the whole file to one site as SITE=labels.csv"
    if kind == "blank site":
        _set(rows, 3, "site", "")
        return rows, [], 3, "site", "blank"
    if kind == "test row not fully labeled":
        _set(rows, 3, "site", "test")
        return rows, [], 3, "b", "test set is fully labeled"
    if kind == "split leaves no training data":
        for r in range(2, 10):
            _set(rows, r, "patient", "same")  # one patient per site, all to validation
        return rows, ["--val-fraction", "0.9"], 2, "patient", "leaves no training case"
    if kind == "mask missing":
        rows = _seg(root)
        rows[1][2] = "gone_mask.png"
        return rows, [], 2, "mask", "file not found"
    if kind == "mask of another size":
        rows = _seg(root)
        rows[1][2] = "big_mask.png"
        return rows, [], 2, "mask", "the mask is 16x20 pixels but its image s.png is 16x16"
    if kind == "box outside the image":
        rows = _seg(root)
        rows[2][3] = "2,2,9,17"
        return rows, [], 3, "box", "outside the 16x16 image"
    if kind == "box not four numbers":
        rows = _seg(root)
        rows[2][3] = "2,2,9"
        return rows, [], 3, "box", "expected x0,y0,x1,y1"
    if kind == "multiclass: unknown class":
        rows = [["image", "site", "label"]] + [[f"i{i}.png", "site-1", "x"] for i in range(3)]
        rows[3][2] = "z"
        return rows, ["--classes", "x,y"], 4, "label", "unknown class 'z'"
    if kind == "multiclass: label column missing":
        rows = [["image", "site"]] + [[f"i{i}.png", "site-1"] for i in range(3)]
        return rows, ["--task", "multiclass"], 1, "label", "missing"
    raise AssertionError(kind)


BROKEN = ["missing image", "unreadable image", "unknown site", "label not 0/1/blank", "class column missing",
          "same image twice", "site column missing", "blank site", "test row not fully labeled", "split leaves no training data",
          "mask missing", "mask of another size", "box outside the image", "box not four numbers",
          "multiclass: unknown class", "multiclass: label column missing"]


@pytest.mark.parametrize("kind", BROKEN)
def test_malformed_row_is_one_line_naming_file_row_and_column(kind, tmp_path, capsys):
    rows, extra, row, column, words = _broken(kind, tmp_path)
    labels = write_csv(tmp_path / "labels.csv", rows)
    out = tmp_path / "out" / "scen"
    rc, _, err = fedlabels(capsys, "import", labels, "--out", out, *extra)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"fedlabels: {labels}: row {row}: column '{column}': "), lines[0]
    assert words in lines[0]
    assert not (tmp_path / "out").exists()  # nothing written, not even the lock file's folder


def test_pixels_that_do_not_decode_name_their_row(tmp_path, capsys):
    """A PNG whose header reads but whose pixel data is cut off fails at conversion, named by row."""
    rows = _base(tmp_path)
    blob = (tmp_path / "i3.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(blob[: len(blob) // 2])
    _set(rows, 5, "image", "cut.png")
    labels = write_csv(tmp_path / "labels.csv", rows)
    out = tmp_path / "scen"
    rc, _, err = fedlabels(capsys, "import", labels, "--out", out, "--workers", "1", "--quiet")
    assert rc == 2 and err.startswith(f"fedlabels: {labels}: row 5: column 'image': "), err
    assert not out.exists() and not list(tmp_path.glob("scen.partial-*"))


# ---------------------------------------------------------------- the documented example


def _doc_section() -> str:
    text = (REPO / "docs" / "datasets.md").read_text()
    start = text.index("## Bring your own data")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_documented_example_runs(tmp_path, capsys, monkeypatch):
    section = _doc_section()
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    python = [b for lang, b in blocks if lang == "python"]
    shell = [b for lang, b in blocks if lang == "bash"]
    assert python and shell
    monkeypatch.chdir(tmp_path)
    for code in python:
        exec(compile(code, "docs/datasets.md", "exec"), {"__name__": "__docs__"})
    commands = []
    for block in shell:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("fedlabels "):
                commands.append(shlex.split(line)[1:])
    assert [c[0] for c in commands][:2] == ["import", "validate"], commands
    # the first command as a real subprocess (the console entry point), the rest in process
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO / "custom"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "fedlabels.cli", *commands[0]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
    for argv in commands[1:]:
        rc, out, err = fedlabels(capsys, *argv)
        assert rc == 0, (argv, err)
    out_dir = Path(commands[0][commands[0].index("--out") + 1])
    sc = load_scenario(tmp_path / out_dir)
    assert len(sc.sites) == 2 and sc.test
    assert list(sc.sites) == ["hospital-a", "hospital-b"]


def test_the_lock_file_goes_and_writers_still_exclude_each_other(tmp_path):
    """The lock beside a scenario folder is removed when its writer is done; a writer waiting on it
    meanwhile locks afresh, after the first has finished (never two at once)."""
    import threading
    import time

    from fedlabels.data.build import _lock, _unlock

    out = tmp_path / "scen"
    first = _lock(out)
    order = []

    def second():
        held = _lock(out)
        order.append("second locked")
        time.sleep(0.1)
        _unlock(held)

    waiter = threading.Thread(target=second)
    waiter.start()
    time.sleep(0.3)
    order.append("first done")
    _unlock(first)
    waiter.join(10)
    assert order == ["first done", "second locked"]
    assert list(tmp_path.iterdir()) == []
