"""``fedlabels simulate``'s progress lines while the real simulator runs (the progress display itself is tests/unit/test_progress.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import fedlabels_env as _env




@pytest.mark.simulator
def test_simulate_prints_each_rounds_site_metrics_while_the_simulator_runs(tmp_path):
    """The real command: its per-round lines arrive while the simulator still runs (before the
    run's last round is written), and the TensorBoard folder it names holds the run's events."""
    env = _env()
    subprocess.run([sys.executable, "-m", "fedlabels.cli", "synth", "cxr", "--out", str(tmp_path / "data"),
                    "--cases", "40", "--size", "32"], env=env, check=True, capture_output=True, timeout=300)
    rounds = 3
    proc = subprocess.Popen([sys.executable, "-m", "fedlabels.cli", "simulate", "fedavg_cxr", "--data",
                             str(tmp_path / "data"), "-n", "2", "--rounds", str(rounds), "-w", str(tmp_path / "run")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "ws" / "server" / "simulate_job" / "metrics.jsonl"
    lines, seen_while_running = [], []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("round 0 site-1:"):
                # the first round is reported before the last one is written
                done = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
                seen_while_running.append(done)
        assert proc.wait(timeout=900) == 0, "\n".join(lines[-40:])
    finally:
        if proc.poll() is None:
            proc.kill()
    assert seen_while_running and seen_while_running[0] < rounds, lines
    text = "\n".join(lines)
    for rnd in range(rounds):
        for site in ("site-1", "site-2"):
            assert re.search(rf"^round {rnd} {site}: n=\d+ train_loss=\d", text, re.M), text
        assert re.search(rf"^round {rnd} done in [\d.]+s; mean_val_auroc of the received model = ", text, re.M)
        assert re.search(rf"^\[simulate\] {rnd + 1}/{rounds} rounds, \d\d:\d\d elapsed, about \d\d:\d\d left", text,
                         re.M)
    tb = re.search(r"tensorboard --logdir (\S+)", text).group(1)
    assert list((tmp_path / tb).glob("events.out.tfevents.*"))
