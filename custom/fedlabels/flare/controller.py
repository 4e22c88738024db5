"""One controller for every registered method (nvflare ``BaseFedAvg``).

Each round: broadcast the global model (plus the method's extras) to each
group of the method's plan, screen the updates (non-finite values, wrong keys
or shapes are dropped with a logged reason), hand the rest to the method's
server rule, never accept a non-finite global model, and persist it. Sites
report validation metrics of the model they received, so the round's best
model is chosen on site validation data, never on test data.

Outputs in the server's run folder: ``FL_global_model.pt`` (last, written by
the persistor), ``best_FL_global_model.pt``, ``metrics.jsonl`` (one line per
round: per-site losses and per-class validation metrics), ``progress.json``
(for resuming), ``cross_site_eval.json`` and TensorBoard events under ``tb/``.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.base_fedavg import BaseFedAvg

from .. import methods
from ..methods.base import Update
from ..profile import write_json_atomic

FATAL = "fatal_error"


def screen_update(params: dict, reference: dict) -> str | None:
    """Why an update must be dropped, or None when it is usable."""
    if not params:
        return "empty update"
    unknown = sorted(set(params) - set(reference))
    if unknown:
        return f"unknown keys {unknown[:3]}"
    for key, value in params.items():
        arr = np.asarray(value)
        if arr.shape != np.shape(reference[key]):
            return f"shape of {key} is {arr.shape}, expected {np.shape(reference[key])}"
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"non-finite values in {key}"
    return None


def _finite(weights: dict) -> bool:
    return all(np.isfinite(np.asarray(v)).all() for v in weights.values() if np.asarray(v).dtype.kind == "f")


class FedLabelsController(BaseFedAvg):
    def __init__(self, *args, method: str = "fedavg", method_options: dict | None = None,
                 key_metric: str = "val_auroc", min_sites: int = 1, resume_from: str = "", seed: int = 0, **kwargs):
        """
        Args:
            method: a name registered in ``fedlabels.methods``.
            method_options: the method's named options (checked before the first round).
            key_metric: the validation metric (mean over sites) that picks the best model.
            min_sites: fewest usable updates a round needs to change the global model.
            resume_from: a previous run's server folder (WS/server/simulate_job: progress.json and
                app_server/FL_global_model.pt): training continues from its last global model and round.
            seed: initialises the global model (the persistor's own init is unseeded).
        """
        # A crashed site is dropped from the round (min_sites decides if the round counts).
        kwargs.setdefault("ignore_result_error", True)
        super().__init__(*args, **kwargs)
        self.method, self.method_options = method, dict(method_options or {})
        self.key_metric, self.min_sites, self.resume_from, self.seed = key_metric, min_sites, resume_from, seed

    # ---------------------------------------------------------------- helpers
    def _write(self, name, data):
        write_json_atomic(os.path.join(self.get_run_dir(), name), data)

    def _append_metrics(self, record):
        path = os.path.join(self.get_run_dir(), "metrics.jsonl")
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        lines = [line for line in lines if json.loads(line)["round"] != record["round"]]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(lines + [json.dumps(record)]) + "\n")
        os.replace(tmp, path)

    def _tb(self):
        if not hasattr(self, "_writer"):
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(os.path.join(self.get_run_dir(), "tb"))
        return self._writer

    def _save_best(self, model: FLModel):
        ml = make_model_learnable(weights=model.params, meta_props=model.meta)
        self.fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, ml, private=True, sticky=True)
        self.event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE)

    def _load_resume(self, model: FLModel) -> tuple:
        """Last global weights, next round and best score of a previous run."""
        import torch

        folder = self.resume_from
        ckpt, progress = os.path.join(folder, "app_server", "FL_global_model.pt"), os.path.join(folder, "progress.json")
        if not (os.path.isfile(ckpt) and os.path.isfile(progress)):
            self.panic(f"resume_from={folder}: expected a previous run's server folder with progress.json and "
                       "app_server/FL_global_model.pt")
            return model, 0, None
        state = torch.load(ckpt, map_location="cpu", weights_only=False)["model"]
        params = {k: np.asarray(v.cpu().numpy() if hasattr(v, "cpu") else v) for k, v in state.items()}
        info = json.load(open(progress))
        self.info(f"resuming from {folder}: round {info['next_round']}, best {self.key_metric}={info.get('best')}")
        return FLModel(params=params, params_type=ParamsType.FULL, meta=model.meta), info["next_round"], info.get("best")

    def _seeded_init(self, params: dict) -> dict:
        """Re-initialise the persistor's network under ``seed`` so runs repeat exactly."""
        net = getattr(self.persistor, "model", None)
        if net is None:
            return params
        import torch

        from ..nets import rebuild

        torch.manual_seed(self.seed)
        return {k: v.detach().cpu().numpy() for k, v in rebuild(net).state_dict().items()}

    def _fatal(self, results) -> bool:
        for r in results:
            if (r.meta or {}).get(FATAL):
                self.panic(f"{r.meta.get('client_name')}: {r.meta[FATAL]}")
                return True
        return False

    def _updates(self, results, reference, round) -> list:
        updates = []
        for r in results:
            site = (r.meta or {}).get("client_name", "?")
            why = screen_update(r.params, reference)
            if why:
                self.warning(f"round {round} {site}: update dropped: {why}")
                continue
            meta = dict(r.meta)
            updates.append(Update(site, r.params, int(meta.get("n", 1)), meta, dict(r.metrics or {})))
        return updates

    # ---------------------------------------------------------------- flow
    def run(self) -> None:
        method = methods.get(self.method)
        server = method.make_server(**self.method_options)
        model = self.load_model()
        if model is None:
            return
        start, best = self.start_round, None
        if self.resume_from:
            model, start, best = self._load_resume(model)
        else:
            model.params = self._seeded_init(model.params)
        self.info(f"method {self.method} {self.method_options}; rounds {start}..{self.num_rounds - 1}")
        previous = None  # the global model the sites validate at the start of this round
        for rnd in range(start, self.num_rounds):
            if self.abort_signal.triggered:
                return
            t0 = time.time()
            self.current_round = rnd
            self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, rnd, private=True, sticky=False)
            self.event(AppEventType.ROUND_STARTED)
            clients = self.sample_clients(self.num_clients)
            record = {"round": rnd, "sites": {}, "dropped": []}
            val_scores = []
            for group in server.plan(rnd, clients) if hasattr(server, "plan") else [clients]:
                data = FLModel(params=model.params, params_type=ParamsType.FULL, current_round=rnd,
                               total_rounds=self.num_rounds, meta={"extras": server.extras(rnd)})
                results = self.send_model_and_wait(task_name="train", targets=group, data=data)
                if self.abort_signal.triggered or self._fatal(results):
                    return
                updates = self._updates(results, model.params, rnd)
                record["dropped"] += sorted({r.meta.get("client_name") for r in results} - {u.site for u in updates})
                for u in updates:
                    record["sites"][u.site] = {"n": u.n, **u.metrics}
                    if self.key_metric in u.metrics:
                        val_scores.append(u.metrics[self.key_metric])
                if len(updates) < self.min_sites:
                    self.warning(f"round {rnd}: {len(updates)} usable update(s) < min_sites={self.min_sites}; global model kept")
                    continue
                new = server.aggregate(updates, dict(model.params), rnd)
                if not _finite(new):
                    self.warning(f"round {rnd}: aggregate is not finite; global model kept")
                    continue
                model = self.update_model(model, FLModel(params=new, params_type=ParamsType.FULL, meta={}))
            # Sites scored the model they received: that is ``previous`` (the last round's result).
            score = float(np.mean(val_scores)) if val_scores else None
            record[f"mean_{self.key_metric}"] = score
            if score is not None and previous is not None and (best is None or score > best):
                best = score
                self._save_best(previous)
                self.info(f"round {rnd}: new best {self.key_metric}={score:.4f} (model of round {rnd - 1})")
            self.save_model(model)
            # A snapshot: update_model() changes the FLModel it is given in place.
            previous = FLModel(params=dict(model.params), params_type=ParamsType.FULL, meta={})
            self._log_round(record, time.time() - t0)
            self._write("progress.json", {"next_round": rnd + 1, "best": best, "method": self.method})
        final = self._cross_site_eval(model)
        if final is not None and previous is not None and (best is None or final > best):
            self._save_best(model)
            best = final
        self._write("progress.json", {"next_round": self.num_rounds, "best": best, "method": self.method})
        self.info(f"finished {self.method}: best mean {self.key_metric} = {best}")

    def _cross_site_eval(self, model):
        """The final global model validated at every site (per-class, label-aware)."""
        results = self.send_model_and_wait(task_name="validate", data=FLModel(params=model.params, params_type=ParamsType.FULL,
                                                                              current_round=self.num_rounds))
        per_site = {r.meta.get("client_name"): r.meta.get("evaluation", r.metrics) for r in results if r.metrics}
        self._write("cross_site_eval.json", per_site)
        scores = [r.metrics[self.key_metric] for r in results if r.metrics and self.key_metric in r.metrics]
        for site, m in sorted(per_site.items()):
            self.info(f"final global model at {site}: {self.key_metric}={m.get(self.key_metric.removeprefix('val_'))}")
        return float(np.mean(scores)) if scores else None

    def _log_round(self, record, seconds):
        rnd = record["round"]
        for site, m in sorted(record["sites"].items()):
            vals = " ".join(f"{k}={v:.4f}" for k, v in m.items() if "/" not in k and isinstance(v, float))
            self.info(f"round {rnd} {site}: n={m['n']} {vals}")
        self.info(f"round {rnd} done in {seconds:.1f}s; mean {self.key_metric} of received model = "
                  f"{record[f'mean_{self.key_metric}']}" + (f"; dropped {record['dropped']}" if record["dropped"] else ""))
        record["seconds"] = seconds
        self._append_metrics(record)
        tb = self._tb()
        for site, m in record["sites"].items():
            for k, v in m.items():
                if isinstance(v, (int, float)):
                    tb.add_scalar(f"{site}/{k}", v, rnd)
        if record[f"mean_{self.key_metric}"] is not None:
            tb.add_scalar(f"global/mean_{self.key_metric}", record[f"mean_{self.key_metric}"], rnd)
        tb.flush()
