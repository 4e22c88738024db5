"""FLARE glue without the simulator: the run watchdog, hostile replies at the engine, the committed job
folders (drift, configuration, filters) and the site-side refusals. The simulator runs are
tests/simulator/test_flare_runs.py."""

import filecmp
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlabels import methods
from fedlabels.data.synthetic import generate
from fedlabels.flare.commands import write_jobs
from fedlabels.flare.simulator import LOST_SITE, SiteLostAtStartup, run_watched
from fedlabels.flare.job import JOBS
from shared_runs import COVERED_BY, CXR, FEDMIX_RUNS, SEMI_SUPERVISED

REPO = Path(__file__).resolve().parents[2]


def test_run_watched_stops_a_run_that_lost_a_site(tmp_path):
    # The simulator never exits when a site is lost at start-up: the watchdog must stop it at once.
    script = f"import time; print('starting'); print({LOST_SITE!r}, flush=True); time.sleep(120)"
    t0 = time.time()
    with pytest.raises(SiteLostAtStartup, match="lost at start-up"):
        run_watched([sys.executable, "-c", script], None, tmp_path / "lost.log", poll=0.2)
    assert time.time() - t0 < 30
    assert "starting" in (tmp_path / "lost.log").read_text()


def test_run_watched_ignores_what_an_earlier_attempt_logged(tmp_path):
    # simulate() retries into the same log: the earlier attempt's lost-site line must not stop the retry.
    log = tmp_path / "retry.log"
    log.write_text(f"first attempt\n{LOST_SITE}\n[fedlabels] a site was lost at start-up; retry 1 of 1\n")
    assert run_watched([sys.executable, "-c", "import time; time.sleep(1.5)"], None, log, poll=0.2) == 0


def test_run_watched_stops_a_run_whose_site_died_before_its_first_task(tmp_path):
    # The simulator's runner loses a site's worker at start-up ("Connection reset by peer"): the server waits for
    # it for ever, so the watchdog stops the run once the grace has passed. A site that had a task and then
    # died (the fault drill's crash) is the round engine's to survive; a run that ends within the grace ends.
    # As in nvflare's concise console, the task assignments are only in the server's own log.
    server_log = tmp_path / "server-log.txt"
    server_log.write_text("ServerRunner - INFO - [peer=site-4] - assigned task to client site-4: name=train\n")
    died = "2026-11-28 21:33:09,877 - ERROR - Communication error with client site-3: [Errno 104] Connection reset"
    script = f"import time; print({died!r}, flush=True); time.sleep(120)"
    t0 = time.time()
    with pytest.raises(SiteLostAtStartup, match="site-3 died before its first task"):
        run_watched([sys.executable, "-c", script], None, tmp_path / "died.log", poll=0.2, grace=1,
                    server_log=server_log)
    assert time.time() - t0 < 30
    crashed = "import time; print('- ERROR - Subprocess died for client site-4, exit code: 1', flush=True); time.sleep(3)"
    assert run_watched([sys.executable, "-c", crashed], None, tmp_path / "crash.log", poll=0.2, grace=0.5,
                       server_log=server_log) == 0
    ending = f"import time; print({died!r}, flush=True); time.sleep(1)"
    assert run_watched([sys.executable, "-c", ending], None, tmp_path / "end.log", poll=0.2, grace=5,
                       server_log=server_log) == 0
    # without the server's log nothing says whether the site had a task: the run is left alone
    assert run_watched([sys.executable, "-c", f"import time; print({died!r}, flush=True); time.sleep(2)"], None,
                       tmp_path / "blind.log", poll=0.2, grace=0.5) == 0


def test_run_watched_timeout_and_exit_code(tmp_path):
    with pytest.raises(RuntimeError, match="within 1 s"):
        run_watched([sys.executable, "-c", "import time; time.sleep(120)"], None, tmp_path / "slow.log", timeout=1, poll=0.2)
    assert run_watched([sys.executable, "-c", "raise SystemExit(3)"], None, tmp_path / "exit.log", poll=0.2) == 3


@pytest.mark.parametrize("reply, reason", [
    ({"meta": {"n": "many"}}, "case count 'many' is not a positive integer"),
    ({"meta": {"n": [3]}}, "case count [3] is not a positive integer"),
    ({"meta": {"n": 10**9}}, "exceeds the 10 the site can train on"),  # declared 10 cases (2 epochs: n counts one)
    ({"meta": {"n": 3, "extras": [1, 2]}}, "extras are a list"),
    ({"meta": {"n": 3, "abstain": np.array([True, False])}}, None),  # not a real boolean: no abstention
    ({"meta": {"n": 3, "fatal_error": "cannot read my data"}}, "the site cannot run: cannot read my data"),
    ({"meta": {"n": 3}, "metrics": {"val_auroc": "0.99", "train_loss": {"x": 1}}}, None),
])
def test_a_hostile_reply_reaches_the_engine_and_is_dropped_there(reply, reason):
    """The controller's reading of a site's reply (``to_update``, nvflare's own ``FLModel``) converts and
    trusts nothing: the engine screens it. Today ``int(n)`` on a non-number, a non-dict extras or
    metrics and a fatal error in a round each stopped the job."""
    from nvflare.app_common.abstract.fl_model import FLModel

    from fedlabels.engine import RoundEngine
    from fedlabels.flare.controller import case_bounds, to_update
    from fedlabels.methods.fedavg import FedAvgServer

    glob = {"w": np.zeros(2, dtype=np.float32)}
    good = FLModel(params={"w": np.ones(2, dtype=np.float32)}, metrics={"val_auroc": 0.5},
                   meta={"client_name": "site-1", "n": 2})
    meta = {"client_name": "site-2", **reply["meta"]}
    bad = FLModel(params={"w": np.full(2, 5, dtype=np.float32)}, metrics=reply.get("metrics", {}), meta=meta)
    bounds = case_bounds({"site-1": {"cases": 10}, "site-2": {"cases": 10}})
    assert bounds == {"site-1": 10, "site-2": 10}
    logs = []
    eng = RoundEngine(FedAvgServer(), lambda *a: [to_update(good), to_update(bad)], key_metric="val_auroc",
                      max_n=bounds, log=lambda lvl, msg: logs.append(msg))
    out, record, _ = eng.run_round(0, glob, ["site-1", "site-2"])
    json.dumps(record)
    if reason:
        assert reason in record["dropped"]["site-2"], record
        np.testing.assert_array_equal(out["w"], [1, 1])
    else:  # a usable update whatever its odd metrics or flags: weighted 2 and 3
        assert record["dropped"] == {} and record["scored_by"] == ["site-1"], (record, logs)
        np.testing.assert_allclose(out["w"], [(2 * 1 + 3 * 5) / 5] * 2)


def test_job_py_sets_the_site_timeout(tmp_path, capsys):
    """`job.py --site-timeout S` reaches the run configuration the server reads; 0 is refused (the
    server would never wait); unset, the configuration leaves it out (the default)."""
    from fedlabels.flare.job import run_cli

    spec = JOBS["fedavg_cxr"]
    run_cli(spec, ["--out", str(tmp_path / "a"), "--site-timeout", "90"])
    assert json.loads((tmp_path / "a" / spec.name / "app" / "custom" / "fedlabels.json").read_text())[
        "site_timeout"] == 90
    run_cli(spec, ["--out", str(tmp_path / "b")])
    assert "site_timeout" not in json.loads((tmp_path / "b" / spec.name / "app" / "custom" / "fedlabels.json")
                                            .read_text())
    with pytest.raises(SystemExit):
        run_cli(spec, ["--out", str(tmp_path / "c"), "--site-timeout", "0"])
    assert "--site-timeout 0: must be >= 1" in capsys.readouterr().err


def test_privacy_noise_widens_the_case_bound_of_the_sites_that_noised():
    """The bound follows each site's own report (the job's option or the hospital's privacy.json), not
    the job's option: a site that noised under a job without the option is not dropped for it."""
    from fedlabels.flare.controller import case_bounds

    report = {"noise_multiplier": 1.0, "clip": 1.5, "epsilon": 2.0, "delta": 1e-5, "releases": 1}
    assert case_bounds({"a": {"cases": 10, "privacy": report}, "b": {"cases": "x"}, "c": {"cases": 10}}) \
        == {"a": 10 + 9, "c": 10}  # 6 x 1.0 x 1.5 where noised


def test_committed_jobs_match_their_code(tmp_path):
    write_jobs(tmp_path)
    committed = REPO / "nvflare_jobs"
    assert sorted(p.name for p in committed.iterdir()) == sorted(JOBS)
    for name in JOBS:
        cmp = filecmp.dircmp(tmp_path / name, committed / name)
        stack, diffs = [cmp], []
        while stack:
            c = stack.pop()
            diffs += c.diff_files + c.left_only + c.right_only
            stack += c.subdirs.values()
        assert not diffs, f"nvflare_jobs/{name} drifted from fedlabels.flare.job ({diffs}); run `fedlabels jobs`"


def test_every_job_runs_in_the_simulator_or_shares_the_code_of_jobs_that_do():
    """A job is run in the simulator here, in tests/simulator/test_fedmix_flare.py or tests/simulator/test_composed_job.py, or every class its method
    trains and aggregates with runs in the jobs COVERED_BY names, on the same bundle and task."""
    simulated = set(CXR) | {"fedavg_medmnist", "fedavg_lesion"} | set(SEMI_SUPERVISED) | set(FEDMIX_RUNS) \
        | {"composed_mixed"}  # tests/simulator/test_composed_job.py
    assert not simulated & set(COVERED_BY) and simulated | set(COVERED_BY) == set(JOBS)
    for name, covering in COVERED_BY.items():
        spec, others = JOBS[name], [JOBS[c] for c in covering]
        assert set(covering) <= simulated, name
        method = methods.get(spec.method)
        assert method.client in {methods.get(o.method).client for o in others}, name
        assert method.server in {methods.get(o.method).server for o in others}, name
        assert all(o.run.bundle == spec.run.bundle and o.run.data.family == spec.run.data.family for o in others), name
        assert spec.run.data.oracle in {o.run.data.oracle for o in others}, name
        assert method.uses_unlabeled in {methods.get(o.method).uses_unlabeled for o in others}, name


def test_every_embedded_family_has_a_job():
    from fedlabels.data.synthetic import FAMILIES

    assert {spec.run.data.family for spec in JOBS.values()} == set(FAMILIES) == {"cxr", "medmnist", "lesion", "mixed"}


def test_the_loss_and_prototype_drills_are_dropped_by_the_rules_that_read_them():
    """What the ``loss`` and ``prototypes`` drills send, through the controller's reading of a reply and the
    real FedMix and FedMLP server rules: each hostile site is dropped or its prototype refused, with the
    reason, and the honest site's update is aggregated."""
    from nvflare.app_common.abstract.fl_model import FLModel

    from fedlabels.engine import RoundEngine
    from fedlabels.flare.client import inject_fault
    from fedlabels.flare.controller import to_update
    from fedlabels.methods.fedmix import AdaptiveAggServer
    from fedlabels.methods.fedmlp import FedMLPServer

    glob = {"head.weight": np.ones((2, 3), np.float32)}

    def reply(site, faults, metrics, extras=None):
        weights, meta, metrics = inject_fault(faults, site, 0, dict(glob), {"n": 4, "extras": extras or {}},
                                              metrics, say=lambda m: None)
        return to_update(FLModel(params=weights, metrics=metrics, meta={"client_name": site, **meta}))

    fedmix = RoundEngine(AdaptiveAggServer(), lambda *a: [reply("a", [], {"train_loss": 0.4}),
                                                          reply("b", ["b:loss:0"], {"train_loss": 0.4})],
                         key_metric="val_dice")
    _, record, _ = fedmix.run_round(0, glob, ["a", "b"])
    assert "train_loss='1000000.0' is not a Dice loss in [0, 1]" in record["dropped"]["b"]
    assert record["aggregated"] and "a" not in record["dropped"]
    server = FedMLPServer(warmup_rounds=1)
    server.setup({"a": {"labeled_mask": [1, 0], "cases": 4}, "b": {"labeled_mask": [0, 1], "cases": 4}})
    proto = {"prototypes": {"1": [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]}}
    fedmlp = RoundEngine(server, lambda *a: [reply("b", ["b:prototypes:0"], {}, proto),
                                             reply("a", [], {}, {"prototypes": {"0": [[0.0, 1.0, 0.0]] * 2}})],
                         key_metric="val_auroc")
    _, record, _ = fedmlp.run_round(0, glob, ["b", "a"])
    assert any("b: prototype for class '1' dropped: shape (2, 4), expected (2, 3)" in n for n in record["notes"])
    assert sorted(server.prototypes) == [0]


def _client_config(name) -> dict:
    return json.loads((REPO / "nvflare_jobs" / name / "app" / "config" / "config_fed_client.json").read_text())


def _result_filters(config) -> list:
    return [(sorted(entry["tasks"]), f["path"].rsplit(".", 1)[-1], f.get("args", {}))
            for entry in config["task_result_filters"] for f in entry["filters"]]


def test_only_batch_norm_local_jobs_carry_the_exclude_filter_for_every_task():
    """The committed job configs (kept equal to the code by the test above): FedBN's sites remove
    their batch-norm keys from every task's result; every job records its replies last."""
    from fedlabels.bundle import bundle_path, network
    from fedlabels.nets import batchnorm_keys

    tasks = ["submit_model", "train", "validate"]
    for name, spec in JOBS.items():
        filters = _result_filters(_client_config(name))
        assert filters[-1][:2] == (tasks, "SentRecord"), name
        exclude = [f for f in filters if f[1] == "ExcludeVars"]
        if name == "fedbn_cxr":
            bn = batchnorm_keys(network(bundle_path(spec.run.bundle), spec.run.network))
            assert len(bn) > 100 and [(t, f, a["exclude_vars"]) for t, f, a in exclude] == [(tasks, "ExcludeVars",
                                                                                             sorted(bn))]
        else:
            assert not exclude, name
    # the policy, not the method's name, decides: another method's client option fedbn gets it too
    import tempfile

    from fedlabels.flare.job import build_job

    spec = JOBS["surgical_cxr"].replace(client={**JOBS["surgical_cxr"].run.client, "bn_policy": "fedbn"})
    with tempfile.TemporaryDirectory() as tmp:
        build_job(spec, tmp).export_job(tmp)
        config = json.loads((Path(tmp) / spec.name / "app" / "config" / "config_fed_client.json").read_text())
    assert [f[1] for f in _result_filters(config)] == ["ExcludeVars", "SentRecord"]


def test_exclude_filter_removes_exactly_the_batch_norm_keys_from_a_result_and_the_record_shows_it(tmp_path,
                                                                                                   monkeypatch):
    """The fedbn job's own ExcludeVars (built from its committed config) on a real nvflare result,
    as the client script sends it, then the audit record filter after it."""
    from nvflare.apis.dxo import from_shareable
    from nvflare.apis.fl_constant import FLContextKey, ReservedKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.fl_model import FLModel
    from nvflare.app_common.filters import ExcludeVars
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    from fedlabels.bundle import bundle_path, network
    from fedlabels.flare.sent import SentRecord
    from fedlabels.methods.base import to_numpy
    from fedlabels.nets import batchnorm_keys

    net = network(bundle_path(JOBS["fedbn_cxr"].run.bundle))
    state, bn = to_numpy(net.state_dict()), set(batchnorm_keys(net))
    (args,) = [f[2] for f in _result_filters(_client_config("fedbn_cxr")) if f[1] == "ExcludeVars"]
    ctx = FLContext()
    ctx.set_prop(FLContextKey.TASK_NAME, "train", private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-9", private=False, sticky=False)
    monkeypatch.setenv("FEDLABELS_SENT", str(tmp_path))
    with pytest.raises(ValueError, match="stage 'hospital'"):
        SentRecord(stage="hospital")
    for reply in (FLModel(params=dict(state), metrics={"train_loss": 0.5}, meta={"n": 8}, current_round=3),  # train
                  FLModel(params=dict(state))):  # submit_model: the whole state dict
        # nvflare runs the site's scope filters (its privacy.json: its own record) before the job's
        shared = FLModelUtils.to_shareable(reply)
        assert SentRecord(stage="site").process(shared, ctx) is shared
        out = ExcludeVars(**args).process(shared, ctx)
        dxo = from_shareable(out)
        assert set(dxo.data) == set(state) - bn and bn  # exactly the batch norm is gone
        for k, v in dxo.data.items():
            assert v is state[k]  # the rest untouched
    assert dxo.get_filter_history() == ["ExcludeVars"]
    site_record = [json.loads(line) for line in (tmp_path / "site-9.site.jsonl").read_text().splitlines()]
    assert [set(e["weights"]) for e in site_record] == [set(state)] * 2  # before the job's ExcludeVars
    assert [e["round"] for e in site_record] == [3, None]  # the round the reply carries
    assert SentRecord().process(out, ctx) is out
    (line,) = (tmp_path / f"{ctx.get_identity_name()}.jsonl").read_text().splitlines()
    entry = json.loads(line)
    assert set(entry["weights"]) == set(state) - bn
    assert entry["array_bytes"] == sum(v.nbytes for k, v in state.items() if k not in bn)


def test_a_hospital_that_noises_its_summary_does_so_whatever_the_job_says(tmp_path, monkeypatch):
    """A kit whose privacy.json holds its own privacy options (``provision --noise-summary``): the site's
    run configuration takes them in place of the job's (off, or other numbers), its first reply carries the
    noised summary and its report, and the server's case bound follows that report. A bad option names the
    file and field before anything is released; outside a kit nothing changes."""
    from argparse import Namespace

    from fedlabels.config import RunConfig
    from fedlabels.flare.client import prepare, site_privacy
    from fedlabels.flare.controller import case_bounds
    from fedlabels.flare.provision import SITE_NOISE, site_policy

    kit = tmp_path / "site-1"
    here = kit / "job-1" / "app_site-1" / "custom"
    here.mkdir(parents=True)
    (kit / "startup").mkdir()
    (kit / "startup" / "rootCA.pem").write_text("")
    monkeypatch.setenv("FEDLABELS_PRIVACY_LEDGER", str(tmp_path / "ledger.json"))
    data = generate("cxr", tmp_path / "data", seed=0, cases=16, test_cases=4, size=32, sites=2)
    lines = []
    for job_privacy in ({}, {"noise_multiplier": 3.0, "clip": 4.0, "delta": 1e-6}):
        cfg = RunConfig(method="fedavg", bundle="cxr_resnet18", network={"widen_factor": 0.25},
                        privacy=dict(job_privacy))
        site_privacy(cfg, here, lines.append)
        assert cfg.privacy == job_privacy and not lines  # the default policy: the job's choice stands
    site_policy(kit, noise_summary=SITE_NOISE)
    cfg = RunConfig(method="fedavg", bundle="cxr_resnet18", network={"widen_factor": 0.25})
    setup, _ = prepare(cfg, Namespace(data=str(data), device="cpu"), "site-1", here, lines.append)
    assert cfg.privacy == SITE_NOISE and "replaces the job's exact counts" in lines[0]
    summary = setup.summary()
    assert summary["privacy"]["noise_multiplier"] == 1.0 and summary["privacy"]["clip"] == 4.0
    assert case_bounds({"site-1": summary}) == {"site-1": summary["cases"] + 24}
    site_policy(kit, noise_summary={**SITE_NOISE, "delta": 2.0})
    with pytest.raises(ValueError, match=r"local/privacy.json: field 'properties.fedlabels_privacy.delta': "
                                         r"must lie in \(0, 1\)"):
        site_privacy(RunConfig(method="fedavg"), here)
    cfg = RunConfig(method="fedavg")
    site_privacy(cfg, tmp_path / "not-a-kit" / "custom")
    assert cfg.privacy == {}


@pytest.mark.parametrize("bundle", ["cxr_densenet121", "cxr_resnet18", "medmnist_cnn", "lesion_unet"])
def test_the_batch_norm_told_from_names_alone_is_the_networks(bundle):
    """What a hospital's WithholdBatchNorm finds in a reply without the network is what FedBN keeps local."""
    from fedlabels.bundle import bundle_path, network
    from fedlabels.nets import batchnorm_keys, batchnorm_keys_by_name

    net = network(bundle_path(bundle))
    assert sorted(batchnorm_keys_by_name(net.state_dict())) == sorted(batchnorm_keys(net))
    assert batchnorm_keys_by_name(["a.weight", "a.running_var", "b.running_mean_x", "c.running_mean",
                                   "c.weight", "c.bias", "cc.weight", "c.extra"]) == ["c.running_mean", "c.weight",
                                                                                     "c.bias"]


def test_a_hospital_that_withholds_batch_norm_removes_it_from_every_reply_and_refuses_jobs_that_average_it(
        tmp_path):
    """The site's own WithholdBatchNorm (its privacy.json, ``provision --withhold-batchnorm``) on real nvflare
    replies of a FedAvg job (which does not withhold): train and submit_model lose exactly the batch norm,
    a validation reply passes untouched. Such a hospital's client refuses a FedAvg job before round 0 and
    takes a FedBN one."""
    from types import SimpleNamespace

    from nvflare.apis.dxo import from_shareable
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.fl_model import FLModel
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    from fedlabels.bundle import bundle_path, network
    from fedlabels.flare.client import check_site_withholds
    from fedlabels.flare.provision import site_policy
    from fedlabels.flare.withhold import WithholdBatchNorm
    from fedlabels.methods.base import to_numpy
    from fedlabels.nets import batchnorm_keys

    from nvflare.app_common.abstract.fl_model import ParamsType

    net = network(bundle_path("cxr_densenet121"))
    state, bn = to_numpy(net.state_dict()), set(batchnorm_keys(net))
    for reply in (FLModel(params=dict(state), metrics={"train_loss": 0.5}, meta={"n": 8}),  # train
                  FLModel(params=dict(state)),  # submit_model
                  FLModel(params=dict(state), params_type=ParamsType.DIFF, meta={"n": 8})):  # a weight difference
        out = WithholdBatchNorm().process(FLModelUtils.to_shareable(reply), FLContext())
        dxo = from_shareable(out)
        assert set(dxo.data) == set(state) - bn and len(bn) > 100
        assert all(v is state[k] for k, v in dxo.data.items())
        back = FLModelUtils.from_shareable(out)
        assert back.meta.get("n") == reply.meta.get("n") and back.metrics == reply.metrics  # the rest travels
    metrics = FLModelUtils.to_shareable(FLModel(metrics={"val_auroc": 0.7}))
    assert from_shareable(WithholdBatchNorm().process(metrics, FLContext())).data == {"val_auroc": 0.7}

    kit = tmp_path / "hospital-a"  # a provisioned kit: the job's custom folder is <kit>/<job>/app_<site>/custom
    here = kit / "job-1" / "app_hospital-a" / "custom"
    here.mkdir(parents=True)
    (kit / "startup").mkdir()
    (kit / "startup" / "rootCA.pem").write_text("")
    fedavg = SimpleNamespace(net=net, local_keys=[], bn_policy="fedavg")
    fedbn = SimpleNamespace(net=net, local_keys=sorted(bn), bn_policy="fedbn")
    site_policy(kit)  # the default policy: the audit record only
    check_site_withholds(fedavg, here)
    site_policy(kit, withhold_batchnorm=True)
    with pytest.raises(ValueError, match=r"withholds its batch norm .*bn_policy 'fedavg' averages it \(\d+ keys"):
        check_site_withholds(fedavg, here)
    check_site_withholds(fedbn, here)
    check_site_withholds(SimpleNamespace(net=network(bundle_path("medmnist_cnn")), local_keys=[], bn_policy="fedavg"),
                         here)  # a network without batch norm runs as usual
    untracked = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2, track_running_stats=False))
    with pytest.raises(ValueError, match=r"batch norm '1.bias' keeps no running statistics"):
        check_site_withholds(SimpleNamespace(net=untracked, local_keys=["1.weight", "1.bias"], bn_policy="fedbn"), here)


def test_a_site_that_keeps_keys_refuses_a_job_without_their_filter():
    """The ExcludeVars filter is written when the job is built; a bn_policy edited in fedlabels.json
    afterwards would send the batch norm. The site compares them before round 0."""
    from types import SimpleNamespace

    from fedlabels.flare.client import check_local_keys

    bn = {"features.norm0.weight", "features.norm0.bias"}
    site = SimpleNamespace(local_keys=bn, bn_policy="fedbn")
    check_local_keys(site, REPO / "nvflare_jobs" / "fedbn_cxr" / "app" / "custom")  # the filter covers them
    with pytest.raises(ValueError, match=r"fedavg_cxr/app/config/config_fed_client.json: task_result_filters: "
                                         r"no ExcludeVars filter for 2 keys"):
        check_local_keys(site, REPO / "nvflare_jobs" / "fedavg_cxr" / "app" / "custom")
    check_local_keys(SimpleNamespace(local_keys=set(), bn_policy="fedavg"),
                     REPO / "nvflare_jobs" / "fedavg_cxr" / "app" / "custom")


def test_production_jobs_carry_configuration_only_and_name_only_allowed_classes(tmp_path):
    """``job.py --prod`` submits the production form (``build_job(installed=True)``): no custom folder
    (nvflare counts any as custom code, which a --no-byoc hospital refuses), no MONAI expression, and only
    classes that a provisioned kit's class allow list admits (exactly ``gate.ALLOWED``); every client
    configuration but the upper bounds' (``oracle``) passes the hospital's gate."""
    from fedlabels.flare.gate import ALLOWED, GateError, check_client_config
    from fedlabels.flare.job import export

    allowed, used = list(ALLOWED), set()
    specs = [*JOBS.values(), JOBS["fedbn_cxr"].replace(name="fedbn_half", transfer="float16")]
    for spec in specs:
        folder = export(spec, tmp_path, installed=True)
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        assert files == ["app/config/config_fed_client.json", "app/config/config_fed_server.json", "meta.json"], files
        text = "".join((folder / f).read_text() for f in files)
        paths = re.findall(r'"path": "([^"]+)"', text)
        assert "fedlabels.flare.executor.SiteExecutor" in paths and "fedlabels.flare.controller.FedLabelsController" in paths
        refused = [p for p in paths if not any(p == a or p.startswith(a.rstrip(".") + ".") for a in allowed)]
        assert not refused, (spec.name, refused)
        used |= {a for a in ALLOWED for p in paths if p == a or p.startswith(a + ".")}
        configs = "".join((folder / f).read_text() for f in files if f.startswith("app/"))
        assert not re.search(r'"[$@%]', configs), spec.name  # no MONAI expression or reference travels with the job
        client = json.loads((folder / "app/config/config_fed_client.json").read_text())
        assert client["executors"][0]["executor"]["args"]["config"] == spec.run.to_json()
        if spec.run.data.oracle:
            with pytest.raises(GateError, match="data.oracle"):
                check_client_config(client, "site-1")
        else:
            check_client_config(client, "site-1")
    assert used == set(ALLOWED)  # the kits allow nothing a production job does not name


def test_a_job_made_from_a_shipped_one_changes_only_itself():
    """``JobSpec.replace`` routes each change to the job, its run or the run's data section by name, and the
    copy holds its own option dicts: changing them leaves the shipped job as it was."""
    shipped = JOBS["fedprox_cxr"]
    mine = shipped.replace(name="mine", rounds=3, seed=7, batch_size=4, synth={"cases": 9})
    assert (mine.name, mine.rounds, mine.run.seed, mine.run.data.batch_size, mine.run.data.synth) == \
        ("mine", 3, 7, 4, {"cases": 9})
    mine.run.client["mu"] = 0.5
    mine.run.data.synth["size"] = 8
    assert shipped.run.client["mu"] == 0.001 and shipped.run.data.synth == {} and shipped.rounds == 20
    with pytest.raises(ValueError, match=r"no field \['preset'\]"):
        shipped.replace(preset="isofed")  # a preset's options are merged by job(), once
