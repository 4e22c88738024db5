"""What an exported bundle tells the people who deploy it.

* decision thresholds chosen on validation data (multi-label: per class, the
  point of the ROC curve with the largest Youden index, i.e. the best balanced
  accuracy; segmentation: the probability cut with the best mean validation
  Dice; multi-class: none, the arg-max decides);
* test metrics per class with 95 % confidence intervals: AUROC by a
  stratified percentile bootstrap (positives and negatives resampled apart,
  ``scipy.stats.bootstrap``), sensitivity, specificity and accuracy by Wilson
  intervals (``scipy.stats.binomtest``), Dice by a percentile bootstrap of the
  per-case mean;
* the sites' label table (who annotated what), and the model card
  (``docs/README.md``) written from all of it.

Validation labels keep ``-1`` for classes a site does not annotate: a class's
threshold comes from the validation cases that annotate it, pooled over sites.
"""

from __future__ import annotations

import numpy as np
from scipy import stats
from sklearn.metrics import roc_auc_score, roc_curve

from ..metrics import dice_per_case
from ..profile import held_sites, load_scenario

CONFIDENCE = 0.95
SEG_GRID = np.round(np.linspace(0.05, 0.95, 19), 2)


# ---------------------------------------------------------------- data


def _predictions(net, transform, task: str, raw: list, device="cpu"):
    """Probabilities and labels of the labeled datalist items ``raw`` (None, None without any)."""
    from ..site import _loader, predict
    from . import data as bundle_data

    items = [bundle_data.bundle_item(i, task, labeled_only=True) for i in raw]
    items = [i for i in items if i is not None]
    if not items:
        return None, None
    return predict(net, _loader(items, transform, 32, False, 0), task, device)


# ----------------------------------------------------------- thresholds


def youden_threshold(y, p) -> float | None:
    """The probability cut that maximises sensitivity + specificity - 1 (None without both groups)."""
    y, p = np.asarray(y), np.asarray(p, dtype=np.float64)
    if (y == 1).sum() == 0 or (y == 0).sum() == 0:
        return None
    fpr, tpr, cuts = roc_curve(y, p)
    best = int(np.argmax(tpr - fpr))
    if tpr[best] - fpr[best] <= 0:  # no cut does better than chance: none is chosen
        return None
    return float(cuts[best])


def dice_threshold(probs, masks, grid=SEG_GRID) -> float | None:
    """The cut in ``grid`` with the best mean per-case Dice (ties: the cut nearest 0.5)."""
    if probs is None or len(probs) == 0:
        return None
    target = np.asarray(masks) > 0.5
    scores = [dice_per_case(np.asarray(probs) >= t, target).mean() for t in grid]
    best = max(range(len(grid)), key=lambda i: (round(scores[i], 12), -abs(grid[i] - 0.5)))
    return float(grid[best])


def choose_thresholds(task: str, probs, labels, classes) -> dict:
    """Per class decision threshold from validation predictions (None where it cannot be chosen)."""
    if task == "multiclass":
        return {}
    if probs is None:  # no validation case: no threshold can be chosen
        return {name: None for name in classes}
    if task == "segmentation":
        return {name: dice_threshold(probs[:, c], labels[:, c]) for c, name in enumerate(classes)}
    out = {}
    for c, name in enumerate(classes):
        keep = labels[:, c] >= 0
        out[name] = youden_threshold(labels[keep, c], probs[keep, c])
    return out


# -------------------------------------------------------- test metrics


def _ci(res) -> list:
    return [float(res.confidence_interval.low), float(res.confidence_interval.high)]


def auroc_ci(y, p, confidence=CONFIDENCE, n_resamples=2000, seed=0) -> list | None:
    """Stratified percentile bootstrap of the AUROC: positives and negatives are resampled
    apart, so every resample has both (AUROC = Mann-Whitney U / (n_pos n_neg))."""
    y, p = np.asarray(y), np.asarray(p, dtype=np.float64)
    pos, neg = p[y == 1], p[y == 0]
    if len(pos) < 2 or len(neg) < 2:
        return None

    def auc(a, b, axis=-1):
        return stats.mannwhitneyu(a, b, axis=axis).statistic / (a.shape[axis] * b.shape[axis])

    res = stats.bootstrap((pos, neg), auc, n_resamples=n_resamples, confidence_level=confidence,
                          method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    return _ci(res)


def proportion(k: int, n: int, confidence=CONFIDENCE) -> dict:
    """k of n with its Wilson interval (None when n is 0)."""
    if n == 0:
        return {"value": None, "ci": None, "n": 0}
    ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return {"value": k / n, "ci": [float(ci.low), float(ci.high)], "n": int(n)}


def mean_ci(values, confidence=CONFIDENCE, n_resamples=2000, seed=0) -> list | None:
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return None
    if np.all(values == values[0]):
        return [float(values[0])] * 2
    res = stats.bootstrap((values,), np.mean, n_resamples=n_resamples, confidence_level=confidence,
                          method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    return _ci(res)


def test_report(task: str, probs, labels, classes, thresholds: dict) -> dict:
    """Per-class test metrics with 95 % intervals, at the chosen thresholds."""
    per_class = {}
    if task == "segmentation":
        for c, name in enumerate(classes):
            cut = 0.5 if thresholds.get(name) is None else thresholds[name]
            dice = dice_per_case(probs[:, c] >= cut, labels[:, c] > 0.5)
            per_class[name] = {"dice": float(dice.mean()), "dice_ci": mean_ci(dice), "cases": len(dice),
                               "threshold": cut}
        return {"per_class": per_class, "confidence": CONFIDENCE, "cases": len(probs)}
    if task == "multiclass":
        y = labels.reshape(-1)
        pred = probs.argmax(1)
        for c, name in enumerate(classes):
            yc = (y == c).astype(int)
            per_class[name] = {
                "auroc": float(roc_auc_score(yc, probs[:, c])) if 0 < yc.sum() < len(yc) else None,
                "auroc_ci": auroc_ci(yc, probs[:, c]),
                "sensitivity": proportion(int(((pred == c) & (y == c)).sum()), int((y == c).sum())),
                "specificity": proportion(int(((pred != c) & (y != c)).sum()), int((y != c).sum())),
                "n_pos": int(yc.sum()), "n_neg": int(len(yc) - yc.sum())}
        return {"per_class": per_class, "accuracy": proportion(int((pred == y).sum()), len(y)),
                "confidence": CONFIDENCE, "cases": len(y)}
    for c, name in enumerate(classes):
        keep = labels[:, c] >= 0
        y, p = labels[keep, c], probs[keep, c]
        npos, nneg = int((y == 1).sum()), int((y == 0).sum())
        cut = thresholds.get(name)
        entry = {"auroc": float(roc_auc_score(y, p)) if npos and nneg else None, "auroc_ci": auroc_ci(y, p),
                 "n_pos": npos, "n_neg": nneg, "threshold": cut}
        if cut is not None:
            entry["sensitivity"] = proportion(int(((p >= cut) & (y == 1)).sum()), npos)
            entry["specificity"] = proportion(int(((p < cut) & (y == 0)).sum()), nneg)
        per_class[name] = entry
    return {"per_class": per_class, "confidence": CONFIDENCE, "cases": len(labels)}


# ------------------------------------------------------------- evidence


def label_table(summaries: dict, classes) -> dict:
    """Per site: training cases, and per class whether the site labels it (its declared profile) and
    the annotated and positive counts, from the sites' label summaries (``profile.label_summary``;
    ``noised`` when the run's privacy option sent them with noise)."""
    return {name: {"cases": s["cases"], "supervision": s["supervision"],
                   "labels": dict(zip(classes, map(bool, s.get("labeled_mask") or [a > 0 for a in s["annotated"]]))),
                   "annotated": dict(zip(classes, s["annotated"])), "positives": dict(zip(classes, s["positives"])),
                   "noised": "privacy" in s}
            for name, s in summaries.items()}


def evidence(net, bundle, data, classes, sites=None, summaries=None, image_size=None, device="cpu") -> dict:
    """Thresholds from the validation splits of ``sites`` (default: all the scenario's) and
    the test report of ``net`` on scenario ``data``; the label table from ``summaries`` (what
    the run's server received), else from the scenario's sites."""
    from .. import bundle as bundles

    held = held_sites(data, sites) or held_sites(data)  # the run's sites this folder holds, else all it holds
    scenario = load_scenario(data, sites=held)  # read once: validation splits and the test split, if any
    task = scenario.task
    if list(scenario.classes) != list(classes):
        raise ValueError(f"{data}: the scenario's classes {list(scenario.classes)} are not the bundle's {list(classes)}")
    size = {} if image_size is None else {"image_size": int(image_size)}  # the exported model's input size
    transform = bundles.read(bundle, data, class_names=list(classes), **size).get_parsed_content(
        "validate#preprocessing", instantiate=True)
    validation = [item for site in scenario.sites.values() for item in site.validation]
    vp, vl = _predictions(net, transform, task, validation, device)
    thresholds = choose_thresholds(task, vp, vl, classes)
    out = {"task": task, "scenario": scenario.name, "scenario_dir": str(scenario.root),
           "decision_thresholds": thresholds,
           "threshold_rule": {"multilabel": "Youden index on the pooled site validation cases that annotate the class",
                              "segmentation": "best mean Dice on the pooled site validation cases",
                              "multiclass": "none: the class with the highest probability"}[task],
           "validation_cases": 0 if vp is None else len(vp), "validation_sites": held,
           "label_table": label_table(summaries or {n: site.summary() for n, site in scenario.sites.items()}, classes),
           "label_table_source": "the run's label_summaries.json (as the server received them)" if summaries
           else f"the scenario's site folders ({scenario.root})"}
    tp, tl = _predictions(net, transform, task, scenario.test or [], device)  # None: no test split (a hospital's)
    out["test"] = None if tp is None else test_report(task, tp, tl, classes, thresholds)
    return out


# ----------------------------------------------------------- model card


def _fmt(v, ci=None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3f}" + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else "")


def limitations(meta: dict) -> list:
    """Known limitations the numbers show (one line each)."""
    classes, table = meta["class_names"], meta.get("training", {}).get("label_table") or {}
    out = []
    for name in classes:
        labelers = [s for s, row in table.items() if row["labels"].get(name)]
        if table and not labelers:
            out.append(f"`{name}`: no training site annotated it; its output is not learned from labels.")
        elif table and len(labelers) == 1 and len(table) > 1:
            out.append(f"`{name}`: only {labelers[0]} annotated it; the other sites' images taught it nothing "
                       f"about this finding, and its performance may not carry to other hospitals.")
    thresholds = meta.get("decision_thresholds") or {}
    for name, cut in thresholds.items():
        if cut is None:
            out.append(f"`{name}`: no threshold could be chosen (the validation cases lack positives or negatives); "
                       f"the bundle reports its probability only.")
    test = meta.get("test_metrics")
    if not test:
        out.append("Not evaluated on a held-out test set at export: the numbers above are absent.")
    else:
        for name, m in test["per_class"].items():
            if m.get("n_pos") is not None and m["n_pos"] < 10:
                out.append(f"`{name}`: {m['n_pos']} test positives; its intervals are wide.")
    return out


def model_card(meta: dict) -> str:
    """The exported bundle's ``docs/README.md`` header: intended use, training data and label
    heterogeneity, per-class performance, limitations (all from ``metadata.json``)."""
    classes, training = meta["class_names"], meta.get("training", {})
    lines = [f"# Model card: {meta['name']}", "", meta.get("description", ""), "",
             "## Intended use", "", meta.get("intended_use", ""), ""]
    prov = meta.get("provenance", {})
    lines += ["## Training", ""]
    for key, label in (("method", "Federated method"), ("rounds", "Rounds completed"), ("checkpoint_kind", "Model"),
                       ("model_after_rounds", "The model after round(s)"),
                       ("best_scored_by", "Chosen as the best on the validation data of"),
                       ("site_state", "Batch norm of one site (FedBN), from"), ("scenario", "Training scenario")):
        value = prov.get(key, training.get(key))
        if isinstance(value, list):
            value = ", ".join(map(str, value))
        if value is not None:
            lines.append(f"- {label}: {value}")
    table = training.get("label_table") or {}
    if table:
        source = training.get("label_table_source")
        noised = any(row.get("noised") for row in table.values())
        lines += ["", "Which site annotated which class (annotated cases / positives; - = the site does not label "
                  "the class" + (f"; from {source}" if source else "") + "):"
                  + (" the counts were sent with noise (the run's privacy option), per image, not per patient; "
                     "which site labels which class is exact, and each round's FedAvg weight n, sent exactly, "
                     "gives the number of cases (at a site that annotates every case, its annotated counts "
                     "too)." if noised else ""), "",
                  "| site | cases | " + " | ".join(classes) + " |", "|---|---|" + "---|" * len(classes)]
        for site, row in table.items():
            cells = [f"{row['annotated'][c]} / {row['positives'][c]}" if row["labels"][c] else "-" for c in classes]
            lines.append(f"| {site} | {row['cases']} | " + " | ".join(cells) + " |")
    lines += ["", "## Performance", ""]
    thresholds = meta.get("decision_thresholds") or {}
    if training.get("threshold_rule"):
        lines.append(f"Decision thresholds: {training['threshold_rule']} "
                     f"({training.get('validation_cases', 0)} validation cases).")
    test = meta.get("test_metrics")
    if test:
        pct = int(round(100 * test.get("confidence", CONFIDENCE)))
        lines += ["", f"Held-out test set, {test['cases']} cases; {pct} % confidence intervals in brackets.", ""]
        if training.get("task") == "segmentation":
            lines += ["| class | threshold | Dice |", "|---|---|---|"]
            for name, m in test["per_class"].items():
                lines.append(f"| {name} | {_fmt(m['threshold'])} | {_fmt(m['dice'], m['dice_ci'])} |")
        else:
            lines += ["| class | test positives / negatives | threshold | AUROC | sensitivity | specificity |",
                      "|---|---|---|---|---|---|"]
            for name, m in test["per_class"].items():
                sens, spec = m.get("sensitivity") or {}, m.get("specificity") or {}
                lines.append(f"| {name} | {m['n_pos']} / {m['n_neg']} | {_fmt(thresholds.get(name))} | "
                             f"{_fmt(m['auroc'], m['auroc_ci'])} | {_fmt(sens.get('value'), sens.get('ci'))} | "
                             f"{_fmt(spec.get('value'), spec.get('ci'))} |")
            if test.get("accuracy"):
                acc = test["accuracy"]
                lines += ["", f"Accuracy (arg-max): {_fmt(acc['value'], acc['ci'])}."]
    lines += ["", "## Known limitations", ""]
    lines += [f"- {line}" for line in limitations(meta)] or ["- none found in the numbers above."]
    lines += ["- Trained and evaluated on the data named above only; check it on your own images before use.", ""]
    return "\n".join(lines + running(meta))


def running(meta: dict) -> list:
    """The model card's "Running it": both inference paths, and what a DICOM result claims."""
    segmentation = meta.get("training", {}).get("task") == "segmentation" or \
        meta.get("network_data_format", {}).get("outputs", {}).get("pred", {}).get("format") != "classes"
    files = ("a mask per image (PNG for PNG/JPEG, NIfTI for NIfTI and DICOM)" if segmentation else
             "`predictions.csv` (per class the probability and the decision)")
    dicom = ("`dicom/seg_<series UID>.dcm`: a DICOM SEG per series (per image without a frame of reference), "
             "one segment per class, referencing the source images; non-DICOM inputs keep their mask files"
             if segmentation else
             "`dicom/sr_<study UID>.dcm`: a DICOM structured report (TID 1500) per study, with per image and class "
             "the probability and the decision, each referencing its image; `predictions.csv` keeps every input")
    return ["## Running it", "",
            "```bash", "python -m monai.bundle run --config_file configs/inference.json --bundle_root . \\",
            "    --dataset_dir <images> --output_dir <out>", "```", "",
            f"writes {files}. DICOM in, DICOM out:", "",
            "```bash",
            "python -m monai.bundle run --config_file \"['configs/inference.json','configs/inference_dicom.json']\" \\",
            "    --bundle_root . --dataset_dir <DICOM folder> --output_dir <out>", "```", "",
            f"adds {dicom}. DICOM files are found by content (no `.dcm` needed); the rescale and the first "
            "window or VOI LUT are applied, MONOCHROME1 is inverted.", "",
            "What a DICOM result claims: this model's output for that image (the algorithm's name, version, "
            "federated method and rounds are in it), decided at the thresholds above, which were chosen on the "
            "training sites' validation cases, not on your hospital's (multi-class: the most probable class). "
            "What it does not claim: a diagnosis. It is marked preliminary and unverified (no person has read "
            "it), and its use is bounded by the intended use above.", ""]


__all__ = ["evidence", "choose_thresholds", "youden_threshold", "dice_threshold", "test_report", "auroc_ci",
           "proportion", "mean_ci", "label_table", "model_card", "limitations", "running"]
