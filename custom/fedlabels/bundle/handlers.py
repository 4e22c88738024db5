"""Ignite metrics and handlers the bundles use (``bundles/*/configs``).

* ``LabelAwareMetric`` -- the label-aware metrics of ``fedlabels.metrics`` as an
  ignite metric: multi-label entries of -1 are skipped, classes without
  positives/negatives are reported as undefined, never averaged in.
* ``MetricsJSONWriter`` -- writes an evaluator's metrics (with per-class
  details) to a JSON file when it completes.
* ``PredictionCSVWriter`` -- one CSV row per input image: path, per-class
  probability, and the decision at each class's threshold (multi-label) or the
  most probable class (multi-class), with a header of class names.
* ``EpochSummary`` -- one readable log line per epoch (loss, images/s, ETA).
* ``BestMetricCheckpointSaver`` -- MONAI's ``CheckpointSaver`` that does not
  save a "best" model at an epoch whose key metric is undefined (NaN).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from ignite.engine import Engine, Events
from ignite.metrics import Metric
from monai.handlers import CheckpointSaver

from .. import metrics as fm

logger = logging.getLogger("fedlabels.bundle")

MAIN_METRIC = {"multilabel": "auroc", "multiclass": "accuracy", "segmentation": "dice"}


def _stack(values) -> np.ndarray:
    if isinstance(values, (list, tuple)):
        values = [torch.as_tensor(v) for v in values]
        values = torch.stack(values) if values else torch.zeros(0)
    return torch.as_tensor(values).detach().float().cpu().numpy()


class LabelAwareMetric(Metric):
    """Accumulate predictions and labels over an epoch; compute ``fedlabels.metrics``.

    ``output_transform`` must give ``(pred, label)`` -- batches or lists of
    decollated items. ``pred`` holds probabilities (classification) or a binary
    mask (segmentation); apply the activation / threshold in the evaluator's
    postprocessing.

    The metric's value is the macro ``main`` score (default: AUROC for
    multi-label, accuracy for multi-class, Dice for segmentation). The other
    macro scores go into ``engine.state.metrics`` as ``<prefix><score>``; the
    full result (per class, undefined classes) into
    ``engine.state.metric_details[name]``. An undefined main score is NaN and
    logged with the reason.
    """

    def __init__(self, task: str, classes=None, main: str | None = None, prefix: str = "val_",
                 output_transform=lambda x: x, device="cpu"):
        if task not in MAIN_METRIC:
            raise ValueError(f"unknown task {task!r}; expected one of {list(MAIN_METRIC)}")
        self.task, self.classes = task, list(classes or [])
        self.main, self.prefix = main or MAIN_METRIC[task], prefix
        self.details: dict = {}
        super().__init__(output_transform=output_transform, device=device)

    def reset(self) -> None:
        self._preds, self._labels = [], []

    def update(self, output) -> None:
        pred, label = output
        pred, label = _stack(pred), _stack(label)
        if self.task == "segmentation":
            n = pred.shape[0]
            self._preds.append(pred.reshape(n, -1) > 0.5)
            self._labels.append(label.reshape(n, -1) > 0.5)
        else:
            self._preds.append(pred.reshape(pred.shape[0], -1))
            self._labels.append(label.reshape(label.shape[0], -1))

    def compute(self) -> float:
        if not self._preds:
            self.details = {"n_cases": 0}
            logger.warning("LabelAwareMetric: no cases were evaluated")
            return float("nan")
        preds, labels = np.concatenate(self._preds), np.concatenate(self._labels)
        n = int(preds.shape[0])
        if self.task == "multilabel":
            result = fm.multilabel_metrics(preds, labels, self.classes)
        elif self.task == "multiclass":
            result = fm.multiclass_metrics(preds, labels.reshape(-1).astype(np.int64), self.classes)
        else:
            result = fm.segmentation_metrics(preds, labels)
        result["n_cases"] = n
        self.details = result
        value = result.get(self.main)
        if value is None:
            why = f"undefined classes {result.get('undefined')}" if result.get("undefined") else "no labeled cases"
            logger.warning(f"{self.main} is undefined on these {n} cases ({why}); reported as NaN")
            return float("nan")
        return float(value)

    def completed(self, engine: Engine, name: str) -> None:
        engine.state.metrics[name] = self.compute()
        for key, value in self.details.items():
            if key != self.main and isinstance(value, float):
                engine.state.metrics[f"{self.prefix}{key}"] = value
        details = getattr(engine.state, "metric_details", None)
        if isinstance(details, dict):
            details[name] = self.details


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (np.floating, float)):
        return None if math.isnan(float(value)) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


class MetricsJSONWriter:
    """On ``COMPLETED``, write ``{"metrics": ..., "details": ..., **info}`` to ``filepath``.

    NaN (undefined) scores are written as ``null``.
    """

    def __init__(self, filepath: str, info: dict | None = None, include_per_case: bool = False):
        self.filepath, self.info, self.include_per_case = str(filepath), dict(info or {}), include_per_case

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        details = dict(getattr(engine.state, "metric_details", {}) or {})
        if not self.include_per_case:
            details = {k: {kk: vv for kk, vv in v.items() if kk != "dice_per_case"} if isinstance(v, dict) else v
                       for k, v in details.items()}
        out = dict(self.info)
        out["metrics"] = {k: v for k, v in engine.state.metrics.items() if not isinstance(v, dict)}
        out["details"] = details
        out["n_iterations"] = int(engine.state.iteration)
        path = Path(self.filepath)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(_jsonable(out), indent=1))
        os.replace(tmp, path)
        shown = ", ".join(f"{k}={v:.4f}" for k, v in out["metrics"].items() if isinstance(v, float))
        logger.info(f"metrics ({shown}) written to {path}")


class PredictionCSVWriter:
    """Write ``image,<class 1>,<class 2>,...`` rows of per-class probabilities.

    ``thresholds`` (class -> cut, from the exported bundle's metadata) adds a
    ``<class>_positive`` column per class, 1 when the probability reaches the
    cut, empty for a class without a threshold; ``decision="argmax"``
    (multi-class) adds ``predicted``, the most probable class. Filenames come
    from the input image's metadata (``filename_or_obj``). Rows are written in
    the order the evaluator sees the images, to a temporary name renamed when
    the evaluator completes.
    """

    def __init__(self, filepath: str, class_names, image_key: str = "image", pred_key: str = "pred",
                 thresholds: dict | None = None, decision: str | None = None):
        self.filepath, self.class_names = str(filepath), [str(c) for c in class_names]
        self.image_key, self.pred_key = image_key, pred_key
        self.thresholds = dict(thresholds or {})
        unknown = sorted(set(self.thresholds) - set(self.class_names))
        if unknown:
            raise ValueError(f"decision thresholds for unknown classes {unknown}; classes are {self.class_names}")
        if decision not in (None, "argmax"):
            raise ValueError(f"decision must be None or 'argmax', not {decision!r}")
        self.decision = decision
        self._rows: list = []

    def header(self) -> list:
        cols = ["image"] + self.class_names
        if self.thresholds:
            cols += [f"{c}_positive" for c in self.class_names]
        if self.decision == "argmax":
            cols.append("predicted")
        return cols

    def row(self, name: str, probs: list) -> list:
        out = [str(name)] + [f"{p:.6f}" for p in probs]
        if self.thresholds:
            cuts = [self.thresholds.get(c) for c in self.class_names]
            out += ["" if t is None else str(int(p >= t)) for p, t in zip(probs, cuts)]
        if self.decision == "argmax":
            out.append(self.class_names[int(np.argmax(probs))])
        return out

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._reset)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._collect)
        engine.add_event_handler(Events.COMPLETED, self._write)

    def _reset(self, engine: Engine) -> None:
        self._rows = []

    def _collect(self, engine: Engine) -> None:
        batch, output = engine.state.batch, engine.state.output
        if isinstance(output, dict):  # not decollated: split the batch
            preds = list(output[self.pred_key])
            images = list(batch[self.image_key])
        else:
            preds = [o[self.pred_key] for o in output]
            images = [b[self.image_key] for b in batch]
        for img, pred in zip(images, preds):
            meta = getattr(img, "meta", {}) or {}
            name = meta.get("filename_or_obj", "")
            probs = torch.as_tensor(pred).detach().float().cpu().reshape(-1).tolist()
            if len(probs) != len(self.class_names):
                raise ValueError(f"{name}: {len(probs)} outputs for {len(self.class_names)} class names")
            self._rows.append(self.row(name, probs))

    def _write(self, engine: Engine) -> None:
        path = Path(self.filepath)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(self.header())
            w.writerows(self._rows)
        os.replace(tmp, path)
        logger.info(f"{len(self._rows)} predictions written to {path}")


class EpochSummary:
    """One log line per training epoch: mean loss, images/s, elapsed time and ETA.

    ``loss_key`` names the loss in the trainer's output dict.
    """

    def __init__(self, loss_key: str = "loss", name: str = "train"):
        self.loss_key, self.name = loss_key, name

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._iteration)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)

    def _started(self, engine: Engine) -> None:
        self._t0 = time.perf_counter()
        self._first_epoch = engine.state.epoch

    def _epoch_started(self, engine: Engine) -> None:
        self._t_epoch, self._loss, self._n, self._images = time.perf_counter(), 0.0, 0, 0

    def _iteration(self, engine: Engine) -> None:
        out = engine.state.output
        item = out[0] if isinstance(out, list) and out else out
        loss = item.get(self.loss_key) if isinstance(item, dict) else None
        if loss is not None:  # summed as a tensor: no device sync per iteration
            self._loss = self._loss + torch.as_tensor(loss).detach()
            self._n += 1
        batch = engine.state.batch
        images = batch.get("image") if isinstance(batch, dict) else batch
        self._images += len(images) if hasattr(images, "__len__") else 0

    def _epoch_completed(self, engine: Engine) -> None:
        now = time.perf_counter()
        dt = max(now - self._t_epoch, 1e-9)
        done = engine.state.epoch - self._first_epoch
        left = engine.state.max_epochs - engine.state.epoch
        eta = (now - self._t0) / max(done, 1) * left
        loss = f"{float(self._loss) / self._n:.4f}" if self._n else "n/a"
        logger.info(f"{self.name} epoch {engine.state.epoch}/{engine.state.max_epochs}: loss {loss}, "
                    f"{self._images / dt:.1f} images/s, {dt:.1f} s, ETA {eta:.0f} s")


class BestMetricCheckpointSaver(CheckpointSaver):
    """``monai.handlers.CheckpointSaver`` whose key-metric checkpoint skips undefined (NaN) epochs.

    Ignite keeps the first checkpoint whatever its score and then compares
    ``new > best``, which is never true against NaN: an undefined key metric
    at the first validation (a small site without positives for its classes)
    would freeze ``model.pt`` at that epoch. Here such epochs are skipped and
    logged; ``model.pt`` is the best epoch with a defined metric, or absent.
    """

    def __init__(self, *args, key_metric_name: str | None = None, **kwargs):
        super().__init__(*args, key_metric_name=key_metric_name, **kwargs)
        self._metric_name = key_metric_name

    def metrics_completed(self, engine: Engine) -> None:
        name = self._metric_name or getattr(engine.state, "key_metric_name", None)
        value = engine.state.metrics.get(name) if name else None
        if isinstance(value, float) and math.isnan(value):
            logger.warning(f"epoch {engine.state.epoch}: {name} is undefined; no best-model checkpoint this epoch")
            return
        super().metrics_completed(engine)


__all__ = ["LabelAwareMetric", "MetricsJSONWriter", "PredictionCSVWriter", "EpochSummary", "BestMetricCheckpointSaver"]
