"""A real provisioned federation on loopback: TLS kits, separate processes, separate data.

``fedlabels provision`` makes a server, two hospital and one admin kit; each
participant starts from its kit (``startup/start.sh``) as its own process
tree, each hospital with its own scenario folder in ``FEDLABELS_DATA``
(holding only its own site). Jobs are submitted the way an admin does it,
``python nvflare_jobs/<job>/job.py --prod ADMIN_KIT`` (nvflare's ProdEnv
through the admin API), in their production form (configuration only;
site-2 is provisioned with ``--no-byoc``). The tests run in file order on one
federation: a job and its exported model; malformed data at one hospital; a
job with custom code refused by site-2; a site running another fedlabels
version refused; a kit signed by another CA refused; hostile replies and a
stalled hospital dropped; a hospital killed mid-round; the server killed
at several points of a job, each time resumed to the uninterrupted model, then one hospital
without its saved state.

The killed hospital is killed while it holds its trained round-1 update (the
``hang`` fault drill: it never sends it), so the test does not depend on how fast
the machine is: the hospital cannot have finished round 1 before the kill.

Two deployment settings are shortened so that the fault tests take seconds,
not the 10 minutes of nvflare's defaults: the server's heartbeat timeout
(``local/resources.json``) and the grace before a silent site is declared
dead (``NVFLARE_DEAD_CLIENT_GRACE_PERIOD``, ``..._CHECK_LEAD_TIME``).
docs/deployment.md says where an IT team sets them.
"""

from __future__ import annotations

import csv
import dataclasses
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
from fedlabels.flare.local_federation import (Participant, free_ports, kit_processes, set_heartbeat_timeout,
                                              this_python_first, wait_for_sites)
from fedlabels.flare.provision import PINNED, installed

pytestmark = pytest.mark.deploy

FEDLABELS = str(Path(sys.executable).with_name("fedlabels"))  # the installed console script
REPO = Path(__file__).resolve().parents[1]
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


def submit(fed, *args, wait=True, faults=(), name="fedavg_cxr"):
    """The committed job through its job.py; with ``faults`` or another job ``name``, that job through
    fedlabels.flare.job.run_cli (what job.py calls), with these fault drills in its configuration."""
    argv = ["--prod", str(fed["admin"]), "-n", "2", *args]
    if faults or name != "fedavg_cxr":
        code = ("import dataclasses, sys; from fedlabels.flare.job import JOBS, run_cli; "
                f"run_cli(dataclasses.replace(JOBS[{name!r}], faults={list(faults)!r}), sys.argv[1:])")
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
                    filepath=str(Path(__file__).with_name("monai_bundle_metadata.schema.json")))
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


def test_a_hospital_with_malformed_data_stops_the_job_before_round_0(fed):
    """The production job folder, its audit filter deleted from its configuration by hand, through
    nvflare's own admin CLI: site-2's malformed datalist stops the job before round 0, and each hospital's
    own record (its kit's local/privacy.json) still holds what it sent, the job's record nothing."""
    t0 = time.time()
    datalist = fed["data"]["site-2"] / "site-2" / "datalist.json"
    good = datalist.read_text()
    datalist.write_text(good.replace('"label"', '"labels"', 1))
    kit = ["--startup-kit", str(fed["admin"])]
    folder = subprocess.run([sys.executable, str(JOB), "--out", str(fed["tmp"] / "jobs"), "--config-only"],
                            capture_output=True, text=True, check=True).stdout.strip()
    client_config = Path(folder) / "app" / "config" / "config_fed_client.json"
    config = json.loads(client_config.read_text())
    assert [f["path"] for c in config["task_result_filters"] for f in c["filters"]] == ["fedlabels.flare.sent.SentRecord"]
    config["task_result_filters"] = []
    client_config.write_text(json.dumps(config))
    try:
        # the production job folder through nvflare's own admin CLI (docs/deployment.md, "Submit")
        out = nvflare("job", "submit", "-j", folder, *kit)
        job_id = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", out).group(0)
        assert job_id in nvflare("job", "list", *kit)
        nvflare("job", "wait", job_id, "--timeout", "180", *kit, check=False)
        status = nvflare("job", "meta", job_id, *kit)
        nvflare("job", "download", job_id, "-o", str(fed["tmp"] / "bad"), *kit)
    finally:
        datalist.write_text(good)
    assert "FINISHED:COMPLETED" not in status and "FINISHED" in status, status
    result = fed["tmp"] / "bad"
    log = next(result.rglob("workspace/log.txt")).read_text()
    # the hospital's message reaches the admin's download naming the field, not the hospital's path or
    # file name; the hospital's own log has the full message
    told = re.findall(r"site-2: <local file>[^\n]*", log)
    assert told and "label" in told[0] and str(datalist) not in log and "datalist.json" not in log, told
    own = "".join(p.read_text() for p in fed["kits"]["site-2"].rglob(f"{job_id}/log.txt"))
    assert str(datalist) in own and "label" in own
    assert not list(result.rglob("metrics.jsonl"))  # no round ran
    for site, task in (("site-1", "summary"), ("site-2", "fatal")):  # site-1's label summary, site-2's error
        records = fed["kits"][site] / "fedlabels_sent"
        own = [e for e in map(json.loads, (records / f"{site}.site.jsonl").read_text().splitlines()) if e["time"] > t0]
        assert [e["task"] for e in own] == [task], own
        job_record = records / f"{site}.jsonl"
        assert not job_record.exists() or all(json.loads(line)["time"] < t0
                                              for line in job_record.read_text().splitlines())


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
        "preset": ({"data": {"family": "cxr", "protocol": "../../../../etc/hosts"}}, {}, {}, "data.protocol"),
        "data": ({}, {"data": str(fed["data"]["site-1"])}, {}, "data"),
        "oracle": ({"data": {"family": "cxr", "oracle": True}}, {}, {}, "data.oracle"),
        "drill": ({"faults": ["site-1:hang:0"]}, {}, {}, "faults[0]"),
        "log": ({}, {}, {"components": [streamer]}, "components[0]"),
    }
    submitted = {}
    for name, (change, args, extra, field) in attacks.items():
        folder = Path(subprocess.run([sys.executable, str(JOB), "--out", str(fed["tmp"] / "gate" / name), "-n", "2",
                                      "--min-sites", "2", "--rounds", "1", "--config-only"],
                                     capture_output=True, text=True, check=True).stdout.strip())
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
                time.sleep(2)
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


def site_env(fed, site, **extra) -> dict:
    return {"FEDLABELS_DATA": str(fed["data"][site]), "OMP_NUM_THREADS": "1", **extra}


def connected(fed) -> set:
    from fedlabels.flare.local_federation import admin_session

    session = admin_session(fed["admin"])
    try:
        return {c.name for c in session.get_system_info().client_info}
    finally:
        session.close()


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


def test_hostile_replies_and_a_stalled_hospital_are_dropped_and_the_job_finishes(fed):
    """Surgical Aggregation (its rule reads each site's per-class labeled mask) for 8 rounds. site-2 sends
    what a broken or hostile site could (a case count that is no number, one far above what it declared at
    the handshake, weights of another dtype, extras that are no mapping, an infinite validation score, a
    weight of the right shape holding text, a labeled mask of text) and, in round 1, answers only after the
    server's site_timeout; with the first and the third it sends a key metric that is text, then NaN. (site-1's
    validation split is too small for an AUROC: site-2 alone scores.) Each update is dropped with its reason
    in metrics.jsonl, no score that is not a finite number is scored, and every round goes on (tests/test_flare.py drills the other kinds in the simulator)."""
    job_id, status, result = submit(fed, "--rounds", "8", "--min-sites", "1", "--site-timeout", str(SITE_TIMEOUT),
                                    name="surgical_cxr",
                                    faults=["site-2:n_text:0", "site-2:metric_text:0", "site-2:stall:1",
                                            "site-2:dtype:2", "site-2:metric_nan:2", "site-2:n_huge:3",
                                            "site-2:extras:4", "site-2:metric:5", "site-2:strings:6",
                                            "site-2:mask:7"])
    assert status == "FINISHED:COMPLETED"
    recs = [json.loads(line) for line in (result / "workspace" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in recs] == list(range(8)) and all(r["aggregated"] for r in recs)
    assert [sorted(r["dropped"]) for r in recs] == [["site-2"]] * 5 + [[], ["site-2"], ["site-2"]]
    reasons = [r["dropped"]["site-2"] for r in recs[:5]]
    assert "case count 'many' is not a positive integer" in reasons[0]
    assert "no result" in reasons[1]  # stalled past the timeout
    assert "dtype of" in reasons[2] and "float64" in reasons[2]
    assert "exceeds the" in reasons[3]
    assert "extras are a list" in reasons[4]
    assert "dtype of" in recs[6]["dropped"]["site-2"] and "<U" in recs[6]["dropped"]["site-2"], recs[6]["dropped"]
    assert "could not convert string to float: 'yes'" in recs[7]["dropped"]["site-2"], recs[7]["dropped"]
    # a score is the site's validation of the model it received: it counts when its update is dropped
    assert [r["scored_by"] for r in recs] == [[], [], [], ["site-2"], ["site-2"], [], ["site-2"], ["site-2"]], recs
    assert sorted(recs[5]["sites"]) == list(SITES)  # site-2's update counts; its score does not
    log = (result / "workspace" / "log.txt").read_text()
    assert f"did not answer within {SITE_TIMEOUT}s (site_timeout)" in log
    assert re.search(r"round 0 site-2: metric 'val_\w+'='high' is not a number: left out of the record", log), \
        log[-3000:]
    for rnd, value in [(2, "nan"), (5, "inf")]:
        assert re.search(rf"round {rnd} site-2: val_\w+={value} is not finite: not scored", log), log[-3000:]


def test_a_killed_hospital_is_left_out_and_the_job_finishes(fed):
    t0 = time.time()
    proc = submit(fed, "--rounds", "2", "--min-sites", "1", wait=False, faults=["site-2:hang:1"])
    try:
        # round 0 aggregated from both; site-2 has trained round 1 and holds its update (the hang drill)
        wait_for_round(fed["kits"]["localhost"], 1, t0, proc)
        wait_for_line(fed["kits"]["site-2"], "fault drill: site-2 hangs in round 1", t0, proc)
        fed["sites"]["site-2"].stop()  # SIGKILL to the whole hospital: no goodbye to the server
        out, _ = proc.communicate(timeout=HANG)
    finally:
        proc.kill()
        fed["sites"]["site-2"].start()
    job_id, status, result = _result(out)
    assert status == "FINISHED:COMPLETED"
    rounds = [json.loads(line) for line in (result / "workspace" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1]
    assert sorted(rounds[0]["sites"]) == list(SITES)
    assert list(rounds[-1]["sites"]) == ["site-1"]  # the round went on with the hospital that stayed
    wait_for_sites(fed["admin"], SITES)


def test_a_server_killed_at_any_point_resumes_to_the_uninterrupted_model(fed):
    """fedbn_cxr for 4 rounds (each hospital keeps its own batch norm and its Adam moments from round to
    round), the server stopped five times and the job resumed each time from the folder the stopped
    server left: the whole server killed (SIGKILL) wherever it is once round 0 is aggregated, then
    restarted; then the fault drill once the hospitals have answered round 2 (they hold their round-2
    state, the server wrote nothing of the round); once round 3 is aggregated but before anything of it is written;
    after round 3's checkpoint, progress.json and metrics but before its model file; and, from the same
    folder again, after everything of round 3 but before the final evaluation (the job resumed from there
    has no round left: it validates the checkpoint's model with the sites' saved state). Each leg finds its
    drill's line in the server's log and the files it should have left behind. That global model equals 4 uninterrupted rounds
    of the in-process engine, the engine the FLARE controller runs
    (FLARE = in-process: tests/test_flare.py). Then site-2 loses its saved state and the last round is
    resumed again: it joins from the global model, restarted with its own rules (its privacy.json): its
    batch norm never leaves it, which its record of what it sent shows, and its label summary leaves
    noised, which the server's log shows."""
    from fedlabels.bundle import network
    from fedlabels.checkpoint import read_checkpoint
    from fedlabels.flare.job import JOBS
    from fedlabels.flare.provision import SITE_NOISE, site_policy
    from fedlabels.nets import batchnorm_keys
    from fedlabels.references import federate, setups

    server_kit = fed["kits"]["localhost"]
    t0 = time.time()
    proc = submit(fed, "--rounds", "4", wait=False, name="fedbn_cxr")
    try:
        progress = wait_for_round(server_kit, 1, t0, proc)
        fed["server"].stop()
    finally:
        proc.kill()
        proc.communicate()
    first = progress.parent
    next_round, run = (json.loads(progress.read_text())[k] for k in ("next_round", "run"))
    assert next_round in (1, 2), next_round  # stopped in round 1 (or 2 on a fast machine), before the drills' round
    fed["server"] = Participant(server_kit, env=SERVER_ENV).start()
    wait_for_sites(fed["admin"], SITES)

    def leg(resume_from, *faults):
        job_id, status, result = submit(fed, "--rounds", "4", "--resume-from", str(resume_from), faults=faults,
                                        name="fedbn_cxr")
        assert status == "FINISHED:COMPLETED", status
        log = (result / "workspace" / "log.txt").read_text()
        assert f"resuming from {resume_from}: round " in log
        metrics = result / "workspace" / "metrics.jsonl"
        recs = [json.loads(line)["round"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
        # nvflare archives a finished job's run folder into its job store: resumed from the admin's download
        return result / "workspace", job_id, log, recs

    def states(site):
        (folder,) = fed["kits"][site].rglob(f"fedlabels_state/{run}/{site}")
        return sorted(p.name for p in folder.iterdir())

    b, job_id, log, recs = leg(first, "server:mid_round:2")
    assert "fault drill: the server dies at mid_round of round 2" in log
    assert recs == list(range(next_round, 2)), recs  # round 2 answered by the sites, never logged
    assert read_checkpoint(b, "fedbn", 4)["next_round"] == 2
    assert states("site-1") == ["round-00001.pt", "round-00002.pt"]  # its last two rounds
    def model_file(folder):
        return torch.load(folder / "app_server" / "FL_global_model.pt", weights_only=False)["model"]

    def same(a, b):
        return set(a) == set(b) and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)

    c, job_id, log, recs = leg(b, "server:before_checkpoint:3")
    assert "fault drill: the server dies at before_checkpoint of round 3" in log
    for site in SITES:  # they had trained round 2 for the stopped server: they resume the state before it
        assert f"[{site}] resumed its state of round 1" in site_log(fed, site, job_id)
    assert recs == [2]  # round 3 aggregated, nothing of it written: no line ahead of the checkpoint
    saved = read_checkpoint(c, "fedbn", 4)
    assert saved["next_round"] == 3 and json.loads((c / "progress.json").read_text())["next_round"] == 3
    assert same(model_file(c), saved["weights"])  # the model file is the checkpoint's (round 2's), never round 3's
    d, job_id, log, recs = leg(c, "server:before_model:3")
    assert "fault drill: the server dies at before_model of round 3" in log
    for site in SITES:
        assert f"[{site}] resumed its state of round 2" in site_log(fed, site, job_id)
    assert recs == [3] and read_checkpoint(d, "fedbn", 4)["next_round"] == 4  # checkpointed, its model file not:
    assert same(model_file(d), saved["weights"]) and not same(model_file(d), read_checkpoint(d, "fedbn", 4)["weights"])
    # the same round again from c, the server stopped after everything of round 3, before the final evaluation
    d2, job_id, log, recs = leg(c, "server:between_rounds:3")
    assert "fault drill: the server dies at between_rounds of round 3" in log
    final = read_checkpoint(d2, "fedbn", 4)
    assert recs == [3] and final["next_round"] == 4 and same(model_file(d2), final["weights"])
    assert same(final["weights"], read_checkpoint(d, "fedbn", 4)["weights"])  # round 3 twice from c: one model
    assert not (d2 / "cross_site_eval.json").exists()  # the final evaluation never ran
    e, job_id, log, recs = leg(d2)
    assert recs == [] and f"(run {run})" in log  # nothing left to train: the checkpoint's model, validated
    assert (e / "cross_site_eval.json").exists()
    for site in SITES:  # with the state each site saved (its own batch norm), not the initial one
        assert f"[{site}] resumed its state of round 3" in site_log(fed, site, job_id)
    resumed = model_file(e)

    spec = dataclasses.replace(JOBS["fedbn_cxr"], sites=2, rounds=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each hospital (OMP_NUM_THREADS=1): the same order of sums
    try:
        straight = federate("fedbn", setups(REPO / "bundles" / spec.bundle, fed["full"], seed=spec.seed,
                                            config=spec.config().bundle_config() or None),
                            4, seed=spec.seed, client_options=spec.client, log=None)["last"]
    finally:
        torch.set_num_threads(threads)
    assert set(resumed) == set(straight)
    for k in resumed:
        np.testing.assert_allclose(np.asarray(resumed[k]), straight[k], rtol=0, atol=1e-5, err_msg=k)

    # site-2 lost its saved state (a replaced machine, or a site new to the run): it joins from the global
    # model. It comes back with its own rule that batch norm never leaves it (provision --withhold-batchnorm):
    # its record of what it sent, taken after that rule and before the job's filters, holds no batch norm.
    lost = list(fed["kits"]["site-2"].rglob(f"fedlabels_state/{run}/site-2"))
    assert lost, "site-2 saved no state under its kit"
    for folder in lost:
        shutil.rmtree(folder)
    site = fed["sites"]["site-2"]
    site.stop()
    site_policy(fed["kits"]["site-2"], withhold_batchnorm=True, noise_summary=SITE_NOISE)
    # the hospital's privacy ledger, in the test's folder rather than the account's home
    site.env["FEDLABELS_PRIVACY_LEDGER"] = str(fed["tmp"] / "site-2-ledger.json")
    site.start()
    wait_for_sites(fed["admin"], SITES)
    try:
        t1 = time.time()
        f, job_id, _, recs = leg(c)
        assert recs == [3]
        assert ("[site-2] no saved state of this run before round 3" in site_log(fed, "site-2", job_id)
                and "joins from the global model" in site_log(fed, "site-2", job_id))
        last = json.loads((f / "metrics.jsonl").read_text().splitlines()[-1])
        assert sorted(last["sites"]) == list(SITES)  # both trained the last round
        bn = set(batchnorm_keys(network(REPO / "bundles" / spec.bundle)))
        for site, has_bn in (("site-1", True), ("site-2", False)):
            lines = (fed["kits"][site] / "fedlabels_sent" / f"{site}.site.jsonl").read_text().splitlines()
            trained = [e for e in map(json.loads, lines) if e["time"] > t1 and e["task"] == "train"]
            assert len(trained) == 1 and bool(bn & set(trained[0]["weights"])) == has_bn, \
                (site, sorted(trained[0]["weights"])[:5])
        assert re.search(r"withheld \d+ batch-norm entries", site_log(fed, "site-2", job_id))
        # and its own label-summary noise, under a job without the privacy option; the server takes it
        assert "the hospital's own label-summary noise" in site_log(fed, "site-2", job_id)
        server_log = (f / "log.txt").read_text()
        assert "privacy: site-2: label summary noised (Gaussian, noise_multiplier=1, clip=4)" in server_log
        assert "privacy: site-1" not in server_log
    finally:
        # the last test on this federation: site-2's policy file goes back to the default, and the running
        # site keeps its rules until the fixture stops it (a restart here cost CI half a minute)
        site_policy(fed["kits"]["site-2"])
        fed["sites"]["site-2"].env.pop("FEDLABELS_PRIVACY_LEDGER", None)


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
