"""Progress of the long commands: a bar with the time left on a terminal, one line per step elsewhere.

``fedlabels import`` runs as a real subprocess twice: once with its output on a pseudo-terminal
(the bar, redrawn in place with carriage returns) and once into a pipe (plain lines, each with
the time left). ``fedlabels simulate``'s per-round report reads the run's metrics.jsonl as the
server rewrites it: checked here on a file written round by round, and with the real command, whose per-round lines
must arrive while the simulator still runs, in tests/simulator/test_progress_simulate.py.
"""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedlabels import progress
from helpers import fedlabels_env as _env

REPO = Path(__file__).resolve().parents[2]
IMAGES = 60  # enough steps that the line mode thins its lines out (about every 5 %)


def _dataset(root: Path) -> Path:
    """A small multi-label dataset of two hospitals and a test set, as a CSV next to its images."""
    rng = np.random.default_rng(0)
    rows = ["image,site,effusion,nodule"]
    for i in range(IMAGES):
        site = ("hospital-a", "hospital-b", "test")[i % 3]
        name = f"img/{i}.png"
        (root / "img").mkdir(parents=True, exist_ok=True)
        Image.fromarray((rng.random((24, 24)) * 255).astype(np.uint8)).save(root / name)
        eff, nod = rng.integers(0, 2, 2)
        rows.append(f"{name},{site},{eff if site != 'hospital-b' else ''},{nod}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root / "labels.csv"


def _import_cmd(labels: Path, out: Path) -> list:
    return [sys.executable, "-m", "fedlabels.cli", "import", str(labels), "--out", str(out), "--workers", "1"]


def test_import_without_terminal_prints_one_line_per_step_with_time_left(tmp_path):
    labels = _dataset(tmp_path)
    proc = subprocess.run(_import_cmd(labels, tmp_path / "scen"), cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout and "\x1b" not in proc.stdout  # no bar drawing into a pipe
    steps = re.findall(r"^  (\d+)/(\d+) images written, (\d\d:\d\d) elapsed(, about (\d\d:\d\d) left)?",
                       proc.stdout, re.M)
    assert len(steps) >= 3, proc.stdout
    counts = [int(done) for done, *_ in steps]
    assert counts == sorted(counts) and counts[-1] == int(steps[-1][1]) == IMAGES
    assert all(s[3] for s in steps)  # every line gives the time left (0 at the end)
    assert len(steps) < IMAGES  # thinned out, not one line per image


def _run_in_pty(cmd, cwd, env, timeout=300) -> str:
    """Run ``cmd`` with its stdout and stderr on a pseudo-terminal; what the terminal received."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks, deadline = [], time.time() + timeout
    try:
        while time.time() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_import_on_a_terminal_draws_a_bar_with_time_left(tmp_path):
    labels = _dataset(tmp_path)
    text = _run_in_pty(_import_cmd(labels, tmp_path / "scen"), tmp_path, _env())
    assert "wrote" in text
    # the bar is redrawn in place: carriage return, clear line, bar, count, time left
    bars = re.findall(r"\r\x1b\[K  ([#-]{20}) (\d+)/(\d+) images written  \d\d:\d\d elapsed(, about \d\d:\d\d left)?",
                      text)
    # drawn at the start and at the end (in between at most ten times a second)
    assert len(bars) >= 2 and int(bars[0][1]) == 0, repr(text[-2000:])
    assert bars[-1][0] == "#" * 20 and int(bars[-1][1]) == IMAGES and bars[-1][3]
    # and the line mode's lines are not printed on a terminal
    assert not re.search(r"^  \d+/\d+ images written, ", text, re.M)


def test_time_left_is_the_mean_step_time_times_the_steps_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    lines = []
    bar = progress.Progress(5, "cells", say_fn=lines.append, tty=False)
    bar.step("skipped", counted=False)  # done earlier: no time, not in the mean
    now[0] += 10
    bar.step("a")
    now[0] += 20
    bar.step("b")
    assert bar.left() == pytest.approx(15 * 2)  # (10 + 20) / 2 per counted step, 2 steps left
    assert lines[-1] == "3/5 cells, 00:30 elapsed, about 00:30 left: b"
    assert len(lines) == 3


def test_messages_clear_the_bar_and_redraw_it():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    bar = progress.Progress(2, "rounds", stream=out, tty=True)
    try:
        real = sys.stdout
        sys.stdout = out
        progress.say("round 0 site-1: n=3")
    finally:
        sys.stdout = real
    bar.doing("round 0")
    bar.step()
    bar.step()
    text = out.getvalue()
    assert "\r\x1b[Kround 0 site-1: n=3\n\r\x1b[K" in text  # the message on its own line, the bar drawn again
    assert re.search(r"\r\x1b\[K-{20} 0/2 rounds  00:00 elapsed  round 0(\r|$)", text)  # the step now running
    assert text.endswith("2/2 rounds  00:00 elapsed, about 00:00 left\n")
    assert progress._active is None


def _record(rnd, auroc):
    return {"round": rnd, "sites": {"site-2": {"n": 4, "train_loss": 0.5, "val_auroc": auroc,
                                               "val_auroc/effusion": 0.1},
                                    "site-1": {"n": 3, "train_loss": 0.25, "val_auroc": auroc}},
            "mean_val_auroc": auroc, "dropped": {}, "abstained": [], "seconds": 1.5}


def test_simulate_reports_each_round_as_the_server_writes_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = []
    follower = progress.RoundFollower(path, rounds=3, poll=0.05, say_fn=lines.append, tty=False).start()
    try:
        written = []
        for rnd, auroc in enumerate((0.5, 0.625, 0.75)):
            written.append(json.dumps(_record(rnd, auroc)))
            path.write_text("\n".join(written) + "\n")  # the server rewrites the whole file each round
            deadline = time.time() + 10
            while not any(line.startswith(f"round {rnd} done") for line in lines) and time.time() < deadline:
                time.sleep(0.02)
            # reported while the run goes on, before the next round is written
            assert any(line.startswith(f"round {rnd} done") for line in lines), lines
    finally:
        follower.stop()
    assert lines[:4] == [
        "round 0 site-1: n=3 train_loss=0.2500 val_auroc=0.5000",
        "round 0 site-2: n=4 train_loss=0.5000 val_auroc=0.5000",
        "round 0 done in 1.5s; mean_val_auroc of the received model = 0.5000",
        "[simulate] 1/3 rounds, 00:00 elapsed, about 00:00 left: round 0",
    ]
    assert sum(line.startswith("round 2 site-") for line in lines) == 2  # each round once
    assert lines[-1].startswith("[simulate] 3/3 rounds")


def test_a_resumed_run_reports_only_its_own_rounds(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(_record(r, 0.5)) for r in range(4)) + "\n")
    lines = []
    follower = progress.RoundFollower(path, rounds=4, first=2, poll=10, say_fn=lines.append, tty=False).start()
    follower.stop()
    assert [line.split(" done")[0] for line in lines if " done" in line] == ["round 2", "round 3"]
    assert lines[-1].startswith("[simulate] 2/2 rounds")
