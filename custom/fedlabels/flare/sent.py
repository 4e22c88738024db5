"""A site's audit record of what it sends: an nvflare task-result filter.

Two places record. The job's own ``SentRecord``, last of the job's result
filters, sees each reply as it leaves, after every filter before it (the
site's own privacy filters, then the job's: FedBN's ``ExcludeVars``,
half-precision ``ModelQuantizer``), so its record shows what the server
receives: ``FEDLABELS_SENT`` (default ``./fedlabels_sent``) ``/<site>.jsonl``.
The site's own ``SentRecord(stage="site")``, in the privacy scope that
``fedlabels provision`` writes into every hospital kit (``local/privacy.json``),
records every job's replies whatever the job's configuration says, to
``<site>.site.jsonl``. nvflare runs a site's scope filters before the job's,
so this record shows a reply before the job's filters; the filters
fedlabels' production jobs name only drop weights or lower their precision,
so every weight they let leave is in it. One JSON line
per reply: task, round, the server's run token (job stage only), every
weight's shape and dtype (never values), the metadata and metric fields with
their values, and the bytes of the arrays. The filter changes nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from nvflare.apis.dxo import DataKind, MetaKey, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AppConstants

from .controller import FATAL, RUN, SUMMARY


def _describe(value):
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return {"shape": list(value.shape), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def _nbytes(value) -> int:
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def entry(task: str, shareable: Shareable, rnd=None, run=None) -> dict:
    """One record line for a reply as nvflare sends it (task = nvflare's task name)."""
    try:
        dxo = from_shareable(shareable)
    except (ValueError, TypeError):  # an error reply carries no DXO
        dxo = None
    meta = dict(dxo.meta) if dxo is not None else {}
    if dxo is not None and dxo.data_kind == DataKind.METRICS:
        params, metrics = {}, dxo.data or {}
    else:
        params = (dxo.data if dxo is not None else None) or {}
        # nvflare carries the metrics of a reply with weights in its DXO meta: recorded once, as metrics
        metrics = meta.pop(MetaKey.INITIAL_METRICS, None) or {}
    # the set-up handshake and a start-up failure travel as "train" tasks: named by what they carry
    label = "fatal" if FATAL in meta else "summary" if SUMMARY in meta else task
    out = {"time": time.time(), "run": run, "task": label, "round": rnd,
           "weights": {k: _describe(v) for k, v in params.items()},
           "meta": _describe(meta), "metrics": _describe(metrics),
           "array_bytes": _nbytes(params) + _nbytes(meta)}
    if dxo is None:
        out["return_code"] = shareable.get_return_code()
    return out


STAGES = {"job": ".jsonl", "site": ".site.jsonl"}


class SentRecord(Filter):
    """Appends each reply to the site's audit record and passes it on unchanged."""

    def __init__(self, stage: str = "job"):
        """
        Args:
            stage: "job" (a job's filter: ``<site>.jsonl``) or "site" (the site's privacy scope:
                ``<site>.site.jsonl``; nvflare sends a scope's filters no events, so the round is the reply's own).
        """
        super().__init__()
        if stage not in STAGES:
            raise ValueError(f"SentRecord stage {stage!r}: one of {sorted(STAGES)}")
        self.stage = stage
        self._task = {}

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        # The reply carries neither round nor run token: note them from the task it answers.
        if event_type == EventType.BEFORE_TASK_EXECUTION:
            task = fl_ctx.get_prop(FLContextKey.TASK_DATA)
            self._task = {"rnd": None, "run": None}
            if not isinstance(task, Shareable):
                return
            self._task["rnd"] = task.get_header(AppConstants.CURRENT_ROUND)
            try:
                self._task["run"] = from_shareable(task).get_meta_prop(RUN)
            except (ValueError, TypeError):
                pass

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        site = fl_ctx.get_identity_name()
        path = Path(os.environ.get("FEDLABELS_SENT", "fedlabels_sent")) / f"{site}{STAGES[self.stage]}"
        task = self._task or {"rnd": shareable.get_header(AppConstants.CURRENT_ROUND)}
        line = entry(fl_ctx.get_prop(FLContextKey.TASK_NAME), shareable, **task)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        return shareable
