"""The project's training path against an independent plain-PyTorch loop of the same protocol.

    python benchmarks/reference_check.py --protocol isofed --data 'DIR-s{seed}' --seeds 0,1,2 --rounds 20 \
        --eval-rounds 5,10,20 --label pneumoniamnist-g0.8 --out benchmarks/results/reference_check

Per seed (one prepared split each; ``{seed}`` in ``--data``) it runs the
project's ``oracle:fedavg`` row (``fedlabels bench``'s in-process round engine
with the preset, every site fully labeled) and ``benchmarks/reference/``'s
loop of the same protocol on the same split, and prints the test metric of
both at every eval round and both times per round. Cells are resumable
(``OUT/cells/LABEL-seedS.json``, written atomically); ``OUT/../reference_check.md``
is rewritten from every finished cell: mean ± sd over seeds, the difference,
and whether it is within ``TOLERANCE`` (2 points of accuracy, 0.02 Dice).

``--reference-scaling minmax`` runs the reference with each image scaled to
[0, 1] by its own min and max instead of the preset's scaling, which shows
what that scaling alone does to the same loop.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import fedavg_classification, fedavg_multilabel, fedavg_segmentation  # noqa: E402

# What the reference needs of a preset, read from the preset itself (so a preset edit reaches both sides).
# protocol -> (reference loop, the metric compared)
REFERENCES = {"isofed": ("classification", "accuracy"), "fedmix": ("segmentation", "dice"),
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
# the same augmentation applied to each batch at once (fedlabels.bundle.augment; the cxr preset's)
CXR_BATCH_AUGMENT = [{"_target_": "fedlabels.bundle.augment.BatchRandAffine", "prob": 0.5, "rotate_range": 0.1,
                      "scale_range": [0.1, 0.1], "translate_range": [3, 3], "padding_mode": "border"},
                     {"_target_": "fedlabels.bundle.augment.BatchRandAdjustContrast", "prob": 0.3, "gamma": [0.8, 1.25]}]


def reference_settings(protocol: str) -> dict:
    """The reference loop's arguments, read from the bundle config merged with the preset (so a preset or
    bundle edit reaches both sides); a setting the loop has no equivalent of stops here, naming the field."""
    from fedlabels import presets
    from fedlabels.bundle import read

    p = presets.load(protocol)
    cfg = read(p.bundle, "", protocol=protocol, class_names=["a"])
    where = f"{p.path} over {p.bundle / 'configs' / 'train.json'}"
    if p.client.get("optimizer", "adam") != "adam" or not p.client.get("reset_optimizer", False):
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
    batch = cfg["train"].get("batch_transforms") or []
    if random == CXR_AUGMENT and not batch or random == CXR_AUGMENT[-1:] and batch == CXR_BATCH_AUGMENT:
        augment = "affine_contrast"
    elif batch:
        raise ValueError(f"{where}: field 'train#batch_transforms': the reference loop has no equivalent of {batch}")
    if augment is None:
        raise ValueError(f"{where}: field 'train#random_transforms': the reference loop has no equivalent of {flips}")
    common = {"lr": p.client.get("lr", 1e-3), "batch_size": cfg["batch_size"], "epochs": p.local_epochs}
    kind = REFERENCES[protocol][0]
    expected = {"classification": {("fixed", "hflip"), ("fixed", "dihedral"), ("minmax", "hflip"), ("minmax", "dihedral"),
                                   ("fixed", "none"), ("minmax", "none")},
                "segmentation": {("minmax", "dihedral")},
                "multilabel": {("minmax", "affine_contrast"), ("fixed", "affine_contrast")}}[kind]
    if (scaling, augment) not in expected:
        raise ValueError(f"{where}: the {kind} reference has no equivalent of scaling {scaling} with {augment}")
    if kind == "classification":
        if p.client.get("weight_decay", 0.0):
            raise ValueError(f"{where}: field 'federated.client.weight_decay': the classification reference has none")
        return {**common, "scaling": scaling, "augment": augment}
    if kind == "segmentation":
        return {**common, "weight_decay": p.client.get("weight_decay", 0.0)}
    widen = cfg["network_def"].get("widen_factor")  # a preset may narrow the ResNet-18 (MONAI's widen_factor)
    return {**common, "weight_decay": p.client.get("weight_decay", 0.0), "scaling": scaling,
            **({"widen": float(widen)} if widen else {})}


def project_cell(protocol: str, data: Path, seed: int, rounds: int, eval_rounds: list, work: Path,
                 config: dict | None = None, image_size: int | None = None, widen: float | None = None,
                 log=print) -> dict:
    """``fedlabels bench``'s ``oracle:fedavg`` cell (in process) with the preset: test metrics per eval round."""
    from fedlabels import bench

    args = SimpleNamespace(data=str(data), bundle=None, methods="oracle:fedavg", seeds=str(seed), rounds=rounds,
                           local_epochs=None, opt=None, eval_rounds=",".join(map(str, eval_rounds)),
                           engine="inprocess", synth=None, batch_size=None, image_size=image_size,
                           network=[f"widen_factor={widen}"] if widen else None,
                           out=str(work), protocol=protocol)
    plan = bench.make_plan(args)
    plan.overrides = dict(config or {})  # e.g. a test switching the scaling back
    bench.prepare_data(plan)
    scorer = bench.Scorer(plan.bundle, plan.datasets[seed], plan.network, plan.config)
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
        out = bench.run_federated_inprocess(plan, bench.Cell("oracle:fedavg", seed), scorer, lambda m: None)
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
    for r, m in metrics.items():
        log(f"[project] seed {seed} round {r}: {m}")
    seconds = [rec["seconds"] for rec in out["records"]]
    return {"metrics": metrics, "seconds_per_round": float(np.mean(seconds)), "seconds": seconds,
            "validation_seconds_per_round": validating[0] / rounds}


def compare(protocol, data: Path, seed: int, rounds: int, eval_rounds: list, work: Path, reference_scaling=None,
            config=None, log=print, reference_run=None, image_size=None, widen=None) -> dict:
    """One split: the project's cell and the reference's, side by side, one after the other in this process
    (``reference_run``: an earlier reference result of the same split and settings, reused)."""
    settings = reference_settings(protocol)
    if reference_scaling:
        settings["scaling"] = reference_scaling
    if widen:
        if REFERENCES[protocol][0] != "multilabel":
            raise ValueError(f"--widen: only the ResNet-18 of the multi-label reference has a width option")
        settings["widen"] = widen
    proj = project_cell(protocol, data, seed, rounds, eval_rounds, work, config=config, image_size=image_size,
                        widen=widen, log=log)
    loop = LOOPS[REFERENCES[protocol][0]]
    ref = reference_run or loop.run(data, rounds, set(eval_rounds), seed=seed, log=lambda m: log(m), **settings)
    return {"protocol": protocol, "metric": REFERENCES[protocol][1], "data": str(data), "seed": seed,
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
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


def table(out: Path, tolerance: dict = TOLERANCE) -> str:
    cells = [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))]
    groups = {}
    for c in cells:
        groups.setdefault((c["label"], c["reference"].get("scaling", "minmax")), []).append(c)
    lines = ["# The project's training path against an independent plain-PyTorch reference", "",
             "Written by `benchmarks/reference_check.py` from `benchmarks/results/reference_check/cells/`. "
             "Both sides train FedAvg with every site fully labeled on the same prepared split (one split per "
             "seed), with the preset's settings; the project side is `fedlabels bench`'s `oracle:fedavg` row "
             "(the in-process round engine, the MONAI bundle's transforms), the reference side is "
             "`benchmarks/reference/` (plain PyTorch, Pillow, no MONAI or fedlabels code). Metric: the last "
             "model's test metric, mean ± sd over splits; `difference` = project - reference per split, mean ± sd "
             "(paired: both sides train on the same split); `classes` = classes predicted for at least one test "
             "case, per split. Seconds per round: the project's includes scoring the received model on each "
             "site's validation data (best-model selection); the reference trains only.", ""]
    for (label, scaling), cs in sorted(groups.items()):
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
        diagnostic = scaling != reference_settings(cs[0]["protocol"]).get("scaling", scaling)
        note = (" This section is a diagnostic, not a check: the reference scales each image by its own min and "
                "max while the project keeps the preset's scaling, so the difference is what the scaling alone "
                "does to the same loop.") if diagnostic else ""
        lines += [f"## {label} (protocol `{cs[0]['protocol']}`, reference scaling `{scaling}`, seeds {seeds})", "",
                  timing + ". Load average (1 min) at each cell's start and end: "
                  + ", ".join(f"{c['load'][0]:.1f}-{c['load'][1]:.1f}" if c.get("load") else "not recorded" for c in cs)
                  + f", on {os.cpu_count()} cores (both sides of a cell ran one after the other, under the same load)."
                  + note,
                  "",
                  f"| round | project {metric} | reference {metric} | difference | within {100 * tol:.0f} points |"
                  + (" project AUROC | reference AUROC | classes (project / reference) |" if metric == "accuracy" else ""),
                  "|---|---|---|---|---|" + ("---|---|---|" if metric == "accuracy" else "")]
        for r in rounds:
            p = [c["project"]["metrics"].get(str(r), {}) for c in cs]
            q = [c["reference_run"]["metrics"].get(str(r), {}) for c in cs]
            pm, qm = [x.get(metric) for x in p], [x.get(metric) for x in q]
            diffs = [a - b for a, b in zip(pm, qm)]  # paired: the same split on both sides
            diff = float(np.mean(diffs))
            spread = f" ± {100 * float(np.std(diffs, ddof=1)):.1f}" if len(diffs) > 1 else ""
            row = (f"| {r} | {_fmt(pm)} | {_fmt(qm)} | {100 * diff:+.1f}{spread} "
                   f"| {'n/a' if diagnostic else 'yes' if abs(diff) <= tol + 1e-12 else 'NO'} |")
            if metric == "accuracy":
                row += (f" {_fmt([x.get('auroc') for x in p])} | {_fmt([x.get('auroc') for x in q])} "
                        f"| {','.join(str(x.get('classes_predicted')) for x in p)} / "
                        f"{','.join(str(x.get('classes_predicted')) for x in q)} |")
            lines.append(row)
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocol", required=True, choices=sorted(REFERENCES))
    ap.add_argument("--data", required=True, help="prepared scenario folder with {seed} in it (one split per seed)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--eval-rounds", help="comma-separated rounds to score (default: the last)")
    ap.add_argument("--label", required=True, help="the row's name in the table, e.g. pneumoniamnist-g0.8")
    ap.add_argument("--reference-scaling", choices=("fixed", "minmax"),
                    help="the reference's input scaling instead of the preset's")
    ap.add_argument("--widen", type=float, help="ResNet-18 width multiplier on both sides (MONAI's widen_factor)")
    ap.add_argument("--image-size", type=int, help="the project's input size instead of the preset's (the reference "
                                                  "reads the prepared files at their size: prepare with --size)")
    ap.add_argument("--per-case-augmentation", action="store_true",
                    help="the project side augments each case in the loader (the chest X-ray bundles' RandAffined and "
                         "RandAdjustContrastd) instead of the preset's per-batch augmentation: what the batching saves")
    ap.add_argument("--out", default="benchmarks/results/reference_check")
    args = ap.parse_args(argv)
    config = None
    if args.per_case_augmentation:
        if REFERENCES[args.protocol][0] != "multilabel":
            ap.error("--per-case-augmentation: only the chest X-ray bundles augment per batch")
        config = {"train#random_transforms": CXR_AUGMENT, "train#batch_transforms": []}
    out = Path(args.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    # the last round is always scored (the project side refuses scored rounds that stop before it)
    eval_rounds = sorted({int(r) for r in (args.eval_rounds or "").split(",") if r} | {args.rounds})
    for seed in seeds:
        data = Path(args.data.replace("{seed}", str(seed)))
        if not (data / "scenario.yaml").is_file():
            raise SystemExit(f"reference_check: {data}: no scenario.yaml (prepare the split first: fedlabels prepare ...)")
    for seed in seeds:
        tag = args.label + (f"-ref{args.reference_scaling}" if args.reference_scaling else "")
        cell = out / "cells" / f"{tag}-seed{seed}.json"
        if cell.is_file():
            print(f"[check] {cell.name}: done, skipped", flush=True)
            continue
        t0 = time.time()
        data = Path(args.data.replace("{seed}", str(seed)))
        load_before = os.getloadavg()[0]
        result = compare(args.protocol, data, seed, args.rounds, eval_rounds, out / "work" / tag,
                         reference_scaling=args.reference_scaling, image_size=args.image_size, widen=args.widen,
                         config=config, log=lambda m: print(m, flush=True))
        result["label"] = args.label
        result["project_config"] = config  # settings the project side changed from the preset (None: none)
        result["load"] = (load_before, os.getloadavg()[0])
        _write_atomic(cell, json.dumps(result, indent=1, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else o))
        print(f"[check] {cell.name}: {time.time() - t0:.0f}s", flush=True)
    _write_atomic(out.parent / "reference_check.md", table(out))
    print(f"[check] wrote {out.parent / 'reference_check.md'}", flush=True)


if __name__ == "__main__":
    main()
