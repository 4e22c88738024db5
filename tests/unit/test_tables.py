"""benchmarks/tables.py: a paper's table from its declarative plan.

The numbers are checked on hand-written cells against hand-computed means, the floors against
rules that give another answer when broken (a class scored by a site that does not annotate it
would win), the plan's errors name the file and field before anything runs, and one real run
(``fedlabels bench`` on a generated split) shows that a second run computes nothing. Every
committed TABLE.md is what its plan writes from the committed cells.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import tables  # noqa: E402


def _row(rnd, cls, metric, value, group="pooled", model="last"):
    return {"round": rnd, "model": model, "group": group, "class": cls, "metric": metric, "value": value,
            "split": "test"}


def _cell(out: Path, run: str, method: str, seed: int, rows, records=(), rounds=2):
    folder = out / run / "cells"
    folder.mkdir(parents=True, exist_ok=True)
    name = method.replace(":", "_")
    (folder / f"{name}-seed{seed}.json").write_text(json.dumps(
        {"config": {"method": method, "seed": seed, "rounds": rounds}, "rows": rows, "records": list(records)}))


PLAN = {
    "title": "A table",
    "out": "OUT",
    "seeds": [0, 1],
    "prepare": {"data": "data/s{seed}", "command": ["synth", "medmnist", "--out", "{data}"]},
    "columns": [{"label": "AUROC", "metric": "auroc"},
                {"label": "AUROC, round 1", "metric": "auroc", "round": 1},
                {"label": "best AUROC", "metric": "auroc", "model": "best"},
                {"label": "tags", "records": ["tagged_negatives", "tagged_positives"]},
                {"label": "recalls", "recalled": True}],
    "paper": {"source": "A paper", "columns": ["AUROC"],
              "values": {"fedavg": {"table": "Table 9", "row": "FedAvg", "values": [70.0]}}},
    "glance": {"column": "AUROC"},
    "sections": [{"heading": "Level one", "class_floor": True,
                  "runs": {"main": {"methods": ["fedavg"]}},
                  "rows": [{"run": "main", "method": "fedavg", "label": "FedAvg", "paper": "fedavg"},
                           {"run": "main", "floor": True}]}],
}


def _write_plan(tmp_path: Path, plan: dict) -> Path:
    plan = json.loads(json.dumps(plan).replace('"OUT"', json.dumps(str(tmp_path / "out"))))
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


@pytest.fixture
def filled(tmp_path):
    """The plan above with hand-written cells: two splits, two sites annotating one class each."""
    out = tmp_path / "out"
    run = "runs/main"
    recall = {0: (0.0, 0.9), 1: (0.5, 0.5)}  # seed 0 recalls one class, seed 1 both
    for seed, (last, first, best) in {0: (0.5, 0.4, 0.6), 1: (0.7, 0.6, None)}.items():
        rows = [_row(2, "mean", "auroc", last), _row(1, "mean", "auroc", first),
                _row(2, "a", "recall", recall[seed][0]), _row(2, "b", "recall", recall[seed][1])]
        if best is not None:
            rows.append(_row(2, "mean", "auroc", best, model="best"))
        records = [{"sites": {"site-1": {"tagged_negatives": 2, "tagged_positives": 1},
                              "site-2": {"tagged_negatives": 3}}}] if seed == 0 else []
        _cell(out, run, "fedavg", seed, rows, records)
    # Per class: site-1 annotates a, site-2 annotates b. Site-2 scores a higher than site-1 does, but
    # it does not annotate a, so the one-model-per-class floor must not take it.
    per_site = {("site-1", 0): (0.55, 0.9, 0.1), ("site-2", 0): (0.3, 0.95, 0.8),
                ("site-1", 1): (0.65, 0.7, 0.2), ("site-2", 1): (0.5, 0.99, 0.6)}
    for (site, seed), (mean, a, b) in per_site.items():
        _cell(out, run, f"local:{site}", seed,
              [_row(2, "mean", "auroc", mean), _row(2, "a", "auroc", a), _row(2, "b", "auroc", b)])
    (out / "splits.json").write_text(json.dumps({
        f"data/s{seed}": {"site-1": {"training": 30, "annotated": ["a"]},
                          "site-2": {"training": 10, "annotated": ["b"]}} for seed in (0, 1)}))
    return _write_plan(tmp_path, PLAN)


def test_the_table_is_the_hand_computed_means_floors_and_paper_values(filled):
    text = tables.table(tables.load_plan(filled))
    # AUROC (0.5, 0.7): 60.0 ± 14.1 (sd with ddof 1); round 1 (0.4, 0.6); best only in seed 0
    assert ("| FedAvg (2) | 60.0 ± 14.1 | 50.0 ± 14.1 | 60.0 | 5 / 1 ; - | 1,2 | 70.0 (Table 9, FedAvg) |"
            in text), text
    # floors with their share of the training cases (30 of 40, 10 of 40)
    assert "| local:site-1 alone (75 % of the training cases) (2) | 60.0 ± 7.1 | — | — |  | 0,0 |  |" in text
    assert "| local:site-2 alone (25 % of the training cases) (2) | 40.0 ± 14.1 |" in text
    # one model per class: seed 0 (0.9 + 0.8) / 2, seed 1 (0.7 + 0.6) / 2; were site-2's a counted,
    # seed 0 would be (0.95 + 0.8) / 2
    assert "| local learning, one model per class (each class by the best site annotating it, picked on test) " \
           "| 75.0 ± 14.1 |" in text
    glance = text.split("## Level one")[0]
    assert "| Level one | 60.0 ± 14.1 (1/2 one class) / 70.0 | 75.0 ± 14.1 (one model per class) |" in glance


def test_a_section_whose_cells_came_from_different_code_names_which_rows_each_wrote(filled):
    assert "written by different code" not in tables.table(tables.load_plan(filled))  # none recorded: one kind
    cells = filled.parent / "out" / "runs" / "main" / "cells"
    for path in cells.glob("*.json"):  # every cell by one recorded version: nothing to say
        path.write_text(json.dumps({**json.loads(path.read_text()), "code": "0.1.0 aaa"}))
    assert "written by different code" not in tables.table(tables.load_plan(filled))
    # FedAvg rerun by later code on one split, site-2's floor cells from before cells recorded it
    path = cells / "fedavg-seed1.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "code": "0.1.0 bbb"}))
    for path in cells.glob("local_site-2-*.json"):
        cell = json.loads(path.read_text())
        del cell["code"]
        path.write_text(json.dumps(cell))
    text = tables.table(tables.load_plan(filled))
    assert ("Cells written by different code (cells per row in brackets): 0.1.0 aaa: FedAvg (1), local:site-1 "
            "alone (75 % of the training cases) (2); 0.1.0 bbb: FedAvg (1); code not recorded: local:site-2 alone "
            "(25 % of the training cases) (2).") in text, text


def test_a_minus_column_is_the_paired_difference_from_the_floor_split_by_split(filled):
    plan = yaml.safe_load(filled.read_text())
    plan["columns"].append({"label": "less site-1", "metric": "auroc", "minus": "local:site-1"})
    filled.write_text(yaml.safe_dump(plan, sort_keys=False))
    text = tables.table(tables.load_plan(filled))
    # FedAvg (0.5, 0.7) less site-1 alone (0.55, 0.65): -5.0 and +5.0 -> +0.0 ± 7.1, 1 of 2 splits above;
    # the means' difference alone (60.0 - 60.0) would hide that the row is below the floor in one split
    assert "| 1,2 | +0.0 ± 7.1 (1/2 above) | 70.0 (Table 9, FedAvg) |" in text, text
    # site-2 alone (0.3, 0.5) less site-1 alone: -25 and -15
    assert "| -20.0 ± 7.1 (0/2 above) |" in text


def test_the_glance_floor_without_class_floor_is_the_best_site_alone(filled):
    plan = yaml.safe_load(filled.read_text())
    plan["sections"][0]["class_floor"] = False
    text = tables.table(tables.load_plan(_write_plan(filled.parent, plan)))
    assert "| Level one | 60.0 ± 14.1 (1/2 one class) / 70.0 | 60.0 ± 7.1 (site-1, 75 % of the training cases) |" \
        in text
    assert "one model per class" not in text


def test_sections_repeat_over_the_for_product_and_share_runs(tmp_path):
    plan = {**PLAN, "glance": None,
            "for": [[{"ds": "x"}, {"ds": "y"}], [{"k": 1}, {"k": 2}]],
            "sections": [{"heading": "{ds} at {k}",
                          "runs": {"ub": {"methods": ["oracle:fedavg"], "dir": "runs/{ds}-ub", "data": "data/{ds}-s{seed}"},
                                   "semi": {"methods": ["fedavg"], "dir": "runs/{ds}-k{k}", "data": "data/{ds}-s{seed}"}},
                          "rows": [{"run": "ub", "method": "oracle:fedavg", "label": "UB"},
                                   {"run": "semi", "method": "fedavg", "label": "FedAvg"}]}]}
    loaded = tables.load_plan(_write_plan(tmp_path, plan))
    assert [s[0] for s in loaded.sections] == ["x at 1", "x at 2", "y at 1", "y at 2"]
    assert list(loaded.runs) == ["runs/x-ub", "runs/x-k1", "runs/x-k2", "runs/y-ub", "runs/y-k1", "runs/y-k2"]
    assert loaded.runs["runs/y-k2"].data == "data/y-s{seed}"  # {seed} is left for each split
    # section by section, seed by seed; the upper bound shared by two sections runs once per seed
    assert tables.tasks(loaded)[:6] == [("runs/x-ub", 0), ("runs/x-k1", 0), ("runs/x-ub", 1), ("runs/x-k1", 1),
                                        ("runs/x-k2", 0), ("runs/x-k2", 1)]
    assert tables.tasks(loaded, {"y-ub"}) == [("runs/y-ub", 0), ("runs/y-ub", 1)]  # a folder
    assert tables.tasks(loaded, {"semi"})[:2] == [("runs/x-k1", 0), ("runs/x-k1", 1)]  # a run name


BAD = [
    (lambda p: p.pop("seeds"), "missing field 'seeds'"),
    (lambda p: p.update(colums=[]), "unknown field(s) ['colums']"),
    (lambda p: p["sections"][0]["rows"][0].update(run="mian"), "rows[0]: 'run' must name one of this section's runs"),
    (lambda p: p["sections"][0]["rows"][0].update(method="fedmlp"), "rows[0]: run main does not train 'fedmlp'"),
    (lambda p: p["sections"][0]["rows"][0].update(paper="fedavgg"), "paper value 'fedavgg' is not in paper.values"),
    (lambda p: p["paper"]["values"]["fedavg"].update(values=[1, 2]), "paper.values['fedavg'] needs"),
    (lambda p: p["columns"].append({"label": "x"}), "columns[5] needs 'label' and one of"),
    (lambda p: p["glance"].update(column="BACC"), "glance.column 'BACC' is not a column label"),
    # the commands a plan runs parse with fedlabels' own parser (a bench option of another command, a prepare
    # command without its required option) before any split is prepared
    (lambda p: p.update(bench=["--protocol", "isofed"]),
     "bench (with the run's own), for runs/main: fedlabels: error: unrecognized arguments: --protocol isofed"),
    (lambda p: p["prepare"].update(command=["prepare", "bloodmnist", "--src", "{src}", "--out", "{data}"]),
     "prepare.command, for runs/main: fedlabels prepare: error: the following arguments are required: --protocol"),
]


@pytest.mark.parametrize("spoil,message", BAD, ids=[m for _, m in BAD])
def test_a_bad_plan_is_one_error_naming_file_and_field_before_anything_runs(tmp_path, capsys, spoil, message):
    plan = json.loads(json.dumps(PLAN))
    spoil(plan)
    path = _write_plan(tmp_path, plan)
    with pytest.raises(tables.PlanError, match=None) as err:
        tables.load_plan(path)
    assert str(path) in str(err.value) and message in str(err.value)
    assert tables.main([str(path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing prepared, run or written


def test_a_run_computes_its_cells_and_a_second_run_computes_nothing(tmp_path, monkeypatch):
    """The real driver: a split made by the plan's prepare command, one real bench process."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the bench process's torch threads
    plan = {"title": "Tiny", "out": str(tmp_path / "out"), "seeds": [0],
            "prepare": {"data": "data/s{seed}", "command": ["synth", "medmnist", "--cases", 32, "--test-cases", 16,
                                                            "--labeled", "{labeled}", "--seed", "{seed}", "--out",
                                                            "{data}"]},
            "bench": ["--bundle", "medmnist_cnn", "--rounds", 1],
            "columns": [{"label": "accuracy", "metric": "accuracy"}],
            "sections": [{"heading": "One", "runs": {"main": {"methods": ["fedavg"], "vars": {"labeled": "1,2"}}},
                          "rows": [{"run": "main", "method": "fedavg", "label": "FedAvg"},
                                   {"run": "main", "floor": True}]}]}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    assert tables.main([str(path)]) == 0
    out = tmp_path / "out"
    cells = sorted((out / "runs" / "main" / "cells").glob("*.json"))
    assert [c.name for c in cells] == ["fedavg-seed0.json", "local_site-1-seed0.json", "local_site-2-seed0.json"]
    splits = json.loads((out / "splits.json").read_text())
    assert list(splits) == ["data/s0"] and sum(s["training"] for s in splits["data/s0"].values()) > 0
    text = (out / "TABLE.md").read_text()
    accuracy = json.loads(cells[0].read_text())
    value = next(r["value"] for r in accuracy["rows"] if (r["model"], r["group"], r["class"], r["metric"], r["round"])
                 == ("last", "pooled", "mean", "accuracy", 1))
    assert f"| FedAvg (1) | {100 * value:.1f} |" in text
    assert "| local:site-2 alone (" in text
    stamps = {c: c.stat().st_mtime_ns for c in cells}
    assert tables.main([str(path)]) == 0
    assert {c: c.stat().st_mtime_ns for c in cells} == stamps  # bench kept every finished cell
    assert (out / "TABLE.md").read_text() == text


@pytest.mark.parametrize("plan", sorted((REPO / "benchmarks" / "plans").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_committed_table_is_what_its_plan_writes_from_the_committed_cells(plan):
    loaded = tables.load_plan(plan)
    committed = loaded.out / "TABLE.md"
    assert committed.is_file(), f"{plan.name}: {committed} missing (python benchmarks/tables.py {plan} --table-only)"
    assert tables.table(loaded) == committed.read_text(), (
        f"{os.path.relpath(committed, REPO)} differs from what {plan.name} writes: "
        f"python benchmarks/tables.py {os.path.relpath(plan, REPO)} --table-only (the cells of a run still going "
        "count too)")
