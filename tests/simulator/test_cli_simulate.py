"""``fedlabels simulate`` failing in the real simulator: one line, its log kept (the CLI's other checks are tests/unit/test_cli.py)."""

from __future__ import annotations


import pytest

from fedlabels import cli
from helpers import cli_in_repo as _in_process



@pytest.mark.simulator
def test_a_failed_simulate_leaves_its_log_and_no_job_folder(tmp_path):
    """A simulation that fails (three sites asked of a two-site scenario: the simulator stops) ends with one
    line pointing at its log; the job folder it exported is removed, the log and workspace stay."""
    data = tmp_path / "two-sites"
    assert cli.main(["synth", "cxr", "--out", str(data), "--sites", "2", "--cases", "8", "--size", "16",
                     "--test-cases", "8"]) == 0
    ws = tmp_path / "sim"
    code, out, err = _in_process(["simulate", "fedavg_cxr", "--data", data, "-n", "3", "--rounds", "1", "-w", ws])
    assert code == 1 and "did not finish" in err and str(ws / "simulator.log") in err, err
    assert (ws / "simulator.log").is_file() and not (ws / "jobs").exists()
