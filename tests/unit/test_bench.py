"""``fedlabels bench``: the comparison table, its floor rows, reruns, refusals and its numbers.

One tiny bench run (embedded cxr, 12 cases per reference site, 8 test cases,
ResNet-18 a quarter as wide at 32 px, 2 rounds, FedAvg and Surgical Aggregation,
seed 0) is shared by the tests of this module: a real ``fedlabels bench`` process
(``python -m fedlabels.cli``), so its console is the one a user sees, and its
folder serves the checks that read a run's output (the reruns, ``--reuse`` and the
refusals run through the CLI's ``main()`` in this process). Its numbers
are checked against ``references.federate`` + ``score`` (and ``references.local``
for a floor row) called directly: a plumbing check (bench reports what the engine
computed, for the right cell, model and class), not an independent one, since bench
calls the same functions. The engine and the rules are checked against hand-written
loops in tests/unit/test_engine.py and tests/unit/test_methods.py, the training path against a
plain-PyTorch FedAvg in tests/unit/test_reference_check.py. The FLARE-engine test runs the
real simulator: tests/simulator/test_bench_flare.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fedlabels import bench, cli, references
from fedlabels.bundle import bundle_path
from fedlabels.release import code_version
from helpers import fedlabels_env, read_csv as _read_csv, run_cli as _main, score_directly

BENCH = ["bench", "--data", "embedded:cxr", "--synth", "cases=12", "--synth", "test_cases=8", "--bundle",
         "cxr_resnet18", "--methods", "fedavg,surgical", "--seeds", "0", "--rounds", "2", "--batch-size", "8",
         "--network", "widen_factor=0.25", "--image-size", "32"]  # small and fast: no check here depends on size
SITES = [f"site-{k}" for k in range(1, 5)]


def _value(rows, **where) -> float:
    hits = [r for r in rows if all(r[k] == str(v) for k, v in where.items())]
    assert len(hits) == 1, (where, hits)
    return float(hits[0]["value"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The module's bench run, as a user runs it: a ``fedlabels bench`` process on one OpenMP thread (as this
    session's torch), its stdout and, for the console checks, its stdout and stderr together."""
    out = tmp_path_factory.mktemp("bench") / "out"
    proc = subprocess.run([sys.executable, "-m", "fedlabels.cli", *BENCH, "--out", str(out)], capture_output=True,
                          text=True, timeout=900, env=fedlabels_env())
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    return {"out": out, "stdout": proc.stdout, "console": console, "rows": _read_csv(out / "results.csv")}


def test_writes_table_floors_and_plots(run):
    out, rows = run["out"], run["rows"]
    assert list(rows[0]) == list(bench.CSV_COLUMNS)
    methods = {r["method"] for r in rows}
    assert methods == {"fedavg", "surgical"} | {f"local:{s}" for s in SITES}
    for m in ("fedavg", "surgical"):
        assert {r["model"] for r in rows if r["method"] == m} == {"last", "best"}
    assert {r["model"] for r in rows if r["method"].startswith("local:")} == {"last"}
    # pooled, and per site-style group (the embedded test cases name the style they were drawn in)
    assert {r["split"] for r in rows} == {"test"}
    assert {r["group"] for r in rows} == {"pooled", "site-1", "site-2", "site-3", "site-4"}
    assert {r["metric"] for r in rows} == {"auroc", "ap", "bacc"}
    assert {r["round"] for r in rows} == {"2"}
    # every defined value is a number in [0, 1]; undefined ones are empty, never 0 or NaN
    assert all(r["value"] == "" or 0.0 <= float(r["value"]) <= 1.0 for r in rows)
    assert any(r["value"] for r in rows if r["method"] == "fedavg")
    md = (out / "results.md").read_text()
    for s in SITES:
        assert f"local:{s} (" in md
    assert "% of training cases" in md and "1 seed(s)" in md and "each seed its own split" in md
    assert "| fedavg · last |" in md and "| surgical · best |" in md
    assert list((out / "plots").glob("*.png"))
    assert sorted(p.name for p in (out / "cells").glob("*.json")) == sorted(
        ["fedavg-seed0.json", "surgical-seed0.json"] + [f"local_{s}-seed0.json" for s in SITES])
    # each cell names the code that wrote it (a checkout's commit here)
    assert {json.loads(p.read_text())["code"] for p in (out / "cells").glob("*.json")} == {code_version()}
    # progress: one start and one finish line per cell, with the elapsed time
    for label in ["fedavg seed 0", "surgical seed 0"] + [f"local:{s} seed 0" for s in SITES]:
        assert f"{label}: start" in run["stdout"]
        assert f"{label}: done in " in run["stdout"]


def test_rerun_skips_every_cell(run):
    out = run["out"]
    cells = sorted((out / "cells").glob("*.json"))
    before = {p: p.stat().st_mtime_ns for p in cells}
    table = (out / "results.csv").read_text()
    code, stdout, stderr = _main(BENCH + ["--out", out])
    assert code == 0, stderr
    assert stdout.count("skipped (done)") == len(cells) == 6
    assert ": start" not in stdout
    assert {p: p.stat().st_mtime_ns for p in cells} == before
    assert (out / "results.csv").read_text() == table


def test_rerun_reuses_cells_computed_at_another_path_of_the_same_split(run, tmp_path):
    """Cells keep absolute paths; a checkout elsewhere (or another machine) holds the same split and
    bundle under other ones. The folder names decide; another split's folder is refused."""
    out = tmp_path / "out"
    shutil.copytree(run["out"], out)
    cells = sorted((out / "cells").glob("*.json"))
    for path in cells:
        cell = json.loads(path.read_text())
        cell["config"]["bundle"] = "/elsewhere/bundles/" + Path(cell["config"]["bundle"]).name
        cell["config"]["data"] = "/elsewhere/data/" + Path(cell["config"]["data"]).name
        path.write_text(json.dumps(cell))
    code, stdout, stderr = _main(BENCH + ["--out", out])
    assert code == 0, stderr
    assert stdout.count("skipped (done)") == len(cells) and ": start" not in stdout
    assert "kept, written by" not in stdout  # the same code wrote them
    # a cell written by other code stands (its settings match) but is named, with the code now
    cell = json.loads(cells[0].read_text())
    cell["code"] = "0.0.9 0123abc"
    cells[0].write_text(json.dumps(cell))
    code, stdout, stderr = _main(BENCH + ["--out", out])
    assert code == 0, stderr
    assert stdout.count("kept, written by") == 1
    assert f"seed 0: kept, written by 0.0.9 0123abc (the code now: {code_version()})" in stdout
    cell["config"]["data"] = "/elsewhere/data/another-split"
    cells[0].write_text(json.dumps(cell))
    code, _, stderr = _main(BENCH + ["--out", out])
    assert code != 0 and "computed with other settings (data:" in stderr


def test_reuse_copies_only_cells_with_the_same_settings(run, tmp_path):
    """An ablation beside a finished run (``--reuse``): the cells whose settings it shares (surgical, the
    floor rows) are copied as they are; FedAvg, trained here with another learning rate, is trained."""
    out = tmp_path / "ablation"
    code, stdout, stderr = _main(BENCH + ["--out", out, "--opt", "fedavg:lr=0.002", "--reuse", run["out"]])
    assert code == 0, stderr
    source = {p.name: p for p in (run["out"] / "cells").glob("*.json")}
    copied = sorted(n for n in source if n != "fedavg-seed0.json")
    assert copied and len(copied) == len(source) - 1
    assert stdout.count("reused from") == len(copied) and stdout.count(": start") == 1
    assert "fedavg seed 0: start" in stdout
    for name in copied:
        assert json.loads((out / "cells" / name).read_text()) == json.loads(source[name].read_text())
    assert json.loads((out / "cells" / "fedavg-seed0.json").read_text())["config"]["client_options"]["lr"] == 0.002


def test_numbers_are_the_engines_own_a_plumbing_check(run):
    """Plumbing check: the CSV's numbers for FedAvg (last and best, mean and per class) and one floor row
    equal ``references.federate`` / ``local`` and the test split scored directly (``helpers.score_directly``) with the same settings. Not an
    independent computation: bench calls these functions (see the module docstring for what checks them)."""
    rows, data = run["rows"], run["out"] / "data" / "cxr-seed0"
    bundle = bundle_path("cxr_resnet18")
    small = dict(network_overrides={"widen_factor": 0.25}, config={"image_size": 32})  # BENCH's
    setups = references.setups(bundle, data, batch_size=8, seed=0, method="fedavg", **small)
    result = references.federate("fedavg", setups, 2, seed=0, log=None, client_options={"lr": 1e-3, "epochs": 1})
    net = next(iter(setups.values())).net
    for model in ("last", "best"):
        metrics = score_directly(net, result[model], bundle, data, config=small["config"])
        where = dict(method="fedavg", seed=0, round=2, model=model, group="pooled", metric="auroc")
        assert metrics["auroc"] is not None
        assert _value(rows, **where, **{"class": "mean"}) == pytest.approx(metrics["auroc"], abs=1e-9)
        for cls, vals in metrics["per_class"].items():
            if vals["auroc"] is not None:
                assert _value(rows, **where, **{"class": cls}) == pytest.approx(vals["auroc"], abs=1e-9)
    local = references.local(bundle, data, epochs=2, batch_size=8, seed=0, log=None, **small)
    assert _value(rows, method="local:site-1", seed=0, round=2, model="last", group="pooled", metric="ap",
                  **{"class": "mean"}) == pytest.approx(local["site-1"]["test"]["ap"], abs=1e-9)


def test_test_items_with_a_group_are_also_scored_per_group(run, tmp_path):
    """Pooled rows are the test split scored directly; a group's rows are the score of a test split holding that group only."""
    import json
    import shutil

    from fedlabels.methods.base import to_numpy

    bundle = bundle_path("cxr_resnet18")
    grouped = tmp_path / "grouped"
    shutil.copytree(run["out"] / "data" / "cxr-seed0", grouped)
    path = grouped / "test" / "datalist.json"
    items = json.loads(path.read_text())["testing"]
    for i, item in enumerate(items):
        item["group"] = "hospital-a" if i % 2 else "hospital-b"
    path.write_text(json.dumps({"testing": items}))
    only_a = tmp_path / "only-a"
    shutil.copytree(grouped, only_a)
    (only_a / "test" / "datalist.json").write_text(json.dumps({"testing": [i for i in items if i["group"] == "hospital-a"]}))

    from fedlabels.scoring import Scorer

    scorer = Scorer(bundle, grouped)
    weights = to_numpy(scorer.net.state_dict())
    scored = {(g, c, m): v for g, c, m, v in scorer(weights)}
    assert {g for g, _, _ in scored} == {"pooled", "hospital-a", "hospital-b"}
    pooled = score_directly(scorer.net, weights, bundle, grouped)
    group_a = score_directly(scorer.net, weights, bundle, only_a)
    for metric in ("auroc", "ap", "bacc"):
        assert scored[("pooled", "mean", metric)] == pooled[metric]
        assert scored[("hospital-a", "mean", metric)] == group_a[metric]


@pytest.mark.parametrize("extra, message", [
    (["--opt", "fedavg:no_such_option=1"], "no option 'no_such_option'"),
    (["--opt", "fedavg:lr"], "expected METHOD:key=value"),
    (["--opt", "fedprox:mu=0.1"], "not one of --methods"),
    (["--eval-rounds", "1,3"], "outside 1..2"),
    (["--eval-rounds", "0"], "outside 1..2"),
    (["--eval-rounds", "1"], "the last scored round 1 is not --rounds 2"),
    (["--synth", "no_such=1"], "unknown option"),
    (["--reuse", "no-such-bench-folder"], "no cells/ folder there"),
])
def test_bad_input_fails_before_any_cell(tmp_path, extra, message):
    out = tmp_path / "out"
    code, _, stderr = _main(BENCH + ["--out", out] + extra)
    assert code == 2
    assert message in stderr and len(stderr.strip().splitlines()) == 1
    assert not (out / "cells").exists() and not (out / "data").exists()


def test_unknown_method_fails_before_any_cell(tmp_path):
    out = tmp_path / "out"
    argv = [a if a != "fedavg,surgical" else "fedavg,no_such_method" for a in BENCH]
    code, _, stderr = _main(argv + ["--out", out])
    assert code == 2 and "unknown method 'no_such_method'" in stderr
    assert not out.exists()


def test_invalid_scenario_is_one_line(tmp_path):
    out = tmp_path / "out"
    argv = list(BENCH)
    i = argv.index("embedded:cxr")
    argv[i - 1: i + 1] = ["--data", str(tmp_path / "nowhere-seed{seed}")]
    argv = [a for a in argv if a not in ("--synth", "cases=12", "test_cases=8")]
    code, _, stderr = _main(argv + ["--out", out])
    assert code == 2 and stderr.startswith("fedlabels: invalid scenario:") and "nowhere-seed0" in stderr
    assert not (out / "cells").exists()


def test_options_are_routed_by_name_and_parsed_as_json():
    parser = cli.build_parser(flare=False)
    args = parser.parse_args(BENCH + ["--out", "unused", "--opt", "all:lr=5e-05", "--opt", "surgical:weighted=true",
                                      "--opt", "surgical:warmup_epochs=0", "--opt", "local:weight_decay=0.01",
                                      "--local-epochs", "3"])
    plan = bench.make_plan(args)
    assert plan.options["fedavg"] == {"client": {"lr": 5e-05, "epochs": 3}, "server": {}}
    assert plan.options["surgical"] == {"client": {"lr": 5e-05, "epochs": 3, "warmup_epochs": 0},
                                        "server": {"weighted": True}}
    assert plan.floor_client == {"lr": 5e-05, "weight_decay": 0.01}
    assert isinstance(plan.options["fedavg"]["client"]["lr"], float)
    # a fixed folder without {seed}: one split for every seed
    args = parser.parse_args(["bench", "--data", "somewhere", "--bundle", "cxr_resnet18", "--methods", "fedavg",
                              "--seeds", "0,1", "--rounds", "3", "--eval-rounds", "3,1", "--out", "unused"])
    plan = bench.make_plan(args)
    assert not plan.per_seed_split and plan.eval_rounds == [1, 3]
    assert plan.data_for(0) == plan.data_for(1)


def test_oracle_rows_train_every_site_on_its_full_labels(tmp_path):
    """``oracle:METHOD``: the same split with every site's labels; options reach it by its row name."""
    argv = ["bench", "--data", "embedded:medmnist", "--synth", "cases=64", "--synth", "test_cases=16", "--bundle",
            "medmnist_cnn", "--methods", "wfedavg,oracle:wfedavg", "--seeds", "0", "--rounds", "1",
            "--opt", "oracle:wfedavg:lambda_c=0", "--out", tmp_path / "b"]
    plan = bench.make_plan(cli.build_parser(flare=False).parse_args([str(a) for a in argv]))
    assert plan.options["oracle:wfedavg"]["server"] == {"lambda_c": 0}
    assert plan.options["wfedavg"]["server"] == {}
    code, _, err = _main(argv)
    assert code == 0, err
    import json

    cells = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "b" / "cells").glob("*.json")}
    plain, oracle = cells["wfedavg-seed0"]["records"][0], cells["oracle_wfedavg-seed0"]["records"][0]
    # embedded medmnist: only site-1 is labeled; the others abstain, except on their oracle labels
    assert sorted(plain["abstained"]) == ["site-2", "site-3", "site-4"]
    assert not oracle["abstained"] and all(oracle["sites"][s]["n"] > 0 for s in SITES)
    md = (tmp_path / "b" / "results.md").read_text()
    for metric in ("accuracy", "auroc", "precision", "recall"):
        assert f"## {metric} -- pooled test split" in md
    bad = argv[:-2] + ["--opt", "oracle:nosuch:lr=1", "--out", tmp_path / "c"]
    code, _, err = _main(bad)
    assert code == 2 and "'oracle:nosuch' is not one of --methods" in err


def test_network_and_image_size_reach_every_row_and_a_misspelt_option_stops_before_any_cell(run, tmp_path):
    """The module's run was asked for ``--network widen_factor=0.25 --image-size 32`` (``BENCH``): every cell,
    the federated ones and the floor rows, was trained with both."""
    cells = sorted((run["out"] / "cells").glob("*.json"))
    assert {c.name for c in cells} >= {"fedavg-seed0.json", "local_site-1-seed0.json"}
    for c in cells:
        cell = json.loads(c.read_text())
        assert cell["config"]["network"] == {"widen_factor": 0.25} and cell["config"]["image_size"] == 32, c.name
        assert cell["torch_threads"] >= 1, c.name  # recorded: a run's numbers depend on it
        assert cell["cpu_capability"] == torch.backends.cpu.get_cpu_capability(), c.name  # and on this
    argv = [a if a != "fedavg,surgical" else "fedavg" for a in BENCH]
    bad = tmp_path / "bad"
    code, _, stderr = _main(argv + ["--network", "widen=0.25", "--out", bad])
    assert code == 2 and "--network" in stderr and len(stderr.strip().splitlines()) == 1
    assert not (bad / "cells").exists()


def test_a_bench_says_the_nvimagecodec_notice_at_most_once_and_prints_rounded_numbers(run):
    """The console of a real `fedlabels bench` (the module's run, a subprocess: MONAI's own logging and warnings
    as a user sees them): MONAI's nvImageCodec notice at most once for all its cells, every number rounded for
    display."""
    from fedlabels.progress import number

    text = run["console"]
    assert text.count("nvImageCodec") <= 1, text
    assert "train_loss=" in text and "round 0" in text
    assert not re.findall(r"\d\.\d{5,}", text), re.findall(r".*\d\.\d{5,}.*", text)
    assert (number(1 / 3), number(0.25), number(None), number(float("nan")), number(3)) == \
        ("0.3333", "0.2500", "n/a", "n/a", "3")
