"""The loopback federation's helpers: submitting a job, nvflare's admin CLI, waiting on rounds and logs
(tests/deploy/conftest.py starts the federation; tests/deploy/test_federation.py, tests/deploy/test_drills.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

FEDLABELS = str(Path(sys.executable).with_name("fedlabels"))  # the installed console script
REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "nvflare_jobs" / "fedavg_cxr" / "job.py"
SITES = ("site-1", "site-2")
ADMIN = "admin@fedlabels.org"
SERVER_ENV = {"NVFLARE_DEAD_CLIENT_GRACE_PERIOD": "2", "NVFLARE_DEAD_CLIENT_CHECK_LEAD_TIME": "2"}
# What only catches a hung job or command. A slow 2-core machine, with the rest of the suite beside
# this lane, takes 2-4 times an idle fast one's time: the bounds leave room for that.
HANG = 600
# The hostile-replies job's site_timeout: on a slow loaded machine both hospitals took over 15 s to answer
# round 0, so 15 left the healthy site out too.
SITE_TIMEOUT = 60


def submit(fed, *args, wait=True, faults=(), name="fedavg_cxr"):
    """The committed job through its job.py; with ``faults`` or another job ``name``, that job through
    fedlabels.flare.job.run_cli (what job.py calls), with these fault drills in its configuration."""
    argv = ["--prod", str(fed["admin"]), "-n", "2", *args]
    if faults or name != "fedavg_cxr":
        code = ("import sys; from fedlabels.flare.job import JOBS, run_cli; "
                f"run_cli(JOBS[{name!r}].replace(faults={list(faults)!r}), sys.argv[1:])")
        cmd = [sys.executable, "-c", code, *argv]
    else:
        cmd = [sys.executable, str(JOB), *argv]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG)
    return _result(out.stdout + out.stderr)


def _result(text):
    lines = [line for line in text.splitlines() if line.startswith("job ") and "results:" in line]
    assert lines, text[-3000:]
    job_id = lines[-1].split()[1].rstrip(":")
    status = lines[-1].split()[2].rstrip(";")
    return job_id, status, Path(lines[-1].split("results: ")[1].strip())


def nvflare(*args, check=True) -> str:
    out = subprocess.run([str(Path(sys.executable).with_name("nvflare")), *args], capture_output=True, text=True,
                         timeout=HANG)
    assert out.returncode == 0 or not check, f"nvflare {' '.join(args)}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
    return out.stdout + out.stderr


def wait_for_round(server_kit, next_round, since, proc, timeout=HANG) -> Path:
    """The server run's progress.json once rounds before ``next_round`` are aggregated."""
    while True:
        for p in server_kit.glob("*/progress.json"):
            if p.stat().st_mtime > since and json.loads(p.read_text())["next_round"] >= next_round:
                return p
        assert proc.poll() is None and time.time() - since < timeout, f"round {next_round - 1} never finished"
        time.sleep(0.2)


def site_log(fed, site, job_id) -> str:
    return (fed["kits"][site] / job_id / "log.txt").read_text()


def wait_for_line(kit, line, since, proc, timeout=HANG) -> Path:
    """The log of a job this participant started after ``since`` once it holds ``line``."""
    while True:
        for log in kit.glob("*/log.txt"):
            if log.stat().st_mtime > since and line in log.read_text(errors="replace"):
                return log
        assert proc.poll() is None and time.time() - since < timeout, f"no job log of {kit.name} says {line!r}"
        time.sleep(0.2)


def site_env(fed, site, **extra) -> dict:
    return {"FEDLABELS_DATA": str(fed["data"][site]), "OMP_NUM_THREADS": "1", **extra}


def connected(fed) -> set:
    from fedlabels.flare.local_federation import admin_session

    session = admin_session(fed["admin"])
    try:
        return {c.name for c in session.get_system_info().client_info}
    finally:
        session.close()


def wait_for_text(path: Path, text: str, deadline: float, poll: float = 0.5) -> None:
    """Until ``path`` holds ``text`` or the clock passes ``deadline`` (the caller asserts what it needs)."""
    while time.time() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        time.sleep(poll)
