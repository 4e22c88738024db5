"""A real provisioned federation on loopback: TLS kits, separate processes, separate data.

``fedlabels provision`` makes a server, two hospital and one admin kit; each
participant starts from its kit (``startup/start.sh``) as its own process
tree, each hospital with its own scenario folder in ``FEDLABELS_DATA``
(holding only its own site). Jobs are submitted the way an admin does it,
``python nvflare_jobs/<job>/job.py --prod ADMIN_KIT`` (nvflare's ProdEnv
through the admin API), in their production form (configuration only;
site-2 is provisioned with ``--no-byoc``). The tests run in file order on one
federation (the ``fed`` fixture, tests/deploy/conftest.py; the helpers are
tests/deploy/loopback.py): the kits' mutual TLS; a job and its exported model;
a job with custom code refused by site-2; each configuration attack refused by
a hospital's gate before round 0; a server whose run token is a path refused;
a site running another fedlabels version refused; a kit signed by another CA
refused; then the same job in nvflare's POC mode.

The fault drills (malformed data, hostile replies and a stalled hospital, a killed
hospital, the server killed and resumed) are tests/deploy/test_drills.py, on a
federation of their own, outside CI (``make test-drills``, before a release).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from monai.bundle import verify_metadata

from clinical_inputs import write_inputs
from fedlabels.data.synthetic import generate
from fedlabels.flare.local_federation import Participant, free_ports, kit_processes, this_python_first, wait_for_sites
from fedlabels.flare.provision import PINNED, installed
from loopback import (ADMIN, FEDLABELS, HANG, JOB, SITES, _result, connected, nvflare, site_env, site_log,
                      submit, wait_for_text)

pytestmark = pytest.mark.deploy


def test_provisioned_kits_use_mutual_tls_and_pin_the_packages(fed):
    kits = fed["kits"]
    server = json.loads((kits["localhost"] / "startup" / "fed_server.json").read_text())
    assert server["servers"][0]["connection_security"] == "mtls"
    for site in SITES:
        client = json.loads((kits[site] / "startup" / "fed_client.json").read_text())
        assert client["client"]["connection_security"] == "mtls"
        for name in ("client.crt", "client.key", "rootCA.pem"):
            assert (kits[site] / "startup" / name).is_file()
        pins = (kits[site] / "startup" / "requirements.txt").read_text().split()
        assert pins == [f"{name}=={installed(name)}" for name in PINNED]


def test_a_job_runs_on_the_loopback_federation_and_its_model_serves(fed, tmp_path):
    t0 = time.time()
    job_id, status, result = submit(fed, "--rounds", "2")
    assert status == "FINISHED:COMPLETED"
    rounds = [json.loads(line) for line in (result / "workspace" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1]
    assert all(sorted(r["sites"]) == list(SITES) for r in rounds)
    # each hospital trained on its own folder: its own cases and label set
    for site in SITES:
        own = json.loads((fed["data"][site] / site / "datalist.json").read_text())["training"]
        assert f"[{site}] fedavg on synthetic-cxr: {len(own)} training cases" in site_log(fed, site, job_id)
    assert sorted(json.loads((result / "workspace" / "cross_site_eval.json").read_text())) == list(SITES)
    # the server keeps the job in the store its kit was provisioned with (--server-storage), not in /tmp/nvflare
    assert (fed["tmp"] / "server-storage" / "jobs-storage" / job_id / "workspace").is_file()

    model = result / "workspace" / "app_server" / "FL_global_model.pt"
    # each hospital's audit record: what it sent, task by task
    state = torch.load(model, weights_only=False)["model"]
    for site in SITES:
        lines = (fed["kits"][site] / "fedlabels_sent" / f"{site}.jsonl").read_text().splitlines()
        sent = [e for e in map(json.loads, lines) if e["time"] > t0]
        assert [e["task"] for e in sent] == ["summary", "train", "train", "validate"]
        assert "weights" in sent[0] and not sent[0]["weights"]  # the handshake: label summary and versions only
        assert set(sent[0]["meta"]) == {"label_summary", "versions"}
        for e in sent[1:3]:
            assert {k: v["shape"] for k, v in e["weights"].items()} == {k: list(v.shape) for k, v in state.items()}
            assert e["array_bytes"] == sum(np.asarray(v).nbytes for v in state.values())
            assert e["meta"]["n"] == len(json.loads((fed["data"][site] / site / "datalist.json").read_text())["training"])
        assert sent[3]["weights"] == {}  # validation sends metrics only
        # the hospital's own record (its kit's privacy.json): the same replies, before the job's filters
        lines = (fed["kits"][site] / "fedlabels_sent" / f"{site}.site.jsonl").read_text().splitlines()
        own = [e for e in map(json.loads, lines) if e["time"] > t0]
        assert [(e["task"], e["weights"], e["meta"]) for e in own] == [(e["task"], e["weights"], e["meta"]) for e in sent]
        assert [e["round"] for e in own[1:3]] == [0, 1]
    # the clinical bundle: thresholds from the sites' validation cases, test metrics, the run's provenance
    bundle = tmp_path / "bundle"
    subprocess.run([FEDLABELS, "export", "--bundle", "cxr_densenet121", "--run", str(result / "workspace"),
                    "--data", str(fed["full"]), "--out", str(bundle)], check=True, capture_output=True)
    verify_metadata(meta_file=str(bundle / "configs" / "metadata.json"),
                    filepath=str(Path(__file__).resolve().parents[1] / "monai_bundle_metadata.schema.json"))
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert meta["provenance"]["method"] == "fedavg" and meta["provenance"]["rounds"] == 2
    assert meta["provenance"]["checkpoint"].endswith("best_FL_global_model.pt")  # the documented default
    assert meta["provenance"]["sites"] == list(SITES)
    # the label table is what the server received from each hospital (its label_summaries.json)
    received = json.loads((result / "workspace" / "label_summaries.json").read_text())
    assert sorted(received) == list(SITES) and "label_summaries.json" in meta["training"]["label_table_source"]
    for site in SITES:
        row = meta["training"]["label_table"][site]
        assert [row["annotated"][c] for c in meta["class_names"]] == received[site]["annotated"]
    assert meta["test_metrics"]["cases"] == 12 and set(meta["decision_thresholds"]) == set(meta["class_names"])
    card = (bundle / "docs" / "README.md").read_text()  # the model card, from the same metadata
    for part in ("## Intended use", "Federated method: fedavg", "Rounds completed: 2", "## Performance",
                 "## Known limitations", *SITES):
        assert part in card, part
    images = tmp_path / "images"
    for f in sorted((fed["full"] / "test" / "images").glob("*.png"))[:2]:
        write_inputs(images, f)  # PNG, NIfTI, DICOM and inverted (MONOCHROME1) DICOM of the same picture
    subprocess.run([sys.executable, "-m", "monai.bundle", "run", "--config_file", str(bundle / "configs" / "inference.json"),
                    "--bundle_root", str(bundle), "--dataset_dir", str(images), "--output_dir", str(tmp_path / "out"),
                    "--device", "cpu"], check=True, capture_output=True)
    rows = list(csv.reader(open(tmp_path / "out" / "predictions.csv")))
    assert [Path(r[0]).name for r in rows[1:]] == sorted(p.name for p in images.iterdir())
    probs = np.array([[float(v) for v in r[1:7]] for r in rows[1:]])
    assert probs.shape == (8, 6) and ((probs > 0) & (probs < 1)).all()
    for k in (1, 2, 3):  # each picture's four files, in name order, give the same probabilities
        assert np.allclose(probs[0::4], probs[k::4], atol=1e-5)


def test_a_hospital_that_refuses_custom_code_refuses_a_job_that_carries_it(fed):
    """site-2 was provisioned with --no-byoc: a job folder in the simulator form (its client script and
    bundle in app/custom) is refused there whoever submits it, the project admin included; every other
    test submits the production form (configuration only) and runs at both."""
    kit = ["--startup-kit", str(fed["admin"])]
    # the committed job's form (client script and bundle in app/custom), needing both hospitals: refused at
    # site-2, it cannot start anywhere
    folder = subprocess.run([sys.executable, str(JOB), "--out", str(fed["tmp"] / "byoc"), "-n", "2", "--min-sites", "2"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert (Path(folder) / "app" / "custom").is_dir()
    out = nvflare("job", "submit", "-j", folder, *kit)
    job_id = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", out).group(0)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # nvflare's job record shows each site's deployment
            status = nvflare("job", "meta", job_id, *kit)
            if re.search(r"site-2\W+NVFLARE_ERROR", status):
                break
            time.sleep(2)
    finally:
        nvflare("job", "abort", job_id, *kit, check=False)
        nvflare("job", "wait", job_id, "--timeout", "60", *kit, check=False)
    assert re.search(r"BYOC\W+yes", status), status
    assert re.search(r"site-2\W+NVFLARE_ERROR: BYOC not permitted", status), status
    assert not list(fed["kits"]["site-2"].glob(f"{job_id}/log.txt"))  # nothing of it ran at site-2


def test_a_hospitals_gate_refuses_each_configuration_attack_before_round_0(fed):
    """Configuration-only jobs (no code: what a --no-byoc hospital runs) that would make site-2 run code, pick
    its data, or stream its log: each is refused there at deployment by its gate (nvflare's app_validator,
    fedlabels.flare.gate), naming the field, in site-2's log and in the job record the admin reads; no file
    the attack would write exists. Drills are allowed at site-2 (--fault-drills), so the drill case asks for
    one at site-1, which allows none."""
    kit = ["--startup-kit", str(fed["admin"])]
    marker = fed["tmp"] / "gate-pwned"
    code = f"$__import__('pathlib').Path({str(marker)!r}).write_text('x') and 1"
    streamer = {"id": "log", "path": "nvflare.app_common.logging.job_log_streamer.JobLogStreamer", "args": {}}
    attacks = {  # name -> (change to the executor's run configuration, to its args, to the config; field)
        "expression": ({"network": {"in_channels": code}}, {}, {}, "network.in_channels"),
        "target": ({"network": {"_target_": "pathlib.Path"}}, {}, {}, "network._target_"),
        "preset": ({"data": {"family": "cxr", "preset": "../../../../etc/hosts"}}, {}, {}, "data.preset"),
        "data": ({}, {"data": str(fed["data"]["site-1"])}, {}, "data"),
        "oracle": ({"data": {"family": "cxr", "oracle": True}}, {}, {}, "data.oracle"),
        "drill": ({"faults": ["site-1:hang:0"]}, {}, {}, "faults[0]"),
        "log": ({}, {}, {"components": [streamer]}, "components[0]"),
    }
    # one production job folder, copied for each attack (each job.py process imports the training stack)
    clean = Path(subprocess.run([sys.executable, str(JOB), "--out", str(fed["tmp"] / "gate" / "clean"), "-n", "2",
                                 "--min-sites", "2", "--rounds", "1", "--config-only"],
                                capture_output=True, text=True, check=True).stdout.strip())
    submitted = {}
    for name, (change, args, extra, field) in attacks.items():
        folder = fed["tmp"] / "gate" / name / clean.name
        shutil.copytree(clean, folder)
        path = folder / "app" / "config" / "config_fed_client.json"
        doc = json.loads(path.read_text())
        executor = doc["executors"][0]["executor"]
        executor["args"]["config"].update(change)
        executor["args"].update(args)
        doc.update(extra)
        path.write_text(json.dumps(doc))
        out = nvflare("job", "submit", "-j", str(folder), *kit)
        submitted[name] = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", out).group(0)
    try:
        for name, job_id in submitted.items():
            site = "site-1" if name == "drill" else "site-2"
            field = attacks[name][3]
            deadline, status = time.time() + HANG, ""
            while time.time() < deadline:  # nvflare's job record shows each site's deployment
                status = nvflare("job", "meta", job_id, *kit)
                if re.search(rf"{site}\W+NVFLARE_ERROR", status):
                    break
                # the site's own log says it first; until then a file read, not an admin process, waits
                wait_for_text(fed["kits"][site] / "log.txt", f"field {field!r}", deadline)
                time.sleep(1)  # the job record follows the site's log
            assert f"fedlabels gate at {site}: refused by the site's gate: field {field!r}" in status, (name, status)
            assert not list(fed["kits"][site].glob(f"{job_id}/log.txt")), name  # nothing of it ran there
            assert f"field {field!r}" in (fed["kits"][site] / "log.txt").read_text(errors="replace"), name
    finally:
        for job_id in submitted.values():
            nvflare("job", "abort", job_id, *kit, check=False)
        for job_id in submitted.values():
            nvflare("job", "wait", job_id, "--timeout", "60", *kit, check=False)
    assert not marker.exists()


def test_a_site_refuses_a_server_whose_run_token_is_a_path(fed):
    """A server that is not ours (the job's server app carries its own controller, which names the run
    ``../../escaped``): each hospital refuses the task, writes nothing under that name, and says why; the
    job stops before round 0 with the hospitals' reason."""
    kit = ["--startup-kit", str(fed["admin"])]
    folder = Path(subprocess.run([sys.executable, str(JOB), "--out", str(fed["tmp"] / "hostile-server"), "-n", "2",
                                  "--rounds", "1", "--config-only"], capture_output=True, text=True,
                                 check=True).stdout.strip())
    shutil.copytree(folder / "app", folder / "app_server")
    (folder / "app").rename(folder / "app_site")
    (folder / "app_server" / "custom").mkdir()
    (folder / "app_server" / "custom" / "hostile_controller.py").write_text(
        "from fedlabels.flare.controller import RUN, FedLabelsController\n\n\n"
        "class HostileController(FedLabelsController):\n"
        "    def _task_meta(self):\n"
        "        return {**super()._task_meta(), RUN: '../../escaped'}\n")
    server_config = folder / "app_server" / "config" / "config_fed_server.json"
    server_config.write_text(server_config.read_text().replace("fedlabels.flare.controller.FedLabelsController",
                                                               "hostile_controller.HostileController"))
    meta = json.loads((folder / "meta.json").read_text())
    meta["deploy_map"] = {"app_server": ["server"], "app_site": list(SITES)}
    (folder / "meta.json").write_text(json.dumps(meta))
    t0 = time.time()
    out = nvflare("job", "submit", "-j", str(folder), *kit)
    job_id = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", out).group(0)
    nvflare("job", "wait", job_id, "--timeout", str(HANG), *kit, check=False)
    status = nvflare("job", "meta", job_id, *kit)
    assert "FINISHED:COMPLETED" not in status, status
    for site in SITES:
        log = site_log(fed, site, job_id)
        assert f"[{site}] refused a train task from the server: run token '../../escaped' is not a plain name" in log
    nvflare("job", "download", job_id, "-o", str(fed["tmp"] / "hostile-server-result"), *kit)
    server_log = next((fed["tmp"] / "hostile-server-result").rglob("workspace/log.txt")).read_text(errors="replace")
    assert "run token '../../escaped' is not a plain name" in server_log, server_log[-3000:]
    assert not [p for p in fed["tmp"].rglob("escaped") if p.stat().st_mtime > t0]
    assert not list(fed["tmp"].rglob("escaped"))


def test_a_hospital_running_another_fedlabels_version_is_refused_before_round_0(fed):
    """site-2 restarted in an environment where fedlabels reports another version (a distribution record
    first on its path): the server compares every site's versions at the handshake and stops the job
    before round 0, naming the site and both versions."""
    other = fed["tmp"] / "other-version"
    (other / "fedlabels-0.0.1.dist-info").mkdir(parents=True, exist_ok=True)
    (other / "fedlabels-0.0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fedlabels\n"
                                                                  "Version: 0.0.1\n")
    fed["sites"]["site-2"].stop()
    fed["sites"]["site-2"] = Participant(fed["kits"]["site-2"],
                                         env=site_env(fed, "site-2", PYTHONPATH=str(other))).start()
    try:
        wait_for_sites(fed["admin"], SITES)
        job_id, status, result = submit(fed, "--rounds", "1")
    finally:
        fed["sites"]["site-2"].stop()
        fed["sites"]["site-2"] = Participant(fed["kits"]["site-2"], env=site_env(fed, "site-2")).start()
        wait_for_sites(fed["admin"], SITES)
    assert status != "FINISHED:COMPLETED", status
    log = (result / "workspace" / "log.txt").read_text()
    assert f"site-2 runs {{'fedlabels': '0.0.1'}}, the server {{'fedlabels': '{installed('fedlabels')}'" in log
    assert not (result / "workspace" / "metrics.jsonl").exists()  # no round ran


def test_a_site_whose_certificate_another_ca_signed_is_refused(fed):
    """A kit provisioned by another project (its own root CA) for this server's address and ports: the
    server's mutual TLS refuses it, and it never joins the federation."""
    fl_port, admin_port = fed["ports"]
    out = subprocess.run([FEDLABELS, "provision", "--project", "rogue", "--server", "localhost", "--sites", "site-3",
                          "--admin", ADMIN, "--out", str(fed["tmp"] / "rogue"), "--fl-port", str(fl_port),
                          "--admin-port", str(admin_port)], capture_output=True, text=True, check=True).stdout
    kit = Path(next(line.split()[1] for line in out.splitlines() if line.startswith("site-3 ")))
    rogue = Participant(kit, env={"FEDLABELS_DATA": str(fed["data"]["site-2"]), "OMP_NUM_THREADS": "1"}).start()
    try:
        deadline, log, refused = time.time() + 90, kit / "log.txt", None
        while time.time() < deadline and refused is None:  # the kit's own log: its connection attempts
            time.sleep(1)
            text = log.read_text(errors="replace") if log.is_file() else ""
            refused = re.search(r"ClientConnectorCertificateError.*SSLCertVerification", text)
        assert refused, (log.read_text(errors="replace") if log.is_file() else "no log.txt")[-3000:]
        assert "site-3" not in connected(fed)
    finally:
        rogue.stop()


def test_the_same_job_runs_in_poc_mode(tmp_path):
    """nvflare's POC mode (``job.py --poc``): PocEnv provisions a local project, starts its
    server and sites, runs the job, downloads the result and stops every service. On free
    ports, not nvflare's default 8002/8003 (busy on a machine running another POC): PocEnv
    provisions from the workspace's project.yml, here nvflare's own default with the ports changed."""
    from nvflare.lighter.provision import gen_default_project_config

    workspace = tmp_path / "poc"
    workspace.mkdir()
    gen_default_project_config("dummy_project.yml", str(workspace / "project.yml"))
    project = yaml.safe_load((workspace / "project.yml").read_text())
    fl_port, admin_port = free_ports(2)
    (server,) = [p for p in project["participants"] if p["type"] == "server"]
    server.update(fed_learn_port=fl_port, admin_port=admin_port)
    (workspace / "project.yml").write_text(yaml.safe_dump(project, sort_keys=False))
    data = generate("cxr", tmp_path / "data", seed=0, cases=16, test_cases=12, sites=2)
    env = this_python_first({**os.environ, "NVFLARE_POC_WORKSPACE": str(workspace), "FEDLABELS_DATA": str(data),
                             "OMP_NUM_THREADS": "1"})
    out = subprocess.run([sys.executable, str(JOB), "--poc", "-n", "2", "--rounds", "2"], capture_output=True,
                         text=True, env=env, timeout=300)
    job_id, status, result = _result(out.stdout + out.stderr)
    assert status == "FINISHED:COMPLETED"
    assert result.is_relative_to(workspace)
    rounds = [json.loads(line) for line in (result / "workspace" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1] and all(sorted(r["sites"]) == list(SITES) for r in rounds)
    assert (result / "workspace" / "app_server" / "FL_global_model.pt").is_file()
    (fed_server,) = workspace.rglob("server/startup/fed_server.json")  # the provisioned server: the free ports
    listening = json.loads(fed_server.read_text())["servers"][0]
    assert listening["service"]["target"].endswith(f":{fl_port}") and listening["admin_port"] == admin_port, listening
    # nvflare's supervisor loops notice the stop within their 5 s poll
    deadline = time.time() + 30
    while kit_processes(workspace) and time.time() < deadline:
        time.sleep(1)
    left = kit_processes(workspace)
    assert not left, f"POC services left running: {[(p.pid, p.cmdline()) for p in left]}"
