"""``fedlabels bench --engine flare``: the FLARE engine's numbers are the in-process engine's (the real simulator; the rest of bench is tests/unit/test_bench.py)."""

from __future__ import annotations

import json


import pytest
import torch
from helpers import read_csv as _read_csv, run_cli as _main



@pytest.fixture
def one_thread():
    """One torch thread here and in the simulator's sites: an exact comparison must not depend on the cores."""
    from shared_runs import ONE_THREAD, environment

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with environment(ONE_THREAD):
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.simulator
def test_flare_engine_matches_the_inprocess_engine(tmp_path, one_thread):
    """2 sites x 2 rounds in the FLARE simulator; the last global model scores as the in-process engine's
    (one torch thread on both sides)."""
    common = ["bench", "--bundle", "medmnist_cnn", "--methods", "fedavg", "--seeds", "0", "--rounds", "2",
              "--batch-size", "8"]
    flare_out = tmp_path / "flare"
    code, _, stderr = _main(common + ["--data", "embedded:medmnist", "--synth", "sites=2", "--synth",
                                           "labeled=[0,1]", "--synth", "cases=48", "--synth", "test_cases=16",
                                           "--engine", "flare", "--out", flare_out])
    assert code == 0, stderr
    flare_rows = _read_csv(flare_out / "results.csv")
    assert {r["method"] for r in flare_rows} == {"fedavg", "local:site-1", "local:site-2"}
    assert {r["metric"] for r in flare_rows} == {"accuracy", "auroc", "precision", "recall"}
    # the same data as a fixed folder, in-process
    inproc_out = tmp_path / "inprocess"
    code, _, stderr = _main(common + ["--data", flare_out / "data" / "medmnist-seed0", "--out", inproc_out])
    assert code == 0, stderr
    assert "split fixed: seeds vary initialisation and order only" in (inproc_out / "results.md").read_text()
    inproc_rows = _read_csv(inproc_out / "results.csv")

    def last(rows):
        return {(r["class"], r["metric"]): r["value"] for r in rows if r["method"] == "fedavg" and r["model"] == "last"}

    assert last(flare_rows) == last(inproc_rows)
    # both engines trained one run configuration, which each cell records; the FLARE job carried it to its sites
    from fedlabels.run import Run

    flare_cell, inproc_cell = (json.loads((out / "cells" / "fedavg-seed0.json").read_text())
                               for out in (flare_out, inproc_out))
    assert Run(flare_cell["run_dir"]).config.to_json() == flare_cell["run"]
    assert {**flare_cell["run"], "data": None} == {**inproc_cell["run"], "data": None}
    assert flare_cell["run"]["method"] == "fedavg" and flare_cell["run"]["data"]["batch_size"] == 8
