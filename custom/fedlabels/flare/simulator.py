"""Running a job folder in ``nvflare simulator``: how many site processes fit, the watched subprocess,
and the run's outcome read from the controller's progress file (the exit code does not say it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path


# What nvflare's simulator logs when a site worker comes up under another
# site's identity and cannot find its app (seen at start-up with several
# sites on a busy machine). The server then waits for that site for ever.
LOST_SITE = "Can not find client_script.py"
# What its runner logs when a site's worker process dies or drops its connection. Before the site was ever
# given a task (seen at start-up: "Connection reset by peer") the server waits for it for ever too; after it,
# the site crashed mid-run, which the round engine survives (the fault drill's crash).
SITE_DIED = re.compile(rb"(?:Communication error with|Subprocess died for) client ([\w.-]+)")
ASSIGNED = re.compile(rb"assigned task to client ([\w.-]+)")
# How long a run may go on after a site died before its first task: a run that is ending exits within it.
DIED_GRACE = 60.0


class SiteLostAtStartup(RuntimeError):
    """A simulated site never started; the run cannot finish."""


def run_watched(cmd, env, log: Path, timeout=None, poll=1.0, grace=DIED_GRACE, server_log=None) -> int:
    """Run ``cmd`` in its own process group, output appended to ``log``.

    Kills the group and raises ``SiteLostAtStartup`` as soon as the log shows
    a lost site, or ``grace`` seconds after it shows a site's worker dying
    before its first task; ``RuntimeError`` when ``timeout`` seconds pass;
    otherwise returns the exit code. The simulator's console (nvflare's
    default concise mode) leaves out which site was given a task: that is
    read from ``server_log`` (the server's ``log.txt``); without one a dying
    worker never stops the run.
    """
    log = Path(log)
    # Watch only what this run appends: a retry appends to the log of the attempt it replaces.
    start, seen = time.time(), (log.stat().st_size if log.exists() else 0)
    partial, tasked, died = b"", set(), None  # died: (site, when) of a worker lost before its first task
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                try:
                    return proc.wait(timeout=poll)
                except subprocess.TimeoutExpired:
                    pass
                with open(log, "rb") as f:  # whole lines added since the last look
                    f.seek(seen)
                    *lines, partial = (partial + f.read()).split(b"\n")
                    seen = f.tell()
                for line in lines:
                    if LOST_SITE.encode() in line:
                        raise SiteLostAtStartup(f"a site worker was lost at start-up ({LOST_SITE!r}); see {log}")
                    if m := ASSIGNED.search(line):
                        tasked.add(m.group(1))
                    elif (m := SITE_DIED.search(line)) and m.group(1) not in tasked and died is None:
                        died = (m.group(1).decode(), time.time())
                if died and time.time() - died[1] > grace and server_log is not None:
                    text = Path(server_log).read_bytes() if Path(server_log).is_file() else b""
                    tasked |= {m.group(1) for m in ASSIGNED.finditer(text)}
                    if died[0].encode() in tasked:  # it had a task: a crash mid-run, the round engine's
                        died = None
                        continue
                    raise SiteLostAtStartup(f"the worker of {died[0]} died before its first task and the run did "
                                            f"not end; see {log}")
                if timeout is not None and time.time() - start > timeout:
                    raise RuntimeError(f"did not finish within {timeout} s; see {log}")
        except BaseException:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            raise


# Memory of one simulated site process and of the simulator's own processes. Measured
# (benchmarks/results/scale.md, DenseNet121 at 64 px): a site peaks at 0.83-0.93 GiB,
# 0.45 of it torch + MONAI + nvflare imports; the simulator's processes at 1.1-2.5 GiB
# for 4-16 sites. Rounded up: they decide how many site processes fit in memory.
SITE_PROCESS_MIB = 1100
SERVER_MIB = 1500


def default_threads(sites: int, memory_mib: int | None = None, cores: int | None = None) -> int:
    """Simulator worker processes for ``sites`` sites: one long-lived process per site
    when they all fit in the available memory; otherwise as many as there are cores,
    and the sites take turns (nvflare then starts a process per site task; each site
    continues its saved state, see fedlabels.flare.client)."""
    import psutil

    memory_mib = psutil.virtual_memory().available // 2**20 if memory_mib is None else memory_mib
    if sites * SITE_PROCESS_MIB + SERVER_MIB <= memory_mib:
        return sites
    fit = max(1, (memory_mib - SERVER_MIB) // SITE_PROCESS_MIB)
    return int(max(1, min(fit, cores or os.cpu_count() or 1, sites)))


def simulate(job_dir, workspace, sites: int, data=None, threads=None, log=None, timeout=None,
             retries=1, environ=None) -> Path:
    """Run ``nvflare simulator`` on a job folder; returns the server's run folder.

    The simulator's exit code does not say whether training finished (it is 0
    when sites die at start-up), so success is the controller's progress file.
    A site lost at start-up (``LOST_SITE`` in the log, or its worker dying
    before its first task: ``run_watched``) is retried ``retries``
    times (the simulator empties its workspace when it starts); ``timeout``
    (seconds) bounds each attempt. The simulator's output goes to ``log``
    (default: ``WORKSPACE.log`` beside the workspace). ``threads``: simulator
    worker processes (nvflare's ``-t``), default ``default_threads(sites)``; with
    fewer than ``sites``, each process's torch threads are its share of the cores.
    ``environ``: the simulator's environment (default: this process's), so that runs
    started from several threads need not change ``os.environ``.
    """
    job_dir, workspace = Path(job_dir), Path(workspace)
    threads = threads or default_threads(sites)
    env = dict(os.environ if environ is None else environ)
    if threads < sites:  # the server sizes sites by their number; here fewer run at once
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // threads)))
    if data:
        env["FEDLABELS_DATA"] = str(Path(data).resolve())
    # Site state (for resuming) outside the workspace, which the simulator empties.
    env.setdefault("FEDLABELS_STATE", str((workspace.parent / f"{workspace.name}.state").resolve()))
    # Simulated sites are not hospitals: their privacy ledger (fedlabels.privacy) lies beside the workspace,
    # so one study's runs compose and another study starts its own (a real site's is in its home folder).
    env.setdefault("FEDLABELS_PRIVACY_LEDGER",
                   str((workspace.parent / f"{workspace.name}.privacy-ledger.json").resolve()))
    cmd = [sys.executable, "-m", "nvflare.cli", "simulator", str(job_dir), "-w", str(workspace),
           "-n", str(sites), "-t", str(threads)]
    run_dir = workspace / "server" / "simulate_job"
    log = Path(log) if log else workspace.parent / f"{workspace.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    for attempt in range(retries + 1):
        try:
            code = run_watched(cmd, env, log, timeout=timeout, server_log=workspace / "server" / "log.txt")
            break
        except SiteLostAtStartup as e:
            if attempt == retries:
                raise SiteLostAtStartup(f"simulation of {job_dir.name}: {e}") from None
            with open(log, "a") as out:
                out.write(f"\n[fedlabels] a site was lost at start-up; retry {attempt + 1} of {retries}\n\n")
        except RuntimeError as e:
            raise RuntimeError(f"simulation of {job_dir.name} {e}") from None
    progress = run_dir / "progress.json"
    if not progress.is_file():
        raise RuntimeError(f"simulation of {job_dir.name} did not finish (exit code {code}); see {log}")
    info = json.loads(progress.read_text())
    if info.get("error"):
        raise RuntimeError(f"simulation of {job_dir.name} failed: {info['error']}; see {log}")
    spec = json.loads((job_dir / "app" / "config" / "config_fed_server.json").read_text())
    rounds = spec["workflows"][0]["args"].get("num_rounds")
    if rounds is not None and info["next_round"] < rounds:
        raise RuntimeError(f"simulation of {job_dir.name} stopped at round {info['next_round']} of {rounds}; see {log}")
    return run_dir
