"""The one client script every job runs (nvflare Client API).

It reads the job's ``fedlabels.json`` (``fedlabels.config.RunConfig``, the
file the server reads too), its site's data from the scenario folder by
``flare.get_site_name()``, builds the network and transforms from the bundle,
and runs the method's client rule through the round engine's site task
(``fedlabels.site.train_task``). A bad scenario or configuration is reported
to the server as a fatal error at the set-up handshake, so the whole job
stops with that one message before round 0.

Where the data is: ``--data DIR`` or the ``FEDLABELS_DATA`` environment
variable (each real site sets its own); neither -> the embedded synthetic
scenario of the configuration's ``data.family``, generated on first use, in
the simulator only (``FEDLABELS_DATA=embedded`` asks for it anywhere): a
provisioned site without data refuses to start (``data_root``).
Where the site keeps its state between rounds (for resuming):
``FEDLABELS_STATE/<run>/<site>/round-NNNNN.pt`` (default ``./fedlabels_state`` in the
site's workspace; ``<run>`` names the run, kept by a resumed run, so two jobs at one
hospital never share it; ``fedlabels.site.state_folder``).
What the site sent is recorded after nvflare's result filters, as it leaves
(``fedlabels.flare.sent``): FedBN's batch norm, for one, is removed by a
filter from the whole state dict this script hands to nvflare.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import nvflare.client as flare
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from .. import methods, privacy
from ..bundle import bundle_path
from ..config import FILE, RunConfig
from ..methods.base import ABSTAIN, EXTRAS, LABELED_MASK, N, PHASE, REASON, RESUME, to_numpy
from ..nets import batchnorm_keys, batchnorm_keys_by_name
from ..profile import ScenarioError
from ..site import flat_metrics, load_state, save_state, setup_site, state_folder, train_task, validate_task
from .controller import FATAL, RUN, SUMMARY, TASKS, THREADS, VERSIONS, on_the_wire, versions
from .gate import check_job
from .withhold import PATH as WITHHOLD_BN


def build_parser():
    p = argparse.ArgumentParser(description="fedlabels FLARE client")
    p.add_argument("--config", default=FILE, help="the run configuration (looked up in the job's custom folder)")
    p.add_argument("--data", default=None,
                   help="scenario folder (default: $FEDLABELS_DATA; the embedded one in the simulator)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def say(message: str) -> None:
    """A line for the site's log: the client script's print goes there (nvflare redirects it)."""
    print(message, flush=True)


METRIC_FAULTS = {"metric": float("inf"), "metric_nan": float("nan"), "metric_text": "high", "metric_huge": 1e9}


def inject_fault(faults, site: str, rnd: int, weights: dict, meta: dict, metrics: dict | None = None,
                 timeout: int | None = None, say=say) -> tuple:
    """Deliberately corrupt this site's update, to drill the server's fault handling; returns
    (weights, meta, metrics). ``hang``: the site keeps its trained update and never returns (a
    hospital that goes silent mid-round; the drill ends when its process is killed). ``stall``: it
    answers only after the server's ``timeout`` has passed (a site far slower than the others, or
    hung and back later): the server has left it out of the round by then. The hostile kinds
    (``n_text``, ``n_huge``, ``dtype``, ``strings``, ``extras``, ``mask``, ``norm``, ``loss``, ``prototypes``) send
    what a broken or hostile site could: the server drops each with its reason. ``metric`` (inf),
    ``metric_nan``, ``metric_text`` and ``metric_huge`` (1e9) replace its validation scores: the update still
    counts, the score does not. The label-summary kinds are ``inject_summary_fault``'s."""
    metrics = dict(metrics or {})
    for fault in faults:
        where, kind, when = fault.split(":")
        if where != site or int(when) != rnd:
            continue
        if kind == "hang":
            say(f"fault drill: {site} hangs in round {rnd}")
            while True:
                time.sleep(3600)
        if kind == "stall":
            wait = (timeout or 60) + 3
            say(f"fault drill: {site} stalls {wait}s in round {rnd}")
            time.sleep(wait)
            continue
        key = next(k for k, v in weights.items() if v.dtype.kind == "f")
        if kind == "crash":
            raise RuntimeError(f"fault drill: {site} crashes in round {rnd}")
        weights, meta = dict(weights), dict(meta)
        if kind == "nan":
            weights[key] = weights[key] * float("nan")
        elif kind == "shape":
            weights[key] = weights[key].reshape(-1)[:-1]
        elif kind == "keys":
            weights["not_a_layer.weight"] = weights.pop(key)
        elif kind == "no_n":
            meta.pop(N)
        elif kind == "n_text":
            meta[N] = "many"
        elif kind == "n_huge":
            meta[N] = 10**9
        elif kind == "dtype":
            weights[key] = weights[key].astype(np.float64)
        elif kind == "strings":  # the right shape, text instead of numbers
            weights[key] = weights[key].astype(str)
        elif kind == "extras":
            meta[EXTRAS] = ["not", "a", "mapping"]
        elif kind == "mask":  # per-class labeled mask (Surgical, FedPSL read it) that is no number
            meta[LABELED_MASK] = ["yes"] * len(meta.get(LABELED_MASK) or [0])
        elif kind == "norm":  # the right keys, shapes and dtypes, every float weight scaled 100 times
            weights = {k: (v * 100).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in weights.items()}
        elif kind == "loss":  # a training loss far outside a Dice loss's range (FedMix weighs by it)
            metrics["train_loss"] = 1e6
        elif kind == "prototypes":  # FedMLP's prototypes one feature longer than the network's
            extras = meta.get(EXTRAS) if isinstance(meta.get(EXTRAS), dict) else {}
            protos = extras.get("prototypes") or {}
            meta[EXTRAS] = {**extras, "prototypes": {c: [list(row) + [0.0] for row in p] for c, p in protos.items()}}
        elif kind in METRIC_FAULTS:
            metrics = {k: (METRIC_FAULTS[kind] if k.startswith("val_") else v) for k, v in metrics.items()}
        elif kind not in SUMMARY_FAULTS:
            raise ValueError(f"unknown fault kind {kind!r}")
    return weights, meta, metrics


# What a broken or hostile site could declare before round 0 (its label summary; the server leaves it out).
SUMMARY_FAULTS = {"summary_cases": lambda s: {**s, "cases": 10**8},
                  "summary_noise": lambda s: {**s, "privacy": {"noise_multiplier": 1e12, "clip": 4.0, "epsilon": 1.0,
                                                               "delta": 1e-5, "releases": 1}}}


def inject_summary_fault(faults, site: str, summary: dict, say=say) -> dict:
    """The handshake's drills: ``summary_cases`` declares 10^8 cases, ``summary_noise`` a privacy report
    whose noise would widen its case bound by 2.4e13 cases (the round in ``SITE:KIND:ROUND`` is not read)."""
    for fault in faults:
        where, kind, _ = fault.split(":")
        if where == site and kind in SUMMARY_FAULTS:
            say(f"fault drill: {site} declares a hostile label summary ({kind})")
            summary = SUMMARY_FAULTS[kind](summary)
    return summary


EMBEDDED = "embedded"  # FEDLABELS_DATA=embedded: the embedded synthetic scenario, asked for by name


def provisioned(here: Path | None) -> bool:
    """Whether this site runs from a provisioned startup kit (POC or production): the job's custom folder
    is ``<kit>/<job id>/app_<site>/custom`` and the kit holds the project's root certificate. A simulated
    site's workspace has a ``startup`` folder without one."""
    return here is not None and (Path(here).resolve().parents[2] / "startup" / "rootCA.pem").is_file()


def data_root(args, cfg: RunConfig, here: Path | None = None) -> Path:
    """The site's scenario folder: ``--data``, else ``FEDLABELS_DATA``, else the embedded synthetic one --
    in the simulator, or when ``FEDLABELS_DATA=embedded``. A provisioned site with neither refuses to
    start: the synthetic scenario's sites are named site-1 ... site-N, and a hospital kit of that name
    would otherwise train on it and report it as the hospital's."""
    root = args.data or os.environ.get("FEDLABELS_DATA")
    if root and root != EMBEDDED:
        return Path(root)
    if not root and provisioned(here):
        raise ValueError("FEDLABELS_DATA is not set: a provisioned site trains on its own scenario folder; set "
                         f"FEDLABELS_DATA to it before startup/start.sh (or to {EMBEDDED!r} for the embedded "
                         "synthetic data)")
    from ..data.synthetic import default_scenario

    return default_scenario(cfg.data.family, seed=cfg.seed, **cfg.data.synth)


def prepare(cfg: RunConfig, args, site: str, here: Path | None, say=say):
    """Everything a site needs, validated before the first round."""
    cfg.validate("client")
    site_privacy(cfg, here, say)
    method = methods.get(cfg.method)
    setup = setup_site(bundle_path(cfg.bundle, here), data_root(args, cfg, here), site,
                       batch_size=cfg.data.batch_size,
                       seed=cfg.seed, device=args.device, network_overrides=cfg.network, unlabeled=method.uses_unlabeled,
                       strong_view=method.strong_view, oracle=cfg.data.oracle,
                       config=cfg.bundle_config())
    if setup.task not in method.tasks:
        raise ValueError(f"method {method.name!r} handles {method.tasks}, not the scenario's task {setup.task!r}")
    if cfg.privacy:  # the label summary is noised once, recorded in the site's ledger, sent as is (fedlabels.privacy)
        ledger = privacy.ledger_path()
        report, reused = setup.release_summary(cfg.privacy, ledger, note=cfg.method)
        total, releases = privacy.spent(ledger, site, report["delta"])
        say(f"[{site}] {privacy.describe(report)}" + (f"; reused from {ledger}" if reused else "")
            + f"; the ledger {ledger} records {releases} release(s) of this site: epsilon {total:.4g} in all")
    client = method.make_client(setup.net, setup.context(), **cfg.client)
    check_local_keys(client, here)
    check_site_withholds(client, here)
    return setup, client


# a path (absolute, or relative with a folder) or a data file's name
_PATH = re.compile(r"(?:[A-Za-z]:\\|~?/|\.{1,2}/)?(?:[\w.@+-]+[/\\])+[\w.@+-]*"
                   r"|[\w@+-][\w.@+-]*\.(?:json|ya?ml|csv|tsv|txt|png|jpe?g|bmp|tiff?|dcm|dicom|nii|gz|npz|npy|"
                   r"pt|pth|ckpt|h5|pkl|zip)\b", re.IGNORECASE)


def redact(message):
    """A message for the server: every local path and file name replaced by ``<local file>`` (a hospital's
    folder layout and file names can name patients or studies). The field names and the reason stay."""
    if not message:
        return message
    return _PATH.sub("<local file>", str(message)) + " (the site's log has the full message)"


SITE_PRIVACY = "fedlabels_privacy"  # the hospital's own label-summary noise: a property of its privacy scope


def site_policy_file(here: Path) -> Path:
    """The kit's ``local/privacy.json`` (a provisioned job's custom folder is ``<kit>/<job>/app_<site>/custom``)."""
    return Path(here).resolve().parents[2] / "local" / "privacy.json"


def site_scope(here: Path | None) -> dict:
    """The default scope of the kit's ``local/privacy.json`` (the hospital's own policy; provision.site_policy),
    or {} outside a provisioned kit or when there is none readable (nvflare refuses to start on a broken one)."""
    if here is None or not provisioned(here):
        return {}
    path = site_policy_file(here)
    try:
        policy = json.loads(path.read_text()) if path.is_file() else {}
        scope = next(s for s in policy.get("scopes", []) if s.get("name") == policy.get("default_scope"))
    except (ValueError, StopIteration, AttributeError, TypeError):
        return {}
    return scope if isinstance(scope, dict) else {}


def site_privacy(cfg: RunConfig, here: Path | None, say=say) -> None:
    """A hospital that noises its label summary itself (its privacy scope's ``properties.fedlabels_privacy``,
    ``fedlabels provision --noise-summary``) does so whatever the job says: its options replace the job's
    ``privacy`` for this site. The server bounds each site's case count by the noise its report states."""
    props = site_scope(here).get("properties")
    own = props.get(SITE_PRIVACY) if isinstance(props, dict) else None
    if own is None:
        return
    try:
        privacy.options(own)
    except privacy.OptionError as e:
        where = f"properties.{SITE_PRIVACY}" + (f".{e.key}" if e.key else "")
        raise ValueError(f"{site_policy_file(here)}: field '{where}': {e}") from None
    if own != cfg.privacy:
        say(f"the hospital's own label-summary noise ({SITE_PRIVACY} in its privacy.json) replaces the job's "
            f"{cfg.privacy or 'exact counts'}: {own}")
    cfg.privacy = dict(own)


def check_site_withholds(client, here: Path | None) -> None:
    """A hospital whose kit's ``local/privacy.json`` withholds batch norm (``flare.withhold``) takes part
    only in jobs that keep it at the site: the updates of a job that averages it would lack those keys
    and be dropped every round. Refused here, before round 0, with the reason; so is a network whose
    batch norm the filter cannot find by name (no running statistics), which would leave."""
    scope = site_scope(here)
    if not any(isinstance(f, dict) and f.get("path") == WITHHOLD_BN for f in scope.get("task_result_filters", [])):
        return
    path = site_policy_file(here)
    by_name = set(batchnorm_keys_by_name(client.net.state_dict()))
    unseen = sorted(set(batchnorm_keys(client.net)) - by_name)
    if unseen:
        raise ValueError(f"this hospital withholds its batch norm from every reply ({path.name}: {WITHHOLD_BN}), "
                         f"but this network's batch norm {unseen[0]!r} keeps no running statistics, so the filter "
                         "cannot find it by name and it would leave")
    sent = sorted(by_name - set(client.local_keys))
    if sent:
        raise ValueError(f"this hospital withholds its batch norm from every reply ({path.name}: {WITHHOLD_BN}), "
                         f"and this job's bn_policy {client.bn_policy!r} averages it ({len(sent)} keys, e.g. "
                         f"{sent[0]!r}): jobs whose network has batch norm run here only with a bn_policy that "
                         "keeps it at the site (fedbn, fedbn+)")


def check_local_keys(client, here: Path | None) -> None:
    """A site that keeps keys local (FedBN's batch norm) hands nvflare its whole state dict, and the
    job's ExcludeVars result filter removes those keys. The filter is fixed when the job is built,
    the policy read at run time (fedlabels.json): they must agree, or the keys would leave."""
    keep = set(client.local_keys)
    if not keep or here is None:
        return
    path = here.parent / "config" / "config_fed_client.json"
    doc = json.loads(path.read_text()) if path.is_file() else {}
    excluded = {k for chain in doc.get("task_result_filters", []) for f in chain.get("filters", [])
                if f.get("path", "").endswith("ExcludeVars") and set(TASKS) <= set(chain.get("tasks", []))
                for k in f.get("args", {}).get("exclude_vars", [])}
    missing = sorted(keep - excluded)
    if missing:
        raise ValueError(f"{path}: task_result_filters: no ExcludeVars filter for {len(missing)} keys this site keeps "
                         f"(e.g. {missing[:2]}; bn_policy {client.bn_policy!r}), so they would leave the site: "
                         "rebuild the job from its definition (python nvflare_jobs/<job>/job.py --out DIR)")


def shareable(evaluation: dict, counts: bool) -> dict:
    """What of a validation result leaves the site: never per-case values (``dice_per_case``);
    the per-class positive and negative counts only when the run does not noise its counts
    (the privacy option)."""
    drop = {"dice_per_case"} | (set() if counts else {"n_pos", "n_neg"})
    if isinstance(evaluation, dict):
        return {k: shareable(v, counts) for k, v in evaluation.items() if k not in drop}
    return evaluation


def size_threads(meta: dict) -> None:
    """Simulated sites share one machine: take the share of the cores the server gives,
    unless OMP_NUM_THREADS says otherwise. Every task carries it, as a task may be the
    first of a new process. Never more than this machine's cores (the server's number is its word)."""
    threads = meta.get(THREADS)
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0 \
            and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(threads, os.cpu_count() or 1))


TOKEN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # a run token names a folder under FEDLABELS_STATE


def screen_task(meta: dict, rnd, params, reference: dict, transfer: str) -> str | None:
    """Why a task the server sent must be refused, or None. The run token becomes a folder name (never a
    path: no separator, no ``..``); the round a non-negative integer; the weights the network's own keys,
    shapes and float dtypes, finite (a half-precision transfer leaves integer buffers at the site)."""
    token = meta.get(RUN)
    if token not in (None, "") and (not isinstance(token, str) or not TOKEN.fullmatch(token) or set(token) == {"."}):
        return f"run token {str(token)[:60]!r} is not a plain name"
    if rnd is not None and (isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 0):
        return f"round {str(rnd)[:30]} is not a non-negative integer"
    if not params:
        return None
    if not isinstance(params, dict):
        return f"weights are a {type(params).__name__}, not a mapping"
    unknown = sorted(map(str, set(params) - set(reference)))
    if unknown:
        return f"unknown weight keys {unknown[:3]}"
    for key, value in params.items():
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError):
            return f"{key} is not an array"
        want = reference[key]
        if tuple(arr.shape) != tuple(want.shape):
            return f"shape of {key} is {tuple(arr.shape)}, the network's is {tuple(want.shape)}"
        if arr.dtype.kind != ("f" if want.is_floating_point() else arr.dtype.kind) or arr.dtype.kind not in "fiub":
            return f"dtype of {key} is {arr.dtype}"
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"non-finite values in {key}"
    missing = sorted(k for k, v in reference.items() if k not in params and (transfer == "float32" or
                                                                               v.is_floating_point()))
    if missing:
        return f"weights lack {len(missing)} of the network's keys (e.g. {missing[0]!r})"
    return None


class SiteSession:
    """One site's side of a job, task by task: what the client script's loop and the installed executor
    (``fedlabels.flare.executor``, production jobs without custom code) both run.

    ``cfg_source``: the run configuration's file or its contents (a dict); ``here``: the job's custom
    folder, where a job's bundle and its ``config_fed_client.json`` (``../config``) are looked up. A bad
    scenario or configuration does not raise: every task is answered with the redacted error, so the
    server stops the job with that one message before round 0."""

    def __init__(self, site: str, cfg_source, args, here: Path | None, say=say, gate: dict | None = None):
        self.site, self.args, self.here, self.say = site, args, here, say
        self.state_root = Path(os.environ.get("FEDLABELS_STATE", "fedlabels_state"))
        self.cfg, self.setup, self.client, self.fatal, self.first_task = None, None, None, None, True
        try:
            if gate is not None:  # a configuration-only job: the site's gate first (nothing of it is parsed yet)
                check_job(cfg_source, **gate)
            self.cfg = (RunConfig.from_json(dict(cfg_source), "config_fed_client.json: executor args: config")
                        if isinstance(cfg_source, dict) else RunConfig.load(cfg_source))
            self.setup, self.client = prepare(self.cfg, args, site, here, say)
            say(f"[{site}] {self.cfg.method} on {self.setup.scenario.name}: {len(self.setup.items())} training "
                f"cases, annotates {list(self.setup.site.profile.annotated) or 'nothing'}; client options "
                f"{self.cfg.client}")
        except (ScenarioError, ValueError, FileNotFoundError) as e:
            self.fatal = str(e)
            say(f"[{site}] cannot start: {self.fatal}")

    def handle(self, task: str, model: FLModel) -> FLModel:
        """The reply to one task ("train", "validate" or "submit_model") carrying ``model``."""
        try:
            return self._handle(task, model)
        finally:
            self.first_task = False

    def _handle(self, task: str, model: FLModel) -> FLModel:
        site, cfg, client, setup = self.site, self.cfg, self.client, self.setup
        meta = model.meta or {}
        if self.fatal:  # the full message stays in the site's log; the server learns no local path or file name
            return FLModel(params={}, meta={FATAL: redact(self.fatal)})
        t0 = time.time()
        if self.first_task:
            size_threads(meta)
            self.say(f"[{site}] torch threads: {torch.get_num_threads()}")
        rnd = model.current_round
        why = screen_task(meta, rnd, model.params, client.net.state_dict(), cfg.transfer)
        if why:  # what the server sent is not what a fedlabels server sends: nothing of it is used or written
            self.say(f"[{site}] refused a {task} task from the server: {why}")
            return FLModel(params={}, meta={N: 0, ABSTAIN: True, REASON: f"the site refused the task: {why}"})
        folder = state_folder(self.state_root, meta[RUN], site) if meta.get(RUN) else None
        if folder is not None and rnd is not None and meta.get(PHASE) != "summary":
            if site in (meta.get(RESUME) or []):
                # a resumed run: the state before the resumed round (the site may have trained that
                # round already, for a server that died before aggregating it)
                got = load_state(folder, client, before=rnd)
                self.say(f"[{site}] resumed its state of round {got} from {folder}" if got is not None else
                         f"[{site}] no saved state of this run before round {rnd} in {folder}: joins from the "
                         "global model")
            elif self.first_task:
                # nvflare's simulator with fewer threads than sites starts a process per task: continue
                # what this site saved last in this run (a second draw in a round continues the first)
                got = load_state(folder, client, through=rnd)
                if got is not None:
                    self.say(f"[{site}] continued its state of this run (round {got}) from {folder}")
        if task == "train" and meta.get(PHASE) == "summary":
            summary = inject_summary_fault(cfg.faults, site, setup.summary(), self.say)
            return FLModel(params={}, meta={SUMMARY: summary, VERSIONS: versions()})
        if task == "train":
            update = train_task(client, setup, model.params, rnd, meta.get(EXTRAS) or {})
            if folder is not None:
                save_state(folder, client, rnd)
            out = {**update.meta, N: update.n, ABSTAIN: update.abstain, REASON: redact(update.reason),
                   EXTRAS: update.extras, "NUM_STEPS_CURRENT_ROUND": update.n}
            weights, out, metrics = inject_fault(cfg.faults, site, rnd, update.weights, out, update.metrics,
                                                 cfg.site_timeout, self.say)
            scores = {k: v for k, v in update.metrics.items() if k.startswith("val_") and "/" not in k}
            self.say(f"[{site}] round {rnd}: n={update.n}" + (f" stopped: {update.reason}" if update.reason else
                     " abstained" if update.abstain else
                     f" train_loss={update.metrics.get('train_loss', float('nan')):.4f}")
                     + f" received model: {scores} ({time.time() - t0:.1f}s)")
            # the round travels with the reply too: the site's own audit record (sent.py) reads it there
            return FLModel(params=on_the_wire(weights, cfg.transfer), metrics=metrics, meta=out, current_round=rnd)
        if task == "validate":
            result = validate_task(client, setup, model.params)
            return FLModel(metrics=flat_metrics(result) or {"val_cases": 0.0},
                           meta={"evaluation": shareable(result, counts=not cfg.privacy)})
        if task == "submit_model":  # the whole state dict: the job's filters withhold what the site keeps
            return FLModel(params=on_the_wire(to_numpy(client.net.state_dict()), cfg.transfer))
        raise ValueError(f"task {task!r}: a fedlabels site answers {TASKS}")


def main(argv=None, here: Path | None = None):
    """The client script's loop (nvflare Client API): each task to the site's ``SiteSession``."""
    args = build_parser().parse_args(argv)
    flare.init()
    session = SiteSession(flare.get_site_name(), Path(args.config) if here is None else here / args.config,
                          args, here)
    while flare.is_running():
        model = flare.receive()
        if model is None:
            break
        task = ("train" if flare.is_train() else "validate" if flare.is_evaluate() else
                "submit_model" if flare.is_submit_model() else flare.get_task_name())
        flare.send(session.handle(task, model))


if __name__ == "__main__":
    main()
