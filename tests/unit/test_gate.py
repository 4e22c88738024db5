"""The hospital's job gate (fedlabels.flare.gate) and what a site checks of the server's tasks.

Each attack is a configuration-only job's argument that MONAI's parser, the preset loader or the site
would otherwise act on; each is refused naming its field, and where the attack writes a file, the file
does not exist afterwards. The loopback federation (tests/deploy/test_federation.py) refuses the same jobs at a
provisioned site through nvflare's app_validator.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlabels import nets
from fedlabels.bundle import network
from fedlabels.flare.client import SiteSession, build_parser, screen_task, size_threads
from fedlabels.flare.controller import RUN, THREADS
from fedlabels.flare.gate import NETWORK_KEYS, GateError, JobGate, check_client_config, check_job
from fedlabels.flare.job import JOBS

SITE = "site-2"


def job(**changes) -> dict:
    """The fedavg_cxr production job's run configuration, with ``changes`` merged into its sections."""
    doc = JOBS["fedavg_cxr"].run.to_json()
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return doc


def attacks(tmp_path: Path) -> dict:
    """name -> (run configuration, data argument, the field the gate names, a file the attack writes)."""
    marker = tmp_path / "pwned"
    code = f"$__import__('pathlib').Path({str(marker)!r}).write_text('x') and 1"
    return {
        "expression": (job(network={"in_channels": code}), "", "network.in_channels", marker),
        "reference": (job(network={"out_channels": "@num_classes"}), "", "network.out_channels", None),
        "target": (job(network={"_target_": "pathlib.Path"}), "", "network._target_", None),
        "target_expression": (job(network={"_target_": code}), "", "network._target_", marker),
        "nested": (job(network={"features": [{"_target_": "os.system", "command": "true"}]}), "",
                   "network.features[0]", None),
        "checkpoint": (job(network={"init_ckpt": "/etc/passwd"}), "", "network.init_ckpt", None),
        "mode": (job(network={"_mode_": "debug"}), "", "network._mode_", None),
        "preset_path": (job(data={"preset": "../../../../etc/hosts"}), "", "data.preset", None),
        "preset_other_bundle": (job(data={"preset": "fedmix"}), "", "data.preset", None),
        "bundle_path": (job(bundle=str(tmp_path / "evil_bundle")), "", "bundle", None),
        "bundle_unknown": (job(bundle="not_installed"), "", "bundle", None),
        "data_folder": (job(), str(tmp_path), "data", None),
        "oracle": (job(data={"oracle": True}), "", "data.oracle", None),
        "data_key": (job(data={"root": "/data/other"}), "", "data.root", None),
        "batch_word": (job(data={"batch_size": "all"}), "", "data.batch_size", None),
        "synth_expression": (job(data={"synth": {"cases": code}}), "", "data.synth.cases", marker),
        "client_expression": (job(client={"lr": code}), "", "client.lr", marker),
        "server_nested": (job(server={"weighted": {"_target_": "os.system"}}), "", "server.weighted", None),
        "fault_drill": (job(faults=[f"{SITE}:hang:0"]), "", "faults[0]", None),
        "not_a_mapping": (["method", "fedavg"], "", "config", None),
        "unknown_field": (job(runner="x"), "", "config", None),
    }


def test_every_attack_is_refused_naming_its_field_and_writes_nothing(tmp_path):
    for name, (config, data, field, marker) in attacks(tmp_path).items():
        with pytest.raises(GateError) as e:
            check_job(config, SITE, data)
        assert e.value.field == field, (name, str(e.value))
        assert f"field {field!r}" in str(e.value)
        assert marker is None or not marker.exists(), name


def test_the_shipped_production_jobs_pass_the_gate():
    """Every committed job but the upper bounds (oracle: every site's full labels) is what a hospital runs."""
    for name, spec in JOBS.items():
        config = spec.run.to_json()
        if config["data"].get("oracle"):
            with pytest.raises(GateError, match="data.oracle"):
                check_job(config, SITE)
        else:
            check_job(config, SITE)
    # a plain network override, a preset of the job's own bundle, a drill naming another site, a drill the
    # site allows
    check_job(job(network={"hidden": 16, "dropout": 0.1}), SITE)
    check_job(JOBS["isofed_medmnist"].run.to_json(), SITE)
    check_job(job(faults=["site-1:hang:0", "server:mid_round:1"]), SITE)
    check_job(job(faults=[f"{SITE}:nan:0"]), SITE, fault_drills=True)


def test_the_gate_without_its_checks_would_let_the_expression_run(tmp_path):
    """The expression attack is real: the same network override given to the bundle without the gate
    writes the file (so the tests above fail if the gate stops refusing it)."""
    config, _, _, marker = attacks(tmp_path)["expression"]
    network("cxr_densenet121", config["network"])
    assert marker.read_text() == "x"


def test_network_keys_are_the_networks_own_arguments_less_the_checkpoint():
    params = set()
    for cls in (nets.DenseNet121Classifier, nets.ResNet18Classifier, nets.SimpleCNN, nets.GroupNormUNet,
                nets.TwinUNet):
        params |= set(inspect.signature(cls.__init__).parameters) - {"self", "init_ckpt"}
    assert set(NETWORK_KEYS) == params


def test_the_site_validator_reads_the_jobs_client_configuration(tmp_path):
    app = tmp_path / "app"
    (app / "config").mkdir(parents=True)
    config, data, _, _ = attacks(tmp_path)["oracle"]
    doc = {"format_version": 2, "executors": [{"tasks": ["train"], "executor": {
        "path": "fedlabels.flare.executor.SiteExecutor", "args": {"config": config}}}]}
    (app / "config" / "config_fed_client.json").write_text(json.dumps(doc))
    err, info = JobGate(SITE).validate(str(app))
    assert err.startswith(f"fedlabels gate at {SITE}: refused by the site's gate: field 'data.oracle'") and info == {}
    doc["executors"][0]["executor"]["args"] = {"config": job()}
    (app / "config" / "config_fed_client.json").write_text(json.dumps(doc))
    assert JobGate(SITE).validate(str(app)) == ("", {})
    doc["executors"][0]["executor"]["args"] = {"config": job(), "data": "/elsewhere"}
    with pytest.raises(GateError, match="field 'data'"):
        check_client_config(doc, SITE)
    doc["executors"][0]["executor"]["args"] = {"config": job(), "shell": "x"}
    with pytest.raises(GateError, match="executor.args.shell"):
        check_client_config(doc, SITE)
    # a log streamer (the site's unredacted log to the server), another executor: classes no job of ours names
    doc["executors"][0]["executor"]["args"] = {"config": job()}
    streamer = {"id": "log", "path": "nvflare.app_common.logging.job_log_streamer.JobLogStreamer", "args": {}}
    with pytest.raises(GateError, match=r"field 'components\[0\]'.*JobLogStreamer"):
        check_client_config({**doc, "components": [streamer]}, SITE)
    other = {"tasks": ["train"], "executor": {"path": "nvflare.app_common.np.np_trainer.NPTrainer"}}
    with pytest.raises(GateError, match="NPTrainer"):
        check_client_config({**doc, "executors": doc["executors"] + [other]}, SITE)
    (app / "custom").mkdir()  # a job with code: nvflare's BYOC right decides, not the gate
    (app / "config" / "config_fed_client.json").write_text(json.dumps({**doc, "components": [streamer]}))
    assert JobGate(SITE).validate(str(app)) == ("", {})


def test_a_gated_session_refuses_before_building_anything(tmp_path):
    """SiteExecutor's own check (a kit without the validator): the session answers every task with the
    refusal, and the expression never ran."""
    config, _, field, marker = attacks(tmp_path)["expression"]
    said = []
    session = SiteSession(SITE, config, build_parser().parse_args([]), here=None, say=said.append,
                          gate={"site": SITE, "fault_drills": False})
    assert session.fatal and f"field {field!r}" in session.fatal and session.setup is None
    assert not marker.exists()
    assert any("cannot start" in line for line in said)


def test_a_site_refuses_a_task_whose_token_round_or_weights_are_not_a_servers():
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    ref = net.state_dict()
    good = {k: v.numpy().copy() for k, v in ref.items()}
    assert screen_task({RUN: "fedavg-0123abcd"}, 0, good, ref, "float32") is None
    assert screen_task({RUN: ""}, 0, {}, ref, "float32") is None  # the handshake: no token, no weights yet
    half = {k: v for k, v in good.items() if v.dtype.kind == "f"}  # float16 transfer leaves integer buffers
    assert screen_task({}, 1, half, ref, "float16") is None
    bad = {
        "absolute token": ({RUN: "/tmp/x"}, 0, good, "run token '/tmp/x' is not a plain name"),
        "parent token": ({RUN: ".."}, 0, good, "run token '..' is not a plain name"),
        "nested token": ({RUN: "a/../../b"}, 0, good, "is not a plain name"),
        "token type": ({RUN: ["x"]}, 0, good, "is not a plain name"),
        "round": ({}, -1, good, "round -1 is not a non-negative integer"),
        "nan": ({}, 0, {**good, "0.weight": good["0.weight"] * np.nan}, "non-finite values in 0.weight"),
        "shape": ({}, 0, {**good, "0.weight": good["0.weight"][:1]}, "shape of 0.weight is (1, 3)"),
        "dtype": ({}, 0, {**good, "0.weight": good["0.weight"].astype(str)}, "dtype of 0.weight"),
        "keys": ({}, 0, {**good, "x": good["0.bias"]}, "unknown weight keys ['x']"),
        "missing": ({}, 0, {k: v for k, v in good.items() if k != "0.bias"}, "lack 1 of the network's keys"),
        "missing int": ({}, 0, half, "lack 1 of the network's keys (e.g. '1.num_batches_tracked')"),
    }
    for name, (meta, rnd, params, why) in bad.items():
        assert why in (screen_task(meta, rnd, params, ref, "float32") or ""), name


def test_threads_from_the_server_never_exceed_this_machines_cores(monkeypatch):
    import os

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        size_threads({THREADS: 10**6})
        assert torch.get_num_threads() == (os.cpu_count() or 1)
        torch.set_num_threads(1)
        for bad in ("8", True, -3, 2.5):
            size_threads({THREADS: bad})
            assert torch.get_num_threads() == 1, bad
    finally:
        torch.set_num_threads(before)
