"""The ``fedlabels`` command on a malformed scenario: one line, no traceback, no training.

Every command that reads a scenario folder validates it with
``profile.load_scenario`` before any model code runs. Most commands run in this
process through ``cli.main`` (its output captured; an exception escaping it counts as
a traceback); two run as real subprocesses, at once, to show that the console entry
point prints no traceback either: ``train`` (the light parser) and ``simulate`` (the
FLARE parser). A ``simulate`` that fails in the real simulator is
tests/simulator/test_cli_simulate.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedlabels import cli
from fedlabels.data.synthetic import generate
from fedlabels.profile import ScenarioError
from helpers import cli_in_repo as _in_process, one_error_line as _one_error_line

REPO = Path(__file__).resolve().parents[2]
BAD_FILE = str(Path("site-2") / "datalist.json")


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """A valid scenario, one whose site-2 has a label list one entry short, one with unparsable YAML."""
    root = tmp_path_factory.mktemp("cli")
    good = generate("cxr", root / "good", seed=0, cases=8, test_cases=4)
    short = root / "short-label"
    shutil.copytree(good, short)
    path = short / "site-2" / "datalist.json"
    datalist = json.loads(path.read_text())
    datalist["training"][0]["label"] = datalist["training"][0]["label"][:-1]
    path.write_text(json.dumps(datalist))
    bad_yaml = root / "bad-yaml"
    shutil.copytree(good, bad_yaml)
    (bad_yaml / "site-3" / "profile.yaml").write_text("site: site-3\nannotated: [atelectasis, nodule\ntask: multilabel\n")
    return {"root": root, "good": good, "short": short, "yaml": bad_yaml}


def _commands(root: Path, data: Path) -> dict:
    job = sorted(p.name for p in (REPO / "nvflare_jobs").iterdir() if (p / "job.py").is_file())[0]
    return {
        "train": ["train", "--bundle", "cxr_resnet18", "--data", data, "--out", root / "train-out"],
        "train-site": ["train", "--bundle", "cxr_resnet18", "--data", data, "--site", "site-1", "--out", root / "train-site-out"],
        "evaluate": ["evaluate", "--bundle", "cxr_resnet18", "--ckpt", root / "no-such.pt", "--data", data],
        "baseline-local": ["baseline", "local", "--bundle", "cxr_resnet18", "--data", data, "--epochs", "1"],
        "baseline-centralized": ["baseline", "centralized", "--bundle", "cxr_resnet18", "--data", data, "--epochs", "1"],
        "baseline-oracle": ["baseline", "oracle", "--bundle", "cxr_resnet18", "--data", data, "--epochs", "1"],
        "simulate": ["simulate", job, "--data", data, "-n", "4", "--rounds", "1", "-w", root / "simulate-ws"],
        "report": ["report", f"x={root / 'no-run'}", "--bundle", "cxr_resnet18", "--data", data],
        "validate": ["validate", data],
    }


# the commands that run as real subprocesses
SUBPROCESS = ("short/train", "short/simulate")


def _run_all(argvs: dict) -> dict:
    """name -> (rc, stdout, stderr): the SUBPROCESS entries as subprocesses (started first, at once), the
    others in this process meanwhile."""
    results = _launch({name: argv for name, argv in argvs.items() if name in SUBPROCESS}, wait=False)
    for name, argv in argvs.items():
        if name not in SUBPROCESS:
            results[name] = _in_process(argv)
    return {name: r() if callable(r) else r for name, r in results.items()}


def _launch(argvs: dict, wait=True) -> dict:
    """Run ``python -m fedlabels.cli ARGV`` for every entry at once; name -> (rc, stdout, stderr)
    (``wait=False``: name -> a function that waits for it and returns them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "fedlabels.cli", *map(str, argv)], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, argv in argvs.items()
    }

    def result(proc):
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return proc.returncode, out, err

    if not wait:
        return {name: (lambda p=proc: result(p)) for name, proc in procs.items()}
    return {name: result(proc) for name, proc in procs.items()}


@pytest.fixture(scope="module")
def runs(scenarios):
    root = scenarios["root"]
    argvs = {f"short/{k}": v for k, v in _commands(root / "short-runs", scenarios["short"]).items()}
    argvs["yaml/train"] = _commands(root / "yaml-runs", scenarios["yaml"])["train"]
    return _run_all(argvs)


@pytest.mark.parametrize("command", list(_commands(Path("x"), Path("x"))))
def test_malformed_scenario_is_one_line_naming_file_and_field(command, runs, scenarios):
    line = _one_error_line(runs[f"short/{command}"])
    assert line.startswith("fedlabels: invalid scenario: ")
    assert str(scenarios["short"] / BAD_FILE) in line
    assert "item training[0]" in line and "field 'label'" in line and "expected a list of 6 entries" in line
    rc, out, _ = runs[f"short/{command}"]
    assert rc == 2 and "checkpoint" not in out
    assert not (scenarios["root"] / "short-runs").exists(), "a command wrote output before failing"


def test_multiline_yaml_error_is_printed_on_one_line(runs, scenarios):
    line = _one_error_line(runs["yaml/train"])
    assert str(scenarios["yaml"] / "site-3" / "profile.yaml") in line and "not valid YAML" in line


def test_check_scenario_only_for_commands_with_data(scenarios):
    parse = lambda *a: cli.build_parser(flare=False).parse_args([str(x) for x in a])  # noqa: E731
    with pytest.raises(ScenarioError, match="field 'label'"):
        cli.check_scenario(parse("baseline", "local", "--data", scenarios["short"]))
    cli.check_scenario(parse("baseline", "local", "--data", scenarios["good"]))
    cli.check_scenario(parse("export", "--bundle", "b", "--ckpt", "c", "--out", "o"))  # reads no scenario


def test_flare_commands_are_registered_only_when_needed():
    assert cli._needs_flare([]) == cli._needs_flare(["--help"]) == cli.LISTING and cli._needs_flare(["simulate", "x"])
    assert not cli._needs_flare(["train", "--data", "d"]) and not cli._needs_flare(["validate", "d"])
    light = cli.build_parser(flare=False)
    choices = next(a for a in light._actions if a.dest == "command").choices
    assert "train" in choices and not set(cli.FLARE_COMMANDS) & set(choices)


def test_the_help_listing_names_every_flare_command_as_it_registers_itself():
    """``fedlabels --help`` lists the FLARE subcommands from cli.FLARE_HELP (no FLARE import): the same names
    and help lines as flare/commands.py registers, in its order; the listing imports neither FLARE nor MONAI."""
    def listed(parser):
        action = next(a for a in parser._actions if a.dest == "command")
        return [(a.dest, a.help) for a in action._choices_actions]

    light = {name for name, _ in listed(cli.build_parser(flare=False))}
    real = [(n, h) for n, h in listed(cli.build_parser(flare=True)) if n not in light]
    assert real == list(cli.FLARE_HELP.items())
    assert listed(cli.build_parser(flare=cli.LISTING)) == listed(cli.build_parser(flare=True))
    code = ("import sys, contextlib, io\nfrom fedlabels import cli\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n    try:\n        cli.main(['--help'])\n"
            "    except SystemExit:\n        pass\n"
            "assert 'kit-policy' in out.getvalue() and 'simulate' in out.getvalue(), out.getvalue()\n"
            "print(sorted(m for m in ('nvflare', 'monai', 'torch') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_scenario_error_wrapped_by_a_library_is_found():
    inner = ScenarioError("site-2/datalist.json", "no labeled cases", field="training")
    try:
        try:
            raise inner
        except ScenarioError as e:
            raise RuntimeError("Failed to evaluate ConfigExpression") from e
    except RuntimeError as outer:
        assert cli._scenario_error(outer) is inner
    assert cli._scenario_error(RuntimeError("unrelated")) is None


def test_train_bundle_validates_before_monai(scenarios, tmp_path):
    from fedlabels.bundle.workflows import train_bundle

    with pytest.raises(ScenarioError, match="field 'label'"):
        train_bundle("cxr_resnet18", scenarios["short"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_worker_processes_and_site_count_are_one_line_before_anything_runs(tmp_path):
    ws, out = tmp_path / "ws", tmp_path / "synth"
    results = _run_all({
        "threads": ["simulate", "fedavg_cxr", "-n", "2", "-t", "3", "--rounds", "1", "-w", ws],
        "sites": ["synth", "cxr", "--sites", "0", "--out", out],
        "missing": ["synth", "lesion", "--missing", "1", "--out", out],
        "cover": ["synth", "cxr", "--missing", "5", "--out", out],
    })
    assert "--threads must be between 1 and the number of sites (2), not 3" in _one_error_line(results["threads"])
    assert "--sites must be >= 1, not 0" in _one_error_line(results["sites"])
    assert "--missing applies to the cxr family, not lesion" in _one_error_line(results["missing"])
    assert "4 sites annotating 1 class each cannot cover all 6 classes" in _one_error_line(results["cover"])
    assert not ws.exists() and not out.exists()


def test_bad_provisioning_arguments_are_one_line_before_anything_is_written(tmp_path):
    base = ["provision", "--project", "study", "--server", "localhost", "--admin", "admin@example.org"]
    results = _run_all({
        "twice": base + ["--sites", "hospital-a,hospital-a", "--out", tmp_path / "twice"],
        "name": base[:-2] + ["--admin", "not-an-email", "--sites", "hospital-a", "--out", tmp_path / "name"],
        "ports": base + ["--sites", "hospital-a", "--fl-port", "8002", "--admin-port", "8002", "--out", tmp_path / "ports"],
    })
    assert "--sites: ['hospital-a'] named twice" in _one_error_line(results["twice"])
    assert "--admin 'not-an-email'" in _one_error_line(results["name"])
    assert "--fl-port and --admin-port are both 8002" in _one_error_line(results["ports"])
    assert not any((tmp_path / name).exists() for name in results)


def test_validate_one_hospitals_folder(tmp_path):
    full = generate("cxr", tmp_path / "full", seed=0, cases=8, test_cases=4, sites=2)
    hospital = tmp_path / "hospital"
    hospital.mkdir()
    shutil.copy(full / "scenario.yaml", hospital)
    shutil.copytree(full / "site-2", hospital / "site-2")
    assert cli.main(["validate", str(hospital), "--site", "site-2"]) == 0
    assert cli.main(["validate", str(hospital)]) == 2  # the whole scenario: site-1 and test are not here


def _small_run(tmp_path: Path) -> Path:
    """A seeded ResNet-18 checkpoint (width 0.25) at ``tmp_path/m.pt`` and a run folder whose fedlabels.json
    says how it was trained (32 px); returns the run folder."""
    import torch

    from fedlabels.config import RunConfig
    from fedlabels.nets import ResNet18Classifier

    torch.manual_seed(0)
    torch.save(ResNet18Classifier(in_channels=1, out_channels=6, widen_factor=0.25).state_dict(), tmp_path / "m.pt")
    run = tmp_path / "run"
    RunConfig("fedavg", bundle="cxr_resnet18", network={"widen_factor": 0.25},
              data={"image_size": 32}).save(run / "app_server" / "custom" / "fedlabels.json")
    return run


def test_export_on_a_hospitals_own_folder(tmp_path, capsys):
    """``export --data`` on a folder holding one site and no test split: thresholds from that site's
    validation cases, no test metrics (the model card says so). A folder that is no scenario, or a
    --run that is no run, is one line and writes nothing."""
    full = generate("cxr", tmp_path / "full", seed=0, cases=24, test_cases=4, size=32, sites=2)
    hospital = tmp_path / "hospital"
    hospital.mkdir()
    shutil.copy(full / "scenario.yaml", hospital)
    shutil.copytree(full / "site-2", hospital / "site-2")
    run = _small_run(tmp_path)
    out = tmp_path / "bundle"
    assert cli.main(["export", "--bundle", "cxr_resnet18", "--ckpt", str(tmp_path / "m.pt"), "--run", str(run),
                     "--data", str(hospital), "--out", str(out)]) == 0
    meta = json.loads((out / "configs" / "metadata.json").read_text())
    assert meta["training"]["validation_sites"] == ["site-2"] and list(meta["training"]["label_table"]) == ["site-2"]
    assert meta["test_metrics"] is None and set(meta["decision_thresholds"]) == set(meta["class_names"])
    assert "Not evaluated on a held-out test set" in (out / "docs" / "README.md").read_text()
    capsys.readouterr()
    for args, expected in (
        (["--ckpt", str(tmp_path / "m.pt"), "--data", str(tmp_path)], "scenario.yaml"),
        (["--run", str(tmp_path)], "not a fedlabels run's server folder"),
    ):
        assert cli.main(["export", "--bundle", "cxr_resnet18", *args, "--out", str(tmp_path / "no")]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and expected in err[0], err
        assert not (tmp_path / "no").exists()


def test_export_twin_first_and_mean_and_a_single_network_refused(tmp_path, capsys):
    """``export --twin``: a FedMix checkpoint ships F1 as the plain UNet (default) or both networks
    averaged; ``--twin mean`` on a one-network checkpoint is one line and writes nothing."""
    import torch

    from fedlabels.nets import GroupNormUNet, TwinUNet

    torch.manual_seed(0)
    twin = TwinUNet()
    torch.save(twin.state_dict(), tmp_path / "twin.pt")
    torch.save(GroupNormUNet().state_dict(), tmp_path / "one.pt")
    assert cli.main(["export", "--bundle", "lesion_unet", "--ckpt", str(tmp_path / "twin.pt"), "--out",
                     str(tmp_path / "first")]) == 0
    shipped = torch.load(tmp_path / "first" / "models" / "model.pt", weights_only=True)
    assert all(torch.equal(v, twin.f1.state_dict()[k]) for k, v in shipped.items()) and len(shipped) == len(
        twin.f1.state_dict())
    assert cli.main(["export", "--bundle", "lesion_unet", "--ckpt", str(tmp_path / "twin.pt"), "--twin", "mean",
                     "--out", str(tmp_path / "mean")]) == 0
    ts = torch.jit.load(str(tmp_path / "mean" / "models" / "model.ts"))
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        twin.eval()
        want = torch.logit((torch.sigmoid(twin.f1(x)) + torch.sigmoid(twin.f2(x))) / 2, eps=1e-6)
        assert torch.allclose(ts(x), want, atol=1e-5)
    capsys.readouterr()
    assert cli.main(["export", "--bundle", "lesion_unet", "--ckpt", str(tmp_path / "one.pt"), "--twin", "mean",
                     "--out", str(tmp_path / "no")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "needs a FedMix model" in err[0] and not (tmp_path / "no").exists()


def test_provisioning_gives_each_hospital_its_admin_its_byoc_policy_and_guards_the_ca(tmp_path):
    """Each hospital gets its own org admin (role org_admin, its own org); a --no-byoc site's
    local/authorization.json refuses custom code for every role, the others keep nvflare's default; every
    hospital's local/privacy.json runs its own audit record on every job, a --withhold-batchnorm site's
    after removing batch norm, and a --noise-summary site's holds its own privacy options; the root
    CA's private key is readable by its owner only; a .gitignore covers the whole provisioning folder."""
    import stat

    out = tmp_path / "prov"
    assert cli.main(["provision", "--project", "study", "--server", "localhost", "--admin", "admin@example.org",
                     "--sites", "hospital-a,hospital-b", "--org-admin", "hospital-a=it@a.example.org",
                     "--no-byoc", "hospital-b", "--withhold-batchnorm", "hospital-a", "--noise-summary", "hospital-b",
                     "--own-operation", "hospital-a", "--fault-drills", "hospital-b",
                     "--server-storage", "/srv/fedlabels", "--out", str(out)]) == 0
    spec = yaml.safe_load((out / "project.yml").read_text())
    admins = {p["name"]: (p["org"], p["role"]) for p in spec["participants"] if p["type"] == "admin"}
    assert admins == {"admin@example.org": ("fedlabels", "project_admin"),
                      "it@a.example.org": ("hospital_a", "org_admin"),
                      "hospital-b-admin@example.org": ("hospital_b", "org_admin")}
    prod = out / "study" / "prod_00"
    assert all((prod / name / "startup").is_dir() for name in admins)  # one admin kit each
    policy = json.loads((prod / "hospital-b" / "local" / "authorization.json").read_text())["permissions"]
    assert {role: rights["byoc"] for role, rights in policy.items() if "byoc" in rights} == \
        {"project_admin": "none", "org_admin": "none", "lead": "none", "member": "none"}
    assert policy["project_admin"]["submit_job"] == "any"  # only custom code is refused
    # hospital-a: only its own admins operate it or run shell commands there; custom code as nvflare's default
    own = json.loads((prod / "hospital-a" / "local" / "authorization.json").read_text())["permissions"]
    default = json.loads((prod / "hospital-a" / "local" / "authorization.json.default").read_text())["permissions"]
    assert {role: (rights.get("operate"), rights.get("shell_commands")) for role, rights in own.items()} == \
        {"project_admin": ("o:site", "o:site"), "org_admin": ("o:site", "o:site"), "lead": ("o:site", "o:site"),
         "member": (None, None)}
    assert {role: rights.get("byoc") for role, rights in own.items()} == \
        {"project_admin": "any", **{r: v.get("byoc") for r, v in default.items() if isinstance(v, dict)}}
    assert policy["project_admin"]["operate"] == "any"  # hospital-b did not ask for it
    record = {"path": "fedlabels.flare.sent.SentRecord", "args": {"stage": "site"}}
    withhold = {"path": "fedlabels.flare.withhold.WithholdBatchNorm", "args": {}}
    for site, filters in (("hospital-a", [withhold, record]), ("hospital-b", [record])):
        # every hospital's own audit record in its default privacy scope, after hospital-a's batch-norm rule
        scope = json.loads((prod / site / "local" / "privacy.json").read_text())
        assert scope["default_scope"] == "fedlabels" and [s["name"] for s in scope["scopes"]] == ["fedlabels"]
        assert scope["scopes"][0]["task_result_filters"] == filters
        assert scope["scopes"][0].get("properties") == ({"fedlabels_privacy": {"noise_multiplier": 1.0, "clip": 4.0,
                                                                               "delta": 1e-05}}
                                                        if site == "hospital-b" else None)
    assert not (prod / "localhost" / "local" / "privacy.json").exists()
    from fedlabels.flare.gate import ALLOWED

    for site in ("hospital-a", "hospital-b"):  # least privilege: our classes only, the gate, no log streaming
        resources = json.loads((prod / site / "local" / "resources.json").read_text())
        assert resources["class_allow_list"] == list(ALLOWED) and resources["class_list_enforcement_mode"] == "enforce"
        assert resources["allow_log_streaming"] is False
        assert resources["app_validator"] == {"path": "fedlabels.flare.gate.JobGate",
                                              "args": {"site": site, "fault_drills": site == "hospital-b"}}
    resources = json.loads((prod / "localhost" / "local" / "resources.json").read_text())  # --server-storage
    assert resources["class_allow_list"] == list(ALLOWED) and "app_validator" not in resources
    assert resources["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"] == "/srv/fedlabels/snapshot-storage"
    assert [c["args"]["uri_root"] for c in resources["components"] if c["id"] == "job_manager"] == \
        ["/srv/fedlabels/jobs-storage"]
    assert stat.S_IMODE((out / "study" / "state" / "cert.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "study" / "state").stat().st_mode) == 0o700
    assert (out / ".gitignore").read_text().splitlines()[-1] == "*"
    bad = _run_all({
        "org": ["provision", "--project", "s", "--server", "localhost", "--admin", "admin@example.org",
                "--sites", "hospital-a", "--org-admin", "hospital-z=x@example.org", "--out", tmp_path / "org"],
        "byoc": ["provision", "--project", "s", "--server", "localhost", "--admin", "admin@example.org",
                 "--sites", "hospital-a", "--no-byoc", "hospital-z", "--out", tmp_path / "byoc"],
        "storage": ["provision", "--project", "s", "--server", "localhost", "--admin", "admin@example.org",
                    "--sites", "hospital-a", "--server-storage", "store", "--out", tmp_path / "storage"],
    })
    assert "--org-admin hospital-z=...: 'hospital-z' is not one of --sites" in _one_error_line(bad["org"])
    assert "--no-byoc 'hospital-z': not one of --sites" in _one_error_line(bad["byoc"])
    assert "--server-storage 'store': give an absolute path" in _one_error_line(bad["storage"])
    assert not any((tmp_path / name).exists() for name in bad)


def test_job_py_writes_its_folder_with_out_and_explains_export(tmp_path):
    """nvflare 2.9 removes --export from sys.argv when nvflare.recipe is imported, so job.py writes its
    folder with --out; --export gets one line saying so (both as a user runs them: a script, a subprocess)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "custom"), os.environ.get("PYTHONPATH", "")]))
    job = str(REPO / "nvflare_jobs" / "fedavg_cxr" / "job.py")
    procs = {flag: subprocess.Popen([sys.executable, job, flag, str(tmp_path / flag.strip("-")), "--rounds", "3"],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for flag in ("--out", "--export")}
    out, err = (p.communicate(timeout=300) for p in procs.values())
    assert procs["--out"].returncode == 0, out[1][-2000:]
    server = json.loads((tmp_path / "out" / "fedavg_cxr" / "app" / "config" / "config_fed_server.json").read_text())
    assert server["workflows"][0]["args"]["num_rounds"] == 3
    assert procs["--export"].returncode == 2 and "write the job folder with --out DIR" in err[1]
    assert "Traceback" not in err[1] and not (tmp_path / "export").exists()


def _tree(root: Path) -> dict:
    """Every path under ``root`` with its bytes (folders: None) and mode: what "left as it was" means."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes(), p.stat().st_mode)
            for p in sorted(root.rglob("*"))}


FOREIGN = "{out}"
WRITERS = {
    "synth": ["synth", "cxr", "--out", FOREIGN],
    "prepare": ["prepare", "nih", "--src", "nowhere", "--protocol", "fedpsl-6", "--out", FOREIGN],
    "bench": ["bench", "--data", "embedded:cxr", "--methods", "fedavg", "--rounds", "1", "--out", FOREIGN],
    "simulate": ["simulate", "fedavg_cxr", "-w", FOREIGN],
    "provision": ["provision", "--project", "p", "--server", "localhost", "--sites", "a,b", "--admin", "a@b.c",
                  "--out", FOREIGN],
    "demo": ["demo", "--out", FOREIGN],
}


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_a_command_never_writes_into_a_folder_it_did_not_write(command, tmp_path, capsys):
    """`fedlabels export --out .` replaced the working folder whole. Every command that writes a folder
    refuses a non-empty one that holds no earlier output of its own, exits non-zero with one line naming
    the folder, and leaves it byte-identical; --force allows it."""
    folder = tmp_path / "my notes"
    (folder / "sub").mkdir(parents=True)
    (folder / "patients.csv").write_text("id,name\n1,x\n")
    (folder / "sub" / "scan.png").write_bytes(bytes(range(256)))
    before = _tree(folder)
    argv = [a.replace(FOREIGN, str(folder)) for a in WRITERS[command]]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fedlabels: {folder}: --") and "not empty and not an earlier" in err and "--force" in err
    assert len(err.splitlines()) == 1
    assert _tree(folder) == before
    assert not [p for p in tmp_path.iterdir() if p.name != "my notes"]  # nothing written beside it either


def test_export_refuses_a_folder_it_did_not_write_and_replaces_an_earlier_export(tmp_path, capsys):
    """The export of a real checkpoint into a folder of other files: refused, byte-identical (today it
    was replaced whole); with --force it is written; an earlier export is replaced without --force."""
    run = _small_run(tmp_path)
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    before = _tree(folder)
    argv = ["export", "--bundle", "cxr_resnet18", "--ckpt", str(tmp_path / "m.pt"), "--run", str(run),
            "--out", str(folder)]
    assert cli.main(argv) == 2
    assert "not an earlier exported bundle" in capsys.readouterr().err
    assert _tree(folder) == before
    assert cli.main(argv + ["--force"]) == 0
    assert (folder / "configs" / "metadata.json").is_file() and not (folder / "notes.txt").exists()
    assert cli.main(argv) == 0  # an earlier export: replaced


def test_job_folders_are_replaced_only_when_they_are_job_folders(tmp_path):
    from fedlabels.flare.job import JOBS, export

    target = tmp_path / "fedavg_cxr"
    target.mkdir()
    (target / "mine.txt").write_text("x")
    with pytest.raises(ValueError, match="not an earlier FLARE job folder"):
        export(JOBS["fedavg_cxr"], tmp_path)
    assert [p.name for p in target.iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("argv, option", [
    (["simulate", "fedavg_cxr", "-n", "0"], "-n/--sites"),
    (["simulate", "fedavg_cxr", "--rounds", "0"], "--rounds"),
    (["simulate", "fedavg_cxr", "-t", "0"], "-t/--threads"),
    (["synth", "cxr", "--cases", "0"], "--cases"),
    (["demo", "--rounds", "0"], "--rounds"),
    (["demo", "--cases", "0"], "--cases"),
])
def test_a_count_of_zero_is_an_error_not_the_default(argv, option, tmp_path, capsys):
    """`--rounds 0` fell through `if args.rounds:` to the job's default rounds; each count is >= 1."""
    out = ["-w" if argv[0] == "simulate" else "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        cli.main(argv + out)
    assert e.value.code == 2
    assert f"argument {option}: must be >= 1, not 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_job_with_fewer_sites_than_its_method_needs_is_refused_before_it_runs(tmp_path, capsys):
    """RSCFed draws subsets of subset_size (3) distinct sites: with 2 the server stopped the job at its
    handshake, after the deployment had started (found running every shipped job in POC mode). Both
    entry points refuse it before anything is written; 3 sites, or a smaller subset_size, pass."""
    from fedlabels.flare.job import JOBS, check_sites

    code = cli.main(["simulate", "rscfed_medmnist", "-n", "2", "-w", str(tmp_path / "sim")])
    err = capsys.readouterr().err
    assert code != 0 and "rscfed_medmnist (rscfed, server options its defaults) needs at least 3 sites, not 2" in err
    assert len(err.strip().splitlines()) == 1
    out = subprocess.run([sys.executable, str(REPO / "nvflare_jobs" / "rscfed_medmnist" / "job.py"), "--out",
                          str(tmp_path / "job"), "-n", "2"], capture_output=True, text=True)
    assert out.returncode == 2 and "error: rscfed_medmnist" in out.stderr and "needs at least 3 sites, not 2" in out.stderr
    assert not (tmp_path / "sim").exists() and not (tmp_path / "job").exists()
    check_sites(JOBS["rscfed_medmnist"].replace(sites=3))
    check_sites(JOBS["rscfed_medmnist"].replace(sites=2, server={**JOBS["rscfed_medmnist"].run.server, "subset_size": 2}))


def test_report_scores_the_network_the_run_trained(tmp_path, capsys):
    """A run of the ResNet-18 bundle (a quarter as wide, 32 px): `report` without --bundle builds that
    network from the run's fedlabels.json; it used to build DenseNet121, which cannot take the weights."""
    import torch

    from fedlabels.config import RunConfig
    from fedlabels.nets import ResNet18Classifier

    data = generate("cxr", tmp_path / "data", seed=0, cases=8, test_cases=8, size=32, sites=2)
    run = tmp_path / "run"
    RunConfig("fedavg", bundle="cxr_resnet18", network={"widen_factor": 0.25},
              data={"image_size": 32}).save(run / "app_server" / "custom" / "fedlabels.json")
    torch.manual_seed(0)
    net = ResNet18Classifier(in_channels=1, out_channels=6, widen_factor=0.25)
    torch.save({"model": net.state_dict()}, run / "app_server" / "best_FL_global_model.pt")
    assert cli.main(["report", f"r={run}", "--data", str(data)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0] == "| class | sites labeling it | r |" and "**mean**" in table, table


def test_synth_cases_is_what_its_help_says(tmp_path, capsys):
    """`synth cxr --cases 30`: a reference site of 30 cases, the others scaled as the help says (30/18/48/24)."""
    from fedlabels.data.synthetic import CXR_SITE_SCALE
    from fedlabels.profile import load_scenario

    assert cli.CXR_SCALES == ", ".join(f"{s:g}" for s in CXR_SITE_SCALE)
    synth = next(a for a in cli.build_parser(flare=False)._actions if a.dest == "command").choices["synth"]
    said = next(a for a in synth._actions if a.dest == "cases").help
    assert "reference site" in said and f"s = {cli.CXR_SCALES}" in said
    assert cli.main(["synth", "cxr", "--out", str(tmp_path / "d"), "--cases", "30", "--size", "16",
                     "--test-cases", "8"]) == 0
    sites = load_scenario(tmp_path / "d").sites
    assert [len(s.training) + len(s.validation) for s in sites.values()] == \
        [round(s * 30) for s in CXR_SITE_SCALE] == [30, 18, 48, 24]
