"""A federated run's server folder, read in one place: what it trained with and what it left.

The folder is nvflare's server run folder (``WORKSPACE/server/<job>`` in the simulator, the job's
``workspace`` in a deployment): ``fedlabels.json`` (the ``RunConfig``), ``progress.json``, one line of
``metrics.jsonl`` per round, ``label_summaries.json``, and the global models under ``app_server/``:
``FL_global_model.pt`` (the last) and ``best_FL_global_model.pt`` (the best on the sites' validation
data). ``fedlabels export``, ``fedlabels report``, ``fedlabels bench --engine flare`` and the demo read
runs through ``Run``; the controller writes them (fedlabels.flare.controller, fedlabels.checkpoint).
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

MODELS = {"best": "best_FL_global_model.pt", "last": "FL_global_model.pt"}


class Run:
    def __init__(self, folder):
        self.folder = Path(folder)

    @cached_property
    def config(self):
        """The run configuration (``fedlabels.config.RunConfig``)."""
        from .config import FILE, RunConfig

        # the controller writes it into the run folder (a production job carries it in its configuration
        # only); a simulator job also has the job's copy in app_server/custom
        for path in (self.folder / FILE, self.folder / "app_server" / "custom" / FILE):
            if path.is_file():
                return RunConfig.load(path)
        raise FileNotFoundError(f"{self.folder}: not a fedlabels run's server folder (no {FILE})")

    def model_path(self, which: str = "best") -> Path:
        if which not in MODELS:
            raise ValueError(f"which model: {sorted(MODELS)}, not {which!r}")
        return self.folder / "app_server" / MODELS[which]

    def model(self, which: str = "best") -> dict:
        """The global model's state dict (name -> tensor)."""
        from .checkpoint import load_state_dict

        return load_state_dict(self.model_path(which))

    @property
    def progress(self) -> dict:
        path = self.folder / "progress.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    @property
    def rounds(self) -> list:
        """One record per finished round (``metrics.jsonl``)."""
        path = self.folder / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def bundle(self, name=None) -> Path:
        """The bundle the run trained with: ``name`` when given, else the one its configuration names (from
        the job's custom folder, where it travelled, else the installed ones). Another bundle's network
        would not load the run's weights, or would score a different network."""
        from .bundle.locate import bundle_path

        if name:
            return bundle_path(name)
        try:
            cfg = self.config
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e}; name the bundle with --bundle") from None
        return bundle_path(cfg.bundle, self.folder / "app_server" / "custom")

    def provenance(self, ckpt) -> dict:
        """What the folder says about the model in ``ckpt``: method, rounds, best or last, its sites."""
        import os

        cfg, progress, rounds = self.config, self.progress, self.rounds
        name = Path(str(ckpt)).name if isinstance(ckpt, (str, os.PathLike)) else ""
        sites = sorted({s for r in rounds for s in r.get("sites", {})}) or None
        kind = {MODELS["best"]: "best global model (chosen on the sites' validation data)",
                MODELS["last"]: "last global model"}.get(name, name or "in-memory state dict")
        return {"method": cfg.method, "rounds": progress.get("next_round"), "checkpoint_kind": kind,
                "model_after_rounds": _model_after_rounds(name, rounds, progress),
                "best_validation_score": progress.get("best"),
                **({"best_scored_by": progress["best_scored_by"]} if name == MODELS["best"]
                   and progress.get("best_scored_by") else {}),
                "sites": sites, "run": str(self.folder.resolve())}


def _model_after_rounds(name: str, rounds: list, progress: dict):
    """How many rounds the shipped global model has been through (the "round" a DICOM result names):
    the last model, all of them; the best, the round whose sites validated it at its start (they
    validate the model they receive), else the final model (also when no model ever scored: the
    controller then saves the final one as the best); None for another file."""
    done = progress.get("next_round")
    if name == MODELS["last"] or (name == MODELS["best"] and progress.get("best") is None):
        return done
    if name != MODELS["best"]:
        return None
    if progress.get("best_round") is not None:  # recorded by the controller (runs since it keeps it)
        return progress["best_round"]
    for record in rounds:
        scores = [v for k, v in record.items() if k.startswith("mean_")]
        if scores and scores[0] == progress["best"]:
            return record["round"]
    return done  # no round's received model scored the best: the final model did
