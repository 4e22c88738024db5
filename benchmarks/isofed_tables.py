"""IsoFed's Tables 1-2 (BloodMNIST, PneumoniaMNIST) on the real MedMNIST files, with the paper's numbers beside ours.

    python benchmarks/isofed_tables.py --src ../shared/data/medmnist --out benchmarks/results/isofed [--jobs 2]
    python benchmarks/isofed_tables.py --out benchmarks/results/isofed --table-only

The paper's protocol: 4 sites, Dirichlet(gamma) label split of the official
training split, gamma in {0.8, 0.5}, L:U in {3:1, 2:2, 1:3} (the first L
sites keep their labels), the official test split. Every cell is a
``fedlabels bench`` cell (in-process round engine = the FLARE arithmetic):

* one bench run per (dataset, gamma, L:U): mt_wfedavg, rscfed, isofed,
  isofed_nopt and the floor (each labeled site alone); seeds ``--seeds``
  (``--seeds-13`` for the L:U = 1:3 rows); each seed is its own Dirichlet split;
* one per (dataset, gamma) for the upper bound ``oracle:wfedavg`` (the same
  splits with every site's labels; the Dirichlet split depends on the seed and
  gamma only, so L:U changes who keeps labels, not who holds which case).

Runs are resumable (finished cells are skipped) and go in priority order: the
L:U = 1:3 rows first. ``--jobs 2`` runs two bench processes at once with one
torch thread each. The table (``TABLE.md``) is assembled from every run's
finished cells: the last model after ``--rounds`` rounds, pooled test split,
mean ± sd over seeds, and the paper's value; a cell more than 3 points from the
paper is marked. Cells not run yet are shown as "not run".
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

METHODS = ["mt_wfedavg", "rscfed", "isofed", "isofed_nopt"]
UB = "oracle:wfedavg"
LABELS = {UB: "wFedAvg (UB)", "mt_wfedavg": "MT+wFedAvg", "rscfed": "RSCFed", "isofed": "IsoFed",
          "isofed_nopt": "IsoFed w/o PT"}
METRICS = ("accuracy", "auroc", "precision", "recall")

# The paper's Table 1 (BloodMNIST) and Table 2 (PneumoniaMNIST): (method, L) -> gamma -> (acc, auc, prec, recall) in %.
# Saha et al., "IsoFed: Federated learning with isolated aggregation...", MICCAI 2023. "w/o PT" is printed for
# OrganAMNIST only.
PAPER = {
    "bloodmnist": {
        (UB, 4): {0.8: (79.57, 96.61, 77.65, 75.70), 0.5: (79.45, 96.80, 78.28, 73.31)},
        ("mt_wfedavg", 3): {0.8: (77.32, 96.70, 74.16, 73.79), 0.5: (70.89, 95.11, 73.46, 65.06)},
        ("rscfed", 3): {0.8: (76.94, 95.54, 75.11, 71.18), 0.5: (75.18, 94.99, 76.55, 68.96)},
        ("isofed", 3): {0.8: (79.43, 97.32, 76.70, 76.67), 0.5: (76.10, 95.88, 77.13, 72.29)},
        ("mt_wfedavg", 2): {0.8: (75.88, 96.56, 72.85, 71.94), 0.5: (58.29, 88.35, 57.85, 60.46)},
        ("rscfed", 2): {0.8: (75.97, 95.30, 73.58, 72.77), 0.5: (61.18, 91.50, 54.85, 60.79)},
        ("isofed", 2): {0.8: (80.47, 97.25, 77.11, 78.11), 0.5: (64.05, 90.01, 60.26, 64.03)},
        ("mt_wfedavg", 1): {0.8: (75.24, 95.13, 72.43, 70.37), 0.5: (52.56, 89.39, 57.89, 55.81)},
        ("rscfed", 1): {0.8: (71.88, 93.96, 70.47, 67.75), 0.5: (19.35, 64.31, 7.05, 23.62)},
        ("isofed", 1): {0.8: (79.23, 96.43, 76.68, 77.00), 0.5: (63.70, 90.58, 70.22, 63.81)},
    },
    "pneumoniamnist": {
        (UB, 4): {0.8: (87.34, 95.32, 86.71, 89.02), 0.5: (87.02, 95.64, 86.45, 88.76)},
        ("mt_wfedavg", 3): {0.8: (86.54, 95.20, 85.94, 88.21), 0.5: (86.86, 94.85, 85.92, 87.86)},
        ("rscfed", 3): {0.8: (86.58, 95.63, 89.02, 88.68), 0.5: (86.70, 94.50, 85.75, 87.65)},
        ("isofed", 3): {0.8: (87.10, 95.04, 86.45, 89.00), 0.5: (89.26, 95.80, 88.26, 89.44)},
        ("mt_wfedavg", 2): {0.8: (83.65, 89.74, 82.45, 82.99), 0.5: (82.21, 96.17, 83.20, 85.26)},
        ("rscfed", 2): {0.8: (78.37, 87.36, 77.31, 78.76), 0.5: (84.46, 95.58, 84.58, 86.88)},
        ("isofed", 2): {0.8: (84.70, 90.75, 83.56, 84.64), 0.5: (82.68, 95.15, 83.34, 85.41)},
        ("mt_wfedavg", 1): {0.8: (81.41, 89.84, 82.05, 77.69), 0.5: (79.97, 94.45, 81.28, 83.12)},
        ("rscfed", 1): {0.8: (78.85, 86.66, 77.56, 76.84), 0.5: (62.50, 50.00, 31.25, 50.00)},
        ("isofed", 1): {0.8: (85.00, 91.68, 83.98, 83.95), 0.5: (77.12, 93.65, 80.47, 81.40)},
    },
}


def _seeds(text):
    return [int(s) for s in text.split(",") if s.strip()]


def data_dir(out: Path, ds: str, gamma: float, labeled: int) -> Path:
    return out / "data" / f"{ds}-g{gamma}-l{labeled}-s{{seed}}"


def prepare(args, ds, gamma, labeled, seed) -> None:
    target = Path(str(data_dir(args.out, ds, gamma, labeled)).replace("{seed}", str(seed)))
    if (target / "scenario.yaml").is_file():
        return
    cmd = ["fedlabels", "prepare", ds, "--src", str(args.src), "--protocol", "isofed", "--gamma", str(gamma),
           "--labeled", str(labeled), "--seed", str(seed), "--out", str(target)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def runs(args) -> list:
    """(name, dataset, gamma, labeled, methods, seeds) in priority order: L:U = 1:3 first."""
    out = []
    for labeled in args.labeled:
        for ds in args.datasets:
            for gamma in args.gammas:
                seeds = args.seeds_13 if labeled == 1 else args.seeds
                out.append((f"{ds}-g{gamma}-l{labeled}", ds, gamma, labeled, METHODS, seeds))
                if labeled == 1:  # the upper bound on the same splits as the 1:3 rows
                    out.append((f"{ds}-g{gamma}-ub", ds, gamma, 1, [UB], args.seeds_13))
    return out


def bench(args, run) -> int:
    name, ds, gamma, labeled, methods, seeds = run
    cmd = ["fedlabels", "bench", "--data", str(data_dir(args.out, ds, gamma, labeled)), "--bundle", "medmnist_cnn",
           "--methods", ",".join(methods), "--seeds", ",".join(map(str, seeds)), "--rounds", str(args.rounds),
           "--local-epochs", "1", "--out", str(args.out / "runs" / name)]
    if args.protocol:  # the preset: input scaling, augmentation, optimizer (rounds stay --rounds)
        cmd += ["--protocol", args.protocol, "--eval-rounds", ",".join(str(r) for r in args.eval_rounds)]
    log = args.out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.time()
    print(f"[isofed] {name}: {' '.join(cmd)}", flush=True)
    with open(log, "a") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    print(f"[isofed] {name}: exit {rc} after {time.time() - t0:.0f}s (log {log})", flush=True)
    return rc


def read_results(out: Path) -> dict:
    """(run name, method, seed, metric) -> value: last model, final round, pooled test split, class mean;
    metric "predicted" = how many classes the model predicts at all (per-class recall > 0): 1 = collapsed."""
    values, rounds, predicted = {}, {}, {}
    for path in sorted((out / "runs").glob("*/cells/*.json")):  # finished cells (a run may still be going)
        name = path.parent.parent.name
        for r in json.loads(path.read_text())["rows"]:
            if r["model"] != "last" or r["group"] != "pooled" or r["value"] is None:
                continue
            key = (name, r["method"], int(r["seed"]), r["metric"])
            if int(r["round"]) < rounds.get(key, -1):
                continue
            if r["class"] == "mean":
                values[key], rounds[key] = float(r["value"]), int(r["round"])
            elif r["metric"] == "recall":
                pk = (name, r["method"], int(r["seed"]), "predicted")
                predicted.setdefault(pk, {})[r["class"]] = float(r["value"]) > 0
    values.update({k: float(sum(v.values())) for k, v in predicted.items()})
    return values


def _cell(values, run, method, metric="accuracy", paper=None):
    vals = [v for (r, m, s, mt), v in values.items() if r == run and m == method and mt == metric]
    if not vals:
        return "not run"
    mean = 100 * float(np.mean(vals))
    text = f"{mean:.1f}" + (f" ± {100 * float(np.std(vals, ddof=1)):.1f}" if len(vals) > 1 else "")
    collapsed = sum(1 for (r, m, s, mt), v in values.items() if r == run and m == method and mt == "predicted" and v == 1)
    text += f" ({collapsed}/{len(vals)} collapsed)" if collapsed else ""
    text += f" (n = {len(vals)}, unfinished)" if len(vals) < 3 else ""  # one or two splits are no estimate
    return text + (f" / {paper:.1f}" if paper is not None else "")


def site_share(folders, k) -> float | None:
    """Site k's share of the training cases (%), mean over these prepared splits."""
    shares = []
    for folder in folders:
        counts = {p.parent.name: len(json.loads(p.read_text())["training"]) for p in folder.glob("site-*/datalist.json")}
        if f"site-{k}" in counts and sum(counts.values()):
            shares.append(100 * counts[f"site-{k}"] / sum(counts.values()))
    return float(np.mean(shares)) if shares else None


def glance(args, values) -> list:
    """Accuracy only, one row per (dataset, gamma, L:U): ours / paper; the best labeled site alone."""
    cols = [UB] + METHODS
    lines = ["## Accuracy at a glance (ours / paper; mean ± sd over seeds; collapsed = recalls one class)", "",
             "| dataset | gamma | L:U | " + " | ".join(LABELS[m] for m in cols) + " | best labeled site alone (chosen on test) |",
             "|---|---|---|" + "---|" * (len(cols) + 1)]
    for ds in args.datasets:
        for gamma in args.gammas:
            for labeled in (3, 2, 1):
                run = f"{ds}-g{gamma}-l{labeled}"
                cells = []
                for m in cols:
                    paper = PAPER[ds].get((m, 4 if m == UB else labeled), {}).get(gamma)
                    paper = None if paper is None else paper[0]  # accuracy
                    cells.append(_cell(values, f"{ds}-g{gamma}-ub" if m == UB else run, m, paper=paper))
                floors = [(float(np.mean([v for (r, mm, s, mt), v in values.items()
                                          if r == run and mm == f"local:site-{k}" and mt == "accuracy"] or [np.nan])), k)
                          for k in range(1, labeled + 1)]
                floors = [f for f in floors if not np.isnan(f[0])]
                best = max(floors) if floors else None
                splits = sorted((args.out / "data").glob(f"{ds}-g{gamma}-l{labeled}-s*"))
                share = site_share(splits, best[1]) if best else None
                cells.append(f"{_cell(values, run, f'local:site-{best[1]}')} (site-{best[1]}"
                             + (f", {share:.0f} % of the training cases)" if share is not None else ")")
                             if best else "not run")
                lines.append(f"| {ds} | {gamma} | {labeled}:{4 - labeled} | " + " | ".join(cells) + " |")
    return lines + [""]


def curve(args) -> list:
    """Accuracy of every finished row at each scored round (mean ± sd over seeds): whether 20 rounds is flat."""
    acc = {}
    for path in sorted((args.out / "runs").glob("*/cells/*.json")):
        for r in json.loads(path.read_text())["rows"]:
            if (r["model"], r["group"], r["class"], r["metric"]) == ("last", "pooled", "mean", "accuracy") \
                    and r["value"] is not None:
                acc.setdefault((path.parent.parent.name, r["method"], int(r["round"])), []).append(float(r["value"]))
    rounds = sorted({k[2] for k in acc})
    if len(rounds) < 2:
        return []
    lines = ["## The curve: accuracy at each scored round (mean ± sd over seeds)", "",
             "| run | method | " + " | ".join(f"round {r}" for r in rounds) + " |", "|---|---|" + "---|" * len(rounds)]
    for run, method in sorted({k[:2] for k in acc}):
        cells = [f"{100 * np.mean(v):.1f} ± {100 * np.std(v, ddof=1) if len(v) > 1 else 0:.1f}"
                 if (v := acc.get((run, method, r))) else "—" for r in rounds]
        lines.append(f"| {run} | {LABELS.get(method, method)} | " + " | ".join(cells) + " |")
    return lines + [""]


def table(args) -> str:
    values = read_results(args.out)
    lines = [f"# IsoFed Tables 1-2 on the real MedMNIST files: ours beside the paper's", "",
             f"Written by `benchmarks/isofed_tables.py`"
             + (f" with the `{args.protocol}` preset (`bundles/medmnist_cnn/configs/protocols/{args.protocol}.json`: "
                "fixed 0-255 -> [-1, 1] scaling, left-right flip, Adam 1e-3 fresh each round, batch 64)"
                if args.protocol else " with the bundle's defaults") + ". "
             f"Last model after {args.rounds} rounds x 1 local epoch, pooled official test split, mean ± sd over "
             "seeds (each seed its own Dirichlet split; n = seeds run; \"not run\" = not measured yet). `paper`: "
             "Saha et al. 2023, Tables 1-2. `!` marks |ours - paper| > 3 points. `classes predicted`: per seed, how "
             "many classes the model recalls (per-class recall above 0; 1 = collapsed: every other class has recall "
             "0). Floor rows: each labeled site trained alone for the same number of epochs; the glance's best "
             "labeled site is chosen on test.", ""]
    lines += glance(args, values)
    lines += curve(args)
    for ds in args.datasets:
        for gamma in args.gammas:
            lines += [f"## {ds}, gamma = {gamma}", "",
                      "| method | L:U | " + " | ".join(f"{m} (ours / paper)" for m in METRICS)
                      + " | classes predicted | n |",
                      "|---|---|" + "---|" * len(METRICS) + "---|---|"]
            rows = [(UB, 4, f"{ds}-g{gamma}-ub")]
            for labeled in (3, 2, 1):
                rows += [(m, labeled, f"{ds}-g{gamma}-l{labeled}") for m in METHODS]
                rows += [(f"local:site-{k}", labeled, f"{ds}-g{gamma}-l{labeled}") for k in range(1, labeled + 1)]
            for method, labeled, run in rows:
                paper = PAPER[ds].get((method, labeled), {}).get(gamma)
                cells, n = [], 0
                for i, metric in enumerate(METRICS):
                    vals = [v for (r, m, s, mt), v in values.items() if r == run and m == method and mt == metric]
                    n = max(n, len(vals))
                    if not vals:
                        ours = "not run"
                    else:
                        mean = 100 * float(np.mean(vals))
                        ours = f"{mean:.1f}" + (f" ± {100 * float(np.std(vals, ddof=1)):.1f}" if len(vals) > 1 else "")
                        if paper is not None and abs(mean - paper[i]) > 3:
                            ours += " !"
                    cells.append(f"{ours} / {paper[i]:.1f}" if paper is not None else f"{ours} / —")
                label = LABELS.get(method, method)
                lu = "4:0" if method == UB else f"{labeled}:{4 - labeled}"
                pred = sorted(int(v) for (r, m, s, mt), v in values.items()
                              if r == run and m == method and mt == "predicted")
                lines.append(f"| {label} | {lu} | " + " | ".join(cells) + f" | {','.join(map(str, pred)) or '-'} | {n} |")
            lines.append("")
    return "\n".join(lines)


# IsoFed's pretraining readings (fedlabels.methods.semisup.SemiSupClient: pretrain_target, pretrain_sites,
# pretrain_lr, pretrain_epochs), each a `fedlabels bench` run of its own under ablations/ (ablations/run.sh)
# on the same prepared splits as the table; the option each reading changes is read from its cells.
PRETRAIN_DEFAULTS = {"pretrain_target": "both", "pretrain_sites": "unlabeled", "pretrain_lr": "the client's lr",
                     "pretrain_epochs": 1}


def ablation_table(out: Path, datasets) -> str | None:
    """ablations/TABLE.md: one row per reading, accuracy at each scored round, AUROC and classes at the last.
    The readings' runs are the folders ``ablations/<dataset>-...`` (run.sh names them so); other ablations
    kept under ``ablations/`` are not readings."""
    rows, floors, splits, protocols, rounds = {}, set(), set(), set(), set()  # rows: label -> key -> values
    for path in sorted(p for ds in datasets for p in (out / "ablations").glob(f"{ds}-*/cells/*.json")):
        cell = json.loads(path.read_text())
        cfg = cell["config"]
        splits.add(Path(cfg["data"]))
        protocols.add(cfg.get("protocol") or "bundle default")
        rounds.add(cfg["rounds"])
        changed = {k: v for k, v in cfg["client_options"].items() if k.startswith("pretrain_")}
        label = LABELS.get(cfg["method"], cfg["method"]) + (
            " (" + ", ".join(f"{k}={v}" for k, v in changed.items()) + ")" if changed else "")
        if label.startswith("local:") and (label, cfg["seed"]) in floors:
            continue  # the floor is the same cell in every reading's run: counted once per split
        floors.add((label, cfg["seed"]))
        vals = rows.setdefault(label, {})
        for r in cell["rows"]:
            if r["model"] == "last" and r["group"] == "pooled" and r["value"] is not None:
                if r["class"] == "mean" and r["metric"] in ("accuracy", "auroc"):
                    vals.setdefault((r["metric"], int(r["round"])), []).append(float(r["value"]))
                elif r["metric"] == "recall" and r["class"] != "mean":
                    key = ("recalled", int(r["round"]), cfg["seed"])
                    vals[key] = vals.get(key, 0) + (float(r["value"]) > 0)
    rows = [(label if not label.startswith("local:") else f"{label} alone "
             f"({site_share(sorted(splits), int(label.split('-')[-1])):.0f} % of the training cases, mean over "
             "the splits)", vals) for label, vals in rows.items()]
    if not rows:
        return None
    rows.sort(key=lambda r: (r[0].startswith("local:"), r[0] != "IsoFed", r[0] != "IsoFed w/o PT", r[0]))
    scored = sorted({k[1] for _, v in rows for k in v if k[0] == "accuracy"})
    last = scored[-1]

    def cell(v):
        return f"{100 * np.mean(v):.1f} ± {100 * np.std(v, ddof=1):.1f}" if len(v) > 1 else f"{100 * v[0]:.1f}"

    lines = ["# IsoFed's pretraining readings, each an ablation row", "",
             "Written by `benchmarks/isofed_tables.py --table-only` from the cells under `ablations/` "
             "(`ablations/run.sh`: one `fedlabels bench` run per reading). Splits: "
             + ", ".join(f"`{d.name}`" for d in sorted(splits)) + f" (the main table's), the `{'`, `'.join(sorted(protocols))}` "
             f"preset, {', '.join(map(str, sorted(rounds)))} rounds. Each reading differs from the `IsoFed` row in the "
             "one option named; the defaults are "
             + ", ".join(f"{k} = {v}" for k, v in PRETRAIN_DEFAULTS.items())
             + " (`fedlabels.methods.semisup`). Last model, pooled official test split, mean ± sd over the splits; "
             "`recalls` and `per split` in seed order; `recalls`: the classes with recall above 0 (1 = one class "
             "predicted).", "",
             "| row | " + " | ".join(f"accuracy, round {r}" for r in scored) + f" | AUROC, round {last} | recalls | per split (accuracy, round {last}) |",
             "|---|" + "---|" * (len(scored) + 3)]
    for label, vals in rows:
        recalled = [int(v) for k, v in sorted(vals.items()) if k[0] == "recalled" and k[1] == last]
        lines.append(f"| {label} | " + " | ".join(cell(vals[("accuracy", r)]) for r in scored)
                     + f" | {cell(vals[('auroc', last)])} | {','.join(map(str, recalled))} | "
                     + ", ".join(f"{100 * v:.1f}" for v in vals[("accuracy", last)]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", type=Path, default=Path("../shared/data/medmnist"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/isofed"))
    p.add_argument("--datasets", default="bloodmnist,pneumoniamnist")
    p.add_argument("--gammas", default="0.8,0.5")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seeds", default="0,1,2", help="seeds of the L:U = 3:1 and 2:2 rows (each its own split)")
    p.add_argument("--seeds-13", default="0,1,2", help="seeds of the L:U = 1:3 rows")
    p.add_argument("--labeled", default="1,3,2", help="which L (labeled sites of 4) to run, in this order")
    p.add_argument("--protocol", default="isofed", help="the preset every row trains with ('' = the bundle's defaults)")
    p.add_argument("--eval-rounds", default="5,10,20", help="rounds scored (with --protocol), the curve")
    p.add_argument("--jobs", type=int, default=1, help="bench processes at once (one torch thread each when > 1)")
    p.add_argument("--table-only", action="store_true", help="only assemble TABLE.md from finished cells")
    args = p.parse_args(argv)
    args.datasets = [d for d in args.datasets.split(",") if d]
    args.gammas = [float(g) for g in args.gammas.split(",") if g]
    args.seeds, args.seeds_13, args.labeled = _seeds(args.seeds), _seeds(args.seeds_13), _seeds(args.labeled)
    # the run's last round is always scored (fedlabels bench refuses scored rounds that stop before it)
    args.eval_rounds = sorted({r for r in _seeds(args.eval_rounds) if r <= args.rounds} | {args.rounds})
    args.out = args.out.resolve()
    args.src = args.src.resolve()
    args.threads = 1 if args.jobs > 1 else int(os.environ.get("OMP_NUM_THREADS", "2"))
    if not args.table_only:
        for d in args.datasets:
            if not (args.src / f"{d}.npz").is_file():
                sys.exit(f"{args.src / (d + '.npz')}: missing (--src names the folder of the MedMNIST .npz files)")
        t0 = time.time()
        todo = runs(args)
        for _, ds, gamma, labeled, _, seeds in todo:  # every split first, one at a time (runs share them)
            for s in seeds:
                prepare(args, ds, gamma, labeled, s)
        print(f"[isofed] scenarios ready after {time.time() - t0:.0f}s", flush=True)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            codes = list(pool.map(lambda r: bench(args, r), todo))
        print(f"[isofed] all runs done in {time.time() - t0:.0f}s; exit codes {codes}", flush=True)
    text = table(args)
    tmp = args.out / "TABLE.md.tmp"  # a reader never sees half a table
    tmp.write_text(text)
    tmp.replace(args.out / "TABLE.md")
    readings = ablation_table(args.out, args.datasets)
    if readings:
        tmp = args.out / "ablations" / "TABLE.md.tmp"
        tmp.write_text(readings)
        tmp.replace(args.out / "ablations" / "TABLE.md")
    print(text)


if __name__ == "__main__":
    main()
