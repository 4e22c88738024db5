"""The loopback federation (``fed``), one per test module of tests/deploy that asks for it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from fedlabels.data.synthetic import generate
from fedlabels.flare.local_federation import Participant, free_ports, kit_processes, set_heartbeat_timeout, wait_for_sites
from loopback import ADMIN, FEDLABELS, SERVER_ENV, SITES


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loopback")
    full = generate("cxr", tmp / "full", seed=0, cases=16, test_cases=12, sites=2)
    data = {}
    for site in SITES:  # each hospital holds only its own folder
        data[site] = tmp / "data" / site
        data[site].mkdir(parents=True)
        shutil.copy(full / "scenario.yaml", data[site])
        shutil.copytree(full / site, data[site] / site)
        checked = subprocess.run([FEDLABELS, "validate", str(data[site]), "--site", site], capture_output=True,
                                 text=True, check=True).stdout
        assert site in checked
    fl_port, admin_port = free_ports(2)
    out = subprocess.run([FEDLABELS, "provision", "--project", "loop", "--server", "localhost",
                          "--sites", ",".join(SITES), "--admin", ADMIN, "--out", str(tmp / "prov"),
                          "--fl-port", str(fl_port), "--admin-port", str(admin_port), "--no-byoc", "site-2",
                          "--fault-drills", "site-2", "--server-storage", str(tmp / "server-storage")],
                         capture_output=True, text=True, check=True).stdout
    kits = {line.split()[0]: Path(line.split()[1]) for line in out.splitlines() if len(line.split()) == 2}
    # sites send a heartbeat every 10 s (nvflare's default): 25 s tolerates one late beat
    set_heartbeat_timeout(kits["localhost"], 25)
    server = Participant(kits["localhost"], env=SERVER_ENV).start()
    sites = {s: Participant(kits[s], env={"FEDLABELS_DATA": str(data[s]), "OMP_NUM_THREADS": "1"}).start()
             for s in SITES}
    fed = {"tmp": tmp, "kits": kits, "data": data, "full": full, "server": server, "sites": sites,
           "admin": kits[ADMIN], "ports": (fl_port, admin_port)}
    try:
        wait_for_sites(kits[ADMIN], SITES)
        yield fed
    finally:
        for p in [fed["server"], *sites.values()]:
            p.stop()
        left = [p.pid for kit in kits.values() for p in kit_processes(kit)]
        assert not left, f"processes left behind: {left}"
