"""Partial labels at a realistic training budget: when do the class-wise rules beat naive FedAvg, and why?

Every method of the study trains with the same client (Adam, lr 1e-3, batch 16,
5 local epochs per round: the papers train 1-10), network and data; the rows
differ in the method only. Each global model is scored at several budgets, counted in cumulative
local optimiser steps per site (the mean over sites), on the fully labeled test
split, with diagnostics of the mechanism:

* per class: AUROC, balanced accuracy at 0.5, mean probability / prevalence
  (pooled and per test group = the site style a test case was drawn with);
* ``probe``: a linear probe (5-fold cross-validated logistic regression,
  scikit-learn) on the frozen features with the true labels -- do the
  features carry the finding?
* ``spearman``: Spearman(logit_c, sum of the features) over the test cases --
  does the head score a case by its overall feature activation?
* ``head_mean``: the mean of class c's head row (weights).

Datasets (one split per seed: the seed redraws the data too):

* ``cxr``: the embedded scenario (FedPSL's Table I label sets; infiltration is
  annotated only at site-1, pneumothorax only at site-4), 32 px;
* ``blood``: BloodMNIST (``../shared/data/medmnist``) as one-vs-rest
  multi-label, ``partial`` protocol, 4 sites x ~300 cases, each site
  annotating 4 of 8 classes so that classes 0 and 7 are single-site.

Network: the ``cxr_resnet18`` bundle's ResNet-18 (MONAI, stride-2 stem) at
``widen_factor`` 0.25 and 32 px, from scratch, so that 3 seeds x 8 methods x 2
datasets x ~1000 local steps per site fit this 2-core CPU machine.

Resumable, one cell (dataset, method, seed) at a time:
``OUT/cells/<dataset>-<method>-seed<s>.json`` (written atomically). The
summary ``OUT/summary.md`` and ``OUT/curves.png`` are rebuilt from the cells.

    python benchmarks/partial_label_study.py --datasets cxr blood --seeds 0 1 2 [--methods ...]
    python benchmarks/partial_label_study.py --summary      # tables and plot from the finished cells
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fedlabels.bundle import bundle_path
from fedlabels.data.synthetic import generate
from fedlabels.methods.base import load_weights
from fedlabels.profile import load_scenario, write_json_atomic
from fedlabels.references import federate, setups
from fedlabels.site import predict, test_loader

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "partial_label_study"
SHARED = REPO.parent / "shared" / "data" / "medmnist"
# Row -> (registered method, client options beyond the common ones).
METHODS = {
    "fedavg": ("fedavg", {}),                       # naive: missing labels trained as negatives
    "fedavg_pl": ("fedavg_pl", {}),                 # partial loss, plain FedAvg
    "fedprox": ("fedprox", {}),                     # partial loss, proximal term
    "surgical": ("surgical", {"warmup_epochs": 2}),
    "surgical_nowarmup": ("surgical", {"warmup_epochs": 0}),
    "fedpsl_tdma": ("fedpsl_tdma", {}),
    "fedpsl_tadl": ("fedpsl_tadl", {}),
    "fedpsl": ("fedpsl", {}),
}
COMMON = {"lr": 1e-3, "epochs": 5}
CONFIG = {"image_size": 32}                         # bundle config overrides
NETWORK = {"widen_factor": 0.25}
BLOOD_SITE_CLASSES = "0,1,2,3;1,2,4,5;2,3,5,6;4,5,6,7"   # classes 0 and 7 single-site
STEPS = (30, 60, 150, 300, 600, 1000)               # budget points, local steps per site


def scenario(dataset: str, seed: int, work: Path) -> Path:
    root = work / f"{dataset}-seed{seed}"
    if (root / "scenario.yaml").is_file():
        return root
    if dataset == "cxr":
        return generate("cxr", root, seed=seed, size=32, test_cases=600)
    cmd = [str(Path(sys.executable).with_name("fedlabels")), "prepare", "bloodmnist", "--src", str(SHARED),
           "--protocol", "partial", "--site-classes", BLOOD_SITE_CLASSES, "--limit", "1200", "--test-cases", "800",
           "--size", "32", "--seed", str(seed), "--out", str(root), "--quiet"]
    subprocess.run(cmd, check=True)
    return root


def single_site_classes(data) -> list:
    sc = load_scenario(data, check_files=False, with_test=False)
    return [c for c in sc.classes if sum(c in s.profile.annotated for s in sc.sites.values()) == 1]


@torch.no_grad()
def features_and_logits(net, loader):
    net.eval()
    feats, logits, labels, groups = [], [], [], []
    for batch in loader:
        f = net.extract(batch["image"])
        feats.append(f)
        logits.append(net.head(f))
        labels.append(torch.as_tensor(batch["label"]))
    return torch.cat(feats).numpy(), torch.cat(logits).numpy(), torch.cat(labels).numpy()


def diagnostics(net, weights, loader, classes, groups) -> dict:
    """Test metrics per class (pooled and per group) and the mechanism's diagnostics."""
    from scipy.stats import spearmanr
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from fedlabels.metrics import multilabel_metrics

    load_weights(net, weights)
    feats, logits, labels = features_and_logits(net, loader)
    probs = 1 / (1 + np.exp(-logits))
    out = {"pooled": multilabel_metrics(probs, labels, classes)["per_class"], "groups": {}, "probe": {},
           "spearman": {}, "head_mean": {}}
    for g in sorted(set(groups)):
        idx = np.array([i for i, x in enumerate(groups) if x == g])
        out["groups"][g] = {c: m["auroc"] for c, m in
                            multilabel_metrics(probs[idx], labels[idx], classes)["per_class"].items()}
    total = feats.sum(1)
    head = net.head.weight.detach().numpy()
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=1.0))
    from sklearn.metrics import roc_auc_score

    for c, name in enumerate(classes):
        y = labels[:, c].astype(int)
        if 0 < y.sum() < len(y) and min(y.sum(), len(y) - y.sum()) >= 5:
            cv = StratifiedKFold(5, shuffle=True, random_state=0)
            p = cross_val_predict(probe, feats, y, cv=cv, method="predict_proba")[:, 1]
            out["probe"][name] = float(roc_auc_score(y, p))
        rho = spearmanr(logits[:, c], total).statistic
        out["spearman"][name] = None if not np.isfinite(rho) else float(rho)
        out["head_mean"][name] = float(head[c].mean())
    return out


def run_cell(dataset: str, method: str, seed: int, work: Path, cells: Path, log, budget=STEPS) -> Path:
    path = cells / f"{dataset}-{method}-seed{seed}.json"
    if path.is_file():
        return path
    data = scenario(dataset, seed, work)
    bundle = bundle_path("cxr_resnet18")
    name, extra = METHODS[method]
    st = setups(bundle, data, seed=seed, network_overrides=NETWORK, config=CONFIG, method=name)
    # local steps per round and site: batches per epoch x epochs, the mean over sites
    steps_per_round = float(np.mean([len(s.context().train) for s in st.values()])) * COMMON["epochs"]
    points = sorted({max(1, round(s / steps_per_round)) for s in budget})
    rounds = points[-1]
    sc = load_scenario(data, sites=[], with_test=True)
    loader = test_loader(bundle, data, config=CONFIG)
    groups = [str(i.get("group")) for i in sc.test]
    net = next(iter(st.values())).net.__class__(in_channels=1, out_channels=len(sc.classes), **NETWORK)
    rows, t0 = [], time.time()

    def on_round(record, weights, best):
        rnd = record["round"] + 1
        if rnd in points:
            d = diagnostics(net, weights, loader, list(sc.classes), groups)
            rows.append({"round": rnd, "steps": rnd * steps_per_round, "seconds": time.time() - t0, **d})
            single = single_site_classes(data)
            log(f"[{dataset} {method} seed {seed}] {rnd * steps_per_round:.0f} steps/site: "
                + " ".join(f"{c} AUROC {d['pooled'][c]['auroc']:.3f} probe {d['probe'].get(c, float('nan')):.3f} "
                           f"rho {d['spearman'][c]:+.2f}" for c in single) + f" ({time.time() - t0:.0f}s)")

    federate(name, st, rounds, seed=seed, log=None, client_options={**COMMON, **extra}, on_round=on_round)
    doc = {"dataset": dataset, "method": method, "registered": name, "seed": seed, "options": {**COMMON, **extra},
           "network": {"bundle": "cxr_resnet18", **NETWORK, **CONFIG}, "steps_per_round": steps_per_round,
           "single_site_classes": single_site_classes(data), "classes": list(sc.classes), "points": rows,
           "seconds": time.time() - t0, "threads": torch.get_num_threads()}
    write_json_atomic(path, doc)
    return path


# ------------------------------------------------------------------ summary


def _ms(values) -> str:
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return "n/a"
    return f"{np.mean(v):.3f} ± {np.std(v):.3f}" if len(v) > 1 else f"{v[0]:.3f}"


def summary(out: Path) -> str:
    docs = [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))]
    if not docs:
        return "no finished cells"
    lines = ["# Partial labels at a realistic budget", "",
             "Generated by `python benchmarks/partial_label_study.py` (cells in `cells/`). Mean ± sd over seeds "
             "(each seed redraws the split). Steps = cumulative local optimiser steps per site (mean over sites). "
             "Single-site classes only; `AUROC` pooled test split; `BACC` at 0.5; `p/prev` mean probability over "
             "prevalence; `probe` linear-probe AUROC on the frozen features; `rho` Spearman(logit, sum of features); "
             "`head` mean of the class's head row.", ""]
    for dataset in dict.fromkeys(d["dataset"] for d in docs):
        ds = [d for d in docs if d["dataset"] == dataset]
        single = ds[0]["single_site_classes"]
        seeds = sorted({d["seed"] for d in ds})
        lines += [f"## {dataset} (single-site classes: {', '.join(single)}; seeds {seeds})", ""]
        npoints = max(len(d["points"]) for d in ds)
        for metric, get in (("AUROC", lambda p, c: p["pooled"][c]["auroc"]),
                            ("BACC@0.5", lambda p, c: p["pooled"][c]["bacc"]),
                            ("p/prev", lambda p, c: p["pooled"][c]["eo_ratio"]),
                            ("probe AUROC", lambda p, c: p["probe"].get(c)),
                            ("rho(logit, sum of features)", lambda p, c: p["spearman"][c]),
                            ("head row mean", lambda p, c: p["head_mean"][c])):
            steps = [round(np.mean([d["points"][i]["steps"] for d in ds if len(d["points"]) > i]))
                     for i in range(npoints)]
            lines += [f"### {metric}, mean over the single-site classes", "",
                      "| method | " + " | ".join(f"{s} steps" for s in steps) + " |",
                      "|---|" + "---|" * len(steps)]
            for method in METHODS:
                cells = [d for d in ds if d["method"] == method]
                if not cells:
                    continue
                row = []
                for i in range(npoints):
                    vals = []
                    for d in cells:
                        if len(d["points"]) > i:
                            xs = [get(d["points"][i], c) for c in single]
                            xs = [x for x in xs if x is not None]
                            vals.append(float(np.mean(xs)) if xs else None)
                    row.append(_ms(vals))
                lines.append(f"| {method} ({len(cells)} seeds) | " + " | ".join(row) + " |")
            lines.append("")
        # per group at the last point
        last = [d for d in ds if d["points"]]
        groups = sorted({g for d in last for g in d["points"][-1]["groups"]})
        if groups:
            lines += ["### single-site AUROC per test group (site style), last budget point", "",
                      "| method | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
            for method in METHODS:
                cells = [d for d in last if d["method"] == method]
                if cells:
                    row = [_ms([float(np.mean([x for x in (d["points"][-1]["groups"][g].get(c) for c in single)
                                               if x is not None] or [np.nan])) for d in cells]) for g in groups]
                    lines.append(f"| {method} | " + " | ".join(row) + " |")
            lines.append("")
    total = sum(d["seconds"] for d in docs)
    lines.append(f"{len(docs)} cells, {total / 60:.0f} minutes of training and scoring summed over the cells "
                 "(wall time, one thread each).")
    return "\n".join(lines) + "\n"


def plot(out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))]
    datasets = list(dict.fromkeys(d["dataset"] for d in docs))
    if not datasets:
        return None
    fig, axes = plt.subplots(2, len(datasets), figsize=(6 * len(datasets), 8), squeeze=False)
    for j, dataset in enumerate(datasets):
        for method in METHODS:
            cells = [d for d in docs if d["dataset"] == dataset and d["method"] == method and d["points"]]
            if not cells:
                continue
            n = min(len(d["points"]) for d in cells)
            steps = [np.mean([d["points"][i]["steps"] for d in cells]) for i in range(n)]
            for k, (key, label) in enumerate((("auroc", "single-site AUROC"), ("spearman", "rho(logit, sum feat)"))):
                vals = []
                for i in range(n):
                    per = []
                    for d in cells:
                        p = d["points"][i]
                        xs = [p["pooled"][c]["auroc"] if key == "auroc" else p["spearman"][c]
                              for c in d["single_site_classes"]]
                        per.append(np.mean([x for x in xs if x is not None]))
                    vals.append(per)
                m, s = np.array([np.mean(v) for v in vals]), np.array([np.std(v) for v in vals])
                ax = axes[k][j]
                ax.plot(steps, m, marker="o", label=method)
                ax.fill_between(steps, m - s, m + s, alpha=0.1)
                ax.set_xscale("log")
                ax.set_title(f"{dataset}: {label}")
                ax.set_xlabel("local steps per site")
    for ax in axes[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "curves.png"
    tmp = out / ".curves.png"
    fig.savefig(tmp, format="png", dpi=90)
    os.replace(tmp, path)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", nargs="+", default=["cxr", "blood"], choices=["cxr", "blood"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, nargs="+", default=list(STEPS), help="budget points, local steps per site")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--work", default="/tmp/fedlabels-partial-study", help="scenario folders")
    p.add_argument("--summary", action="store_true", help="only rebuild summary.md and curves.png")
    args = p.parse_args()
    out = Path(args.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    if not args.summary:
        torch.set_num_threads(args.threads)
        if "blood" in args.datasets and not (SHARED / "bloodmnist.npz").is_file():
            raise SystemExit(f"{SHARED / 'bloodmnist.npz'}: not found (the blood dataset reads ../shared/data)")
        for dataset in args.datasets:
            for seed in args.seeds:
                for method in args.methods:
                    run_cell(dataset, method, seed, Path(args.work), out / "cells", log=lambda m: print(m, flush=True),
                             budget=args.steps)
    text = summary(out)
    tmp = out / ".summary.md"
    tmp.write_text(text)
    os.replace(tmp, out / "summary.md")
    plot(out)
    print(text)


if __name__ == "__main__":
    main()
