"""The README's FLARE and clinical commands, run as written in the real simulator (its other commands are tests/unit/test_readme.py)."""

from __future__ import annotations

import json
import re

import pytest

from readme_commands import CMDS, _program, _workdir, needs_simulator, run




@pytest.mark.simulator
def test_flare_and_clinical_paths_run_as_written(tmp_path):
    work = _workdir(tmp_path)
    # the scenario the FLARE commands point at is the researcher path's
    synth = next(c for c in CMDS if _program(c).startswith("fedlabels synth"))
    run(synth, work, timeout=300)
    flare = [c for c in CMDS if needs_simulator(c)]
    assert len(flare) == 5, flare
    job_py, write_job, nvsim, export, infer = flare
    run(job_py, work, timeout=900)
    run_dir = work / re.search(r"--run (\S+)", export).group(1)
    assert (run_dir / "app_server" / "best_FL_global_model.pt").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == int(re.search(r"--rounds (\d+)", job_py).group(1))
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))  # the TensorBoard logs the README names
    run(write_job, work, timeout=300)  # job.py --out: nvflare 2.9 takes --export for itself
    job_dir = work / re.search(r"nvflare simulator (\S+)", nvsim).group(1)
    assert json.loads((job_dir / "app" / "config" / "config_fed_server.json").read_text()
                      )["workflows"][0]["args"]["num_rounds"] == int(re.search(r"--rounds (\d+)", write_job).group(1))
    run(nvsim, work, timeout=900)
    ws = work / re.search(r"-w (\S+)", nvsim).group(1)
    assert (ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt").is_file()
    out = run(export, work, timeout=600).stdout
    assert "exported bundle" in out and "decision thresholds" in out
    run(infer, work, timeout=600)
    predictions = work / re.search(r"--output_dir (\S+)", infer).group(1) / "predictions.csv"
    images = work / re.search(r"--dataset_dir (\S+)", infer).group(1)
    assert len(predictions.read_text().splitlines()) == 1 + len(list(images.iterdir()))
