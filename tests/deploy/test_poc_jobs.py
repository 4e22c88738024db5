"""Every shipped job in nvflare's POC mode with the production defaults (``make test-poc-jobs``).

One POC deployment (``nvflare poc``: a locally provisioned server and two sites,
each its own process tree) runs every job of ``fedlabels.flare.job.JOBS`` in its
production form (configuration only, submitted with ``job.py --prod`` through
the POC admin kit), so ``--min-sites`` defaults to every site: a method whose
step reaches fewer sites (IsoFed's, RSCFed's) or whose site abstains must still
aggregate. Each job trains its smoke settings (tests/shared_runs.py: 2 sites,
2 rounds, batches of 8) on the embedded data of its family, which each site
generates itself (``FEDLABELS_DATA=embedded``), small.

The sites are hospitals: their kits carry fedlabels' site policy as ``fedlabels provision`` writes it (the
class allow list, the job gate, no log streaming), so the upper-bound jobs (``oracle``: every site's full
labels) are refused at deployment by the gate, naming ``data.oracle``, and every other job must finish.

The simulator runs of every job in the main suite check what each method
computes; this checks that each one deploys and finishes in a real deployment.
About 10 minutes on 2 cores, so it is its own target beside ``make test``,
run before a release (docs/testing.md).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from fedlabels.flare.job import JOBS
from fedlabels.flare.local_federation import free_ports, kit_processes, wait_for_sites
from fedlabels.flare.provision import allow_fedlabels
from shared_runs import environment, smoke

pytestmark = pytest.mark.poc_jobs

SITES = ("site-1", "site-2")
# the embedded data of each family, as small as the simulator tests' (tests/conftest.py)
SYNTH = {"cxr": {"cases": 16, "test_cases": 12}, "medmnist": {"sites": 2, "cases": 48, "test_cases": 16},
         "lesion": {"sites": 2, "size": 32, "cases": 12, "test_cases": 8},
         "mixed": {"cases": 48, "test_cases": 12}}  # 4 sites written; the two POC sites: every class and a half
# RSCFed's default subsets of 3 sites need 3 (job.py refuses -n 2); with two, subsets of two
CHANGES = {"rscfed_medmnist": {"server": {"subset_size": 2}}}
AT_ONCE = 2  # jobs submitted at once (nvflare's POC server runs several; each job is 3 processes)


@pytest.fixture(scope="module")
def poc(tmp_path_factory):
    from nvflare.lighter.provision import gen_default_project_config
    from nvflare.tool.poc.poc_commands import _start_poc, _stop_poc, prepare_poc_provision

    workspace = tmp_path_factory.mktemp("poc") / "poc"
    workspace.mkdir()
    gen_default_project_config("dummy_project.yml", str(workspace / "project.yml"))
    project = yaml.safe_load((workspace / "project.yml").read_text())
    (server,) = [p for p in project["participants"] if p["type"] == "server"]
    (admin,) = [p["name"] for p in project["participants"] if p.get("role") == "project_admin"]
    server.update(zip(("fed_learn_port", "admin_port"), free_ports(2)))  # not 8002/8003: another POC may hold them
    (workspace / "project.yml").write_text(yaml.safe_dump(project, sort_keys=False))
    prepare_poc_provision(clients=[], number_of_clients=len(SITES), workspace=str(workspace),
                          docker_image=None, use_he=False, project_conf_path=str(workspace / "project.yml"),
                          examples_dir=None)
    kits = {p.parents[1].name: p.parents[1] for p in workspace.rglob("startup/fed_*.json")}
    for name in [server["name"], *SITES]:  # the production form names installed fedlabels classes
        allow_fedlabels(kits[name], site=name if name in SITES else None)
    with environment({"FEDLABELS_DATA": "embedded", "OMP_NUM_THREADS": "1"}):  # what the services start with
        _start_poc(poc_workspace=str(workspace), gpu_ids=[], excluded=[admin], services_list=[])
    try:
        wait_for_sites(kits[admin], SITES)
        yield {"workspace": workspace, "admin": kits[admin], "kits": kits}
    finally:
        _stop_poc(poc_workspace=str(workspace), excluded=[admin], services_list=[])
        deadline = time.time() + 60
        while kit_processes(workspace) and time.time() < deadline:
            time.sleep(1)


def run_job(poc, name):
    spec = smoke(name)
    changes = {side: {**getattr(spec.run, side), **options} for side, options in CHANGES.get(name, {}).items()}
    spec = spec.replace(synth={**SYNTH[spec.run.data.family], **spec.run.data.synth}, **changes)
    own = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "run"}
    code = ("import sys; from fedlabels.config import RunConfig; from fedlabels.flare.job import JobSpec, run_cli; "
            f"run_cli(JobSpec(run=RunConfig.from_json({spec.run.to_json()!r}), **{own!r}), sys.argv[1:])")
    out = subprocess.run([sys.executable, "-c", code, "--prod", str(poc["admin"]), "-n", str(len(SITES)),
                          "--rounds", str(spec.rounds)], capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    lines = [line for line in text.splitlines() if line.startswith("job ") and "results:" in line]
    return name, text, lines[-1] if lines else None


def test_every_shipped_job_finishes_in_poc_mode_with_the_production_defaults(poc):
    with ThreadPoolExecutor(AT_ONCE) as pool:
        finished = list(pool.map(lambda name: run_job(poc, name), sorted(JOBS)))
    failures = []
    for name, text, line in finished:
        if JOBS[name].run.data.oracle:  # a hospital refuses it: its gate names the field, nothing of it runs
            job_id = line.split()[1].rstrip(":") if line else None
            logs = [(poc["kits"][site] / "log.txt").read_text(errors="replace") for site in SITES]
            if job_id is None or line.split()[2].rstrip(";") == "FINISHED:COMPLETED" \
                    or not all("refused by the site's gate: field 'data.oracle'" in log for log in logs) \
                    or any((poc["kits"][site] / job_id / "log.txt").exists() for site in SITES):
                failures.append(f"{name}: not refused by both sites' gates: {line or text[-1500:]}")
            continue
        if line is None or line.split()[2].rstrip(";") != "FINISHED:COMPLETED":
            failures.append(f"{name}: {line or text[-1500:]}")
            continue
        workspace = line.split("results: ")[1].strip() + "/workspace"
        config = json.loads(open(f"{workspace}/fedlabels.json").read())
        rounds = [json.loads(r) for r in open(f"{workspace}/metrics.jsonl").read().splitlines()]
        if config["min_sites"] != len(SITES) or [r["round"] for r in rounds] != [0, 1]:
            failures.append(f"{name}: min_sites {config['min_sites']}, rounds {[r['round'] for r in rounds]}")
        elif not all(r.get("aggregated") for r in rounds):
            failures.append(f"{name}: a round did not aggregate: {rounds}")
    assert not failures, "\n".join(failures)
