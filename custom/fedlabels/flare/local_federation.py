"""Run provisioned startup kits as separate processes on one machine.

Used to try a provisioned project before its kits are shipped, by the
loopback deployment test and by ``benchmarks/deployment.py``. Every
participant is started the way a hospital starts it (``startup/start.sh``
from its kit, the data folder in ``FEDLABELS_DATA``) in its own session, and
stopped by killing every process that runs from its kit, so nothing is left
behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil


def free_ports(n: int) -> list:
    """``n`` distinct TCP ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def set_heartbeat_timeout(server_kit, seconds: float) -> None:
    """How long the server waits before it drops a silent site (nvflare's default: 600 s),
    set in the server's ``local/resources.json``, the kit's place for local settings."""
    local = Path(server_kit) / "local"
    path = local / "resources.json"
    config = json.loads((path if path.exists() else local / "resources.json.default").read_text())
    for server in config["servers"]:
        server["heart_beat_timeout"] = seconds
    path.write_text(json.dumps(config, indent=2))


def kit_processes(kit) -> list:
    """Every process started from this kit (its start loop, its nvflare process, its job processes)."""
    kit = str(Path(kit).resolve())
    found = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        try:
            cmdline = " ".join(p.info["cmdline"] or [])
            if kit in cmdline or (p.info["cwd"] or "").startswith(kit):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return [p for p in found if p.pid != os.getpid()]


def this_python_first(env: dict) -> dict:
    """``env`` with this interpreter's folder first on PATH: a kit's scripts run ``python3``,
    which must be the environment where fedlabels and nvflare are installed."""
    return {**env, "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])}


class Participant:
    def __init__(self, kit, env: dict | None = None, log=None):
        self.kit = Path(kit).resolve()
        self.env = this_python_first({**os.environ, **(env or {})})
        self.log = Path(log or self.kit / "start.log")
        self.proc = None

    def start(self) -> "Participant":
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(["bash", str(self.kit / "startup" / "start.sh")], cwd=self.kit, env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Kill everything this kit runs (SIGKILL: also how a crashed hospital looks to the server)."""
        procs = kit_processes(self.kit)
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=timeout)
        for flag in ("pid.fl", "daemon_pid.fl", "shutdown.fl", "restart.fl"):
            (self.kit / flag).unlink(missing_ok=True)

    def running(self) -> bool:
        return bool(kit_processes(self.kit))


def admin_session(admin_kit, timeout: float = 10.0):
    """An nvflare Flare API session with the admin kit's own user."""
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    from .job import admin_user

    return new_secure_session(admin_user(admin_kit), str(admin_kit), timeout=timeout)


def wait_for_sites(admin_kit, sites, timeout: float = 120.0) -> float:
    """Seconds until every site in ``sites`` is connected to the server."""
    t0 = time.time()
    last = None
    while time.time() - t0 < timeout:
        try:
            session = admin_session(admin_kit)
            try:
                while time.time() - t0 < timeout:
                    connected = {c.name for c in session.get_system_info().client_info}
                    if set(sites) <= connected:
                        return time.time() - t0
                    time.sleep(0.5)
            finally:
                session.close()
        except Exception as e:  # the server is still starting: its admin port is not open yet
            last = e
            time.sleep(1.0)
    raise TimeoutError(f"sites {sorted(sites)} not all connected after {timeout:.0f} s (last error: {last})")
