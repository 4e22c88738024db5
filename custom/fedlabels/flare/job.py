"""Build a FLARE job for any method x bundle with the nvflare Job API.

A job differs from another only in its arguments: the server runs
``FedLabelsController`` with the method's name and options, every site runs
``fedlabels.flare.client`` through the Client API, the bundle travels inside
the job (``app/custom/<bundle>``) so sites read the same network and
transforms, and the global model is persisted by nvflare's ``PTModel``.
A site's replies pass nvflare result filters: ``ExcludeVars`` removes the keys
its batch-norm policy keeps local (fedbn, fedbn+), and ``SentRecord``, last,
writes the audit record of what leaves.

The committed folders under ``nvflare_jobs/`` are exported from here
(``fedlabels jobs``); a test fails when they drift.
"""

from __future__ import annotations

import shutil
import tempfile
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from nvflare.app_common.executors.client_api_executor import ClientAPIExecutor
from nvflare.app_common.filters import ExcludeVars
from nvflare.app_opt.pt.job_config.model import PTModel
from nvflare.client.config import ExchangeFormat
from nvflare.job_config.api import FedJob
from nvflare.job_config.defs import FilterType

from .. import methods
from ..config import DEFAULT_SITE_TIMEOUT, FILE, TRANSFERS, DataSpec, RunConfig
from ..bundle import bundle_path, network
from ..methods.base import local_keys
from .controller import TASKS, FedLabelsController
from .sent import SentRecord

SHIM = Path(__file__).with_name("client_script.py")


@dataclass(frozen=True)
class JobSpec:
    """A job: its name, the run it trains (``RunConfig``: method, options, bundle, data), how many sites and
    rounds, and how the simulator runs its sites."""

    name: str
    run: RunConfig
    sites: int = 4
    rounds: int = 20
    resume_from: str = ""           # a previous run's server folder: continue from its last round
    external_process: bool = False  # the client script in a process of its own (the simulator form only)
    bundle_dir: str = ""            # the bundle folder the simulator form carries ("": the run's bundle by name)

    @property
    def method(self) -> str:
        return self.run.method

    def replace(self, **changes) -> "JobSpec":
        """A copy with ``changes``, each to the job's, the run's or its data section's field of that name
        (a preset's settings are merged once, by ``job``: name a preset there, not here)."""
        own = {f.name for f in dataclasses.fields(self)} - {"run"}
        data_fields = {f.name for f in dataclasses.fields(DataSpec)} - {"preset"}
        run_fields = {f.name for f in dataclasses.fields(RunConfig)} - {"data"}
        unknown = sorted(set(changes) - own - data_fields - run_fields)
        if unknown:
            raise ValueError(f"JobSpec.replace: no field {unknown} (the job's: {sorted(own)}, the run's: "
                             f"{sorted(run_fields)}, its data's: {sorted(data_fields)})")
        data = dataclasses.replace(self.run.data, **{k: v for k, v in changes.items() if k in data_fields})
        run = dataclasses.replace(self.run, data=data, **{k: v for k, v in changes.items() if k in run_fields})
        return dataclasses.replace(self, run=run, **{k: v for k, v in changes.items() if k in own})


def job(name: str, method: str, *, sites: int = 4, rounds: int = 20, preset: str | None = None,
        family: str = "cxr", synth: dict | None = None, batch_size: int | None = None, oracle: bool = False,
        image_size: int | None = None, client: dict | None = None, server: dict | None = None,
        network: dict | None = None, bundle: str = "cxr_densenet121", **run) -> JobSpec:
    """A job of the tables below. With a ``preset``, the preset's client settings and method options come first
    and the job's own ``client``/``server`` options override them (as ``fedlabels bench --preset`` gives its rows);
    ``run``: the run configuration's other fields (seed, key_metric, min_sites, faults, transfer, privacy, ...)."""
    given = {"client": {}, "server": {}}
    if preset:
        from ..presets import load

        given = load(preset, bundle).rule_options(methods.get(method))
    data = DataSpec(family=family, synth=dict(synth or {}), batch_size=batch_size, oracle=oracle,
                    image_size=image_size, preset=preset)
    return JobSpec(name, RunConfig(method=method, bundle=Path(bundle).name, client={**given["client"], **(client or {})},
                                   server={**given["server"], **(server or {})},
                                   network=methods.get(method).network_options(network or {}), data=data, **run),
                   sites=sites, rounds=rounds, bundle_dir=str(bundle) if Path(bundle).name != str(bundle) else "")


# One job per federated method on the embedded cxr scenario (DenseNet121, 64 px).
CXR_TRAINING = {"lr": 1e-3, "epochs": 1}
CXR_JOBS = [
    job("fedavg_cxr", "fedavg", client=dict(CXR_TRAINING)),
    job("fedavg_pl_cxr", "fedavg_pl", client=dict(CXR_TRAINING)),
    job("fedprox_cxr", "fedprox", client={**CXR_TRAINING, "mu": 0.001}),
    job("fedbn_cxr", "fedbn", client=dict(CXR_TRAINING)),
    job("surgical_cxr", "surgical", client={**CXR_TRAINING, "warmup_epochs": 3, "warmup_lr": 5e-3}),
    job("fedpsl_cxr", "fedpsl", client=dict(CXR_TRAINING)),
    job("fedpsl_tdma_cxr", "fedpsl_tdma", client=dict(CXR_TRAINING)),
    job("fedpsl_tadl_cxr", "fedpsl_tadl", client=dict(CXR_TRAINING)),
]
# Segmentation rows train with FedMix's Adam settings (lr 1e-3, weight decay 1e-4).
LESION_TRAINING = {"lr": 1e-3, "epochs": 1, "weight_decay": 1e-4}
# Every task through the FL path: multi-class (MedMNIST-like, site-1 labeled, the
# other sites abstain) and segmentation (the sites' pixel-labeled cases).
OTHER_TASK_JOBS = [
    job("fedavg_medmnist", "fedavg", bundle="medmnist_cnn", family="medmnist", preset="isofed"),
    job("fedavg_lesion", "fedavg", bundle="lesion_unet", family="lesion", client=dict(LESION_TRAINING)),
]
# Semi-supervised (IsoFed and its baselines) on the paper's CNN: the embedded medmnist
# scenario (site-1 labeled, the others unlabeled) or a prepared `isofed` scenario via
# FEDLABELS_DATA. wfedavg_medmnist is the upper bound: every site's full labels. They train with the
# isofed preset (bundles/medmnist_cnn/configs/presets/isofed.json): its scaling, flip and client settings.
SEMISUP_JOBS = [
    job("isofed_medmnist", "isofed", bundle="medmnist_cnn", family="medmnist", preset="isofed"),
    job("mt_wfedavg_medmnist", "mt_wfedavg", bundle="medmnist_cnn", family="medmnist", preset="isofed"),
    job("rscfed_medmnist", "rscfed", bundle="medmnist_cnn", family="medmnist", preset="isofed"),
    job("wfedavg_medmnist", "wfedavg", bundle="medmnist_cnn", family="medmnist", preset="isofed", oracle=True),
]
# FedMLP and the pseudo-label baselines of its Tables 1-2, on the paper's ResNet-18. FedMLP warms up for a
# quarter of the rounds (the paper: 50 of 500, with 10x more rounds to go after).
FEDMLP_JOBS = [
    job("fedmlp_cxr", "fedmlp", bundle="cxr_resnet18", client=dict(CXR_TRAINING), server={"warmup_rounds": 5}),
    job("fedfixmatch_cxr", "fedfixmatch", bundle="cxr_resnet18", client=dict(CXR_TRAINING)),
    job("fednoro_cxr", "fednoro", bundle="cxr_resnet18", client={**CXR_TRAINING, "rampup_begin": 0, "rampup_end": 19}),
]
# FedMix and its baselines on the embedded lesion scenario (site-1 masks, site-2 boxes, site-3
# image-level tags, site-4 nothing). fedavg_lesion (above) is FedAvg over the pixel-labeled sites; the *_full rows train on
# every site's masks (oracle.json), as the paper's FedAvg and FedAdaptAgg under full supervision.
FEDMIX_JOBS = [
    job("fedmix_lesion", "fedmix", bundle="lesion_unet", family="lesion", client=dict(LESION_TRAINING)),
    job("fedavg_full_lesion", "fedavg", bundle="lesion_unet", family="lesion", client=dict(LESION_TRAINING),
            oracle=True),
    job("fedadaptagg_lesion", "fedadaptagg", bundle="lesion_unet", family="lesion", client=dict(LESION_TRAINING),
            oracle=True),
    job("fedst_lesion", "fedst", bundle="lesion_unet", family="lesion", client=dict(LESION_TRAINING),
            server={"warmup_rounds": 5}),
]
# The composed method on the embedded mixed scenario (a site annotating every class, sites annotating a share of
# them, a site annotating none; docs/methods/composed.md), with the settings of the BloodMNIST partial-label
# tables (preset fedmlp_blood: ResNet-18 at width 0.25 from scratch, 32 px, Adam 1e-3). The bundle's own class
# list is the chest X-ray one: the server's initial model gets the scenario's 8 outputs.
MIXED_JOBS = [
    job("composed_mixed", "composed", bundle="cxr_resnet18", family="mixed", preset="fedmlp_blood",
            network={"out_channels": 8}),
]

JOBS = {spec.name: spec for spec in CXR_JOBS + OTHER_TASK_JOBS + SEMISUP_JOBS + FEDMLP_JOBS + FEDMIX_JOBS + MIXED_JOBS}


def check_sites(spec: JobSpec) -> None:
    """Refuses a job with fewer sites than its server rule needs (RSCFed: ``subset_size``), before anything runs."""
    needed = methods.get(spec.method).make_server(**spec.run.server).sites_needed
    if spec.sites < needed:
        raise ValueError(f"{spec.name} ({spec.method}, server options {spec.run.server or 'its defaults'}) needs at least "
                         f"{needed} sites, not {spec.sites}")


def build_job(spec: JobSpec, workdir, installed: bool = False) -> FedJob:
    """The job; its ``fedlabels.json`` is written into ``workdir``, which must outlive the export.

    ``installed``: the production form, configuration only (no custom folder: nvflare counts any as
    custom code, BYOC). The sites run the installed ``fedlabels.flare.executor.SiteExecutor`` and the
    installed bundles; the run configuration travels as the executor's and the controller's argument.
    Otherwise the job carries the client script, ``fedlabels.json`` and a copy of the bundle (the
    simulator form: a bundle edited in the job is what the sites run)."""
    cfg = spec.run
    cfg.validate("server")
    cfg.validate("client")
    config_file = cfg.save(Path(workdir) / FILE)
    bundle = bundle_path(spec.bundle_dir or cfg.bundle)
    net = network(bundle, cfg.network, **cfg.bundle_config())  # the server's persistor (a preset may set the network)
    # nvflare starts the job once min_sites sites are connected and aborts it when fewer stay
    # alive: the same floor a round needs (a lost hospital does not end a run that can go on).
    fed = FedJob(name=spec.name, min_clients=cfg.min_sites)
    # fedlabels is pip-installed at every site and server: reference it, don't copy it.
    fed.set_app_packages(["fedlabels"])
    fed.to_server(FedLabelsController(num_clients=spec.sites, num_rounds=spec.rounds, resume_from=spec.resume_from,
                                      config=cfg.to_json() if installed else None), id="controller")
    # Sites poll for tasks every 0.2 s instead of 2 s: a round is not padded by polling.
    fed.to_server({"server": {"task_request_interval": 0.2}})
    fed.to_server(PTModel(net))
    if installed:
        from .executor import SiteExecutor

        executor = SiteExecutor(config=cfg.to_json())
    elif spec.external_process:
        executor = ClientAPIExecutor(execution_mode="external_process", command=f"python3 -u custom/{SHIM.name}",
                                     params_exchange_format=ExchangeFormat.NUMPY, server_expected_format=ExchangeFormat.NUMPY)
    else:
        executor = ClientAPIExecutor(execution_mode="in_process", task_script_path=SHIM.name, task_script_args="",
                                     params_exchange_format=ExchangeFormat.NUMPY, server_expected_format=ExchangeFormat.NUMPY)
    fed.to_clients(executor, tasks=TASKS if installed else ["*"])
    # Result filters at the sites run in this order: what a site keeps is removed first, then
    # the weights are quantized, and the audit record sees the reply as it leaves.
    keep = local_keys(net, methods.get(spec.method).client_options(**cfg.client).get("bn_policy", "fedavg"))
    if keep:
        add_local_keys_filter(fed, keep)
    if cfg.transfer == "float16":
        add_half_precision_filters(fed)
    fed.to_clients(SentRecord(), filter_type=FilterType.TASK_RESULT, tasks=TASKS)
    if installed:
        return fed
    fed.add_file_to_clients(str(SHIM))
    # One configuration file for both sides (the simulator and a POC/production deployment
    # both place it in the app's custom folder).
    fed.add_file_to_clients(str(config_file))
    fed.add_file_to_server(str(config_file))
    fed.add_file_to_clients(str(_job_copy(bundle, workdir)), dest_dir=bundle.name)
    return fed


def _job_copy(bundle: Path, workdir) -> Path:
    """The bundle as sites need it in a job: without ``configs/logging.conf``, an INI file that
    ``nvflare job submit`` would try to parse as a job configuration and reject (sites only read
    the network and transforms; ``monai.bundle run`` on the bundle itself keeps its logging)."""
    copy = Path(workdir) / "bundle" / bundle.name
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(bundle, copy, ignore=lambda folder, names: ["logging.conf"] if Path(folder).name == "configs" else [])
    return copy


def add_local_keys_filter(fed: FedJob, keys: list) -> None:
    """The keys a site keeps (FedBN / FedBN+: its batch norm, ``methods.base.local_keys``) leave in no
    task's result: nvflare's ExcludeVars removes them from every reply's weights at the site."""
    fed.to_clients(ExcludeVars(exclude_vars=sorted(keys)), filter_type=FilterType.TASK_RESULT, tasks=TASKS)


def add_half_precision_filters(fed: FedJob) -> None:
    """nvflare's own quantization filters, both directions: the sender quantizes to
    float16, the receiver restores float32 before any fedlabels code sees the weights."""
    from nvflare.app_opt.pt.quantization.dequantizer import ModelDequantizer
    from nvflare.app_opt.pt.quantization.quantizer import ModelQuantizer

    fed.to_server(ModelQuantizer(quantization_type="float16"), filter_type=FilterType.TASK_DATA, tasks=TASKS)
    fed.to_server(ModelDequantizer(), filter_type=FilterType.TASK_RESULT, tasks=TASKS)
    fed.to_clients(ModelDequantizer(), filter_type=FilterType.TASK_DATA, tasks=TASKS)
    fed.to_clients(ModelQuantizer(quantization_type="float16"), filter_type=FilterType.TASK_RESULT, tasks=TASKS)


def export(spec: JobSpec, out_dir, installed: bool = False) -> Path:
    """Write the job folder ``out_dir/<name>`` (replacing an older one atomically; a folder of that name
    that is not a job folder is refused, never deleted). ``installed``: the production form (``build_job``)."""
    out_dir = Path(out_dir)
    from ..profile import check_output_dir

    check_output_dir(out_dir / spec.name, ("meta.json",), "FLARE job folder", option="job folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        build_job(spec, tmp, installed=installed).export_job(tmp)
        for config in (Path(tmp) / spec.name).glob("*/config/config_fed_*.json"):
            _sort_filter_tasks(config)
        target = out_dir / spec.name
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(Path(tmp) / spec.name), target)
    return target


def _sort_filter_tasks(config: Path) -> None:
    """nvflare keeps a filter's tasks as a set, written in the process's hash order: sorted, an
    export is the same file in every process (the committed folders are compared with one)."""
    import json

    doc = json.loads(config.read_text())
    for chain in ("task_data_filters", "task_result_filters"):
        for entry in doc.get(chain, []):
            entry["tasks"] = sorted(entry["tasks"])
    config.write_text(json.dumps(doc, indent=4))


def run_cli(spec: JobSpec, argv=None) -> None:
    """The command line of each ``nvflare_jobs/<job>/job.py``: export, or run in SimEnv / PocEnv / ProdEnv."""
    import argparse

    from nvflare.recipe import spec as recipe_spec  # importing it takes nvflare's own flags out of sys.argv

    p = argparse.ArgumentParser(description=f"fedlabels job {spec.name} ({spec.method})")
    if argv is None and getattr(recipe_spec, "_peek_recipe_args", lambda: (False, None))()[0]:
        p.error("--export is nvflare's own flag (nvflare removes it before this parser runs): write the job "
                "folder with --out DIR")
    where = p.add_mutually_exclusive_group(required=True)
    # not --export: nvflare 2.9 takes --export and --export-dir out of sys.argv when nvflare.recipe is imported
    where.add_argument("--out", metavar="DIR", help="write the job folder into DIR")
    where.add_argument("--sim", metavar="WORKSPACE", help="run in the FLARE simulator")
    where.add_argument("--poc", action="store_true", help="run in a local POC deployment (nvflare poc prepare first)")
    where.add_argument("--prod", metavar="STARTUP_KIT", help="submit to a provisioned project with this admin startup kit")
    p.add_argument("--config-only", action="store_true",
                   help="--out: the production form (no custom code: the sites run the installed fedlabels; "
                        "what --prod submits)")
    p.add_argument("-n", "--sites", type=int, default=spec.sites)
    p.add_argument("--rounds", type=int, default=spec.rounds)
    p.add_argument("-t", "--threads", type=int, help="--sim: worker processes (default: as `fedlabels simulate`)")
    p.add_argument("--transfer", choices=TRANSFERS, default=spec.run.transfer,
                   help="precision of the weights on the wire")
    p.add_argument("--min-sites", type=int,
                   help="fewest sites a round needs; nvflare starts the job once this many are connected and "
                        "stops it when fewer stay (default: every site with --poc/--prod, else the job's own)")
    p.add_argument("--site-timeout", type=int, default=spec.run.site_timeout, metavar="SECONDS",
                   help="seconds a site has to answer a task (a round's training, the final evaluation); one that "
                        "does not answer in time is left out of that step, logged, and the round goes on "
                        f"(default {DEFAULT_SITE_TIMEOUT} in a deployment; none in the simulator, where sites "
                        "may take turns)")
    p.add_argument("--resume-from", default=spec.resume_from,
                   help="a previous run's server folder (on the server's machine): continue from its last round")
    args = p.parse_args(argv)
    if args.min_sites is None:
        # a real deployment waits for every hospital unless told it may run with fewer
        args.min_sites = args.sites if (args.poc or args.prod) else spec.run.min_sites
    if not 1 <= args.min_sites <= args.sites:
        p.error(f"--min-sites {args.min_sites}: must be between 1 and the number of sites ({args.sites})")
    if args.site_timeout is not None and args.site_timeout < 1:
        p.error(f"--site-timeout {args.site_timeout}: must be >= 1 (seconds)")
    spec = spec.replace(sites=args.sites, rounds=args.rounds, transfer=args.transfer, min_sites=args.min_sites,
                        resume_from=args.resume_from, site_timeout=args.site_timeout)
    try:
        check_sites(spec)
    except ValueError as e:  # too few sites for the method (-n), or a server option the rule refuses
        p.error(str(e))
    if args.config_only and not args.out:
        p.error("--config-only goes with --out (--prod always submits the production form)")
    if args.out:
        print(export(spec, args.out, installed=args.config_only))
        return

    workdir = tempfile.mkdtemp(prefix=f"{spec.name}-")  # the job folder the recipe submits, removed after
    try:
        _execute(spec, args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _execute(spec: JobSpec, args, workdir: str) -> None:
    from nvflare.recipe import PocEnv, ProdEnv, SimEnv
    from nvflare.recipe.spec import Recipe

    class FedLabelsRecipe(Recipe):
        def __init__(self):
            # a provisioned federation runs the installed fedlabels: the job carries configuration only (nvflare's
            # POC kits keep nvflare's default class allow list, so --poc submits the job with its code)
            super().__init__(build_job(spec, workdir, installed=bool(args.prod)))

    if args.sim:
        from .simulator import default_threads

        env = SimEnv(num_clients=args.sites, num_threads=args.threads or default_threads(args.sites), workspace_root=args.sim)
    elif args.poc:
        env = PocEnv(num_clients=args.sites)
    else:
        env = ProdEnv(startup_kit_location=args.prod, username=admin_user(args.prod))
    run = FedLabelsRecipe().execute(env)
    if run is not None:
        # Waits for the job and downloads its server workspace; PocEnv then stops its services
        # (clean_up=False: without it nvflare deletes the POC workspace, the result with it).
        result = run.get_result(clean_up=False)
        print(f"job {run.get_job_id()}: {run.get_status()}; results: {result}")


def admin_user(kit) -> str:
    """The admin user a provisioned admin startup kit logs in as."""
    import json

    path = Path(kit) / "startup" / "fed_admin.json"
    try:
        return json.loads(path.read_text())["admin"]["username"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{path}: not an admin startup kit ({e})")
