"""One controller for every registered method (nvflare ``BaseFedAvg``).

The round itself belongs to ``fedlabels.engine.RoundEngine``; this class only
supplies what needs nvflare: sending a step to its sites
(``send_model_and_wait``), aggregating through ``BaseFedAvg.aggregate`` (so
nvflare's aggregation events fire), persisting models and state.

Before round 0 a handshake task collects every site's label summary for the
server rule's ``setup`` (a site whose data is invalid answers with its error
and the job stops there). Sites report validation metrics of the model they
received, so the best model is chosen on site validation data, never on test
data.

Outputs in the server's run folder: ``FL_global_model.pt`` (last, written by
the persistor), ``best_FL_global_model.pt``, ``metrics.jsonl`` (one line per
round: per-site losses and per-class validation metrics, dropped and
abstaining sites), ``fedlabels_server_state.pt`` (the resume checkpoint,
``fedlabels.checkpoint``) and ``progress.json``, ``fedlabels.json`` (the run configuration),
``cross_site_eval.json``, ``label_summaries.json`` (each site's
label summary as the server received it: the exported bundle's label table)
and TensorBoard events under ``tb/``.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.base_fedavg import BaseFedAvg

from .. import methods
from ..checkpoint import read_checkpoint, write_checkpoint
from ..config import DEFAULT_SITE_TIMEOUT, FILE, RunConfig
from ..engine import NORM_RATIO, NoProgress, RoundEngine, clean_metrics
from ..methods.base import ABSTAIN, EXTRAS, N, PHASE, REASON, RESUME, Update
from ..privacy import REPORT as PRIVACY_REPORT, server_lines
from ..progress import number
from ..profile import check_summaries, check_summary, write_atomic, write_json_atomic

FATAL = "fatal_error"
# Every task a site answers (the client script). Filters are registered for named tasks:
# nvflare 2.9 looks them up by task name, and "*" matches none.
TASKS = ["train", "validate", "submit_model"]
SUMMARY = "label_summary"
SUMMARIES_FILE = "label_summaries.json"  # in the run folder: what each site reported, for the model card
THREADS = "threads"  # torch threads a simulated site should use
RUN = "run_token"  # names this run (a resumed run keeps it): the folder of each site's saved state
SERVER = "server"  # the fault drills' name for the server: "server:POINT:ROUND" (DRILL_POINTS)
# Where the server-kill drill ends the server in a round: once the sites have answered a step and nothing
# of the round is written; once the round is aggregated, still with nothing of it written; after its
# checkpoint, progress.json, metrics line and best model but before FL_global_model.pt; after everything
# of the round.
DRILL_POINTS = ("mid_round", "before_checkpoint", "before_model", "between_rounds")
VERSIONS = "versions"  # the packages a site runs; the server refuses a mismatch before round 0


def versions() -> dict:
    """The versions of the packages a site and the server must share (those a provisioned kit pins), and the
    sha256 of the fedlabels wheel this install came from (None for an editable or index install): two builds
    that share a version number are told apart."""
    from ..release import installed_sha256
    from .provision import PINNED, installed

    return {**{name: installed(name) for name in PINNED}, "fedlabels_wheel": installed_sha256()}


class FedLabelsController(BaseFedAvg):
    def __init__(self, *args, resume_from: str = "", config: dict | None = None, **kwargs):
        """
        Everything else (method, options, seed, key metric, min_sites) comes from the
        job's ``fedlabels.json`` (``fedlabels.config``), which the sites read too.

        Args:
            resume_from: a previous run's server folder (WS/server/simulate_job): training continues
                from its last global model, server-rule state and round; sites load their saved state.
            config: the run configuration itself (a production job that carries configuration only);
                None: the ``fedlabels.json`` in the job's custom folder.
        """
        # A crashed site is dropped from the round (min_sites decides if the round counts).
        kwargs.setdefault("ignore_result_error", True)
        super().__init__(*args, **kwargs)
        self.resume_from = resume_from
        self.config = config
        self._resume_sites = set()
        self._run_token = ""
        self._best_weights = None
        self._drills = []
        self._transfer = "float32"
        self._site_timeout = DEFAULT_SITE_TIMEOUT
        self._clients = []

    # ---------------------------------------------------------------- helpers
    def _path(self, name):
        return os.path.join(self.get_run_dir(), name)

    def _append_metrics(self, record):
        path = self._path("metrics.jsonl")
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        lines = [line for line in lines if json.loads(line)["round"] != record["round"]]
        write_atomic(path, ("\n".join(lines + [json.dumps(record)]) + "\n").encode())

    def _tb(self):
        if not hasattr(self, "_writer"):
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self._path("tb"))
        return self._writer

    def _save_best(self, params: dict):
        self._best_weights = dict(params)
        self.fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(weights=params, meta_props={}),
                             private=True, sticky=True)
        self.event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE)

    def _log(self, level, msg):
        (self.warning if level == "warning" else self.info)(msg)

    def _config(self) -> RunConfig:
        if self.config is not None:
            cfg = RunConfig.from_json(dict(self.config), "config_fed_server.json: controller args: config")
        else:
            folder = self.fl_ctx.get_engine().get_workspace().get_app_custom_dir(self.fl_ctx.get_job_id())
            cfg = RunConfig.load(os.path.join(folder, FILE))
        cfg.validate("server")
        return cfg

    def _seeded_init(self, params: dict, seed: int) -> dict:
        """Re-initialise the persistor's network under ``seed`` so runs repeat exactly."""
        net = getattr(self.persistor, "model", None)
        if net is None:
            return params
        import torch

        from ..nets import rebuild

        torch.manual_seed(seed)
        return {k: v.detach().cpu().numpy() for k, v in rebuild(net).state_dict().items()}

    def _fatal(self, results) -> bool:
        for r in results:
            if (r.meta or {}).get(FATAL):
                self.panic(f"{r.meta.get('client_name')}: {r.meta[FATAL]}")
                return True
        return False

    def _task_meta(self) -> dict:
        """What every task carries besides the model: with fewer simulator threads than sites,
        nvflare runs each site task in a new process, which needs both again."""
        return {THREADS: self._threads_per_site(self.num_clients), RUN: self._run_token}

    # ---------------------------------------------------------------- what the engine calls
    def _send(self, step, targets, weights, rnd, extras) -> list:
        resume = sorted(self._resume_sites & set(targets))
        self._resume_sites -= set(targets)
        data = FLModel(params=on_the_wire(weights, self._transfer), params_type=ParamsType.FULL, current_round=rnd,
                       total_rounds=self.num_rounds,
                       meta={EXTRAS: extras, RESUME: resume, **self._task_meta()})
        results = self._wait("train", targets, data)
        if self.abort_signal.triggered:
            raise _Stop()
        self._drill("mid_round", rnd)
        return [to_update(r) for r in results]

    def _wait(self, task, targets, data, timeout=None) -> list:
        """Send a task to the connected ``targets`` and wait at most ``timeout`` (default
        ``site_timeout``) seconds: a site that has not answered by then (hung, or far slower than the
        others) is left out of the results, so the engine drops it from this step with a logged reason
        and the round goes on; nvflare discards a late answer."""
        targets = self._connected(targets)
        if not targets:
            return []
        timeout = self._site_timeout if timeout is None else timeout
        t0 = time.time()
        results = self.send_model_and_wait(task_name=task, targets=targets, data=data,
                                           min_responses=len(targets), timeout=timeout)
        answered = {(r.meta or {}).get("client_name") for r in results if isinstance(r.meta, dict)}
        late = sorted(set(targets) - answered)
        if late and timeout and not self.abort_signal.triggered and time.time() - t0 >= timeout - 1:
            self.warning(f"task {task}: {late} did not answer within {timeout}s (site_timeout): left out of "
                         "this step")
        return results

    def _aggregate(self, updates, fn):
        results = [FLModel(params=u.weights, params_type=ParamsType.FULL, meta={"client_name": u.site, N: u.n})
                   for u in updates]
        out = self.aggregate(results, aggregate_fn=lambda _: FLModel(params=fn(), params_type=ParamsType.FULL))
        return out.params or None

    def _threads_per_site(self, n_sites: int):
        """In the simulator every site shares this machine: each gets its share of the cores
        (N processes each using every core oversubscribe them). None in a real deployment."""
        if not self._simulated():
            return None
        return max(1, (os.cpu_count() or 1) // max(1, n_sites))

    def _simulated(self) -> bool:
        try:
            from nvflare.private.fed.simulator.simulator_server import SimulatorServerEngine
        except ImportError:
            return False
        return isinstance(self.fl_ctx.get_engine(), SimulatorServerEngine)

    def _handshake(self, clients, min_sites: int = 1) -> dict:
        """Every site's usable label summary, before round 0 (and, simulated, its share of the cores)."""
        meta = {PHASE: "summary", **self._task_meta()}
        # The first task also waits for each site's start-up (loading and validating its whole
        # datalist), far longer than a round on a large dataset: at least the default timeout.
        timeout = max(self._site_timeout, DEFAULT_SITE_TIMEOUT) if self._site_timeout else 0
        results = self._wait("train", clients, FLModel(params={}, meta=meta), timeout)
        if self._fatal(results):
            return None
        summaries = {r.meta["client_name"]: r.meta[SUMMARY] for r in results if SUMMARY in (r.meta or {})}
        missing = sorted(set(clients) - set(summaries))
        if missing:
            why = {r.meta.get("client_name"): str(r.meta[REASON])[:300] for r in results
                   if isinstance(r.meta, dict) and r.meta.get(REASON)}
            self.panic(f"no label summary from {missing}: the site failed at start-up"
                       + (f" ({why})" if why else ""))
            return None
        ours = versions()
        for r in results:
            theirs = r.meta.get(VERSIONS)
            theirs = theirs if isinstance(theirs, dict) else {}
            differ = {k: theirs.get(k) for k in ours if theirs.get(k) != ours[k]}
            if differ:
                self.panic(f"{r.meta['client_name']} runs {differ}, the server {ours}: install the startup kit's "
                           "requirements.txt at every site")
                return None
        # the same versions: a summary that fails the screen is broken or hostile, not another format; nothing
        # a site sent before round 0 reaches a method unscreened. That site is left out of the run, with its
        # reason; the others go on if there are enough of them.
        for site in sorted(summaries):
            why = check_summary(summaries[site])
            if why:
                self.warning(f"{site} is left out of this run: its label summary: {why}")
                del summaries[site]
        if len(summaries) < max(1, min_sites):
            self.panic(f"{len(summaries)} site(s) with a usable label summary, fewer than min_sites={min_sites}: "
                       "no round starts")
            return None
        why = check_summaries(summaries)  # what the sites must share: no one site can be told wrong
        if why:
            self.panic(f"{why}: no round starts")
            return None
        return summaries

    def _connected(self, targets) -> list:
        """The targets nvflare has not declared dead: a site lost mid-run (killed, network down)
        is left out of later tasks instead of each task waiting for the dead-client check again."""
        gone = sorted(t for t in targets if self.get_client_disconnect_time(t))
        if gone:
            self.warning(f"{gone} not connected: left out of this task")
        return [t for t in targets if t not in gone]

    # ---------------------------------------------------------------- flow
    def _drill(self, point, rnd) -> None:
        """The server-kill drill: the server stops here, writing nothing more (what a killed server
        leaves on disk); the job is then resumed from its folder."""
        if f"{point}:{rnd}" in self._drills:
            self.warning(f"fault drill: the server dies at {point} of round {rnd}")
            raise _Stop()

    def run(self) -> None:
        try:
            self._run()
        except _Stop:
            return

    def _run(self) -> None:
        cfg = self._config()
        cfg.save(self._path(FILE))  # the run's own record of its configuration (fedlabels export --run reads it)
        self._drills = [f.split(":", 1)[1] for f in cfg.faults if f.split(":")[0] == SERVER]
        unknown = [d for d in self._drills if d.split(":")[0] not in DRILL_POINTS]
        if unknown:
            self.panic(f"faults: server drill {unknown[0]!r}: the points are {list(DRILL_POINTS)}")
            return
        self._run_token = f"{cfg.method}-{uuid.uuid4().hex[:12]}"
        self._transfer = cfg.transfer
        self._site_timeout = cfg.site_timeout or (0 if self._simulated() else DEFAULT_SITE_TIMEOUT)
        if self._site_timeout:
            self.info(f"a site has {self._site_timeout}s to answer each task (site_timeout)")
        server = methods.get(cfg.method).make_server(run_seed=cfg.seed, **cfg.server)
        model = self.load_model()
        if model is None:
            return
        sampled = self.sample_clients(self.num_clients)
        summaries = self._handshake(sampled, cfg.min_sites)
        if summaries is None:
            return
        clients = self._clients = [c for c in sampled if c in summaries]  # those with a usable summary
        try:  # what each site's noised label summary spent, once per run (fedlabels.privacy)
            for line in server_lines(summaries, required=bool(cfg.privacy)):
                self.info(line)
        except ValueError as e:
            self.panic(str(e))
            return
        write_json_atomic(self._path(SUMMARIES_FILE), summaries)
        task = next(iter(summaries.values()))["task"]
        key = cfg.metric(task)
        why = methods.get(cfg.method).refusal(summaries)  # a site the method cannot serve: named before round 0
        if why:
            self.panic(f"method {cfg.method}: {why}")
            return
        try:
            notes = server.setup(summaries) or []
        except ValueError as e:  # the method cannot run on these sites (e.g. no labeled site)
            self.panic(f"method {cfg.method}: {e}")
            return
        for line in notes:
            self.info(f"method {cfg.method}: {line}")
        engine = RoundEngine(server, self._send, key_metric=key, min_sites=cfg.min_sites, aggregate=self._aggregate,
                             log=self._log, max_n=case_bounds(summaries), norm_ratio=NORM_RATIO)
        start = self.start_round
        if self.resume_from:
            model.params, start = self._resume(engine, cfg.method)
            self._resume_sites = set(summaries)
            self._save_state(engine, start, cfg.method, model.params)  # this folder can be resumed in turn
            self.save_model(model)  # the checkpoint's model, also when no round is left to run
        else:
            model.params = self._seeded_init(model.params, cfg.seed)
        self.info(f"method {cfg.method} client {cfg.client} server {cfg.server}; rounds {start}..{self.num_rounds - 1}; "
                  f"the sites keep their state under <FEDLABELS_STATE>/{self._run_token}/<site>")
        for rnd in range(start, self.num_rounds):
            if self.abort_signal.triggered:
                return
            t0 = time.time()
            self.current_round = rnd
            self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, rnd, private=True, sticky=False)
            self.event(AppEventType.ROUND_STARTED)
            received = dict(model.params)
            weights, record, best = engine.run_round(rnd, received, list(clients))
            if best is not None:
                self._best_weights = dict(best)  # into the checkpoint first; its file after
            model = self.update_model(model, FLModel(params=weights, params_type=ParamsType.FULL, meta={}))
            record["seconds"] = time.time() - t0
            self._drill("before_checkpoint", rnd)  # nothing of the round is written yet
            # The checkpoint first, then what a person reads: no file is ever ahead of it (a resumed run
            # writes the checkpoint's best model again).
            self._save_state(engine, rnd + 1, cfg.method, model.params)
            if best is not None:
                self._save_best(best)
                self.info(f"round {rnd}: new best {key}={engine.best:.4f} (the model the scoring sites "
                          f"{record['scored_by']} received)")
            self._log_round(record, key)
            self._drill("before_model", rnd)
            self.save_model(model)  # after the checkpoint: FL_global_model.pt is never ahead of it
            self._drill("between_rounds", rnd)
        final = self._cross_site_eval(model, key)
        _, is_best = engine.score_final(final, rounds=self.num_rounds)
        if is_best or not os.path.isfile(os.path.join(self.get_run_dir(), "app_server", "best_FL_global_model.pt")):
            self._save_best(dict(model.params))
        try:
            engine.check_progress()
        except NoProgress as e:
            write_json_atomic(self._path("progress.json"), {"next_round": self.num_rounds, "error": str(e)})
            self.panic(str(e))
            return
        self._save_state(engine, self.num_rounds, cfg.method, model.params)
        self.info(f"finished {cfg.method}: best mean {key} = {engine.best}")

    def _save_state(self, engine, next_round, method, weights):
        """The resume checkpoint (``fedlabels.checkpoint``), then ``progress.json`` from the same values."""
        write_checkpoint(self.get_run_dir(), next_round=next_round, method=method, run=self._run_token,
                         weights=weights, engine=engine.state_dict(), best_weights=self._best_weights)
        # best_round: the round at whose start the scoring sites validated the best model (the number of
        # rounds: the final model), best_scored_by: those sites (the model card's provenance)
        write_json_atomic(self._path("progress.json"), {"next_round": next_round, "best": engine.best, "method": method,
                                                        "run": self._run_token, "best_round": engine.best_round,
                                                        "best_scored_by": sorted(engine.best_scores)})

    def _resume(self, engine, method) -> tuple:
        """Global weights, server-rule and engine state, next round and run token of a previous run's
        checkpoint; its best model carried over. A checkpoint of another method is refused."""
        try:
            saved = read_checkpoint(self.resume_from, method, self.num_rounds)
        except ValueError as e:
            self.panic(f"resume_from: {e}")
            raise _Stop()
        engine.load_state_dict(saved["engine"])
        self._run_token = saved["run"]
        if saved["best_weights"] is not None:
            self._save_best(saved["best_weights"])
        self.info(f"resuming from {self.resume_from}: round {saved['next_round']}, best {engine.key_metric}="
                  f"{engine.best} (run {self._run_token})")
        return saved["weights"], saved["next_round"]

    def _cross_site_eval(self, model, key) -> dict:
        """The final global model validated at every site (per-class, label-aware); {site: key metric}."""
        # a site that has not trained since a resume loads its saved state first (FedBN's batch norm)
        resume = sorted(self._resume_sites & set(self._clients))
        self._resume_sites -= set(resume)
        data = FLModel(params=on_the_wire(model.params, self._transfer), params_type=ParamsType.FULL,
                       current_round=self.num_rounds, meta={RESUME: resume, **self._task_meta()})
        results = self._wait("validate", list(self._clients), data)
        per_site, scores = {}, {}
        for r in results:  # what a site sent: only numbers are kept (clean_metrics), never passed on as is
            u = to_update(r)
            metrics, left = clean_metrics(u.metrics)
            for why in left:
                self.warning(f"final evaluation {u.site}: {why}: left out")
            if metrics:
                evaluation = u.meta.get("evaluation")
                try:
                    json.dumps(evaluation)
                except (TypeError, ValueError):
                    evaluation = None
                per_site[u.site] = evaluation if isinstance(evaluation, dict) else metrics
            if key in metrics:
                scores[u.site] = metrics[key]
        write_json_atomic(self._path("cross_site_eval.json"), per_site)
        for site, value in sorted(scores.items()):
            self.info(f"final global model at {site}: {key}={value:.4f}")
        return scores

    def _log_round(self, record, key):
        rnd, seconds = record["round"], record["seconds"]
        for site, m in sorted(record["sites"].items()):
            vals = " ".join(f"{k}={v:.4f}" for k, v in m.items() if "/" not in k and isinstance(v, float))
            self.info(f"round {rnd} {site}: n={m['n']} {vals}")
        self.info(f"round {rnd} done in {seconds:.1f}s; mean {key} of received model = {number(record[f'mean_{key}'])}"
                  + (f"; dropped {sorted(record['dropped'])}" if record["dropped"] else "")
                  + (f"; abstained {record['abstained']}" if record["abstained"] else ""))
        self._append_metrics(record)
        tb = self._tb()
        for site, m in record["sites"].items():
            for k, v in m.items():
                if isinstance(v, (int, float)) and v is not None:
                    tb.add_scalar(f"{site}/{k}", v, rnd)
        if record[f"mean_{key}"] is not None:
            tb.add_scalar(f"global/mean_{key}", record[f"mean_{key}"], rnd)
        tb.flush()


def _flag(value) -> bool:
    """A site-sent yes/no: only a real boolean counts (bool() of an array raises, of a string is True)."""
    return isinstance(value, (bool, np.bool_)) and bool(value)


def to_update(result) -> Update:
    """One site's reply (an ``FLModel``) as an ``Update``, taking nothing on trust: nothing here
    converts or raises on what the site sent (``int(n)`` on a non-number would stop the job); the
    engine screens it (``fedlabels.engine.screen_update``) and drops what is unusable with a reason.
    A site that reports it cannot run (its start-up failed after a restart) is dropped from the step
    with that reason, not allowed to stop the federation."""
    meta = dict(result.meta) if isinstance(result.meta, dict) else {}
    site = str(meta.get("client_name", "?"))
    params = result.params if result.params is not None else {}
    metrics = result.metrics if result.metrics is not None else {}
    if meta.get(FATAL):
        return Update(site, {}, None, meta, metrics, {}, True, f"the site cannot run: {str(meta[FATAL])[:300]}")
    reason = meta.get(REASON)
    return Update(site, params, meta.get(N), meta, metrics, meta.pop(EXTRAS, None) if EXTRAS in meta else {},
                  _flag(meta.get(ABSTAIN)), str(reason)[:300] if reason else "")


def case_bounds(summaries: dict) -> dict:
    """Per site, the largest case count (``n``) an update may carry: the cases the site declared at
    the handshake (an update's n counts the cases of one local epoch, ``ClientRule.train``). A site
    that noised its summary (the job's privacy option, or the hospital's own in its privacy.json)
    declared noised cases: the bound allows 6 standard deviations of the noise its report states
    (exceeded with probability ~1e-9)."""
    out = {}
    for site, summary in summaries.items():
        cases = summary.get("cases") if isinstance(summary, dict) else None
        report = summary.get(PRIVACY_REPORT) if isinstance(summary, dict) else None
        slack = 0
        if isinstance(report, dict):  # its numbers are checked at the handshake (profile.check_summary)
            slack = int(np.ceil(6 * abs(float(report["noise_multiplier"])) * abs(float(report["clip"]))))
        if isinstance(cases, int) and not isinstance(cases, bool) and cases >= 0:
            out[site] = cases + slack
    return out


def on_the_wire(params: dict, transfer: str) -> dict:
    """The arrays as they are sent. Half precision goes through nvflare's ModelQuantizer
    filters, which take float arrays only: integer buffers (BatchNorm's
    num_batches_tracked, unused with a momentum) then stay where they are; the
    server keeps its global value of a key no update sent, and a site its own.
    A new dict, so the filter never changes the caller's."""
    if transfer == "float32":
        return params
    return {k: v for k, v in params.items() if np.asarray(v).dtype.kind == "f"}


class _Stop(Exception):
    """The job was aborted or a site reported a fatal error: leave the run loop."""
