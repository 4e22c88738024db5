"""The project's rows against independent plain-PyTorch references, with an equivalence criterion.

Methods (IsoFed's table, Surgical Aggregation, FedMLP and its FedAvg baselines, FedPSL and its FedProx, FedMix and
FedST;
``--rows``)::

    python benchmarks/reference_check.py --preset isofed --rows oracle:wfedavg,isofed,mt_wfedavg \
        --data 'DIR-s{seed}' --seeds 0,1,2 --rounds 20 --eval-rounds 5,10,20 --label pneumoniamnist-g0.8-1L3U
    python benchmarks/reference_check.py --preset isofed_rscfed --rows oracle:wfedavg,isofed --set augment=crop_hflip \
        --set strong=photometric --set warmup_rounds=7 --set sup_scale=100 --data 'DIR-rscfed-s{seed}' \
        --seeds 0,1,2 --rounds 60 --eval-rounds 20,40,60 --label pneumoniamnist-rscfed-g0.5-1L3U  # isofed-rscfed
    python benchmarks/reference_check.py --preset fedmlp_blood --rows surgical --data 'DIR-s{seed}' \
        --seeds 0,1,2 --rounds 150 --eval-rounds 50,100,150 --label bloodmnist-one-class
    python benchmarks/reference_check.py --preset fedmix --rows fedmix --image-size 32 --data 'DIR-s{seed}' \
        --seeds 0,1,2 --rounds 50 --eval-rounds 25,50 --label ph2-UUL
    python benchmarks/reference_check.py --preset cxr --rows fedavg,fedavg_pl --per-case-augmentation \
        --set lr=0.001 --set batch_size=16 --set weight_decay=0 --set pos_weight=neg_over_pos \
        --set carry_optimizer=true --data 'DIR-s{seed}' --seeds 0,1,2 --rounds 20 --eval-rounds 5,10,20 \
        --label cxr-64px-bench-baselines     # bench_cxr's rows: the bundle's defaults, 64 px

Per split s (one prepared split each; ``{seed}`` in ``--data``) and row, the project's row runs twice
(``fedlabels bench``'s in-process round engine, training seeds s and s + ``SEED_OFFSET``) and its reference
once: ``benchmarks/reference/semisup.py`` with ``semisup.CHECK`` (RSCFed's released values where the project
can express them); ``surgical.py``, ``fedmlp.py``, ``partial_fedavg.py`` (FedMLP's FedAvg and FedAvg-PL),
``fedpsl.py``, ``fedprox.py`` (FedPSL's FedProx), ``fedfixmatch.py`` and ``fednoro.py`` (FedMLP's FedFixMatch
and FedNoRo), ``rscfed_pl.py``, ``composed.py``, ``fedmix.py`` (also FedAdaptAgg, and on a segmentation preset
FedAvg, ``oracle:fedavg`` and the floor: Eq. 5 with lambda = 0) and ``fedst.py`` (FedMix's FedST) with their
``CHECK`` (the paper's values, the
released code's or a stated choice where the paper prints none, each source in the module's ``PAPER``); both
sides train with them
(``project_settings`` turns them into the row's options and stops on any it cannot; ``--set KEY=VALUE``
changes one of them on both sides).

FedAvg (the training path; no ``--rows``)::

    python benchmarks/reference_check.py --preset isofed --data 'DIR-s{seed}' --seeds 0,1,2 --rounds 20 \
        --eval-rounds 5,10,20 --label pneumoniamnist-g0.8

Per split it runs the project's ``oracle:fedavg`` row with the preset and ``benchmarks/reference/``'s FedAvg
loop of the same task with the preset's settings (this checks the training path, not the preset).

Both criteria of the check (``criterion_a``, ``criterion_b``, comment above them): (a) the 90 % t interval
of the mean paired project-minus-reference difference inside ±2 points (two one-sided tests), (b) the widest
per-split difference no wider than the widest difference between the project's two training seeds. Cells are
resumable (``OUT/cells/*.json``, written atomically, named by label, row and split): a finished cell is kept
when the settings it records are the ones asked, and refused, naming the field, when another command wrote it
under the same label; ``OUT/../reference_check.md`` is rewritten from every finished cell (``--table-only``:
only that).

``--reference-scaling minmax`` runs the FedAvg reference with each image scaled to [0, 1] by its own min and
max instead of the preset's scaling, which shows what that scaling alone does to the same loop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import fedavg_classification, fedavg_multilabel, fedavg_segmentation  # noqa: E402

# What the reference needs of a preset, read from the preset itself (so a preset edit reaches both sides).
# preset -> (reference loop, the metric compared)
REFERENCES = {"isofed": ("classification", "accuracy"), "isofed_rscfed": ("classification", "accuracy"),
              "fedmix": ("segmentation", "dice"),
              "cxr": ("multilabel", "auroc"), "fedmlp_blood": ("multilabel", "auroc")}
LOOPS = {"classification": fedavg_classification, "segmentation": fedavg_segmentation,
         "multilabel": fedavg_multilabel}
# how far the project may sit from the reference (mean over splits, every eval round)
TOLERANCE = {"accuracy": 0.02, "dice": 0.02, "auroc": 0.02}
# the chest X-ray bundles' weak augmentation, as fedavg_multilabel.augment implements it
CXR_AUGMENT = [{"_target_": "RandAffined", "keys": ["image"], "prob": 0.5, "rotate_range": [0.1],
                "scale_range": [0.1, 0.1], "translate_range": [3, 3], "padding_mode": "border"},
               {"_target_": "RandAdjustContrastd", "keys": ["image"], "prob": 0.3, "gamma": [0.8, 1.25]},
               {"_target_": "EnsureTyped", "keys": ["image", "label"], "track_meta": False}]
# --no-augmentation: the project's loader augments nothing (a diagnostic, with partial_fedavg.run(augment=False))
NO_AUGMENT = [{"_target_": "EnsureTyped", "keys": ["image", "label"], "track_meta": False}]
# the same augmentation applied to each batch at once (fedlabels.bundle.augment; the cxr preset's)
CXR_BATCH_AUGMENT = [{"_target_": "fedlabels.bundle.augment.BatchRandAffine", "prob": 0.5, "rotate_range": 0.1,
                      "scale_range": [0.1, 0.1], "translate_range": [3, 3], "padding_mode": "border"},
                     {"_target_": "fedlabels.bundle.augment.BatchRandAdjustContrast", "prob": 0.3, "gamma": [0.8, 1.25]}]


# the isofed_rscfed preset's weak view (RSCFed's resize, crop and flip), as semisup.crop_hflip implements it
RSCFED_CROP = [{"_target_": "Resized", "keys": ["image"], "spatial_size": ["$@image_size * 5 // 4"] * 2,
                "mode": "bilinear", "anti_aliasing": False},
               {"_target_": "RandSpatialCropd", "keys": ["image"], "roi_size": ["@image_size", "@image_size"],
                "random_size": False},
               {"_target_": "fedlabels.bundle.data.RandMirrord", "keys": ["image"], "prob": 0.5, "spatial_axis": 0}]
# the medmnist_cnn bundle's strong view, as semisup.photometric implements it
PHOTOMETRIC = [{"_target_": "RandAdjustContrastd", "keys": ["image"], "prob": 0.8, "gamma": [0.5, 2.0]},
               {"_target_": "RandGaussianNoised", "keys": ["image"], "prob": 0.8, "std": 0.2},
               {"_target_": "RandCoarseDropoutd", "keys": ["image"], "holes": 1, "spatial_size": "$@image_size // 4",
                "fill_value": 0.0, "prob": 0.5},
               {"_target_": "EnsureTyped", "keys": ["image"], "track_meta": False}]


def reference_settings(preset: str, fedavg_loop: bool = True) -> dict:
    """The reference loop's arguments, read from the bundle config merged with the preset (so a preset or
    bundle edit reaches both sides); a setting the loop has no equivalent of stops here, naming the field.
    ``fedavg_loop`` False: only what the method references read of it (scaling, augmentation, width), whose
    optimizer comes from their own settings."""
    from fedlabels import presets
    from fedlabels.bundle import read

    p = presets.load(preset)
    cfg = read(p.bundle, "", preset=preset, class_names=["a"])
    where = f"{p.path} over {p.bundle / 'configs' / 'train.json'}"
    if fedavg_loop and (p.client.get("optimizer", "adam") != "adam" or not p.client.get("reset_optimizer", False)):
        raise ValueError(f"{where}: field 'federated.client': the reference loop implements a fresh Adam every "
                         "round only")
    intensity = cfg["intensity"]
    if intensity.get("_target_") == "ScaleIntensityRanged" and (intensity.get("a_min"), intensity.get("a_max"),
                                                                intensity.get("b_min"), intensity.get("b_max")) == (0.0, 255.0, -1.0, 1.0):
        scaling = "fixed"
    elif intensity == {"_target_": "ScaleIntensityd", "keys": ["image"]}:
        scaling = "minmax"  # each image by its own min and max
    else:
        raise ValueError(f"{where}: field 'intensity': the reference loop has no equivalent of {intensity}")
    random = cfg["train"]["random_transforms"]
    flips = tuple(t.get("_target_") for t in random)
    augment = {(): "none", ("fedlabels.bundle.data.RandMirrord",): "hflip", ("RandFlipd",): "hflip",
               ("fedlabels.bundle.data.RandDihedrald",): "dihedral"}.get(flips)
    if random == RSCFED_CROP:
        augment = "crop_hflip"
    batch = cfg["train"].get("batch_transforms") or []
    if random == CXR_AUGMENT and not batch or random == CXR_AUGMENT[-1:] and batch == CXR_BATCH_AUGMENT:
        augment = "affine_contrast"
    elif batch:
        raise ValueError(f"{where}: field 'train#batch_transforms': the reference loop has no equivalent of {batch}")
    if augment is None:
        raise ValueError(f"{where}: field 'train#random_transforms': the reference loop has no equivalent of {flips}")
    common = {"lr": p.client.get("lr", 1e-3), "batch_size": cfg["batch_size"], "epochs": p.local_epochs}
    kind = REFERENCES[preset][0]
    expected = {"classification": {("fixed", "hflip"), ("fixed", "dihedral"), ("minmax", "hflip"), ("minmax", "dihedral"),
                                   ("fixed", "none"), ("minmax", "none"), ("fixed", "crop_hflip")},
                "segmentation": {("minmax", "dihedral")},
                "multilabel": {("minmax", "affine_contrast"), ("fixed", "affine_contrast")}}[kind]
    if (scaling, augment) not in expected:
        raise ValueError(f"{where}: the {kind} reference has no equivalent of scaling {scaling} with {augment}")
    if kind == "classification":
        if fedavg_loop and augment == "crop_hflip":
            raise ValueError(f"{where}: field 'train#random_transforms': the FedAvg reference loop has no crop "
                             "(the method references do: --rows)")
        if fedavg_loop and p.client.get("weight_decay", 0.0):
            raise ValueError(f"{where}: field 'federated.client.weight_decay': the classification reference has none")
        if fedavg_loop:
            return {**common, "scaling": scaling, "augment": augment}
        # the student's view, as the method references name it (None: one they have no equivalent of)
        strong = "photometric" if cfg["train"].get("strong_random_transforms") == PHOTOMETRIC else None
        return {**common, "scaling": scaling, "augment": augment, "strong": strong}
    if kind == "segmentation":
        return {**common, "weight_decay": p.client.get("weight_decay", 0.0)}
    widen = cfg["network_def"].get("widen_factor")  # a preset may narrow the ResNet-18 (MONAI's widen_factor)
    return {**common, "weight_decay": p.client.get("weight_decay", 0.0), "scaling": scaling,
            **({"widen": float(widen)} if widen else {})}


def project_cell(preset: str, data: Path, seed: int, rounds: int, eval_rounds: list, work: Path,
                 config: dict | None = None, image_size: int | None = None, widen: float | None = None,
                 log=print, method: str = "oracle:fedavg", opts: list | None = None, batch_size: int | None = None,
                 local_epochs: int | None = None) -> dict:
    """``fedlabels bench``'s cell of one row (default ``oracle:fedavg``; in process) with the preset and any
    ``--opt METHOD:key=value`` items ``opts``: test metrics per eval round. ``seed`` is the training seed
    (initialisation, sampling, augmentation); ``data`` is the one prepared split it trains on."""
    from fedlabels import bench
    from fedlabels.bench.plan import floor_method

    floor = method.startswith(f"{bench.FLOOR}:")  # a floor row: the plan of its kind's floor method carries it
    methods = floor_method(REFERENCES[preset][0]) if floor else method
    args = SimpleNamespace(data=str(data), bundle=None, methods=methods, seeds=str(seed),
                           rounds=rounds,
                           local_epochs=local_epochs, opt=list(opts or []) or None,
                           eval_rounds=",".join(map(str, eval_rounds)),
                           engine="inprocess", synth=None, batch_size=batch_size, image_size=image_size,
                           network=[f"widen_factor={widen}"] if widen else None,
                           out=str(work), preset=preset)
    plan = bench.make_plan(args)
    plan.overrides = dict(config or {})  # e.g. a test switching the scaling back
    bench.prepare_data(plan)
    from fedlabels.scoring import Scorer

    scorer = Scorer(plan.bundle, plan.datasets[seed], plan.network, plan.config)
    # Time the sites' scoring of the received model (best-model selection, which the reference does not do)
    # apart from their training.
    from fedlabels import site

    validating, validate = [0.0], site.validate_task

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return validate(*a, **kw)
        finally:
            validating[0] += time.perf_counter() - t0

    site.validate_task = timed
    try:
        if floor:
            out = bench.run_floor(plan, bench.Cell(method, seed, method.split(":", 1)[1]), scorer, lambda m: None)
        else:
            out = bench.run_federated_inprocess(plan, bench.Cell(method, seed), scorer, lambda m: None)
    finally:
        site.validate_task = validate
    metrics = {}
    for r in out["rows"]:
        if r["model"] != "last" or r["group"] != bench.POOLED:
            continue
        m = metrics.setdefault(int(r["round"]), {})
        if r["class"] == bench.MEAN and r["metric"] in ("accuracy", "auroc", "dice", "ap"):
            m[r["metric"]] = r["value"]
        elif r["metric"] == "recall" and r["class"] != bench.MEAN:  # a class predicted for no case has recall 0
            m["classes_predicted"] = m.get("classes_predicted", 0) + int(bool(r["value"]))
    for r, tags in tag_counts(out["records"], metrics).items():
        metrics[r]["tags"] = tags
    for r, m in metrics.items():
        log(f"[project] {method} seed {seed} round {r}: {m}")
    # the floor keeps no per-round records: each stretch's training time is spread over its epoch-rounds
    seconds = [rec["seconds"] for rec in out["records"]] or \
        [t / (r - before) for t, before, r in zip(out["train_seconds"], [0, *eval_rounds], eval_rounds)
         for _ in range(r - before)]
    # sites the round engine dropped (e.g. a non-finite update) or that abstained, per round (1-based)
    dropped = {str(rec["round"] + 1): sorted(set(rec.get("dropped") or {}) | set(rec.get("abstained") or []))
               for rec in out["records"] if rec.get("dropped") or rec.get("abstained")}
    return {"metrics": metrics, "seconds_per_round": float(np.mean(seconds)), "seconds": seconds,
            "validation_seconds_per_round": validating[0] / rounds, "dropped": dropped,
            **({"train_seconds": out["train_seconds"]} if floor else {})}


def tag_counts(records: list, eval_rounds) -> dict:
    """FedMLP's tags made up to each eval round (1-based), summed over sites: {round: [negatives, positives]},
    as ``benchmarks/reference/fedmlp.py`` reports them; empty for a row that tags nothing (no such record)."""
    if not any("tagged_negatives" in st for rec in records for st in rec["sites"].values()):
        return {}
    out = {}
    for r in eval_rounds:
        made = [st for rec in records if rec["round"] < r for st in rec["sites"].values()]
        out[r] = [sum(int(st.get("tagged_negatives") or 0) for st in made),
                  sum(int(st.get("tagged_positives") or 0) for st in made)]
    return out


def compare(preset, data: Path, seed: int, rounds: int, eval_rounds: list, work: Path, reference_scaling=None,
            config=None, log=print, reference_run=None, image_size=None, widen=None) -> dict:
    """One split: the project's cell and the reference's, side by side, one after the other in this process
    (``reference_run``: an earlier reference result of the same split and settings, reused)."""
    settings = reference_settings(preset)
    if reference_scaling:
        settings["scaling"] = reference_scaling
    if widen:
        if REFERENCES[preset][0] != "multilabel":
            raise ValueError("--widen: only the ResNet-18 of the multi-label reference has a width option")
        settings["widen"] = widen
    proj = project_cell(preset, data, seed, rounds, eval_rounds, work, config=config, image_size=image_size,
                        widen=widen, log=log)
    loop = LOOPS[REFERENCES[preset][0]]
    ref = reference_run or loop.run(data, rounds, set(eval_rounds), seed=seed, log=lambda m: log(m), **settings)
    return {"preset": preset, "metric": REFERENCES[preset][1], "data": str(data), "seed": seed,
            "rounds": rounds, "image_size": image_size, "widen": widen, "reference": settings, "project": proj,
            "reference_run": ref}


def problems(result: dict, tolerance: float) -> list:
    """What fails the check at the last eval round: the project predicting fewer classes than the reference,
    or its metric more than ``tolerance`` from the reference's. Empty = passed."""
    metric = result["metric"]
    last = max(result["project"]["metrics"])
    p, q = result["project"]["metrics"][last], result["reference_run"]["metrics"][last]
    out = []
    if p.get("classes_predicted", 0) < q.get("classes_predicted", 0):
        out.append(f"round {last}: the project predicts {p['classes_predicted']} class(es), the reference "
                   f"{q['classes_predicted']}")
    if abs(p[metric] - q[metric]) > tolerance:
        out.append(f"round {last}: project {metric} {p[metric]:.3f} vs reference {q[metric]:.3f} "
                   f"(tolerance {tolerance})")
    return out


# ---------------------------------------------------------------- the equivalence criterion
#
# Per split i (one prepared split, the same on both sides), at a scored round:
#   P_i^A, P_i^B  the project's metric with two training seeds (initialisation, sampling, augmentation),
#   R_i           the reference's metric on the same split,
#   d_i = (P_i^A + P_i^B) / 2 - R_i   the paired project-minus-reference difference,
#   s_i = P_i^A - P_i^B               the project's own seed-to-seed difference.
# (a) the 90 % interval of mean(d) (t over the splits, n - 1 degrees of freedom) lies inside (-MARGIN, +MARGIN):
#     the two one-sided tests at 5 % each;
# (b) max_i |d_i| <= max_i |s_i|: no split differs from the reference by more than the project differs from itself
#     between two training seeds on some split.
# Equivalence is shown only when both pass; a mean inside the margin alone is not a pass.

MARGIN = 0.02
LEVEL = 0.90


def mean_interval(diffs, level: float = LEVEL) -> tuple:
    """(mean, low, high): the two-sided ``level`` t interval of the mean of ``diffs`` (None, None without 2)."""
    from scipy import stats

    d = np.asarray(diffs, dtype=np.float64)
    mean = float(d.mean())
    if len(d) < 2:
        return mean, None, None
    half = float(stats.t.ppf((1 + level) / 2, len(d) - 1)) * float(d.std(ddof=1)) / math.sqrt(len(d))
    return mean, mean - half, mean + half


def criterion_a(diffs, margin: float = MARGIN, level: float = LEVEL) -> dict:
    """Two one-sided tests: the ``level`` interval of the mean paired difference inside (-margin, margin)."""
    mean, low, high = mean_interval(diffs, level)
    passed = low is not None and -margin < low and high < margin
    return {"n": len(diffs), "mean": mean, "low": low, "high": high, "pass": bool(passed)}


def criterion_b(diffs, seed_diffs) -> dict:
    """max |d_i| over the splits against max |s_i| (the project's seed-to-seed differences); None if unmeasured."""
    widest = float(np.max(np.abs(diffs)))
    if not seed_diffs:
        return {"max_diff": widest, "max_seed": None, "pass": None}
    seed = float(np.max(np.abs(seed_diffs)))
    return {"max_diff": widest, "max_seed": seed, "pass": bool(widest <= seed)}


def per_split(cells: list, rnd, metric: str) -> tuple:
    """(d_i, s_i) at round ``rnd`` over the cells (one a split); s is empty where a cell has one project run."""
    d, s = [], []
    for c in cells:
        runs = [r["metrics"][str(rnd)][metric] for r in _project_runs(c)]
        ref = reference_metric(c, rnd, metric)
        d.append(float(np.mean(runs)) - ref)
        if len(runs) == 2:
            s.append(runs[0] - runs[1])
    return d, (s if len(s) == len(cells) else [])


def reference_runs(cell: dict) -> list:
    """A cell's reference runs: ``reference_run`` (seed s) and, where it ran more than once (``--reference-runs``),
    ``more_reference_runs`` (seeds s + k * SEED_OFFSET)."""
    return [cell["reference_run"], *cell.get("more_reference_runs", [])]


def reference_metric(cell: dict, rnd, metric: str) -> float:
    """The reference's metric of a cell at ``rnd``: the mean over its runs."""
    return float(np.mean([r["metrics"][str(rnd)][metric] for r in reference_runs(cell)]))


def _project_runs(cell: dict) -> list:
    """The project's runs of a cell: ``project`` (one run, older cells) or ``projects`` (one per training seed)."""
    if "projects" in cell:
        return cell["projects"]
    return [{**cell["project"], "metrics": {str(k): v for k, v in cell["project"]["metrics"].items()}}]


def verdict(a: dict, b: dict) -> str:
    if a["pass"] and b["pass"]:
        return "equivalent"
    if b["pass"] is None:
        return "not shown (b unmeasured)" if a["pass"] else "not shown"
    return "not shown"


# ---------------------------------------------------------------- the methods

# a table's floor rows, a site trained alone (fedlabels.bench.run_floor): the reference is FedAvg-PL's on that site
# alone on a multi-label preset, wFedAvg's on a classification one (row_kind, floor_reference)
FLOOR_ROWS = tuple(f"local:site-{k}" for k in range(1, 9))
# a project row -> (the reference's method, every site from its full labels); the module of benchmarks/reference/
# that implements each is method_reference's
METHOD_ROWS = {"oracle:wfedavg": ("wfedavg", True), "isofed": ("isofed", False), "isofed_nopt": ("isofed_nopt", False),
               "surgical": ("surgical", False), "fedmlp": ("fedmlp", False),
               "fedpsl": ("fedpsl", False), "fedpsl_tdma": ("fedpsl", False), "fedpsl_tadl": ("fedpsl", False),
               "fedavg": ("fedavg", False), "fedavg_pl": ("fedavg_pl", False), "oracle:fedavg_pl": ("fedavg_pl", True),
               **{row: ("fedavg_pl", False) for row in FLOOR_ROWS},
               "fedprox": ("fedprox", False), "fedfixmatch": ("fedfixmatch", False),
               "fednoro": ("fednoro", False), "rscfed_pl": ("rscfed_pl", False),
               "composed": ("composed", False),
               "mt_wfedavg": ("mt_wfedavg", False), "rscfed": ("rscfed", False), "fedmix": ("fedmix", False),
               "oracle:fedadaptagg": ("fedadaptagg", True), "fedst": ("fedst", False),
               "oracle:fedavg": ("fedavg", True)}
# the kind of preset each row's reference trains (the others: classification)
ROW_KIND = {"surgical": "multilabel", "fedmlp": "multilabel", "fedpsl": "multilabel", "fedpsl_tdma": "multilabel",
            "fedpsl_tadl": "multilabel", "fedavg": "multilabel",
            "fedavg_pl": "multilabel", "oracle:fedavg_pl": "multilabel",
            **{row: "multilabel" for row in FLOOR_ROWS},
            "fedprox": "multilabel",
            "fedfixmatch": "multilabel", "fednoro": "multilabel", "rscfed_pl": "multilabel", "composed": "multilabel",
            "fedmix": "segmentation", "fedst": "segmentation",
            "oracle:fedadaptagg": "segmentation", "oracle:fedavg": "segmentation"}


def row_kind(row: str, preset: str | None = None) -> str:
    """The kind of preset ``row``'s reference trains: a floor row's is its preset's (a site trained alone has a
    reference of each kind), and so is ``fedavg``'s on a segmentation preset (FedMix's reference at lambda = 0);
    ``preset`` None: the multi-label reference."""
    if preset is not None and (row in FLOOR_ROWS or
                               (row == "fedavg" and REFERENCES[preset][0] == "segmentation")):
        return REFERENCES[preset][0]
    return ROW_KIND.get(row, "classification")


SEED_OFFSET = 1000  # the project's second training seed on split s is s + SEED_OFFSET
# The project's strong view is its weak view further transformed (fedlabels.site.TwoViews); a second random
# left-right flip of the flipped view is, in distribution, a second independent flip: RSCFed's second weak view.
STRONG_AS_SECOND_FLIP = [{"_target_": "fedlabels.bundle.data.RandMirrord", "keys": ["image"], "prob": 0.5,
                          "spatial_axis": 0},
                         {"_target_": "EnsureTyped", "keys": ["image"], "track_meta": False}]


def project_settings(preset: str, row: str, s: dict) -> dict:
    """What the project's row must be given to train with the reference's settings ``s`` (semisup.CHECK):
    ``--opt`` items, the batch size, local epochs and bundle overrides. A setting the project cannot express
    stops here, naming it; so does a preset whose scaling or weak augmentation is not the reference's."""
    if row not in METHOD_ROWS:
        raise ValueError(f"row {row!r}: the method references cover {sorted(METHOD_ROWS)}")
    if row == "surgical":
        return surgical_settings(preset, s)
    if row == "fedmlp":
        return fedmlp_settings(preset, s)
    if row in FEDPSL_ABLATIONS:
        return fedpsl_settings(preset, s, row)
    if row in ("rscfed_pl", "composed"):
        return mean_teacher_settings(preset, row, s)
    if row_kind(row, preset) == "segmentation":
        return fedmix_settings(preset, row, s)
    floor = row in FLOOR_ROWS
    if row in ("fedavg", "fedavg_pl", "oracle:fedavg_pl", "fedprox", "fedfixmatch", "fednoro") or \
            (floor and row_kind(row, preset) == "multilabel"):
        return partial_fedavg_settings(preset, row, s)
    bundle = reference_settings(preset, fedavg_loop=False)  # the preset's scaling and weak view, as the reference names them
    for key in ("scaling", "augment"):
        if bundle[key] != s[key]:
            raise ValueError(f"the {preset} preset's {key} is {bundle[key]!r}, the reference's {s[key]!r}")
    client = {"optimizer": s["optimizer"], "lr": s["lr"], "weight_decay": s["weight_decay"],
              "reset_optimizer": not s["carry_optimizer"], "clip_grad_norm": s["max_grad_norm"]}
    if s["optimizer"] == "sgd":
        client["momentum"] = s["momentum"]
    if floor:  # the labeled site alone (wFedAvg's reference on it): its client options, no server, no second view
        return {"opts": [f"local:{k}={json.dumps(v)}" for k, v in client.items()], "batch_size": s["batch_size"],
                "local_epochs": s["epochs"], "config": {}}
    if s["distance"] != "paper":
        raise ValueError(f"distance {s['distance']!r}: the project implements the paper's (the flattened model)")
    if s["strong"] == "photometric":
        if bundle["strong"] != "photometric":
            raise ValueError(f"strong view 'photometric': the {preset} preset's train#strong_random_transforms is "
                             "not the reference's")
    elif s["strong"] != "hflip":
        raise ValueError(f"strong view {s['strong']!r}: the check has the project's equivalent of 'hflip' and "
                         "'photometric' only")
    if row != "oracle:wfedavg":
        client |= {"consistency_weight": s["lambda_u"], "temperature": s["temperature"], "ema_alpha": s["ema_alpha"],
                   "lr_unlabeled": s.get("lr_unlabeled")}
    if row == "isofed":
        client |= {"pretrain": True, "pretrain_epochs": s["pretrain_epochs"], "pretrain_target": "both",
                   "pretrain_sites": "unlabeled"}
    server = {"lambda_c": s["sup_scale"], "lambda_unlabeled": s["dist_scale"], "labeled_multiplier": s["w_mul_times"],
              "warmup_rounds": s["warmup_rounds"]}
    if row == "rscfed":  # the subsets are drawn from the run's seed on the project's side, Python's random here
        server |= {"subsets": s["subsets"], "subset_size": s["subset_size"]}
    opts = [f"{row}:{k}={json.dumps(v)}" for k, v in {**client, **server}.items()]
    second_flip = row != "oracle:wfedavg" and s["strong"] == "hflip"
    return {"opts": opts, "batch_size": s["batch_size"], "local_epochs": s["epochs"],
            "config": {"train#strong_random_transforms": STRONG_AS_SECOND_FLIP} if second_flip else {}}


def surgical_settings(preset: str, s: dict) -> dict:
    """The project's ``surgical`` row with the reference's settings ``s`` (surgical.CHECK: the paper's)."""
    if REFERENCES[preset][0] != "multilabel":
        raise ValueError(f"surgical: a multi-label preset, not {preset!r}")
    if s["pos_weight"] not in ("none", "neg_over_pos"):
        raise ValueError(f"pos_weight {s['pos_weight']!r}: the project weighs positives by N_neg / N_pos "
                         "('neg_over_pos') or not at all ('none', the paper's plain BCE)")
    client = {"optimizer": s["optimizer"], "lr": s["lr"], "weight_decay": 0.0, "reset_optimizer": not s["carry_optimizer"],
              "warmup_epochs": s["warmup_epochs"], "warmup_lr": s["warmup_lr"],
              "pos_weighted": s["pos_weight"] == "neg_over_pos"}
    server = {"weighted": False}  # Eq. 1 as printed (1/K sum_k), the released code's unweighted mean
    opts = [f"surgical:{k}={json.dumps(v)}" for k, v in {**client, **server}.items()]
    return {"opts": opts, "batch_size": s["batch_size"], "local_epochs": s["epochs"], "config": {}}


def fedmlp_settings(preset: str, s: dict) -> dict:
    """The project's ``fedmlp`` row with the reference's settings ``s`` (fedmlp.CHECK: the paper's, the released
    code's where it prints none). Both sides use the bundle's two views."""
    if REFERENCES[preset][0] != "multilabel":
        raise ValueError(f"fedmlp: a multi-label preset, not {preset!r}")
    if s["missing_prior"] != "tags":
        raise ValueError(f"missing_prior {s['missing_prior']!r}: the project takes a missing class's prior from the "
                         "rate among its tags")
    client = {"optimizer": "adam", "lr": s["lr"], "weight_decay": s["weight_decay"],
              "reset_optimizer": not s["carry_optimizer"], "logit_adjustment": s["logit_adjustment"],
              "warmup_consistency": False, "stage2_consistency": True, "consistency_weight": s["consistency_weight"],
              "degree_low": s["low"], "degree_high": s["high"], "two_views": s["two_views"]}
    server = {"warmup_rounds": s["warmup_rounds"], "tau0": s["tau0"], "tau1": s["tau1"],
              "adaptive_threshold": s["adaptive_threshold"], "prototype_weighting": "mean",
              "degree_sites": s["degree_sites"], "weighted": True}
    opts = [f"fedmlp:{k}={json.dumps(v)}" for k, v in {**client, **server}.items()]
    return {"opts": opts, "batch_size": s["batch_size"], "local_epochs": s["epochs"], "config": {}}


def mean_teacher_settings(preset: str, row: str, s: dict) -> dict:
    """The project's ``rscfed_pl`` or ``composed`` row with the reference's settings ``s`` (rscfed_pl.CHECK and
    composed.CHECK: FedMLP's values for every comparison method, RSCFed's released code's for the rest; the
    composed method's own parts at its page's defaults)."""
    if REFERENCES[preset][0] != "multilabel":
        raise ValueError(f"{row}: a multi-label preset, not {preset!r}")
    if s["pos_weight"] not in ("none", "neg_over_pos"):
        raise ValueError(f"pos_weight {s['pos_weight']!r}: the project weighs positives by N_neg / N_pos "
                         "('neg_over_pos') or not at all ('none')")
    client = {"optimizer": "adam", "lr": s["lr"], "weight_decay": s["weight_decay"],
              "reset_optimizer": not s["carry_optimizer"], "pos_weighted": s["pos_weight"] == "neg_over_pos",
              "consistency_weight": s["consistency_weight"], "ema_alpha": s["ema_alpha"]}
    server = ({"isolate": s["isolate"], "classwise_head": s["classwise_head"]} if row == "composed" else
              {"lambda_c": s["sup_scale"], "subsets": s["subsets"], "subset_size": s["subset_size"],
               "labeled_multiplier": 1.0, "warmup_rounds": 0})
    opts = [f"{row}:{k}={json.dumps(v)}" for k, v in {**client, **server}.items()]
    return {"opts": opts, "batch_size": s["batch_size"], "local_epochs": s["epochs"], "config": {}}


# FedPSL and its ablation rows -> the reference's (local rule, aggregation)
FEDPSL_ABLATIONS = {"fedpsl": ("tadl", "tdma"), "fedpsl_tdma": ("plain", "tdma"), "fedpsl_tadl": ("tadl", "fedavg")}


def fedpsl_settings(preset: str, s: dict, row: str = "fedpsl") -> dict:
    """The project's ``fedpsl`` row (or an ablation: ``fedpsl_tdma``, ``fedpsl_tadl``) with the reference's
    settings ``s`` (fedpsl.CHECK: the paper's, the reference's where the paper prints none). Inner and meta
    learning rates are both the paper's alpha = beta."""
    if REFERENCES[preset][0] != "multilabel":
        raise ValueError(f"{row}: a multi-label preset, not {preset!r}")
    client = {"optimizer": "adam", "lr": s["lr"], "weight_decay": 0.0, "reset_optimizer": not s["carry_optimizer"],
              "pos_weighted": True}
    if FEDPSL_ABLATIONS[row][0] == "tadl":
        client["first_order"] = not s["second_order"]
    if FEDPSL_ABLATIONS[row][1] == "fedavg":
        client["weighted"] = True  # the server's FedAvg by n_k
    opts = [f"{row}:{k}={json.dumps(v)}" for k, v in client.items()]
    return {"opts": opts, "batch_size": s["batch_size"], "local_epochs": s["epochs"], "config": {}}


def partial_fedavg_settings(preset: str, row: str, s: dict) -> dict:
    """The project's ``fedavg`` (missing labels as negatives), ``fedavg_pl`` (partial loss), ``fedprox``
    (partial loss and the proximal term), ``fedfixmatch`` (partial loss and FixMatch on the missing classes) or
    ``fednoro`` (partial loss and distillation to the received model on them) row with the reference's settings
    ``s`` (partial_fedavg, fedfixmatch and fednoro CHECK: FedMLP's paper, its released code where it prints none;
    fedprox.CHECK: FedPSL's paper)."""
    if REFERENCES[preset][0] != "multilabel":
        raise ValueError(f"{row}: a multi-label preset, not {preset!r}")
    if s["pos_weight"] not in ("none", "neg_over_pos"):
        raise ValueError(f"pos_weight {s['pos_weight']!r}: the project weighs positives by N_neg / N_pos "
                         "('neg_over_pos') or not at all ('none')")
    client = {"optimizer": "adam", "lr": s["lr"], "weight_decay": s.get("weight_decay", 0.0),
              "reset_optimizer": not s["carry_optimizer"], "pos_weighted": s["pos_weight"] == "neg_over_pos"}
    if row == "fedprox":
        client["mu"] = s["mu"]
    if row == "fedfixmatch":
        client |= {"confidence": s["confidence"], "lambda_u": s["lambda_u"]}
    if row == "fednoro":
        client |= {key: s[key] for key in ("kd_weight", "temperature", "rampup_begin", "rampup_end")}
    server = {"weighted": True} if row not in FLOOR_ROWS else {}  # FedAvg by case counts; the floor has no server
    target = "local" if row in FLOOR_ROWS else row  # fedlabels bench's --opt local:key=value: the floor's client
    opts = [f"{target}:{k}={json.dumps(v)}" for k, v in {**client, **server}.items()]
    return {"opts": opts, "batch_size": s["batch_size"], "local_epochs": s["epochs"], "config": {}}


def fedmix_settings(preset: str, row: str, s: dict) -> dict:
    """The project's ``fedmix``, ``oracle:fedadaptagg``, ``fedst``, ``fedavg``, ``oracle:fedavg`` or floor row
    with the reference's settings ``s`` (fedmix.CHECK or fedst.CHECK: the paper's, the released code's where it
    prints none, FedST's stated choices). The reference augments as the preset does (a random 90-degree turn and
    flip)."""
    if REFERENCES[preset][0] != "segmentation":
        raise ValueError(f"fedmix: a segmentation preset, not {preset!r}")
    if s["dice_eps"] > 1e-3:
        raise ValueError(f"dice_eps {s['dice_eps']}: the project's soft Dice smooths by 1e-5; a larger eps is "
                         "another loss")
    client = {"optimizer": "adam", "lr": s["lr"], "weight_decay": s["weight_decay"],
              "reset_optimizer": not s["carry_optimizer"]}
    if row == "fedmix":
        client |= {"epsilon": s["epsilon"], "box_rule": s["box_rule"], "threshold": s["threshold"]}
    if row == "fedst":
        if s["threshold"] != 0.5:
            raise ValueError(f"threshold {s['threshold']}: the project's FedST labels foreground above 0.5")
        client |= {"confidence": s["confidence"]}
        server = {"warmup_rounds": s["warmup_rounds"], "weighted": True}
    elif row in FLOOR_ROWS:
        server = {}  # a site alone: no server
    elif row in ("fedavg", "oracle:fedavg"):
        server = {"weighted": True}  # FedAvg by case counts
    else:
        server = {"lam": s["lam"], "beta": s["beta"]}
    target = "local" if row in FLOOR_ROWS else row  # fedlabels bench's --opt local:key=value: the floor's client
    opts = [f"{target}:{k}={json.dumps(v)}" for k, v in {**client, **server}.items()]
    return {"opts": opts, "batch_size": s["batch_size"], "local_epochs": s["epochs"], "config": {}}


def method_reference(row: str, preset: str | None = None):
    """The module of ``benchmarks/reference/`` that implements ``row``'s method (a floor row's: by its preset's
    kind, ``row_kind``)."""
    from reference import (composed, fedfixmatch, fedmix, fedmlp, fednoro, fedprox, fedpsl, fedst, partial_fedavg,
                           rscfed_pl, semisup, surgical)

    if row in FLOOR_ROWS and row_kind(row, preset) == "classification":
        return semisup  # wFedAvg of the one labeled site
    if row_kind(row, preset) == "segmentation" and row != "fedst":
        return fedmix  # FedMix, FedAdaptAgg, and FedAvg (lambda = 0) of every, the pixel-labeled or one site

    return {"surgical": surgical, "fedmlp": fedmlp, "fedpsl": fedpsl, "fedpsl_tdma": fedpsl, "fedpsl_tadl": fedpsl,
            "fedmix": fedmix, "fedst": fedst,
            "oracle:fedadaptagg": fedmix, "fedavg": partial_fedavg, "fedavg_pl": partial_fedavg,
            "oracle:fedavg_pl": partial_fedavg,
            **{row: partial_fedavg for row in FLOOR_ROWS},
            "fedprox": fedprox, "fedfixmatch": fedfixmatch,
            "fednoro": fednoro, "rscfed_pl": rscfed_pl,
            "composed": composed}.get(row, semisup)  # semisup: IsoFed, MT+wFedAvg, RSCFed and wFedAvg


def refuse_options(row: str, augment: bool = True, grey: str | None = None, reference_runs: int = 1,
                   widen: float | None = None, eval_rounds: list | None = None, carry_optimizer: bool = False,
                   preset: str | None = None) -> None:
    """Options ``row``'s reference (on ``preset``) cannot take, refused before anything trains (ValueError naming
    the option)."""
    if row in FLOOR_ROWS and eval_rounds and not carry_optimizer and \
            eval_rounds != [eval_rounds[0] * (i + 1) for i in range(len(eval_rounds))]:
        raise ValueError(f"--eval-rounds {','.join(map(str, eval_rounds))}: with a fresh optimizer at each, the "
                         "floor's reference trains one stretch per eval round, so they must be evenly spaced from "
                         "the first (e.g. 10,20,30)")
    from reference import fednoro, partial_fedavg

    multilabel = row_kind(row, preset) == "multilabel"
    if not augment and method_reference(row, preset) not in (partial_fedavg, fednoro):
        raise ValueError(f"--no-augmentation: only the references of FedAvg, FedAvg-PL (partial_fedavg.py) and "
                         f"FedNoRo (fednoro.py) have it, not {row}'s")
    if grey is not None and not multilabel:
        raise ValueError("--reference-grey: only the multi-label references read colour images as grey")
    if reference_runs < 1 or (reference_runs > 1 and row_kind(row, preset) == "classification"):
        raise ValueError(f"--reference-runs {reference_runs}: at least 1; more than 1 with the multi-label and "
                         "segmentation references only")
    if widen and not multilabel:
        raise ValueError("--widen: only the ResNet-18 of the multi-label references has a width option")


def compare_methods(preset: str, row: str, data: Path, split: int, rounds: int, eval_rounds: list, work: Path,
                    log=print, settings: dict | None = None, image_size: int | None = None,
                    config: dict | None = None, widen: float | None = None, augment: bool = True,
                    grey: str | None = None, reference_runs: int = 1) -> dict:
    """One split, one row: the project twice (training seeds ``split`` and ``split + SEED_OFFSET``) and the
    method reference once (seed ``split``; ``reference_runs`` > 1: also seeds ``split + k * SEED_OFFSET``, its own
    seed-to-seed spread), one after the other in this process. ``config``: bundle overrides
    of the project side beyond the row's (``--per-case-augmentation``); ``widen``: the multi-label ResNet-18's
    width on both sides instead of the preset's."""
    from reference import fedmix, fednoro, fedst, partial_fedavg, semisup

    reference = method_reference(row, preset)
    s = {**reference.CHECK, **(settings or {})}
    refuse_options(row, augment, grey, reference_runs, widen, eval_rounds, bool(s.get("carry_optimizer")), preset)
    multilabel = row_kind(row, preset) == "multilabel"
    grey = grey or "mean"  # the bundles' rule (Ensure2DChannelsd); cells before it was an option read luma
    proj = project_settings(preset, row, s)
    proj["config"] = {**proj["config"], **(config or {})}
    if reference is fedmix and row in FLOOR_ROWS:
        _check_floor_site(data, row)
    runs = []
    for seed in (split, split + SEED_OFFSET):
        run = project_cell(preset, data, seed, rounds, eval_rounds, work / f"seed{seed}", config=proj["config"],
                           log=log, method=row, opts=proj["opts"], batch_size=proj["batch_size"],
                           local_epochs=proj["local_epochs"], image_size=image_size, widen=widen)
        run["metrics"] = {str(k): v for k, v in run["metrics"].items()}
        runs.append({**run, "train_seed": seed})
    method, oracle = METHOD_ROWS[row]
    # the multi-label references read the preset's network width and scaling, as the FedAvg check does
    if multilabel:
        bundle = reference_settings(preset)
        extra = ({"partial": row != "fedavg", "augment": augment, "oracle": oracle} if reference is partial_fedavg else
                 {"augment": augment} if reference is fednoro else
                 dict(zip(("local", "aggregation"), FEDPSL_ABLATIONS[row])) if row in FEDPSL_ABLATIONS else {})
        extra["grey"] = grey
        if row in FLOOR_ROWS:  # the site alone, in rounds of one or more epoch-rounds (floor_reference)
            extra["only"] = row.split(":", 1)[1]
            refs = [floor_reference(reference.run, data, eval_rounds, split + k * SEED_OFFSET, log,
                                    {**extra, **s, "scaling": bundle["scaling"],
                                     "widen": widen or bundle.get("widen", 1.0)})
                    for k in range(reference_runs)]
        else:
            refs = [reference.run(data, rounds, set(eval_rounds), seed=split + k * SEED_OFFSET, log=log,
                                  scaling=bundle["scaling"], widen=widen or bundle.get("widen", 1.0), **extra, **s)
                    for k in range(reference_runs)]
        ref = refs[0]
    elif reference is fedmix and row in FLOOR_ROWS:  # the site alone: FedAvg of one site, as floor_reference maps
        refs = [floor_reference(lambda d, r, ev, **kw: fedmix.run(d, r, ev, method="fedavg", **kw), data,
                                eval_rounds, split + k * SEED_OFFSET, log, {**s, "only": row.split(":", 1)[1]})
                for k in range(reference_runs)]
        ref = refs[0]
    elif reference in (fedmix, fedst):
        kw = {"method": method, "oracle": oracle} if reference is fedmix else {}
        refs = [reference.run(data, rounds, set(eval_rounds), seed=split + k * SEED_OFFSET, log=log, **kw, **s)
                for k in range(reference_runs)]
        ref = refs[0]
    elif row in FLOOR_ROWS:  # the labeled site alone: wFedAvg of one site, in rounds as floor_reference maps them
        ref = floor_reference(lambda d, r, ev, **kw: semisup.run(d, "wfedavg", r, ev, **kw), data, eval_rounds,
                              split, log, {**s, "only": row.split(":", 1)[1]})
    else:
        ref = semisup.run(data, method, rounds, set(eval_rounds), seed=split, oracle=oracle, log=log, **(settings or {}))
    ref["metrics"] = {str(k): v for k, v in ref["metrics"].items()}
    more = {}
    if reference_runs > 1:
        for k, r in enumerate(refs):
            r["metrics"], r["train_seed"] = {str(key): v for key, v in r["metrics"].items()}, split + k * SEED_OFFSET
        more["more_reference_runs"] = refs[1:]
    return {**more, "kind": "methods", "preset": preset, "row": row, "metric": REFERENCES[preset][1],
            "data": str(data), "seed": split, "rounds": rounds, "image_size": image_size, "widen": widen,
            "reference": s, **({"reference_grey": grey} if multilabel else {}),
            "project_options": proj,
            "projects": runs, "reference_run": ref}


def _check_floor_site(data: Path, row: str) -> None:
    """A segmentation floor trains its site's pixel masks: a site without them stops here, before training."""
    from reference import fedmix

    site = row.split(":", 1)[1]
    if not (data / site / "datalist.json").is_file():
        raise ValueError(f"{row}: {data / site / 'datalist.json'} is missing (the split's sites: scenario.yaml)")
    level = fedmix.site_level(data / site)
    if level != fedmix.PIXEL:
        raise ValueError(f"{row}: {data / site / 'datalist.json'}: field 'training[].supervision' is {level!r}; a "
                         "segmentation floor trains a site with pixel masks")


def floor_reference(run, data, eval_rounds: list, seed: int, log, kw: dict) -> dict:
    """A floor's reference run. The project's floor trains on to each eval round, its optimizer fresh at each
    unless carried (``run_floor``); the reference trains the site alone in rounds of ``step`` x the epochs of a
    round (averaging one site's model is the model itself): ``step`` the first eval round when the optimizer is
    fresh at each (evenly spaced eval rounds, ``refuse_options``), else their greatest common divisor."""
    step = eval_rounds[0] if not kw.get("carry_optimizer") else math.gcd(*eval_rounds)
    out = run(data, eval_rounds[-1] // step, {r // step for r in eval_rounds}, seed=seed, log=log,
              **{**kw, "epochs": step * kw["epochs"]})
    out["metrics"] = {int(r) * step: m for r, m in out["metrics"].items()}
    out["seconds"] = [s / step for s in out["seconds"] for _ in range(step)]  # per epoch-round, as the project's
    out["seconds_per_round"] = float(np.mean(out["seconds"]))
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # lanes sharing a results folder each write their own
    tmp.write_text(text)
    tmp.replace(path)


def _fmt(vals, scale=100.0, digits=1):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "—"
    mean = scale * float(np.mean(vals))
    sd = scale * float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def _steady(side: dict) -> float:
    """Seconds per round after the first (lazy imports and first-touch costs fall in the first); older cells
    recorded only the mean over every round."""
    seconds = side.get("seconds") or []
    return float(np.mean(seconds[1:])) if len(seconds) > 1 else side["seconds_per_round"]


def _pts(x, sign=False):
    return "—" if x is None else (f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}")


def _yes(flag) -> str:
    return "not measured" if flag is None else "pass" if flag else "FAIL"


def one_class_everywhere(cs: list, rnd) -> bool:
    """Every run of both sides predicts a single class at ``rnd``: accuracy is then the test split's share of
    that class on every side, and agreeing on it says nothing of the training."""
    runs = [r["metrics"].get(str(rnd), {}) for c in cs for r in _project_runs(c)]
    runs += [c["reference_run"]["metrics"].get(str(rnd), {}) for c in cs]
    return all(r.get("classes_predicted") == 1 for r in runs)


def _criteria_cells(cs: list, rnd, metric: str, margin: float) -> tuple:
    """The criteria columns of one round: (cells text, a, b)."""
    d, s = per_split(cs, rnd, metric)
    a, b = criterion_a(d, margin), criterion_b(d, s)
    said = verdict(a, b)
    if metric == "accuracy" and one_class_everywhere(cs, rnd):
        said = "uninformative: every run predicts one class"
    interval = "—" if a["low"] is None else f"{_pts(a['low'], True)} to {_pts(a['high'], True)}"
    spread = f" ± {100 * float(np.std(d, ddof=1)):.1f}" if len(d) > 1 else ""
    text = (f"{_pts(a['mean'], True)}{spread} | {interval} | {_yes(a['pass'])} | {_pts(b['max_diff'])} "
            f"| {_pts(b['max_seed'])} | {_yes(b['pass'])} | {said}")
    return text, a, b


CRITERIA_HEAD = ("difference d, mean ± sd | 90 % interval of mean d | (a) inside ±{m} | max abs d "
                 "| max abs seed-to-seed | (b) | equivalence")

# Published plans (docs/results/*.md, benchmarks/plans/) and what this check covers of them.
COVERAGE = [
    ("`isofed` preset, PneumoniaMNIST / BloodMNIST, every L:U and gamma (`isofed-preset`, `isofed-pretraining`)",
     "`oracle:fedavg` with the preset on PneumoniaMNIST gamma 0.8 and BloodMNIST gamma 0.5 (two training seeds per "
     "split). The `oracle:wfedavg`, `isofed`, `isofed_nopt`, `mt_wfedavg` and `rscfed` rows against the method "
     "references on PneumoniaMNIST and BloodMNIST, gamma 0.8 and 0.5, 1 labeled : 3 unlabeled, each with the "
     "reference's settings (RSCFed's released values where the project can express them), not with the preset's "
     "Adam 1e-3, and the floor row (`local:site-1`) likewise on the same four splits (`*-floor`); on PneumoniaMNIST "
     "at both gamma also 2 labeled : 2 unlabeled and 3 : 1 (`pneumoniamnist-g*-2L2U`, `-3L1U`: `isofed`, "
     "`mt_wfedavg`, `rscfed`, the same way, on the plan's splits 0-2), and their floor rows, site-2 and site-3 "
     "alone, in the `*-floor` sections; on BloodMNIST at both gamma 2 : 2 and 3 : 1 the same way "
     "(`bloodmnist-g*-2L2U`, `-3L1U`, site-2 and site-3 alone in `bloodmnist-g*-floor`). The published rows with "
     "the preset's own settings (Adam 1e-3 fresh each round, consistency weight 1, no clipping, the bundle's strong "
     "view; `--set` on both sides) on PneumoniaMNIST 1 : 3 at both gamma: `oracle:wfedavg`, `isofed`, "
     "`isofed_nopt`, `mt_wfedavg`, `rscfed` (`pneumoniamnist-g*-1L3U-preset`) and the floor "
     "(`pneumoniamnist-g*-preset-floor`, scored at rounds 5, 10, 15 and 20: with a fresh optimizer at each eval "
     "round, another trajectory past round 10 than the table's); their first-seed project runs are not the table's "
     "cells (at most 1.0 accuracy points apart for the upper bound, 2.2 for `isofed_nopt`, `mt_wfedavg` and "
     "`rscfed`, 22.8 for `isofed`: those cells record no thread count or code). The same rows and the floor on "
     "BloodMNIST 1 : 3 at gamma 0.8 the same way (`bloodmnist-g0.8-1L3U-preset`, `bloodmnist-g0.8-preset-floor`; "
     "the method rows' first-seed project runs equal the table's cells to every digit on split 2, elsewhere up to "
     "1.8 accuracy points apart for the upper bound, 2.0 for `isofed_nopt`, 0.03 for `mt_wfedavg`, 0.3 for "
     "`rscfed`, 12.9 for `isofed`; the floor's within 2.4 at rounds 5 and 10, another trajectory past round 10). "
     "BloodMNIST at gamma 0.5 and the other L:U with the preset's settings unchecked"),
    ("`isofed-rscfed` (the `isofed_rscfed` preset on RSCFed's split, 1 labeled : 3 unlabeled, 60 rounds)",
     "on PneumoniaMNIST, both gamma, the plan's splits 0-2: every row, `oracle:wfedavg`, `isofed`, `mt_wfedavg` and "
     "`rscfed` (labeled multiplier 6 on both sides) against the method reference with the published rows' "
     "settings (the preset's resize-crop-flip and strong view, 7 labeled-only warm-up rounds, lambda_c 100; "
     "`pneumoniamnist-rscfed-*`), and the floor row against wFedAvg's reference on the labeled site alone "
     "(`pneumoniamnist-rscfed-*-floor`); the check's first-seed project runs are the published cells to every "
     "digit. On BloodMNIST, the plan's splits 0-2, the same way: every row at both gamma "
     "(`bloodmnist-rscfed-g*-1L3U`, the floor `bloodmnist-rscfed-g*-floor`); the first-seed project runs equal the "
     "table's cells to every digit, but for `rscfed` at both gamma and `mt_wfedavg` at gamma 0.8, which ran on "
     "another machine and drift from the cells (at most 5.5 to 8.6 accuracy points apart per row at rounds "
     "20-60; a 9-round rerun of MT+wFedAvg's split 0 there gives the cell's site losses to 1e-8 at round 2 and "
     "1e-5 at round 9: float rounding, not the code)"),
    ("`mixed` (BloodMNIST: every class / a half / the other half / none)",
     "the upper bound (`oracle:fedavg_pl`), `fedavg`, `fedavg_pl`, `fedprox`, `surgical`, `fedmlp`, `fedpsl`, "
     "`fedfixmatch`, `fednoro` and the three floor rows against their references with the published rows' "
     "settings (the `fedmlp_blood` preset's and each method's defaults), splits 0-2 (`bloodmnist-mixed-*`); "
     "`rscfed_pl`, `composed` and its three ablations (`isolate=false`, `classwise_head=false`, "
     "`consistency_weight=0`) against `benchmarks/reference/rscfed_pl.py` and `composed.py` with the published "
     "rows' settings (the consistency weight 1.0 set on both sides), splits 0-2 (`bloodmnist-mixed-rscfed_pl`, "
     "`-composed`, `-composed-no*`); their first-seed project runs are not the table's cells to every digit (at "
     "most 0.9 AUROC points apart at round 30: those cells record no thread count or code)"),
    ("`partial_label_study` (embedded chest X-rays; BloodMNIST with per-image min-max scaling)",
     "on BloodMNIST with the study's settings (per-image min-max scaling, Adam 1e-3 kept across rounds, batch 16, "
     "5 local epochs, N_neg / N_pos weighting, ResNet-18 width 0.25 at 32 px; its scoring points, 80-960 local steps "
     "a site, are rounds 1-12): `fedavg`, `fedavg_pl`, `fedprox`, `surgical` (2 warm-up epochs), "
     "`surgical_nowarmup` and `fedpsl` against their references, splits 0-2 (`pls-blood-*`), every row again "
     "with the references reading the colour images by the bundles' grey rule (`pls-blood-*-grey-mean`; the "
     "other sections' references read Pillow's luma); FedPSL's two ablations (`fedpsl_tdma`, `fedpsl_tadl`) "
     "with the bundles' rule (`pls-blood-fedpsl-ablations`); on the embedded chest X-rays the same six rows the "
     "same way, splits 0-2, scored at rounds 1, 2, 4, 7 and 12 (81-975 steps; `pls-cxr-*`); its first-seed project "
     "runs are not the study's cells (up to 3.9-6.2 AUROC points apart per row, 1.5-7.5 on BloodMNIST); FedPSL's "
     "ablation `fedpsl_tdma` on the chest X-rays the same way (`pls-cxr-fedpsl-ablations`; within 3.9 of the "
     "study's cells); `fedpsl_tadl` on the chest X-rays and the mechanism's diagnostics (probe, rho, head) "
     "unchecked"),
    ("`bench_cxr` (embedded chest X-rays, 64 px: FedAvg, FedAvg-PL, FedProx, Surgical, FedPSL)",
     "every row against its reference with the comparison's settings (the bundle's defaults: Adam 1e-3 kept across "
     "rounds, batch 16, N_neg / N_pos weighting, per-case augmentation, full-width ResNet-18 at 64 px; Surgical "
     "without its warm-up), on the comparison's splits 0-2 and for `fedavg`, `fedavg_pl` and `surgical` also 3-5 "
     "(`cxr-64px-bench-*`); the four floor rows against FedAvg-PL's reference on each site alone, splits 0-2 "
     "(`cxr-64px-bench-floor`); the best-on-validation models unchecked"),
    ("`fedmlp`, `fedmlp-preset`, `fedmlp-scale`, `fedmlp-cxr` (FedMLP, FedPSL, Surgical and the other multi-label rows)",
     "the upper bound's training path (`oracle:fedavg`, `fedmlp_blood` and `cxr` presets); on BloodMNIST one class a "
     "site (`fedmlp-preset`'s missing-7 level): `surgical` against its training reference "
     "(`benchmarks/reference/surgical.py`) with the paper's settings, not the preset's; `fedmlp` against "
     "`benchmarks/reference/fedmlp.py` with the published row \"FedMLP, T0 = T1 = 10 %, no ST\"'s settings; `fedpsl` "
     "against `benchmarks/reference/fedpsl.py` with the published row's settings (the preset's, 1 local epoch); "
     "`fedavg`, `fedavg_pl`, `fedfixmatch` and `fednoro` against `partial_fedavg.py`, `fedfixmatch.py` and "
     "`fednoro.py` (FedMLP's released code) with the published rows' settings (the preset's: Adam 1e-3 fresh each "
     "round, batch 16, N_neg / N_pos weighting; FedNoRo's ramp over the 30 rounds); the 8 floor rows against "
     "FedAvg-PL's reference on each site alone (`bloodmnist-one-class-floor`); `rscfed_pl` unchecked (FedMLP's "
     "released RSCFed is another scheme, docs/methods/fedmlp.md); FedMLP's other rows and ablations, the other "
     "levels, `fedmlp-cxr` and `fedmlp-scale` unchecked. The sections above read BloodMNIST's colour images by "
     "Pillow's luma on the reference's side; `fedavg`, `fedavg_pl`, `fedfixmatch`, `fednoro` and `fedpsl` ran "
     "again on splits 0-2 with the bundles' grey rule (`*-grey-mean`; FedNoRo's reference three times per "
     "split). The `*-no-augmentation` sections are diagnostics, not published rows"),
    ("`fedmix-ph2`, `fedmix-lesion` (FedMix, FedST, FedAvg)",
     "on PH2 at 32 px: the upper bound's training path (`oracle:fedavg`, two training seeds); `fedmix` [U, U, L] "
     "and [B, B, L] and `oracle:fedadaptagg` against their reference (`benchmarks/reference/fedmix.py`) with the "
     "reference's settings (the paper's beta 2.5 for skin, Adams kept across rounds as in the released code), "
     "and both again with the plan's beta 3 (the published rows: the plan also keeps each site's Adams); "
     "`fedst` [U, U, L] against its reference (`benchmarks/reference/fedst.py`) with the published row's settings "
     "(25 pixel-only warm-up rounds, confidence 0.9, Adams kept), splits 0-5, the reference three times a split "
     "(`ph2-UUL-fedst`; the first-seed project runs are within 0.7 pooled Dice points of the table's cells on "
     "splits 0-2, not equal to every digit: those cells record no thread count or code); `fedmix` [B, U, L] and "
     "the [U, U, L] ablation lam = 0 against the reference with the published rows' settings (beta 3), splits 0-2 "
     "(`ph2-BUL-beta3`, `ph2-UUL-lam0`; their first-seed project runs within 0.75 pooled Dice points of the plan's "
     "cells at round 100); the ablations without the selection (epsilon = 0, [U, U, L]) and without the box rule "
     "([B, B, L]), [I, B, L] and [I, U, L] the same way (`ph2-UUL-eps0`, `ph2-BBL-nobox`, `ph2-IBL-beta3`, "
     "`ph2-IUL-beta3`; their first-seed project runs within 2.3 pooled Dice points of the plan's cells at rounds "
     "25-100). The beta 2.5 rows are the `ph2-UUL` and `ph2-BBL` sections' settings: their first-seed project runs "
     "on splits 0-2 are the plan's `fedmix_beta25` and `fedmix_BBL_beta25` cells to every digit. On the embedded "
     "lesion scenario with the plan's settings (beta 3, 60 rounds), splits 0-2: `fedmix` [U, U, L], [I, U, L], "
     "[B, U, L], [B, B, L], [I, B, L], the ablations epsilon = 0, lam = 0 and [B, B, L] without the box rule, "
     "`oracle:fedadaptagg` and `fedst` (`lesion-*`; their first-seed project runs within 1.7 pooled Dice points "
     "of the plan's cells at round 60, 4.4 at rounds 20 and 40); the scenario's LL, FedAvg and `oracle:fedavg` "
     "rows unchecked"),
    ("`isofed`, `isofed-100`, `fedmlp` (bundle defaults, the old per-image min-max scaling)",
     "kept for the record; unchecked (the `minmax` sections are diagnostics)"),
]


def _fedavg_section(label, scaling, cs, tolerance) -> list:
    metric = cs[0].get("metric", "accuracy")
    tol = tolerance[metric]
    rounds = sorted({int(r) for c in cs for r in c["project"]["metrics"]})
    seeds = [c["seed"] for c in cs]
    proj_s = [_steady(c["project"]) for c in cs]
    val_s = [c["project"].get("validation_seconds_per_round") for c in cs]
    ref_s = [_steady(c["reference_run"]) for c in cs]
    timing = (f"Seconds per round (after the first, mean over splits): project {np.mean(proj_s):.2f}, reference "
              f"{np.mean(ref_s):.2f} (project / reference {np.mean(proj_s) / np.mean(ref_s):.2f}x)")
    if None not in val_s:
        train_s = [p - v for p, v in zip(proj_s, val_s)]
        timing += (f"; of the project's, {np.mean(val_s):.2f} s score the received model on the sites' "
                   f"validation data, and training alone is {np.mean(train_s) / np.mean(ref_s):.2f}x the reference")
    diagnostic = scaling != reference_settings(cs[0]["preset"]).get("scaling", scaling)
    note = (" This section is a diagnostic, not a check: the reference scales each image by its own min and "
            "max while the project keeps the preset's scaling, so the difference is what the scaling alone "
            "does to the same loop.") if diagnostic else ""
    lines = [f"## {label} (preset `{cs[0]['preset']}`, reference scaling `{scaling}`, seeds {seeds})", "",
             timing + ". Load average (1 min) at each cell's start and end: "
             + ", ".join(f"{c['load'][0]:.1f}-{c['load'][1]:.1f}" if c.get("load") else "not recorded" for c in cs)
             + f", on {os.cpu_count()} cores (both sides of a cell ran one after the other, under the same load)."
             + note, ""]
    if not diagnostic and all("projects" in c for c in cs):
        lines += [f"The project ran twice per split (training seeds s and s + {SEED_OFFSET}); its column is the mean "
                  "of the two runs, and criterion (b) compares with their difference.", ""]
    elif not diagnostic:
        lines += ["The project ran one training seed per split here, so its seed-to-seed spread and criterion (b) "
                  "are not measured: equivalence is not shown whatever (a) says.", ""]
    lines += [f"| round | project {metric} | reference {metric} | " + CRITERIA_HEAD.format(m=f"{100 * tol:.0f}")
              + (" | project AUROC | reference AUROC | classes (project / reference) |" if metric == "accuracy" else " |"),
              "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if metric == "accuracy" else "")]
    for r in rounds:
        p = [c["project"]["metrics"].get(str(r), c["project"]["metrics"].get(r, {})) for c in cs]
        if all("projects" in c for c in cs):  # the mean of the two training seeds, as the criterion pairs it
            p = [{k: float(np.mean([run["metrics"][str(r)][k] for run in c["projects"]]))
                  for k in ("accuracy", "auroc", "dice") if k in c["projects"][0]["metrics"][str(r)]}
                 | {"classes_predicted": "/".join(str(run["metrics"][str(r)].get("classes_predicted"))
                                                  for run in c["projects"])} for c in cs]
        q = [c["reference_run"]["metrics"].get(str(r), {}) for c in cs]
        if diagnostic:
            d = [x.get(metric) - y.get(metric) for x, y in zip(p, q)]
            crit = f"{_pts(float(np.mean(d)), True)} ± {100 * float(np.std(d, ddof=1)):.1f} | n/a | n/a | n/a | n/a | n/a | n/a"
        else:
            crit = _criteria_cells(cs, r, metric, tol)[0]
        row = f"| {r} | {_fmt([x.get(metric) for x in p])} | {_fmt([x.get(metric) for x in q])} | {crit} |"
        if metric == "accuracy":
            row += (f" {_fmt([x.get('auroc') for x in p])} | {_fmt([x.get('auroc') for x in q])} "
                    f"| {','.join(str(x.get('classes_predicted')) for x in p)} / "
                    f"{','.join(str(x.get('classes_predicted')) for x in q)} |")
        lines.append(row)
    return lines + [""]


def _settings_text(s: dict, row: str, preset: str | None = None) -> str:
    from reference import semisup, surgical

    if row_kind(row, preset) == "segmentation":
        ref = method_reference(row, preset)
        used = ", ".join(f"{k} {v}" for k, v in s.items())
        left = "; ".join(f"{k}: {v}" for k, v in ref.LEFT_OUT.items())
        name = ref.__name__.rsplit(".", 1)[-1]
        return (f"Both sides train with the reference's settings (`benchmarks/reference/{name}.py` `CHECK`, the "
                f"paper's values, or the released code's where the paper prints none"
                + ("; FedST's confidence and warm-up are stated choices" if row == "fedst" else "")
                + f"; their sources are its `PAPER`): {used}"
                + (". The reference follows Algorithm 1: each round a site's cases are pseudo-labelled once by the "
                   "received F1 and F2, selected by Eq. 2, and the kept cases re-batched; the project selects within "
                   "each batch" if row == "fedmix" else
                   ". For warmup_rounds rounds only the sites with masks train; then every other site's cases learn "
                   "the received model's confident pixels (soft Dice over them), FedAvg by cases" if row == "fedst"
                   else
                   " (epsilon, lam, beta, threshold and box_rule are FedMix's, unused here). The reference trains "
                   "one network on its site's masks alone, on to each eval round (`floor_reference`); the project's "
                   "floor the same way (`fedlabels.bench.run_floor`)" if row in FLOOR_ROWS else
                   " (epsilon, lam, beta, threshold and box_rule are FedMix's, unused here). The reference trains one "
                   "network on the pixel-labeled sites' masks (`oracle:fedavg`: every site's) and averages by case "
                   "counts, Eq. 5 with lambda = 0" if row in ("fedavg", "oracle:fedavg") else
                   " (epsilon, threshold and box_rule are FedMix's; FedAdaptAgg trains one network on every site's "
                   "masks and aggregates by Eqs. 4-5)")
                + f". The project's row is given the settings as options (`project_options` in each cell). Not the "
                f"paper's, and what runs instead: {left}.")

    if row_kind(row, preset) == "multilabel" and row != "surgical":
        used = ", ".join(f"{k} {v}" for k, v in s.items())
        ref = method_reference(row, preset)
        name = ref.__name__.rsplit(".", 1)[-1]
        left = "; ".join(f"{k}: {v}" for k, v in ref.LEFT_OUT.items())
        where = ("a stated choice (FedPSL has no released code)" if row in ("fedprox", *FEDPSL_ABLATIONS)
                 else "RSCFed's released code's" if row == "rscfed_pl" else
                 "RSCFed's released code's or docs/methods/composed.md's" if row == "composed" else "the released code's")
        changed = [k for k in s if k in ref.CHECK and s[k] != ref.CHECK[k]]
        scenario = {"oracle:fedavg_pl": " Every site trains on every label (each site's `oracle.json`) on both "
                                        "sides: the upper bound."}.get(row, "")
        if row in FLOOR_ROWS:
            scenario = (" Each floor row's site trains alone on both sides (the table's floor): the "
                        "project's floor trains on to each eval round, its optimizer fresh at each unless carried "
                        "(`fedlabels.bench.run_floor`); the reference runs FedAvg-PL's rounds on that site alone, "
                        "each of as many epochs as the stretch between eval rounds, or, with the optimizer "
                        "carried, as their greatest common divisor (`floor_reference`).")
        return (f"Both sides train with the reference's settings (`benchmarks/reference/{name}.py` `CHECK`, the "
                f"paper's values, or {where} where the paper prints none; their sources are its "
                f"`PAPER`), with {', '.join(changed) or 'none'} changed by `--set`: {used}. The project's row is "
                f"given them as options (`project_options` in each cell).{scenario} Not the paper's, and what runs "
                f"instead: {left}.")

    if row == "surgical":
        s = {**s, "pos_weight": s.get("pos_weight", "none")}  # cells older than the option trained unweighted
        used = ", ".join(f"{k} {v}" for k, v in s.items())
        left = "; ".join(f"{k}: {v}" for k, v in surgical.LEFT_OUT.items())
        return (f"Both sides train with the reference's settings (`benchmarks/reference/surgical.py` `CHECK`, the "
                f"paper's values, or the released code's where the paper prints none; their sources are its "
                f"`PAPER`), with {', '.join(k for k in s if s[k] != surgical.CHECK.get(k)) or 'none'} changed by "
                f"`--set`: {used}; the BCE over each site's own classes and the unweighted feature mean. The project's row is given them as options (`project_options` in each "
                f"cell). Not the paper's, and what runs instead: {left}.")

    floor = row in FLOOR_ROWS  # one labeled site alone: no unlabeled site, no aggregation
    keys = (("optimizer", "lr", "momentum", "weight_decay", "batch_size", "epochs", "carry_optimizer", "max_grad_norm",
             "augment", "scaling") if floor else
            ("optimizer", "lr", "momentum", "weight_decay", "batch_size", "epochs", "lambda_u", "temperature",
             "ema_alpha", "sup_scale", "dist_scale", "carry_optimizer", "max_grad_norm", "augment", "strong", "scaling",
             "distance", "pretrain_epochs", "subsets", "subset_size", "warmup_rounds", "w_mul_times"))
    used = ", ".join(f"{k} {s[k]}" for k in keys  # older cells lack later settings (w_mul_times, ...)
                     if k in s and (k != "momentum" or s.get("optimizer", "sgd") == "sgd"))
    left = "; ".join(f"{k}: {v}" for k, v in semisup.left_out(s, student=not floor).items()
                     if not floor or k in ("augment", "rounds", "scaling", *semisup.TRAINING))
    floor = (" Each floor row's labeled site trains alone on both sides (the table's floor): the project's floor "
             "trains on to each eval round (`fedlabels.bench.run_floor`, the options as `local:` items); the "
             "reference is wFedAvg's on that site alone (`semisup.run(only=...)`), in rounds of as many epochs as the "
             "stretch between eval rounds, or, with the optimizer carried, as their greatest common divisor "
             "(`floor_reference`)." if floor else "")
    changed = [k for k in semisup.TRAINING if k in s and s[k] != semisup.CHECK[k]]
    changed = f", with {', '.join(changed)} changed by `--set`" if changed else ""
    return (f"Both sides train with the reference's settings (`benchmarks/reference/semisup.py` `CHECK`, taken from "
            f"RSCFed's released code, whose values and sources are its `RSCFED`){changed}: {used}. The project's row is given "
            f"them as options (`project_options` in each cell).{floor} RSCFed's values not used here, and what runs "
            f"instead: {left}.")


def _row_settings_text(cs_all: list) -> str:
    """The settings of the section's other rows of the same reference where they differ from its first cell's (a
    setting a cell does not record is the reference's CHECK value: older cells predate it)."""
    preset, first = cs_all[0]["preset"], cs_all[0]
    ref = method_reference(first["row"], preset)
    parts = []
    for row in dict.fromkeys(c["row"] for c in cs_all):
        if method_reference(row, preset) is not ref:
            continue
        s = next(c["reference"] for c in cs_all if c["row"] == row)
        full, base = {**ref.CHECK, **s}, {**ref.CHECK, **first["reference"]}
        diff = [f"{k} {full[k]}" for k in full if full[k] != base.get(k)]
        if diff:
            parts.append(f"`{row}` {', '.join(diff)}")
    return f" Where a row's settings differ from these: {'; '.join(parts)}." if parts else ""


_SCALINGS = {"fixed": "0-255 to [-1, 1]", "minmax": "each image to [0, 1] by its own min and max"}


def _input_text(preset: str, cs: list) -> str:
    """The multi-label sections' network and input (they differ between sections): the ResNet-18's width, the
    image size, the preset's intensity scaling (both sides read it) and where the project side augments."""
    if REFERENCES[preset][0] != "multilabel":
        return ""
    from fedlabels import presets
    from fedlabels.bundle import read

    cfg = read(presets.load(preset).bundle, "", preset=preset, class_names=["a"])
    widen = cs[0].get("widen") or reference_settings(preset).get("widen", 1.0)
    size = cs[0].get("image_size") or cfg["image_size"]
    per_batch = bool(cfg["train"].get("batch_transforms"))
    config = cs[0].get("project_config") or {}
    colour = ("colour images (BloodMNIST) made grey by the mean of R, G and B on both sides; "
              if cs[0].get("reference_grey") == "mean" else
              "colour images (BloodMNIST) made grey by the mean of R, G and B on the project's side and by Pillow's "
              "luma (0.299 R + 0.587 G + 0.114 B) on the reference's; ")
    where = ("per case in the loader (`--per-case-augmentation`, as the bundle without a preset does)"
             if config else f"per {'batch' if per_batch else 'case'}, as the preset does")
    augments = ("neither side augments (`--no-augmentation`, a diagnostic)"
                if config.get("train#random_transforms") == NO_AUGMENT else
                f"the project augments {where}, the reference per case")
    scaling = _SCALINGS[reference_settings(preset)["scaling"]]
    return (f"Network: ResNet-18 from scratch, width {widen:g}, {size} px on both sides; intensity: {scaling}, on both "
            f"sides; {colour}{augments}. ")


def _methods_section(label, preset, cs_all, tolerance) -> list:
    metric = cs_all[0]["metric"]
    tol = tolerance[metric]
    splits = sorted({c["seed"] for c in cs_all})
    rows = [r for r in METHOD_ROWS if any(c["row"] == r for c in cs_all)]
    nref = max(len(reference_runs(c)) for c in cs_all)
    lines = [f"## {label}: the methods against their references (preset `{preset}`, splits {splits})", "",
             _input_text(preset, cs_all) + _settings_text(cs_all[0]["reference"], cs_all[0]["row"], preset)
             + _row_settings_text(cs_all), "",
             f"Per split the project ran twice (training seeds s and s + {SEED_OFFSET}, columns A and B) and the "
             + ("reference once (seed s)" if nref == 1 else f"reference {nref} times (its column: their mean; below)")
             + ". d = mean(A, B) - reference per split; seed-to-seed = A - B per split. "
             f"(a): the 90 % t interval of the mean of d inside ±{100 * tol:.0f} points; (b): max abs d <= max abs "
             "seed-to-seed. Metric: the last model's test metric, mean ± sd over splits"
             + ("; `classes` = classes predicted for at least one test case, per split (A / B / reference)."
                if metric == "accuracy" else "."), ""]
    for m in (metric, "auroc") if metric == "accuracy" else (metric,):
        classes = m == "accuracy"  # classes predicted: a multi-class model's (a multi-label one scores every class)
        lines += [f"| row | round | project A {m} | project B {m} | reference {m} | "
                  + CRITERIA_HEAD.format(m=f"{100 * tol:.0f}") + (" | classes |" if classes else " |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if classes else "")]
        for row in rows:
            cs = sorted((c for c in cs_all if c["row"] == row), key=lambda c: c["seed"])
            rounds = sorted({int(r) for c in cs for r in c["reference_run"]["metrics"]})
            for r in rounds:
                a = [c["projects"][0]["metrics"][str(r)] for c in cs]
                b = [c["projects"][1]["metrics"][str(r)] for c in cs]
                q = [c["reference_run"]["metrics"][str(r)] for c in cs]  # classes: an accuracy row has one run
                crit = _criteria_cells(cs, r, m, tol)[0]
                line = (f"| `{row}` | {r} | {_fmt([x[m] for x in a])} | {_fmt([x[m] for x in b])} "
                        f"| {_fmt([reference_metric(c, r, m) for c in cs])} | {crit} |")
                if classes:
                    line += (" " + " / ".join(",".join(str(x.get("classes_predicted")) for x in side)
                                             for side in (a, b, q)) + " |")
                lines.append(line)
        lines.append("")
    lines += _tags_lines(cs_all) + _reference_spread_lines(cs_all, metric)
    def by_site(dropped: dict) -> str:
        """{round: [site, ...]} as "site in n round(s), first-last" per site."""
        rounds = {}
        for rnd, names in (dropped or {}).items():
            for name in names:
                rounds.setdefault(name, []).append(int(rnd))
        return ", ".join(f"{name} in {len(r)} round(s), {min(r)}-{max(r)}" for name, r in sorted(rounds.items()))

    cs_sorted = sorted(cs_all, key=lambda c: (list(METHOD_ROWS).index(c["row"]), c["seed"]))
    lost = [f"`{c['row']}` split {c['seed']}: {by_site(c['reference_run'].get('dropped'))}"
            for c in cs_sorted if c["reference_run"].get("dropped")]
    if all("dropped" in c["reference_run"] for c in cs_all):
        lines += ["Reference sites whose trained model was not finite, left out of their group's aggregate (the "
                  "reference's rule): " + ("; ".join(lost) if lost else "none") + ".", ""]
    else:  # only semisup.py leaves a non-finite site out; the other references have no such rule
        lines += ["Reference sites whose trained model was not finite: not recorded (this reference has no rule "
                  "for them).", ""]
    if all("dropped" in p for c in cs_all for p in c["projects"]):
        gone = [f"`{c['row']}` split {c['seed']} seed {p['train_seed']}: {by_site(p['dropped'])}"
                for c in cs_sorted for p in c["projects"] if p["dropped"]]
        lines += ["Project sites its round engine dropped or that abstained: " + ("; ".join(gone) or "none") + ".", ""]
    else:
        lines += ["Project sites dropped by its round engine: not recorded in these cells.", ""]
    secs = [(row, np.mean([_steady(p) for c in cs_all if c["row"] == row for p in c["projects"]]),
             np.mean([_steady(c["reference_run"]) for c in cs_all if c["row"] == row])) for row in rows]
    lines += ["Seconds per round (after the first, mean over runs), project / reference: "
              + ", ".join(f"`{r}` {p:.2f} / {q:.2f}" for r, p, q in secs)
              + ". Load average (1 min) at each cell's start and end: "
              + ", ".join(f"{c['load'][0]:.1f}-{c['load'][1]:.1f}" for c in cs_all if c.get("load"))
              + f", on {os.cpu_count()} cores.", ""]
    if any(c["row"] in FLOOR_ROWS and "train_seconds" not in p for c in cs_all for p in c["projects"]):
        lines += ["The project's floor seconds in these cells are its whole run (site set-up and test scoring "
                  "included) spread evenly over its rounds, not its training alone: the ratio overstates its "
                  "cost.", ""]
    return lines


def _reference_spread_lines(cs_all: list, metric: str) -> list:
    """Where the reference ran more than once per split (``--reference-runs``): its runs per split and round."""
    cs = sorted((c for c in cs_all if len(reference_runs(c)) > 1), key=lambda c: (c["row"], c["seed"]))
    if not cs:
        return []
    n = len(reference_runs(cs[0]))
    parts = []
    for c in cs:
        for r in sorted(c["reference_run"]["metrics"], key=int):
            vals = [100 * run["metrics"][r][metric] for run in reference_runs(c)]
            parts.append(f"`{c['row']}` split {c['seed']} round {r}: " + ", ".join(f"{v:.1f}" for v in vals)
                         + f" (max - min {max(vals) - min(vals):.1f})")
    return [f"The reference ran {n} times per split (seeds s, s + {SEED_OFFSET}"
            + (f", s + {2 * SEED_OFFSET}" if n > 2 else "") + (", ..." if n > 3 else "")
            + "); its column and d use the mean of its runs. Its own runs: " + "; ".join(parts) + ".", ""]


def _tags_lines(cs_all: list) -> list:
    """FedMLP's tag counts at the last eval round, per split: the project's two runs beside the reference's."""
    cs = sorted((c for c in cs_all if any("tags" in m for m in c["reference_run"]["metrics"].values())),
                key=lambda c: (c["row"], c["seed"]))
    if not cs:
        return []

    def tags(side, r):
        t = side["metrics"].get(str(r), {}).get("tags")
        return "not recorded" if t is None else f"{t[0]:,} / {t[1]:,}"

    parts = []
    for c in cs:
        r = max(int(k) for k in c["reference_run"]["metrics"])
        parts.append(f"`{c['row']}` split {c['seed']}, round {r}: "
                     + ", ".join(tags(side, r) for side in (*c["projects"], c["reference_run"])))
    return ["Tags made by the last eval round (negative / positive, all sites), project A, project B, reference: "
            + "; ".join(parts) + ".", ""]


def table(out: Path, tolerance: dict = TOLERANCE) -> str:
    cells = [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))]
    fedavg = {}
    methods = {}
    for c in cells:
        if c.get("kind") == "methods":
            methods.setdefault((c["label"], c["preset"]), []).append(c)
        else:
            fedavg.setdefault((c["label"], c["reference"].get("scaling", "minmax")), []).append(c)
    lines = ["# The project against independent plain-PyTorch references", "",
             "Written by `benchmarks/reference_check.py` from `benchmarks/results/reference_check/cells/`. Two kinds "
             "of section. The methods sections run the project's method rows (`fedlabels bench`'s in-process round "
             "engine) beside `benchmarks/reference/semisup.py`, IsoFed, MT+wFedAvg and dynamically weighted FedAvg "
             "written from the papers with RSCFed's released settings. The FedAvg sections run the project's "
             "`oracle:fedavg` row beside `benchmarks/reference/fedavg_*.py` with the preset's settings: they check "
             "the training path, not the preset's provenance. References use plain PyTorch, NumPy and Pillow, no "
             "MONAI or fedlabels code, and read the prepared split themselves; both sides train on the same split.",
             "",
             "**The equivalence criterion.** Per split i, P_i = the project's metric (the mean of its two "
             "training seeds where it ran twice), R_i = the reference's; d_i = P_i - R_i; s_i = the project's "
             "seed-to-seed difference (seed A - seed B) on split i. (a) The 90 % interval of the mean of d (t "
             "distribution over the splits, n - 1 degrees of freedom) lies inside ±2 points: the two one-sided "
             "tests at 5 % each. (b) max_i |d_i| <= max_i |s_i|: no split sits further from the reference than "
             "the project sits from itself between two training seeds on some split. Equivalence is shown only "
             "where both pass; a mean inside 2 points alone is not a pass. With 3 splits the interval's half-width "
             "is 2.92 sd / sqrt(3) = 1.69 sd of d, so (a) needs a per-split sd of d well under 1.2 points; (b) "
             "compares two maxima of 3 values each and can go either way by chance when both sides are the same "
             "method.", ""]
    for (label, preset), cs in sorted(methods.items()):
        lines += _methods_section(label, preset, cs, tolerance)
    for (label, scaling), cs in sorted(fedavg.items()):
        lines += _fedavg_section(label, scaling, cs, tolerance)
    lines += ["## What the check does not cover", "",
              "Published plans (`benchmarks/plans/`, `docs/results/`) and what the sections above check of them:",
              "", "| plan | checked |", "|---|---|"]
    lines += [f"| {p} | {what} |" for p, what in COVERAGE]
    return "\n".join(lines) + "\n"


def _provenance(load_before: float) -> dict:
    """What a cell records of how it ran: the load around it, torch's threads and the CPU's vector kernels (both
    change float sums, and over many rounds a run's numbers), and the code."""
    return {"load": (load_before, os.getloadavg()[0]), "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "code": _code()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, choices=sorted(REFERENCES))
    ap.add_argument("--data", required=True, help="prepared scenario folder with {seed} in it (one split per seed)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--eval-rounds", help="comma-separated rounds to score (default: the last)")
    ap.add_argument("--label", required=True, help="the row's name in the table, e.g. pneumoniamnist-g0.8")
    ap.add_argument("--reference-scaling", choices=("fixed", "minmax"),
                    help="the reference's input scaling instead of the preset's")
    ap.add_argument("--widen", type=float, help="ResNet-18 width multiplier on both sides (MONAI's widen_factor)")
    ap.add_argument("--image-size", type=int,
                    help="the project's input size instead of the preset's (the reference reads the prepared files "
                         "at their size; the check stops before training when the two differ)")
    ap.add_argument("--per-case-augmentation", action="store_true",
                    help="the project side augments each case in the loader (the chest X-ray bundles' RandAffined and "
                         "RandAdjustContrastd) instead of the preset's per-batch augmentation, as the bundle without a preset does "
                         "(e.g. the rows of bench_cxr); without --rows: what the batching saves")
    ap.add_argument("--reference-grey", choices=("luma", "mean"),
                    help="with multi-label --rows: how the reference makes colour images grey (mean, the default: the "
                         "mean of R, G and B, as the bundles do; luma: Pillow's convert('L'), what the cells before "
                         "this option read)")
    ap.add_argument("--no-augmentation", action="store_true",
                    help="with --rows fedavg / fedavg_pl / fednoro: neither side augments (a diagnostic of where a gap "
                         "comes from)")
    ap.add_argument("--rows", help="comma-separated project rows checked against the method references "
                                   "(benchmarks/reference/semisup.py, surgical.py, fedmlp.py, partial_fedavg.py, "
                                   "fedpsl.py, fedprox.py, fedfixmatch.py, fednoro.py, rscfed_pl.py, composed.py, "
                                   "fedmix.py, fedst.py): "
                                   f"{', '.join(METHOD_ROWS)}; "
                                   f"each split runs the project with training seeds s and s + {SEED_OFFSET} and the "
                                   "reference once, with the reference's settings (semisup.CHECK, surgical.CHECK, "
                                   "fedmlp.CHECK, partial_fedavg.CHECK, fedpsl.CHECK, fedprox.CHECK, fedfixmatch.CHECK, "
                                   "fednoro.CHECK, rscfed_pl.CHECK, composed.CHECK, fedmix.CHECK, fedst.CHECK)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="with --rows: a reference setting instead of its CHECK value (a JSON value, e.g. beta=3, "
                         "carry_optimizer=false); both sides train with it")
    ap.add_argument("--reference-runs", type=int, default=1,
                    help="with multi-label or segmentation --rows: the reference trains this many times per split "
                         f"(seeds s, s + {SEED_OFFSET}, ...): its own seed-to-seed spread; its mean is what d "
                         "compares with")
    ap.add_argument("--two-seeds", action="store_true",
                    help=f"run the project twice per split (training seeds s and s + {SEED_OFFSET}): criterion (b)")
    ap.add_argument("--table-only", action="store_true", help="rewrite reference_check.md from the finished cells")
    ap.add_argument("--out", default="benchmarks/results/reference_check")
    args = ap.parse_args(argv)
    if args.table_only:
        out = Path(args.out)
        _write_atomic(out.parent / "reference_check.md", table(out))
        return
    config = None
    if args.no_augmentation:
        if not args.rows or args.per_case_augmentation:
            ap.error("--no-augmentation: with --rows fedavg, fedavg_pl or fednoro, without --per-case-augmentation")
        config = {"train#random_transforms": NO_AUGMENT, "train#batch_transforms": []}
    if args.per_case_augmentation:
        if REFERENCES[args.preset][0] != "multilabel":
            ap.error("--per-case-augmentation: only the chest X-ray bundles augment per batch")
        config = {"train#random_transforms": CXR_AUGMENT, "train#batch_transforms": []}
    if args.rows:
        return main_methods(args, config)
    if args.set:
        ap.error("--set: a method reference's setting; give it with --rows")
    try:  # the preset's settings the FedAvg loop cannot take, before anything trains
        reference_settings(args.preset)
    except ValueError as e:
        raise SystemExit(f"--preset {args.preset}: {e}") from None
    seeds, eval_rounds = _splits(args)
    _check_sizes(args, seeds)
    out = Path(args.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        tag = args.label + (f"-ref{args.reference_scaling}" if args.reference_scaling else "")
        cell = out / "cells" / f"{tag}-seed{seed}.json"
        if cell.is_file():
            _skipped(cell, {"preset": args.preset, "rounds": args.rounds, "image_size": args.image_size,
                            "widen": args.widen, "project_config": config}, eval_rounds)
            continue
        t0 = time.time()
        data = Path(args.data.replace("{seed}", str(seed)))
        load_before = os.getloadavg()[0]
        result = compare(args.preset, data, seed, args.rounds, eval_rounds, out / "work" / tag,
                         reference_scaling=args.reference_scaling, image_size=args.image_size, widen=args.widen,
                         config=config, log=lambda m: print(m, flush=True))
        if args.two_seeds:  # the project again on the same split with another training seed: its own spread
            again = project_cell(args.preset, data, seed + SEED_OFFSET, args.rounds, eval_rounds,
                                 out / "work" / tag / "second-seed", config=config, image_size=args.image_size,
                                 widen=args.widen, log=lambda m: print(m, flush=True))
            result["projects"] = [{**run, "metrics": {str(k): v for k, v in run["metrics"].items()},
                                   "train_seed": s} for run, s in ((result["project"], seed), (again, seed + SEED_OFFSET))]
        result["label"] = args.label
        result["project_config"] = config  # settings the project side changed from the preset (None: none)
        result.update(_provenance(load_before))
        _write_atomic(cell, json.dumps(result, indent=1, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else o))
        print(f"[check] {cell.name}: {time.time() - t0:.0f}s", flush=True)
    _write_atomic(out.parent / "reference_check.md", table(out))
    print(f"[check] wrote {out.parent / 'reference_check.md'}", flush=True)


def _code() -> str:
    """The code running here (``fedlabels.release.code_version``), recorded in each cell."""
    from fedlabels.release import code_version

    return code_version()


def _skipped(cell: Path, asked: dict, eval_rounds: list, runs: int | None = None) -> None:
    """A finished cell is kept when it ran what this command asks: each field of ``asked`` it records
    (``reference.KEY``: a reference setting) equal, every round of ``eval_rounds`` scored and (``runs``) the
    reference run that many times; else one error naming the cell and the field, before anything trains (a cell
    is found by its label, which another command can reuse). A kept cell written by other code than this says
    so."""
    done = json.loads(cell.read_text())
    if runs is not None and "reference_run" in done and len(reference_runs(done)) != runs:
        raise SystemExit(f"reference_check: {cell}: field 'reference runs' is {len(reference_runs(done))} in the "
                         f"finished cell, this command asks {runs}; give another --label, or remove the cell to "
                         "recompute it")
    for field, want in asked.items():
        group, _, key = field.rpartition(".")
        record = done.get(group, {}) if group else done
        if key in record and record[key] != want:
            raise SystemExit(f"reference_check: {cell}: field {field!r} is {record[key]!r} in the finished cell, this "
                             f"command asks {want!r}; give another --label, or remove the cell to recompute it")
    scored = {int(r) for r in (done.get("reference_run") or {}).get("metrics", {})}
    if scored and not set(eval_rounds) <= scored:
        raise SystemExit(f"reference_check: {cell}: field 'eval rounds' is {sorted(scored)} in the finished cell, this "
                         f"command asks {eval_rounds}; give another --label, or remove the cell to recompute it")
    code, now = done.get("code"), _code()
    other = "" if code == now else f" (written by {code or 'code not recorded'}; the code now: {now})"
    print(f"[check] {cell.name}: done, skipped{other}", flush=True)


def _splits(args) -> tuple:
    """(seeds, eval rounds) of a run, every seed's prepared split checked before any cell trains. The last
    round is always scored (the project side refuses scored rounds that stop before it)."""
    seeds = [int(s) for s in args.seeds.split(",")]
    eval_rounds = sorted({int(r) for r in (args.eval_rounds or "").split(",") if r} | {args.rounds})
    for seed in seeds:
        data = Path(args.data.replace("{seed}", str(seed)))
        if not (data / "scenario.yaml").is_file():
            raise SystemExit(f"reference_check: {data}: no scenario.yaml (prepare the split first: fedlabels prepare ...)")
    return seeds, eval_rounds


def _check_sizes(args, seeds) -> None:
    """The reference reads the prepared images at their size; the project resizes them to its input size (the
    preset's unless --image-size): two sizes would compare two problems, so that stops here."""
    from fedlabels import presets
    from fedlabels.bundle import read

    size = args.image_size or read(presets.load(args.preset).bundle, "", preset=args.preset,
                                   class_names=["a"])["image_size"]
    for seed in seeds:
        _check_size(args, Path(args.data.replace("{seed}", str(seed))), size)


def _check_size(args, data: Path, size: int) -> None:
    prepared = (yaml.safe_load((data / "scenario.yaml").read_text()) or {}).get("image_size")
    prepared = prepared[0] if isinstance(prepared, list) else prepared
    if prepared is not None and int(prepared) != int(size):
        how = "--image-size" if args.image_size else f"preset {args.preset!r}"
        raise SystemExit(f"reference_check: {data / 'scenario.yaml'}: field 'image_size' is {prepared} px, but the "
                         f"project would train at {size} px ({how}) while the reference reads the prepared {prepared} "
                         f"px images: pass --image-size {prepared}, or prepare the split with --size {size}")


def _settings(items: list, rows: list, preset: str | None = None) -> dict:
    """``--set KEY=VALUE`` items as reference settings; a key the rows' references do not have stops here."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: KEY=VALUE")
        for row in rows:
            check = method_reference(row, preset).CHECK
            if key not in check:
                raise SystemExit(f"--set {key}: not a setting of row {row}'s reference ({', '.join(check)})")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main_methods(args, config: dict | None = None) -> None:
    """``--rows``: one cell per (row, split), resumable, one after the other (``config``: the project side's
    bundle overrides, e.g. per-case augmentation)."""
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    kind = REFERENCES[args.preset][0]
    unknown = [r for r in rows if r not in METHOD_ROWS]
    if unknown:
        raise SystemExit(f"--rows {unknown}: the method references cover {sorted(METHOD_ROWS)}")
    wrong = [r for r in rows if row_kind(r, args.preset) != kind]
    if wrong:
        raise SystemExit(f"--rows {wrong}: not a method of the {kind} preset {args.preset} (surgical, fedmlp, fedpsl and its "
                         "ablations, fedavg_pl, fedprox, fedfixmatch, fednoro, rscfed_pl, composed: a multi-label "
                         "preset; fedmix, fedst, oracle:fedadaptagg, oracle:fedavg: a segmentation preset; fedavg: "
                         "either; the floor rows: any; the others: a classification preset)")
    seeds, eval_rounds = _splits(args)
    settings = _settings(args.set, rows, args.preset)
    for row in rows:  # every row's options, before the first cell trains
        carry = {**method_reference(row, args.preset).CHECK, **settings}.get("carry_optimizer", False)
        try:
            refuse_options(row, not args.no_augmentation, args.reference_grey, args.reference_runs, args.widen,
                           eval_rounds, bool(carry), args.preset)
        except ValueError as e:
            raise SystemExit(f"--rows {row}: {e}") from None
    _check_sizes(args, seeds)
    for seed in seeds:
        for row in rows:
            if row in FLOOR_ROWS and kind == "segmentation":
                try:
                    _check_floor_site(Path(args.data.replace("{seed}", str(seed))), row)
                except ValueError as e:
                    raise SystemExit(f"reference_check: {e}") from None
    out = Path(args.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for row in rows:
            cell = out / "cells" / f"{args.label}-{row.replace(':', '_')}-seed{seed}.json"
            if cell.is_file():
                grey = args.reference_grey or ("mean" if row_kind(row, args.preset) == "multilabel" else None)
                _skipped(cell, {"preset": args.preset, "row": row, "rounds": args.rounds, "image_size": args.image_size,
                                "widen": args.widen, "project_config": config, "reference_grey": grey,
                                **{f"reference.{k}": v for k, v in settings.items()}}, eval_rounds,
                         args.reference_runs)
                continue
            t0 = time.time()
            load_before = os.getloadavg()[0]
            result = compare_methods(args.preset, row, Path(args.data.replace("{seed}", str(seed))), seed,
                                     args.rounds, eval_rounds, out / "work" / f"{args.label}-{row.replace(':', '_')}",
                                     log=lambda m: print(m, flush=True), image_size=args.image_size,
                                     settings=settings, config=config, widen=args.widen,
                                     augment=not args.no_augmentation, grey=args.reference_grey,
                                     reference_runs=args.reference_runs)
            result["label"] = args.label
            result["project_config"] = config  # settings the project side changed from the preset (None: none)
            result.update(_provenance(load_before))
            _write_atomic(cell, json.dumps(result, indent=1, default=_json_default))
            print(f"[check] {cell.name}: {time.time() - t0:.0f}s", flush=True)
            _write_atomic(out.parent / "reference_check.md", table(out))
    print(f"[check] wrote {out.parent / 'reference_check.md'}", flush=True)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, (np.generic,)):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return None


if __name__ == "__main__":
    main()
