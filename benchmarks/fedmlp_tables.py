"""FedMLP's comparison at one class per site (its Tables 1-3, extreme level) on BloodMNIST, beside the paper.

    python benchmarks/fedmlp_tables.py --src ../shared/data/medmnist --out benchmarks/results/fedmlp [--jobs 2]
    python benchmarks/fedmlp_tables.py --out benchmarks/results/fedmlp --table-only

``--dataset cxr`` runs the same rows on the synthetic chest X-ray scenario with its drop-k-classes
option instead (``fedlabels synth cxr --missing k``: 6 sites of 90-240 cases, 6 findings, 400 test
cases, 32 px; default ``--out benchmarks/results/fedmlp-cxr``, levels 5 = one finding per site).

Protocol: BloodMNIST (8 classes) as one-vs-rest multi-label, ``partial``
protocol with 8 sites that each annotate one class (``--missing 7``: every
class annotated at exactly one site, the paper's extreme level), 1200
training cases split equally, an 800-case test split, 32 px; each seed
redraws the split and who annotates what. Every row: ResNet-18 at
``widen_factor`` 0.25 from scratch, Adam lr 1e-3, batch 16, 30 rounds of one
local epoch (about 300 local steps per site), scored at rounds 10, 20, 30.

Runs (each seed a ``fedlabels bench`` process of its own, ``--jobs`` at once; resumable cell by cell):

* ``main``: fedavg (missing as negatives, pos-weighted: the paper's FedAvg),
  fedavg_pl, fedfixmatch, fednoro, rscfed_pl (RSCFed: 3 random subsets of 3
  sites a round), surgical (no head warm-up: the backbone is
  not pretrained), fedpsl and fedmlp with the paper's defaults
  (T0 = 0.5 %, T1 = 1 %, adaptive threshold) and ``warmup_rounds`` 10, plus
  the floor (each site alone);
* ``fedmlp_t10``: fedmlp with fixed ratios T0 = T1 = 10 %, no adaptive
  threshold. The paper's ratios assume ~3,000 cases a site (1 % = 30 tags a
  class a round); with 150 they tag nothing (int(0.01 x d x 150) = 0), so this
  row keeps the per-round count of tags nearer the paper's;
* ``fedmlp_nomld``: fedmlp without missing-label detection (``mld=false``:
  WPC and consistency only), Table 3's "w/o MLD";
* ``fedmlp_t10_nowpc`` / ``fedmlp_t10_nocr``: the 10 % row without WPC
  (untagged missing entries as negatives) / without stage-2 consistency.

The table (``TABLE.md``) holds the last model at round 30 and the best on
validation, macro BACC at 0.5, AUROC and mAP on the pooled test split,
mean ± sd over seeds, the paper's ChestX-ray14 and ICH numbers at the same
level beside them, and the tags each FedMLP row made (from the round records).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--bundle", "cxr_resnet18", "--rounds", "30", "--eval-rounds", "10,20,30", "--local-epochs", "1",
          "--batch-size", "16", "--network", "widen_factor=0.25", "--image-size", "32"]
# with --protocol the preset sets bundle, size, scaling, network width, batch, optimizer and rounds
PRESET_COMMON = ["--eval-rounds", "10,20,30"]
RUNS = {
    # the upper bound: every site with every label (the scenario's oracle labels), the same splits
    "oracle": (["oracle:fedavg"], []),
    "main": (["fedavg", "fedavg_pl", "fedfixmatch", "fednoro", "rscfed_pl", "surgical", "fedpsl", "fedmlp"],
             ["--opt", "surgical:warmup_epochs=0", "--opt", "fedmlp:warmup_rounds=10",
              "--opt", "fednoro:rampup_begin=0", "--opt", "fednoro:rampup_end=29"]),
    "fedmlp_t10": (["fedmlp"], ["--opt", "fedmlp:warmup_rounds=10", "--opt", "fedmlp:tau0=0.1",
                                "--opt", "fedmlp:tau1=0.1", "--opt", "fedmlp:adaptive_threshold=false"]),
    "fedmlp_nomld": (["fedmlp"], ["--opt", "fedmlp:warmup_rounds=10", "--opt", "fedmlp:mld=false"]),
    # Table 3's other switches, on the row that tags (at the paper's ratios nothing is tagged here)
    "fedmlp_t10_nowpc": (["fedmlp"], ["--opt", "fedmlp:warmup_rounds=10", "--opt", "fedmlp:tau0=0.1",
                                      "--opt", "fedmlp:tau1=0.1", "--opt", "fedmlp:adaptive_threshold=false",
                                      "--opt", "fedmlp:wpc=false"]),
    "fedmlp_t10_nocr": (["fedmlp"], ["--opt", "fedmlp:warmup_rounds=10", "--opt", "fedmlp:tau0=0.1",
                                     "--opt", "fedmlp:tau1=0.1", "--opt", "fedmlp:adaptive_threshold=false",
                                     "--opt", "fedmlp:stage2_consistency=false"]),
}
LABELS = {"oracle:fedavg": "FedAvg, every site labeled (upper bound)", "fedavg": "FedAvg", "fedavg_pl": "FedAvg-PL", "fedfixmatch": "FedFixMatch", "fednoro": "FedNoRo",
          "rscfed_pl": "RSCFed",
          "surgical": "Surgical", "fedpsl": "FedPSL", "fedmlp": "FedMLP"}
# FedMLP Tables 1-2, the level "one class per site": (BACC, AUROC, mAP) in %, last-epoch model.
PAPER = {"fedavg": {"cxr14": (50.00, 66.64, 12.16), "ich": (50.00, 76.32, 32.62)},
         "fedavg_pl": {"cxr14": (53.30, 64.80, 11.49), "ich": (61.46, 79.48, 40.60)},
         "fedfixmatch": {"cxr14": (54.52, 65.59, 11.42), "ich": (50.00, 74.90, 31.05)},
         "fednoro": {"cxr14": (66.54, 74.23, 20.31), "ich": (74.64, 85.09, 59.28)},
         "rscfed_pl": {"cxr14": (50.49, 65.92, 14.70), "ich": (67.16, 71.16, 36.89)},
         "fedmlp": {"cxr14": (70.08, 75.76, 22.48), "ich": (80.07, 88.47, 59.31)}}
METRICS = ("bacc", "auroc", "ap")
WORDS = {6: "six", 8: "eight"}


# The data each table runs on: BloodMNIST (the ``partial`` protocol of fedlabels prepare) or the embedded
# synthetic chest X-ray scenario with its drop-k-classes option (``fedlabels synth cxr --missing k``; 6 sites,
# so that one finding per site covers the six).
DATASETS = {
    "blood": {"classes": 8, "title": "BloodMNIST, 8 sites x ~150 cases", "test": 800,
              "data": lambda missing: "blood-one-class-s{seed}" if missing == 7 else f"blood-missing{missing}-s{{seed}}"},
    "cxr": {"classes": 6, "title": "the synthetic chest X-ray scenario (drop k findings a site), 6 sites x 90-240 cases",
            "test": 400, "data": lambda missing: f"cxr-missing{missing}-s{{seed}}"},
}


def data_dir(out: Path, missing: int = 7, dataset: str = "blood") -> Path:
    return out / "data" / DATASETS[dataset]["data"](missing)


def run_dir(out: Path, name: str, missing: int = 7, dataset: str = "blood") -> Path:
    """Runs at one class per site keep the run's name; other levels say theirs."""
    return out / "runs" / (name if missing == DATASETS[dataset]["classes"] - 1 else f"{name}-missing{missing}")


def prepare(args, seed: int, missing: int) -> None:
    target = Path(str(data_dir(args.out, missing, args.dataset)).replace("{seed}", str(seed)))
    if (target / "scenario.yaml").is_file():
        return
    fedlabels = str(Path(sys.executable).with_name("fedlabels"))
    if args.dataset == "cxr":
        cmd = [fedlabels, "synth", "cxr", "--sites", "6", "--missing", str(missing), "--cases", "150",
               "--test-cases", str(DATASETS["cxr"]["test"]), "--size", "32", "--seed", str(seed), "--out", str(target)]
    else:
        cmd = [fedlabels, "prepare", "bloodmnist", "--src", str(args.src), "--protocol", "partial", "--sites", "8",
               "--missing", str(missing), "--limit", "1200", "--test-cases", "800", "--size", "32", "--seed",
               str(seed), "--out", str(target), "--quiet"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def bench(args, task) -> int:
    """One (run, seed): a bench process of its own, so that two can go at once (cells are per seed)."""
    name, seed, missing = task
    methods, extra = RUNS[name]
    cmd = [str(Path(sys.executable).with_name("fedlabels")), "bench", "--data", str(data_dir(args.out, missing, args.dataset)),
           "--methods", ",".join(methods), "--seeds", str(seed),
           *(["--protocol", args.protocol, *PRESET_COMMON] if args.protocol else COMMON), *extra,
           "--out", str(run_dir(args.out, name, missing, args.dataset))]
    log = args.out / "logs" / f"{run_dir(args.out, name, missing, args.dataset).name}-seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.time()
    print(f"[fedmlp] {name} seed {seed}: {' '.join(cmd)}", flush=True)
    with open(log, "a") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    print(f"[fedmlp] {name} seed {seed}: exit {rc} after {time.time() - t0:.0f}s (log {log})", flush=True)
    return rc


def read_cells(out: Path, missing: int = 7, dataset: str = "blood") -> dict:
    """(run, row, seed) -> finished cell."""
    cells = {}
    for name in RUNS:
        for path in sorted((run_dir(out, name, missing, dataset) / "cells").glob("*.json")):
            cell = json.loads(path.read_text())
            cells[(name, cell["config"]["method"], int(cell["config"]["seed"]))] = cell
    return cells


def value(cell, metric, model="last", rnd=30):
    hits = [r["value"] for r in cell["rows"] if r["round"] == rnd and r["model"] == model and r["group"] == "pooled"
            and r["class"] == "mean" and r["metric"] == metric]
    return hits[0] if hits and hits[0] is not None else None


def class_value(cell, cls, metric, model="last", rnd=30):
    hits = [r["value"] for r in cell["rows"] if r["round"] == rnd and r["model"] == model and r["group"] == "pooled"
            and r["class"] == cls and r["metric"] == metric]
    return hits[0] if hits else None


def own_classes(out: Path, seed: int, missing: int = 7, dataset: str = "blood") -> dict:
    """site -> the classes it annotates, from the seed's scenario."""
    sys.path.insert(0, str(REPO / "custom"))
    from fedlabels.profile import load_scenario

    sc = load_scenario(Path(str(data_dir(out, missing, dataset)).replace("{seed}", str(seed))), check_files=False,
                       with_test=False)
    return {name: list(site.profile.annotated) for name, site in sc.sites.items()}


def fmt(vals):
    vals = [100 * v for v in vals if v is not None]
    if not vals:
        return "not run"
    return f"{np.mean(vals):.1f}" + (f" ± {np.std(vals, ddof=1):.1f}" if len(vals) > 1 else "")


def tags(cell):
    """Tags the sites made over the run (pseudo-negatives, pseudo-positives), from the round records."""
    neg = sum(s.get("tagged_negatives", 0) for r in cell.get("records", []) for s in r["sites"].values())
    pos = sum(s.get("tagged_positives", 0) for r in cell.get("records", []) for s in r["sites"].values())
    return neg, pos


def table(out: Path, seeds, levels, protocol=None, dataset: str = "blood") -> str:
    lines = [f"# FedMLP's comparison on {DATASETS[dataset]['title']}, 3 splits", "",
             (f"Every row trains with the `{protocol}` preset (`bundles/cxr_resnet18/configs/protocols/"
              f"{protocol}.json`: 0-255 -> [-1, 1] scaling, ResNet-18 at width 0.25, 32 px, batch 16, Adam 1e-3 "
              "fresh each round). " if protocol else "Every row trains with the bundle's defaults (per-image "
              "min-max scaling). ") +
             "Last model after 30 rounds (about 300 local steps per site) and the best on validation; pooled "
             f"test split ({DATASETS[dataset]['test']} cases); macro BACC at 0.5, AUROC, mAP in %; mean ± sd over the seeds' splits "
             "(the count of seeds in brackets). Paper: FedMLP Tables 1-2 at one class per site "
             "(ChestX-ray14 / ICH, last-epoch model, 500 rounds, ImageNet ResNet-18, about 5,000-6,000 training cases a site: the paper splits 25,000 ICH "
             "training images over 5 sites and does not print its ChestX-ray14 count). "
             "RSCFed's sites validate only in the rounds they are drawn, so no round is a best-model candidate "
             "and its best-on-validation model is the final one."]
    for missing in levels:
        lines += section(out, seeds, missing, dataset)
    return "\n".join(lines) + "\n"


def section(out: Path, seeds, missing: int, dataset: str = "blood") -> list:
    cells = read_cells(out, missing, dataset)
    classes = DATASETS[dataset]["classes"]
    keep = classes - missing
    rows = [("oracle", "oracle:fedavg", LABELS["oracle:fedavg"])] if any(run == "oracle" for run, _, _ in cells) else []
    rows += [("main", m, LABELS[m]) for m in RUNS["main"][0]]
    if any(run not in ("main", "oracle") for run, _, _ in cells):
        rows += [("fedmlp_t10", "fedmlp", "FedMLP, T0 = T1 = 10 %, no ST"),
                 ("fedmlp_t10_nowpc", "fedmlp", "FedMLP, T0 = T1 = 10 %, no ST, w/o WPC"),
                 ("fedmlp_t10_nocr", "fedmlp", "FedMLP, T0 = T1 = 10 %, no ST, w/o CR"),
                 ("fedmlp_nomld", "fedmlp", "FedMLP w/o MLD")]
    floor = sorted({row for (run, row, _) in cells if run == "main" and row.startswith("local:")})
    lines = ["", f"## Each site annotates {keep} of the {classes} classes (--missing {missing})", "",
             "| row | BACC | AUROC | mAP | best-on-val AUROC | tags (neg / pos, all sites, all rounds) | "
             "paper BACC / AUROC / mAP, CXR14 | ICH |", "|---|---|---|---|---|---|---|---|"]
    for run, row, label in rows:
        got = [cells.get((run, row, s)) for s in seeds]
        got = [c for c in got if c is not None]
        t = [tags(c) for c in got] if row == "fedmlp" else []
        tag_text = " ; ".join(f"{n} / {p}" for n, p in t) if t else ""
        paper = PAPER.get(row) if run == "main" and keep == 1 else None
        ptext = (" / ".join(f"{v:.1f}" for v in paper["cxr14"]), " / ".join(f"{v:.1f}" for v in paper["ich"])) \
            if paper else ("", "")
        lines.append(f"| {label} ({len(got)}) | " + " | ".join(fmt([value(c, m) for c in got]) for m in METRICS)
                     + f" | {fmt([value(c, 'auroc', 'best') for c in got])} | {tag_text} | {ptext[0]} | {ptext[1]} |")
    if floor:
        lines += ["", f"Floor: each site alone (it annotates {keep} class(es); scored on all {WORDS[classes]}), 30 epochs.", "",
                  "| site | BACC | AUROC | mAP |", "|---|---|---|---|"]
        for row in floor:
            got = [c for c in (cells.get(("main", row, s)) for s in seeds) if c is not None]
            lines.append(f"| {row} ({len(got)}) | " + " | ".join(fmt([value(c, m) for c in got]) for m in METRICS) + " |")
        own = {m: [] for m in METRICS}
        for s in seeds:
            sites = own_classes(out, s, missing, dataset)
            for m in METRICS:
                per_class = {}
                for row in floor:
                    if ("main", row, s) not in cells:
                        continue
                    for c in sites[row.split(":", 1)[1]]:
                        v = class_value(cells[("main", row, s)], c, m)
                        if v is not None:
                            per_class.setdefault(c, []).append(v)
                if len(per_class) == classes:
                    own[m].append(float(np.mean([max(v) for v in per_class.values()])))
        lines += ["", "Local learning, one model per class: each class scored by the best of the sites that "
                  f"annotate it, trained alone (the mean over the {WORDS[classes]} classes; an optimistic floor, since the "
                  "best site is picked on test data; at one class per site it is the one site): " + ", ".join(f"{m.upper()} {fmt(own[m])}" for m in METRICS)
                  + ". A federated row that does not beat it adds nothing over the sites' own models."]
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", choices=list(DATASETS), default="blood",
                   help="blood: BloodMNIST from --src; cxr: the synthetic chest X-ray scenario (fedlabels synth "
                        "cxr --missing k, 6 sites)")
    p.add_argument("--src", default=str(REPO.parent / "shared" / "data" / "medmnist"))
    p.add_argument("--out", type=Path, help="default: benchmarks/results/fedmlp (blood), fedmlp-cxr (cxr)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--runs", nargs="+", default=[r for r in RUNS if r != "oracle"], choices=list(RUNS),
                   help="default: every run but the upper bound (oracle)")
    p.add_argument("--jobs", type=int, default=1, help="bench runs at once (one torch thread each)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--levels", type=int, nargs="+",
                   help="--missing levels: classes each site does not annotate (default: one class per site, 7 "
                        "for blood, 5 for cxr); the ablation rows run at that level only")
    p.add_argument("--protocol", default="", help="a preset every row trains with (fedmlp_blood); '' = the "
                                                 "bundle's defaults, as the first table")
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args()
    args.out = (args.out or REPO / "benchmarks" / "results" / ("fedmlp" if args.dataset == "blood" else "fedmlp-cxr")).resolve()
    args.levels = args.levels or [DATASETS[args.dataset]["classes"] - 1]
    if not args.table_only:
        if args.dataset == "blood" and not (Path(args.src) / "bloodmnist.npz").is_file():
            raise SystemExit(f"{Path(args.src) / 'bloodmnist.npz'}: not found")
        for missing in args.levels:
            for seed in args.seeds:
                prepare(args, seed, missing)
        # level by level, seed by seed: a table fills evenly
        tasks = [(name, seed, missing) for missing in args.levels for seed in args.seeds for name in args.runs
                 if missing == DATASETS[args.dataset]["classes"] - 1 or name in ("main", "oracle")]
        with ThreadPoolExecutor(args.jobs) as pool:
            codes = list(pool.map(lambda task: bench(args, task), tasks))
        if any(codes):
            print(f"[fedmlp] some runs failed: {dict(zip(tasks, codes))}", flush=True)
    text = table(args.out, args.seeds, args.levels, args.protocol or None, args.dataset)
    tmp = args.out / ".TABLE.md"
    tmp.write_text(text)
    os.replace(tmp, args.out / "TABLE.md")
    print(text)


if __name__ == "__main__":
    main()
